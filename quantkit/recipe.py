"""Recipes: which tensors get which quantization scheme, as validated frozen dataclasses.

A recipe is YAML (docs/recipes.md):

    name: int4-experts-rtn
    groups:
      experts:
        targets: ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"]
        method: rtn
        scheme: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
    ignore: ["re:.*mlp\\.gate$", "lm_head"]
    kv_cache: null        # {strategy: tensor|attn_head}  (FP8 KV scales)
    calibration: null     # {dataset, num_samples, seq_len}

Targets and ignore entries name *modules* (no `.weight` suffix) and follow compressed-tensors rules:
an exact module name, or `re:` + a regex applied with `re.match` (anchored at the start only).
Fused on-disk experts (`experts.gate_up_proj`) are matched under their per-expert names
(`experts.E.gate_proj`, `experts.E.up_proj`), because that is how they are written.
`ignore` wins over every group; among groups the first match wins.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import RecipeError

METHODS = ("rtn", "gptq", "awq")
STRATEGIES = ("group", "channel", "tensor", "block")


@dataclass(frozen=True)
class Scheme:
    """How one weight is quantized. `type: int` -> INT4/INT8 pack-quantized; `type: float` -> FP8."""

    num_bits: int = 4
    type: str = "int"
    symmetric: bool = True
    strategy: str = "group"
    group_size: int | None = 32
    block_structure: tuple[int, int] | None = None
    # Used when in_features % group_size != 0: "channel", or another group size (int), or None (error).
    fallback: str | int | None = None

    def __post_init__(self):
        if self.type not in ("int", "float"):
            raise RecipeError(f"scheme.type must be 'int' or 'float', got {self.type!r}")
        if self.strategy not in STRATEGIES:
            raise RecipeError(f"scheme.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.type == "int":
            if self.num_bits not in (4, 8):
                raise RecipeError(f"integer schemes support num_bits 4 or 8, got {self.num_bits}")
            if self.strategy == "group":
                if not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 8:
                    raise RecipeError(f"group_size must be a positive multiple of 8, got {self.group_size!r}")
            elif self.strategy == "channel":
                object.__setattr__(self, "group_size", None)
            else:
                raise RecipeError(f"integer schemes support strategy group or channel, got {self.strategy!r}")
        else:
            if self.num_bits != 8:
                raise RecipeError(f"float schemes are FP8 (num_bits 8), got {self.num_bits}")
            if not self.symmetric:
                raise RecipeError("FP8 schemes are symmetric")
            if self.strategy == "block":
                bs = tuple(self.block_structure or (128, 128))
                if len(bs) != 2 or any(not isinstance(b, int) or b <= 0 for b in bs):
                    raise RecipeError(f"block_structure must be two positive ints, got {self.block_structure!r}")
                object.__setattr__(self, "block_structure", bs)
            elif self.strategy in ("channel", "tensor"):
                object.__setattr__(self, "block_structure", None)
            else:
                raise RecipeError(f"FP8 schemes support strategy tensor, channel or block, got {self.strategy!r}")
            object.__setattr__(self, "group_size", None)
        fb = self.fallback
        if fb is not None and fb != "channel" and not (isinstance(fb, int) and fb > 0 and fb % 8 == 0):
            raise RecipeError(f"scheme.fallback must be 'channel' or a group size, got {fb!r}")

    def for_in_features(self, k: int) -> "Scheme":
        """The scheme actually applied to a weight with `k` input features (applies `fallback`)."""
        from .errors import GroupSizeError

        if self.type != "int" or self.strategy != "group" or k % self.group_size == 0:
            return self
        if self.fallback == "channel":
            return Scheme(self.num_bits, "int", self.symmetric, "channel", None)
        if isinstance(self.fallback, int) and k % self.fallback == 0:
            return Scheme(self.num_bits, "int", self.symmetric, "group", self.fallback)
        raise GroupSizeError(f"in_features {k} is not a multiple of group_size {self.group_size}"
                             + (f" nor of fallback {self.fallback}" if self.fallback else ""))

    def weights_config(self) -> dict[str, Any]:
        """compressed-tensors QuantizationArgs, minimal field set (older vLLM pins reject unknown keys)."""
        return {
            "num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
            "strategy": self.strategy, "group_size": self.group_size, "dynamic": False, "actorder": None,
            "block_structure": list(self.block_structure) if self.block_structure else None,
            "observer": "minmax", "observer_kwargs": {},
        }

    @property
    def format(self) -> str:
        return "pack-quantized" if self.type == "int" else "float-quantized"

    @property
    def label(self) -> str:
        if self.type == "float":
            return f"fp8-{self.strategy}" + (f"{self.block_structure[0]}x{self.block_structure[1]}" if self.block_structure else "")
        part = f"g{self.group_size}" if self.strategy == "group" else "channel"
        return f"int{self.num_bits}-{part}-{'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class WeightGroup:
    name: str
    targets: tuple[str, ...]
    scheme: Scheme
    method: str = "rtn"
    options: tuple[tuple[str, Any], ...] = ()  # method options (e.g. GPTQ damping), kept sorted

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)


@dataclass(frozen=True)
class KVCacheSpec:
    strategy: str = "tensor"  # tensor | attn_head

    def __post_init__(self):
        if self.strategy not in ("tensor", "attn_head"):
            raise RecipeError(f"kv_cache.strategy must be 'tensor' or 'attn_head', got {self.strategy!r}")

    def config(self) -> dict[str, Any]:
        return {"num_bits": 8, "type": "float", "strategy": self.strategy, "dynamic": False, "symmetric": True}


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str | None = None
    num_samples: int = 128
    seq_len: int = 512

    def __post_init__(self):
        if self.num_samples <= 0 or self.seq_len <= 0:
            raise RecipeError("calibration.num_samples and seq_len must be positive")


@dataclass(frozen=True)
class Recipe:
    name: str
    groups: tuple[WeightGroup, ...]
    ignore: tuple[str, ...] = ()
    kv_cache: KVCacheSpec | None = None
    calibration: CalibrationSpec | None = None
    description: str = ""
    text: str = field(default="", compare=False, repr=False)  # the YAML as loaded (for the manifest)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def match(self, module: str) -> WeightGroup | None:
        """The group that quantizes `module` (a module name, no `.weight`), or None to keep it as is."""
        if any(matches(p, module) for p in self.ignore):
            return None
        for g in self.groups:
            if any(matches(p, module) for p in g.targets):
                return g
        return None

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache is not None or any(g.method != "rtn" for g in self.groups)


_RE_CACHE: dict[str, re.Pattern] = {}


def matches(pattern: str, name: str) -> bool:
    """compressed-tensors target rule: exact name, or `re:<regex>` with re.match."""
    if pattern.startswith("re:"):
        rx = _RE_CACHE.get(pattern)
        if rx is None:
            rx = _RE_CACHE[pattern] = re.compile(pattern[3:])
        return rx.match(name) is not None
    return pattern == name


# ---- loading ---------------------------------------------------------------------------------------
def shipped_recipes() -> list[str]:
    root = resources.files("quantkit") / "data" / "recipes"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe from a YAML path, or the name of a shipped recipe (e.g. `int4-experts-rtn`)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise RecipeError(f"recipe file {str(p)!r} does not exist")
        text = p.read_text(encoding="utf-8")
    else:
        res = resources.files("quantkit") / "data" / "recipes" / f"{name_or_path}.yaml"
        if not res.is_file():
            raise RecipeError(f"unknown recipe {str(name_or_path)!r}",
                              hint=f"shipped recipes: {', '.join(shipped_recipes())}; or pass a path to a YAML file")
        text = res.read_text(encoding="utf-8")
    return parse_recipe(text, default_name=p.stem)


def _check_keys(where: str, d: dict, allowed: set[str]):
    if not isinstance(d, dict):
        raise RecipeError(f"{where} must be a mapping, got {type(d).__name__}")
    extra = set(d) - allowed
    if extra:
        raise RecipeError(f"{where}: unknown key(s) {sorted(extra)}; allowed: {sorted(allowed)}")


def _str_list(where: str, v) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise RecipeError(f"{where} must be a list of module names or 're:' patterns")
    for x in v:
        if x.startswith("re:"):
            try:
                re.compile(x[3:])
            except re.error as e:
                raise RecipeError(f"{where}: bad regex {x!r}: {e}") from None
    return tuple(v)


def parse_recipe(text: str, default_name: str = "recipe") -> Recipe:
    try:
        d = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe is not valid YAML: {str(e).splitlines()[0]}") from None
    _check_keys("recipe", d, {"name", "description", "groups", "ignore", "kv_cache", "calibration", "version"})
    groups = []
    raw_groups = d.get("groups") or {}
    _check_keys("groups", raw_groups, set(raw_groups))
    scheme_keys = {f.name for f in fields(Scheme)}
    for gname, g in raw_groups.items():
        _check_keys(f"groups.{gname}", g, {"targets", "scheme", "method", "options"})
        if "targets" not in g:
            raise RecipeError(f"groups.{gname}: 'targets' is required")
        method = g.get("method", "rtn")
        if method not in METHODS:
            raise RecipeError(f"groups.{gname}.method must be one of {METHODS}, got {method!r}")
        sd = g.get("scheme") or {}
        _check_keys(f"groups.{gname}.scheme", sd, scheme_keys)
        if "block_structure" in sd and sd["block_structure"] is not None:
            sd = {**sd, "block_structure": tuple(sd["block_structure"])}
        try:
            scheme = Scheme(**sd)
        except RecipeError as e:
            raise RecipeError(f"groups.{gname}.{e.message}") from None
        except TypeError as e:
            raise RecipeError(f"groups.{gname}.scheme: {e}") from None
        if method != "rtn" and scheme.type != "int":
            raise RecipeError(f"groups.{gname}: method {method} applies to integer schemes only")
        opts = g.get("options") or {}
        _check_keys(f"groups.{gname}.options", opts, set(opts))
        groups.append(WeightGroup(str(gname), _str_list(f"groups.{gname}.targets", g["targets"]), scheme,
                                  method, tuple(sorted(opts.items()))))
    if not groups and not d.get("kv_cache"):
        raise RecipeError("recipe has no groups and no kv_cache section: it would do nothing")
    kv = d.get("kv_cache")
    if kv is not None:
        _check_keys("kv_cache", kv, {"strategy"})
        kv = KVCacheSpec(**kv)
    cal = d.get("calibration")
    if cal is not None:
        _check_keys("calibration", cal, {"dataset", "num_samples", "seq_len"})
        cal = CalibrationSpec(**cal)
    return Recipe(name=str(d.get("name") or default_name), groups=tuple(groups),
                  ignore=_str_list("ignore", d.get("ignore") or []), kv_cache=kv, calibration=cal,
                  description=str(d.get("description", "")), text=text)
