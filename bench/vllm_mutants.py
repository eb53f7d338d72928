"""Prove that bench/vllm_check.py can fail: break a good quantkit output in ways vLLM's loader swallows.

    python -m bench vllm_mutants GOOD_CKPT [--work DIR] [--python bench/.cache/vllm-venv/bin/python]
    python -m bench vllm_mutants --smoke     # a tiny qwen3_moe converted with int4-experts-rtn (needs the vLLM venv)

GOOD_CKPT is an INT4-expert output of `quantkit convert` that the check accepts. Each mutant is a copy of
it with one defect; the check must reject every mutant (exit 1, `accepted: false`) and accept the
unmodified copy. Prints one JSON object ({mutants: [{name, what, exit_code, accepted, evidence}], ok}) and
exits 0 only when all of that holds. Needs torch + safetensors only (either venv); the check itself runs
in the vLLM venv's Python.

Mutants (one expert Linear of the last MoE layer is the victim):
  missing-scale    its `weight_scale` removed (shard and index)
  half-groups      its `weight_scale` cut to the first half of its groups, [N, G] -> [N, G/2]
  transposed       its `weight_packed` stored transposed, [N, K/8] -> [K/8, N]
  group-size       config.json says group_size 2x what the tensors were made with
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from bench.harness import BENCH_DIR as HERE
from bench.harness import Run, Skip, add_common_args, measure_cmd, scratch_dir

DEFAULT_PYTHON = HERE / ".cache" / "vllm-venv" / "bin" / "python"
INDEX = "model.safetensors.index.json"
MUTANTS = {
    "missing-scale": "an expert weight_scale removed",
    "half-groups": "an expert weight_scale with half of its groups",
    "transposed": "an expert weight_packed stored transposed",
    "group-size": "config group_size disagrees with the tensors (2x)",
}


def victim(index: dict) -> str:
    """The module whose tensors get broken: expert 1's gate (gate_proj / Mixtral w1) in the last MoE layer."""
    pat = re.compile(r"^(.*\.layers\.(\d+)\..*experts\.1\.(gate_proj|w1))\.weight_scale$")
    hits = [(int(m.group(2)), m.group(1)) for n in index["weight_map"] if (m := pat.match(n))]
    if not hits:
        raise SystemExit("no INT4 expert weight_scale in the checkpoint (convert with an int4-experts recipe)")
    return max(hits)[1]


def edit_tensor(ckpt: Path, name: str, fn) -> tuple[list[int], list[int] | None]:
    """Replace tensor `name` by fn(tensor) (None: delete it) in its shard and the index."""
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / INDEX).read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(str(shard))
    old = list(tensors[name].shape)
    new = fn(tensors[name])
    if new is None:
        del tensors[name]
        del index["weight_map"][name]
        (ckpt / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        tensors[name] = new.contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return old, (None if new is None else list(new.shape))


def make_mutant(good: Path, out: Path, kind: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    index = json.loads((out / INDEX).read_text())
    module = victim(index)
    if kind == "missing-scale":
        old, new = edit_tensor(out, f"{module}.weight_scale", lambda t: None)
        return {"tensor": f"{module}.weight_scale", "shape": old, "now": new}
    if kind == "half-groups":
        old, new = edit_tensor(out, f"{module}.weight_scale", lambda t: t[:, : t.shape[1] // 2].clone())
        return {"tensor": f"{module}.weight_scale", "shape": old, "now": new}
    if kind == "transposed":
        old, new = edit_tensor(out, f"{module}.weight_packed", lambda t: t.t().clone())
        return {"tensor": f"{module}.weight_packed", "shape": old, "now": new}
    if kind == "group-size":
        cfg = json.loads((out / "config.json").read_text())
        groups = cfg["quantization_config"]["config_groups"]
        changed = {}
        for gname, g in groups.items():
            w = g.get("weights") or {}
            if w.get("num_bits") == 4 and w.get("group_size"):
                changed[gname] = [w["group_size"], 2 * w["group_size"]]
                w["group_size"] *= 2
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return {"config_groups": changed}
    raise ValueError(kind)


def run_check(python: Path, ckpt: Path) -> tuple[int, dict]:
    p = measure_cmd([str(python), str(HERE / "vllm_check.py"), str(ckpt)],
                    env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    try:
        return p["rc"], json.loads(p["stdout"])
    except json.JSONDecodeError:
        return p["rc"], {"check_error": (p["stdout"] + p["stderr"])[-2000:]}


def evidence(report: dict) -> str:
    """One line: why the check rejected (or accepted) it."""
    if "error" in report:
        e = report["error"]
        return f"{e['stage']}: {e['type']}: {e['message'][:160]}"
    if "check_error" in report:
        return "check broke: " + report["check_error"][:160]
    bits = []
    if report.get("dropped"):
        bits.append("dropped " + ", ".join(d["tensor"] for d in report["dropped"][:3]))
    if report.get("unwritten"):
        bits.append("unwritten " + ", ".join(f"{u['param']} ({u['unwritten']}/{u['numel']})"
                                             for u in report["unwritten"][:3]))
    if report.get("strict_tracking") not in (None, "passed"):
        bits.append("strict tracking: " + report["strict_tracking"][:120])
    return "; ".join(bits) or "nothing found"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench vllm_mutants", description=__doc__.split("\n\n")[0])
    ap.add_argument("good", type=Path, nargs="?")
    ap.add_argument("--work", type=Path, help="where the mutated copies go (default: GOOD + '-mutants')")
    ap.add_argument("--python", type=Path, default=DEFAULT_PYTHON, help="the vLLM venv's Python")
    ap.add_argument("--only", nargs="*", choices=sorted(MUTANTS), help="run these mutants only")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    if not args.python.is_file():
        raise Skip(f"no vLLM venv Python at {args.python}: see docs/engine.md")
    run = Run("vllm_mutants", args, argv)
    if args.smoke:
        from quantkit.convert import ConvertOptions, convert
        from quantkit.tiny import make_tiny_model

        tmp = scratch_dir("qk-vllm-mutants-")
        args.good = tmp / "good"
        convert(make_tiny_model("qwen3_moe", tmp / "src"), args.good, ConvertOptions(recipe="int4-experts-rtn"))
    if args.good is None:
        ap.error("GOOD_CKPT (or --smoke)")
    good = args.good.resolve()
    work = (args.work or good.with_name(good.name + "-mutants")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    rows = []
    code, rep = run_check(args.python, good)
    rows.append({"name": "unmodified", "what": "the good output as written", "exit_code": code,
                 "accepted": rep.get("accepted"), "expected": True, "evidence": evidence(rep)})
    for kind in args.only or MUTANTS:
        change = make_mutant(good, work / kind, kind)
        code, rep = run_check(args.python, work / kind)
        rows.append({"name": kind, "what": MUTANTS[kind], "change": change, "exit_code": code,
                     "accepted": rep.get("accepted"), "expected": False, "evidence": evidence(rep),
                     "raised_by_vllm": "error" in rep})
        print(f"{kind}: exit {code}, accepted={rep.get('accepted')}: {rows[-1]['evidence']}", file=sys.stderr)
    ok = all(r["accepted"] is r["expected"] and r["exit_code"] == (0 if r["expected"] else 1) for r in rows)
    print(json.dumps({"good": str(good), "mutants": rows, "ok": ok}, indent=1))
    run.write(rows, {"good": str(good), "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
