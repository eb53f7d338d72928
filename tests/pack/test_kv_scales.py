"""`convert --kv-scales FILE`: FP8 KV-cache scales shipped in the output.

A hand-made scales file (float32 `model.layers.L.self_attn.{k,v}_scale`, shape [1] for strategy tensor
or [num_kv_heads, 1, 1] for attn_head) is validated against the source model, written as the extra
shard `model-kv-scales.safetensors` (layer by layer, k before v), indexed, declared as `kv_cache_scheme`
in config.json and recorded in the manifest. transformers must load the result. (transformers 5.24 with
compressed-tensors 0.20.1 does not apply a kv_cache_scheme — compressed-tensors looks for a
`past_key_values` forward argument that transformers 5 renamed `cache` — so it reports the scales as
unexpected keys and runs BF16 attention; the test accepts that or, on a stack that applies them, checks
it holds our values.)
"""

import hashlib
import json

import pytest
import torch

import quantkit.convert.calibrated as qconvert
from quantkit import options
from quantkit.convert import MANIFEST_NAME, ConvertOptions, convert
from quantkit.pack.kv import KV_SHARD_NAME
from quantkit.errors import CalibrationNeeded, KVScalesError
from quantkit.inspect import inspect_checkpoint
from quantkit.read.checkpoint import INDEX_NAME, Checkpoint
from quantkit.read.safetensors import SafetensorsFile
from quantkit.write.writer import write_safetensors
from quantkit.match.recipe import parse_recipe
from quantkit.testing import load_model, make_tiny_model, quiet_transformers

LAYERS, KV_HEADS = 2, 2  # the tiny qwen3_moe: 2 layers, num_key_value_heads 2


def scales(shape=(1,), layers=LAYERS, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(layers):
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.full(shape, 0.01 * (layer + 1), dtype=dtype)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.full(shape, 0.002 * (layer + 1), dtype=dtype)
    return out


def save(tmp_path, sc, name="kv.safetensors") -> str:
    p = tmp_path / name
    write_safetensors(p, sc)
    return str(p)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("kvsrc"))


@pytest.fixture(scope="module")
def plain(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "q"
    convert(src, out, ConvertOptions())
    return out


def test_kv_scales_written_and_loaded(src, plain, tmp_path):
    sc = scales()
    kv_file = save(tmp_path, sc)
    out = tmp_path / "q"
    res = convert(src, out, ConvertOptions(kv_scales=kv_file))
    # the extra shard: exactly the scales, in layer order, float32
    with SafetensorsFile(out / KV_SHARD_NAME) as f:
        names = [f"model.layers.{layer}.self_attn.{kv}_scale" for layer in range(LAYERS) for kv in "kv"]
        assert list(f.header.tensors) == names
        for n, t in sc.items():
            assert torch.equal(f.get(n), t)
    index = json.loads((out / INDEX_NAME).read_text())
    assert all(index["weight_map"][n] == KV_SHARD_NAME for n in sc)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
    # every other tensor is what the conversion without scales wrote
    a, b = Checkpoint.open(out), Checkpoint.open(plain)
    assert set(a.location) - set(b.location) == set(sc)
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["kv_cache"]["strategy"] == "tensor" and m["kv_cache"]["tensors"] == 4
    assert m["kv_cache"]["origin"]["sha256"] == hashlib.sha256(open(kv_file, "rb").read()).hexdigest()
    kv_shard = next(s for s in m["shards"] if s["name"] == KV_SHARD_NAME)
    assert kv_shard["sha256"] == hashlib.sha256((out / KV_SHARD_NAME).read_bytes()).hexdigest()
    assert m["tensors"]["model.layers.0.self_attn.k_scale"]["shard"] == KV_SHARD_NAME
    assert res.tensors_total == len(a.location)
    assert inspect_checkpoint(out)["schemes"]["kv-scales"]["tensors"] == 4

    # transformers loads it
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, output_loading_info=True)
    params = dict(model.named_parameters())
    if "model.layers.0.self_attn.k_scale" in params:  # a stack that applies kv_cache_scheme
        for n, t in sc.items():
            assert torch.equal(params[n].float().reshape(t.shape), t)
    else:  # transformers 5.24 + compressed-tensors 0.20.1: ignored, reported
        assert set(sc) <= set(info["unexpected_keys"])
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, load_model(plain, torch.bfloat16).eval()(ids).logits)


def test_attn_head_scales_and_determinism(src, tmp_path):
    kv_file = save(tmp_path, scales((KV_HEADS, 1, 1)))
    convert(src, tmp_path / "a", ConvertOptions(kv_scales=kv_file))
    convert(src, tmp_path / "b", ConvertOptions(kv_scales=kv_file, workers=2))
    qc = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head"
    for name in (KV_SHARD_NAME, INDEX_NAME, "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    load_model(tmp_path / "a", torch.bfloat16)  # loads


def _drop(sc, name):
    sc = dict(sc)
    del sc[name]
    return sc


@pytest.mark.parametrize("make,match", [
    (lambda: {**scales(), "model.layers.0.self_attn.q_scale": torch.ones(1)}, "unexpected tensor"),
    (lambda: {**scales(), "model.layers.0.mlp.k_scale": torch.ones(1)}, "unexpected tensor"),
    (lambda: scales(layers=3), "layer 2 does not exist"),
    (lambda: _drop(scales(), "model.layers.1.self_attn.v_scale"), "1 KV scale.*missing.*layers.1.self_attn.v_scale"),
    (lambda: scales((3,)), r"shape \[3\]"),
    (lambda: scales((4, 1, 1)), r"num_key_value_heads = 2"),
    (lambda: scales(dtype=torch.float16), "must be float32"),
    (lambda: {**scales(), "model.layers.0.self_attn.k_scale": torch.tensor([-1.0])}, "positive finite"),
    (lambda: {**scales(), "model.layers.0.self_attn.k_scale": torch.ones(2, 1, 1)}, "mix shapes"),
    # implausible (issue 26): 1e38 rounds every K to 0 in FP8, 1e-45 (subnormal) saturates every K
    (lambda: {**scales(), "model.layers.0.self_attn.k_scale": torch.tensor([1e38])}, "k_scale holds 1e.38.*past 65504"),
    (lambda: {**scales(), "model.layers.1.self_attn.v_scale": torch.tensor([147.0])}, "v_scale holds 147.*past 65504"),
    (lambda: {**scales(), "model.layers.0.self_attn.k_scale": torch.tensor([1e-45])}, "smallest normal"),
])
def test_bad_scales_refused_before_writing(src, tmp_path, make, match):
    kv_file = save(tmp_path, make())
    with pytest.raises(KVScalesError, match=match):
        convert(src, tmp_path / "q", ConvertOptions(kv_scales=kv_file))
    assert not (tmp_path / "q").exists()


KV_RECIPE = """name: kv
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    scheme: {group_size: 32}
kv_cache: {strategy: tensor}
calibration: {num_samples: 8, seq_len: 16}
"""


def test_recipe_strategy_must_match(src, tmp_path):
    with pytest.raises(KVScalesError, match="kv_cache.strategy is 'tensor'.*per attn_head"):
        convert(src, tmp_path / "q", ConvertOptions(recipe=parse_recipe(KV_RECIPE),
                                                    kv_scales=save(tmp_path, scales((KV_HEADS, 1, 1)))))


def test_kv_recipe_without_scales_needs_calibration(src, tmp_path, monkeypatch):
    monkeypatch.setattr(qconvert, "_find_calibrate", lambda: None)
    with pytest.raises(CalibrationNeeded) as ei:
        convert(src, tmp_path / "q", ConvertOptions(recipe=parse_recipe(KV_RECIPE)))
    assert "calibration" in ei.value.message and "quantkit calibrate" in ei.value.hint
    assert "--kv-scales" in ei.value.hint
    assert not (tmp_path / "q").exists()


def test_kv_recipe_calls_calibrate(src, tmp_path, monkeypatch):
    calls = []

    class Result:
        def __init__(self, s):
            self.scales = s

    def fake_calibrate(model_dir, opts):
        calls.append((model_dir, opts.dataset, opts.num_samples, opts.seq_len, opts.strategy, opts.device, opts.dtype))
        return Result(scales())

    monkeypatch.setattr(qconvert, "_find_calibrate", lambda: fake_calibrate)
    convert(src, tmp_path / "q", ConvertOptions(recipe=parse_recipe(KV_RECIPE)))
    # the convert's calibration device and compute dtype
    assert calls == [(str(src), None, 8, 16, "tensor", options.DEVICE, options.COMPUTE_DTYPE)]
    m = json.loads((tmp_path / "q" / MANIFEST_NAME).read_text())
    assert m["kv_cache"]["origin"] == {"calibrate": {"dataset": None, "num_samples": 8, "seq_len": 16}}


def test_source_scales_kept_or_replaced(src, tmp_path):
    convert(src, tmp_path / "a", ConvertOptions(kv_scales=save(tmp_path, scales())))
    # re-converting a checkpoint with scales keeps them and their scheme...
    res = convert(tmp_path / "a", tmp_path / "b", ConvertOptions())
    qc = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor" and not any("KV" in n for n in res.notes)
    # ...unless new ones are given, which replace them
    new = {n: t * 2 for n, t in scales().items()}
    res = convert(tmp_path / "a", tmp_path / "c", ConvertOptions(kv_scales=save(tmp_path, new, "new.safetensors")))
    assert any("4 KV-cache scale tensor(s) of the source replaced" in n for n in res.notes)
    with SafetensorsFile(tmp_path / "c" / KV_SHARD_NAME) as f:
        assert all(torch.equal(f.get(n), t) for n, t in new.items())


def test_mla_rejects_per_head_scales(tmp_path):
    ds = make_tiny_model("deepseek_v3", tmp_path / "ds")
    with pytest.raises(KVScalesError, match="MLA"):
        convert(ds, tmp_path / "q", ConvertOptions(kv_scales=save(tmp_path, scales((4, 1, 1)))))
    convert(ds, tmp_path / "ok", ConvertOptions(kv_scales=save(tmp_path, scales(), "t.safetensors")))


def test_mla_single_head_scales_become_per_tensor(tmp_path):
    """calibrate --strategy attn_head on an MLA model writes [1, 1, 1] (the latent has one "head");
    convert ships them as the per-tensor scales engines load for MLA."""
    import json

    from quantkit.calibrate import CalibrateOptions, calibrate, write_scales
    from quantkit.convert import ConvertOptions, convert
    from quantkit.read.checkpoint import Checkpoint
    from quantkit.read.safetensors import SafetensorsFile
    from quantkit.testing import make_tiny_model

    src = make_tiny_model("deepseek_v3", tmp_path / "src")
    res = calibrate(src, CalibrateOptions(num_samples=2, seq_len=32, strategy="attn_head"))
    assert all(tuple(t.shape) == (1, 1, 1) for t in res.scales.values())
    write_scales(res, tmp_path / "kv.safetensors")
    convert(src, tmp_path / "q", ConvertOptions(kv_scales=str(tmp_path / "kv.safetensors")))
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    ck = Checkpoint.open(tmp_path / "q")
    name = "model.layers.0.self_attn.k_scale"
    with SafetensorsFile(ck.shard(ck.location[name]).header) as f:
        t = f.get(name)
    assert tuple(t.shape) == (1,) and t.item() == res.scales[name].item()


def test_tiny_scales_are_kept_with_a_note(src, tmp_path):
    """Plausible but tiny (a head that never activates gets float32's smallest normal from calibrate): kept, and
    a note says so; the largest plausible scale (cached values up to 65504) is kept silently."""
    sc = {**scales(), "model.layers.0.self_attn.k_scale": torch.tensor([torch.finfo(torch.float32).tiny]),
          "model.layers.1.self_attn.k_scale": torch.tensor([65504.0 / 448])}
    res = convert(src, tmp_path / "q", ConvertOptions(kv_scales=save(tmp_path, sc)))
    notes = [n for n in res.notes if "tiny" in n]
    assert len(notes) == 1 and "1 KV scale(s)" in notes[0] and "layers.0.self_attn.k_scale" in notes[0]


@pytest.mark.parametrize("value,match", [(1e38, "past 65504"), (float("nan"), "positive finite"),
                                         (1e-45, "smallest normal")])
def test_source_kv_scales_are_held_to_the_same_rules(src, tmp_path, value, match):
    """A source's own KV scales (kept when no new ones are given) are checked like a --kv-scales file."""
    convert(src, tmp_path / "a", ConvertOptions(kv_scales=save(tmp_path, scales())))
    p = tmp_path / "a" / KV_SHARD_NAME
    with SafetensorsFile(p) as f:
        t = {n: f.get(n) for n in f.header.tensors}
    t["model.layers.1.self_attn.k_scale"] = torch.tensor([value])
    write_safetensors(p, t)
    with pytest.raises(KVScalesError, match=f"the source's model.layers.1.self_attn.k_scale.*{match}"):
        convert(tmp_path / "a", tmp_path / "b", ConvertOptions())
    assert not (tmp_path / "b").exists()
    convert(tmp_path / "a", tmp_path / "c", ConvertOptions(kv_scales=save(tmp_path, scales(), "new.safetensors")))


def test_calibrate_never_writes_implausible_scales(tmp_path):
    from types import SimpleNamespace

    from quantkit.calibrate import write_scales

    bad = SimpleNamespace(scales={**scales(), "model.layers.0.self_attn.v_scale": torch.tensor([1e30])})
    with pytest.raises(KVScalesError, match="calibration gave model.layers.0.self_attn.v_scale holds 1e.30"):
        write_scales(bad, tmp_path / "kv.safetensors")
    assert not list(tmp_path.iterdir())
