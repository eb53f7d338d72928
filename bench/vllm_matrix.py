"""Which quantkit outputs vLLM 0.33 loads completely: tiny models x recipes x KV scales, judged by vLLM's loader.

    python -m bench vllm_matrix [--archs ...] [--recipes ...] [--jobs 2] [--mutants] [--work DIR]

Runs with quantkit's venv. For every architecture it builds a tiny random model (quantkit.testing; the
DeepSeek-V3 and GLM-5 configs get `topk_method: noaux_tc`, as the real ones have), measures FP8 KV-cache
scales with `quantkit calibrate --strategy tensor|attn_head`, converts with `quantkit convert` per recipe,
without and with `--kv-scales`, and runs bench/vllm_check.py on each output with the vLLM venv's Python
(bench/.cache/vllm-venv, see docs/engine.md). Outputs with KV scales on MLA models are checked a second
time with `--plugin` (quantkit/engine/vllm_plugin.py). Also: a Kimi-K2.5-style wrapper (model_type
kimi_k25, text model in text_config, tensors under `language_model.`, a tiny vision tower), a block-FP8
DeepSeek-V3 source whose dims are not multiples of 128 (partial 128x128 blocks), converted and checked, the
source itself checked too, and the glm recipe on `-wide` variants whose fused Linear parts are multiples
of 128 (the default tiny widths are not, which vLLM's block-FP8 layers refuse). Not in the default run:
`kimi_k25-int4`, the same wrapper as a Kimi K2.5 / K2.6 release ships it, routed experts INT4
pack-quantized group 32 on Kimi's 15-level QAT grid (quantkit.testing.make_tiny_kimi_k25(int4_experts="qat")),
with the vision tower vLLM builds; e.g. `--archs kimi_k25-int4 --recipes nvfp4-experts kimi-k2-nvfp4a4
mxfp4-experts --kv none tensor --no-fp8-source --results-name vllm_matrix_kimi_int4 --detail`.

Recipes with a `kv_cache` section (kimi-k2, fp8-kv) calibrate inside convert when no --kv-scales is given.
quantkit up to at least a40f670 took that calibration's size from the recipe only (128 x 512 tokens), not
from --num-samples/--seq-len; so that the run stays short whatever the version, this driver then passes a
copy of the recipe whose `calibration` says 4 x 64 (same groups, same layout; the table marks it).
`--shipped-calibration` uses the shipped recipe.

Prints a markdown table on stderr and one JSON object on stdout; writes bench/results/vllm_matrix.json
(--results-name NAME: vllm_matrix-NAME.json; --detail adds a table of tensors reaching a parameter, parameters
and unwritten ones per check). Without the vLLM venv it skips, saying so. Everything else goes under --work (default bench/.cache/vllm-matrix).
Exit 0 when every step ran (whatever the verdicts), 1 when the check itself broke somewhere.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import BENCH_DIR as HERE
from bench.harness import REPO, Run, Skip, add_common_args, measure_cmd

QUANTKIT = Path(sys.executable).with_name("quantkit")
VLLM_PYTHON = HERE / ".cache" / "vllm-venv" / "bin" / "python"

ARCHS = ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "mixtral", "kimi_k25")
# sources built on request only (--archs): the Kimi wrapper with INT4 QAT experts, as the releases ship it
EXTRA_ARCHS = ("kimi_k25-int4",)
MLA = {"deepseek_v3", "glm_moe_dsa", "kimi_k25", "kimi_k25-int4", "deepseek_v3-fp8", "deepseek_v3-wide",
       "glm_moe_dsa-wide"}
RECIPES = ("int4-experts-rtn", "int4-experts-gptq", "int4-experts-awq", "glm", "kimi-k2", "fp8-kv", "nvfp4-experts",
           "mxfp4-experts")
KV_VARIANTS = ("none", "tensor", "attn_head")
# attn_head scales are tried with these recipes only (the layout question is the same for every recipe)
ATTN_HEAD_RECIPES = ("int4-experts-rtn", "fp8-kv")
CAL = ["--num-samples", "4", "--seq-len", "64"]
ODD_DIMS = {"hidden": 160, "q_lora_rank": 96, "kv_lora_rank": 48, "moe_intermediate": 96}  # not multiples of 128
# The tiny models' fused Linears have output parts of 64 (k_proj, shared-expert gate/up, q_a_proj), which
# vLLM's block-FP8 layers refuse (see docs/engine.md, Rules); these widths make every part a multiple of
# 128 as in the real GLM / DeepSeek configs, for the glm recipe
WIDE = {"glm4_moe-wide": ("glm4_moe", {"head_dim": 64, "moe_intermediate": 128}),
        "deepseek_v3-wide": ("deepseek_v3", {"q_lora_rank": 128, "moe_intermediate": 128, "topk_method": "noaux_tc"}),
        "glm_moe_dsa-wide": ("glm_moe_dsa", {"q_lora_rank": 128, "moe_intermediate": 128, "topk_method": "noaux_tc"})}


def run(cmd: list[str], timeout: int = 1800, env: dict | None = None) -> tuple[int, str, str, float]:
    r = measure_cmd([str(c) for c in cmd], timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)
    return (124 if r["timed_out"] else r["rc"]), r["stdout"], r["stderr"], r["wall_s"]


def last_error(stderr: str) -> str:
    """The one-line error quantkit prints (plus its hint), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and "━" not in ln]
    errs = [i for i, ln in enumerate(lines) if ln.startswith(("error:", "internal error:"))]
    if errs:
        return " ".join(lines[errs[-1]: errs[-1] + 2])[:400]
    return (lines[-1] if lines else "")[:400]


# ---- sources --------------------------------------------------------------------------------------------
def make_source(arch: str, root: Path) -> Path:
    out = root / "src" / arch
    if (out / "config.json").is_file():
        return out
    from quantkit.testing import make_tiny_model

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if arch == "kimi_k25":
        make_kimi_k25(tmp, root)
    elif arch == "kimi_k25-int4":
        make_kimi_k25_int4(tmp)
    elif arch == "deepseek_v3-fp8":
        bf16 = make_source("deepseek_v3-odd", root)
        write_block_fp8(bf16, tmp)
    elif arch in WIDE:
        make_tiny_model(WIDE[arch][0], tmp, **WIDE[arch][1])
    elif arch == "deepseek_v3-odd":
        make_tiny_model("deepseek_v3", tmp, topk_method="noaux_tc", **ODD_DIMS)
    else:
        extra = {"topk_method": "noaux_tc"} if arch in ("deepseek_v3", "glm_moe_dsa") else {}
        make_tiny_model(arch, tmp, **extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_block_fp8(bf16: Path, dst: Path) -> None:
    try:
        from quantkit.testing import write_block_fp8_checkpoint
    except ImportError:  # older layout of the package
        from quantkit.io.sources import write_block_fp8_checkpoint
    write_block_fp8_checkpoint(bf16, dst)


# A tiny MoonViT config (field names of transformers' Kimi_K25VisionConfig, which vLLM reads)
KIMI_VISION = {"model_type": "kimi_k25_vision", "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4,
               "pos_emb_time": 4, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
               "intermediate_size": 64, "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2]}


def make_kimi_k25(out: Path, root: Path) -> None:
    """A Kimi-K2.5-style wrapper around the tiny deepseek_v3: config {model_type: kimi_k25, text_config:
    {...deepseek_v3...}, vision_config}, text tensors renamed `language_model.` + name, plus the vision
    tower and projector tensors vLLM's KimiK25 class declares (names and shapes asked from vLLM itself, HF
    spelling `mm_projector.proj.{0,2}`), random BF16."""
    from safetensors.torch import load_file, save_file

    inner = make_source("deepseek_v3", root)
    out.mkdir(parents=True)
    text = json.loads((inner / "config.json").read_text())
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
           "vision_config": KIMI_VISION, "projection_hidden_size": 32, "image_token_id": 500, "video_token_id": 501,
           "vision_start_token_id": 502, "vision_end_token_id": 503, "tie_word_embeddings": False, "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    index = json.loads((inner / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {f"language_model.{n}": t for n, t in load_file(str(inner / shard)).items()}
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    write_vllm_vision(out, weight_map)


def write_vllm_vision(out: Path, weight_map: dict) -> None:
    """Add to the wrapper in OUT (config.json and text shards written; `weight_map` its text tensors) the
    vision tower and projector tensors vLLM's KimiK25 class declares for its config, random BF16, in
    model-vision.safetensors, and write the index."""
    import torch
    from safetensors.torch import save_file

    # vision tower + projector: ask vLLM which parameters it builds (the config alone suffices)
    code, stdout, stderr, _ = run([VLLM_PYTHON, HERE / "vllm_check.py", out, "--list-params",
                                   "vision_tower.,mm_projector."], env={"VLLM_TARGET_DEVICE": "cpu"})
    if code != 0:
        raise RuntimeError(f"vLLM could not build the kimi_k25 wrapper: {last_error(stderr + stdout)}")
    params = json.loads(stdout)["params"]
    gen = torch.Generator().manual_seed(0)
    vision = {}
    for name, (shape, dtype) in sorted(params.items()):
        hf = name.replace("mm_projector.linear_1", "mm_projector.proj.0").replace("mm_projector.linear_2",
                                                                                     "mm_projector.proj.2")
        t = torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)
        vision[hf] = t.to(getattr(torch, dtype.replace("torch.", "")))
    save_file(vision, str(out / "model-vision.safetensors"), metadata={"format": "pt"})
    weight_map.update({n: "model-vision.safetensors" for n in vision})
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")


def make_kimi_k25_int4(out: Path) -> None:
    """The Kimi-K2.5 wrapper as the K2.5 / K2.6 releases ship it: quantkit.testing.make_tiny_kimi_k25 with
    `int4_experts="qat"` (routed experts INT4 pack-quantized group 32 symmetric on the 15-level grid, a
    top-level quantization_config with the release's ignore list, text config model_type kimi_k2), whose
    stand-in vision tensors are replaced by the full tower vLLM builds for KIMI_VISION (as make_kimi_k25)."""
    from quantkit.testing import make_tiny_kimi_k25

    make_tiny_kimi_k25(out, int4_experts="qat")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(vision_config=KIMI_VISION, projection_hidden_size=32)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    (out / "model-vision.safetensors").unlink()
    weight_map = {n: s for n, s in index["weight_map"].items() if s != "model-vision.safetensors"}
    write_vllm_vision(out, weight_map)


# ---- steps ----------------------------------------------------------------------------------------------
def calibrate(src: Path, strategy: str, work: Path, fresh: bool = False) -> dict:
    out = work / "kv" / f"{src.name}-{strategy}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file() and not fresh:
        return {"ok": True, "path": str(out), "cached": True}
    code, _, err, secs = run([QUANTKIT, "calibrate", src, "-o", out, "--strategy", strategy, *CAL, "--json"])
    return {"ok": code == 0, "path": str(out) if code == 0 else None, "exit_code": code,
            "error": None if code == 0 else last_error(err), "seconds": round(secs, 1)}


def recipe_arg(recipe: str, work: Path, kv_given: bool, shipped: bool) -> tuple[str, str | None]:
    """(the --recipe value, a note) - a quick-calibration copy for kv_cache recipes without --kv-scales."""
    path = REPO / "recipes" / f"{recipe}.yaml"
    text = path.read_text() if path.is_file() else ""
    if kv_given or shipped or not re.search(r"^kv_cache:", text, re.MULTILINE):
        return recipe, None
    import yaml

    quick = work / "recipes" / f"{recipe}.yaml"
    quick.parent.mkdir(parents=True, exist_ok=True)
    doc = yaml.safe_load(text)
    doc["calibration"] = {**(doc.get("calibration") or {}), "num_samples": 4, "seq_len": 64}
    quick.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(quick), "recipe copy with calibration 4 x 64"


def convert(src: Path, out: Path, recipe: str, kv: str | None, fresh: bool = False) -> dict:
    """Run `quantkit convert`; reuse OUT when the same command already completed there (OUT.convert.json)."""
    cmd = [QUANTKIT, "convert", src, out, "--recipe", recipe, *CAL, "--json", "--overwrite"]
    if kv:
        cmd += ["--kv-scales", kv]
    stamp = out.with_name(out.name + ".convert.json")
    key = [str(c) for c in cmd] + [_recipe_text(recipe)]
    if not fresh and stamp.is_file():
        old = json.loads(stamp.read_text())
        if old.get("key") == key and (not old["result"]["ok"] or (out / "quantkit_manifest.json").is_file()):
            return {**old["result"], "cached": True}
    for f in out.parent.glob(f"{out.name}.vllm*.json"):  # check reports of an older conversion
        f.unlink()
    res = {**_convert(cmd), "quantkit": quantkit_state()}
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"key": key, "result": res}) + "\n")
    return res


def _recipe_text(recipe: str) -> str:
    p = Path(recipe) if recipe.endswith(".yaml") else REPO / "recipes" / f"{recipe}.yaml"
    return p.read_text() if p.is_file() else recipe


def _convert(cmd: list) -> dict:
    code, stdout, err, secs = run(cmd)
    res = {"ok": code == 0, "exit_code": code, "seconds": round(secs, 1)}
    if code != 0:
        res["error"] = last_error(err)
    else:
        try:
            res["tensors_quantized"] = json.loads(stdout).get("tensors_quantized")
        except json.JSONDecodeError:
            pass
    return res


def vllm_check(ckpt: Path, plugin: bool = False, fresh: bool = False) -> dict:
    """Run bench/vllm_check.py; reuse its report when it was made for this very conversion."""
    report = ckpt.parent / f"{ckpt.name}.vllm{'-plugin' if plugin else ''}.json"
    if not fresh and report.is_file() and _newer(report, ckpt / "quantkit_manifest.json", ckpt / "config.json"):
        rep = json.loads(report.read_text())
        rep.setdefault("exit_code", 0 if rep.get("accepted") else 1)
        return {**rep, "cached": True}
    cmd = [VLLM_PYTHON, HERE / "vllm_check.py", ckpt, "--json-out", report]
    if plugin:
        cmd.append("--plugin")
    code, stdout, err, secs = run(cmd, env={"VLLM_TARGET_DEVICE": "cpu"})
    try:
        rep = json.loads(stdout)
    except json.JSONDecodeError:
        rep = {"check_error": (stdout + err)[-1500:]}
    rep["exit_code"] = code
    rep["seconds"] = round(secs, 1)
    return rep


def _newer(path: Path, *than: Path) -> bool:
    return all(not t.exists() or path.stat().st_mtime >= t.stat().st_mtime for t in than)


def verdict(rep: dict | None) -> str:
    if rep is None:
        return "-"
    if "check_error" in rep:
        return "CHECK BROKE"
    if "error" in rep:
        return f"raised at {rep['error']['stage']}"
    return "accepted" if rep.get("accepted") else "rejected"


def summary(rep: dict | None) -> dict:
    """The table's view of a check report."""
    if rep is None:
        return {}
    s = {"verdict": verdict(rep), "exit_code": rep.get("exit_code")}
    if "error" in rep:
        s["error"] = f"{rep['error']['type']}: {rep['error']['message'][:300]}"
    if "check_error" in rep:
        s["error"] = rep["check_error"][-300:]
    s["dropped"] = [d["tensor"] for d in rep.get("dropped", [])]
    s["unwritten"] = [f"{u['param']} ({u['unwritten']}/{u['numel']})" for u in rep.get("unwritten", [])]
    kv = rep.get("kv_scales_loaded") or {}
    s["kv_layers"] = len(kv)
    s["kv_loaded"] = sum(1 for r in kv.values() if r.get("k_scale") is not None and r.get("v_scale") is not None)
    s["kv_dropped_warnings"] = len(rep.get("kv_scales_dropped_by_vllm", []))
    s["moe_backend"] = rep.get("moe_backend_emulated")
    for key in ("tensors_on_disk", "tensors_reaching_a_param", "parameters", "moe_methods"):
        if key in rep:
            s[key] = rep[key]
    return s


def short_error(text: str) -> str:
    text = re.sub(r"^(internal )?error: ", "", text or "").split(" hint:")[0]
    return text[:110] + ("..." if len(text) > 110 else "")


def cell(row: dict) -> str:
    """One table cell: what happened to this output, in a few words."""
    if row.get("calibrate_error"):
        return "calibrate failed"
    if not row["convert"].get("ok"):
        return "convert failed: " + short_error(row["convert"].get("error"))
    c = row.get("check") or {}
    text = c.get("verdict", "-")
    if c.get("error"):
        text = "vLLM raised: " + short_error(c["error"].split(": ", 1)[-1])
    bits = []
    if c.get("dropped"):
        bits.append(f"{len(c['dropped'])} dropped ({_short(c['dropped'])})")
    if c.get("unwritten"):
        bits.append(f"{len(c['unwritten'])} unwritten ({_short(c['unwritten'])})")
    text += (": " + "; ".join(bits) if bits else "")
    if c.get("kv_layers") and (row["kv"] != "none" or _recipe_has_kv(row["recipe"])):
        text += f"; KV {c['kv_loaded']}/{c['kv_layers']}"
    p = row.get("check_plugin")
    if p:
        text += f" (--plugin: {p.get('verdict')}" + (f", KV {p['kv_loaded']}/{p['kv_layers']}" if p.get("kv_layers") else "") + ")"
    return text


def _recipe_has_kv(recipe: str) -> bool:
    path = REPO / "recipes" / f"{recipe}.yaml"
    return path.is_file() and re.search(r"^kv_cache:", path.read_text(), re.MULTILINE) is not None


def _short(names: list[str]) -> str:
    n = re.sub(r"^(language_model\.)?model\.", "", names[0])
    return n + (", ..." if len(names) > 1 else "")


def markdown(rows: list[dict], extra: list[dict], vllm_version: str, scales: dict) -> str:
    # the quantkit each conversion ran (other work may change it during a run); "?" for older caches
    states = sorted({(r["convert"].get("quantkit") or {}).get("commit", "?")[:7] + (
        " + uncommitted changes" if (r["convert"].get("quantkit") or {}).get("quantkit_tree_modified") else "")
        for r in rows if r.get("convert", {}).get("ok")})
    head = (f"vLLM {vllm_version}, CPU, bench/vllm_check.py on each `quantkit convert` output (quantkit: "
            f"{', '.join(states) or '-'}). \"KV a/b\": a of b attention layers hold the checkpoint's k_scale and "
            "v_scale.")
    lines = [head, "",
             "| model | recipe | no --kv-scales | --kv-scales (tensor) | --kv-scales (attn_head) |", "|---|---|---|---|---|"]
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        table.setdefault((r["arch"], r["recipe"]), {})[r["kv"]] = r
    for (arch, recipe), by_kv in table.items():
        star = " \\*" if any(r.get("recipe_note") for r in by_kv.values()) else ""
        cells = [cell(by_kv[k]) if k in by_kv else "" for k in KV_VARIANTS]
        lines.append(f"| {arch} | {recipe}{star} | " + " | ".join(cells) + " |")
    for e in extra:
        lines.append(f"| {e['arch']} | {e['recipe']} | {e['text']} | | |")
    lines.append("")
    for arch, by in scales.items():
        for strategy, cal in by.items():
            if isinstance(cal, dict) and not cal.get("ok"):
                lines.append(f"- calibrate failed for {arch} ({strategy}): {short_error(cal.get('error'))}")
    if any(r.get("recipe_note") for r in rows):
        lines.append("- \\* recipe with a kv_cache section, no --kv-scales: a copy with calibration 4 x 64, so that "
                     "convert's own KV calibration is short whatever --num-samples does.")
    return "\n".join(lines)


def detail_table(rows: list[dict]) -> str:
    """Per check: tensors reaching a parameter / tensors on disk, vLLM's parameters (non-empty) and how many
    hold unwritten elements, the MoE method vLLM chose, the verdict."""
    lines = ["| model | recipe | --kv-scales | check | tensors reaching a parameter | parameters | unwritten "
             "| dropped | vLLM MoE method | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for key in ("check", "check_plugin"):
            c = r.get(key)
            if not c:
                continue
            tens = (f"{c['tensors_reaching_a_param']} / {c['tensors_on_disk']}" if "tensors_on_disk" in c else "-")
            lines.append(f"| {r['arch']} | {r['recipe']} | {r['kv']} | {'--plugin' if key == 'check_plugin' else 'plain'} "
                         f"| {tens} | {c.get('parameters', '-')} | {len(c.get('unwritten', []))} "
                         f"| {len(c.get('dropped', []))} | {', '.join(c.get('moe_methods') or []) or '-'} "
                         f"| {c.get('verdict')} |")
    return "\n".join(lines)


def quantkit_state() -> dict:
    """The commit quantkit ran from, and whether its working tree differed from it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "quantkit"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return {"commit": head, "quantkit_tree_modified": bool(dirty)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench vllm_matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="*", default=list(ARCHS), help=f"also: {', '.join(EXTRA_ARCHS)}")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--kv", nargs="*", default=list(KV_VARIANTS), choices=KV_VARIANTS)
    ap.add_argument("--no-fp8-source", action="store_true", help="skip the block-FP8 (partial blocks) source")
    ap.add_argument("--no-wide", action="store_true", help="skip the glm recipe on the 128-wide variants")
    ap.add_argument("--mutants", action="store_true", help="also run bench/vllm_mutants.py on two good outputs")
    ap.add_argument("--shipped-calibration", action="store_true")
    ap.add_argument("--jobs", type=int, default=2, help="vLLM checks run in parallel")
    ap.add_argument("--fresh", action="store_true", help="redo conversions and checks found under --work")
    ap.add_argument("--work", type=Path, default=HERE / ".cache" / "vllm-matrix")
    ap.add_argument("--render", type=Path, metavar="JSON", help="only print the table of an earlier run's JSON")
    ap.add_argument("--results-name", default=None,
                    help="write bench/results/vllm_matrix-NAME.json (default vllm_matrix.json)")
    ap.add_argument("--detail", action="store_true",
                    help="add a table of tensors reaching a parameter / parameters / unwritten per check")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    if args.smoke:  # one architecture, one recipe, no KV scales
        args.archs, args.recipes, args.kv, args.no_fp8_source, args.no_wide = ["qwen3_moe"], ["int4-experts-rtn"], \
            ["none"], True, True
    if args.render:
        done = json.loads(args.render.read_text())
        print(markdown(done["rows"], [], done["vllm"], done["calibration"]))
        if args.detail:
            print("\n" + detail_table(done["rows"]))
        return 0
    if not VLLM_PYTHON.is_file():
        raise Skip(f"no vLLM venv at {VLLM_PYTHON}: see docs/engine.md")
    bench_run = Run("vllm_matrix", args, argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    # 1. sources and KV scales
    sources, scales = {}, {}
    for arch in args.archs:
        try:
            sources[arch] = make_source(arch, work)
        except Exception as e:  # noqa: BLE001 - recorded in the table (e.g. a wrapper vLLM cannot build)
            sources[arch] = None
            scales[arch] = {"source_error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{arch}: source failed: {e}", file=sys.stderr)
            continue
        for strategy in [k for k in args.kv if k != "none"]:
            scales.setdefault(arch, {})[strategy] = calibrate(sources[arch], strategy, work, args.fresh)
            print(f"{arch}: calibrate {strategy}: {scales[arch][strategy].get('error') or 'ok'}", file=sys.stderr)

    # 2. conversions (sequential: quantkit uses both cores), checks in a pool
    rows: list[dict] = []
    pool = cf.ThreadPoolExecutor(max_workers=args.jobs)
    futures = {}
    for arch in args.archs:
        if sources.get(arch) is None:
            rows.append({"arch": arch, "recipe": "-", "kv": "none", "convert": {"ok": False,
                         "error": scales[arch]["source_error"]}})
            continue
        for recipe in args.recipes:
            for kv in args.kv:
                if kv == "attn_head" and recipe not in ATTN_HEAD_RECIPES:
                    continue
                row = {"arch": arch, "recipe": recipe, "kv": kv}
                rows.append(row)
                kv_file = None
                if kv != "none":
                    cal = scales[arch][kv]
                    if not cal["ok"]:
                        row["calibrate_error"] = cal["error"]
                        row["convert"] = {"ok": False, "error": "no scales"}
                        continue
                    kv_file = cal["path"]
                rarg, note = recipe_arg(recipe, work, kv_file is not None, args.shipped_calibration)
                row["recipe_note"] = note
                out = work / "out" / f"{arch}--{recipe}--kv-{kv}"
                row["output"] = str(out)
                row["convert"] = convert(sources[arch], out, rarg, kv_file, args.fresh)
                print(f"{arch} {recipe} kv={kv}: convert {row['convert'].get('error') or 'ok'}", file=sys.stderr)
                if row["convert"]["ok"]:
                    futures[pool.submit(vllm_check, out, False, args.fresh)] = (row, "check")
                    has_kv = json.loads((out / "config.json").read_text()).get("quantization_config", {}) or {}
                    if arch in MLA and has_kv.get("kv_cache_scheme"):
                        futures[pool.submit(vllm_check, out, True, args.fresh)] = (row, "check_plugin")

    # 3. the block-FP8 source: itself, and converted
    extra = []
    if not args.no_fp8_source:
        try:
            fp8 = make_source("deepseek_v3-fp8", work)
            futures[pool.submit(vllm_check, fp8, False, args.fresh)] = (row_fp8 := {"arch": "deepseek_v3 block-FP8 source (odd dims)",
                                                                 "recipe": "(source as released)", "kv": "none",
                                                                 "convert": {"ok": True}, "output": str(fp8)}, "check")
            rows_fp8 = [row_fp8]
            for recipe in ("int4-experts-rtn", "glm", "kimi-k2"):
                out = work / "out" / f"deepseek_v3-fp8--{recipe}"
                rarg, note = recipe_arg(recipe, work, False, args.shipped_calibration)
                r = {"arch": "deepseek_v3 block-FP8 source (odd dims)", "recipe": recipe, "kv": "none",
                     "recipe_note": note, "output": str(out), "convert": convert(fp8, out, rarg, None, args.fresh)}
                rows_fp8.append(r)
                print(f"fp8 source {recipe}: convert {r['convert'].get('error') or 'ok'}", file=sys.stderr)
                if r["convert"]["ok"]:
                    futures[pool.submit(vllm_check, out, False, args.fresh)] = (r, "check")
                    if json.loads((out / "config.json").read_text()).get("quantization_config", {}).get("kv_cache_scheme"):
                        futures[pool.submit(vllm_check, out, True, args.fresh)] = (r, "check_plugin")
            rows += rows_fp8
        except Exception as e:  # noqa: BLE001 - recorded in the table
            extra.append({"arch": "deepseek_v3 block-FP8 source", "recipe": "-", "text": f"source failed: {e}"})

    # 4. the glm recipe on widths where every fused part is a multiple of 128
    if "glm" in args.recipes and not args.no_wide:
        for arch in WIDE:
            r = {"arch": arch + f" ({', '.join(f'{k}={v}' for k, v in WIDE[arch][1].items() if k != 'topk_method')})",
                 "recipe": "glm", "kv": "none"}
            out = work / "out" / f"{arch}--glm"
            r["output"] = str(out)
            r["convert"] = convert(make_source(arch, work), out, "glm", None, args.fresh)
            rows.append(r)
            print(f"{arch} glm: convert {r['convert'].get('error') or 'ok'}", file=sys.stderr)
            if r["convert"]["ok"]:
                futures[pool.submit(vllm_check, out, False, args.fresh)] = (r, "check")

    reports = {}
    for fut in cf.as_completed(futures):
        row, key = futures[fut]
        rep = fut.result()
        reports[(row.get("output"), key)] = rep
        row[key] = summary(rep)
        print(f"{row['arch']} {row['recipe']} kv={row['kv']} {key}: {row[key]['verdict']}", file=sys.stderr)
    pool.shutdown()

    # 5. mutants
    mutants = None
    if args.mutants:
        mutants = []
        for arch in ("qwen3_moe", "deepseek_v3"):
            good = work / "out" / f"{arch}--int4-experts-rtn--kv-none"
            if not good.is_dir():
                continue
            _, stdout, err, _ = run([sys.executable, "-m", "bench", "vllm_mutants", good, "--work",
                                     work / "mutants" / arch])
            try:
                mutants.append(json.loads(stdout))
            except json.JSONDecodeError:
                mutants.append({"good": str(good), "ok": False, "error": err[-800:]})

    vllm_version = next((r.get("vllm") for r in reports.values() if r.get("vllm")), "?")
    table = markdown(rows, extra, vllm_version, scales)
    if args.detail:
        table += "\n\n" + detail_table(rows)
    result = {"vllm": vllm_version, "quantkit": quantkit_state(), "seconds": round(time.perf_counter() - t_start),
              "calibration": scales,
              "rows": rows, "mutants": mutants}
    bench_run.write([{k: v for k, v in r.items()} for r in rows],
                    {k: v for k, v in result.items() if k != "rows"} | {"table": table}, tag=args.results_name)
    print(table, file=sys.stderr)
    if mutants is not None:
        for m in mutants:
            for r in m.get("mutants", []):
                print(f"mutant {Path(m['good']).name} {r['name']}: exit {r['exit_code']} accepted={r['accepted']}: "
                      f"{r['evidence']}", file=sys.stderr)
    print(json.dumps(result, default=str))
    broke = any((r.get("check") or {}).get("verdict") == "CHECK BROKE" for r in rows)
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
