"""compressed-tensors metadata: the quantization args of a scheme (`weights_config`), its label in the
manifest, and the `quantization_config` of config.json for what `convert` wrote (docs/format.md,
"config.json quantization_config"). The field set is the minimal one older vLLM pins accept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..arch.layout import EXPERTS, is_routed_expert
from ..errors import ConfigError, QuantkitError
from ..quant.fp8 import FP8Layout
from .names import PACKED_FORMATS
from .targets import matches

# a checkpoint's own quantization_config is input: its `re:` targets pass the same checks as a recipe's
TARGET_HINT = "the checkpoint's quantization_config has a target quantkit will not evaluate; check its source"


def canonical_json(d) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


FP4_SCALE_DTYPES = {"nvfp4": "torch.float8_e4m3fn", "mxfp4": "torch.uint8"}  # as compressed-tensors serializes them


@dataclass(frozen=True)
class Group:
    """One entry of a checkpoint's `quantization_config.config_groups`, as compressed-tensors reads it."""

    name: str
    format: str | None  # the group's own `format`, else the config's
    targets: tuple[str, ...]
    weights: dict | None
    input_activations: dict | None


def group_problem(name: Any, g: Any) -> str | None:
    """What makes one `config_groups` entry unreadable (hostile input), or None: it must be an object whose
    `targets` is a list of strings, whose `weights` and `input_activations` are objects or absent, and whose
    `format` is a string or absent."""
    where = f"quantization_config.config_groups.{str(name)[:40]}"
    if not isinstance(g, Mapping):
        return f"{where} must be an object"
    targets = g.get("targets") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        return f"{where}: targets must be a list of strings"
    if any(g.get(k) is not None and not isinstance(g.get(k), Mapping) for k in ("weights", "input_activations")):
        return f"{where}: weights and input_activations must be objects"
    if g.get("format") is not None and not isinstance(g.get("format"), str):
        return f"{where}: format must be a string"
    return None


def config_groups(qc: Mapping | None, error: type[QuantkitError] = ConfigError, *,
                  lenient: bool = False) -> list[Group]:
    """The config groups of a `quantization_config` (hostile input), in the config's order: each an object
    whose `targets` is a list of strings and whose `weights` / `input_activations` are objects or absent.
    A group breaking that is `error` (a QuantkitError subclass), or skipped when `lenient`."""
    if not isinstance(qc, Mapping):
        return []
    raw = qc.get("config_groups") or {}
    if not isinstance(raw, Mapping):
        if lenient:
            return []
        raise error("quantization_config.config_groups must be an object")
    top, out = qc.get("format"), []
    for name, g in raw.items():
        problem = group_problem(name, g)
        if problem is not None:
            if lenient:
                continue
            raise error(problem)
        targets = g.get("targets") or []
        fmt = g.get("format") or top
        out.append(Group(str(name), fmt if isinstance(fmt, str) else None, tuple(targets),
                         dict(g["weights"]) if g.get("weights") else None,
                         dict(g["input_activations"]) if g.get("input_activations") else None))
    return out


def weights_config(scheme) -> dict[str, Any]:
    """compressed-tensors QuantizationArgs of a match.recipe.Scheme, minimal field set (older vLLM pins
    reject unknown keys). FP4 schemes add `scale_dtype`, as compressed-tensors' NVFP4A16 / MXFP4A16
    presets write it: the engines that read FP4 know the key, and it says how to read the scales."""
    fp4 = getattr(scheme, "fp4", None)
    if fp4:
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": scheme.strategy,
                "group_size": scheme.group_size, "dynamic": False, "actorder": None, "block_structure": None,
                "observer": "minmax", "observer_kwargs": {}, "scale_dtype": FP4_SCALE_DTYPES[fp4]}
    return {
        "num_bits": scheme.num_bits, "type": scheme.type, "symmetric": scheme.symmetric,
        "strategy": scheme.strategy, "group_size": scheme.group_size, "dynamic": False, "actorder": None,
        "block_structure": list(scheme.block_structure) if scheme.block_structure else None,
        "observer": "minmax", "observer_kwargs": {},
    }


class _Args(NamedTuple):
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    block_structure: tuple[int, int] | None


def fp8_weights_config(layout: FP8Layout) -> dict[str, Any]:
    return weights_config(_Args(8, "float", True, layout.strategy, None, layout.block))


def fp8_input_activations(layout: FP8Layout) -> dict[str, Any]:
    """Dynamic FP8 activations, as the block-FP8 releases run (`activation_scheme: dynamic`) and as
    llm-compressor's FP8_DYNAMIC / FP8_BLOCK presets write: per token for tensor/channel weights, per
    1 x b1 group for block weights. This is what selects vLLM's W8A8 FP8 kernels."""
    block = layout.strategy == "block"
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group" if block else "token",
            "group_size": layout.block[1] if block else None, "dynamic": True, "actorder": None,
            "block_structure": None, "observer": None, "observer_kwargs": {}}


# W4AFP8 (compressed-tensors' W4AFP8 preset): INT4 group-128 symmetric weights with dynamic per-token FP8
# activations. vLLM 0.33.0 runs it for MoE on Hopper (CompressedTensorsW4A8Fp8MoEMethod; docs/engine.md W1-W4).
W4AFP8_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "group_size": None,
                      "dynamic": True, "actorder": None, "block_structure": None, "observer": None,
                      "observer_kwargs": {}}
W4AFP8_GROUP_SIZE = 128


def is_w4afp8(w: dict | None, acts: dict | None) -> bool:
    """Weight and input-activation args that vLLM 0.33.0 reads as W4AFP8 (compressed_tensors.py
    `_is_fp8_w4a8`): 4-bit int group weights, static, symmetric; 8-bit float per-token dynamic symmetric
    activations."""
    if not isinstance(w, dict) or not isinstance(acts, dict):
        return False
    return (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") == "group"
            and not w.get("dynamic") and w.get("symmetric", True) is not False
            and acts.get("num_bits") == 8 and acts.get("type") == "float" and acts.get("strategy") == "token"
            and bool(acts.get("dynamic")) and acts.get("symmetric", True) is not False)


# NVFP4 W4A4 (compressed-tensors' NVFP4 preset): NVFP4 weights and NVFP4 input activations, quantized when the
# engine runs them: per 16 values an FP8 e4m3 scale computed on the fly ("local" dynamic), under one static FP32
# global scale per module stored as `input_global_scale` (= 448 * 6 / the calibrated input amax). vLLM 0.33.0
# runs it for MoE through CompressedTensorsW4A4Nvfp4MoEMethod (docs/engine.md, rules A1-A4).
NVFP4_ACTIVATIONS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                     "dynamic": "local", "actorder": None, "block_structure": None, "observer": "static_minmax",
                     "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn"}


def is_nvfp4_args(a: dict | None) -> bool:
    """Args vLLM 0.33.0 reads as NVFP4 (compressed_tensors.py `_is_nvfp4_format`): 4-bit float, strategy
    tensor_group, group_size 16, symmetric."""
    return (isinstance(a, dict) and a.get("num_bits") == 4 and a.get("type") == "float"
            and a.get("strategy") == "tensor_group" and a.get("group_size") == 16 and a.get("symmetric", True) is not False)


def is_nvfp4_w4a4(w: dict | None, acts: dict | None) -> bool:
    """NVFP4 weights with NVFP4 input activations whose block scales are dynamic and whose global scale is
    static (`dynamic: local`): the W4A4 form that stores an `input_global_scale` per module."""
    return is_nvfp4_args(w) and is_nvfp4_args(acts) and str(acts.get("dynamic")).lower() == "local"


def weights_label(w: dict, acts: dict | None = None) -> str:
    """The manifest's scheme label of compressed-tensors weight args (and input activations), e.g.
    int4-g32-sym, int4-channel-asym, fp8-block128x128, fp8-channel; W4AFP8: int4-g128-sym-afp8; NVFP4 W4A4:
    nvfp4-g16-a4."""
    if is_w4afp8(w, acts):
        return f"{weights_label(w)}-afp8"
    if is_nvfp4_w4a4(w, acts):
        return f"{weights_label(w)}-a4"
    if w.get("type") == "float" and w.get("num_bits") == 4:
        kind = "nvfp4" if w.get("strategy") == "tensor_group" else "mxfp4"
        return f"{kind}-g{w.get('group_size')}"
    if w.get("type") == "float":
        bs = w.get("block_structure")
        return f"fp8-{w.get('strategy')}" + (f"{bs[0]}x{bs[1]}" if bs else "")
    part = f"g{w.get('group_size')}" if w.get("strategy") == "group" else str(w.get("strategy"))
    return f"int{w.get('num_bits')}-{part}-{'sym' if w.get('symmetric', True) else 'asym'}"


def scheme_label(scheme) -> str:
    return weights_label(weights_config(scheme), scheme_config(scheme)["input_activations"])


def scheme_config(scheme) -> dict:
    """format + compressed-tensors args of a scheme convert applies (FP8: dynamic FP8 activations)."""
    if getattr(scheme, "fp4", None):
        acts = dict(NVFP4_ACTIVATIONS) if getattr(scheme, "activations", None) == "nvfp4" else None
        return {"format": scheme.format, "weights": weights_config(scheme), "input_activations": acts}
    if scheme.type == "float":
        layout = FP8Layout(scheme.strategy, scheme.block_structure)
        return {"format": "float-quantized", "weights": fp8_weights_config(layout),
                "input_activations": fp8_input_activations(layout)}
    acts = dict(W4AFP8_ACTIVATIONS) if getattr(scheme, "activations", None) == "fp8" else None
    return {"format": "pack-quantized", "weights": weights_config(scheme), "input_activations": acts}


def _patterns(modules: list[str]) -> dict[str, list[str]]:
    """`re:` patterns standing for `modules`: indices become \\d+, names differing only in their last
    segment share one alternation, e.g. re:model\\.layers\\.\\d+\\.self_attn\\.(o_proj|q_proj)$."""
    members: dict[str, list[str]] = {}
    lasts: dict[str, set[str]] = {}
    for m in modules:
        parts = m.split(".")
        prefix = r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts[:-1])
        members.setdefault(prefix, []).append(m)
        lasts.setdefault(prefix, set()).add(parts[-1])
    out = {}
    for prefix in sorted(members):
        last = sorted(lasts[prefix])
        alt = re.escape(last[0]) if len(last) == 1 else "(" + "|".join(map(re.escape, last)) + ")"
        pat = (prefix + r"\." if prefix else "") + alt + "$"
        if not any(is_routed_expert(m) for m in members[prefix]):
            # transformers 5 picks the experts' config group as the one whose re: targets contain
            # "experts"; shared experts must not look like that. expert[s] is the same regex.
            pat = pat.replace(EXPERTS, EXPERTS[:-1] + "[s]")
        out["re:" + pat] = members[prefix]
    return out


def quantization_config(results: dict[str, dict], kv_scheme: dict | None, prefix: str = "") -> dict | None:
    """compressed-tensors config for what was written (None when nothing is quantized).

    INT4 only (the Kimi-K2-Thinking style, the most widely loadable): the most used scheme targets
    ["Linear"]; any other scheme (e.g. a group-size fallback) gets a group of exact module names, which
    compressed-tensors matches before class names. With FP8 groups: top-level "mixed-precision" (a
    `format` per group) when formats differ; each format's most used scheme targets `re:` patterns of its
    modules (the INT4 expert group first: transformers takes its expert scheme from the first group whose
    re: targets mention "experts", its dense scheme from the first that does not), other schemes exact
    names. Every 2-D weight left unquantized is listed in `ignore`, which wins over every target.

    A wrapped text model (`prefix`, e.g. Kimi K2.5's "language_model.") gets its names written without the
    wrapper's layout (`_unwrapped`): engines and transformers name the same modules differently."""
    by_label: dict[str, list[str]] = {}
    configs: dict[str, dict] = {}
    kept = set()
    for rec in results.values():
        configs.update(rec.get("schemes") or {})
        for name, e in rec["tensors"].items():
            if name.endswith(".weight_packed") or (name.endswith(".weight") and "scheme" in e):
                by_label.setdefault(e["scheme"], []).append(name.rsplit(".", 1)[0])
            elif name.endswith(".weight") and len(e["shape"]) == 2:
                kept.add(name[: -len(".weight")])
    if not by_label and kv_scheme is None:
        return None

    def group(label, targets, with_format):
        c = configs[label]
        g = {"targets": targets, "input_activations": c["input_activations"], "output_activations": None,
             "weights": c["weights"]}
        if with_format:
            g["format"] = c["format"]
        return g

    rank = lambda lb: (-len(by_label[lb]), lb)  # noqa: E731
    formats = sorted({configs[lb]["format"] for lb in by_label})
    groups = {}
    if not formats:  # KV scales only
        top = "dense"
    elif formats == ["pack-quantized"]:
        for i, label in enumerate(sorted(by_label, key=rank)):
            groups[f"group_{i}"] = group(label, ["Linear"] if i == 0 else sorted(by_label[label]), False)
        top = "pack-quantized"
    else:
        # packed 4-bit formats (INT4, NVFP4, MXFP4: the experts) first, then FP8 (the dense Linears)
        packed = sorted((lb for lb in by_label if configs[lb]["format"].endswith("pack-quantized")), key=rank)
        fp8 = sorted((lb for lb in by_label if not configs[lb]["format"].endswith("pack-quantized")), key=rank)
        mains = [lbs[0] for lbs in (packed, fp8) if lbs]
        rest = sorted((lb for lb in by_label if lb not in mains), key=rank)
        exact = {m for lb in rest for m in by_label[lb]}
        every = [m for lb in by_label for m in by_label[lb]] + sorted(kept)
        targets: dict[str, list[str]] = {}
        for lb in mains:
            mine = set(by_label[lb])
            targets[lb] = []
            for pat, members in _patterns(by_label[lb]).items():
                rx = re.compile(pat[3:])
                clash = [m for m in every if rx.match(m) and m not in mine and m not in exact and m not in kept]
                targets[lb] += sorted(members) if clash else [pat]  # a clash: name them instead
        mixed = len(formats) > 1
        for i, label in enumerate(mains + rest):
            groups[f"group_{i}"] = group(label, targets.get(label) or sorted(by_label[label]), mixed)
        top = "mixed-precision" if mixed else formats[0]
    ignore = sorted(kept)
    if prefix:
        # the wrapper's other parts (a vision tower, its projector) are copied as they are: one entry each
        # covers every module of theirs, including any the engine builds beyond the checkpoint's tensors
        others = sorted({n.split(".", 1)[0] for rec in results.values() for n in rec["tensors"]
                         if not n.startswith(prefix) and "." in n})
        ignore = sorted({_unwrapped(e, prefix) for e in ignore if not e.startswith(tuple(o + "." for o in others))}
                        | {rf"re:(?:.*\.)?{re.escape(o)}\..*" for o in others})
        for g in groups.values():
            g["targets"] = [t if t[:1].isupper() else _unwrapped(t, prefix) for t in g["targets"]]
    return {"quant_method": "compressed-tensors", "format": top,
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
            "kv_cache_scheme": kv_scheme}


def _unwrapped(entry: str, prefix: str) -> str:
    r"""A target or ignore entry of a wrapped model as a `re:` pattern that holds whatever the wrapper's
    modules are called: vLLM keeps the checkpoint's `language_model.model.layers.L...`, transformers' own
    Kimi K2.5 class names them `model.language_model.layers.L...`, so an exact name matches in one and
    misses in the other (and a missed ignore entry means an attention Linear quantized on load). The
    pattern keeps the module's own path from `layers.` (or `lm_head`, `embed_tokens`, a vision module)
    and lets anything precede it: `re:(?:.*\.)?layers\.0\.self_attn\.q_a_proj$`."""
    wrapped = re.escape(prefix) + r"model\."
    any_ = r"(?:.*\.)?"
    if entry.startswith("re:"):
        pat = entry[3:]
        for head in (wrapped, re.escape(prefix)):
            if pat.startswith(head):
                return "re:" + any_ + pat[len(head):]
        return entry
    tail = entry.removeprefix(prefix)
    tail = tail.removeprefix("model.") if entry.startswith(prefix) else tail
    return "re:" + any_ + re.escape(tail) + "$"




def targeting(module: str, groups, targets=lambda g: g.targets) -> list:
    """The config groups that target `module` at compressed-tensors' first matching precedence level: an
    exact module name, then a `re:` pattern (re.match), then a class name such as "Linear" (quantized
    modules are Linear layers). `targets(group)` gives a group's targets. More than one entry: ambiguous."""
    levels = (lambda t: t == module,
              lambda t: t.startswith("re:") and matches(t, module, ConfigError, TARGET_HINT),
              lambda t: not t.startswith("re:") and "." not in t and t[:1].isupper())
    for level in levels:
        hit = [g for g in groups if any(level(t) for t in targets(g))]
        if hit:
            return hit
    return []
