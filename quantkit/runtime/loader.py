"""Loading a quantkit checkpoint for the runner: config groups (pack/config.py's precedence), every layer's
weights through the one tensor reader (read/tensors.py) with routed experts kept packed as one INT4 stack
per layer, and the FP8 KV-cache scales (pack/kv.py's rules).

Groups the runner executes: INT4 pack-quantized weight-only (W4A16), NVFP4/MXFP4 experts, W4AFP8 (INT4
group 128 with dynamic per-token FP8 activations, runtime/w4afp8.py) and FP8 `float-quantized` weights
with dynamic FP8 activations (runtime/fp8.py). Unquantized routed experts (a BF16 source) run as plain
weights."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..arch.layout import (DENSE_MLP, EXPERTS, K, K_NORM, KV_A, KV_A_NORM, KV_B, O, Q, Q_A, Q_A_NORM, Q_B, Q_NORM,
                           QWEN_EXPERTS, ROUTER_BIAS, V, ExpertNames, LayerNames, top_level)
from ..errors import KVScalesMissing, UnsupportedCheckpoint
from ..pack import kv as kvrules
from ..pack.config import targeting
from ..read.safetensors import SafetensorsFile
from ..read.tensors import TensorReader
from .fp4 import FP4Experts, PackedFP4, fuse_gate_up_fp4
from .fp8 import DenseExperts, FP8Weight, W4AFP8Experts, fp8_linear
from .fused_moe import Int4Experts
from .int4 import PackedInt4, int4_gemm
from .paged_attention import FP8_DTYPE
from .spec import ModelSpec, MoESpec
from .w4afp8 import W4AFP8Weight, w4afp8_gemm
from ..pack.names import Format, Tensor


@dataclass(frozen=True)
class Linear:
    """y = x @ W^T (+ b). weight: dense [N, K] in the compute dtype, PackedInt4 (N, K), an FP8 weight (W8A8,
    dynamic FP8 input) or a W4AFP8 weight (INT4 weight, dynamic per-token FP8 input)."""

    weight: torch.Tensor | PackedInt4 | FP8Weight | W4AFP8Weight
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        if isinstance(self.weight, (PackedInt4, FP8Weight, W4AFP8Weight)):
            w = self.weight
            y = (int4_gemm(x, w, backend=backend) if isinstance(w, PackedInt4) else fp8_linear(x, w)
                 if isinstance(w, FP8Weight) else w4afp8_gemm(x, w, backend=backend))
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight
        if isinstance(w, FP8Weight):
            return w.w.to(dtype)
        if isinstance(w, W4AFP8Weight):
            return (w.effective() * w.chan[..., None]).to(dtype)
        return (w.dequantize(torch.float32) if isinstance(w, PackedInt4) else w).to(dtype)


@dataclass(frozen=True)
class DenseMLP:
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True)
class MoEBlock:
    router: torch.Tensor  # [E, D]
    bias: torch.Tensor | None  # fp32 [E] e_score_correction_bias (sigmoid routing)
    experts: Int4Experts | FP4Experts | DenseExperts | W4AFP8Experts
    shared: DenseMLP | None


@dataclass(frozen=True)
class GQAAttention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class MLAAttention:
    q: Linear | None  # q_lora_rank None
    q_a: Linear | None
    q_a_norm: torch.Tensor | None
    q_b: Linear | None
    kv_a: Linear  # -> [L + R]
    kv_a_norm: torch.Tensor  # [L]
    kv_b: Linear  # [H * (nope + v), L]
    w_uk: torch.Tensor  # fp32 [H, nope, L]  (absorbed into q for decode)
    w_uv: torch.Tensor  # fp32 [H, v, L]
    o: Linear


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: GQAAttention | MLAAttention
    mlp: DenseMLP | MoEBlock


@dataclass(frozen=True)
class Weights:
    """A model's weights as the runner holds them: embed [V, D], the decoder layers, the final norm [D],
    lm_head [V, D] (the embedding itself when tied and not stored)."""

    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor


@dataclass(frozen=True)
class _Group:
    targets: list
    group_size: int | None  # INT4 group size (None: per channel, or not INT4)
    kind: str  # int4 (W4A16) | w4afp8 | fp4 | fp8 (W8A8, dynamic FP8 input)
    fp8_layout: object = None  # quant.fp8.FP8Layout of an fp8 group
    act_group: int | None = None  # fp8: the dynamic input's group size (None: per token)


class _QuantScheme:
    """The config's compressed-tensors groups, validated: pack-quantized INT4 weight-only or W4AFP8, FP4
    experts, or float-quantized FP8 weights with dynamic FP8 input activations."""

    def __init__(self, qcfg: dict | None):
        self.groups = []
        if qcfg is None:
            return
        if qcfg.get("quant_method") != "compressed-tensors":
            raise UnsupportedCheckpoint(f"quantization_config.quant_method {qcfg.get('quant_method')!r}: the runner "
                                        "reads compressed-tensors checkpoints")
        if qcfg.get("quantization_status", "compressed") != "compressed":
            raise UnsupportedCheckpoint(f"quantization_status {qcfg.get('quantization_status')!r}, "
                                        "expected 'compressed'")
        from ..pack.config import config_groups, is_w4afp8
        from ..quant.fp8 import FP8Layout

        for g in config_groups(qcfg, UnsupportedCheckpoint):
            name, w, acts, fmt = g.name, g.weights or {}, g.input_activations, g.format
            int4 = fmt == Format.PACKED and w.get("num_bits") == 4 and w.get("type") == "int"
            fp4 = fmt in (Format.NVFP4, Format.MXFP4)  # routed experts (fused_moe_fp4)
            fp8 = (fmt == Format.FLOAT and w.get("num_bits") == 8 and w.get("type") == "float"
                   and w.get("strategy") in ("tensor", "channel", "block"))
            fp8_acts = (isinstance(acts, dict) and acts.get("num_bits") == 8 and acts.get("type") == "float"
                        and bool(acts.get("dynamic")) and acts.get("strategy") in ("token", "group"))
            w4afp8 = int4 and is_w4afp8(w, acts) and w.get("group_size") == 128
            if acts and not (w4afp8 or (fp8 and fp8_acts)) or not (int4 or fp4 or fp8):
                what = " with quantized activations" if acts else ""
                raise UnsupportedCheckpoint(f"quantization group {str(name)[:40]!r} is {fmt} {w.get('type')}"
                                            f"{w.get('num_bits')}{what}; the runner executes pack-quantized INT4 "
                                            "(W4A16, or W4AFP8 at group 128), FP4 experts, and FP8 weights with "
                                            "dynamic FP8 activations")
            if w.get("actorder") == "group":
                raise UnsupportedCheckpoint("act-order 'group' (weight_g_idx) is not supported by the INT4 kernels")
            targets = list(g.targets)
            if fp8:
                bs = w.get("block_structure")
                try:
                    layout = FP8Layout(w["strategy"], tuple(bs) if bs else None)
                except (ValueError, TypeError) as e:
                    raise UnsupportedCheckpoint(f"quantization group {str(name)[:40]!r}: {e}") from None
                ag = acts.get("group_size") if acts and acts.get("strategy") == "group" else None
                self.groups.append(_Group(targets, None, "fp8", layout, ag if isinstance(ag, int) and ag > 0 else None))
                continue
            gs = w.get("group_size") if w.get("strategy") == "group" else None
            self.groups.append(_Group(targets, gs, "w4afp8" if w4afp8 else "fp4" if fp4 else "int4"))

    def group(self, module: str) -> _Group | None:
        hit = targeting(module, self.groups, lambda g: g.targets)
        return hit[0] if hit else None

    def group_size(self, module: str) -> int | None:
        """The group size the config gives `module` (None: infer from the scale's shape)."""
        g = self.group(module)
        return g.group_size if g else None

    def kind(self, module: str) -> str | None:
        g = self.group(module)
        return g.kind if g else None


class _Reader(TensorReader):
    """The checkpoint's tensors; a missing one is an UnsupportedCheckpoint."""

    def __init__(self, ckpt):
        r = TensorReader.of(ckpt)
        super().__init__(r.root, r.location, r._headers)
        self.ckpt = ckpt

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise UnsupportedCheckpoint(f"tensor {name} is missing from the checkpoint")
        return super().get(name).clone()  # weights outlive the mapping (closed after load)


class _Loader:
    def __init__(self, reader: _Reader, scheme: _QuantScheme, dtype: torch.dtype, device: torch.device):
        self.r, self.scheme, self.dtype, self.device = reader, scheme, dtype, device

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.r.get(name)
        if not t.is_floating_point() or t.dtype == FP8_DTYPE:
            raise UnsupportedCheckpoint(f"{name} is {str(t.dtype).removeprefix('torch.')}; expected a BF16/FP16/FP32 "
                                        "tensor (FP8 weights are not supported by the runner)")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def packed(self, module: str) -> PackedInt4:
        if self.r.has(Tensor.G_IDX.of(module)):
            raise UnsupportedCheckpoint(f"{module} has weight_g_idx (act-order 'group'), which the kernels do not take")
        zp = Tensor.ZERO_POINT.of(module)
        return PackedInt4.from_tensors(
            self.r.get(Tensor.PACKED.of(module)).to(self.device), self.r.get(Tensor.SCALE.of(module)).to(self.device),
            self.r.get(Tensor.SHAPE.of(module)), self.r.get(zp).to(self.device) if self.r.has(zp) else None,
            self.scheme.group_size(module))

    def fp8(self, module: str) -> FP8Weight:
        """An FP8 `float-quantized` weight: codes times scales, exact in fp32, and its input's dynamic groups."""
        from ..quant.fp8 import dequantize as fp8_dequantize
        from ..read.tensors import read_scale

        g = self.scheme.group(module)
        if g is None or g.kind != "fp8":
            raise UnsupportedCheckpoint(f"{module}.weight is float8, but no float-quantized config group targets it")
        q = self.r.get(f"{module}.weight")
        s = read_scale(self.r.get, Tensor.SCALE.of(module), g.fp8_layout)
        if tuple(s.shape) != tuple(g.fp8_layout.scale_shape(*q.shape)) and s.numel() != 1:
            raise UnsupportedCheckpoint(f"{module}.weight_scale is {list(s.shape)}, the {g.fp8_layout.strategy} "
                                        f"layout of a {list(q.shape)} weight implies "
                                        f"{list(g.fp8_layout.scale_shape(*q.shape))}")
        w = fp8_dequantize(q, s, g.fp8_layout, torch.float32).to(self.device)
        ag = g.act_group if g.act_group and q.shape[1] % g.act_group == 0 else None
        return FP8Weight(w, ag)

    def _is_fp8(self, module: str) -> bool:
        n = f"{module}.weight"
        return self.r.has(n) and self.r.info(n).dtype == FP8_DTYPE

    def linear(self, module: str, shape: tuple[int, int] | None = None) -> Linear:
        if self.r.has(Tensor.PACKED.of(module)):
            w = self.packed(module)
            got = w.shape
            if self.scheme.kind(module) == "w4afp8":
                w = W4AFP8Weight.from_int4(w)
        elif self._is_fp8(module):
            w = self.fp8(module)
            got = w.shape
        elif self.r.has(f"{module}.weight"):
            w = self.tensor(f"{module}.weight")
            got = tuple(w.shape)
        else:
            raise UnsupportedCheckpoint(f"{module}: neither {module}.weight nor {module}.weight_packed is in "
                                        "the checkpoint")
        if shape is not None and tuple(got) != tuple(shape):
            raise UnsupportedCheckpoint(f"{module} has shape {list(got)}, the config implies {list(shape)}")
        b = f"{module}.bias"
        return Linear(w, self.tensor(b) if self.r.has(b) else None)

    def mlp(self, prefix: str, d: int, inter: int) -> DenseMLP:
        g, u, dn = DENSE_MLP.gate, DENSE_MLP.up, DENSE_MLP.down
        return DenseMLP(self.linear(f"{prefix}.{g}", (inter, d)), self.linear(f"{prefix}.{u}", (inter, d)),
                        self.linear(f"{prefix}.{dn}", (d, inter)))

    def experts(self, prefix: str, spec: MoESpec, d: int) -> Int4Experts | FP4Experts | DenseExperts | W4AFP8Experts:
        """Stack the per-expert packed tensors of one layer into [E, ...] PackedInt4s (or, for NVFP4 /
        MXFP4 experts, PackedFP4 w13 = gate + up and w2; W4AFP8: the W4A8 kernel's gate_up / down; FP8 or
        unquantized experts: DenseExperts)."""
        first = f"{prefix}.0.{spec.names[0]}"
        if self.r.has(Tensor.PACKED.of(first)) and self.r.info(Tensor.PACKED.of(first)).dtype == torch.uint8:
            return self._fp4_experts(prefix, spec, d)
        if not self.r.has(Tensor.PACKED.of(first)) and self.r.has(f"{first}.weight"):
            return self._dense_experts(prefix, spec, d)
        stacks = []
        for name, shape in zip(spec.names, [(spec.intermediate_size, d)] * 2 + [(d, spec.intermediate_size)]):
            mods = [f"{prefix}.{e}.{name}" for e in range(spec.num_experts)]
            if not self.r.has(Tensor.PACKED.of(mods[0])):
                raise UnsupportedCheckpoint(
                    f"{mods[0]} is not INT4 pack-quantized; the runner executes quantized experts only",
                    hint="convert the model with an INT4 expert recipe (quantkit convert, e.g. int4-experts-rtn)")
            parts = [self.packed(m) for m in mods]
            if any(p.shape != tuple(shape) or p.group_size != parts[0].group_size for p in parts):
                raise UnsupportedCheckpoint(f"{prefix}.*.{name}: experts disagree in shape or group size "
                                            f"(expected {list(shape)})")
            zps = [p.zero_point for p in parts]
            zp = None if zps[0] is None else torch.stack(zps)
            stacks.append(PackedInt4(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]),
                                     zp, tuple(shape), parts[0].group_size))
        gate, up, down = stacks
        if self.scheme.kind(f"{prefix}.0.{spec.names[0]}") == "w4afp8":
            # vLLM stacks gate and up into w13 [E, 2I, D] and converts each to FP8 group + fp32 channel scales
            gu = PackedInt4(torch.cat([gate.packed, up.packed], 1), torch.cat([gate.scale, up.scale], 1), None,
                            (2 * gate.shape[0], gate.shape[1]), gate.group_size)
            try:
                return W4AFP8Experts(W4AFP8Weight.from_int4(gu), W4AFP8Weight.from_int4(down))
            except ValueError as e:
                raise UnsupportedCheckpoint(f"{prefix}: {e}") from None
        return Int4Experts(down, gate=gate, up=up)

    def _dense_experts(self, prefix: str, spec: MoESpec, d: int) -> DenseExperts:
        """FP8 experts (codes x scales, fp32, dynamic FP8 inputs) or unquantized ones (the compute dtype)."""
        fp8 = self._is_fp8(f"{prefix}.0.{spec.names[0]}")
        stacks, act_group = [], None
        for name, shape in zip(spec.names, [(spec.intermediate_size, d)] * 2 + [(d, spec.intermediate_size)]):
            ws = []
            for e in range(spec.num_experts):
                m = f"{prefix}.{e}.{name}"
                if self._is_fp8(m) != fp8:
                    raise UnsupportedCheckpoint(f"{m}: experts of one layer mix FP8 and other formats")
                if fp8:
                    fw = self.fp8(m)
                    act_group = fw.act_group
                    w = fw.w
                else:
                    w = self.tensor(f"{m}.weight")
                if tuple(w.shape) != tuple(shape):
                    raise UnsupportedCheckpoint(f"{m} has shape {list(w.shape)}, the config implies {list(shape)}")
                ws.append(w)
            stacks.append(torch.stack(ws))
        return DenseExperts(*stacks, fp8=fp8, act_group=act_group)

    def _fp4_experts(self, prefix: str, spec: MoESpec, d: int) -> FP4Experts:
        stacks = []
        for name, shape in zip(spec.names, [(spec.intermediate_size, d)] * 2 + [(d, spec.intermediate_size)]):
            parts = []
            for e in range(spec.num_experts):
                m = f"{prefix}.{e}.{name}"
                gs = Tensor.GLOBAL_SCALE.of(m)
                parts.append(PackedFP4.from_tensors(self.r.get(Tensor.PACKED.of(m)), self.r.get(Tensor.SCALE.of(m)),
                                                    self.r.get(gs) if self.r.has(gs) else None))
            if any(p.shape != tuple(shape) or p.kind != parts[0].kind for p in parts):
                raise UnsupportedCheckpoint(f"{prefix}.*.{name}: experts disagree in shape or FP4 kind "
                                            f"(expected {list(shape)})")
            gss = [p.global_scale for p in parts]
            stacks.append(PackedFP4(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]),
                                    None if gss[0] is None else torch.stack([g.reshape(1) for g in gss]),
                                    tuple(shape), parts[0].kind).to(self.device))
        gate, up, down = stacks
        try:
            w13 = fuse_gate_up_fp4(gate, up)
        except ValueError as e:
            raise UnsupportedCheckpoint(f"{prefix}: {e}") from None
        return FP4Experts(w13, down)


def _load_layer(ld: _Loader, spec: ModelSpec, i: int) -> Layer:
    names = LayerNames("", i, ExpertNames(spec.moe.prefix, *spec.moe.names) if spec.moe else QWEN_EXPERTS)
    a = names.att
    d, h = spec.hidden_size, spec.num_heads
    if spec.mla is None:
        dh, hkv = spec.head_dim, spec.num_kv_heads
        attn = GQAAttention(ld.linear(a(Q), (h * dh, d)), ld.linear(a(K), (hkv * dh, d)),
                            ld.linear(a(V), (hkv * dh, d)), ld.linear(a(O), (d, h * dh)),
                            ld.tensor(a(Q_NORM) + ".weight") if spec.qk_norm else None,
                            ld.tensor(a(K_NORM) + ".weight") if spec.qk_norm else None)
    else:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q, q_a, q_a_norm, q_b = ld.linear(a(Q), (h * qk, d)), None, None, None
        else:
            q = None
            q_a = ld.linear(a(Q_A), (m.q_lora_rank, d))
            q_a_norm = ld.tensor(a(Q_A_NORM) + ".weight")
            q_b = ld.linear(a(Q_B), (h * qk, m.q_lora_rank))
        kv_b = ld.linear(a(KV_B), (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
        # the absorbed decode needs W_UK / W_UV as matrices: an INT4 kv_b_proj is dequantized once here
        wkv = kv_b.dense(torch.float32).view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        attn = MLAAttention(q, q_a, q_a_norm, q_b,
                            ld.linear(a(KV_A), (m.kv_lora_rank + m.qk_rope_head_dim, d)),
                            ld.tensor(a(KV_A_NORM) + ".weight"), kv_b,
                            wkv[:, : m.qk_nope_head_dim].contiguous(), wkv[:, m.qk_nope_head_dim:].contiguous(),
                            ld.linear(a(O), (d, h * m.v_head_dim)))
    if spec.moe_layers[i]:
        if ld.r.has(Tensor.PACKED.of(names.router)):
            raise UnsupportedCheckpoint(f"{names.router} (the router) is quantized; routers must stay in full "
                                        "precision")
        sigmoid = spec.moe.scoring == "sigmoid"
        # DeepSeek/GLM keep the router and its bias in fp32 (_keep_in_fp32_modules_strict)
        router = ld.tensor(names.router + ".weight", torch.float32 if sigmoid else None)
        bias = None
        if sigmoid:
            bn = f"{names.router}.{ROUTER_BIAS}"
            bias = ld.tensor(bn, torch.float32) if ld.r.has(bn) else torch.zeros(spec.moe.num_experts, device=ld.device)
        shared = (ld.mlp(names.shared, d, spec.moe.shared_intermediate)
                  if spec.moe.shared_intermediate else None)
        mlp = MoEBlock(router, bias, ld.experts(f"{names.mlp}.{EXPERTS}", spec.moe, d), shared)
    else:
        mlp = ld.mlp(names.dense_mlp, d, spec.intermediate_size)
    return Layer(ld.tensor(names.input_norm + ".weight"), ld.tensor(names.post_attn_norm + ".weight"), attn, mlp)


def _load_weights(ld: _Loader, reader: _Reader, spec: ModelSpec, dtype: torch.dtype) -> Weights:
    """Every weight of the model, the embedding's shape held to the config."""
    embed_name, norm_name, head_name = top_level()
    embed = ld.tensor(embed_name + ".weight")
    if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
        raise UnsupportedCheckpoint(f"{embed_name}.weight is {list(embed.shape)}, the config implies "
                                    f"[{spec.vocab_size}, {spec.hidden_size}]")
    layers = [_load_layer(ld, spec, i) for i in range(spec.num_layers)]
    norm = ld.tensor(norm_name + ".weight")
    if spec.tie_word_embeddings and not reader.has(head_name + ".weight"):
        lm_head = embed
    else:
        lm_head = ld.linear(head_name, (spec.vocab_size, spec.hidden_size)).dense(dtype)
    return Weights(embed, layers, norm, lm_head)


def _kv_scale_source(kv_scales, reader: _Reader):
    """name -> tensor lookup for the KV scales: the argument (mapping or safetensors path), else the checkpoint."""
    if kv_scales is None:
        return reader.get if any(kvrules.KV_SCALE.match(n) for n in reader.location) else None, "checkpoint"
    if isinstance(kv_scales, (str, os.PathLike)):
        path = Path(kv_scales)
        if not path.is_file():
            raise KVScalesMissing(f"KV-scales file {str(path)!r} does not exist")
        with SafetensorsFile(path) as f:
            table = {n: f.get(n) for n in f.header.tensors}
        return table.get, str(path)
    if isinstance(kv_scales, Mapping):
        return (lambda n: kv_scales.get(n)), "kv_scales"
    raise TypeError("kv_scales must be None, a path to a safetensors file, or a mapping name -> tensor")


def _load_kv_scales(spec: ModelSpec, kv_dtype, kv_scales, reader: _Reader, device) -> list[tuple]:
    """Per layer (k_scale, v_scale) fp32 [1] or [Hkv, 1, 1]; (None, None) for a BF16/FP16 cache."""
    if kv_dtype != FP8_DTYPE:
        return [(None, None)] * spec.num_layers
    lookup, origin = _kv_scale_source(kv_scales, reader)
    if lookup is None:
        raise KVScalesMissing("kv_dtype is float8_e4m3fn but the checkpoint holds no self_attn.k_scale / v_scale")
    out = []
    for i in range(spec.num_layers):
        pair = []
        for kind in ("k", "v") if spec.mla is None else ("k",):  # MLA: one scale for the whole latent
            name = kvrules.kv_scale_name(i, kind)
            t = lookup(name) if (origin != "checkpoint" or reader.has(name)) else None
            if t is None:
                raise KVScalesMissing(f"{name} is missing ({origin})")
            t = torch.as_tensor(t).to(device=device, dtype=torch.float32)
            per_head = kvrules.scale_shape("attn_head", spec.num_kv_heads, spec.mla is not None)
            ok_shape = t.numel() == 1 or tuple(t.shape) == per_head
            if not ok_shape or not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise KVScalesMissing(f"{name} must be positive finite fp32 [1]"
                                      + ("" if spec.mla else f" or [{spec.num_kv_heads}, 1, 1]")
                                      + f", got {list(t.shape)}")
            pair.append(t.reshape(-1, 1, 1) if t.numel() > 1 else t.reshape(1))
        out.append((pair[0], pair[1] if len(pair) > 1 else None))
    return out
