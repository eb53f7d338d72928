"""What the manifest says, per module and per (layer, expert): the report's data model."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


from ..arch import layer_index
from ..arch.layout import ATTN, EXPERT
from ..errors import ConfigError
from ..pack.manifest import MANIFEST_NAME
from ..verify.common import SQNR_CAP_DB  # an exact module has infinite SQNR: reports and verify cap it alike

VERIFY_NAME = "verify.json"  # picked up from the output directory when no verify JSON is passed
DEFAULT_OUTPUT_NAME = "quantkit_report.html"
# The manifest has ~530 bytes per output tensor: Kimi K2 (60 MoE layers x 384 experts x 3 projections x
# 3 tensors) writes ~110 MB, over read_json_file's 64 MiB cap for config files, so it is read here.

# Module names are the only place the manifest keeps (layer, expert, projection); convert's
# calibration report reads them with the same pattern.
# Indices of at most 9 digits: a 5,000-digit "layer" in a hostile name is not an index (int() would refuse it).
_EXPERT = EXPERT
_KV = re.compile(rf"(?:^|\.)layers\.(?P<layer>\d{{1,9}})\.{ATTN}\.(?P<kind>[kv])_scale$")

WORST_MODULES = 10
MAX_EXPERTS = 1 << 14  # per layer; the largest releases have 384
MAX_GRID_CELLS = 1 << 20  # layers x experts drawn as one heatmap (Kimi K2: 60 x 384 = 23,040); above, skipped
MAX_PROJECTIONS = 16  # distinct projection names per expert that the report names (real models: 3)
MAX_VERIFY_LAYERS = 100_000  # verify.json's per-layer rows drawn
MAX_FALLBACK_ROWS = 1000  # one row per expert; the rest are counted (all of them are in the manifest)
MAX_METRICS = 100  # verify's metrics / generation entries shown (it writes ~10)
ANNOTATE_CELLS = 256  # heatmaps up to this many cells print their values in the cells
FIG_WIDTH_IN = 10.0

# Colours shared by figures and their legends.
BELOW_THRESHOLD = "#d62728"  # SQNR below verify's min_sqnr_db
FALLBACK = "#d62728"  # expert whose calibration fell back (too few tokens)
ZERO_TOKENS = "#000000"  # expert that saw no token and has no recorded fallback
MISSING = "#e6e6e6"  # no such module / no value

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"  # offline by construction

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1d1d1f; margin: 0 auto; max-width: 1100px; padding: 0 24px 48px; }
h1 { font-size: 24px; margin: 24px 0 4px; } h2 { font-size: 19px; margin: 36px 0 8px;
       border-bottom: 1px solid #ddd; padding-bottom: 4px; } h3 { font-size: 16px; margin: 20px 0 6px; }
.sub { color: #555; margin: 0 0 16px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13.5px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #444; font-weight: 600; } td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kv th { width: 190px; } td.nw { white-space: nowrap; }
code, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 12.5px; }
figure { margin: 12px 0 20px; } figure svg { max-width: 100%; height: auto; display: block; }
figure svg image { image-rendering: crisp-edges; image-rendering: pixelated; }
figcaption { color: #333; font-size: 14px; margin-top: 6px; max-width: 900px; }
.skip { color: #666; font-style: italic; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #c62828; font-weight: 600; } .na { color: #777; }
nav a { margin-right: 14px; color: #0b57d0; text-decoration: none; }
details pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
ul.notes { margin: 4px 0 12px; padding-left: 20px; }
"""


# ---- what the manifest says, per module --------------------------------------------------------------
@dataclass(frozen=True)
class ModuleInfo:
    name: str
    scheme: str
    method: str | None
    sqnr_db: float | None  # None when the manifest records none (pass-through)
    tokens: int | None  # calibration tokens routed to it (calibrated methods only)
    fallback: str | None
    layer: int | None  # the N of `...layers.N...`, None outside the decoder layers
    prefix: str | None  # `...experts` for a routed expert
    expert: int | None
    proj: str | None
    heldout_kept: str | None = None  # GPTQ's held-out check: "solve", "rtn" or "retry" (a re-solve, damping raised)


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        x = float(x)
    except OverflowError:  # a JSON integer beyond float range
        return None
    return None if math.isnan(x) else x


def _shown(x) -> str:
    """A value from an input file as an error message names it: short whatever its size (a 1 MB string, a
    1000-digit integer, a list of a million entries), in JSON's spelling for true, false and null."""
    if x is None or isinstance(x, bool):
        return "null" if x is None else str(x).lower()
    if isinstance(x, str):
        return repr(x[:40]) + ("..." if len(x) > 40 else "")
    if isinstance(x, int):
        return str(x) if x.bit_length() <= 64 else f"a {x.bit_length()}-bit integer"
    if isinstance(x, float):
        return repr(x)
    return "a list" if isinstance(x, list) else "an object" if isinstance(x, dict) else type(x).__name__


def _layer_of(name: str) -> int | None:
    return layer_index(name + ".")  # arch.py's rule; a module name may end at its layer


def collect_modules(tensors: dict[str, dict]) -> list[ModuleInfo]:
    """One entry per quantized or passed-through module (the manifest keys those tensors by `scheme`;
    every tensor of a module repeats the module's fields, so the first that has an SQNR is taken)."""
    first: dict[str, dict] = {}
    for name, e in tensors.items():
        if not isinstance(e, dict) or "scheme" not in e:
            continue
        module = name.rsplit(".", 1)[0]
        if module not in first or (first[module].get("sqnr_db") is None and e.get("sqnr_db") is not None):
            first[module] = e
    out = []
    for module, e in first.items():
        m = _EXPERT.match(module)
        tokens = e.get("tokens")
        out.append(ModuleInfo(
            name=module, scheme=str(e["scheme"]), method=e["method"] if isinstance(e.get("method"), str) else None,
            sqnr_db=_number(e.get("sqnr_db")),
            tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
            fallback=str(e["fallback"]) if e.get("fallback") else None, layer=_layer_of(module),
            prefix=m["prefix"] if m else None, expert=int(m["expert"]) if m else None,
            proj=m["proj"] if m else None, heldout_kept=_kept(e.get("heldout"))))
    return out


def _kept(heldout) -> str | None:
    kept = heldout.get("kept") if isinstance(heldout, dict) else None
    return kept if kept in ("solve", "rtn", "retry") else None


class GridTooLarge(ValueError):
    """A layers x experts grid too large to draw densely: the section says so and draws nothing."""


@dataclass(frozen=True)
class ExpertGrid:
    """Rows = expert containers (`model.layers.L.mlp.experts`) in layer order, columns = expert index."""

    rows: tuple[str, ...]
    labels: tuple[str, ...]  # row labels: the layer index, or the whole prefix when layers repeat
    n_experts: int

    @classmethod
    def of(cls, prefixes, n_experts: int) -> ExpertGrid:
        if n_experts > MAX_EXPERTS:  # the grid is dense: a hostile index must not allocate gigabytes
            raise ConfigError(f"{MANIFEST_NAME} names routed expert {n_experts - 1}, beyond the {MAX_EXPERTS} "
                              "experts per layer the report draws", hint="the manifest is damaged or not quantkit's")
        rows = sorted(set(prefixes), key=lambda p: (_layer_of(p) if _layer_of(p) is not None else -1, p))
        if len(rows) * n_experts > MAX_GRID_CELLS:
            raise GridTooLarge(f"{len(rows):,} expert rows x {n_experts:,} experts is over the {MAX_GRID_CELLS:,} "
                               "cells one heatmap draws")
        labels = [str(_layer_of(p)) if _layer_of(p) is not None else p for p in rows]
        if len(set(labels)) < len(labels):
            labels = list(rows)
        return cls(tuple(rows), tuple(labels), n_experts)

    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.rows)}


