"""`quantkit plan` for people: the report as rich tables."""

from __future__ import annotations

from .kv import KV_DTYPES
from .tensors import ROLES

GIB = 1 << 30


def _gb(n: int | None) -> str:
    """Decimal and binary units side by side (vendors quote GB, allocators GiB)."""
    if n is None:
        return "-"
    if n >= 10**9:
        return f"{n / 1e9:,.1f} GB ({n / GIB:,.1f} GiB)"
    if n >= 10**6:
        return f"{n / 1e6:,.2f} MB ({n / (1 << 20):,.2f} MiB)"
    return f"{n:,} B"


def _count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:,.2f}{unit}"
    return str(n)


def render(report, console) -> None:
    """Draw the report as rich tables on `console` (a rich.console.Console)."""
    from rich.table import Table

    r = report
    title = f"{r.model} ({r.model_type}, source {r.source_format}" + (f", recipe {r.recipe})" if r.recipe else ")")
    t = Table(title=f"Parameters and checkpoint bytes: {title}", title_justify="left")
    t.add_column("role")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    t.add_column("source bytes", justify="right")
    if r.recipe:
        t.add_column("recipe bytes", justify="right")
    total = r.parameters["total"] or 1
    for role in ROLES:
        n = r.parameters.get(role, 0)
        b = r.bytes_by_role.get(role)
        if not n and not b:
            continue
        row = [role, _count(n), f"{100 * n / total:.1f}%", _gb(b["source"]) if b else "-"]
        if r.recipe:
            row.append(_gb(b["recipe"]) if b else "-")
        t.add_row(*row)
    row = ["total", _count(r.parameters["total"]), "100%", _gb(r.checkpoint_bytes["source"])]
    if r.recipe:
        row.append(_gb(r.checkpoint_bytes["recipe"]))
    t.add_row(*row, style="bold")
    console.print(t)
    console.print(f"active parameters per token: {_count(r.active_parameters)}"
                  + (f"; recipe checkpoint is {r.checkpoint_bytes['recipe'] / r.checkpoint_bytes['source']:.1%} "
                     "of the source" if r.recipe else ""))

    kv = Table(title=f"KV cache on {r.gpus} x {r.gpu_memory_gib:g} GiB, tp={r.tp}, context {r.context_len:,}",
               title_justify="left")
    for c in ("KV dtype", "bytes/token", "per GPU", "resident tokens", "vs bf16", "max concurrency"):
        kv.add_column(c, justify="left" if c == "KV dtype" else "right")
    base = r.kv_tokens["bfloat16"] or 0
    for d in KV_DTYPES:
        b = r.kv_bytes_per_token[d]
        if b is None:
            continue
        tok = r.kv_tokens[d] or 0
        kv.add_row(d + (" *" if d == r.kv_dtype else ""), f"{b:,}", f"{r.kv_bytes_per_token_per_gpu[d]:,}",
                   f"{tok:,}", f"{tok / base:.3f}x" if base else "-", f"{r.max_concurrency[d]:,}")
    console.print(kv)
    console.print(f"per GPU: {r.gpu_memory_gib:g} GiB - weights {r.weight_bytes_per_gpu / GIB:,.2f} GiB - reserve "
                  f"{r.activation_reserve_gib:g} GiB = KV budget {r.kv_budget_bytes_per_gpu / GIB:,.2f} GiB")
    for w in r.warnings:
        console.print(f"[bold red]warning:[/] {w}")
    console.print("assumptions:")
    for a in r.assumptions:
        console.print(f"  - {a}", highlight=False)
    if getattr(r, "calibration", None) is not None:
        render_calibration(r.calibration, console)


def _secs(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:,.2f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    return f"{s:,.2f} s"


def render_calibration(c, console) -> None:
    """The calibration cost (plan/calibration.py) as a table of components, then memory and assumptions."""
    from rich.table import Table

    if not c.calibrated:
        for w in c.warnings:
            console.print(f"calibration: {w}", highlight=False)
        return
    where = f"{c.world_size} x {c.device}" + (" rank" if c.world_size == 1 else " ranks")
    t = Table(title=f"Calibration cost: {c.recipe} ({', '.join(c.methods)}) on {c.num_samples} x {c.seq_len} tokens, "
                    f"{where} ({c.dtype}), {c.calibrated_layers} of {c.layers} layers calibrated",
              title_justify="left")
    t.add_column("component")
    t.add_column("wall", justify="right")
    t.add_column("share", justify="right")
    total = c.total_seconds or 1.0
    for k, v in c.seconds.items():
        t.add_row(k, _secs(v), f"{100 * v / total:.1f}%")
    t.add_row("calibration total", _secs(c.total_seconds), "100%", style="bold")
    t.add_row("then: writing the output", _secs(c.convert_output_seconds), "")
    console.print(t)
    mem = f"device memory per rank: {_gb(c.device_memory_bytes)} (the executor's plan, the busiest rank's statistics)"
    if c.fits is not None:
        mem += "; fits" if c.fits else "; DOES NOT FIT"
    console.print(mem, highlight=False)
    console.print(f"host RAM per rank: {_gb(c.host_ram_bytes)} ("
                  + ", ".join(f"{k} {_gb(v)}" for k, v in c.host_ram.items()) + ")", highlight=False)
    if c.communication_bytes:
        console.print("between ranks, per rank: " + ", ".join(f"{k.replace('_', ' ')} {_gb(v)}"
                                                             for k, v in c.communication_bytes.items()),
                      highlight=False)
    k = c.constants
    console.print(f"constants ({k.get('kind')}): {k.get('provenance', '').upper()}: {k.get('source')}", highlight=False)
    for w in c.warnings:
        console.print(f"[bold red]warning:[/] {w}")
    console.print("calibration assumptions:")
    for a in c.assumptions:
        console.print(f"  - {a}", highlight=False)


def render_fit(result, out: str, console) -> None:
    """`plan --fit`: the arithmetic, the choice per unit (bytes, predicted loss, the candidates it beat), and the
    uniform mixes beside it, on `console`."""
    from rich.table import Table

    for line in result.arithmetic:
        console.print(f"fit: {line}", highlight=False)
    t = Table(title=f"chosen per layer ({result.loss_source} loss) -> {out}", title_justify="left")
    for col in ("layer", "unit", "choice", "bytes", "predicted loss", "candidates (bytes, loss)"):
        t.add_column(col, justify="right" if col in ("layer", "bytes", "predicted loss") else "left")
    for u in result.units:
        others = ", ".join(f"{c} {b / 2**20:.2f} MiB {loss:.2e}" for c, (b, loss) in
                           sorted(u.options.items(), key=lambda kv: kv[1][0]) if c != u.choice)
        t.add_row(str(u.layer), u.kind, u.choice, _gb(u.bytes), f"{u.loss:.3e}", others)
    console.print(t)
    fits = [r for r in result.uniform if r["fits"]]
    best = min(fits, key=lambda r: r["predicted_loss"]) if fits else None
    console.print(f"fit: weights {_gb(result.weights_bytes)} of {_gb(result.budget_bytes)} allowed; predicted loss "
                  f"{result.predicted_loss:.3e}" + (f"; best uniform mix that fits: routed {best['routed']}, dense "
                                                   f"{best['dense']}, predicted {best['predicted_loss']:.3e}"
                                                   if best else "; no uniform mix fits"), highlight=False)
    for c, why in result.dropped.items():
        console.print(f"fit: {c} not a candidate here: {why}", highlight=False)
