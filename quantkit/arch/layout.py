"""How checkpoints name their modules: the vocabulary every stage uses to find attention, routers, routed and
shared experts, norms and embeddings (the registry, arch/registry.py, says which family uses which), the
routed-expert names every stage parses (`EXPERT`, `expert_parts`, `expert_role`), and one decoder layer's
module names (`LayerNames`), from which `enumerate_tensors` writes a config's whole hub layout.

    <prefix>model.embed_tokens                          EMBED
    <prefix>model.layers.L.self_attn.{q,k,v,o}_proj     GQA (+ q_norm, k_norm)
    <prefix>model.layers.L.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
                                      kv_a_layernorm, kv_b_proj, o_proj}            MLA
    <prefix>model.layers.L.<block>.gate                 the router [E, D] (+ e_score_correction_bias)
    <prefix>model.layers.L.<block>.experts.E.<proj>     routed experts: ExpertNames (gate, up, down)
    <prefix>model.layers.L.<block>.shared_experts.<proj>
    <prefix>model.norm, <prefix>lm_head

<block> is `mlp`, or `block_sparse_moe` (Mixtral). transformers 5 holds routed experts fused in memory (and
some checkpoints on disk): `experts.gate_up_proj` [E, 2*Im, D] (gate rows first), `experts.down_proj` [E, D, Im].
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import ConfigError

# ---- the vocabulary ------------------------------------------------------------------------------------
EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"
LM_HEAD = "lm_head"
LAYERS = "model.layers"
ATTN = "self_attn"
INPUT_NORM = "input_layernorm"
POST_ATTN_NORM = "post_attention_layernorm"
ROUTER = "gate"  # <block>.gate
ROUTER_BIAS = "e_score_correction_bias"  # <block>.gate.<this> (noaux_tc routing)
EXPERTS = "experts"
SHARED_EXPERTS = "shared_experts"  # DeepSeek / GLM / Kimi
SHARED_EXPERT_PREFIX = "shared_expert"  # both spellings (Qwen2-MoE style: shared_expert, shared_expert_gate)
Q, K, V, O = "q_proj", "k_proj", "v_proj", "o_proj"
Q_NORM, K_NORM = "q_norm", "k_norm"
Q_A, Q_A_NORM, Q_B = "q_a_proj", "q_a_layernorm", "q_b_proj"
KV_A, KV_A_NORM, KV_B = "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"  # transformers' fused experts
# tensors outside the text model that wrappers (Kimi K2.5) and other multimodal checkpoints carry
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "visual.", "vision_model.", "multi_modal_projector.")


@dataclass(frozen=True)
class ExpertNames:
    """On-disk per-expert module names under `model.layers.L.<block>.experts.E.`."""

    block: str  # "mlp" | "block_sparse_moe" (Mixtral)
    gate: str
    up: str
    down: str

    def role(self, proj: str) -> str | None:
        """"gate" | "up" | "down" for one of this family's projection names, else None."""
        return {self.gate: "gate", self.up: "up", self.down: "down"}.get(proj)


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
DENSE_MLP = QWEN_EXPERTS  # a dense MLP (and a shared expert) names its projections as Qwen's experts
EXPERT_NAMINGS = (QWEN_EXPERTS, MIXTRAL_EXPERTS)
EXPERT_BLOCKS = tuple(dict.fromkeys(n.block for n in EXPERT_NAMINGS))
# vLLM fuses these Linears of a layer into one (each part must share a scheme): (parts, fused name)
FUSED_LINEARS = (((Q, K, V), "qkv_proj"), ((QWEN_EXPERTS.gate, QWEN_EXPERTS.up), FUSED_GATE_UP),
                 ((Q_A, KV_A), "fused_qkv_a_proj"))

_ROLES = {p: n.role(p) for n in EXPERT_NAMINGS for p in (n.gate, n.up, n.down)}
_PARTNERS = {p: q for n in EXPERT_NAMINGS for p, q in ((n.gate, n.up), (n.up, n.gate))}
_ALT = "|".join(map(re.escape, _ROLES))
# one routed expert's projection: groups prefix ("...experts"), expert, proj (any name)
EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d{1,9})\.(?P<proj>[^.]+)$")
# ...and only the known projection names, under a known block: groups layer (the text before the block), e, proj
EXPERT_PROJ = re.compile(r"^(?P<layer>.*)\.(?:" + "|".join(EXPERT_BLOCKS) + r")\.experts\.(?P<e>\d{1,9})\.(?P<proj>"
                         + _ALT + r")$")
_EXPERT_INDEX = re.compile(r"\.experts\.\d{1,9}\.")
_EXPERT_MODULE = re.compile(r"(\.experts\.\d{1,9})\.[^.]+$")


def expert_role(proj: str) -> str | None:
    """"gate" | "up" | "down" for a routed-expert projection name of any family (w1 -> gate), else None."""
    return _ROLES.get(proj)


def partner(proj: str) -> str | None:
    """The other half of a gate/up pair (gate_proj <-> up_proj, w1 <-> w3), which engines fuse; else None."""
    return _PARTNERS.get(proj)


def expert_parts(module: str) -> tuple[str, int, str] | None:
    """("...experts", expert, proj) of one routed expert's projection module, or None."""
    m = EXPERT.match(module)
    return (m["prefix"], int(m["expert"]), m["proj"]) if m else None


def is_expert_proj(module: str) -> bool:
    """A routed expert's gate, up or down projection (any family's names)."""
    m = EXPERT.match(module)
    return m is not None and m["proj"] in _ROLES


def is_routed_expert(name: str) -> bool:
    """A tensor or module of a routed expert (`.experts.E.` in its name)."""
    return _EXPERT_INDEX.search(name) is not None


def any_expert(module: str) -> str:
    """The name with its expert index replaced by `*` (`...experts.*.gate_proj`): one key for the same
    projection of every expert of a layer."""
    return _EXPERT_INDEX.sub(".experts.*.", module)


def expert_module(module: str) -> str:
    """The expert a projection belongs to (`...experts.3.up_proj` -> `...experts.3`); other names unchanged."""
    return _EXPERT_MODULE.sub(r"\1", module)


def is_router(name: str) -> bool:
    """A router's tensor or module (`<block>.gate`, its weight or correction bias)."""
    return any(f".{b}.{ROUTER}." in name or name.endswith(f".{b}.{ROUTER}") for b in EXPERT_BLOCKS)


ROUTER_TARGETS = tuple(rf"re:.*\.{b}\.{ROUTER}$" for b in EXPERT_BLOCKS)  # recipe targets naming every router


# ---- one decoder layer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerNames:
    """Module names of decoder layer `i` under `prefix` ("" or a wrapper's, e.g. "language_model.")."""

    prefix: str
    i: int
    experts: ExpertNames = QWEN_EXPERTS

    @property
    def layer(self) -> str:
        return f"{self.prefix}{LAYERS}.{self.i}"

    @property
    def attn(self) -> str:
        return f"{self.layer}.{ATTN}"

    def att(self, name: str) -> str:
        """An attention submodule: att(Q) -> `...self_attn.q_proj`."""
        return f"{self.attn}.{name}"

    @property
    def input_norm(self) -> str:
        return f"{self.layer}.{INPUT_NORM}"

    @property
    def post_attn_norm(self) -> str:
        return f"{self.layer}.{POST_ATTN_NORM}"

    @property
    def mlp(self) -> str:
        """The MoE block (`mlp` or `block_sparse_moe`); a dense layer's MLP is `dense_mlp`."""
        return f"{self.layer}.{self.experts.block}"

    @property
    def dense_mlp(self) -> str:
        return f"{self.layer}.{DENSE_MLP.block}"

    @property
    def router(self) -> str:
        return f"{self.mlp}.{ROUTER}"

    @property
    def shared(self) -> str:
        return f"{self.mlp}.{SHARED_EXPERTS}"

    def expert(self, e: int, role: str) -> str:
        """Routed expert `e`'s projection by role ("gate" | "up" | "down")."""
        return f"{self.mlp}.{EXPERTS}.{e}.{getattr(self.experts, role)}"


def top_level(prefix: str = "") -> tuple[str, str, str]:
    """(embedding, final norm, lm_head) module names under `prefix`."""
    return f"{prefix}{EMBED}", f"{prefix}{FINAL_NORM}", f"{prefix}{LM_HEAD}"


# ---- a config's hub layout -----------------------------------------------------------------------------
# MTP layers (DeepSeek-V3, GLM) carry, around their decoder block: enorm, hnorm, eh_proj, shared_head.norm
# and, in DeepSeek-V3 / GLM-4.5, their own embed_tokens and shared_head.head
MTP_NORMS = ("enorm", "hnorm", "shared_head.norm")
MTP_PROJ, MTP_HEAD = "eh_proj", "shared_head.head"
INDEXER = "indexer"  # glm_moe_dsa: self_attn.indexer.{wq_b, wk, k_norm, weights_proj}


def _mlp(p: str, D: int, inter: int, dt: str, bias: bool = False) -> Iterator[tuple[str, tuple[int, ...], str]]:
    n = DENSE_MLP
    for proj, shape in ((n.gate, (inter, D)), (n.up, (inter, D)), (n.down, (D, inter))):
        yield f"{p}.{proj}.weight", shape, dt
        if bias:
            yield f"{p}.{proj}.bias", (shape[0],), dt


def layer_tensors(s, i: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every tensor of decoder layer `i` of ModelSpec `s`."""
    ln = LayerNames(s.prefix, i, s.experts or QWEN_EXPERTS)
    D, dt = s.hidden_size, s.dtype
    a = ln.att
    if s.attention == "mla":
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            yield a(Q_A) + ".weight", (s.q_lora_rank, D), dt
            if s.qkv_bias:
                yield a(Q_A) + ".bias", (s.q_lora_rank,), dt
            yield a(Q_A_NORM) + ".weight", (s.q_lora_rank,), dt
            yield a(Q_B) + ".weight", (s.num_heads * qk, s.q_lora_rank), dt
        else:
            yield a(Q) + ".weight", (s.num_heads * qk, D), dt
        yield a(KV_A) + ".weight", (s.kv_lora_rank + s.qk_rope_head_dim, D), dt
        if s.qkv_bias:
            yield a(KV_A) + ".bias", (s.kv_lora_rank + s.qk_rope_head_dim,), dt
        yield a(KV_A_NORM) + ".weight", (s.kv_lora_rank,), dt
        yield a(KV_B) + ".weight", (s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), dt
        yield a(O) + ".weight", (D, s.num_heads * s.v_head_dim), dt
        if s.o_bias:
            yield a(O) + ".bias", (D,), dt
        if s.indexer and s.indexer[i]:
            x, n, hd = a(INDEXER) + ".", s.index_n_heads, s.index_head_dim
            yield x + "wq_b.weight", (n * hd, s.q_lora_rank), dt  # [n*hd, q_lora_rank]
            yield x + "wk.weight", (hd, D), dt  # one K head shared by all index heads
            yield x + "k_norm.weight", (hd,), dt  # LayerNorm: weight and bias
            yield x + "k_norm.bias", (hd,), dt
            yield x + "weights_proj.weight", (n, D), dt
    else:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for proj, out in ((Q, q), (K, kv), (V, kv)):
            yield a(proj) + ".weight", (out, D), dt
            if s.qkv_bias:
                yield a(proj) + ".bias", (out,), dt
        yield a(O) + ".weight", (D, q), dt
        if s.o_bias:
            yield a(O) + ".bias", (D,), dt
        if s.qk_norm:
            qw, kw = s.qk_norm_widths
            yield a(Q_NORM) + ".weight", (qw,), dt
            yield a(K_NORM) + ".weight", (kw,), dt
    yield ln.input_norm + ".weight", (D,), dt
    yield ln.post_attn_norm + ".weight", (D,), dt
    if not s.moe[i]:
        yield from _mlp(ln.dense_mlp, D, s.intermediate_size, dt, s.mlp_bias)
        return
    E, Im, names = s.num_experts, s.moe_intermediate_size, ln.experts
    for e in range(E):
        if names is QWEN_EXPERTS:
            yield from _mlp(f"{ln.mlp}.{EXPERTS}.{e}", D, Im, dt)
        else:  # in the order save_pretrained writes them (sorted names)
            for role, shape in sorted((("gate", (Im, D)), ("down", (D, Im)), ("up", (Im, D))),
                                      key=lambda x: getattr(names, x[0])):
                yield ln.expert(e, role) + ".weight", shape, dt
    yield ln.router + ".weight", (E, D), dt  # router [E, D]
    if s.router_bias:
        yield f"{ln.router}.{ROUTER_BIAS}", (E,), "F32"  # float32 in the DeepSeek/Kimi/GLM releases
    if s.shared_intermediate:
        yield from _mlp(ln.shared, D, s.shared_intermediate, dt)


def enumerate_tensors(spec, *, mtp: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
    """The unquantized checkpoint's tensors by on-disk name: {name: (shape, dtype)}.

    `mtp=True` includes the MTP layers as the hub releases ship them (DeepSeek-V3: layer 61, GLM-4.5:
    layer 92, GLM-5: layer 78); transformers' `save_pretrained` drops them, so pass `mtp=False` to
    compare with a checkpoint written by transformers."""
    s, D, V, dt = spec, spec.hidden_size, spec.vocab_size, spec.dtype
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    embed, norm, head = top_level(s.prefix)
    out[embed + ".weight"] = ((V, D), dt)
    out[norm + ".weight"] = ((D,), dt)
    if not s.tie_word_embeddings:
        out[head + ".weight"] = ((V, D), dt)
    for i in range(s.num_layers + (s.mtp_layers if mtp else 0)):
        for name, shape, d in layer_tensors(s, i):
            out[name] = (shape, d)
        if i >= s.num_layers:  # MTP extras around the decoder block
            p = LayerNames(s.prefix, i).layer + "."
            for n in MTP_NORMS[:2]:
                out[f"{p}{n}.weight"] = ((D,), dt)
            out[f"{p}{MTP_PROJ}.weight"] = ((D, 2 * D), dt)  # [D, 2D]: concat(embedding, hidden) -> hidden
            out[f"{p}{MTP_NORMS[2]}.weight"] = ((D,), dt)
            if s.mtp_embeddings:
                out[f"{p}{EMBED.rsplit('.', 1)[1]}.weight"] = ((V, D), dt)
                out[f"{p}{MTP_HEAD}.weight"] = ((V, D), dt)
    return out


# ---- a tensor's role -----------------------------------------------------------------------------------
ROLES = ("routed_experts", "shared_experts", "attention", "dense_mlp", "router", "embeddings", "lm_head",
         "norms", "mtp", "vision", "other")
_EMBED_LEAF = EMBED.rsplit(".", 1)[1]


def _layer_index(name: str) -> int | None:
    i = name.find("layers.")
    if i < 0 or (i and name[i - 1] != "."):
        return None
    j = name.find(".", i + 7)
    idx = name[i + 7:j]
    return int(idx) if idx.isdigit() and len(idx) <= 9 else None


def tensor_role(name: str, num_layers: int | None = None) -> str:
    """The role of a tensor (one of ROLES) from its name; layers >= num_layers are MTP layers.
    (Plain substring tests: this runs once per tensor, ~10^5 times for a 1T-parameter model.)"""
    if name.startswith(VISION_PREFIXES):
        return "vision"
    if num_layers is not None:
        li = _layer_index(name)
        if li is not None and li >= num_layers:
            return "mtp"
    if f".{EXPERTS}." in name:
        return "routed_experts"
    if f".{SHARED_EXPERT_PREFIX}" in name:  # shared_experts (DeepSeek/GLM), shared_expert(_gate) (Qwen2-MoE style)
        return "shared_experts"
    if any(f".{b}.{ROUTER}." in name for b in EXPERT_BLOCKS):
        return "router"
    module = name.rsplit(".", 1)[0]
    if module.endswith("norm"):  # input_layernorm, q_a_layernorm, k_norm, model.norm, enorm, ...
        return "norms"
    if f".{ATTN}." in name:
        return "attention"
    if f".{DENSE_MLP.block}." in name:
        return "dense_mlp"
    if f"{_EMBED_LEAF}." in name:
        return "embeddings"
    if name.startswith(f"{LM_HEAD}.") or f".{LM_HEAD}." in name:
        return "lm_head"
    return "other"


# what a Linear-shaped 2-D weight is not: an embedding (the spellings of the families quantkit reads)
EMBED_MODULES = (_EMBED_LEAF, "wte", "word_embeddings", "embeddings")
# Kept in BF16 by the DeepSeek-style FP8 block releases (DeepSeek-V3, Kimi K2, GLM FP8): not nn.Linear in their
# modeling code (routers), or precision-sensitive by convention (lm_head, MTP's head and eh_proj, the DSA indexer's
# weights_proj)
FP8_RELEASE_KEEP = re.compile(r"(?:^|\.)(?:" + "|".join(map(re.escape, (LM_HEAD, MTP_HEAD, MTP_PROJ, ROUTER,
                                                                         "weights_proj"))) + r")$")


def attention_of(name: str) -> tuple[str, str] | None:
    """(attention module, its layer index as text) of a tensor under `...layers.L.self_attn.`, else None."""
    i = name.find(f".{ATTN}.")
    if i < 0:
        return None
    m = re.search(r"(?:^|\.)layers\.(\d{1,9})$", name[:i])
    return (name[: i + len(ATTN) + 1], m[1]) if m else None


# Linears whose input dimension engines split over tensor-parallel ranks (row parallel): attention's output
# projection and the MLPs' down projections; every other Linear splits its output rows
ROW_PARALLEL = tuple(dict.fromkeys((O,) + tuple(n.down for n in EXPERT_NAMINGS)))


def is_row_parallel(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in ROW_PARALLEL


# ---- transformers' in-memory names ---------------------------------------------------------------------
HF_BLOCK = "mlp"  # transformers 5 names every family's MoE block `mlp` (Mixtral's on-disk block_sparse_moe too)
_EXPERTS_KEY = re.compile(r"(?:^|\.)(layers\.\d{1,9})\.(?:" + "|".join(EXPERT_BLOCKS) + r")\.experts$")


def hf_expert_param(module: str) -> tuple[str, int, str | None] | None:
    """Where one on-disk routed expert projection lives in a transformers 5 model: (its fused parameter,
    expert, "gate" | "up" for the half of gate_up_proj it fills, None for down_proj), or None when `module`
    is not a routed expert projection of a known naming."""
    m = EXPERT_PROJ.match(module)
    if m is None:
        return None
    role = expert_role(m["proj"])
    fused = FUSED_DOWN if role == "down" else FUSED_GATE_UP
    return f"{m['layer']}.{HF_BLOCK}.{EXPERTS}.{fused}", int(m["e"]), None if role == "down" else role


def experts_key(name: str) -> str | None:
    """`layers.L` of a routed-experts container (`...layers.L.mlp.experts`, on disk or in transformers), else None."""
    m = _EXPERTS_KEY.search(name)
    return m[1] if m else None


def disk_experts(hf_name: str, has) -> tuple[str, ExpertNames] | None:
    """The on-disk prefix and naming of the routed experts a transformers model holds at `hf_name`
    (`...mlp.experts`): the first naming whose expert 0 gate projection `has(module)` says is stored."""
    for names in EXPERT_NAMINGS:
        base = hf_name
        tail = f".{HF_BLOCK}.{EXPERTS}"
        if hf_name.endswith(tail):
            base = hf_name[: -len(tail)] + f".{names.block}.{EXPERTS}"
        if has(f"{base}.0.{names.gate}"):
            return base, names
    return None


def naming_of(proj: str) -> ExpertNames | None:
    """The expert naming a projection name belongs to (gate_proj -> Qwen's, w1 -> Mixtral's)."""
    return next((n for n in EXPERT_NAMINGS if proj in (n.gate, n.up, n.down)), None)
SHARED_SPELLINGS = (SHARED_EXPERTS, SHARED_EXPERT_PREFIX)  # DeepSeek / GLM / Kimi; Qwen2-MoE style


def hf_moe_parts(layer):
    """(MoE block, fused routed experts, router, shared experts or None) of a transformers 5 decoder layer, or
    None when the layer has no fused routed experts (a dense layer, or experts transformers keeps unfused)."""
    block = next((b for b in (getattr(layer, n, None) for n in (HF_BLOCK, *EXPERT_BLOCKS)) if b is not None), None)
    experts = getattr(block, EXPERTS, None) if block is not None else None
    if experts is None or not hasattr(experts, FUSED_GATE_UP):
        return None
    return block, experts, getattr(block, ROUTER, None), shared_of(block)


def shared_of(block):
    """A transformers MoE block's shared experts module (either spelling), or None."""
    return next((s for s in (getattr(block, n, None) for n in SHARED_SPELLINGS) if s is not None), None)


def shared_name(block) -> str:
    """The attribute (= on-disk) name a MoE block gives its shared experts."""
    return next((n for n in SHARED_SPELLINGS if hasattr(block, n)), SHARED_EXPERTS)


ROUTER_MODULES = tuple(f"{b}.{ROUTER}" for b in EXPERT_BLOCKS)  # a router relative to its layer: mlp.gate, ...
# the shared expert's gate and up of a layer (either spelling): group 1 is the layer
SHARED_GATE_UP = re.compile(rf"(.*)\.{HF_BLOCK}\.{SHARED_EXPERT_PREFIX}s?\.(?:{DENSE_MLP.gate}|{DENSE_MLP.up})$")
# noaux_tc's router correction bias, anywhere
ROUTER_BIAS_TENSOR = re.compile(rf"(?:^|\.){HF_BLOCK}\.{ROUTER}\.{ROUTER_BIAS}$")


def layer_module(layer_name: str, rel: str) -> str:
    """A module of a layer by its name relative to the layer (`post_attention_layernorm`, ...)."""
    return f"{layer_name}.{rel}"


def targets_experts(target: str) -> bool:
    """Whether a recipe / config target names routed experts (transformers' own test: the word `experts`)."""
    return EXPERTS in target


# ---- on-disk expert layouts ---------------------------------------------------------------------------
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?$")


def fused_experts(name: str, shape: tuple[int, ...], hidden: int | None = None):
    """Per-expert (module, expert, rows, [N, K]) of a fused 3-D expert tensor in the transformers layout
    (`experts.gate_up_proj` [E, 2*Im, D] with gate rows first, `experts.down_proj` [E, D, Im]); None if
    `name` is not one. With `hidden`, a tensor in another orientation is an error."""
    m = _FUSED.match(name)
    if not m or len(shape) != 3:
        return None
    e_count, a, b = shape
    prefix, kind = m["prefix"], m["kind"]
    if hidden is not None and not (b == hidden if kind == "gate_up_proj" else a == hidden):
        raise ConfigError(f"fused expert tensor {name} {list(shape)} is not in the [experts, out, in] layout",
                          hint="only the transformers layout gate_up_proj [E, 2*I, H] / down_proj [E, H, I] "
                               "is supported")
    out = []
    for e in range(e_count):
        if kind == "gate_up_proj":
            half = a // 2
            out.append((f"{prefix}.{e}.gate_proj", e, (0, half), (half, b)))
            out.append((f"{prefix}.{e}.up_proj", e, (half, a), (half, b)))
        else:
            out.append((f"{prefix}.{e}.down_proj", e, (0, a), (a, b)))
    return out

