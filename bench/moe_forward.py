"""Time one routed-experts forward on CPU: transformers' eager loop, its batched_mm and grouped_mm options,
a padded-bmm variant, and quantkit.calib.moe.batched_experts_forward, side by side in one run.

    python -m bench moe_forward                      # E 32/64/128, T 4096/8192, 1 and 2 threads
    python -m bench moe_forward --experts 32 --tokens 1024 --threads 1 --repeats 2  # quick look
    python -m bench moe_forward --smoke              # E 8, T 64, 1 thread, 1 repeat

The layer: transformers' own Qwen3MoeExperts (fused gate_up_proj [E, 2I, H], down_proj [E, H, I], SiLU)
and Qwen3MoeTopKRouter built from a qwen3_moe config, hidden 512, expert intermediate 256, top-8, weights
drawn N(0, 0.02), float32 (`--dtype bfloat16` also works). The router runs once per shape on N(0, 1)
tokens; every variant then gets the same (hidden, top_k_index, top_k_weights). transformers' variants run
through the module's own dispatch (`config._experts_implementation`).

Per row: the fastest wall time of `--repeats` calls (variants interleaved, after one warm-up call each),
the CPU time of that call (all threads), the speed-up against eager (by fastest wall time, and by fastest
CPU time), the peak RSS above the RSS before the call (VmHWM reset through /proc/self/clear_refs; the heap
bounded as the executor bounds it, so freed temporaries leave the RSS; the output included), and the
largest |difference| from eager relative to max |eager|. `--default-heap` keeps glibc's defaults instead
(faster for eager, whose per-expert buffers then come from a reused heap; peaks then undercount).
`other` is the CPU (in cores) other processes used while the row's calls ran: on a shared machine it
inflates wall times, which is why the CPU column is there.

batched_mm gathers one weight matrix per routed pair (T*k*(2I*H + H*I) values: 48 GiB at 4096 tokens);
it runs only where that fits in `--max-gather-gib` and is listed as skipped otherwise.
"""

from __future__ import annotations

import argparse

import torch

from bench.harness import Run, add_common_args, measure_fn
from quantkit.calib import moe
from quantkit.calib.weights import bound_heap

GiB = 1 << 30


# ---- the padded-bmm variant (kept here for comparison; slower than the segment-wise forward) -----------
def padded_bmm_forward(experts, hidden, idx, weights, budget=moe.DEFAULT_BUDGET):
    """The same computation with the tokens of several experts zero-padded to [e, t, H] blocks and one
    torch.bmm per projection; blocks bounded by `budget` bytes of padded temporaries."""
    gu_w, dn_w = experts.gate_up_proj, experts.down_proj
    e_all, p, h = gu_w.shape
    r = moe.route(idx, weights, e_all)
    out = torch.zeros_like(hidden)
    row = hidden.element_size() * (h + 2 * p + h)  # padded xs, gate/up (+ act), down out
    segs = list(r.segments())
    i = 0
    while i < len(segs):
        j, longest = i + 1, segs[i][2] - segs[i][1]
        while j < len(segs) and (j - i + 1) * max(longest, segs[j][2] - segs[j][1]) * row <= budget:
            longest, j = max(longest, segs[j][2] - segs[j][1]), j + 1
        chunk = segs[i:j]
        ids = torch.tensor([e for e, _, _ in chunk])
        a, b = chunk[0][1], chunk[-1][2]
        local = torch.repeat_interleave(torch.arange(len(chunk)), torch.tensor([t - s for _, s, t in chunk]))
        pos = torch.arange(a, b) - torch.tensor([s for _, s, _ in chunk])[local]
        xs = hidden.new_zeros(len(chunk), longest, h)
        xs[local, pos] = hidden.index_select(0, r.token[a:b])
        g, u = torch.bmm(xs, gu_w.index_select(0, ids).transpose(1, 2)).chunk(2, dim=-1)
        act = experts.act_fn(g) * u
        y = torch.bmm(act, dn_w.index_select(0, ids).transpose(1, 2))[local, pos]
        y = y * r.weight[a:b, None]
        out.index_add_(0, r.token[a:b], y.to(out.dtype))
        i = j
    return out


# ---- the run ----------------------------------------------------------------------------------------------
def build(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

    from quantkit.testing import quiet_transformers, tiny_config

    quiet_transformers()
    cfg = tiny_config("qwen3_moe", layers=1, hidden=hidden, experts=num_experts, moe_intermediate=inter,
                      num_experts_per_tok=top_k)
    cfg._experts_implementation = "eager"
    experts, router = Qwen3MoeExperts(cfg), Qwen3MoeTopKRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in (experts, router):
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return cfg, experts.to(dtype).eval(), router.to(dtype).eval()


def variants(cfg, experts, budget):
    def via_config(name):
        def run(x, idx, w):
            cfg._experts_implementation = name
            try:
                return experts(x, idx, w)
            finally:
                cfg._experts_implementation = "eager"
        return run

    return {
        "eager": via_config("eager"),
        "batched_mm": via_config("batched_mm"),
        "grouped_mm": via_config("grouped_mm"),
        "padded_bmm": lambda x, idx, w: padded_bmm_forward(experts, x, idx, w, budget),
        "quantkit": lambda x, idx, w: moe.batched_experts_forward(experts, x, idx, w, budget=budget),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench moe_forward", description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeat", "--repeats", dest="repeat", type=int, default=3, help="timed calls per variant")
    ap.add_argument("--budget-mib", type=int, default=moe.DEFAULT_BUDGET >> 20)
    ap.add_argument("--max-gather-gib", type=float, default=4.0,
                    help="skip batched_mm where its gathered weights would exceed this")
    ap.add_argument("--only", nargs="+", help="variants to run (default: all)")
    ap.add_argument("--default-heap", action="store_true",
                    help="keep glibc's malloc settings (the executor's bound_heap() is applied otherwise)")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.experts, args.tokens, args.threads, args.repeat = [8], [64], [1], 1
    bench_run = Run("moe_forward", args, argv)

    if not args.default_heap:
        bound_heap()  # as the executor does: >= 1 MiB allocations via mmap, so freed temporaries leave the RSS
    dtype = getattr(torch, args.dtype)
    budget = args.budget_mib << 20
    import transformers

    machine = {"transformers": transformers.__version__}
    print(f"# {machine}  dtype={args.dtype} H={args.hidden} I={args.intermediate} top-{args.top_k} "
          f"budget={args.budget_mib} MiB repeats={args.repeat} heap={'glibc' if args.default_heap else 'bounded'}",
          flush=True)
    head = (f"{'E':>4} {'tokens':>6} {'thr':>3}  {'variant':<11} {'wall ms':>9} {'cpu ms':>9} {'vs eager':>8} "
            f"{'cpu vs':>6} {'peak MiB':>9} {'max|d|/max':>10} {'other':>5}")
    print(head)
    print("-" * len(head), flush=True)
    rows = []
    for num_experts in args.experts:
        cfg, experts, router = build(num_experts, args.hidden, args.intermediate, args.top_k, dtype)
        names = variants(cfg, experts, budget)
        if args.only:
            names = {k: v for k, v in names.items() if k in args.only or k == "eager"}
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
            with torch.no_grad():
                _, w, idx = router(x)
            gather = tokens * args.top_k * (2 * args.intermediate * args.hidden + args.hidden * args.intermediate)
            gather *= experts.gate_up_proj.element_size()
            for threads in args.threads:
                torch.set_num_threads(threads)
                run = {k: v for k, v in names.items() if not (k == "batched_mm" and gather > args.max_gather_gib * GiB)}
                stats = {k: dict(wall=[], cpu=[], other=0.0, span=0.0) for k in run}
                peaks, outs = {}, {}
                with torch.no_grad():
                    for k, fn in run.items():  # warm-up call: peak RSS and the output
                        outs[k], m = measure_fn(fn, x, idx, w)
                        peaks[k] = m["rss_added_bytes"]
                    ref = outs["eager"].float()
                    diffs = {k: float((o.float() - ref).abs().max() / ref.abs().max()) for k, o in outs.items()}
                    del outs
                    for _ in range(args.repeat):
                        for k, fn in run.items():
                            _, m = measure_fn(fn, x, idx, w)
                            s = stats[k]
                            s["wall"].append(m["wall_s"])
                            s["cpu"].append(m["cpu_s"])
                            s["other"] += m["other_cpu_s"]
                            s["span"] += m["wall_s"]
                eager_wall, eager_cpu = min(stats["eager"]["wall"]), min(stats["eager"]["cpu"])
                for k in names:  # noqa: PLR1702
                    if k not in run:
                        print(f"{num_experts:>4} {tokens:>6} {threads:>3}  {k:<11} skipped: gathers "
                              f"{gather / GiB:.1f} GiB of weights", flush=True)
                        rows.append(dict(experts=num_experts, tokens=tokens, threads=threads, variant=k,
                                         skipped=f"gathers {gather / GiB:.1f} GiB of weights"))
                        continue
                    s = stats[k]
                    i = min(range(len(s["wall"])), key=s["wall"].__getitem__)
                    wall, cpu = s["wall"][i], s["cpu"][i]
                    other = s["other"] / max(s["span"], 1e-9)
                    peak = peaks[k]
                    mib = "-" if peak is None else f"{peak / 2**20:.0f}"
                    print(f"{num_experts:>4} {tokens:>6} {threads:>3}  {k:<11} {wall * 1e3:>9.1f} {cpu * 1e3:>9.1f} "
                          f"{eager_wall / wall:>7.2f}x {eager_cpu / min(s['cpu']):>5.2f}x {mib:>9} "
                          f"{diffs[k]:>10.1e} {other:>5.1f}", flush=True)
                    rows.append(dict(experts=num_experts, tokens=tokens, threads=threads, variant=k,
                                     wall_ms=round(wall * 1e3, 2), cpu_ms=round(cpu * 1e3, 2),
                                     speedup_vs_eager=round(eager_wall / wall, 3),
                                     cpu_speedup_vs_eager=round(eager_cpu / min(s["cpu"]), 3), peak_rss_bytes=peak,
                                     max_rel_diff_vs_eager=diffs[k], other_cores=round(other, 2)))
    bench_run.write(rows, {"transformers": machine["transformers"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
