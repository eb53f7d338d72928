"""A parsed config held against the checkpoint's tensors: `validate` parses config.json and `check_tensors`
holds the spec against every tensor's shape; `check_expert_shapes` holds the routed experts' logical shapes.
ConfigMismatch names the config field and the tensor that disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, ConfigMismatch
from .config import (FIELD_HINT, MAX_LAYERS, ModelSpec, _experts_key, _FIRST_DENSE, _int_list, _key, _show,
                     parse_config)
from .layout import (ATTN, DENSE_MLP, EXPERT_BLOCKS, EXPERTS, K, K_NORM, KV_A, KV_A_NORM, KV_B, LAYERS, O, Q, Q_A,
                     Q_A_NORM, Q_B, Q_NORM, QWEN_EXPERTS, ROUTER_MODULES, SHARED_EXPERT_PREFIX, SHARED_EXPERTS, V,
                     LayerNames, expert_parts, expert_role)
from .registry import ARCHITECTURES, family, layer_index, text_config


def _expert_rx(p: str) -> re.Pattern:
    """Per-expert tensors of a checkpoint whose text model sits under prefix `p`: groups layer, expert."""
    return re.compile(re.escape(p) + r"model\.layers\.(\d{1,9})\.(?:mlp|block_sparse_moe)\.experts\.(\d{1,9})\.")


def check_tensors(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Hold `spec` against a checkpoint's tensors (name -> shape): the embedding's vocab and hidden size, the
    number of decoder layers, the routed experts of each MoE layer and their widths, and in each layer the shards
    hold: the dense/MoE layout (an MoE layer holds routed experts and a router, a dense one a dense MLP and
    neither), the shared expert, the dense MLP's width and every attention projection (`_check_layer`). Raises
    ConfigMismatch naming the config field and the tensor that disagree. Shapes are read from `<module>.weight`
    tensors (dense or FP8); a module stored in another form counts only as present. Layers beyond `num_layers`
    are allowed only as MTP layers; tensors of other modalities (wrappers) are not looked at. One pass over the
    names (Kimi K2: ~10^5)."""
    p = spec.prefix
    emb = shapes.get(f"{p}model.embed_tokens.weight")
    if emb is not None and len(emb) == 2:
        if emb[1] != spec.hidden_size:
            _mismatch("hidden_size", spec.hidden_size, f"{p}model.embed_tokens.weight", emb)
        if emb[0] != spec.vocab_size:
            _mismatch("vocab_size", spec.vocab_size, f"{p}model.embed_tokens.weight", emb)
    layers: set[int] = set()
    experts: dict[int, set[int]] = {}
    fused: dict[int, int] = {}
    routed: dict[int, str] = {}  # layer -> the first routed-expert tensor it holds
    held: dict[int, dict[str, tuple[int, ...] | None]] = {}  # layer -> module -> its .weight shape (None: absent)
    expert_weights: dict[str, tuple[int, ...]] = {}
    ex = _expert_rx(p)
    fx = re.compile(re.escape(p) + r"model\.layers\.(\d{1,9})\.mlp\.experts\.(?:gate_up_proj|down_proj)$")
    head, routed_part = f"{p}{LAYERS}.", f".{EXPERTS}."
    for name, shape in shapes.items():
        if not name.startswith(head):
            continue
        idx = layer_index(name)
        if idx is None:  # e.g. a 5,000-digit "index": not a decoder layer of any model
            shown = name if len(name) <= 80 else name[:77] + "..."
            raise ConfigMismatch(f"tensor {shown!r} is under model.layers. without a decoder-layer index "
                                 f"(at most 9 digits)")
        layers.add(idx)
        if routed_part in name:
            routed.setdefault(idx, name)
            e = ex.match(name)
            if e:
                experts.setdefault(int(e[1]), set()).add(int(e[2]))
                if name.endswith(".weight"):
                    expert_weights[name] = shape
            f = fx.match(name)
            if f and len(shape) == 3:
                fused[int(f[1])] = shape[0]
            continue
        module, _, leaf = name.rpartition(".")
        mods = held.setdefault(idx, {})
        if leaf == "weight":
            mods[module] = tuple(shape)
        else:
            mods.setdefault(module, None)
    if layers:
        top = max(layers)
        if top >= spec.num_layers + spec.mtp_layers:
            _mismatch("num_hidden_layers", spec.num_layers, f"{p}model.layers.{top}.*", None,
                      f"the shards hold layer {top}")
        gap = next((i for i in range(spec.num_layers) if i not in layers), None)  # O(layers on disk)
        if gap is not None:
            _mismatch("num_hidden_layers", spec.num_layers, f"{p}model.layers.{gap}.*", None,
                      f"the shards hold no layer {gap}")
    key = _experts_key(spec.arch, spec.text)
    for layer in sorted(set(experts) | set(fused)):
        ids = experts.get(layer, set())
        count = fused.get(layer, max(ids) + 1 if ids else 0)
        if count != spec.num_experts or (ids and len(ids) != count):
            _mismatch(key, spec.num_experts, f"{p}model.layers.{layer}.*.experts.*", None,
                      f"layer {layer} stores {count if not ids or len(ids) == count else len(ids)} routed experts")
    check_expert_shapes(spec, expert_weights)
    for i in sorted(layers):
        _check_layer(spec, i, held.get(i, {}), routed.get(i))


def _held(mods: Mapping[str, tuple[int, ...] | None], module: str) -> str:
    """The tensor to name for a module the shards hold: its weight, or all of it when stored in another form."""
    return f"{module}.weight" if mods.get(module) is not None else f"{module}.*"


def _check_shape(mods: Mapping[str, tuple[int, ...] | None], module: str, want: tuple[int, ...],
                 fields: tuple[tuple[str, Any], ...], formula: str) -> None:
    """`module`'s weight, when the shards hold it as `.weight`, against `want`; a dimension that differs names
    its field (`fields[d]`: config key, value). `formula`: how the config implies `want`, for the message."""
    shape = mods.get(module)
    if shape is None or len(shape) != len(want) or shape == want:
        return
    d = next(k for k in range(len(want)) if shape[k] != want[k])
    _mismatch(fields[d][0], fields[d][1], f"{module}.weight", shape,
              f"shape {list(shape)}, the config implies {list(want)} = [{formula}]")


def _layout_field(spec: ModelSpec, i: int) -> tuple[str, Any]:
    """(config key, value as shown) of the field that makes layer `i` an MoE layer or a dense one."""
    cfg, a = spec.text, spec.arch
    if i >= spec.num_layers:
        return _key(a, cfg, "num_nextn_predict_layers"), spec.mtp_layers
    if ARCHITECTURES[a].experts is None:
        return "model_type", _show(spec.model_type)
    if a in ("mixtral", "olmoe") or not spec.num_experts:
        return _experts_key(a, cfg), spec.num_experts
    if a == "qwen3_moe":
        only = _int_list(cfg, "mlp_only_layers", MAX_LAYERS)
        if i in only or (spec.moe[i] and only):
            return "mlp_only_layers", _show(only)
        return "decoder_sparse_step", cfg.get("decoder_sparse_step") or 1
    if a == "glm_moe_dsa" and cfg.get("mlp_layer_types"):
        return "mlp_layer_types", _show(cfg["mlp_layer_types"])
    first = cfg.get("first_k_dense_replace")
    first = min(_FIRST_DENSE.get(a, 3), spec.num_layers) if first is None else first
    freq = (cfg.get("moe_layer_freq") or 1) if a == "deepseek_v3" else 1
    if i >= first and freq > 1:
        return "moe_layer_freq", freq
    return "first_k_dense_replace", first


def _check_layer(spec: ModelSpec, i: int, mods: Mapping[str, tuple[int, ...] | None], routed: str | None) -> None:
    """Decoder layer `i` as the shards hold it (`mods`: its modules other than routed experts -> their weight's
    shape; `routed`: a routed-expert tensor it holds, or None) against the spec: attention, then its MLP."""
    if i >= len(spec.moe):
        return
    ln = LayerNames(spec.prefix, i, ARCHITECTURES[spec.arch].experts or QWEN_EXPERTS)
    if spec.attention == "mla":
        _check_mla(spec, ln, mods)
    else:
        _check_gqa(spec, ln, mods)
    D, I = spec.hidden_size, spec.intermediate_size
    dense = [f"{ln.dense_mlp}.{proj}" for proj in (DENSE_MLP.gate, DENSE_MLP.up, DENSE_MLP.down)]
    routers = [m for m in (f"{ln.layer}.{r}" for r in ROUTER_MODULES) if m in mods]
    shared_at = tuple(f"{ln.layer}.{b}.{SHARED_EXPERT_PREFIX}" for b in EXPERT_BLOCKS)
    shared = next((m for m in mods if m.startswith(shared_at)), None)
    field_, value = _layout_field(spec, i)
    if not spec.moe[i]:
        found = routed or (f"{routers[0]}.*" if routers else None) or (_held(mods, shared) if shared else None)
        if found:
            what = "routed experts" if routed else "a router" if routers else "a shared expert"
            _mismatch(field_, value, found, None, f"the config makes layer {i} dense; the shards hold {what} there")
        for module in dense:
            if module not in mods:
                _mismatch(field_, value, f"{module}.weight", None,
                          f"the config makes layer {i} dense; the shards hold no {module.rsplit('.', 1)[1]} there")
        for module, want, fields in zip(dense, ((I, D), (I, D), (D, I)), (("intermediate_size", "hidden_size"),) * 2
                                        + (("hidden_size", "intermediate_size"),)):
            _check_shape(mods, module, want, tuple((f, getattr(spec, f)) for f in fields),
                         ", ".join(fields))
        return
    if routed is None:
        found = next((m for m in dense if m in mods), None)
        _mismatch(field_, value, _held(mods, found) if found else f"{ln.mlp}.{EXPERTS}.*", None,
                  f"the config makes layer {i} an MoE layer; the shards hold "
                  f"{'a dense MLP' if found else 'no routed experts'} there")
    if not routers:
        raise ConfigMismatch(f"layer {i} holds routed experts but no router ({ln.router}.weight): the shards are "
                             "incomplete")
    key = _experts_key(spec.arch, spec.text)
    _check_shape(mods, routers[0], (spec.num_experts, D), ((key, spec.num_experts), ("hidden_size", D)),
                 f"{key}, hidden_size")
    S = spec.shared_intermediate
    n_shared = ("n_shared_experts", spec.text.get("n_shared_experts") or 0) \
        if spec.arch in ("deepseek_v3", "glm4_moe", "glm_moe_dsa") else ("model_type", _show(spec.model_type))
    if S and shared is None:
        _mismatch(*n_shared, f"{ln.shared}.*", None,
                  f"the config gives layer {i} a shared expert {S} wide; the shards hold none")
    if not S and shared is not None:
        _mismatch(*n_shared, _held(mods, shared), None, f"the config gives layer {i} no shared expert; the shards "
                                                        "hold one")
    if S:
        for proj, want in ((DENSE_MLP.gate, (S, D)), (DENSE_MLP.up, (S, D)), (DENSE_MLP.down, (D, S))):
            dims = (n_shared, ("hidden_size", D)) if want[0] == S else (("hidden_size", D), n_shared)
            _check_shape(mods, f"{ln.shared}.{proj}", want, dims,
                         ", ".join("n_shared_experts x moe_intermediate_size" if w == S else "hidden_size"
                                   for w in want))


def _check_gqa(spec: ModelSpec, ln: LayerNames, mods: Mapping[str, tuple[int, ...] | None]) -> None:
    """q/k/v/o_proj [H*hd, D], [KV*hd, D], [KV*hd, D], [D, H*hd] and the q/k norms' widths."""
    H, KV, hd, D = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    explicit = spec.text.get("head_dim") is not None
    hd_is = "head_dim" if explicit else "head_dim (hidden_size / num_attention_heads)"
    heads, kv, hidden = ("num_attention_heads", H), ("num_key_value_heads", KV), ("hidden_size", D)
    if spec.qk_norm:
        qw, kw = spec.qk_norm_widths
        if ARCHITECTURES[spec.arch].qk_norm_whole:
            norms = ((Q_NORM, qw, heads, f"num_attention_heads x {hd_is}"),
                     (K_NORM, kw, kv, f"num_key_value_heads x {hd_is}"))
        else:
            f = ("head_dim", hd) if explicit else heads
            norms = ((Q_NORM, qw, f, hd_is), (K_NORM, kw, f, hd_is))
        for proj, want, f, formula in norms:
            _check_shape(mods, ln.att(proj), (want,), (f,), formula)
    for proj, want, fields, formula in (
            (Q, (H * hd, D), (heads, hidden), f"num_attention_heads x {hd_is}, hidden_size"),
            (K, (KV * hd, D), (kv, hidden), f"num_key_value_heads x {hd_is}, hidden_size"),
            (V, (KV * hd, D), (kv, hidden), f"num_key_value_heads x {hd_is}, hidden_size"),
            (O, (D, H * hd), (hidden, heads), f"hidden_size, num_attention_heads x {hd_is}")):
        _check_shape(mods, ln.att(proj), want, fields, formula)


def _check_mla(spec: ModelSpec, ln: LayerNames, mods: Mapping[str, tuple[int, ...] | None]) -> None:
    """MLA's projections: q_a_proj [rq, D], q_a_layernorm [rq], q_b_proj [H*(nope+rope), rq] (or one q_proj
    [H*(nope+rope), D] when q_lora_rank is null), kv_a_layernorm [rkv], kv_a_proj_with_mqa [rkv+rope, D],
    kv_b_proj [H*(nope+v), rkv], o_proj [D, H*v]. Which of heads, nope and v is wrong is solved from the three
    projections that share them, when all three are stored as weights."""
    H, D, rq, rkv = spec.num_heads, spec.hidden_size, spec.q_lora_rank, spec.kv_lora_rank
    nope, rope, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    a = ln.att
    q_rank = ("q_lora_rank", "null" if rq is None else rq)
    if rq is None and a(Q_A) in mods:
        _mismatch(*q_rank, _held(mods, a(Q_A)), None, "the config has one q_proj and no q latent; the shards hold "
                                                      "q_a_proj")
    if rq is not None and a(Q_A) not in mods:
        _mismatch(*q_rank, f"{a(Q_A)}.weight", None, f"the shards hold no q_a_proj"
                                                      f"{' but a q_proj' if a(Q) in mods else ''}")
    hidden, kv_rank, rope_f = ("hidden_size", D), ("kv_lora_rank", rkv), ("qk_rope_head_dim", rope)
    if rq is not None:
        _check_shape(mods, a(Q_A), (rq, D), (q_rank, hidden), "q_lora_rank, hidden_size")
        _check_shape(mods, a(Q_A_NORM), (rq,), (q_rank,), "q_lora_rank")
    _check_shape(mods, a(KV_A_NORM), (rkv,), (kv_rank,), "kv_lora_rank")
    _check_shape(mods, a(KV_A), (rkv + rope, D), (rope_f if mods.get(a(KV_A_NORM)) else kv_rank, hidden),
                 "kv_lora_rank + qk_rope_head_dim, hidden_size")
    q_out = mods.get(a(Q_B) if rq is not None else a(Q))
    kvb, o = mods.get(a(KV_B)), mods.get(a(O))
    culprit = ("num_attention_heads", H)
    if q_out and kvb and o and len(q_out) == len(kvb) == len(o) == 2:
        hr = o[1] + q_out[0] - kvb[0]  # H*v + H*(nope+rope) - H*(nope+v) = H*rope
        if hr % rope == 0 and hr // rope == H:
            culprit = ("v_head_dim", v) if o[1] != H * v else ("qk_nope_head_dim", nope)
    q_formula = "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)"
    if rq is not None:
        _check_shape(mods, a(Q_B), (H * (nope + rope), rq), (culprit, q_rank), f"{q_formula}, q_lora_rank")
    else:
        _check_shape(mods, a(Q), (H * (nope + rope), D), (culprit, hidden), f"{q_formula}, hidden_size")
    _check_shape(mods, a(KV_B), (H * (nope + v), rkv), (culprit, kv_rank),
                 "num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank")
    _check_shape(mods, a(O), (D, H * v), (hidden, culprit), "hidden_size, num_attention_heads x v_head_dim")


def check_expert_shapes(spec: ModelSpec, weights: Mapping[str, tuple[int, ...]]) -> None:
    """Each routed expert's weight (module + ".weight" -> [out, in]; a packed module's logical shape, as
    read/sources.py decodes it from its headers and weight_shape) against the config: gate/up [width, hidden],
    down [hidden, width]. ConfigMismatch names the field and the tensor: a config that disagrees with the
    experts it ships would be copied into the output and refused by every engine that loads it."""
    p = spec.prefix
    ex = _expert_rx(p)
    width_field = "intermediate_size" if spec.arch in ("mixtral", "olmoe") else "moe_intermediate_size"
    h, w = spec.hidden_size, spec.moe_intermediate_size
    for name, shape in weights.items():
        parts = expert_parts(name[: -len(".weight")]) if name.endswith(".weight") and ex.match(name) else None
        role = expert_role(parts[2]) if parts else None
        if role is None or len(shape) != 2:
            continue
        want = (h, w) if role == "down" else (w, h)
        if tuple(shape) != want:
            hidden_off = shape[0 if role == "down" else 1] != h
            field_, value = ("hidden_size", h) if hidden_off else (width_field, w)
            _mismatch(field_, value, name, shape, f"shape {list(shape)}, the config implies {list(want)}")


def _mismatch(field_: str, value, tensor: str, shape, detail: str | None = None):
    what = detail or f"shape {list(shape)}"
    raise ConfigMismatch(f"config.json {field_} = {value} contradicts {tensor} ({what})")



def validate(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> ModelSpec | None:
    """Hold a checkpoint's config.json against its tensors before anything is built from it: parse it and
    `check_tensors` (ConfigMismatch names the field and the tensor). A value beyond the sanity bounds is
    reported against the tensors too when they show the real one. A model type the registry does not know
    is not checked (None): model-free conversions stream any architecture (a model_type that is not a string
    is refused: the output's config.json would carry it to every loader)."""
    mt = config.get("model_type") if isinstance(config, Mapping) else None
    if mt is not None and not isinstance(mt, str):
        raise ConfigError(f"config.json 'model_type' must be a string, got {str(mt)[:40]}", hint=FIELD_HINT)
    try:
        family(config)
    except ConfigError:
        return None
    try:
        spec = parse_config(config)
    except ConfigError as e:
        field_ = getattr(e, "field", None)
        seen = _evidence(field_, shapes, text_config(config)[1]) if field_ else None
        if seen:
            _mismatch(field_, e.value, seen[0], None, seen[1])
        raise
    check_tensors(spec, shapes)
    return spec


def _evidence(field_: str, shapes: Mapping[str, tuple[int, ...]], p: str) -> tuple[str, str] | None:
    """(tensor, what it shows) for the real value of a config field, when the tensors show it."""
    emb = f"{p}model.embed_tokens.weight"
    if field_ in ("hidden_size", "vocab_size") and emb in shapes and len(shapes[emb]) == 2:
        return emb, f"shape {list(shapes[emb])}"
    if field_ == "num_hidden_layers":
        layers = {i for n in shapes if n.startswith(f"{p}model.layers.") and (i := layer_index(n)) is not None}
        if layers:
            return f"{p}model.layers.{max(layers)}.*", f"the shards' last layer is {max(layers)}"
    if field_ in ("num_experts", "num_local_experts", "n_routed_experts"):
        ex = _expert_rx(p)
        ids = [(int(m[1]), int(m[2])) for n in shapes if (m := ex.match(n))]
        if ids:
            layer = ids[0][0]
            n = 1 + max(e for lay, e in ids if lay == layer)
            return f"{p}model.layers.{layer}.*.experts.*", f"layer {layer} stores {n} routed experts"
    module = _EVIDENCE.get(field_)
    if module:
        name = next((n for n in shapes if n.startswith(f"{p}model.layers.") and n.endswith(f".{module}.weight")), None)
        if name:
            return name, f"shape {list(shapes[name])}"
    return None


# the module whose weight shows a field's real value (heads: with head_dim; MLA: with the other ranks)
_EVIDENCE = {"num_attention_heads": f"{ATTN}.{Q}", "num_key_value_heads": f"{ATTN}.{K}", "head_dim": f"{ATTN}.{Q}",
             "q_lora_rank": f"{ATTN}.{Q_A}", "kv_lora_rank": f"{ATTN}.{KV_A_NORM}",
             "qk_rope_head_dim": f"{ATTN}.{KV_A}", "qk_nope_head_dim": f"{ATTN}.{KV_B}", "v_head_dim": f"{ATTN}.{O}",
             "intermediate_size": f"{DENSE_MLP.block}.{DENSE_MLP.down}",
             "n_shared_experts": f"{SHARED_EXPERTS}.{DENSE_MLP.down}"}
