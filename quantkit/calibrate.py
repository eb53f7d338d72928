"""`quantkit calibrate`: FP8 KV-cache scales (and expert token counts) from calibration data.

Pipeline: open the checkpoint -> tokenize and sample the calibration data (`calib.data`) -> stream the
decoder layers one at a time (`calib.executor`) with a KV-cache observer and an expert-token counter
attached (`calib.observers`) -> scales = amax / 448 per layer -> `CalibrationResult`, written by
`write_scales` as a small safetensors file that `convert --kv-scales` and vLLM-style loaders read:
`model.layers.L.self_attn.k_scale` / `v_scale`, float32, shape [1] (strategy "tensor") or
[num_kv_heads, 1, 1] ("attn_head"; for MLA the "head" count is 1). Names are relative to the text
model; a wrapper's checkpoint carries them under its prefix (`CalibrationResult.checkpoint_scales`).

Memory: one decoder layer's weights (in the compute dtype) plus two copies of the calibration
activations (samples x seq_len x hidden); docs/calibration.md derives the bound. `device` (cpu, cuda,
cuda:N, auto; the default is options.DEVICE, shared with the CLI): on a GPU the layers run there in
bfloat16, and every layer's peak device memory is estimated and checked before any work (calib/device.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__, options
from .errors import CalibrationError, KVScalesError
from .calib.data import DEFAULT_SEED, load_calibration_data, load_tokenizer
from .calib.executor import DEFAULT_ACTIVATION_BUDGET, LayerExecutor
from .calib.observers import FP8_E4M3_MAX, ExpertTokenCounter, KVCacheObserver, fp8_scale
from .write.writer import write_safetensors
from .pack import kv as kvrules

# The one set of defaults the CLI, recipes and library share (quantkit/options.py).
DEFAULT_NUM_SAMPLES: int = options.NUM_SAMPLES
DEFAULT_SEQ_LEN: int = options.SEQ_LEN
DEFAULT_STRATEGY = options.KV_STRATEGY
DEFAULT_DEVICE = options.DEVICE
STRATEGIES = kvrules.STRATEGIES
SCALES_FORMAT = "quantkit-kv-scales"


@dataclass(frozen=True)
class LayerKV:
    """KV statistics of one decoder layer: floats for strategy "tensor", per-head lists for "attn_head"."""

    layer: int
    k_amax: float | list[float]
    v_amax: float | list[float]
    k_scale: float | list[float]
    v_scale: float | list[float]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "k_amax": self.k_amax, "v_amax": self.v_amax, "k_scale": self.k_scale,
                "v_scale": self.v_scale}


@dataclass
class CalibrationResult:
    model: str
    model_type: str
    attention: str  # "gqa" | "mla"
    strategy: str
    layers: list[LayerKV]  # index = layer
    expert_tokens: dict[int, list[int]]  # MoE layer -> tokens routed to each expert
    scales: dict[str, torch.Tensor]  # tensor name -> float32 [1] or [H_kv, 1, 1]
    data: dict[str, Any]  # source, sha256, num_samples, seq_len, num_tokens, tokenizer, ...
    seconds: float
    peak_rss_bytes: int
    top_k: dict[int, int] = field(default_factory=dict)
    output: str | None = None  # set by write_scales
    # DSA models (glm_moe_dsa): amax of the keys each indexer caches, per layer with an indexer. Reported,
    # never written as a scale: vLLM quantizes those keys with scales it computes per 128 values.
    indexer_k_amax: dict[int, float] = field(default_factory=dict)
    # The text model's tensor prefix in the checkpoint ("language_model." for Kimi K2.5's kimi_k25 wrapper).
    # `scales` (and the scales file) are named relative to the text model, as pack/kv.py defines them;
    # `checkpoint_scales()` gives the names a serving engine loads from a checkpoint of this model.
    prefix: str = ""
    # where the layers ran ("cpu", "cuda:0") and the memory plan (calib/device.py: estimated peak bytes per
    # layer, available bytes, where the activations lived, the measured peak on a GPU)
    device: str | None = None
    memory: dict | None = None

    @property
    def kv_cache_scheme(self) -> dict[str, Any]:
        return kvrules.kv_cache_scheme(self.strategy)

    def checkpoint_scales(self) -> dict[str, torch.Tensor]:
        """`scales` under the names a checkpoint of this model carries them (the wrapper's prefix added:
        vLLM's KimiK25ForConditionalGeneration routes only `language_model.*` to its text model)."""
        return {self.prefix + n: t for n, t in self.scales.items()}

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: contract keys `output`, `layers`, `expert_tokens`, plus extras
        (`indexer_k_amax` for DSA models, `prefix` for wrapped text models)."""
        out = {
            "output": self.output,
            "layers": [lk.to_json() for lk in self.layers],
            "expert_tokens": {str(k): v for k, v in sorted(self.expert_tokens.items())},
            "model": self.model, "model_type": self.model_type, "attention": self.attention,
            "strategy": self.strategy, "kv_cache_scheme": self.kv_cache_scheme, "fp8_max": FP8_E4M3_MAX,
            "top_k": {str(k): v for k, v in sorted(self.top_k.items())},
            "data": self.data, "seconds": round(self.seconds, 3), "peak_rss_bytes": self.peak_rss_bytes,
        }
        if self.indexer_k_amax:
            out["indexer_k_amax"] = {str(k): v for k, v in sorted(self.indexer_k_amax.items())}
        if self.prefix:
            out["prefix"] = self.prefix
        if self.device is not None:
            out["device"] = self.device
            out["device_memory"] = self.memory
        return out


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _floats(t: torch.Tensor, strategy: str) -> float | list[float]:
    return float(t.reshape(-1)[0]) if strategy == "tensor" else [float(x) for x in t.reshape(-1)]


def calibrate(model_dir: str | os.PathLike, *, dataset: str | os.PathLike | None = None,
              num_samples: int = DEFAULT_NUM_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN, strategy: str = DEFAULT_STRATEGY,
              seed: int = DEFAULT_SEED, dtype: torch.dtype | None = None, device: str | None = DEFAULT_DEVICE,
              batch_tokens: int | None = None, activation_budget_bytes: int = DEFAULT_ACTIVATION_BUDGET,
              available_bytes: int | None = None, progress: Callable[[int, int], None] | None = None,
              log: Callable[[str], None] | None = None) -> CalibrationResult:
    """Calibrate FP8 KV-cache scales for the checkpoint in `model_dir` (see the module docstring).
    `progress(layer_idx, num_layers)` is called after each decoder layer; `log(line)` gets the device and its
    memory plan before the first. `device`: cpu, cuda, cuda:N or auto (None: the default); `dtype`: what the
    layers compute in (None: float32 on the CPU, bfloat16 on a GPU); `available_bytes`: the device memory the
    plan may use (None: what the GPU reports free); `batch_tokens`: tokens per forward call (None: sized to
    the layer, see `LayerExecutor.auto_batch_tokens`)."""
    if strategy not in STRATEGIES:
        raise CalibrationError(f"unknown KV-cache strategy {strategy!r}", hint="use --strategy tensor or attn_head")
    t0 = time.perf_counter()
    ex = LayerExecutor(model_dir, dtype=dtype, device=device, batch_tokens=batch_tokens,
                       activation_budget_bytes=activation_budget_bytes, available_bytes=available_bytes)
    data = load_calibration_data(dataset, tokenizer=load_tokenizer(model_dir), vocab_size=ex.config.vocab_size,
                                 num_samples=num_samples, seq_len=seq_len, seed=seed)
    lengths = [len(s) for s in data.samples]
    plan = ex.plan_memory(lengths, statistics=lambda i, layer: _observer_bytes(ex, ex.call_tokens(lengths)))
    if log is not None:
        log(plan.summary())
    kv, experts = KVCacheObserver(), ExpertTokenCounter()
    final = ex.run(data.samples, [kv, experts], progress=progress)
    final.close()
    ex.measured_peak_bytes()

    return _result(model_dir, ex, kv, experts, strategy, data, t0, plan)


def _result(model_dir, ex: LayerExecutor, kv: KVCacheObserver, experts: ExpertTokenCounter, strategy: str, data,
            t0: float, plan) -> CalibrationResult:
    """The scales (amax / 448 per layer) and everything measured, from the observers of a finished pass (one
    process, or the statistics every rank contributed: calib/kv_dist.py)."""
    layers, scales = [], {}
    for i in range(ex.num_layers):
        ka, va = kv.amax(i, strategy)  # [1] or [H_kv, 1, 1]
        ks, vs = fp8_scale(ka), fp8_scale(va)
        layers.append(LayerKV(i, _floats(ka, strategy), _floats(va, strategy), _floats(ks, strategy),
                              _floats(vs, strategy)))
        scales[kvrules.kv_scale_name(i, "k")] = ks
        scales[kvrules.kv_scale_name(i, "v")] = vs
    return CalibrationResult(
        model=str(model_dir), model_type=str(ex.ckpt.config.get("model_type")), attention=ex.spec.attention,
        strategy=strategy, layers=layers, expert_tokens={i: c.tolist() for i, c in sorted(experts.counts.items())},
        scales=scales, data=data.describe(), seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(),
        top_k=dict(experts.top_k), indexer_k_amax=dict(sorted(kv.indexer_k_amax.items())), prefix=ex.prefix,
        device=str(ex.device), memory=plan.to_json())


def _observer_bytes(ex: LayerExecutor, tokens: int) -> dict[str, int]:
    """What the KV observer holds during one forward call: the recomputed K and V (or the MLA latent) of a
    batch and their rotated copies, in the compute dtype."""
    cfg = ex.config
    item = torch.empty((), dtype=ex.dtype).element_size()
    if getattr(cfg, "kv_lora_rank", None):
        width = int(cfg.kv_lora_rank) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
    else:
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        width = 2 * heads * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return {"kv_observer": 3 * tokens * width * item}


def write_scales(result: CalibrationResult, path: str | os.PathLike) -> int:
    """Write `result.scales` as safetensors to `path` (via a temporary file, then renamed); sets
    `result.output` and returns the bytes written. The metadata records the scheme and the data used."""
    path = Path(path)
    for name, t in result.scales.items():  # pack/kv.py's rules, plausible range included: nothing else is written
        problem = kvrules.tensor_problem(name, t)
        if problem:
            raise KVScalesError(f"calibration gave {problem}", hint="the model's activations are implausible on "
                                "this data (check its weights); the scales were not written")
    meta = {"format": SCALES_FORMAT, "strategy": result.strategy, "kv_cache_scheme": json.dumps(result.kv_cache_scheme),
            "model_type": result.model_type, "attention": result.attention, "quantkit_version": __version__,
            "data": json.dumps(result.data, sort_keys=True)}
    if result.prefix:  # the names in the file are relative to the text model; a checkpoint adds this prefix
        meta["prefix"] = result.prefix
    tmp = path.with_name(f".{path.name}.tmp")
    n = write_safetensors(tmp, result.scales, metadata=meta)
    os.replace(tmp, path)
    result.output = str(path)
    return n


def read_scales(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read and validate a KV-scales file (pack/kv.py's rules): only `model.layers.L.self_attn.{k,v}_scale`,
    float32, shape [1] or [H, 1, 1], finite and positive, both K and V for every layer, one shape throughout."""
    scales = kvrules.read_file(path)
    layers = {int(kvrules.KV_SCALE.match(n)[1]) for n in scales}
    shape = next(iter(scales.values())).shape
    kvrules.validate(scales, num_layers=max(layers) + 1, attn_layers=layers, kv_heads=shape[0], mla=False)
    return scales


def scales_strategy(scales: dict[str, torch.Tensor]) -> str:
    """"tensor" or "attn_head", from the shapes of validated scales (`read_scales`)."""
    return kvrules.strategy_of(tuple(next(iter(scales.values())).shape))
