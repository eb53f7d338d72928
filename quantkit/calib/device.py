"""Where a calibrated pass computes, and how much of the device's memory each decoder layer needs.

`resolve_device(spec)`: "cpu", "cuda", "cuda:N" or "auto" (quantkit/options.py checks the spelling; "auto" is
the first CUDA device torch sees, else the CPU) -> a torch.device, or a DeviceError saying why not (torch
built without CUDA, no GPU visible, N out of range). `compute_dtype(device, spec)`: what the layers compute in
(`--compute-dtype`): "auto" is float32 on the CPU (what quantkit always did, bit for bit) and bfloat16 on a
GPU (the checkpoints' own dtype); "float32" or "bfloat16" anywhere (bfloat16 on a CPU with bfloat16
instructions, AVX512_BF16 or AMX, runs large GEMMs ~2x faster, which speeds up forward-bound passes such as
KV scales; GPTQ on the CPU was measured slower in bfloat16: docs/calibration.md). Routers are kept in
float32 as `from_pretrained` keeps them; statistics and GPTQ solves are float32 or wider whatever the choice.

`MemoryPlan`: before any layer is read, the executor estimates for every decoder layer the peak bytes it
will hold on the device (its weights in the compute dtype, the forward's temporaries, the pass's
statistics and solves, and the activations when they live there) and checks them against the free memory.
On a GPU the calibration activations (two copies: a layer's inputs and outputs) stay on the device when the
largest layer still fits beside them, and in host memory (RAM, or the memory-mapped file above the
activation budget) when not; a layer that does not fit even without them is refused before any work, with
the layer, the bytes it needs and the bytes available (`DeviceMemoryError`). On the CPU nothing is refused
(the host memory bound is docs/calibration.md's); the estimate is reported all the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .. import options
from ..errors import DeviceError, DeviceMemoryError


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """The device a calibration runs on; `spec` None is the shared default (options.DEVICE)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    name = options.parse_device(options.DEVICE if spec is None else spec)
    if name == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"device {name!r} asked for, but {why} (torch {torch.__version__})",
                          hint="use --device cpu (or auto: a GPU when there is one, else the CPU)")
    index = torch.cuda.current_device() if name == "cuda" else int(name.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r} asked for, but torch sees {count} CUDA device(s) (cuda:0 .. "
                          f"cuda:{count - 1})")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Placement:
    """Where a calibrated pass computes (calib/spool.py run_calibrated), as LayerExecutor takes it: `device`
    (cpu, cuda, cuda:N, auto; None: options.DEVICE), `dtype` the layers compute in (a torch dtype, auto,
    float32, bfloat16; None: the device's compute dtype), `available_bytes` the device memory the plan may use
    (None: what the GPU reports free; the CPU is not checked)."""

    device: str | torch.device | None = None
    dtype: torch.dtype | str | None = None
    available_bytes: int | None = None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compute_dtype(device: torch.device, spec: str | torch.dtype | None = None) -> torch.dtype:
    """What the layers compute in on `device`: `spec` a torch dtype (as it is), or one of
    options.COMPUTE_DTYPE_CHOICES (None: options.COMPUTE_DTYPE); "auto" is float32 on the CPU, bfloat16 on a GPU."""
    if isinstance(spec, torch.dtype):
        return spec
    s = options.parse_compute_dtype(options.COMPUTE_DTYPE if spec is None else spec)
    if s == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[s]


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ...: how plans, identities and manifests name a compute dtype."""
    return str(dtype).replace("torch.", "")


# torch's CPU bfloat16 matmuls go through oneDNN, which keeps a compiled primitive per GEMM shape in two LRU
# caches of 1024 entries (oneDNN's own, ONEDNN_PRIMITIVE_CACHE_CAPACITY, and torch's ideep layer's,
# LRU_CACHE_CAPACITY). The routed experts' row counts differ per expert and per layer, so in a bfloat16 pass on
# the CPU those caches grew the process by ~30-60 MB per decoder layer (bench/HISTORY.md). 128 entries hold a
# layer's expert shapes on the bench models (AWQ's candidates reuse them: at 16 its search ran ~15% slower).
ONEDNN_CACHE_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_ENTRIES = 128


def bound_primitive_cache(device: torch.device, dtype: torch.dtype, environ=os.environ) -> None:
    """Before a CPU pass in a dtype other than float32: cap both caches (ONEDNN_CACHE_ENVS, each read once, at
    its first use in the process) to ONEDNN_CACHE_ENTRIES, each unless the user set it. Nothing on a GPU or in
    float32 (float32 GEMMs do not go through oneDNN)."""
    if device.type == "cpu" and dtype != torch.float32:
        for name in ONEDNN_CACHE_ENVS:
            environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def available_bytes(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (what the driver reports, other processes' use excluded); None on the CPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def peak_bytes(device: torch.device) -> int | None:
    """The most bytes torch's allocator held on a CUDA device since the plan was made; None on the CPU."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


# statistics components (calib.layer.statistics_bytes) alive only during a forward call, and only during a solve
FORWARD_PHASE = ("gram", "input_amax")
SOLVE_PHASE = ("solve", "dense_solve")


@dataclass(frozen=True)
class LayerMemory:
    """Estimated peak bytes of one decoder layer on the device, by what holds them."""

    layer: int
    weights: int  # the layer's parameters and buffers in the compute dtype
    forward: int  # one forward call's temporaries (batch of tokens, attention scores, MoE blocks, mask)
    statistics: dict[str, int] = field(default_factory=dict)  # the pass's: Hessians, samples, solves, searches
    activations: int = 0  # the two activation copies, when they live on the device

    @property
    def without_activations(self) -> int:
        """The weights and what the pass holds throughout (Hessians, samples, ...), plus the larger of its two
        phases, which never overlap: a forward call with its statistics' gathers (FORWARD_PHASE), or a solve
        (SOLVE_PHASE: one solve at a time, experts' or a dense Linear's)."""
        st = self.statistics
        held = sum(v for k, v in st.items() if k not in FORWARD_PHASE and k not in SOLVE_PHASE)
        forward = self.forward + sum(st.get(k, 0) for k in FORWARD_PHASE)
        return self.weights + held + max(forward, max((st.get(k, 0) for k in SOLVE_PHASE), default=0))

    @property
    def total(self) -> int:
        return self.without_activations + self.activations

    def to_json(self) -> dict:
        return {"layer": self.layer, "weights": self.weights, "forward": self.forward,
                "statistics": dict(self.statistics), "activations": self.activations, "total": self.total}


@dataclass
class MemoryPlan:
    """Every layer's estimate, where the activations live, and what was available when it was made."""

    device: str
    dtype: str
    available_bytes: int | None  # free device memory (None: the CPU, not checked)
    activation_bytes: int  # one copy of the calibration activations (samples x tokens x hidden)
    activations: str  # "device" | "host"
    layers: list[LayerMemory]
    measured_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated after the pass (CUDA only)

    @property
    def peak(self) -> LayerMemory:
        return max(self.layers, key=lambda m: m.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total if self.layers else 0

    def summary(self) -> str:
        """One line for the progress log."""
        if not self.layers:
            return f"calibrating on {self.device} ({self.dtype})"
        p = self.peak
        avail = "" if self.available_bytes is None else f" of {_gib(self.available_bytes)} free"
        return (f"calibrating on {self.device} ({self.dtype}): estimated peak {_gib(p.total)}{avail} per layer "
                f"(layer {p.layer}: weights {_gib(p.weights)}, statistics {_gib(sum(p.statistics.values()))}), "
                f"activations {_gib(self.activation_bytes)} x 2 in {self.activations} memory")

    def to_json(self) -> dict:
        p = self.peak if self.layers else None
        return {"device": self.device, "dtype": self.dtype, "available_bytes": self.available_bytes,
                "estimated_peak_bytes": self.peak_bytes, "peak_layer": None if p is None else p.layer,
                "activation_bytes": self.activation_bytes, "activations": self.activations,
                "measured_peak_bytes": self.measured_peak_bytes, "layers": [m.to_json() for m in self.layers]}


def make_plan(device: torch.device, dtype: torch.dtype, layers: list[LayerMemory], activation_bytes: int,
              available: int | None) -> MemoryPlan:
    """Place the activations and check every layer against `available` (None: nothing to check).

    The activations (two copies) go on the device when every layer fits beside them; otherwise to host
    memory. A layer that does not fit without them raises DeviceMemoryError naming it, before any work."""
    on_device = device.type != "cpu"
    if available is not None:
        worst = max(layers, key=lambda m: m.without_activations, default=None)
        if worst is not None and worst.without_activations > available:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in
                              [("weights", worst.weights), ("forward", worst.forward), *worst.statistics.items()]
                              if v)
            raise DeviceMemoryError(
                f"decoder layer {worst.layer} needs {worst.without_activations} bytes "
                f"({_gib(worst.without_activations)}: {parts}) on {device}, but {available} bytes "
                f"({_gib(available)}) are available")
        if worst is not None and worst.without_activations + 2 * activation_bytes > available:
            on_device = False
    if on_device:
        layers = [LayerMemory(m.layer, m.weights, m.forward, m.statistics, 2 * activation_bytes) for m in layers]
    return MemoryPlan(str(device), dtype_name(dtype), available, activation_bytes,
                      "device" if on_device else "host", layers)
