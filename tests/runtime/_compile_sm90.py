"""Compile every runtime kernel variant the tests launch for an NVIDIA sm_90 target (H100/H200)
without a GPU: the wrappers run with their launches intercepted, and each intercepted launch is
lowered through Triton's compiler to PTX and a cubin (ptxas ships with Triton). Run as a script
with TRITON_INTERPRET unset; prints one line per kernel and exits non-zero on any failure.

This catches what the interpreter cannot: type errors in the compiled dialect, tl.dot shape/dtype
rules, shared-memory budgets. It does not check numerics (tests/runtime on a GPU does)."""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SHARED_LIMIT = 227 * 1024  # H100/H200 max dynamic shared memory per block
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
launches = []


def _capture(self, *args, grid, warmup, **kwargs):
    launches.append((self, args, kwargs))


def _compile(fn, args, kwargs):
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "num_stages")}
    vals = dict(zip(fn.arg_names, args), **kwargs)
    sig, const = {}, {}
    for p in fn.params:
        v = vals[p.name]
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)


def _exercise():
    import quantkit.runtime.fused_moe as fm
    import quantkit.runtime.int4 as i4
    import quantkit.runtime.paged_attention as pa
    from quantkit.runtime import (FP8_DTYPE, PagedKV, fused_moe_int4, int4_gemm, paged_decode_attention,
                                  paged_mla_decode_attention, write_kv_cache)
    from quantkit.runtime.synth import random_int4, random_int4_experts

    for m in (i4, fm, pa):  # let the wrappers "launch" on CPU tensors; launches are only captured
        m.resolve_backend = lambda backend, device: "triton"
    for g, sym, k in ((32, True, 200), (128, False, 256), (None, True, 100), (48, False, 96)):
        w = random_int4(48, k, g, symmetric=sym)
        for dt in (torch.bfloat16, torch.float16):
            int4_gemm(torch.randn(3, k).to(dt), w, split_k=2)
    for sym, fused, g in ((True, True, 32), (False, False, 128)):
        ex = random_int4_experts(4, 128, 64, g, symmetric=sym, fused_gate_up=fused)
        fused_moe_int4(torch.randn(5, 128).bfloat16(), torch.randint(0, 4, (5, 2)), torch.rand(5, 2), ex)
    owner = torch.zeros(10, dtype=torch.int32)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    ctx = torch.tensor([5, 9], dtype=torch.int32)
    for dt in (torch.bfloat16, FP8_DTYPE):
        s = torch.tensor([0.1]) if dt == FP8_DTYPE else None
        kc = torch.zeros(10, 16, 4, 128, dtype=dt)
        for check in (True, False):
            paged_decode_attention(torch.randn(2, 32, 128).bfloat16(),
                                   PagedKV(kc, kc, bt, k_scale=s, v_scale=s, owner=owner), ctx, check=check)
        paged_mla_decode_attention(torch.randn(2, 16, 512).bfloat16(), torch.randn(2, 16, 64).bfloat16(),
                                   PagedKV(torch.zeros(10, 16, 576, dtype=dt), None, bt, k_scale=s, owner=owner), ctx,
                                   sm_scale=0.1)
        write_kv_cache(torch.randn(2, 4, 128).bfloat16(), torch.randn(2, 4, 128).bfloat16(),
                       PagedKV(kc, kc.clone(), bt, k_scale=s, v_scale=s, owner=owner), ctx)


def main() -> int:
    JITFunction.run = _capture
    _exercise()
    failures = 0
    seen = set()
    for fn, args, kwargs in launches:
        try:
            kernel = _compile(fn, args, dict(kwargs))
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {str(e)[:1500]}")
            continue
        key = (fn.__name__, kernel.hash)
        if key in seen:
            continue
        seen.add(key)
        shared = kernel.metadata.shared
        ok = shared <= SHARED_LIMIT
        failures += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {fn.__name__:<22} shared={shared} B  cubin={len(kernel.asm['cubin'])} B")
    print(f"{len(launches)} launches, {len(seen)} distinct kernels, {failures} failures")
    return 1 if failures or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
