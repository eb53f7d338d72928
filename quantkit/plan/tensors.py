"""A checkpoint as names, shapes and dtypes: the tensors a config.json implies (in the hub's on-disk
layout), their roles, and what they become after a recipe, laid out exactly as `convert` writes them
(pack/layout.py). Pure arithmetic over shapes: never reads tensor data."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


from ..arch import ModelSpec, fused_experts
from ..arch.layout import (EMBED_MODULES, FP8_RELEASE_KEEP, KV_A, ROLES, ROUTER_TARGETS, VISION_PREFIXES,  # noqa: F401
                           attention_of, enumerate_tensors, tensor_role)
from ..errors import ConfigError
from ..match.recipe import KVCacheSpec, Recipe, Scheme, WeightGroup, fused_rows_ok, load_recipe
from ..pack import kv as kvrules
from ..pack.config import config_groups
from ..pack.layout import FP8_RELEASE_SCALE, module_tensors
from ..read.safetensors import CODE_OF, DTYPES
from ..pack.names import Tensor

# Legend: D = hidden_size, V = vocab_size, H = attention heads, KV = key/value heads, hd = head_dim,
# I = dense intermediate, Im = expert intermediate, E = routed experts, L = decoder layers (no MTP).

# Name -> (shape, safetensors dtype string such as "BF16", "F8_E4M3", "I32").
TensorShapes = dict[str, tuple[tuple[int, ...], str]]

# Shard size assumed for a config-only plan (the hub convention); it only moves the header estimate.
DEFAULT_SHARD_BYTES = 5 * 10**9


# ---- bytes as quantkit writes them ---------------------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


_BYTES_MEMO: dict[tuple[tuple[int, ...], str], int] = {}


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of one stored tensor (memoized: a 1T-parameter model has ~10^5 tensors but few shapes)."""
    key = (shape, dtype)
    b = _BYTES_MEMO.get(key)
    if b is None:
        if dtype not in DTYPES:
            raise ConfigError(f"unknown safetensors dtype {dtype!r}", hint=f"known: {', '.join(sorted(DTYPES))}")
        b = _BYTES_MEMO[key] = _numel(shape) * DTYPES[dtype][1]
    return b


_SCALE_SUFFIXES = (Tensor.RELEASE_SCALE, Tensor.SCALE, Tensor.ZERO_POINT, Tensor.SHAPE, Tensor.G_IDX,
                   "input_scale", "k_scale", "v_scale")


def _is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A Linear's 2-D weight (what a recipe can quantize). Embeddings and norms are not Linears."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    return name[:-7].rsplit(".", 1)[-1] not in EMBED_MODULES


def _replacement(shape: tuple[int, int], dtype: str, scheme: Scheme, g_idx: bool):
    """(suffix, shape, dtype code) of the tensors that replace one `.weight` [out, k] (pack/layout.py)."""
    return tuple((name, sh, CODE_OF[dt]) for name, dt, sh in module_tensors("", shape, scheme, DTYPES[dtype][0],
                                                                             g_idx=g_idx))


def _packed_source(name: str, shape: tuple[int, ...], dtype: str, tensors: Mapping) -> tuple[str, int] | None:
    """(encoding, in_features) when `name` is the packed weight of a module the source stores packed:
    "nvfp4" / "mxfp4" (two E2M1 codes a byte, no weight_shape; NVFP4 has a global scale) or "int4"
    (int32 words of eight codes, with weight_shape; in_features as the header gives it, a multiple of 8),
    else None."""
    if not name.endswith(Tensor.PACKED.dotted) or len(shape) != 2:
        return None
    module = name[: -len(Tensor.PACKED.dotted)]
    if Tensor.SHAPE.of(module) in tensors:
        return ("int4", shape[1] * 8) if dtype == "I32" else None
    if dtype != "U8":
        return None
    return ("nvfp4" if Tensor.GLOBAL_SCALE.of(module) in tensors else "mxfp4"), shape[1] * 2


def quantized_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], recipe: Recipe | None, *,
                     spec: ModelSpec | None = None, g_idx_groups: frozenset[str] = frozenset()) -> TensorShapes:
    """The checkpoint `tensors` become after `recipe`, as quantkit writes it (recipe None: unchanged).

    Per Linear weight `X.weight` [out, k]: `group = recipe.match("X")`; None keeps `X.weight` as is (an
    FP8 release's `X.weight_scale_inv` becomes `X.weight_scale`, float32, as convert passes it through),
    otherwise the scheme's tensors replace them. Every other
    tensor (norms, biases, embeddings, router bias) is kept. With `recipe.kv_cache`, k_scale/v_scale
    float32 tensors are added to every attention module of the decoder layers (not MTP layers).
    `g_idx_groups`: groups whose modules carry `weight_g_idx` (sources written with actorder "group")."""
    if recipe is None:
        return dict(tensors)
    out: TensorShapes = {}
    dropped: set[str] = set()
    # (group, shape, dtype) -> the replacement tensors as (suffix, shape, dtype): all experts of a model
    # share a handful of shapes, so each scheme is applied (and for_in_features checked) once per shape.
    memo: dict[tuple[int, tuple[int, ...], str, bool], tuple[tuple[str, tuple[int, ...], str], ...]] = {}
    def rows_of(module):
        t = tensors.get(f"{module}.weight")
        return None if t is None else t[0][0]

    # FP4 in the source and another scheme in the recipe, or INT4 in the source and FP4 in the recipe
    # (match/shards.decide): decoded on read and re-quantized
    requant: dict[str, tuple[Scheme, WeightGroup, int]] = {}
    for name, (shape, dtype) in tensors.items():
        packed = _packed_source(name, tuple(shape), dtype, tensors)
        group = recipe.match(name[: -len(Tensor.PACKED.dotted)]) if packed else None
        if group is None or (packed[0] == "int4" and not group.scheme.fp4):
            continue
        scheme = group.scheme.for_in_features(packed[1])
        if scheme.fp4 != packed[0]:
            requant[name[: -len(Tensor.PACKED.dotted)]] = (scheme, group, packed[1])
    for name, (shape, dtype) in tensors.items():
        if type(shape) is not tuple:
            shape = tuple(shape)
        split = fused_experts(name, shape) if len(shape) == 3 else None
        if split and any(recipe.match(m) for m, _, _, _ in split):
            todo = [(m + ".weight", sh, dtype) for m, _, _, sh in split]
        else:
            todo = ((name, shape, dtype),)
        for name, shape, dtype in todo:
            module, _, suffix = name.rpartition(".")
            if module in requant:  # an FP4 source module the recipe re-quantizes: decoded, then its scheme
                if suffix == Tensor.PACKED:
                    scheme, group, k = requant[module]
                    for sfx, sh, d in _replacement((shape[0], k), "BF16", scheme,
                                                   group.name in g_idx_groups):
                        out[module + sfx] = (sh, d)
                continue
            if not _is_linear_weight(name, shape):
                out[name] = (shape, dtype)
                continue
            module = name[:-7]
            group = recipe.match(module)
            if group is None:
                out[name] = (shape, dtype)
                continue
            ok = True
            if group.scheme.type == "float" and group.scheme.strategy == "block":  # fused Linears' rows rule
                ok = fused_rows_ok(module, rows_of, group.scheme.block_structure[0])
            key = (id(group), shape, dtype, ok)
            parts = memo.get(key)
            if parts is None:
                scheme = group.scheme.for_in_features(shape[1], ok)  # may raise GroupSizeError
                parts = memo[key] = _replacement(shape, dtype, scheme, group.name in g_idx_groups)
            for suffix, sh, d in parts:
                out[module + suffix] = (sh, d)
            dropped.add(module + Tensor.RELEASE_SCALE.dotted)
    for n in dropped:
        out.pop(n, None)
    b1 = ((spec.quantization or {}).get("weight_block_size") or [128, 128])[1] if spec is not None else 128
    for n in [n for n in out if n.endswith("." + FP8_RELEASE_SCALE)]:  # kept FP8 modules: compressed-tensors' name
        shape, _ = out.pop(n)
        w = n[: -len(FP8_RELEASE_SCALE)] + "weight"
        if w in out and out[w][0][1] % b1:  # a partial block along K: written as BF16 (convert's DecodeUnit)
            out[w] = (out[w][0], "BF16")
            continue
        out[n[: -len(FP8_RELEASE_SCALE)] + Tensor.SCALE] = (shape, "F32")
    if recipe.kv_cache is not None:
        out.update(_kv_scale_tensors(tensors, recipe.kv_cache, spec))
    return out


def _kv_scale_tensors(tensors: Mapping, kv: KVCacheSpec, spec: ModelSpec | None) -> TensorShapes:
    attn: dict[str, int] = {}
    for name in tensors:
        m = attention_of(name)
        if m and (spec is None or int(m[1]) < spec.num_layers):
            attn[m[0]] = int(m[1])
    mla = any(f".{KV_A}." in n for n in tensors) if spec is None else spec.attention == "mla"
    try:
        shape = kvrules.scale_shape(kv.strategy, None if spec is None else spec.num_kv_heads, mla)
    except Exception as e:  # KVScalesError: attn_head without the number of KV heads
        raise ConfigError(f"{e}", hint="pass spec=parse_config(config) to predict_bytes") from None
    out: TensorShapes = {}
    for a in attn:
        out[a + ".k_scale"] = (shape, "F32")
        out[a + ".v_scale"] = (shape, "F32")
    return out


def header_bytes(tensors: Mapping[str, tuple[tuple[int, ...], str]], n_shards: int = 1) -> int:
    """Estimated safetensors header bytes for `tensors` written in `n_shards` files: per shard the 8-byte
    length, the compact JSON (`{"__metadata__":{"format":"pt"},"name":{"dtype":..,"shape":[..],
    "data_offsets":[a,b]},...}`) and the padding to 8 bytes. Offsets are simulated (name order)."""
    n_shards = max(1, n_shards)
    names = sorted(tensors)
    sizes = [tensor_bytes(*tensors[n]) for n in names]
    target = sum(sizes) / n_shards
    total, shard_json, off, used = 0, 0, 0, 0
    shape_len: dict[tuple[int, ...], int] = {}
    fixed = len(',"":{"dtype":"","shape":[],"data_offsets":[,]}')

    def close(js: int) -> float:
        raw = js + len('{"__metadata__":{"format":"pt"}}')
        return 8 + raw + 3.5  # 8-byte length prefix; padding to 8 bytes averages 3.5

    for name, nb in zip(names, sizes):
        if off and off + nb > target and used < n_shards - 1:
            total += close(shard_json)
            shard_json, off, used = 0, 0, used + 1
        shape, dtype = tensors[name]
        sl = shape_len.get(shape)
        if sl is None:
            sl = shape_len[shape] = len(",".join(str(x) for x in shape))
        # ,"name":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]}
        shard_json += len(name) + len(dtype) + sl + len(str(off)) + len(str(off + nb)) + fixed
        off += nb
    total += close(shard_json)
    return int(round(total))


def predict_bytes(tensor_shapes: Mapping[str, tuple[tuple[int, ...], str]], recipe: Recipe | str | None, *,
                  spec: ModelSpec | None = None, n_shards: int | None = None, header: bool = True) -> int:
    """Bytes of the checkpoint `tensor_shapes` describe after `recipe` (a Recipe, a recipe name or path,
    or None for the checkpoint as it is), with the safetensors headers of `n_shards` files (default: one
    per DEFAULT_SHARD_BYTES) unless `header=False`."""
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    layout = quantized_layout(tensor_shapes, recipe, spec=spec)
    data = sum(tensor_bytes(sh, d) for sh, d in layout.values())
    if not header:
        return data
    if n_shards is None:
        n_shards = max(1, -(-data // DEFAULT_SHARD_BYTES))
    return data + header_bytes(layout, n_shards)


# ---- source layouts of quantized releases ---------------------------------------------------------------
def _not_converted(module: str, entries: list[str]) -> bool:
    return any(module == e or module.startswith(e + ".") or module.endswith("." + e) for e in entries)


def fp8_block_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], qc: Mapping[str, Any]) -> TensorShapes:
    """`tensors` as an FP8 block checkpoint (`quant_method: fp8`) stores them: each Linear weight as
    float8_e4m3fn plus `weight_scale_inv` float32 [ceil(out/b0), ceil(in/b1)]; embeddings, lm_head,
    routers, eh_proj, the indexer's weights_proj and `modules_to_not_convert` stay as they are."""
    b0, b1 = tuple(qc.get("weight_block_size") or (128, 128))
    skip = [str(e) for e in (qc.get("modules_to_not_convert") or [])]
    out: TensorShapes = {}
    for name, (shape, dtype) in tensors.items():
        module = name[:-7]
        if (not _is_linear_weight(name, shape) or FP8_RELEASE_KEEP.search(module) or name.startswith(VISION_PREFIXES)
                or (skip and _not_converted(module, skip))):
            out[name] = (shape, dtype)
            continue
        n_out, k = shape
        out[name] = (shape, "F8_E4M3")
        out[module + Tensor.RELEASE_SCALE.dotted] = ((-(-n_out // b0), -(-k // b1)), "F32")  # [ceil(out/b0), ceil(k/b1)]
    return out


def recipe_from_quantization_config(qc: Mapping[str, Any]) -> tuple[Recipe, frozenset[str]]:
    """A Recipe equivalent to a compressed-tensors `quantization_config` (used to size its source bytes),
    and the names of its groups written with actorder "group" (their modules carry `weight_g_idx`).
    The target "Linear" means every Linear; routers are not nn.Linear in the MoE modeling code."""
    groups, g_idx = [], set()
    for g in config_groups(qc):
        gname, w = g.name, g.weights
        if not w:
            continue
        scheme = Scheme.from_weights_config(w)
        if scheme is None:
            raise ConfigError(f"quantization_config group {gname!r}: weights {str(w)[:80]} are not a scheme quantkit "
                              "sizes", hint="the planner sizes pack-quantized INT4 and FP8 schemes")
        targets = tuple("re:.*" if t == "Linear" else t for t in (g.targets or ("Linear",)))
        groups.append(WeightGroup(str(gname), targets, scheme, "rtn"))
        if w.get("actorder") == "group":
            g_idx.add(str(gname))
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no weight groups")
    kv = qc.get("kv_cache_scheme")
    kv_spec = KVCacheSpec(kv.get("strategy", "tensor")) if isinstance(kv, Mapping) else None
    ignore = tuple(str(x) for x in (qc.get("ignore") or [])) + ROUTER_TARGETS
    return Recipe(name="quantization_config", groups=tuple(groups), ignore=ignore, kv_cache=kv_spec), frozenset(g_idx)


def source_tensors(spec: ModelSpec, *, mtp: bool = True) -> TensorShapes:
    """The tensors of the checkpoint a config.json describes, in its own format (BF16, FP8 block, or
    compressed-tensors as its quantization_config says)."""
    t = enumerate_tensors(spec, mtp=mtp)
    q = spec.quantization
    if not q:
        return t
    method = q.get("quant_method")
    if method == "fp8":
        return fp8_block_layout(t, q)
    if method == "compressed-tensors":
        recipe, g_idx = recipe_from_quantization_config(q)
        return quantized_layout(t, recipe, spec=spec, g_idx_groups=g_idx)
    raise ConfigError(f"quantization_config quant_method {method!r} is not supported by the planner",
                      hint="supported: no quantization_config (BF16), quant_method fp8 (block), compressed-tensors")


# ---- parameters -------------------------------------------------------------------------------------
def parameter_count(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """Parameters a stored tensor holds: scales, zero points and shapes hold none; a packed INT4 word
    holds 8 (INT8 checkpoints are counted as INT4 too: the header alone does not say)."""
    last = name.rsplit(".", 1)[-1]
    if last in _SCALE_SUFFIXES:
        return 0
    if last == Tensor.PACKED:
        return _numel(shape) * 8
    return _numel(shape)


def _by_role(tensors: Mapping[str, tuple[tuple[int, ...], str]], num_layers: int, fn) -> dict[str, int]:
    acc = dict.fromkeys(ROLES, 0)
    memo: dict[str, str] = {}  # module -> role: X.weight, X.weight_scale, X.weight_shape share one lookup
    for name, (shape, dtype) in tensors.items():
        module = name.rpartition(".")[0]
        role = memo.get(module) if module else None
        if role is None:
            role = tensor_role(name, num_layers)
            if module:
                memo[module] = role
        acc[role] += fn(name, tuple(shape), dtype)
    return acc


