"""Quality of INT4 expert quantization on *trained* tiny MoEs (bench/fixture.py): held-out perplexity and
mean next-token KL(bf16 || quantized) for BF16, RTN, GPTQ and AWQ (and their variants) at group 32 and 128,
all through the real pipeline (`quantkit convert` with a recipe, then transformers loading the written
checkpoint; outputs transformers cannot load as written, asymmetric or NVFP4 experts, as `verify` measures
them: the BF16 model with quantkit's dequantized weights).

Optionally, side by side on the same model, the same calibration token ids and the same targets (the routed
experts), the peers run in a separate venv (`--peer-python`, bench/setup_peers.sh): llm-compressor's
`oneshot` GPTQ (W4A16, same group size; `llmc` with its default moe_calibrate_all_experts, `llmc-routed`
without it) and auto-round's default W4A16 recipe (`autoround`; `autoround-asym`: the same with sym=False, its
zero points; auto-round 0.15.1 cannot export those to compressed-tensors, so its result after quantize() is
written as the source with each module's weights dequantized from its own codes, fp16 scales and zero points).

    python -m bench quality [--fixtures default skewed] [--groups 32 128] [--methods rtn gptq gptq-mse-aff]
                            [--num-samples 64] [--eval-windows 2048] [--fp4 nvfp4 mxfp4]
                            [--peer-python bench/.cache/peer-venv/bin/python --peers llmc llmc-routed autoround
                             autoround-asym]
    python -m bench quality --smoke   # the `tiny` fixture (2 layers, 5 training steps), RTN g32, 8 windows

Fixtures: `default` (8 experts, top-2) and `skewed` (32 experts, top-4, trained without a balancing loss;
expert width 64, so no group 128), `skewed128` (the same with expert width 128), `normtopk` (the default's shape with
norm_topk_prob true, trained 1200 steps: gguf_export's), `tiny` (2 layers, trained 5 steps: the smoke case).
Every quantization runs in its own process: its wall time (`seconds`: imports excluded, reading the source
included: quantkit's `convert()` call, the peers' scripts from before `from_pretrained` to the saved
checkpoint; `process_seconds`: the whole process) and its peak RSS.
`--fp4`: NVFP4 / MXFP4 experts (RTN and GPTQ; each format has its own group) beside the INT4 rows, and with
the peer, llm-compressor's NVFP4A16 preset on the same targets.

Evaluation: non-overlapping 128-token windows of the held-out split (2048 of them by default, ~260k
tokens; 0 = all), computed in float32. Besides perplexity and KL(bf16 || q), each row reports the exact
split of its NLL change into KL + `cross` (see `evaluate`) and the standard error of that change, so
that a perplexity difference can be told from noise. Writes bench/results/quality.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.fixture import NORMTOPK, SKEWED, SKEWED128, TINY, FixtureSpec, get_fixture
from bench.harness import REPO, Run, add_common_args, id_rows, last_json, measure_cmd, measure_fn, scratch_dir

TARGETS = ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']


# FP4 "groups": the format names its own group (NVFP4: 16 values, FP8 scale, FP32 global; MXFP4: 32, E8M0)
FP4_SCHEMES = {"nvfp4": "{num_bits: 4, type: float, symmetric: true, strategy: tensor_group}",
               "mxfp4": "{num_bits: 4, type: float, symmetric: true, strategy: group}"}


def recipe_yaml(method: str, group: int | str) -> str:
    """`method` rtn, gptq or awq, with modifiers after dashes: "mse" (RTN: `scale_search: mse`, each group's
    clipping searched; GPTQ: `observer: mse`, each group's scale searched against the Hessian-weighted
    error), "aff" (GPTQ: `stats: affinity`, every token in every expert's Hessian weighted by the router's
    affinity), "affN" (the same over the router's top-N experts per token; "affNk": N times the router's
    top-k), "refit" (GPTQ, INT4: `refit_scales: true`, each row's group scales refitted to its codes) or
    "cdN" (GPTQ, INT4: `refine_sweeps: N`, N coordinate-descent sweeps over the codes; "cd": one), "dampX"
    (GPTQ: `damp: X`), "asym" (an asymmetric scheme: a zero point per group),
    "hoN" (GPTQ: `holdout: N`), "noact" (GPTQ: `actorder: false`), "balN" / "poolM" (GPTQ: `balance_tokens: N`,
    `balance_pool: M`; the pool comes from the rows `--calib-extra` adds), "fitP" (GPTQ: `fit_unquantized: P/100`),
    "fdP" (GPTQ: `fit_down: P/100`): e.g. gptq-mse-aff-refit-cd2."""
    base, *mods = method.split("-")
    gptq = {"damp": "0.01", "actorder": "true", "block_size": "128"}
    opts = {"gptq": gptq, "awq": {"n_grid": "20"}, "rtn": {}}[base]
    search = None
    symmetric = "true"
    for m in mods:
        if m == "asym":
            symmetric = "false"
        elif m == "mse" and base == "gptq":
            opts["observer"] = "mse"
        elif m == "mse" and base == "rtn":
            search = "mse"
        elif m == "refit" and base == "gptq":
            opts["refit_scales"] = "true"
        elif m.startswith("damp") and base == "gptq":
            opts["damp"] = m[4:]
        elif m.startswith("ho") and m[2:].isdigit() and base == "gptq":
            opts["holdout"] = m[2:]
        elif m == "noact" and base == "gptq":
            opts["actorder"] = "false"
        elif m.startswith("bal") and m[3:].isdigit() and base == "gptq":
            opts["balance_tokens"] = m[3:]
        elif m.startswith("pool") and m[4:].isdigit() and base == "gptq":
            opts["balance_pool"] = m[4:]
        elif m.startswith("fit") and m[3:].isdigit() and base == "gptq":
            opts["fit_unquantized"] = str(int(m[3:]) / 100)
        elif m.startswith("fd") and m[2:].isdigit() and base == "gptq":
            opts["fit_down"] = str(int(m[2:]) / 100)
        elif m.startswith("cd") and base == "gptq":
            opts["refine_sweeps"] = m[2:] or "1"
        elif m.startswith("aff") and base == "gptq" and (m == "aff" or m[3:].isdigit() or m[3:-1].isdigit()
                                                         and m.endswith("k")):
            opts["stats"] = "affinity"
            if m != "aff":
                opts["affinity_top_k"] = m[3:]
        else:
            raise SystemExit(f"unknown method {method!r}")
    opts = ("    options: {" + ", ".join(f"{k}: {v}" for k, v in opts.items()) + "}\n") if opts else ""
    scheme = FP4_SCHEMES.get(str(group)) or (f"{{num_bits: 4, type: int, symmetric: {symmetric}, strategy: group, "
                                             f"group_size: {group}}}")
    if search:
        scheme = scheme[:-1] + f", scale_search: {search}}}"
    return (f"name: bench-{method}-g{group}\ngroups:\n  experts:\n    targets: {json.dumps(TARGETS)}\n"
            f"    method: {base}\n    scheme: {scheme}\n{opts}ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']\n")


def windows(tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n windows of seq_len tokens at seeded random offsets (they may overlap): the calibration samples."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (n,), generator=g)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])


def heldout_windows(tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n distinct non-overlapping windows of the held-out split in seeded order (n = 0 or more than there
    are: all of them)."""
    total = len(tokens) // seq_len
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    take = order if n <= 0 else order[:n]
    return torch.stack([tokens[s * seq_len:(s + 1) * seq_len] for s in take.tolist()])


EVAL_BATCH = 32


@torch.no_grad()
def evaluate(model_dir, eval_ids: torch.Tensor, ref: dict | None = None, src=None):
    """Held-out metrics of the checkpoint in model_dir, computed in float32 (the stored weights are exact in
    it; bf16 arithmetic would add its own rounding noise to every comparison).

    With `ref` (the BF16 model's evaluation) also: KL(bf16 || q) per token, and the exact split of the
    change in mean NLL into KL + `cross`, where cross = E[(p_bf16 - onehot(y)) . (log q - log p_bf16)]: the
    part of the NLL change that comes from the direction of the perturbation relative to the reference's
    own errors. For a model trained to a minimum of its loss this term vanishes to first order; for an
    undertrained one it can dominate perplexity differences. `dnll_se`: standard error of the mean NLL
    change over windows. `src`: the BF16 checkpoint, for outputs transformers cannot load as written."""
    from quantkit.testing import load_model
    from quantkit.verify.numerics import load_dequantized, transformers_cannot_load

    if src is not None and transformers_cannot_load(Path(model_dir)):
        # NVFP4 routed experts: transformers drops their global scales on load, so the BF16 model gets the
        # dequantized weights (what verify does; compressed-tensors' decompressor agrees bit for bit)
        model = load_dequantized(Path(src), Path(model_dir), torch.device("cpu"), torch.float32)
    else:
        model = load_model(model_dir, torch.float32).eval()
    nll_w, kl_w, lps = [], [], []
    for j, i in enumerate(range(0, len(eval_ids), EVAL_BATCH)):
        x = eval_ids[i:i + EVAL_BATCH]
        lp = F.log_softmax(model(x).logits.float()[:, :-1], -1)
        nll_w.append(-lp.gather(-1, x[:, 1:, None])[..., 0].mean(1))
        if ref is None:
            lps.append(lp)
        else:
            r = ref["logprobs"][j]
            kl_w.append((r.exp() * (r - lp)).sum(-1).mean(1))
    nll = torch.cat(nll_w).double()
    out = {"perplexity": float(nll.mean().exp()), "kl": 0.0, "cross": 0.0, "dnll_se": 0.0}
    if ref is not None:
        dn = nll - ref["nll"]
        kl = float(torch.cat(kl_w).double().mean())
        out.update(kl=kl, cross=float(dn.mean()) - kl, dnll_se=float(dn.std() / len(dn) ** 0.5))
        return out, None
    return out, {"logprobs": lps, "nll": nll}


def method_options(method: str, group: int | str) -> dict:
    """ConvertOptions fields for a method name: its recipe (`recipe_yaml`), and after an "@" the pass's
    compute dtype ("gptq@bfloat16": `convert --compute-dtype bfloat16`; none: the default)."""
    from quantkit.match.recipe import parse_recipe

    name, _, dtype = method.partition("@")
    return {"recipe": parse_recipe(recipe_yaml(name, group)), **({"compute_dtype": dtype} if dtype else {})}


def run_quantkit(src, out, method, group, calib_file, num_samples, seq_len):
    from quantkit.convert import ConvertOptions, convert

    _, m = measure_fn(convert, src, out, ConvertOptions(overwrite=True, dataset=str(calib_file), num_samples=num_samples,
                                                        seq_len=seq_len, **method_options(method, group)))
    return m["wall_s"]


# every peer script's last line: its time since t0 and its own peak RSS (VmHWM; see peak_rss_mib), as JSON
_REPORT = textwrap.dedent("""
    hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_mib": hwm}))
""")

PEER = textwrap.dedent("""
    import json, sys, time, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    src, out, calib, group, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    all_experts = sys.argv[6] == "all"
    rows = [json.loads(l) for l in open(calib)]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                            "attention_mask": [[1] * len(r["input_ids"]) for r in rows]})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": group}, "targets": ["Linear"]}
    mod = GPTQModifier(config_groups={"group_0": scheme},
                       ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"], dampening_frac=0.01,
                       actorder="static", block_size=128)
    oneshot(model=model, dataset=ds, recipe=[mod], max_seq_length=seq_len, num_calibration_samples=len(rows),
            moe_calibrate_all_experts=all_experts)
    model.save_pretrained(out, save_compressed=True)
""") + _REPORT

# auto-round's default INT4 recipe (W4A16 symmetric, SignRound with its default 200 iterations and learning
# rate), its group size set to the row's, on the same targets (the routed experts: attention and the router
# kept) and the same calibration token ids, exported by auto-round in the compressed-tensors format
PEER_AUTOROUND = textwrap.dedent("""
    import json, sys, time, torch
    from transformers import AutoModelForCausalLM
    from auto_round import AutoRound
    src, out, calib, group, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    sym = sys.argv[6:] != ["asym"]
    data = [torch.tensor([json.loads(l)["input_ids"][:seq_len]]) for l in open(calib)]

    class ByteIds:  # the fixture is byte-level and ships no tokenizer: the calibration data are ids already
        pad_token_id = None
        def save_pretrained(self, *a, **k):
            return ()

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ar = AutoRound(model, tokenizer=ByteIds(), scheme="W4A16", group_size=group, sym=sym, dataset=data,
                   nsamples=len(data), seqlen=seq_len, device_map="cpu",
                   layer_config={"self_attn": {"bits": 16}, "lm_head": {"bits": 16}})
    import pathlib, shutil
    if sym:
        ar.quantize_and_save(out, format="llm_compressor")
        # it writes into a subfolder named after the scheme (out/model-w4g128/)
        made = next(p.parent for p in pathlib.Path(out).rglob("config.json"))
        if made != pathlib.Path(out):
            for f in made.iterdir():
                shutil.move(str(f), out)
            made.rmdir()
    else:
        # auto-round 0.15.1's compressed-tensors export stops on asymmetric zero points ("Tensor must be
        # quantized to torch.int8 before packing"), so its result is written as it stands after quantize():
        # each module's codes q = round(w / scale) (its weight is q * scale in bf16) against its own fp16
        # scales, with the unsigned code q + zp checked to lie in [0, 15]; the source's shards are copied
        # with those weights, dequantized in float32, in place of the routed experts'
        from safetensors.torch import load_file, save_file
        qmodel, _ = ar.quantize()
        deq = {}
        for name, mod in qmodel.named_modules():
            if hasattr(mod, "scale") and hasattr(mod, "zp"):
                w, sc = mod.weight.detach().float(), mod.scale.detach().float()
                n_, k_ = w.shape
                q = (w.view(n_, sc.shape[1], -1) / sc[..., None]).round()
                u = q + mod.zp.detach().float().reshape(n_, -1)[..., None]
                assert bool(((u >= 0) & (u <= 15)).all()), name
                deq[name + ".weight"] = (q * sc[..., None]).reshape(n_, k_)
        assert deq, "no quantized module"
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        for f in pathlib.Path(src).iterdir():
            if f.suffix == ".safetensors":
                t = load_file(str(f))
                t.update({k: v for k, v in deq.items() if k in t})
                save_file(t, str(pathlib.Path(out) / f.name), metadata={"format": "pt"})
            else:
                shutil.copy(f, out)
        print(f"{len(deq)} modules dequantized", file=sys.stderr)
""") + _REPORT

# llm-compressor's NVFP4 weights-only preset (its NVFP4 examples' QuantizationModifier: min-max scales,
# one global scale per matrix, fused gate/up global scales made equal), on the same targets
PEER_NVFP4 = textwrap.dedent("""
    import json, sys, time, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    src, out, calib, seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rows = [json.loads(l) for l in open(calib)]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                            "attention_mask": [[1] * len(r["input_ids"]) for r in rows]})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    mod = QuantizationModifier(targets="Linear", scheme="NVFP4A16",
                               ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"])
    oneshot(model=model, dataset=ds, recipe=[mod], max_seq_length=seq_len, num_calibration_samples=len(rows))
    model.save_pretrained(out, save_compressed=True)
""") + _REPORT

# the peers beside each INT4 group: (tool, method label, script, extra argument)
PEERS = {"llmc": ("llm-compressor", "gptq", PEER, "all"),  # its default: every expert sees every token
         "llmc-routed": ("llm-compressor", "gptq-routed", PEER, "routed"),
         "autoround": ("auto-round", "autoround", PEER_AUTOROUND, None),
         "autoround-asym": ("auto-round", "autoround-asym", PEER_AUTOROUND, "asym")}  # its recipe, sym=False


def run_child(cmd: list[str]) -> dict | None:
    """Run one quantization in its own process: its JSON line (seconds, peak_rss_mib: the process's VmHWM)
    plus the process's wall time, or None (its stderr printed) when it failed."""
    r = measure_cmd(cmd, cwd=REPO)
    if r["rc"] != 0:
        print(f"{' '.join(cmd[:4])} failed:\n" + r["stderr"][-3000:], file=sys.stderr)
        return None
    return {**last_json(r["stdout"].strip().splitlines()[-1]), "process_seconds": round(r["wall_s"], 2)}


def child_quantkit(argv: list[str]) -> None:
    """`python -m bench.quality --child METHOD GROUP SRC OUT CALIB N SEQ`: one quantkit convert, timed in its own
    process."""
    method, group, src, out, calib, n, seq = argv
    secs = run_quantkit(Path(src), Path(out), method, group if group in FP4_SCHEMES else int(group), calib,
                        int(n), int(seq))
    print(json.dumps({"seconds": secs, "peak_rss_mib": peak_rss_mib()}))


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started (VmHWM: ru_maxrss would also count the forked
    parent's pages, i.e. the bench's own)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


FIXTURES = {"default": FixtureSpec(), "skewed": SKEWED, "skewed128": SKEWED128, "normtopk": NORMTOPK, "tiny": TINY}


def run_fixture(name: str, a, work: Path) -> dict:
    """Every row (quantkit's methods and the peers) on one fixture, and its summary."""
    spec = FIXTURES[name]
    if a.fixture_steps is not None:
        spec = replace(spec, steps=a.fixture_steps)
    fx = get_fixture(spec)
    src = Path(fx["model_dir"])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    eval_ids = heldout_windows(held, a.seq_len, a.eval_windows, seed=1)
    # --calib-extra: the file holds more windows than the samples; convert then draws its num_samples (and
    # a balance_tokens pool) from them, so every quantkit row of the run shares those samples
    calib_ids = windows(train, a.seq_len, a.num_samples + a.calib_extra, seed=a.calib_seed)
    work = work / name
    work.mkdir(parents=True)
    calib_file = work / "calib.jsonl"
    id_rows(calib_file, calib_ids)

    rows = []
    base, ref_lp = evaluate(src, eval_ids)
    rows.append({"method": "bf16", "group": None, **base, "seconds": None})
    print(f"[{name}] bf16: ppl {base['perplexity']:.4f}", flush=True)

    def add(tool, method, group, out, timing):
        if timing is None:
            return
        m, _ = evaluate(out, eval_ids, ref_lp, src)
        rows.append({"tool": tool, "method": method, "group": group, **m, "seconds": round(timing["seconds"], 2),
                     "process_seconds": timing["process_seconds"],
                     "peak_rss_mib": round(timing["peak_rss_mib"], 1)})
        print(f"[{name}] {tool} {method} g{group}: ppl {m['perplexity']:.4f} kl {m['kl']:.3e} cross "
              f"{m['cross']:+.3e} ({timing['seconds']:.1f}s, {timing['peak_rss_mib']:.0f} MiB)", flush=True)

    for group in list(a.groups) + list(a.fp4):
        for method in (a.methods if group not in FP4_SCHEMES else [m for m in a.methods if m != "awq"]):
            out = work / f"{method}-g{group}"
            add("quantkit", method, group, out, run_child(
                [sys.executable, "-m", "bench.quality", "--child", method, str(group), str(src), str(out), str(calib_file),
                 str(a.num_samples), str(a.seq_len)]))
        if not a.peer_python:
            continue
        if group == "nvfp4":
            script = work / "peer_nvfp4.py"
            script.write_text(PEER_NVFP4)
            out = work / "llmc-nvfp4"
            add("llm-compressor", "rtn", group, out,
                run_child([a.peer_python, str(script), str(src), str(out), str(calib_file), str(a.seq_len)]))
        if group in FP4_SCHEMES:
            continue
        for peer in a.peers:
            tool, label, code, extra = PEERS[peer]
            script = work / f"peer_{peer.replace('-', '_')}.py"
            script.write_text(code)
            out = work / f"{peer}-g{group}"
            add(tool, label, group, out, run_child([a.peer_python, str(script), str(src), str(out), str(calib_file),
                                                     str(group), str(a.seq_len), *([extra] if extra else [])]))

    summary = {}
    for group in list(a.groups) + list(a.fp4):
        here = [r for r in rows if r["group"] == group]
        by = {(r["tool"], r["method"]): r for r in here}
        s = {}
        rtn_r = by.get(("quantkit", "rtn"))
        for r in here:
            if r["tool"] == "quantkit" and rtn_r and r is not rtn_r and rtn_r["kl"]:
                s[f"{r['method']}_kl_vs_rtn"] = r["kl"] / rtn_r["kl"]
        ours = [r for r in here if r["tool"] == "quantkit"]
        peers = [r for r in here if r["tool"] != "quantkit"]
        if ours and peers:
            best, peer = min(ours, key=lambda r: r["kl"]), min(peers, key=lambda r: r["kl"])
            s.update(best=best["method"], best_peer=f"{peer['tool']} {peer['method']}",
                     best_kl_vs_best_peer=best["kl"] / peer["kl"] if peer["kl"] else None,
                     best_ppl_vs_best_peer=best["perplexity"] / peer["perplexity"])
            # the target: quantkit's best recipe's KL <= 0.8x the best peer's
            s["target_met"] = s["best_kl_vs_best_peer"] is not None and s["best_kl_vs_best_peer"] <= 0.8
        summary[str(group)] = s
    return {"fixture": {k: v for k, v in fx.items() if k not in ("model_dir", "train_tokens", "heldout_tokens")},
            "rows": rows, "summary": summary}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_quantkit(argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", nargs="+", default=["default"], choices=sorted(FIXTURES),
                    help="default: bench/fixture.py's 8-expert top-2 model; skewed: its 32-expert top-4 one "
                         "(expert width 64: no g128); skewed128: the same with expert width 128")
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"],
                    help="rtn, gptq or awq, with modifiers: -mse (RTN: scale_search mse; GPTQ: observer mse), "
                         "-aff / -affN (GPTQ: stats affinity, over every expert / the router's top N), "
                         "-refit (GPTQ, INT4: refit_scales), -cdN (GPTQ, INT4: refine_sweeps N); "
                         "@bfloat16 after any: convert --compute-dtype bfloat16")
    ap.add_argument("--fixture-steps", type=int, default=None,
                    help="train the fixture for this many steps instead of FixtureSpec's (a cheaper, less trained model)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-seed", type=int, default=2, help="seed of the calibration windows")
    ap.add_argument("--calib-extra", type=int, default=0,
                    help="windows in the calibration file besides --num-samples (a balance_tokens pool's source; "
                         "quantkit then draws its samples from all of them; not with peers)")
    ap.add_argument("--eval-windows", type=int, default=2048,
                    help="non-overlapping held-out windows to evaluate on (0: the whole held-out split)")
    ap.add_argument("--peer-python", default=None, help="python of a venv with llmcompressor (and auto-round)")
    ap.add_argument("--peers", nargs="+", default=["llmc"], choices=sorted(PEERS),
                    help="with --peer-python: llmc (llm-compressor GPTQ, its default moe_calibrate_all_experts), "
                         "llmc-routed (the same, routed tokens only), autoround (auto-round's W4A16 SignRound)")
    ap.add_argument("--fp4", nargs="*", default=[], choices=["nvfp4", "mxfp4"],
                    help="also these FP4 formats (RTN and GPTQ), beside the INT4 groups; with --peer-python, "
                         "llm-compressor's NVFP4 too")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.fixtures, a.groups, a.methods, a.num_samples, a.eval_windows, a.fp4 = ["tiny"], [32], ["rtn"], 4, 8, []
    run = Run("quality", a, argv)
    if a.calib_extra and a.peer_python:
        ap.error("--calib-extra gives quantkit a larger file to draw from: the peers would read all of it")

    work = scratch_dir("qk-quality-")
    per = {name: run_fixture(name, a, work) for name in a.fixtures}
    rows = [{"fixture": name, "tool": "-", **r} if "tool" not in r else {"fixture": name, **r}
            for name, res in per.items() for r in res["rows"]]
    run.write(rows, {name: {"fixture": res["fixture"], "summary": res["summary"]} for name, res in per.items()})
    print("\n| fixture | tool | method | group | perplexity | KL(bf16 \\|\\| q) | cross | dNLL s.e. | seconds "
          "| peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fixture']} | {r['tool']} | {r['method']} | {r['group'] or '-'} | {r['perplexity']:.4f} | "
              f"{r['kl']:.3e} | {r['cross']:+.2e} | {r['dnll_se']:.1e} | "
              f"{r['seconds'] if r['seconds'] is not None else '-'} | {r.get('peak_rss_mib', '-')} |")
    print(json.dumps({name: res["summary"] for name, res in per.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
