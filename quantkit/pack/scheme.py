"""`Scheme`: how one weight is quantized, in compressed-tensors' QuantizationArgs terms, with every rule a scheme
obeys (types, strategies, group sizes, FP4's fixed groups, W4AFP8's one form, activations) checked when it is built.
Recipes (match/recipe.py) name schemes; sources' and outputs' config groups are read back into them
(`Scheme.parse_weights_config`); the format's layout and checks (pack/layout.py, pack/checks.py) take them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import options
from ..errors import RecipeError
from .config import W4AFP8_GROUP_SIZE, is_nvfp4_w4a4, scheme_label, weights_config
from .names import Format

STRATEGIES = ("group", "channel", "tensor", "block", "tensor_group")
FP4_GROUP_SIZES = {"tensor_group": 16, "group": 32}  # NVFP4: 16 + a global scale; MXFP4: 32, E8M0 scales
MAX_GROUP_SIZE = 1 << 20  # wider than any model's in_features (a larger group is a channel)


@dataclass(frozen=True)
class Scheme:
    """How one weight is quantized (compressed-tensors QuantizationArgs terms):

        type int,   num_bits 4, group | channel      INT4 pack-quantized (W4A16)
        type int,   num_bits 8, group | channel, symmetric   INT8 pack-quantized (W8A16), four values a word
        type float, num_bits 8, tensor | channel | block   FP8 float-quantized (W8A8, dynamic activations)
        type float, num_bits 4, tensor_group, group_size 16   NVFP4 (nvfp4-pack-quantized, W4A16)
        type float, num_bits 4, group, group_size 32          MXFP4 (mxfp4-pack-quantized, W4A16)
        type int,   num_bits 4, group 128, activations fp8    W4AFP8 (pack-quantized + dynamic FP8 activations)
        type float, num_bits 4, tensor_group, activations nvfp4   NVFP4 W4A4 (+ a calibrated input_global_scale)
    """

    num_bits: int = 4
    type: str = "int"
    symmetric: bool = True
    strategy: str = "group"
    group_size: int | None = None  # INT4 group: options.INT4_GROUP_SIZE when not given; FP4: fixed by the format
    block_structure: tuple[int, int] | None = None
    # Used when in_features % group_size != 0: "channel", or another group size (int), or None (error).
    fallback: str | int | None = None
    # INT4: "fp8" = dynamic per-token FP8 e4m3 input activations (W4AFP8, compressed-tensors' preset of that
    # name); W4AFP8 is INT4 group 128 symmetric, no fallback (vLLM's only form). NVFP4: "nvfp4" = NVFP4 input
    # activations (W4A4, compressed-tensors' NVFP4 preset): per-16 block scales computed at run time under a
    # static per-module `input_global_scale` that convert calibrates. None = weights only (W4A16).
    activations: str | None = None
    # FP4 only, how RTN picks each group's scale (quant/fp4.py): "amax" (compressed-tensors' minmax, bit
    # for bit), "mse" (fitted: the candidate scale with the least squared error), None: "mse" for NVFP4
    # modules the source stores INT4 (their grid is not E2M1's), "amax" otherwise
    scale_search: str | None = None

    def __post_init__(self):
        if not isinstance(self.symmetric, bool):
            raise RecipeError(f"scheme.symmetric must be true or false, got {str(self.symmetric)[:40]}")
        if not isinstance(self.num_bits, int) or isinstance(self.num_bits, bool):
            raise RecipeError(f"scheme.num_bits must be 4 or 8, got {str(self.num_bits)[:40]}")
        if self.type not in ("int", "float"):
            raise RecipeError(f"scheme.type must be 'int' or 'float', got {self.type!r}")
        if self.strategy not in STRATEGIES:
            raise RecipeError(f"scheme.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.type == "int":
            if self.num_bits not in (4, 8):
                raise RecipeError(f"integer schemes are INT4 or INT8 (num_bits 4 or 8, pack-quantized), got "
                                  f"{self.num_bits!r}")
            if self.num_bits == 8 and not self.symmetric:
                raise RecipeError("INT8 schemes are symmetric (no zero points)")
            if self.strategy == "group":
                if self.group_size is None:
                    object.__setattr__(self, "group_size", options.INT4_GROUP_SIZE)
                if (not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0
                        or self.group_size % 8 or self.group_size > MAX_GROUP_SIZE):
                    raise RecipeError(f"group_size must be a positive multiple of 8 up to {MAX_GROUP_SIZE}, got "
                                      f"{str(self.group_size)[:40]}")
            elif self.strategy == "channel":
                object.__setattr__(self, "group_size", None)
            else:
                raise RecipeError(f"integer schemes support strategy group or channel, got {self.strategy!r}")
        elif self.num_bits == 4:  # FP4: NVFP4 or MXFP4
            if not self.symmetric:
                raise RecipeError("FP4 schemes are symmetric")
            if self.strategy not in FP4_GROUP_SIZES:
                raise RecipeError(f"FP4 schemes use strategy tensor_group (NVFP4) or group (MXFP4), got {self.strategy!r}")
            want = FP4_GROUP_SIZES[self.strategy]
            if self.group_size not in (None, want):
                raise RecipeError(f"{self.fp4} has group_size {want}, got {self.group_size!r}")
            if self.fallback is not None:
                raise RecipeError("FP4 schemes take no fallback: in_features must be a multiple of the group size")
            object.__setattr__(self, "group_size", want)
            object.__setattr__(self, "block_structure", None)
        else:
            if self.num_bits != 8:
                raise RecipeError(f"float schemes are FP8 (num_bits 8) or FP4 (num_bits 4), got {self.num_bits}")
            if not self.symmetric:
                raise RecipeError("FP8 schemes are symmetric")
            if self.strategy == "block":
                bs = tuple(self.block_structure or (128, 128))
                if len(bs) != 2 or any(not isinstance(b, int) or b <= 0 for b in bs):
                    raise RecipeError(f"block_structure must be two positive ints, got {self.block_structure!r}")
                object.__setattr__(self, "block_structure", bs)
            elif self.strategy in ("channel", "tensor"):
                object.__setattr__(self, "block_structure", None)
            else:
                raise RecipeError(f"FP8 schemes support strategy tensor, channel or block, got {self.strategy!r}")
            object.__setattr__(self, "group_size", None)
        if self.activations == "nvfp4":
            if self.fp4 != "nvfp4":
                raise RecipeError("activations: nvfp4 (W4A4) needs an NVFP4 weight scheme (type float, num_bits 4, "
                                  "strategy tensor_group): vLLM runs FP4 activations only with NVFP4 weights")
        elif self.activations is not None:
            if self.activations != "fp8":
                raise RecipeError(f"scheme.activations must be 'fp8' (dynamic per-token FP8, W4AFP8), 'nvfp4' "
                                  f"(NVFP4 W4A4) or absent, got {self.activations!r}")
            if not (self.type == "int" and self.num_bits == 4 and self.strategy == "group" and self.symmetric
                    and self.group_size == W4AFP8_GROUP_SIZE and self.fallback is None):
                raise RecipeError(f"activations: fp8 (W4AFP8) needs INT4 strategy group, group_size "
                                  f"{W4AFP8_GROUP_SIZE}, symmetric, no fallback: the only form vLLM loads "
                                  f"(CompressedTensorsW4A8Fp8MoEMethod)")
        if self.scale_search is not None:
            int4 = self.type == "int" and self.num_bits == 4
            if self.scale_search not in ("amax", "mse") or not (self.fp4 or int4):
                raise RecipeError("scale_search is amax or mse, for FP4 and INT4 schemes (RTN), not "
                                  f"{self.type}{self.num_bits}"
                                  if self.scale_search in ("amax", "mse") else
                                  f"scale_search must be amax or mse, got {self.scale_search!r}")
        fb = self.fallback
        if fb is not None and fb != "channel" and not (isinstance(fb, int) and not isinstance(fb, bool) and
                                                       0 < fb <= MAX_GROUP_SIZE and fb % 8 == 0):
            raise RecipeError(f"scheme.fallback must be 'channel' or a group size, got {fb!r}")

    @property
    def fp4(self) -> str | None:
        """"nvfp4" or "mxfp4" for an FP4 scheme, else None."""
        if self.type != "float" or self.num_bits != 4:
            return None
        return "nvfp4" if self.strategy == "tensor_group" else "mxfp4"

    @property
    def w4a4(self) -> bool:
        """NVFP4 weights and NVFP4 input activations (each module carries a calibrated input_global_scale)."""
        return self.activations == "nvfp4"

    @classmethod
    def from_weights_config(cls, w: dict, acts: dict | None = None) -> "Scheme | None":
        """The scheme that compressed-tensors weight args (and input activations: NVFP4 W4A4 is recognised)
        describe, or None when quantkit has no such scheme (the args are then carried as they are)."""
        try:
            return cls.parse_weights_config(w, acts)
        except RecipeError:
            return None

    @classmethod
    def parse_weights_config(cls, w: dict, acts: dict | None = None) -> "Scheme":
        """`from_weights_config`, raising RecipeError with the rule the args break (num_bits, type,
        strategy, group_size, symmetric, block_structure): what convert says of a source's config group and
        verify of a written one. `acts`: the group's input_activations; NVFP4 W4A4 ones give activations
        "nvfp4" (other activation args leave the weights' scheme as it is)."""
        if not isinstance(w, dict):
            raise RecipeError(f"weights must be an object, got {type(w).__name__}")
        nb, sym = w.get("num_bits", 4), w.get("symmetric", True)
        if type(nb) is not int:
            raise RecipeError(f"num_bits must be an integer, got {str(nb)[:40]!r}")
        if sym is not None and type(sym) is not bool:
            raise RecipeError(f"symmetric must be true or false, got {str(sym)[:40]!r}")
        bs = w.get("block_structure")
        if bs is not None and not (isinstance(bs, list) and len(bs) == 2 and all(type(b) is int for b in bs)):
            raise RecipeError(f"block_structure must be two positive integers, got {str(bs)[:40]}")
        if type(w.get("group_size")) not in (int, type(None)):
            raise RecipeError(f"group_size must be an integer, got {str(w.get('group_size'))[:40]!r}")
        try:
            return cls(nb, w.get("type", "int"), sym is not False, w.get("strategy", "group"), w.get("group_size"),
                       tuple(bs) if bs else None, activations="nvfp4" if is_nvfp4_w4a4(w, acts) else None)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"not a scheme: {str(e)[:80]}") from None

    def for_in_features(self, k: int, fused_rows_ok: bool = True) -> "Scheme":
        """The scheme actually applied to a weight with `k` input features: INT4 group-size `fallback`s,
        and for FP8 block schemes the K % b1 rule (dynamic 1 x b1 activation groups in compressed-tensors
        and vLLM need K to be a multiple of the block width, so such a weight takes `fallback: channel`,
        per-channel FP8, or is an error). `fused_rows_ok` False (see `fused_rows_ok`): the module is part of
        a Linear engines fuse whose parts do not all fill whole blocks of rows, which takes the same
        fallback. convert, the calibrated pass and plan all go through here."""
        from ..errors import GroupSizeError

        if self.type == "float" and self.strategy == "block" and (k % self.block_structure[1] or not fused_rows_ok):
            if self.fallback == "channel":
                return Scheme(8, "float", True, "channel", None)
            if not k % self.block_structure[1]:  # K fits: the fused rows are what failed
                raise GroupSizeError(f"it is part of a Linear engines fuse (qkv_proj, gate_up_proj, "
                                     f"fused_qkv_a_proj) whose parts but the last need multiples of "
                                     f"{self.block_structure[0]} output rows for block FP8",
                                     hint="set `fallback: channel` in the recipe's FP8 scheme (per-channel FP8 for "
                                          "such modules), or leave them unquantized")
            raise GroupSizeError(f"in_features {k} is not a multiple of the FP8 block width {self.block_structure[1]}",
                                 hint="set `fallback: channel` in the recipe's FP8 scheme (per-channel FP8 for such "
                                      "modules), or leave them unquantized")
        if self.fp4 and k % self.group_size:
            raise GroupSizeError(f"in_features {k} is not a multiple of the {self.fp4} group size {self.group_size}",
                                 hint="leave such modules unquantized (ignore), or use an INT4/FP8 scheme for them")
        if self.type != "int" or self.strategy != "group" or k % self.group_size == 0:
            return self
        if self.fallback == "channel":
            return Scheme(self.num_bits, "int", self.symmetric, "channel", None)
        if isinstance(self.fallback, int) and k % self.fallback == 0:
            return Scheme(self.num_bits, "int", self.symmetric, "group", self.fallback)
        raise GroupSizeError(f"in_features {k} is not a multiple of group_size {self.group_size}"
                             + (f" nor of fallback {self.fallback}" if self.fallback else ""))

    def weights_config(self) -> dict[str, Any]:
        """compressed-tensors QuantizationArgs of this scheme (pack/config.py)."""
        return weights_config(self)

    @property
    def format(self) -> str:
        if self.fp4:
            return Format.NVFP4 if self.fp4 == "nvfp4" else Format.MXFP4
        return Format.PACKED if self.type == "int" else Format.FLOAT

    @property
    def label(self) -> str:
        """The manifest's name for this scheme, e.g. int4-g32-sym, fp8-block128x128 (pack/config.py)."""
        return scheme_label(self)
