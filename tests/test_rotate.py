"""The residual rotation R1 (quant/rotate.py, read/rotate.py, arch/residual.py): Q is orthogonal and the fast
transform is the dense matrix; a rotation-only recipe writes a BF16 model that transformers runs to the same
next-token distribution and the same routed experts as the source, for every family; the output is the same
bytes across runs and --workers; what cannot be rotated is refused, by name, before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.convert import MANIFEST_NAME, ConvertOptions, convert
from quantkit.errors import RecipeError, RotationError
from quantkit.match.recipe import parse_recipe
from quantkit.quant.rotate import Hadamard, block_size, dense_q, fwht, hadamard_matrix, random_signs
from quantkit.read.checkpoint import Checkpoint
from quantkit.testing import load_model, make_tiny_model

ROTATE = "rotate: {kind: hadamard, seed: 7}\n"


# ---- the math ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [96, 128, 160, 1536])
def test_q_is_orthogonal(hidden):
    q = dense_q(hidden, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(hidden, dtype=q.dtype), atol=1e-12)
    assert set(random_signs(hidden, 3).tolist()) <= {-1.0, 1.0}


def test_block_sizes():
    # the hidden sizes of the large releases: largest power-of-two block
    assert block_size(7168) == 1024 and block_size(6144) == 2048 and block_size(5120) == 1024
    assert block_size(4096) == 4096 and block_size(96) == 32
    # the recipe's rotate.block bounds it: one block per NVFP4 / MXFP4 group
    assert block_size(7168, 16) == 16 and block_size(96, 64) == 32 and block_size(6144, 4096) == 2048


@pytest.mark.parametrize("hidden,at_most", [(96, 16), (7168, 32), (256, 2)])
def test_a_bounded_block_is_orthogonal_and_the_fast_transform(hidden, at_most):
    q = dense_q(hidden, seed=5, at_most=at_most)
    assert torch.allclose(q @ q.T, torch.eye(hidden, dtype=q.dtype), atol=1e-12)
    assert q[:at_most, at_most:].abs().max() == 0 and q[:at_most, :at_most].abs().min() > 0  # one block's width
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    h = Hadamard(hidden, 5, at_most)
    assert h.block == at_most
    assert torch.allclose(h.rows(x).double(), x.double() @ q, atol=1e-5)


@pytest.mark.parametrize("hidden", [96, 256, 7168])
def test_fwht_equals_the_dense_matrix(hidden):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=g)
    q = dense_q(hidden, seed=11)
    h = Hadamard(hidden, 11)
    assert torch.allclose(h.rows(x).double(), x.double() @ q, atol=1e-5)
    w = torch.randn(hidden, 3, generator=g)  # a writer [H, in]: Q^T W
    assert torch.allclose(h.cols(w).double(), q.T @ w.double(), atol=1e-5)
    gain = torch.rand(hidden, generator=g) + 0.5  # a reader: W diag(g) Q
    assert torch.allclose(h.rows(x, gain).double(), (x.double() * gain.double()) @ q, atol=1e-5)
    b = block_size(hidden)
    assert torch.allclose(fwht(torch.eye(b), b).double(), hadamard_matrix(b), atol=1e-6)


@pytest.mark.parametrize("block", [2, 32, 128, 2048])
def test_native_transform_is_bit_identical_to_torch(block):
    x = torch.randn(33, 3 * block, generator=torch.Generator().manual_seed(block))
    assert torch.equal(fwht(x, block), fwht(x, block, native=False))


@pytest.mark.parametrize("hidden", [2, 8, 96, 160, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_is_bit_identical_to_torch(hidden, dtype):
    """The fused row kernel (signs and gain, transform, rounding to the dtype once) against the torch path."""
    g = torch.Generator().manual_seed(hidden)
    h = Hadamard(hidden, 3)
    x = (torch.randn(40, hidden, generator=g) * 3).to(dtype)
    gain = torch.rand(hidden, generator=g) + 0.5
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(h.turned(x, gain).view(bits), h.turned(x, gain, native=False).view(bits))
    for k in (24, 100, 300):  # one partial column tile; several tiles split over threads
        w = torch.randn(hidden, k, generator=g).to(dtype)
        assert torch.equal(h.turned_cols(w).view(bits), h.turned_cols(w, native=False).view(bits))
        into = torch.empty_like(w)  # written in place: what the reader's strips do
        assert h.turned_cols(w, out=into) is into and torch.equal(into.view(bits), h.turned_cols(w).view(bits))


@pytest.mark.parametrize("native", [True, False])
def test_a_nonfinite_weight_is_refused(native):
    from quantkit.errors import NonFiniteWeight

    x = torch.randn(4, 64).to(torch.bfloat16)
    x[2, 7] = float("nan")
    with pytest.raises(NonFiniteWeight):
        Hadamard(64, 0).turned(x, native=native)
    w = torch.randn(64, 40).to(torch.bfloat16)  # a writer [H, K]: the column kernel
    w[9, 33] = float("inf")
    with pytest.raises(NonFiniteWeight):
        Hadamard(64, 0).turned_cols(w, native=native)


def test_signs_depend_on_the_seed_only():
    assert torch.equal(random_signs(512, 5), random_signs(512, 5))
    assert not torch.equal(random_signs(512, 5), random_signs(512, 6))


# ---- the recipe --------------------------------------------------------------------------------------
def test_recipe_accepts_rotation_alone():
    r = parse_recipe(ROTATE)
    assert r.rotate is not None and r.rotate.kind == "hadamard" and r.rotate.seed == 7 and not r.groups
    assert r.rotate.block is None and parse_recipe("rotate: {block: 16}").rotate.block == 16


@pytest.mark.parametrize("text", ["rotate: {kind: givens}\n", "rotate: {seed: -1}\n", "rotate: {seed: x}\n",
                                  "rotate: {kind: hadamard, block: 48}\n", "rotate: {block: 1}\n",
                                  "rotate: {block: 65536}\n", "rotate: {block: true}\n", "rotate: {size: 64}\n",
                                  "rotate: yes\n"])
def test_recipe_refuses_bad_rotations(text):
    with pytest.raises(RecipeError, match="rotate"):
        parse_recipe(text)


# ---- the rotated model against the source ------------------------------------------------------------
def _random_gains(model_dir: Path, seed: int = 0) -> None:
    """Every norm gain of the checkpoint drawn at random (the tiny models' are ones): the folding of the gains
    into the readers is then what the comparison checks."""
    g = torch.Generator().manual_seed(seed)
    for shard in Checkpoint.open(model_dir).shards:
        t = load_file(str(model_dir / shard.name))
        for n in sorted(t):
            if n.endswith("norm.weight"):
                t[n] = (1 + 0.3 * torch.randn(t[n].shape, generator=g)).to(t[n].dtype)
        save_file(t, str(model_dir / shard.name), metadata={"format": "pt"})


def _run(model_dir: Path, ids: torch.Tensor):
    """(log-probabilities [B, T, V], routed expert sets: one frozenset per router call and token)."""
    model = load_model(model_dir, torch.float32).eval()
    chosen = []

    def hook(_m, _inp, out):
        chosen.extend(frozenset(row.tolist()) for row in out[-1].reshape(-1, out[-1].shape[-1]))

    for name, m in model.named_modules():
        if name.endswith(".gate") and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            m.register_forward_hook(hook)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits.float().log_softmax(-1), chosen


CASES = [("qwen3_moe", {"hidden": 96}), ("mixtral", {"hidden": 128}), ("deepseek_v3", {"hidden": 96}),
         ("glm4_moe", {"hidden": 96}), ("glm_moe_dsa", {"hidden": 96}), ("kimi_k25", {}),
         ("olmoe", {"hidden": 96}), ("qwen3_moe", {"hidden": 160})]
# Routed experts that agree: BF16 sources round every turned weight once, and a tiny random router (4 experts,
# std 0.02) has near ties that one rounding flips (1 token-layer in 128 seen); float32 sources turn exactly
# enough for the 99.9%.
SAME_EXPERTS = {torch.bfloat16: 0.98, torch.float32: 0.999}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{kw.get('hidden', 128)}" for a, kw in CASES])
def test_rotated_model_matches_the_source(tmp_path, arch, kw, dtype):
    src = make_tiny_model(arch, tmp_path / "src", seed=1, dtype=dtype, **kw)
    _random_gains(src)
    out = tmp_path / "out"
    res = convert(src, out, ConvertOptions(recipe=parse_recipe(ROTATE, "rot"), model_card=False))
    assert res.tensors_quantized == 0
    # 16 tokens: within the DSA indexer's top-k (16), whose selection would otherwise flip on rounding ties
    ids = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    la, ea = _run(src, ids)
    lb, eb = _run(out, ids)
    kl = float((la.exp() * (la - lb)).sum(-1).mean())
    assert kl <= 1e-5, kl
    assert len(ea) == len(eb) > 0
    same = sum(a == b for a, b in zip(ea, eb)) / len(ea)
    assert same >= SAME_EXPERTS[dtype], same
    # the weights did change: not a copy
    a, b = (load_file(str(p / Checkpoint.open(p).location[n])) for p, n in ((src, _embed(src)), (out, _embed(src))))
    assert not torch.equal(a[_embed(src)], b[_embed(src)])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    hidden = kw.get("hidden", 128)
    assert manifest["rotation"]["kind"] == "hadamard" and manifest["rotation"]["seed"] == 7
    assert manifest["rotation"]["hidden_size"] == hidden and manifest["rotation"]["block_size"] == hidden & -hidden


def _embed(model_dir: Path) -> str:
    return next(n for n in Checkpoint.open(model_dir).location if n.endswith("embed_tokens.weight"))


def test_an_unrotated_reader_would_fail(tmp_path):
    """The comparison above can fail: the rotated output with one reader's rotation undone is far off."""
    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=1, hidden=96)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(recipe=parse_recipe(ROTATE, "rot"), model_card=False))
    ck = Checkpoint.open(out)
    name = next(n for n in ck.location if n.endswith("self_attn.q_proj.weight"))
    t = load_file(str(out / ck.location[name]))
    t[name] = load_file(str(src / Checkpoint.open(src).location[name]))[name]
    save_file(t, str(out / ck.location[name]), metadata={"format": "pt"})
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    la, _ = _run(src, ids)
    lb, _ = _run(out, ids)
    assert float((la.exp() * (la - lb)).sum(-1).mean()) > 1e-4


# ---- determinism -------------------------------------------------------------------------------------
def _shard_bytes(out: Path) -> dict[str, bytes]:
    m = json.loads((out / MANIFEST_NAME).read_text())
    return {s["name"]: (out / s["name"]).read_bytes() for s in m["shards"]}


def test_same_bytes_across_runs_and_workers(tmp_path):
    src = make_tiny_model("deepseek_v3", tmp_path / "src", seed=2, hidden=96)
    _random_gains(src, 1)
    recipe = parse_recipe(ROTATE + "groups:\n  experts:\n    targets: ['re:.*mlp\\.experts\\..*']\n"
                          "    scheme: {num_bits: 4, group_size: 32}\n", "rot-int4")
    outs = []
    for i, workers in enumerate((1, 1, 2)):
        outs.append(tmp_path / f"out{i}")
        convert(src, outs[-1], ConvertOptions(recipe=recipe, workers=workers, model_card=False))
    assert len(Checkpoint.open(src).shards) > 1  # --workers 2 has shards to share
    first = _shard_bytes(outs[0])
    assert first == _shard_bytes(outs[1]) == _shard_bytes(outs[2])
    m = json.loads((outs[0] / MANIFEST_NAME).read_text())
    assert m["summary"]["modules_quantized"] > 0 and m["rotation"]["seed"] == 7


def test_turned_while_quantized_equals_quantizing_the_turned_model(tmp_path):
    """RTN of a rotated recipe turns each expert straight into the reused batch (read_into): its output equals
    the rotation-only model's experts quantized by the same recipe without rotation, byte for byte."""
    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=3, hidden=96)
    _random_gains(src, 2)
    rtn = "groups:\n  experts:\n    targets: ['re:.*mlp\\.experts\\..*']\n    scheme: {num_bits: 4, group_size: 32}\n"
    convert(src, tmp_path / "both", ConvertOptions(recipe=parse_recipe(ROTATE + rtn, "rot-int4"), model_card=False))
    convert(src, tmp_path / "turned", ConvertOptions(recipe=parse_recipe(ROTATE, "rot"), model_card=False))
    convert(tmp_path / "turned", tmp_path / "then", ConvertOptions(recipe=parse_recipe(rtn, "int4"), model_card=False))
    both, then = (_tensors(tmp_path / d) for d in ("both", "then"))
    packed = [n for n in both if n.endswith("weight_packed")]
    assert packed and both.keys() == then.keys()
    assert all(torch.equal(both[n], then[n]) for n in both)


def test_read_into_turns_rows_and_columns_in_place(tmp_path):
    """TensorReader.read_into a rotated tensor (a reader's rows r0:r1, a writer whole or by rows) equals the
    turned tensor `view` hands out, sliced."""
    from quantkit.read.rotate import Rotation
    from quantkit.read.tensors import TensorReader
    from quantkit.quant.rotate import RotationSpec

    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=4, hidden=96)
    _random_gains(src, 3)
    ck = Checkpoint.open(src)
    rot = Rotation.plan(ck, RotationSpec(seed=5))
    reader = next(n for n in ck.location if n.endswith("experts.1.up_proj.weight"))
    writer = next(n for n in ck.location if n.endswith("experts.1.down_proj.weight"))
    with TensorReader(ck.root, ck.location, {sh.name: sh.header for sh in ck.shards}, rotation=rot) as r:
        for name, rows in ((reader, None), (reader, (3, 11)), (writer, None), (writer, (5, 40))):
            want = r.view(name, rows=rows)
            out = torch.full(want.shape, float("nan"), dtype=want.dtype)
            r.read_into(name, out, rows=rows)
            assert torch.equal(out.view(torch.int16), want.contiguous().view(torch.int16)), (name, rows)
        assert not torch.equal(r.view(reader), r._get(reader))  # turned, not copied


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return {n: t for s in json.loads((out / MANIFEST_NAME).read_text())["shards"]
            for n, t in load_file(str(out / s["name"])).items()}


# ---- block-FP8 sources -------------------------------------------------------------------------------
def test_block_fp8_source_is_decoded_then_turned(tmp_path):
    """An FP8 source turned equals its own dequantized float32 values turned, cast once to BF16."""
    from quantkit.read.sources import detect_format, scan
    from quantkit.read.tensors import TensorReader
    from quantkit.testing import write_block_fp8_checkpoint

    src = make_tiny_model("deepseek_v3", tmp_path / "src", seed=3, hidden=96)
    _random_gains(src, 2)
    fp8 = tmp_path / "fp8"
    write_block_fp8_checkpoint(src, fp8, block=(32, 32))
    # the FP8 source's own values in float32: the reference the turned FP8 output is compared with
    ck = Checkpoint.open(fp8)
    stored = scan(ck, detect_format(ck.config))
    dense = tmp_path / "dense"
    dense.mkdir()
    with TensorReader.of(ck) as r:
        tensors = {n: r.get(n).clone() for n in ck.location if n.rsplit(".", 1)[0] not in stored}
        tensors |= {m + ".weight": r.decode(sw, torch.float32) for m, sw in stored.items()}
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    (dense / "config.json").write_text(json.dumps(cfg))
    recipe = parse_recipe(ROTATE, "rot")
    convert(fp8, tmp_path / "a", ConvertOptions(recipe=recipe, model_card=False))
    convert(dense, tmp_path / "b", ConvertOptions(recipe=recipe, model_card=False))
    a, b = Checkpoint.open(tmp_path / "a"), Checkpoint.open(tmp_path / "b")
    assert set(b.location) <= set(a.location)
    kept = 0
    with TensorReader.of(a) as ra, TensorReader.of(b) as rb:
        for n in sorted(b.location):
            t = ra.get(n)
            if t.dtype == torch.float8_e4m3fn:  # q_b_proj / kv_b_proj read attention's own norms: kept as FP8
                assert n.endswith(("q_b_proj.weight", "kv_b_proj.weight")), n
                kept += 1
                continue
            assert torch.equal(t, rb.get(n).to(t.dtype)), n  # the decoded modules turned from float32 both ways
    assert kept == 4
    notes = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())["notes"]
    assert any("rotation" in n for n in notes)


# ---- refusals ----------------------------------------------------------------------------------------
def _cli_convert(src: Path, out: Path, recipe: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", "convert", str(src), str(out), "--recipe", str(recipe)],
                          capture_output=True, text=True, timeout=120)


def test_refusals_end_in_one_line(tmp_path):
    recipe = tmp_path / "rot.yaml"
    recipe.write_text(ROTATE)
    tied = make_tiny_model("qwen3_moe", tmp_path / "tied", seed=1, hidden=96, tie_word_embeddings=True)
    r = _cli_convert(tied, tmp_path / "out1", recipe)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tied" in errors[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out1").exists()
    int4 = make_tiny_model("kimi_k25", tmp_path / "int4", seed=1, int4_experts=True)
    with pytest.raises(RotationError, match="int4"):
        convert(int4, tmp_path / "out2", ConvertOptions(recipe=parse_recipe(ROTATE, "rot"), model_card=False))
    assert not (tmp_path / "out2").exists()


def test_mtp_layer_is_refused(tmp_path):
    """An MTP layer as the DeepSeek-V3 releases store it (layer num_hidden_layers: a decoder block plus enorm,
    hnorm, eh_proj and shared_head.norm) is refused by name before anything is written."""
    src = make_tiny_model("deepseek_v3", tmp_path / "src", seed=1, hidden=96, max_shard_size="50MB")
    ck = Checkpoint.open(src)
    shard = ck.shards[0].name
    t = load_file(str(src / shard))
    for n in [n for n in t if n.startswith("model.layers.1.")]:
        t[n.replace("model.layers.1.", "model.layers.2.")] = t[n].clone()
    for n in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.2.{n}.weight"] = torch.ones(96, dtype=torch.bfloat16)
    t["model.layers.2.eh_proj.weight"] = torch.zeros(96, 192, dtype=torch.bfloat16)
    save_file(t, str(src / shard), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(RotationError, match="MTP"):
        convert(src, tmp_path / "out", ConvertOptions(recipe=parse_recipe(ROTATE, "rot"), model_card=False))
    assert not (tmp_path / "out").exists()


# ---- verify against the unrotated source -------------------------------------------------------------
def test_verify_measures_a_rotated_output_against_its_source(tmp_path):
    """verify --reference SRC on a rotated NVFP4 output: the weights' SQNR against the source turned the same way,
    the model (the reference with the output's dequantized weights: transformers cannot load NVFP4) from every
    tensor of the output, not the unrotated reference's norms and attention (that gave 50x the KL here)."""
    from quantkit import verify as v
    from quantkit.match.recipe import load_recipe

    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=1, hidden=128)
    kls = {}
    # rotate.block 16: one 16-wide block per NVFP4 group, which verify must rebuild from the manifest's block_size
    for rot in ("", ROTATE, "rotate: {kind: hadamard, seed: 7, block: 16}\n"):
        out = tmp_path / f"out{len(kls)}"
        text = rot + load_recipe("nvfp4-experts").text
        convert(src, out, ConvertOptions(recipe=parse_recipe(text, "nvfp4"), model_card=False))
        res = v.verify(out, v.VerifyOptions(reference=str(src), num_samples=4, seq_len=64, generation_tokens=0))
        doc = res.to_json()
        assert doc["passed"], [c for c in doc["checks"] if c["ok"] is False]
        kls[rot] = doc["metrics"]["kl_divergence"]
        if rot:
            blk = json.loads((out / MANIFEST_NAME).read_text())["rotation"]["block_size"]
            assert blk == (16 if "block" in rot else 128)
    assert all(kl < 3 * kls[""] for kl in kls.values()), kls


def test_calibrated_methods_run_on_the_rotated_model(tmp_path):
    """AWQ (scales folded into the norms the rotation set to ones) and GPTQ on a rotated model: each output passes
    verify against the unrotated source, with a KL of the size the unrotated conversion gets."""
    from quantkit import verify as v
    from quantkit.match.recipe import load_recipe

    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=1, hidden=128)
    _random_gains(src, 4)
    for name in ("int4-experts-awq", "int4-experts-gptq"):
        kls = {}
        for rot in (False, True):
            out = tmp_path / f"{name}-{rot}"
            text = (ROTATE if rot else "") + load_recipe(name).text
            convert(src, out, ConvertOptions(recipe=parse_recipe(text, name), model_card=False, num_samples=8,
                                             seq_len=64))
            doc = v.verify(out, v.VerifyOptions(reference=str(src), num_samples=4, seq_len=64,
                                                generation_tokens=0)).to_json()
            assert doc["passed"], (name, rot, [c for c in doc["checks"] if c["ok"] is False])
            kls[rot] = doc["metrics"]["kl_divergence"]
        assert kls[True] < 3 * kls[False], (name, kls)
