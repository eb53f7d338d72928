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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import (CheckpointNotFound, KernelsUnavailable, QuantkitError, ReferenceModelError,
                      VerificationFailed, VerifyOptionError)
from ..read.checkpoint import Checkpoint
from .common import Check, Listing, listed, resolve_device
from .format import Judge, tensor_pass
from .integrity import check_integrity, check_manifest_tensors
from .numerics import (check_reference, check_reference_content, drift_check, kernel_check, layer_summary, model_metrics, sqnr_check,
                       token_data)
from .. import options
from ..options import Thresholds
from ..pack.names import Tensor

__all__ = ["verify", "VerifyReport", "Thresholds", "Check"]


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
def verify(qmodel_dir, *, reference=None, dataset=None, num_samples: int = options.VERIFY_NUM_SAMPLES,
           seq_len: int = options.VERIFY_SEQ_LEN, device: str = options.VERIFY_DEVICE, kernels: str = options.VERIFY_KERNELS,
           thresholds: Thresholds = Thresholds(), progress: Callable[[str], None] | None = None,
           generation_tokens: int = options.VERIFY_GENERATION_TOKENS, engine: str | None = None,
           tp: int = options.VERIFY_TP,
           seed: int = 0, engine_run: dict | None = None, pair=None) -> VerifyReport:
    """Verify the converted checkpoint in `qmodel_dir` (see the module docstring).

    reference: the source checkpoint it was converted from; without it the numerics are skipped and
    `passed` depends on integrity and format only. dataset/num_samples/seq_len: the token data for the
    model-level metrics (quantkit.calib.data formats; default: the shipped calibration set through the
    reference's tokenizer, or seeded random ids when it has none). generation_tokens: greedy steps per prompt (0:
    skip). device: where the models run. kernels: "torch", or "triton" to also check the runtime's
    INT4 GEMM kernel against its torch reference on a few modules. engine: "vllm" to also check the rules
    vLLM applies when it loads the checkpoint (quantkit/engine/vllm.py), at tensor parallelism `tp`.
    engine_run: with engine "vllm", also run QMODEL in vLLM and measure it there (quantkit/verify/vllm_run.py);
    a dict of its options: python (the engine environment's interpreter; default this one), timeout (s),
    kv_cache_dtype ("served": fp8 when the checkpoint has KV scales, as its model card serves it; or vLLM's
    values, e.g. "auto", "bfloat16"), engine_args (extra vllm.LLM keyword arguments).
    pair: the prefill checkpoint of a prefill/decode pair whose decode half is `qmodel_dir` (convert --pair):
    checked to belong together (PairMismatch otherwise, before anything else) and, with a reference, measured as
    served: FP8 prefill into the KV cache, decode reading it (verify/pair.py)."""
    t0 = time.perf_counter()
    say = progress or (lambda _s: None)
    thresholds = thresholds if thresholds is not None else Thresholds()
    root = Path(qmodel_dir)
    if not root.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {str(root)!r} does not exist")
    if kernels not in ("torch", "triton"):
        raise VerifyOptionError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
    if not isinstance(num_samples, int) or num_samples <= 0 or not isinstance(seq_len, int) or seq_len < 2:
        raise VerifyOptionError(f"num_samples must be >= 1 and seq_len >= 2 (got {num_samples}, {seq_len})",
                                hint="pass --num-samples N and --seq-len L with L >= 2")
    if generation_tokens < 0:
        raise VerifyOptionError(f"generation_tokens must be >= 0, got {generation_tokens}")
    dev = resolve_device(device)
    ref_ck = None
    if reference is not None:
        ref_ck = Checkpoint.open(reference)  # raises for an unusable reference (missing, corrupt headers)
        method = (ref_ck.quantization_config or {}).get("quant_method")
        if method not in (None, "fp8", "compressed-tensors"):
            raise ReferenceModelError(f"reference {str(reference)!r} is quantized with {method!r}, which quantkit "
                                      "does not read", hint="pass the checkpoint the conversion started from (BF16/"
                                      "FP16/FP32, block FP8, or compressed-tensors such as Kimi K2.5's INT4 release)")
    if kernels == "triton":
        _require_triton(dev)
    pair_doc = None
    if pair is not None:
        from .pair import check_pair

        say("pair: manifests, source and KV scales of the two checkpoints")
        pair_doc = check_pair(root, Path(pair))  # PairMismatch: the pair is refused, nothing measured

    checks: list[Check] = []
    # 1. integrity
    manifest, mismatches, hashed = check_integrity(root, say)
    ck, open_error = _open(root)
    if ck is not None and manifest is not None:
        check_manifest_tensors(ck, manifest, mismatches)
    integrity = {"ok": len(mismatches) == 0, "mismatches": listed(mismatches, {"file": "*", "problem": None}),
                 "files_checked": len((manifest or {}).get("shards") or []), "bytes_hashed": hashed}
    checks.append(Check("integrity", integrity["ok"], "every shard matches the manifest" if integrity["ok"] else
                        f"{len(mismatches)} mismatch(es), first: {mismatches.items[0]['file']}: "
                        f"{mismatches.items[0]['problem']}"))

    # 2. format (+ the per-module SQNR pass, which reads the same tensors)
    problems = Listing()
    sqnr: dict[str, float] = {}
    drift: list[tuple[str, float, float]] = []
    kernel_modules: list[tuple[str, dict]] = []
    ref_check = None
    judge = Judge()
    modules_checked = 0
    if ck is None:
        problems.add(f"the checkpoint does not open: {open_error}")
    else:
        if ref_ck is not None:
            ref_check = check_reference(ref_ck, manifest)
        modules_checked = tensor_pass(ck, manifest, ref_ck, judge, problems, sqnr, drift, kernel_modules,
                                       want_kernels=kernels == "triton", say=say)
    fmt = {"ok": len(problems) == 0, "problems": listed(problems, None), "modules_checked": modules_checked,
           "judge": judge.name}
    checks.append(Check("format", fmt["ok"], f"{modules_checked} quantized modules consistent with config.json"
                        if fmt["ok"] else f"{len(problems)} problem(s), first: {problems.items[0]}"))

    # 3. numerics
    metrics = {"kl_divergence": None, "top1_agreement": None, "perplexity_reference": None,
               "perplexity_quantized": None}
    layers: list[dict] = []
    generation = None
    data: dict[str, Any] = {"device": str(dev), "kernels": kernels, "source": None}
    if ref_ck is None:
        why = "no reference given: numerics skipped (pass the source checkpoint as reference)"
        checks += [Check(n, None, why) for n in ("weight_sqnr", "kl_divergence", "top1_agreement",
                                                 "perplexity_ratio", "generation_agreement")]
    elif ck is None:
        why = "the checkpoint does not open: numerics skipped"
        checks += [Check(n, None, why) for n in ("weight_sqnr", "kl_divergence", "top1_agreement",
                                                 "perplexity_ratio", "generation_agreement")]
    elif (wrong := check_reference_content(sqnr, drift) if ref_check.ok is not False else None) is not None:
        checks.append(wrong)  # named before any number is blamed on the quantization
        why = "the reference is not the source this checkpoint was converted from: numerics skipped"
        checks += [Check(n, None, why) for n in ("weight_sqnr", "sqnr_vs_manifest", "kl_divergence",
                                                 "top1_agreement", "perplexity_ratio", "generation_agreement")]
    else:
        checks.append(ref_check)
        layers = layer_summary(sqnr, thresholds.min_sqnr_db)
        awq = sum(1 for n, e in (manifest or {}).get("tensors", {}).items()
                  if n.endswith(Tensor.PACKED.dotted) and isinstance(e, dict) and e.get("method") == "awq")
        checks.append(sqnr_check(sqnr, layers, modules_checked - awq, thresholds, awq))
        checks.append(drift_check(drift, thresholds))
        say("numerics: preparing token data")
        samples, data_info = token_data(ref_ck, dataset, num_samples, seq_len, seed)
        data.update(data_info)
        m, generation, model_checks = model_metrics(ref_ck.root, root, samples, dev, generation_tokens,
                                                     thresholds, say)
        metrics.update(m)
        checks += model_checks
    if kernels == "triton":
        say("kernels: INT4 GEMM (triton) against its torch reference")
        checks.append(kernel_check(kernel_modules, dev) if kernel_modules else
                      Check("kernels", None, "no quantized module could be read: kernel check skipped"))

    engine_doc = run_doc = None
    if engine_run is not None and engine != "vllm":
        raise VerifyOptionError("running the checkpoint in an engine needs engine='vllm'", hint="pass --engine vllm --run")
    if engine is not None:
        if engine != "vllm":
            raise VerifyOptionError(f"unknown engine {engine!r}", hint="the engine rules quantkit knows: vllm")
        from ..engine.vllm import check as engine_check

        say(f"engine: the rules vLLM applies, at tp {tp}")
        er = engine_check(root, tp=tp)
        engine_doc = er.to_json()
        first = (er.problems or er.warnings or [None])[0]
        detail = (f"{len(er.problems)} problem(s), {len(er.warnings)} warning(s)"
                  + (f"; first: {first['rule']} {first['where']}: {first['detail']}" if first else ""))
        checks.append(Check(f"engine_{engine}", er.ok, detail if first else f"{er.engine} loads it as written"))
    if engine_run is not None:
        from . import vllm_run

        if ck is None:
            raise VerificationFailed("the checkpoint does not open: it cannot be run in vLLM")
        if ref_ck is None:  # no numerics stage: the token data from QMODEL's own tokenizer / vocabulary
            samples, info = token_data(ck, dataset, num_samples, seq_len, seed)
            data.update(info)
        run_doc, run_checks = vllm_run.run(root, ref_ck.root if ref_ck is not None else None, samples, dev,
                                           generation_tokens, thresholds, python=engine_run.get("python"),
                                           kv_cache_dtype=engine_run.get("kv_cache_dtype") or "served",
                                           engine_args=engine_run.get("engine_args"),
                                           timeout=engine_run.get("timeout") or vllm_run.DEFAULT_TIMEOUT_S,
                                           transformers_ppl=metrics.get("perplexity_quantized"), say=say)
        checks += run_checks
    if pair_doc is not None:
        checks.append(Check("pair", True, f"same source, same KV layout, {pair_doc['kv_tensors']} KV-scale tensors "
                            "identical bit for bit, manifests record each other"))
        wrong_ref = any(c.name == "reference" and c.ok is False for c in checks)
        if ref_ck is not None and ck is not None and integrity["ok"] and not wrong_ref:
            from .pair import pair_metrics

            if not data.get("source"):
                samples, info = token_data(ref_ck, dataset, num_samples, seq_len, seed)
                data.update(info)
            pair_doc["metrics"] = pm = pair_metrics(ref_ck.root, root, Path(pair), samples, dev, generation_tokens, say)
            checks.append(_pair_limit(pm["pair"], thresholds))
    passed = integrity["ok"] and fmt["ok"] and all(c.ok is not False for c in checks)
    return VerifyReport(passed, integrity, fmt, metrics, layers, generation, checks, thresholds, data,
                        round(time.perf_counter() - t0, 3), engine_doc, run_doc, pair_doc)


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
