"""Time the runtime kernels on a CUDA GPU: INT4 GEMM (W4A16) vs torch bf16 matmul, fused INT4 MoE vs a
bf16 per-expert torch loop, paged decode attention with a BF16 vs FP8 KV cache, GQA and MLA, with the
KV-cache integrity check on and off; NVFP4 / MXFP4 weight-only GEMM and fused MoE (`--only fp4`).

    python -m bench kernel_timings                 # CUDA: full table (~1-2 minutes on an H100/H200)
    python -m bench kernel_timings --smoke         # CPU: tiny shapes in the Triton interpreter (crash test only)
    python -m bench kernel_timings --json out.json # also write the rows as this JSON ($OUT/kernels.json when $OUT is set)

Timings are medians of triton.testing.do_bench (CUDA events). Smoke timings are meaningless.
This measures kernels in isolation with random weights; it is not an end-to-end serving benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / quantkit.runtime are imported

from bench.harness import Run, Skip, add_common_args  # noqa: E402
from quantkit.runtime import (FP8_DTYPE, PagedKV, fused_moe_int4, int4_gemm, paged_decode_attention,  # noqa: E402
                              paged_mla_decode_attention, quantize_kv)
from quantkit.runtime.fp4 import FP4Experts, PackedFP4, fp4_gemm, fused_moe_fp4  # noqa: E402
from quantkit.runtime.synth import random_int4, random_int4_experts  # noqa: E402

ROWS: list[dict] = []


def timeit(fn, smoke: bool) -> float:
    """Median milliseconds per call."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def row(section: str, case: str, variant: str, ms: float, **extra):
    r = dict(section=section, case=case, variant=variant, ms=round(ms, 4), **extra)
    ROWS.append(r)
    more = "  ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{section:<10} {case:<34} {variant:<26} {ms * 1e3:>10.1f} us  {more}", flush=True)


def bench_gemm(dev, smoke):
    shapes = [(64, 96)] if smoke else [(7168, 2048), (2048, 7168), (4096, 5120)]
    ms_list = [1, 16] if smoke else [1, 16, 64]
    groups = [32] if smoke else [32, 128]
    for n, k in shapes:
        wb = (torch.randn(n, k, device=dev) / math.sqrt(k)).to(torch.bfloat16)
        for m in ms_list:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            t_bf16 = timeit(lambda: x @ wb.T, smoke)
            row("gemm", f"M={m} N={n} K={k}", "torch bf16", t_bf16, tbps=round(2 * n * k / t_bf16 / 1e9, 3))
            for g in groups:
                w = random_int4(n, k, g, device=dev)
                t = timeit(lambda: int4_gemm(x, w, backend="triton"), smoke)
                row("gemm", f"M={m} N={n} K={k}", f"int4 g{g} (triton)", t,
                    speedup=round(t_bf16 / t, 2), tbps=round((n * k / 2 + n * k / g * 2) / t / 1e9, 3))
                del w
        del wb


def bench_moe(dev, smoke):
    e, d, i, k = (4, 64, 32, 2) if smoke else (16, 7168, 2048, 8)  # Kimi-K2 expert shapes, 16 of 384 experts
    ex = random_int4_experts(e, d, i, 32, device=dev)
    gate_up, down = ex.gate_up.dequantize(torch.bfloat16), ex.down.dequantize(torch.bfloat16)  # [E, 2I, D], [E, D, I]
    dense = [(gate_up[j], down[j]) for j in range(e)]
    for t in ([1, 4] if smoke else [1, 16, 64]):
        x = torch.randn(t, d, device=dev).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, device=dev), -1)

        def bf16_loop():
            out = torch.zeros(t, d, device=dev, dtype=torch.float32)
            for j in torch.unique(ids).tolist():
                tok, slot = torch.nonzero(ids == j, as_tuple=True)
                gu, dn = dense[j]
                h = x[tok] @ gu.T
                a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
                out.index_add_(0, tok, (a @ dn.T).float() * w[tok, slot, None])
            return out

        t_ref = timeit(bf16_loop, smoke)
        case = f"T={t} E={e} D={d} I={i} top{k}"
        row("moe", case, "torch bf16 expert loop", t_ref)
        t_k = timeit(lambda: fused_moe_int4(x, ids, w, ex, backend="triton"), smoke)
        row("moe", case, "int4 g32 fused (triton)", t_k, speedup=round(t_ref / t_k, 2))
    del dense, gate_up, down, ex


def _random_fp4(kind, n, k, dev, experts=None) -> PackedFP4:
    """Random FP4 bytes and scales drawn on `dev` (every code occurs; ~unit-scale weights / sqrt(K))."""
    lead = () if experts is None else (experts,)
    packed = torch.randint(0, 256, (*lead, n, k // 2), device=dev, dtype=torch.uint8)
    if kind == "nvfp4":
        scale = (torch.rand(*lead, n, k // 16, device=dev) + 0.5).to(torch.float8_e4m3fn)
        gs = torch.full((*lead, 1), 3.0 * math.sqrt(k), device=dev)
        return PackedFP4(packed, scale, gs, (n, k), kind)
    scale = torch.full((*lead, n, k // 32), 127 - round(math.log2(3.0 * math.sqrt(k))), device=dev, dtype=torch.uint8)
    return PackedFP4(packed, scale, None, (n, k), kind)


def bench_fp4(dev, smoke):
    """FP4 weight-only (W4A16) GEMM vs torch bf16, then fused FP4 MoE, NVFP4 and MXFP4."""
    shapes = [(64, 128)] if smoke else [(7168, 2048), (2048, 7168), (4096, 5120)]
    for n, k in shapes:
        wb = (torch.randn(n, k, device=dev) / math.sqrt(k)).to(torch.bfloat16)
        ws = {kind: _random_fp4(kind, n, k, dev) for kind in ("nvfp4", "mxfp4")}
        for m in ([1, 16] if smoke else [1, 16, 64]):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            t_bf16 = timeit(lambda: x @ wb.T, smoke)
            row("fp4-gemm", f"M={m} N={n} K={k}", "torch bf16", t_bf16, tbps=round(2 * n * k / t_bf16 / 1e9, 3))
            for kind, w in ws.items():
                t = timeit(lambda: fp4_gemm(x, w, backend="triton"), smoke)
                g = w.group_size
                row("fp4-gemm", f"M={m} N={n} K={k}", f"{kind} (triton)", t, speedup=round(t_bf16 / t, 2),
                    tbps=round((n * k / 2 + n * k / g) / t / 1e9, 3))
        del wb, ws
    e, d, i, k = (4, 64, 32, 2) if smoke else (16, 7168, 2048, 8)
    for kind in ("nvfp4", "mxfp4"):
        ex = FP4Experts(w13=_random_fp4(kind, 2 * i, d, dev, e), w2=_random_fp4(kind, d, i, dev, e))
        for t in ([1, 4] if smoke else [1, 16, 64]):
            x = torch.randn(t, d, device=dev).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
            w = torch.softmax(torch.randn(t, k, device=dev), -1)
            row("fp4-moe", f"T={t} E={e} D={d} I={i} top{k}", f"{kind} fused (triton)",
                timeit(lambda: fused_moe_fp4(x, ids, w, ex, backend="triton"), smoke))
        del ex


def _paged(dev, b, ctx, page, hkv, d, dtype, gen):
    need = math.ceil(ctx / page)
    p = b * need
    perm = torch.randperm(p, generator=gen)
    table = perm.view(b, need).to(torch.int32)
    owner = torch.arange(b, dtype=torch.int32).repeat_interleave(need)[torch.argsort(perm)]
    scale = torch.tensor([0.02]) if dtype == FP8_DTYPE else None
    kc = quantize_kv(torch.randn(p, page, hkv, d, generator=gen), scale, dtype)
    return table.to(dev), owner.to(dev), kc.to(dev), None if scale is None else scale.to(dev)


def bench_attention(dev, smoke):
    gen = torch.Generator().manual_seed(1)
    b, ctx, page = (2, 40, 16) if smoke else (32, 4096, 16)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    hq, hkv, d = (4, 2, 32) if smoke else (32, 4, 128)  # per-GPU heads of a GQA model, 8 q per kv head
    for dtype in (torch.bfloat16, FP8_DTYPE):
        table, owner, kc, ks = _paged(dev, b, ctx, page, hkv, d, dtype, gen)
        vc = kc.clone()
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        name = "bf16" if dtype == torch.bfloat16 else "fp8"
        kv_bytes = 2 * b * ctx * hkv * d * kc.element_size()
        times = {}
        for check in (False, True):
            kv = PagedKV(kc, vc, table, k_scale=ks, v_scale=ks, owner=owner)
            fn = lambda: paged_decode_attention(q, kv, lens, check=check, backend="triton")  # noqa: E731
            times[check] = timeit(fn, smoke)
            row("attn-gqa", f"B={b} ctx={ctx} Hq={hq} Hkv={hkv} D={d}", f"{name} check={'on' if check else 'off'}",
                times[check], tbps=round(kv_bytes / times[check] / 1e9, 3))
        ROWS[-1]["integrity_overhead_pct"] = round(100 * (times[True] / times[False] - 1), 2)
        print(f"{'':<10} {'':<34} integrity overhead {ROWS[-1]['integrity_overhead_pct']:+.2f}%")
        del kc, vc
    h, lr, rope = (4, 32, 16) if smoke else (16, 512, 64)
    for dtype in (torch.bfloat16, FP8_DTYPE):
        table, owner, kc, sc = _paged(dev, b, ctx, page, 1, lr + rope, dtype, gen)
        qn = torch.randn(b, h, lr, device=dev).to(torch.bfloat16)
        qp = torch.randn(b, h, rope, device=dev).to(torch.bfloat16)
        name = "bf16" if dtype == torch.bfloat16 else "fp8"
        kv_bytes = b * ctx * (lr + rope) * kc.element_size()
        times = {}
        for check in (False, True):
            kv = PagedKV(kc[:, :, 0], None, table, k_scale=sc, owner=owner)
            fn = lambda: paged_mla_decode_attention(qn, qp, kv, lens, sm_scale=0.07, check=check,  # noqa: E731
                                                    backend="triton")
            times[check] = timeit(fn, smoke)
            row("attn-mla", f"B={b} ctx={ctx} H={h} L={lr}+{rope}", f"{name} check={'on' if check else 'off'}",
                times[check], tbps=round(kv_bytes / times[check] / 1e9, 3))
        ROWS[-1]["integrity_overhead_pct"] = round(100 * (times[True] / times[False] - 1), 2)
        print(f"{'':<10} {'':<34} integrity overhead {ROWS[-1]['integrity_overhead_pct']:+.2f}%")
        del kc


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench kernel_timings", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write rows as JSON (default: $OUT/kernels.json if $OUT)")
    ap.add_argument("--only", choices=["gemm", "moe", "attn", "fp4"], default=None, help="run one section")
    add_common_args(ap, repeat=None)  # --smoke: tiny shapes on CPU in the Triton interpreter
    args = ap.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed (pip install -e '.[triton]')")
    run = Run("kernel_timings", args, argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: running --smoke", file=sys.stderr)
        args.smoke = True
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter, timings meaningless)'}")
    print(f"{'section':<10} {'case':<34} {'variant':<26} {'time':>13}")
    for name, fn in (("gemm", bench_gemm), ("moe", bench_moe), ("attn", bench_attention), ("fp4", bench_fp4)):
        if args.only in (None, name):
            fn(dev, args.smoke)
            if cuda:
                torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu-interpreter", smoke=args.smoke,
                torch=torch.__version__, seconds=round(time.time() - t0, 1))
    out = args.json or (Path(os.environ["OUT"]) / "kernels.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))
        print(f"wrote {out}", file=sys.stderr)
    print(f"done in {meta['seconds']} s", file=sys.stderr)
    run.write(ROWS, meta)


if __name__ == "__main__":
    main()
