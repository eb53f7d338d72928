"""The compressed-tensors vocabulary, named once: the `format` of a config group and the tensor suffixes a
module is stored under (docs/format.md). Every module outside pack/ spells these through the two enums
below; the members are `str`s (StrEnum), so they format, compare, hash and serialize as their values.

    Format        what one module of the group stores
    PACKED        INT4 (or INT8) `weight_packed` int32 words, `weight_scale`, `weight_shape`
                  [, `weight_zero_point`, `weight_g_idx`]                                  (pack/int4.py)
    NVFP4         `weight_packed` uint8 E2M1 pairs, `weight_scale` e4m3 per 16, `weight_global_scale`
                  [, `input_global_scale` for W4A4]                                       (pack/fp4.py)
    MXFP4         `weight_packed` uint8 E2M1 pairs, `weight_scale` E8M0 per 32
    FLOAT         `weight` float8_e4m3fn, `weight_scale` float32 [, `input_scale`]
    NAIVE         as FLOAT (compressed-tensors' uncompressed spelling; read, never written)

Block-FP8 releases (quant_method "fp8") name their scale `weight_scale_inv` (`Tensor.RELEASE_SCALE`).
"""

from __future__ import annotations

from enum import StrEnum


class Format(StrEnum):
    """compressed-tensors' `format` of a config group (or of the whole quantization_config)."""

    PACKED = "pack-quantized"
    NVFP4 = "nvfp4-pack-quantized"
    MXFP4 = "mxfp4-pack-quantized"
    FLOAT = "float-quantized"
    NAIVE = "naive-quantized"

    @property
    def fp4(self) -> str | None:
        """"nvfp4" | "mxfp4" for the FP4 formats, else None."""
        return {Format.NVFP4: "nvfp4", Format.MXFP4: "mxfp4"}.get(self)


FP4_FORMATS = (Format.NVFP4, Format.MXFP4)
FLOAT_FORMATS = (Format.FLOAT, Format.NAIVE)
# the formats whose weights are `weight_packed`, and the encoding (pack/checks.py kind) each names
PACKED_FORMATS = {Format.PACKED: "int4", Format.NVFP4: "nvfp4", Format.MXFP4: "mxfp4"}


class Tensor(StrEnum):
    """The suffix of a stored tensor after its module name: `<module>.<suffix>`."""

    WEIGHT = "weight"
    PACKED = "weight_packed"
    SCALE = "weight_scale"
    SHAPE = "weight_shape"
    ZERO_POINT = "weight_zero_point"
    G_IDX = "weight_g_idx"
    GLOBAL_SCALE = "weight_global_scale"
    INPUT_SCALE = "input_scale"  # FP8 static activation scale
    INPUT_ZERO_POINT = "input_zero_point"
    INPUT_GLOBAL_SCALE = "input_global_scale"  # NVFP4 W4A4: the static global scale of the FP4 input
    RELEASE_SCALE = "weight_scale_inv"  # block-FP8 releases: a multiplier despite its name

    def of(self, module: str) -> str:
        """The full tensor name `<module>.<suffix>`."""
        return f"{module}.{self.value}"

    @property
    def dotted(self) -> str:
        """`.<suffix>`: what a full tensor name of this kind ends with."""
        return "." + self.value
