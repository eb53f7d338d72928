"""verify's Judge (compressed-tensors' decompressor): one Judge may judge several checkpoints (a prefill/decode
pair), whose config groups share names like group_0; each must be decompressed with its own scheme."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")

from quantkit.quant.int4 import dequantize, rtn  # noqa: E402
from quantkit.pack.int4 import unpack_int4  # noqa: E402
from quantkit.verify.format import Judge, _Group  # noqa: E402


def _module(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    res = rtn(w, 4, group, True, torch.bfloat16, pack=True)
    local = {"weight_packed": res.q, "weight_scale": res.qparams.scale.to(torch.bfloat16),
             "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}
    own = dequantize(unpack_int4(res.q, w.shape[1]), local["weight_scale"], None, dtype=torch.bfloat16)
    return local, own


def test_groups_with_the_same_name_keep_their_own_schemes():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    judge = Judge()
    assert judge.ct is not None
    for group_size in (32, 64, 32):  # the first scheme must not be reused for the second checkpoint's group_0
        local, own = _module(w, group_size)
        g = _Group("group_0", ("Linear",), {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                            "group_size": group_size}, True)
        got = judge.decompress(local, g)
        assert torch.equal(got.to(torch.bfloat16), own), group_size
