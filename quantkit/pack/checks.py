"""The rules one compressed-tensors module obeys, whoever wrote it: its config group's weight args, the
tensors its scheme implies (names, dtypes, shapes: pack/layout.py) and what its scales may hold. `convert`
holds every quantized source module to them before anything is written (read/sources.py, `validate`),
`verify` every written module (verify/format.py): one home per rule (docs/format.md, "Sources").

Kinds: "int4" (pack-quantized: INT4, or INT8 when its args say num_bits 8), "fp8" (float-quantized; also
block-FP8 releases), "nvfp4", "mxfp4".

Scales must be finite and positive (an NVFP4 group scale may be 0: an e4m3 scale of a tiny group underflows
to 0 and decodes to zeros, which is what the group held), an E8M0 byte is never 255 (its NaN), and the
largest weight a scale can decode to must stay within MAX_WEIGHT: no trained checkpoint holds a weight past
float16's range, and a scale of 1e30 is corruption, not a model. Every check reads only the small tensors
(scales, global scales, weight_shape, g_idx), never the packed weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..quant.fp8 import FP8_MAX  # the largest float8_e4m3fn magnitude
from .layout import FP4_SUFFIXES, INPUT_SCALE, INT4_SUFFIXES, module_tensors

MAX_WEIGHT = 65504.0  # float16's largest finite number: the largest decoded weight a scale may give
KINDS = ("int4", "fp8", "nvfp4", "mxfp4")
FP4_MAX = 6.0  # the largest E2M1 magnitude
INT4_SCALE_DTYPES = (torch.bfloat16, torch.float16)
# weight_shape: convert writes int64; compressed-tensors decodes any integer dtype (torch.Size over its values)
SHAPE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
E8M0_NAN = 255


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scheme_problem(kind: str, w) -> str | None:
    """What makes compressed-tensors weight args `w` no scheme of `kind` quantkit reads and writes (the
    rules of match.recipe.Scheme: INT4 num_bits 4 (or symmetric INT8, num_bits 8) with a positive group_size
    that is a multiple of 8, or per channel; FP8 tensor / channel / block; NVFP4 tensor_group 16; MXFP4 group
    32), or None."""
    from ..errors import RecipeError
    from .scheme import Scheme

    try:
        s = Scheme.parse_weights_config(w)
    except RecipeError as e:
        return e.message[:200]
    found = s.fp4 or ("fp8" if s.type == "float" else "int4")
    if found != kind:
        want = {"int4": "INT4 or INT8 (type int, num_bits 4 or 8, strategy group or channel)",
                "fp8": "FP8 (type float, num_bits 8, strategy tensor, channel or block)",
                "nvfp4": "NVFP4 (type float, num_bits 4, strategy tensor_group, group_size 16)",
                "mxfp4": "MXFP4 (type float, num_bits 4, strategy group, group_size 32)"}[kind]
        return f"the args describe {found} ({s.label}), but the format needs {want}"
    return None


def expected(kind: str, weights: dict, scheme, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """suffix -> (dtype, shape) a packed module with weight [n, k] must carry (pack/layout.py); INT4 scales may
    be bf16 or fp16 (the layout's dtype is the one convert writes from a bf16 weight)."""
    g_idx = kind == "int4" and weights.get("actorder") == "group"
    return {name.rsplit(".", 1)[1]: (dtype, shape)
            for name, dtype, shape in module_tensors("m", (n, k), scheme, torch.bfloat16, g_idx=g_idx)}


def header_problems(module: str, infos: Mapping, kind: str, weights: dict, scheme, group: str) -> list[str]:
    """A packed module's (INT4, NVFP4, MXFP4) tensors as the headers show them, before any value is read:
    the tensors its group implies are there (no others), with their dtypes; weight_packed is 2-D and
    non-empty; weight_shape (INT4 only) is [2]. `infos`: suffix -> an object with .dtype and .shape."""
    out = []
    want = expected(kind, weights, scheme, 8, scheme.group_size or 8)
    for suffix in (INT4_SUFFIXES if kind == "int4" else (*FP4_SUFFIXES, INPUT_SCALE)):
        i, w = infos.get(suffix), want.get(suffix)
        if w is None:
            if i is not None:
                why = {"weight_zero_point": "is symmetric",
                       "weight_g_idx": f"has actorder {str(weights.get('actorder'))[:40]!r}",
                       INPUT_SCALE: "has no NVFP4 W4A4 input_activations"}
                out.append(f"{module}.{suffix}: present, but {group} {why.get(suffix, f'({kind}) has none')}")
            continue
        if i is None:
            why = {"weight_zero_point": f" ({group} is asymmetric: symmetric false needs zero points)",
                   "weight_g_idx": " (actorder 'group')",
                   INPUT_SCALE: f" ({group} quantizes input activations to NVFP4: their static global scale)"}
            out.append(f"{module}.{suffix}: missing{why.get(suffix, '')}")
            continue
        dtypes = (INT4_SCALE_DTYPES if suffix == "weight_scale" and kind == "int4"
                  else SHAPE_DTYPES if suffix == "weight_shape" else (w[0],))
        if i.dtype not in dtypes:
            what = ("bfloat16 or float16" if suffix == "weight_scale" and kind == "int4"
                    else "an integer dtype" if suffix == "weight_shape" else _dt(w[0]))
            out.append(f"{module}.{suffix}: dtype {_dt(i.dtype)}, expected {what}")
    ws, packed = infos.get("weight_shape"), infos.get("weight_packed")
    if kind != "int4" and ws is not None:
        out.append(f"{module}.weight_shape: present, but {kind} modules carry none")
    elif ws is not None and tuple(ws.shape) != (2,):
        out.append(f"{module}.weight_shape: shape {list(ws.shape)}, expected [2]")
    if packed is not None and (len(packed.shape) != 2 or not all(packed.shape)):
        out.append(f"{module}.weight_packed: shape {list(packed.shape)}, expected a non-empty 2-D [out, packed in]")
    return out


def shape_problems(module: str, infos: Mapping, kind: str, weights: dict, scheme, group: str, label: str,
                   n: int, k: int) -> list[str]:
    """A packed module's tensor shapes against its weight [n, k] (INT4: what weight_shape holds): positive,
    every tensor the shape the scheme implies (weight_packed's too: weight_shape agrees with the packed
    data), in_features a multiple of the group size."""
    if n <= 0 or k <= 0:
        return [f"{module}.weight_shape: holds {[n, k]}, expected positive [out, in]"]
    out = []
    for suffix, (_, want) in expected(kind, weights, scheme, n, k).items():
        have = tuple(infos[suffix].shape)
        if have != want:
            out.append(f"{module}.{suffix}: shape {list(have)}, expected {list(want)} for weight [{n}, {k}] under "
                       f"{group} ({label})")
    gs = scheme.group_size if scheme.strategy in ("group", "tensor_group") else None
    if gs and k % gs:
        out.append(f"{module}: in_features {k} is not a multiple of group_size {gs}")
    return out


def _too_large(name: str, scale_max: float, code_max: float) -> str | None:
    top = scale_max * code_max
    if math.isfinite(top) and top <= MAX_WEIGHT:
        return None
    return (f"{name}: a scale of {scale_max:.3g} decodes to weights up to {top:.3g}, past {MAX_WEIGHT:g} (no trained "
            "checkpoint holds such weights)")


def _range(t: torch.Tensor) -> tuple[float, float]:
    """(min, max) of `t` in one pass (NaN propagates to both), float8 widened first."""
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        t = t.float()
    lo, hi = torch.aminmax(t.reshape(-1))
    return float(lo), float(hi)


def value_problems(module: str, kind: str, tensors: Mapping[str, torch.Tensor], scale: str = "weight_scale",
                   symmetric: bool = True, num_bits: int = 4) -> list[str]:
    """What a module's scales hold (tensors: suffix -> tensor, only the small ones are read): finite and
    positive, E8M0 never 255, NVFP4 global scale finite and positive, the largest decodable weight within
    MAX_WEIGHT; INT4 g_idx within the groups. `scale`: the scale's suffix (block-FP8 releases:
    weight_scale_inv). `num_bits`: a pack-quantized module's (4 or 8: the largest code it decodes).
    One min/max pass per scale; the counts for a message only when something is wrong."""
    name = f"{module}.{scale}"
    s = tensors[scale]
    if not s.numel():
        return []
    lo, hi = _range(s)  # NaN fails every comparison below, +-inf the range
    if kind == "mxfp4":
        if hi == E8M0_NAN:
            return [f"{name}: {int((s.view(torch.uint8) == E8M0_NAN).sum())} E8M0 NaN (255) value(s)"]
        return [p for p in [_too_large(name, 2.0 ** (hi - 127), FP4_MAX)] if p]
    if kind == "nvfp4":
        if not (lo >= 0 and math.isfinite(hi)):
            f = s.float()
            return [f"{name}: {int((~torch.isfinite(f) | (f < 0)).sum())} NaN or negative value(s)"]
        g = tensors["weight_global_scale"].float().reshape(-1)
        gv = float(g[0]) if g.numel() == 1 else float("nan")
        if not (math.isfinite(gv) and gv > 0):
            return [f"{module}.weight_global_scale: holds {[round(float(x), 6) for x in g[:4]]}, expected one finite "
                    "positive number (a negative one would negate every weight, zero or NaN none decodes)"]
        out = [p for p in [_too_large(name + " / weight_global_scale", hi / gv, FP4_MAX)] if p]
        a = tensors.get(INPUT_SCALE)
        if a is not None:
            av = a.float().reshape(-1)
            if not (av.numel() == 1 and math.isfinite(float(av[0])) and float(av[0]) > 0):
                out.append(f"{module}.{INPUT_SCALE}: holds {[round(float(x), 6) for x in av[:4]]}, expected one finite "
                           "positive number (engines divide by it; one NaN, Inf or 0 spoils a whole MoE layer)")
        return out
    if not (lo > 0 and math.isfinite(hi)):
        f = s.float()
        return [f"{name}: {int((~torch.isfinite(f) | (f <= 0)).sum())} non-finite or non-positive value(s)"]
    code_max = float(2 ** (num_bits - 1) if symmetric else 2 ** num_bits - 1)  # INT4: 8 or 15; INT8: 128
    out = [p for p in [_too_large(name, hi, FP8_MAX if kind == "fp8" else code_max)] if p]
    g_idx = tensors.get("weight_g_idx") if kind == "int4" else None
    if g_idx is not None and g_idx.numel() and s.dim() == 2:
        glo, ghi = _range(g_idx)
        if glo < 0 or ghi >= s.shape[1]:
            out.append(f"{module}.weight_g_idx: values outside [0, {s.shape[1]})")
    return out


def fp8_nan_codes(q: torch.Tensor) -> int:
    """How many float8_e4m3fn codes of `q` are NaN (0x7F / 0xFF). Checked as a passed-through FP8 weight is
    copied (read then anyway), not before: the one payload check that needs the whole weight."""
    return int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
