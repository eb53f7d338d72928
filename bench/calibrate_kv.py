"""Benchmark `quantkit calibrate` (FP8 KV-cache scales) for memory and time, beside llm-compressor.

    .venv/bin/python bench/calibrate_kv.py [--layers 8] [--num-samples 32] [--seq-len 512]
                                           [--compute-dtypes float32 [bfloat16]] [--peer-dtype float32]
                                           [--peer-python PATH] [--skip-peer] [--check]

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
`--check` exits 1 if quantkit's peak RSS exceeds the bound.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = HERE / ".cache"
RESULTS = HERE / "results" / "calibrate_kv.json"
MB = 1_000_000
SLACK = 500 * MB
POLL_S = 0.02
DEFAULT_PEER = CACHE / "peer-venv" / "bin" / "python"

ARCH = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4)
GEN_VERSION = 1


# ---- the synthetic checkpoint ---------------------------------------------------------------------------
def tensor_specs(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    a = ARCH
    h, hd, e, i = a["hidden_size"], a["head_dim"], a["num_experts"], a["moe_intermediate_size"]
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (a["vocab_size"], h))]
    for L in range(layers):
        p = f"model.layers.{L}"
        specs += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (q, h)),
                  (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                  (f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.self_attn.q_norm.weight", (hd,)),
                  (f"{p}.self_attn.k_norm.weight", (hd,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                  (f"{p}.mlp.gate.weight", (e, h))]
        for x in range(e):
            specs += [(f"{p}.mlp.experts.{x}.gate_proj.weight", (i, h)),
                      (f"{p}.mlp.experts.{x}.up_proj.weight", (i, h)),
                      (f"{p}.mlp.experts.{x}.down_proj.weight", (h, i))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (a["vocab_size"], h))]
    return specs


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_checkpoint(layers: int, seed: int = 0) -> Path:
    """Generate (or reuse) the checkpoint: one shard per decoder layer plus one for embeddings/head,
    tensors drawn per name from seeded generators (never the whole model in memory)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    params = {"gen_version": GEN_VERSION, "arch": ARCH, "layers": layers, "seed": seed}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    root = CACHE / f"calib-qwen3moe-{layers}L-{key}"
    if (root / ".complete.json").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3MoeConfig(**ARCH, num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                                      tie_word_embeddings=False, max_position_embeddings=4096, dtype="bfloat16")
    cfg.save_pretrained(root)
    groups: dict[str, list] = {}
    for name, shape in tensor_specs(layers):
        part = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(part, []).append((name, shape))
    names = sorted(groups, key=lambda p: (p != "other", int(p) if p.isdigit() else -1))
    weight_map, total = {}, 0
    for k, part in enumerate(names):
        fname = f"model-{k + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = {}
        for name, shape in groups[part]:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(root / f".{fname}.tmp"), metadata={"format": "pt"})
        os.replace(root / f".{fname}.tmp", root / fname)
        print(f"  generated {fname} ({(root / fname).stat().st_size / MB:.0f} MB)", file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (root / ".complete.json").write_text(json.dumps(params) + "\n")
    return root


def make_tokens(root: Path, num_samples: int, seq_len: int) -> tuple[Path, dict]:
    import warnings

    sys.path.insert(0, str(REPO))
    from quantkit.calib.data import load_calibration_data

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = load_calibration_data(None, vocab_size=ARCH["vocab_size"], num_samples=num_samples, seq_len=seq_len)
    path = root.parent / f"{root.name}-ids-{num_samples}x{seq_len}.jsonl"
    with open(path, "w") as f:
        for s in data.samples:
            f.write(json.dumps({"input_ids": s.tolist()}) + "\n")
    return path, data.describe()


# ---- measurement ----------------------------------------------------------------------------------------
def run_measured(cmd: list[str], log: Path, stdout_path: Path) -> dict:
    """Wall seconds, peak RSS (ru_maxrss from wait4 and the polled RSS of the process tree), CPU seconds."""
    import psutil

    log.parent.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    with open(log, "wb") as err_f, open(stdout_path, "wb") as out_f:
        t0 = time.perf_counter()
        popen = subprocess.Popen(cmd, stdout=out_f, stderr=err_f)
        proc = psutil.Process(popen.pid)
        peak = 0
        while True:
            pid, status, ru = os.wait4(popen.pid, os.WNOHANG)
            if pid:
                break
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [proc] + proc.children(recursive=True)))
            except psutil.Error:
                pass
            time.sleep(POLL_S)
        wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "wall_s": round(wall, 2), "peak_rss_bytes": max(peak, ru.ru_maxrss * 1024),
            "ru_maxrss_bytes": ru.ru_maxrss * 1024, "polled_peak_rss_bytes": peak,
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],  # before, after: contention
            "log": str(log)}


QUANTKIT_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, {repo!r})
    warnings.simplefilter("ignore")
    from quantkit import allocator
    allocator.tune()  # as the `quantkit calibrate` command does, before torch is imported
    import torch
    from quantkit.calibrate import calibrate, write_scales
    res = calibrate({model!r}, dataset={ids!r}, num_samples={n}, seq_len={t}, strategy="tensor", batch_tokens={bt},
                    dtype={dtype!r},
                    progress=lambda i, n: print(f"layer {{i + 1}}/{{n}}", file=sys.stderr, flush=True))
    write_scales(res, {out!r})
    print(json.dumps(res.to_json()))
""")

BASELINE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
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


def peer_available(python: Path) -> tuple[bool, str]:
    if not python.is_file():
        return False, f"{python} does not exist (the peer venv is not set up yet)"
    r = subprocess.run([str(python), "-c", "import llmcompressor, datasets; print(llmcompressor.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"{python} cannot import llmcompressor: {r.stderr.strip().splitlines()[-1:]}"
    return True, r.stdout.strip().splitlines()[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--peer-python", type=Path, default=DEFAULT_PEER)
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
    a = ap.parse_args()

    root = make_checkpoint(a.layers)
    ids, data = make_tokens(root, a.num_samples, a.seq_len)
    work = CACHE / "calibrate_kv"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    fmt = dict(repo=str(REPO), model=str(root), ids=str(ids), n=a.num_samples, t=a.seq_len,
               out=str(work / "kv_scales.safetensors"), observer=a.peer_observer, bt=a.batch_tokens,
               dtype=a.compute_dtypes[0], peer_dtype=a.peer_dtype)

    h = ARCH["hidden_size"]
    layer_numel = sum(numel(s) for n, s in tensor_specs(1) if n.startswith("model.layers.0."))
    layer_bytes = layer_numel * 4  # float32 compute dtype
    tokens = data["num_tokens"]
    act_bytes = 2 * tokens * h * 4  # inputs + outputs of one layer, float32
    bound = 2 * layer_bytes + act_bytes + SLACK
    disk_bytes = sum(p.stat().st_size for p in root.glob("*.safetensors"))

    print(f"model: {root.name}: {disk_bytes / MB:.0f} MB on disk, {a.layers} layers of {layer_bytes / MB:.0f} MB "
          f"(float32); {tokens} calibration tokens", file=sys.stderr)
    base = run_measured([py, "-c", BASELINE_SCRIPT.format(**fmt)], work / "baseline.err", work / "baseline.out")
    by_dtype = {}
    for dt in a.compute_dtypes:
        r = run_measured([py, "-c", QUANTKIT_SCRIPT.format(**{**fmt, "dtype": dt})], work / f"quantkit-{dt}.err",
                         work / f"quantkit-{dt}.out")
        if r["rc"] != 0:
            raise SystemExit(f"quantkit failed, see {r['log']}")
        by_dtype[dt] = r
        if len(a.compute_dtypes) > 1:
            print(f"quantkit, --compute-dtype {dt}: {r['wall_s']} s wall ({r['cpu_s']} CPU s, load "
                  f"{r['loadavg_1min']}), peak RSS {r['peak_rss_bytes'] / MB:.0f} MB", file=sys.stderr)
    qk = by_dtype[a.compute_dtypes[0]]
    qk_res = json.loads((work / f"quantkit-{a.compute_dtypes[0]}.out").read_text())
    ours = [[lk["k_scale"], lk["v_scale"]] for lk in qk_res["layers"]]
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": {"dir": str(root), "arch": ARCH, "layers": a.layers, "disk_bytes": disk_bytes,
                  "layer_weight_bytes_fp32": layer_bytes},
        "data": data,
        "bound": {"bytes": bound, "formula": "2 x layer weights (fp32) + 2 x tokens x hidden x 4 B + 500 MB",
                  "layer_weights": 2 * layer_bytes, "activations": act_bytes, "slack": SLACK},
        "quantkit": {**qk, "batch_tokens": a.batch_tokens or "auto", "seconds_reported": qk_res["seconds"],
                     "rss_vs_bound": round(qk["peak_rss_bytes"] / bound, 3),
                     "import_baseline_rss_bytes": base["peak_rss_bytes"], "scales": ours,
                     "compute_dtype": a.compute_dtypes[0]},
        "quantkit_by_dtype": by_dtype,
    }
    print(f"quantkit: {qk['wall_s']} s wall ({qk['cpu_s']} CPU s, load {qk['loadavg_1min']}), "
          f"peak RSS {qk['peak_rss_bytes'] / MB:.0f} MB (imports + meta model alone: "
          f"{base['peak_rss_bytes'] / MB:.0f} MB); bound {bound / MB:.0f} MB "
          f"-> {result['quantkit']['rss_vs_bound']:.2f} of the bound", file=sys.stderr)

    if a.skip_peer:
        result["llmcompressor"] = {"skipped": "--skip-peer"}
    else:
        ok, why = peer_available(a.peer_python)
        if not ok:
            result["llmcompressor"] = {"pending": why}
            print(f"llm-compressor: pending ({why}); re-run with --peer-python PATH", file=sys.stderr)
        else:
            peer = run_measured([str(a.peer_python), "-c", PEER_SCRIPT.format(**fmt)], work / "peer.err",
                                work / "peer.out")
            entry = {"version": why, "observer": a.peer_observer, "dtype": a.peer_dtype, **peer}
            if peer["rc"] == 0:
                pj = json.loads((work / "peer.out").read_text().strip().splitlines()[-1])
                theirs = pj["scales"]
                rel = [[abs(o - t) / o for o, t in zip(ol, tl)] for ol, tl in zip(ours, theirs)]
                entry.update(oneshot_seconds=round(pj["oneshot_seconds"], 2), scales=theirs,
                             rel_diff_layer0=max(rel[0]), rel_diff_max=max(max(r) for r in rel),
                             speedup_quantkit=round(peer["wall_s"] / qk["wall_s"], 2),
                             cpu_ratio=round(peer["cpu_s"] / qk["cpu_s"], 2),
                             quantkit_over_peer_wall={dt: round(r["wall_s"] / peer["wall_s"], 3)
                                                      for dt, r in by_dtype.items()})
                print(f"llm-compressor {why}: {peer['wall_s']} s wall (oneshot {entry['oneshot_seconds']} s, "
                      f"{peer['cpu_s']} CPU s, load {peer['loadavg_1min']}), "
                      f"peak RSS {peer['peak_rss_bytes'] / MB:.0f} MB; quantkit is {entry['speedup_quantkit']}x "
                      f"faster in wall time, {entry['cpu_ratio']}x in CPU time; scales differ by "
                      f"{entry['rel_diff_layer0']:.2%} at layer 0, {entry['rel_diff_max']:.2%} at most; "
                      f"quantkit's wall / the peer's by compute dtype: {entry['quantkit_over_peer_wall']}",
                      file=sys.stderr)
            else:
                print(f"llm-compressor failed (rc {peer['rc']}), see {peer['log']}", file=sys.stderr)
            result["llmcompressor"] = entry
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if a.check and qk["peak_rss_bytes"] > bound:
        sys.exit(1)


if __name__ == "__main__":
    main()
