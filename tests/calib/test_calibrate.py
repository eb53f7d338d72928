"""Calibration engine: the layer-streamed executor equals a full transformers forward, the KV scales equal
an independent computation on that forward (monkeypatched RoPE + hooks, and the transformers KV cache),
expert token counts equal the full forward's router choices, and the scales file round-trips."""

import json
import re
import warnings

import pytest
import torch

from quantkit.errors import CalibrationError, KVScalesError, UnsupportedArchitecture, UnsupportedWeights
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor, modeling_module
from quantkit.calib.weights import load_layer_weights
from quantkit.calib.observers import ExpertTokenCounter, KVCacheObserver
from quantkit.calibrate import (DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN, CalibrateOptions, calibrate, read_scales,
                                scales_strategy, write_scales)
from quantkit.errors import QuantkitError
from quantkit.read.checkpoint import Checkpoint
from quantkit.write.writer import write_safetensors
from quantkit.match.recipe import CalibrationSpec, load_recipe
from quantkit.testing import load_model

N, T = 6, 48  # calibration samples x tokens: small, but several batches with batch_tokens=100
ARCH_KW = {  # the tiny models the executor is checked on (glm4_moe with its optional qk norm on)
    "qwen3_moe": {}, "deepseek_v3": {"layers": 3}, "mixtral": {}, "glm4_moe": {"use_qk_norm": True},
    "llama": {}, "qwen3": {},
    "olmoe": {},  # q/k norms over the whole projection (arch.Arch.qk_norm_whole)
}


def _model(tiny_models, arch):
    return tiny_models(arch, **ARCH_KW[arch])


def _samples(vocab=512, n=N, t=T):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=vocab, num_samples=n, seq_len=t).samples)


def _calibrate(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return calibrate(path, CalibrateOptions(num_samples=N, seq_len=T, **kw))


def _ids_file(p, n=3, t=16):
    """A small pre-tokenized dataset (no tokenizer warnings, fast)."""
    p.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in _samples(n=n, t=t)))
    return p


class FullForward:
    """An independent reference: a plain float32 from_pretrained forward over all samples at once, with
    (1) apply_rotary_pos_emb monkeypatched to record post-RoPE keys and hooks on v_proj / kv_a_layernorm,
    (2) the transformers DynamicCache, (3) router hooks, (4) the input of the final norm."""

    def __init__(self, path, samples, monkeypatch):
        from transformers import DynamicCache

        self.model = m = load_model(path)
        mod = modeling_module(m.model.layers[0].self_attn)
        self.keys, self.values, self.routes, self.latent_nope = {}, {}, {}, {}
        current = {}
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            attn.register_forward_pre_hook(lambda mod_, a, i=i: current.__setitem__("layer", i))
            if hasattr(attn, "v_proj"):
                attn.v_proj.register_forward_hook(lambda mod_, a, o, i=i: self.values.__setitem__(i, o))
            else:  # MLA: the normalized c_kv half of the latent
                attn.kv_a_layernorm.register_forward_hook(lambda mod_, a, o, i=i: self.latent_nope.__setitem__(i, o))
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, torch.nn.Module) and hasattr(layer.mlp, "experts"):
                gate.register_forward_hook(lambda mod_, a, o, i=i: self.routes.__setitem__(i, o[-1]))
        for fname in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
            if hasattr(mod, fname):
                orig = getattr(mod, fname)

                def wrapped(q, k, cos, sin, *a, _orig=orig, **kw):
                    q2, k2 = _orig(q, k, cos, sin, *a, **kw)
                    self.keys[current["layer"]] = k2
                    return q2, k2

                monkeypatch.setattr(mod, fname, wrapped)
        cap = {}
        m.model.norm.register_forward_pre_hook(lambda mod_, a: cap.__setitem__("h", a[0]))
        self.cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(torch.stack(samples), use_cache=True, cache=self.cache)
        self.final_hidden = cap["h"]  # [N, T, D] before the final norm

    def cached(self, layer: int):
        """(K, V) as the engine caches them, from the monkeypatched RoPE + hooks: [N, H, T, d]."""
        k = self.keys[layer]
        if layer in self.latent_nope:  # MLA latent = cat(kv_a_layernorm(c_kv), rope(k_pe))
            n, _, t, _ = k.shape
            lat = torch.cat([self.latent_nope[layer].view(n, 1, t, -1), k], dim=-1)
            return lat, lat
        v = self.values[layer]
        n, t, _ = v.shape
        return k, v.view(n, t, k.shape[1], -1).transpose(1, 2)

    def cache_kv(self, layer: int):
        """(K, V) from the transformers KV cache; for MLA it holds (c_kv, k_pe): the latent."""
        k, v = self.cache.layers[layer].keys, self.cache.layers[layer].values
        if layer in self.latent_nope:
            lat = torch.cat([k, v], dim=-1)
            return lat, lat
        return k, v


def _amax(t, strategy):
    a = t.abs().amax(dim=(0, 2, 3)).float()
    return a.amax().reshape(1) if strategy == "tensor" else a.reshape(-1, 1, 1)


@pytest.fixture(scope="module")
def full_forward(tiny_models):
    """One independent reference forward per architecture, shared by the strategy cases."""
    cache = {}

    def get(arch):
        if arch not in cache:
            with pytest.MonkeyPatch.context() as mp:
                cache[arch] = FullForward(_model(tiny_models, arch), _samples(), mp)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "olmoe"])
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_scales_match_independent_full_forward(tiny_models, full_forward, arch, strategy):
    path = _model(tiny_models, arch)
    res = _calibrate(path, strategy=strategy)
    ref = full_forward(arch)
    n_layers = ref.model.config.num_hidden_layers
    assert len(res.layers) == n_layers and len(res.scales) == 2 * n_layers
    for i in range(n_layers):
        k_ref, v_ref = ref.cached(i)
        k_cache, v_cache = ref.cache_kv(i)
        torch.testing.assert_close(k_ref, k_cache)  # the two references agree with each other
        torch.testing.assert_close(v_ref, v_cache)
        ks, vs = res.scales[f"model.layers.{i}.self_attn.k_scale"], res.scales[f"model.layers.{i}.self_attn.v_scale"]
        want_shape = (1,) if strategy == "tensor" else (k_ref.shape[1], 1, 1)
        assert ks.dtype == torch.float32 and tuple(ks.shape) == want_shape and tuple(vs.shape) == want_shape
        torch.testing.assert_close(ks, _amax(k_ref, strategy) / 448, rtol=1e-2, atol=0)
        torch.testing.assert_close(vs, _amax(v_ref, strategy) / 448, rtol=1e-2, atol=0)
        lk = res.layers[i]
        assert torch.tensor(lk.k_scale).reshape(ks.shape).allclose(ks)  # floats, or lists for attn_head
        assert torch.tensor(lk.k_amax).reshape(ks.shape).div(448).allclose(ks)
        if arch == "deepseek_v3":  # MLA: one latent, one scale for K and V, one "head"
            assert torch.equal(ks, vs) and lk.k_amax == lk.v_amax
            assert k_ref.shape[1] == 1 and k_ref.shape[-1] == 32 + 16  # kv_lora_rank + qk_rope_head_dim


@pytest.mark.parametrize("arch", sorted(ARCH_KW))
def test_streamed_hidden_states_equal_full_forward(tiny_models, monkeypatch, arch):
    """The executor (one layer at a time, batched, activations memory-mapped to disk) reproduces the
    full model's hidden states before the final norm, and its KV observer equals the KV cache."""
    path = _model(tiny_models, arch)
    samples = _samples()
    ex = LayerExecutor(path, batch_tokens=100, activation_budget_bytes=0)  # 2 samples per batch, on disk
    kv, experts = KVCacheObserver(), ExpertTokenCounter()
    seen = []
    final = ex.run(samples, [kv, experts], progress=lambda i, n: seen.append((i, n)))
    assert final.on_disk
    got = torch.stack([final[i] for i in range(len(samples))])
    final.close()
    ref = FullForward(path, samples, monkeypatch)
    torch.testing.assert_close(got, ref.final_hidden, rtol=1e-5, atol=1e-5)
    assert seen == [(i, ex.num_layers) for i in range(ex.num_layers)]
    for i in range(ex.num_layers):
        k, v = ref.cache_kv(i)
        torch.testing.assert_close(kv.k_amax[i], k.abs().amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kv.v_amax[i], v.abs().amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    assert sorted(experts.counts) == sorted(ref.routes)
    for i, routes in ref.routes.items():  # expert token counts = the full forward's router choices
        want = torch.bincount(routes.reshape(-1), minlength=experts.counts[i].numel())
        assert torch.equal(experts.counts[i], want)
    # every layer was freed again: nothing but meta tensors left in the skeleton
    assert all(p.is_meta for p in ex.model.parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_expert_tokens_sum_to_tokens_times_top_k(tiny_models, arch):
    path = _model(tiny_models, arch)
    res = _calibrate(path)
    cfg = Checkpoint.open(path).config
    moe_layers = [i for i in range(cfg["num_hidden_layers"]) if i >= cfg.get("first_k_dense_replace", 0)]
    assert sorted(res.expert_tokens) == moe_layers
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    for i, counts in res.expert_tokens.items():
        assert len(counts) == n_exp and sum(counts) == N * T * cfg["num_experts_per_tok"]
    js = res.to_json()
    assert set(js) >= {"output", "layers", "expert_tokens"}
    assert js["expert_tokens"] == {str(i): c for i, c in res.expert_tokens.items()}
    assert js["data"]["num_samples"] == N and js["data"]["seq_len"] == T and js["data"]["sha256"]
    assert [set(lk) >= {"k_amax", "v_amax", "k_scale", "v_scale"} for lk in js["layers"]] == [True] * len(js["layers"])
    json.dumps(js)  # serializable as is


def test_variable_length_pretokenized_samples(tiny_models, tmp_path):
    """Pre-tokenized rows of different lengths run unpadded, each equal to its own full forward."""
    path = _model(tiny_models, "qwen3_moe")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (17, 40, 17, 9)]
    ds = tmp_path / "ids.jsonl"
    ds.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    with pytest.warns(CalibrationWarning, match="holds 4"):
        res = calibrate(path, CalibrateOptions(dataset=ds, num_samples=10, seq_len=64))
    assert res.data["pretokenized"] and res.data["num_tokens"] == sum(map(len, rows))
    assert sum(res.expert_tokens[0]) == sum(map(len, rows)) * 2
    final = LayerExecutor(path, batch_tokens=40).run([torch.tensor(r) for r in rows])
    model, cap = load_model(path), {}
    model.model.norm.register_forward_pre_hook(lambda m, a: cap.__setitem__("h", a[0]))
    for i, r in enumerate(rows):
        with torch.no_grad():
            model(torch.tensor([r]))
        torch.testing.assert_close(final[i], cap["h"][0], rtol=1e-5, atol=1e-5)


def test_layers_generator_allows_replacing_outputs(tiny_models):
    """GPTQ-style use: hooks on submodules inside the loop, and true-sequential output replacement."""
    path = _model(tiny_models, "qwen3_moe")
    samples = _samples(n=2, t=16)
    ex = LayerExecutor(path)
    seen_inputs = []
    for step in ex.layers(samples):
        idx, layer, inputs = step
        h = layer.mlp.experts.register_forward_pre_hook(lambda m, a: seen_inputs.append((idx, a[0].shape)))
        step.forward()
        h.remove()
        if idx == 0:
            with torch.no_grad():
                for p in layer.parameters():
                    p.zero_()
            out = step.forward()  # the zeroed layer is the identity on the residual stream
            torch.testing.assert_close(out[0], inputs[0])
    assert [i for i, _ in seen_inputs] == [0, 1]
    ref = LayerExecutor(path)
    ref_final = ref.run(samples)
    assert not torch.allclose(ex.final[0], ref_final[0])  # layer 0's replaced outputs were propagated


def test_write_and_read_scales(tiny_models, tmp_path):
    res = _calibrate(_model(tiny_models, "qwen3_moe"), strategy="attn_head")
    out = tmp_path / "kv.safetensors"
    n = write_scales(res, out)
    assert out.stat().st_size == n and res.output == str(out) and res.to_json()["output"] == str(out)
    back = read_scales(out)
    assert list(back) == list(res.scales) and all(torch.equal(back[k], res.scales[k]) for k in back)
    assert scales_strategy(back) == "attn_head"
    assert not list(tmp_path.glob(".*tmp"))  # the temporary name is gone


@pytest.mark.parametrize("bad, match", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(1)}, "no v_scale"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(1, dtype=torch.float16),
      "model.layers.0.self_attn.v_scale": torch.ones(1)}, "float32"),
    ({"model.layers.0.self_attn.k_scale": torch.zeros(1), "model.layers.0.self_attn.v_scale": torch.ones(1)}, "zero"),
    ({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale": torch.ones(2)}, "shape"),
    ({"model.layers.0.mlp.k_scale": torch.ones(1)}, "unexpected"),
])
def test_read_scales_rejects_bad_files(tmp_path, bad, match):
    p = tmp_path / "bad.safetensors"
    write_safetensors(p, bad)
    with pytest.raises(KVScalesError, match=match):
        read_scales(p)
    with pytest.raises(KVScalesError, match="does not exist"):
        read_scales(tmp_path / "missing.safetensors")


def test_unsupported_architecture_and_strategy(tmp_path, tiny_models):
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    write_safetensors(d / "model.safetensors", {"wte.weight": torch.zeros(4, 4)})
    with pytest.raises(UnsupportedArchitecture, match="gpt2") as e:
        calibrate(d)
    assert isinstance(e.value, QuantkitError) and "qwen3_moe" in e.value.hint
    with pytest.raises(CalibrationError, match="strategy"):
        calibrate(_model(tiny_models, "qwen3_moe"), CalibrateOptions(strategy="channel"))


def test_missing_layer_tensor_is_a_clear_error(tiny_models, tmp_path):
    src = Checkpoint.open(_model(tiny_models, "qwen3_moe"))
    from quantkit.read.safetensors import SafetensorsFile

    tensors = {}
    for s in src.shards:
        with SafetensorsFile(s.header) as f:
            tensors.update({n: f.get(n) for n in s.tensors if n != "model.layers.1.self_attn.k_norm.weight"})
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(src.config))
    write_safetensors(d / "model.safetensors", tensors)
    ex = LayerExecutor(d)
    ex.load_layer(0)
    with pytest.raises(UnsupportedWeights, match="k_norm"):
        ex.load_layer(1)


def _fp8_block_copy(src_dir, out_dir, block=32):
    """The tiny model with every 2-D projection weight stored DeepSeek-style: float8_e4m3fn `weight` +
    float32 `weight_scale_inv` per block x block tile (partial edge tiles), scale = amax / 448."""
    src = Checkpoint.open(src_dir)
    from quantkit.read.safetensors import SafetensorsFile

    out, deq = {}, {}
    for s in src.shards:
        with SafetensorsFile(s.header) as f:
            for n in s.tensors:
                t = f.get(n)
                if n.startswith("model.layers.") and re.search(r"proj\w*\.weight$", n) and t.ndim == 2:
                    w = t.float()
                    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
                    pad = torch.zeros(rows * block, cols * block)
                    pad[: w.shape[0], : w.shape[1]] = w
                    tiles = pad.view(rows, block, cols, block)
                    scale = (tiles.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)  # [rows, cols]
                    s_full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
                    q = (w / s_full).to(torch.float8_e4m3fn)
                    out[n], out[n[: -len("weight")] + "weight_scale_inv"] = q, scale
                    deq[n] = q.float() * s_full
                else:
                    out[n] = t
    out_dir.mkdir()
    cfg = dict(src.config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [block, block]})
    (out_dir / "config.json").write_text(json.dumps(cfg))
    write_safetensors(out_dir / "model.safetensors", out)
    return deq


def test_block_fp8_source_is_dequantized_on_load(tiny_models, tmp_path):
    src_dir = _model(tiny_models, "deepseek_v3")
    deq = _fp8_block_copy(src_dir, tmp_path / "fp8")
    ck, ref = Checkpoint.open(tmp_path / "fp8"), Checkpoint.open(src_dir)
    sd, sd_ref = load_layer_weights(ck, 1), load_layer_weights(ref, 1)
    assert set(sd) == set(sd_ref)
    torch.testing.assert_close(sd["self_attn.kv_a_proj_with_mqa.weight"],
                               deq["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])  # 48 rows: partial tiles
    e3 = torch.cat([deq[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(sd["mlp.experts.gate_up_proj"][3], e3)
    for k in sd:  # FP8 is close to the original weights, not equal
        assert (sd[k] - sd_ref[k]).norm() <= 0.07 * sd_ref[k].norm() + 1e-6, k
    res = _calibrate(tmp_path / "fp8")
    assert len(res.layers) == 3 and all(lk.k_scale > 0 for lk in res.layers)


def test_int4_pack_quantized_source_is_dequantized_on_load(tiny_models, tmp_path):
    from quantkit.convert import ConvertOptions, convert
    from quantkit.quant.int4 import dequantize, rtn

    src_dir = _model(tiny_models, "qwen3_moe")
    convert(src_dir, tmp_path / "q", ConvertOptions(recipe="int4-experts-rtn"))
    sd = load_layer_weights(Checkpoint.open(tmp_path / "q"), 1)
    sd_ref = load_layer_weights(Checkpoint.open(src_dir), 1)
    w = sd_ref["mlp.experts.down_proj"]  # [E, D, I]
    r = rtn(w.to(torch.bfloat16), 4, 32, True)
    torch.testing.assert_close(sd["mlp.experts.down_proj"], dequantize(r.q, r.qparams.scale), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(sd["self_attn.q_proj.weight"], sd_ref["self_attn.q_proj.weight"], rtol=0, atol=0)


def test_defaults_are_shared_with_recipes():
    assert DEFAULT_NUM_SAMPLES == CalibrationSpec().num_samples and DEFAULT_SEQ_LEN == CalibrationSpec().seq_len
    r = load_recipe("fp8-kv")
    assert r.groups == () and r.kv_cache.strategy == "tensor" and r.calibration.num_samples > 0
    assert r.needs_calibration


def test_early_exit_leaves_no_activation_files(tiny_models, tmp_path):
    ex = LayerExecutor(_model(tiny_models, "qwen3_moe"), activation_budget_bytes=0, workdir=tmp_path)
    for step in ex.layers(_samples(n=2, t=16)):
        step.forward()
        assert step.inputs.on_disk and len(list(tmp_path.iterdir())) == 2  # inputs + outputs
        break
    assert list(tmp_path.iterdir()) == []
    assert all(p.is_meta for p in ex.model.parameters())


def test_bfloat16_compute_keeps_fp32_routers(tiny_models, tmp_path):
    """dtype=bfloat16 halves the layer's memory; routers stay float32 as from_pretrained keeps them."""
    path = _model(tiny_models, "deepseek_v3")
    ex = LayerExecutor(path, dtype=torch.bfloat16)
    layer = ex.load_layer(1)
    assert layer.mlp.gate.weight.dtype == torch.float32 and layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.kv_a_proj_with_mqa.weight.dtype == torch.bfloat16
    ex.free_layer(1)
    ids = _ids_file(tmp_path / "ids16.jsonl")
    res16 = calibrate(path, CalibrateOptions(dataset=ids, num_samples=3, seq_len=16, dtype=torch.bfloat16))
    res32 = calibrate(path, CalibrateOptions(dataset=ids, num_samples=3, seq_len=16))
    for a, b in zip(res16.layers, res32.layers):
        assert a.k_scale == pytest.approx(b.k_scale, rel=0.05)
