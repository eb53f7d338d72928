"""Which tensors replace `<module>.weight` under each scheme: names, dtypes and shapes. The one table
`convert` writes by, the calibrated pass spools by, `plan` sizes by and `verify` checks against
(docs/format.md, "INT4 weights" and "FP8 weights").

    scheme                        tensors of one module with weight [N, K] (G = groups per row)
    INT4 pack-quantized           weight_packed int32 [N, ceil(K/8)], weight_scale <scale dtype> [N, G],
                                  weight_shape int64 [2], + weight_zero_point int32 [ceil(N/8), G] (asym),
                                  + weight_g_idx int32 [K] (actorder "group")
    INT8 pack-quantized           as INT4 with four values a word: weight_packed int32 [N, ceil(K/4)]; symmetric
    FP8 float-quantized           weight float8_e4m3fn [N, K], weight_scale float32 [1] | [N, 1] |
                                  [ceil(N/b0), ceil(K/b1)]
    NVFP4 nvfp4-pack-quantized    weight_packed uint8 [N, K/2] (two E2M1 codes a byte, even column low),
                                  weight_scale float8_e4m3fn [N, K/16], weight_global_scale float32 [1]
    MXFP4 mxfp4-pack-quantized    weight_packed uint8 [N, K/2], weight_scale uint8 E8M0 [N, K/32]
    NVFP4 W4A4                    the NVFP4 tensors + input_global_scale float32 [1] (448 * 6 / the
                                  calibrated input amax; gate and up of an expert hold the same value)

The INT4 (and INT8) scale dtype is the source weight's when that is bf16 or fp16, else bf16 (fp32 sources, and FP8
sources, which are dequantized to bf16 on read): `scale_dtype`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..quant.fp8 import FP8_DTYPE, FP8Layout
from .int4 import pack_zero_point
from .names import Tensor

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape)
INT4_SUFFIXES = (Tensor.PACKED, Tensor.SCALE, Tensor.SHAPE, Tensor.ZERO_POINT, Tensor.G_IDX)
FP8_SUFFIXES = (Tensor.WEIGHT, Tensor.SCALE)
FP4_SUFFIXES = (Tensor.PACKED, Tensor.SCALE, Tensor.GLOBAL_SCALE)
# NVFP4 W4A4 only: the static global scale of the module's FP4 input activations
INPUT_SCALE = Tensor.INPUT_GLOBAL_SCALE
# A block-FP8 release's `weight_scale_inv` (a multiplier despite its name) is exactly compressed-tensors'
# block `weight_scale`: a module passed through is written with it renamed and widened to float32.
FP8_RELEASE_SCALE = Tensor.RELEASE_SCALE


def scale_dtype(src_dtype: torch.dtype) -> torch.dtype:
    """dtype of INT4 scales for a weight stored as `src_dtype` (see the module docstring)."""
    return src_dtype if src_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def fp8_layout(scheme) -> FP8Layout:
    """Where an FP8 scheme's scales live."""
    return FP8Layout(scheme.strategy, scheme.block_structure)


def num_groups(scheme, k: int) -> int:
    return 1 if scheme.strategy == "channel" else -(-k // scheme.group_size)


def module_tensors(module: str, shape: tuple[int, int], scheme, src_dtype: torch.dtype, *,
                   g_idx: bool = False) -> list[TensorSpec]:
    """The tensors that replace `module.weight` [N, K] = `shape` under `scheme` (a match.recipe.Scheme
    already resolved for this K), in the order they are written. `g_idx`: INT4 with actorder "group"."""
    n, k = shape
    if scheme.fp4:
        out = [(Tensor.PACKED.of(module), torch.uint8, (n, k // 2)),
               (Tensor.SCALE.of(module), torch.float8_e4m3fn if scheme.fp4 == "nvfp4" else torch.uint8,
                (n, k // scheme.group_size))]
        if scheme.fp4 == "nvfp4":
            out.append((Tensor.GLOBAL_SCALE.of(module), torch.float32, (1,)))
        if getattr(scheme, "activations", None) == "nvfp4":
            out.append((INPUT_SCALE.of(module), torch.float32, (1,)))
        return out
    if scheme.type == "float":
        return [(Tensor.WEIGHT.of(module), FP8_DTYPE, (n, k)),
                (Tensor.SCALE.of(module), torch.float32, fp8_layout(scheme).scale_shape(n, k))]
    groups = num_groups(scheme, k)
    per_word = 32 // scheme.num_bits
    out = [(Tensor.PACKED.of(module), torch.int32, (n, -(-k // per_word))),
           (Tensor.SCALE.of(module), scale_dtype(src_dtype), (n, groups)),
           (Tensor.SHAPE.of(module), torch.int64, (2,))]
    if not scheme.symmetric:
        out.append((Tensor.ZERO_POINT.of(module), torch.int32, (-(-n // per_word), groups)))
    if g_idx:
        out.append((Tensor.G_IDX.of(module), torch.int32, (k,)))
    return out


def int4_module(module: str, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                shape: tuple[int, int], scheme, src_dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """One INT4 (or INT8) module's output tensors, in `module_tensors` order: `packed` int32 [N, ceil(K/8)]
    (INT8: [N, ceil(K/4)]; see pack/int4.py), `scale` [N, G] (stored in `scale_dtype(src_dtype)`), `zero_point`
    [N, G] (unpacked; packed here along N; INT4 only) or None."""
    values = {Tensor.PACKED: packed, Tensor.SHAPE: torch.tensor(shape, dtype=torch.int64)}
    out = []
    for name, dtype, want in module_tensors(module, shape, scheme, src_dtype):
        suffix = name.rsplit(".", 1)[1]
        if suffix == Tensor.SCALE:
            t = scale.to(dtype)
        elif suffix == Tensor.ZERO_POINT:
            t = pack_zero_point(zero_point)
        else:
            t = values[suffix]
        if tuple(t.shape) != tuple(want):  # e.g. INT4 words under an INT8 scheme
            raise ValueError(f"{name}: shape {list(t.shape)}, the scheme ({scheme.num_bits} bits) needs {list(want)}")
        out.append((name, t))
    return out


def fp4_module(module: str, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """One FP4 module's weight tensors, in `module_tensors` order: `packed` uint8 [N, K/2] (pack/fp4.py),
    `scale` [N, K/group] (e4m3 for NVFP4, E8M0 bytes for MXFP4), `global_scale` (NVFP4, one value) or None
    (MXFP4). A W4A4 module's input_global_scale is the calibrated pass's, added by its writer."""
    out = [(Tensor.PACKED.of(module), packed), (Tensor.SCALE.of(module), scale)]
    if global_scale is not None:
        out.append((Tensor.GLOBAL_SCALE.of(module), global_scale.reshape(1)))
    return out


def check_module(specs: list[TensorSpec], tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first way `tensors` (name -> tensor) differ from `specs` (missing, dtype, shape), or None."""
    for name, dtype, shape in specs:
        t = tensors.get(name)
        if t is None:
            return f"{name}: missing"
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            return f"{name}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, expected " \
                   f"{str(dtype).removeprefix('torch.')} {list(shape)}"
    return None
