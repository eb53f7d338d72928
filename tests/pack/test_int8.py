"""INT8 weight-only (W8A16) in compressed-tensors `pack-quantized`: four values a word, stored q + 128,
least-significant byte first (pack/int4.py), held to compressed-tensors' own packer and decompressor."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import RecipeError
from quantkit.match.recipe import Scheme, parse_recipe
from quantkit.pack import checks
from quantkit.pack.config import scheme_config
from quantkit.pack.int4 import (dequantize_int4, dequantize_module, pack_int4, pack_int8, pack_ints, unpack_int8,
                                unpack_ints)
from quantkit.pack.layout import int4_module, module_tensors
from quantkit.quant.int4 import rtn

ct = pytest.importorskip("compressed_tensors")

INT8 = "{num_bits: 8, type: int, symmetric: true, strategy: %s}"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_words_hold_bytes_low_first_offset_128():
    # u = q + 128: 1 -> 0x81, -2 -> 0x7E, 127 -> 0xFF, -128 -> 0x00; element 0 in the low byte
    word = pack_int8(torch.tensor([[1, -2, 127, -128]], dtype=torch.int8))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) & 0xFFFFFFFF == 0x00FF7E81
    # a partial last word is padded with u = 0 bytes (q = -128 on unpack, trimmed by the column count)
    assert int(pack_int8(torch.tensor([[0]], dtype=torch.int8))) == 0x80
    assert torch.equal(unpack_int8(word, 4), torch.tensor([[1, -2, 127, -128]], dtype=torch.int8))


@pytest.mark.parametrize("cols", [1, 3, 4, 5, 31, 32, 33, 130])
def test_pack_equals_compressed_tensors(cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.randint(-128, 128, (2, 5, cols), dtype=torch.int8, generator=_gen(cols))
    mine = pack_int8(q)
    assert mine.shape == (2, 5, -(-cols // 4))
    assert torch.equal(mine, pack_to_int32(q, 8))
    assert torch.equal(unpack_int8(mine, cols), q)
    assert torch.equal(unpack_from_int32(mine, 8, q.shape), q)
    assert torch.equal(pack_ints(q, 8), mine) and torch.equal(unpack_ints(mine, cols, 8), q)


def test_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError):
        pack_int8(torch.tensor([[128]]))
    with pytest.raises(TypeError):
        pack_int8(torch.zeros(1, 4))
    with pytest.raises(ValueError):
        unpack_int8(torch.zeros(1, 2, dtype=torch.int32), 4)  # ceil(4/4) = 1 word, not 2
    with pytest.raises(ValueError):
        pack_ints(torch.zeros(1, 4, dtype=torch.int8), 3)


def test_int4_packing_unchanged_through_pack_ints():
    q = torch.randint(-8, 8, (3, 40), dtype=torch.int8, generator=_gen(1))
    assert torch.equal(pack_ints(q, 4), pack_int4(q))


@pytest.mark.parametrize("group_size", [None, 32])
def test_rtn_packs_int8_and_compressed_tensors_decompresses_it_bit_for_bit(group_size):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = (torch.randn(3, 24, 96, generator=_gen(2)) * 0.02).to(torch.bfloat16)
    packed = rtn(w, 8, group_size, True, torch.bfloat16, pack=True)
    plain = rtn(w, 8, group_size, True, torch.bfloat16, pack=False)
    assert packed.q.shape == (3, 24, 24) and torch.equal(packed.q, pack_int8(plain.q))
    assert int(plain.q.min()) >= -128 and int(plain.q.max()) <= 127 and int(plain.q.abs().max()) > 64
    scheme = Scheme(8, "int", True, "group" if group_size else "channel", group_size)
    args = QuantizationArgs(**scheme.weights_config())
    for e in range(3):
        tensors = dict(int4_module("m", packed.q[e], packed.qparams.scale[e], None, (24, 96), scheme, torch.bfloat16))
        local = {k.rsplit(".", 1)[1]: v for k, v in tensors.items()}
        mine = dequantize_module(local, torch.float32, num_bits=8)
        theirs = PackedQuantizationCompressor.decompress(dict(local), QuantizationScheme(targets=["Linear"],
                                                                                          weights=args))["weight"]
        assert torch.equal(theirs, mine.to(theirs.dtype))
        # on the INT8 grid every weight decodes within one step of the source (half a step, plus the clamp
        # of a bf16-rounded scale at the group's absmax)
        step = local["weight_scale"].float().repeat_interleave(group_size or 96, dim=-1)
        assert bool(((mine - w[e].float()).abs() <= step).all())
        # read as INT4 words the same data cannot be taken for the module
        with pytest.raises(ValueError):
            dequantize_module(local, torch.float32)


def test_scheme_rules():
    s = parse_recipe("groups: {e: {targets: [x], scheme: %s}}" % (INT8 % "channel")).groups[0].scheme
    assert (s.num_bits, s.strategy, s.group_size, s.label) == (8, "channel", None, "int8-channel-sym")
    g = Scheme(8, "int", True, "group", 64)
    assert g.label == "int8-g64-sym" and g.format == "pack-quantized"
    assert scheme_config(g)["input_activations"] is None and scheme_config(g)["weights"]["num_bits"] == 8
    assert Scheme.from_weights_config(g.weights_config()) == g
    assert Scheme(8, "int", True, "group", 64, fallback="channel").for_in_features(96) == Scheme(8, "int", True, "channel")
    for bad, why in ((dict(symmetric=False), "symmetric"), (dict(num_bits=6), "num_bits"),
                     (dict(group_size=128, activations="fp8"), "W4AFP8"), (dict(scale_search="mse"), "scale_search")):
        kw = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128} | bad
        with pytest.raises(RecipeError, match=why):
            Scheme(**kw)


def test_layout_and_checks():
    s = Scheme(8, "int", True, "group", 32)
    specs = module_tensors("m", (24, 96), s, torch.bfloat16)
    assert [(n, d, sh) for n, d, sh in specs] == [("m.weight_packed", torch.int32, (24, 24)),
                                                   ("m.weight_scale", torch.bfloat16, (24, 3)),
                                                   ("m.weight_shape", torch.int64, (2,))]
    ch = module_tensors("m", (24, 97), Scheme(8, "int", True, "channel"), torch.float16)
    assert ch[0][2] == (24, 25) and ch[1][1:] == (torch.float16, (24, 1))
    with pytest.raises(ValueError, match="8 bits"):  # INT4 words under an INT8 scheme
        int4_module("m", torch.zeros(24, 12, dtype=torch.int32), torch.ones(24, 3), None, (24, 96), s, torch.bfloat16)
    assert checks.scheme_problem("int4", s.weights_config()) is None
    # the largest decodable weight: 128 codes a side for INT8 (8 for INT4)
    scale = {"weight_scale": torch.full((24, 3), 600.0)}
    assert checks.value_problems("m", "int4", scale) == []
    assert "past 65504" in checks.value_problems("m", "int4", scale, num_bits=8)[0]


def test_dequantize_int8_refuses_zero_points():
    with pytest.raises(ValueError, match="INT4 only"):
        dequantize_int4(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                        shape=(1, 4), num_bits=8)
