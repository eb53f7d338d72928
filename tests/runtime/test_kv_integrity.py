"""KV-cache integrity: randomized injection of bad block-table entries (another request's page, a
free page, a page of a request outside the batch, out-of-range values, an over-long context) into
reads (attention) and writes (cache append). Every injection must be detected, clean runs must flag
nothing, only the offending requests may be flagged, and every other request's output (and cache
contents) must equal a clean run's bit for bit.

The bulk (>= 1000 injections) runs the torch references; a smaller randomized set runs the Triton
kernels; decode_step is checked end to end on a PagedKVPool with both backends."""

import math

import pytest
import torch

from quantkit.runtime.decode import DecodeInputs, decode_step
from quantkit.runtime.kv_pool import PagedKVPool, PoolSize
from quantkit.runtime.paged_attention import (FP8_DTYPE, PagedKV, paged_decode_attention, paged_decode_attention_ref,
                                              paged_mla_decode_attention, paged_mla_decode_attention_ref,
                                              quantize_kv, write_kv_cache, write_kv_cache_ref)

from .helpers import DEVICE, needs_triton, rel_err

BAD_VALUES = (-1, -7, 2**31 - 1, -(2**31))  # plus P and P + 3, which depend on the pool size


def _randint(gen, lo, hi):
    return int(torch.randint(lo, hi, (1,), generator=gen))


def _batch(gen, *, mla: bool):
    """A random batch: requests with random lengths on shuffled pages, plus free pages and pages of
    requests that are not in the batch. Returns (kernel kwargs, per-request page lists, meta)."""
    b = _randint(gen, 2, 8)
    page = (4, 8, 16)[_randint(gen, 0, 3)]
    hkv, g = (1, 1) if mla else ((1, 2)[_randint(gen, 0, 2)], (1, 2, 4)[_randint(gen, 0, 3)])
    d = 24 if mla else 16
    ctx = torch.randint(1, 41, (b,), generator=gen, dtype=torch.int32)
    need = [math.ceil(int(c) / page) for c in ctx]
    n_foreign, n_free = _randint(gen, 1, 4), _randint(gen, 1, 4)
    p = sum(need) + n_foreign + n_free
    perm = torch.randperm(p, generator=gen).tolist()
    rid = (torch.randperm(500, generator=gen)[:b + 1] + 1).to(torch.int32)  # rid[b] is outside the batch
    owner = torch.full((p,), -1, dtype=torch.int32)
    max_pages = max(need) + _randint(gen, 0, 3)
    table = torch.full((b, max_pages), -1, dtype=torch.int32)
    pages, at = [], 0
    for i, n in enumerate(need):
        pg = perm[at:at + n]
        at += n
        table[i, :n] = torch.tensor(pg, dtype=torch.int32)
        owner[pg] = rid[i]
        pages.append(pg)
    foreign = perm[at:at + n_foreign]
    owner[foreign] = rid[b]
    free = perm[at + n_foreign:]
    dtype = (torch.bfloat16, FP8_DTYPE)[_randint(gen, 0, 2)]
    scale = torch.tensor([0.02]) if dtype == FP8_DTYPE else None
    kc = quantize_kv(torch.randn(p, page, hkv, d, generator=gen), scale, dtype)
    if mla:
        kw = dict(q_nope=torch.randn(b, 4, 16, generator=gen).to(torch.bfloat16),
                  q_pe=torch.randn(b, 4, 8, generator=gen).to(torch.bfloat16), latent_cache=kc[:, :, 0],
                  sm_scale=0.2, scale=scale)
    else:
        vc = quantize_kv(torch.randn(p, page, hkv, d, generator=gen), scale, dtype)
        kw = dict(q=torch.randn(b, hkv * g, d, generator=gen).to(torch.bfloat16), k_cache=kc, v_cache=vc,
                  k_scale=scale, v_scale=scale)
    kw.update(block_tables=table, context_lens=ctx, owner=owner, request_ids=rid[:b])
    meta = dict(b=b, page=page, num_pages=p, pages=pages, foreign=foreign, free=free, need=need,
                max_pages=max_pages, hkv=hkv, d=d)
    return kw, meta


def _bad_entry(gen, meta, i):
    """A value that request i must not use as a table entry (only out-of-range ones without an owner table)."""
    kind = 3 if meta["range_only"] else _randint(gen, 0, 4)
    if kind == 0 and meta["b"] > 1:  # another request's page in this batch
        j = (i + _randint(gen, 1, meta["b"])) % meta["b"]
        return meta["pages"][j][_randint(gen, 0, len(meta["pages"][j]))]
    if kind == 1:  # a page owned by a request outside the batch
        return meta["foreign"][_randint(gen, 0, len(meta["foreign"]))]
    if kind == 2:  # a free page
        return meta["free"][_randint(gen, 0, len(meta["free"]))]
    vals = BAD_VALUES + (meta["num_pages"], meta["num_pages"] + 3)  # out of range
    return vals[_randint(gen, 0, len(vals))]


def _inject_reads(gen, kw, meta):
    """Corrupt one read entry (or the context length) of a random strict subset of the requests."""
    b = meta["b"]
    chosen = torch.zeros(b, dtype=torch.bool)
    for i in torch.randperm(b, generator=gen)[:_randint(gen, 1, b)].tolist():
        chosen[i] = True
    table, ctx = kw["block_tables"].clone(), kw["context_lens"].clone()
    for i in chosen.nonzero().flatten().tolist():
        if _randint(gen, 0, 10) == 0:  # a context longer than the table reaches past it
            ctx[i] = meta["max_pages"] * meta["page"] + _randint(gen, 1, 5)
        else:
            table[i, _randint(gen, 0, meta["need"][i])] = _bad_entry(gen, meta, i)
    return {**kw, "block_tables": table, "context_lens": ctx}, chosen


def _kernel_args(kw, mla):
    """_batch's arguments as the attention kernels take them: (positional, keyword)."""
    if mla:
        kv = PagedKV(kw["latent_cache"], None, kw["block_tables"], k_scale=kw["scale"], owner=kw["owner"],
                     request_ids=kw["request_ids"])
        return (kw["q_nope"], kw["q_pe"], kv, kw["context_lens"]), dict(sm_scale=kw["sm_scale"])
    kv = PagedKV(kw["k_cache"], kw["v_cache"], kw["block_tables"], k_scale=kw["k_scale"], v_scale=kw["v_scale"],
                 owner=kw["owner"], request_ids=kw["request_ids"])
    return (kw["q"], kv, kw["context_lens"]), {}


def _attend(kw, mla, backend):
    args, extra = _kernel_args(kw, mla)
    if backend == "torch":
        return (paged_mla_decode_attention_ref if mla else paged_decode_attention_ref)(*args, **extra)
    return (paged_mla_decode_attention if mla else paged_decode_attention)(*args, **extra, backend=backend)


def _write(kw, meta, mla, positions, table, backend, gen_vals):
    """Write one token per request into clones of the caches. -> (flags, k cache, v cache or None)."""
    kc = (kw["latent_cache"].unsqueeze(2) if mla else kw["k_cache"]).clone()
    vc = None if mla else kw["v_cache"].clone()
    k_new, v_new = gen_vals
    fn = write_kv_cache if backend == "triton" else write_kv_cache_ref
    extra = {"backend": "triton"} if backend == "triton" else {}
    scale = kw["scale"] if mla else kw["k_scale"]
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    kcd, vcd = kc.to(dev), (vc.to(dev) if vc is not None else None)
    on_dev = lambda t: None if t is None else t.to(dev)  # noqa: E731
    kv = PagedKV(kcd, vcd, table.to(dev), k_scale=on_dev(scale), v_scale=None if mla else on_dev(scale),
                 owner=on_dev(kw["owner"]), request_ids=kw["request_ids"].to(dev))
    flags = fn(k_new.to(dev), None if mla else v_new.to(dev), kv, positions.to(dev), **extra)
    return flags.cpu(), kcd.cpu(), (vcd.cpu() if vcd is not None else None)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _check_writes(gen, kw, meta, mla, backend):
    """Inject at the written entry of a random subset; returns the number of injections."""
    b, page = meta["b"], meta["page"]
    positions = kw["context_lens"] - 1  # last slot of each context
    k_new = torch.randn(b, meta["hkv"], meta["d"], generator=gen).to(torch.bfloat16)
    v_new = torch.randn(b, meta["hkv"], meta["d"], generator=gen).to(torch.bfloat16)
    flags0, k0, v0 = _write(kw, meta, mla, positions, kw["block_tables"], backend, (k_new, v_new))
    assert not flags0.any(), "false positive on a clean write"
    chosen = torch.zeros(b, dtype=torch.bool)
    for i in torch.randperm(b, generator=gen)[:_randint(gen, 1, b + 1)].tolist():
        chosen[i] = True
    table = kw["block_tables"].clone()
    for i in chosen.nonzero().flatten().tolist():
        table[i, int(positions[i]) // page] = _bad_entry(gen, meta, i)
    flags1, k1, v1 = _write(kw, meta, mla, positions, table, backend, (k_new, v_new))
    assert torch.equal(flags1, chosen), f"write flags {flags1.tolist()} != injected {chosen.tolist()}"
    # expected cache: the clean write, minus the writes of the flagged requests (left untouched)
    k_orig = (kw["latent_cache"].unsqueeze(2) if mla else kw["k_cache"])
    k_want = k0.clone()
    v_want = None if mla else v0.clone()
    for i in chosen.nonzero().flatten().tolist():
        pg, sl = int(kw["block_tables"][i, int(positions[i]) // page]), int(positions[i]) % page
        k_want[pg, sl] = k_orig[pg, sl]
        if not mla:
            v_want[pg, sl] = kw["v_cache"][pg, sl]
    assert torch.equal(_bits(k1), _bits(k_want)), "a blocked write changed the cache"
    if not mla:
        assert torch.equal(_bits(v1), _bits(v_want))
    return int(chosen.sum())


def _on_device(kw):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _run_trial(gen, backend):
    mla = _randint(gen, 0, 10) < 3
    kw, meta = _batch(gen, mla=mla)
    meta["range_only"] = _randint(gen, 0, 10) < 2  # no owner table: the range check alone must hold
    if meta["range_only"]:
        kw["owner"] = None
    run_kw = kw if backend == "torch" else _on_device(kw)
    out0, bad0 = _attend(run_kw, mla, backend)
    assert not bad0.any(), "false positive on a clean batch"
    bad_kw, chosen = _inject_reads(gen, kw, meta)
    if backend != "torch":
        bad_kw = _on_device(bad_kw)
    out1, bad1 = _attend(bad_kw, mla, backend)
    bad1, out0, out1 = bad1.cpu(), out0.cpu(), out1.cpu()
    assert torch.equal(bad1, chosen), f"read flags {bad1.tolist()} != injected {chosen.tolist()}"
    assert torch.equal(out1[~chosen], out0[~chosen]), "an innocent request's output changed"
    if backend == "torch":
        assert out1[chosen].abs().max() == 0  # the reference zeroes flagged requests
    n = int(chosen.sum())
    n += _check_writes(gen, kw, meta, mla, backend)
    return n, out0, kw, mla


def test_injections_reference_path(capsys):
    gen = torch.Generator().manual_seed(2024)
    injected = trials = 0
    while injected < 1000:
        n, out0, _, _ = _run_trial(gen, "torch")
        injected += n
        trials += 1
        assert trials < 2000
    with capsys.disabled():
        print(f"\n[integrity] torch reference: {injected} injections in {trials} random batches, all detected, "
              f"0 false positives")
    assert injected >= 1000


@needs_triton
def test_injections_triton_path(capsys):
    gen = torch.Generator().manual_seed(7)
    injected = 0
    for _ in range(10):
        n, out0, kw, mla = _run_trial(gen, "triton")
        injected += n
        want, _ = _attend(kw, mla, "torch")  # clean kernel output also matches the reference
        assert rel_err(out0, want) < 2e-2
    with capsys.disabled():
        print(f"\n[integrity] triton kernels: {injected} injections in 10 random batches, all detected")
    assert injected >= 20


@needs_triton
def test_check_off_matches_check_on_when_clean():
    gen = torch.Generator().manual_seed(8)
    kw, _ = _batch(gen, mla=False)
    kw = _on_device(kw)
    args, _ = _kernel_args(kw, mla=False)
    on, _ = paged_decode_attention(*args, backend="triton")
    off, bad = paged_decode_attention(*args, check=False, backend="triton")
    assert torch.equal(on, off) and not bad.any()


# --------------------------------------------------------------------------------------------------
# decode_step on a pool
# --------------------------------------------------------------------------------------------------
def _pool(dtype, latent=False):
    kw = dict(dtype=dtype, device=DEVICE)
    if dtype == FP8_DTYPE:
        kw.update(k_scale=torch.tensor([0.02]), v_scale=None if latent else torch.tensor([0.03]))
    size = PoolSize(40, 4, max_requests=6, max_pages_per_request=8)
    if latent:
        return PagedKVPool(size, 1, 24, latent=True, **kw)
    return PagedKVPool(size, 2, 16, **kw)


def _step(pool, ids, inputs, backend):
    """decode_step with _step_inputs' tensors (and, for an MLA pool, its sm_scale)."""
    tensors = {k: v for k, v in inputs.items() if k != "sm_scale"}
    return decode_step(pool, ids, DecodeInputs(**tensors), sm_scale=inputs.get("sm_scale"), backend=backend)


def _step_inputs(gen, b, latent):
    if latent:
        return dict(q=torch.randn(b, 4, 16, generator=gen).to(torch.bfloat16).to(DEVICE),
                    q_pe=torch.randn(b, 4, 8, generator=gen).to(torch.bfloat16).to(DEVICE),
                    k_new=torch.randn(b, 24, generator=gen).to(torch.bfloat16).to(DEVICE), sm_scale=0.2)
    return dict(q=torch.randn(b, 4, 16, generator=gen).to(torch.bfloat16).to(DEVICE),
                k_new=torch.randn(b, 2, 16, generator=gen).to(torch.bfloat16).to(DEVICE),
                v_new=torch.randn(b, 2, 16, generator=gen).to(torch.bfloat16).to(DEVICE))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype,latent,corruption", [(torch.bfloat16, False, "cross_read"),
                                                     (FP8_DTYPE, False, "cross_write"),
                                                     (FP8_DTYPE, True, "out_of_range")])
def test_decode_step_aborts_only_the_offender(backend, dtype, latent, corruption):
    """Twin pools run the same steps; in one, request 12's table is corrupted at step 3. Only 12 is
    aborted (pages freed), the others' outputs match the clean twin at every step, and the victim's
    cache pages are untouched."""
    ids = [10, 11, 12, 13]
    clean, dirty = _pool(dtype, latent), _pool(dtype, latent)
    for p in (clean, dirty):
        for r in ids:
            p.add_request(r)
    gen = torch.Generator().manual_seed(11)
    live = list(ids)
    for step in range(6):
        inputs = _step_inputs(gen, len(ids), latent)
        ref = _step(clean, ids, inputs, backend)
        assert ref.aborted == [] and not ref.violated.any()
        if step == 3:
            dirty.reserve(live, 1)  # make sure the page of this step exists before corrupting it
            row = dirty._row[12]
            victim_page = dirty.pages_of(11)[0]
            pos = dirty.seq_len(12)
            if corruption == "cross_read":
                dirty.block_table[row, 0] = victim_page
            elif corruption == "cross_write":
                dirty.block_table[row, pos // dirty.page_size] = victim_page
            else:
                dirty.block_table[row, pos // dirty.page_size] = dirty.num_pages + 5
        batch = list(live)
        sel = [ids.index(r) for r in batch]
        res = _step(dirty, batch, {k: (v[sel] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                    backend)
        if step == 3:
            assert res.aborted == [12]
            assert res.violated.tolist() == [r == 12 for r in batch]
            assert res.output[batch.index(12)].abs().max() == 0
            assert 12 not in dirty.requests
            live.remove(12)
            assert torch.equal(_bits(clean.k_cache[:, victim_page].cpu()), _bits(dirty.k_cache[:, victim_page].cpu()))
        else:
            assert res.aborted == []
        for r in live:
            assert torch.equal(res.output[batch.index(r)], ref.output[ids.index(r)]), f"request {r} diverged"
    # the aborted request's pages went back to the pool: every live page is owned by a live request
    owned = dirty.owner[dirty.owner >= 0].cpu().tolist()
    assert set(owned) <= set(live)
    assert dirty.num_free_pages == dirty.num_pages - sum(len(dirty.pages_of(r)) for r in live)
