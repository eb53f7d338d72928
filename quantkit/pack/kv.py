"""FP8 KV-cache scales: names, shapes, config and every rule they must satisfy (docs/format.md, "KV-cache
scales"). The one definition `calibrate` writes by, `convert` validates and ships by, `plan` sizes by,
`verify` checks by and the runtime loads by.

- Tensors `model.layers.L.self_attn.k_scale` / `v_scale`, float32, positive and finite, for every layer
  that has attention; shape [1] (strategy "tensor") or [num_key_value_heads, 1, 1] ("attn_head").
- MLA models (DeepSeek-V3 / Kimi K2 / GLM-5) cache one latent per token and layer, scaled by a single
  scale: a per-"head" scale there has one head, [1, 1, 1], which is the per-tensor scale [1] engines load.
- config.json `kv_cache_scheme`: {"num_bits": 8, "type": "float", "strategy": S, "dynamic": false,
  "symmetric": true}.
- scale = amax / 448 over what the engine caches (K after RoPE and k_norm, V as projected, the MLA latent).
- A multimodal wrapper (Kimi K2.5's kimi_k25) carries its text model's tensors under a prefix, and so its
  scales: `language_model.model.layers.L.self_attn.k_scale`. vLLM maps that name to the text model's
  attention; the bare name makes the wrapper's loader raise. Scales files (`quantkit calibrate`) hold the
  text model's names; `KVScales.prefix` adds the wrapper's when they are shipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..arch import WRAPPERS
from ..arch.layout import ATTN, LAYERS
from ..errors import KVScalesError
from ..quant.fp8 import FP8_MAX

KV_SHARD_NAME = "model-kv-scales.safetensors"
_PREFIX = "(?:" + "|".join(sorted(re.escape(w.prefix) for w in WRAPPERS.values())) + ")?"  # a wrapper's, or none
_LAYERS = re.escape(LAYERS)
KV_SCALE = re.compile(rf"^{_PREFIX}{_LAYERS}\.(\d{{1,9}})\.{ATTN}\.([kv])_scale$")
STRATEGIES = ("tensor", "attn_head")
ATTN_TENSOR = re.compile(rf"^{_PREFIX}{_LAYERS}\.(\d{{1,9}})\.{ATTN}\.")  # a tensor of layer L's attention


def kv_scale_name(layer: int, kind: str, prefix: str = "") -> str:
    """kind: "k" or "v"; prefix: the wrapper's ("language_model.") in a wrapped model's checkpoint."""
    return f"{prefix}{LAYERS}.{layer}.{ATTN}.{kind}_scale"


def unprefixed(name: str) -> str:
    """The text model's name of a scale (a wrapper's prefix removed)."""
    for w in WRAPPERS.values():
        if name.startswith(f"{w.prefix}{LAYERS}."):
            return name[len(w.prefix):]
    return name


def kv_cache_scheme(strategy: str) -> dict:
    """config.json's `quantization_config.kv_cache_scheme` for FP8 scales of `strategy`."""
    if strategy not in STRATEGIES:
        raise KVScalesError(f"unknown KV-cache strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def scale_shape(strategy: str, kv_heads: int | None, mla: bool) -> tuple[int, ...]:
    """The shape of each scale for `strategy` ([1] for MLA whatever the strategy: one latent)."""
    if strategy == "tensor" or mla:
        return (1,)
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise KVScalesError("kv_cache strategy attn_head needs the number of KV heads (num_key_value_heads)")
    return (kv_heads, 1, 1)


def shipped_strategy(strategy: str, mla: bool) -> str:
    """The strategy written to config.json: MLA's single latent scale is per tensor."""
    return "tensor" if mla else strategy


def strategy_of(shape: tuple[int, ...]) -> str | None:
    """"tensor" for [1], "attn_head" for [H, 1, 1], None for anything else."""
    if tuple(shape) == (1,):
        return "tensor"
    if len(shape) == 3 and tuple(shape[1:]) == (1, 1) and shape[0] > 0:
        return "attn_head"
    return None


# Plausible scales (docs/format.md, "KV-cache scales"). The engine caches round(K / scale) in e4m3, whose largest
# finite value is 448 and smallest subnormal 2^-9: a scale says the cached values reach 448 * scale.
# - refused above MAX_KV_SCALE: 448 * scale past 65504 (float16's range; no engine's K or V lives there); a
#   scale of 1e38 rounds every K to 0;
# - refused below MIN_KV_SCALE (float32's smallest normal number, what calibrate writes for a head that never
#   activates): 1e-45 saturates every K at +-448;
# - a note below LOW_KV_AMAX / 448 (cached values under float16's smallest normal number, 2^-14): right for a
#   head that never activates, wrong for any other (every larger value saturates).
FP8_E4M3_MAX = FP8_MAX
MAX_KV_SCALE = 65504.0 / FP8_E4M3_MAX
MIN_KV_SCALE = torch.finfo(torch.float32).tiny
LOW_KV_AMAX = 2.0 ** -14


def range_problem(name: str, t: torch.Tensor) -> str | None:
    """A scale outside the plausible range (see above), or None. `t`: positive and finite."""
    hi, lo = float(t.max()), float(t.min())
    if hi > MAX_KV_SCALE:
        return (f"{name} holds {hi:.3g}: cached values up to {FP8_E4M3_MAX * hi:.3g}, past 65504, where no K or V "
                f"lives (KV scales are at most {MAX_KV_SCALE:.4g}; a scale this large rounds every value to 0)")
    if lo < MIN_KV_SCALE:
        return (f"{name} holds {lo:.3g}, below float32's smallest normal number {MIN_KV_SCALE:.3g}: every cached "
                "value would saturate at +-448")
    return None


def range_notes(scales: Mapping[str, torch.Tensor]) -> list[str]:
    """One note when some scales are plausible but tiny (see above)."""
    low = sorted(n for n, t in scales.items() if t.numel() and float(t.min()) * FP8_E4M3_MAX < LOW_KV_AMAX)
    if not low:
        return []
    return [f"{len(low)} KV scale(s) are tiny (e.g. {low[0]}: cached values under {LOW_KV_AMAX:.3g}): right for a "
            "head that never activates, else every larger K/V saturates in the FP8 cache; recalibrate if unsure"]


def tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """What is wrong with one scale tensor on its own (name, dtype, shape, values), or None."""
    if KV_SCALE.match(name) is None:
        return f"unexpected tensor {name[:100]!r} (expected model.layers.L.self_attn.k_scale / v_scale)"
    if t.dtype != torch.float32:
        return f"{name} is {str(t.dtype).removeprefix('torch.')}; KV scales must be float32"
    if strategy_of(tuple(t.shape)) is None:
        return f"{name} has shape {list(t.shape)}, neither [1] (tensor) nor [H, 1, 1] (attn_head)"
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        return f"{name} holds a zero, negative or non-finite scale: KV scales must be positive finite numbers"
    return range_problem(name, t)


def normalize_mla(scales: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MLA scales as engines load them: a single-"head" [1, 1, 1] becomes [1] (the same number)."""
    return {n: (t.reshape(1) if tuple(t.shape) == (1, 1, 1) else t) for n, t in scales.items()}


def validate(scales: Mapping[str, torch.Tensor], *, num_layers: int, attn_layers: Iterable[int],
             kv_heads: int | None, mla: bool, strategy: str | None = None) -> str:
    """Check scales against a model: every tensor well-formed, one for K and V of every attention layer
    (a missing one would silently be 1.0 in vLLM), none for a layer without attention, one shape for all.
    Returns the strategy ("tensor" | "attn_head"); raises KVScalesError."""
    attn = sorted(set(attn_layers))
    if not scales:
        raise KVScalesError("the KV scales are empty")
    shapes = set()
    for name, t in scales.items():
        problem = tensor_problem(name, t)
        if problem:
            raise KVScalesError(problem)
        layer = int(KV_SCALE.match(name)[1])
        if layer >= num_layers:
            raise KVScalesError(f"{name}: layer {layer} does not exist (the model has {num_layers} layers)")
        if layer not in attn:
            raise KVScalesError(f"{name}: the source has no model.layers.{layer}.self_attn weights")
        shapes.add(tuple(t.shape))
    missing = [kv_scale_name(L, kind) for L in attn for kind in "kv" if kv_scale_name(L, kind) not in scales]
    if missing:  # an engine would silently use 1.0 for them
        m = KV_SCALE.match(missing[0])
        raise KVScalesError(f"{len(missing)} KV scale(s) missing, e.g. {missing[0]} (layer {m[1]} has no {m[2]}_scale)")
    if len(shapes) != 1:
        raise KVScalesError(f"the KV scales mix shapes {sorted(shapes)}; use one strategy for all layers")
    (shape,) = shapes
    found = strategy_of(shape)
    if found == "attn_head" and mla:
        raise KVScalesError("per-head KV scales (attn_head) do not apply to MLA models: the engine caches one "
                            "latent per token and layer, scaled by a single k_scale")
    if found == "attn_head" and shape[0] != kv_heads:
        raise KVScalesError(f"KV scale shape {list(shape)} is neither [1] (tensor) nor [{kv_heads}, 1, 1] "
                            f"(attn_head, num_key_value_heads = {kv_heads})")
    if strategy is not None and strategy != found:
        raise KVScalesError(f"the recipe's kv_cache.strategy is {strategy!r}, but the scales are per {found}")
    return found


def checkpoint_problems(location: Mapping[str, str], info, config_scheme, *, num_layers: int | None,
                        kv_heads: int | None, mla: bool, prefix: str = "") -> list[str]:
    """The KV scales of a written checkpoint against its `kv_cache_scheme` (`info(name)` gives a tensor's
    header entry): every layer has both scales of the scheme's shape, under the model's `prefix`, iff the
    scheme is set."""
    present = sorted(n for n in location if KV_SCALE.match(n))
    if config_scheme is None:
        return [f"{present[0]}: KV-cache scales present but quantization_config.kv_cache_scheme is null"] if present \
            else []
    if not isinstance(config_scheme, dict):
        return ["quantization_config.kv_cache_scheme must be an object or null"]
    strategy = config_scheme.get("strategy")
    if strategy not in STRATEGIES:
        return [f"quantization_config.kv_cache_scheme.strategy is {strategy!r}; expected 'tensor' or 'attn_head'"]
    want = {(1,)} if strategy == "tensor" else ({(kv_heads, 1, 1)} if isinstance(kv_heads, int) else set())
    if mla:
        want.add((1,))
    out = []
    for layer in range(num_layers if isinstance(num_layers, int) else 0):
        for kind in "kv":
            name = kv_scale_name(layer, kind, prefix)
            i = info(name) if name in location else None
            if i is None:
                bare = kv_scale_name(layer, kind)
                out.append(f"{name}: missing (kv_cache_scheme is set)" + (
                    f"; {bare} is there, which the wrapper's loader cannot place" if prefix and bare in location
                    else ""))
            elif i.dtype != torch.float32 or (want and tuple(i.shape) not in want):
                out.append(f"{name}: {str(i.dtype).removeprefix('torch.')}{list(i.shape)}, expected float32 "
                           f"{' or '.join(str(list(w)) for w in sorted(want))}")
    return out


def check_source(get, names: Iterable[str]) -> list[str]:
    """The KV scales a source checkpoint holds (kept when no new ones are given): each tensor checked on its
    own (`tensor_problem`, raising KVScalesError naming the source's tensor); returns `range_notes`.
    `get(name)` reads one tensor."""
    scales = {n: get(n) for n in sorted(names)}
    for name, t in scales.items():
        problem = tensor_problem(name, t)
        if problem:
            raise KVScalesError(f"the source's {problem}", hint="the source checkpoint's KV scales are broken: pass "
                                "new ones with --kv-scales (from `quantkit calibrate`), or fix the checkpoint")
    return range_notes(scales)


@dataclass(frozen=True)
class KVScales:
    """Validated scales ready to ship: the text model's tensor name -> float32 tensor, their strategy,
    where they came from ({"file": path, "sha256": ...} or {"calibrate": {dataset, num_samples, seq_len}})
    and the prefix a wrapped model's checkpoint names them with."""

    scales: dict
    strategy: str
    origin: dict
    prefix: str = ""

    def config(self) -> dict:
        return kv_cache_scheme(self.strategy)

    def ordered(self) -> list[tuple[str, torch.Tensor]]:
        """Layer by layer, k before v: the order the extra shard stores them in (deterministic)."""
        def key(n):
            m = KV_SCALE.match(n)
            return int(m[1]), m[2]

        return [(self.prefix + n, self.scales[n]) for n in sorted(self.scales, key=key)]
