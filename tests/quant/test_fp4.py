"""FP4 math (quant/fp4.py): golden bytes for E2M1 codes, packing, NVFP4 and MXFP4 scales; round trips;
and the judge, compressed-tensors 0.20.1: from the same BF16/FP32 weight its NVFP4/MXFP4 compressors give
our bytes (packed, scales, global scale), and its decompressors turn our bytes into our dequantized
weights bit for bit. The reference runs one matrix at a time (its compressors are 2-D); ours is batched."""

import pytest
import torch

from quantkit.errors import GroupSizeError
from quantkit.quant import fp4
from quantkit.quant.int4 import sqnr_db

# one NVFP4 group whose amax is 6: global scale 448*6/6 = 448, group scale 448 (fp8 0x7E), effective
# scale exactly 1, so the codes are those of the values themselves (ties to the even index, signed zero)
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, -0.25, -0.0, -5.0, 0.2, 0.26, 4.9, -1e-3, 6.0]
TIES_CODES = [0, 2, 2, 4, 4, 6, 6, 15, 8, 0, 14, 0, 1, 6, 8, 7]
TIES_BYTES = [0x20, 0x42, 0x64, 0xF6, 0x08, 0x0E, 0x61, 0x78]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (torch.equal says -0.0 == 0.0; the format does not)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# --- golden bytes -----------------------------------------------------------------------------------
def test_pack_golden_bytes():
    # codes 1, 10 -> 0xA1: the even column is the low nibble
    p = fp4.pack_fp4(torch.tensor([[1, 10, 7, 15, 0, 3, 5, 9]], dtype=torch.uint8))
    assert p.dtype == torch.uint8 and p.tolist() == [[0xA1, 0xF7, 0x30, 0x95]]
    assert fp4.unpack_fp4(p).tolist() == [[1, 10, 7, 15, 0, 3, 5, 9]]


def test_e2m1_codes_and_values():
    x = torch.tensor(TIES)
    assert fp4.encode_e2m1(x).tolist() == TIES_CODES
    assert fp4.round_to_e2m1(torch.tensor([0.3, -0.8, 2.9, 100.0])).tolist() == [0.5, -1.0, 3.0, 6.0]
    assert fp4.decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist() == fp4.E2M1_VALUES.tolist()
    assert bits(fp4.decode_e2m1(torch.tensor([8], dtype=torch.uint8))).item() == -(2**31)  # -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_golden(dtype):
    w = torch.tensor([TIES, [0.0] * 16], dtype=dtype)  # second row: an all-zero group
    r = fp4.rtn_nvfp4(w)
    assert r.global_scale.dtype == torch.float32 and r.global_scale.tolist() == [448.0]
    assert r.packed.tolist() == [TIES_BYTES, [0] * 8]
    # 448 = 1.75 * 2^8 -> e4m3 0_1111_110; the zero group gets compressed-tensors' 0.125 = 0_0100_000
    assert bits(r.scale).tolist() == [[0x7E], [0x20]]
    assert fp4.choose_global_scale(torch.zeros(4, 16, dtype=dtype)).tolist() == [1.0]  # all-zero weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_golden(dtype):
    w = torch.zeros(4, 32, dtype=dtype)
    w[0, :16] = torch.tensor(TIES)  # amax 6 = 1.5*2^2: rounds down, scale 2^0 (E8M0 127)
    w[1, :5] = torch.tensor([7.0, 3.0, 1.0, -2.5, 0.5])  # amax 7 = 1.75*2^2: rounds up, scale 2^1 (128)
    w[2, :2] = torch.tensor([6.5, -6.5])  # amax 1.625*2^2: scale 2^0, and 6.5 saturates to 6
    r = fp4.rtn_mxfp4(w)  # row 3: zeros -> E8M0 0
    assert r.global_scale is None and r.scale.dtype == torch.uint8
    assert r.scale.tolist() == [[127], [128], [127], [0]]
    assert r.packed[0].tolist() == TIES_BYTES + [0] * 8
    # 3.5 -> 4 (6), 1.5 (3), 0.5 (1), -1.25 -> -1 (10), 0.25 -> 0
    assert r.packed[1].tolist() == [0x36, 0xA1] + [0] * 14
    assert r.packed[2].tolist() == [0xF7] + [0] * 15
    assert r.packed[3].tolist() == [0] * 16


# --- round trips, shapes, errors --------------------------------------------------------------------
def test_pack_round_trip_batched():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    p = fp4.pack_fp4(codes)
    assert p.shape == (3, 5, 32)
    assert torch.equal(fp4.unpack_fp4(p), codes)
    assert torch.equal(p[..., 0] & 0xF, codes[..., 0]) and torch.equal(p[..., 0] >> 4, codes[..., 1])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rtn_round_trip_and_batching(fmt):
    w = torch.randn(4, 24, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 0.02
    rtn = fp4.rtn_nvfp4 if fmt == "nvfp4" else fp4.rtn_mxfp4
    r = rtn(w)
    codes = fp4.unpack_fp4(r.packed)
    if fmt == "nvfp4":
        qp = fp4.choose_qparams_nvfp4(w)
        assert torch.equal(bits(qp.scale), bits(r.scale)) and torch.equal(qp.global_scale, r.global_scale)
        assert torch.equal(fp4.quantize_nvfp4(w, qp), codes)
        deq = fp4.dequantize_nvfp4(codes, r.scale, r.global_scale, torch.float32)
    else:
        assert torch.equal(fp4.choose_qparams_mxfp4(w), r.scale)
        assert torch.equal(fp4.quantize_mxfp4(w, r.scale), codes)
        deq = fp4.dequantize_mxfp4(codes, r.scale, torch.float32)
    # E2M1 with group scales: ~20 dB on Gaussian weights (NVFP4 measured 20.5, MXFP4 18.5-19.5)
    for e in range(4):
        s = sqnr_db(w[e].float(), deq[e]).item()
        assert s > 17.0 and abs(s - r.sqnr_db()[e].item()) < 1e-6
        one = rtn(w[e])  # one matrix alone gives the same bytes as inside the batch
        assert torch.equal(one.packed, r.packed[e]) and torch.equal(bits(one.scale), bits(r.scale[e]))
    assert bool(r.finite.all())
    small = fp4.CHUNK_ELEMENTS
    try:  # chunked rows give the same result as one pass
        fp4.CHUNK_ELEMENTS = 256
        again = rtn(w)
    finally:
        fp4.CHUNK_ELEMENTS = small
    assert torch.equal(again.packed, r.packed) and torch.equal(bits(again.scale), bits(r.scale))


def test_group_size_errors():
    with pytest.raises(GroupSizeError, match="NVFP4.*16.*24"):
        fp4.rtn_nvfp4(torch.zeros(2, 24))
    with pytest.raises(GroupSizeError, match="MXFP4.*32.*48"):
        fp4.rtn_mxfp4(torch.zeros(2, 48))
    with pytest.raises(GroupSizeError):
        fp4.choose_qparams_mxfp4(torch.zeros(2, 16))
    assert fp4.rtn_nvfp4(torch.zeros(2, 48)).packed.shape == (2, 24)  # 48 is fine for group 16


def test_fp16_is_widened_to_float32():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).half() * 0.01  # amax < 0.041
    a, b = fp4.rtn_nvfp4(w), fp4.rtn_nvfp4(w.float())
    assert torch.equal(a.packed, b.packed) and torch.equal(a.global_scale, b.global_scale)
    assert a.global_scale.item() > 10000  # not the 1.0 FP16 arithmetic would give


def test_shared_global_scale_for_gate_and_up():
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(3, 16, 64, generator=g) * 0.02).to(torch.bfloat16)
    up = (torch.randn(3, 16, 64, generator=g) * 0.05).to(torch.bfloat16)
    gs = fp4.choose_global_scale(gate, up)  # [E, 1]
    rg, ru = fp4.rtn_nvfp4(gate, gs), fp4.rtn_nvfp4(up, gs)
    assert gs.shape == (3, 1) and torch.equal(rg.global_scale, ru.global_scale)
    assert not torch.equal(fp4.rtn_nvfp4(gate).global_scale, fp4.rtn_nvfp4(up).global_scale)
    # = the global scale of the fused [E, 2I, H] gate_up, and compressed-tensors' on the pair's amax
    assert torch.equal(gs, fp4.choose_global_scale(torch.cat([gate, up], dim=1)))
    from compressed_tensors.quantization.utils import generate_gparam

    for e in range(3):
        both = torch.cat([gate[e], up[e]])
        assert torch.equal(gs[e], generate_gparam(both.amin().reshape(1), both.amax().reshape(1)))
        for w, r in ((gate[e], rg), (up[e], ru)):  # and its compressor agrees with the shared scale
            ref = ct_compress("nvfp4", w, gs[e])
            assert torch.equal(ref["weight_packed"], r.packed[e])
            assert torch.equal(bits(ref["weight_scale"]), bits(r.scale[e]))


def test_quantize_column_matches_whole_matrix():
    """GPTQ's sweep with fixed group scales: column by column (and block by block) == the whole matrix."""
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)) * 0.03
    for qp_eff, codes in (
        (fp4.choose_qparams_nvfp4(w).effective(), fp4.quantize_nvfp4(w, fp4.choose_qparams_nvfp4(w))),
        (fp4.effective_scale_mxfp4(fp4.choose_qparams_mxfp4(w)), fp4.quantize_mxfp4(w, fp4.choose_qparams_mxfp4(w))),
    ):
        g = w.shape[-1] // qp_eff.shape[-1]
        for col in range(w.shape[-1]):
            q, deq = fp4.quantize_column(w[:, :, col], qp_eff[:, :, col // g])  # [E, N]
            assert torch.equal(q, codes[:, :, col])
            assert torch.equal(deq, fp4.decode_e2m1(codes[:, :, col]) * qp_eff[:, :, col // g])
        q, _ = fp4.quantize_column(w[:, :, :g], qp_eff[:, :, :1])  # a block of one group
        assert torch.equal(q, codes[:, :, :g])
    with pytest.raises(ValueError):
        fp4.quantize_column(w[:, :, 0], qp_eff[:, :, 0], zero_point=torch.zeros(2, 8))


# --- the judge: compressed-tensors ------------------------------------------------------------------
def ct_scheme(fmt: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4A16" if fmt == "nvfp4" else "MXFP4A16", ["Linear"])


def ct_compressor(fmt: str):
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(f"{fmt}-pack-quantized")


def ct_compress(fmt: str, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict:
    """compressed-tensors end to end on one [N, K] weight, as llm-compressor drives it: min/max statistics
    in the weight's dtype, `generate_gparam`, `calculate_qparams`, the scale parameter in the weight's
    dtype, then the format's compressor."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = ct_scheme(fmt)
    grouped = w.unflatten(-1, (-1, scheme.weights.group_size))
    sd = {"weight": w}
    if fmt == "nvfp4" and global_scale is None:
        global_scale = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
    if global_scale is not None:
        sd["weight_global_scale"] = global_scale
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights, global_scale=global_scale)
    sd["weight_scale"] = scale.to(w.dtype)
    return ct_compressor(fmt).compress(sd, scheme)


def ct_decompress(fmt: str, packed, scale, global_scale=None) -> torch.Tensor:
    sd = {"weight_packed": packed, "weight_scale": scale}
    if global_scale is not None:
        sd["weight_global_scale"] = global_scale
    return ct_compressor(fmt).decompress(sd, ct_scheme(fmt))["weight"]


def hostile_weight(shape, dtype, seed):
    """Gaussian rows plus the cases that decide bytes: an all-zero row, an outlier (so a row of ~3e-4
    gets subnormal fp8 scales), a row of ~1e-7 (NVFP4 scale underflows to 0 -> 0.125), signed
    zeros and tiny negatives (code 8 vs 0), E2M1 ties at scale 1, MXFP4's power-of-two edges, and a
    BF16 subnormal that MXFP4's division (in the weight's dtype) flushes to -0.0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.02
    w[..., 0, :] = 0.0
    w[..., 1, 5] = 40.0
    w[..., 2, :] = torch.randn(shape[-1], generator=g) * 1e-7
    w[..., 8, :] = torch.randn(shape[-1], generator=g) * 3e-4
    w[..., 3, ::3] = -0.0
    w[..., 3, 1::3] = -1e-9
    w[..., 4, :16] = torch.tensor(TIES) * 0.25
    w[..., 5, :32] = torch.linspace(-1.75, 1.75, 32)
    w[..., 6, :32] = torch.linspace(-1.5, 0.5, 32)
    w = w.to(dtype)
    w[..., 7, :2] = torch.tensor([8.0, -(2.0**-133)])  # MXFP4 scale 2: -2^-134 is -0.0 in BF16 arithmetic
    return w


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(12, 96), (3, 10, 64)], ids=["2d", "experts"])
def test_compressed_tensors_judge(fmt, dtype, shape):
    w = hostile_weight(shape, dtype, seed=len(shape))
    r = fp4.rtn_nvfp4(w) if fmt == "nvfp4" else fp4.rtn_mxfp4(w)
    codes = fp4.unpack_fp4(r.packed)
    mine = (fp4.dequantize_nvfp4(codes, r.scale, r.global_scale) if fmt == "nvfp4"
            else fp4.dequantize_mxfp4(codes, r.scale))  # bf16, what the decompressors return
    mats = [(w, r.packed, r.scale, r.global_scale, mine)] if w.ndim == 2 else [
        (w[e], r.packed[e], r.scale[e], None if r.global_scale is None else r.global_scale[e], mine[e])
        for e in range(w.shape[0])]
    for we, pe, se, gse, de in mats:
        ref = ct_compress(fmt, we)
        assert torch.equal(ref["weight_packed"], pe)
        assert ref["weight_scale"].dtype == se.dtype and torch.equal(bits(ref["weight_scale"]), bits(se))
        if fmt == "nvfp4":
            assert ref["weight_global_scale"].dtype == torch.float32
            assert torch.equal(bits(ref["weight_global_scale"]), bits(gse))
        else:
            assert "weight_global_scale" not in ref
        out = ct_decompress(fmt, pe, se, gse)
        assert out.dtype == de.dtype == torch.bfloat16 and torch.equal(bits(out), bits(de))
    # the cases are really there: zero-group scales, code 8 (negative zero), saturation at 6
    assert (codes == 8).any() and (codes & 7 == 7).any()
    if fmt == "nvfp4":
        s = r.scale.float()
        assert (s == 0.125).any() and ((s > 0) & (s < 2.0**-6)).any()  # zero-group and subnormal scales
