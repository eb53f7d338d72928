"""Options and their defaults, shared by the command line and the library: each default is written once,
here, and both `cli.py` and the library's config dataclasses (convert.ConvertOptions, match.recipe.
CalibrationSpec, calibrate, verify) take it from here. Deliberately light: importing it costs no torch, so
the CLI can build its options before any heavy import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from .errors import DeviceError, ThresholdError

# convert
RECIPE = "int4-experts-rtn"
WORKERS = 1
MAX_SHARD_BYTES = 5 * 10**9  # the hub convention, "5GB"
MAX_SHARD_SIZE = "5GB"  # MAX_SHARD_BYTES as the CLI spells it
BATCH_BYTES = 256 << 20  # source weight bytes quantized in one batch at most
# recipes: the INT4 group size of a scheme that names none (strategy group)
INT4_GROUP_SIZE = 32
# calibration data (GPTQ/AWQ and KV scales): a recipe's `calibration` section overrides these
NUM_SAMPLES = 128
SEQ_LEN = 512
MAX_NUM_SAMPLES = 1 << 20  # bounds on what a recipe or option may ask for (real runs use hundreds to thousands)
MAX_SEQ_LEN = 1 << 20
KV_STRATEGY = "tensor"
# where calibration computes (`calibrate`, the calibrated pass of `convert`): "auto" is the first CUDA device
# torch sees, else the CPU (calib/device.py resolves it; on the CPU nothing changes: float32, host memory)
DEVICE = "auto"
DEVICE_CHOICES = "cpu|cuda|cuda:N|auto"
# what the layers compute in during calibration: "auto" is float32 on the CPU (bit for bit what quantkit always
# did) and bfloat16 on a GPU; statistics, GPTQ solves and routers stay float32 (or wider) whatever is chosen
COMPUTE_DTYPE = "auto"
COMPUTE_DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# verify's model-level metrics
VERIFY_NUM_SAMPLES = 8
VERIFY_SEQ_LEN = 128
VERIFY_GENERATION_TOKENS = 32
VERIFY_DEVICE = "cpu"  # where verify's numerics run: cpu | cuda
VERIFY_KERNELS = "torch"  # torch, or triton to also check the runtime's INT4 GEMM
VERIFY_TP = 1  # the tensor parallelism verify's engine rules are checked at
# plan: the serving setup it sizes for, and where the calibration cost is predicted
PLAN_GPU_MEMORY_GIB = 80
PLAN_GPUS = 8
PLAN_CONTEXT_LEN = 131072
PLAN_COST_DEVICE = "cuda"
# demo
DEMO_ARCH = "qwen3_moe"


def parse_device(spec: object) -> str:
    """The canonical spelling of a calibration device: "cpu", "cuda", "cuda:N" or "auto" (case and blanks
    around it ignored); anything else is a DeviceError. Only the spelling is checked here: whether that
    device exists is decided when calibration starts (calib/device.py)."""
    s = str(spec).strip().lower() if spec is not None else ""
    if s in ("cpu", "cuda", "auto"):
        return s
    head, sep, num = s.partition(":")
    if head == "cuda" and sep and num.isdigit() and num.isascii():
        return f"cuda:{int(num)}"
    raise DeviceError(f"unknown device {spec!r}: expected {DEVICE_CHOICES}")


def parse_compute_dtype(spec: object) -> str:
    """The canonical spelling of a calibration compute dtype (COMPUTE_DTYPE_CHOICES; "fp32" and "bf16" are
    accepted for float32 and bfloat16, case and blanks ignored); anything else is a DeviceError."""
    s = str(spec).strip().lower() if spec is not None else ""
    s = {"fp32": "float32", "bf16": "bfloat16"}.get(s, s)
    if s in COMPUTE_DTYPE_CHOICES:
        return s
    raise DeviceError(f"unknown compute dtype {spec!r}: expected {'|'.join(COMPUTE_DTYPE_CHOICES)}")


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits. The defaults pass a correct int4-experts-rtn (g32) conversion with margin and
    fail a single tensor with a wrong scale; `docs/verify.md` says why each value was chosen. The CLI
    exposes one flag per field (`--max-kl`, ...) and builds the object with `with_overrides`."""

    max_kl: float = field(default=0.05, metadata={"help": "maximum mean next-token KL(reference || quantized), nats"})
    min_top1: float = field(default=0.85, metadata={"help": "minimum top-1 next-token agreement, 0..1"})
    max_ppl_ratio: float = field(default=1.10, metadata={
        "help": "maximum perplexity(quantized) / perplexity(reference)"})
    min_sqnr_db: float = field(default=10.0, metadata={"help": "minimum weight SQNR of every quantized module, dB"})
    max_sqnr_drift_db: float = field(default=0.1, metadata={
        "help": "maximum |SQNR measured now - SQNR the manifest recorded at conversion|, dB"})
    min_generation_agreement: float = field(default=0.80, metadata={
        "help": "minimum fraction of greedy-generation steps where the quantized model picks the reference's token"})

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ThresholdError(f"threshold {f.name} must be a number, got {v!r}")
        for name in ("min_top1", "min_generation_agreement"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ThresholdError(f"threshold {name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("max_kl", "max_ppl_ratio", "max_sqnr_drift_db"):
            if getattr(self, name) < 0:
                raise ThresholdError(f"threshold {name} must be >= 0, got {getattr(self, name)}")

    def with_overrides(self, **overrides: float | None) -> "Thresholds":
        """A copy with the given fields replaced; None means "keep" (an unset CLI flag)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ThresholdError(f"unknown threshold(s) {unknown}; known: {sorted(known)}")
        return replace(self, **{k: float(v) for k, v in overrides.items() if v is not None})

    @classmethod
    def options(cls) -> list[tuple[str, float, str]]:
        """(field name, default, help) per threshold: what the CLI turns into flags (`--max-kl`, ...)."""
        return [(f.name, f.default, f.metadata["help"]) for f in fields(cls)]
