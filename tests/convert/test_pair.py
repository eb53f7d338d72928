"""Prefill/decode pairs: `convert --pair fp8-prefill` and `verify DECODE --pair PREFILL`.

What must hold: both checkpoints carry the same KV-scale shard, byte for byte, computed once; each manifest
records the other (role, partner manifest hash without its pair section); the prefill checkpoint is FP8
weights and runs in quantkit's runner; verify --pair measures the pair (FP8 prefill into the FP8 KV cache,
INT4 decode reading it) beside each model alone; a pair whose KV scales differ by one bit, whose files differ
from what their manifests recorded, or whose manifests do not record each other, is refused with PairMismatch
(exit 1). Hostile edits, kills and resumes: tests/convert/test_pair_hostile.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantkit.cli import main
from quantkit.convert import ConvertOptions
from quantkit.convert.pair import convert_pair
from quantkit.errors import PairMismatch
from quantkit.pack import kv as kvrules
from quantkit.pack.manifest import manifest_digest
from quantkit.read.safetensors import SafetensorsFile
from quantkit.verify import VerifyOptions, verify
from quantkit.verify.pair import check_pair
from quantkit.write.writer import write_safetensors


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    src = tiny_models("qwen3_moe")
    out = tmp_path_factory.mktemp("pair") / "dec"
    res = convert_pair(src, out, ConvertOptions(recipe="int4-experts-rtn", num_samples=4, seq_len=32), "fp8-prefill")
    return src, out, out.with_name("dec-prefill"), res


def _manifest(d):
    return json.loads((d / "quantkit_manifest.json").read_text())


def test_pair_shares_kv_scales_and_records_each_other(pair):
    src, dec, pre, res = pair
    kv = kvrules.KV_SHARD_NAME
    assert (dec / kv).read_bytes() == (pre / kv).read_bytes()
    md, mp = _manifest(dec), _manifest(pre)
    assert md["pair"]["role"] == "decode" and mp["pair"]["role"] == "prefill"
    assert md["pair"]["partner_manifest_sha256"] == manifest_digest(mp)
    assert mp["pair"]["partner_manifest_sha256"] == manifest_digest(md)
    assert md["pair"]["kv_shard_sha256"] == res.kv_shard_sha256 == mp["pair"]["kv_shard_sha256"]
    assert md["status"] == mp["status"] == "complete" and set(md["pair"]["files"]) >= {"config.json"}
    assert "calibrate" in res.kv_origin  # computed once, on the source
    # decode: INT4 experts; prefill: FP8 weights everywhere the recipe targets
    labels_d = {e.get("scheme") for e in md["tensors"].values() if e.get("scheme")}
    labels_p = {e.get("scheme") for e in mp["tensors"].values() if e.get("scheme")}
    assert any(str(x).startswith("int4") for x in labels_d) and not any(str(x).startswith("fp8") for x in labels_d)
    assert labels_p and all(str(x).startswith("fp8") for x in labels_p)
    assert check_pair(dec, pre)["kv_tensors"] == 4


def test_runner_runs_the_fp8_checkpoint_close_to_the_source(pair):
    from quantkit.runtime.fp8 import DenseExperts
    from quantkit.runtime.paged_attention import FP8_DTYPE
    from quantkit.runtime.runner import load_runner

    src, dec, pre, _ = pair
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1))
    ref = load_runner(src).prefill(0, ids)
    r = load_runner(pre, kv_dtype=FP8_DTYPE)
    assert isinstance(r.layers[0].mlp.experts, DenseExperts) and r.layers[0].mlp.experts.fp8
    got = r.prefill(0, ids)
    lr, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = float((lr.exp() * (lr - lq)).sum(-1).mean())
    assert 0 < kl < 0.01  # FP8 everywhere changes the logits a little, never a lot (measured ~1.5e-4)


def test_quant_act_groups():
    from quantkit.runtime.fp8 import quant_act

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))  # seeded: the 1/8 bound below holds for e4m3 normals; an unseeded draw (its value depends on the tests run before) can land one among the subnormals
    x[:, :128] *= 1e-4  # under one per-token scale (set by the large half) these fall below e4m3's subnormals
    x[:, 128:] *= 400
    tok, grp = quant_act(x, None), quant_act(x, 128)
    assert tok.shape == grp.shape == x.shape
    assert (tok[:, :128] == 0).float().mean() > 0.9  # flushed to zero
    assert ((grp[:, :128] - x[:, :128]).abs() <= x[:, :128].abs() / 8).all()  # kept, to e4m3's 3 mantissa bits
    assert torch.equal(tok[:, 128:], grp[:, 128:])  # the large half sets both scales alike
    # a value exactly on the e4m3 grid times its group scale survives unchanged
    g = torch.zeros(1, 128)
    g[0, 0] = 448.0
    g[0, 1] = 2.0
    assert torch.equal(quant_act(g, 128), g)


def test_verify_measures_the_pair(pair):
    src, dec, pre, _ = pair
    rep = verify(dec, VerifyOptions(reference=src, pair=pre, num_samples=2, seq_len=16, generation_tokens=4))
    checks = {c.name: c for c in rep.checks}
    assert checks["pair"].ok and checks["integrity"].ok and checks["format"].ok
    assert checks["pair_quality"].ok is not None  # judged (16 positions on a random model: pass or fail)
    pm = rep.pair["metrics"]
    for k in ("pair", "decode", "prefill"):
        assert 0 <= pm[k]["kl_divergence"] < 0.05 and 0 <= pm[k]["top1_agreement"] <= 1
        assert 0 <= pm[k]["generation_agreement"] <= 1
    assert pm["positions"] == 2 * 8
    # the pair is neither model alone: its decode reads the FP8 model's cache
    assert pm["pair"]["kl_divergence"] != pm["decode"]["kl_divergence"]
    assert pm["pair"]["kl_vs_decode"] > 0
    assert rep.to_json()["pair"]["kv_tensors"] == 4


def _rewrite_kv(d, edit):
    path = d / kvrules.KV_SHARD_NAME
    with SafetensorsFile(path) as f:
        t = {n: f.get(n).clone() for n in f.header.tensors}
    edit(t)
    path.unlink()
    write_safetensors(path, t, metadata={"format": "pt"})


def test_pair_with_other_kv_scales_is_refused(pair, tmp_path, capsys):
    src, dec, pre, _ = pair
    bad = tmp_path / "pre"
    shutil.copytree(pre, bad)

    def one_ulp(t):
        n = sorted(t)[0]
        t[n] = torch.nextafter(t[n], torch.full_like(t[n], float("inf")))

    _rewrite_kv(bad, one_ulp)
    # the shard no longer matches the manifest that recorded it (with the manifest re-forged to match, the KV
    # comparison itself refuses it: tests/convert/test_pair_hostile.py)
    with pytest.raises(PairMismatch, match=f"prefill checkpoint .* does not match its manifest: {kvrules.KV_SHARD_NAME}"):
        check_pair(dec, bad)
    code, out, err = _cli(["verify", str(dec), "--pair", str(bad), "--no-save"], capsys)
    assert code == 1 and kvrules.KV_SHARD_NAME in err and "Traceback" not in err


def test_pair_whose_manifests_do_not_record_each_other_is_refused(pair, tmp_path, capsys):
    src, dec, pre, _ = pair
    bad = tmp_path / "pre"
    shutil.copytree(pre, bad)
    m = _manifest(bad)
    m["notes"] = m["notes"] + ["edited"]
    (bad / "quantkit_manifest.json").write_text(json.dumps(m))
    with pytest.raises(PairMismatch, match="do not record each other"):
        check_pair(dec, bad)
    # swapped roles
    with pytest.raises(PairMismatch, match="roles"):
        check_pair(pre, dec)
    code, _, err = _cli(["verify", str(dec), "--pair", str(bad), "--no-save"], capsys)
    assert code == 1 and "PairMismatch" not in err and "error:" in err


def test_pair_out_needs_pair(tmp_path, capsys):
    code, _, err = _cli(["convert", str(tmp_path), str(tmp_path / "o"), "--pair-out", str(tmp_path / "p")], capsys)
    assert code == 2


def test_cli_pair_with_a_kv_file(pair, tmp_path, capsys):
    """--kv-scales FILE: no calibration; both halves carry that file's tensors; --json has both results."""
    src, dec, _, _ = pair
    out = tmp_path / "d"
    code, stdout, err = _cli(["convert", str(src), str(out), "-r", "int4-experts-rtn", "--pair", "fp8-prefill",
                              "--pair-out", str(tmp_path / "p"), "--kv-scales", str(dec / kvrules.KV_SHARD_NAME),
                              "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["output"] == str(out) and doc["pair"]["prefill"]["output"] == str(tmp_path / "p")
    assert doc["pair"]["kv_origin"]["file"] == str(dec / kvrules.KV_SHARD_NAME)
    kv = (dec / kvrules.KV_SHARD_NAME).read_bytes()
    assert (out / kvrules.KV_SHARD_NAME).read_bytes() == kv == (tmp_path / "p" / kvrules.KV_SHARD_NAME).read_bytes()
    assert check_pair(out, tmp_path / "p")["kv_tensors"] == 4
    assert _manifest(out)["pair"]["partner"] == "../p"


def test_runner_runs_w4afp8_experts_as_the_engine(tiny_models, tmp_path):
    """A W4AFP8 decode checkpoint runs in the runner through the W4A8 MoE math (runtime/w4afp8.py): close to,
    and not equal to, the same INT4 weights run W4A16."""
    from quantkit.convert import convert
    from quantkit.runtime.fp8 import W4AFP8Experts
    from quantkit.runtime.runner import load_runner

    src = tiny_models("qwen3_moe", hidden=256, moe_intermediate=256)
    out = tmp_path / "w4afp8"
    convert(src, out, ConvertOptions(recipe="int4-experts-w4afp8"))
    r = load_runner(out)
    assert isinstance(r.layers[0].mlp.experts, W4AFP8Experts)
    ids = torch.arange(16) * 11 % 500
    got = r.prefill(0, ids)
    # the same packed weights as W4A16: the config group without its input activations
    w4a16 = tmp_path / "w4a16"
    shutil.copytree(out, w4a16)
    cfg = json.loads((w4a16 / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["input_activations"] = None
    (w4a16 / "config.json").write_text(json.dumps(cfg))
    r16 = load_runner(w4a16)
    assert not isinstance(r16.layers[0].mlp.experts, W4AFP8Experts)
    ref = r16.prefill(0, ids)
    assert not torch.equal(got, ref)
    lr, lq = ref.log_softmax(-1), got.log_softmax(-1)
    assert float((lr.exp() * (lr - lq)).sum(-1).mean()) < 0.01
