"""`plan --fit`: the per-layer recipe of least predicted loss whose weights, KV cache and activation reserve fit.

The model is cut into *units*, two per decoder layer: the layer's routed experts (one scheme for all of them: vLLM's
fused MoE runs one per layer) and its dense Linears (attention, shared experts, a dense MLP). Each unit can take
one of a few *choices*, each a shipped recipe's group (`CHOICES`): kept as it is (BF16, or what an FP8 source
holds), FP8 e4m3 128x128 blocks, INT4 group 128 / group 32 GPTQ, NVFP4, MXFP4 (experts; the dense Linears keep or
go FP8, as the mission's provider served them). A unit's *bytes* under a choice are what `convert` writes for it
(plan/tensors.quantized_layout, exact); its *loss* is measured once (plan/sensitivity.py: the KL to the source when
that unit alone is quantized) or, without weights, a prior (`prior_loss`: the scheme's relative weight error on a
heavy-tailed matrix times the unit's parameters, the same for every layer). The predicted loss of a mix is the sum
of its units' losses (one-at-a-time KLs add up for small independent errors; bench/fit.py measures how well).

The budget is plan's own arithmetic (plan/__init__._serving): per GPU, the resident weights (MTP layers excluded)
split over tp, the KV cache of `concurrency` requests of `context_len` tokens in the chosen KV dtype, and the
activation reserve must fit the GPU; `weights_gib` caps the whole model's resident weights directly. The choice
is a multiple-choice knapsack, solved exactly over bytes rounded up to 1/`RESOLUTION` of the budget (so the mix
always fits), then held to plan's exact bytes of the written recipe (headers, KV scales) and re-solved tighter
when those tip it over.

Not done here: per-expert choices inside a layer (engines run one scheme per layer's experts), W4AFP8 and W4A4
choices (their activation rounding is not part of the measured loss), the KV dtype's own loss (the KV dtype is an
input: FP8 by default, with calibrated per-tensor scales)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import yaml

from ..arch import ModelSpec
from ..arch.layout import EXPERTS, ROLES, tensor_role
from ..errors import ConfigError, FitError
from ..match.recipe import Recipe, parse_recipe
from .tensors import TensorShapes, quantized_layout, tensor_bytes

GIB = 1 << 30
RESOLUTION = 20_000  # the knapsack's byte grid: budget / RESOLUTION per cell
KEEP = "keep"
ROUTED_KIND, DENSE_KIND = "routed", "dense"
# routed experts -> one unit per layer; shared experts, attention, dense MLP -> the layer's dense unit
_UNIT_ROLES = dict(zip(ROLES[:4], (ROUTED_KIND, DENSE_KIND, DENSE_KIND, DENSE_KIND)))
# the recipe whose `ignore` list the chosen recipe takes: router, shared-expert gate, DSA indexer, lm_head
IGNORE_FROM = "fp8-prefill"


@dataclass(frozen=True)
class Choice:
    """One candidate for a unit: the group `group` of shipped recipe `recipe` (its scheme, method and options)."""

    name: str
    kinds: tuple[str, ...]  # the unit kinds it may take
    recipe: str | None = None  # None: keep the unit as it is
    group: str | None = None
    why: str = ""
    bits: float = 16.0  # stored bits per weight, scales included (keep: BF16's; an FP8 source keeps 8)

    @property
    def keep(self) -> bool:
        return self.recipe is None


CHOICES: tuple[Choice, ...] = (
    Choice(KEEP, (ROUTED_KIND, DENSE_KIND), why="kept as the source holds it"),
    Choice("fp8-block", (ROUTED_KIND, DENSE_KIND), "fp8-prefill", "fp8", "FP8 e4m3, 128x128 block scales", 8.002),
    Choice("int4-g128-gptq", (ROUTED_KIND,), "int4-experts-gptq-g128", EXPERTS, "INT4 group 128, GPTQ", 4.125),
    Choice("int4-g32-gptq", (ROUTED_KIND,), "int4-experts-gptq", EXPERTS, "INT4 group 32, GPTQ", 4.5),
    Choice("nvfp4", (ROUTED_KIND,), "nvfp4-experts", EXPERTS, "NVFP4 (E2M1, FP8 scale per 16), RTN", 4.5),
    Choice("mxfp4", (ROUTED_KIND,), "mxfp4-experts", EXPERTS, "MXFP4 (E2M1, E8M0 scale per 32), RTN", 4.25),
)
CHOICE = {c.name: c for c in CHOICES}


def choices(names: Sequence[str] | None) -> tuple[Choice, ...]:
    """The candidates `names` (None: all), `keep` always among them; a ConfigError names an unknown one."""
    if names is None:
        return CHOICES
    unknown = [n for n in names if n not in CHOICE]
    if unknown:
        raise ConfigError(f"unknown fit scheme {unknown[0][:40]!r}", hint=f"choose among {', '.join(CHOICE)}")
    return tuple(c for c in CHOICES if c.keep or c.name in names)


@cache
def _shipped_group(recipe: str, group: str) -> dict[str, Any]:
    text = (resources.files("quantkit") / "data" / "recipes" / f"{recipe}.yaml").read_text()
    body = dict(yaml.safe_load(text)["groups"][group])
    body.pop("targets", None)
    return body


@cache
def _shipped_ignore(recipe: str) -> tuple[str, ...]:
    text = (resources.files("quantkit") / "data" / "recipes" / f"{recipe}.yaml").read_text()
    return tuple(yaml.safe_load(text).get("ignore") or ())


# ---- units ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    layer: int
    kind: str  # ROUTED_KIND | DENSE_KIND
    modules: tuple[str, ...]  # on-disk module names (no ".weight")

    @property
    def name(self) -> str:
        return f"layer {self.layer} {self.kind}"


def units(tensors: TensorShapes, spec: ModelSpec) -> list[Unit]:
    """The units of a checkpoint's tensors: per decoder layer (MTP layers excluded: not resident), its routed
    experts and its dense Linears, the shipped ignore list (routers, DSA indexer) left out."""
    ignore = parse_recipe(yaml.safe_dump({"name": "ignore", "ignore": list(_shipped_ignore(IGNORE_FROM)),
                                          "kv_cache": {"strategy": "tensor"}}))
    acc: dict[tuple[int, str], list[str]] = {}
    for name, (shape, _) in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2:
            continue
        kind = _UNIT_ROLES.get(tensor_role(name, spec.num_layers))
        layer = _layer(module)
        if kind is None or layer is None or layer >= spec.num_layers or any(
                _matches(p, module) for p in ignore.ignore):
            continue
        acc.setdefault((layer, kind), []).append(module)
    return [Unit(layer, kind, tuple(sorted(mods))) for (layer, kind), mods in sorted(acc.items())]


def _matches(pattern: str, module: str) -> bool:
    from ..match.recipe import matches

    return matches(pattern, module)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")


def _layer(module: str) -> int | None:
    m = _LAYER.search(module)
    return int(m[1]) if m else None


def targets(modules: Sequence[str], layers: Sequence[int]) -> list[str]:
    """Recipe targets (`re:` patterns) matching `modules` in exactly `layers`: each module name with its layer
    index replaced by the set of layers and an expert index by any index."""
    layer_set = "|".join(str(i) for i in sorted(set(layers)))
    escaped = re.escape(f".{EXPERTS}.")  # as it reads in an escaped name
    out: dict[str, None] = {}
    for m in modules:
        p = re.escape(m)
        p = re.sub(r"(^|\\\.)layers\\\.\d+\\\.", lambda g: f"{g[1]}layers\\.(?:{layer_set})\\.", p, count=1)
        p = re.sub(re.escape(escaped) + r"\d+\\\.", lambda g: escaped + r"\d+\.", p)
        out[f"re:^{p}$"] = None
    return list(out)


# ---- bytes ---------------------------------------------------------------------------------------------
class _Plain(yaml.SafeDumper):
    """A safe dumper that writes a shared scheme out again instead of as a YAML alias (*id001)."""

    def ignore_aliases(self, data):
        return True


def _recipe_text(name: str, groups: Mapping[str, tuple[Choice, list[str]]], kv: bool,
                 calibration: Mapping[str, Any] | None, description: str = "",
                 record: Mapping[str, Any] | None = None) -> str:
    doc: dict[str, Any] = {"name": name}
    if description:
        doc["description"] = description
    doc["groups"] = {g: {"targets": t, **_shipped_group(c.recipe, c.group)} for g, (c, t) in groups.items()}
    doc["ignore"] = list(_shipped_ignore(IGNORE_FROM))
    if kv:
        doc["kv_cache"] = {"strategy": "tensor"}
    if calibration and any(_shipped_group(c.recipe, c.group).get("method", "rtn") != "rtn"
                           for c, _ in groups.values()):
        doc["calibration"] = dict(calibration)
    text = yaml.dump(doc, Dumper=_Plain, sort_keys=False, width=1 << 16)
    if record:  # one unit a line: [layer, kind, choice, bytes, loss]
        text += yaml.dump({"fit": dict(record)}, Dumper=_Plain, sort_keys=False, width=1 << 16,
                          default_flow_style=None)
    return text


def uniform_recipe(choice: Choice, units_: Sequence[Unit], kv: bool = False,
                   calibration: Mapping[str, Any] | None = None) -> Recipe | None:
    """The recipe that gives every unit `choice` can take that choice (None for `keep`)."""
    if choice.keep:
        return None
    us = [u for u in units_ if u.kind in choice.kinds]
    if not us:
        return None
    mods = sorted({m for u in us for m in u.modules})
    text = _recipe_text(f"fit-uniform-{choice.name}", {choice.name: (choice, targets(mods, [u.layer for u in us]))},
                        kv, calibration)
    return parse_recipe(text)


def unit_bytes(tensors: TensorShapes, spec: ModelSpec, units_: Sequence[Unit], cands: Sequence[Choice]
               ) -> tuple[dict[tuple[int, str], dict[str, int]], int, dict[str, str]]:
    """({(layer, kind): {choice: bytes}}, the resident bytes outside every unit, {choice: why it was dropped}):
    bytes as `convert` writes them (quantized_layout). A choice whose uniform layout the model's shapes refuse is
    dropped with the reason."""
    owner = {m: (u.layer, u.kind) for u in units_ for m in u.modules}
    out: dict[tuple[int, str], dict[str, int]] = {(u.layer, u.kind): {} for u in units_}
    dropped: dict[str, str] = {}
    fixed = 0
    for c in cands:
        try:
            layout = quantized_layout(tensors, uniform_recipe(c, units_), spec=spec)
        except Exception as e:  # noqa: BLE001 - a scheme the shapes refuse is not a candidate
            dropped[c.name] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        acc: dict[tuple[int, str], int] = dict.fromkeys(out, 0)
        rest = 0
        for name, (shape, dtype) in layout.items():
            key = owner.get(name.rpartition(".")[0])
            if key is not None:
                acc[key] += tensor_bytes(shape, dtype)
            elif c.keep and tensor_role(name, spec.num_layers) != "mtp":
                rest += tensor_bytes(shape, dtype)
        for key, b in acc.items():
            if key[1] in c.kinds:
                out[key][c.name] = b
        if c.keep:
            fixed = rest
    return out, fixed, dropped


# ---- the knapsack --------------------------------------------------------------------------------------
def solve(options: Sequence[Mapping[str, tuple[int, float]]], budget: int) -> list[str] | None:
    """Multiple-choice knapsack: for each unit one choice from `options[i]` ({choice: (bytes, loss)}) so that the
    bytes sum to at most `budget` and the loss sum is least; None when even the smallest choices do not fit.
    Exact over bytes rounded up to budget / RESOLUTION (a solution always fits; it may miss a better one by one
    cell's worth of bytes per unit). Ties go to fewer bytes."""
    import numpy as np

    if budget < 0 or sum(min(b for b, _ in o.values()) for o in options) > budget:
        return None
    cell = max(1, math.ceil(budget / RESOLUTION))
    cells = budget // cell
    inf = float("inf")
    best = np.zeros(cells + 1)  # best[c]: least loss of the units so far in at most c cells
    picks: list[np.ndarray] = []
    for o in options:
        names = sorted(o, key=lambda n: (o[n][0], o[n][1], n))
        new = np.full(cells + 1, inf)
        pick = np.full(cells + 1, -1, dtype=np.int16)
        for j, n in enumerate(names):
            b, loss = o[n]
            w = math.ceil(b / cell)
            if w > cells:
                continue
            cand = np.full(cells + 1, inf)
            cand[w:] = best[: cells + 1 - w] + loss
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        picks.append((names, pick))
        best = new
    if not math.isfinite(best[cells]):
        return None
    out, c = [], cells
    for (names, pick), o in zip(reversed(picks), reversed(options)):
        n = names[pick[c]]
        out.append(n)
        c -= math.ceil(o[n][0] / cell)
    return out[::-1]


# ---- the result ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitUnit:
    layer: int
    kind: str
    choice: str
    bytes: int
    loss: float
    options: Mapping[str, tuple[int, float]]  # every candidate: (bytes, loss)
    modules: tuple[str, ...] = ()  # the unit's on-disk module names


@dataclass(frozen=True)
class FitResult:
    units: tuple[FitUnit, ...]
    budget_bytes: int  # resident weights allowed, whole model
    fixed_bytes: int  # resident bytes outside the units (embeddings, lm_head, norms, routers)
    weights_bytes: int  # the chosen recipe's resident bytes, exact (plan)
    predicted_loss: float
    loss_source: str  # "measured" | "prior"
    recipe_text: str
    uniform: tuple[dict[str, Any], ...]  # every uniform mix: bytes, predicted loss, fits
    arithmetic: tuple[str, ...]
    dropped: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "weights_bytes": self.weights_bytes,
                "fixed_bytes": self.fixed_bytes, "predicted_loss": self.predicted_loss,
                "loss_source": self.loss_source,
                "units": [{"layer": u.layer, "kind": u.kind, "choice": u.choice, "bytes": u.bytes, "loss": u.loss,
                           "options": {k: {"bytes": b, "loss": l} for k, (b, l) in u.options.items()}}
                          for u in self.units],
                "uniform": list(self.uniform), "arithmetic": list(self.arithmetic), "dropped": dict(self.dropped),
                "recipe": self.recipe_text}


def chosen_recipe_text(model: str, picks: Sequence[tuple[Unit, str, int, float]], kv: bool,
                       calibration: Mapping[str, Any] | None, header: Sequence[str],
                       record: Mapping[str, Any] | None = None) -> str:
    """The recipe YAML of a mix: one group per (kind, choice) with the layers that got it, the why in comments and
    in its `fit` mapping (`record` plus one [layer, kind, choice, bytes, loss] row per unit: what `quantkit
    report` draws)."""
    by: dict[tuple[str, str], list[Unit]] = {}
    for u, c, _, _ in picks:
        if not CHOICE[c].keep:
            by.setdefault((u.kind, c), []).append(u)
    groups = {f"{kind}-{c}": (CHOICE[c], targets(sorted({m for u in us for m in u.modules}), [u.layer for u in us]))
              for (kind, c), us in sorted(by.items())}
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")[:60] or "model"
    if not groups and not kv:
        raise FitError("the budget keeps every layer as it is and no FP8 KV cache was asked for: there is nothing "
                       "to convert", hint="the source already fits; serve it as it is")
    rec = None if record is None else {**record, "units": [[u.layer, u.kind, c, int(b), float(loss)]
                                                           for u, c, b, loss in picks]}
    body = _recipe_text(f"fit-{label}", groups, kv, calibration,
                        description="chosen by `quantkit plan --fit`: per layer, the scheme of least measured loss "
                                    "that fits the memory target (the comments say why)", record=rec)
    lines = [f"# {h}" for h in header]
    lines.append("# per unit: layer kind -> choice (bytes, predicted loss); the other candidates after it")
    for u, c, b, loss in picks:
        lines.append(f"#   layer {u.layer:>3} {u.kind:<7} -> {c:<15} {b / 2**20:9.2f} MiB  loss {loss:.3e}")
    return "\n".join(lines) + "\n" + body


def prior_loss(choice: Choice) -> float:
    """Relative squared weight error (noise / signal) of `choice`'s scheme, RTN, on a seeded heavy-tailed matrix
    (Student-t, 5 degrees of freedom, 256 x 1024): the loss per parameter assumed when no calibration data is
    measured. Layers all look alike under it; only the schemes' sizes and errors differ."""
    return _prior(choice.name)


@cache
def _prior(name: str) -> float:
    import torch

    if name == KEEP:
        return 0.0
    g = torch.Generator().manual_seed(0)
    w = _student_t(g, (256, 1024))
    body = _shipped_group(CHOICE[name].recipe, CHOICE[name].group)["scheme"]
    if body.get("type") == "float" and body.get("num_bits") == 8:
        from ..quant.fp8 import FP8Layout, quantize_fp8

        r = quantize_fp8(w, FP8Layout("block", (128, 128)))
    elif body.get("type") == "float":
        from ..quant.fp4 import rtn_mxfp4, rtn_nvfp4

        r = rtn_nvfp4(w) if body.get("strategy") == "tensor_group" else rtn_mxfp4(w)
    else:
        from ..quant.int4 import rtn

        r = rtn(w, 4, body.get("group_size", 32), True)
    return float(r.noise.sum() / r.signal.sum())


def _student_t(g, shape):
    import torch

    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((5, *shape), generator=g).pow(2).sum(0)
    return z / (chi2 / 5).sqrt()
