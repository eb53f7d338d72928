"""Real dimensions: one MoE layer of Kimi K2 or GLM-5 at its true widths, converted with RTN and GPTQ, against
`plan --calibration`'s prediction, the machine's own GEMM rate at the same shapes, and RTN's per-expert error.

    python -m bench real_shape [--model kimi-k2|glm-5] [--experts 16] [--num-samples 8] [--seq-len 512]
    python -m bench real_shape --smoke      # the same steps at toy widths (seconds; the figures mean nothing)

Results: bench/results/real_shape.json (Kimi K2), real_shape-glm-5.json (GLM-5).

The layer: the shipped reference config (quantkit/data/configs/) with one decoder layer, MoE from layer 0, its
true hidden size, expert width, attention (MLA ranks, heads, rope dims; GLM-5's DSA indexer) and top-8 routing,
but `--experts` routed experts instead of 384 / 256 (one expert is 88 MB / 75 MB in BF16: 16 experts and the
attention make a 1.9 GB checkpoint; the full layer would be 34 / 19 GB, more than this machine's disk budget
for a bench), a 4096-token vocabulary (the embedding and lm_head are not the layer) and no MTP layer. Weights
like a trained model's, not plain Gaussian: each entry Gaussian times exp(0.5 N(0,1)) (heavy tails, kurtosis
~8), rows and columns scaled by exp(0.25 N(0,1)), 1 in 128 input columns x6 (outlier channels), std 1/sqrt(in).

Tokens per expert: with top-8 of 16 experts each expert sees half of the tokens; `--num-samples 8 --seq-len 512`
(4096 tokens) gives ~2,000 per expert, the order a real 384-expert layer gets from 128 x 2048 calibration
tokens (~5,500 at top-8 / 384). Steps, each as a user runs it:

1. `plan --calibration N,T --gpus 1 --device cpu` (the shipped CPU rates): predicted wall time per phase and
   host RAM, before anything runs;
2. `quantkit convert` with int4-experts-rtn and int4-experts-gptq in a process of its own: wall time, peak RSS
   (polled), the timeline's phases (setup, load, forward, statistics = the Hessians, solve, write);
3. the roof: torch.mm in float32 into a preallocated output, timed alone at each product's shape as the pass
   runs it: the `grams` phase (the Hessians, timed apart from the statistics forward that calls them) does, per
   expert and forward call of t rows (t = the mean over the pass's batch plan), X^T X ([H, t] x [t, H]), the
   down inputs ([t, H] x [H, 2I]) and their Gram ([I, t] x [t, I]), and x x^T of every token; its roof is those
   shapes' rates weighted by their FLOPs. The solve's roof: a rank-128 update ([P, 128] x [128, H]). Each
   phase's FLOPs (solve: per Linear [rows, cols] cols^3 + rows cols^2, the factorization and the column sweep's
   updates) over its measured seconds, as a fraction of its roof; beside it the Gram's rate at all of an
   expert's tokens in one product (`grams_roof_all_tokens_gflops`: what accumulating larger blocks would reach);
4. the layer's own float output per expert: the routed tokens' expert inputs (the source model run in
   transformers, routing recomputed from the router), ||f(X) - f_q(X)|| / ||f(X)|| for RTN's and GPTQ's decoded
   weights, and any NaN / Inf; on held-out windows (`rtn_rel_err`, `gptq_rel_err`: other windows of the same
   text) and on the calibration tokens themselves (`*_calib`). An expert's Hessian has rank at most its tokens
   (~2,000 here, ~5,500 in a real 384-expert layer) against 7168 inputs: on its own calibration tokens GPTQ's
   error is far below what it does on new ones.

Predictions: with the shipped CPU table (`predicted_s`, an Intel Xeon's rates) and with this machine's rates
measured first (`predicted_here_s`, `plan --calibration --measure`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Run, add_common_args, last_json, measure_cmd, mib

MODELS = {"kimi-k2": "deepseek_v3", "glm-5": "glm_moe_dsa"}
KEEP = ("hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
        "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim", "num_experts_per_tok",
        "n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring_func",
        "topk_method", "rms_norm_eps", "rope_theta", "index_n_heads", "index_head_dim", "index_topk",
        "intermediate_size", "hidden_act")
SMOKE = dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             intermediate_size=512, index_n_heads=2, index_head_dim=32, index_topk=16)
VOCAB = 4096


def layer_config(name: str, experts: int, smoke: bool):
    from quantkit.plan.source import reference_config
    from quantkit.tiny import tiny_config

    ref = reference_config(name)
    kw = {k: ref[k] for k in KEEP if k in ref}
    kw.update(SMOKE if smoke else {})
    kw.update(first_k_dense_replace=0, num_nextn_predict_layers=0, max_position_embeddings=4096)
    arch = MODELS[name]
    return tiny_config(arch, layers=1, hidden=kw.pop("hidden_size"), experts=experts,
                       moe_intermediate=kw.pop("moe_intermediate_size"), vocab=VOCAB, **kw)


def synth_weights(model, seed: int = 0) -> None:
    """Every matrix of `model` redrawn in place like a trained model's (module docstring); norms ones, biases 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
                continue
            for w in (p if p.ndim == 3 else p[None]):  # fused experts [E, out, in]: one matrix at a time
                out, inp = w.shape
                x = torch.randn(out, inp, generator=g) * torch.exp(0.5 * torch.randn(out, inp, generator=g))
                x *= torch.exp(0.25 * torch.randn(out, 1, generator=g))
                col = torch.exp(0.25 * torch.randn(inp, generator=g))
                col[torch.randperm(inp, generator=g)[: max(1, inp // 128)]] *= 6
                x *= col
                x *= 1.0 / (math.sqrt(inp) * float(x.std()))
                w.copy_(x.to(w.dtype))


def make_layer(name: str, experts: int, smoke: bool, dst: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = layer_config(name, experts, smoke)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    synth_weights(model)
    model.save_pretrained(dst, max_shard_size="2GB")
    del model
    return dst


def gemm_rate(m: int, k: int, n: int, repeat: int = 3) -> float:
    """float32 FLOP/s of torch.mm [m, k] x [k, n] into a preallocated output (as the pass writes its products) on
    this machine, best of `repeat`."""
    import torch

    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2.0 * m * k * n / best


def call_rows(src: Path, lengths: list[int], top, experts: int) -> tuple[int, int]:
    """(the mean rows an expert gets in one forward call of the calibrated pass, the mean tokens of a call), from
    its batch plan at the executor's batch size: the inner dimensions of the pass's expert Grams and gate/up
    products, and of its all-token x x^T."""
    from quantkit.calib.activations import batch_plan
    from quantkit.calib.executor import LayerExecutor
    from quantkit.calib.spool import pass_batch_tokens

    plan = batch_plan(lengths, pass_batch_tokens(LayerExecutor(src).batch_tokens, lengths))
    per = top.view(len(lengths), -1, top.shape[-1])
    counts = [int((per[b] == e).any(-1).sum()) for b in plan for e in range(experts)]
    seen = [c for c in counts if c]
    call_tokens = sum(lengths[j] for b in plan for j in b) / max(1, len(plan))
    return max(1, round(sum(seen) / max(1, len(seen)))), max(1, round(call_tokens))


def routed_inputs(src: Path, ids) -> tuple[object, object, dict]:
    """(the MoE block's input [T, H] float32, each token's top-k experts [T, k], the config) from the source model
    run in transformers; the routing recomputed from the router's weights and correction bias (sigmoid, top-k:
    n_group 1 as both configs have)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    layer = m.model.layers[0]
    got = []
    layer.post_attention_layernorm.register_forward_hook(lambda _m, _i, out: got.append(out.detach()))
    with torch.no_grad():
        for row in ids:
            m(input_ids=row[None])
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in got])
    gate = layer.mlp.gate
    scores = torch.sigmoid(x @ gate.weight.float().T)
    bias = getattr(gate, "e_score_correction_bias", None)
    sel = scores + (bias.float() if bias is not None else 0)
    top = sel.topk(m.config.num_experts_per_tok, dim=-1).indices
    cfg = m.config
    del m
    return x, top, cfg


def expert_errors(src: Path, outs: dict[str, Path], x, top, experts: int) -> list[dict]:
    """Per routed expert: its tokens, and for each output the relative error of the expert's output on them."""
    import torch
    import torch.nn.functional as F

    from quantkit.read.checkpoint import Checkpoint
    from quantkit.read.sources import detect_format, scan
    from quantkit.read.tensors import TensorReader

    ck = Checkpoint.open(src)
    readers = {}
    for k, p in outs.items():
        q = Checkpoint.open(p)
        readers[k] = (TensorReader.of(q), scan(q, detect_format(q.config)))
    rows = []
    try:
        with TensorReader.of(ck) as rs:
            for e in range(experts):
                mask = (top == e).any(-1)
                xe = x[mask]
                base = f"model.layers.0.mlp.experts.{e}."
                w = {p: rs.get(base + p + ".weight").float() for p in ("gate_proj", "up_proj", "down_proj")}

                def f(w):
                    return (F.silu(xe @ w["gate_proj"].T) * (xe @ w["up_proj"].T)) @ w["down_proj"].T

                ref = f(w)
                row = {"expert": e, "tokens": int(mask.sum())}
                for k, (r, stored) in readers.items():
                    wq = {p: r.decode(stored[base + p], torch.float32) for p in w}
                    y = f(wq)
                    row[f"{k}_finite"] = bool(torch.isfinite(y).all())
                    row[f"{k}_rel_err"] = float((y - ref).norm() / ref.norm()) if len(xe) else None
                rows.append(row)
    finally:
        for r, _ in readers.values():
            r.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench real_shape", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="kimi-k2")
    ap.add_argument("--experts", type=int, default=16, help="routed experts in the layer (the real: 384 / 256)")
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", default=None, help="keep the checkpoints here (default: a temporary directory)")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.experts, a.num_samples, a.seq_len = 8, 2, 64
    run = Run("real_shape", a, argv)

    import torch

    from quantkit.calib.data import load_calibration_data
    from quantkit.plan.calibration import CostOptions, calibration_cost

    tmp = tempfile.TemporaryDirectory(prefix="qk-bench-real-") if a.work is None else None
    work = Path(a.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    src = make_layer(a.model, a.experts, a.smoke, work / "src")
    cfg = json.loads((src / "config.json").read_text())
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"{a.model} layer: hidden {cfg['hidden_size']}, experts {a.experts} x {cfg['moe_intermediate_size']}, "
          f"{size / 2**30:.2f} GiB, made in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    # this machine's rates (plan --measure: measured on plan's own small shapes), beside the shipped table's
    from quantkit.plan.measure import measure_throughput

    here = measure_throughput("cpu", config=cfg, log=lambda m: print(f"  {m}", file=sys.stderr))
    rows, outs = [], {}
    for recipe in ("int4-experts-rtn", "int4-experts-gptq"):
        pred = calibration_cost(str(src), recipe, a.num_samples, a.seq_len, CostOptions(device="cpu"))
        pred_here = calibration_cost(str(src), recipe, a.num_samples, a.seq_len,
                                     CostOptions(device="cpu", throughput=here))
        out = work / recipe
        r = measure_cmd([sys.executable, "-m", "quantkit", "convert", str(src), str(out), "-r", recipe,
                         "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--overwrite",
                         "--device", "cpu", "--json"], check=True)
        doc = last_json(r["stdout"])
        tl = doc["timeline"]["ranks"][0]
        predicted_s = pred.total_seconds + pred.convert_output_seconds
        here_s = pred_here.total_seconds + pred_here.convert_output_seconds
        calibrated = bool(pred.seconds)  # plan --calibration covers calibrated passes; RTN has none
        row = {"recipe": recipe, "wall_s": round(doc["seconds"], 1),
               "predicted_s": round(predicted_s, 1) if calibrated else None,
               "time_error": round(predicted_s / doc["seconds"] - 1, 3) if calibrated else None,
               "predicted_here_s": round(here_s, 1) if calibrated else None,
               "time_error_here": round(here_s / doc["seconds"] - 1, 3) if calibrated else None,
               "peak_rss_mib": mib(r["peak_rss_bytes"]), "predicted_ram_mib": mib(pred.host_ram_bytes or None),
               "ram_error": round(pred.host_ram_bytes / r["peak_rss_bytes"] - 1, 3) if pred.host_ram_bytes else None,
               "cpu_s": round(r["cpu_s"], 1), "phases": {k: round(v, 2) for k, v in tl["phases"].items()},
               "predicted_phases": {k: round(v, 2) for k, v in pred.seconds.items()},
               "predicted_phases_here": {k: round(v, 2) for k, v in pred_here.seconds.items()}}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        outs[recipe.split("-")[-1]] = out

    # the roof at the phases' shapes, and their FLOPs
    data = load_calibration_data(None, vocab_size=VOCAB, num_samples=a.num_samples, seq_len=a.seq_len)
    ids = torch.stack([s[: a.seq_len] for s in data.samples[: data.num_samples]])
    x, top, hf_cfg = routed_inputs(src, ids)
    # held out: other windows of the same text (another seed), none of them a calibration sample
    held = load_calibration_data(None, vocab_size=VOCAB, num_samples=a.num_samples, seq_len=a.seq_len, seed=12345)
    hids = torch.stack([s[: a.seq_len] for s in held.samples[: held.num_samples]])
    overlap = {tuple(r.tolist()) for r in ids} & {tuple(r.tolist()) for r in hids}
    hx, htop, _ = routed_inputs(src, hids)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    te = [int((top == e).any(-1).sum()) for e in range(a.experts)]
    te_mean = max(1, round(sum(te) / len(te)))
    tc, tcall = call_rows(src, [a.seq_len] * a.num_samples, top, a.experts)
    # the grams phase (the Hessians apart from the forward): per expert and call X^T X [H, t] x [t, H], the down
    # inputs X [gate; up]^T [t, H] x [H, 2I] and their Gram [I, t] x [t, I]; x x^T of every token
    tokens = a.num_samples * a.seq_len
    parts = [(sum(2.0 * t * h * h for t in te), (h, tc, h)), (sum(4.0 * t * h * i for t in te), (tc, h, 2 * i)),
             (sum(2.0 * t * i * i for t in te), (i, tc, i)), (2.0 * tokens * h * h, (h, tcall, h))]
    grams_flops = sum(f for f, _ in parts)
    roof_grams = grams_flops / sum(f / gemm_rate(*shape) for f, shape in parts)  # each part at its own shape
    linears = [(2 * i, h), (h, i)]  # gate+up read the hidden state, down the expert width
    solve_flops = a.experts * sum(c ** 3 + r_ * c * c for r_, c in linears)
    roof_solve = gemm_rate(2 * i, 128, h)
    gptq = rows[1]
    ph = gptq["phases"]
    # the plan's forward is both forwards of the layer: the statistics forward (`statistics`, less its nested
    # grams) and the quantized layer's (`forward`); its hessians are the grams
    gptq["forwards_s"] = round(ph.get("forward", 0.0) + ph.get("statistics", 0.0), 2)
    gptq["forwards_predicted_here_s"] = gptq["predicted_phases_here"].get("forward")
    gptq["grams_s"] = ph.get("grams")
    gptq["grams_predicted_here_s"] = gptq["predicted_phases_here"].get("hessians")
    gptq["grams_call_rows"] = tc
    for row, phase, flops, roof in ((gptq, "grams", grams_flops, roof_grams),
                                    (gptq, "solve", solve_flops, roof_solve)):
        s = row["phases"].get(phase) or float("nan")
        row[f"{phase}_gflops"] = round(flops / s / 1e9, 1)
        row[f"{phase}_roof_gflops"] = round(roof / 1e9, 1)
        row[f"{phase}_of_roof"] = round(flops / s / roof, 3)
    # what larger products would reach: the Gram of all of an expert's tokens at once
    gptq["grams_roof_all_tokens_gflops"] = round(gemm_rate(h, te_mean, h) / 1e9, 1)

    errs = expert_errors(src, outs, hx, htop, a.experts)
    seen = expert_errors(src, outs, x, top, a.experts)
    ratios = [e["gptq_rel_err"] / e["rtn_rel_err"] for e in errs if e["tokens"] and e["rtn_rel_err"]]
    for e, c in zip(errs, seen):
        rows.append({"recipe": f"expert {e['expert']}", "calib_tokens": c["tokens"],
                     **{k: v for k, v in e.items() if k != "expert"},
                     "gptq_rel_err_calib": c["gptq_rel_err"], "rtn_rel_err_calib": c["rtn_rel_err"]})
    summary = {"model": a.model, "layer": {"hidden": h, "moe_intermediate": i, "experts": a.experts,
                                           "top_k": hf_cfg.num_experts_per_tok, "bytes": size},
               "tokens": a.num_samples * a.seq_len, "tokens_per_expert_mean": te_mean,
               "gptq_over_rtn_max": round(max(ratios), 3) if ratios else None,
               "gptq_over_rtn_median": round(sorted(ratios)[len(ratios) // 2], 3) if ratios else None,
               "all_finite": all(e[k] for e in errs + seen for k in e if k.endswith("_finite")),
               "heldout_windows_shared_with_calibration": len(overlap),
               "rates_here": {k: v for k, v in here.to_json().items() if k.endswith(("flops", "_per_s"))}}
    print(json.dumps(summary), file=sys.stderr)
    run.write(rows, summary, tag=None if a.model == "kimi-k2" else a.model)  # real_shape[-glm-5].json
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
