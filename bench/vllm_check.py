"""Load a quantkit output with vLLM's own model class and weight loader, on the CPU, and account for every tensor.

    VLLM_TARGET_DEVICE=cpu bench/.cache/vllm-venv/bin/python bench/vllm_check.py CKPT [--plugin] [--json-out F]

Run by the Python of a vLLM venv (bench/vllm_matrix.py makes and calls it), as a file: a helper, not a bench (it
imports nothing from bench/ nor from quantkit except, with `--plugin`, quantkit/engine/vllm_plugin.py, loaded from
this file's repository by its path, no install).
Prints one JSON object on stdout (vLLM's own logs go to stderr) and exits 0 when the checkpoint is accepted,
1 when it is not, 2 when the check itself could not run.

Method. The engine config is vLLM's (EngineArgs -> VllmConfig, `enable_weights_track`), the parallel state a
one-process gloo group (world size 1), the model vLLM's `initialize_model`, and the weights go through
vLLM's DefaultModelLoader.load_weights -> the model class's `load_weights` -> each parameter's
`weight_loader`, then vLLM's strict tracking. `process_weights_after_loading` is never called: it repacks
into GPU kernel layouts (Marlin, ...), and what it consumes is exactly the parameters judged here.

"Did not raise" proves little: vLLM's MoE weight loader narrows the destination to the source's shape, so a
too-small scale tensor loads "successfully" into part of a parameter, and its strict tracking counts a fused
parameter (`w13_weight_scale`, all experts) as loaded once any tensor reached it. So, in addition:
  * every parameter's `weight_loader` is wrapped to record which checkpoint tensor reached which parameter;
    a checkpoint tensor that reached none is *dropped*;
  * every parameter is filled with a sentinel before loading (NaN for floats, an unlikely value for ints);
    an element that still holds it afterwards is an *unwritten slot*;
  * vLLM's warnings are captured; "Found k_scale in the checkpoint ... k_scale is not loaded" is a dropped
    KV scale.
Accepted = no load error, vLLM's strict tracking passed, nothing dropped, no unwritten slot (KV-cache
q/prob scales excepted: compressed-tensors checkpoints never carry them; k/v scales excepted only when the
config declares no kv_cache_scheme), and when a kv_cache_scheme is declared every attention layer holds
the checkpoint's k_scale and v_scale.

Kernel-selection gates of vLLM's CPU platform refuse to build these models here (the WNA16 MoE backend
oracle, the MLA attention backend with an fp8 KV cache, the block-FP8 linear kernel without AMX); they are
bypassed in this script only (see `_bypass_cpu_kernel_gates`). None changes a parameter's name, shape or dtype.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import re
import struct
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

REPO = Path(__file__).resolve().parent.parent
INT_SENTINEL = -0x5A5A5A5B  # an int32/int64 value a packed INT4 word or a shape is very unlikely to hold
# KV-cache method parameters a symmetric compressed-tensors checkpoint does not carry: vLLM falls back to
# defaults for q/prob scales and never uses the zero points (compressed_tensors.py CompressedTensorsKVCacheMethod)
KV_OPTIONAL = ("q_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point")
KV_SCALES = ("k_scale", "v_scale")
KV_DROPPED = re.compile(r"Found (\w+) in the checkpoint \(e\.g\. (\S+)\), but not found the expected name in "
                        r"the model \(e\.g\. (\S+)\)\. \w+ is not loaded")


# ---- the checkpoint, read without vLLM ------------------------------------------------------------------
def checkpoint_tensors(ckpt: Path) -> dict[str, tuple[str, list[int], str]]:
    """{tensor name: (dtype, shape, file)} from the safetensors headers of `ckpt`."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["dtype"], info["shape"], f.name)
    return out


# ---- gates of the CPU platform ------------------------------------------------------------------------
def _bypass_cpu_kernel_gates(report: dict) -> None:
    """Let vLLM's CPU platform build the layers a GPU would build; record what was bypassed (four gates).

    1. WNA16 MoE backend oracle (fused_moe/oracle/int_wna16.py `select_wna16_moe_backend`): on a CPU
       platform it only tries the ZEN_CPU / CPU int4 kernels, which this CUDA wheel lacks (no vllm._C), and
       raises "No WNA16 MoE backend supports the deployment configuration". The replacement asks vLLM's own
       `_backend_incompatibility_reason` about the NVIDIA backends in vLLM's order (Marlin, batched Marlin,
       Triton) and returns the first it accepts - the group-size and shape rules a GPU would apply, without
       the device-capability probe. The MoE parameters do not depend on the choice:
       CompressedTensorsWNA16MoEMethod.create_weights always allocates the checkpoint's N-first layout
       (`w13_weight_packed [E, 2I, H/8]`, `w13_weight_scale [E, 2I, H/g]`, ...); the backend only matters
       in process_weights_after_loading, which is not run.
    2. CPU attention backend selection (platforms/cpu.py `CpuPlatform.get_attn_backend_cls`) refuses an fp8
       KV-cache dtype for MLA ("--kv-cache-dtype fp8 is not supported by MLA attention on CPU"), for other
       attention on a host without AVX-512 or AMX ("... not supported by the CPU attention backend on this
       host"), and any sparse MLA (GLM-5's DSA). The replacement asks the platform for the backend class with the KV dtype
       'auto' and the dense flag; the layer still gets kv_cache_dtype=fp8 and so its KV-cache quant method
       and k/v scale parameters are created exactly as on a GPU (attention.py `_init_kv_cache_quant` depends
       on the quant config and kv dtype, not on the backend). The backend class owns no checkpoint
       parameters.
    """
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )
    from vllm.platforms import current_platform

    chosen = report.setdefault("moe_backend_emulated", {})

    def select_like_a_gpu(config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding=False):
        reasons = {}
        for backend in (int_wna16.WNA16MoEBackend.MARLIN, int_wna16.WNA16MoEBackend.BATCHED_MARLIN,
                        int_wna16.WNA16MoEBackend.TRITON):
            why = int_wna16._backend_incompatibility_reason(backend, config, quant_config, may_have_zp,
                                                             may_have_bias, allow_tile_padding)
            if why is None:
                chosen[backend.value] = chosen.get(backend.value, 0) + 1
                return backend, int_wna16.backend_to_kernel_cls(backend)[0]
            reasons[backend.value] = why
        raise NotImplementedError(f"no NVIDIA WNA16 MoE backend accepts this layer: {reasons}")

    ct_wna16.select_wna16_moe_backend = select_like_a_gpu

    # 4. NVFP4 MoE backend oracle (fused_moe/oracle/nvfp4.py `select_nvfp4_moe_backend`): every backend's
    #    kernel class asks the device (SM100 FP4 tensor cores for FlashInfer/CUTLASS, SM80+ for Marlin), so
    #    on a CPU none is supported ("No NvFp4 MoE backend supports the deployment configuration"). The
    #    replacement returns Marlin, the one vLLM's order reaches on a Hopper GPU (no FP4 tensor cores: a
    #    dequantizing kernel). CompressedTensorsW4A4Nvfp4MoEMethod.create_weights allocates the same
    #    parameters for every backend (`w13_weight_packed [E, 2I, H/2]` uint8, `w13_weight_scale
    #    [E, 2I, H/16]` fp8, `w13_weight_global_scale [E, 2]`, ...); the backend acts in
    #    process_weights_after_loading (not run).
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4,
    )

    def nvfp4_like_a_hopper(config, weight_key, activation_key):
        backend = nvfp4_oracle.NvFp4MoeBackend.MARLIN
        chosen[f"nvfp4-{backend.value}"] = chosen.get(f"nvfp4-{backend.value}", 0) + 1
        return backend, nvfp4_oracle.backend_to_kernel_cls(backend)[0]

    ct_nvfp4.select_nvfp4_moe_backend = nvfp4_like_a_hopper

    # 5. W4AFP8 MoE backend oracle (fused_moe/oracle/w4a8.py `select_w4a8_moe_backend`, called by
    #    CompressedTensorsW4A8Fp8MoEMethod.__init__): each kernel class's `is_supported_config` first asks the
    #    device (SM90 + CUTLASS grouped GEMM for CUTLASS, a GPU for Humming). The replacement runs vLLM's own
    #    `is_supported_config` for the CUTLASS class (bf16 in/out, gated activation, quant keys, parallel config,
    #    routing, shape) with only the device probe answered "Hopper". create_weights allocates the same
    #    parameters for both backends (`w13_weight_packed [E, 2I, H/8]` int32, `w13_weight_scale [E, 2I, H/128]`
    #    in the model dtype, `w13_weight_shape [E, 2]`, ...) and asserts the 256 rule itself.
    from vllm.model_executor.layers.fused_moe.oracle import w4a8 as w4a8_oracle
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_fp8 as ct_w4a8,
    )

    def w4a8_like_a_hopper(config, weight_key=w4a8_oracle.kInt4Static, activation_key=w4a8_oracle.kFp8DynamicTokenSym):
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk

        backend = w4a8_oracle.W4A8MoeBackend.CUTLASS
        cls = w4a8_oracle.backend_to_kernel_cls(backend)[0]
        probe = cls._supports_current_device
        cls._supports_current_device = staticmethod(lambda: True)
        try:
            ok, why = cls.is_supported_config(cls, config, weight_key, activation_key,
                                              mk.FusedMoEActivationFormat.Standard)
        finally:
            cls._supports_current_device = probe
        if not ok:
            raise NotImplementedError(f"the CUTLASS W4A8 MoE kernel refuses this layer on Hopper too: {why}")
        chosen[f"w4a8-{backend.value}"] = chosen.get(f"w4a8-{backend.value}", 0) + 1
        return backend, cls

    ct_w4a8.select_w4a8_moe_backend = w4a8_like_a_hopper

    platform_cls = type(current_platform)
    original = platform_cls.get_attn_backend_cls.__func__
    bypassed = report.setdefault("attention_gate_bypassed", [])

    def attn_backend_without_mla_gate(cls, selected_backend, attn_selector_config, num_heads=None):
        sc = attn_selector_config
        # MLA: every fp8 KV dtype is refused on the CPU; the dense CPU backend refuses it on hosts without
        # AVX-512 or AMX (cpu_attn.py supports_kv_cache_dtype): both asked again with 'auto'
        if sc.use_sparse or sc.kv_cache_dtype not in (None, "auto", "bfloat16", "float16"):
            bypassed.append({"kv_cache_dtype": sc.kv_cache_dtype, "sparse": sc.use_sparse})
            sc = sc._replace(kv_cache_dtype="auto", use_sparse=False)  # a NamedTuple
        return original(cls, selected_backend, sc, num_heads)

    platform_cls.get_attn_backend_cls = classmethod(attn_backend_without_mla_gate)

    # 3. FP8 linear kernel selection (model_executor/kernels/linear `init_fp8_linear_kernel`): on this CPU
    #    the block-FP8 kernels need AMX ("Failed to find a kernel that can implement the ScaledMM linear
    #    layer"). Every FP8 linear method calls it at the end of create_weights, after registering
    #    `weight` / `weight_scale` (compressed_tensors_w8a8_fp8.py, fp8.py); the kernel only acts in
    #    process_weights_after_loading and forward. A stub stands in when no kernel is found.
    import importlib

    fp8_stubbed = report.setdefault("fp8_linear_kernel_stubbed", [])

    class NoKernel:
        def input_quant_key(self):
            return None

    for mod_name in ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8",
                     "vllm.model_executor.layers.quantization.fp8"):
        mod = importlib.import_module(mod_name)
        inner = mod.init_fp8_linear_kernel

        def init_or_stub(*args, _inner=inner, **kwargs):
            try:
                return _inner(*args, **kwargs)
            except ValueError as e:
                if "Failed to find a kernel" not in str(e):
                    raise
                fp8_stubbed.append(kwargs.get("module_name") or "?")
                return NoKernel()

        mod.init_fp8_linear_kernel = init_or_stub


# ---- tracing the load ---------------------------------------------------------------------------------
class Trace:
    """Which checkpoint tensor reached which parameter."""

    def __init__(self):
        self.current: str | None = None
        self.ranges: list[tuple[int, int, str]] = []  # [data_ptr, end) of every yielded tensor
        self.keep: list = []  # keeps yielded tensors alive so their addresses stay unique
        self.yielded: list[str] = []
        self.reached: dict[str, set[str]] = {}  # checkpoint tensor -> parameters
        self.calls = 0

    def source_of(self, tensor) -> str | None:
        try:
            ptr = tensor.data_ptr()
        except (AttributeError, RuntimeError):  # not a plain tensor (e.g. a meta or wrapper tensor)
            return self.current
        for lo, hi, name in reversed(self.ranges):
            if lo <= ptr < hi or (lo == hi == ptr):
                return name
        return self.current

    def iterate(self, weights):
        for name, tensor in weights:
            self.current = name
            self.yielded.append(name)
            self.keep.append(tensor)
            ptr = tensor.data_ptr()
            self.ranges.append((ptr, ptr + tensor.numel() * tensor.element_size(), name))
            yield name, tensor
        self.current = None


def wrap_weight_loaders(model, trace: Trace) -> None:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for pname, param in model.named_parameters():
        inner = getattr(param, "weight_loader", default_weight_loader)

        def loader(*args, _inner=inner, _pname=pname, **kwargs):
            # call sites differ: (param, loaded_weight, ...) positionally or by keyword
            loaded_weight = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
            result = _inner(*args, **kwargs)
            # FusedMoE loaders called with return_success=True say False when the expert is not local
            if not (kwargs.get("return_success") and result is False):
                trace.calls += 1
                trace.reached.setdefault(trace.source_of(loaded_weight) or "?", set()).add(_pname)
            return result

        try:
            param.weight_loader = loader
        except AttributeError:  # a parameter class whose weight_loader cannot be replaced
            pass


def fill_sentinels(model) -> dict[str, str]:
    """NaN (floats) or INT_SENTINEL (int32/int64) in every parameter; {name: why} for those that cannot."""
    import torch

    skipped = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if p.dtype.is_floating_point:
                p.data.fill_(float("nan"))
            elif p.dtype in (torch.int32, torch.int64):
                p.data.fill_(INT_SENTINEL)
            else:
                skipped[name] = f"dtype {p.dtype} has no unused value"
    return skipped


def unwritten_slots(model, kv_required: bool) -> tuple[list[dict], list[dict]]:
    """(unwritten, exempt): parameters with elements still holding the sentinel."""
    import torch

    unwritten, exempt = [], []
    # NVFP4 experts without activation quantization (W4A16): the method allocates input global scales for
    # W4A4 too, and with use_a16 drops them unread (fused_moe/oracle/nvfp4.py: Marlin sets a13/a2 to None)
    a16_unused = {f"{m}.{leaf}" for m, mod in model.named_modules()
                  if getattr(getattr(mod, "quant_method", None), "use_a16", False)
                  for leaf in ("w13_input_global_scale", "w2_input_global_scale")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if p.dtype.is_floating_point:
                left = int(torch.isnan(p.data.float()).sum())
            elif p.dtype in (torch.int32, torch.int64):
                left = int((p.data == INT_SENTINEL).sum())
            else:
                continue
            if left:
                row = {"param": name, "unwritten": left, "numel": p.numel(), "shape": list(p.shape)}
                leaf = name.rsplit(".", 1)[-1]
                if leaf in KV_OPTIONAL or (leaf in KV_SCALES and not kv_required) or name in a16_unused:
                    exempt.append(row)
                else:
                    unwritten.append(row)
    return unwritten, exempt


def kv_scale_report(model) -> dict:
    """Per attention layer: its class and the k/v scale values its parameters hold (None: no such parameter
    or never written)."""
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, (Attention, MLAAttention)):
            continue
        row = {"class": type(mod).__name__, "quant_method": type(getattr(mod, "quant_method", None)).__name__}
        for s in KV_SCALES:
            p = dict(mod.named_parameters(recurse=False)).get(s)
            if p is None:
                row[s] = None
            else:
                vals = p.detach().float().flatten().tolist()
                row[s] = None if any(math.isnan(v) for v in vals) else (vals[0] if len(vals) == 1 else vals)
        out[name] = row
    return out


# Spellings a checkpoint could give an MLA layer's K scale: quantkit's, the names vLLM's remapping produces or
# looks for, other exporters' (ModelOpt k_proj.k_scale, kv_scale, k_cache.scale), and the buffer itself.
KV_NAME_CANDIDATES = (
    "self_attn.k_scale", "self_attn.attn.k_scale", "self_attn.mla_attn.k_scale", "self_attn.mla_attn.mla_attn.k_scale",
    "self_attn.mla_attn.mla_attn.attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.kv_a_proj_with_mqa.k_scale",
    "self_attn.kv_b_proj.k_scale", "self_attn.kv_scale", "self_attn.k_cache.scale", "self_attn.mla_attn.mla_attn._k_scale",
)


def probe_kv_names(model, trace: Trace, tap: WarningTap, layer_prefix: str) -> list[dict]:
    """Feed one K-scale tensor at a time, under each candidate name, through the model's real `load_weights`
    (AutoWeightsLoader mappers, the model's remapping, the weight loaders) and record where it lands."""
    import torch
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    layers = [m for _, m in model.named_modules() if isinstance(m, (Attention, MLAAttention))]
    out = []
    for suffix in KV_NAME_CANDIDATES:
        name = f"{layer_prefix}layers.1.{suffix}"
        value = torch.tensor([0.4375], dtype=torch.float32)
        with torch.no_grad():
            for m in layers:
                for s in KV_SCALES:
                    if isinstance(getattr(m, s, None), torch.nn.Parameter):
                        getattr(m, s).fill_(float("nan"))
        before = len(tap.messages)
        trace.reached.pop(name, None)
        row = {"checkpoint_name": name}
        try:
            model.load_weights(trace.iterate([(name, value)]))
        except Exception as e:  # noqa: BLE001 - whatever vLLM raises for this spelling is the finding
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["reached"] = sorted(trace.reached.get(name, ()))
        landed = [f"{n}.{s}" for n, m in model.named_modules() if isinstance(m, (Attention, MLAAttention))
                  for s in KV_SCALES if isinstance(getattr(m, s, None), torch.nn.Parameter)
                  and float(getattr(m, s).detach().float().flatten()[0]) == 0.4375]
        row["landed_in_kv_param"] = landed
        row["warnings"] = tap.messages[before:]
        out.append(row)
    return out


class WarningTap(logging.Handler):
    """Collects vLLM's warnings. vLLM re-applies its logging dictConfig when the engine config is built,
    which drops foreign handlers from the "vllm" logger: `attach` again after that."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def attach(self):
        log = logging.getLogger("vllm")
        if self not in log.handlers:
            log.addHandler(self)

    def emit(self, record):
        try:
            msg = record.getMessage()
        except (TypeError, ValueError):  # a malformed %-format: keep the raw message
            msg = str(record.msg)
        self.messages.append(msg)


# ---- the check ----------------------------------------------------------------------------------------
def check(ckpt: Path, *, plugin: str | None, kv_cache_dtype: str | None, probe: bool = False,
          list_params: list[str] | None = None) -> dict:
    import torch

    config = json.loads((ckpt / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    kv_declared = qc.get("kv_cache_scheme") is not None
    kv_dtype = kv_cache_dtype or ("fp8" if kv_declared else "auto")
    report: dict = {"checkpoint": str(ckpt), "model_type": config.get("model_type"), "kv_cache_dtype": kv_dtype,
                    "kv_cache_scheme": qc.get("kv_cache_scheme"), "plugin": plugin}

    import vllm
    import vllm.logger

    tap = WarningTap()
    tap.attach()

    report["vllm"] = vllm.__version__
    if plugin:
        import importlib.util  # the plugin's file from this repository (quantkit is not installed in vLLM's venv)

        spec = importlib.util.spec_from_file_location("quantkit_vllm_plugin", REPO / "quantkit" / "engine" /
                                                      "vllm_plugin.py")
        vllm_plugin = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(vllm_plugin)

        if plugin == "method-only":
            vllm_plugin._give_mla_the_kv_cache_method()
        else:
            vllm_plugin.register()
    _bypass_cpu_kernel_gates(report)

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = EngineArgs(model=str(ckpt), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                      max_model_len=128, load_format="safetensors", kv_cache_dtype=kv_dtype,
                      tensor_parallel_size=1, distributed_executor_backend="uni",
                      model_loader_extra_config={"enable_weights_track": True})
    stage = "config"
    try:
        vllm_config = args.create_engine_config()
        report["architecture"] = vllm_config.model_config.architectures[0]
        report["quantization"] = vllm_config.model_config.quantization
        tap.attach()
        stage = "distributed"
        with set_current_vllm_config(vllm_config):
            init_file = tempfile.mktemp(prefix="vllm-check-")
            # gloo's file store leaves its file behind: gone when this process (one check) exits
            atexit.register(lambda: Path(init_file).unlink(missing_ok=True))
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{init_file}", backend="gloo")
            initialize_model_parallel(1, 1)
            stage = "initialize_model"
            with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config)
            report["model_class"] = type(model).__name__
            if list_params is not None:  # names and shapes only (used to build test checkpoints)
                report["params"] = {n: [list(p.shape), str(p.dtype)] for n, p in model.named_parameters()
                                    if n.startswith(tuple(list_params))}
                report["accepted"] = True
                return report
            stage = "load_weights"
            report["sentinel_skipped"] = fill_sentinels(model)
            trace = Trace()
            wrap_weight_loaders(model, trace)
            loader = get_model_loader(vllm_config.load_config)
            inner_iter = loader.get_all_weights
            loader.get_all_weights = lambda mc, m: trace.iterate(inner_iter(mc, m))
            try:
                loader.load_weights(model, vllm_config.model_config)
                report["strict_tracking"] = "passed"
            except ValueError as e:
                if "were not initialized from checkpoint" not in str(e):
                    raise
                report["strict_tracking"] = str(e)[:2000]
    except Exception as e:  # noqa: BLE001 - what vLLM raised is the verdict: the checkpoint failed at `stage`
        report.update(accepted=False, error={"stage": stage, "type": type(e).__name__, "message": str(e)[:2000],
                                             "where": traceback.format_exc().strip().splitlines()[-3:]})
        report["warnings"] = tap.messages
        return report

    on_disk = checkpoint_tensors(ckpt)
    dropped = []
    for name in sorted(on_disk):
        if name in trace.reached:
            continue
        why = "never reached a parameter" if name in trace.yielded else "filtered out before load_weights"
        dropped.append({"tensor": name, "shape": on_disk[name][1], "dtype": on_disk[name][0], "why": why})
    for m in tap.messages:
        hit = KV_DROPPED.search(m)
        if hit:
            report.setdefault("kv_scales_dropped_by_vllm", []).append(
                {"scale": hit.group(1), "checkpoint_name": hit.group(2), "expected_param": hit.group(3)})
    unwritten, exempt = unwritten_slots(model, kv_declared)
    if report["strict_tracking"] != "passed":
        # vLLM's own list of parameters nothing wrote: those the sentinel pass exempts (unused input global
        # scales of W4A16 NVFP4 experts, KV-cache extras) do not count against the checkpoint
        named = set(re.findall(r"'([^']+)'", report["strict_tracking"].split(":", 1)[-1]))
        excused = {row["param"] for row in exempt}
        if named and named <= excused:
            report["strict_tracking"] = "passed"
            report["strict_tracking_exempt"] = sorted(named)
    kv = kv_scale_report(model)
    kv_missing = []
    if kv_declared:
        kv_missing = [f"{layer}.{s}" for layer, row in kv.items() for s in KV_SCALES if row[s] is None]

    report.update(
        accepted=not dropped and not unwritten and not kv_missing and report["strict_tracking"] == "passed",
        dropped=dropped,
        unwritten=unwritten,
        unwritten_exempt=exempt,
        kv_scales_loaded=kv,
        kv_scales_missing=kv_missing,
        tensors_on_disk=len(on_disk),
        tensors_reaching_a_param=len([n for n in on_disk if n in trace.reached]),
        parameters=sum(1 for p in model.parameters() if p.numel()),
        moe_methods=sorted({type(m.quant_method).__name__ for m in model.modules()
                            if type(getattr(m, "quant_method", None)).__name__.endswith("MoEMethod")}),
        weight_loader_calls=trace.calls,
        warnings=tap.messages,
    )
    if probe:
        first = next((n for n in on_disk if ".layers." in n), "model.layers.0")
        report["kv_name_probe"] = probe_kv_names(model, trace, tap, first[: first.index("layers.")])
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--plugin", nargs="?", const="all", choices=("all", "method-only"),
                    help="register quantkit/engine/vllm_plugin.py first (KV-cache method for MLA layers); "
                         "method-only: just its first half (MLA gets the KV-cache method, names unchanged)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="default: fp8 when the config declares a kv_cache_scheme, else auto")
    ap.add_argument("--probe-kv-names", action="store_true",
                    help="after the check, feed a K scale under each spelling in KV_NAME_CANDIDATES through "
                         "load_weights and report where it lands (the MLA KV-scale question)")
    ap.add_argument("--list-params", metavar="PREFIXES",
                    help="only build the model (config.json suffices) and list the parameters whose names start "
                         "with one of these comma-separated prefixes: {params: {name: [shape, dtype]}}")
    ap.add_argument("--json-out", type=Path, help="also write the JSON report here")
    args = ap.parse_args(argv)
    # stdout carries the JSON object only: everything vLLM prints (its logger writes to stdout) goes to stderr
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        report = check(args.checkpoint.resolve(), plugin=args.plugin, kv_cache_dtype=args.kv_cache_dtype,
                       probe=args.probe_kv_names,
                       list_params=None if args.list_params is None else args.list_params.split(","))
    except Exception as e:  # noqa: BLE001 - the check itself broke (not the checkpoint): exit 2 with the reason
        report = {"checkpoint": str(args.checkpoint), "accepted": False, "check_error": repr(e)[:2000],
                  "where": traceback.format_exc().strip().splitlines()[-6:]}
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if "check_error" in report:
        print(json.dumps(report, indent=1))
        return 2
    text = json.dumps(report, indent=1, default=str)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0 if report.get("accepted") else 1


if __name__ == "__main__":
    sys.exit(main())
