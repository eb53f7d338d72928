"""The report's sections, one function each: SQNR, calibration tokens, KV-cache scales, bytes by
scheme, verify's results, and the tables."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import numpy as np

from ..read.checkpoint import Checkpoint
from ..read.safetensors import SafetensorsFile
from .model import MAX_METRICS, MAX_PROJECTIONS, MAX_VERIFY_LAYERS, GridTooLarge
from .model import ANNOTATE_CELLS, BELOW_THRESHOLD, ExpertGrid, FALLBACK, MAX_FALLBACK_ROWS, MISSING, ModuleInfo, SQNR_CAP_DB, VERIFY_NAME, WORST_MODULES, ZERO_TOKENS, _EXPERT, _KV, _layer_of, _number
from .page import _Page, _annotate, _e, _short, _fmt_bytes, _fmt_db, _fmt_value, _heat_rows, _integer_x, _label_axes, _luminance, _new_figure


# ---- section: SQNR ------------------------------------------------------------------------------------
def _section_sqnr(page: _Page, modules: list[ModuleInfo], threshold: float) -> None:
    page.section("sec-sqnr", "Weight SQNR per layer and expert")
    measured = [m for m in modules if m.sqnr_db is not None]
    if not measured:
        page.skip("sqnr", "No module carries an SQNR in the manifest (nothing was quantized by this run: "
                          "modules only copied or passed through), so there is no error to map.")
        return
    experts = [m for m in measured if m.prefix is not None]
    if experts:
        _sqnr_heatmap(page, experts, threshold)
    else:
        page.skip("sqnr-heatmap", "No routed-expert module was quantized in this output (a dense model, or a "
                                  "recipe that leaves the experts alone), so there is no layer x expert heatmap.")
    _sqnr_layers(page, measured, threshold)


def _sqnr_heatmap(page: _Page, experts: list[ModuleInfo], threshold: float) -> None:
    import matplotlib as mpl
    from matplotlib.colors import Normalize
    from matplotlib.patches import Patch

    try:
        grid = ExpertGrid.of((m.prefix for m in experts), max(m.expert for m in experts) + 1)
    except GridTooLarge as e:
        page.skip("sqnr-heatmap", f"No layer x expert heatmap: {e}. The per-layer figure and the tables below "
                                  "still cover every module.")
        return
    row = grid.index()
    projs = sorted({m.proj for m in experts})
    worst = np.full((len(grid.rows), grid.n_experts), np.nan)  # [layers, experts] dB
    worst_proj = np.full(worst.shape, -1)
    pidx = {p: i for i, p in enumerate(projs)}
    for m in experts:
        i, j = row[m.prefix], m.expert
        if not worst[i, j] <= m.sqnr_db:  # NaN (unset) or larger
            worst[i, j], worst_proj[i, j] = m.sqnr_db, pidx[m.proj]
    shown = np.clip(worst, -SQNR_CAP_DB, SQNR_CAP_DB)
    finite = shown[np.isfinite(shown)]
    lo, hi = float(finite.min()), float(finite.max())
    # the colours span the passing values; a value below the threshold takes the map's `under` colour
    passing = finite[finite >= threshold]
    vmin = max(float(passing.min()), threshold) if passing.size else threshold
    vmax = max(hi, vmin + 0.1)
    below = int(np.sum(shown < threshold))
    cmap = mpl.colormaps["viridis"].with_extremes(under=BELOW_THRESHOLD, bad=MISSING)
    norm = Normalize(vmin=vmin, vmax=vmax)

    fig, axs = _new_figure(_heat_rows(len(grid.rows)))
    ax = axs[0, 0]
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto", interpolation="none")
    _label_axes(ax, grid)
    ax.set_title(f"SQNR of each expert's worst projection (min over {_proj_list(projs, 60)}), dB", fontsize=11)
    cb = fig.colorbar(im, ax=ax, extend="min" if below else "neither", fraction=0.04, pad=0.01)
    cb.set_label("dB (darker = more error)")
    handles = [Patch(color=MISSING, label="no such module")] if np.isnan(worst).any() else []
    if below:
        handles.append(Patch(color=BELOW_THRESHOLD, label=f"below {threshold:g} dB"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.12 if len(grid.rows) < 8 else -0.06),
                  ncols=len(handles), fontsize=8, frameon=False)
    _annotate(ax, shown, lambda v: "" if not np.isfinite(v) else f"{v:.1f}",
              _luminance(cmap(norm(np.nan_to_num(shown, nan=vmax)))) < 0.5)

    # caption: where it is worst, which projection is usually the worst one
    i, j = np.unravel_index(np.nanargmin(shown), shown.shape)
    counts = Counter(int(p) for p in worst_proj.ravel() if p >= 0)
    share = ", ".join(f"{projs[p]} {c / sum(counts.values()):.0%}" for p, c in counts.most_common(MAX_PROJECTIONS))
    per_proj: dict[str, list[float]] = defaultdict(list)  # one pass: 10^6 projection names stay linear
    for m in experts:
        per_proj[m.proj].append(m.sqnr_db)
    med = {p: float(np.median(per_proj[p])) for p in projs[:MAX_PROJECTIONS]}
    cap = (f"Each cell is one routed expert (column) of one MoE layer (row); its colour is the lowest SQNR "
           f"among the expert's projections ({_e(_proj_list(projs, 80))}), as convert recorded it "
           f"(10&nbsp;log10(&Sigma;w&sup2; / &Sigma;(w &minus; dequant)&sup2;)). Higher is better: dark cells "
           f"carry the most quantization error; red cells are below verify's {threshold:g}&nbsp;dB threshold "
           f"({below} of {int(np.isfinite(worst).sum())}). Worst: layer {_e(grid.labels[i])}, expert {j} at "
           f"{shown[i, j]:.2f}&nbsp;dB; range {lo:.2f}&ndash;{hi:.2f}&nbsp;dB. The worst projection is "
           f"{_e(share)} of the time; median per projection: "
           + ", ".join(f"{_e(p)} {v:.2f}&nbsp;dB" for p, v in med.items())
           + (f" (the first {MAX_PROJECTIONS} of {len(projs):,} projection names)" if len(projs) > MAX_PROJECTIONS else "")
           + ".")
    page.figure("fig-sqnr-heatmap", fig, cap)


def _sqnr_layers(page: _Page, measured: list[ModuleInfo], threshold: float) -> None:
    by_layer: dict[int, list[float]] = defaultdict(list)
    outside = [m for m in measured if m.layer is None]
    for m in measured:
        if m.layer is not None:
            by_layer[m.layer].append(_clip_db(m.sqnr_db))
    if not by_layer:
        return
    layers = sorted(by_layer)
    stats = np.array([[min(by_layer[L]), float(np.median(by_layer[L])), max(by_layer[L])] for L in layers])
    fig, axs = _new_figure(3.2)
    ax = axs[0, 0]
    marker = "o" if len(layers) <= 64 else None
    ax.fill_between(layers, stats[:, 0], stats[:, 2], color="#9ecae1", alpha=0.5, label="min – max")
    ax.plot(layers, stats[:, 1], color="#08519c", marker=marker, ms=3, label="median")
    ax.plot(layers, stats[:, 0], color="#3f007d", marker=marker, ms=3, lw=1, label="min")
    ax.axhline(threshold, color=BELOW_THRESHOLD, ls="--", lw=1, label=f"verify threshold {threshold:g} dB")
    ax.set_xlabel("layer")
    _integer_x(ax)
    ax.set_ylabel("SQNR, dB")
    fig.legend(fontsize=8, loc="outside upper left", ncols=4, frameon=False)
    ax.grid(alpha=0.3)
    kinds = Counter(m.scheme for m in measured)
    cap = (f"Per decoder layer, the SQNR of every quantized module ({len(measured)} modules: "
           + ", ".join(f"{c} {_e(s)}" for s, c in kinds.most_common())
           + "): the line is the median, the band spans min to max, the dark line is the minimum. A layer whose "
           "minimum dips far below its median holds one badly quantized module; see the worst-modules table."
           + (f" {len(outside)} quantized module(s) outside the decoder layers are in the table only."
              if outside else ""))
    page.figure("fig-sqnr-layers", fig, cap)


# ---- section: calibration tokens ------------------------------------------------------------------------
def _section_tokens(page: _Page, manifest: dict, modules: list[ModuleInfo]) -> None:
    import matplotlib as mpl
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Patch

    page.section("sec-tokens", "Expert token coverage (calibration)")
    cal = manifest.get("calibration")
    if not isinstance(cal, dict):
        methods = sorted({m.method for m in modules if m.method})
        page.skip("tokens", "This output was not calibrated (methods: " + (", ".join(methods) or "none")
                  + "), so no expert saw calibration tokens and nothing fell back.")
        return
    counts = {p: c for p, c in (cal.get("expert_tokens") or {}).items() if isinstance(c, list)}
    fallbacks = cal.get("fallbacks") or {}
    if not counts:
        page.skip("tokens", f"Calibrated, but no routed expert was calibrated (no calibration.expert_tokens); "
                            f"{len(fallbacks)} fallback(s) are listed in the table below.")
        return
    try:
        grid = ExpertGrid.of(counts, max(len(c) for c in counts.values()))
    except GridTooLarge as e:
        page.skip("tokens", f"No token-coverage heatmap: {e}. The fallbacks table below lists every fallback.")
        return
    row = grid.index()
    tokens = np.full((len(grid.rows), grid.n_experts), -1.0)  # [layers, experts]; -1 = no such expert
    for p, c in counts.items():
        tokens[row[p], :len(c)] = [_token_count(x) for x in c]
    fell = np.zeros(tokens.shape, bool)
    for module in fallbacks:
        m = _EXPERT.match(module)
        if m and m["prefix"] in row and int(m["expert"]) < grid.n_experts:
            fell[row[m["prefix"]], int(m["expert"])] = True

    # one RGBA image: token counts on a log colour scale, then the marks painted over
    vmax = max(float(tokens.max()), 2.0)
    norm = LogNorm(vmin=1.0, vmax=vmax)
    cmap = mpl.colormaps["cividis"]
    rgba = cmap(norm(np.clip(tokens, 1.0, None)))
    rgba[tokens == 0] = mpl.colors.to_rgba(ZERO_TOKENS)
    rgba[tokens < 0] = mpl.colors.to_rgba(MISSING)
    rgba[fell] = mpl.colors.to_rgba(FALLBACK)
    zero_no_fb = int(np.sum((tokens == 0) & ~fell))

    fig, axs = _new_figure(_heat_rows(len(grid.rows)))
    ax = axs[0, 0]
    ax.imshow(rgba, aspect="auto", interpolation="none")
    _label_axes(ax, grid)
    ax.set_title("calibration tokens routed to each expert (log scale); fallbacks in red", fontsize=11)
    cb = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.04, pad=0.01)
    cb.set_label("tokens")
    handles = [Patch(color=FALLBACK, label="fallback (too few tokens)")]
    if zero_no_fb:
        handles.append(Patch(color=ZERO_TOKENS, label="0 tokens, no fallback recorded"))
    if (tokens < 0).any():
        handles.append(Patch(color=MISSING, label="no such expert"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.12 if len(grid.rows) < 8 else -0.06),
              ncols=len(handles), fontsize=8, frameon=False)
    _annotate(ax, tokens, lambda v: "" if v < 0 else f"{int(v)}", _luminance(rgba) < 0.5)

    total_experts = int((tokens >= 0).sum())
    fb_experts = int(fell.sum())
    per_layer = tokens.clip(0, None).sum(axis=1)
    share = tokens.clip(0, None) / np.where(per_layer > 0, per_layer, 1)[:, None]
    sq_fb = [m.sqnr_db for m in modules if m.sqnr_db is not None and m.name in fallbacks]
    sq_ok = [m.sqnr_db for m in modules if m.sqnr_db is not None and m.prefix and m.name not in fallbacks]
    sqnr_note = (f" Median SQNR of fallback modules {np.median(sq_fb):.2f}&nbsp;dB vs {np.median(sq_ok):.2f}&nbsp;dB "
                 "for the others." if sq_fb and sq_ok else "")
    # GPTQ's held-out check (calib/gptq_pass.py): a calibrated module that is not a fallback but ends RTN
    calibrated = [m for m in modules if m.prefix and m.tokens is not None and m.name not in fallbacks]
    kept_rtn = sum(m.method == "rtn" for m in calibrated)
    if any(m.method == "gptq" for m in calibrated) or kept_rtn:
        sqnr_note += (f" {kept_rtn} of {len(calibrated)} calibrated expert modules kept RTN's result: its output "
                      f"error on held-out calibration tokens was smaller than GPTQ's (the manifest's "
                      f"<code>method</code> and <code>heldout</code> per module).")
        retried = sum(m.heldout_kept == "retry" for m in calibrated)
        if retried:
            sqnr_note += (f" {retried} kept a second GPTQ solve with a higher damping, which did better on those "
                          f"tokens than both the first solve and RTN.")
    cap = (f"Each cell is one routed expert; its colour is the number of calibration tokens ({_e(cal.get('num_tokens', '?'))} "
           f"in all, each routed to top-k experts) the router sent to it, on a log scale. A GPTQ/AWQ expert needs "
           f"tokens to estimate its Hessian / activation scales: <b>red</b> cells are experts that saw too few and "
           f"fell back (reason in the table below), black cells saw none. {fb_experts} of {total_experts} experts "
           f"fell back; {int((tokens == 0).sum())} saw no token. The busiest expert took "
           f"{float(share.max()):.1%} of its layer's routed tokens.{sqnr_note} More calibration samples "
           f"(<code>--num-samples</code>) shrink the red area.")
    page.figure("fig-expert-tokens", fig, cap)


# ---- section: KV-cache scales ---------------------------------------------------------------------------
def _kv_scales(ck: Checkpoint, tensors: dict[str, dict]) -> dict[str, dict[int, np.ndarray]]:
    """{'k'|'v': {layer: per-head float32 values}} read from the output's KV-scale tensors. The manifest
    marks them with `kv_cache`; a source's own KV scales kept by convert are matched by name."""
    names = [n for n, e in tensors.items() if isinstance(e, dict) and "kv_cache" in e and n in ck.location]
    if not names:
        names = [n for n in ck.location if _KV.search(n)]
    by_shard: dict[str, list[str]] = defaultdict(list)
    for n in names:
        by_shard[ck.location[n]].append(n)
    out: dict[str, dict[int, np.ndarray]] = {"k": {}, "v": {}}
    for shard, ns in sorted(by_shard.items()):
        with SafetensorsFile(ck.shard(shard).header) as f:
            for n in ns:
                m = _KV.search(n)
                if m:
                    out[m["kind"]][int(m["layer"])] = f.get(n).float().reshape(-1).numpy()
    return out


def _section_kv(page: _Page, ck: Checkpoint, tensors: dict[str, dict]) -> None:
    page.section("sec-kv", "FP8 KV-cache scales")
    kv = _kv_scales(ck, tensors)
    if not kv["k"] and not kv["v"]:
        page.skip("kv", "This output ships no KV-cache scales (no --kv-scales, no kv_cache in the recipe): "
                        "engines run the KV cache in the model dtype.")
        return
    layers = sorted(set(kv["k"]) | set(kv["v"]))
    heads = max(len(a) for d in kv.values() for a in d.values())
    kinds = [k for k in ("k", "v") if kv[k]]

    def matrix(kind):  # [heads, layers]
        a = np.full((heads, len(layers)), np.nan)
        for c, L in enumerate(layers):
            vals = kv[kind].get(L)
            if vals is not None:
                a[:len(vals), c] = vals
        return a

    if heads == 1:
        fig, axs = _new_figure(3.2)
        ax = axs[0, 0]
        for kind, colour in (("k", "#1f77b4"), ("v", "#ff7f0e")):
            if kv[kind]:
                a = matrix(kind)[0]
                ax.plot(layers, a, marker="o" if len(layers) <= 64 else None, ms=3, color=colour,
                        label=f"{kind}_scale")
        vals = np.concatenate([matrix(k)[0] for k in kinds])
        vals = vals[np.isfinite(vals) & (vals > 0)]
        if vals.size and vals.max() / vals.min() > 20:
            ax.set_yscale("log")
        ax.set_xlabel("layer")
        _integer_x(ax)
        ax.set_ylabel("scale (amax / 448)")
        ax.grid(alpha=0.3)
        fig.legend(fontsize=8, frameon=False, ncols=2, loc="outside upper left")
        how = "one scale per layer (strategy tensor)"
    else:
        import matplotlib as mpl

        fig, axs = _new_figure(1.2 + len(kinds) * (0.9 + heads * min(0.3, 4.0 / heads)), nrows=len(kinds))
        cmap = mpl.colormaps["magma"].with_extremes(bad=MISSING)
        for ax, kind in zip(axs[:, 0], kinds):
            a = matrix(kind)
            im = ax.imshow(np.ma.masked_invalid(a), cmap=cmap, aspect="auto", interpolation="none")
            fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01).set_label(f"{kind}_scale")
            ax.set_ylabel("KV head")
            ax.set_yticks(range(heads) if heads <= 16 else range(0, heads, math.ceil(heads / 16)))
            step = max(1, math.ceil(len(layers) / 40))
            ax.set_xticks(range(0, len(layers), step))
            ax.set_xticklabels([str(L) for L in layers[::step]], fontsize=8)
            ax.set_title(f"{kind}_scale per layer and KV head", fontsize=10)
            if a.size <= ANNOTATE_CELLS // 2:
                norm = im.norm
                dark = _luminance(cmap(norm(np.nan_to_num(a, nan=np.nanmax(a))))) < 0.5
                _annotate(ax, a, lambda v: "" if not np.isfinite(v) else f"{v:.3g}", dark)
        axs[-1, 0].set_xlabel("layer")
        how = f"one scale per KV head ({heads} heads, strategy attn_head)"
    spread = []
    for kind in kinds:
        a = matrix(kind)
        if np.isfinite(a).any():
            c, L = np.unravel_index(np.nanargmax(a), a.shape)
            spread.append(f"largest {kind}_scale {np.nanmax(a):.4g} (layer {layers[L]}"
                          + (f", head {c}" if heads > 1 else "") + f"), median {np.nanmedian(a):.4g}")
    extremes = "; ".join(spread)
    cap = (f"The FP8 (e4m3) KV-cache scales this output ships, {how}, for {len(layers)} layers: scale = amax / 448 "
           f"of the post-RoPE keys (k) and the values (v) seen in calibration, so a cached value is stored as "
           f"fp8(x / scale). A scale far above its neighbours marks outlier activations, which FP8 then resolves "
           f"more coarsely in that layer/head. " + extremes[:1].upper() + extremes[1:] + ".")
    page.figure("fig-kv-scales", fig, cap)


# ---- section: bytes by scheme ---------------------------------------------------------------------------
def bytes_by_scheme(ck: Checkpoint, tensors: dict[str, dict]) -> dict[str, dict[str, int]]:
    """{label: {tensors, modules, bytes}} over the output's shards. Labels as `quantkit inspect`: a
    quantized or passed-through module's tensors under its scheme (from the manifest), KV scales under
    `kv-scales`, everything else under its dtype. Bytes are the headers' (what the shard holds)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "modules": 0, "bytes": 0})
    modules: dict[str, set[str]] = defaultdict(set)
    for shard in ck.shards:
        for name, info in shard.tensors.items():
            e = tensors.get(name)
            if isinstance(e, dict) and "scheme" in e:
                label = str(e["scheme"])
                modules[label].add(name.rsplit(".", 1)[0])
            elif (isinstance(e, dict) and "kv_cache" in e) or _KV.search(name):
                label = "kv-scales"
            else:
                label = str(info.dtype).removeprefix("torch.")
            out[label]["tensors"] += 1
            out[label]["bytes"] += info.nbytes
    for label, ms in modules.items():
        out[label]["modules"] = len(ms)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def _section_bytes(page: _Page, ck: Checkpoint, tensors: dict[str, dict]) -> None:
    page.section("sec-bytes", "Bytes by scheme")
    schemes = bytes_by_scheme(ck, tensors)
    total = sum(s["bytes"] for s in schemes.values()) or 1
    labels = list(schemes)
    fig, axs = _new_figure(1.0 + 0.38 * len(labels))
    ax = axs[0, 0]
    vals = [schemes[k]["bytes"] for k in labels]
    colours = ["#2ca02c" if k.startswith(("int4", "fp8")) else "#ff7f0e" if k == "kv-scales" else "#7f7f7f"
               for k in labels]
    ax.barh(range(len(labels)), vals, color=colours)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.3 if vals and max(vals) > 0 else 1)
    for i, v in enumerate(vals):
        ax.text(v, i, f"  {_fmt_bytes(v)} ({v / total:.1%})", va="center", fontsize=8)
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt_bytes(x) if x else "0"))
    ax.set_xlabel("bytes in the output shards")
    ax.grid(axis="x", alpha=0.3)
    rows = "".join(f"<tr><td class=\"mono\">{_e(k)}</td><td class=\"num\">{s['modules'] or ''}</td>"
                   f"<td class=\"num\">{s['tensors']}</td><td class=\"num\">{_fmt_bytes(s['bytes'])}</td>"
                   f"<td class=\"num\">{s['bytes'] / total:.1%}</td></tr>" for k, s in schemes.items())
    cap = (f"Where the {_fmt_bytes(total)} of the output go, grouped as <code>quantkit inspect</code> groups them: "
           "quantized (green) and passed-through modules under their scheme (weights, scales and shapes "
           "together), KV-cache scales (orange), everything left as it was under its dtype (grey). A large grey "
           "bar is the part the recipe did not shrink.")
    page.figure("fig-bytes", fig, cap)
    page.add("<table><tr><th>scheme</th><th class=\"num\">modules</th><th class=\"num\">tensors</th>"
             f"<th class=\"num\">bytes</th><th class=\"num\">share</th></tr>{rows}</table>")


# ---- section: verify --------------------------------------------------------------------------------------
def _ok(v) -> str:
    return ('<span class="ok">pass</span>' if v is True else '<span class="bad">FAIL</span>' if v is False
            else '<span class="na">skipped</span>')


def _section_verify(page: _Page, doc: dict | None, origin: str | None) -> None:
    page.section("sec-verify", "quantkit verify")
    if doc is None:
        page.skip("verify", f"No verify result: run `quantkit verify OUT --reference SRC --json > OUT/{VERIFY_NAME}` "
                            "(or pass its JSON) to add the checks and metrics here.")
        return
    page.add(f"<p>Result: {_ok(doc.get('passed'))} (from {_e(origin)}).</p>")
    checks = [c for c in doc.get("checks") or [] if isinstance(c, dict)]
    more = len(checks) - MAX_FALLBACK_ROWS  # verify writes ~20; a file with 10^6 makes no 10^6-row table
    checks = checks[:MAX_FALLBACK_ROWS]
    if checks:
        page.add("<table><tr><th>check</th><th>result</th><th class=\"num\">value</th><th class=\"num\">threshold</th>"
                 "<th>detail</th></tr>" + "".join(
                     f"<tr><td>{_e(c.get('name', '?'))}</td><td>{_ok(c.get('ok'))}</td>"
                     f"<td class=\"num\">{_e(_fmt_value(c.get('value')))}</td>"
                     f"<td class=\"num\">{_e(_fmt_value(c.get('threshold')))}</td><td>{_e(c.get('detail', ''))}</td></tr>"
                     for c in checks) + "</table>"
                 + (f"<p class=\"skip\">... and {more} more checks in the verify JSON.</p>" if more > 0 else ""))
    metrics = dict(list((doc.get("metrics") or {}).items())[:MAX_METRICS])
    metrics.update({f"generation {k}": v for k, v in list((doc.get("generation") or {}).items())[:MAX_METRICS]})
    if any(v is not None for v in metrics.values()):
        page.add("<h3>Model-level metrics</h3><table>" + "".join(
            f"<tr><th>{_e(k)}</th><td class=\"num\">{_e(_fmt_value(v))}</td></tr>" for k, v in metrics.items())
            + "</table>")
    else:
        page.add('<p class="skip">No model-level metrics: verify ran without --reference.</p>')
    raw = doc.get("layers") if isinstance(doc.get("layers"), list) else []
    # a layer index is a small non-negative integer (a 1000-digit one cannot be drawn, nor is it a layer)
    layers = [x for x in raw[:MAX_VERIFY_LAYERS] if isinstance(x, dict) and isinstance(x.get("layer"), int)
              and not isinstance(x.get("layer"), bool) and 0 <= x["layer"] < 10 ** 9
              and _number(x.get("min_sqnr_db")) is not None]
    if not layers:
        page.skip("verify-layers", "verify measured no per-layer SQNR (it needs --reference).")
        return
    threshold = _number((doc.get("thresholds") or {}).get("min_sqnr_db"))
    xs = [x["layer"] for x in layers]
    fig, axs = _new_figure(3.0)
    ax = axs[0, 0]
    ax.plot(xs, [_clip_db(x["min_sqnr_db"]) for x in layers], marker="o", ms=3, color="#3f007d",
            label="min (worst module)")
    if all(_number(x.get("mean_sqnr_db")) is not None for x in layers):
        ax.plot(xs, [_clip_db(x["mean_sqnr_db"]) for x in layers], marker="o", ms=3, color="#08519c", label="mean")
    bad = [x for x in layers if x.get("ok") is False]
    if bad:
        ax.scatter([x["layer"] for x in bad], [_clip_db(x["min_sqnr_db"]) for x in bad], color=BELOW_THRESHOLD,
                   zorder=3, label="failing layer")
    if threshold is not None:
        ax.axhline(threshold, color=BELOW_THRESHOLD, ls="--", lw=1, label=f"threshold {threshold:g} dB")
    ax.set_xlabel("layer")
    _integer_x(ax)
    ax.set_ylabel("SQNR measured by verify, dB")
    ax.grid(alpha=0.3)
    fig.legend(fontsize=8, frameon=False, ncols=4, loc="outside upper left")
    worst = min(layers, key=lambda x: x["min_sqnr_db"])
    page.figure("fig-verify-layers", fig,
                "Per decoder layer, the weight SQNR verify measured against the reference (dequantized output vs "
                "source tensor): worst and mean module. Points in red fail the threshold. Worst: layer "
                f"{worst['layer']} ({_e(worst.get('worst_module', '?'))}, {worst['min_sqnr_db']:.2f}&nbsp;dB). "
                "These should match the manifest's values in the first figure; the <code>sqnr_vs_manifest</code> "
                "check says whether they do.")


# ---- section: tables --------------------------------------------------------------------------------------
def _section_tables(page: _Page, modules: list[ModuleInfo], manifest: dict) -> None:
    page.section("sec-tables", "Worst modules and fallbacks")
    measured = sorted((m for m in modules if m.sqnr_db is not None), key=lambda m: (m.sqnr_db, m.name))
    if measured:
        page.add(f"<h3>The {min(WORST_MODULES, len(measured))} modules with the lowest SQNR (of {len(measured)})</h3>"
                 "<table><tr><th>module</th><th class=\"num\">layer</th><th class=\"num\">expert</th><th>scheme</th>"
                 "<th>method</th><th class=\"num\">SQNR dB</th><th class=\"num\">tokens</th><th>fallback</th></tr>"
                 + "".join(f"<tr><td class=\"mono\">{_e(m.name)}</td><td class=\"num\">{_e(_fmt_value(m.layer))}</td>"
                           f"<td class=\"num\">{_e(_fmt_value(m.expert))}</td><td class=\"nw\">{_e(m.scheme)}</td>"
                           f"<td>{_e(m.method or '—')}</td><td class=\"num\">{_fmt_db(m.sqnr_db)}</td>"
                           f"<td class=\"num\">{_e(_fmt_value(m.tokens))}</td><td>{_e(m.fallback or '')}</td></tr>"
                           for m in measured[:WORST_MODULES]) + "</table>")
    else:
        page.skip("worst-modules", "No module has an SQNR: nothing to rank.")
    cal = manifest.get("calibration") if isinstance(manifest.get("calibration"), dict) else {}
    fallbacks = cal.get("fallbacks") or {}
    if not fallbacks:
        page.add("<h3>Fallbacks</h3><p class=\"skip\">"
                 + ("No module fell back: every calibrated module saw enough tokens." if cal else
                    "No calibration, so no fallbacks.") + "</p>")
        return
    # one row per expert (its projections usually share the reason), other modules one row each
    tokens = {m.name: m.tokens for m in modules}
    grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, reason in fallbacks.items():
        m = _EXPERT.match(module)
        key = (f"{m['prefix']}.{m['expert']}", str(reason)) if m else (module, str(reason))
        grouped[key].append(m["proj"] if m else "")
    items = sorted(grouped.items(), key=lambda kv: (_layer_of(kv[0][0]) or -1, _natural(kv[0][0])))
    rows = []
    for (owner, reason), projs in items[:MAX_FALLBACK_ROWS]:
        tk = next((tokens.get(f"{owner}.{p}" if p else owner) for p in projs
                   if tokens.get(f"{owner}.{p}" if p else owner) is not None), None)
        rows.append(f"<tr><td class=\"mono\">{_e(owner)}</td><td>{_e(', '.join(p for p in sorted(projs) if p))}</td>"
                    f"<td class=\"num\">{_e(_fmt_value(tk))}</td><td>{_e(reason)}</td></tr>")
    more = len(items) - MAX_FALLBACK_ROWS
    page.add(f"<h3>All fallbacks: {len(fallbacks)} modules in {len(items)} rows</h3>"
             "<table><tr><th>module / expert</th><th>projections</th><th class=\"num\">tokens</th><th>reason</th></tr>"
             + "".join(rows) + "</table>"
             + (f"<p class=\"skip\">... and {more} more rows (all listed in the manifest's calibration.fallbacks).</p>"
                if more > 0 else ""))


def _proj_list(projs: list[str], limit: int) -> str:
    """Projection names for a title or caption: at most MAX_PROJECTIONS, each cut to `limit` characters."""
    shown = ", ".join(_short(p, limit) for p in projs[:MAX_PROJECTIONS])
    return shown + (f", ... ({len(projs):,} names)" if len(projs) > MAX_PROJECTIONS else "")


def _token_count(x) -> float:
    """A routed-token count as drawn: a non-negative number, at most 1e15 (a 1000-digit integer, a negative or
    NaN count from a hostile manifest is drawn as 'no such expert', never an OverflowError)."""
    v = _number(x)
    return -1.0 if v is None or v < 0 else min(v, 1e15)


def _clip_db(x: float) -> float:
    """An SQNR as drawn: within +-SQNR_CAP_DB (verify caps there; 1e308 dB from a hostile file breaks the axes)."""
    return max(-SQNR_CAP_DB, min(float(x), SQNR_CAP_DB))


def _natural(name: str) -> list:
    """Sort key putting experts.2 before experts.10."""
    # (kind, number, text) so numbers and text never compare; a digit run too long for int() stays text
    return [(0, int(t), "") if t.isdigit() and len(t) <= 18 else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _section_input_scales(page: _Page, manifest: dict) -> None:
    """NVFP4 W4A4: the modules whose input_global_scale is not their own calibration's (an expert no calibration
    token reached takes its layer's largest input amax; manifest calibration.input_scale_fallbacks)."""
    cal = manifest.get("calibration") if isinstance(manifest.get("calibration"), dict) else {}
    fb = cal.get("input_scale_fallbacks") or {}
    if not isinstance(fb, dict) or not fb:
        return
    rows = [f"<tr><td class=\"mono\">{_e(m)}</td><td>{_e(str(r.get('source', '')))}</td>"
            f"<td class=\"num\">{_e(_fmt_value(r.get('tokens')))}</td><td>{_e(str(r.get('reason', '')))}</td></tr>"
            for m, r in ((m, r if isinstance(r, dict) else {})
                         for m, r in sorted(fb.items(), key=lambda kv: _natural(kv[0]))[:MAX_FALLBACK_ROWS])]
    more = len(fb) - MAX_FALLBACK_ROWS
    page.add(f"<h3>NVFP4 input scales not from the module's own calibration: {len(fb)} modules</h3>"
             "<table><tr><th>module</th><th>scale from</th><th class=\"num\">tokens</th><th>why</th></tr>"
             + "".join(rows) + "</table>"
             + (f"<p class=\"skip\">... and {more} more (all listed in the manifest's "
                "calibration.input_scale_fallbacks).</p>" if more > 0 else ""))


# ---- section: plan --fit ----------------------------------------------------------------------------------
MAX_FIT_UNITS = 4096  # rows of a recipe's fit record drawn (a 1T model has ~200 units)


def fit_units(manifest: dict) -> list[tuple[int, str, str, int, float]]:
    """(layer, kind, choice, bytes, predicted loss) per unit of the `fit` record in the manifest's recipe (what
    `plan --fit` chose); rows that are not exactly that shape, or not finite, are left out."""
    from ..match.recipe import fit_record

    rec = fit_record(((manifest.get("recipe") or {}) if isinstance(manifest.get("recipe"), dict) else {}).get("text"))
    rows = rec.get("units") if rec else None
    out = []
    for r in (rows if isinstance(rows, list) else [])[:MAX_FIT_UNITS]:
        if not (isinstance(r, list) and len(r) == 5):
            continue
        layer, kind, choice, b, loss = r
        ok = (isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < 1 << 20
              and isinstance(kind, str) and isinstance(choice, str) and len(kind) <= 40 and len(choice) <= 40
              and isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and 0 <= b < 1 << 60
              and isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss) and loss >= 0)
        if ok:
            out.append((layer, kind, choice, int(b), float(loss)))
    return out


def _section_fit(page: _Page, manifest: dict) -> None:
    units = fit_units(manifest)
    if not units:
        return  # not a plan --fit recipe: no section
    page.section("sec-fit", "Chosen per layer (plan --fit)")
    layers = sorted({u[0] for u in units})
    pos = {l: i for i, l in enumerate(layers)}
    choices = sorted({u[2] for u in units})
    palette = ["#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
    colour = {c: palette[i % len(palette)] for i, c in enumerate(choices)}
    fig, axs = _new_figure(4.2, nrows=2, sharex=True)
    bottom_b = [0.0] * len(layers)
    bottom_l = [0.0] * len(layers)
    seen = set()
    for kind_i, kind in enumerate(sorted({u[1] for u in units})):
        for layer, k, choice, b, loss in (u for u in units if u[1] == kind):
            i = pos[layer]
            lab = choice if choice not in seen else None
            seen.add(choice)
            hatch = "//" if kind_i else None
            axs[0, 0].bar(i, b, bottom=bottom_b[i], color=colour[choice], hatch=hatch, label=lab, width=0.8)
            axs[1, 0].bar(i, loss, bottom=bottom_l[i], color=colour[choice], hatch=hatch, width=0.8)
            bottom_b[i] += b
            bottom_l[i] += loss
    from matplotlib.ticker import FuncFormatter

    axs[0, 0].yaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt_bytes(x) if x else "0"))
    axs[0, 0].set_ylabel("bytes")
    axs[1, 0].set_ylabel("predicted loss")
    axs[1, 0].set_xlabel("decoder layer")
    step = max(1, len(layers) // 24)
    axs[1, 0].set_xticks(range(0, len(layers), step))
    axs[1, 0].set_xticklabels([str(layers[i]) for i in range(0, len(layers), step)], fontsize=8)
    axs[0, 0].legend(fontsize=8, ncols=min(4, len(choices)), loc="upper right")
    for ax in axs[:, 0]:
        ax.grid(axis="y", alpha=0.3)
    rec_total = sum(u[3] for u in units)
    cap = (f"What <code>quantkit plan --fit</code> chose for each decoder layer's routed experts (plain) and dense "
           f"Linears (hatched), coloured by scheme: the bytes each unit takes ({_fmt_bytes(rec_total)} in all, the "
           "rest of the model not counted) and the loss predicted for it (its KL to the source when quantized "
           "alone, or the prior where no weights were measured), as recorded in the recipe's <code>fit</code> "
           "mapping.")
    page.figure("fig-fit", fig, cap)
