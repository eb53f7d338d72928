"""End-to-end `convert` on tiny models of every supported architecture.

The judge of the format is compressed-tensors' own decompressor: it must reproduce quantkit's
dequantization bit for bit. transformers must load the output, and its logits must match the original
model with the same dequantized weights substituted, and
stay close to the unquantized model (mean next-token KL < 2e-3 on these random-weight models).
Both models run in bf16 (transformers keeps decompressed experts in the scale dtype), and the
substituted model must give the same logits (max |diff| <= 1e-6)."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quantkit.convert import MANIFEST_NAME, ConvertOptions, convert
from quantkit.errors import GroupSizeError, OutputBusy, OutputExists
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.safetensors import SafetensorsFile
from quantkit.quant.int4 import dequantize
from quantkit.pack.int4 import unpack_int4
from quantkit.match.recipe import parse_recipe
from quantkit.testing import load_model, make_tiny_model

ROUTED = re.compile(r".*\.(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


def read_all(path) -> dict[str, torch.Tensor]:
    ck = Checkpoint.open(path)
    out = {}
    for s in ck.shards:
        with SafetensorsFile(s.header) as f:
            for n in s.tensors:
                out[n] = f.get(n)
    return out


def own_dequant(sd, module, dtype):
    shape = tuple(sd[f"{module}.weight_shape"].tolist())
    q = unpack_int4(sd[f"{module}.weight_packed"], shape[1])
    zp = sd.get(f"{module}.weight_zero_point")
    if zp is not None:
        zp = unpack_int4(zp.transpose(0, 1).contiguous(), shape[0]).transpose(0, 1)
    return dequantize(q, sd[f"{module}.weight_scale"], zp, dtype=dtype)


def judge_dequant(sd, module, weights_cfg):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights_cfg))
    local = {k[len(module) + 1:]: v for k, v in sd.items() if k.startswith(module + ".") and "." not in k[len(module) + 1:]}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"]


def check_against_judge(out_dir):
    cfg = json.loads((Path(out_dir) / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    groups = qc["config_groups"]
    sd = read_all(out_dir)
    modules = sorted(n[: -len(".weight_packed")] for n in sd if n.endswith(".weight_packed"))
    assert modules
    for m in modules:
        # the group that names the module exactly wins over the ["Linear"] group (compressed-tensors rule)
        exact = [g for g in groups.values() if m in g["targets"]]
        weights_cfg = (exact or [g for g in groups.values() if g["targets"] == ["Linear"]])[0]["weights"]
        theirs = judge_dequant(sd, m, weights_cfg)
        mine = own_dequant(sd, m, theirs.dtype)
        assert theirs.dtype == sd[f"{m}.weight_scale"].dtype
        assert torch.equal(theirs, mine), m
    return sd, modules, qc


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            src = make_tiny_model(arch, tmp_path_factory.mktemp(f"src_{arch}"))
            out = tmp_path_factory.mktemp(f"out_{arch}") / "q"
            res = convert(src, out, ConvertOptions(recipe="int4-experts-rtn"))
            cache[arch] = (src, out, res)
        return cache[arch]

    return get


def test_convert_matches_judge_and_loads(arch, converted):
    src, out, res = converted(arch)
    sd, modules, qc = check_against_judge(out)
    src_names = set(Checkpoint.open(src).location)
    routed = sorted(n[: -len(".weight")] for n in src_names if ROUTED.match(n[: -len(".weight")]))
    assert modules == routed  # exactly the routed experts, nothing else
    assert res.tensors_quantized == len(routed)
    # every other tensor passed through unchanged
    src_sd = read_all(src)
    for n, t in src_sd.items():
        if n[: -len(".weight")] not in routed:
            assert torch.equal(sd[n], t), n
    # unquantized 2-D weights are listed in ignore (vLLM and transformers need it with targets [Linear])
    for n, t in src_sd.items():
        if n.endswith(".weight") and t.ndim == 2 and n[:-7] not in routed:
            assert n[:-7] in qc["ignore"]

    # transformers loads it; its logits equal the source model with our dequantized experts substituted
    # (bf16 throughout: transformers keeps decompressed experts in the scale dtype, bf16)
    qmodel = load_model(out, torch.bfloat16).eval()
    ref = load_model(src, torch.bfloat16).eval()
    subst = load_model(src, torch.bfloat16).eval()
    deq_sd = {f"{m}.weight": own_dequant(sd, m, torch.bfloat16) for m in modules}
    _substitute(subst, deq_sd)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, lr, ls = qmodel(ids).logits, ref(ids).logits, subst(ids).logits
    lq, lr, ls = lq.float(), lr.float(), ls.float()
    assert (lq - ls).abs().max().item() <= 1e-6
    assert not torch.equal(lq, lr)  # the experts really are quantized
    kl = F.kl_div(F.log_softmax(lq, -1), F.log_softmax(lr, -1), log_target=True, reduction="batchmean").item() / ids.shape[1]
    assert kl < 2e-3


def _substitute(model, weights: dict[str, torch.Tensor]):
    """Write per-expert weights into a transformers model, whatever its in-memory expert layout."""
    params = dict(model.named_parameters())
    done = set()
    for name, w in weights.items():
        if name in params:
            params[name].data.copy_(w)
            done.add(name)
            continue
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$", name)
        prefix, e, kind = m[1].replace(".block_sparse_moe.", ".mlp."), int(m[2]), m[3]  # Mixtral's disk names
        if kind in ("gate_proj", "w1", "up_proj", "w3"):
            p = params[f"{prefix}.gate_up_proj"]
            half = p.shape[1] // 2
            rows = slice(0, half) if kind in ("gate_proj", "w1") else slice(half, 2 * half)
            p.data[e, rows].copy_(w)
        else:
            params[f"{prefix}.down_proj"].data[e].copy_(w)
        done.add(name)
    assert len(done) == len(weights)


def test_manifest_schema(converted):
    src, out, res = converted("qwen3_moe")
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["status"] == "complete"
    assert set(m) >= {"status", "format_version", "tool", "recipe", "source", "shards", "tensors", "summary"}
    assert m["tool"]["name"] == "quantkit" and m["recipe"]["name"] == "int4-experts-rtn"
    import hashlib

    assert m["recipe"]["sha256"] == hashlib.sha256(m["recipe"]["text"].encode()).hexdigest()
    ck = Checkpoint.open(out)
    assert {s["name"] for s in m["shards"]} == {s.name for s in ck.shards}
    for s in m["shards"]:
        p = out / s["name"]
        assert p.stat().st_size == s["size"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == s["sha256"]
    for s in m["source"]["shards"]:
        assert hashlib.sha256((src / s["name"]).read_bytes()).hexdigest() == s["sha256"]
    assert set(m["tensors"]) == set(ck.location)
    for name, e in m["tensors"].items():
        info = ck.info(name)
        assert e["shape"] == list(info.shape) and e["dtype"] == str(info.dtype).removeprefix("torch.")
        assert e["shard"] == ck.location[name]
        assert e["source_shard"] in {s["name"] for s in m["source"]["shards"]}
        if name.endswith(".weight_packed"):
            assert e["scheme"] == "int4-g32-sym" and e["method"] == "rtn" and 15 < e["sqnr_db"] < 30
    assert m["summary"]["modules_quantized"] == res.tensors_quantized
    assert not (out / ".quantkit-journal").exists()
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


def _recipe(scheme: str, targets=r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"):
    return parse_recipe(f"name: t\ngroups:\n  experts:\n    targets: ['{targets}']\n    scheme: {scheme}\n")


@pytest.mark.parametrize("scheme", [
    "{group_size: 64}", "{group_size: 128, symmetric: false}", "{strategy: channel}",
    "{strategy: channel, symmetric: false}", "{group_size: 32, symmetric: false}",
    "{group_size: 32, scale_search: mse}", "{group_size: 32, symmetric: false, scale_search: mse}",
])
def test_schemes_match_judge(tiny_models, tmp_path, scheme):
    src = tiny_models("qwen3_moe", moe_intermediate=128)
    convert(src, tmp_path / "q", ConvertOptions(recipe=_recipe(scheme)))
    _, modules, _ = check_against_judge(tmp_path / "q")
    assert len(modules) == 24


def test_rtn_mse_scales_never_worse_than_minmax(tiny_models, tmp_path):
    """scale_search: mse on symmetric INT4: each group's clipping searched; every module's SQNR at least
    min/max's (ratio 1.0 is a candidate and kept on ties), some strictly better, and the manifest says so."""
    src = tiny_models("qwen3_moe", moe_intermediate=128)
    convert(src, tmp_path / "amax", ConvertOptions(recipe=_recipe("{group_size: 32}")))
    convert(src, tmp_path / "mse", ConvertOptions(recipe=_recipe("{group_size: 32, scale_search: mse}")))
    amax = json.loads((tmp_path / "amax" / "quantkit_manifest.json").read_text())["tensors"]
    mse = json.loads((tmp_path / "mse" / "quantkit_manifest.json").read_text())["tensors"]
    packed = [n for n, e in mse.items() if n.endswith(".weight_packed")]
    assert len(packed) == 24
    gains = [mse[n]["sqnr_db"] - amax[n]["sqnr_db"] for n in packed]
    assert min(gains) >= -1e-3 and max(gains) > 0.1, gains
    assert all(mse[n]["scale_search"] == "mse" and "scale_search" not in amax[n] for n in packed)


def _save_fused(src: Path, dst: Path):
    """Rewrite a per-expert checkpoint with fused 3-D experts.gate_up_proj / down_proj tensors."""
    from safetensors.torch import save_file

    sd = read_all(src)
    out, experts = {}, {}
    for n, t in sd.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", n)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out[n] = t
    for prefix, ex in experts.items():
        ids = sorted(ex)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([ex[e]["gate_proj"], ex[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([ex[e]["down_proj"] for e in ids])
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())


def test_fused_layout_equals_per_expert(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe")
    fused = tmp_path / "fused"
    _save_fused(src, fused)
    convert(src, tmp_path / "a", ConvertOptions())
    convert(fused, tmp_path / "b", ConvertOptions())
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    check_against_judge(tmp_path / "b")


def test_group_size_error_before_writing(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", moe_intermediate=48)  # down_proj in=48
    with pytest.raises(GroupSizeError, match="down_proj.*48.*32"):
        convert(src, tmp_path / "q", ConvertOptions())
    assert not (tmp_path / "q").exists()
    r = _recipe("{group_size: 32, fallback: 16}")
    convert(src, tmp_path / "q2", ConvertOptions(recipe=r))
    m = json.loads((tmp_path / "q2" / MANIFEST_NAME).read_text())
    by_scheme = {}
    for n, e in m["tensors"].items():
        if n.endswith(".weight_packed"):
            by_scheme.setdefault(e["scheme"], set()).add(n.split(".")[-2])
    assert by_scheme == {"int4-g32-sym": {"gate_proj", "up_proj"}, "int4-g16-sym": {"down_proj"}}
    _, modules, qc = check_against_judge(tmp_path / "q2")
    assert len(qc["config_groups"]) == 2 and qc["config_groups"]["group_1"]["weights"]["group_size"] == 16
    # the fallback modules are named exactly in their own group, which compressed-tensors matches first
    assert set(qc["config_groups"]["group_1"]["targets"]) == {m for m in modules if m.endswith("down_proj")}


def test_output_not_empty_refused(tiny_models, tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "x").write_text("keep me")
    with pytest.raises(OutputExists):
        convert(tiny_models("qwen3_moe"), tmp_path / "q", ConvertOptions())
    assert (tmp_path / "q" / "x").read_text() == "keep me"



def test_second_convert_into_busy_output_refused(tiny_models, tmp_path):
    """Another process holding OUT (as a running convert does) makes a second convert fail at once, touching
    nothing; once it lets go, the same call goes through. --overwrite keeps the directory itself (the lock
    is held on it), so a third convert cannot slip in while the first replaces the contents."""
    import subprocess
    import sys

    src, out = tiny_models("qwen3_moe"), tmp_path / "q"
    convert(src, out, ConvertOptions())
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputBusy, match="being written by another"):
            convert(src, out, ConvertOptions(overwrite=True))
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    ino = out.stat().st_ino
    convert(src, out, ConvertOptions(overwrite=True))
    assert out.stat().st_ino == ino
    assert (out / "quantkit_manifest.json").is_file()

def test_max_shard_size_splits_outputs(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe")
    convert(src, tmp_path / "whole", ConvertOptions())
    convert(src, tmp_path / "split", ConvertOptions(max_shard_bytes=60_000))
    whole, split = Checkpoint.open(tmp_path / "whole"), Checkpoint.open(tmp_path / "split")
    assert len(split.shards) > len(whole.shards)
    for s in split.shards:  # a part may exceed the limit only when it holds a single tensor group
        assert s.size <= 60_000 + 4096 or len(s.tensors) <= 4
    a, b = read_all(tmp_path / "whole"), read_all(tmp_path / "split")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    m = json.loads((tmp_path / "split" / MANIFEST_NAME).read_text())
    assert [s["name"] for s in m["shards"]] == [s.name for s in split.shards]
    check_against_judge(tmp_path / "split")
