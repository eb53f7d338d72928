"""The executor runs routed experts with calib/moe.py's batched forward: installed on every layer it
materializes, gone when the layer is freed, bit-identical to transformers' eager loop through whole passes
(hidden states, KV amax, expert counts, GPTQ and AWQ spools), and one routing per call shared by the
forward and the observers' hooks, whose statistics match an independent computation from the router."""

import warnings

import pytest
import torch

from quantkit.calib import moe
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats
from quantkit.calib.observers import ExpertTokenCounter, KVCacheObserver
from quantkit.calib.spool import run_calibrated
from quantkit.read.safetensors import SafetensorsFile

from calib.test_passes import recipe


def _samples(n=6, t=40, vocab=512):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=vocab, num_samples=n, seq_len=t).samples)


def _stream(path, batched, samples):
    ex = LayerExecutor(path, batch_tokens=80, batched_experts=batched)
    kv, counter = KVCacheObserver(), ExpertTokenCounter()
    installed = []
    for step in ex.layers(samples, [kv, counter]):
        installed.append([moe.installed(m) for m in step.layer.modules() if moe.is_routed_experts(m)])
        step.forward()
    final = ex.final
    out = final.data.clone()
    final.close()
    assert not any(moe.installed(m) for m in ex.model.modules())  # uninstalled when each layer was freed
    return out, kv, counter, installed


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_batched_executor_is_bit_identical_to_eager(tiny_models, arch):
    path = tiny_models(arch, experts=8, layers=3)
    samples = _samples()
    got, kv, counts, installed = _stream(path, True, samples)
    ref, kv_ref, counts_ref, installed_ref = _stream(path, False, samples)
    assert any(any(i) for i in installed) and all(all(i) for i in installed)  # every MoE layer, batched
    assert not any(any(i) for i in installed_ref)
    assert torch.equal(got, ref)  # hidden states after the last layer, bit for bit
    for i in kv_ref.k_amax:
        assert torch.equal(kv.k_amax[i], kv_ref.k_amax[i]) and torch.equal(kv.v_amax[i], kv_ref.v_amax[i])
    assert sorted(counts.counts) == sorted(counts_ref.counts) and counts.counts
    for i, c in counts_ref.counts.items():
        assert torch.equal(counts.counts[i], c)
        assert int(c.sum()) == sum(len(s) for s in samples) * counts.top_k[i]


def _spool_tensors(spool, index):
    out = {}
    for name in index["layers"]:
        with SafetensorsFile(spool / f"{name}.safetensors") as f:
            out.update({k: f.get(k).clone() for k in f.header.tensors})
    return out


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_pass_batched_equals_eager(tmp_path, tiny_models, monkeypatch, method):
    """The pre-change pass (transformers' eager expert loop, no shared routing) is the reference: the spool,
    packed tensors and manifest metadata, is the same bit for bit."""
    path = tiny_models("qwen3_moe", experts=8, layers=2)
    samples = _samples(n=8, t=32)
    index = run_calibrated(path, recipe(method), samples, tmp_path / "batched")
    monkeypatch.setattr(LayerExecutor, "__init__", _eager_init(LayerExecutor.__init__))
    ref = run_calibrated(path, recipe(method), samples, tmp_path / "eager")
    assert index["modules"] == ref["modules"] and index["layers"] == ref["layers"]
    got, want = _spool_tensors(tmp_path / "batched", index), _spool_tensors(tmp_path / "eager", ref)
    assert sorted(got) == sorted(want) and got
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _eager_init(init):
    def patched(self, *a, **kw):
        init(self, *a, **{**kw, "batched_experts": False})
    return patched


def test_one_routing_per_call_shared_by_forward_and_hooks(tiny_models, monkeypatch):
    """With the expert statistics and the token counter attached, each experts call sorts its routing once,
    and the statistics equal an independent computation from the router's own top-k choices."""
    path = tiny_models("qwen3_moe", experts=8, layers=2)
    samples = _samples(n=4, t=32)
    calls = []
    real_route = moe.route
    monkeypatch.setattr(moe, "route", lambda *a, **kw: calls.append(1) or real_route(*a, **kw))
    ex = LayerExecutor(path, batch_tokens=64)
    counter = ExpertTokenCounter()
    for step in ex.layers(samples, [counter]):
        mlp = step.layer.mlp
        stats = ExpertStats(mlp.experts, need_hessians=True, sample_tokens=10 ** 6)
        routes, inputs = [], []
        h1 = mlp.gate.register_forward_hook(lambda m, a, out: routes.append(out[2].clone()))
        h2 = mlp.experts.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone()))
        calls.clear()
        step.forward()
        n_calls = len(inputs)
        assert n_calls == 2 and len(calls) == n_calls  # one sort per experts call (4 samples x 32 / 64)
        assert "_quantkit_routing" not in mlp.experts.__dict__  # dropped when the call ended
        for h in (h1, h2):
            h.remove()
        stats.remove()
        x, idx = torch.cat(inputs), torch.cat(routes)
        e = mlp.experts.gate_up_proj.shape[0]
        for j in range(e):
            tok = (idx == j).any(-1)
            xe = x[tok]
            assert int(stats.counts[j]) == int(tok.sum())
            _close(stats.h_gu[j], xe.T @ xe)
            gate, up = (xe @ mlp.experts.gate_up_proj[j].T).chunk(2, -1)
            hd = mlp.experts.act_fn(gate) * up
            _close(stats.h_down[j], hd.T @ hd)
        assert torch.equal(counter.counts[step.index], stats.counts)
    ex.final.close()


def _close(got, ref, tol=1e-5):
    """Within float32 summation-order differences, relative to the matrix's largest entry."""
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_routing_for_shares_within_a_call_only():
    from transformers import AutoModelForCausalLM

    from quantkit.testing import tiny_config

    torch.manual_seed(0)
    block = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", experts=4), experts_implementation="eager")
    experts = block.model.layers[0].mlp.experts
    idx = torch.tensor([[0, 1], [2, 1], [3, 0]])
    w = torch.rand(3, 2)
    a, b = moe.routing_for(experts, idx, w), moe.routing_for(experts, idx, w)
    assert a is not b  # not installed: nothing is kept between callers
    moe.install(experts)
    try:
        a, b = moe.routing_for(experts, idx, w), moe.routing_for(experts, idx, w)
        assert a is b
        assert moe.routing_for(experts, idx.clone(), w) is not a  # another tensor: another call
        with torch.no_grad():
            experts(torch.randn(3, experts.gate_up_proj.shape[-1]), idx, w)
        assert "_quantkit_routing" not in experts.__dict__
    finally:
        moe.uninstall(experts)
    tok, wt = moe.route(idx, w, 4).token_major()
    assert tok.tolist() == [0, 2, 0, 1, 1, 2]  # expert 0: tokens 0 (slot 0), 2 (slot 1); expert 1: 0, 1; ...
    assert torch.equal(wt, torch.stack([w[0, 0], w[2, 1], w[0, 1], w[1, 1], w[1, 0], w[2, 0]]))
