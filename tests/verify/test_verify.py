"""`verify` on a tiny converted qwen3_moe: a correct conversion passes; a flipped byte in any shard, a
wrong scale (with the manifest fixed up so only the numerics can see it) and format damage each fail and
name the shard / layer / tensor. Small on purpose: 2 samples x 32 tokens, 16 greedy tokens."""

import hashlib
import json
import random
import shutil

import pytest
import torch

from quantkit.convert import MANIFEST_NAME, ConvertOptions, convert
from quantkit.errors import CheckpointNotFound, QuantkitError
from quantkit.read.checkpoint import INDEX_NAME, Checkpoint
from quantkit.read.safetensors import SafetensorsFile, read_header
from quantkit.write.writer import write_safetensors
from quantkit.testing import make_tiny_model, zero_tensors
from quantkit.verify import Thresholds, VerifyOptions, verify
from quantkit.verify.numerics import token_data as _token_data

CONTRACT = {"passed", "integrity", "format", "metrics", "layers"}
METRICS = {"kl_divergence", "top1_agreement", "perplexity_reference", "perplexity_quantized"}
SMALL = dict(num_samples=2, seq_len=32, generation_tokens=16)
WRONG = "model.layers.1.mlp.experts.2.down_proj"  # the module whose scale the numerics test breaks


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("out") / "q"
    convert(src, out, ConvertOptions(recipe="int4-experts-rtn"))
    return src, out


@pytest.fixture
def copy(converted, tmp_path):
    """A private copy of the converted checkpoint to damage."""
    dst = tmp_path / "q"
    shutil.copytree(converted[1], dst)
    return dst


def _manifest(d):
    return json.loads((d / MANIFEST_NAME).read_text())


def _rewrite_shard(d, shard, edit):
    """Rewrite `shard` with `edit(tensors)` applied, then make the manifest's sha256/size and the index
    agree with it, so that integrity passes and only the other stages can see the change."""
    with SafetensorsFile(d / shard) as f:
        meta = f.header.metadata
        tensors = {n: f.get(n) for n in f.header.tensors}
    edit(tensors)
    write_safetensors(d / shard, tensors, metadata=meta)
    m = _manifest(d)
    for s in m["shards"]:
        if s["name"] == shard:
            s["sha256"] = hashlib.sha256((d / shard).read_bytes()).hexdigest()
            s["size"] = (d / shard).stat().st_size
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    index = json.loads((d / INDEX_NAME).read_text())
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f != shard or t in tensors}
    index["metadata"]["total_size"] = sum(s["size"] for s in m["shards"])
    (d / INDEX_NAME).write_text(json.dumps(index))


def _shard_of(d, tensor):
    return json.loads((d / INDEX_NAME).read_text())["weight_map"][tensor]


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


def test_correct_conversion_passes(converted):
    src, out = converted
    steps = []
    r = verify(out, VerifyOptions(reference=src, **SMALL), progress=steps.append)
    d = r.to_json()
    assert CONTRACT <= set(d) and set(d["metrics"]) == METRICS
    assert set(d["integrity"]) >= {"ok", "mismatches"} and set(d["format"]) >= {"ok", "problems"}
    json.dumps(d, allow_nan=False)  # strict JSON: what `--json` prints
    assert r.passed, [c for c in r.checks if c.ok is False]
    assert d["integrity"] == {**d["integrity"], "ok": True, "mismatches": []}
    assert d["format"]["ok"] and d["format"]["problems"] == [] and d["format"]["modules_checked"] == 24
    assert d["format"]["judge"].startswith("compressed-tensors")
    assert [lay["layer"] for lay in d["layers"]] == [0, 1]
    for lay in d["layers"]:
        assert lay["modules"] == 12 and 15 < lay["min_sqnr_db"] <= lay["mean_sqnr_db"] < 30
    m = d["metrics"]
    assert 0 <= m["kl_divergence"] < Thresholds().max_kl and m["top1_agreement"] >= Thresholds().min_top1
    assert m["perplexity_quantized"] / m["perplexity_reference"] < Thresholds().max_ppl_ratio
    assert d["generation"]["tokens"] == 16 and d["generation"]["agreement"] >= Thresholds().min_generation_agreement
    assert {c["name"] for c in d["checks"]} >= {"integrity", "format", "reference", "weight_sqnr", "sqnr_vs_manifest",
                                                "kl_divergence", "top1_agreement", "perplexity_ratio",
                                                "generation_agreement"}
    assert _check(r, "sqnr_vs_manifest").ok and _check(r, "sqnr_vs_manifest").value < 1e-3
    assert any(s.startswith("integrity") for s in steps) and any(s.startswith("numerics") for s in steps)

    # without a reference: numerics skipped (null metrics), passed rests on integrity + format
    r2 = verify(out, VerifyOptions(**SMALL))
    assert r2.passed and r2.layers == [] and all(v is None for v in r2.metrics.values())
    assert _check(r2, "kl_divergence").ok is None and "reference" in _check(r2, "kl_divergence").detail


def test_flipped_byte_names_the_shard(copy):
    shards = [s["name"] for s in _manifest(copy)["shards"]]
    assert len(shards) >= 3
    rng = random.Random(0)
    for name in shards:
        p = copy / name
        raw = bytearray(p.read_bytes())
        header_end = read_header(p).data_start  # the JSON header is raw[8:header_end]
        # one byte in the tensor data of every shard, plus one in the JSON header of the first
        offsets = [rng.randrange(header_end, len(raw))]
        if name == shards[0]:
            offsets.append(rng.randrange(9, header_end - 1))
        for off in offsets:
            orig = raw[off]
            raw[off] ^= 0x5A
            p.write_bytes(bytes(raw))
            r = verify(copy)  # must not raise, even when the header no longer parses
            assert not r.passed and not r.integrity["ok"]
            assert [x["file"] for x in r.integrity["mismatches"]] == [name], r.integrity["mismatches"]
            assert "sha256" in r.integrity["mismatches"][0]["problem"]
            raw[off] = orig
            p.write_bytes(bytes(raw))
    assert verify(copy).passed


def test_missing_extra_and_unfinished_files(copy):
    shards = [s["name"] for s in _manifest(copy)["shards"]]
    shutil.copy(copy / shards[0], copy / "model-extra.safetensors")
    (copy / shards[1]).unlink()
    m = _manifest(copy)
    m["status"] = "in_progress"
    (copy / MANIFEST_NAME).write_text(json.dumps(m))
    r = verify(copy)
    assert not r.passed
    bad = {x["file"]: x["problem"] for x in r.integrity["mismatches"]}
    assert "missing" in bad[shards[1]] and "extra" in bad["model-extra.safetensors"]
    assert "in_progress" in bad[MANIFEST_NAME]
    assert not r.format["ok"]  # the index names a missing shard: the checkpoint does not open


def test_wrong_scale_fails_numerics_and_names_the_layer(copy, converted):
    src, _ = converted
    _edit_tensors(copy, {f"{WRONG}.weight_scale": lambda t: t * 4})
    assert verify(copy).passed  # integrity and format cannot see it: the manifest was fixed up

    r = verify(copy, VerifyOptions(reference=src, **SMALL))
    assert not r.passed
    assert r.integrity["ok"] and r.format["ok"]
    sq = _check(r, "weight_sqnr")
    assert sq.ok is False and "layer 1" in sq.detail and WRONG in sq.detail and sq.value < Thresholds().min_sqnr_db
    lay = {x["layer"]: x for x in r.layers}
    assert lay[0]["ok"] and not lay[1]["ok"] and lay[1]["worst_module"] == WRONG and lay[1]["min_sqnr_db"] < 0
    drift = _check(r, "sqnr_vs_manifest")
    assert drift.ok is False and WRONG in drift.detail


def test_format_problems_name_the_tensor(copy):
    a, b = "model.layers.0.mlp.experts.1.up_proj", "model.layers.1.mlp.experts.0.gate_proj"
    edited = _edit_tensors(copy, {f"{a}.weight_shape": lambda t: None,  # removed
                                  f"{b}.weight_scale": lambda t: t[:, :2].contiguous()})  # [64, 4] -> [64, 2]
    cfg = json.loads((copy / "config.json").read_text())
    ignored = "model.layers.0.mlp.experts.3.down_proj"
    cfg["quantization_config"]["ignore"].append(ignored)
    (copy / "config.json").write_text(json.dumps(cfg))

    r = verify(copy)
    assert not r.passed and not r.format["ok"]
    problems = r.format["problems"]
    assert f"{a}.weight_shape: missing" in problems
    assert any(p.startswith(f"{b}.weight_scale: shape [64, 2], expected [64, 4]") for p in problems), problems
    assert any(p.startswith(f"{ignored}: quantized") and "ignore" in p for p in problems), problems
    assert len(problems) == 3, problems
    # the manifest's tensor table still describes the old tensors: integrity names the edited shard(s)
    assert not r.integrity["ok"] and {x["file"] for x in r.integrity["mismatches"]} <= edited


def _edit_tensors(d, edits) -> set:
    """Apply {tensor: fn(t) -> new tensor, or None to remove it} shard by shard; return the shards."""
    by_shard = {}
    for name, fn in edits.items():
        by_shard.setdefault(_shard_of(d, name), {})[name] = fn
    for shard, fns in by_shard.items():
        def apply(t, fns=fns):
            for n, fn in fns.items():
                v = fn(t[n])
                if v is None:
                    del t[n]
                else:
                    t[n] = v
        _rewrite_shard(d, shard, apply)
    return set(by_shard)


def test_dataset_and_unusable_input(converted, tmp_path):
    src, out = converted
    with pytest.raises(CheckpointNotFound):
        verify(tmp_path / "nope")
    with pytest.raises(CheckpointNotFound):
        verify(out, VerifyOptions(reference=tmp_path / "nope"))
    with pytest.raises(QuantkitError):
        verify(out, VerifyOptions(kernels="cuda-magic"))
    # a dataset goes through quantkit.calib.data (pre-tokenized rows: no tokenizer needed); models not run here
    ds = tmp_path / "ids.jsonl"
    g = torch.Generator().manual_seed(1)
    ds.write_text("".join(json.dumps({"input_ids": torch.randint(0, 512, (24,), generator=g).tolist()}) + "\n"
                          for _ in range(3)))
    samples, info = _token_data(Checkpoint.open(src), ds, 2, 24, 0)
    assert len(samples) == 2 and all(s.shape == (24,) for s in samples)
    assert info["source"] == str(ds) and info["pretokenized"]
    samples, info = _token_data(Checkpoint.open(src), None, 3, 16, 0)  # no tokenizer: seeded random ids
    assert [s.shape for s in samples] == [(16,)] * 3 and "random" in info["source"]
    assert torch.equal(torch.stack(samples), torch.stack(_token_data(Checkpoint.open(src), None, 3, 16, 0)[0]))


def test_token_data_uses_the_reference_tokenizer(converted, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    ref = tmp_path / "ref"
    shutil.copytree(converted[0], ref)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the a of and to in is it that was for on with as by at"],
                            trainers.WordLevelTrainer(vocab_size=64, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(ref)
    samples, info = _token_data(Checkpoint.open(ref), None, 2, 16, 0)
    assert [s.shape for s in samples] == [(16,), (16,)] and info["tokenizer"] and not info.get("pretokenized")


def test_kv_cache_scheme_needs_scales(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (copy / "config.json").write_text(json.dumps(cfg))
    r = verify(copy)
    assert not r.passed and r.integrity["ok"]
    assert r.format["problems"] == [f"model.layers.{i}.self_attn.{k}_scale: missing (kv_cache_scheme is set)"
                                    for i in range(2) for k in "kv"]


def test_thresholds_overrides():
    t = Thresholds()
    assert [name for name, _, _ in Thresholds.options()] == ["max_kl", "min_top1", "max_ppl_ratio", "min_sqnr_db",
                                                             "max_sqnr_drift_db", "min_generation_agreement"]
    t2 = t.with_overrides(max_kl=0.5, min_top1=None)
    assert t2.max_kl == 0.5 and t2.min_top1 == t.min_top1
    with pytest.raises(QuantkitError, match="unknown threshold"):
        t.with_overrides(max_kld=1.0)
    with pytest.raises(QuantkitError):
        Thresholds(min_top1=1.5)
    with pytest.raises(QuantkitError):
        Thresholds(max_kl=float("nan"))


def test_outputs_transformers_cannot_load_are_measured_on_the_dequantized_reference(converted, tmp_path):
    """A KV-scales-only config stops transformers' MoE expert converter, so the model-level checks run on the
    reference model with the output's weights: here the reference's own (KL exactly 0). With FP8 modules
    (glm recipe) the dequantized model carries their FP8 values, not the reference's."""
    from quantkit.quant import fp8
    from quantkit.verify.numerics import load_dequantized, transformers_cannot_load

    src, _ = converted
    kv = tmp_path / "kv"
    convert(src, kv, ConvertOptions(recipe="fp8-kv", num_samples=2, seq_len=16))
    assert transformers_cannot_load(kv)
    rep = verify(kv, VerifyOptions(reference=src, **SMALL))
    assert rep.passed, rep.failed_checks()
    assert rep.metrics["kl_divergence"] == 0.0
    glm = tmp_path / "glm"
    convert(src, glm, ConvertOptions(recipe="glm"))
    model = load_dequantized(src, glm, torch.device("cpu"), torch.float32)
    ck = Checkpoint.open(glm)
    m = "model.layers.0.self_attn.o_proj"
    with SafetensorsFile(glm / ck.location[m + ".weight"]) as f:
        q = f.get(m + ".weight")
    with SafetensorsFile(glm / ck.location[m + ".weight_scale"]) as f:
        s = f.get(m + ".weight_scale")
    want = fp8.dequantize(q, s, fp8.FP8Layout("block", (128, 128)))
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight.data, want)


EXPERT_RECIPE = """name: experts
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: rtn
    scheme: {scheme}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


@pytest.mark.parametrize("scheme, inter", [
    ("{num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}", None),
    ("{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64, fallback: 32}", 96),
])
def test_expert_layouts_transformers_cannot_load_are_verified(tmp_path, scheme, inter):
    """Asymmetric INT4 experts (a weight_zero_point) and experts whose down_proj took a group-size fallback
    stop transformers' expert converter (docs/format.md). verify measures them on the reference model with the
    dequantized weights and passes; before, every model-level check failed with "transformers cannot load"."""
    from quantkit.match.recipe import parse_recipe
    from quantkit.verify.numerics import transformers_cannot_load

    src = make_tiny_model("qwen3_moe", tmp_path / "src", **({"moe_intermediate": inter} if inter else {}))
    out = tmp_path / "q"
    convert(src, out, ConvertOptions(recipe=parse_recipe(EXPERT_RECIPE.format(scheme=scheme))))
    assert transformers_cannot_load(out)
    rep = verify(out, VerifyOptions(reference=src, **SMALL))
    assert rep.passed, rep.failed_checks()
    assert 0 < rep.metrics["kl_divergence"] < 0.05


def test_an_all_zero_expert_weight_is_an_exact_match(tmp_path):
    """An all-zero expert projection quantizes to zero: its SQNR is 0/0 (nan) at conversion and at verify
    (capped like an exact match), which the drift check used to compare as nan != nan and fail."""
    src = make_tiny_model("qwen3_moe", tmp_path / "src")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    zero_tensors(src, [name])
    out = tmp_path / "q"
    convert(src, out, ConvertOptions(recipe="int4-experts-rtn"))
    db = _manifest(out)["tensors"][name[:-len("weight")] + "weight_packed"]["sqnr_db"]
    assert db != db  # nan as recorded
    rep = verify(out, VerifyOptions(reference=src, **SMALL))
    assert rep.passed, rep.failed_checks()
    assert _check(rep, "sqnr_vs_manifest").ok is True


def test_one_scheme_symmetric_experts_load_in_transformers(converted):
    """The common case stays on transformers' own loader: symmetric INT4 experts of one scheme."""
    from quantkit.verify.numerics import transformers_cannot_load

    assert not transformers_cannot_load(converted[1])


def test_a_reference_of_the_same_shape_but_other_weights_is_named(converted, tmp_path):
    """Issue 26: the same model with another seed has the source's shard names, sizes and config.json. verify
    names the reference as not the source (from the SQNR the manifest recorded per module), and blames no
    number on the quantization."""
    src, out = converted
    other = make_tiny_model("qwen3_moe", tmp_path / "other", seed=1)
    assert (other / "config.json").read_bytes() == (src / "config.json").read_bytes()
    r = verify(out, VerifyOptions(reference=other, **SMALL))
    assert not r.passed and r.integrity["ok"] and r.format["ok"]
    ref = _check(r, "reference")
    assert ref.ok is False and "not the source" in ref.detail and "another model of the same shape" in ref.detail
    for name in ("weight_sqnr", "sqnr_vs_manifest", "kl_divergence", "top1_agreement"):
        c = _check(r, name)
        assert c.ok is None and "not the source" in c.detail, (name, c)
    assert [c.name for c in r.failed_checks()] == ["reference"]
