"""Which tensors of a checkpoint read the residual stream, which write it, and which norms sit between:
what a rotation of the residual stream (quant/rotate.py, read/rotate.py) must turn. Names only, from the
vocabulary of arch/layout.py; the math is elsewhere.

Row-vector convention (y = x W^T), residual x' = x Q:

    reader  W [out, H]  -> W diag(g) Q    q/k/v, MLA q_a_proj / kv_a_proj_with_mqa, the DSA indexer's wk and
                                          weights_proj, the router, routed / shared / dense gate and up
                                          (fused experts.gate_up_proj [E, 2I, H] too), lm_head; g the gain of
                                          the RMSNorm in front of it (input / post-attention / final norm)
    writer  W [H, in]   -> Q^T W          o_proj, every down_proj (fused experts.down_proj [E, H, I] too), a
                                          multimodal projector's last Linear; its bias b -> b Q
    embed   E [V, H]    -> E Q
    norm    g [H]       -> ones           (its gain now lives in its readers)

Left as they are: the norms inside attention (q_norm, k_norm, q_a_layernorm, kv_a_layernorm, the indexer's
k_norm), what reads them (q_b_proj, kv_b_proj, the indexer's wq_b), the router's correction bias, readers'
biases. Anything else with a dimension of width H is not known to be rotation-safe: `residual_roles` names it
among the refusals, as it does MTP layers, tied embeddings and norms with a bias.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .layout import (ATTN, DENSE_MLP, EMBED, EXPERT_BLOCKS, EXPERT_NAMINGS, EXPERTS, FINAL_NORM, FUSED_DOWN,
                     FUSED_GATE_UP, INDEXER, INPUT_NORM, K, KV_A, LAYERS, LM_HEAD, MTP_PROJ, O, POST_ATTN_NORM, Q,
                     Q_A, ROUTER, SHARED_EXPERT_PREFIX, SHARED_EXPERTS, V, VISION_PREFIXES)

READER, WRITER, WRITER_BIAS, EMBEDDING, NORM = "reader", "writer", "writer_bias", "embedding", "norm"

# the indexer's inputs that read the normalized hidden state (transformers' GlmMoeDsaIndexer: wk(hidden_states),
# weights_proj(hidden_states); wq_b reads q_a_layernorm's output)
INDEXER_READERS = ("wk", "weights_proj")
ATTN_READERS = (Q, K, V, Q_A, KV_A)
# the projectors that carry a vision tower's output into the text model's embedding space
PROJECTORS = tuple(p for p in VISION_PREFIXES if "projector" in p)
SHARED_GATE = f"{SHARED_EXPERT_PREFIX}_gate"  # Qwen2-MoE style: shared_expert_gate [1, H] reads the norm


@dataclass(frozen=True)
class Role:
    """What a tensor is to the residual stream: `kind` (READER, WRITER, WRITER_BIAS, EMBEDDING, NORM) and, for a
    reader, the norm whose gain it takes (`norm`: that norm's weight tensor)."""

    kind: str
    norm: str | None = None


@dataclass(frozen=True)
class ResidualMap:
    roles: dict  # tensor name -> Role
    refused: tuple[tuple[str, str], ...]  # (tensor name, why it cannot be rotated)


def _proj_roles() -> tuple[set[str], set[str]]:
    """(reader, writer) projection names of routed experts, shared experts and dense MLPs, every family."""
    readers = {n.gate for n in EXPERT_NAMINGS} | {n.up for n in EXPERT_NAMINGS} | {DENSE_MLP.gate, DENSE_MLP.up}
    writers = {n.down for n in EXPERT_NAMINGS} | {DENSE_MLP.down}
    return readers, writers


def _layer_role(rel: str, norms: tuple[str, str]) -> Role | None | str:
    """A decoder-layer tensor's role from its name relative to the layer (`self_attn.q_proj.weight`): a Role,
    None (untouched), or "unknown"."""
    attn_norm, mlp_norm = norms
    module, _, leaf = rel.rpartition(".")
    if rel == f"{INPUT_NORM}.weight" or rel == f"{POST_ATTN_NORM}.weight":
        return Role(NORM)
    if rel.startswith(f"{ATTN}."):
        sub = module[len(ATTN) + 1:]
        if leaf == "weight" and (sub in ATTN_READERS or sub in (f"{INDEXER}.{r}" for r in INDEXER_READERS)):
            return Role(READER, attn_norm)
        if sub == O:
            return Role(WRITER) if leaf == "weight" else Role(WRITER_BIAS) if leaf == "bias" else "unknown"
        return None  # attention's own norms and what reads them, readers' biases, KV scales
    block = next((b for b in EXPERT_BLOCKS if rel.startswith(b + ".")), None)
    if block is None:
        return "unknown"
    readers, writers = _proj_roles()
    parts = module.split(".")[1:]  # without the block
    if parts and parts[0] == ROUTER:
        return Role(READER, mlp_norm) if parts == [ROUTER] and leaf == "weight" else None  # correction bias kept
    if parts == [SHARED_GATE] and leaf == "weight":
        return Role(READER, mlp_norm)
    if parts and parts[0] == EXPERTS and len(parts) == 1 and leaf in (FUSED_GATE_UP, FUSED_DOWN):
        return Role(READER, mlp_norm) if leaf == FUSED_GATE_UP else Role(WRITER)  # fused [E, 2I, H] / [E, H, I]
    if parts and parts[0] == EXPERTS and len(parts) == 2 and leaf == "weight" and parts[1] in (FUSED_GATE_UP,
                                                                                              FUSED_DOWN):
        return Role(READER, mlp_norm) if parts[1] == FUSED_GATE_UP else Role(WRITER)
    proj = parts[-1] if parts else ""
    owner = parts[:-1]
    if not (owner == [] or (owner and owner[0] in (SHARED_EXPERTS, SHARED_EXPERT_PREFIX) and len(owner) == 1)
            or (len(owner) == 2 and owner[0] == EXPERTS and owner[1].isdigit())):
        return "unknown"
    if proj in readers:
        return Role(READER, mlp_norm) if leaf == "weight" else None if leaf == "bias" else "unknown"
    if proj in writers:
        return Role(WRITER) if leaf == "weight" else Role(WRITER_BIAS) if leaf == "bias" else "unknown"
    return "unknown"


_LAYER = re.compile(r"^(?P<layer>" + re.escape(LAYERS) + r"\.(?P<i>\d{1,9}))\.(?P<rel>.+)$")


def residual_roles(names: Iterable[str], shape: Callable[[str], tuple[int, ...]], *, prefix: str, hidden: int,
                   num_layers: int, tied: bool, companions: Iterable[str] = ()) -> ResidualMap:
    """The role of every tensor of a checkpoint (`names`, with `shape(name)`), and what forbids rotating it.
    `prefix`: a wrapper's text prefix ("" or "language_model."); `num_layers`: the decoder layers that run (a
    layer index beyond is an MTP layer); `tied`: config.json ties the embeddings; `companions`: scale / shape
    tensors of modules the source stores quantized (judged with their module, not here)."""
    names = list(names)
    present = set(names)
    roles: dict[str, Role] = {}
    refused: list[tuple[str, str]] = []
    skip = set(companions)
    embed, final_norm, lm_head = f"{prefix}{EMBED}.weight", f"{prefix}{FINAL_NORM}.weight", f"{prefix}{LM_HEAD}.weight"
    if tied:
        refused.append((embed, "tied word embeddings (the embedding turns by Q, lm_head by diag(g) Q: one tensor "
                               "cannot be both)"))
    projector_writers = []
    for name in sorted(names):
        if name in skip:
            continue
        dims = tuple(shape(name))
        if name == embed:
            roles[name] = Role(EMBEDDING)
            continue
        if name == final_norm:
            roles[name] = Role(NORM)
            continue
        if name == lm_head:
            roles[name] = Role(READER, final_norm)
            continue
        if name.startswith(PROJECTORS):
            if name.endswith(".weight") and len(dims) == 2 and dims[0] == hidden:
                projector_writers.append(name)
            continue
        if name.startswith(VISION_PREFIXES):
            continue  # the vision tower's own width; only its projector writes the text model's embeddings
        m = _LAYER.match(name[len(prefix):]) if name.startswith(prefix) else None
        if m is None:
            if hidden in dims:
                refused.append((name, "a tensor of the hidden width outside the decoder layers that rotation "
                                      "does not know"))
            continue
        layer = prefix + m["layer"]
        if int(m["i"]) >= num_layers:
            if hidden in dims or m["rel"].startswith(MTP_PROJ):
                refused.append((name, "an MTP layer (eh_proj reads concat(enorm(embedding), hnorm(hidden)) and "
                                      "writes the residual; its rotation is not implemented)"))
            continue
        role = _layer_role(m["rel"], (f"{layer}.{INPUT_NORM}.weight", f"{layer}.{POST_ATTN_NORM}.weight"))
        if role == "unknown":
            if hidden in dims:
                refused.append((name, "a tensor of the hidden width that rotation does not know"))
            continue
        if role is not None:
            roles[name] = role
    for norm in {r.norm for r in roles.values() if r.norm is not None}:
        bias = norm[: -len(".weight")] + ".bias"
        if norm not in roles:
            refused.append((norm, "the norm in front of a residual reader is missing"))
        elif bias in present:
            refused.append((bias, "a norm with a bias (LayerNorm): its bias cannot be folded into the readers"))
    if prefix + LM_HEAD + ".weight" not in roles and not tied:
        refused.append((lm_head, "no lm_head in the checkpoint (tied embeddings?)"))
    if len(projector_writers) > 1:
        refused.append((projector_writers[0], "several projector Linears write the hidden width: which one feeds "
                                              "the embeddings is unknown"))
    for name in projector_writers[:1]:
        roles[name] = Role(WRITER)
        bias = name[: -len(".weight")] + ".bias"
        if bias in present:
            roles[bias] = Role(WRITER_BIAS)
    return ResidualMap(roles, tuple(refused))
