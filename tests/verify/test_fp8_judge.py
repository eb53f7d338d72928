"""`verify` on FP8 (`float-quantized`) modules: the format stage resolves each one to its config group,
checks its weight / weight_scale against the group's strategy, has compressed-tensors' own float-quantized
compressor decompress it (bit for bit against quantkit's q.float() * scale), and measures its weight SQNR.

Outputs: the `glm` recipe on a tiny glm4_moe (INT4 experts, FP8 block 128x128 and per-channel elsewhere), an
FP8-only recipe (per-tensor and per-channel), and a block-FP8 deepseek_v3 converted with int4-experts-rtn
(its FP8 modules passed through). Mutants each fail and name the module."""

import json
import shutil

import pytest
import torch

from quantkit.convert import MANIFEST_NAME, ConvertOptions, convert
from quantkit.match.recipe import parse_recipe
from quantkit.read.checkpoint import Checkpoint
from quantkit.testing import make_tiny_model, write_block_fp8_checkpoint
from quantkit.verify import Thresholds, VerifyOptions, verify
from quantkit.verify import format as vformat
from quantkit.verify.common import SQNR_CAP_DB, Listing

from .test_verify import _edit_tensors

SMALL = dict(num_samples=2, seq_len=32, generation_tokens=8)
ODD_DIMS = dict(hidden=160, q_lora_rank=96, kv_lora_rank=48, moe_intermediate=96)  # partial FP8 blocks
O0, O1 = "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"  # glm: fp8-block128x128, exact names
Q0 = "model.layers.0.self_attn.q_proj"  # glm: fp8-channel (fused qkv rows rule), a re: target


def _fp8_modules(d) -> list[str]:
    ck = Checkpoint.open(d)
    return sorted(n[: -len(".weight")] for n in ck.location
                  if n.endswith(".weight") and ck.info(n).dtype == torch.float8_e4m3fn)


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    src = make_tiny_model("glm4_moe", root / "src")
    convert(src, root / "q", ConvertOptions(recipe="glm"))
    return src, root / "q"


@pytest.fixture
def glm_copy(glm, tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(glm[1], dst)
    return dst


def _edit_config(d, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def test_glm_output_passes_and_its_fp8_modules_are_judged(glm, monkeypatch):
    src, out = glm
    fp8 = _fp8_modules(out)
    assert len(fp8) == 14  # attention x 2 layers, the dense MLP (layer 0), the shared expert (layer 1)
    judged = []
    decompress = vformat.Judge.decompress

    def spy(self, local, group):
        theirs = decompress(self, local, group)
        if group.format == "float-quantized":
            assert theirs is not None and theirs.dtype == torch.float32
            judged.append(group.label)
        return theirs

    monkeypatch.setattr(vformat.Judge, "decompress", spy)
    r = verify(out, VerifyOptions(reference=src, **SMALL))
    assert r.passed, r.failed_checks()
    assert r.format["ok"] and r.format["judge"].startswith("compressed-tensors")
    assert r.format["modules_checked"] == 12 + 14  # INT4 experts + FP8 modules
    assert sorted(judged) == ["fp8-block128x128"] * 5 + ["fp8-channel"] * 9  # every FP8 module, once
    # every FP8 module has an SQNR: layer 0 holds FP8 modules only (attention, dense MLP)
    lay = {x["layer"]: x for x in r.layers}
    assert lay[0]["modules"] == 7 and lay[1]["modules"] == 12 + 4 + 3
    assert 25 < lay[0]["min_sqnr_db"] < 40 and lay[0]["ok"] and lay[1]["ok"]
    sq = _check(r, "weight_sqnr")
    assert sq.ok and sq.detail.startswith("26 modules")
    drift = _check(r, "sqnr_vs_manifest")  # convert recorded the FP8 SQNR too: the same value, remeasured
    assert drift.ok and drift.detail.startswith("26 modules") and drift.value < 1e-3


def test_fp8_only_output_per_tensor_and_channel(glm, tmp_path):
    """No packed module at all (top-level format float-quantized): the FP8 modules are still judged."""
    src, _ = glm
    recipe = parse_recipe("name: f\ngroups:\n"
                          "  attn:\n    targets: ['re:.*self_attn\\.(q|k|v|o)_proj$']\n"
                          "    scheme: {num_bits: 8, type: float, strategy: tensor}\n"
                          "  mlp:\n    targets: ['re:.*mlp\\.(shared_experts\\.)?(gate|up|down)_proj$']\n"
                          "    scheme: {num_bits: 8, type: float, strategy: channel}\n")
    out = tmp_path / "q"
    res = convert(src, out, ConvertOptions(recipe=recipe))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized" and res.tensors_quantized == 14
    ck = Checkpoint.open(out)
    assert ck.info(f"{O0}.weight_scale").shape == (1,)
    r = verify(out)
    assert r.passed and r.format["modules_checked"] == 14, r.format
    # a per-tensor scale of 0 is refused (the scale must be positive)
    _edit_tensors(out, {f"{O0}.weight_scale": lambda t: t * 0})
    assert verify(out).format["problems"] == [f"{O0}.weight_scale: 1 non-finite or non-positive value(s)"]


def test_block_fp8_source_passed_through(tmp_path):
    """A block-FP8 release converted with int4-experts-rtn keeps its FP8 modules (weight_scale_inv renamed
    weight_scale): judged like any other, and exact against the FP8 reference (SQNR at the cap)."""
    bf16 = make_tiny_model("deepseek_v3", tmp_path / "bf16", **ODD_DIMS)
    write_block_fp8_checkpoint(bf16, tmp_path / "fp8")
    out = tmp_path / "q"
    convert(tmp_path / "fp8", out, ConvertOptions(recipe="int4-experts-rtn"))
    kept = _fp8_modules(out)
    assert kept == [O0, O1]  # K = 128; the others have a partial block along K and are written BF16
    man = json.loads((out / MANIFEST_NAME).read_text())
    assert all(man["tensors"][f"{m}.weight"]["method"] == "passthrough" for m in kept)
    r = verify(out)
    assert r.passed and r.format["modules_checked"] == 12 + 2, r.format
    # the SQNR pass itself, against the FP8 reference
    problems, sqnr, drift = Listing(), {}, []
    n = vformat.tensor_pass(Checkpoint.open(out), man, Checkpoint.open(tmp_path / "fp8"), vformat.Judge(),
                            vformat.Findings(problems, sqnr, drift), say=lambda _s: None)
    assert n == 14 and len(problems) == 0, problems.items
    assert all(sqnr[m] == SQNR_CAP_DB for m in kept)  # passed through bit-exact: decoded, identical
    assert all(15 < v < 30 for m, v in sqnr.items() if m not in kept)
    # doubled scale of a passed-through module: the judge still agrees (it reads the same scale), the SQNR does not
    _edit_tensors(out, {f"{O1}.weight_scale": lambda t: t * 2})
    sqnr = {}
    vformat.tensor_pass(Checkpoint.open(out), man, Checkpoint.open(tmp_path / "fp8"), vformat.Judge(),
                        vformat.Findings(problems, sqnr, []), say=lambda _s: None)
    assert len(problems) == 0 and sqnr[O0] == SQNR_CAP_DB and abs(sqnr[O1]) < 0.5


def test_wrong_scale_shape_names_the_module(glm_copy):
    edited = _edit_tensors(glm_copy, {f"{Q0}.weight_scale": lambda t: t[:64].contiguous(),  # [128, 1] -> [64, 1]
                                      f"{O1}.weight_scale": lambda t: t.repeat(2, 1)})  # [1, 1] -> [2, 1]
    r = verify(glm_copy)
    assert not r.passed and not r.format["ok"]
    assert r.format["problems"] == [
        f"{Q0}.weight_scale: shape [64, 1], expected [128, 1] for weight [128, 128] under group_1 (fp8-channel)",
        f"{O1}.weight_scale: shape [2, 1], expected [1, 1] for weight [128, 128] under group_2 (fp8-block128x128)"]
    # the manifest's tensor table still records the old shapes: integrity names the edited shard(s)
    assert {x["file"] for x in r.integrity["mismatches"]} <= edited


def test_doubled_scale_fails_the_numerics(glm, glm_copy):
    src, _ = glm
    _edit_tensors(glm_copy, {f"{O0}.weight_scale": lambda t: t * 2})
    assert verify(glm_copy).passed  # a valid FP8 module that compressed-tensors decodes as we do
    r = verify(glm_copy, VerifyOptions(reference=src, **SMALL))
    assert not r.passed and r.integrity["ok"] and r.format["ok"]
    sq = _check(r, "weight_sqnr")
    assert sq.ok is False and "layer 0" in sq.detail and O0 in sq.detail and sq.value < Thresholds().min_sqnr_db
    lay = {x["layer"]: x for x in r.layers}
    assert not lay[0]["ok"] and lay[0]["worst_module"] == O0 and abs(lay[0]["min_sqnr_db"]) < 0.5 and lay[1]["ok"]
    drift = _check(r, "sqnr_vs_manifest")
    assert drift.ok is False and O0 in drift.detail


def test_judge_disagreement_names_the_module(glm, monkeypatch):
    """The bit-for-bit comparison is live: quantkit's dequantization off by one ulp in one element of each
    FP8 module is found in every FP8 module, and only there."""
    real = vformat.fp8_dequantize

    def off_by_one_ulp(q, scale, layout, dtype=torch.float32, out=None):
        w = real(q, scale, layout, dtype, out)
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
        return w

    monkeypatch.setattr(vformat, "fp8_dequantize", off_by_one_ulp)
    r = verify(glm[1])
    assert not r.format["ok"]
    named = sorted(p.split(":")[0] for p in r.format["problems"])
    assert named == _fp8_modules(glm[1])
    assert all("compressed-tensors decompresses it differently from quantkit" in p for p in r.format["problems"])


@pytest.mark.parametrize("mutant", ["untargeted", "ignored", "int4_group"])
def test_fp8_module_outside_the_fp8_groups_names_it(glm_copy, mutant):
    def edit(qc):
        groups = qc["config_groups"]
        assert O0 in groups["group_2"]["targets"] and groups["group_0"]["format"] == "pack-quantized"
        if mutant == "ignored":
            qc["ignore"].append(O0)
            return
        groups["group_2"]["targets"].remove(O0)  # no group targets it: no ["Linear"] group in this config
        if mutant == "int4_group":
            groups["group_0"]["targets"].append(O0)

    _edit_config(glm_copy, edit)
    r = verify(glm_copy)
    assert not r.passed and r.integrity["ok"] and not r.format["ok"]
    want = {"untargeted": f"{O0}: has an FP8 weight (float8_e4m3fn) but no config group targets it",
            "ignored": f"{O0}: stored FP8 (a float8 weight) but listed in quantization_config.ignore (loaders "
                       "would read the float8 codes as an unquantized weight)",
            "int4_group": f"{O0}: has an FP8 weight (float8_e4m3fn), but the config group that targets it, group_0, "
                          "is pack-quantized (int4-g32-sym), not float-quantized (FP8)"}[mutant]
    assert r.format["problems"] == [want]


def test_awq_scaled_shared_expert_is_left_to_the_model_level(glm):
    """Where AWQ changed a layer's post-attention norm (manifest `modified_by: awq`), the shared expert's
    gate/up were quantized from W * s (the norm scale compensated there): their stored weights are not the
    reference's, so their SQNR is not measured (the model-level metrics judge them, as AWQ modules); the
    shared down_proj, which does not read the norm, still is."""
    src, out = glm
    man = json.loads((out / MANIFEST_NAME).read_text())
    shared = [f"model.layers.1.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")]

    def measured(manifest):
        problems, sqnr, drift = Listing(), {}, []
        vformat.tensor_pass(Checkpoint.open(out), manifest, Checkpoint.open(src), vformat.Judge(),
                            vformat.Findings(problems, sqnr, drift), say=lambda _s: None)
        assert len(problems) == 0, problems.items
        return {m for m in shared if m in sqnr}, {m for m, _, _ in drift if m in shared}

    assert measured(man) == (set(shared), set(shared))
    man["tensors"]["model.layers.1.post_attention_layernorm.weight"]["modified_by"] = "awq"
    assert measured(man) == ({shared[2]}, {shared[2]})


def test_verify_against_a_block_fp8_release(tmp_path):
    """The whole verify, numerics included, with the FP8 release as the reference: transformers loads it
    through accelerate (a dependency). Whole 128-blocks here, as the releases have (transformers, like
    vLLM, cannot load a release with partial blocks in a merged layer)."""
    bf16 = make_tiny_model("deepseek_v3", tmp_path / "bf16")
    write_block_fp8_checkpoint(bf16, tmp_path / "fp8")
    out = tmp_path / "q"
    convert(tmp_path / "fp8", out, ConvertOptions(recipe="int4-experts-rtn"))
    rep = verify(out, VerifyOptions(reference=tmp_path / "fp8", num_samples=2, seq_len=16, generation_tokens=0))
    assert rep.passed, rep.failed_checks()
    assert 0 < rep.metrics["kl_divergence"] < 0.05
    assert rep.format["modules_checked"] > len([m for m in _fp8_modules(out)])  # INT4 experts and FP8 kept
