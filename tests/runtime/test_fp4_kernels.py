"""runtime/fp4.py: PackedFP4 validation and dequantization (against quant/fp4.py bit for bit and against a
naive per-element decoder), the in-kernel bit decoders exhaustively, the FP4 W4A16 GEMM and the fused FP4
MoE against their torch references (which are themselves checked against float64 computations).

Weights come from quant/fp4.py's RTN (rtn_nvfp4 / rtn_mxfp4), i.e. what a converter would write."""

import os
import sys
from pathlib import Path

import pytest
import torch

from quantkit.pack.fp4 import E2M1_VALUES, dequantize_module, unpack_fp4
from quantkit.quant.fp4 import (choose_global_scale, dequantize_mxfp4, dequantize_nvfp4, effective_scale_mxfp4,
                                rtn_mxfp4, rtn_nvfp4)
from quantkit.runtime.fp4 import (FP4Experts, PackedFP4, fp4_gemm, fp4_gemm_ref, fuse_gate_up_fp4, fused_moe_fp4,
                                  fused_moe_fp4_ref)

from .helpers import DEVICE, HAVE_TRITON, needs_triton, rel_err
from harness import run_bounded

# kernel vs reference, as for INT4: both accumulate in fp32 and the dequantized weights are bit-identical
# (same float32 product e2m1 * scale); on a GPU the kernel rounds them to bf16 for the tensor-core dot
# (~2**-9 relative per weight) and outputs are bf16. In the interpreter the dot is fp32, and only the
# summation order differs (measured: 0 or one bf16 ulp).
GEMM_TOL = 2e-2
MOE_TOL = 2e-2  # plus the bf16 intermediate activation (as vLLM stores it)
REF_TOL = 8e-3  # torch reference vs float64: bf16 output rounding only

RTN = {"nvfp4": rtn_nvfp4, "mxfp4": rtn_mxfp4}


def _weight(kind, n, k, gen, experts=None, dtype=torch.bfloat16) -> PackedFP4:
    lead = () if experts is None else (experts,)
    w = (torch.randn(*lead, n, k, generator=gen) / k ** 0.5).to(dtype)
    r = RTN[kind](w)
    return PackedFP4.from_tensors(r.packed, r.scale, r.global_scale)


# --- naive decoding, element by element from the bits (independent of quant/fp4.py) ---------------------
def _e2m1(c: int) -> float:
    e, m = (c >> 1) & 3, c & 1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if c & 8 else v


def _e4m3(b: int) -> float:
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return float("nan")
    v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if b & 0x80 else v


def _naive_dequant(w: PackedFP4) -> torch.Tensor:
    """float32 [E?, N, K]: e2m1 * eff rounded once to float32 (the float64 product of a 2-bit and a 24-bit
    significand is exact; the float64 quotient rounded to float32 equals the float32 IEEE quotient)."""
    if w.num_experts is not None:
        return torch.stack([_naive_dequant(w.expert(e)) for e in range(w.num_experts)])
    n, k = w.shape
    g = w.group_size
    packed = w.packed.tolist()
    sb = w.scale.view(torch.uint8).tolist()
    if w.kind == "nvfp4":
        gs = float(w.global_scale.reshape(()))
        eff = [[float(torch.tensor(_e4m3(b) / gs, dtype=torch.float64).float()) for b in row] for row in sb]
    else:
        eff = [[2.0 ** (b - 127) for b in row] for row in sb]
    out = [[_e2m1((packed[r][c // 2] >> (4 * (c % 2))) & 0xF) * eff[r][c // g] for c in range(k)] for r in range(n)]
    return torch.tensor(out, dtype=torch.float64).float()


# --- PackedFP4 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("experts", [None, 3])
def test_dequantize_bit_exact(kind, experts):
    gen = torch.Generator().manual_seed(0)
    w = _weight(kind, 16, 64, gen, experts)
    codes = unpack_fp4(w.packed)
    for dt in (torch.float32, torch.bfloat16):
        want = (dequantize_nvfp4(codes, w.scale, w.global_scale, dt) if kind == "nvfp4"
                else dequantize_mxfp4(codes, w.scale, dt))
        got = w.dequantize(dt)
        assert got.dtype == dt and got.shape == (*(() if experts is None else (experts,)), 16, 64)
        assert torch.equal(got.view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dt == torch.bfloat16 else torch.int32))
    assert torch.equal(w.dequantize().view(torch.int32), _naive_dequant(w).view(torch.int32))
    tensors = {"weight_packed": w.packed, "weight_scale": w.scale}
    if w.global_scale is not None:
        tensors["weight_global_scale"] = w.global_scale
    assert torch.equal(w.dequantize(torch.bfloat16).view(torch.int16),  # pack/fp4.py: convert's and verify's decoder
                       dequantize_module(kind, tensors, torch.bfloat16).view(torch.int16))
    if experts is not None:  # per-expert global scales ([E, 1]) are applied to their own expert
        assert torch.equal(w.expert(1).dequantize(), w.dequantize()[1])


def test_dequantize_golden_byte():
    # byte 0xF1: column 0 = code 1 (+0.5), column 1 = code 15 (-6); scale 2.0 / global 4.0 -> 0.5
    nv = PackedFP4.from_tensors(torch.full((1, 8), 0xF1, dtype=torch.uint8),
                                torch.tensor([[2.0]]).to(torch.float8_e4m3fn), torch.tensor([4.0]))
    assert nv.dequantize()[0, :2].tolist() == [0.25, -3.0]
    mx = PackedFP4.from_tensors(torch.full((1, 16), 0x98, dtype=torch.uint8), torch.tensor([[129]], dtype=torch.uint8))
    d = mx.dequantize()[0, :2]  # code 8 (-0.0) then code 9 (-0.5), times 2^2
    assert d.tolist() == [0.0, -2.0] and torch.signbit(d[0])


def test_from_tensors_validation():
    gen = torch.Generator().manual_seed(1)
    nv = rtn_nvfp4(torch.randn(16, 64, generator=gen))
    mx = rtn_mxfp4(torch.randn(16, 64, generator=gen))
    w = PackedFP4.from_tensors(nv.packed, nv.scale, nv.global_scale)
    assert (w.kind, w.shape, w.group_size) == ("nvfp4", (16, 64), 16)
    assert PackedFP4.from_tensors(nv.packed, nv.scale, nv.global_scale.reshape(())).global_scale.shape == (1,)
    assert PackedFP4.from_tensors(mx.packed, mx.scale).kind == "mxfp4"
    cases = [
        (dict(weight_packed=nv.packed.to(torch.int32)), "packed must be uint8"),
        (dict(weight_packed=nv.packed[:, :16]), "scale must be"),                 # K = 32: 2 groups, scale has 4
        (dict(weight_packed=nv.packed[:8]), "scale must be"),
        (dict(weight_scale=nv.scale.float()), "cannot tell the FP4 kind"),
        (dict(weight_scale=nv.scale[:, :2]), "scale must be"),
        (dict(weight_scale=nv.scale.view(torch.uint8)), "mxfp4 scale must be"),  # uint8 -> mxfp4, wrong shape
        (dict(weight_global_scale=None), "global_scale must be float32"),
        (dict(weight_global_scale=nv.global_scale.double()), "global_scale must be float32"),
        (dict(weight_global_scale=torch.ones(2)), "global_scale must be float32"),
        (dict(weight_shape=torch.tensor([16, 56])), "divisible by its group size"),
        (dict(weight_shape=torch.tensor([16, 96])), "packed must be"),
        (dict(kind="fp4"), "kind must be one of"),
        (dict(kind="mxfp4"), "mxfp4 scale must be"),
    ]
    for change, msg in cases:
        kw = dict(weight_packed=nv.packed, weight_scale=nv.scale, weight_global_scale=nv.global_scale) | change
        with pytest.raises(ValueError, match=msg):
            PackedFP4.from_tensors(**kw)
    with pytest.raises(ValueError, match="no global scale"):
        PackedFP4.from_tensors(mx.packed, mx.scale, torch.ones(1))
    with pytest.raises(ValueError, match="2-D"):
        PackedFP4.from_tensors(mx.packed[None, None], mx.scale[None, None])
    stack = rtn_nvfp4(torch.randn(3, 16, 64, generator=gen))
    with pytest.raises(ValueError, match=r"global_scale must be float32 \[3, 1\]"):
        PackedFP4(stack.packed, stack.scale, stack.global_scale[:2], (16, 64), "nvfp4")
    one = PackedFP4.from_tensors(stack.packed, stack.scale, torch.tensor([2.0]))  # one scale for the stack
    assert one.global_scale.shape == (3, 1)


# --- Triton: bit decoders, exhaustively ----------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from quantkit.runtime.fp4 import e2m1_to_f32, e4m3_to_f32, e8m0_to_f32

    @triton.jit
    def _decode_all_kernel(out_ptr):
        b = tl.arange(0, 256)  # every byte value
        tl.store(out_ptr + b, e4m3_to_f32(b))
        tl.store(out_ptr + 256 + b, e8m0_to_f32(b))
        tl.store(out_ptr + 512 + b, e2m1_to_f32(b & 0xF))


@needs_triton
def test_bit_decoders_exhaustive():
    out = torch.empty(768, dtype=torch.float32, device=DEVICE)
    _decode_all_kernel[(1,)](out)
    out = out.cpu()
    b = torch.arange(256, dtype=torch.uint8)
    fp8 = b.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(fp8)
    assert nan.sum() == 2 and torch.isnan(out[:256][nan]).all()
    assert torch.equal(out[:256][~nan].view(torch.int32), fp8[~nan].view(torch.int32))  # signed zeros included
    assert torch.equal(out[256:512].view(torch.int32), effective_scale_mxfp4(b).view(torch.int32))
    assert torch.equal(out[512:].view(torch.int32), E2M1_VALUES.repeat(16).view(torch.int32))


# --- GEMM ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_gemm_reference_matches_float64(kind):
    gen = torch.Generator().manual_seed(2)
    w = _weight(kind, 24, 96, gen)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    assert rel_err(fp4_gemm_ref(x, w), x.double() @ _naive_dequant(w).double().T) < REF_TOL


GEMM_CASES = [
    # kind, M, N, K, split_k, dtype
    *[(kind, m, 64, 128, None, torch.bfloat16) for kind in ("nvfp4", "mxfp4") for m in (1, 5, 16)],
    ("nvfp4", 3, 96, 160, None, torch.bfloat16),   # N not a multiple of BLOCK_N, K ends mid-tile
    ("mxfp4", 2, 32, 256, 2, torch.bfloat16),      # two K slices
    ("nvfp4", 4, 64, 128, None, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("kind,m,n,k,split_k,dtype", GEMM_CASES)
def test_gemm_kernel_matches_reference(kind, m, n, k, split_k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = _weight(kind, n, k, gen).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    want = fp4_gemm_ref(x, w)
    got = fp4_gemm(x, w, backend="triton", split_k=split_k)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, want) < GEMM_TOL


@needs_triton
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_gemm_comparison_is_sensitive(kind):
    """A wrong nibble, or a scale of the wrong group, must push the kernel outside the tolerance."""
    gen = torch.Generator().manual_seed(3)
    w = _weight(kind, 16, 64, gen)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 3] = 1.0  # y = column 3 of W (high nibble of byte 1)
    row = int(w.dequantize()[:, 3].abs().argmax())
    bad = w.packed.clone()
    bad[row, 1] ^= 0x40  # flips the exponent's high bit of column 3 (magnitude index +-4)
    wbad = PackedFP4(bad, w.scale, w.global_scale, w.shape, w.kind)
    assert rel_err(fp4_gemm(x.to(DEVICE), wbad.to(DEVICE), backend="triton"), fp4_gemm_ref(x, w)) > GEMM_TOL
    # the same weight, all columns: leading dims pass through
    xs = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    got = fp4_gemm(xs.to(DEVICE), w.to(DEVICE), backend="triton")
    assert got.shape == (2, 3, 16) and rel_err(got, fp4_gemm_ref(xs, w)) < GEMM_TOL


def test_gemm_errors():
    gen = torch.Generator().manual_seed(4)
    w = _weight("mxfp4", 16, 64, gen)
    with pytest.raises(ValueError, match="K="):
        fp4_gemm(torch.zeros(1, 32, dtype=torch.bfloat16), w, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        fp4_gemm(torch.zeros(1, 64, dtype=torch.bfloat16), w, backend="cuda")
    with pytest.raises(ValueError, match="2-D"):
        fp4_gemm(torch.zeros(1, 64, dtype=torch.bfloat16), _weight("mxfp4", 16, 64, gen, experts=2))


# --- fused MoE ----------------------------------------------------------------------------------------
def _experts(kind, e, d, i, gen) -> FP4Experts:
    """RTN experts the way a converter writes them: gate and up quantized per expert (NVFP4: with the
    pair's shared global scale), stacked into w13; down on its own."""
    gate, up, down = ((torch.randn(e, r, c, generator=gen) / c ** 0.5).to(torch.bfloat16)
                      for r, c in ((i, d), (i, d), (d, i)))
    if kind == "nvfp4":
        gs = choose_global_scale(gate, up)  # [E, 1]
        g, u = rtn_nvfp4(gate, gs), rtn_nvfp4(up, gs)
    else:
        g, u = rtn_mxfp4(gate), rtn_mxfp4(up)
    wg, wu = (PackedFP4.from_tensors(r.packed, r.scale, r.global_scale) for r in (g, u))
    dn = RTN[kind](down)
    return FP4Experts(w13=fuse_gate_up_fp4(wg, wu), w2=PackedFP4.from_tensors(dn.packed, dn.scale, dn.global_scale))


def _routing(t, k, e, gen, used=None):
    pool = torch.tensor(used if used is not None else list(range(e)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)])
    return ids, torch.softmax(torch.randn(t, k, generator=gen), -1)


def test_moe_reference_matches_float64():
    gen = torch.Generator().manual_seed(5)
    ex = _experts("nvfp4", 3, 32, 32, gen)
    x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    ids, w = _routing(4, 2, 3, gen)
    i = ex.intermediate_size
    w13, w2 = _naive_dequant(ex.w13).double(), _naive_dequant(ex.w2).double()
    want = torch.zeros(4, 32, dtype=torch.float64)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            h = w13[e] @ x[t].double()
            want[t] += float(w[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    assert rel_err(fused_moe_fp4_ref(x, ids, w, ex), want) < REF_TOL


MOE_CASES = [
    # kind, T, k, E, D, I, used experts (None = all)
    ("nvfp4", 1, 2, 4, 64, 32, None),        # decode token: 2 of 4 experts work
    ("mxfp4", 9, 2, 4, 128, 64, [0, 2, 3]),  # expert 1 empty
    ("nvfp4", 6, 2, 3, 96, 64, None),        # D not a multiple of BLOCK_N / BLOCK_K
]


@needs_triton
@pytest.mark.parametrize("kind,t,k,e,d,i,used", MOE_CASES)
def test_moe_kernel_matches_reference(kind, t, k, e, d, i, used):
    gen = torch.Generator().manual_seed(t * 100 + e)
    ex = _experts(kind, e, d, i, gen)
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    ids, w = _routing(t, k, e, gen, used)
    want = fused_moe_fp4_ref(x, ids, w, ex)
    got = fused_moe_fp4(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), ex.to(DEVICE), backend="triton")
    assert got.shape == (t, d) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < MOE_TOL


def test_experts_validation_and_shared_global_scale():
    gen = torch.Generator().manual_seed(6)
    gate, up = _weight("nvfp4", 32, 64, gen, experts=2), _weight("nvfp4", 32, 64, gen, experts=2)
    with pytest.raises(ValueError, match="global scales differ for experts"):
        fuse_gate_up_fp4(gate, up)  # quantized separately: each has its own global scale
    shared = PackedFP4(up.packed, up.scale, gate.global_scale.clone(), up.shape, up.kind)
    w13 = fuse_gate_up_fp4(gate, shared)
    assert w13.shape == (64, 64) and w13.global_scale.shape == (2, 1)
    assert torch.equal(w13.dequantize()[:, 32:], shared.dequantize())
    down = _weight("nvfp4", 64, 32, gen, experts=2)
    FP4Experts(w13=w13, w2=down)
    with pytest.raises(ValueError, match="one FP4 kind"):
        FP4Experts(w13=w13, w2=_weight("mxfp4", 64, 32, gen, experts=2))
    with pytest.raises(ValueError, match="does not match"):
        FP4Experts(w13=gate, w2=down)
    with pytest.raises(ValueError, match="3-D"):
        FP4Experts(w13=w13.expert(0), w2=down.expert(0))
    with pytest.raises(ValueError, match="experts"):
        FP4Experts(w13=w13, w2=_weight("nvfp4", 64, 32, gen, experts=3))
    with pytest.raises(ValueError, match="must match"):
        fuse_gate_up_fp4(gate, _weight("mxfp4", 32, 64, gen, experts=2))


# --- sm_90 compile check (the interpreter cannot see compile errors) -------------------------------------
@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the kernel tests compile and run there")
def test_fp4_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = run_bounded([sys.executable, str(Path(__file__).with_name("_compile_sm90_fp4.py"))], timeout=600, env=env, cwd=root)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
