"""runtime/kv_pool.py: page allocation, block tables, the owner table, freeing, FP8 storage, and
decode_step over many steps against dense attention over everything appended so far."""

import pytest
import torch

from quantkit.runtime.decode import DecodeInputs, decode_step
from quantkit.runtime.kv_pool import PagedKVPool, PoolSize
from quantkit.errors import KVPoolError, KVPoolExhausted
from quantkit.runtime.paged_attention import FP8_DTYPE, quantize_kv

from .helpers import naive_attention, rel_err


def _owner_consistent(pool: PagedKVPool):
    owner = pool.owner.cpu()
    for r in pool.requests:
        pages = pool.pages_of(r)
        assert (owner[pages] == r).all()
        row = pool.block_tables([r])[0].cpu()
        assert row[:len(pages)].tolist() == pages and (row[len(pages):] == -1).all()
        assert len(pages) * pool.page_size >= pool.seq_len(r)
    held = sum(len(pool.pages_of(r)) for r in pool.requests)
    assert int((owner >= 0).sum()) == held and pool.num_free_pages == pool.num_pages - held


def test_allocate_append_free():
    pool = PagedKVPool(PoolSize(10, 4, max_requests=3, max_pages_per_request=5), 2, 8)
    pool.add_request(5)
    pool.add_request(9)
    pos = pool.reserve([5, 9], 6)  # 2 pages each
    assert pos.tolist() == [0, 0] and pool.num_free_pages == 6
    assert pool.reserve([5, 9], 6).tolist() == [0, 0] and pool.num_free_pages == 6  # idempotent
    pool.advance([5, 9], 6)
    assert pool.reserve([5], 3).tolist() == [6]  # 9 tokens -> 3 pages
    pool.advance([5], 3)
    _owner_consistent(pool)
    freed = pool.pages_of(5)
    pool.free(5)
    assert (pool.owner[freed] == -1).all() and pool.num_free_pages == 8
    _owner_consistent(pool)
    pool.add_request(5)  # ids may be reused once freed
    assert pool.seq_len(5) == 0


def test_errors():
    pool = PagedKVPool(PoolSize(4, 4, max_requests=2, max_pages_per_request=3), 1, 8)
    with pytest.raises(KVPoolError):
        pool.reserve([1])
    pool.add_request(1)
    with pytest.raises(KVPoolError, match="already"):
        pool.add_request(1)
    with pytest.raises(KVPoolExhausted, match="table"):
        pool.reserve([1], 13)
    pool.add_request(2)
    pool.reserve([1], 12)
    with pytest.raises(KVPoolExhausted, match="free"):
        pool.reserve([2], 8)  # all-or-nothing: nothing allocated
    assert pool.num_free_pages == 1 and pool.pages_of(2) == []
    with pytest.raises(KVPoolError, match="twice"):
        pool.reserve([1, 1])
    with pytest.raises(ValueError, match="k_scale"):
        PagedKVPool(PoolSize(4, 4, max_requests=1, max_pages_per_request=1), 1, 8, dtype=FP8_DTYPE)


def test_free_never_releases_pages_it_does_not_own():
    pool = PagedKVPool(PoolSize(8, 4, max_requests=2, max_pages_per_request=4), 1, 8)
    for r in (1, 2):
        pool.add_request(r)
    pool.reserve([1, 2], 8)
    pool.block_table[pool._row[1], 0] = pool.pages_of(2)[0]  # corrupted device table
    pool.free(1)
    assert (pool.owner[pool.pages_of(2)] == 2).all()
    _owner_consistent(pool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_decode_steps_match_dense_attention(dtype):
    """20 decode steps of 3 requests that join at different times; each step's output must equal
    dense float64 attention over everything that request appended (quantized as the pool stores it)."""
    gen = torch.Generator().manual_seed(0)
    ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
    pool = PagedKVPool(PoolSize(24, 4, max_requests=4, max_pages_per_request=8), 2, 16, dtype=dtype,
                       k_scale=ks if dtype == FP8_DTYPE else None, v_scale=vs if dtype == FP8_DTYPE else None)
    hist = {}
    for step in range(20):
        if step in (0, 3, 9):
            rid = 100 + step
            pool.add_request(rid)
            hist[rid] = ([], [])
        ids = pool.requests
        q = torch.randn(len(ids), 4, 16, generator=gen).to(torch.bfloat16)
        k = torch.randn(len(ids), 2, 16, generator=gen).to(torch.bfloat16)
        v = torch.randn(len(ids), 2, 16, generator=gen).to(torch.bfloat16)
        res = decode_step(pool, ids, DecodeInputs(q, k, v), backend="torch")
        assert res.aborted == []
        for j, r in enumerate(ids):
            kq = quantize_kv(k[j], ks, dtype).float() * (ks if dtype == FP8_DTYPE else 1)
            vq = quantize_kv(v[j], vs, dtype).float() * (vs if dtype == FP8_DTYPE else 1)
            hist[r][0].append(kq.double())
            hist[r][1].append(vq.double())
            want = naive_attention(q[j], torch.stack(hist[r][0]), torch.stack(hist[r][1]), 0.25)
            assert rel_err(res.output[j], want) < 8e-3
        if step == 14:
            pool.free(103)
            del hist[103]
        _owner_consistent(pool)
    assert pool.seq_len(100) == 20 and pool.bytes_per_token() == 2 * 2 * 16 * pool.k_cache.element_size()
