"""plan --pair: both pools of a prefill/decode pair, one FP8 KV cache; and the mission's GLM size figure."""

from __future__ import annotations

from quantkit.match.recipe import load_recipe
from quantkit.plan import PlanOptions, plan
from quantkit.plan.pair import expert_math, plan_pair

GIB = 1 << 30


def test_pair_pools_share_the_kv_format():
    p = plan_pair("glm-5", "int4-experts-rtn", "fp8-prefill", PlanOptions(gpus=8, gpu_memory_gib=141))
    fp8 = plan("glm-5", "int4-experts-rtn").to_json()["kv_bytes_per_token"]["float8_e4m3"]
    assert p["kv_bytes_per_token"] == fp8 == 78 * (576 + 128)  # latent + rope, plus the DSA indexer's K
    assert p["prefill"]["checkpoint_bytes"] > p["decode"]["checkpoint_bytes"]
    assert p["prefill"]["kv_tokens"] < p["decode"]["kv_tokens"]  # FP8 weights leave less room for KV
    assert (p["prefill"]["expert_math"], p["decode"]["expert_math"]) == ("fp8", "bf16")


def test_expert_math_of_recipes():
    assert expert_math(load_recipe("int4-experts-w4afp8")) == "fp8"
    assert expert_math(load_recipe("glm-w4afp8")) == "fp8"
    assert expert_math(load_recipe("int4-experts-rtn")) == "bf16"


def test_glm_size_figure():
    """The mission's 705 GB -> 421 GB is GLM-5 in GiB: the FP8 checkpoint (every decoder Linear FP8 128x128)
    is ~705 GiB and INT4 g32 experts with the rest BF16 ~421 GiB (docs/cost.md)."""
    fp8 = plan("glm-5", "fp8-prefill").checkpoint_bytes["recipe"] / GIB
    int4 = plan("glm-5", "int4-experts-rtn").checkpoint_bytes["recipe"] / GIB
    assert abs(fp8 - 705) < 3 and abs(int4 - 421) < 3, (fp8, int4)
