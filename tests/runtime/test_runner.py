"""quantkit.runtime.runner against transformers, on tiny INT4 checkpoints written by `quantkit convert`.

Models: make_tiny_model(arch) with a few values made non-trivial first (norm weights, router
correction biases, sharper attention: see _perturb), converted with the default int4-experts-rtn
recipe. References, per arch:
- ref32: transformers in fp32 on the converted checkpoint, its experts replaced by fp32
  dequantizations of the packed tensors (read here by name, independently of the runner; equal to
  what compressed-tensors decompresses, checked bit for bit after rounding to bf16). Same weights as
  the runner, so the runner in fp32 must agree closely.
- ref16: transformers in bf16 on the converted checkpoint as compressed-tensors decompresses it.

Tolerances (err = max |runner - ref| / max |ref| over the logits compared):
- fp32 prefill vs ref32: err <= 1e-4 (measured ~4e-7).
- fp32 decode (FP16 KV cache) vs ref32 at the same positions: err <= 2e-3; the cache rounds K/V to
  fp16 (measured <= ~5e-4). bf16 prefill and decode (BF16 KV cache) vs ref16: err <= 2e-2.
- FP8 KV cache (calibrated amax / 448 scales) vs the BF16-KV run: decode err <= 6e-2; prefill is equal
  (prefill attends over the fresh K/V, not the cache).
- Batched vs alone: err <= 1e-5 (fp32; the MoE GEMMs see different row counts).
- Greedy generation (8 tokens, fp32) equals transformers' greedy tokens, except that a divergence is
  accepted where transformers' own top-1 / top-2 logits gap is below 2e-3 * max |logit| (a near tie).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from quantkit.convert import ConvertOptions, convert
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.safetensors import SafetensorsFile
from quantkit.write.writer import write_safetensors
from quantkit.runtime import FP8_DTYPE, dequantize_int4
from quantkit.errors import KVPoolError
from quantkit.runtime.runner import MoEBlock, PoolSize, load_runner, parse_config
from quantkit.errors import KVScalesMissing, UnsupportedCheckpoint, UnsupportedModel
from quantkit.testing import load_model, make_tiny_model

from .helpers import needs_triton, rel_err

# per arch: make_tiny_model overrides. Eight experts in two groups exercise group-limited top-k.
ARCHS = {
    "qwen3_moe": dict(experts=8),  # softmax top-2, norm_topk_prob False, q/k norm
    "mixtral": dict(),  # softmax top-2, always renormalized
    "glm4_moe": dict(experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True),
    "deepseek_v3": dict(experts=8, n_group=2, topk_group=1,  # MLA, rope interleave, yarn + mscale
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                                             beta_fast=32.0, beta_slow=1.0)),
}
PROMPT, TOTAL = 8, 16  # prefill PROMPT tokens, then decode up to TOTAL
PAGE = 4  # small pages: prompts and decodes cross page boundaries


def _perturb(src: Path, seed: int) -> None:
    """make_tiny_model sets norms to 1, biases to 0 and every weight to std 0.02 (near-uniform
    attention, where a position bug barely shows). Rewrite the shards in place with norms
    1 + 0.2 N(0, 1), correction biases 0.1 N(0, 1) and 4x the query/key projections."""
    gen = torch.Generator().manual_seed(seed)
    sharp = re.compile(r"self_attn\.(q_proj|k_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$")
    for shard in Checkpoint.open(src).shards:
        with SafetensorsFile(shard.header) as f:
            ts = {n: f.get(n) for n in shard.tensors}
        for n, t in ts.items():
            if n.endswith("norm.weight"):
                ts[n] = (1 + 0.2 * torch.randn(t.shape, generator=gen)).to(t.dtype)
            elif n.endswith("e_score_correction_bias"):
                ts[n] = (0.1 * torch.randn(t.shape, generator=gen)).to(t.dtype)
            elif sharp.search(n):
                ts[n] = t * 4
        write_safetensors(shard.path, ts, metadata=shard.header.metadata)


def _dequantized_experts(out: Path, layer: int, prefix: str, names, num_experts: int):
    """fp32 (gate_up [E, 2I, D], down [E, D, I]) read from the packed checkpoint by tensor name."""
    ck = Checkpoint.open(out)
    files = {}

    def deq(mod):
        ts = {}
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            name = f"{mod}.{suffix}"
            shard = ck.location[name]
            files.setdefault(shard, SafetensorsFile(ck.shard(shard).header))
            ts[suffix] = files[shard].get(name)
        return dequantize_int4(ts["weight_packed"], ts["weight_scale"], shape=ts["weight_shape"])

    g, u, d = ([deq(f"model.layers.{layer}.{prefix}.experts.{e}.{n}") for e in range(num_experts)] for n in names)
    for f in files.values():
        f.close()
    return torch.cat([torch.stack(g), torch.stack(u)], 1), torch.stack(d)


class Built:
    def __init__(self, arch: str, root: Path):
        self.arch = arch
        self.src = make_tiny_model(arch, root / "src", **ARCHS[arch])
        _perturb(self.src, seed=1)
        self.out = root / "int4"
        convert(str(self.src), str(self.out), ConvertOptions())
        gen = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 512, (TOTAL,), generator=gen)
        self.ids2 = torch.randint(0, 512, (TOTAL,), generator=gen)
        self.ref16_model = load_model(self.out, torch.bfloat16)
        self.ref32_model = load_model(self.out, torch.float32)
        probe = load_runner(self.out, dtype=torch.float32)  # only to learn which layers are MoE
        moe = probe.spec.moe
        for i, layer in enumerate(probe.layers):
            if not isinstance(layer.mlp, MoEBlock):
                continue
            gu, dn = _dequantized_experts(self.out, i, moe.prefix, moe.names, moe.num_experts)
            mod = self.ref32_model.model.layers[i].mlp.experts
            # what compressed-tensors decompressed (bf16) is our dequantization, rounded
            assert torch.equal(mod.gate_up_proj.data, gu.to(mod.gate_up_proj.dtype))
            assert torch.equal(mod.down_proj.data, dn.to(mod.down_proj.dtype))
            mod.gate_up_proj = torch.nn.Parameter(gu, requires_grad=False)
            mod.down_proj = torch.nn.Parameter(dn, requires_grad=False)
        with torch.no_grad():
            self.ref32 = self.ref32_model(self.ids[None]).logits[0].float()  # [TOTAL, V]
            self.ref16 = self.ref16_model(self.ids[None]).logits[0].float()

    def runner(self, **kw):
        kw = {"dtype": torch.float32, "kv_dtype": torch.float16, "pool_size": PoolSize(48, PAGE), **kw}
        return load_runner(self.out, **kw)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    cache = {}

    def get(arch: str) -> Built:
        if arch not in cache:
            cache[arch] = Built(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def _run(r, ids, rid=0, prompt=PROMPT, total=TOTAL):
    """Prefill ids[:prompt], decode ids[prompt:total] one by one. -> logits fp32 [total, V]."""
    rows = [r.prefill(rid, ids[:prompt])]
    for t in range(prompt, total):
        lg, aborted = r.decode([rid], ids[t:t + 1])
        assert aborted == []
        rows.append(lg)
    return torch.cat(rows)


# --------------------------------------------------------------------------------------------------
# logits vs transformers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_prefill_and_decode_match_transformers(build, arch):
    b = build(arch)
    out = _run(b.runner(), b.ids)
    assert rel_err(out[:PROMPT], b.ref32[:PROMPT]) <= 1e-4
    for t in range(PROMPT, TOTAL):  # decode logits of token t vs the full-sequence logits at t
        assert rel_err(out[t], b.ref32[t]) <= 2e-3, t


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_prefill_and_decode_match_transformers(build, arch):
    b = build(arch)
    out = _run(b.runner(dtype=torch.bfloat16, kv_dtype=torch.bfloat16), b.ids)
    assert rel_err(out[:PROMPT], b.ref16[:PROMPT]) <= 2e-2
    for t in range(PROMPT, TOTAL):
        assert rel_err(out[t], b.ref16[t]) <= 2e-2, t


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generation_matches_transformers(build, arch):
    b = build(arch)
    n = 8
    got = b.runner().generate(b.ids[:PROMPT].tolist(), n)
    res = b.ref32_model.generate(b.ids[None, :PROMPT], max_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    want = res.sequences[0, PROMPT:].tolist()
    assert len(got) == n and len(want) <= n
    for j, (g, w) in enumerate(zip(got, want)):
        if g != w:  # only a near tie in transformers' own logits may flip the argmax
            top = res.logits[j][0].float().topk(2).values
            gap = float(top[0] - top[1]) / float(res.logits[j][0].abs().max())
            assert gap < 2e-3, f"step {j}: runner {g}, transformers {w}, top-2 gap {gap:.2e}"
            break


# --------------------------------------------------------------------------------------------------
# FP8 KV cache
# --------------------------------------------------------------------------------------------------
def _calibrated_scales(r, per_head: bool) -> dict:
    """amax / 448 of what a BF16 pool cached, per layer (docs/format.md, 'KV-cache FP8 scales')."""
    out = {}
    for i in range(r.spec.num_layers):
        kc, vc = r.pool.layer(i)
        for kind, c in (("k", kc), ("v", vc if vc is not None else kc)):  # MLA: k_scale == v_scale
            c = c.float().abs()
            amax = c.amax(dim=(0, 1, 3)).reshape(-1, 1, 1) if per_head else c.amax().reshape(1)
            out[f"model.layers.{i}.self_attn.{kind}_scale"] = (amax / 448.0).to(torch.float32)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fp8_kv_cache_close_to_bf16(build, arch, tmp_path):
    b = build(arch)
    r16 = b.runner(dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    base = _run(r16, b.ids)
    scales = _calibrated_scales(r16, per_head=arch == "qwen3_moe")
    if arch == "qwen3_moe":  # scales shipped in the checkpoint (convert --kv-scales), per KV head
        path = tmp_path / "kv.safetensors"
        write_safetensors(path, scales)
        out = tmp_path / "int4-fp8kv"
        convert(str(b.src), str(out), ConvertOptions(kv_scales=str(path)))
        r8 = load_runner(out, dtype=torch.bfloat16, kv_dtype=FP8_DTYPE, pool_size=PoolSize(48, PAGE))
    else:  # MLA: one scale for the whole latent, passed as a mapping
        r8 = b.runner(dtype=torch.bfloat16, kv_dtype=FP8_DTYPE, kv_scales=scales)
    assert r8.pool.k_cache.dtype == FP8_DTYPE
    got = _run(r8, b.ids)
    assert torch.equal(got[:PROMPT], base[:PROMPT])  # prefill attends over fresh K/V
    err = rel_err(got[PROMPT:], base[PROMPT:])
    assert 0 < err <= 6e-2  # > 0: the decode really read FP8 pages


def test_fp8_kv_cache_without_scales_raises(build):
    b = build("qwen3_moe")
    with pytest.raises(KVScalesMissing) as e:
        load_runner(b.out, kv_dtype=FP8_DTYPE)
    assert e.value.hint


# --------------------------------------------------------------------------------------------------
# paging and integrity
# --------------------------------------------------------------------------------------------------
STEPS = 4


def _alone(b, r, ids, prompt):
    lg = _run(r, ids, rid=99, prompt=prompt, total=prompt + STEPS)[prompt:]
    r.free(99)
    return lg  # [STEPS, V]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_batched_decode_matches_each_alone(build, arch):
    b = build(arch)
    r = b.runner()
    pa, pb = 7, 5  # partial last pages; decodes then cross page boundaries at different steps
    alone_a, alone_b = _alone(b, r, b.ids, pa), _alone(b, r, b.ids2, pb)
    r.prefill(1, b.ids[:pa])
    r.prefill(2, b.ids2[:pb])
    for s in range(STEPS):
        lg, aborted = r.decode([1, 2], torch.stack([b.ids[pa + s], b.ids2[pb + s]]))
        assert aborted == []
        assert rel_err(lg[0], alone_a[s]) <= 1e-5 and rel_err(lg[1], alone_b[s]) <= 1e-5, s
    assert not set(r.pool.pages_of(1)) & set(r.pool.pages_of(2))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_corrupted_block_table_aborts_only_that_request(build, arch):
    b = build(arch)
    r = b.runner()
    pa, pb = 7, 5
    alone_b = _alone(b, r, b.ids2, pb)
    r.prefill(1, b.ids[:pa])
    r.prefill(2, b.ids2[:pb])
    lg, aborted = r.decode([1, 2], torch.stack([b.ids[pa], b.ids2[pb]]))
    assert aborted == [] and rel_err(lg[1], alone_b[0]) <= 1e-5
    victim_page = r.pool.pages_of(2)[0]
    row = int(r.pool.rows([1])[0])
    r.pool.block_table[row, 0] = victim_page  # request 1 now points at request 2's first page
    before = r.pool.k_cache[:, victim_page].clone()
    lg, aborted = r.decode([1, 2], torch.stack([b.ids[pa + 1], b.ids2[pb + 1]]))
    assert aborted == [1]
    assert not lg[0].any()  # the offender's row is zeros (must not be used)
    assert rel_err(lg[1], alone_b[1]) <= 1e-5
    assert torch.equal(r.pool.k_cache[:, victim_page], before)  # the victim's page was not written
    assert r.requests == [2] and int(r.pool.owner[victim_page]) == 2  # the offender's free spared it
    for s in range(2, STEPS):  # the innocent request continues as if alone
        lg, aborted = r.decode([2], b.ids2[pb + s:pb + s + 1])
        assert aborted == [] and rel_err(lg[0], alone_b[s]) <= 1e-5
    with pytest.raises(KVPoolError):
        r.decode([1], b.ids[pa + 2:pa + 3])


# --------------------------------------------------------------------------------------------------
# Triton path (interpreter on CPU, compiled kernels on CUDA)
# --------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_triton_backend_matches_torch(build, arch):
    b = build(arch)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device=dev, pool_size=PoolSize(16, PAGE))
    ref = _run(load_runner(b.out, backend="torch", **kw), b.ids.to(dev), prompt=5, total=7)
    got = _run(load_runner(b.out, backend="triton", **kw), b.ids.to(dev), prompt=5, total=7)
    assert rel_err(got, ref) <= 2e-2


# --------------------------------------------------------------------------------------------------
# what the runner refuses
# --------------------------------------------------------------------------------------------------
def test_unsupported_models_raise_with_hint(build):
    cfg = Checkpoint.open(build("qwen3_moe").out).config
    ds = Checkpoint.open(build("deepseek_v3").out).config
    cases = [
        {**cfg, "model_type": "llama"},
        {**cfg, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        {**cfg, "use_sliding_window": True},
        {**ds, "scoring_func": "softmax"},
    ]
    for c in cases:
        with pytest.raises(UnsupportedModel) as e:
            parse_config(copy.deepcopy(c))
        assert e.value.hint
    spec = parse_config(copy.deepcopy(ds))
    assert spec.mla is not None and spec.rope.kind == "yarn" and spec.rope.interleave
    assert parse_config({**ds, "model_type": "kimi_k2"}).mla == spec.mla


def test_unquantized_experts_run_as_plain_weights(build):
    """The BF16 source runs too (verify --pair's reference): experts unpacked, close to its INT4 conversion."""
    from quantkit.runtime.fp8 import DenseExperts

    b = build("qwen3_moe")
    src = load_runner(b.src)
    ex = src.layers[0].mlp.experts
    assert isinstance(ex, DenseExperts) and not ex.fp8 and ex.gate.dtype == torch.bfloat16
    ids = torch.arange(12) * 7 % 500
    lr, lq = src.prefill(0, ids).log_softmax(-1), load_runner(b.out).prefill(0, ids).log_softmax(-1)
    assert 0 < float((lr.exp() * (lr - lq)).sum(-1).mean()) < 0.01
