"""`quantkit plan MODEL --recipe DECODE --pair PREFILL`: the two pools of a prefill/decode pair (convert --pair).

Each pool serves its own checkpoint with the same FP8 KV cache (one set of scales: a page written by the
prefill pool is read by the decode pool as it is), so the pair's figures are two `plan` reports side by side
with the KV forced to float8_e4m3: checkpoint bytes and weight bytes per GPU per pool, KV bytes per token
(identical in both: it is the page format shipped between them), resident tokens and concurrency per pool.
Plus, per pool, what its routed-expert GEMMs compute in on Hopper: `fp8` (FP8 weights, or W4AFP8: INT4
weights with FP8 activations) runs on FP8 tensor cores (dense peak 2x BF16 on H100/H200), `bf16` (W4A16) on
BF16 ones; and the bytes decode reads per token for the experts' weights (bandwidth-bound decode)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..arch.layout import targets_experts
from ..match.recipe import Recipe, check_prefill_recipe, load_recipe

__all__ = ["plan_pair", "expert_math", "prefill_recipe"]

FP8_PEAK_VS_BF16 = 2.0  # H100/H200 SXM dense tensor-core peak, FP8 over BF16 (989 vs 1979 TFLOPS)


def expert_math(recipe: Recipe | None) -> str:
    """What a recipe's routed-expert GEMMs compute in: fp8 (FP8 weights or W4AFP8), bf16 (W4A16, or none)."""
    for g in (recipe.groups if recipe else ()):
        if any(targets_experts(t) for t in g.targets):
            s = g.scheme
            return "fp8" if (s.type == "float" and s.num_bits == 8) or getattr(s, "activations", None) == "fp8" else "bf16"
    return "bf16"


def _pool(rep, recipe: Recipe) -> dict[str, Any]:
    j = rep.to_json()
    routed = j["bytes_by_role"].get("routed_experts") if isinstance(j.get("bytes_by_role"), dict) else None
    math = expert_math(recipe)
    return {"recipe": recipe.name, "checkpoint_bytes": j["checkpoint_bytes"]["recipe"],
            "routed_expert_bytes": (routed or {}).get("recipe") if isinstance(routed, dict) else None,
            "weight_bytes_per_gpu": j["per_gpu"]["weight_bytes"], "kv_tokens": j["kv_tokens"].get("float8_e4m3"),
            "max_concurrency": j["max_concurrency"].get("float8_e4m3"), "expert_math": math,
            "expert_peak_vs_bf16": FP8_PEAK_VS_BF16 if math == "fp8" else 1.0}


def prefill_recipe(prefill: str | Recipe) -> Recipe:
    """The pair's prefill recipe, loaded and held to the rule `convert --pair` holds it to
    (match.recipe.check_prefill_recipe: an FP8 weight group; RecipeError otherwise)."""
    return check_prefill_recipe(prefill if isinstance(prefill, Recipe) else load_recipe(prefill))


def plan_pair(target, decode: str | Recipe, prefill: str | Recipe, opts=None) -> dict[str, Any]:
    """Both pools' figures (module docstring), each pool served as `opts` says (a PlanOptions: gpus,
    gpu_memory_gib, tp, ...; None: its defaults), its KV in float8_e4m3; no calibration cost is predicted. A
    prefill recipe that `convert --pair` refuses is refused here too, for the same reason (prefill_recipe)."""
    from . import PlanOptions, plan

    opts = replace(opts or PlanOptions(), kv_dtype="float8_e4m3", calibration=None)
    rp = prefill_recipe(prefill)
    rd = decode if isinstance(decode, Recipe) else load_recipe(decode)
    dec = plan(target, rd, opts)
    pre = plan(target, rp, opts)
    kv = dec.to_json()["kv_bytes_per_token"].get("float8_e4m3")
    return {"kv_dtype": "float8_e4m3", "kv_bytes_per_token": kv, "source_bytes": dec.checkpoint_bytes["source"],
            "decode": _pool(dec, rd), "prefill": _pool(pre, rp)}
