"""A decoder layer's forward in two halves (LayerExecutor.forward_to / forward_from), as the GPTQ pass of the
routed experts runs it: the statistics forward stops at the experts' call, and the forward after the
solves runs only the MLP block from the residual stream kept in between. Held against the layer's own whole
forward, bit for bit: the outputs, the statistics the experts' hooks collect, and a whole calibrated pass."""

import warnings

import pytest
import torch

from quantkit.calib import moe
from quantkit.calib.data import CalibrationWarning, load_calibration_data
from quantkit.calib.executor import LayerExecutor
from quantkit.calib.hessians import ExpertStats
from quantkit.calib.spool import run_calibrated

from calib.test_executor import _spool_tensors
from calib.test_passes import TARGETS, recipe


def _samples(n=6, t=40, vocab=512):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        return list(load_calibration_data(None, vocab_size=vocab, num_samples=n, seq_len=t).samples)


def _experts(layer):
    return next((m for m in layer.modules() if moe.is_routed_experts(m)), None)


def _stats(experts):
    return ExpertStats(experts, need_hessians=True, sample_tokens=64)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral", "glm4_moe"])
def test_split_forward_is_the_whole_forward(tiny_models, arch):
    path = tiny_models(arch, experts=8, layers=3)
    ex = LayerExecutor(path, batch_tokens=80)
    split = 0
    for step in ex.layers(_samples()):
        experts = _experts(step.layer)
        if experts is None:  # deepseek_v3's dense first layer
            step.forward()
            continue
        st = _stats(experts)
        whole = ex.forward_layer(step.layer, step.inputs)
        st.remove()
        st_split = _stats(experts)
        step.observe(stop_at=experts)
        st_split.remove()
        assert step.residual is not None and step.outputs is None  # the first half ran, and only it
        out = step.forward()
        assert torch.equal(out.data, whole.data)
        whole.close()
        assert torch.equal(st_split.counts, st.counts) and int(st.counts.sum()) > 0
        assert torch.equal(st_split.h_gu, st.h_gu) and torch.equal(st_split.h_down, st.h_down)
        assert torch.equal(st_split.h_all, st.h_all)
        split += 1
    assert split >= 2
    assert ex._split_ok == {type(step.layer): True}  # checked once against a whole forward, and it held
    ex.final.close()


def test_a_layer_that_is_not_residual_plus_block_is_forwarded_whole(tiny_models):
    """A forward the split does not describe (here: the layer's output scaled after the residual add) is
    caught by the check against a whole forward: the outputs are the whole forward's, and that layer class
    is not split again."""
    path = tiny_models("qwen3_moe", experts=8, layers=2)
    ex = LayerExecutor(path, batch_tokens=80)
    cls = type(ex.decoder_layers[0])
    plain = cls.forward

    def scaled(self, *args, **kw):
        return plain(self, *args, **kw) * 0.5

    cls.forward = scaled
    try:
        for step in ex.layers(_samples()):
            experts = _experts(step.layer)
            whole = ex.forward_layer(step.layer, step.inputs)
            step.observe(stop_at=experts)
            out = step.forward()
            assert torch.equal(out.data, whole.data)
            whole.close()
            assert ex._split_ok == {cls: False}
            assert ex.forward_to(step.layer, step.inputs, experts) is None  # never split again
    finally:
        cls.forward = plain
    ex.final.close()


def test_gptq_pass_with_and_without_split(tmp_path, tiny_models, monkeypatch):
    """The whole GPTQ pass (spool tensors and metadata) is the same bit for bit whether the layers are split
    or every forward is whole."""
    path = tiny_models("deepseek_v3", experts=8, layers=3)
    samples = _samples(n=8, t=32)
    calls = []
    real = LayerExecutor.forward_to

    def counting(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(LayerExecutor, "forward_to", counting)
    index = run_calibrated(path, recipe("gptq"), samples, tmp_path / "split")
    assert len(calls) == 2  # the two MoE layers
    monkeypatch.setattr(LayerExecutor, "forward_to", lambda self, *a, **kw: None)
    ref = run_calibrated(path, recipe("gptq"), samples, tmp_path / "whole")
    assert index["modules"] == ref["modules"] and index["layers"] == ref["layers"]
    got, want = _spool_tensors(tmp_path / "split", index), _spool_tensors(tmp_path / "whole", ref)
    assert sorted(got) == sorted(want) and got
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("method", ["awq", "gptq-with-dense"])
def test_passes_that_change_the_layer_before_the_experts_forward_it_whole(tmp_path, tiny_models, monkeypatch, method):
    """AWQ (it scales the post-attention norm and the router) and GPTQ with dense targets (attention) change
    what the layer computes before its experts: their statistics forward is never split."""
    from quantkit.match.recipe import parse_recipe

    path = tiny_models("qwen3_moe", experts=8, layers=2)
    calls = []
    monkeypatch.setattr(LayerExecutor, "forward_to", lambda self, *a, **kw: calls.append(1))
    if method == "awq":
        rec = recipe("awq")
    else:
        rec = parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: gptq\n"
                           "    scheme: {group_size: 32}\n  attention:\n    targets: ['re:.*self_attn[.]o_proj$']\n"
                           "    method: gptq\n    scheme: {group_size: 32}\n")
        assert any(g.method == "gptq" and "o_proj" in str(g.targets) for g in rec.groups)
    index = run_calibrated(path, rec, _samples(n=8, t=32), tmp_path / "spool")
    assert index["modules"] and not calls


def test_no_split_where_layers_carry_dsa_indices(tiny_models):
    """glm_moe_dsa: a layer's indexer results travel to later layers (TopKCarry), which a forward that skips
    the attention would not produce; such layers are forwarded whole."""
    path = tiny_models("glm_moe_dsa", experts=8, layers=3, index_topk_pattern="FSF")
    ex = LayerExecutor(path, batch_tokens=80)
    assert ex.topk is not None
    seen = 0
    for step in ex.layers(_samples(n=2, t=16)):
        experts = _experts(step.layer)
        if experts is None:
            continue
        assert ex.forward_to(step.layer, step.inputs, experts) is None
        step.observe(stop_at=experts)
        assert step.residual is None and step.outputs is not None  # a whole forward
        seen += 1
    assert seen >= 1
    ex.final.close()
