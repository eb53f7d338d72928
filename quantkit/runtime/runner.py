"""A small model runner that executes a quantkit INT4 checkpoint as written: packed experts through
`fused_moe_int4`, paged KV cache (BF16 or FP8) with the page-ownership check on every decode step.

It reads config.json and the shards (lazily, per tensor, through quantkit.io) and nothing of the
converter. Supported architectures, with routing, norms and RoPE as transformers' modeling files
define them (models/{qwen3_moe,mixtral,glm4_moe,deepseek_v3}/modeling_*.py):

    qwen3_moe    GQA + per-head q/k RMSNorm, softmax top-k (renormalized if norm_topk_prob)
    mixtral      GQA, softmax top-k, always renormalized
    glm4_moe     GQA (optional qk-norm, partial rotary, default factor 0.5), sigmoid scores +
                 e_score_correction_bias, group-limited top-k, routed_scaling_factor, shared expert,
                 first_k_dense_replace dense layers
    deepseek_v3  MLA (Kimi K2: model_type kimi_k2), same routing as glm4_moe; rope interleave, yarn

Weights: routed experts stay INT4 (`Int4Experts`, one stack per layer); packed dense Linears run
through `int4_gemm`; everything else is a BF16 tensor cast to the compute dtype. RoPE: default,
linear, yarn (anything else raises UnsupportedModel).

Attention: prefill computes causal attention in torch over the request's own tokens (fresh K/V)
and writes K/V to the pool; decode reads only the paged cache with the kernels of
runtime/paged_attention.py, integrity check on. GQA caches post-RoPE K (after k_norm) and V; MLA
caches the latent kv_a_layernorm(kv_a) ++ rotated k_pe and decodes in the absorbed form (q_nope
times W_UK, attention in latent space, W_UV after). The per-layer FP8 scales are why decode calls
write_kv_cache / paged_*_attention itself rather than decode_step (whose pool holds one scale for
all layers); the step is decode_step's, applied to every layer: a request whose block table points
outside its own pages is aborted (its pages freed, its id returned), the others are unaffected.

Not here: a scheduler, chunked prefill or prefix caching, sliding-window attention, sampling
(generate is greedy), tensor/expert parallelism, multimodal wrappers.

Legend: T = tokens of one request, B = requests in a decode batch, D = hidden, H / Hkv = query / KV
heads, Dh = head dim, E = experts, k = experts per token, V = vocab, L = kv_lora_rank, R = rope dim.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..errors import KVCacheViolation, RunnerError
from ..read.checkpoint import Checkpoint
from ._triton import resolve_backend
from .kv_pool import PagedKVPool, PoolSize
from .loader import (GQAAttention, Layer, MLAAttention, MoEBlock, Weights, _load_kv_scales, _load_weights, _Loader,
                     _QuantScheme, _Reader)
from .model import apply_rope, causal_attention, mlp_forward, moe_forward, rms_norm, rope_cos_sin
from .paged_attention import FP8_DTYPE, PagedKV, paged_decode_attention, paged_mla_decode_attention, write_kv_cache
from .spec import ModelSpec, parse_config

__all__ = ["load_runner", "Runner", "ModelSpec", "PoolSize", "Weights", "parse_config", "MoEBlock"]


class Runner:
    """A loaded model plus its paged KV pool. Build with load_runner().

    prefill(request_id, token_ids) -> logits fp32 [T, V]      registers the request, caches its K/V
    decode(request_ids, token_ids) -> (logits fp32 [B, V], aborted ids)   one token per request
    generate(token_ids, max_new_tokens) -> new token ids        greedy, frees its request after
    free(request_id)
    """

    def __init__(self, spec: ModelSpec, weights: Weights, pool: PagedKVPool, kv_scales: list[tuple], *,
                 backend: str, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.embed, self.layers, self.norm, self.lm_head = weights.embed, weights.layers, weights.norm, weights.lm_head
        self.pool, self.kv_scales = pool, kv_scales  # per layer (k_scale, v_scale) fp32 or (None, None)
        self.backend, self.dtype, self.device = backend, dtype, device
        self.inv_freq = spec.rope.inv_freq().to(device)

    # --- public API --------------------------------------------------------------------------------
    @property
    def requests(self) -> list[int]:
        return self.pool.requests

    def free(self, request_id: int) -> None:
        self.pool.free(request_id)

    @torch.no_grad()
    def prefill(self, request_id: int, token_ids) -> torch.Tensor:
        """Run a new request's prompt, write its K/V into the pool. -> logits fp32 [T, V]."""
        ids = self._tokens(token_ids)
        if ids.numel() == 0:
            raise RunnerError("prefill needs at least one token")
        self.pool.add_request(request_id)
        try:
            return self._prefill(request_id, ids)
        except BaseException:
            if request_id in self.pool.requests:
                self.pool.free(request_id)  # no half-registered request on any failure
            raise

    def _prefill(self, request_id: int, ids: torch.Tensor) -> torch.Tensor:
        t = ids.numel()
        self.pool.reserve([request_id], t)
        # every token is one "row" of the checked cache write: the request's table repeated T times
        tables = self.pool.block_tables([request_id]).expand(t, -1).contiguous()  # [T, max_pages]
        rows = self.pool.request_id_tensor([request_id] * t)
        positions = torch.arange(t, dtype=torch.int32, device=self.device)
        cos, sin = rope_cos_sin(self.spec.rope, self.inv_freq, torch.arange(t, device=self.device), self.dtype)
        x = self.embed[ids]  # [T, D]
        bad = torch.zeros(t, dtype=torch.bool, device=self.device)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.spec.rms_norm_eps)
            a, wbad = self._attn_prefill(layer.attn, h, cos, sin, self._paged(i, tables, rows), positions)
            bad |= wbad
            x = x + a
            x = x + self._mlp(i, layer, x)
        if bool(bad.any()):
            raise KVCacheViolation(f"request {request_id}: its block table points outside its own pages during "
                                   "prefill; it was aborted")
        self.pool.advance([request_id], t)
        return self._logits(x)

    @torch.no_grad()
    def decode(self, request_ids, token_ids) -> tuple[torch.Tensor, list[int]]:
        """One new token per request (already prefilled). -> (logits fp32 [B, V], aborted ids).

        Each request's K/V write and its attention read are checked against the page-owner table;
        a request whose block table points outside its own pages is aborted: its logits row is zeros
        and must not be used, its pages are freed, its id is returned. The other requests' results
        equal those of a batch without it."""
        rids = list(request_ids)
        ids = self._tokens(token_ids)
        if ids.numel() != len(rids) or not rids:
            raise RunnerError(f"decode takes one token per request: {len(rids)} requests, {ids.numel()} tokens")
        positions = self.pool.reserve(rids, 1)  # int32 [B], slot of the new token = tokens stored so far
        tables, rows = self.pool.block_tables(rids), self.pool.request_id_tensor(rids)
        cos, sin = rope_cos_sin(self.spec.rope, self.inv_freq, positions.to(torch.long), self.dtype)
        x = self.embed[ids]  # [B, D]
        violated = torch.zeros(len(rids), dtype=torch.bool, device=self.device)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.spec.rms_norm_eps)
            a, bad = self._attn_decode(layer.attn, h, cos, sin, self._paged(i, tables, rows), positions)
            violated |= bad
            x = x + a.masked_fill(violated[:, None], 0)  # a flagged row's attention is unspecified
            x = x + self._mlp(i, layer, x)
        logits = self._logits(x).masked_fill(violated[:, None], 0)
        aborted = [rids[j] for j in violated.nonzero().flatten().tolist()]
        for r in aborted:
            self.pool.free(r)  # frees only the pages the owner table says it owns
        gone = set(aborted)
        self.pool.advance([r for r in rids if r not in gone])
        return logits, aborted

    @torch.no_grad()
    def generate(self, token_ids, max_new_tokens: int, *, stop_token_ids=()) -> list[int]:
        """Greedy decoding of one prompt: the new tokens (without the prompt), at most max_new_tokens;
        stops after a token in stop_token_ids. The request is freed afterwards."""
        if max_new_tokens <= 0:
            return []
        rid = next(r for r in range(len(self.pool.requests) + 1) if r not in set(self.pool.requests))
        stop = set(stop_token_ids)
        try:
            tok = int(self.prefill(rid, token_ids)[-1].argmax())
            out = [tok]
            while len(out) < max_new_tokens and tok not in stop:
                logits, aborted = self.decode([rid], [tok])
                if aborted:
                    raise KVCacheViolation(f"request {rid} was aborted by the KV-cache integrity check")
                tok = int(logits[0].argmax())
                out.append(tok)
            return out
        finally:
            if rid in self.pool.requests:
                self.pool.free(rid)

    # --- pieces ------------------------------------------------------------------------------------
    def _tokens(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise RunnerError(f"token ids must lie in [0, {self.spec.vocab_size})")
        return ids

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm, self.spec.rms_norm_eps)
        return F.linear(h, self.lm_head).to(torch.float32)

    def _mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
        if isinstance(layer.mlp, MoEBlock):
            return moe_forward(self.spec.moe, layer.mlp, h, self.backend)
        return mlp_forward(layer.mlp, h, self.backend)

    def _gqa_qkv(self, a: GQAAttention, h, cos, sin):
        """-> q [N, H, Dh], k [N, Hkv, Dh] (post qk-norm, post RoPE), v [N, Hkv, Dh]."""
        n, dh, be = h.shape[0], self.spec.head_dim, self.backend
        q = a.q(h, be).view(n, -1, dh)
        k = a.k(h, be).view(n, -1, dh)
        v = a.v(h, be).view(n, -1, dh)
        if a.q_norm is not None:
            q = rms_norm(q, a.q_norm, self.spec.rms_norm_eps)
            k = rms_norm(k, a.k_norm, self.spec.rms_norm_eps)
        il = self.spec.rope.interleave
        return apply_rope(q, cos, sin, il), apply_rope(k, cos, sin, il), v

    def _mla_q_latent(self, a: MLAAttention, h, cos, sin):
        """-> q_nope [N, H, nope], q_pe [N, H, R] (rotated), latent [N, L + R] = norm(kv_a) ++ rotated k_pe."""
        m, be, n = self.spec.mla, self.backend, h.shape[0]
        q = a.q(h, be) if a.q is not None else a.q_b(rms_norm(a.q_a(h, be), a.q_a_norm, self.spec.rms_norm_eps), be)
        q = q.view(n, self.spec.num_heads, -1)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        kv = a.kv_a(h, be)  # [N, L + R]
        c = rms_norm(kv[:, : m.kv_lora_rank], a.kv_a_norm, self.spec.rms_norm_eps)
        k_pe = kv[:, None, m.kv_lora_rank:]  # [N, 1, R]
        il = self.spec.rope.interleave
        q_pe, k_pe = apply_rope(q_pe, cos, sin, il), apply_rope(k_pe, cos, sin, il)
        return q_nope, q_pe, torch.cat([c, k_pe[:, 0]], dim=-1)

    def _paged(self, i: int, tables: torch.Tensor, request_ids: torch.Tensor) -> PagedKV:
        """Layer i's cache with its own FP8 scales (the pool holds layer 0's), as these rows' tables see it."""
        kc, vc = self.pool.layer(i)
        ks, vs = self.kv_scales[i]
        return PagedKV(kc, vc, tables, k_scale=ks, v_scale=vs, owner=self.pool.owner, request_ids=request_ids)

    def _attn_prefill(self, a, h, cos, sin, kv: PagedKV, positions):
        """-> (attention output [T, D], write violated bool [T])."""
        t = h.shape[0]
        if isinstance(a, GQAAttention):
            q, k, v = self._gqa_qkv(a, h, cos, sin)
            bad = write_kv_cache(k, v, kv, positions, check=True, backend=self.backend)
            o = causal_attention(q, k, v, self.spec.sm_scale)  # [T, H, Dh]
        else:
            m = self.spec.mla
            q_nope, q_pe, latent = self._mla_q_latent(a, h, cos, sin)
            bad = write_kv_cache(latent[:, None], None, kv, positions, check=True, backend=self.backend)
            # as transformers: expand the latent to per-head K / V (the non-absorbed form)
            kv_up = a.kv_b(latent[:, : m.kv_lora_rank], self.backend).view(t, self.spec.num_heads, -1)
            k_nope, v = kv_up[..., : m.qk_nope_head_dim], kv_up[..., m.qk_nope_head_dim:]
            k_pe = latent[:, None, m.kv_lora_rank:].expand(t, self.spec.num_heads, m.qk_rope_head_dim)
            o = causal_attention(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, self.spec.sm_scale)
        return a.o(o.reshape(t, -1), self.backend), bad

    def _attn_decode(self, a, h, cos, sin, kv: PagedKV, positions):
        """-> (attention output [B, D], violated bool [B]) over the paged cache."""
        b = h.shape[0]
        ctx = positions + 1  # attend over the stored tokens and the one written now
        guard = dict(check=True, backend=self.backend)  # integrity always on
        if isinstance(a, GQAAttention):
            q, k, v = self._gqa_qkv(a, h, cos, sin)
            wbad = write_kv_cache(k, v, kv, positions, **guard)
            o, rbad = paged_decode_attention(q, kv, ctx, sm_scale=self.spec.sm_scale, **guard)  # [B, H, Dh]
        else:
            q_nope, q_pe, latent = self._mla_q_latent(a, h, cos, sin)
            wbad = write_kv_cache(latent[:, None], None, kv, positions, **guard)
            # absorbed form: scores = (q_nope W_UK) . c + q_pe . k_pe; out = (softmax @ c) W_UV^T
            q_abs = torch.einsum("bhn,hnl->bhl", q_nope.to(torch.float32), a.w_uk).to(self.dtype)  # [B, H, L]
            lat, rbad = paged_mla_decode_attention(q_abs, q_pe.contiguous(), kv, ctx, sm_scale=self.spec.sm_scale,
                                                   **guard)  # [B, H, L]
            o = torch.einsum("bhl,hvl->bhv", lat.to(torch.float32), a.w_uv).to(self.dtype)  # [B, H, v]
        return a.o(o.reshape(b, -1), self.backend), wbad | rbad


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
def load_runner(checkpoint_dir: str | os.PathLike, *, device="cpu", backend: str = "torch",
                dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype = torch.bfloat16, kv_scales=None,
                pool_size: PoolSize = PoolSize()) -> Runner:
    """Load a quantkit INT4 checkpoint for running.

    dtype: activation / dense-weight dtype (bf16, fp16; fp32 only with the torch backend).
    kv_dtype: bfloat16, float16 or float8_e4m3fn; FP8 takes per-layer scales from kv_scales (a mapping
    name -> tensor or a safetensors file of model.layers.L.self_attn.{k,v}_scale) or, when None, the
    checkpoint's own. The pool holds pool_size: num_pages pages of page_size tokens, max_requests
    requests at once, each holding up to max_pages_per_request pages (None or 0: all of them)."""
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise RunnerError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    try:
        resolved = resolve_backend(backend, device)
    except (RuntimeError, ValueError) as e:
        raise RunnerError(str(e), hint="use backend='torch', or set TRITON_INTERPRET=1 before importing "
                                       "quantkit.runtime to run the kernels on a CPU") from None
    if kv_dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        raise RunnerError(f"kv_dtype must be bfloat16, float16 or float8_e4m3fn, got {kv_dtype}")
    if resolved == "triton" and dtype == torch.float32:
        raise RunnerError("the Triton kernels take bf16/fp16 activations", hint="use dtype=torch.bfloat16 or "
                                                                                 "backend='torch'")
    ckpt = Checkpoint.open(checkpoint_dir)
    spec = parse_config(ckpt.config)
    scheme = _QuantScheme(ckpt.quantization_config)
    reader = _Reader(ckpt)
    try:
        weights = _load_weights(_Loader(reader, scheme, dtype, device), reader, spec, dtype)
        scales = _load_kv_scales(spec, kv_dtype, kv_scales, reader, device)
    finally:
        reader.close()
    width = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    k0, v0 = scales[0]
    size = replace(pool_size, max_pages_per_request=pool_size.max_pages_per_request or pool_size.num_pages)
    pool = PagedKVPool(size, spec.num_kv_heads, width, dtype=kv_dtype, k_scale=k0, v_scale=v0,
                       num_layers=spec.num_layers, latent=spec.mla is not None,
                       device=device)  # the pool's own scales go unused: each layer passes its own
    return Runner(spec, weights, pool, scales, backend=backend, dtype=dtype, device=device)
