"""`quantkit export` (GGUF for llama.cpp) measured: what llama.cpp computes on exported checkpoints, and how fast and
small an INT4 release exports.

    python -m bench gguf_export quality   # trained fixture + every architecture, llama.cpp vs transformers
    python -m bench gguf_export release   # a Kimi K2.5-style INT4 release at Kimi K2's widths: time, RSS
    python -m bench gguf_export --smoke   # quality on the tiny fixture, RTN only, no architectures (needs llama.cpp)

`quality`: the trained fixture with llama.cpp's routing (bench/fixture.py --normtopk: qwen3_moe, norm_topk_prob true,
byte-level, 1200 steps) converted with int4-experts-rtn, int4-experts-gptq (calibrated on 64 x 256 training bytes),
mxfp4-experts and nvfp4-experts, each exported and run by llama.cpp on 16 x 256 held-out bytes: KL(source || checkpoint) from
transformers, KL(checkpoint || llama.cpp), their ratio (target <= 0.25), perplexities of the checkpoint in transformers
and in llama.cpp (target within 2%). Then every architecture's tiny random model (quantkit.tiny, llama.cpp-compatible
settings: see tests/engine/test_llamacpp_run.py) with RTN, GPTQ (16 x 64 tokens of the shipped calibration set) and
MXFP4 experts, on random token ids.

`release`: a synthetic Kimi K2.5-style release (the multimodal wrapper, a deepseek_v3 text model at Kimi K2's widths:
hidden 7168, expert width 2048, 64 heads, MLA ranks 1536 / 512; `--experts` routed experts per layer (48), 3 layers,
one dense; routed experts INT4 g32 symmetric as random words and bf16 scales, everything else random BF16), cached in
bench/.cache/. Measured in one run: `cat` of its shards (page cache warm, fastest of 3), the same `cat` followed by an
fsync of its output (the durability export gives: its files are fsynced before they are renamed into place),
`quantkit export --json` as a
subprocess (wall, peak RSS of the process tree, polled, and the kernel's high-water mark), and bit-exactness of every
routed expert (gguf-py's dequantization of the GGUF == quantkit's decode of the release). Results:
bench/results/gguf_export-quality.json and gguf_export-release.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.harness import (CACHE, REPO, Run, Skip, add_common_args, llamacpp_run_gguf, measure_cmd, measure_fn, settle,
                           shard_files, time_cat)


# ---- quality ---------------------------------------------------------------------------------------------------
def _row(src, q, gguf, dataset, n, seq):
    doc = llamacpp_run_gguf(gguf, src, q, dataset=dataset, num_samples=n, seq_len=seq, generation_tokens=16)
    e = doc["engine_run"]
    return {"kl_source_checkpoint": e["kl_source_checkpoint"], "kl_checkpoint_llamacpp": e["kl_divergence"],
            "ratio": e["kl_engine_vs_quantization"], "ppl_source": e["perplexity_source"],
            "ppl_checkpoint_transformers": e["perplexity_reference"], "ppl_llamacpp": e["perplexity_engine"],
            "ppl_ratio": e["perplexity_ratio"], "top1": e["top1_agreement"],
            "generation_agreement": (e.get("generation") or {}).get("agreement"), "llamacpp_s": e["wall_seconds"],
            "passed": doc["passed"]}


def quality(args) -> list[dict]:
    import tempfile

    from bench.fixture import NORMTOPK, TINY, get_fixture, stdlib_corpus
    from quantkit.convert import ConvertOptions, convert
    from quantkit.export import export
    from quantkit.tiny import make_tiny_model

    rows = []
    spec = replace(TINY, norm_topk=True) if args.smoke else NORMTOPK
    fx = get_fixture(spec, log=lambda m: None)
    train, held = stdlib_corpus(spec.corpus_bytes)
    n_cal, n_ev = (4, 2) if args.smoke else (64, 16)
    with tempfile.TemporaryDirectory(prefix="qk-gguf-") as tmp:
        tmp = Path(tmp)

        def jsonl(name, data, n, length):  # byte-level model: a row's ids are its bytes
            step = max(length, (len(data) - length) // n)
            rows = [list(data[i * step: i * step + length]) for i in range(n)]
            (tmp / name).write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
            return str(tmp / name)

        cal, ev = jsonl("cal.jsonl", train, n_cal, 256), jsonl("eval.jsonl", held, n_ev, 256)
        for recipe in args.recipes:
            q = tmp / recipe
            _, m = measure_fn(convert, fx["model_dir"], q, ConvertOptions(recipe=recipe, model_card=False, dataset=cal,
                                                                        num_samples=n_cal, seq_len=256))
            res = export(q, tmp / f"{recipe}.gguf")
            row = {"model": "fixture", "recipe": recipe, "convert_s": round(m["wall_s"], 1), "export_s": res["seconds"],
                   "experts": str(res["expert_types"]), **_row(fx["model_dir"], q, tmp / f"{recipe}.gguf", ev, n_ev, 256)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        kw = {"qwen3_moe": {"norm_topk_prob": True}, "mixtral": {}, "deepseek_v3": {}, "glm4_moe": {},
              "glm_moe_dsa": {"index_head_dim": 64, "index_topk": 256, "rms_norm_eps": 1e-6}, "kimi_k25": {}}
        for arch, extra in ({} if args.smoke else kw).items():
            src = make_tiny_model(arch, tmp / f"src_{arch}", **extra)
            for recipe in ("int4-experts-rtn", "int4-experts-gptq", "mxfp4-experts"):
                q = tmp / f"{arch}_{recipe}"
                convert(src, q, ConvertOptions(recipe=recipe, model_card=False, num_samples=16, seq_len=64))
                export(q, tmp / f"{arch}_{recipe}.gguf")
                row = {"model": arch, "recipe": recipe, **_row(src, q, tmp / f"{arch}_{recipe}.gguf", None, 8, 128)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


# ---- release ---------------------------------------------------------------------------------------------------
def make_release(experts: int, seed: int = 0) -> Path:
    """The synthetic Kimi K2.5-style INT4 release (cached): written a layer a shard, never whole in memory."""
    import torch

    from quantkit.tiny import make_tiny_kimi_k25
    from quantkit.write.writer import write_safetensors

    root = CACHE / f"k25-int4-e{experts}-s{seed}"
    if (root / "done").is_file():
        return root
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    tiny = make_tiny_kimi_k25(root.with_suffix(".tiny"), int4_experts=True)  # the release's config layout
    cfg = json.loads((tiny / "config.json").read_text())
    shutil.rmtree(tiny)
    k2 = json.loads((REPO / "quantkit" / "data" / "configs" / "kimi-k2.json").read_text())
    text = {k: v for k, v in k2.items() if not k.startswith("_") and k != "quantization_config"}
    text.update(num_hidden_layers=3, n_routed_experts=experts, vocab_size=32768, model_type="kimi_k2",
                max_position_embeddings=4096)
    cfg["text_config"] = {**text, "architectures": ["DeepseekV3ForCausalLM"]}
    cfg["media_placeholder_token_id"] = text["vocab_size"] - 1
    import transformers

    mcfg = transformers.CONFIG_MAPPING["deepseek_v3"](**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(mcfg)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    # per-expert names as the releases store them (transformers keeps experts fused in memory)
    flat = {}
    for n, s in shapes.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(s[0]):
                flat[f"{base}{e}.gate_proj.weight"] = (s[1] // 2, s[2])
                flat[f"{base}{e}.up_proj.weight"] = (s[1] // 2, s[2])
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(s[0]):
                flat[f"{base}{e}.down_proj.weight"] = (s[1], s[2])
        else:
            flat[n] = s
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, list[str]] = {}
    for n in flat:
        li = n.split(".")[2] if n.startswith("model.layers.") else "other"
        groups.setdefault(li, []).append(n)
    weight_map, total = {}, 0
    for i, (key, names) in enumerate(sorted(groups.items())):
        tensors = {}
        for n in sorted(names):
            shape = flat[n]
            name = "language_model." + n
            if ".mlp.experts." in n:
                rows, cols = shape
                m = name[: -len(".weight")]
                tensors[m + ".weight_packed"] = torch.randint(-2**31, 2**31 - 1, (rows, cols // 8), generator=g,
                                                              dtype=torch.int32)
                tensors[m + ".weight_scale"] = (torch.rand(rows, cols // 32, generator=g) * 0.004 + 0.001).bfloat16()
                tensors[m + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
            elif len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16) if "norm" in n else torch.zeros(
                    shape, dtype=torch.float32 if "bias" in n else torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(root / shard, tensors, metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
        del tensors
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (root / "done").write_text("ok")
    return root


def release(args) -> tuple[list[dict], dict]:
    src = make_release(args.experts)
    files = shard_files(src)
    size = sum(f.stat().st_size for f in files)
    out_dir = CACHE / "gguf-out"
    cat = time_cat(files, 3)
    cat_sync = time_cat(files, 3, durable=True)
    runs = []
    for _ in range(args.repeat):
        settle(out_dir)
        out_dir.mkdir(parents=True)
        runs.append(measure_cmd([sys.executable, "-m", "quantkit", "export", str(src), str(out_dir / "k25.gguf"),
                                 "--json"], check=True))
    best = min(runs, key=lambda r: r["wall_s"])
    doc = json.loads(best["stdout"])
    layer_experts = 3 * args.experts * (2048 * 7168 // 2 + 2048 * 7168 // 32 * 2)  # packed + bf16 scales, one layer
    bound = layer_experts + (512 << 20)
    exact = check_exact(src, out_dir / "k25.gguf")
    res = {"source_bytes": size, "shards": len(files), "experts_per_layer": args.experts,
           "cat": cat, "cat_fsync": cat_sync, "export": {k: best[k] for k in ("wall_s", "cpu_s", "peak_rss_bytes", "ru_maxrss_bytes",
                                                       "other_cpu_s")},
           "runs_wall_s": [r["wall_s"] for r in runs], "export_report_seconds": doc["seconds"],
           "gguf_bytes": doc["bytes_written"], "scales": doc["scales"], "time_vs_cat": round(best["wall_s"] / cat["wall_s"], 3),
           "time_vs_cat_fsync": round(best["wall_s"] / cat_sync["wall_s"], 3),
           "rss_bound_bytes": bound, "rss_vs_bound": round(max(best["peak_rss_bytes"], best["ru_maxrss_bytes"]) / bound,
                                                           3),
           "exact": exact}
    print(json.dumps(res, indent=2))
    settle(out_dir)
    rows = [{"run": "cat (page cache warm)", "wall_s": cat["wall_s"]},
            {"run": "cat + fsync", "wall_s": cat_sync["wall_s"]},
            {"run": "quantkit export", "wall_s": best["wall_s"], "cpu_s": best["cpu_s"],
             "peak_rss_mib": round(max(best["peak_rss_bytes"], best["ru_maxrss_bytes"]) / 2**20),
             "rss_vs_bound": res["rss_vs_bound"], "time_vs_cat": res["time_vs_cat"],
             "time_vs_cat_fsync": res["time_vs_cat_fsync"]}]
    return rows, res


def check_exact(src: Path, gguf_path: Path) -> dict:
    """Every routed expert of the GGUF, dequantized by gguf-py, against quantkit's decode of the release."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from quantkit.read.checkpoint import Checkpoint
    from quantkit.read.sources import detect_format, scan
    from quantkit.read.tensors import TensorReader

    ck = Checkpoint.open(src)
    stored = scan(ck, detect_format(ck.config))
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    checked = mismatched = 0
    with TensorReader.of(ck) as r:
        for m, sw in stored.items():
            p = m.split(".")  # language_model.model.layers.L.mlp.experts.E.proj
            li, e, role = int(p[3]), int(p[6]), p[7].split("_")[0]
            t = tensors[f"blk.{li}.ffn_{role}_exps.weight"]
            n = sw.shape[0]
            rows = np.asarray(t.data).reshape(-1, t.data.shape[-1])[e * n:(e + 1) * n]  # expert e's rows of blocks
            got = dequantize(rows, t.tensor_type).reshape(n, -1)
            want = r.decode(sw, torch.float32).numpy()
            checked += 1
            mismatched += int(not np.array_equal(got, want))
    return {"experts_checked": checked, "mismatched": mismatched}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gguf_export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, repeat=None)
    sub = ap.add_subparsers(dest="what")
    q = sub.add_parser("quality")
    q.add_argument("--recipes", nargs="+", default=["int4-experts-rtn", "int4-experts-gptq", "mxfp4-experts", "nvfp4-experts"])
    r = sub.add_parser("release")
    r.add_argument("--experts", type=int, default=48)
    r.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args(argv)
    if a.smoke:
        a.what, a.recipes = "quality", ["int4-experts-rtn"]
    if a.what is None:
        ap.error("quality or release (or --smoke)")
    if a.what == "quality":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise Skip("llama-cpp-python is not installed (bash bench/setup_llamacpp.sh)")
    run = Run("gguf_export", a, argv)
    if a.what == "quality":
        run.write(quality(a), tag="quality")
    else:
        rows, res = release(a)
        run.write(rows, res, tag="release")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
