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

Recipes may come from strangers, so loading is bounded (docs/recipes.md, "Limits"): at most
MAX_RECIPE_BYTES of UTF-8, YAML nested at most MAX_YAML_DEPTH deep, and every `re:` pattern passes
`check_regex` (no quantifier or alternation inside an unbounded repeat, at most MAX_UNBOUNDED unbounded
repeats) so that matching one name costs at most a cubic number of steps in its length; names longer
than MAX_MATCH_NAME characters are not matched against patterns (a RecipeError).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from collections.abc import Callable
from typing import Any

import yaml

from .. import options
from ..errors import RecipeError
from ..pack.kv import STRATEGIES as KV_STRATEGIES
from ..pack.kv import kv_cache_scheme
from ..arch.layout import FUSED_LINEARS
from ..pack.scheme import Scheme
from ..quant.rotate import RotationSpec
from ..read.files import read_text
from ..pack.targets import (MAX_CHOICES, MAX_MATCH_NAME, MAX_PATTERN_CHARS, MAX_UNBOUNDED,  # noqa: F401
                            check_regex, matches)

METHODS = ("rtn", "gptq", "awq")


# Linears that engines run as one (arch.layout.FUSED_LINEARS): a block-FP8 fused Linear needs every part but
# the last to fill whole blocks of rows (vLLM refuses it at build time otherwise) and takes one scheme for all
# parts (the first part's).


def fused_rows_ok(module: str, rows_of: Callable[[str], int | None], block_rows: int) -> bool:
    """False when `module` is a part of a fused Linear (FUSED_LINEARS) whose parts but the last do not all
    have a multiple of `block_rows` output rows: then every part of it must leave block FP8 alike.
    `rows_of(module)` gives a module's output rows, None when the checkpoint has no such module."""
    base, _, last = module.rpartition(".")
    for parts, _fused in FUSED_LINEARS:
        if last in parts:
            rows = [r for r in (rows_of(f"{base}.{p}" if base else p) for p in parts) if r is not None]
            return all(r % block_rows == 0 for r in rows[:-1])
    return True


@dataclass(frozen=True)
class RTNOptions:
    """Round-to-nearest takes no options."""


@dataclass(frozen=True)
class _Calibrated:
    """Options every calibrated method shares: expert coverage (docs/calibration.md). An expert that
    received fewer than `min_tokens` routed tokens (None: 0.5% of the layer's tokens, at least 1) takes
    statistics from all of the layer's tokens (`fallback: all_tokens`) or is quantized with RTN
    (`fallback: rtn`); `stats: all` uses all tokens for every expert; GPTQ's `stats: affinity` weights every
    token by the router's affinity for the expert (see GPTQOptions)."""

    min_tokens: int | None = None
    fallback: str = "all_tokens"
    stats: str = "routed"
    sample_tokens: int = 4096  # tokens per MoE layer kept as samples (AWQ searches, fallback statistics)

    def __post_init__(self):
        if self.fallback not in ("all_tokens", "rtn"):
            raise RecipeError(f"options.fallback must be all_tokens or rtn, got {self.fallback!r}")
        if self.stats not in ("routed", "all", "affinity"):
            raise RecipeError(f"options.stats must be routed, all or affinity, got {self.stats!r}")


@dataclass(frozen=True)
class GPTQOptions(_Calibrated):
    """GPTQ (quant/gptq.py): damping as a fraction of the mean Hessian diagonal; static act-order
    (columns by descending Hessian diagonal, group parameters fixed up front: no g_idx is written);
    lazy-update block size; `holdout` k: every k-th token routed to an expert is held out of its Hessian, and
    each expert module keeps GPTQ's result only where its output error on those tokens is no larger than
    RTN's (0: off, every token in the Hessian and no check). `stats: affinity`: each expert's Hessians sum
    x x^T over the tokens among the router's `affinity_top_k` preferred experts for it (an integer, or "nk":
    n times the router's top-k; null: every token; `affinity_experts`), weighted by the router's affinity
    (softmax, or sigmoid for noaux_tc routers), the forward still following the router's top-k
    (calib/hessians.py); the routed tokens held out stay out. `refit_scales` (INT4): after the sweep each
    row's group scales are the least-squares ones for its codes (and zero points) under the damped Hessian
    (quant/gptq.py refit_scales); `refine_sweeps` n (INT4): then n coordinate-descent sweeps over
    the codes under those scales (quant/gptq.py refine_codes). `balance_tokens` n (routed experts): every
    expert that the calibration samples route fewer than n tokens to is topped up from a pool of
    `balance_pool` further samples of the same dataset (null: as many as the calibration's), forwarded
    after them: the pool's tokens enter an expert's statistics, in order, until it has n routed tokens
    (calib/hessians.py); nothing else sees the pool. `fit_unquantized` a in (0, 1] (routed experts):
    each expert is fitted to what the unquantized model computes for the same tokens, not to its own
    weights on the quantized model's inputs: GPTQ of W + a W (A - H) H_damped^-1 under H, A the cross-Gram of
    the unquantized model's inputs with the quantized model's, down_proj's statistics taken after gate/up
    are quantized (asymmetric calibration, docs/calibration.md); 0: off. `fit_down` a in (0, 1] (routed
    experts): each expert's down_proj alone is fitted to what the unquantized gate/up give it for the same
    inputs: GPTQ of W + a W (A - H) H_damped^-1 with H the Gram of the quantized gate/up's outputs and A their
    cross-Gram with the unquantized gate/up's, so down_proj undoes part of its expert's gate/up error; no
    second stream is carried (docs/calibration.md); 0: off. fit_unquantized already fits down_proj (to the
    unquantized model's own down inputs), so the two are not combined."""

    damp: float = 0.01
    actorder: bool = False
    block_size: int = 128
    holdout: int = 8
    observer: str = "minmax"  # or "mse": each group's scale searched against the Hessian-weighted error (INT4, FP4)
    affinity_top_k: int | str | None = None  # experts per token, or "nk": n times the router's top-k
    refit_scales: bool = False  # INT4: each row's group scales refitted to its codes after the sweep
    refine_sweeps: int = 0  # INT4: coordinate-descent sweeps over the codes after the solve (0: none)
    balance_tokens: int | None = None  # routed experts: top up every expert to this many routed tokens
    balance_pool: int | None = None  # samples in the top-up pool (null: the calibration's num_samples)
    fit_unquantized: float = 0.0  # routed experts: weight of the correction toward the unquantized model's outputs
    fit_down: float = 0.0  # routed experts: weight of down_proj's correction toward the unquantized gate/up's outputs

    def __post_init__(self):
        super().__post_init__()
        for key in _FIT_OPTIONS:
            a = getattr(self, key)
            if not 0.0 <= a <= 1.0:  # NaN too
                raise RecipeError(f"options.{key} must be a number in [0, 1] (0: off), got {a!r}")
        if self.fit_unquantized and self.fit_down:
            raise RecipeError("options.fit_unquantized and options.fit_down cannot be combined (fit_unquantized "
                              "already fits down_proj, to the unquantized model's own down inputs)")
        if self.fit_unquantized and self.balance_tokens is not None:
            raise RecipeError("options.fit_unquantized and options.balance_tokens cannot be combined (the top-up pool "
                              "has no unquantized-model stream)")
        if self.refine_sweeps < 0 or self.refine_sweeps > 8:
            raise RecipeError(f"options.refine_sweeps must be 0 to 8, got {self.refine_sweeps!r}")
        if self.observer not in ("minmax", "mse"):
            raise RecipeError(f"options.observer must be minmax or mse, got {self.observer!r}")
        if self.holdout < 0 or self.holdout == 1:
            raise RecipeError(f"options.holdout must be 0 (off) or at least 2, got {self.holdout!r}")
        if self.balance_pool is not None and self.balance_tokens is None:
            raise RecipeError("options.balance_pool sizes the pool of balance_tokens, which is not set")
        k = self.affinity_top_k
        if k is not None and (isinstance(k, bool) or not (isinstance(k, int) and k > 0 or isinstance(k, str)
                                                          and _AFFINITY_K.fullmatch(k))):
            raise RecipeError(f"options.affinity_top_k must be a positive integer or \"nk\" (n times the router's "
                              f"top-k, e.g. 2k), got {k!r}")
        if k is not None and self.stats != "affinity":
            raise RecipeError(f"options.affinity_top_k applies to stats: affinity (stats is {self.stats!r})")


@dataclass(frozen=True)
class AWQOptions(_Calibrated):
    """AWQ (quant/awq.py): grid points of the scale search, clipping search, per-expert up -> down scales."""

    n_grid: int = 20
    grid_stride: int = 2
    clip: bool = True
    scale_down: bool = True
    sample_tokens: int = 8192

    def __post_init__(self):
        super().__post_init__()
        if self.stats == "affinity":
            raise RecipeError("options.stats: affinity weights GPTQ's Hessians; AWQ takes routed or all")


_FIT_OPTIONS = ("fit_unquantized", "fit_down")  # floats in [0, 1], 0 meaning off
_AFFINITY_K = re.compile(r"[1-9][0-9]{0,5}k")  # n up to 999999: a bounded integer


def affinity_experts(affinity_top_k: int | str | None, top_k: int, num_experts: int) -> int:
    """How many experts each token's row goes to under `stats: affinity`: `affinity_top_k` experts (an
    integer), n times the router's `top_k` ("nk"), or every expert (None); at most `num_experts`."""
    if affinity_top_k is None:
        return num_experts
    if isinstance(affinity_top_k, str):
        return min(num_experts, int(affinity_top_k[:-1]) * top_k)
    return min(num_experts, affinity_top_k)


OPTIONS = {"rtn": RTNOptions, "gptq": GPTQOptions, "awq": AWQOptions}
_POSITIVE = ("block_size", "sample_tokens", "n_grid", "grid_stride", "min_tokens", "balance_tokens",
             "balance_pool")
# integer options past these are no setting anyone means (n_grid: scale candidates AWQ evaluates one by one)
_INT_MAX = {"n_grid": 1000, "balance_pool": options.MAX_NUM_SAMPLES}
_INT_MAX_DEFAULT = 1 << 31


def parse_options(method: str, raw: dict, where: str):
    """The typed options of `method` from a recipe's `options` mapping (unknown keys and wrong types are
    RecipeErrors naming the key)."""
    cls = OPTIONS[method]
    known = {f.name: f for f in fields(cls)}
    _check_keys(where, raw, set(known))
    for key, v in raw.items():
        want = known[key].type
        if "bool" in want and not isinstance(v, bool):
            raise RecipeError(f"{where}.{key} must be true or false, got {v!r}")
        # an integer field that also takes a string (affinity_top_k: 16 or "2k") is checked by its dataclass
        if "int" in want and "bool" not in want and "str" not in want and (v is not None or "None" not in want) and (
                isinstance(v, bool) or not isinstance(v, int) or (key in _POSITIVE and v <= 0)):
            raise RecipeError(f"{where}.{key} must be a positive integer, got {v!r}")
        top = _INT_MAX.get(key, _INT_MAX_DEFAULT)
        if isinstance(v, int) and not isinstance(v, bool) and v > top:
            raise RecipeError(f"{where}.{key} must be at most {top}, got {str(v)[:40]}")
        if key in _FIT_OPTIONS and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise RecipeError(f"{where}.{key} must be a number in [0, 1] (0: off), got {v!r}")
        if key not in _FIT_OPTIONS and want == "float" and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1):
            raise RecipeError(f"{where}.{key} must be a number in (0, 1), got {v!r}")
        if want == "str" and not isinstance(v, str):
            raise RecipeError(f"{where}.{key} must be a string, got {v!r}")
    try:
        return cls(**{k: (float(v) if known[k].type == "float" else v) for k, v in raw.items()})
    except RecipeError as e:
        raise RecipeError(f"{where.rsplit('.', 1)[0]}.{e.message}") from None


@dataclass(frozen=True)
class WeightGroup:
    name: str
    targets: tuple[str, ...]
    scheme: Scheme
    method: str = "rtn"
    options: RTNOptions | GPTQOptions | AWQOptions = None  # typed, validated on load; None: the method's defaults

    def __post_init__(self):
        if self.options is None:
            object.__setattr__(self, "options", OPTIONS[self.method]())


@dataclass(frozen=True)
class KVCacheSpec:
    strategy: str = "tensor"  # tensor | attn_head (pack/kv.py)

    def __post_init__(self):
        if self.strategy not in KV_STRATEGIES:
            raise RecipeError(f"kv_cache.strategy must be 'tensor' or 'attn_head', got {self.strategy!r}")

    def config(self) -> dict[str, Any]:
        return kv_cache_scheme(self.strategy)


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str | None = None
    num_samples: int = options.NUM_SAMPLES
    seq_len: int = options.SEQ_LEN

    def __post_init__(self):
        for key, top in (("num_samples", options.MAX_NUM_SAMPLES), ("seq_len", options.MAX_SEQ_LEN)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= top:
                raise RecipeError(f"calibration.{key} must be an integer from 1 to {top}, got {str(v)[:40]}")
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise RecipeError(f"calibration.dataset must be a path or a hub dataset id, got {str(self.dataset)[:40]}")


@dataclass(frozen=True)
class Recipe:
    name: str
    groups: tuple[WeightGroup, ...]
    ignore: tuple[str, ...] = ()
    kv_cache: KVCacheSpec | None = None
    calibration: CalibrationSpec | None = None
    description: str = ""
    rotate: RotationSpec | None = None  # the residual rotation fused into the weights (quant/rotate.py)
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
    def needs_calibrated_pass(self) -> bool:
        """Some group quantizes with calibration data (GPTQ/AWQ), or needs calibrated input scales (NVFP4
        W4A4, whatever its method), layer by layer before streaming."""
        return any(g.method != "rtn" or g.scheme.w4a4 for g in self.groups)

    def balance_pool(self, num_samples: int) -> int:
        """Samples of the top-up pool the calibrated pass forwards after `num_samples` calibration samples
        (GPTQOptions.balance_tokens; 0: none)."""
        return max((g.options.balance_pool or num_samples for g in self.groups
                    if g.method == "gptq" and g.options.balance_tokens is not None), default=0)

    @property
    def needs_calibration(self) -> bool:
        """Calibration data is needed at all: a calibrated pass, or KV-cache scales."""
        return self.kv_cache is not None or self.needs_calibrated_pass


def check_prefill_recipe(recipe: Recipe) -> Recipe:
    """The rule for the prefill half of a prefill/decode pair (`convert --pair`, `plan --pair`): the prefill
    pool serves FP8 weights, so a recipe with no FP8 weight group is refused (RecipeError); returns `recipe`."""
    if not any(g.scheme.type == "float" and g.scheme.num_bits == 8 for g in recipe.groups):
        raise RecipeError(f"the pair's prefill recipe {recipe.name[:60]!r} has no FP8 weight group",
                          hint="use --pair fp8-prefill (FP8 weights for the prefill pool)")
    return recipe


MAX_RECIPE_BYTES = 256 << 10  # recipes are a few KB; larger files are refused before YAML parses them
MAX_YAML_DEPTH = 64  # nesting of YAML collections (a recipe needs 5)


def _short(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


# ---- loading ---------------------------------------------------------------------------------------
def shipped_recipes() -> list[str]:
    root = resources.files("quantkit") / "data" / "recipes"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe from a YAML path, or the name of a shipped recipe (e.g. `int4-experts-rtn`)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not os.path.lexists(p):
            raise RecipeError(f"recipe file {_short(str(p))} does not exist")
        # a regular file of at most MAX_RECIPE_BYTES (a FIFO or /dev/zero refused, a 100 MB file never read)
        text = read_text(p, "recipe file", RecipeError, MAX_RECIPE_BYTES,
                         hint="recipes are a few KB of UTF-8 YAML; see docs/recipes.md")
    else:
        res = resources.files("quantkit") / "data" / "recipes" / f"{name_or_path}.yaml"
        if not res.is_file():
            raise RecipeError(f"unknown recipe {str(name_or_path)!r}",
                              hint=f"shipped recipes: {', '.join(shipped_recipes())}; or pass a path to a YAML file")
        text = res.read_text(encoding="utf-8")
    return parse_recipe(text, default_name=p.stem)


_GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
                check_regex(x[3:])
                re.compile(x[3:])
            except (ValueError, re.error) as e:  # re.error is a ValueError
                raise RecipeError(f"{where}: bad regex {_short(x)}: {str(e)[:120]}",
                                  hint="docs/recipes.md, Limits: no quantifier or | inside a repeated group; at most "
                                       f"{MAX_UNBOUNDED} unbounded repeats per pattern") from None
    return tuple(v)


class _BoundedLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing collections nested deeper than MAX_YAML_DEPTH as they are composed
    (a 100,000-deep `[[[...` would otherwise recurse until RecursionError, ~10 s)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise RecipeError(f"recipe YAML is nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        """A key given twice in one mapping is an error (YAML says keys are unique; PyYAML keeps the last one,
        so `method: rtn` then `method: gptq` silently ran GPTQ)."""
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class names it
                    break
                if dup:
                    raise RecipeError(f"recipe YAML gives the key {_short(str(key))} twice in one mapping "
                                      f"(line {key_node.start_mark.line + 1})")
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str):
    """A recipe's YAML as data: size and depth bounded, a safe loader; RecipeError naming what is wrong."""
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe is {len(text)} characters, over the {MAX_RECIPE_BYTES} limit")
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise RecipeError("recipe YAML is nested too deeply") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe is not valid YAML: {str(e).splitlines()[0]}") from None


def fit_record(text: str) -> dict | None:
    """The `fit` mapping of a recipe's YAML (what `plan --fit` chose and why), read as recipes are; None when the
    text has none or is not a recipe."""
    if not isinstance(text, str):
        return None
    try:
        d = _load_yaml(text)
    except RecipeError:
        return None
    fit = d.get("fit") if isinstance(d, dict) else None
    return fit if isinstance(fit, dict) else None


def parse_recipe(text: str, default_name: str = "recipe") -> Recipe:
    d = _load_yaml(text)
    _check_keys("recipe", d, {"name", "description", "groups", "ignore", "kv_cache", "calibration", "version",
                                 "rotate", "fit"})
    if d.get("fit") is not None and not isinstance(d["fit"], dict):  # `plan --fit`'s record: kept, not used
        raise RecipeError(f"recipe fit must be a mapping (what plan --fit chose and why), got {type(d['fit']).__name__}")
    for key in ("name", "description"):  # both go into the manifest and the model card
        if d.get(key) is not None and not isinstance(d[key], str):
            raise RecipeError(f"recipe {key} must be a string, got {type(d[key]).__name__}")
    groups = []
    raw_groups = d.get("groups") or {}
    _check_keys("groups", raw_groups, set(raw_groups) if isinstance(raw_groups, dict) else set())
    scheme_keys = {f.name for f in fields(Scheme)}
    for gname, g in raw_groups.items():
        # a group's name goes into every message about it, the manifest and config.json's group names
        if not isinstance(gname, str) or not _GROUP_NAME.fullmatch(gname):
            raise RecipeError(f"groups: a group name must be 1-64 letters, digits, '_', '-' or '.', got "
                              f"{_short(repr(gname))}")
        _check_keys(f"groups.{gname}", g, {"targets", "scheme", "method", "options"})
        if "targets" not in g:
            raise RecipeError(f"groups.{gname}: 'targets' is required")
        method = g.get("method", "rtn")
        if method not in METHODS:
            raise RecipeError(f"groups.{gname}.method must be one of {METHODS}, got {method!r}")
        sd = g.get("scheme") or {}
        _check_keys(f"groups.{gname}.scheme", sd, scheme_keys)
        if "block_structure" in sd and sd["block_structure"] is not None:
            if not isinstance(sd["block_structure"], list):
                raise RecipeError(f"groups.{gname}.block_structure must be two positive ints, got "
                                  f"{str(sd['block_structure'])[:40]}")
            sd = {**sd, "block_structure": tuple(sd["block_structure"])}
        try:
            scheme = Scheme(**sd)
        except RecipeError as e:
            raise RecipeError(f"groups.{gname}.{e.message}") from None
        except TypeError as e:
            raise RecipeError(f"groups.{gname}.scheme: {e}") from None
        if sd.get("block_structure") is not None and scheme.strategy != "block":  # would reach config.json
            raise RecipeError(f"groups.{gname}.scheme.block_structure applies to FP8 block schemes (strategy block)")
        if sd.get("group_size") is not None and scheme.group_size is None:
            raise RecipeError(f"groups.{gname}.scheme.group_size applies to group schemes, not strategy "
                              f"{scheme.strategy}")
        if method == "awq" and scheme.type != "int":
            raise RecipeError(f"groups.{gname}: method awq applies to INT4 schemes only")
        if method == "gptq" and scheme.type != "int" and not scheme.fp4:
            raise RecipeError(f"groups.{gname}: method gptq applies to INT4 and FP4 schemes")
        if scheme.scale_search == "mse" and method != "rtn":  # the calibrated methods choose their own scales
            raise RecipeError(f"groups.{gname}.scheme.scale_search: mse is RTN's scale search; method {method} "
                              "would ignore it",
                              hint="drop scale_search (GPTQ searches with options.observer: mse; AWQ with its "
                                   "clipping grid), or use method rtn")
        opts = parse_options(method, {} if g.get("options") is None else g["options"], f"groups.{gname}.options")
        for key in ("refit_scales", "refine_sweeps"):
            if getattr(opts, key, False) and scheme.type != "int":
                raise RecipeError(f"groups.{gname}.options.{key} applies to INT4 schemes "
                                  f"(the scales of FP4 grids are fixed before the solve)")
        groups.append(WeightGroup(str(gname), _str_list(f"groups.{gname}.targets", g["targets"]), scheme,
                                  method, opts))
    rotate = d.get("rotate")
    if rotate is not None:  # rotate: {kind: hadamard, seed: 0}
        _check_keys("rotate", rotate, {"kind", "seed", "block"})
        rotate = RotationSpec(**rotate)
    if not groups and not d.get("kv_cache") and rotate is None:
        raise RecipeError("recipe has no groups, no kv_cache and no rotate section: it would do nothing")
    balanced = [g.name for g in groups if g.method == "gptq" and g.options.balance_tokens is not None]
    others = [g.name for g in groups if g.name not in balanced and (g.method != "rtn" or g.scheme.w4a4)]
    if balanced and (others or len(balanced) > 1 or any(g.scheme.w4a4 for g in groups)):
        raise RecipeError(f"groups.{balanced[0]}.options.balance_tokens: the top-up pool is forwarded through "
                          f"every layer, and only one GPTQ group of routed experts may read it (calibrated "
                          f"here too: {', '.join(n for n in others + balanced[1:]) or 'W4A4 input scales'})",
                          hint="quantize the other groups with RTN, or drop balance_tokens")
    kv = d.get("kv_cache")
    if kv is not None:
        _check_keys("kv_cache", kv, {"strategy"})
        kv = KVCacheSpec(**kv)
    cal = d.get("calibration")
    if cal is not None:
        _check_keys("calibration", cal, {"dataset", "num_samples", "seq_len"})
        cal = CalibrationSpec(**cal)
    recipe = Recipe(name=str(d.get("name") or default_name), groups=tuple(groups),
                    ignore=_str_list("ignore", [] if d.get("ignore") is None else d["ignore"]), kv_cache=kv,
                    calibration=cal, description=d.get("description") or "", text=text, rotate=rotate)
    if cal is not None and not recipe.needs_calibration:  # it would be silently ignored
        raise RecipeError("recipe has a calibration section but calibrates nothing (RTN groups only, no kv_cache)",
                          hint="drop the calibration section, or add a GPTQ/AWQ group or a kv_cache section")
    return recipe
