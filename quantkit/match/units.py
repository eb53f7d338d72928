"""Units of work: what `convert` does to a tensor or a batch of weights, one class per kind.

    CopyUnit        a tensor the recipe does not touch, copied unchanged
    RTNUnit         same-shape weights of one layer quantized to INT4/INT8 pack-quantized, round-to-nearest
    FP8Unit         same-shape weights quantized to FP8 float-quantized
    FP4Unit         same-shape weights quantized to NVFP4 / MXFP4 (RTN); an NVFP4 gate/up pair shares
                    one global scale (`QuantItem.partner`: vLLM fuses the pair into w13 with one)
    CalibratedUnit  weights the calibrated pass (GPTQ/AWQ) already quantized: written from its spool
    PassUnit        one module the source already stores quantized, written unchanged
    DecodeUnit      one module the source stores quantized in a layout no engine can run, written as its
                    BF16 values (block-FP8 with a partial block along K)

Every unit knows the tensors it writes (`outputs`, from pack/layout.py); convert/run.py has one handler
per kind. Units are frozen and picklable: a shard's plan travels to a worker process as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from ..pack.layout import TensorSpec, module_tensors
from ..quant.fp8 import FP8Layout
from .recipe import Scheme, WeightGroup


@dataclass(frozen=True)
class SourceRef:
    """Where a 2-D weight comes from: a whole tensor, or rows r0:r1 of expert e of a fused 3-D tensor.
    An FP8 source weight also names its scale tensor and layout: it is dequantized to BF16 on read."""

    tensor: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    scale: str | None = None
    layout: FP8Layout | None = None
    scale_fmt: str | None = None
    encoding: str | None = None  # the source encoding when not dense ("fp8-block" | "fp8" | "nvfp4" | "mxfp4")
    stored: object | None = None  # FP4 sources: the read.sources.StoredWeight decoded on read


@dataclass(frozen=True)
class QuantItem:
    module: str  # output module name, e.g. model.layers.3.mlp.experts.7.down_proj
    source: SourceRef
    shape: tuple[int, int]  # [out, in]
    partner: QuantItem | None = None  # NVFP4: the other half of a gate/up pair (one global scale for both)


@dataclass(frozen=True)
class CopyUnit:
    tensor: str  # source tensor name

    def outputs(self, info: Callable) -> list[TensorSpec]:
        i = info(self.tensor)
        return [(self.tensor, i.dtype, i.shape)]


@dataclass(frozen=True)
class _BatchUnit:
    """Same-shape weights of one layer and projection, one scheme (all experts of a layer that fit)."""

    items: tuple[QuantItem, ...]
    group: WeightGroup
    scheme: Scheme  # resolved for these weights' in_features (fallbacks applied)
    src_dtype: torch.dtype  # the source's float dtype (FP8 sources: bfloat16, dequantized on read)

    def outputs(self, info: Callable = None) -> list[TensorSpec]:
        return [spec for it in self.items for spec in module_tensors(it.module, it.shape, self.scheme, self.src_dtype)]


@dataclass(frozen=True)
class RTNUnit(_BatchUnit):
    pass


@dataclass(frozen=True)
class FP8Unit(_BatchUnit):
    @property
    def layout(self) -> FP8Layout:
        return FP8Layout(self.scheme.strategy, self.scheme.block_structure)


@dataclass(frozen=True)
class FP4Unit(_BatchUnit):
    pass


@dataclass(frozen=True)
class CalibratedUnit(_BatchUnit):
    pass


@dataclass(frozen=True)
class PassUnit:
    """One stored-quantized module written unchanged: (output name, source tensor, output dtype, output
    shape) per tensor, the module's scheme label, its compressed-tensors config (JSON text, hashable) and
    why it is passed through."""

    item: QuantItem
    group: WeightGroup | None
    renames: tuple[tuple[str, str, torch.dtype, tuple[int, ...]], ...]
    label: str
    config: str
    reason: str

    @property
    def items(self) -> tuple[QuantItem, ...]:
        return (self.item,)

    def outputs(self, info: Callable = None) -> list[TensorSpec]:
        return [(name, dtype, shape) for name, _, dtype, shape in self.renames]


@dataclass(frozen=True)
class DecodeUnit:
    item: QuantItem
    reason: str
    label: str  # the source's scheme label, e.g. fp8-block128x128

    @property
    def items(self) -> tuple[QuantItem, ...]:
        return (self.item,)

    def outputs(self, info: Callable = None) -> list[TensorSpec]:
        return [(f"{self.item.module}.weight", torch.bfloat16, self.item.shape)]


Unit = Union[CopyUnit, RTNUnit, FP8Unit, FP4Unit, CalibratedUnit, PassUnit, DecodeUnit]
