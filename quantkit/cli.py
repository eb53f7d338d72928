"""The `quantkit` command line: thin. Each command builds options, calls one library function, prints.

Results go to stdout (`--json`: exactly one JSON object); progress, logs and hints go to stderr.
Exit codes: 0 success, 1 domain failure (one line + hint), 2 usage error, 3 `verify --run`: the engine cannot run the
checkpoint on this machine (one line: what and why). QUANTKIT_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import allocator, dist, options
from .errors import QuantkitError
from .options import Thresholds

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

# ---- option aliases shared by the commands (defaults: quantkit/options.py) ---------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (human output goes to stderr).")]
RevisionOpt = Annotated[Optional[str], typer.Option(help="Branch, tag or commit of a hub id (default: main).")]
DatasetOpt = Annotated[Optional[str], typer.Option(
    help="Calibration data: .jsonl/.json/.txt/.parquet, a save_to_disk folder or a hub dataset id (default: the "
         "recipe's, then the shipped set).")]
NumSamplesOpt = Annotated[Optional[int], typer.Option(
    min=1, max=options.MAX_NUM_SAMPLES,
    help=f"Calibration samples (default: the recipe's, then {options.NUM_SAMPLES}).")]
SeqLenOpt = Annotated[Optional[int], typer.Option(
    min=1, max=options.MAX_SEQ_LEN,
    help=f"Tokens per calibration sample (default: the recipe's, then {options.SEQ_LEN}).")]
DeviceOpt = Annotated[str, typer.Option(
    help=f"Where calibration computes: {options.DEVICE_CHOICES} (auto: the first GPU torch sees, else the CPU; "
         "on a GPU the layer runs in bfloat16 and its peak memory is checked before any work).")]
ComputeDtypeOpt = Annotated[str, typer.Option(
    "--compute-dtype", help=f"What calibration's layers compute in: {'|'.join(options.COMPUTE_DTYPE_CHOICES)} (auto: "
    "float32 on the CPU, bfloat16 on a GPU; on a CPU with bfloat16 instructions bfloat16 speeds up forward-bound "
    "passes such as KV scales, not GPTQ: docs/calibration.md). Statistics and solves are float32 or wider either "
    "way.")]


def _device(value: str) -> str:
    """--device spelled right (a usage error otherwise); whether it exists is the library's to say."""
    try:
        return options.parse_device(value)
    except QuantkitError as e:
        raise typer.BadParameter(e.message, param_hint="--device") from None


def _compute_dtype(value: str) -> str:
    """--compute-dtype spelled right (a usage error otherwise)."""
    try:
        return options.parse_compute_dtype(value)
    except QuantkitError as e:
        raise typer.BadParameter(e.message, param_hint="--compute-dtype") from None


def _in_range(value, option: str, lo: float, hi: float, *, integer: bool, lo_open: bool = False):
    """A numeric option's value as click parsed it, held to a finite number (an int where `integer`) in [lo, hi]
    ((lo, hi] where `lo_open`); None (an optional option left unset) passes. Anything else (NaN, infinities,
    1e400 read as infinity, a huge or out-of-range number) is a usage error naming the option, as _parse_size's."""
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if ok and not isinstance(value, bool) and (integer or math.isfinite(value)):
        if (lo < value if lo_open else lo <= value) and value <= hi:
            return value
    shown = f"<a {value.bit_length()}-bit integer>" if isinstance(value, int) and abs(value) >= 10**40 else repr(value)
    what = "an integer" if integer else "a finite number"
    raise typer.BadParameter(f"must be {what} in {'(' if lo_open else '['}{lo}, {hi}], got {shown[:40]}",
                             param_hint=option)


def _ranged(option: str, lo: float, hi: float, *, integer: bool, lo_open: bool = False):
    """The typer callback of `_in_range` for `option`."""
    return lambda value: _in_range(value, option, lo, hi, integer=integer, lo_open=lo_open)


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _progress(description: str, enabled: bool = True):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False, disable=not enabled)


def _source(name: str, revision: str | None) -> Path:
    """A checkpoint argument: a local directory, or a hub id resolved to its snapshot (quantkit/hub.py)."""
    from .hub import resolve_source

    return resolve_source(name, revision, log=lambda m: err.print(f"note: {escape(m)}", soft_wrap=True))


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Source checkpoint: a directory (config.json + *.safetensors) or a hub id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must be empty unless --overwrite/--resume).")],
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe name (see `quantkit recipes`) or YAML path.")] = options.RECIPE,
    workers: Annotated[int, typer.Option(min=1, help="Shards processed in parallel (processes).")] = options.WORKERS,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue an interrupted conversion in OUT.")] = True,
    overwrite: Annotated[bool, typer.Option(help="Delete OUT first if it is not empty.")] = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB (10^9 bytes) or 4GiB.")] = options.MAX_SHARD_SIZE,
    dataset: DatasetOpt = None,
    num_samples: NumSamplesOpt = None,
    seq_len: SeqLenOpt = None,
    kv_scales: Annotated[Optional[Path], typer.Option(help="FP8 KV-cache scales from `quantkit calibrate`.")] = None,
    device: DeviceOpt = options.DEVICE,
    compute_dtype: ComputeDtypeOpt = options.COMPUTE_DTYPE,
    revision: RevisionOpt = None,
    tp: Annotated[Optional[int], typer.Option(min=1, help="Tensor-parallel size the output will be served at: W4AFP8 recipes are refused up front when vLLM cannot load them at it (default: checked at 1).")] = None,
    allow_unmatched: Annotated[bool, typer.Option("--allow-unmatched", help="Write the output even when the recipe's weight groups match no module of SRC (an error otherwise).")] = False,
    pair: Annotated[Optional[str], typer.Option("--pair", help="Also write the prefill checkpoint of a prefill/decode pair with this recipe (fp8-prefill): OUT is the decode half; both get the same KV-cache scales and record each other (docs/recipes.md).")] = None,
    pair_out: Annotated[Optional[Path], typer.Option("--pair-out", help="Where --pair writes the prefill checkpoint (default: OUT-prefill).")] = None,
    json_out: JsonOpt = False,
):
    """Quantize SRC into OUT per RECIPE, streaming shard by shard."""
    if pair_out is not None and pair is None:
        raise typer.BadParameter("--pair-out needs --pair", param_hint="--pair-out")
    max_shard_bytes = _parse_size(max_shard_size)  # a usage error (exit 2) before anything else
    device, compute_dtype = _device(device), _compute_dtype(compute_dtype)
    src_dir = _source(src, revision)
    from .read import prehash

    prehash.start(src_dir, *dist.launched())  # this rank's source shards' sha256, while the next import runs
    from .convert import ConvertOptions, convert as run

    gc.freeze()  # the imported modules' objects are permanent: collections scan only what convert makes

    opts = ConvertOptions(recipe=recipe, workers=workers, resume=resume and not overwrite, overwrite=overwrite,
                          max_shard_bytes=max_shard_bytes, dataset=dataset, num_samples=num_samples,
                          seq_len=seq_len, kv_scales=str(kv_scales) if kv_scales else None,
                          source_id=None if Path(src).exists() else src, device=device,
                          compute_dtype=compute_dtype, tp=tp,
                          allow_unmatched=allow_unmatched)
    leader = os.environ.get("RANK", "0") in ("0", "")  # under torchrun only rank 0 shows progress and results
    with _progress("converting", enabled=leader) as prog:
        task = prog.add_task("converting", total=None)
        kw = dict(progress=lambda done, total: prog.update(task, completed=done, total=total),
                  log=lambda line: prog.console.print(f"note: {escape(line)}", soft_wrap=True) if leader else None)
        if pair is not None:
            from .convert.pair import convert_pair

            pres = convert_pair(src_dir, out, opts, pair, pair_out, **kw)
        else:
            res = run(src_dir, out, opts, **kw)
    if not leader:
        return
    if pair is not None:
        if json_out:
            _print_json(pres.to_json())
        else:
            for role, r in (("decode", pres.decode), ("prefill", pres.prefill)):
                err.print(f"[green]wrote[/] {escape(r['output'])} ({role}): {r['tensors_quantized']} modules quantized, "
                          f"{r['bytes_written'] / 1e6:.1f} MB in {r['seconds']:.1f} s", soft_wrap=True)
            err.print(f"both hold the same KV-cache scales (sha256 {pres.kv_shard_sha256[:16]}...)")
        return
    if json_out:
        _print_json(res.to_json())
    else:
        err.print(f"[green]wrote[/] {escape(res.output)}: {res.tensors_quantized} modules quantized, "
                  f"{res.bytes_read / 1e6:.1f} MB -> {res.bytes_written / 1e6:.1f} MB in {res.seconds:.1f} s "
                  f"(peak RSS {res.peak_rss_bytes / 2**20:.0f} MiB)", soft_wrap=True)


@app.command()
def inspect(
    ckpt: Annotated[str, typer.Argument(help="Checkpoint directory or hub id.")],
    revision: RevisionOpt = None,
    json_out: JsonOpt = False,
):
    """Show a checkpoint's format and, per scheme, tensor counts and bytes."""
    from .inspect import inspect_checkpoint

    rep = inspect_checkpoint(_source(ckpt, revision))
    if json_out:
        _print_json(rep)
        return
    from rich.table import Table

    q = rep["quantization"]
    shown = lambda v: escape(str(v)[:80])  # noqa: E731  config and manifest strings are the checkpoint's, not markup
    err.print(f"{shown(rep['path'])}: {shown(rep['model_type'])}, {rep['shards']} shard(s), {rep['tensors']} tensors, "
              f"{rep['total_bytes'] / 1e6:.2f} MB; quantization: "
              f"{(shown(q['quant_method']) + ' / ' + shown(q['format'])) if q else 'none'}"
              + (f"; manifest: {shown(rep['manifest_status'])}" if rep["manifest_status"] else ""), soft_wrap=True)
    t = Table("scheme", "modules", "tensors", "bytes", "share")
    for label, s in rep["schemes"].items():
        t.add_row(escape(label), str(s["modules"] or ""), str(s["tensors"]), f"{s['bytes']:,}",
                  f"{100 * s['bytes'] / max(rep['total_bytes'], 1):.1f}%")
    Console().print(t)


@app.command()
def calibrate(
    model: Annotated[str, typer.Argument(help="Checkpoint directory or hub id (BF16, block-FP8 or INT4 compressed-tensors).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the scales (.safetensors).")],
    dataset: DatasetOpt = None,
    num_samples: NumSamplesOpt = None,
    seq_len: SeqLenOpt = None,
    strategy: Annotated[str, typer.Option(help="tensor (one scale per layer) or attn_head (one per KV head).")] = options.KV_STRATEGY,
    device: DeviceOpt = options.DEVICE,
    compute_dtype: ComputeDtypeOpt = options.COMPUTE_DTYPE,
    revision: RevisionOpt = None,
    json_out: JsonOpt = False,
):
    """Measure FP8 KV-cache scales on what the engine caches (post-RoPE K, V; the MLA latent), layer by layer."""
    device, compute_dtype = _device(device), _compute_dtype(compute_dtype)
    model_dir = _source(model, revision)
    from .calibrate import CalibrateOptions, calibrate as run, write_scales

    opts = CalibrateOptions(dataset=dataset, num_samples=num_samples or options.NUM_SAMPLES,
                            seq_len=seq_len or options.SEQ_LEN, strategy=strategy, device=device, dtype=compute_dtype)
    with _progress("calibrating", enabled=True) as prog:
        task = prog.add_task("layers", total=None)
        res = run(model_dir, opts, progress=lambda i, n: prog.update(task, completed=i + 1, total=n),
                  log=lambda line: prog.console.print(f"note: {escape(line)}", soft_wrap=True))
    write_scales(res, output)
    if json_out:
        _print_json(res.to_json())
    else:
        err.print(f"[green]wrote[/] {output}: {len(res.layers)} layers, strategy {res.strategy}, "
                  f"{res.data['num_samples']} samples x {res.data['seq_len']} tokens in {res.seconds:.1f} s")
    _kv_use_notes(model_dir)


def _kv_use_notes(model_dir) -> None:
    """Say which calibrated KV scales vLLM does not use for this model (MLA v_scale; DSA's fp8_ds_mla cache)."""
    from .engine.vllm_config import kv_scale_use_notes
    from .errors import QuantkitError
    from .read.checkpoint import read_json_file

    try:
        config = read_json_file(Path(model_dir) / "config.json", "config.json")
    except QuantkitError:
        return
    for n in kv_scale_use_notes(config if isinstance(config, dict) else {}):
        err.print(f"note: {n}", soft_wrap=True, markup=False)


def _threshold_options(command):
    """Add one `--<name>` option per `Thresholds` field to `command` (default None: keep the library's
    default; help text and default from options.Thresholds), collected into `thresholds=`."""
    import functools
    import inspect as pyinspect
    import typing

    hints = typing.get_type_hints(command, include_extras=True)
    sig = pyinspect.signature(command)
    sig = sig.replace(parameters=[p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()])
    extra = []
    for name, default, help_ in Thresholds.options():
        opt = typer.Option(f"--{name.replace('_', '-')}", help=f"{help_[0].upper()}{help_[1:]} (default {default:g}).")
        extra.append(pyinspect.Parameter(name, pyinspect.Parameter.KEYWORD_ONLY, default=None,
                                         annotation=Annotated[Optional[float], opt]))
    params = [p for p in sig.parameters.values() if p.name != "thresholds"]

    @functools.wraps(command)
    def wrapper(**kw):
        th = Thresholds().with_overrides(**{name: kw.pop(name) for name, _, _ in Thresholds.options()})
        return command(thresholds=th, **kw)

    wrapper.__signature__ = sig.replace(parameters=params + extra)
    return wrapper


@app.command()
@_threshold_options
def verify(
    qmodel: Annotated[Path, typer.Argument(help="A checkpoint written by `quantkit convert`.")],
    reference: Annotated[Optional[str], typer.Option(help="The source checkpoint (directory or hub id), for the "
                                                          "numeric checks.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Token data for the model-level metrics.")] = None,
    num_samples: Annotated[int, typer.Option(min=1, max=options.MAX_NUM_SAMPLES, help="Samples for the model-level metrics.")] = options.VERIFY_NUM_SAMPLES,
    seq_len: Annotated[int, typer.Option(min=2, max=options.MAX_SEQ_LEN, help="Tokens per sample.")] = options.VERIFY_SEQ_LEN,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = options.VERIFY_DEVICE,
    kernels: Annotated[str, typer.Option(help="torch, or triton to also check the runtime's INT4 GEMM.")] = options.VERIFY_KERNELS,
    engine: Annotated[Optional[str], typer.Option(help="vllm: also check the rules vLLM applies when it loads "
                                                       "the checkpoint (no vLLM needed); llama.cpp: with --run, run "
                                                       "a GGUF from quantkit export in llama.cpp.")] = None,
    tp: Annotated[int, typer.Option(min=1, help="Tensor parallelism the engine rules are checked at.")] = options.VERIFY_TP,
    run_engine: Annotated[bool, typer.Option("--run", help="With --engine vllm: also run QMODEL in vLLM and measure it "
                                                           "there (perplexity, top-1, greedy agreement against the "
                                                           "reference; the KV scales vLLM holds); with --engine "
                                                           "llama.cpp, run the GGUF QMODEL in llama.cpp (KL too). Exit "
                                                           "3 when the engine cannot run it on this machine.")] = False,
    engine_python: Annotated[Optional[Path], typer.Option(help="The python (or venv directory) vLLM / llama-cpp-python is installed in, "
                                                               "for --run (default: this one).")] = None,
    engine_timeout: Annotated[int, typer.Option(min=1, help="Seconds --run may take in vLLM.")] = 3600,
    engine_kv_cache_dtype: Annotated[str, typer.Option(help="vLLM's --kv-cache-dtype for --run (served: as the model "
                                                            "card serves it, fp8 when the checkpoint has KV scales; "
                                                            "or auto, bfloat16, fp8).")] = "served",
    save: Annotated[bool, typer.Option("--save/--no-save", help="Keep the report in QMODEL (verify.json) and refresh "
                                                                "its model card.")] = True,
    pair: Annotated[Optional[Path], typer.Option("--pair", help="The prefill checkpoint of a prefill/decode pair "
                                                              "(convert --pair) whose decode half is QMODEL: refused "
                                                              "unless both share the source and the KV scales bit for "
                                                              "bit; with --reference, measured as served (FP8 prefill "
                                                              "into the KV cache, decode reading it).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="With a GGUF: the quantkit checkpoint it was exported "
                                                            "from; the reference is then that checkpoint as "
                                                            "transformers runs it, and KL(source || checkpoint) is "
                                                            "reported beside KL(checkpoint || llama.cpp).")] = None,
    revision: RevisionOpt = None,
    json_out: JsonOpt = False,
    thresholds: Thresholds = Thresholds(),
):
    """Check a converted checkpoint: shard hashes, format, and numerics against the reference. Exit 1 on failure;
    with --engine vllm --run, exit 3 when every check passed but this vLLM build cannot run it on this machine."""
    from .verify import EngineRun, VerifyOptions, verify as run

    if device not in ("cpu", "cuda") or kernels not in ("torch", "triton"):
        raise typer.BadParameter("--device is cpu or cuda; --kernels is torch or triton")
    if engine not in (None, "vllm", "llama.cpp"):
        raise typer.BadParameter("--engine is vllm or llama.cpp", param_hint="--engine")
    if qmodel.is_file() or qmodel.suffix == ".gguf":
        if engine != "llama.cpp" or not run_engine or reference is None:
            raise typer.BadParameter("a GGUF is verified by running it: --engine llama.cpp --run --reference SRC",
                                     param_hint="QMODEL")
        opts = VerifyOptions(dataset=dataset, num_samples=num_samples, seq_len=seq_len, device=device,
                             thresholds=thresholds, engine_run=EngineRun(python=engine_python, timeout=engine_timeout))
        return _verify_gguf(qmodel, _source(reference, revision), checkpoint, opts, json_out)
    if engine == "llama.cpp":
        raise typer.BadParameter("--engine llama.cpp runs a GGUF: pass the .gguf written by quantkit export",
                                 param_hint="--engine")
    if checkpoint is not None:
        raise typer.BadParameter("--checkpoint goes with a GGUF (the checkpoint it was exported from)",
                                 param_hint="--checkpoint")
    if run_engine and engine != "vllm":
        raise typer.BadParameter("--run needs --engine vllm or llama.cpp", param_hint="--run")
    ref = _source(reference, revision) if reference is not None else None
    engine_run = (EngineRun(python=engine_python, timeout=engine_timeout, kv_cache_dtype=engine_kv_cache_dtype)
                  if run_engine else None)
    rep = run(qmodel, VerifyOptions(reference=ref, dataset=dataset, num_samples=num_samples, seq_len=seq_len,
                                    device=device, kernels=kernels, thresholds=thresholds, engine=engine, tp=tp,
                                    engine_run=engine_run, pair=pair),
              progress=lambda step: err.print(f"  {step}"))
    doc = rep.to_json()
    if save and rep.integrity.get("ok"):
        _save_verify(qmodel, doc, reference)
    if json_out:
        _print_json(doc)
    else:
        for c in rep.checks:
            mark = "[green]ok[/]" if c.ok else ("[yellow]skipped[/]" if c.ok is None else "[red]FAILED[/]")
            err.print(f"{mark} {c.name}: {escape(c.detail)}")
        for w in (rep.engine or {}).get("warnings", []):
            err.print(f"[yellow]warning[/] ({w['rule']}) {escape(w['where'])}: {escape(w['detail'])}", soft_wrap=True)
    if not rep.passed:
        failed = rep.failed_checks()
        err.print(f"[red]error:[/] verification failed: {', '.join(c.name for c in failed) or 'see report'}")
        err.print("hint: see the checks above (or --json); re-run convert for integrity failures", markup=False)
        raise typer.Exit(1)
    if (rep.engine_run or {}).get("status") == "cannot_run":
        from .verify.vllm_run import EXIT_CANNOT_RUN

        err.print(rep.engine_run["line"], soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_CANNOT_RUN)


def _verify_gguf(gguf: Path, reference: Path, checkpoint: Path | None, opts, json_out: bool) -> None:
    """verify OUT.gguf --engine llama.cpp --run --reference SRC [--checkpoint QMODEL], `opts` a VerifyOptions."""
    from .verify.llamacpp_run import run_gguf

    doc = run_gguf(gguf, reference, checkpoint, opts, say=lambda step: err.print(f"  {step}"))
    if json_out:
        _print_json(doc)
    else:
        for c in doc["checks"]:
            mark = "[green]ok[/]" if c["ok"] else ("[yellow]skipped[/]" if c["ok"] is None else "[red]FAILED[/]")
            err.print(f"{mark} {c['name']}: {escape(c['detail'])}")
    if not doc["passed"]:
        err.print(f"[red]error:[/] verification failed: {', '.join(c['name'] for c in doc['checks'] if c['ok'] is False)}")
        raise typer.Exit(1)
    if doc["engine_run"].get("status") == "cannot_run":
        from .verify.vllm_run import EXIT_CANNOT_RUN

        err.print(doc["engine_run"]["line"], soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_CANNOT_RUN)


@app.command("export")
def export_gguf(
    qmodel: Annotated[Path, typer.Argument(help="A checkpoint written by quantkit convert (or a compressed-tensors "
                                                "one quantkit reads).")],
    out: Annotated[Path, typer.Argument(help="The GGUF to write (a name ending in .gguf).")],
    split_max_size: Annotated[Optional[str], typer.Option(help="Split into llama.cpp's NAME-0000N-of-0000M.gguf "
                                                               "files of at most this size (e.g. 50GB).")] = None,
    fp8: Annotated[str, typer.Option(help="FP8 modules (no GGUF type holds them) decoded to bf16 (one rounding, as "
                                          "the releases' fp8_cast_bf16) or f32 (exact).")] = "bf16",
    pre_tokenizer: Annotated[Optional[str], typer.Option(help="llama.cpp's pre-tokenizer name for text prompts "
                                                              "(qwen2, deepseek-v3, glm4, kimi-k2, ...; default: "
                                                              "default).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output.")] = False,
    json_out: JsonOpt = False,
):
    """Write QMODEL as a GGUF that llama.cpp runs: routed experts keep their codes and scales (INT4 -> Q4_0 / Q4_1,
    INT8 -> Q8_0, MXFP4 -> MXFP4, qwen3_moe's NVFP4 -> NVFP4), nothing re-quantized. Exit 1 with one line when llama.cpp cannot represent it."""
    from .export import ExportOptions, export

    opts = ExportOptions(split_max_size=_parse_size(split_max_size) if split_max_size else 0, fp8=fp8,
                         pre_tokenizer=pre_tokenizer, overwrite=overwrite)
    res = export(qmodel, out, opts, say=lambda s: err.print(f"  {escape(s)}") if not json_out else None)
    if json_out:
        _print_json(res)
        return
    err.print(f"wrote {', '.join(res['output'])} ({res['bytes_written'] / 1e6:.1f} MB, {res['tensors']} tensors, "
              f"{res['seconds']:.1f} s)")
    for k, v in res["expert_types"].items():
        err.print(f"  experts: {escape(k)} ({v} tensors)")
    sc = res["scales"]
    if sc["changed"] or sc["q4_1_min_rounded"]:
        err.print(f"  fp16 scales: {sc['changed']} of {sc['scales']} changed, {sc['q4_1_min_rounded']} Q4_1 minimums "
                  f"rounded (worst relative change {sc['worst_relative_change']:.2g})")
    for n in res["notes"]:
        err.print(f"  note: {escape(n)}", soft_wrap=True)


def _save_verify(qmodel: Path, doc: dict, reference: str | None) -> None:
    """verify.json in the checkpoint (what the model card and `quantkit report` show), and the card refreshed."""
    from .card import VERIFY_JSON, write_model_card
    from .write.writer import write_json_atomic

    write_json_atomic(qmodel / VERIFY_JSON, {**doc, "reference": reference})
    if (qmodel / "README.md").is_file():
        write_model_card(qmodel, verify_report=doc)


@app.command()
def report(
    qmodel: Annotated[Path, typer.Argument(help="A checkpoint written by `quantkit convert`.")],
    reference: Annotated[Optional[str], typer.Option(help="The source checkpoint, named in the report.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="The HTML file (default: "
                                                                          "QMODEL/quantkit_report.html).")] = None,
    verify_json: Annotated[Optional[Path], typer.Option(help="`quantkit verify --json` output to show (default: "
                                                             "QMODEL/verify.json when present).")] = None,
    timeline: Annotated[Optional[Path], typer.Option(help="`quantkit convert --json` output: adds where the time "
                                                          "went, per rank and phase.")] = None,
    json_out: JsonOpt = False,
):
    """One self-contained HTML page of pictures: where the error went (SQNR per layer and expert), expert
    token coverage and fallbacks, KV scales, bytes by scheme, verify's metrics."""
    from .report import build_report

    res = build_report(qmodel, reference=reference, output=output, verify_json=verify_json, timeline=timeline)
    if json_out:
        _print_json(res.to_json())
    else:
        err.print(f"[green]wrote[/] {escape(str(res.output))}: {len(res.figures)} figure(s), {res.bytes:,} bytes",
                  soft_wrap=True)


# plan's ranges: every real serving setup fits with room to spare (quantkit/plan/bounds.py holds the library to
# the same numbers; tests/plan/test_plan_hostile.py checks that they agree)
PLAN_MAX_GPU_MEMORY_GIB = 16384
PLAN_MAX_GPUS = 65536
PLAN_MAX_CONTEXT_LEN = 1 << 24
PLAN_MAX_CONCURRENCY = 1 << 24  # --fit's requests (plan.MAX_CONCURRENCY)
PLAN_MAX_WEIGHTS_GIB = PLAN_MAX_GPU_MEMORY_GIB * PLAN_MAX_GPUS  # --fit's --weights-gib (plan.MAX_WEIGHTS_GIB)
PLAN_MAX_CALIBRATION = (1 << 16, options.MAX_SEQ_LEN)  # N samples, T tokens per sample


def _calibration(value: Optional[str]) -> Optional[tuple[int, int]]:
    """--calibration N,T as (samples, tokens per sample), each in its range; anything else is a usage error."""
    if value is None:
        return None
    from .plan.calibration import parse_calibration

    try:
        return parse_calibration(value)
    except QuantkitError as e:
        raise typer.BadParameter(e.message, param_hint="--calibration") from None


def _cost_device(value: str) -> str:
    if value not in ("cuda", "cpu"):
        raise typer.BadParameter(f"{value!r} is not one of cuda, cpu", param_hint="--device")
    return value


@app.command()
def plan(
    model_or_config: Annotated[str, typer.Argument(help="config.json, a checkpoint directory, a hub id, or a shipped "
                                                        "reference config: kimi-k2, glm-4.5, glm-5.")],
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Predict the checkpoint `convert` would write.")] = None,
    gpu_memory_gib: Annotated[float, typer.Option(
        callback=_ranged("--gpu-memory-gib", 0, PLAN_MAX_GPU_MEMORY_GIB, integer=False, lo_open=True),
        help=f"Memory per GPU, GiB: a finite number in (0, {PLAN_MAX_GPU_MEMORY_GIB}].")] = options.PLAN_GPU_MEMORY_GIB,
    gpus: Annotated[int, typer.Option(
        callback=_ranged("--gpus", 1, PLAN_MAX_GPUS, integer=True),
        help=f"GPUs (with --calibration --device cpu: ranks), 1 to {PLAN_MAX_GPUS}.")] = options.PLAN_GPUS,
    tp: Annotated[Optional[int], typer.Option(callback=_ranged("--tp", 1, PLAN_MAX_GPUS, integer=True), help=(
        f"Tensor-parallel size, 1 to {PLAN_MAX_GPUS}, dividing --gpus (default: all GPUs)."))] = None,
    context_len: Annotated[int, typer.Option(
        callback=_ranged("--context-len", 1, PLAN_MAX_CONTEXT_LEN, integer=True),
        help=f"Tokens per request for the concurrency figure, 1 to {PLAN_MAX_CONTEXT_LEN:,}.")] = options.PLAN_CONTEXT_LEN,
    activation_reserve_gib: Annotated[Optional[float], typer.Option(
        callback=_ranged("--activation-reserve-gib", 0, PLAN_MAX_GPU_MEMORY_GIB, integer=False),
        help=f"Memory kept free per GPU for activations, GiB: a finite number in [0, {PLAN_MAX_GPU_MEMORY_GIB}] "
             "(default: 10% of --gpu-memory-gib).")] = None,
    calibration: Annotated[Optional[str], typer.Option(
        "--calibration", metavar="N,T", callback=lambda v: _calibration(v),
        help="Also predict the recipe's calibrated pass (GPTQ/AWQ, KV scales) on N samples x T tokens (N 1 to "
             f"{PLAN_MAX_CALIBRATION[0]}, T 1 to {PLAN_MAX_CALIBRATION[1]}): wall time by component, device memory "
             "and host RAM per rank, on --gpus ranks of --device (docs/cost.md).")] = None,
    device: Annotated[str, typer.Option(
        "--device", callback=lambda v: _cost_device(v),
        help="What the calibration cost is predicted for: cuda (--gpus GPUs of --gpu-memory-gib) or cpu (--gpus "
             "processes).")] = options.PLAN_COST_DEVICE,
    measure: Annotated[bool, typer.Option(
        "--measure", help="With --calibration: measure this machine's rates for --device first (~1 min; a GPU "
                          "must be visible for cuda) and predict with them instead of the shipped table; with "
                          "--device cpu, as one of --gpus ranks sharing this host (the others computing "
                          "alongside; refused where --gpus processes outnumber this host's CPUs or outgrow its "
                          "available memory).")] = False,
    compute_dtype: Annotated[str, typer.Option(
        "--compute-dtype", help=f"With --calibration: what the layers compute in, as convert's "
        f"({'|'.join(options.COMPUTE_DTYPE_CHOICES)}; auto: float32 on the CPU, bfloat16 on a GPU).")] = options.COMPUTE_DTYPE,
    pair: Annotated[Optional[str], typer.Option("--pair", help="Also plan the prefill pool of a prefill/decode pair "
                                                             "served with this recipe (fp8-prefill) beside --recipe's "
                                                             "decode pool, one FP8 KV cache for both.")] = None,
    fit: Annotated[Optional[Path], typer.Option(
        "--fit", metavar="OUT.yaml", help="Choose the recipe of least predicted loss (per layer: experts and dense "
        "Linears each kept, FP8 block, INT4 g128/g32 GPTQ, NVFP4 or MXFP4) whose weights, KV cache for --concurrency "
        "requests of --context-len tokens and activation reserve fit --gpus GPUs of --gpu-memory-gib (and "
        "--weights-gib); write it to OUT.yaml (`convert --recipe OUT.yaml` runs it) and plan it (docs/memory.md).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(
        callback=_ranged("--concurrency", 1, PLAN_MAX_CONCURRENCY, integer=True),
        help=f"With --fit: requests of --context-len tokens the KV cache must hold, 1 to {PLAN_MAX_CONCURRENCY:,} "
             "(default: none; the weights alone are fitted).")] = None,
    weights_gib: Annotated[Optional[float], typer.Option(
        callback=_ranged("--weights-gib", 0, PLAN_MAX_WEIGHTS_GIB, integer=False, lo_open=True),
        help="With --fit: at most this many GiB of resident weights, the whole model (a number in (0, "
             f"{PLAN_MAX_WEIGHTS_GIB:,}]).")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(
        "--kv-dtype", help="With --fit: the KV cache's dtype (fp8 or bf16; default fp8, calibrated scales written "
                           "by the recipe).")] = None,
    fit_schemes: Annotated[Optional[str], typer.Option(
        "--fit-schemes", metavar="A,B,...", help="With --fit: the candidate schemes (keep always; default all: "
        "fp8-block,int4-g128-gptq,int4-g32-gptq,nvfp4,mxfp4).")] = None,
    sensitivity: Annotated[Optional[str], typer.Option(
        "--sensitivity", help="With --fit: measure (each unit's KL under each scheme, on calibration data, cached; "
        "a checkpoint directory) or prior (the schemes' weight error, the same for every layer; the default for a "
        "config).")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="With --fit: calibration data of the measurement and the "
                                                        "recipe (default: the shipped set).")] = None,
    num_samples: Annotated[int, typer.Option(min=1, max=options.MAX_NUM_SAMPLES, help="With --fit: calibration "
                                             "samples.")] = 16,
    seq_len: Annotated[int, typer.Option(min=2, max=options.MAX_SEQ_LEN, help="With --fit: tokens per "
                                         "sample.")] = 256,
    revision: RevisionOpt = None,
    json_out: JsonOpt = False,
):
    """Explain the memory: parameters by role, checkpoint bytes per recipe, KV bytes per token, resident
    tokens and concurrency; with --calibration, what the calibrated pass costs; with --fit, the recipe that
    fits a memory target at the least loss."""
    if fit is not None:
        return _plan_fit(model_or_config, fit, revision, json_out, dict(
            gpu_memory_gib=gpu_memory_gib, gpus=gpus, tp=tp, context_len=context_len,
            activation_reserve_gib=activation_reserve_gib), dict(
            concurrency=concurrency, weights_gib=weights_gib, kv_dtype=kv_dtype, sensitivity=sensitivity,
            schemes=None if fit_schemes is None else tuple(x.strip() for x in fit_schemes.split(",") if x.strip()),
            dataset=dataset, num_samples=num_samples, seq_len=seq_len), recipe or calibration or pair or measure)
    given = [n for n, v in (("--concurrency", concurrency), ("--weights-gib", weights_gib), ("--kv-dtype", kv_dtype),
                            ("--fit-schemes", fit_schemes), ("--sensitivity", sensitivity), ("--dataset", dataset))
             if v is not None]
    if given:
        raise typer.BadParameter(f"{given[0]} needs --fit", param_hint=given[0])
    if pair is not None and recipe is None:
        raise typer.BadParameter("--pair needs --recipe (the decode pool's recipe)", param_hint="--pair")
    from .plan import REFERENCE_CONFIGS, PlanOptions, check_serving, plan as run, render

    if calibration is not None and recipe is None:
        raise typer.BadParameter("--calibration needs --recipe (the calibrated recipe to cost)",
                                 param_hint="--calibration")
    if measure and calibration is None:
        raise typer.BadParameter("--measure needs --calibration (it measures the rates the cost is predicted "
                                 "with)", param_hint="--measure")
    compute_dtype = _compute_dtype(compute_dtype)
    if compute_dtype != options.COMPUTE_DTYPE and calibration is None:
        raise typer.BadParameter("--compute-dtype needs --calibration (it sets the calibrated pass's dtype)",
                                 param_hint="--compute-dtype")
    # what fails without reading the model fails first, before anything slow (--measure)
    check_serving(gpu_memory_gib=gpu_memory_gib, gpus=gpus, tp=tp, context_len=context_len,
                  activation_reserve_gib=activation_reserve_gib)
    pair_recipe = None
    if pair is not None:
        from .plan.pair import prefill_recipe

        pair_recipe = prefill_recipe(pair)  # refused as `convert --pair` refuses it
    target = model_or_config
    if model_or_config not in REFERENCE_CONFIGS and not Path(model_or_config).exists():
        target = str(_source(model_or_config, revision))
    opts = PlanOptions(gpu_memory_gib=gpu_memory_gib, gpus=gpus, context_len=context_len, tp=tp,
                       activation_reserve_gib=activation_reserve_gib, calibration=calibration, device=device,
                       throughput=_plan_measure(target, recipe, device, gpus) if measure else None,
                       compute_dtype=compute_dtype)
    rep = run(target, recipe, opts)
    pair_doc = None
    if pair is not None:
        from .plan.pair import plan_pair

        pair_doc = plan_pair(target, recipe, pair_recipe, opts)
    if json_out:
        _print_json({**rep.to_json(), **({"pair": pair_doc} if pair_doc else {})})
    else:
        render(rep, Console())
        if pair_doc:
            _print_pair(pair_doc)


def _plan_fit(model_or_config: str, out: Path, revision, json_out: bool, serving: dict, fit_opts: dict,
              other) -> None:
    """`plan --fit OUT.yaml`: the chosen recipe written to OUT.yaml, the choice and its arithmetic shown, and the
    usual plan of the chosen recipe (`--json`: the plan's object with a `fit` key)."""
    from .plan import REFERENCE_CONFIGS, FitOptions, PlanOptions, check_fit, check_serving, fit, render

    if other:
        raise typer.BadParameter("--fit chooses the recipe: it takes no --recipe, --calibration, --pair or --measure",
                                 param_hint="--fit")
    check_serving(**serving)
    fopts = FitOptions(**fit_opts)
    check_fit(fopts)
    if out.exists() and not out.is_file():
        raise typer.BadParameter(f"{str(out)[:80]!r} is not a file path", param_hint="--fit")
    target = model_or_config
    if model_or_config not in REFERENCE_CONFIGS and not Path(model_or_config).exists():
        target = str(_source(model_or_config, revision))
    result, rep = fit(target, PlanOptions(**serving), fopts,
                      say=lambda m: err.print(m, highlight=False, soft_wrap=True, markup=False))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(result.recipe_text)
    tmp.replace(out)
    if json_out:
        _print_json({**rep.to_json(), "fit": {**result.to_json(), "output": str(out)}})
        return
    from .plan.render import render_fit

    render_fit(result, str(out), Console(stderr=True))
    render(rep, Console())


def _plan_measure(target: str, recipe: str, device: str, gpus: int):
    """`plan --measure`: this machine's rates for `device` (plan.measure.measure_throughput), as one of `gpus`
    ranks sharing this host for cpu, after what plan refuses without measuring (the host, the config, the
    recipe)."""
    from .match.recipe import load_recipe
    from .plan import parse_config
    from .plan.measure import check_host, measure_throughput
    from .plan.source import resolve

    ranks = gpus if device == "cpu" else 1
    if device == "cpu":
        check_host(ranks)
    config = resolve(target).config
    parse_config(config)  # a config or recipe that plan refuses is refused before measuring
    load_recipe(recipe)
    err.print(f"measuring this machine's {device} rates for the cost model ...", highlight=False)
    return measure_throughput(device, ranks=ranks, config=config,
                              log=lambda m: err.print(f"  {m}", highlight=False, soft_wrap=True))


def _print_pair(pair_doc: dict) -> None:
    """`plan --pair`'s two pools, one line each, on stderr."""
    err.print(f"prefill/decode pair, one FP8 KV cache ({pair_doc['kv_bytes_per_token']:,} B/token):")
    for role in ("prefill", "decode"):
        d = pair_doc[role]
        err.print(f"  {role}: {escape(d['recipe'])}: checkpoint {d['checkpoint_bytes'] / 1e9:.1f} GB, weights "
                  f"{d['weight_bytes_per_gpu'] / 2**30:.1f} GiB/GPU, {d['kv_tokens']:,} KV tokens, expert "
                  f"GEMMs in {d['expert_math']} (peak x{d['expert_peak_vs_bf16']:g} vs BF16)", soft_wrap=True)


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
    arch: Annotated[str, typer.Option(help="Tiny model architecture to generate.")] = options.DEMO_ARCH,
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
    if unit not in units or not math.isfinite(value) or value <= 0 or value * units[unit] > 2**62:
        raise typer.BadParameter(f"cannot parse size {s!r}; use e.g. 500MB or 5GB")
    return int(value * units[unit])


def _show_warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"warning: {escape(str(message))}", soft_wrap=True)  # one line, no source excerpt


def main(argv: Optional[list[str]] = None) -> None:
    debug = os.environ.get("QUANTKIT_DEBUG") == "1"
    if not debug:
        import warnings

        warnings.showwarning = _show_warning
    from . import signals
    from .errors import Terminated

    signals.raise_on_termination()  # SIGTERM/SIGHUP unwind like Ctrl-C: workers ended, temporaries removed
    try:
        # not standalone: a usage error is one `error:` line here (exit 2), like every other failure
        rv = app(args=argv, prog_name="quantkit", standalone_mode=False)
    except _USAGE_ERROR as e:
        if e.format_message():
            where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "quantkit"
            err.print(f"[red]error:[/] {escape(e.format_message())}", markup=True, soft_wrap=True)
            err.print(f"hint: see `{where} --help`", soft_wrap=True, markup=False)
        sys.exit(e.exit_code)  # 2 (no arguments at all: the help was printed)
    except (KeyboardInterrupt, typer.Abort):
        err.print("interrupted; run the same command again to resume")
        sys.exit(130)
    except Terminated as t:
        err.print(f"terminated by signal {t.signum}; run the same command again to resume", markup=False)
        sys.exit(128 + t.signum)
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
    if type(rv) is int and rv:  # typer.Exit(code) from a command
        sys.exit(rv)


# click's UsageError (bad option values, unknown options, missing arguments), found through the public
# BadParameter: typer ships its own copy of click, whose module path is private
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def entry() -> None:
    """The `quantkit` command: `main()`, and after a successful command, leave without tearing the
    interpreter down (unloading torch and friends takes ~0.5 s here; every file is already written,
    fsynced and closed, and the output streams are flushed below). Failures exit normally. glibc's malloc
    is first told to keep freed memory for reuse (quantkit/allocator.py)."""
    allocator.tune()
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            dist.shutdown(ok=False)  # every rank leaves the process group, failed or not
            raise
    dist.shutdown(ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    entry()
