"""Calibration of GLM-5 (`glm_moe_dsa`: MLA plus the DSA indexer) and of Kimi K2.5 (`kimi_k25`: a
multimodal wrapper around a DeepSeek-V3 text model, its routed experts possibly INT4 already).

Against independent full transformers forwards: the KV scales (the MLA latent the engine caches), the DSA
indexer's key amax (reported, never a scale), the streamed hidden states (top-k indices carried across a
"shared" indexer layer, also through a resumed pass), and GPTQ through `convert` (loads with transformers
and beats RTN for GLM-5; for the wrapper: compressed-tensors reproduces every packed weight, and the result
equals GPTQ of the unwrapped text model)."""

import json
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor, modeling_module
from quantkit.calib.observers import ExpertTokenCounter, KVCacheObserver
from quantkit.calib.spool import PROGRESS_NAME, run_calibrated
from quantkit.calibrate import CalibrateOptions, calibrate, read_scales, write_scales
from quantkit.convert import ConvertOptions, convert
from quantkit.errors import CalibrationError
from quantkit.match.recipe import load_recipe
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.safetensors import SafetensorsFile
from quantkit.testing import KIMI_K25_PREFIX, load_model, make_tiny_model, wrap_kimi_k25
from quantkit.verify import verify

from .test_calibrate import FullForward

N, T = 6, 48  # T > index_topk (16): the DSA indexer really selects a subset of the keys
GLM = dict(layers=3, index_topk_pattern="FSF")  # layer 1 reuses layer 0's top-k ("shared")


def _samples(n=N, t=T, seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=512, num_samples=n, seq_len=t, seed=seed).samples)


def _calibrate(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return calibrate(path, CalibrateOptions(num_samples=N, seq_len=T, **kw))


def _convert(src, out, recipe, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return convert(src, out, ConvertOptions(recipe=recipe, model_card=False, **kw))


def _tensors(d):
    ck = Checkpoint.open(d)
    out = {}
    for s in ck.shards:
        with SafetensorsFile(s.header) as f:
            out.update({n: f.get(n) for n in s.tensors})
    return out


def _amax(t, strategy):
    a = t.abs().amax(dim=(0, 2, 3)).float()
    return a.amax().reshape(1) if strategy == "tensor" else a.reshape(-1, 1, 1)


def kl(a, b):
    return F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="batchmean").item()


# ---- GLM-5: glm_moe_dsa ---------------------------------------------------------------------------------
class DsaForward:
    """The reference: a plain float32 from_pretrained forward of the whole model over all samples, with
    (1) the MLA latent from hooks (kv_a_layernorm output ++ the k_pe the attention rotates; the indexer's
    own RoPE call, unsqueeze_dim=2, is told apart), (2) transformers' DynamicCache, which for this model
    holds (c_kv, k_pe) and the indexer keys of each layer with an indexer, (3) the routers' choices,
    (4) the input of the final norm."""

    def __init__(self, path, samples, monkeypatch):
        from transformers import DynamicCache

        self.model = m = load_model(path)
        mod = modeling_module(m.model.layers[0].self_attn)
        self.nope, self.rot, self.routes, current = {}, {}, {}, {}
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.register_forward_pre_hook(lambda mod_, a, i=i: current.__setitem__("layer", i))
            layer.self_attn.kv_a_layernorm.register_forward_hook(lambda mod_, a, o, i=i: self.nope.__setitem__(i, o))
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.register_forward_hook(lambda mod_, a, o, i=i: self.routes.__setitem__(i, o[-1]))
        orig = mod.apply_rotary_pos_emb_interleave

        def rope(q, k, cos, sin, *a, **kw):
            q2, k2 = orig(q, k, cos, sin, *a, **kw)
            if kw.get("unsqueeze_dim", 1) == 1:  # the attention's k_pe, not the indexer's keys
                self.rot[current["layer"]] = k2
            return q2, k2

        monkeypatch.setattr(mod, "apply_rotary_pos_emb_interleave", rope)
        cap = {}
        m.model.norm.register_forward_pre_hook(lambda mod_, a: cap.__setitem__("h", a[0]))
        self.cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(torch.stack(samples), use_cache=True, cache=self.cache)
        self.final_hidden = cap["h"]
        n, t = self.final_hidden.shape[:2]
        # taken now: the patched RoPE stays in place for the test and would record other models' calls
        self.hooked = {i: torch.cat([self.nope[i].view(n, 1, t, -1), k], dim=-1) for i, k in self.rot.items()}

    def latent(self, layer):
        c = self.cache.layers[layer]
        cached = torch.cat([c.keys, c.values], dim=-1)  # [N, 1, T, kv_lora_rank + rope]
        torch.testing.assert_close(self.hooked[layer], cached)  # the two references agree
        return cached

    def indexer_keys(self, layer):
        return self.cache.layers[layer].indexer_keys  # [N, T, index_head_dim] or None


@pytest.fixture(scope="module")
def glm(tiny_models):
    return tiny_models("glm_moe_dsa", **GLM)


def test_glm_moe_dsa_kv_scales_and_stream_match_full_forward(glm, monkeypatch):
    cfg = Checkpoint.open(glm).config
    assert cfg["indexer_types"] == ["full", "shared", "full"] and cfg["index_topk"] < T
    ref = DsaForward(glm, _samples(), monkeypatch)
    res = _calibrate(glm)
    assert res.attention == "mla" and res.model_type == "glm_moe_dsa" and res.prefix == ""
    # only the MLA latent gets scales: K and V of each layer, nothing for the indexer's keys
    assert sorted(res.scales) == sorted(f"model.layers.{i}.self_attn.{k}_scale" for i in range(3) for k in "kv")
    for i in range(3):
        lat = ref.latent(i)
        assert lat.shape[1] == 1 and lat.shape[-1] == 32 + 16  # kv_lora_rank + qk_rope_head_dim
        ks, vs = (res.scales[f"model.layers.{i}.self_attn.{k}_scale"] for k in "kv")
        assert tuple(ks.shape) == (1,) and torch.equal(ks, vs)
        torch.testing.assert_close(ks, _amax(lat, "tensor") / 448, rtol=1e-2, atol=0)
    # the indexer keys: measured on the layers that run an indexer, reported in the JSON extras
    assert sorted(res.indexer_k_amax) == [0, 2] and ref.indexer_keys(1) is None
    for i in (0, 2):
        assert res.indexer_k_amax[i] == pytest.approx(float(ref.indexer_keys(i).abs().amax()), rel=1e-2)
    js = res.to_json()
    assert js["indexer_k_amax"] == {"0": res.indexer_k_amax[0], "2": res.indexer_k_amax[2]}
    json.dumps(js)
    # expert token counts = the full forward's router choices
    for i, routes in ref.routes.items():
        assert res.expert_tokens[i] == torch.bincount(routes.reshape(-1), minlength=4).tolist()
    # streamed: 2 samples per call, activations and carried top-k indices memory-mapped (budget 0)
    ex = LayerExecutor(glm, batch_tokens=100, activation_budget_bytes=0)
    kv, experts = KVCacheObserver(), ExpertTokenCounter()
    final = ex.run(_samples(), [kv, experts])
    got = torch.stack([final[i] for i in range(N)])
    final.close()
    torch.testing.assert_close(got, ref.final_hidden, rtol=1e-5, atol=1e-5)
    assert ex.topk.store is None and all(p.is_meta for p in ex.model.parameters())
    for i in range(3):  # per "head" (attn_head): MLA has one, the latent
        ka, va = kv.amax(i, "attn_head")
        assert tuple(ka.shape) == (1, 1, 1) and torch.equal(ka, va)
        torch.testing.assert_close(ka, _amax(ref.latent(i), "attn_head"), rtol=1e-5, atol=1e-6)
    assert kv.indexer_k_amax == pytest.approx(res.indexer_k_amax, rel=1e-5)  # batched differently, same amax


def test_glm_moe_dsa_shared_layer_needs_the_carried_top_k(glm, monkeypatch):
    """Handing the shared layer other top-k indices than layer 0's changes its output: the carry matters."""
    from quantkit.calib import executor

    ex = LayerExecutor(glm)
    want = ex.run(_samples(n=2))[0].clone()
    orig = executor.TopKCarry.inputs

    def flipped(self, idx, t):
        return {k: v.flip(1) for k, v in orig(self, idx, t).items()}

    monkeypatch.setattr(executor.TopKCarry, "inputs", flipped)
    got = ex.run(_samples(n=2))[0]
    assert not torch.allclose(got, want, atol=1e-4)


def test_glm_moe_dsa_resumed_pass_reloads_the_top_k(glm, tmp_path):
    """A GPTQ pass interrupted after layer 0 resumes at the shared layer 1 with layer 0's indices from the
    spool, and ends exactly as an uninterrupted pass; without them it stops with a clear error."""
    recipe, samples = load_recipe("int4-experts-gptq"), _samples(n=4, t=32)
    whole = run_calibrated(glm, recipe, samples, tmp_path / "whole")

    class Stop(Exception):
        pass

    def stop(done, total):
        if done == 1:
            raise Stop

    spool = tmp_path / "spool"
    with pytest.raises(Stop):
        run_calibrated(glm, recipe, samples, spool, progress=stop)
    assert json.loads((spool / PROGRESS_NAME).read_text())["next_layer"] == 1
    assert json.loads((spool / "dsa-topk.json").read_text())["layer"] == 0
    broken = tmp_path / "broken"
    shutil.copytree(spool, broken)
    (broken / "dsa-topk.bin").unlink()
    with pytest.raises(CalibrationError, match="cannot resume at decoder layer 1"):
        run_calibrated(glm, recipe, samples, broken)
    resumed = run_calibrated(glm, recipe, samples, spool)
    assert resumed == whole and len(whole["modules"]) == 2 * 4 * 3
    for name in whole["layers"]:
        a, b = _tensors_file(tmp_path / "whole" / f"{name}.safetensors"), _tensors_file(spool / f"{name}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(spool.glob("dsa-topk*")) and not list(spool.glob("activations-*"))


def _tensors_file(p):
    with SafetensorsFile(p) as f:
        return {n: f.get(n) for n in f.header.tensors}


def test_glm_moe_dsa_gptq_loads_and_beats_rtn(glm, tmp_path):
    for recipe in ("int4-experts-gptq", "int4-experts-rtn"):
        res = _convert(glm, tmp_path / recipe, recipe, num_samples=16, seq_len=32)
        assert res.tensors_quantized == 2 * 4 * 3  # layers 1-2 are MoE: 4 experts x 3 projections
    ref, gptq, rtn = (load_model(p).eval() for p in (glm, *(tmp_path / r for r in ("int4-experts-gptq",
                                                                                    "int4-experts-rtn"))))
    ids = torch.stack(_samples(n=16, t=32))  # the calibration distribution
    with torch.no_grad():
        lr = ref(ids).logits
        k_gptq, k_rtn = kl(lr, gptq(ids).logits), kl(lr, rtn(ids).logits)
    assert k_gptq < k_rtn, (k_gptq, k_rtn)


# ---- Kimi K2.5: the kimi_k25 wrapper ------------------------------------------------------------------
@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The text model (deepseek_v3, noaux_tc), its INT4-experts conversion, and both wrapped as kimi_k25."""
    d = tmp_path_factory.mktemp("kimi_k25")
    text = make_tiny_model("deepseek_v3", d / "text", layers=3, topk_method="noaux_tc")
    _convert(text, d / "text-int4", "int4-experts-rtn")
    return SimpleNamespace(text=text, text_int4=d / "text-int4", k25=wrap_kimi_k25(text, d / "k25"),
                           k25_int4=wrap_kimi_k25(d / "text-int4", d / "k25-int4"))


def test_kimi_k25_builder_layout(kimi):
    ck = Checkpoint.open(kimi.k25_int4)
    cfg = ck.config
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "kimi_k2"
    assert cfg["text_config"]["topk_method"] == "noaux_tc" and "quantization_config" not in cfg["text_config"]
    qc = cfg["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    names = set(ck.location)
    assert "language_model.lm_head.weight" in names and "language_model.model.embed_tokens.weight" in names
    assert "language_model.model.layers.1.mlp.experts.3.down_proj.weight_packed" in names
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}


@pytest.mark.parametrize("variant", ["bf16", "int4"])
def test_kimi_k25_kv_scales_match_text_model_forward(kimi, monkeypatch, tmp_path, variant):
    wrapped, text = (kimi.k25, kimi.text) if variant == "bf16" else (kimi.k25_int4, kimi.text_int4)
    res = _calibrate(wrapped)
    assert res.model_type == "kimi_k25" and res.attention == "mla" and res.prefix == KIMI_K25_PREFIX
    ref = FullForward(text, _samples(), monkeypatch)  # transformers decompresses the INT4 experts itself
    for i in range(3):
        lat, _ = ref.cached(i)
        torch.testing.assert_close(res.scales[f"model.layers.{i}.self_attn.k_scale"], _amax(lat, "tensor") / 448,
                                   rtol=1e-2, atol=0)
    for i, routes in ref.routes.items():
        assert sum(res.expert_tokens[i]) == N * T * 2
        if variant == "bf16":
            assert res.expert_tokens[i] == torch.bincount(routes.reshape(-1), minlength=4).tolist()
    # the scales file stays in the text model's namespace (pack/kv.py); a checkpoint names them as vLLM's
    # KimiK25ForConditionalGeneration routes them: under language_model.
    ckpt = res.checkpoint_scales()
    assert sorted(ckpt) == sorted(KIMI_K25_PREFIX + n for n in res.scales)
    assert res.to_json()["prefix"] == KIMI_K25_PREFIX
    write_scales(res, tmp_path / "kv.safetensors")
    back = read_scales(tmp_path / "kv.safetensors")
    assert all(torch.equal(back[k], res.scales[k]) for k in res.scales)
    with SafetensorsFile(tmp_path / "kv.safetensors") as f:
        assert f.header.metadata["prefix"] == KIMI_K25_PREFIX and f.header.metadata["model_type"] == "kimi_k25"


def test_kimi_k25_gptq(kimi, tmp_path):
    """GPTQ of the wrapper: every packed weight reproduced by compressed-tensors (verify's format stage),
    bit-identical to GPTQ of the unwrapped text model, the vision tower carried along; INT4 experts of a
    source are never re-quantized."""
    kw = dict(num_samples=8, seq_len=32)
    _convert(kimi.k25, tmp_path / "k25", "int4-experts-gptq", **kw)
    _convert(kimi.text, tmp_path / "text", "int4-experts-gptq", **kw)
    rep = verify(tmp_path / "k25")
    assert rep.integrity["ok"] and rep.format["ok"], (rep.integrity, rep.format)
    assert rep.format["modules_checked"] == 2 * 4 * 3 and rep.format["judge"].startswith("compressed-tensors")
    got, want, src = _tensors(tmp_path / "k25"), _tensors(tmp_path / "text"), _tensors(kimi.k25)
    packed = sorted(n for n in got if n.endswith(".weight_packed"))
    assert len(packed) == 24 and all(n.startswith("language_model.model.layers.") for n in packed)
    for n, t in want.items():
        assert torch.equal(got[KIMI_K25_PREFIX + n], t), n
    vision = [n for n in src if not n.startswith(KIMI_K25_PREFIX)]
    assert vision and all(torch.equal(got[n], src[n]) for n in vision)
    manifest = json.loads((tmp_path / "k25" / "quantkit_manifest.json").read_text())
    assert "gptq" in json.dumps(manifest)
    # an INT4 source (a real K2.5): the calibrated pass leaves its experts alone (convert passes them through)
    index = run_calibrated(kimi.k25_int4, load_recipe("int4-experts-gptq"), _samples(n=2, t=16), tmp_path / "spool")
    assert index["modules"] == {} and index["layers"] == []
