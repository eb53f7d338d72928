"""runtime/int4.py: golden bytes, unpack/dequant against compressed-tensors and a naive bit-by-bit
decoder, and the W4A16 GEMM kernel against its torch reference (which is itself checked against a
float64 computation)."""

import math

import pytest
import torch

from quantkit.runtime.int4 import (PackedInt4, dequantize_int4, int4_gemm, int4_gemm_ref, pack_int4, unpack_int4,
                                   unpack_zero_point)
from quantkit.runtime.synth import random_int4

from .helpers import DEVICE, naive_dequant, naive_dequant_weight, needs_triton, rel_err

# kernel vs reference: both accumulate in fp32; on a GPU the kernel rounds the dequantized weight
# to the activation dtype before the tensor-core dot (~2**-9 relative), and outputs are bf16.
GEMM_TOL = 2e-2


def test_unpack_golden_bytes():
    packed = torch.tensor([[0x8FEDCBA9 - 2**32]], dtype=torch.int32)  # signed view of 0x8FEDCBA9
    assert unpack_int4(packed, 8).tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])).item() == 0x8FEDCBA9 - 2**32
    assert pack_int4(torch.full((1, 8), 7)).item() == -1  # 0xFFFFFFFF
    assert unpack_int4(torch.zeros(1, 1, dtype=torch.int32), 8).tolist() == [[-8] * 8]
    # element 8 starts word 1; a ragged row of 9 trims the padding nibbles
    two = torch.tensor([[0x88888888 - 2**32, 0x9]], dtype=torch.int32)
    assert unpack_int4(two, 9).tolist() == [[0] * 8 + [1]]


def test_pack_unpack_round_trip_batched():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 37), generator=g)  # [E, N, K], K not a multiple of 8
    p = pack_int4(q)
    assert p.shape == (3, 5, 5) and p.dtype == torch.int32
    assert torch.equal(unpack_int4(p, 37).long(), q)
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[8]]))


def test_matches_compressed_tensors_packing():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(1)
    for n, k in [(16, 64), (9, 37), (24, 8)]:
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        theirs = helpers.pack_to_int32(q, 4)
        assert torch.equal(pack_int4(q), theirs)  # byte-identical, padding included
        assert torch.equal(unpack_int4(theirs, k), q)
        # zero points are packed along dim 0
        zt = helpers.pack_to_int32(q, 4, packed_dim=0)
        assert torch.equal(unpack_zero_point(zt, n), q)


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, True), (None, False), (32, False)])
def test_dequantize_matches_naive(group_size, symmetric):
    g = torch.Generator().manual_seed(2)
    n, k = 24, 256
    w = random_int4(n, k, group_size, symmetric=symmetric, generator=g)
    ref = naive_dequant(w.packed, w.scale, w.zero_point, n, k, w.group_size)
    got = dequantize_int4(w.packed, w.scale, w.zero_point, shape=torch.tensor([n, k]))
    assert torch.equal(got.double(), ref)  # exact: (q - zp) * scale in fp32 of bf16 scales


def test_dequantize_batched_experts_and_ragged_group():
    g = torch.Generator().manual_seed(3)
    w = random_int4(16, 100, 32, symmetric=False, num_experts=3, generator=g)  # last group is 4 wide
    assert w.scale.shape == (3, 16, 4) and w.zero_point.shape == (3, 2, 4)
    assert torch.equal(w.dequantize().double(), naive_dequant_weight(w))


def test_packed_int4_validates_shapes():
    w = random_int4(16, 64, 32)
    with pytest.raises(ValueError, match="scale"):
        PackedInt4(w.packed, w.scale[:, :1], None, (16, 64), 32)
    with pytest.raises(ValueError, match="packed"):
        PackedInt4(w.packed[:, :4], w.scale, None, (16, 64), 32)
    w2 = PackedInt4.from_tensors(w.packed, w.scale, torch.tensor([16, 64]))
    assert w2.group_size == 32 and w2.symmetric


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemm_reference_matches_float64(symmetric):
    g = torch.Generator().manual_seed(4)
    n, k = 24, 200
    w = random_int4(n, k, 32, symmetric=symmetric, generator=g)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    want = x.double() @ naive_dequant_weight(w).T  # independent dequant, float64 matmul
    got = int4_gemm_ref(x, w)
    assert rel_err(got, want) < 8e-3  # bf16 output rounding only


GEMM_CASES = [
    # M, N, K, group_size, symmetric, split_k
    (1, 48, 200, 32, True, None),      # decode row, K = 200 not a multiple of BLOCK_K
    (1, 64, 256, 128, False, 2),       # forced split-K
    (5, 40, 100, 100, True, 1),        # channel-wise (group = K); K = 100 ends mid-word
    (7, 72, 384, 64, False, 3),        # three K slices, N not a multiple of BLOCK_N
    (33, 32, 128, 32, True, None),     # M spans two row blocks
    (2, 16, 96, 32, False, 1),         # tiny N (asym zero points packed over 2 words)
    (3, 32, 96, 48, False, 1),         # group 48: neither divides nor is divided by BLOCK_K (gather path)
]


# every case in bf16; fp16 on the decode row and the split-K case (keeps the interpreter run short)
GEMM_PARAMS = [(*c, torch.bfloat16) for c in GEMM_CASES] + [(*c, torch.float16) for c in GEMM_CASES if c[0] in (1, 7)]


@needs_triton
@pytest.mark.parametrize("m,n,k,group_size,symmetric,split_k,dtype", GEMM_PARAMS)
def test_gemm_kernel_matches_reference(m, n, k, group_size, symmetric, split_k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = random_int4(n, k, group_size, symmetric=symmetric, generator=g).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    want = int4_gemm_ref(x, w)
    got = int4_gemm(x, w, backend="triton", split_k=split_k)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, want) < GEMM_TOL


@needs_triton
def test_gemm_batched_leading_dims_and_ragged_last_group():
    g = torch.Generator().manual_seed(5)
    w = random_int4(32, 72, 32, symmetric=False, generator=g).to(DEVICE)  # groups 32, 32, 8
    x = torch.randn(2, 3, 72, generator=g).to(torch.bfloat16).to(DEVICE)
    got = int4_gemm(x, w, backend="triton")
    assert got.shape == (2, 3, 32)
    assert rel_err(got, int4_gemm_ref(x, w)) < GEMM_TOL
    assert rel_err(int4_gemm_ref(x, w).cpu(), x.double().cpu() @ naive_dequant_weight(w).T) < 8e-3


@needs_triton
def test_gemm_comparison_is_sensitive():
    """Flipping one nibble of one word must push the kernel outside the tolerance of the unflipped ref."""
    g = torch.Generator().manual_seed(6)
    w = random_int4(16, 64, 32, generator=g)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 3] = 1.0  # y = column 3 of W
    bad = w.packed.clone()
    bad[5, 0] ^= 0x7 << 12  # element 3 of row 5: q changes by >= 1
    wbad = PackedInt4(bad, w.scale, None, w.shape, w.group_size)
    assert rel_err(int4_gemm(x.to(DEVICE), wbad.to(DEVICE), backend="triton"), int4_gemm_ref(x, w)) > GEMM_TOL


def test_backend_errors():
    w = random_int4(16, 64, 32)
    with pytest.raises(ValueError, match="backend"):
        int4_gemm(torch.zeros(1, 64, dtype=torch.bfloat16), w, backend="cuda")
    with pytest.raises(ValueError, match="K="):
        int4_gemm(torch.zeros(1, 63, dtype=torch.bfloat16), w, backend="torch")
    assert math.isclose(float(int4_gemm(torch.zeros(1, 64), w, backend="torch").abs().sum()), 0.0)
