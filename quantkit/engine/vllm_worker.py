"""Run a checkpoint in vLLM and measure it: the worker of `quantkit verify --engine vllm --run`.

    ENGINE_PYTHON quantkit/engine/vllm_worker.py REQUEST.json RESULT.json

Runs under the Python of the environment vLLM is installed in (vLLM pins its own torch, so usually not
quantkit's). It imports the standard library and vLLM only, plus quantkit's vLLM plugin
(quantkit/engine/vllm_plugin.py, which itself imports only vLLM) when the request asks for it; nothing of
quantkit's heavy code. Token ids in, numbers out, as JSON files.

The request (written by quantkit/verify/vllm_run.py):
  model            the checkpoint directory
  kv_cache_dtype   "auto" (what `vllm serve` does: a declared kv_cache_scheme turns it into fp8) or explicit
  plugin           import quantkit.engine.vllm_plugin and call register() (MLA KV scales)
  quantkit_root    the directory holding the `quantkit` package, for the plugin
  samples          [[token id]]: prompt_logprobs of every token after the first (perplexity, top-1)
  forced           [[token id]]: prompt + the reference's greedy continuation, scored teacher-forced
  prompt_lens      the prompt length of each `forced` sequence
  gen_tokens       greedy tokens generated free-running from each prompt
  max_model_len, engine_args (extra keyword arguments of vllm.LLM)

The result: status "ok" | "cannot_run" | "error"; on "cannot_run" `stage` (load, run) and `reason` (vLLM's
own message, one line) - quantkit names the scheme; `kv_scales` {attention layer: {k, v, kv_cache_dtype,
class}} read from the layers after vLLM's post-load processing (what the kernels are given, not the file's
values); per-sample summed NLL, target count and top-1 ids; teacher-forced top-1 ids; generated ids;
vllm version, platform, CPU features, seconds. Exit code 0 whenever RESULT.json was written.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# run as a script, this file's folder comes first on sys.path, and it holds quantkit's vllm.py: drop it so
# that `import vllm` is the engine's
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _cpu_features() -> dict:
    feats = {}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        flags = set()
        for line in info.splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        vendor = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("vendor_id")), None)
        feats = {"vendor": vendor, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
                 "avx512_bf16": "avx512_bf16" in flags, "amx_tile": "amx_tile" in flags}
    except OSError:
        pass
    return feats


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:600]


class _KVReadBack:
    """Records the KV-cache scales every attention layer holds once vLLM's post-load step has run
    (base_loader's process_weights_after_loading: each module's quant method copies k_scale into
    _k_scale, or forces 1.0 when the cache is not quantized). Observation only: the original runs unchanged."""

    def __init__(self):
        self.scales: dict[str, dict] = {}

    def install(self) -> None:
        from vllm.model_executor.model_loader import base_loader

        original = base_loader.process_weights_after_loading

        def wrapped(model, model_config, target_device):
            out = original(model, model_config, target_device)
            try:
                self.scales = read_kv_scales(model)
            except Exception as e:  # never let the observer break the engine
                self.scales = {"error": _one_line(e)}
            return out

        base_loader.process_weights_after_loading = wrapped


def read_kv_scales(model) -> dict:
    out = {}
    for name, m in model.named_modules():
        if not (hasattr(m, "_k_scale") and hasattr(m, "_v_scale")) or not hasattr(m, "kv_cache_dtype"):
            continue
        k, v = m._k_scale, m._v_scale
        out[name] = {"k": [float(x) for x in k.detach().float().reshape(-1).tolist()],
                     "v": [float(x) for x in v.detach().float().reshape(-1).tolist()],
                     "kv_cache_dtype": str(m.kv_cache_dtype), "class": type(m).__name__}
    return out


def _top1(entry) -> int | None:
    best = None
    for tok, lp in entry.items():
        if getattr(lp, "rank", None) == 1:
            return int(tok)
        if best is None or lp.logprob > best[1]:
            best = (int(tok), lp.logprob)
    return best[0] if best else None


def _register_plugin(req: dict, res: dict) -> bool:
    """Registers quantkit's vLLM plugin when the request asks for it. False (the stage, reason and traceback in
    `res`) when it cannot be."""
    if not req.get("plugin"):
        return True
    try:
        sys.path.insert(0, req["quantkit_root"])
        from quantkit.engine.vllm_plugin import register

        register()
        res["plugin"] = "quantkit.engine.vllm_plugin"
    except Exception as e:
        res.update(stage="plugin", reason=_one_line(e), traceback=traceback.format_exc()[-4000:])
        return False
    return True


def _engine_args(req: dict) -> dict:
    """vllm.LLM's keyword arguments: the checkpoint as `vllm serve` loads it, small and eager, then the request's
    own."""
    args = dict(model=req["model"], skip_tokenizer_init=True, dtype=req.get("dtype", "bfloat16"),
                kv_cache_dtype=req.get("kv_cache_dtype", "auto"), max_model_len=int(req["max_model_len"]),
                enforce_eager=True, max_num_seqs=int(req.get("max_num_seqs", 8)), seed=0,
                gpu_memory_utilization=float(req.get("gpu_memory_utilization", 0.1)),
                kv_cache_memory_bytes=int(req.get("kv_cache_memory_bytes", 256 << 20)))
    args.update(req.get("engine_args") or {})
    return args


def _score(llm, req: dict, res: dict) -> None:
    """Into `res`: per-sample summed NLL, target count and top-1 ids (prompt_logprobs), the top-1 ids of the
    forced sequences after their prompts, and the greedy tokens generated from each prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    score = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0, detokenize=False)
    samples = [[int(t) for t in s] for s in req.get("samples") or []]
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in samples], score, use_tqdm=False)
    per = []
    for ids, o in zip(samples, outs):
        plp = o.prompt_logprobs or []
        nll, top1 = 0.0, []
        for i in range(1, len(ids)):
            entry = plp[i] if i < len(plp) else None
            if not entry:
                raise RuntimeError(f"vLLM returned no prompt logprob at position {i}")
            nll -= float(entry[ids[i]].logprob)
            top1.append(_top1(entry))
        per.append({"nll": nll, "targets": len(ids) - 1, "top1": top1})
    res["samples"] = per

    forced = [[int(t) for t in s] for s in req.get("forced") or []]
    lens = [int(n) for n in req.get("prompt_lens") or []]
    if forced:
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in forced], score, use_tqdm=False)
        res["forced_top1"] = [[_top1(o.prompt_logprobs[i]) for i in range(p, len(s))]
                              for s, p, o in zip(forced, lens, outs)]
        n = int(req.get("gen_tokens") or 0)
        if n > 0:
            greedy = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                                    detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=s[:p]) for s, p in zip(forced, lens)], greedy,
                                use_tqdm=False)
            res["generated"] = [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str]) -> int:
    req_path, res_path = argv[1], argv[2]
    with open(req_path) as f:
        req = json.load(f)
    res: dict = {"status": "error", "stage": "import", "cpu": _cpu_features(), "seconds": {}}

    def done(**kw) -> int:
        res.update(kw)
        tmp = res_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, res_path)
        return 0

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the model is reachable here
    os.environ.setdefault("TQDM_DISABLE", "1")
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams  # noqa: F401 (what _score uses, imported here to fail at "import")
        from vllm.inputs import TokensPrompt  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as e:
        return done(reason=_one_line(e), traceback=traceback.format_exc()[-4000:])
    res["vllm_version"] = getattr(vllm, "__version__", None)
    try:
        res["platform"] = type(current_platform).__name__
    except Exception as e:
        res["platform"] = f"unknown ({_one_line(e)})"
    if not _register_plugin(req, res):
        return done()
    kv = _KVReadBack()
    try:
        kv.install()
    except Exception as e:
        res["kv_scales_note"] = f"post-load observer not installed: {_one_line(e)}"

    res["stage"] = "load"
    t1 = time.perf_counter()
    res["seconds"]["import"] = round(t1 - t0, 1)
    args = _engine_args(req)
    res["engine_args"] = {k: v for k, v in args.items() if k != "model"}
    try:
        llm = LLM(**args)
    except Exception as e:
        return done(status="cannot_run", reason=_one_line(e), kv_scales=kv.scales,
                    traceback=traceback.format_exc()[-4000:])
    t2 = time.perf_counter()
    res["seconds"]["load"] = round(t2 - t1, 1)
    try:
        res["kv_scales"] = llm.apply_model(read_kv_scales)[0]
    except Exception as e:
        res["kv_scales"] = kv.scales
        res["kv_scales_note"] = f"read through the post-load observer ({_one_line(e)})"

    res["stage"] = "run"
    try:
        _score(llm, req, res)
    except Exception as e:
        return done(status="cannot_run", reason=_one_line(e), traceback=traceback.format_exc()[-4000:])
    res["seconds"]["run"] = round(time.perf_counter() - t2, 1)
    return done(status="ok", stage="done")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
