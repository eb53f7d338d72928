"""INT8 weight-only (W8A16, pack-quantized num_bits 8) end to end on a tiny model: RTN, GPTQ and AWQ convert,
compressed-tensors' own decompressor reads what convert wrote back to the source weights, `verify` passes
(format judged by compressed-tensors bit for bit, numerics), and fails when the config says INT4."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from quantkit.convert import ConvertOptions, convert  # noqa: E402
from quantkit.engine.vllm import check as vllm_check  # noqa: E402
from quantkit.quant.int4 import sqnr_db  # noqa: E402
from quantkit.verify import VerifyOptions, verify  # noqa: E402

RECIPE = """\
name: int8-trial
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: {method}
    scheme: {{num_bits: 8, type: int, symmetric: true, strategy: {experts}}}
  attn:
    targets: ['re:.*\\.self_attn\\.(q|k|v|o)_proj$']
    method: rtn
    scheme: {{num_bits: 8, type: int, symmetric: true, strategy: group, group_size: 32}}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""
CAL = dict(num_samples=2, seq_len=16)
SMALL = dict(num_samples=2, seq_len=32, generation_tokens=16)


def _recipe(tmp_path, method="rtn", experts="channel"):
    path = tmp_path / f"int8-{method}-{experts.replace(' ', '').replace(',', '-').replace(':', '')}.yaml"
    path.write_text(RECIPE.format(method=method, experts=experts))
    return str(path)


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _decompressed_by_compressed_tensors(out) -> dict[str, tuple[torch.Tensor, str]]:
    """module -> (the weight compressed-tensors' PackedQuantizationCompressor decompresses, group strategy)."""
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    schemes = {name: QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**g["weights"]))
               for name, g in qc["config_groups"].items()}
    assert {g["weights"]["num_bits"] for g in qc["config_groups"].values()} == {8}
    tensors = _tensors(out)
    res = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        m = name[: -len(".weight_packed")]
        local = {s: tensors[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        assert f"{m}.weight_zero_point" not in tensors
        gname = "group_1" if ".self_attn." in m else "group_0"
        w = PackedQuantizationCompressor.decompress(local, schemes[gname])["weight"]
        res[m] = (w, qc["config_groups"][gname]["weights"]["strategy"])
    return res


def _check_against_source(src, out, n_modules, min_db):
    source = _tensors(src)
    got = _decompressed_by_compressed_tensors(out)
    assert len(got) == n_modules
    for m, (w, _) in got.items():
        ref = source[f"{m}.weight"].float()
        assert tuple(w.shape) == tuple(ref.shape)
        assert float(sqnr_db(ref, w.float())) > min_db, m  # INT4 group 32 gives ~20 dB here: INT8 far more


@pytest.fixture(scope="module")
def rtn_out(tmp_path_factory):
    from quantkit.testing import make_tiny_model

    tmp = tmp_path_factory.mktemp("int8")
    src = make_tiny_model("qwen3_moe", tmp / "src")
    out = tmp / "rtn"
    convert(src, out, ConvertOptions(recipe=_recipe(tmp)))
    return src, out


def test_rtn_convert_decompresses_and_verifies(rtn_out):
    src, out = rtn_out
    _check_against_source(src, out, 2 * (4 * 3 + 4), 38.0)  # 2 layers x (4 experts x 3 + q, k, v, o)
    r = verify(out, VerifyOptions(reference=src, **SMALL))
    assert r.passed, [c for c in r.checks if c.ok is False]
    assert r.format["ok"] and r.format["modules_checked"] == 32 and r.format["judge"].startswith("compressed-tensors")
    labels = {e.get("scheme") for e in json.loads((out / "quantkit_manifest.json").read_text())["tensors"].values()}
    assert {"int8-channel-sym", "int8-g32-sym"} <= labels


def test_config_saying_int4_fails_verify(rtn_out, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(rtn_out[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"]["num_bits"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    r = verify(bad)
    assert not r.format["ok"]
    assert any(".weight_packed: shape" in p and "int4-" in p for p in r.format["problems"]), r.format["problems"][:3]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_convert_decompresses_and_verifies(rtn_out, tmp_path, method):
    """The calibrated passes are num_bits-generic (quant/gptq.py, quant/awq.py); calib/emit.py packs 4 a word."""
    src = rtn_out[0]
    out = tmp_path / method
    convert(src, out, ConvertOptions(recipe=_recipe(tmp_path, method), **CAL))
    if method == "gptq":  # AWQ's experts hold the scaled weights (compared at the model level by verify)
        _check_against_source(src, out, 32, 35.0)
    methods = {e.get("method") for e in json.loads((out / "quantkit_manifest.json").read_text())["tensors"].values()}
    assert method in methods
    r = verify(out)
    assert r.passed and r.format["ok"] and r.format["modules_checked"] == 32


def test_vllm_rules_count_four_codes_a_word(rtn_out, tmp_path):
    """moe_intermediate_size 64 at tp 2 is 32 columns a rank: not a multiple of group_size 64 (rule M4). Read as
    eight codes a word, the packed down_proj would claim 128 (64 a rank) and hide it."""
    out = tmp_path / "g64"
    convert(rtn_out[0], out, ConvertOptions(recipe=_recipe(tmp_path, experts="group, group_size: 64")))
    assert not [p for p in vllm_check(out, tp=1).problems if p["rule"] == "M4"]
    m4 = [p for p in vllm_check(out, tp=2).problems if p["rule"] == "M4"]
    assert m4 and "moe_intermediate_size / tp = 32" in m4[0]["detail"], m4
