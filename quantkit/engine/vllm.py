"""`quantkit verify --engine vllm [--tp N]`: the rules vLLM 0.33.0 applies when it loads a compressed-tensors
checkpoint, as data, each with the vLLM source file it comes from, checked on the checkpoint with no vLLM
installed (config.json, safetensors headers, and a few small tensors: NVFP4 global scales).

The rules were read in vLLM's code and exercised with vLLM's own model classes and weight loaders on the CPU
(bench/vllm_check.py; docs/engine.md has the method, the results and what was only read). A failed rule
names the tensor (or module) and the rule; a warning is something vLLM loads but does not do as the
checkpoint intends (MLA KV scales left at 1.0, a slower kernel path).

Not here: loading the model, or anything vLLM decides at run time from the GPU (kernel availability beyond
the documented gates).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from ..arch import text_config
from ..arch.layout import EXPERT_PROJ as _EXPERT, FUSED_LINEARS, expert_role, is_row_parallel, partner
from ..pack import kv as kvrules
from ..pack.config import Group, config_groups, is_nvfp4_args, is_nvfp4_w4a4, is_w4afp8, targeting
from . import w4afp8 as w4rules
from ..read.checkpoint import Checkpoint
from ..read.tensors import TensorReader
from .vllm_config import router_bias_problem
from ..pack.names import PACKED_FORMATS, Tensor

VLLM_VERSION = "0.33.0"
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES
FP8_BLOCK = 128


@dataclass(frozen=True)
class Rule:
    id: str
    text: str
    source: str  # the vLLM file(s) it comes from, relative to the installed vllm/ package


RULES = {r.id: r for r in (
    Rule("K1", "a KV scale `model.layers.L.self_attn.{k,v}_scale` is renamed `...self_attn.attn.{k,v}_scale` and "
               "must then be a parameter, or it is dropped",
         "model_executor/layers/quantization/base_config.py (get_cache_scale_mapper); "
         "model_executor/model_loader/weight_utils.py (maybe_remap_kv_scale_name)"),
    Rule("K2", "only `Attention` layers get KV-scale parameters from a compressed-tensors config: an MLA layer's "
               "scales are dropped and the FP8 latent cache runs with scale 1.0",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py (get_quant_method); "
         "model_executor/layers/attention/mla_attention.py"),
    Rule("K3", "kv_cache_scheme must be num_bits 8, type float, symmetric, strategy tensor or attn_head",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py "
         "(CompressedTensorsKVCacheMethod.validate_kv_cache_scheme)"),
    Rule("K4", "KV scales: strategy tensor -> one value; attn_head -> [num_kv_heads, 1, 1], sliced per TP rank",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py (create_weights)"),
    Rule("K5", "attn_head KV scales need an attention backend with per-head scales (FlashAttention 3 in 0.33.0)",
         "model_executor/layers/attention/attention.py; v1/attention/backends/flash_attn.py"),
    Rule("K6", "a missing KV scale stays 1.0 without a warning: every attention layer must ship k_scale and v_scale",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py (create_weights)"),
    Rule("K8", "a wrapped text model (kimi_k25) takes its KV scales under the wrapper's prefix "
               "(`language_model.model.layers.L.self_attn.k_scale`); a bare `model.layers...` name makes the "
               "wrapper's loader raise (no module named 'model')",
         "model_executor/models/kimi_k25.py (hf_to_vllm_mapper); model_executor/models/utils.py (AutoWeightsLoader)"),
    Rule("M1", "all routed experts and all three projections of a layer take one scheme (vLLM reads expert 0's "
               "and applies it to every expert)",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py "
         "(get_moe_method)"),
    Rule("M4", "INT4 experts: hidden_size and moe_intermediate_size / tp must be multiples of the group size "
               "(scale groups may not cross TP shard boundaries)",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
         "compressed_tensors_moe_wna16.py (create_weights)"),
    Rule("M5", "Marlin MoE (tried first on NVIDIA): group size in {-1, 32, 64, 128} and hidden_size % 128 == 0; "
               "otherwise the Triton WNA16 path, which takes group strategy only",
         "model_executor/layers/quantization/utils/marlin_utils.py (check_moe_marlin_supports_config); "
         "model_executor/layers/fused_moe/oracle/int_wna16.py"),
    Rule("M6", "an expert's gate and up load into one w13 tensor: they need the same number of scale groups",
         "model_executor/layers/fused_moe/routed_experts.py (_load_w13)"),
    Rule("W1", "W4AFP8 experts (INT4 weights + dynamic per-token FP8 activations): group strategy, group_size 128, "
               "symmetric",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
         "compressed_tensors_moe_w4a8_fp8.py (CompressedTensorsW4A8Fp8MoEMethod.__init__)"),
    Rule("W2", "W4AFP8 experts: hidden_size and moe_intermediate_size / tp must be multiples of 256 (CUTLASS reorder); "
               "with expert parallelism the intermediate size is not split",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
         "compressed_tensors_moe_w4a8_fp8.py (create_weights)"),
    Rule("W3", "W4AFP8 experts run only on SM90 (Hopper) with bfloat16 activations, without EPLB; elsewhere "
               "vLLM finds no W4A8 MoE backend",
         "model_executor/layers/fused_moe/oracle/w4a8.py (select_w4a8_moe_backend); "
         "model_executor/layers/fused_moe/experts/cutlass_moe.py (CutlassExpertsW4A8Fp8)"),
    Rule("F1", "NVFP4 experts: gate and up are fused into w13 with one global scale per expert; when they "
               "differ vLLM warns and uses the gate's (the up half is then mis-scaled)",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
         "compressed_tensors_moe_w4a4_nvfp4.py"),
    Rule("A1", "NVFP4 weights take NVFP4 input activations (num_bits 4, type float, strategy tensor_group, "
               "group_size 16) or none (W4A16); any other input_activations make vLLM raise when the layer is built",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py "
         "(get_moe_method); compressed_tensors.py (_is_nvfp4_format)"),
    Rule("A2", "NVFP4 W4A4 experts: every expert's gate, up and down carry `input_global_scale`, one float32 "
               "element, finite and positive. vLLM loads them into w13_input_global_scale [E, 2] / "
               "w2_input_global_scale [E] (a missing one leaves torch.empty memory: the fused parameter counts as "
               "loaded once any expert's reached it; more than one element raises) and divides by them; its "
               "FlashInfer backends take one maximum of 1 / scale over all experts of a layer, so a single NaN, "
               "Inf or 0 spoils every expert of the layer",
         "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
         "compressed_tensors_moe_w4a4_nvfp4.py (create_weights, process_weights_after_loading); "
         "model_executor/layers/fused_moe/routed_experts.py (_load_per_tensor_weight_scale); "
         "model_executor/layers/quantization/utils/flashinfer_fp4_moe.py"),
    Rule("A3", "NVFP4 W4A4 experts: gate and up see one input, so their input_global_scale should be equal; vLLM "
               "keeps the pair and quantizes w13's input with the smaller scale (max of 1 / scale), without a "
               "warning",
         "model_executor/layers/quantization/utils/flashinfer_fp4_moe.py (prepare_nvfp4_moe_layer_for_fi_or_cutlass)"),
    Rule("A4", "NVFP4 W4A4 experts run FP4 activations only on Blackwell (FlashInfer TRT-LLM / CUTLASS / CuTe-DSL, "
               "vLLM's CUTLASS): the FlashInfer backends, tried first, quantize every expert's input with one scale "
               "per layer (the smallest input_global_scale), vLLM's CUTLASS with each expert's own; on other GPUs "
               "vLLM picks Marlin, which runs the weights with BF16 activations and reads no input scale",
         "model_executor/layers/fused_moe/oracle/nvfp4.py (select_nvfp4_moe_backend, "
         "is_global_sf_supported_for_nvfp4_backend); model_executor/layers/fused_moe/experts/marlin_moe.py"),
    Rule("R1", "a DeepSeek-style router bias (`mlp.gate.e_score_correction_bias`: deepseek_v3, kimi_k2/k25, "
               "glm_moe_dsa) needs `topk_method: noaux_tc` in config.json, or vLLM builds no parameter for it and "
               "the load fails (KeyError)",
         "model_executor/models/deepseek_v2.py (DeepseekV2MoE.__init__)"),
    Rule("B1", "block-FP8 Linears at tp > 1: a row-parallel K / tp and a column-parallel N / tp must be multiples "
               "of the block",
         "model_executor/layers/quantization/utils/fp8_utils.py (validate_fp8_block_shape)"),
    Rule("B2", "a fused block-FP8 Linear (qkv_proj = q, k, v; gate_up_proj = gate, up; fused_qkv_a_proj = q_a_proj, "
               "kv_a_proj_with_mqa) needs every part but the last to have a multiple of 128 output rows, even at tp 1",
         "model_executor/layers/quantization/utils/fp8_utils.py (validate_fp8_block_shape)"),
)}



@dataclass
class EngineReport:
    engine: str
    tp: int
    problems: list[dict] = field(default_factory=list)  # {rule, where, detail}: vLLM refuses or mis-loads
    warnings: list[dict] = field(default_factory=list)  # vLLM loads it, but not as the checkpoint intends

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"engine": self.engine, "tp": self.tp, "ok": self.ok, "problems": self.problems,
                "warnings": self.warnings,
                "rules": {r.id: {"text": r.text, "source": r.source} for r in RULES.values()}}

    def add(self, rule: str, where: str, detail: str, warning: bool = False) -> None:
        (self.warnings if warning else self.problems).append({"rule": rule, "where": where, "detail": detail})


class _Group:
    def __init__(self, g: Group):
        self.name, self.targets, self.weights, self.format = g.name, g.targets, g.weights or {}, g.format
        self.acts = g.input_activations
        self.w4afp8 = is_w4afp8(self.weights, self.acts)
        self.w4a4 = is_nvfp4_w4a4(self.weights, self.acts)


def check(root, tp: int = 1, plugin: bool = False) -> EngineReport:
    """The vLLM rules on the checkpoint in `root` at tensor parallelism `tp`. `plugin`: quantkit's vLLM plugin
    (quantkit.engine.vllm_plugin) is installed in vLLM's environment, so MLA KV scales do load."""
    ck = Checkpoint.open(root)
    rep = EngineReport(f"vllm {VLLM_VERSION}", tp)
    cfg, prefix = text_config(ck.config)
    qc = ck.quantization_config or {}
    groups = [_Group(g) for g in config_groups(qc, lenient=True)]
    _kv(ck, cfg, prefix, qc, rep, tp, plugin)
    bias = router_bias_problem(ck.config, ck.location)
    if bias is not None:
        rep.add("R1", *bias)
    with TensorReader.of(ck) as reader:
        _experts(ck, cfg, groups, rep, tp, reader)
    _fp8_blocks(ck, rep, tp)
    return rep


def _kv(ck, cfg, prefix: str, qc, rep: EngineReport, tp: int, plugin: bool) -> None:
    scheme = qc.get("kv_cache_scheme")
    present = sorted(n for n in ck.location if kvrules.KV_SCALE.match(n))
    if scheme is None:
        return
    if not (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float"
            and scheme.get("symmetric", True) and scheme.get("strategy") in ("tensor", "attn_head")):
        rep.add("K3", "config.json quantization_config.kv_cache_scheme", f"{scheme!r} is refused when the model is built")
        return
    mla = "kv_lora_rank" in cfg
    if mla and present and not plugin:
        rep.add("K2", present[0].rsplit(".", 1)[0],
                f"vLLM {VLLM_VERSION} does not load the FP8 KV-cache scales of MLA layers ({len(present)} tensors): "
                "it serves the FP8 latent cache with scale 1.0. Remedy: install quantkit in vLLM's environment (its "
                "vLLM plugin, quantkit.engine.vllm_plugin, gives MLA layers the KV-cache method and the names)",
                warning=True)
    n_layers = cfg.get("num_hidden_layers")
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    attn = sorted({int(m[1]) for n in ck.location if (m := kvrules.ATTN_TENSOR.match(n))})
    for layer in attn:
        if isinstance(n_layers, int) and layer >= n_layers:
            continue
        for kind in "kv":
            name = kvrules.kv_scale_name(layer, kind, prefix)
            if name not in ck.location:
                bare = kvrules.kv_scale_name(layer, kind)
                if prefix and bare in ck.location:
                    rep.add("K8", bare, f"the wrapper's loader raises on it (no module 'model'); name it {name}")
                else:
                    rep.add("K6", name, "missing: vLLM would use 1.0 for it, silently")
                continue
            shape = tuple(ck.info(name).shape)
            if scheme["strategy"] == "tensor" and ck.info(name).numel != 1:
                rep.add("K4", name, f"shape {list(shape)}: strategy tensor loads one value")
            if scheme["strategy"] == "attn_head" and not mla and shape != (heads, 1, 1):
                rep.add("K4", name, f"shape {list(shape)}: attn_head needs [{heads}, 1, 1]")
    if scheme["strategy"] == "attn_head" and not mla:
        rep.add("K5", "config.json kv_cache_scheme", "per-head KV scales need FlashAttention 3 (Hopper) in vLLM "
                f"{VLLM_VERSION}; other backends refuse them", warning=True)


def _experts(ck, cfg, groups, rep: EngineReport, tp: int, reader) -> None:
    layers: dict[str, dict] = {}
    for name in ck.location:
        if not name.endswith(Tensor.PACKED.dotted):
            continue
        m = _EXPERT.match(name[: -len(Tensor.PACKED.dotted)])
        if m:
            layers.setdefault(m["layer"], {}).setdefault((int(m["e"]), m["proj"]), name[: -len(Tensor.PACKED.dotted)])
    hidden = cfg.get("hidden_size")
    for layer, mods in sorted(layers.items()):
        schemes = {}
        for key, module in mods.items():
            hit = targeting(module, groups)
            schemes[key] = hit[0] if hit else None
        first = next(iter(schemes.values()))
        odd = [mods[k] for k, s in schemes.items() if s is not first]
        if odd:
            rep.add("M1", odd[0], f"{len(odd)} expert module(s) of {layer} take another scheme than expert 0's: vLLM "
                    "applies expert 0's to all of them")
            continue
        w = first.weights if first else {}
        kind = PACKED_FORMATS.get(first.format) if first else None
        down_name = next((mods[k] for k in sorted(mods) if expert_role(k[1]) == "down"), None)
        # codes per packed element: INT4 8 a word, INT8 4 a word (pack/int4.py), FP4 2 a byte
        per = (4 if w.get("num_bits") == 8 else 8) if kind == "int4" else 2
        inter = ck.info(down_name + Tensor.PACKED.dotted).shape[1] * per if down_name else None
        if kind == "int4" and first.w4afp8:
            _w4afp8(layer, w, hidden, inter, tp, rep)
        elif kind == "int4" and w.get("strategy") == "group":
            g = w.get("group_size")
            for what, size in (("hidden_size", hidden), ("moe_intermediate_size / tp", None if inter is None
                                                          else inter // max(tp, 1))):
                if isinstance(size, int) and isinstance(g, int) and size % g:
                    rep.add("M4", layer, f"{what} = {size} is not a multiple of group_size {g}"
                            + (f" at tp {tp}" if "tp" in what else ""))
            if g not in MARLIN_GROUP_SIZES or (isinstance(hidden, int) and hidden % 128):
                rep.add("M5", layer, f"group_size {g}, hidden_size {hidden}: not a Marlin MoE shape; vLLM falls back "
                        "to its Triton WNA16 kernels (slower)", warning=True)
        if kind == "nvfp4" and first.acts is not None and not is_nvfp4_args(first.acts):
            rep.add("A1", layer, f"NVFP4 experts with input_activations {_short_args(first.acts)}: vLLM takes NVFP4 "
                    "activations (tensor_group, group_size 16) or none")
        elif kind == "nvfp4" and first.w4a4:
            _w4a4(ck, layer, mods, rep, reader)
        if kind == "int4" and w.get("strategy") == "channel" and isinstance(hidden, int) and hidden % 128:
            rep.add("M5", layer, "channel-wise INT4 experts need Marlin (hidden_size % 128 == 0)")
        for (e, proj), module in sorted(mods.items()):
            if expert_role(proj) != "gate":
                continue
            up = mods.get((e, partner(proj)))
            if up is None:
                continue
            gs, us = ck.info(module + Tensor.SCALE.dotted).shape, ck.info(up + Tensor.SCALE.dotted).shape
            if gs[-1] != us[-1]:
                rep.add("M6", up, f"{us[-1]} scale groups, gate has {gs[-1]}: one w13 tensor takes both")
            if kind == "nvfp4":
                a, b = (x + Tensor.GLOBAL_SCALE.dotted for x in (module, up))
                if a in ck.location and b in ck.location and not torch.equal(reader.get(a), reader.get(b)):
                    rep.add("F1", up, "its weight_global_scale differs from the gate's: vLLM uses the gate's for both")


def _w4afp8(layer: str, w: dict, hidden, inter, tp: int, rep: EngineReport) -> None:
    """Rules W1-W3 on one MoE layer whose experts are W4AFP8."""
    if w.get("group_size") != w4rules.MULTIPLE // 2 or w.get("symmetric", True) is False:
        rep.add("W1", layer, f"group_size {w.get('group_size')}, symmetric {w.get('symmetric', True)}: the W4A8 MoE "
                "method asserts group_size 128 and symmetric weights")
    if isinstance(hidden, int) and isinstance(inter, int):
        why = w4rules.rule_problem(hidden, inter, max(tp, 1))
        if why:
            rep.add("W2", layer, f"{why} at tp {tp}: vLLM asserts it when the layer is built; works with: "
                    f"{w4rules.describe(hidden, inter)}")
    if not any(x["rule"] == "W3" for x in rep.warnings):  # once per checkpoint
        rep.add("W3", layer, "W4AFP8 experts need a Hopper GPU (SM90) and --dtype bfloat16; without EPLB",
                warning=True)


def _short_args(a: dict) -> str:
    keys = ("num_bits", "type", "strategy", "group_size", "dynamic")
    return "{" + ", ".join(f"{k}: {a.get(k)!r}" for k in keys) + "}"


def _w4a4(ck, layer: str, mods: dict, rep: EngineReport, reader) -> None:
    """Rules A2-A4 on one MoE layer whose experts are NVFP4 W4A4 (`mods`: (expert, proj) -> module)."""
    values: dict[tuple[int, str], float] = {}
    for key, module in sorted(mods.items()):
        name = Tensor.INPUT_GLOBAL_SCALE.of(module)
        if name not in ck.location:
            rep.add("A2", module, "no input_global_scale: vLLM leaves the expert's input scale as uninitialized memory")
            continue
        info = ck.info(name)
        if info.numel != 1 or info.dtype != torch.float32:
            rep.add("A2", name, f"{str(info.dtype).removeprefix('torch.')} {list(info.shape)}: vLLM loads one "
                    "float32 value (more elements raise)")
            continue
        v = float(reader.get(name).reshape(-1)[0])
        if not (math.isfinite(v) and v > 0):
            rep.add("A2", name, f"holds {v!r}: vLLM divides by it, and its FlashInfer backends share the maximum of "
                    "1 / scale over the layer's experts, so every expert of the layer would be mis-scaled")
            continue
        values[key] = v
    for (e, proj), v in sorted(values.items()):
        up = partner(proj) if expert_role(proj) == "gate" else None
        if up is not None and (e, up) in values and values[(e, up)] != v:
            rep.add("A3", mods[(e, up)], f"input_global_scale {values[(e, up)]:.6g} differs from the gate's {v:.6g}: "
                    "vLLM quantizes both with the smaller", warning=True)
    if not any(x["rule"] == "A4" for x in rep.warnings):  # once per checkpoint
        rep.add("A4", layer, "NVFP4 W4A4 experts use FP4 activations on Blackwell only (FlashInfer: one input "
                "scale per layer, the smallest input_global_scale); elsewhere Marlin runs them weights-only",
                warning=True)


def _fp8_blocks(ck, rep: EngineReport, tp: int) -> None:
    blocks = {}
    for name in ck.location:
        if name.endswith(".weight") and ck.info(name).dtype == torch.float8_e4m3fn:
            scale = name[: -len(".weight")] + Tensor.SCALE.dotted
            n, k = ck.info(name).shape
            sshape = tuple(ck.info(scale).shape) if scale in ck.location else None
            if sshape == (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) and sshape != (n, 1):  # 128x128 blocks
                blocks[name[: -len(".weight")]] = (n, k)
    for parts, fused in FUSED_LINEARS:
        for module in [m for m in blocks if m.endswith("." + parts[0])]:
            base = module[: -len(parts[0])]
            present = [(p, blocks[base + p]) for p in parts if base + p in blocks]
            for p, (n, _) in present[:-1]:
                if n % FP8_BLOCK:
                    rep.add("B2", base + p, f"{n} output rows, not a multiple of {FP8_BLOCK}: vLLM refuses the fused "
                            f"block-FP8 {base}{fused} at build time")
    if tp > 1:
        for module, (n, k) in sorted(blocks.items()):
            row_parallel = is_row_parallel(module)
            size, what = (k // tp, "in_features / tp") if row_parallel else (n // tp, "out_features / tp")
            if (k if row_parallel else n) % tp or size % FP8_BLOCK:
                rep.add("B1", module, f"{what} = {(k if row_parallel else n) / tp:g} is not a multiple of the "
                        f"{FP8_BLOCK}-wide block at tp {tp}")
