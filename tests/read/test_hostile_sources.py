"""Hostile sources and side inputs (issue 26): compressed-tensors source modules checked before anything is
written, implausible KV scales, and the smaller cases (a non-UTF-8 verify.json, a `--kv-scales`
directory). Each case exits 1 with one `error:` line naming the tensor and the rule, nothing that looks
complete, or converts correctly. Hub ids (long ones, hostile refs) are in test_hub.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from quantkit import errors as E
from quantkit.convert import ConvertOptions, convert
from quantkit.read.safetensors import SafetensorsFile
from quantkit.report import build_report
from quantkit.write.writer import write_safetensors

from harness import assert_clean_failure, cli, manifest_status, reference, src18  # noqa: F401

M = "model.layers.0.mlp.experts.0.down_proj"  # the module each tensor case breaks
FP8_EXPERTS = ("name: fp8-experts\ngroups:\n  experts:\n    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']\n"
               "    scheme: {num_bits: 8, type: float, strategy: channel}\n")
ASYM_EXPERTS = ("name: asym\ngroups:\n  experts:\n    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']\n"
                "    scheme: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}\n")


# ---- compressed-tensors sources, and ways to break them -----------------------------------------------
@pytest.fixture(scope="module")
def ct_sources(tiny_models, tmp_path_factory):
    """compressed-tensors checkpoints as sources: the tiny qwen3_moe converted by quantkit (judged by
    compressed-tensors in tests/verify), one per scheme kind."""
    src = tiny_models("qwen3_moe")
    d = tmp_path_factory.mktemp("ct_sources")
    (d / "fp8.yaml").write_text(FP8_EXPERTS)
    (d / "asym.yaml").write_text(ASYM_EXPERTS)
    out = {}
    for kind, recipe in (("int4", "int4-experts-rtn"), ("asym", str(d / "asym.yaml")), ("nvfp4", "nvfp4-experts"),
                         ("mxfp4", "mxfp4-experts"), ("fp8", str(d / "fp8.yaml"))):
        convert(src, d / kind, ConvertOptions(recipe=recipe))
        out[kind] = d / kind
    return out


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def edit_tensors(src: Path, edit) -> None:
    """`edit(tensors)` on the shard holding M's tensors (name -> tensor, mutable; names may be added or
    removed); the shard and the index are rewritten."""
    idx = _index(src)
    shard = next(v for k, v in idx["weight_map"].items() if k.startswith(M + "."))
    with SafetensorsFile(src / shard) as f:
        tensors = {n: f.get(n) for n in f.header.tensors}
    before = set(tensors)
    edit(tensors)
    write_safetensors(src / shard, tensors, metadata={"format": "pt"})
    for n in before - set(tensors):
        del idx["weight_map"][n]
    for n in set(tensors) - before:
        idx["weight_map"][n] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def edit_weights_args(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"].update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def put(suffix, value=None, dtype=None, shape=None):
    """An edit of M's `suffix`: its first element set to `value`, or the whole tensor cast / reshaped."""
    def edit(t):
        name = f"{M}.{suffix}"
        x = t[name].clone()
        if value is not None:
            x.view(-1)[0] = value
        if dtype is not None:
            x = x.to(dtype)
        if shape is not None:
            x = shape(x)
        t[name] = x
    return edit


def set_byte(suffix, byte):
    def edit(t):
        name = f"{M}.{suffix}"
        x = t[name].clone()
        x.view(torch.uint8).view(-1)[0] = byte
        t[name] = x
    return edit


def _weight_shape(t):
    return t[f"{M}.weight_shape"]


CT_CASES = [
    # (id, source kind, config edit, tensor edit, error class, what the message must name)
    ("int4_num_bits_3", "int4", {"num_bits": 3}, None, E.SourceSchemeError, "num_bits"),
    ("int4_num_bits_0", "int4", {"num_bits": 0}, None, E.SourceSchemeError, "num_bits"),
    ("int4_num_bits_str", "int4", {"num_bits": "4"}, None, E.SourceSchemeError, "num_bits"),
    ("int4_group_size_0", "int4", {"group_size": 0}, None, E.SourceSchemeError, "group_size"),
    ("int4_group_size_7", "int4", {"group_size": 7}, None, E.SourceSchemeError, "group_size"),
    ("int4_group_size_neg", "int4", {"group_size": -32}, None, E.SourceSchemeError, "group_size"),
    ("int4_group_size_wrong", "int4", {"group_size": 64}, None, E.SourceTensorError, f"{M}.weight_scale: shape"),
    ("int4_strategy_unknown", "int4", {"strategy": "bogus"}, None, E.SourceSchemeError, "strategy"),
    ("int4_type_float", "int4", {"type": "float"}, None, E.SourceSchemeError, "needs INT4"),
    ("int4_asym_without_zero_points", "int4", {"symmetric": False}, None, E.SourceTensorError,
     f"{M}.weight_zero_point: missing"),
    ("int4_symmetric_str", "int4", {"symmetric": "false"}, None, E.SourceSchemeError, "symmetric"),
    ("int4_zero_points_removed", "asym", None, lambda t: t.pop(f"{M}.weight_zero_point"), E.SourceTensorError,
     f"{M}.weight_zero_point: missing"),
    ("int4_weight_shape_disagrees", "int4", None, lambda t: _weight_shape(t).add_(torch.tensor([0, 8])),
     E.SourceTensorError, f"{M}.weight_packed: shape"),
    ("int4_weight_shape_negative", "int4", None, lambda t: _weight_shape(t).mul_(-1), E.SourceTensorError,
     f"{M}.weight_shape: holds"),
    ("int4_weight_shape_3d", "int4", None, put("weight_shape", shape=lambda x: torch.cat([x, x[:1]])),
     E.SourceTensorError, f"{M}.weight_shape: shape [3]"),
    ("int4_packed_int64", "int4", None, put("weight_packed", dtype=torch.int64), E.SourceTensorError,
     f"{M}.weight_packed: dtype int64"),
    ("int4_packed_1d", "int4", None, put("weight_packed", shape=lambda x: x.reshape(-1)), E.SourceTensorError,
     f"{M}.weight_packed: shape"),
    ("int4_scale_float64", "int4", None, put("weight_scale", dtype=torch.float64), E.SourceTensorError,
     f"{M}.weight_scale: dtype float64"),
    ("int4_scale_nan", "int4", None, put("weight_scale", float("nan")), E.SourceTensorError,
     f"{M}.weight_scale: 1 non-finite"),
    ("int4_scale_inf", "int4", None, put("weight_scale", float("inf")), E.SourceTensorError,
     f"{M}.weight_scale: 1 non-finite"),
    ("int4_scale_zero", "int4", None, put("weight_scale", 0.0), E.SourceTensorError, f"{M}.weight_scale: 1 non-finite"),
    ("int4_scale_1e30", "int4", None, put("weight_scale", 1e30), E.SourceTensorError, f"{M}.weight_scale: a scale of 1e+30"),
    ("nvfp4_global_scale_zero", "nvfp4", None, put("weight_global_scale", 0.0), E.SourceTensorError,
     f"{M}.weight_global_scale"),
    ("nvfp4_global_scale_nan", "nvfp4", None, put("weight_global_scale", float("nan")), E.SourceTensorError,
     f"{M}.weight_global_scale"),
    ("nvfp4_global_scale_negative", "nvfp4", None, put("weight_global_scale", -448.0), E.SourceTensorError,
     f"{M}.weight_global_scale"),
    ("nvfp4_global_scale_tiny", "nvfp4", None, put("weight_global_scale", 1e-30), E.SourceTensorError,
     "past 65504"),
    ("nvfp4_scale_nan", "nvfp4", None, set_byte("weight_scale", 0x7F), E.SourceTensorError, f"{M}.weight_scale: 1 NaN"),
    ("nvfp4_scale_negative", "nvfp4", None, set_byte("weight_scale", 0xB8), E.SourceTensorError,
     f"{M}.weight_scale: 1 NaN or negative"),
    ("nvfp4_group_size_32", "nvfp4", {"group_size": 32}, None, E.SourceSchemeError, "group_size"),
    ("mxfp4_e8m0_255", "mxfp4", None, set_byte("weight_scale", 255), E.SourceTensorError, f"{M}.weight_scale: 1 E8M0"),
    ("mxfp4_e8m0_huge", "mxfp4", None, set_byte("weight_scale", 250), E.SourceTensorError, "past 65504"),
    ("mxfp4_group_size_16", "mxfp4", {"group_size": 16}, None, E.SourceSchemeError, "group_size"),
    ("mxfp4_group_size_7", "mxfp4", {"group_size": 7}, None, E.SourceSchemeError, "group_size"),
    ("mxfp4_global_scale_added", "mxfp4", None, lambda t: t.__setitem__(f"{M}.weight_global_scale", torch.ones(1)),
     E.SourceTensorError, f"{M}.weight_global_scale: present"),
    ("fp8_scale_nan", "fp8", None, put("weight_scale", float("nan")), E.SourceTensorError, f"{M}.weight_scale: 1 non-finite"),
    ("fp8_scale_1e30", "fp8", None, put("weight_scale", 1e30), E.SourceTensorError, f"{M}.weight_scale: a scale"),
    ("fp8_input_scale_nan", "fp8", None, lambda t: t.__setitem__(f"{M}.input_scale", torch.tensor([float("nan")])),
     E.SourceTensorError, f"{M}.input_scale: 1 non-finite"),
    ("fp8_strategy_unknown", "fp8", {"strategy": "tensor_group"}, None, E.SourceSchemeError, "strategy"),
    ("fp8_num_bits_4", "fp8", {"num_bits": 4}, None, E.SourceSchemeError, "FP4 schemes use"),
]


def test_nan_codes_in_a_passed_through_fp8_weight(cli, ct_sources, tmp_path):
    """The FP8 payload is read once, as it is copied: a NaN code there stops convert then (NonFiniteWeight),
    with an in-progress manifest, never a complete one."""
    src = tmp_path / "src"
    shutil.copytree(ct_sources["fp8"], src)
    edit_tensors(src, set_byte("weight", 0x7F))
    r = cli.convert(src, tmp_path / "out", "--recipe", _recipe(ct_sources, "fp8"), "--json")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(("error:", "hint:", "Traceback"))]
    assert r.rc == 1 and r.stdout == "" and lines[-1] == f"hint: {E.NonFiniteWeight.hint}", r.stderr
    assert lines[0].startswith(f"error: {M}.weight: 1 NaN code(s)") and len(lines) == 2, r.stderr
    assert manifest_status(tmp_path / "out") == "in_progress"


def _recipe(ct_sources, kind: str) -> str:
    """A recipe that keeps `kind`'s modules as they are (passed through)."""
    return {"mxfp4": "mxfp4-experts", "nvfp4": "nvfp4-experts",
            "fp8": str(ct_sources["fp8"].parent / "fp8.yaml")}.get(kind, "int4-experts-rtn")


def _module_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in d.glob("*.safetensors"):
        with SafetensorsFile(p) as f:
            out.update({n: f.get(n) for n in f.header.tensors if n.startswith(M + ".")})
    return out


@pytest.mark.parametrize("case,kind,args,edit,expected,names", [pytest.param(*c, id=c[0]) for c in CT_CASES])
def test_hostile_compressed_tensors_source(cli, ct_sources, tmp_path, case, kind, args, edit, expected, names):
    """Each broken source module (pass-through included): the library raises the named class, the message
    names the tensor (or group) and the rule; the CLI exits 1 with that one line within 10 s, and nothing
    in OUT looks complete."""
    src = tmp_path / "src"
    shutil.copytree(ct_sources[kind], src)
    if args:
        edit_weights_args(src, **args)
    if edit:
        edit_tensors(src, edit)
    recipe = _recipe(ct_sources, kind)
    with pytest.raises(expected) as ei:
        convert(src, tmp_path / "lib", ConvertOptions(recipe=recipe))
    msg = ei.value.message
    assert names in msg and "\n" not in msg and len(msg) < 400, msg
    assert manifest_status(tmp_path / "lib") is None  # refused before anything was written
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = cli.convert(src, out, "--recipe", recipe, "--json")
    assert time.perf_counter() - t0 < 10
    line = assert_clean_failure(r, out, ei.value.hint)
    assert line == f"error: {msg}" and "internal error" not in r.stderr


@pytest.mark.parametrize("kind", ["int4", "asym", "nvfp4", "mxfp4", "fp8"])
def test_sound_compressed_tensors_sources_pass(ct_sources, tmp_path, kind):
    """The checks refuse nothing a compressed-tensors writer produces: each source converts, its modules
    passed through bit-exact."""
    recipe = _recipe(ct_sources, kind)
    res = convert(ct_sources[kind], tmp_path / "q", ConvertOptions(recipe=recipe))
    assert manifest_status(tmp_path / "q") == "complete" and res.notes
    src, out = _module_tensors(ct_sources[kind]), _module_tensors(tmp_path / "q")
    assert src.keys() == out.keys() and all(torch.equal(src[n], out[n]) for n in src)


# ---- smaller cases (issue 26, item 7) ---------------------------------------------------------------
def test_non_utf8_verify_json_gets_a_hint_about_verify_json(reference, tmp_path):
    out, _ = reference
    bad = tmp_path / "verify.json"
    bad.write_bytes(b'{"passed": true, "checks": "\xff\xfe"}')
    with pytest.raises(E.ConfigError) as e:
        build_report(out, output=tmp_path / "r.html", verify_json=bad)
    assert "not valid JSON" in e.value.message and "UnicodeDecodeError" in e.value.message
    assert "config.json" not in e.value.hint and "quantkit verify" in e.value.hint


def test_kv_scales_directory_is_called_a_directory(cli, src18, tmp_path):
    d = tmp_path / "scales"
    d.mkdir()
    r = cli.convert(src18, tmp_path / "out", "--kv-scales", d)
    line = assert_clean_failure(r, tmp_path / "out")
    assert "is a directory" in line and "does not exist" not in line, line


def test_a_catastrophic_regex_target_in_a_source_config_is_refused(ct_sources, tmp_path):
    """A source's own quantization_config targets are input: an `re:` pattern that backtracks exponentially
    (here against every module name) is refused by the rule recipes follow (pack/targets.py), at once, not
    evaluated."""
    from quantkit.errors import ConfigError

    src = tmp_path / "src"
    shutil.copytree(ct_sources["int4"], src)
    cfg = json.loads((src / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["targets"] = ["re:(.*)*(.*)*(.*)*(.*)*Z$"] + list(g["targets"])
    (src / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="refused regex") as ei:
        convert(src, tmp_path / "q", ConvertOptions(recipe=_recipe(ct_sources, "int4")))
    assert time.perf_counter() - t0 < 10 and "quantization_config" in ei.value.hint
    assert manifest_status(tmp_path / "q") is None


def test_calibrate_checks_a_compressed_tensors_source_too(ct_sources, tmp_path):
    """`quantkit calibrate` decodes a compressed-tensors source's experts for its forward: a NaN scale is
    refused by the same check convert runs, naming the tensor, before any calibration."""
    from quantkit.calibrate import CalibrateOptions, calibrate

    src = tmp_path / "src"
    shutil.copytree(ct_sources["int4"], src)
    edit_tensors(src, put("weight_scale", value=float("nan")))
    with pytest.raises(E.SourceTensorError, match=f"{M}.weight_scale"):
        calibrate(str(src), CalibrateOptions(num_samples=2, seq_len=16))
    assert not list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_an_int32_weight_shape_converts_and_decodes_as_compressed_tensors_decodes_it(ct_sources, tmp_path, dtype):
    """compressed-tensors reads `weight_shape` as any integer tensor (torch.Size over its values): a source that
    stores it as int32 is accepted, passed through, and every module of the output decodes to what
    compressed-tensors' own decompressor makes of the source."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from quantkit.pack.int4 import dequantize_module

    src = tmp_path / "src"
    shutil.copytree(ct_sources["int4"], src)
    for shard in src.glob("*.safetensors"):
        with SafetensorsFile(shard) as f:
            tensors = {n: f.get(n) for n in f.header.tensors}
        tensors = {n: t.to(dtype) if n.endswith(".weight_shape") else t for n, t in tensors.items()}
        write_safetensors(shard, tensors, metadata={"format": "pt"})
    res = convert(src, tmp_path / "q", ConvertOptions(recipe="int4-experts-rtn"))
    assert manifest_status(tmp_path / "q") == "complete" and res.notes
    weights = next(iter(json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]
                        .values()))["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    src_t, out_t = _all_tensors(src), _all_tensors(tmp_path / "q")
    modules = sorted({n.rsplit(".", 1)[0] for n in src_t if n.endswith(".weight_shape")})
    assert len(modules) >= 8 and all(src_t[f"{m}.weight_shape"].dtype == dtype for m in modules)
    for m in modules:
        local = {k[len(m) + 1:]: v for k, v in src_t.items() if k.startswith(m + ".") and "." not in k[len(m) + 1:]}
        judge = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        ours = dequantize_module({k[len(m) + 1:]: v for k, v in out_t.items() if k.startswith(m + ".")},
                                 dtype=judge.dtype)
        assert torch.equal(ours, judge), m
    from quantkit.verify import verify
    rep = verify(tmp_path / "q")  # integrity and format (compressed-tensors as judge) hold the output too
    assert rep.passed, [c for c in rep.to_json()["checks"] if not c.get("passed")]


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in d.glob("*.safetensors"):
        with SafetensorsFile(p) as f:
            out.update({n: f.get(n) for n in f.header.tensors})
    return out


@pytest.mark.parametrize("kind", ["int4", "asym", "nvfp4", "mxfp4", "fp8"])
@pytest.mark.parametrize("factor", [2, 0.5])
def test_a_config_that_disagrees_with_the_packed_experts_is_refused(cli, ct_sources, tmp_path, kind, factor):
    """config.json's expert width against the experts a compressed-tensors source ships (packed: their logical
    [out, in], INT4's from weight_shape, FP4's two codes a byte; FP8: the weight itself): convert refuses in one
    line naming the field and the tensor, and verify's format stage fails the same checkpoint."""
    src = tmp_path / "src"
    shutil.copytree(ct_sources[kind], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = int(cfg["moe_intermediate_size"] * factor)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(E.ConfigMismatch, match=f"moe_intermediate_size = {cfg['moe_intermediate_size']} contradicts "
                                                r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj"):
        convert(src, tmp_path / "lib", ConvertOptions(recipe=_recipe(ct_sources, kind)))
    out = tmp_path / "out"
    r = cli.convert(src, out, "--recipe", _recipe(ct_sources, kind))
    assert "moe_intermediate_size" in assert_clean_failure(r, out)
    from quantkit.verify import verify
    rep = verify(src)
    fmt = next(c for c in rep.to_json()["checks"] if c["name"] == "format")
    assert not rep.passed and fmt["ok"] is False and "moe_intermediate_size" in fmt["detail"], fmt
