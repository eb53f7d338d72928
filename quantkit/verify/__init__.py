"""`quantkit verify`: prove that a converted checkpoint is what its manifest says, loads as the format
says, and computes what the reference computes.

Three stages, each reading only what `convert` wrote, through pack/ (never convert's internals):
verify/integrity.py, verify/format.py, verify/numerics.py.

1. Integrity (no model code): `quantkit_manifest.json` is complete; every shard it lists exists with the
   recorded size and sha256; the index names no shard the manifest lacks and the directory holds no
   shard or leftover temporary file the manifest lacks; the manifest's tensor table matches the headers.
2. Format (headers + small tensors): `config.json`'s `quantization_config` against the tensors. Each
   module with `weight_packed` resolves to one config group (exact name > `re:` pattern > class name, as
   compressed-tensors matches), is not ignored, and carries `weight_scale` / `weight_shape` (and
   `weight_zero_point` iff asymmetric, `weight_g_idx` iff actorder "group") of the dtypes and shapes
   the group implies; each FP8 module (a float8 `weight`) resolves to a `float-quantized` group and carries
   a float32 `weight_scale` of the shape its strategy implies; compressed-tensors' own decompressor (the
   judge) must reproduce our dequantization bit for bit.
3. Numerics (needs `reference`, the source checkpoint): per-module weight SQNR of our dequantization
   against the reference tensor (read lazily, shard by shard), aggregated per decoder layer and compared
   with the SQNR the manifest recorded at conversion; then both models run with transformers on token
   data: mean next-token KL(ref || quant), top-1 agreement, perplexity of each, greedy-generation
   agreement. With `kernels="triton"` the runtime's INT4 GEMM kernel is checked on a few modules.

A failed check never raises: the report says `passed: false` and names the shard, tensor or layer.
Only unusable input raises a QuantkitError (a missing directory, an unreadable reference, an
unavailable device). Memory: stages 1-2 and the SQNR pass hold one module at a time (plus the mapped
pages of the shard being read); the model-level metrics load both models (see docs/verify.md).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import (CheckpointNotFound, KernelsUnavailable, QuantkitError, ReferenceModelError,
                      VerificationFailed, VerifyOptionError)
from ..read.checkpoint import Checkpoint
from .common import Check, RunInputs, listed, resolve_device
from .format import Findings, Judge, tensor_pass
from .integrity import check_integrity, check_manifest_tensors
from .numerics import (check_reference, check_reference_content, drift_check, kernel_check, layer_summary,
                       model_metrics, sqnr_check, token_data)
from ..options import Thresholds
from ..pack.names import Tensor
from .options import EngineRun, VerifyOptions

__all__ = ["verify", "VerifyOptions", "EngineRun", "VerifyReport", "Thresholds", "Check"]


@dataclass
class VerifyReport:
    """What `verify` found. `to_json()` holds the contract keys (passed, integrity, format, metrics,
    layers) first, then extras (generation, checks, thresholds, data, seconds)."""

    passed: bool
    integrity: dict  # {ok, mismatches: [{file, problem}], files_checked, bytes_hashed}
    format: dict  # {ok, problems: [str], modules_checked, judge}
    metrics: dict  # {kl_divergence, top1_agreement, perplexity_reference, perplexity_quantized}
    layers: list  # [{layer, min_sqnr_db, mean_sqnr_db, modules, worst_module, ok}]
    generation: dict | None  # {tokens, prompts, agreement, matching_prefix}
    checks: list[Check]
    thresholds: Thresholds
    data: dict  # token data and run settings
    seconds: float = 0.0
    engine: dict | None = None  # `engine="vllm"`: the rules vLLM applies (quantkit/engine/vllm.py)
    engine_run: dict | None = None  # `engine_run`: QMODEL run in vLLM and measured (quantkit/verify/vllm_run.py)
    pair: dict | None = None  # `pair`: QMODEL as the decode half of a prefill/decode pair (verify/pair.py)

    def to_json(self) -> dict:
        return {"passed": self.passed, "integrity": self.integrity, "format": self.format,
                "metrics": self.metrics, "layers": self.layers, "generation": self.generation,
                "checks": [asdict(c) for c in self.checks], "thresholds": asdict(self.thresholds),
                "data": self.data, "seconds": self.seconds, "engine": self.engine,
                "engine_run": self.engine_run, "pair": self.pair}

    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]


# ---- entry point ---------------------------------------------------------------------------------------
def verify(qmodel_dir, opts: VerifyOptions = VerifyOptions(),
           progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Verify the converted checkpoint in `qmodel_dir` as `opts` says (see the module docstring and
    `VerifyOptions`); `progress(line)` is called at each step."""
    t0 = time.perf_counter()
    v = _start(Path(qmodel_dir), opts, progress or (lambda _s: None))
    integrity = _integrity(v)
    fmt, found, ref_check = _format(v)
    metrics, layers, generation = _numerics(v, found, fmt["modules_checked"], ref_check)
    if opts.kernels == "triton":
        v.say("kernels: INT4 GEMM (triton) against its torch reference")
        v.checks.append(kernel_check(found.kernel_modules, v.dev) if found.kernel_modules else
                        Check("kernels", None, "no quantized module could be read: kernel check skipped"))
    engine_doc = _engine_rules(v)
    run_doc = _engine_run(v, metrics) if opts.engine_run is not None else None
    if v.pair_doc is not None:
        _pair(v, integrity["ok"])
    passed = integrity["ok"] and fmt["ok"] and all(c.ok is not False for c in v.checks)
    return VerifyReport(passed, integrity, fmt, metrics, layers, generation, v.checks, v.thresholds, v.data,
                        round(time.perf_counter() - t0, 3), engine_doc, run_doc, v.pair_doc)


@dataclass
class _Verification:
    """One verify run's state, handed from stage to stage: what it was given, what it opened, the checks so far,
    the token data and its description."""

    root: Path
    opts: VerifyOptions
    say: Callable[[str], None]
    thresholds: Thresholds
    dev: torch.device
    ref_ck: Checkpoint | None
    pair_doc: dict | None
    manifest: dict | None = None
    ck: Checkpoint | None = None
    open_error: str | None = None
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    samples: list[torch.Tensor] | None = None

    def token_data(self, ck: Checkpoint) -> None:
        """The token samples from `ck`'s tokenizer or vocabulary, and their description into `data`."""
        o = self.opts
        self.samples, info = token_data(ck, o.dataset, o.num_samples, o.seq_len, o.seed)
        self.data.update(info)


def _start(root: Path, opts: VerifyOptions, say: Callable[[str], None]) -> _Verification:
    """The options checked, the reference opened, a pair held together: what raises before any stage runs."""
    if not root.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {str(root)!r} does not exist")
    if opts.kernels not in ("torch", "triton"):
        raise VerifyOptionError(f"kernels must be 'torch' or 'triton', got {opts.kernels!r}")
    n, seq_len = opts.num_samples, opts.seq_len
    if not isinstance(n, int) or n <= 0 or not isinstance(seq_len, int) or seq_len < 2:
        raise VerifyOptionError(f"num_samples must be >= 1 and seq_len >= 2 (got {n}, {seq_len})",
                                hint="pass --num-samples N and --seq-len L with L >= 2")
    if opts.generation_tokens < 0:
        raise VerifyOptionError(f"generation_tokens must be >= 0, got {opts.generation_tokens}")
    dev = resolve_device(opts.device)
    ref_ck = _open_reference(opts.reference) if opts.reference is not None else None
    if opts.kernels == "triton":
        _require_triton(dev)
    pair_doc = None
    if opts.pair is not None:
        from .pair import check_pair

        say("pair: manifests, source and KV scales of the two checkpoints")
        pair_doc = check_pair(root, Path(opts.pair))  # PairMismatch: the pair is refused, nothing measured
    thresholds = opts.thresholds if opts.thresholds is not None else Thresholds()
    return _Verification(root, opts, say, thresholds, dev, ref_ck, pair_doc,
                         data={"device": str(dev), "kernels": opts.kernels, "source": None})


def _rotated_reference(ref_ck: Checkpoint, manifest: dict | None) -> Checkpoint:
    """The reference as the conversion read it: turned by the rotation the manifest records (read/rotate.py), so
    that each module's SQNR compares the quantized weights with the rotated source weights they came from. The
    models' outputs are compared unrotated: the rotation leaves them unchanged."""
    rec = (manifest or {}).get("rotation")
    if not isinstance(rec, dict):
        return ref_ck
    from dataclasses import replace

    from ..quant.rotate import RotationSpec
    from ..read.rotate import Rotation
    from ..read.sources import detect_format, scan

    try:
        spec = RotationSpec(kind=rec.get("kind"), seed=rec.get("seed"), block=rec.get("block_size"))
        return replace(ref_ck, rotation=Rotation.plan(ref_ck, spec, scan(ref_ck, detect_format(ref_ck.config))))
    except QuantkitError as e:
        raise ReferenceModelError(f"the manifest records a rotation the reference cannot take: {e.message}",
                                  hint="pass the checkpoint the conversion started from") from None


def _open_reference(reference) -> Checkpoint:
    """The reference checkpoint; raises for an unusable one (missing, corrupt headers, a format quantkit does not
    read)."""
    ref_ck = Checkpoint.open(reference)
    method = (ref_ck.quantization_config or {}).get("quant_method")
    if method not in (None, "fp8", "compressed-tensors"):
        raise ReferenceModelError(f"reference {str(reference)!r} is quantized with {method!r}, which quantkit "
                                  "does not read", hint="pass the checkpoint the conversion started from (BF16/"
                                  "FP16/FP32, block FP8, or compressed-tensors such as Kimi K2.5's INT4 release)")
    return ref_ck


def _integrity(v: _Verification) -> dict:
    """Stage 1: every file against the manifest, the manifest's tensor table against the headers. Opens the
    checkpoint for the later stages (`v.ck`, or why it does not open)."""
    v.manifest, mismatches, hashed = check_integrity(v.root, v.say)
    v.ck, v.open_error = _open(v.root)
    if v.ck is not None and v.manifest is not None:
        check_manifest_tensors(v.ck, v.manifest, mismatches)
    integrity = {"ok": len(mismatches) == 0, "mismatches": listed(mismatches, {"file": "*", "problem": None}),
                 "files_checked": len((v.manifest or {}).get("shards") or []), "bytes_hashed": hashed}
    v.checks.append(Check("integrity", integrity["ok"], "every shard matches the manifest" if integrity["ok"] else
                          f"{len(mismatches)} mismatch(es), first: {mismatches.items[0]['file']}: "
                          f"{mismatches.items[0]['problem']}"))
    return integrity


def _format(v: _Verification) -> tuple[dict, Findings, Check | None]:
    """Stage 2, and the per-module SQNR pass, which reads the same tensors. Returns (the format document, what the
    pass found, the reference's check against the manifest: None without a reference)."""
    found = Findings(kernel_modules=[] if v.opts.kernels == "triton" else None)
    ref_check = None
    judge = Judge()
    modules_checked = 0
    if v.ck is None:
        found.problems.add(f"the checkpoint does not open: {v.open_error}")
    else:
        if v.ref_ck is not None:
            ref_check = check_reference(v.ref_ck, v.manifest)
            v.ref_ck = _rotated_reference(v.ref_ck, v.manifest)
        modules_checked = tensor_pass(v.ck, v.manifest, v.ref_ck, judge, found, v.say)
    problems = found.problems
    fmt = {"ok": len(problems) == 0, "problems": listed(problems, None), "modules_checked": modules_checked,
           "judge": judge.name}
    v.checks.append(Check("format", fmt["ok"], f"{modules_checked} quantized modules consistent with config.json"
                          if fmt["ok"] else f"{len(problems)} problem(s), first: {problems.items[0]}"))
    return fmt, found, ref_check


_MODEL_CHECKS = ("kl_divergence", "top1_agreement", "perplexity_ratio", "generation_agreement")


def _numerics(v: _Verification, found: Findings, modules_checked: int,
              ref_check: Check | None) -> tuple[dict, list[dict], dict | None]:
    """Stage 3 (with a reference): the weight SQNR per layer and against the manifest's, then both models on the
    token data. Returns (metrics, layers, generation)."""
    metrics = {"kl_divergence": None, "top1_agreement": None, "perplexity_reference": None,
               "perplexity_quantized": None}
    if v.ref_ck is None or v.ck is None:
        why = ("no reference given: numerics skipped (pass the source checkpoint as reference)" if v.ref_ck is None
               else "the checkpoint does not open: numerics skipped")
        v.checks += [Check(n, None, why) for n in ("weight_sqnr", *_MODEL_CHECKS)]
        return metrics, [], None
    wrong = check_reference_content(found.sqnr, found.drift) if ref_check.ok is not False else None
    if wrong is not None:
        v.checks.append(wrong)  # named before any number is blamed on the quantization
        why = "the reference is not the source this checkpoint was converted from: numerics skipped"
        v.checks += [Check(n, None, why) for n in ("weight_sqnr", "sqnr_vs_manifest", *_MODEL_CHECKS)]
        return metrics, [], None
    t = v.thresholds
    v.checks.append(ref_check)
    layers = layer_summary(found.sqnr, t.min_sqnr_db)
    awq = sum(1 for n, e in (v.manifest or {}).get("tensors", {}).items()
              if n.endswith(Tensor.PACKED.dotted) and isinstance(e, dict) and e.get("method") == "awq")
    v.checks.append(sqnr_check(found.sqnr, layers, modules_checked - awq, t, awq))
    v.checks.append(drift_check(found.drift, t))
    v.say("numerics: preparing token data")
    v.token_data(v.ref_ck)
    m, generation, model_checks = model_metrics(v.ref_ck.root, v.root, v.samples, v.dev, v.opts.generation_tokens,
                                                t, v.say)
    metrics.update(m)
    v.checks += model_checks
    return metrics, layers, generation


def _engine_rules(v: _Verification) -> dict | None:
    """`engine="vllm"`: the rules vLLM applies when it loads QMODEL, at tensor parallelism `tp`."""
    engine = v.opts.engine
    if v.opts.engine_run is not None and engine != "vllm":
        raise VerifyOptionError("running the checkpoint in an engine needs engine='vllm'",
                                hint="pass --engine vllm --run")
    if engine is None:
        return None
    if engine != "vllm":
        raise VerifyOptionError(f"unknown engine {engine!r}", hint="the engine rules quantkit knows: vllm")
    from ..engine.vllm import check as engine_check

    v.say(f"engine: the rules vLLM applies, at tp {v.opts.tp}")
    er = engine_check(v.root, tp=v.opts.tp)
    first = (er.problems or er.warnings or [None])[0]
    detail = (f"{len(er.problems)} problem(s), {len(er.warnings)} warning(s)"
              + (f"; first: {first['rule']} {first['where']}: {first['detail']}" if first else ""))
    v.checks.append(Check(f"engine_{engine}", er.ok, detail if first else f"{er.engine} loads it as written"))
    return er.to_json()


def _engine_run(v: _Verification, metrics: dict) -> dict | None:
    """`engine_run`: QMODEL run in vLLM and measured there, against the reference when there is one; not run when
    the reference was found not to be QMODEL's source (nothing to measure it against)."""
    from . import vllm_run

    if v.ck is None:
        raise VerificationFailed("the checkpoint does not open: it cannot be run in vLLM")
    if v.ref_ck is not None and v.samples is None:
        v.checks.append(Check("engine_vllm_run", None, "the reference is not the source this checkpoint was "
                              "converted from: the engine run skipped"))
        return None
    if v.ref_ck is None:  # no numerics stage: the token data from QMODEL's own tokenizer / vocabulary
        v.token_data(v.ck)
    inputs = RunInputs(v.samples, v.dev, v.opts.generation_tokens, v.thresholds, v.say)
    run_doc, run_checks = vllm_run.run(v.root, v.ref_ck.root if v.ref_ck is not None else None, inputs,
                                       v.opts.engine_run, transformers_ppl=metrics.get("perplexity_quantized"))
    v.checks += run_checks
    return run_doc


def _pair(v: _Verification, integrity_ok: bool) -> None:
    """`pair`: the pair's check, and with a reference (and nothing found wrong with QMODEL or the reference) the
    pair measured as served, into `v.pair_doc`."""
    v.checks.append(Check("pair", True, f"same source, same KV layout, {v.pair_doc['kv_tensors']} KV-scale tensors "
                          "identical bit for bit, manifests record each other"))
    wrong_ref = any(c.name == "reference" and c.ok is False for c in v.checks)
    if v.ref_ck is not None and v.ck is not None and integrity_ok and not wrong_ref:
        from .pair import pair_metrics

        if not v.data.get("source"):
            v.token_data(v.ref_ck)
        v.pair_doc["metrics"] = pm = pair_metrics(v.ref_ck.root, v.root, Path(v.opts.pair), v.samples, v.dev,
                                                  v.opts.generation_tokens, v.say)
        v.checks.append(_pair_limit(pm["pair"], v.thresholds))


def _pair_limit(m: dict, t: Thresholds) -> Check:
    """The pair (FP8 prefill, then decode reading its KV cache) held to the same KL / top-1 limits."""
    ok = m["kl_divergence"] <= t.max_kl and m["top1_agreement"] >= t.min_top1
    return Check("pair_quality", ok, f"prefill model -> KV cache -> decode model against the source: KL "
                 f"{m['kl_divergence']:.4g} (max {t.max_kl:g}), top-1 {m['top1_agreement']:.2%} (min {t.min_top1:.0%})")


def _require_triton(dev: torch.device) -> None:
    from ..runtime import interpreting, triton_available

    if not triton_available():
        raise KernelsUnavailable("kernels=triton needs the triton package, which is not installed",
                                 hint="pip install triton, or use --kernels torch")
    if dev.type != "cuda" and not interpreting():
        raise KernelsUnavailable("kernels=triton runs on a CUDA device (or on CPU with TRITON_INTERPRET=1)",
                                 hint="use --device cuda, set TRITON_INTERPRET=1, or use --kernels torch")


def _open(root: Path) -> tuple[Checkpoint | None, str | None]:
    try:
        return Checkpoint.open(root), None
    except QuantkitError as e:  # a corrupt header or index is a finding here, not a crash
        return None, f"{type(e).__name__}: {e.message}"
