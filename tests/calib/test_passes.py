"""Layer-streamed GPTQ/AWQ on tiny MoE models: better than RTN where it should be, every expert packed
even when it saw no calibration tokens, fallbacks recorded."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from quantkit.calib.data import load_calibration_data
from quantkit.calib.spool import run_calibrated
from quantkit.read.safetensors import SafetensorsFile
from quantkit.quant.int4 import dequantize, rtn
from quantkit.pack.int4 import unpack_int4
from quantkit.match.recipe import parse_recipe
from quantkit.testing import load_model, make_tiny_model

TARGETS = r"['re:.*experts\.\d+\.(gate|up|down)_proj$', 're:.*block_sparse_moe\.experts\.\d+\.w[123]$']"


def recipe(method, group=32, **opts):
    o = "".join(f"\n      {k}: {v}" for k, v in opts.items())
    return parse_recipe(f"groups:\n  experts:\n    targets: {TARGETS}\n    method: {method}\n"
                        f"    scheme: {{group_size: {group}}}\n" + (f"    options:{o}\n" if opts else ""))


def spool_weights(spool, index):
    """Dequantized per-expert weights and overrides from a spool, keyed by on-disk tensor name."""
    out = {}
    for name in index["layers"]:
        with SafetensorsFile(spool / f"{name}.safetensors") as f:
            sd = {k: f.get(k) for k in f.header.tensors}
        meta = json.loads((spool / f"{name}.json").read_text())
        mods = {k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed")}
        for m in mods:
            n, k = sd[f"{m}.weight_shape"].tolist()
            out[m + ".weight"] = dequantize(unpack_int4(sd[f"{m}.weight_packed"], k), sd[f"{m}.weight_scale"])
        for o in meta["overrides"]:
            out[o] = sd[o].float()
    return out


def substitute(model, weights):
    params = dict(model.named_parameters())
    for name, w in weights.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$", name)
        if m is None:
            params[name.replace(".block_sparse_moe.", ".mlp.")].data.copy_(w)
            continue
        prefix, e, kind = m[1].replace(".block_sparse_moe.", ".mlp."), int(m[2]), m[3]
        if kind in ("gate_proj", "w1", "up_proj", "w3"):
            p = params[f"{prefix}.gate_up_proj"]
            half = p.shape[1] // 2
            rows = slice(0, half) if kind in ("gate_proj", "w1") else slice(half, 2 * half)
            p.data[e, rows].copy_(w)
        else:
            params[f"{prefix}.down_proj"].data[e].copy_(w)


def rtn_weights(src_model):
    """The same model with every routed expert RTN-quantized (g32 symmetric), for comparison."""
    for pname, p in src_model.named_parameters():
        if pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
            r = rtn(p.detach().float(), 4, 32, True)
            deq = dequantize(r.q, r.qparams.scale)
            p.data.copy_(deq)
    return src_model


def kl(a, b):
    return F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="batchmean").item()


@pytest.mark.parametrize("arch,method", [("qwen3_moe", "gptq"), ("deepseek_v3", "gptq"), ("qwen3_moe", "awq"),
                                         ("mixtral", "awq")])
def test_calibrated_beats_rtn(tmp_path, arch, method):
    src = make_tiny_model(arch, tmp_path / "src")
    data = load_calibration_data(None, vocab_size=512, num_samples=16, seq_len=64)
    index = run_calibrated(src, recipe(method), data.samples, tmp_path / "spool")
    w = spool_weights(tmp_path / "spool", index)
    ref = load_model(src).eval()
    q = load_model(src).eval()
    substitute(q, w)
    r = rtn_weights(load_model(src).eval())
    ids = torch.stack(list(data.samples[:8]))  # the calibration distribution
    with torch.no_grad():
        lr, lq, lrtn = ref(ids).logits, q(ids).logits, r(ids).logits
    assert kl(lr, lq) < kl(lr, lrtn), (kl(lr, lq), kl(lr, lrtn))
    for meta in index["modules"].values():
        assert meta["method"] in (method, "rtn") and meta["scheme"] == "int4-g32-sym"


def test_experts_without_tokens_are_quantized_and_reported(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=16)
    samples = [torch.tensor([1, 2, 3])]  # 3 tokens x top-2 = at most 6 of 16 experts routed per layer
    index = run_calibrated(src, recipe("gptq"), samples, tmp_path / "spool")
    mods = index["modules"]
    assert len(mods) == 2 * 16 * 3  # every expert of every layer, all three projections
    zero = [m for m, e in mods.items() if e["tokens"] == 0]
    assert len(zero) >= 3 * 10
    for m in zero:
        assert "Hessian from all tokens" in mods[m]["fallback"]
    w = spool_weights(tmp_path / "spool", index)
    assert all(torch.isfinite(t).all() for t in w.values())
    index2 = run_calibrated(src, recipe("gptq", fallback="rtn"), samples, tmp_path / "spool2")
    assert all(index2["modules"][m]["method"] == "rtn" for m in zero)
    index3 = run_calibrated(src, recipe("awq"), samples, tmp_path / "spool3")
    assert len(index3["modules"]) == 2 * 16 * 3
    assert all(torch.isfinite(t).all() for t in spool_weights(tmp_path / "spool3", index3).values())
