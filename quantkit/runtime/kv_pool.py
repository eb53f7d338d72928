"""A paged KV-cache pool: fixed-size pages handed to requests, per-request block tables, and the
page-owner table that the attention and cache-write kernels check (runtime/paged_attention.py).

The pool is the single writer of the owner table and of the block tables; the kernels only read
them. Host-side bookkeeping (which pages a request holds, its length) is the truth; `owner` and
`block_table` are its device copies. A corrupted device table (a scheduler or kernel bug) is what
the integrity check catches: see runtime/decode.py for the step that aborts such requests.

Not here: prefix sharing / copy-on-write pages (a page has exactly one owner), eviction, swapping,
multi-GPU pools. Storage: BF16/FP16, or FP8 e4m3 with a per-tensor [1] or per-head [Hkv, 1, 1]
scale fixed at construction (calibrated offline, docs/format.md "KV-cache FP8 scales").

Layout: k_cache / v_cache [layers, P, S, Hkv, D]; an MLA latent pool (latent=True) keeps one
latent per token, k_cache [layers, P, S, 1, L+R] and no v_cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import KVPoolError, KVPoolExhausted
from .paged_attention import CACHE_DTYPES, FP8_DTYPE, PagedKV, write_kv_cache

__all__ = ["PoolSize", "PagedKVPool", "KVPoolError", "KVPoolExhausted"]

FREE = -1  # owner-table value of an unallocated page


@dataclass(frozen=True)
class PoolSize:
    """What a pool holds: num_pages pages of page_size tokens, shared by up to max_requests requests at
    once, each holding at most max_pages_per_request pages (None: all of them)."""

    num_pages: int = 256
    page_size: int = 16
    max_requests: int = 8
    max_pages_per_request: int | None = None


class PagedKVPool:
    """Pages of `size.page_size` tokens shared by up to `size.max_requests` concurrent requests."""

    def __init__(self, size: PoolSize, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 num_layers: int = 1, latent: bool = False, device="cpu"):
        num_pages, page_size, max_requests = size.num_pages, size.page_size, size.max_requests
        max_pages_per_request = num_pages if size.max_pages_per_request is None else size.max_pages_per_request
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"KV dtype must be one of {CACHE_DTYPES}, got {dtype}")
        if latent and num_kv_heads != 1:
            raise ValueError("an MLA latent pool has one latent 'head' (num_kv_heads=1)")
        if dtype == FP8_DTYPE and (k_scale is None or (v_scale is None and not latent)):
            raise ValueError("an FP8 pool needs calibrated k_scale (and v_scale); a silent 1.0 loses accuracy")
        self.device = torch.device(device)
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_requests, self.max_pages_per_request = max_requests, max_pages_per_request
        self.dtype, self.latent, self.num_layers = dtype, latent, num_layers
        f32 = dict(dtype=torch.float32, device=self.device)
        self.k_scale = None if dtype != FP8_DTYPE else torch.as_tensor(k_scale, **f32).reshape(-1, 1, 1)
        self.v_scale = None if dtype != FP8_DTYPE or latent else torch.as_tensor(v_scale, **f32).reshape(-1, 1, 1)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # [layers, P, S, Hkv, D]
        self.v_cache = None if latent else torch.zeros(shape, dtype=dtype, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.owner = torch.full((num_pages,), FREE, **i32)  # [P] request id or -1
        self.block_table = torch.full((max_requests, max_pages_per_request), FREE, **i32)  # [R, max_pages]
        self._free_pages = list(range(num_pages - 1, -1, -1))  # stack; pops low ids first
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._row: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}

    # --- bookkeeping -------------------------------------------------------------------------------
    @property
    def requests(self) -> list[int]:
        return list(self._row)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def seq_len(self, rid: int) -> int:
        return self._len[self._known(rid)]

    def pages_of(self, rid: int) -> list[int]:
        return list(self._pages[self._known(rid)])

    def _known(self, rid: int) -> int:
        if rid not in self._row:
            raise KVPoolError(f"request {rid} is not in the pool")
        return rid

    def add_request(self, rid: int) -> None:
        if not 0 <= rid < 2**31:
            raise KVPoolError(f"request ids must be in [0, 2**31), got {rid}")
        if rid in self._row:
            raise KVPoolError(f"request {rid} is already in the pool")
        if not self._free_rows:
            raise KVPoolExhausted(f"all {self.max_requests} request slots are in use")
        self._row[rid] = self._free_rows.pop()
        self._pages[rid], self._len[rid] = [], 0

    def reserve(self, request_ids: list[int], num_tokens: int = 1) -> torch.Tensor:
        """Make room for `num_tokens` more tokens per request (allocating pages, updating the owner
        and block tables); lengths do not change. Idempotent until `advance`. All-or-nothing.
        -> positions int32 [B] of each request's first new token."""
        if len(set(request_ids)) != len(request_ids):
            raise KVPoolError("a batch lists a request twice")
        need = {}
        for rid in request_ids:
            total = math.ceil((self._len[self._known(rid)] + num_tokens) / self.page_size)
            if total > self.max_pages_per_request:
                raise KVPoolExhausted(f"request {rid} would need {total} pages, the table holds "
                                      f"{self.max_pages_per_request}")
            need[rid] = total - len(self._pages[rid])
        wanted = sum(n for n in need.values() if n > 0)
        if wanted > len(self._free_pages):
            raise KVPoolExhausted(f"need {wanted} pages, {len(self._free_pages)} free")
        new_pages, new_rows, new_cols, new_owner = [], [], [], []
        for rid, n in need.items():
            for _ in range(max(0, n)):
                page = self._free_pages.pop()
                new_pages.append(page), new_rows.append(self._row[rid]), new_owner.append(rid)
                new_cols.append(len(self._pages[rid]))
                self._pages[rid].append(page)
        if new_pages:
            idx = dict(dtype=torch.long, device=self.device)
            pages_t = torch.tensor(new_pages, **idx)
            self.owner[pages_t] = torch.tensor(new_owner, dtype=torch.int32, device=self.device)
            self.block_table[torch.tensor(new_rows, **idx), torch.tensor(new_cols, **idx)] = pages_t.to(torch.int32)
        return self.context_lens(request_ids)

    def advance(self, request_ids, num_tokens: int = 1) -> None:
        """Count `num_tokens` more tokens as stored (after they were written)."""
        for rid in request_ids:
            n = self._len[self._known(rid)] + num_tokens
            if n > len(self._pages[rid]) * self.page_size:
                raise KVPoolError(f"request {rid} advanced past its reserved pages; call reserve first")
            self._len[rid] = n

    def free(self, rid: int) -> None:
        """Return a request's pages (and its table row) to the pool."""
        pages = self._pages.pop(self._known(rid))
        row = self._row.pop(rid)
        del self._len[rid]
        if pages:
            pages_t = torch.tensor(pages, dtype=torch.long, device=self.device)
            # only pages this request owns: a corrupted table must not free someone else's page
            mine = self.owner[pages_t] == rid
            self.owner[pages_t[mine]] = FREE
        self.block_table[row] = FREE
        self._free_pages.extend(reversed(pages))
        self._free_rows.append(row)

    # --- views the kernels take --------------------------------------------------------------------
    def rows(self, request_ids) -> torch.Tensor:
        return torch.tensor([self._row[self._known(r)] for r in request_ids], dtype=torch.long, device=self.device)

    def block_tables(self, request_ids) -> torch.Tensor:
        """int32 [B, max_pages_per_request]; unused entries are -1."""
        return self.block_table.index_select(0, self.rows(request_ids))

    def context_lens(self, request_ids) -> torch.Tensor:
        """int32 [B] tokens stored per request."""
        return torch.tensor([self._len[self._known(r)] for r in request_ids], dtype=torch.int32, device=self.device)

    def request_id_tensor(self, request_ids) -> torch.Tensor:
        return torch.tensor(list(request_ids), dtype=torch.int32, device=self.device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(k_cache [P, S, Hkv, D], v_cache or None) of one layer (views)."""
        return self.k_cache[layer], None if self.v_cache is None else self.v_cache[layer]

    def paged(self, request_ids, layer: int = 0) -> PagedKV:
        """One layer as the kernels take it for this batch: its caches, the pool's scales, the requests'
        block tables, the owner table and the request ids."""
        kc, vc = self.layer(layer)
        return PagedKV(kc, vc, self.block_tables(request_ids), k_scale=self.k_scale, v_scale=self.v_scale,
                       owner=self.owner, request_ids=self.request_id_tensor(request_ids))

    def write(self, request_ids, k_new: torch.Tensor, v_new: torch.Tensor | None, positions: torch.Tensor, *,
              layer: int = 0, check: bool = True, backend: str = "auto") -> torch.Tensor:
        """Store one token per request at `positions` (from reserve). -> violated bool [B]."""
        return write_kv_cache(k_new, v_new, self.paged(request_ids, layer), positions, check=check, backend=backend)

    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (scales excluded)."""
        per = self.num_kv_heads * self.head_dim * self.k_cache.element_size()
        return self.num_layers * per * (1 if self.latent else 2)
