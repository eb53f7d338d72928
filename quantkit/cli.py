"""The `quantkit` command line: thin. Each command builds options, calls one library function, prints.

Results go to stdout (`--json`: exactly one JSON object); progress, logs and hints go to stderr.
Exit codes: 0 success, 1 domain failure (one line + hint), 2 usage error. QUANTKIT_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .errors import QuantkitError

# compressed-tensors and transformers draw per-module progress bars on stderr while loading; tqdm reads
# this when it is imported, so it is set before anything imports it
os.environ.setdefault("TQDM_DISABLE", "1")

app = typer.Typer(
    name="quantkit", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Quantize large MoE checkpoints (INT4 experts, FP8) into compressed-tensors format, and prove them.",
    epilog="Examples:\n\n  quantkit demo /tmp/qk-demo\n\n  quantkit convert ./Qwen3-30B-A3B ./out --recipe int4-experts-rtn\n\n"
           "  quantkit inspect ./out --json",
)
err = Console(stderr=True, highlight=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (human output goes to stderr).")]


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _progress(description: str, enabled: bool = True):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False, disable=not enabled)


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Source checkpoint directory (config.json + *.safetensors).")],
    out: Annotated[Path, typer.Argument(help="Output directory (must be empty unless --overwrite/--resume).")],
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe name (see `quantkit recipes`) or YAML path.")] = "int4-experts-rtn",
    workers: Annotated[int, typer.Option(min=1, help="Shards processed in parallel (processes).")] = 1,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue an interrupted conversion in OUT.")] = True,
    overwrite: Annotated[bool, typer.Option(help="Delete OUT first if it is not empty.")] = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB.")] = "5GB",
    dataset: Annotated[Optional[str], typer.Option(help="Calibration data for GPTQ/AWQ/KV recipes (default: the "
                                                        "recipe's, then the shipped set).")] = None,
    num_samples: Annotated[Optional[int], typer.Option(min=1, help="Calibration samples.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=1, help="Tokens per calibration sample.")] = None,
    kv_scales: Annotated[Optional[Path], typer.Option(help="FP8 KV-cache scales from `quantkit calibrate`.")] = None,
    json_out: JsonOpt = False,
):
    """Quantize SRC into OUT per RECIPE, streaming shard by shard."""
    from .read import prehash

    prehash.start(src)  # the source shards' sha256, computed while the next import runs
    from .convert import ConvertOptions, convert as run

    gc.freeze()  # the imported modules' objects are permanent: collections scan only what convert makes

    opts = ConvertOptions(recipe=recipe, workers=workers, resume=resume and not overwrite, overwrite=overwrite,
                          max_shard_bytes=_parse_size(max_shard_size), dataset=dataset, num_samples=num_samples,
                          seq_len=seq_len, kv_scales=str(kv_scales) if kv_scales else None)
    with _progress("converting") as prog:
        task = prog.add_task("converting", total=None)
        res = run(src, out, opts, progress=lambda done, total: prog.update(task, completed=done, total=total),
                  log=lambda line: prog.console.print(f"note: {escape(line)}", soft_wrap=True))
    if json_out:
        _print_json(res.to_json())
    else:
        err.print(f"[green]wrote[/] {escape(res.output)}: {res.tensors_quantized} modules quantized, "
                  f"{res.bytes_read / 1e6:.1f} MB -> {res.bytes_written / 1e6:.1f} MB in {res.seconds:.1f} s "
                  f"(peak RSS {res.peak_rss_bytes / 2**20:.0f} MiB)", soft_wrap=True)


@app.command()
def inspect(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint directory.")],
    json_out: JsonOpt = False,
):
    """Show a checkpoint's format and, per scheme, tensor counts and bytes."""
    from .inspect import inspect_checkpoint

    rep = inspect_checkpoint(ckpt)
    if json_out:
        _print_json(rep)
        return
    from rich.table import Table

    q = rep["quantization"]
    err.print(f"{rep['path']}: {rep['model_type']}, {rep['shards']} shard(s), {rep['tensors']} tensors, "
              f"{rep['total_bytes'] / 1e6:.2f} MB; quantization: "
              f"{(q['quant_method'] + ' / ' + str(q['format'])) if q else 'none'}"
              + (f"; manifest: {rep['manifest_status']}" if rep["manifest_status"] else ""))
    t = Table("scheme", "modules", "tensors", "bytes", "share")
    for label, s in rep["schemes"].items():
        t.add_row(label, str(s["modules"] or ""), str(s["tensors"]), f"{s['bytes']:,}",
                  f"{100 * s['bytes'] / max(rep['total_bytes'], 1):.1f}%")
    Console().print(t)


@app.command()
def calibrate(
    model: Annotated[Path, typer.Argument(help="Checkpoint directory (BF16, block-FP8 or INT4 compressed-tensors).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the scales (.safetensors).")],
    dataset: Annotated[Optional[str], typer.Option(help="Calibration data: .jsonl/.json/.txt/.parquet, a save_to_disk "
                                                        "folder or a hub id. Default: the shipped set.")] = None,
    num_samples: Annotated[Optional[int], typer.Option(min=1, help="Samples to draw.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=1, help="Tokens per sample.")] = None,
    strategy: Annotated[str, typer.Option(help="tensor (one scale per layer) or attn_head (one per KV head).")] = "tensor",
    json_out: JsonOpt = False,
):
    """Measure FP8 KV-cache scales on what the engine caches (post-RoPE K, V; the MLA latent), layer by layer."""
    from .calibrate import DEFAULT_NUM_SAMPLES, DEFAULT_SEQ_LEN, calibrate as run, write_scales

    with _progress("calibrating", enabled=True) as prog:
        task = prog.add_task("layers", total=None)
        res = run(model, dataset=dataset, num_samples=num_samples or DEFAULT_NUM_SAMPLES,
                  seq_len=seq_len or DEFAULT_SEQ_LEN, strategy=strategy,
                  progress=lambda i, n: prog.update(task, completed=i + 1, total=n))
    write_scales(res, output)
    if json_out:
        _print_json(res.to_json())
    else:
        err.print(f"[green]wrote[/] {output}: {len(res.layers)} layers, strategy {res.strategy}, "
                  f"{res.data['num_samples']} samples x {res.data['seq_len']} tokens in {res.seconds:.1f} s")


@app.command()
def verify(
    qmodel: Annotated[Path, typer.Argument(help="A checkpoint written by `quantkit convert`.")],
    reference: Annotated[Optional[Path], typer.Option(help="The source checkpoint, for the numeric checks.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Token data for the model-level metrics.")] = None,
    num_samples: Annotated[int, typer.Option(min=1, help="Samples for the model-level metrics.")] = 8,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per sample.")] = 128,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kernels: Annotated[str, typer.Option(help="torch, or triton to also check the runtime's INT4 GEMM.")] = "torch",
    max_kl: Annotated[Optional[float], typer.Option(help="Maximum mean next-token KL (default 0.05).")] = None,
    min_top1: Annotated[Optional[float], typer.Option(help="Minimum top-1 agreement (default 0.85).")] = None,
    max_ppl_ratio: Annotated[Optional[float], typer.Option(help="Maximum perplexity ratio (default 1.10).")] = None,
    min_sqnr_db: Annotated[Optional[float], typer.Option(help="Minimum weight SQNR, dB (default 10).")] = None,
    max_sqnr_drift_db: Annotated[Optional[float], typer.Option(help="Maximum SQNR drift vs the manifest, dB (default 0.1).")] = None,
    min_generation_agreement: Annotated[Optional[float], typer.Option(help="Minimum greedy agreement (default 0.8).")] = None,
    json_out: JsonOpt = False,
):
    """Check a converted checkpoint: shard hashes, format, and numerics against the reference. Exit 1 on failure."""
    from .verify import Thresholds, verify as run

    if device not in ("cpu", "cuda") or kernels not in ("torch", "triton"):
        raise typer.BadParameter("--device is cpu or cuda; --kernels is torch or triton")
    th = Thresholds().with_overrides(max_kl=max_kl, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio,
                                     min_sqnr_db=min_sqnr_db, max_sqnr_drift_db=max_sqnr_drift_db,
                                     min_generation_agreement=min_generation_agreement)
    rep = run(qmodel, reference=reference, dataset=dataset, num_samples=num_samples, seq_len=seq_len, device=device,
              kernels=kernels, thresholds=th, progress=lambda step: err.print(f"  {step}"))
    doc = rep.to_json()
    if json_out:
        _print_json(doc)
    else:
        for c in rep.checks:
            mark = "[green]ok[/]" if c.ok else ("[yellow]skipped[/]" if c.ok is None else "[red]FAILED[/]")
            err.print(f"{mark} {c.name}: {c.detail}")
    if not rep.passed:
        failed = rep.failed_checks()
        err.print(f"[red]error:[/] verification failed: {', '.join(c.name for c in failed) or 'see report'}")
        err.print("hint: see the checks above (or --json); re-run convert for integrity failures", markup=False)
        raise typer.Exit(1)


@app.command()
def plan(
    model_or_config: Annotated[str, typer.Argument(help="config.json, a checkpoint directory, or a shipped reference "
                                                        "config: kimi-k2, glm-4.5, glm-5.")],
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Predict the checkpoint `convert` would write.")] = None,
    gpu_memory_gib: Annotated[float, typer.Option(min=1, help="Memory per GPU, GiB.")] = 80,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs.")] = 8,
    tp: Annotated[Optional[int], typer.Option(min=1, help="Tensor-parallel size (default: all GPUs).")] = None,
    context_len: Annotated[int, typer.Option(min=1, help="Tokens per request for the concurrency figure.")] = 131072,
    activation_reserve_gib: Annotated[Optional[float], typer.Option(help="Memory kept free per GPU for activations, GiB.")] = None,
    json_out: JsonOpt = False,
):
    """Explain the memory: parameters by role, checkpoint bytes per recipe, KV bytes per token, resident
    tokens and concurrency."""
    from .plan import plan as run, render

    rep = run(model_or_config, recipe, gpu_memory_gib=gpu_memory_gib, gpus=gpus, context_len=context_len,
              activation_reserve_gib=activation_reserve_gib, tp=tp)
    if json_out:
        _print_json(rep.to_json())
    else:
        render(rep, Console())


@app.command()
def recipes():
    """List the shipped recipes."""
    from .match.recipe import load_recipe, shipped_recipes

    for name in shipped_recipes():
        r = load_recipe(name)
        Console().print(f"[bold]{name}[/]: {' '.join(r.description.split())}")


@app.command()
def demo(
    out: Annotated[Path, typer.Argument(help="Directory for the demo (tiny source model + converted output).")],
    arch: Annotated[str, typer.Option(help="Tiny model architecture to generate.")] = "qwen3_moe",
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    json_out: JsonOpt = False,
):
    """Run the whole pipeline on a tiny generated MoE model (no downloads)."""
    from .demo import run_demo

    rep = run_demo(out, arch=arch, overwrite=overwrite, log=lambda m: err.print(escape(m), soft_wrap=True))
    if json_out:
        _print_json(rep)


def _parse_size(s: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = s.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise typer.BadParameter(f"cannot parse size {s!r}; use e.g. 500MB or 5GB")
    return int(value * units[unit])


def _show_warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"warning: {escape(str(message))}", soft_wrap=True)  # one line, no source excerpt


def main(argv: Optional[list[str]] = None) -> None:
    debug = os.environ.get("QUANTKIT_DEBUG") == "1"
    if not debug:
        import warnings

        warnings.showwarning = _show_warning
    try:
        # standalone mode: click itself turns usage errors into exit code 2 with its usage message
        app(args=argv, prog_name="quantkit")
    except KeyboardInterrupt:
        err.print("interrupted; run the same command again to resume")
        sys.exit(130)
    except QuantkitError as e:
        if debug:
            raise
        err.print(f"[red]error:[/] {escape(e.message)}", markup=True, soft_wrap=True)  # names are hostile: no markup
        if e.hint:
            err.print(f"hint: {e.hint}", soft_wrap=True, markup=False)
        sys.exit(1)
    except OSError as e:
        if debug:
            raise
        err.print(f"[red]error:[/] {escape(str(e.strerror or e))}{': ' + escape(str(e.filename)) if e.filename else ''}",
                  soft_wrap=True)
        err.print("hint: check the path and permissions; QUANTKIT_DEBUG=1 shows the traceback", markup=False)
        sys.exit(1)
    except Exception as e:  # a bug: still one line unless debugging
        if debug:
            raise
        err.print(f"[red]internal error:[/] {type(e).__name__}: {escape(str(e)[:300])}", soft_wrap=True)
        err.print("hint: re-run with QUANTKIT_DEBUG=1 for the traceback and report it", markup=False)
        sys.exit(1)


def entry() -> None:
    """The `quantkit` command: `main()`, and after a successful command, leave without tearing the
    interpreter down (unloading torch and friends takes ~0.5 s here; every file is already written,
    fsynced and closed, and the output streams are flushed below). Failures exit normally."""
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    entry()
