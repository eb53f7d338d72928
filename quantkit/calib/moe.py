"""Routed experts run grouped by expert: the calibration executor's forward for transformers 5 MoE layers.

transformers 5 keeps the routed experts of qwen3_moe, mixtral, deepseek_v3 (Kimi K2), glm4_moe and glm_moe_dsa
as one module with fused parameters `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I], no
biases, called as `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`. Its
"eager" implementation loops over the experts that received tokens, in ascending order, and for each one:
finds its (slot, token) pairs with `torch.where` over a one-hot mask (slot-major order), gathers those tokens,
runs `act(x gate^T) * (x up^T)`, then `down`, multiplies by the pair's router weight and `index_add_`s the
result into a zero tensor of the input's dtype. An index equal to E is a sentinel (expert parallelism marks
tokens routed to experts another rank owns this way) and is skipped.

`batched_experts_forward` computes the same thing with the routing sorted once (`route`): every routed pair
grouped by expert, within an expert in the eager loop's order. Consecutive experts' tokens are gathered as
one block, each expert's two products written into its rows of shared buffers (one `mm` per expert, the same
rows in the same order as eager, so the same GEMM calls), the activation, gating and routing weights applied
once per block, and the results added into the output with one `index_add_` per expert in ascending order,
eager's sequence of calls (so bfloat16 rounds after each expert as eager does). On the machine it was
written on the result is bit-identical to eager in float32 and bfloat16 (tests/calib/test_moe.py states the
tolerance it asserts).

Blocks are bounded by `budget` bytes of temporaries (gathered inputs, gate/up products, down products), in
buffers allocated once per call: an expert whose tokens alone exceed it is split into several GEMMs, which may
change the last bits. The GEMMs are eager's, so the gain is the rest: no one-hot mask and per-expert
`torch.where`, and few large element-wise ops instead of many small ones (bench/moe_forward.py, 1 thread:
eager takes 1.1-1.25x the CPU time with glibc's heap, 1.25-1.55x under the executor's `bound_heap`, where its
per-expert buffers are fresh mappings). Padded batched matmuls (`torch.bmm` over [e, t, *] blocks
padded to the longest expert) compute the same values but were slower than this at every shape of the
benchmark (the padding, the scatter into the padded block and the gather back), so they are not used here;
the benchmark keeps that variant for comparison.

`install(model_or_layer)` binds this forward on every routed-experts instance (module forward_pre_hooks, such
as quantkit's GPTQ/AWQ statistics, still see `(hidden, top_k_index, top_k_weights)`); `uninstall` undoes it.
The calibration executor installs it on every decoder layer it materializes. Observers reuse the routing
bookkeeping: `routing_for(experts, top_k_index, top_k_weights)` in a pre-hook returns the `Routing` of that
call (per expert, the token indices and router weights), computed once and shared with the forward and every
other hook of the call.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..arch.layout import FUSED_DOWN, FUSED_GATE_UP, ROUTER_BIAS
from ..errors import CalibrationError

# Legend: T = tokens, k = experts per token, E = routed experts, H = hidden, I = expert intermediate,
#         n = routed (token, slot) pairs kept (T*k minus sentinels)

# Bytes of per-block temporaries (gathered tokens, gate/up and down products). Blocks that stay in cache run
# faster (bench/moe_forward.py: 4-32 MiB within ~3% of each other, 256 MiB ~35% slower); a block holds whole
# experts up to budget / row bytes pairs (8160 at H 512 / I 256, 744 at Kimi K2's 7168 / 2048 in float32).
DEFAULT_BUDGET = 32 << 20
_SAVED = "_quantkit_moe_saved_forward"  # instance attribute: the forward `install` replaced (or _NONE)
_NONE = object()


# ---- routing bookkeeping --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """The router's top-k choices grouped by expert.

    `token`, `slot` and `weight` list every routed (token, slot) pair, expert 0's pairs first, then expert 1's,
    ...; within one expert in slot-major order (slot 0's tokens ascending, then slot 1's), which is the order
    transformers' eager loop visits them. Pairs whose index is the sentinel E are not listed (`dropped`).
    Expert e's pairs are `[offsets[e], offsets[e + 1])`."""

    num_experts: int
    num_tokens: int
    top_k: int
    token: torch.Tensor  # [n] int64: token index of each pair
    slot: torch.Tensor  # [n] int64: position of the expert in the token's top-k
    weight: torch.Tensor  # [n] the router weight top_k_weights[token, slot] (its dtype kept)
    counts: torch.Tensor  # [E] int64: pairs per expert
    offsets: torch.Tensor  # [E + 1] int64: start of each expert's pairs
    bounds: tuple[int, ...]  # offsets as Python ints (slicing without a tensor read per expert)
    dropped: int  # sentinel pairs (index == E)
    token_sorted: bool = False  # each expert's pairs already in ascending token order (one slot per expert)

    def tokens(self, e: int) -> torch.Tensor:
        """Indices of the tokens routed to expert e (slot-major, as eager visits them)."""
        return self.token[self.bounds[e]:self.bounds[e + 1]]

    def weights(self, e: int) -> torch.Tensor:
        """The router weights of those tokens for expert e."""
        return self.weight[self.bounds[e]:self.bounds[e + 1]]

    def segments(self) -> Iterator[tuple[int, int, int]]:
        """(expert, start, end) of every expert that received tokens, ascending."""
        b = self.bounds
        for e in range(self.num_experts):
            if b[e + 1] > b[e]:
                yield e, b[e], b[e + 1]

    def per_expert(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(expert, token indices, router weights) of every expert that received tokens."""
        for e, s, t in self.segments():
            yield e, self.token[s:t], self.weight[s:t]

    def token_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, weight) of every pair with each expert's pairs in ascending token order (ties, a token sent
        twice to one expert, by slot): the order a token-major scan of `top_k_index` visits them, which is the
        order the Hessian accumulation (calib/hessians.py) has always summed rows in. Same `bounds`."""
        if self.top_k == 1 or self.token_sorted or not self.bounds[-1]:
            return self.token, self.weight
        expert = torch.repeat_interleave(torch.arange(self.num_experts, device=self.token.device), self.counts)
        perm = torch.argsort(expert * self.num_tokens + self.token, stable=True)
        return self.token[perm], (self.weight[perm] if self.weight.numel() else self.weight)

    def blocks(self, max_rows: int) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
        """Consecutive pairs in blocks of at most `max_rows` rows: (start, end, [(expert, start, end), ...]).
        A block holds whole experts unless a single expert has more than `max_rows` pairs; that one is split."""
        max_rows = max(1, int(max_rows))
        start, segs = None, []
        for e, s, t in self.segments():
            if segs and t - start > max_rows:
                yield start, segs[-1][2], segs
                start, segs = None, []
            if t - s > max_rows:  # too many pairs for one block: split this expert
                for a in range(s, t, max_rows):
                    yield a, min(a + max_rows, t), [(e, a, min(a + max_rows, t))]
                continue
            if start is None:
                start = s
            segs.append((e, s, t))
        if segs:
            yield start, segs[-1][2], segs


def route(top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None, num_experts: int) -> Routing:
    """Group the routed (token, slot) pairs of `top_k_index` [T, k] by expert with one stable sort.

    Indices must lie in [0, num_experts]; num_experts itself is transformers' sentinel for "no local expert"
    and is dropped. `top_k_weights` [T, k] may be None (then `weight` is empty)."""
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [tokens, top_k], got shape {list(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    t, k = top_k_index.shape
    if top_k_weights is not None and tuple(top_k_weights.shape) != (t, k):
        raise ValueError(f"top_k_weights shape {list(top_k_weights.shape)} != top_k_index shape {[t, k]}")
    flat = top_k_index.t().reshape(-1).long()  # slot-major: pair p = slot * T + token
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > num_experts):
        raise ValueError(f"expert index out of range [0, {num_experts}] (the upper bound is the sentinel)")
    order = torch.argsort(flat, stable=True)
    hist = torch.bincount(flat, minlength=num_experts + 1)
    counts = hist[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    bounds = tuple(offsets.tolist())
    order = order[:bounds[-1]]  # the sentinel pairs sort last
    token = order % t if t else order
    slot = order // t if t else order
    weight = (top_k_weights[token, slot] if top_k_weights is not None
              else torch.empty(0, dtype=torch.float32, device=flat.device))
    return Routing(num_experts, t, k, token, slot, weight, counts, offsets, bounds, int(hist[num_experts]))


def router_affinities(router: nn.Module, x: torch.Tensor, top_k: int | None = None) -> Routing:
    """The router's affinity of every token of x [T, H] for its `top_k` most preferred experts (None: all of
    them), as a Routing whose weights are the affinities (float32): softmax of the logits (Qwen3-MoE,
    Mixtral), or their sigmoid where the router carries noaux_tc's correction bias (DeepSeek-V3 / Kimi K2 /
    GLM), the experts then preferred by sigmoid + bias as that router selects (without its group limit).
    Statistics weighted by it count each token for an expert as much as the router favours that pair."""
    logits = x.float() @ router_weight(router, x.shape[-1]).detach().float().T  # [T, E]
    bias = getattr(router, ROUTER_BIAS, None)
    if isinstance(bias, torch.Tensor):
        aff = torch.sigmoid(logits)
        prefer = aff + bias.detach().float()
    else:
        aff = prefer = torch.softmax(logits, -1)
    t, n = aff.shape
    if top_k is None or top_k >= n:  # expert e in slot e of every token: its pairs are in token order
        idx = torch.arange(n, device=aff.device).expand(t, n)
        return replace(route(idx, aff, n), token_sorted=True)
    idx = prefer.topk(top_k, -1).indices
    return route(idx, aff.gather(-1, idx), n)


def router_weight(router: nn.Module, hidden: int, num_experts: int | None = None) -> torch.Tensor:
    """The router's [experts, hidden] weight, which `router_affinities` scores tokens with; a CalibrationError
    naming what the router has instead."""
    w = getattr(router, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != hidden or \
            (num_experts is not None and w.shape[0] != num_experts):
        want = f"[{num_experts if num_experts is not None else 'E'}, {hidden}]"
        raise CalibrationError(f"stats: affinity needs the router's {want} weight; {type(router).__name__} has "
                               f"{tuple(w.shape) if isinstance(w, torch.Tensor) else None}")
    return w


_ROUTING = "_quantkit_routing"  # instance attribute: (top_k_index, top_k_weights, Routing) of the current call


def routing_for(experts: nn.Module, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None) -> Routing:
    """The routing of the current call of `experts`, computed once per call: forward pre-hooks (quantkit's
    expert statistics and token counters) and the batched forward all get the same object. Only while the
    batched forward is installed is it kept (on the instance, keyed by the identity of the two tensors, which it
    holds, so no other tensor can take their place), and the batched forward drops it when the call ends;
    otherwise each caller gets a fresh one."""
    hit = experts.__dict__.get(_ROUTING)
    if hit is not None and hit[0] is top_k_index and hit[1] is top_k_weights:
        return hit[2]
    r = route(top_k_index, top_k_weights, int(experts.gate_up_proj.shape[0]))
    if installed(experts):
        experts.__dict__[_ROUTING] = (top_k_index, top_k_weights, r)
    return r


def drop_routing(experts: nn.Module) -> None:
    """Forget the routing `routing_for` kept for the current call (a call that ends before the forward)."""
    experts.__dict__.pop(_ROUTING, None)


# ---- the forward ----------------------------------------------------------------------------------------
def _silu_in_place(act_fn) -> bool:
    """Whether act_fn(x) is exactly F.silu(x), so that it may run in place (no hooks, no replaced forward)."""
    if not isinstance(act_fn, nn.Module) or act_fn._forward_hooks or act_fn._forward_pre_hooks:
        return False
    if type(act_fn) is nn.SiLU:
        return not act_fn.inplace
    fwd = getattr(type(act_fn), "forward", None)
    return (type(act_fn).__name__ == "SiLUActivation" and getattr(fwd, "__module__", "") == "transformers.activations"
            and getattr(fwd, "__qualname__", "") == "SiLUActivation.forward")


def _row_bytes(h: int, p: int, dtype: torch.dtype, w_dtype: torch.dtype, silu: bool) -> int:
    """Bytes of temporaries per routed pair in `batched_experts_forward`: the workspace (tokens, then down
    products [H]; gate/up products [2I]), act(gate) [I] unless computed in place, the weighted products
    when the router weights promote them, and the indices."""
    s = torch.empty((), dtype=dtype).element_size()
    wd = torch.promote_types(dtype, w_dtype)
    extra = 0 if wd == dtype else (torch.empty((), dtype=wd).element_size() + s) * h
    return s * (h + p) + max(0 if silu else s * (p // 2), extra) + 16


def batched_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, *, budget: int = DEFAULT_BUDGET,
                            routing: Routing | None = None) -> torch.Tensor:
    """What transformers' eager routed-experts forward returns for `experts` (fused `gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I], `act_fn`), computed expert-grouped in blocks of at most `budget` bytes of
    temporaries. Same dtypes as eager: products in the parameters' / input's dtype, the routing weight
    multiplied with PyTorch's type promotion, the sum accumulated in `hidden_states.dtype`.

    The block buffers are allocated once per call and reused: the executor serves allocations of 1 MiB or
    more with fresh mappings (`bound_heap`), and faulting in new pages for every block costs ~20%."""
    gu_w, dn_w = experts.gate_up_proj, experts.down_proj
    e_count, p, h = gu_w.shape
    if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
        raise ValueError(f"hidden_states must be [tokens, {h}], got {list(hidden_states.shape)}")
    r = routing if routing is not None else route(top_k_index, top_k_weights, e_count)
    if r.weight.numel() != r.bounds[-1]:
        raise ValueError("batched_experts_forward needs the router weights (route(..., top_k_weights, E))")
    out = torch.zeros_like(hidden_states)
    if not r.bounds[-1]:
        return out
    silu = _silu_in_place(experts.act_fn)
    w_dtype = r.weight.dtype
    max_rows = max(1, budget // _row_bytes(h, p, hidden_states.dtype, w_dtype, silu))
    blocks = list(r.blocks(max_rows))
    rows = max(b - a for a, b, _ in blocks)
    ws_h = hidden_states.new_empty(rows, h)  # a block's gathered tokens, then its down products
    ws_p = hidden_states.new_empty(rows, p)  # its gate/up products, then act(gate) * up in the gate half
    # eager's `y * w` may promote (bfloat16 products, float32 router weights); in place when it does not
    in_place_w = torch.promote_types(hidden_states.dtype, w_dtype) == hidden_states.dtype
    for a, b, segs in blocks:
        n, tok = b - a, r.token[a:b]
        xs, gu = ws_h[:n], ws_p[:n]
        torch.index_select(hidden_states, 0, tok, out=xs)  # = hidden_states[token_idx] of each expert, stacked
        for e, s, t in segs:
            torch.mm(xs[s - a:t - a], gu_w[e].t(), out=gu[s - a:t - a])
        gate, up = gu.chunk(2, dim=-1)
        if silu:  # act(gate) * up, eager's two products, computed in place in gu's gate half
            act = nn.functional.silu(gate, inplace=True).mul_(up)
        else:
            act = experts.act_fn(gate)
            shared = act.untyped_storage().data_ptr() == gu.untyped_storage().data_ptr()
            act = act * up if shared else act.mul_(up)  # (an activation may return its input, a view of gu)
        y = xs  # the gathered tokens are no longer needed
        for e, s, t in segs:
            torch.mm(act[s - a:t - a], dn_w[e].t(), out=y[s - a:t - a])
        del act, gate, up
        w = r.weight[a:b, None]
        y = y.mul_(w) if in_place_w else (y * w).to(out.dtype)
        # one index_add_ per expert, ascending, as eager: CPU index_add_ sums the rows of one call that hit the
        # same token in float32 and rounds once for bfloat16/float16, so one call per block would round
        # differently from eager's one rounding per expert (float32 would agree either way)
        for e, s, t in segs:
            out.index_add_(0, tok[s - a:t - a], y[s - a:t - a])
        del y
    return out


# ---- install / uninstall --------------------------------------------------------------------------------
def is_routed_experts(module: nn.Module) -> bool:
    """A transformers 5 fused routed-experts module this forward reproduces: 3-D `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I], an `act_fn`, and none of the variants the eager loop above does not describe
    (biases, transposed weights, ungated experts, a post-expert norm, a custom gate)."""
    gu, dn = getattr(module, FUSED_GATE_UP, None), getattr(module, FUSED_DOWN, None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        return False
    e, p, h = gu.shape
    if p % 2 or tuple(dn.shape) != (e, h, p // 2) or not callable(getattr(module, "act_fn", None)):
        return False
    if (getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False)):
        return False
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None:
        from transformers.integrations.moe import _default_apply_gate

        if gate_fn is not _default_apply_gate:
            return False
    return True


def _make_forward(budget: int):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.gate_up_proj.requires_grad
                                        or self.down_proj.requires_grad):
            # `mm(out=...)` has no autograd: the module's own forward when gradients are wanted
            return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
        try:
            return batched_experts_forward(self, hidden_states, top_k_index, top_k_weights, budget=budget,
                                           routing=routing_for(self, top_k_index, top_k_weights))
        finally:
            self.__dict__.pop(_ROUTING, None)  # the call is over: nobody may reuse its routing

    forward._quantkit_batched = True
    return forward


def install(model_or_layer: nn.Module, *, budget: int = DEFAULT_BUDGET) -> list[nn.Module]:
    """Make every routed-experts module under `model_or_layer` (itself included) run `batched_experts_forward`
    by binding it as the instance's `forward`. Hooks on those modules keep working (they wrap `__call__`).
    Returns the modules changed; installing twice only updates the budget."""
    done = []
    for m in model_or_layer.modules():
        if not is_routed_experts(m):
            continue
        if _SAVED not in m.__dict__:
            m.__dict__[_SAVED] = m.__dict__.get("forward", _NONE)
        m.forward = types.MethodType(_make_forward(int(budget)), m)
        done.append(m)
    return done


def uninstall(model_or_layer: nn.Module) -> int:
    """Undo `install`: each module gets back the forward it had. Returns how many modules were restored."""
    n = 0
    for m in model_or_layer.modules():
        if _SAVED not in m.__dict__:
            continue
        saved = m.__dict__.pop(_SAVED)
        m.__dict__.pop(_ROUTING, None)
        if saved is _NONE:
            m.__dict__.pop("forward", None)
        else:
            m.forward = saved
        n += 1
    return n


def installed(module: nn.Module) -> bool:
    """Whether `module` currently runs the batched forward."""
    f = module.__dict__.get("forward")
    return getattr(getattr(f, "__func__", None), "_quantkit_batched", False)
