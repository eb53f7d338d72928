"""W4AFP8 (INT4 group-128 weights, dynamic per-token FP8 activations) as vLLM 0.33.0 serves it: the shape rules
of its MoE method, checked by `convert` before anything is written and by `verify --engine vllm`.

vLLM 0.33.0, model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/
compressed_tensors_moe_w4a8_fp8.py (`CompressedTensorsW4A8Fp8MoEMethod`):

    W1  group_size == 128, symmetric weights (asserted in __init__)
    W2  hidden_size % 256 == 0 and intermediate_size_per_partition % 256 == 0 (asserted in create_weights:
        "requirement for CUTLASS reorder_tensor"); the intermediate size is split over the tensor-parallel
        ranks (moe_intermediate_size / tp), not with --enable-expert-parallel (each rank holds whole experts)
    W3  the CUTLASS W4A8 MoE kernel takes bfloat16 activations only and an SM90 GPU (Hopper); no EPLB
    W4  vLLM rejects actorder "group" / "dynamic" for every compressed-tensors scheme (compressed_tensors.py)

Pure functions, no torch: the CLI imports this module on its fast path.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..arch.layout import expert_parts, expert_role, is_expert_proj
from ..errors import W4AFP8ShapeError

MULTIPLE = 256  # W2
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def working_tp(hidden: int, inter: int) -> list[int]:
    """The tensor-parallel sizes (powers of two up to 64) at which W2 holds."""
    if hidden % MULTIPLE:
        return []
    return [tp for tp in TP_CANDIDATES if inter % tp == 0 and (inter // tp) % MULTIPLE == 0]


def rule_problem(hidden: int, inter: int, tp: int) -> str | None:
    """Why W2 fails at `tp` (None when it holds)."""
    if hidden % MULTIPLE:
        return f"hidden_size {hidden} is not a multiple of {MULTIPLE}"
    if inter % tp or (inter // tp) % MULTIPLE:
        return (f"moe_intermediate_size / tp = {inter} / {tp} = {inter / tp:g} is not a multiple of {MULTIPLE}")
    return None


def describe(hidden: int, inter: int) -> str:
    """The --tp values that work, in words, for messages and notes."""
    tps = working_tp(hidden, inter)
    ep = "" if hidden % MULTIPLE or inter % MULTIPLE else "; any --tp with --enable-expert-parallel"
    return (f"--tp {', '.join(map(str, tps))}" if tps else f"no --tp value (the widths are not multiples of {MULTIPLE})") + ep


def expert_widths(modules: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[int, int, str] | None:
    """(hidden, intermediate, an example module) of the routed experts among (module, [N, K]) pairs; None
    when there are none. Widths that differ between experts give the first inconsistent pair's error."""
    found = None
    for module, shape in modules:
        if not is_expert_proj(module) or len(shape) != 2:
            continue
        n, k = shape
        # gate and up are [I, H]; down is [H, I]
        hidden, inter = (k, n) if expert_role(expert_parts(module)[2]) in ("gate", "up") else (n, k)
        if found is None or (hidden, inter) > found[:2]:  # the widest layer decides (all equal in practice)
            found = (hidden, inter, module)
    return found


def check_modules(modules: list[tuple[str, tuple[int, ...]]], tp: int | None) -> str | None:
    """Raise W4AFP8ShapeError when the W4AFP8 modules (module, [N, K]) break W2 at `tp` (None: tp 1), or
    when one of them is not a routed expert (vLLM 0.33.0 runs W4AFP8 Linears only for MoE experts on the
    path checked here). Returns a note naming the --tp values that work."""
    for module, _ in modules:
        if not is_expert_proj(module):
            raise W4AFP8ShapeError(f"{module}: W4AFP8 (activations: fp8) applies to routed experts only; vLLM "
                                   "0.33.0 serves it through its W4A8 MoE method (CompressedTensorsW4A8Fp8MoEMethod)",
                                   hint="target routed experts (mlp.experts.E.*) with the W4AFP8 group; use FP8 "
                                        "block or W4A16 INT4 for the other Linears")
    widths = expert_widths(modules)
    if widths is None:
        return None
    hidden, inter, example = widths
    why = rule_problem(hidden, inter, tp or 1)
    if why:
        raise W4AFP8ShapeError(
            f"W4AFP8 experts need hidden_size and moe_intermediate_size / tp to be multiples of {MULTIPLE} "
            f"(vLLM 0.33.0 CompressedTensorsW4A8Fp8MoEMethod, rule W2): {why} ({example}); works with: "
            f"{describe(hidden, inter)}")
    return (f"W4AFP8 experts (hidden {hidden}, moe_intermediate_size {inter}) load in vLLM 0.33.0 on Hopper (SM90, "
            f"bfloat16) with {describe(hidden, inter)} (rule W2)")
