"""Shared plumbing for the runtime's Triton kernels: the optional import, backend dispatch, and two
rounding helpers every kernel that stores a narrow float uses.

This module is not a kernel library. It exists so that `quantkit.runtime` imports without Triton
installed (`triton` is `None` then, and only `backend="torch"` works) and so that every kernel
module chooses its backend the same way.

Interpreter notes (TRITON_INTERPRET=1, Triton 3.9), all checked by tests/runtime:
- bf16 values are held as raw uint16 in the interpreter: bf16 arithmetic and bf16 `tl.dot` give
  garbage, so kernels convert every bf16 load to fp32 first and, in the interpreter only, feed
  `tl.dot` fp32 operands (`dot_f32()`); on a GPU the dot runs in the activation dtype.
- The interpreter's fp32 -> bf16 cast truncates and its fp32 -> fp8e4nv cast mishandles a mantissa
  carry (126.1 becomes 64). `round_to_bf16` / `round_to_e4m3` round in fp32 bit arithmetic first
  (round-to-nearest-even, like torch and like the GPU), so the final cast is exact everywhere.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: the package and every *_ref function work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by tests/runtime/test_no_triton.py in a subprocess
    triton = None
    tl = None

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """True when TRITON_INTERPRET is set now (Triton's own test: any value but "" and "0")."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# triton.jit picks interpreter or compiler when a kernel is *defined*, i.e. when the kernel modules
# are imported (they import this module first), so that moment's setting is the one that counts.
KERNELS_INTERPRETED = triton is not None and interpreting()


def dot_f32() -> bool:
    """Whether kernels must feed tl.dot fp32 operands (the interpreter's bf16 dot is broken)."""
    return KERNELS_INTERPRETED


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to "triton" when the kernels can run on `device` (CUDA, or any device when the
    kernels were defined in interpreter mode), else "torch". "triton" that cannot run raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = triton is not None and (device.type == "cuda" or KERNELS_INTERPRETED)
    if backend == "triton" and not usable:
        if triton is None:
            why = "triton is not installed"
        elif interpreting():
            why = "TRITON_INTERPRET was set after quantkit.runtime was imported; set it before the import"
        else:
            why = f"tensors are on {device.type}, not CUDA, and TRITON_INTERPRET is not set"
        raise RuntimeError(f"backend='triton' unavailable: {why}")
    return "triton" if usable else "torch"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def round_to_bf16(x):
        """fp32 -> fp32 holding the nearest bf16 value (ties to even). Finite inputs only."""
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = bits & -65536  # 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_to_e4m3(x):
        """fp32 -> fp32 holding the nearest float8_e4m3fn value (ties to even), saturating at
        +-448 like vLLM's scaled FP8 conversion. e4m3: 3 mantissa bits, min normal 2**-6,
        subnormal step 2**-9."""
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        # normal range: drop 20 of fp32's 23 mantissa bits with round-half-even on the bits
        sign_bits = x.to(tl.int32, bitcast=True)
        bits = sign_bits + 0x7FFFF + ((sign_bits >> 20) & 1)
        bits = bits & -1048576  # 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        # subnormal range: multiples of 2**-9; y = |x| * 512 < 8 is exact, so is its split
        ax = tl.abs(x)
        y = ax * 512.0
        t = y.to(tl.int32).to(tl.float32)  # floor for y >= 0
        frac = y - t
        odd = (t.to(tl.int32) & 1) == 1
        up = (frac > 0.5) | ((frac == 0.5) & odd)
        r = (t + tl.where(up, 1.0, 0.0)) * (1.0 / 512.0)
        sub = tl.where(sign_bits < 0, -r, r)  # keeps -0.0 like torch
        return tl.where(ax < 0.015625, sub, normal)

    @triton.jit
    def cast_rne(x, dtype: tl.constexpr):
        """Cast fp32 `x` to `dtype` with round-to-nearest-even on every backend."""
        if dtype == tl.bfloat16:
            x = round_to_bf16(x)
        elif dtype == tl.float8e4nv:
            x = round_to_e4m3(x)
        return x.to(dtype)
