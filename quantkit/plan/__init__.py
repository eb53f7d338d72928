"""Memory planner: parameter counts, checkpoint bytes, KV-cache bytes and GPU residency for MoE models.

`plan(model_or_config, recipe, PlanOptions(...))` answers, before anything is downloaded or converted: how
many parameters the model has by role, how many bytes its checkpoint takes as it is and after a recipe
(INT4/FP8 laid out exactly as quantkit writes them), how many bytes one token of KV cache costs in BF16, FP8
and the DeepSeek `fp8_ds_mla` layout, and how many tokens / concurrent requests fit on N GPUs of G GiB.

Inputs: a config.json, a checkpoint directory (its safetensors headers are read, never the data), or the
name of a shipped reference config (`kimi-k2`, `glm-4.5`, `glm-5`). From a config the checkpoint's
tensors are enumerated under their on-disk Hugging Face names and shapes (checked against
`save_pretrained` output in tests/test_plan.py).

The planner is pure arithmetic over shapes (plan/tensors.py, plan/kv.py; the model description is
arch.py's). It is not a loader (it never reads tensor data), not a
converter, and it does not model engine internals beyond what is stated in `PlanReport.assumptions`
(sharding rules, activation reserve, which layers cache KV).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import options
from ..arch import SUPPORTED_MODEL_TYPES, ModelSpec, parse_config, validate
from ..errors import ConfigError, FitError
from ..match.recipe import Recipe, load_recipe
from ..read.sources import detect_format
from .bounds import MAX_CONTEXT_LEN, MAX_GPU_MEMORY_GIB, MAX_GPUS, check_number
from .calibration import CalibrationCost, CostOptions, calibration_cost
from .kv import KV_DTYPES, KVLayout, kv_layout
from .render import render
from .source import REFERENCE_CONFIGS, reference_config, resolve as _resolve
from .source import tensor_shapes_from_checkpoint as _tensor_shapes_from_checkpoint
from .throughput import THROUGHPUT, Throughput
from .tensors import (DEFAULT_SHARD_BYTES, ROLES, TensorShapes, _by_role, enumerate_tensors, header_bytes,
                      parameter_count, predict_bytes, quantized_layout, source_tensors, tensor_bytes, tensor_role)

__all__ = ["plan", "PlanOptions", "PlanReport", "render", "parse_config", "ModelSpec", "enumerate_tensors",
           "quantized_layout", "predict_bytes", "source_tensors", "tensor_role", "kv_layout", "KVLayout", "reference_config",
           "REFERENCE_CONFIGS", "ROLES", "KV_DTYPES", "SUPPORTED_MODEL_TYPES", "calibration_cost", "CalibrationCost",
           "CostOptions", "Throughput", "THROUGHPUT", "check_serving", "fit", "FitOptions", "check_fit"]

GIB = 1 << 30
_KV_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "auto": "bfloat16", "fp8": "float8_e4m3",
               "fp8_e4m3": "float8_e4m3", "float8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
               "fp8_ds_mla": "fp8_ds_mla"}
# Default activation reserve when none is given: 10% of each GPU (like vLLM's default
# gpu_memory_utilization=0.9). Real engines also spend it on CUDA graphs and allocator slack.
DEFAULT_RESERVE_FRACTION = 0.10


# ---- the options and the report -------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanOptions:
    """How the model is served, and what else `plan` predicts; the CLI's defaults are these. Each number is held
    to plan/bounds.py when `plan` runs (check_serving)."""

    gpu_memory_gib: float = options.PLAN_GPU_MEMORY_GIB
    gpus: int = options.PLAN_GPUS
    context_len: int = options.PLAN_CONTEXT_LEN  # tokens per request
    # tensor parallelism: tp GPUs hold one copy of the model, gpus/tp copies serve in parallel (None: all the GPUs)
    tp: int | None = None
    activation_reserve_gib: float | None = None  # kept free of weights and KV per GPU (None: 10% of the GPU)
    # the KV dtype the summary highlights (KV_DTYPES or an alias: fp8, bf16, ...; None: float8_e4m3 for a recipe
    # with a kv_cache section, else bfloat16)
    kv_dtype: str | None = None
    # (samples, tokens per sample): also predict the recipe's calibrated pass (calibration.calibration_cost) on
    # `gpus` ranks of `device` ("cuda" or "cpu"), with the rates of `throughput` (a Throughput, e.g.
    # measure.measure_throughput()'s; None: the shipped table's), the layers computing in `compute_dtype`
    # (options.COMPUTE_DTYPE_CHOICES)
    calibration: tuple[int, int] | None = None
    device: str = options.PLAN_COST_DEVICE
    throughput: Throughput | None = None
    compute_dtype: str = options.COMPUTE_DTYPE


@dataclass(frozen=True)
class PlanReport:
    """Everything `plan` computed. Bytes are bytes; GiB = 2**30 bytes."""

    model: str
    model_type: str
    arch: str
    source_format: str
    recipe: str | None
    parameters: Mapping[str, int]  # by role, plus "total"
    active_parameters: int  # per token: everything but the routed experts and MTP, plus top-k/E of them
    checkpoint_bytes: Mapping[str, int | None]  # {"source", "recipe"}
    bytes_by_role: Mapping[str, Mapping[str, int | None]]  # role -> {"source", "recipe"}
    kv: KVLayout
    kv_bytes_per_token: Mapping[str, int | None]  # whole model, per KV dtype
    kv_bytes_per_token_per_gpu: Mapping[str, int | None]
    kv_tokens: Mapping[str, int | None]
    max_concurrency: Mapping[str, int | None]
    kv_dtype: str  # the dtype the summary highlights
    gpus: int
    tp: int
    gpu_memory_gib: float
    context_len: int
    activation_reserve_gib: float
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    calibration: CalibrationCost | None = None  # `--calibration N,T`: the calibrated pass's cost (calibration.py)

    def to_json(self) -> dict[str, Any]:
        """The `quantkit plan --json` object. Contract keys: parameters, checkpoint_bytes,
        kv_bytes_per_token, kv_tokens, max_concurrency; the rest is extra detail."""
        kv = self.kv
        doc = {
            "parameters": dict(self.parameters),
            "checkpoint_bytes": dict(self.checkpoint_bytes),
            "kv_bytes_per_token": dict(self.kv_bytes_per_token),
            "kv_tokens": dict(self.kv_tokens),
            "max_concurrency": dict(self.max_concurrency),
            "model": {"name": self.model, "model_type": self.model_type, "arch": self.arch,
                      "source_format": self.source_format, "recipe": self.recipe},
            "active_parameters": self.active_parameters,
            "bytes_by_role": {r: dict(v) for r, v in self.bytes_by_role.items()},
            "kv_cache": {"kind": kv.kind, "layers": kv.layers, "values_per_layer": kv.values_per_layer,
                         "indexer_layers": kv.indexer_layers, "indexer_values_per_layer": kv.indexer_dim,
                         "selected_dtype": self.kv_dtype},
            "per_gpu": {"gpus": self.gpus, "tp": self.tp, "replicas": self.gpus // self.tp,
                        "gpu_memory_bytes": int(self.gpu_memory_gib * GIB),
                        "activation_reserve_bytes": int(self.activation_reserve_gib * GIB),
                        "weight_bytes": self.weight_bytes_per_gpu,
                        "kv_budget_bytes": self.kv_budget_bytes_per_gpu,
                        "kv_bytes_per_token": dict(self.kv_bytes_per_token_per_gpu)},
            "context_len": self.context_len,
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }
        if self.calibration is not None:
            doc["calibration"] = self.calibration.to_json()
        return doc


def _kv_dtype(kv_dtype: str | None, recipe: Recipe | None, kind: str) -> str:
    if kv_dtype is None:
        return "float8_e4m3" if recipe is not None and recipe.kv_cache is not None else "bfloat16"
    d = _KV_ALIASES.get(str(kv_dtype).lower())
    if d is None:
        raise ConfigError(f"unknown kv_dtype {kv_dtype!r}", hint=f"choose one of {', '.join(KV_DTYPES)}")
    if d == "fp8_ds_mla" and kind != "mla":
        raise ConfigError("kv_dtype fp8_ds_mla applies to MLA models only (DeepSeek-V3, Kimi K2, GLM-5)")
    return d


def check_serving(*, gpu_memory_gib: float, gpus: int, tp: int | None, context_len: int,
                  activation_reserve_gib: float | None) -> int:
    """The serving setup plan() sizes, held to plan/bounds.py (each a finite number in its range; a ConfigError
    naming it otherwise) and tp to dividing gpus; returns tp (None: all the GPUs). The CLI calls it before
    anything slow (`--measure`)."""
    check_number("gpu_memory_gib", gpu_memory_gib, 0, MAX_GPU_MEMORY_GIB, integer=False, lo_open=True)
    check_number("gpus", gpus, 1, MAX_GPUS, integer=True)
    tp = gpus if tp is None else check_number("tp", tp, 1, MAX_GPUS, integer=True)
    if gpus % tp:
        raise ConfigError(f"gpus={gpus} must be a positive multiple of tp={tp}",
                          hint="tp GPUs hold one copy of the model; gpus/tp copies serve in parallel")
    check_number("context_len", context_len, 1, MAX_CONTEXT_LEN, integer=True)
    if activation_reserve_gib is not None:
        check_number("activation_reserve_gib", activation_reserve_gib, 0, MAX_GPU_MEMORY_GIB, integer=False)
    return tp


def plan(model_or_config: str | Path, recipe: str | Recipe | None = None,
         opts: PlanOptions = PlanOptions()) -> PlanReport:
    """Plan memory for `model_or_config` (config.json, checkpoint directory, or reference config name),
    optionally after `recipe`, served as `opts` says (PlanOptions: `gpus` GPUs of `gpu_memory_gib` GiB with
    tensor parallelism `tp` at `context_len` tokens per request, `activation_reserve_gib` per GPU kept free of
    weights and KV). `opts.calibration` (samples, tokens per sample): also predict the recipe's calibrated pass
    on `gpus` ranks of `opts.device`: wall time by component, device memory and host RAM per rank
    (calibration.calibration_cost)."""
    tp = check_serving(gpu_memory_gib=opts.gpu_memory_gib, gpus=opts.gpus, tp=opts.tp, context_len=opts.context_len,
                       activation_reserve_gib=opts.activation_reserve_gib)
    if opts.calibration is not None and recipe is None:
        raise ConfigError("a calibration cost needs a recipe", hint="pass --recipe, e.g. int4-experts-gptq")
    if opts.device not in ("cpu", "cuda"):
        raise ConfigError(f"device {opts.device!r}: the cost model knows cpu and cuda")
    src = _resolve(model_or_config)
    headers = _tensor_shapes_from_checkpoint(src.checkpoint) if src.checkpoint is not None else None
    # a checkpoint's config.json is held against its tensors (arch.validate) before anything is computed
    spec = (validate(src.config, {n: sh for n, (sh, _) in headers.items()}) if headers else None) \
        or parse_config(src.config)
    if spec.quantization and spec.quantization.get("quant_method") in ("fp8", "compressed-tensors"):
        detect_format({"quantization_config": dict(spec.quantization)})  # what the sizing reads, checked first
    rec = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    kv_sel = _kv_dtype(opts.kv_dtype, rec, "mla" if spec.attention == "mla" else "gqa")
    tensors, n_shards, source_total, assumptions = _source_tensors(src, spec, headers)
    params, active = _parameters(src, spec, tensors)
    src_role = _by_role(tensors, spec.num_layers, lambda n, s, d: tensor_bytes(s, d))
    rec_total, rec_role = _recipe_bytes(tensors, rec, spec, n_shards)
    bytes_by_role = {r: {"source": src_role[r], "recipe": rec_role[r] if rec_role else None}
                     for r in ROLES if src_role[r] or (rec_role and rec_role[r])}
    # GPU residency. MTP weights are not loaded (no speculative decoding) and cache no KV.
    resident = sum((rec_role or src_role)[r] for r in ROLES if r != "mtp")
    serving, warnings = _serving(opts, tp, spec, resident)
    assumptions += _serving_assumptions(opts, tp, spec, rec, serving["kv"], serving["activation_reserve_gib"])
    cost = None
    if opts.calibration is not None:
        cost = calibration_cost(model_or_config, rec, int(opts.calibration[0]), int(opts.calibration[1]),
                                CostOptions(world_size=opts.gpus, device=opts.device,
                                            gpu_memory_gib=opts.gpu_memory_gib if opts.device == "cuda" else None,
                                            throughput=opts.throughput, compute_dtype=opts.compute_dtype))
    return PlanReport(
        model=src.label, model_type=spec.model_type, arch=spec.arch, source_format=spec.source_format,
        recipe=rec.name if rec else None, parameters=params, active_parameters=active,
        checkpoint_bytes={"source": source_total, "recipe": rec_total}, bytes_by_role=bytes_by_role,
        kv_dtype=kv_sel, gpus=opts.gpus, tp=tp, gpu_memory_gib=opts.gpu_memory_gib, context_len=opts.context_len,
        assumptions=tuple(assumptions), warnings=tuple(warnings), calibration=cost, **serving)


def _source_tensors(src, spec: ModelSpec, headers: TensorShapes | None) -> tuple[TensorShapes, int | None, int,
                                                                                 list[str]]:
    """(the tensors, the source's shard count, its bytes, what was assumed): the real headers of a checkpoint
    directory, or the hub layout enumerated from config.json (no shard count: estimated)."""
    if src.checkpoint is not None:
        shard_files = sorted(src.checkpoint.glob("*.safetensors"))
        n_shards = len(shard_files)
        return headers, n_shards, sum(f.stat().st_size for f in shard_files), [
            f"tensors: read from the safetensors headers of {n_shards} shard(s); source bytes are the shard file "
            "sizes"]
    tensors = source_tensors(spec)
    mtp_note = (f"; the {spec.mtp_layers} MTP layer(s) the hub release ships are included"
                if spec.mtp_layers else "")
    assumptions = [f"tensors: enumerated from config.json in the hub layout ({spec.source_format}"
                   f"{mtp_note}); header bytes estimated for {DEFAULT_SHARD_BYTES // 10**9} GB shards"]
    if spec.prefix:
        assumptions.append("kimi_k25: text model only (the vision tower is not enumerated from a config)")
    if spec.quantization and spec.quantization.get("quant_method") == "fp8":
        assumptions.append("fp8 source: every Linear in FP8 with float32 128x128 weight_scale_inv; embeddings, "
                           "lm_head, routers, eh_proj, indexer weights_proj and norms in BF16")
    return tensors, None, predict_bytes(tensors, None), assumptions


def _parameters(src, spec: ModelSpec, tensors: TensorShapes) -> tuple[dict[str, int], int]:
    """(parameters by role and "total", active parameters per token). They come from the unquantized
    enumeration for configs (exact), from headers for directories."""
    logical = enumerate_tensors(spec) if src.checkpoint is None and spec.quantization else tensors
    params = _by_role(logical, spec.num_layers, parameter_count)
    params["total"] = sum(params[r] for r in ROLES)
    routed = params["routed_experts"]
    active = params["total"] - params["mtp"] - routed
    if spec.num_experts:
        active += routed * spec.experts_per_tok // spec.num_experts
    return params, active


def _recipe_bytes(tensors: TensorShapes, rec: Recipe | None, spec: ModelSpec,
                  n_shards: int | None) -> tuple[int | None, dict[str, int] | None]:
    """(the checkpoint's bytes after `rec`, its bytes by role); (None, None) without a recipe."""
    if rec is None:
        return None, None
    layout = quantized_layout(tensors, rec, spec=spec)
    rec_data = sum(tensor_bytes(sh, d) for sh, d in layout.values())
    rec_total = rec_data + header_bytes(layout, n_shards or max(1, -(-rec_data // DEFAULT_SHARD_BYTES)))
    return rec_total, _by_role(layout, spec.num_layers, lambda n, s, d: tensor_bytes(s, d))


def _serving(opts: PlanOptions, tp: int, spec: ModelSpec, resident: int) -> tuple[dict[str, Any], list[str]]:
    """(PlanReport's per-GPU and KV fields, warnings) for `resident` weight bytes split over tp GPUs: what is left
    of each GPU for KV after the weights and the reserve, and the tokens and requests it holds per KV dtype."""
    warnings: list[str] = []
    weights_per_gpu = -(-resident // tp)
    reserve_gib = (DEFAULT_RESERVE_FRACTION * opts.gpu_memory_gib if opts.activation_reserve_gib is None
                   else opts.activation_reserve_gib)
    gpu_bytes = int(opts.gpu_memory_gib * GIB)
    budget = gpu_bytes - int(reserve_gib * GIB) - weights_per_gpu
    if budget <= 0:
        warnings.append(f"weights ({weights_per_gpu / GIB:.1f} GiB per GPU at tp={tp}) plus the reserve "
                        f"({reserve_gib:.1f} GiB) exceed {opts.gpu_memory_gib:g} GiB: no room for KV cache")
        budget = 0
    kv = kv_layout(spec)
    replicas = opts.gpus // tp
    kv_gpu = {d: kv.bytes_per_token(d, tp) for d in KV_DTYPES}
    return {"kv": kv, "kv_bytes_per_token": {d: kv.bytes_per_token(d) for d in KV_DTYPES},
            "kv_bytes_per_token_per_gpu": kv_gpu,
            "kv_tokens": {d: None if b is None else replicas * (budget // b) for d, b in kv_gpu.items()},
            "max_concurrency": {d: None if b is None else replicas * ((budget // b) // opts.context_len)
                                for d, b in kv_gpu.items()},
            "activation_reserve_gib": reserve_gib, "weight_bytes_per_gpu": weights_per_gpu,
            "kv_budget_bytes_per_gpu": budget}, warnings


def _serving_assumptions(opts: PlanOptions, tp: int, spec: ModelSpec, rec: Recipe | None, kv: KVLayout,
                         reserve_gib: float) -> list[str]:
    """What the serving figures assume: the weights' split, the reserve, the KV layout, the source's format."""
    replicas = opts.gpus // tp
    w_label = f"recipe {rec.name}" if rec else f"source ({spec.source_format})"
    assumptions = [
        f"weights on GPU: {w_label} bytes without MTP layers, split evenly over tp={tp} "
        f"({replicas} replica(s)); replicated small tensors (norms, routers) are not double-counted",
        f"activation reserve: {reserve_gib:g} GiB per GPU"
        + (f" (default: {DEFAULT_RESERVE_FRACTION:.0%} of the GPU)" if opts.activation_reserve_gib is None else ""),
        "KV cached by the decoder layers only (MTP layers serve no KV); float8_e4m3 = 1 byte per value "
        "with per-tensor scales",
        ("MLA: one latent (kv_lora_rank + qk_rope_head_dim values) per token per layer, replicated on every "
         "TP rank; fp8_ds_mla = FP8 latent + one fp32 scale per 128 values + BF16 rope (656 B/layer for 512+64)")
        if kv.kind == "mla" else
        f"GQA: K and V of {kv.kv_heads} KV heads x {kv.head_dim}; heads shard over TP ranks "
        f"({-(-kv.kv_heads // tp)} per GPU at tp={tp}, replicated beyond {kv.kv_heads})",
        f"max_concurrency = resident tokens // context_len ({opts.context_len:,} tokens per request)",
    ]
    if kv.kind == "mla":
        from ..engine.vllm_config import DSA_KV_NOTE, MLA_V_SCALE_NOTE

        assumptions.append(MLA_V_SCALE_NOTE + (f"; {DSA_KV_NOTE}" if kv.indexer_layers else ""))
    if kv.indexer_layers:
        assumptions.append(f"DSA indexer: one {kv.indexer_dim}-value key per token in {kv.indexer_layers} layers "
                           "(BF16 2 B, FP8 1 B per value; fp8_ds_mla adds one fp32 scale per 128 values)")
    if spec.quantization and spec.quantization.get("quant_method") == "fp8" and rec is not None:
        assumptions.append("recipe on an FP8 source: tensors the recipe does not target stay FP8 as they are")
    if spec.quantization and spec.quantization.get("quant_method") == "compressed-tensors" and rec is not None:
        assumptions.append("recipe on a compressed-tensors source: INT4 modules pass through as they are (never "
                           "re-quantized), FP4 modules too unless the recipe asks for another scheme")
    return assumptions


# ---- fit: the recipe for a memory target ---------------------------------------------------------------
MAX_CONCURRENCY = 1 << 24  # requests the fit holds KV for (bounds.check_number)
MAX_WEIGHTS_GIB = MAX_GPU_MEMORY_GIB * MAX_GPUS


@dataclass(frozen=True)
class FitOptions:
    """What `plan --fit` fits and how it measures (the serving setup is PlanOptions').

    `concurrency` requests of PlanOptions.context_len tokens must be resident in the KV cache (None: none
    asked, the weights alone are fitted); `weights_gib` caps the whole model's resident weights (None: only the
    GPUs bound them). `kv_dtype` (None: float8_e4m3, with calibrated scales written by the recipe). `schemes`
    restricts the candidates (mix.CHOICES' names; None: all). `sensitivity` "measure" (a checkpoint directory
    transformers loads: plan/sensitivity.py, cached in `cache_dir`) or "prior" (mix.prior_loss); None: measure
    when the model is a checkpoint directory, else the prior. `dataset` / `num_samples` / `seq_len`: the
    calibration data of the measurement and of the written recipe."""

    concurrency: int | None = None
    weights_gib: float | None = None
    kv_dtype: str | None = None
    schemes: tuple[str, ...] | None = None
    sensitivity: str | None = None
    dataset: str | None = None
    num_samples: int = 16
    seq_len: int = 256
    cache_dir: Path | None = None


def check_fit(fopts: FitOptions) -> None:
    """FitOptions' numbers held to their ranges (one ConfigError line each), before anything slow."""
    if fopts.concurrency is not None:
        check_number("concurrency", fopts.concurrency, 1, MAX_CONCURRENCY, integer=True)
    if fopts.weights_gib is not None:
        check_number("weights_gib", fopts.weights_gib, 0, MAX_WEIGHTS_GIB, integer=False, lo_open=True)
    check_number("num_samples", fopts.num_samples, 1, options.MAX_NUM_SAMPLES, integer=True)
    check_number("seq_len", fopts.seq_len, 2, options.MAX_SEQ_LEN, integer=True)
    if fopts.sensitivity not in (None, "measure", "prior"):
        raise ConfigError(f"sensitivity {str(fopts.sensitivity)[:40]!r}: choose measure or prior")
    from .mix import choices

    choices(fopts.schemes)


def fit(model_or_config: str | Path, opts: PlanOptions = PlanOptions(), fopts: FitOptions = FitOptions(),
        say=lambda s: None):
    """The recipe of least predicted loss (mix.py) whose resident weights, KV cache for `fopts.concurrency`
    requests of `opts.context_len` tokens and activation reserve fit `opts.gpus` GPUs of `opts.gpu_memory_gib`
    (and `fopts.weights_gib`): a mix.FitResult with the recipe's YAML; FitError (saying what would fit) when no
    mix does."""
    from . import mix as F
    from .sensitivity import measure

    tp = check_serving(gpu_memory_gib=opts.gpu_memory_gib, gpus=opts.gpus, tp=opts.tp, context_len=opts.context_len,
                       activation_reserve_gib=opts.activation_reserve_gib)
    check_fit(fopts)
    src = _resolve(model_or_config)
    headers = _tensor_shapes_from_checkpoint(src.checkpoint) if src.checkpoint is not None else None
    spec = (validate(src.config, {n: sh for n, (sh, _) in headers.items()}) if headers else None) \
        or parse_config(src.config)
    kind = "mla" if spec.attention == "mla" else "gqa"
    kv_dtype = _kv_dtype(fopts.kv_dtype or "float8_e4m3", None, kind)
    tensors, n_shards, _, _ = _source_tensors(src, spec, headers)
    units = F.units(tensors, spec)
    if not units:
        raise FitError("the model has no decoder-layer Linears to choose a scheme for")
    cands = F.choices(fopts.schemes)
    ubytes, fixed, dropped = F.unit_bytes(tensors, spec, units, cands)
    calib = {"dataset": fopts.dataset, "num_samples": fopts.num_samples, "seq_len": fopts.seq_len}
    mode = fopts.sensitivity or ("measure" if src.checkpoint is not None else "prior")
    live = [c for c in cands if c.name not in dropped]
    if mode == "measure":
        if src.checkpoint is None:
            raise ConfigError("measured sensitivity needs a checkpoint directory with weights",
                              hint="pass the model's directory, or --sensitivity prior")
        cache = fopts.cache_dir or _fit_cache()
        loss, info = measure(src.checkpoint, units, live, calib, cache, say)
        source = "measured"
    else:
        params = {(u.layer, u.kind): sum(math.prod(tensors[f"{m}.weight"][0]) for m in u.modules) for u in units}
        loss = {k: {c.name: F.prior_loss(c) * params[k] for c in live} for k in params}
        info = {"method": "prior: relative RTN weight error of the scheme on a Student-t matrix x the unit's "
                          "parameters (the same for every layer)"}
        source = "prior"
    opts_by_unit = [{c: (ubytes[(u.layer, u.kind)][c], loss[(u.layer, u.kind)][c])
                     for c in ubytes[(u.layer, u.kind)] if c in loss[(u.layer, u.kind)]} for u in units]

    # the budget: plan's own per-GPU arithmetic, turned around
    reserve_gib = (DEFAULT_RESERVE_FRACTION * opts.gpu_memory_gib if opts.activation_reserve_gib is None
                   else opts.activation_reserve_gib)
    replicas = opts.gpus // tp
    kv = kv_layout(spec)
    per_token = kv.bytes_per_token(kv_dtype, tp)
    tokens = 0 if fopts.concurrency is None else -(-fopts.concurrency // replicas) * opts.context_len
    kv_per_gpu = per_token * tokens
    per_gpu = int(opts.gpu_memory_gib * GIB) - int(reserve_gib * GIB) - kv_per_gpu
    budget = per_gpu * tp
    arithmetic = [
        f"per GPU: {opts.gpu_memory_gib:g} GiB - reserve {reserve_gib:g} GiB - KV {kv_per_gpu / GIB:.2f} GiB "
        f"({tokens:,} tokens x {per_token:,} B {kv_dtype}) = {per_gpu / GIB:.2f} GiB for weights",
        f"weights: {per_gpu / GIB:.2f} GiB x tp {tp} = {budget / GIB:.2f} GiB resident (MTP layers not loaded)"]
    if fopts.weights_gib is not None and fopts.weights_gib * GIB < budget:
        budget = int(fopts.weights_gib * GIB)
        arithmetic.append(f"weights capped at {fopts.weights_gib:g} GiB (--weights-gib)")
    smallest = fixed + sum(min(b for b, _ in o.values()) for o in opts_by_unit)
    if budget < smallest:
        raise FitError(_what_would_fit(smallest, opts, fopts, tp, kv, kv_dtype, reserve_gib, kv_per_gpu, cands))

    kv_fp8 = kv_dtype != "bfloat16"
    header = [f"chosen by quantkit plan --fit for {src.label}: {opts.gpus} x {opts.gpu_memory_gib:g} GiB, tp {tp}, "
              f"context {opts.context_len:,}" + (f", {fopts.concurrency} requests" if fopts.concurrency else ""),
              *arithmetic, f"loss: {source} ({info['method']})"]
    room = budget - fixed
    for _ in range(4):  # plan's exact bytes (headers, KV scales) may tip a mix over: solve again tighter
        picks = F.solve(opts_by_unit, room)
        if picks is None:
            raise FitError(_what_would_fit(smallest, opts, fopts, tp, kv, kv_dtype, reserve_gib, kv_per_gpu, cands))
        rows = [(u, c, *opts_by_unit[i][c]) for i, (u, c) in enumerate(zip(units, picks))]
        text = F.chosen_recipe_text(src.label, rows, kv_fp8, calib if fopts.dataset else
                                    {k: v for k, v in calib.items() if v is not None}, header,
                                    {"budget_bytes": budget, "loss_source": source,
                                     "predicted_loss": sum(r[3] for r in rows)})
        rep = plan(model_or_config, F.parse_recipe(text), replace(opts, kv_dtype=kv_dtype))
        resident = sum(v["recipe"] or 0 for r, v in rep.bytes_by_role.items() if r != "mtp")
        if resident <= budget:
            break
        room -= resident - budget
    else:
        raise FitError("the chosen mix stays over the budget after four tighter solves", hint="report this")
    uniform = _uniform_rows(units, opts_by_unit, fixed, budget, live)
    return F.FitResult(
        units=tuple(F.FitUnit(u.layer, u.kind, c, b, l, dict(opts_by_unit[i]), u.modules)
                    for i, (u, c, b, l) in enumerate(rows)),
        budget_bytes=budget, fixed_bytes=fixed, weights_bytes=resident,
        predicted_loss=sum(l for _, _, _, l in rows), loss_source=source, recipe_text=text,
        uniform=tuple(uniform), arithmetic=tuple(arithmetic), dropped=dropped), rep


def _uniform_rows(units, opts_by_unit, fixed: int, budget: int, live) -> list[dict[str, Any]]:
    """Every uniform mix (one choice for all routed experts, one for all dense Linears): bytes, predicted loss,
    fits."""
    from . import mix as F

    out = []
    for ce in live:
        for cd in live:
            if F.ROUTED_KIND not in ce.kinds or F.DENSE_KIND not in cd.kinds:
                continue
            total, loss, ok = fixed, 0.0, True
            for u, o in zip(units, opts_by_unit):
                c = ce.name if u.kind == F.ROUTED_KIND else cd.name
                if c not in o:
                    ok = False
                    break
                total += o[c][0]
                loss += o[c][1]
            if ok:
                out.append({"routed": ce.name, "dense": cd.name, "bytes": total, "predicted_loss": loss,
                            "fits": total <= budget})
    return sorted(out, key=lambda r: r["bytes"])


def _what_would_fit(smallest: int, opts: PlanOptions, fopts: FitOptions, tp: int, kv: KVLayout, kv_dtype: str,
                    reserve_gib: float, kv_per_gpu: int, cands) -> str:
    """One line: the smallest mix against the target, and what would close the gap (fewer requests, more
    GPUs in the tensor-parallel group, a looser --weights-gib, a lower-bit scheme)."""
    gpu, reserve = int(opts.gpu_memory_gib * GIB), int(reserve_gib * GIB)
    lowest = "/".join(c.name for c in cands if not c.keep) or "keep"

    w_gpu = -(-smallest // tp)
    need = w_gpu + kv_per_gpu + reserve
    if fopts.weights_gib is not None and fopts.weights_gib * GIB < smallest:
        return (f"no mix fits --weights-gib {fopts.weights_gib:g}: the smallest ({lowest} where allowed) takes "
                f"{smallest / GIB:.4g} GiB; would fit: --weights-gib {_up(smallest / GIB):.4g} or "
                "more" + (", or a lower-bit scheme (--fit-schemes)" if _lower_bits_excluded(cands) else ""))
    head = (f"no mix fits: the smallest ({lowest} where allowed) needs {w_gpu / GIB:.1f} GiB of weights per GPU at "
            f"tp {tp}" + (f" + {kv_per_gpu / GIB:.1f} GiB of {kv_dtype} KV for {fopts.concurrency} requests of "
                          f"{opts.context_len:,} tokens" if fopts.concurrency else "")
            + f" + {reserve_gib:g} GiB reserve = {need / GIB:.1f} GiB > {opts.gpu_memory_gib:g} GiB")
    would = []
    per_req = kv.bytes_per_token(kv_dtype, tp) * opts.context_len
    if fopts.concurrency and gpu - reserve - w_gpu >= per_req:
        would.append(f"at most {(opts.gpus // tp) * ((gpu - reserve - w_gpu) // per_req)} requests of "
                     f"{opts.context_len:,} tokens")
    more = next((t for t in (tp * 2 ** i for i in range(1, 17)) if t <= MAX_GPUS
                 and -(-smallest // t) + kv.bytes_per_token(kv_dtype, t) * (fopts.concurrency or 0) * opts.context_len
                 + reserve <= gpu), None)
    if more:
        would.append(f"{more} GPUs of {opts.gpu_memory_gib:g} GiB in one tensor-parallel group")
    if _lower_bits_excluded(cands):
        would.append("a lower-bit scheme (--fit-schemes)")
    return head + ("; would fit: " + ", or ".join(would) if would else "")


def _lower_bits_excluded(cands) -> bool:
    """Whether a candidate left out of `cands` stores fewer bits per weight than every one in it."""
    from .mix import CHOICES

    names = {c.name for c in cands}
    allowed = min((c.bits for c in cands if not c.keep), default=16.0)
    return any(c.bits < allowed for c in CHOICES if c.name not in names)


def _up(x: float, digits: int = 4) -> float:
    """`x` rounded up to `digits` significant digits (a bound one can type that still holds x)."""
    k = digits - 1 - math.floor(math.log10(x))
    return math.ceil(x * 10**k) / 10**k


def _fit_cache() -> Path:
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantkit" / "fit"
