"""runtime/paged_attention.py: FP8 conversion, the decode-attention kernel (GQA and MLA latent) and the
cache-write kernel against their torch references, and the references against dense float64
attention over the context walked token by token."""

import math

import pytest
import torch

from quantkit.runtime.paged_attention import (FP8_DTYPE, PagedKV, dequantize_kv, paged_decode_attention,
                                              paged_decode_attention_ref, paged_mla_decode_attention,
                                              paged_mla_decode_attention_ref, quantize_kv, write_kv_cache,
                                              write_kv_cache_ref)

from .helpers import DEVICE, gather_context, naive_attention, needs_triton, rel_err

# kernel vs reference: fp32 softmax both sides; on a GPU the kernel feeds bf16 to tl.dot (P rounded
# to bf16 for P @ V), outputs are bf16.
ATTN_TOL = 2e-2


def _setup(gen, *, b=4, hq=8, hkv=2, d=32, page=16, ctx=(1, 16, 37, 80), dtype=torch.bfloat16,
           per_head=False, spare_pages=6):
    """Random caches, shuffled page assignment, owner table. Returns a dict of kernel arguments."""
    need = [math.ceil(c / page) for c in ctx]
    max_pages = max(need) + 1
    p = sum(need) + spare_pages
    perm = torch.randperm(p, generator=gen)
    table = torch.full((b, max_pages), -1, dtype=torch.int32)
    owner = torch.full((p,), -1, dtype=torch.int32)
    rid = torch.randperm(1000, generator=gen)[:b].to(torch.int32) + 5  # arbitrary request ids
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n].to(torch.int32)
        owner[perm[at:at + n]] = rid[i]
        at += n
    kf = torch.randn(p, page, hkv, d, generator=gen)
    vf = torch.randn(p, page, hkv, d, generator=gen)
    ks = vs = None
    if dtype == FP8_DTYPE:
        if per_head:
            ks = (torch.rand(hkv, 1, 1, generator=gen) + 0.5) / 100
            vs = (torch.rand(hkv, 1, 1, generator=gen) + 0.5) / 100
        else:
            ks, vs = torch.tensor([0.011]), torch.tensor([0.013])
        kf, vf = kf * 2, vf * 2
    kc, vc = quantize_kv(kf, ks, dtype), quantize_kv(vf, vs, dtype)
    q = torch.randn(b, hq, d, generator=gen).to(torch.bfloat16)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=table, context_lens=torch.tensor(ctx, dtype=torch.int32),
                k_scale=ks, v_scale=vs, owner=owner, request_ids=rid)


def _to(args, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _gqa(a):
    """_setup's arguments as the GQA kernels take them: (q, kv, context_lens)."""
    kv = PagedKV(a["k_cache"], a["v_cache"], a["block_tables"], k_scale=a["k_scale"], v_scale=a["v_scale"],
                 owner=a["owner"], request_ids=a["request_ids"])
    return a["q"], kv, a["context_lens"]


def _mla(m):
    """_setup_mla's arguments as the MLA kernels take them: (q_nope, q_pe, kv, context_lens)."""
    kv = PagedKV(m["latent_cache"], None, m["block_tables"], k_scale=m["scale"], owner=m["owner"],
                 request_ids=m["request_ids"])
    return m["q_nope"], m["q_pe"], kv, m["context_lens"]


def test_fp8_quantize_saturates_and_round_trips():
    x = torch.tensor([[[0.0, 1.0, -3.3, 1e6, -1e6, 0.01]]])  # [1, H=1, 6]
    c = quantize_kv(x, torch.tensor([0.5]), FP8_DTYPE)
    assert c.dtype == FP8_DTYPE
    back = dequantize_kv(c, torch.tensor([0.5]))
    assert back[0, 0, 3] == 448 * 0.5 and back[0, 0, 4] == -448 * 0.5  # clamped, not NaN
    assert torch.allclose(back[0, 0, :3], x[0, 0, :3], rtol=0.07)
    per_head = quantize_kv(torch.ones(2, 3, 4), torch.tensor([1.0, 0.5, 0.25]).view(3, 1, 1), FP8_DTYPE)
    assert per_head.float()[0, :, 0].tolist() == [1.0, 2.0, 4.0]


@pytest.mark.parametrize("dtype,per_head", [(torch.bfloat16, False), (FP8_DTYPE, False), (FP8_DTYPE, True)])
def test_reference_matches_naive(dtype, per_head):
    gen = torch.Generator().manual_seed(0)
    a = _setup(gen, ctx=(1, 16, 21, 40), dtype=dtype, per_head=per_head)
    out, bad = paged_decode_attention_ref(*_gqa(a))
    assert not bad.any()
    ks = 1 if a["k_scale"] is None else a["k_scale"].double().view(-1, 1)  # [1 or Hkv, 1]
    vs = 1 if a["v_scale"] is None else a["v_scale"].double().view(-1, 1)
    for i, t in enumerate(a["context_lens"].tolist()):
        k = gather_context(a["k_cache"], a["block_tables"][i], t) * ks  # [T, Hkv, D]
        v = gather_context(a["v_cache"], a["block_tables"][i], t) * vs
        want = naive_attention(a["q"][i], k, v, 1 / math.sqrt(32))
        assert rel_err(out[i], want) < 8e-3


ATTN_CASES = [
    # dtype, per_head, hq, hkv, page, ctx
    (torch.bfloat16, False, 8, 2, 16, (1, 16, 37, 80)),  # GQA 4:1, exact page, partial last page
    (FP8_DTYPE, False, 8, 2, 16, (5, 33, 64, 2)),       # FP8 per-tensor scale
    (FP8_DTYPE, True, 6, 3, 8, (17, 1, 24)),           # FP8 per-head scale, G = 2, page 8
    (torch.bfloat16, False, 4, 4, 6, (13, 0, 6)),        # MHA, page size not a power of two, empty context
    (FP8_DTYPE, True, 16, 1, 16, (40, 9)),              # MQA: 16 heads on one KV head
]


@needs_triton
@pytest.mark.parametrize("dtype,per_head,hq,hkv,page,ctx", ATTN_CASES)
def test_kernel_matches_reference(dtype, per_head, hq, hkv, page, ctx):
    gen = torch.Generator().manual_seed(hq * 10 + page)
    a = _setup(gen, b=len(ctx), hq=hq, hkv=hkv, page=page, ctx=ctx, dtype=dtype, per_head=per_head)
    want, bad_ref = paged_decode_attention_ref(*_gqa(a))
    got, bad = paged_decode_attention(*_gqa(_to(a, DEVICE)), backend="triton")
    assert not bad.any() and not bad_ref.any()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel_err(got, want) < ATTN_TOL
    if 0 in ctx:
        assert got[list(ctx).index(0)].abs().max() == 0  # empty context -> zeros, not NaN


def _setup_mla(gen, *, b=3, h=16, lr=32, rope=16, page=16, ctx=(1, 20, 45), dtype=torch.bfloat16):
    a = _setup(gen, b=b, hq=1, hkv=1, d=lr + rope, page=page, ctx=ctx, dtype=torch.bfloat16)
    latent = torch.randn(a["k_cache"].shape[0], page, lr + rope, generator=gen) * 2  # [P, S, L+R]
    scale = torch.tensor([0.012]) if dtype == FP8_DTYPE else None
    cache = quantize_kv(latent.unsqueeze(2), scale, dtype).squeeze(2)
    qn = torch.randn(b, h, lr, generator=gen).to(torch.bfloat16)
    qp = torch.randn(b, h, rope, generator=gen).to(torch.bfloat16)
    return dict(q_nope=qn, q_pe=qp, latent_cache=cache, block_tables=a["block_tables"],
                context_lens=a["context_lens"], sm_scale=1 / math.sqrt(lr + rope), scale=scale,
                owner=a["owner"], request_ids=a["request_ids"])


def test_mla_reference_matches_naive():
    gen = torch.Generator().manual_seed(1)
    m = _setup_mla(gen, dtype=FP8_DTYPE)
    out, bad = paged_mla_decode_attention_ref(*_mla(m), sm_scale=m["sm_scale"])
    assert not bad.any() and out.shape == (3, 16, 32)
    for i, t in enumerate(m["context_lens"].tolist()):
        c = gather_context(m["latent_cache"], m["block_tables"][i], t) * float(m["scale"])  # [T, L+R]
        q = torch.cat([m["q_nope"][i], m["q_pe"][i]], -1)  # scores = q_nope.c[:L] + q_pe.c[L:]
        want = naive_attention(q, c[:, None, :], c[:, None, :32], m["sm_scale"])
        assert rel_err(out[i], want) < 8e-3


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_mla_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    m = _setup_mla(gen, dtype=dtype)
    want, _ = paged_mla_decode_attention_ref(*_mla(m), sm_scale=m["sm_scale"])
    got, bad = paged_mla_decode_attention(*_mla(_to(m, DEVICE)), sm_scale=m["sm_scale"], backend="triton")
    assert not bad.any()
    assert rel_err(got, want) < ATTN_TOL


@needs_triton
@pytest.mark.parametrize("dtype,per_head", [(torch.bfloat16, False), (FP8_DTYPE, False), (FP8_DTYPE, True)])
def test_write_kernel_matches_reference_bitwise(dtype, per_head):
    gen = torch.Generator().manual_seed(3)
    a = _setup(gen, ctx=(3, 16, 37, 80), dtype=dtype, per_head=per_head)
    b, hkv, d = 4, 2, 32
    k_new = (torch.randn(b, hkv, d, generator=gen) * 3).to(torch.bfloat16)
    k_new[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-5])  # saturation and subnormals in FP8
    v_new = torch.randn(b, hkv, d, generator=gen).to(torch.bfloat16)
    pos = a["context_lens"] - 1  # the last slot of each context: includes a page's first and last slot
    kw = dict(k_scale=a["k_scale"], v_scale=a["v_scale"], owner=a["owner"], request_ids=a["request_ids"])
    kr, vr = a["k_cache"].clone(), a["v_cache"].clone()
    bad_ref = write_kv_cache_ref(k_new, v_new, PagedKV(kr, vr, a["block_tables"], **kw), pos)
    kt, vt = a["k_cache"].clone().to(DEVICE), a["v_cache"].clone().to(DEVICE)
    bad = write_kv_cache(k_new.to(DEVICE), v_new.to(DEVICE), PagedKV(kt, vt, a["block_tables"].to(DEVICE),
                                                                      **_to(kw, DEVICE)),
                         pos.to(DEVICE), backend="triton")
    assert not bad.any() and not bad_ref.any()
    u8 = (lambda t: t.cpu().view(torch.uint8)) if dtype == FP8_DTYPE else (lambda t: t.cpu().view(torch.int16))
    assert torch.equal(u8(kt), u8(kr)) and torch.equal(u8(vt), u8(vr))  # round-to-nearest-even on both sides
    assert not torch.equal(u8(kr), u8(a["k_cache"]))  # something was written
    # the written value reads back as the input, saturated at +-448 * scale (within one FP8 step)
    t = int(pos[2])
    page, slot = int(a["block_tables"][2, t // 16]), t % 16
    back = dequantize_kv(kr[page, slot], a["k_scale"])  # [Hkv, D]
    lim = torch.tensor(float("inf")) if a["k_scale"] is None else 448 * a["k_scale"].view(-1, 1)
    want = torch.minimum(torch.maximum(k_new[2].float(), -lim), lim)
    assert torch.allclose(back, want, rtol=0.07, atol=0.01)


def test_shape_errors():
    gen = torch.Generator().manual_seed(4)
    a = _setup(gen)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention_ref(*_gqa({**a, "q": torch.zeros(4, 7, 32, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(*_gqa({**a, "context_lens": a["context_lens"].long()}), backend="torch")
    with pytest.raises(TypeError):
        paged_decode_attention(*_gqa({**a, "k_cache": a["k_cache"].float()}), backend="torch")
