"""The page: HTML assembly, formatting, and matplotlib figures rendered to inline SVG."""

from __future__ import annotations

import html
import io
import math
import re
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..read.checkpoint import Checkpoint
from .model import ANNOTATE_CELLS, ExpertGrid, FIG_WIDTH_IN, _CSP, _CSS, _number


# ---- the page -----------------------------------------------------------------------------------------
MAX_NOTES = 100  # convert's notes listed (it writes a handful)
MAX_TEXT = 300  # characters of one interpolated value (a module name, a reason) shown; the manifest has all


def _e(x, limit: int = MAX_TEXT) -> str:
    """HTML-escaped text, cut to `limit` characters (names in a manifest are input: a 1 MB module name must not
    make a 1 MB table cell, or a thousand of them a gigabyte page)."""
    s = str(x)
    if len(s) > limit:
        s = f"{s[:limit]}... ({len(s):,} characters)"
    return html.escape(s, quote=True)


def _short(x, limit: int = 60) -> str:
    """Plain text for figure titles and tick labels, cut to `limit` characters."""
    s = str(x)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "—"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_db(x: float | None) -> str:
    if x is None:
        return "—"
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _fmt_value(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


class _Page:
    """HTML fragments in page order, the figures drawn and the sections skipped (with the reason)."""

    def __init__(self):
        self.parts: list[str] = []
        self.nav: list[tuple[str, str]] = []
        self.figures: list[str] = []
        self.skipped: dict[str, str] = {}

    def add(self, fragment: str) -> None:
        self.parts.append(fragment)

    def section(self, sid: str, title: str) -> None:
        self.nav.append((sid, title))
        self.add(f'<h2 id="{sid}">{_e(title)}</h2>')

    def skip(self, key: str, sentence: str) -> None:
        self.skipped[key] = sentence
        self.add(f'<p class="skip">{_e(sentence)}</p>')

    def figure(self, fig_id: str, fig, caption: str) -> None:
        """`caption` is HTML (callers escape what they interpolate)."""
        self.figures.append(fig_id)
        self.add(f"<figure>{_svg(fig, fig_id)}<figcaption>{caption}</figcaption></figure>")

    def header(self, root: Path, ck: Checkpoint, manifest: dict, reference, verify_origin: str | None) -> None:
        cfg = ck.config
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        get = lambda *keys: next((c[k] for k in keys for c in (cfg, text) if c.get(k) is not None), None)  # noqa: E731
        recipe = manifest.get("recipe") or {}
        summary = manifest.get("summary") or {}
        source = manifest.get("source") or {}
        shards = source.get("shards") if isinstance(source.get("shards"), list) else []
        src_bytes = (_number(summary.get("bytes_read"))
                     or sum(_number(s.get("size")) or 0 for s in shards if isinstance(s, dict)))
        out_bytes = ck.total_bytes
        fmt = source.get("format") if isinstance(source.get("format"), dict) else {}
        ratio = f" ({out_bytes / src_bytes:.1%} of the source)" if src_bytes else ""
        archs = cfg.get("architectures")
        arch = (", ".join(map(str, archs[:8])) if isinstance(archs, list) else str(archs or "")) or "—"
        experts = get("n_routed_experts", "num_experts", "num_local_experts")
        rows = [
            ("output", f'<span class="mono">{_e(root)}</span>'),
            ("model", f"{_e(get('model_type') or '—')} ({_e(arch)}), {_e(get('num_hidden_layers') or '?')} layers"
                      + (f", {_e(experts)} routed experts" if experts else "")),
            ("recipe", (f"<b>{_e(recipe.get('name', '—'))}</b> <span class=\"mono\">sha256 "
                       f"{_e(str(recipe.get('sha256', ''))[:12])}</span>")),
            ("source format", _e(fmt.get("description") or fmt.get("kind") or "—")),
            ("size", (f"{_fmt_bytes(src_bytes)} &rarr; <b>{_fmt_bytes(out_bytes)}</b>{ratio}, "
                     f"{len(ck.shards)} shard(s), {len(ck.location)} tensors")),
            ("modules", (f"{_e(summary.get('modules_quantized', '—'))} quantized by this run, "
                        f"{_e(summary.get('modules_passed_through', '—'))} passed through")),
        ]
        cal = manifest.get("calibration") if isinstance(manifest.get("calibration"), dict) else None
        if cal:
            rows.append(("calibration", (f"{_e(cal.get('num_samples', '?'))} samples x {_e(cal.get('seq_len', '?'))} "
                                        f"tokens = {_e(cal.get('num_tokens', '?'))} tokens from "
                                        f"<span class=\"mono\">{_e(cal.get('source', '?'))}</span>")))
        kv = manifest.get("kv_cache")
        if isinstance(kv, dict):
            origin = kv.get("origin") or {}
            rows.append(("KV cache", f"FP8, strategy <b>{_e(kv.get('strategy', '?'))}</b>, "
                                     f"{_e(kv.get('tensors', '?'))} scale tensors"
                                     + (f" from <span class=\"mono\">{_e(origin['file'])}</span>"
                                        if isinstance(origin, dict) and origin.get("file") else "")))
        if reference is not None:
            rows.append(("reference", (f'<span class="mono">{_e(reference)}</span> (shown only; the report '
                                      "computes nothing from it: <code>quantkit verify --reference</code> does)")))
        rows.append(("verify", _e(verify_origin) if verify_origin else "no verify JSON (section skipped)"))
        rows.append(("quantkit", _e((manifest.get("tool") or {}).get("version", "—"))))
        self.add("<table class=\"kv\">" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>")
        notes = list(manifest.get("notes") or []) + list((cal or {}).get("notes") or [])
        if notes:
            more = len(notes) - MAX_NOTES
            self.add("<h3>Notes recorded by convert</h3><ul class=\"notes\">"
                     + "".join(f"<li>{_e(n)}</li>" for n in notes[:MAX_NOTES])
                     + (f"<li>... and {more} more (all in the manifest)</li>" if more > 0 else "") + "</ul>")
        if recipe.get("text"):
            self.add(f"<details><summary>recipe text</summary><pre>{_e(recipe['text'], 1 << 20)}</pre></details>")

    def render(self, title: str) -> str:
        nav = "".join(f'<a href="#{sid}">{_e(t)}</a>' for sid, t in self.nav)
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
                '<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
                f"<h1>{_e(title)}</h1><p class=\"sub\">What <code>quantkit convert</code> wrote, where the "
                f"quantization error went, and what <code>quantkit verify</code> measured.</p>"
                f"<nav>{nav}</nav>\n" + "\n".join(self.parts) + "\n</body></html>\n")


# ---- figures ------------------------------------------------------------------------------------------
def _mpl():
    """matplotlib with the non-interactive SVG canvas (no pyplot: no global figure registry)."""
    try:
        import matplotlib
    except ImportError as e:  # an optional dependency: only the report needs it
        raise ConfigError("matplotlib is not installed; the report draws its figures with it",
                          hint="pip install matplotlib") from e
    return matplotlib


def _new_figure(height_in: float, ncols: int = 1, nrows: int = 1, **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_WIDTH_IN, height_in), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


_SVG_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.DOTALL)
_SVG_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.DOTALL)
_SVG_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def _svg(fig, fig_id: str) -> str:
    """The figure as an inline <svg id=fig_id>: no XML prolog, DOCTYPE, metadata or namespace URIs (the
    HTML parser puts inline <svg> in the SVG namespace itself), `href` instead of `xlink:href` (SVG 2).
    The hash salt is per figure, so the clip-path/image ids of two figures never collide."""
    mpl = _mpl()
    buf = io.StringIO()
    with mpl.rc_context({"svg.hashsalt": f"quantkit-report-{fig_id}", "svg.fonttype": "none",
                         "svg.image_inline": True, "svg.id": fig_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    s = _SVG_PROLOG.sub("", buf.getvalue(), count=1)
    s = _SVG_METADATA.sub("", s, count=1)
    s = _SVG_XMLNS.sub("", s)
    s = s.replace("xlink:href=", "href=")
    s = s.replace("data:image/png;base64,\n", "data:image/png;base64,")
    return s


def _heat_rows(n_rows: int) -> float:
    """Figure height (inches) for a heatmap of n_rows rows: readable cells for a few layers, 61 still fit."""
    return min(1.5 + n_rows * min(0.4, max(0.11, 5.0 / max(n_rows, 1))), 40.0)


def _label_axes(ax, grid: ExpertGrid) -> None:
    from matplotlib.ticker import MaxNLocator

    rows, cols = len(grid.rows), grid.n_experts
    if cols <= 40:
        ax.set_xticks(range(cols))
        ax.tick_params(axis="x", labelsize=7 if cols > 20 else 9)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=24, integer=True))
    step = max(1, math.ceil(rows / 32))
    ax.set_yticks(range(0, rows, step))
    ax.set_yticklabels([_short(x) for x in grid.labels[::step]], fontsize=8 if rows > 16 else 9)
    ax.set_xlabel("routed expert")
    ax.set_ylabel("layer")


def _annotate(ax, values: np.ndarray, fmt, dark: np.ndarray) -> None:
    """Write each cell's value (small grids only); white text on dark cells."""
    if values.size > ANNOTATE_CELLS:
        return
    for (i, j), v in np.ndenumerate(values):
        text = fmt(v)
        if text:
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark[i, j] else "black")


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _luminance(rgba: np.ndarray) -> np.ndarray:
    return 0.299 * rgba[..., 0] + 0.587 * rgba[..., 1] + 0.114 * rgba[..., 2]


