"""A layer-by-layer executor over transformers decoder layers, for calibration without the whole model.

The model is built on the `meta` device from config.json (no weights, no remote code). The calibration
tokens are embedded (only `embed_tokens` is read, and only the rows the tokens use), then each decoder layer
in turn is materialized from the shards (`load_layer_weights`), run over all calibration samples with the
model's own rotary embeddings and causal mask, observed, and freed. Peak memory is one layer's weights
(in the compute dtype) plus two copies of the activations (a layer's inputs and outputs); the final norm,
the lm_head and every other layer stay on `meta`. Activations above `activation_budget_bytes` live in a
temporary file (a memory map) instead of RAM.

Reuse (GPTQ/AWQ, true-sequential):

    ex = LayerExecutor(model_dir)
    for step in ex.layers(samples, observers=[...]):
        idx, layer, inputs = step            # the layer is materialized; hooks may be added to its modules
        step.forward()                        # run it over the inputs (observers fire); sets step.outputs
        quantize(layer)                       # modify the layer in place ...
        step.forward()                        # ... and propagate the *quantized* layer's outputs
    # a step the body did not forward is forwarded by the executor when the loop resumes

Routed experts run grouped by expert (`calib/moe.py`, installed on every layer this executor materializes:
bit-identical to transformers' eager loop, and the routing of each call is sorted once and shared with the
observers' hooks, `moe.routing_for`).

A pass that changes only a layer's MLP block (GPTQ of the routed experts) needs neither forward whole:
`step.observe(stop_at=experts)` runs the layer only until the experts are called (their pre-hooks still
fire) and keeps the residual stream entering the block; the next `step.forward()` then runs only the block
from it (`forward_to` / `forward_from`; checked once per layer class against the layer's own forward).

Device (`device=`: cpu, cuda, cuda:N or auto; calib/device.py): on a GPU the layer is materialized there in
bfloat16 (quantized sources decoded there), and the activations stay there when they fit beside the largest
layer, in host memory otherwise. Before any work, `plan_memory` estimates every layer's peak device memory;
a layer that cannot fit is refused then (DeviceMemoryError). On the CPU everything is as it always was.

What it is not: a serving runtime (no KV cache, no padding, no generation) or a weights loader for the
whole model. `load_layer_weights` (calib/weights.py) maps the on-disk layouts (fused vs per-expert
experts, Mixtral's names, block-FP8 and pack-quantized INT4 sources).

A multimodal wrapper (Kimi K2.5's `kimi_k25`, arch.WRAPPERS) is built as its text model from its
`text_config`, its tensors read under the wrapper's prefix (`language_model.`). GLM-5's sparse attention
(glm_moe_dsa) needs what the model's own forward gives its layers besides the hidden states: a causal
mask that is always materialized, and for "shared" indexer layers the previous full layer's top-k
indices, carried across layers per sample (`TopKCarry`).
"""

from __future__ import annotations

import gc
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from .. import timeline
from ..arch import arch_for, text_config, validate
from ..arch.layout import HF_BLOCK, POST_ATTN_NORM, top_level
from ..errors import CalibrationError, UnsupportedArchitecture, UnsupportedWeights
from ..hf import build_config  # noqa: F401 (the executor's config object; plan/measure.py imports it from here)
from ..read.checkpoint import Checkpoint
from ..read.tensors import TensorReader
from . import moe
from .activations import ActivationStore
from .device import (LayerMemory, MemoryPlan, available_bytes, bound_primitive_cache, compute_dtype, make_plan,
                     peak_bytes, resolve_device)
from .weights import bound_heap, load_layer_weights, release_memory, stored_modules

# Legend: N = samples, B = samples in a batch, T = tokens per sample, D = hidden size,
#         E = routed experts, I = expert intermediate size

MAX_BATCH_TOKENS = 8192  # tokens per forward call at most (B = max(1, batch_tokens // T) samples)
MIN_BATCH_TOKENS = 1024
LIVE_TEMPORARIES = 16  # ~[tokens, hidden] buffers a decoder layer's forward holds at once (measured ~14)
DEFAULT_ACTIVATION_BUDGET = 4 << 30  # bytes of one activation copy kept in RAM; above it, a memory-mapped file
# transformers' "eager" experts loop runs one expert at a time; "grouped_mm" first gathers every routed
# token copy (tokens x top_k x (2D + 3I) floats: ~5 GB per 8k-token batch on Kimi K2), which breaks the
# memory bound on CPU for no gain in speed there. With "eager" the executor installs quantkit's batched
# expert forward (calib/moe.py), bit-identical to it and bounded by moe.DEFAULT_BUDGET bytes of temporaries.
DEFAULT_EXPERTS_IMPLEMENTATION = "eager"


def build_meta_model(config, experts_implementation: str | None = None) -> nn.Module:
    """The CausalLM on the `meta` device: module structure and shapes, no memory. `experts_implementation`
    (MoE models only) picks transformers' routed-experts kernel, e.g. "eager" or "grouped_mm"."""
    from transformers import AutoModelForCausalLM

    from ..hf import quiet_transformers

    quiet_transformers(compressed_tensors=False)  # the config has no quantization_config (model_config)
    kw = {"experts_implementation": experts_implementation} if experts_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kw)
    return model.eval()


# ---- observers protocol -----------------------------------------------------------------------------
class Observer(Protocol):
    def attach(self, layer_idx: int, layer: nn.Module) -> list:  # -> removable hook handles
        ...


@dataclass
class LayerStep:
    """One decoder layer, materialized, with its inputs. Iterates as (index, layer, inputs)."""

    index: int
    layer: nn.Module
    inputs: ActivationStore
    executor: "LayerExecutor"
    outputs: ActivationStore | None = None  # set by forward(), or by the caller to replace the outputs
    residual: ActivationStore | None = None  # set by observe(stop_at=...): the first half of a split forward

    def forward(self) -> ActivationStore:
        """Run the layer (as it is now) over all inputs; the result becomes the next layer's inputs. After
        `observe(stop_at=...)` only the MLP block's half is run (LayerExecutor.forward_from)."""
        if self.outputs is not None:
            self.outputs.close()
            self.outputs = None
        if self.residual is not None:
            resid, self.residual = self.residual, None
            self.outputs = self.executor.forward_from(self.layer, self.inputs, resid)
        else:
            self.outputs = self.executor.forward_layer(self.layer, self.inputs)
        return self.outputs

    def observe(self, stop_at: nn.Module | None = None) -> None:
        """Run the layer over all inputs for its observers' sake. With `stop_at` (a module inside the layer's
        MLP block), only up to that module's call when the layer can be split (LayerExecutor.forward_to):
        the next `forward()` then runs only the block, from the residual stream kept here, so the caller
        must change nothing the layer computes before the block (attention, norms, the block's router) in
        between. Otherwise a whole forward (whose outputs are dropped by the next `forward()`)."""
        self.close()
        if stop_at is not None:
            self.residual = self.executor.forward_to(self.layer, self.inputs, stop_at)
            if self.residual is not None:
                return
        self.forward()

    def close(self) -> None:
        """Drop what this step computed (outputs, a split forward's first half)."""
        for store in (self.outputs, self.residual):
            if store is not None:
                store.close()
        self.outputs = self.residual = None

    def __iter__(self):
        return iter((self.index, self.layer, self.inputs))


# ---- the executor -----------------------------------------------------------------------------------
class LayerExecutor:
    """`device`: cpu, cuda, cuda:N or auto (None: options.DEVICE); `dtype`: a torch dtype or a
    `--compute-dtype` spelling (None, "auto": float32 on the CPU, bfloat16 on a GPU; calib/device.py).
    `batched_experts`: run routed experts with calib/moe.py's grouped forward (when `experts_implementation`
    is "eager", whose results it reproduces). `available_bytes`: the device memory
    the plan may use (None: the free memory a GPU reports; the CPU is not checked)."""

    def __init__(self, model: str | Path | Checkpoint, *, dtype: torch.dtype | str | None = None,
                 device: str | torch.device | None = None, batch_tokens: int | None = None,
                 activation_budget_bytes: int = DEFAULT_ACTIVATION_BUDGET, workdir: str | Path | None = None,
                 experts_implementation: str | None = DEFAULT_EXPERTS_IMPLEMENTATION, batched_experts: bool = True,
                 available_bytes: int | None = None):
        self.device = resolve_device(device)  # a bad or absent device fails before anything is read
        self.ckpt = model if isinstance(model, Checkpoint) else Checkpoint.open(model)
        bound_heap()
        self.spec = arch_for(self.ckpt.config, "calibrate")
        # config.json is hostile input: every field the layers are built from must agree with the tensors
        validate(self.ckpt.config, {n: self.ckpt.info(n).shape for n in self.ckpt.location})
        self.stored = stored_modules(self.ckpt)
        self.prefix = text_config(self.ckpt.config)[1]  # "language_model." for Kimi K2.5's wrapper
        self.config = build_config(self.ckpt.config)
        self.model = build_meta_model(self.config, experts_implementation if self.spec.experts else None)
        self.config = self.model.config
        self.dtype = compute_dtype(self.device, dtype)
        bound_primitive_cache(self.device, self.dtype)
        self.batched_experts = bool(batched_experts) and experts_implementation == "eager"
        self.available_bytes = available_bytes
        self.memory: MemoryPlan | None = None  # plan_memory(), before the first layer
        self.activations_on_device = False
        self.activation_budget_bytes = activation_budget_bytes
        self.workdir = workdir
        body = self.model.model
        self.decoder_layers: nn.ModuleList = body.layers
        self.num_layers = len(self.decoder_layers)
        # The rotary embedding's inv_freq is a non-persistent buffer computed at init: rebuild it for real.
        self.rotary_emb = type(body.rotary_emb)(config=self.model.config).to(self.device)
        self._mask_fn, self._mask_kwargs = self._mask_function()
        self.batch_tokens = batch_tokens or self.auto_batch_tokens()
        self.topk = TopKCarry(self) if "prev_topk_indices" in _forward_params(self.decoder_layers[0]) else None
        # A distributed pass (calib/parallel.py): the batch numbers of `batch_plan` this rank forwards (None:
        # every batch) and the suffix of the files it saves in `workdir` ("" in one process)
        self.share: set[int] | None = None
        self.file_tag = ""
        self._split_ok: dict[type, bool] = {}  # layer class -> whether forward_from reproduces its forward

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def layer_bytes(self, idx: int | None = None) -> int:
        """Bytes of decoder layer `idx` (default: the largest) materialized in the compute dtype."""
        item = torch.empty((), dtype=self.dtype).element_size()
        layers = self.decoder_layers if idx is None else [self.decoder_layers[idx]]
        return max(sum(t.numel() for t in layer.state_dict().values()) for layer in layers) * item

    # -- device memory --------------------------------------------------------------------------
    def weight_bytes(self, idx: int) -> int:
        """Bytes decoder layer `idx` holds once materialized: every tensor in the compute dtype, except what
        stays float32 (routers, as from_pretrained keeps them) and integer buffers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for name, t in self.decoder_layers[idx].state_dict().items():
            if not t.dtype.is_floating_point:
                total += t.numel() * t.element_size()
            else:
                total += t.numel() * (4 if self.dtype != torch.float32 and self._keep_fp32(name) else item)
        return total

    def call_tokens(self, lengths: Sequence[int]) -> int:
        """The most tokens one forward call gets for samples of these lengths (`ActivationStore.batches`:
        max(1, batch_tokens // T) samples of equal length T at once)."""
        by_len: dict[int, int] = {}
        for n in lengths:
            by_len[int(n)] = by_len.get(int(n), 0) + 1
        return max((t * min(c, max(1, self.batch_tokens // max(t, 1))) for t, c in by_len.items()), default=1)

    def forward_bytes(self, idx: int, lengths: Sequence[int]) -> int:
        """Temporaries of one forward call of layer `idx` over the largest batch of these samples: the batch
        itself when the activations are not on the device, ~LIVE_TEMPORARIES [tokens, hidden] buffers, the
        attention scores and probabilities [B, heads, T, T], the causal mask, and for a MoE layer the
        router's logits, the output and the expert blocks (bounded by moe.DEFAULT_BUDGET)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        t = max((int(n) for n in lengths), default=1) or 1
        tokens = self.call_tokens(lengths)
        b = max(1, tokens // t)
        cfg = self.config
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        h = self.hidden_size
        n = (LIVE_TEMPORARIES + 1) * tokens * h * item + 2 * b * heads * t * t * max(item, 4) + b * t * t * item
        if getattr(cfg, "index_topk", None):  # DSA (glm_moe_dsa): the indexer's scores and its top-k indices
            n += b * t * t * (int(getattr(cfg, "index_n_heads", 1) or 1) + 1) * 4 + b * t * min(int(cfg.index_topk), t) * 8
        layer = self.decoder_layers[idx]
        experts = next((m for m in layer.modules() if moe.is_routed_experts(m)), None)
        if experts is not None:
            e, p, _ = (int(d) for d in experts.gate_up_proj.shape)
            k = int(getattr(cfg, "num_experts_per_tok", None) or 8)
            pairs = moe._row_bytes(h, p, self.dtype, torch.float32, False) * tokens * k
            n += min(moe.DEFAULT_BUDGET, pairs) + 2 * tokens * e * 4 + tokens * k * 24 + tokens * h * item
        return int(n)

    def plan_memory(self, lengths: Sequence[int],
                    statistics: Callable[[int, nn.Module], dict[str, int]] | None = None) -> MemoryPlan:
        """Estimate every layer's peak device memory (`statistics(idx, meta layer)`: the pass's own bytes per
        component), place the activations (device or host) and check every layer against the available
        memory: a DeviceMemoryError names the first layer that cannot fit, before any work. Reported as
        `self.memory` (and by the callers: --json, the progress log)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        act = int(sum(int(t) for t in lengths)) * self.hidden_size * item
        layers = [LayerMemory(i, self.weight_bytes(i), self.forward_bytes(i, lengths),
                              dict(statistics(i, self.decoder_layers[i])) if statistics is not None else {})
                  for i in range(self.num_layers)]
        avail = self.available_bytes if self.available_bytes is not None else available_bytes(self.device)
        self.memory = make_plan(self.device, self.dtype, layers, act, avail)
        self.activations_on_device = self.memory.activations == "device"
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.memory

    def measured_peak_bytes(self) -> int | None:
        """The device's allocator peak since the plan (CUDA; None on the CPU), also recorded in the plan."""
        peak = peak_bytes(self.device)
        if self.memory is not None:
            self.memory.measured_peak_bytes = peak
        return peak

    def auto_batch_tokens(self) -> int:
        """Tokens per forward call. Big batches run faster on CPU, but the forward's temporaries grow with
        them; keep those within about one layer's weights (the memory bound allows two), clamped to
        [MIN_BATCH_TOKENS, MAX_BATCH_TOKENS]."""
        item = torch.empty((), dtype=self.dtype).element_size()
        fit = self.layer_bytes() // (LIVE_TEMPORARIES * self.hidden_size * item)
        return int(min(MAX_BATCH_TOKENS, max(MIN_BATCH_TOKENS, fit)))

    # -- building blocks ------------------------------------------------------------------------
    def embed(self, samples: Sequence[torch.Tensor]) -> ActivationStore:
        """Embed token samples (1-D int tensors) into a new store; reads only the used rows."""
        name = f"{top_level(self.prefix)[0]}.weight"
        if name not in self.ckpt.location:
            raise UnsupportedWeights(f"the checkpoint has no {name}")
        vocab = self.ckpt.info(name).shape[0]
        store = self._new_store([len(s) for s in samples])
        r = TensorReader.of(self.ckpt, mapped=False)
        try:
            for i, s in enumerate(samples):
                s = torch.as_tensor(s, dtype=torch.long)
                if s.numel() and (int(s.min()) < 0 or int(s.max()) >= vocab):
                    raise CalibrationError(f"sample {i} holds token ids outside [0, {vocab})",
                                           hint="the data was tokenized for another model")
                if s.numel():
                    store[i] = r.rows(name, s).to(self.dtype)  # only the rows this sample uses
        finally:
            r.close()
        return store

    def load_layer(self, idx: int) -> nn.Module:
        """Materialize decoder layer `idx` (strict: every parameter and buffer must come from disk)."""
        layer = self.decoder_layers[idx]
        sd = load_layer_weights(self.ckpt, idx, dtype=self.dtype, device=self.device, stored=self.stored)
        if self.dtype != torch.float32:  # what from_pretrained keeps in float32 (DeepSeek/GLM routers)
            for k in [k for k in sd if self._keep_fp32(k)]:
                sd[k] = sd[k].float()
        expected = set(layer.state_dict())
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise UnsupportedWeights(
                f"layer {idx}: on-disk tensors do not match the {self.spec.model_type} layer "
                f"(missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''})")
        shapes = {k: tuple(t.shape) for k, t in layer.state_dict().items()}
        for k, v in sd.items():
            if shapes[k] != tuple(v.shape):
                raise UnsupportedWeights(f"layer {idx}: {k} has shape {list(v.shape)} on disk, the config implies "
                                         f"{list(shapes[k])}")
        layer.load_state_dict(sd, strict=True, assign=True)
        left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if left:  # a non-persistent buffer we cannot recompute
            raise UnsupportedArchitecture(f"layer {idx}: {left[0]} is not stored in the checkpoint")
        if self.batched_experts:
            moe.install(layer)
        return layer.eval()

    def _keep_fp32(self, name: str) -> bool:
        mods = list(getattr(self.model, "_keep_in_fp32_modules", None) or []) + \
            list(getattr(self.model, "_keep_in_fp32_modules_strict", None) or [])
        return any(re.search(rf"(^|\.){re.escape(m)}($|\.)", name) for m in mods)

    def free_layer(self, idx: int) -> None:
        moe.uninstall(self.decoder_layers[idx])
        self.decoder_layers[idx].to_empty(device="meta")
        release_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_store(self, lengths: Sequence[int]) -> ActivationStore:
        return ActivationStore(lengths, self.hidden_size, self.dtype, budget_bytes=self.activation_budget_bytes,
                               workdir=self.workdir, device=self.device if self.activations_on_device else None)

    def restore(self, path: str | Path, lengths: Sequence[int]) -> ActivationStore:
        """A store of samples of `lengths` filled from a file written by `ActivationStore.save` (OSError or
        ValueError when the file does not fit them)."""
        store = self._new_store(lengths)
        try:
            store.load(path)
        except BaseException:
            store.close()
            raise
        return store

    def restore_samples(self, path: str | Path, lengths: Sequence[int], samples: Sequence[int]) -> ActivationStore:
        """A store of samples of `lengths` whose rows `samples` are filled from a file written by
        `ActivationStore.save_samples` (a distributed pass's rank file; OSError or ValueError when it does
        not fit them)."""
        store = self._new_store(lengths)
        try:
            store.load_samples(path, samples)
        except BaseException:
            store.close()
            raise
        return store

    def _mask_function(self):
        # The model's own choice (modeling_*.py): sliding-window mask iff config.sliding_window is set.
        from transformers import masking_utils

        fn = (masking_utils.create_sliding_window_causal_mask if getattr(self.config, "sliding_window", None)
              else masking_utils.create_causal_mask)
        params = inspect.signature(fn).parameters
        kw = {"cache": None} if "cache" in params else {"past_key_values": None}
        if getattr(self.config, "indexer_types", None) is not None and "allow_is_causal_skip" in params:
            kw["allow_is_causal_skip"] = False  # DSA: the indexer masks its scores with a real causal mask
        return fn, kw

    def _call_layer(self, layer: nn.Module, x: torch.Tensor, extra: dict | None = None):
        """One forward call of `layer` on a batch x [B, T, D] already on the device, with the model's own
        positions (every sample starts at 0), rotary embeddings and causal mask."""
        b, t, _ = x.shape
        pos = torch.arange(t, device=self.device).unsqueeze(0).expand(b, t)
        pe = self.rotary_emb(x, pos)
        mask = self._mask_fn(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=pos,
                             **self._mask_kwargs)
        return layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe, use_cache=False,
                     **(extra or {}))

    def _check_finite(self, layer: nn.Module, y: torch.Tensor) -> None:
        if not bool(torch.isfinite(y).all()):
            raise CalibrationError(f"decoder layer {getattr(layer.self_attn, 'layer_idx', '?')} "
                                   "produced non-finite hidden states")

    def forward_layer(self, layer: nn.Module, inputs: ActivationStore) -> ActivationStore:
        """Run `layer` over every sample of `inputs`; returns a new store with its outputs."""
        out = self._new_store(inputs.lengths)
        topk = self.topk.begin(layer, inputs.lengths) if self.topk is not None else None
        try:
            with torch.inference_mode():
                for idx, x in inputs.batches(self.batch_tokens, only=self.share):
                    x = x.to(self.device)
                    extra = topk.inputs(idx, x.shape[1]) if topk is not None else {}
                    y = self._call_layer(layer, x, extra)
                    if isinstance(y, tuple):  # (hidden_states, DSA top-k indices); older transformers: (h, ...)
                        if topk is not None:
                            topk.record(idx, y[1])
                        y = y[0]
                    self._check_finite(layer, y)
                    out.write(idx, y)  # copy_ moves device -> host when needed
        except BaseException:
            out.close()
            if topk is not None:
                topk.abort()
            raise
        if topk is not None:
            topk.finish()
        return out

    def check_second_stream(self) -> None:
        """Refuse a second stream of hidden states (GPTQ's fit_unquantized) where the layers carry DSA top-k
        indices from one layer to the next: there is one carry per pass."""
        if self.topk is not None:
            raise CalibrationError("fitting to the unquantized model (fit_unquantized) is not supported on models "
                                   "with DeepSeek sparse attention (glm_moe_dsa)", hint="leave fit_unquantized at 0")

    def forward_capture(self, layer: nn.Module, inputs: ActivationStore,
                        capture: nn.Module | None) -> tuple[ActivationStore, list[torch.Tensor]]:
        """`forward_layer`, also returning what `capture` (a module inside the layer; None: nothing) receives
        as its first argument in each forward call, float32 [rows, D], in batch order: the unquantized
        model's own stream beside the quantized one (GPTQ's fit_unquantized; `check_second_stream`)."""
        self.check_second_stream()
        seen: list[torch.Tensor] = []

        def grab(module, args):
            seen.append(args[0].detach().float().reshape(-1, args[0].shape[-1]).clone())

        handle = capture.register_forward_pre_hook(grab) if capture is not None else None
        try:
            out = self.forward_layer(layer, inputs)
        finally:
            if handle is not None:
                handle.remove()
        return out, seen

    # -- a forward in two halves (calibration statistics of the MLP block only) ---------------------
    def _split_parts(self, layer: nn.Module) -> tuple[nn.Module, nn.Module] | None:
        """(post-attention norm, MLP block) of a layer whose forward `forward_to` / `forward_from` may split
        there, or None. The layer's output must be residual + block(norm(residual)); `forward_from` checks
        that against a whole forward the first time a layer class is split."""
        norm, block = getattr(layer, POST_ATTN_NORM, None), getattr(layer, HF_BLOCK, None)
        if (self.topk is not None or not isinstance(norm, nn.Module) or not isinstance(block, nn.Module)
                or self._split_ok.get(type(layer)) is False):
            return None
        return norm, block

    def forward_to(self, layer: nn.Module, inputs: ActivationStore, stop_at: nn.Module) -> ActivationStore | None:
        """The first half of a split forward: run `layer` over every sample until `stop_at` (a module inside
        its MLP block, e.g. the routed experts) is called. Its forward pre-hooks registered before this
        call (statistics observers) still fire; nothing after them runs. Returns a new store holding, per
        sample, the residual stream that enters the block (the post-attention norm's input), for
        `forward_from`; None, having run nothing, when the layer cannot be split."""
        parts = self._split_parts(layer)
        if parts is None:
            return None
        norm, _ = parts
        seen: list[torch.Tensor] = []

        def grab(module, args):
            seen.append(args[0])

        def stop(module, args):
            moe.drop_routing(module)
            raise _StopForward

        out = self._new_store(inputs.lengths)
        handles = [norm.register_forward_pre_hook(grab), stop_at.register_forward_pre_hook(stop)]
        try:
            with torch.inference_mode():
                for idx, x in inputs.batches(self.batch_tokens, only=self.share):
                    seen.clear()
                    try:
                        self._call_layer(layer, x.to(self.device))
                    except _StopForward:
                        pass
                    if len(seen) != 1:
                        raise CalibrationError(f"decoder layer {getattr(layer.self_attn, 'layer_idx', '?')}: its "
                                               f"post-attention norm ran {len(seen)} times in one forward")
                    self._check_finite(layer, seen[0])
                    out.write(idx, seen[0].reshape(len(idx), x.shape[1], -1))
        except BaseException:
            out.close()
            raise
        finally:
            for h in handles:
                h.remove()
        return out

    def forward_from(self, layer: nn.Module, inputs: ActivationStore, resid: ActivationStore) -> ActivationStore:
        """The second half: every sample's output h + block(norm(h)) from `resid` (forward_to's store, whose
        rows are overwritten in place and which is returned). The first time a layer class is split, the
        first batch is also run whole from `inputs` and both must agree bit for bit; if they do not (or the
        split raises), that class is never split again and this layer's outputs come from whole forwards."""
        norm, block = self._split_parts(layer) or (None, None)
        verify = type(layer) not in self._split_ok
        try:
            with torch.inference_mode():
                pairs = zip(resid.batches(self.batch_tokens, only=self.share),
                            inputs.batches(self.batch_tokens, only=self.share))
                for (idx, h), (_, x) in pairs:
                    h = h.to(self.device)
                    if verify:
                        verify = False
                        try:
                            y = h + _first(block(norm(h)))
                            ok = torch.equal(y, _first(self._call_layer(layer, x.to(self.device))))
                        except Exception:  # a structure the split does not describe
                            ok = False
                        self._split_ok[type(layer)] = ok
                        if not ok:
                            resid.close()
                            return self.forward_layer(layer, inputs)
                    else:
                        y = h + _first(block(norm(h)))
                    self._check_finite(layer, y)
                    resid.write(idx, y)
        except BaseException:
            resid.close()
            raise
        return resid

    # -- the loop -------------------------------------------------------------------------------
    def layers(self, samples: Sequence[torch.Tensor] | ActivationStore, observers: Sequence[Observer] = (),
               start: int = 0) -> Iterator[LayerStep]:
        """Yield each decoder layer materialized with its inputs; see the module docstring. Observers stay
        attached for the whole step (every forward of it). The store left after the last layer (hidden
        states before the final norm) is `self.final`; a store passed as `samples` is consumed. With
        `start` > 0, `samples` must be the store of layer `start`'s inputs (a resumed pass)."""
        if start and not isinstance(samples, ActivationStore):
            raise ValueError("starting past layer 0 needs that layer's inputs as an ActivationStore")
        if self.memory is None:  # every layer checked against the device before any work
            self.plan_memory(samples.lengths if isinstance(samples, ActivationStore) else [len(s) for s in samples])
        with timeline.phase("forward"):
            inputs = samples if isinstance(samples, ActivationStore) else self.embed(samples)
        self.final = None
        step = None
        # what exists now (the imported libraries, the model skeleton: ~400k objects) is left out of the
        # cyclic collections `free_layer` runs after every layer (0.25 s each otherwise); undone at the end
        gc.freeze()
        try:
            if start and self.topk is not None:
                self.topk.resume(start, inputs.lengths)
            for idx in range(start, self.num_layers):
                timeline.set_layer(idx)
                with timeline.phase("load"):
                    layer = self.load_layer(idx)
                handles = [h for o in observers for h in o.attach(idx, layer)]
                step = LayerStep(idx, layer, inputs, self)
                try:
                    yield step
                    if step.outputs is None:
                        with timeline.phase("forward"):
                            step.forward()
                finally:
                    for h in handles:
                        h.remove()
                    self.free_layer(idx)
                    del layer
                inputs.close()
                inputs, step = step.outputs, None
            self.final, inputs = inputs, None
            if self.topk is not None:
                self.topk.discard_saved()  # the pass is complete: nothing left to resume
        finally:  # an early exit (break, error) must not leave memory-mapped activation files behind
            timeline.set_layer(None)
            gc.unfreeze()
            if inputs is not None:
                inputs.close()
            if step is not None:
                step.close()
            if self.topk is not None:
                self.topk.close()

    def run(self, samples: Sequence[torch.Tensor], observers: Sequence[Observer] = (),
            progress: Callable[[int, int], None] | None = None) -> ActivationStore:
        """Stream all layers with `observers` attached; returns the hidden states after the last layer
        (before the final norm). `progress(layer_idx, num_layers)` is called after each layer."""
        for step in self.layers(samples, observers):
            step.forward()
            if progress is not None:
                progress(step.index, self.num_layers)
        return self.final


class _StopForward(Exception):
    """Raised by forward_to's pre-hook to end a decoder layer's forward at a module's call."""


def _first(y):
    """A module's hidden states: the tensor itself, or the first item of a tuple output."""
    return y[0] if isinstance(y, tuple) else y


def _forward_params(module: nn.Module):
    return inspect.signature(type(module).forward).parameters


# ---- DSA: top-k indices carried across decoder layers --------------------------------------------------
class TopKCarry:
    """GLM-5's DeepSeek Sparse Attention (glm_moe_dsa): a layer whose `indexer_types` entry is "full" runs its
    own indexer and returns the top-k key positions each query attends to ([B, T, min(index_topk, T)]); a
    "shared" layer has no indexer and must be given the previous full layer's indices (`prev_topk_indices`),
    as the model's own forward does. Streaming one layer at a time, this keeps those indices per sample
    (int32, in an ActivationStore: memory-mapped above the activation budget) from the last full layer for
    as long as a later shared layer needs them. With a `workdir` (the spool of a resumable pass) they are
    also saved there after each full layer, before the caller saves that layer's outputs, so that a pass
    resumed at a shared layer finds them."""

    FILE, META = "dsa-topk.bin", "dsa-topk.json"

    def __init__(self, ex: "LayerExecutor"):
        self.ex = ex
        types = list(getattr(ex.config, "indexer_types", None) or ["full"] * ex.num_layers)
        self.shared = [t == "shared" for t in types[: ex.num_layers]]
        self.top = int(ex.config.index_topk)
        self.store: ActivationStore | None = None  # indices of full layer `self.layer`
        self.layer: int | None = None
        self._new: ActivationStore | None = None
        self._cur = None

    def _width(self, lengths) -> int:
        return max(1, min(self.top, max(lengths, default=1)))

    def _needed_after(self, idx: int) -> bool:
        """Does a shared layer after full layer `idx` read its indices?"""
        return idx + 1 < len(self.shared) and self.shared[idx + 1]

    def begin(self, layer: nn.Module, lengths) -> "TopKCarry":
        idx = int(layer.self_attn.layer_idx)
        self._cur = idx
        if self.shared[idx]:
            if self.store is None or list(self.store.lengths) != list(lengths):
                raise CalibrationError(f"decoder layer {idx} reuses the DSA top-k indices of an earlier layer, "
                                       "which were not computed in this pass")
        elif self._needed_after(idx):
            self._new = ActivationStore(lengths, self._width(lengths), torch.int32,
                                        budget_bytes=self.ex.activation_budget_bytes, workdir=self.ex.workdir)
        return self

    def inputs(self, idx: list[int], t: int) -> dict:
        if not self.shared[self._cur]:
            return {}
        k = min(self.top, t)
        prev = torch.stack([self.store[i][:, :k] for i in idx]).to(self.ex.device)  # [B, T, k]
        return {"prev_topk_indices": prev}

    def record(self, idx: list[int], indices: torch.Tensor) -> None:
        if self._new is None or self.shared[self._cur]:
            return
        w = self._new.hidden
        if indices.shape[-1] < w:  # a shorter sample: pad with repeats (a repeated index selects nothing new)
            indices = torch.cat([indices, indices[..., -1:].expand(*indices.shape[:-1], w - indices.shape[-1])], -1)
        self._new.write(idx, indices.to(torch.int32))

    def finish(self) -> None:
        if self.shared[self._cur]:
            return
        if self.store is not None:  # a full layer supersedes the indices of any earlier one
            self.store.close()
        self.store, self._new = self._new, None
        self.layer = self._cur if self.store is not None else None
        if self.store is not None and self.ex.workdir is not None:
            from ..write.writer import write_json_atomic

            d = Path(self.ex.workdir)
            self.store.save(d / self._name(self.FILE))
            write_json_atomic(d / self._name(self.META), {"layer": self.layer, "lengths": self.store.lengths,
                                                          "width": self.store.hidden})

    def _name(self, base: str) -> str:
        """The file name in the spool: a distributed pass's ranks each keep their own samples' indices."""
        stem, dot, ext = base.partition(".")
        return f"{stem}{self.ex.file_tag}{dot}{ext}"

    def abort(self) -> None:
        if self._new is not None:
            self._new.close()
            self._new = None

    def resume(self, start: int, lengths) -> None:
        """Before a pass resumed at layer `start`: reload the indices a shared layer there needs."""
        if not self.shared[start]:
            return
        want = max(i for i in range(start) if not self.shared[i])
        store = None
        try:
            d = Path(self.ex.workdir)
            meta = json.loads((d / self._name(self.META)).read_text())
            if meta["layer"] != want or meta["lengths"] != list(lengths) or meta["width"] != self._width(lengths):
                raise ValueError("saved for another layer or other samples")
            store = ActivationStore(lengths, meta["width"], torch.int32,
                                    budget_bytes=self.ex.activation_budget_bytes, workdir=self.ex.workdir)
            store.load(d / self._name(self.FILE))
        except (OSError, ValueError, KeyError, TypeError) as e:
            if store is not None:
                store.close()
            raise CalibrationError(f"cannot resume at decoder layer {start}: the DSA top-k indices of layer {want} "
                                   f"were not saved with the interrupted pass ({e})",
                                   hint="start the pass over (remove the spool)") from None
        self.store, self.layer = store, want

    def discard_saved(self) -> None:
        if self.ex.workdir is not None:
            for name in (self.FILE, self.META):
                (Path(self.ex.workdir) / self._name(name)).unlink(missing_ok=True)

    def close(self) -> None:
        self.abort()
        if self.store is not None:
            self.store.close()
        self.store = self.layer = None


def modeling_module(module: nn.Module):
    """The transformers modeling module that defines `module` (for its apply_rotary_pos_emb)."""
    return sys.modules[type(module).__module__]
