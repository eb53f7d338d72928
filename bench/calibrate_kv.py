"""Benchmark `quantkit calibrate` (FP8 KV-cache scales) for memory and time, beside llm-compressor.

    python -m bench calibrate_kv [--layers 8] [--num-samples 32] [--seq-len 512]
                                 [--compute-dtypes float32 [bfloat16]] [--peer-dtype float32]
                                 [--peer-python PATH] [--skip-peer] [--check] [--smoke]

In one run, on one input (a random-weight BF16 qwen3_moe checkpoint: hidden 1024, 32 experts of width
512, top-4, 16 query / 4 KV heads of 64 (see ARCH); generated once, one shard per layer, cached in
bench/.cache/):

1. quantkit: `calibrate(model, dataset=ids.jsonl, ...)` + `write_scales` in a fresh subprocess, with the
   command's allocator settings (quantkit/allocator.py, applied before torch is imported), once per
   `--compute-dtypes` entry (`calibrate --compute-dtype`; the first is `quantkit` in the results); wall
   time (interpreter start and imports included) and peak RSS (kernel high-water mark of the process,
   and the RSS polled every 20 ms). Also the RSS of a subprocess that only imports the same modules,
   for the fixed cost of Python + torch + transformers.
2. The bound the issue sets: two decoder layers' weights (in the compute dtype, float32) + the
   calibration activations (two copies of samples x seq_len x hidden, float32) + 500 MB.
3. llm-compressor (peer venv, bench/.cache/peer-venv by default): `oneshot` with a recipe holding only
   `kv_cache_scheme` (FP8, tensor), on the same model loaded in float32 (`--peer-dtype`) and the same token rows, with its
   sequential pipeline; same measurements. Its scales are compared with ours layer by layer.

Both tools see identical tokens: the shipped calibration set tokenized by quantkit's byte fallback (the
synthetic model has no tokenizer), written as `input_ids` rows. Results go to bench/results/calibrate_kv.json.
`--smoke`: one layer at toy widths, 2 x 32 tokens, no peer.
`--check` exits 1 if quantkit's peak RSS exceeds the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from bench.convert_rtn import SMOKE_ARCH
from bench.harness import (CACHE, PEER_PYTHON, Run, add_common_args, measure_cmd, numel, peer_available, qwen3moe_specs,
                           synth_qwen3moe)

MB = 1_000_000
SLACK = 500 * MB

ARCH = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4)
GEN_VERSION = 1


def make_checkpoint(layers: int, seed: int = 0, arch: dict = ARCH) -> Path:
    """The checkpoint (cached): one shard per decoder layer plus one for embeddings/head, random BF16."""
    params = {"gen_version": GEN_VERSION, "arch": arch, "layers": layers, "seed": seed}
    return synth_qwen3moe(arch, layers, f"calib-qwen3moe-{layers}L", seed=seed, key_params=params)


def layer_weight_bytes(arch: dict, dtype_bytes: int = 4) -> int:
    """One decoder layer's weights in the compute dtype (float32)."""
    return dtype_bytes * sum(numel(s) for n, s in qwen3moe_specs(arch, 1) if n.startswith("model.layers.0."))


def make_tokens(root: Path, num_samples: int, seq_len: int, vocab: int = ARCH["vocab_size"]) -> tuple[Path, dict]:
    import warnings

    from quantkit.calib.data import load_calibration_data

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_calibration_data(None, vocab_size=vocab, num_samples=num_samples, seq_len=seq_len)
    path = root.parent / f"{root.name}-ids-{num_samples}x{seq_len}.jsonl"
    with open(path, "w") as f:
        for s in data.samples:
            f.write(json.dumps({"input_ids": s.tolist()}) + "\n")
    return path, data.describe()


QUANTKIT_SCRIPT = textwrap.dedent("""
    import inspect, json, sys, warnings
    warnings.simplefilter("ignore")
    from quantkit import allocator
    allocator.tune()  # as the `quantkit calibrate` command does, before torch is imported
    import torch
    import quantkit.calibrate as qc
    kw = dict(dataset={ids!r}, num_samples={n}, seq_len={t}, strategy="tensor", batch_tokens={bt}, dtype={dtype!r})
    progress = lambda i, n: print(f"layer {{i + 1}}/{{n}}", file=sys.stderr, flush=True)
    if "opts" in inspect.signature(qc.calibrate).parameters:  # calibrate(model, CalibrateOptions(...))
        res = qc.calibrate({model!r}, qc.CalibrateOptions(**kw), progress=progress)
    else:
        res = qc.calibrate({model!r}, **kw, progress=progress)
    qc.write_scales(res, {out!r})
    print(json.dumps(res.to_json()))
""")

BASELINE_SCRIPT = textwrap.dedent("""
    import torch, transformers
    from quantkit.calibrate import calibrate
    from quantkit.calib.executor import LayerExecutor
    ex = LayerExecutor({model!r})   # the meta model, rotary tables: no layer weights
    print("ok")
""")

PEER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    rows = [json.loads(l)["input_ids"] for l in open({ids!r})]
    ds = Dataset.from_dict({{"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}})
    model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.{peer_dtype})
    recipe = '''
    quant_stage:
      quant_modifiers:
        QuantizationModifier:
          kv_cache_scheme: {{num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true,
                             observer: {observer}}}
    '''
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length={t}, num_calibration_samples=len(rows))
    seconds = time.perf_counter() - t0
    scales = [[float(l.self_attn.k_scale.reshape(-1)[0]), float(l.self_attn.v_scale.reshape(-1)[0])]
              for l in model.model.layers]
    print(json.dumps({{"oneshot_seconds": seconds, "scales": scales}}))
""")


def _measure(cmd: list[str], out: Path) -> dict:
    """measure_cmd with stdout to `out` (its stderr's tail in the result), wall and CPU seconds rounded."""
    r = measure_cmd(cmd, stdout=out)
    r["peak_rss_bytes"] = max(r["peak_rss_bytes"], r["ru_maxrss_bytes"])
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench calibrate_kv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--peer-observer", default="static_minmax",
                    help="llm-compressor observer for the KV scheme: static_minmax (a global max, like quantkit) "
                         "or minmax (its default moving average)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="quantkit tokens per forward call (default: sized to the layer by the executor)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--compute-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="quantkit calibrate's --compute-dtype, one run each (the first is the headline)")
    ap.add_argument("--peer-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype llm-compressor's model is loaded in")
    ap.add_argument("--check", action="store_true", help="exit 1 if quantkit's peak RSS exceeds the bound")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    arch = ARCH
    if a.smoke:
        arch, a.layers, a.num_samples, a.seq_len, a.skip_peer = SMOKE_ARCH, 1, 2, 32, True
    run = Run("calibrate_kv", a, argv)

    root = make_checkpoint(a.layers, arch=arch)
    ids, data = make_tokens(root, a.num_samples, a.seq_len, arch["vocab_size"])
    work = CACHE / "calibrate_kv"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    fmt = dict(model=str(root), ids=str(ids), n=a.num_samples, t=a.seq_len,
               out=str(work / "kv_scales.safetensors"), observer=a.peer_observer, bt=a.batch_tokens,
               dtype=a.compute_dtypes[0], peer_dtype=a.peer_dtype)

    h = arch["hidden_size"]
    layer_bytes = layer_weight_bytes(arch)
    tokens = data["num_tokens"]
    act_bytes = 2 * tokens * h * 4  # inputs + outputs of one layer, float32
    bound = 2 * layer_bytes + act_bytes + SLACK
    disk_bytes = sum(p.stat().st_size for p in root.glob("*.safetensors"))

    print(f"model: {root.name}: {disk_bytes / MB:.0f} MB on disk, {a.layers} layers of {layer_bytes / MB:.0f} MB "
          f"(float32); {tokens} calibration tokens", file=sys.stderr)
    base = _measure([py, "-c", BASELINE_SCRIPT.format(**fmt)], work / "baseline.out")
    by_dtype = {}
    for dt in a.compute_dtypes:
        r = _measure([py, "-c", QUANTKIT_SCRIPT.format(**{**fmt, "dtype": dt})], work / f"quantkit-{dt}.out")
        if r["rc"] != 0:
            raise SystemExit(f"quantkit failed:\n{r['stderr']}")
        by_dtype[dt] = r
        print(f"quantkit, --compute-dtype {dt}: {r['wall_s']} s wall ({r['cpu_s']} CPU s, load "
              f"{r['loadavg_before']} -> {r['loadavg_after']}), peak RSS {r['peak_rss_bytes'] / MB:.0f} MB", file=sys.stderr)
    qk = by_dtype[a.compute_dtypes[0]]
    qk_res = json.loads((work / f"quantkit-{a.compute_dtypes[0]}.out").read_text())
    ours = [[lk["k_scale"], lk["v_scale"]] for lk in qk_res["layers"]]
    rows = [{"tool": "quantkit", "compute_dtype": dt, "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
             "peak_rss_mb": round(r["peak_rss_bytes"] / MB), "rss_vs_bound": round(r["peak_rss_bytes"] / bound, 3)}
            for dt, r in by_dtype.items()]
    rows.append({"tool": "imports + meta model alone", "wall_s": base["wall_s"], "cpu_s": base["cpu_s"],
                 "peak_rss_mb": round(base["peak_rss_bytes"] / MB)})
    summary = {"model": {"dir": str(root), "arch": arch, "layers": a.layers, "disk_bytes": disk_bytes,
                         "layer_weight_bytes_fp32": layer_bytes},
               "data": data, "bound_mb": round(bound / MB),
               "bound": {"bytes": bound, "formula": "2 x layer weights (fp32) + 2 x tokens x hidden x 4 B + 500 MB",
                         "layer_weights": 2 * layer_bytes, "activations": act_bytes, "slack": SLACK},
               "quantkit_seconds_reported": qk_res["seconds"], "quantkit_scales": ours,
               "batch_tokens": a.batch_tokens or "auto"}
    print(f"bound {bound / MB:.0f} MB -> {rows[0]['rss_vs_bound']:.2f} of the bound", file=sys.stderr)

    if a.skip_peer:
        summary["llmcompressor"] = "skipped (--skip-peer)"
    else:
        ok, why = peer_available(a.peer_python)
        if not ok:
            summary["llmcompressor"] = f"pending: {why}"
            print(f"llm-compressor: pending ({why}); re-run with --peer-python PATH", file=sys.stderr)
        else:
            peer = _measure([str(a.peer_python), "-c", PEER_SCRIPT.format(**fmt)], work / "peer.out")
            entry = {"tool": f"llm-compressor {why}", "compute_dtype": a.peer_dtype, "wall_s": peer["wall_s"],
                     "cpu_s": peer["cpu_s"], "peak_rss_mb": round(peer["peak_rss_bytes"] / MB),
                     "observer": a.peer_observer, "rc": peer["rc"]}
            if peer["rc"] == 0:
                pj = json.loads((work / "peer.out").read_text().strip().splitlines()[-1])
                theirs = pj["scales"]
                rel = [[abs(o - t) / o for o, t in zip(ol, tl)] for ol, tl in zip(ours, theirs)]
                entry.update(oneshot_s=round(pj["oneshot_seconds"], 2), rel_diff_layer0=max(rel[0]),
                             rel_diff_max=max(max(r) for r in rel), speedup_quantkit=round(peer["wall_s"] / qk["wall_s"], 2),
                             cpu_ratio=round(peer["cpu_s"] / qk["cpu_s"], 2))
                summary["llmcompressor_scales"] = theirs
            else:
                print(f"llm-compressor failed (rc {peer['rc']}):\n{peer['stderr']}", file=sys.stderr)
            rows.append(entry)
    run.write(rows, summary)
    for r in rows:
        print("  ".join(f"{k} {v}" for k, v in r.items()))
    return 1 if a.check and qk["peak_rss_bytes"] > bound else 0


if __name__ == "__main__":
    sys.exit(main())
