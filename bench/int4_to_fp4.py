"""INT4 release -> NVFP4: quantkit's streamed re-quantization against llm-compressor's
dequantize-then-quantize path, on one multi-GB synthetic INT4 release, in one run.

    python -m bench int4_to_fp4 [--size-gb 6] [--shards 4] [--skip-peer] [--peer-quant model_free|oneshot] [--smoke]

The input is a Kimi K2.5/K2.6-style INT4 release: compressed-tensors `pack-quantized`, symmetric, group 32,
routed experts only. It is made once (cached under bench/.cache/) by `quantkit convert --recipe
int4-experts-rtn` from convert_rtn's synthetic BF16 qwen3_moe (>= --size-gb GB in --shards
shards); neither step is timed. Then, one after the other on the same release:

1. `quantkit convert INT4 OUT --recipe nvfp4-experts --json`: INT4 experts decoded on read and re-quantized
   to NVFP4 (W4A16), shard by shard, never a BF16 copy. Wall, CPU and peak RSS (ru_maxrss of the child
   and the polled RSS of its process tree), against the bound largest INT4 shard + 512 MiB.
2. llm-compressor's path, as its Kimi K2.6 NVFP4 example does it, in the peer venv of bench/setup_peers.sh:
   a. decompress: compressed-tensors' `convert_checkpoint` with its `CompressedTensorsDequantizer` writes
      the release as a BF16 checkpoint on disk (shard by shard; the copy keeps the source's shard layout);
   b. quantize: NVFP4A16 (weights-only NVFP4, group 16) on that BF16 copy, same expert targets:
      `model_free_ptq` (llm-compressor's streamed path, the default) or `oneshot` on the model loaded by
      transformers (--peer-quant oneshot; needs the whole BF16 model in RAM).
   Each step is timed on its own (wall, CPU, peak RSS), and the sum is the peer's time.

quantkit's resident memory is also split as /proc/PID/status does (RssAnon: tensors and malloc arenas;
RssFile: mapped files, i.e. libraries and source pages read through mmap), polled, with its VmHWM.

Wall times are of whole commands (interpreter start and imports included). The CPU seconds other
processes used during each run are recorded: on a shared machine they inflate wall times.
Results go to bench/results/int4_to_fp4.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.convert_rtn import BOUND_SLACK, EXPERT_TARGETS, IGNORE
from bench.harness import (CACHE, MIB, REPO, Run, Skip, add_common_args, last_json, measure_cmd, quantkit_bin,
                           settle, shard_files, warm_cache)

# decompress the INT4 release to BF16 on disk with compressed-tensors' own entrypoint (what llm-compressor's
# Kimi K2.6 NVFP4 example runs first): convert_checkpoint + CompressedTensorsDequantizer, shard by shard.
DECOMPRESS_SCRIPT = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.environ.setdefault("TQDM_DISABLE", "1")
import torch
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
import importlib.metadata as md
src, out = sys.argv[1], sys.argv[2]
t1 = time.perf_counter()
convert_checkpoint(model_stub=src, save_directory=out, converter=CompressedTensorsDequantizer(src, dtype=torch.bfloat16),
                   max_workers=1, device="cpu")
t2 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 3), "decompress_s": round(t2 - t1, 3),
                  "compressed_tensors": md.version("compressed-tensors"), "torch": md.version("torch")}))
"""

QUANT_SCRIPT = r"""
import json, os, sys, time
t0 = time.perf_counter()
os.environ.setdefault("TQDM_DISABLE", "1")
import importlib.metadata as md
src, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
targets, ignore = json.loads(sys.argv[4]), json.loads(sys.argv[5])
from compressed_tensors.quantization import preset_name_to_scheme
scheme = preset_name_to_scheme("NVFP4A16", targets)
if mode in ("model_free", "model_free_fused"):
    from llmcompressor import model_free_ptq
    converter = None
    if mode == "model_free_fused":  # the INT4 source dequantized on read (no BF16 copy)
        import torch
        from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
        converter = CompressedTensorsDequantizer(src, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=ignore, max_workers=1, device="cpu",
                   converter=converter)
else:
    import torch
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    recipe = QuantizationModifier(config_groups={"experts": scheme}, ignore=ignore)
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
t2 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 3), "quant_s": round(t2 - t1, 3), "mode": mode,
                  "llmcompressor": md.version("llmcompressor"), "compressed_tensors": md.version("compressed-tensors"),
                  "torch": md.version("torch"), "weights": scheme.weights.model_dump(mode="json")}))
"""


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def make_release(args, qk_bin: str) -> Path:
    """The INT4 release (cached): the synthetic BF16 checkpoint converted with int4-experts-rtn."""
    made = subprocess.run([sys.executable, "-m", "bench", "convert_rtn", "--make-only", "--size-gb", str(args.size_gb),
                           "--shards", str(args.shards), *(["--smoke"] if args.smoke else [])], check=True,
                          stdout=subprocess.PIPE, text=True)
    bf16 = Path(made.stdout.strip().splitlines()[-1])
    rel = CACHE / f"int4-release-{bf16.name}"
    stamp = rel / ".complete.json"
    if stamp.is_file():
        return rel
    shutil.rmtree(rel, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([qk_bin, "convert", str(bf16), str(rel), "--recipe", "int4-experts-rtn", "--json"], check=True,
                   stdout=subprocess.DEVNULL)
    stamp.write_text(json.dumps({"from": str(bf16), "recipe": "int4-experts-rtn",
                                 "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return rel


def _print_split(r: dict) -> None:
    """quantkit's resident memory split (harness.measure_cmd's `split`): anonymous vs mapped files, at its peak."""
    s = r.get("rss_split") or {}
    if "at_peak_VmRSS" in s:
        print(f"  VmHWM {s.get('peak_VmHWM', 0) / MIB:.0f} MiB; at the polled peak {s['at_peak_VmRSS'] / MIB:.0f} MiB = "
              f"RssAnon {s.get('at_peak_RssAnon', 0) / MIB:.0f} + RssFile {s.get('at_peak_RssFile', 0) / MIB:.0f} "
              f"(largest polled: RssAnon {s.get('peak_RssAnon', 0) / MIB:.0f}, RssFile "
              f"{s.get('peak_RssFile', 0) / MIB:.0f})", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench int4_to_fp4", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=6.0, help="BF16 source size the INT4 release is made from (default "
                                                                "6: a 2.2 GB INT4 release)")
    ap.add_argument("--shards", type=int, default=4, help="shards of the BF16 source and so of the release (default 4)")
    ap.add_argument("--recipe", default="nvfp4-experts", help="quantkit recipe (default nvfp4-experts)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--quantkit-amax", action="store_true",
                    help="also run quantkit with the recipe's scale_search set to amax (llm-compressor's scales; "
                         "from INT4 quantkit fits them by default, on its torch path)")
    ap.add_argument("--peer-quant", choices=["model_free", "oneshot"], default="model_free")
    ap.add_argument("--peer-fused", action="store_true",
                    help="also run model_free_ptq on the INT4 release itself with compressed-tensors' dequantizer as "
                         "its converter (llm-compressor's own streamed INT4 -> NVFP4, no BF16 copy)")
    ap.add_argument("--peer-venv", type=Path, default=CACHE / "peer-venv")
    ap.add_argument("--keep-outputs", action="store_true")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gb, args.shards, args.skip_peer, args.quantkit_amax = 0.01, 2, True, True
    run = Run("int4_to_fp4", args, argv)
    qk_bin = quantkit_bin()
    peer_py = args.peer_venv / "bin" / "python"
    if not args.skip_peer and not peer_py.exists():
        raise Skip(f"no peer venv at {args.peer_venv}: run bench/setup_peers.sh first, or pass --skip-peer")
    rel = make_release(args, qk_bin)
    files = shard_files(rel)
    sizes = [f.stat().st_size for f in files]
    total, largest = sum(sizes), max(sizes)
    bound = largest + BOUND_SLACK
    print(f"INT4 release: {rel} ({len(files)} shards, {total / 1e9:.3f} GB, largest {largest / MIB:.0f} MiB, "
          f"bound {bound / MIB:.0f} MiB)", file=sys.stderr)
    qk_out, bf16_out, llmc_out = CACHE / "i2f-quantkit", CACHE / "i2f-llmc-bf16", CACHE / "i2f-llmc-nvfp4"
    runs = {}

    def step(key: str, cmd: list[str], out: Path, label: str | None = None, split: bool = False) -> bool:
        """One measured command into runs[key] (runs[key + "_FAILED"] when it fails); whether it succeeded."""
        print("running: " + " ".join(cmd if label is None else cmd[:2] + [label] + cmd[3:]), file=sys.stderr)
        r = measure_cmd(cmd, split=split)
        if label:
            r["cmd"] = r["cmd"][:2] + [label] + r["cmd"][3:]
        if r["rc"]:
            print(f"{key} failed (rc {r['rc']}):\n{r['stderr'][-2000:]}", file=sys.stderr)
            r.pop("stdout", None)
            runs[key + "_FAILED"] = r
            return False
        r["reported"] = last_json(r.pop("stdout"))
        r["out_bytes"] = du(out)
        runs[key] = r
        print(f"  {r['wall_s']:.2f} s, maxrss {r['ru_maxrss_bytes'] / MIB:.0f} MiB", file=sys.stderr)
        _print_split(r)
        return True

    settle(qk_out)
    warm_cache(files)
    if not step("quantkit", [qk_bin, "convert", str(rel), str(qk_out), "--recipe", args.recipe, "--json"], qk_out,
                split=True):
        return 1
    if args.quantkit_amax:
        import tempfile
        text = (REPO / "recipes" / f"{args.recipe}.yaml").read_text()
        text = text.replace("strategy: tensor_group}", "strategy: tensor_group, scale_search: amax}")
        if "scale_search: amax" not in text:
            raise SystemExit(f"recipes/{args.recipe}.yaml changed shape; update --quantkit-amax")
        fd, amax_recipe = tempfile.mkstemp(prefix=f"{args.recipe}-amax-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(text.replace(f"name: {args.recipe}", f"name: {args.recipe}-amax"))
        settle(qk_out)
        warm_cache(files)
        step("quantkit_amax", [qk_bin, "convert", str(rel), str(qk_out), "--recipe", amax_recipe, "--json"], qk_out,
             split=True)
        os.unlink(amax_recipe)
    targets = [json.dumps(EXPERT_TARGETS), json.dumps(IGNORE)]
    if not args.skip_peer:
        settle(bf16_out, llmc_out)
        warm_cache(files)
        if step("llmc_decompress", [str(peer_py), "-c", DECOMPRESS_SCRIPT, str(rel), str(bf16_out)], bf16_out,
                "<DECOMPRESS_SCRIPT>"):
            os.sync()  # the copy's writeback is the decompress step's cost, not the next step's
            runs["llmc_decompress"]["out_bytes"] = du(bf16_out)
            step("llmc_quantize", [str(peer_py), "-c", QUANT_SCRIPT, str(bf16_out), str(llmc_out), args.peer_quant,
                                   *targets], llmc_out, "<QUANT_SCRIPT>")
        shutil.rmtree(bf16_out, ignore_errors=True)
    if args.peer_fused and not args.skip_peer:
        settle(llmc_out)
        warm_cache(files)
        step("llmc_model_free_dequant_on_read", [str(peer_py), "-c", QUANT_SCRIPT, str(rel), str(llmc_out),
                                                 "model_free_fused", *targets], llmc_out, "<QUANT_SCRIPT>")

    qk = runs["quantkit"]
    qk_peak = max(qk["peak_rss_bytes"], qk["ru_maxrss_bytes"])
    print(f"\nINT4 release: {len(files)} shards, {total / 1e9:.3f} GB, largest shard {largest / MIB:.0f} MiB -> "
          f"RSS bound {bound / MIB:.0f} MiB")
    rows = []
    for k, r in runs.items():
        rows.append({"run": k, "rc": r["rc"], "wall_s": r["wall_s"], "tree_rss_mib": round(r["peak_rss_bytes"] / MIB),
                     "maxrss_mib": round(r["ru_maxrss_bytes"] / MIB), "cpu_s": r["cpu_s"],
                     "other_cpu_s": r["other_cpu_s"], "out_gb": round(r.get("out_bytes", 0) / 1e9, 3)})
        print("  ".join(f"{c} {v}" for c, v in rows[-1].items()))
    ratios = {"rss_ratio_vs_bound": qk_peak / bound}
    if "llmc_model_free_dequant_on_read" in runs:
        ratios["speedup_vs_llmcompressor_dequant_on_read"] = runs["llmc_model_free_dequant_on_read"]["wall_s"] / qk["wall_s"]
    if "llmc_quantize" in runs and "llmc_decompress" in runs:
        peer_wall = runs["llmc_decompress"]["wall_s"] + runs["llmc_quantize"]["wall_s"]
        rows.append({"run": "llm-compressor total", "wall_s": peer_wall})
        ratios["speedup_vs_llmcompressor"] = peer_wall / qk["wall_s"]
        ratios["speedup_vs_llmcompressor_quantize_only"] = runs["llmc_quantize"]["wall_s"] / qk["wall_s"]
        if "quantkit_amax" in runs:
            ratios["speedup_vs_llmcompressor_amax"] = peer_wall / runs["quantkit_amax"]["wall_s"]
    for k, v in ratios.items():
        print(f"{k} = {v:.3f}")
    run.write(rows, {**{k: round(v, 4) for k, v in ratios.items()}, "release": str(rel), "shards": len(files),
                     "total_bytes": total, "largest_shard_bytes": largest, "rss_bound_bytes": bound, "runs": runs})
    if not args.keep_outputs:
        for d in (qk_out, bf16_out, llmc_out):
            shutil.rmtree(d, ignore_errors=True)
    return 0
