"""CUDA calibration check: GPTQ of a small bench MoE with `--device cuda`, against the same conversion on
the CPU (float32, what quantkit always did). Run by bench/gpu_check.sh on a GPU machine.

    python -m bench calib_cuda [--device cuda] [--layers 4] [--json PATH]
    python -m bench calib_cuda --device cpu --small     # the bench's own logic, on the CPU, in ~1 minute
    python -m bench calib_cuda --smoke                  # --small on CUDA; skipped without a CUDA device

The model: a random-weight qwen3_moe built locally (quantkit.testing.make_tiny_model: hidden 1024, 32 experts
of width 512, top-4, 16 query / 4 KV heads of 64, vocab 4096; `--small`: hidden 128, 8 experts), calibrated on
`--num-samples` x `--seq-len` random token ids. Both conversions use the recipe int4-experts-gptq.

Measured on the device: the wall time of `convert()`, torch.cuda.max_memory_allocated (the allocator's
peak) and the plan's estimated peak per layer (the result's `device_memory`); the same wall time on the CPU.
Compared (the GPU computes the layers in bfloat16 and solves in float32, the CPU in float32 / float64, so the
two differ by rounding, and GPTQ's rounding decisions follow: two correct GPTQ runs whose Hessians differ by
bfloat16 rounding agree to ~20 dB per module, about as far apart as either is from the source; emulated on
the CPU, bfloat16 layers and float32 solves on tiny models gave a median of 20.4 dB and a manifest SQNR within
0.01 dB of the float32 pass):
- per quantized module, the SQNR of the device's dequantized weights against the CPU's: median >= 12 dB
  (a systematic error, a wrong scale or a transposed weight, gives ~0 dB);
- each run's own SQNR against the source weights (the manifest's): means within 0.5 dB of each other;
- the quantized models' next-token distributions on random tokens, loaded with transformers in float32 on
  the CPU: KL(source || device) <= max(1.25 x KL(source || CPU pass), KL(source || RTN)) (RTN: an RTN
  conversion of the same model; on random weights and random tokens GPTQ need not beat it, while a broken
  conversion is far above both);
- the FP8 KV-cache scales of `calibrate` on the device against the CPU's: largest relative difference <= 3%;
- the measured device peak <= the plan's estimate (the estimate is meant as an upper bound).
Exit status 0 when every check passes; the JSON holds every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import Run, Skip, add_common_args, measure_fn, scratch_dir, token_rows
from quantkit.calibrate import calibrate
from quantkit.convert import ConvertOptions, convert
from quantkit.pack.int4 import dequantize_module
from quantkit.quant.int4 import sqnr_db
from quantkit.read.safetensors import SafetensorsFile
from quantkit.testing import make_tiny_model, read_json

BENCH = dict(hidden=1024, experts=32, moe_intermediate=512, vocab=4096, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_experts_per_tok=4)
SMALL = dict(hidden=128, experts=8, moe_intermediate=64, vocab=512)
MIN_MEDIAN_SQNR_DB = 12.0
MAX_SQNR_DRIFT_DB = 0.5
KL_FACTOR = 1.25
MAX_KV_REL = 0.03


def build(work: Path, layers: int, small: bool) -> Path:
    src = work / f"src-{'small' if small else 'bench'}-{layers}"
    if not (src / "config.json").exists():
        make_tiny_model("qwen3_moe", src, layers=layers, max_shard_size="200MB", **(SMALL if small else BENCH))
    return src


def run_convert(src: Path, out: Path, calib: Path, device: str, n: int, t: int, recipe="int4-experts-gptq") -> dict:
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def call():
        res = convert(src, out, ConvertOptions(recipe=recipe, dataset=str(calib), num_samples=n, seq_len=t,
                                               overwrite=True, model_card=False, device=device))
        if cuda:
            torch.cuda.synchronize()
        return res

    res, m = measure_fn(call)
    mem = res.device_memory or {}
    return {"device": res.device, "wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "seconds": res.seconds,
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "estimated_peak_bytes": mem.get("estimated_peak_bytes"), "activations": mem.get("activations"),
            "available_bytes": mem.get("available_bytes")}


def modules(out: Path) -> dict[str, torch.Tensor]:
    """Dequantized weights of every packed module of a converted checkpoint."""
    idx = read_json(out / "model.safetensors.index.json")["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for name, shard in idx.items():
        if name.endswith(".weight_packed"):
            by_shard.setdefault(shard, []).append(name[: -len(".weight_packed")])
    w = {}
    for shard, mods in by_shard.items():
        with SafetensorsFile(out / shard) as f:
            have = set(f.header.tensors)
            for m in mods:
                parts = {s: f.get(f"{m}.{s}") for s in ("weight_packed", "weight_scale", "weight_shape",
                                                        "weight_zero_point") if f"{m}.{s}" in have}
                w[m] = dequantize_module(parts, torch.float32)
    return w


def manifest_sqnr(out: Path) -> float:
    t = read_json(out / "quantkit_manifest.json")["tensors"]
    vals = [e["sqnr_db"] for e in t.values() if isinstance(e, dict) and isinstance(e.get("sqnr_db"), (int, float))]
    return statistics.fmean(vals) if vals else float("nan")


def kl_of(src: Path, outs: list[Path], vocab: int, seed: int) -> list[float] | None:
    """KL(source || each quantized model), mean per token, float32 on the CPU; None if they do not load."""
    try:
        from quantkit.testing import load_model

        ids = torch.randint(0, vocab, (8, 128), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = torch.log_softmax(load_model(src, torch.float32).eval()(ids).logits.float(), -1)
            out = []
            for o in outs:
                lq = torch.log_softmax(load_model(o, torch.float32).eval()(ids).logits.float(), -1)
                out.append(float((ref.exp() * (ref - lq)).sum(-1).mean()))
        return out
    except Exception as e:  # transformers / compressed-tensors missing on the GPU machine: reported, not fatal
        print(f"calib_cuda: model-level KL skipped ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return None


def kv_rel(src: Path, calib: Path, device: str, n: int, t: int) -> float:
    a = calibrate_with(src, dataset=str(calib), num_samples=n, seq_len=t, device=device)
    b = calibrate_with(src, dataset=str(calib), num_samples=n, seq_len=t, device="cpu")
    return max(float(((a.scales[k] - b.scales[k]).abs() / b.scales[k]).max()) for k in b.scales)


def calibrate_with(src: Path, **kw):
    """quantkit's `calibrate` with CalibrateOptions' fields `kw` (through CalibrateOptions where it takes one)."""
    import inspect

    import quantkit.calibrate as qc

    if "opts" in inspect.signature(calibrate).parameters:
        return calibrate(src, qc.CalibrateOptions(**kw))
    return calibrate(src, **kw)


def _num(x: float):
    return x if x != float("inf") else "inf"  # identical modules: infinite SQNR (JSON has no Infinity)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calib_cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="the device checked against the CPU (default cuda)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick run of the script itself)")
    ap.add_argument("--workdir", default=None, help="where the model and the outputs go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the whole document here")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.small, a.layers, a.num_samples, a.seq_len = True, 2, 4, 32
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise Skip("--device cuda needs torch with CUDA (no CUDA device here)")
    run = Run("calib_cuda", a, argv)
    work = scratch_dir("qk-calib-cuda-", a.workdir)
    t0 = time.perf_counter()
    src = build(work, a.layers, a.small)
    vocab = (SMALL if a.small else BENCH)["vocab"]
    calib = token_rows(work / "calib.jsonl", a.num_samples, a.seq_len, vocab, seed=0)
    build_s = time.perf_counter() - t0

    dev = run_convert(src, work / "out-device", calib, a.device, a.num_samples, a.seq_len)
    cpu = run_convert(src, work / "out-cpu", calib, "cpu", a.num_samples, a.seq_len)
    run_convert(src, work / "out-rtn", calib, "cpu", a.num_samples, a.seq_len, recipe="int4-experts-rtn")
    wd, wc = modules(work / "out-device"), modules(work / "out-cpu")
    assert wd.keys() == wc.keys() and wd, "the two conversions quantized different modules"
    sq = sorted(float(sqnr_db(wc[m], wd[m])) for m in wc)
    finite = [s for s in sq if s != float("inf")]
    median = statistics.median(sq)
    sq_dev, sq_cpu = manifest_sqnr(work / "out-device"), manifest_sqnr(work / "out-cpu")
    kls = kl_of(src, [work / "out-device", work / "out-cpu", work / "out-rtn"], vocab, seed=1)
    kv = kv_rel(src, calib, a.device, a.num_samples, a.seq_len)

    checks = {
        "median_sqnr_device_vs_cpu": median >= MIN_MEDIAN_SQNR_DB,
        "sqnr_vs_source_drift": abs(sq_dev - sq_cpu) <= MAX_SQNR_DRIFT_DB,
        "kv_scales": kv <= MAX_KV_REL,
    }
    if kls is not None:
        checks["kl"] = kls[0] <= max(KL_FACTOR * kls[1], kls[2])
    if dev["max_memory_allocated"] is not None and dev["estimated_peak_bytes"]:
        checks["peak_within_estimate"] = dev["max_memory_allocated"] <= dev["estimated_peak_bytes"]
    doc = {"device": dev, "cpu": cpu, "build_s": round(build_s, 1),
           "modules": len(sq), "sqnr_device_vs_cpu_db": {"median": _num(median), "min": _num(min(sq)),
                                                         "max_finite": max(finite) if finite else None,
                                                         "identical_modules": len(sq) - len(finite)},
           "sqnr_vs_source_db": {"device": sq_dev, "cpu": sq_cpu},
           "kl_vs_source": None if kls is None else {"device": kls[0], "cpu": kls[1], "rtn": kls[2]},
           "kv_scales_max_rel_diff": kv,
           "speedup_vs_cpu": round(cpu["wall_s"] / dev["wall_s"], 2) if dev["wall_s"] else None,
           "tolerances": {"min_median_sqnr_db": MIN_MEDIAN_SQNR_DB, "max_sqnr_drift_db": MAX_SQNR_DRIFT_DB,
                          "kl": f"device <= max({KL_FACTOR} x cpu, rtn)", "max_kv_rel": MAX_KV_REL},
           "checks": checks, "ok": all(checks.values()),
           "machine": {"torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
           "settings": vars(a)}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    run.write([{"run": k, **{c: v for c, v in doc[k].items() if not isinstance(v, dict)}} for k in ("device", "cpu")],
              {k: v for k, v in doc.items() if k not in ("device", "cpu", "settings")})
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
