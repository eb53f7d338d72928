"""sha256 of every file `quantkit convert` writes, for every shipped recipe on the test fixtures.

A behaviour-preserving change to the code must leave these trees byte-identical. Run it before and after
and compare:

    .venv/bin/python bench/tree_hashes.py -o /tmp/before.json      # on the old tree
    .venv/bin/python bench/tree_hashes.py -o /tmp/after.json       # on the new tree
    .venv/bin/python bench/tree_hashes.py --compare /tmp/before.json /tmp/after.json

(`python -m bench tree_hashes ...` is the same; this file imports nothing from bench/, so that it runs as a file
from a worktree of any older tree too. `--smoke`: the first case only, into a temporary work directory.)

The source checkpoints are generated once into `bench/.cache/tree-sources/` (or $QUANTKIT_TREE_CACHE) and
reused, so that their file metadata (which the manifest's resume identity records) is the same for both
runs; to hash an older tree, run this script from a worktree of it with the same $QUANTKIT_TREE_CACHE. The outputs
are written under $QUANTKIT_TREE_CACHE/../tree-work, emptied first: runs that share a cache at the same time must each
set $QUANTKIT_TREE_WORK to a directory of their own. Every conversion goes through the command line (the public
contract), with small calibration settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QUANTKIT_TREE_CACHE", ROOT / "bench" / ".cache" / "tree-sources"))
CAL = ["--num-samples", "4", "--seq-len", "32"]
CAL16 = ["--num-samples", "16", "--seq-len", "64"]  # enough tokens per expert for the solve's options to act

ASYM_RECIPE = """\
name: asym-mixed
groups:
  experts:
    targets: ['re:.*\\.experts\\.\\d+\\.(gate|up|down)_proj$', 're:.*\\.experts\\.\\d+\\.w[123]$']
    method: rtn
    scheme: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64, fallback: channel}
  attn:
    targets: ['re:.*\\.self_attn\\.(q|k|v|o)_proj$']
    method: rtn
    scheme: {num_bits: 8, type: float, symmetric: true, strategy: channel}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


def _sources() -> dict[str, Path]:
    """Build (once) the source checkpoints the cases convert."""
    import torch

    from quantkit.testing import make_tiny_model

    CACHE.mkdir(parents=True, exist_ok=True)
    made = {}

    def tiny(name, arch, **kw):
        d = CACHE / name
        if not (d / "config.json").is_file():
            shutil.rmtree(d, ignore_errors=True)
            make_tiny_model(arch, d, **kw)
        made[name] = d

    tiny("qwen3_moe", "qwen3_moe", experts=8)
    tiny("qwen3_moe-fp32", "qwen3_moe", dtype=torch.float32)
    tiny("mixtral", "mixtral")
    tiny("deepseek_v3", "deepseek_v3", experts=8)
    tiny("glm4_moe", "glm4_moe")
    tiny("glm_moe_dsa", "glm_moe_dsa")
    fp8 = CACHE / "deepseek_v3-fp8"
    if not (fp8 / "config.json").is_file():
        from quantkit.testing import write_block_fp8_checkpoint

        shutil.rmtree(fp8, ignore_errors=True)
        write_block_fp8_checkpoint(made["deepseek_v3"], fp8)
    made["deepseek_v3-fp8"] = fp8
    kimi = CACHE / "kimi_k25-int4"  # a Kimi K2.5-style INT4 release (QAT grid, vision tower), made once
    if not (kimi / "config.json").is_file():
        from quantkit.testing import make_tiny_kimi_k25

        shutil.rmtree(kimi, ignore_errors=True)
        make_tiny_kimi_k25(kimi, int4_experts="qat")
    made["kimi_k25-int4"] = kimi
    # W4AFP8 needs hidden and expert widths that are multiples of 256 (vLLM rule W2)
    tiny("glm4_moe-wide", "glm4_moe", hidden=256, head_dim=64, moe_intermediate=256)
    int4 = CACHE / "qwen3_moe-int4"  # a compressed-tensors INT4 source: made once by the tree that runs first
    if not (int4 / "quantkit_manifest.json").is_file():
        shutil.rmtree(int4, ignore_errors=True)
        _quantkit("convert", str(made["qwen3_moe"]), str(int4), "--recipe", "int4-experts-rtn")
    made["qwen3_moe-int4"] = int4
    recipe = CACHE / "asym-mixed.yaml"
    recipe.write_text(ASYM_RECIPE)
    made["asym-recipe"] = recipe
    return made


def _quantkit(*args: str) -> None:
    exe = Path(sys.executable).with_name("quantkit")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"quantkit {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def _cases(src: dict[str, Path], work: Path):
    """(case name, list of quantkit argument lists). A case's output is `work/<case>/out`."""
    kv_t = work / "kv-tensor-{}.safetensors"
    kv_h = work / "kv-head-{}.safetensors"
    yield "qwen3-rtn", [["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-rtn"]]
    yield "qwen3-gptq", [["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-gptq", *CAL]]
    yield "qwen3-awq", [["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-awq", *CAL]]
    yield "qwen3-fp8kv", [["convert", src["qwen3_moe"], "{out}", "--recipe", "fp8-kv"]]
    yield "qwen3-rtn-kvhead", [
        ["calibrate", src["qwen3_moe"], "-o", str(kv_h).format("qwen3"), "--strategy", "attn_head", *CAL],
        ["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-rtn", "--kv-scales", str(kv_h).format("qwen3")]]
    yield "qwen3-fp32-rtn", [["convert", src["qwen3_moe-fp32"], "{out}", "--recipe", "int4-experts-rtn"]]
    yield "qwen3-asym", [["convert", src["qwen3_moe"], "{out}", "--recipe", str(src["asym-recipe"])]]
    yield "qwen3-rtn-split", [["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-rtn",
                               "--max-shard-size", "100KB"]]
    # searched scales, affinity statistics, refitted scales, sweeps, the held-out check; and the fit
    yield "qwen3-gptq-plus", [["convert", src["qwen3_moe"], "{out}", "--recipe", "int4-experts-gptq-plus", *CAL16]]
    yield "deepseek-gptq-fit", [["convert", src["deepseek_v3"], "{out}", "--recipe", "int4-experts-gptq-fit", *CAL16]]
    yield "deepseek-gptq-asym", [["convert", src["deepseek_v3"], "{out}", "--recipe", "int4-experts-gptq-asym", *CAL16]]
    yield "mixtral-rtn", [["convert", src["mixtral"], "{out}", "--recipe", "int4-experts-rtn"]]
    yield "mixtral-gptq", [["convert", src["mixtral"], "{out}", "--recipe", "int4-experts-gptq", *CAL]]
    yield "mixtral-asym", [["convert", src["mixtral"], "{out}", "--recipe", str(src["asym-recipe"])]]
    yield "deepseek-kimi", [["convert", src["deepseek_v3"], "{out}", "--recipe", "kimi-k2", *CAL]]
    yield "deepseek-awq-kv", [
        ["calibrate", src["deepseek_v3"], "-o", str(kv_t).format("deepseek"), *CAL],
        ["convert", src["deepseek_v3"], "{out}", "--recipe", "int4-experts-awq", *CAL,
         "--kv-scales", str(kv_t).format("deepseek")]]
    yield "deepseek-fp8-rtn", [["convert", src["deepseek_v3-fp8"], "{out}", "--recipe", "int4-experts-rtn"]]
    yield "deepseek-fp8-glm", [["convert", src["deepseek_v3-fp8"], "{out}", "--recipe", "glm"]]
    yield "deepseek-fp8-gptq", [["convert", src["deepseek_v3-fp8"], "{out}", "--recipe", "int4-experts-gptq", *CAL]]
    yield "glm4-glm", [["convert", src["glm4_moe"], "{out}", "--recipe", "glm"]]
    yield "glm4-glm-kv", [
        ["calibrate", src["glm4_moe"], "-o", str(kv_t).format("glm4"), *CAL],
        ["convert", src["glm4_moe"], "{out}", "--recipe", "glm", "--kv-scales", str(kv_t).format("glm4")]]
    yield "glm4-gptq", [["convert", src["glm4_moe"], "{out}", "--recipe", "int4-experts-gptq", *CAL]]
    yield "glm5-glm", [["convert", src["glm_moe_dsa"], "{out}", "--recipe", "glm"]]
    # an INT4 source: the rtn output converted again (INT4 passed through, the rest to FP8)
    yield "int4src-glm", [["convert", src["qwen3_moe-int4"], "{out}", "--recipe", "glm"]]
    # FP4: weights only, amax and fitted scales, and W4A4 (calibrated input scales)
    yield "qwen3-nvfp4", [["convert", src["qwen3_moe"], "{out}", "--recipe", "nvfp4-experts"]]
    yield "qwen3-mxfp4", [["convert", src["qwen3_moe"], "{out}", "--recipe", "mxfp4-experts"]]
    yield "qwen3-nvfp4a4", [["convert", src["qwen3_moe"], "{out}", "--recipe", "nvfp4a4-experts", *CAL]]
    yield "glm4-nvfp4", [["convert", src["glm4_moe"], "{out}", "--recipe", "glm-nvfp4"]]
    yield "glm4-nvfp4a4", [["convert", src["glm4_moe"], "{out}", "--recipe", "glm-nvfp4a4", *CAL]]
    # Kimi K2.5-style INT4 release re-quantized: FP4 (fitted scales from the INT4 grid), W4A4, MXFP4
    yield "kimi-nvfp4", [["convert", src["kimi_k25-int4"], "{out}", "--recipe", "kimi-k2-nvfp4", *CAL]]
    yield "kimi-nvfp4a4", [["convert", src["kimi_k25-int4"], "{out}", "--recipe", "kimi-k2-nvfp4a4", *CAL]]
    yield "kimi-mxfp4", [["convert", src["kimi_k25-int4"], "{out}", "--recipe", "mxfp4-experts"]]
    yield "int4src-nvfp4", [["convert", src["qwen3_moe-int4"], "{out}", "--recipe", "nvfp4-experts"]]
    # W4AFP8 (INT4 group 128 + dynamic FP8 activations), RTN / GPTQ / AWQ, and the FP8 prefill recipe
    yield "glm4w-w4afp8", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "glm-w4afp8", *CAL]]
    yield "glm4w-w4afp8-rtn", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "int4-experts-w4afp8"]]
    yield "glm4w-w4afp8-gptq", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "int4-experts-w4afp8-gptq",
                                 *CAL]]
    yield "glm4w-w4afp8-awq", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "int4-experts-w4afp8-awq", *CAL]]
    yield "glm4w-fp8-prefill", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "fp8-prefill"]]
    # a prefill/decode pair from one command: OUT and its prefill half beside it (hashed as prefill/...); the
    # halves record each other's paths, so runs to compare must share $QUANTKIT_TREE_WORK
    yield "glm4w-pair", [["convert", src["glm4_moe-wide"], "{out}", "--recipe", "glm-w4afp8", *CAL,
                          "--pair", "fp8-prefill", "--pair-out", "{work}/glm4w-pair/prefill"]]


def _hash_tree(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(output: Path, only: list[str] | None) -> None:
    src = _sources()
    work = Path(os.environ.get("QUANTKIT_TREE_WORK", CACHE.parent / "tree-work"))  # one per concurrent run
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result = {}
    for name, steps in _cases(src, work):
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        out = work / name / "out"
        out.parent.mkdir(parents=True, exist_ok=True)
        for args in steps:
            _quantkit(*[str(a).format(out=out, work=work) for a in args])
        result[name] = _hash_tree(out)
        if (out.parent / "prefill").is_dir():
            result[name].update({f"prefill/{k}": v for k, v in _hash_tree(out.parent / "prefill").items()})
        print(f"{name}: {len(result[name])} files, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    output.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"wrote {output}", file=sys.stderr)


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for case in sorted(set(x) | set(y)):
        if case not in x or case not in y:
            print(f"{case}: only in {'first' if case in x else 'second'}")
            bad += 1
            continue
        for f in sorted(set(x[case]) | set(y[case])):
            if x[case].get(f) != y[case].get(f):
                print(f"{case}/{f}: {x[case].get(f, '-')[:12]} != {y[case].get(f, '-')[:12]}")
                bad += 1
    n = sum(len(v) for v in x.values())
    print(f"{len(x)} cases, {n} files: {'identical' if not bad else f'{bad} difference(s)'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tree_hashes", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=Path("tree-hashes.json"))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2, type=Path)
    ap.add_argument("--smoke", action="store_true", help="the first case only, in a temporary directory")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    os.environ.setdefault("TQDM_DISABLE", "1")
    if a.smoke:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="qk-tree-hashes-") as tmp:
            os.environ["QUANTKIT_TREE_WORK"] = str(Path(tmp) / "work")
            run(Path(tmp) / "hashes.json", ["qwen3-rtn"])
            return compare(Path(tmp) / "hashes.json", Path(tmp) / "hashes.json")
    run(a.output, a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
