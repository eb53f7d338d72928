"""`quantkit verify OUT.gguf --engine llama.cpp --run --reference SRC [--checkpoint QMODEL]`: run a GGUF written by
`quantkit export` in llama.cpp (llama-cpp-python) and measure it against transformers.

llama-cpp-python may live in another environment (`--engine-python`): quantkit starts that Python on
quantkit/engine/llamacpp_worker.py, which imports llama_cpp and nothing of quantkit, and exchanges JSON and .npy
files with it. Everything it returns is checked before use (types, shapes, finiteness, paths inside the exchange
folder): a worker that claims success over nothing fails.

The reference is transformers in float32 on SRC, or, with --checkpoint, on SRC with the checkpoint's dequantized
weights (the checkpoint the GGUF was exported from, as transformers runs it): then the table has both
KL(source || checkpoint) and KL(checkpoint || llama.cpp), the part llama.cpp's own arithmetic adds (8-bit
activations, its kernels' order of sums).

Exit codes as the vLLM run: 0 passed, 1 a check failed, 3 llama.cpp cannot run the GGUF here (one line: why).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import EngineError
from .common import Check, RunInputs, finite
from .compare import generation_check, greedy_continuations
from ..engine import worker
from ..engine.worker import locate_python
from ..options import Thresholds
from .options import EngineRun, VerifyOptions

WORKER = Path(__file__).parents[1] / "engine" / "llamacpp_worker.py"  # the worker beside the engine rules, in engine/
DEFAULT_TIMEOUT_S = 1800
MAX_LOGIT_BYTES = 2 << 30  # the engine's float32 logits kept at once (samples x positions x vocab)


def gguf_files(path: Path) -> list[Path]:
    """The GGUF file(s) of `path`: itself, or every split `stem-0000N-of-0000M.gguf` when `path` names the first."""
    path = Path(path)
    if not path.is_file():
        raise EngineError(f"{path} is not a file", hint="pass the .gguf written by quantkit export (the first "
                                                       "-00001-of-0000N.gguf file of a split one)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise EngineError(f"{path} is not a GGUF file (no GGUF magic)")
    return [path]


def reference_logprobs(ref_dir: Path, ckpt_dir: Path | None, samples: list[torch.Tensor], gen_tokens: int,
                       dev: torch.device, say) -> dict:
    """transformers (float32) on the reference: log-probabilities of every position, greedy continuations of up to
    MAX_PROMPTS prompts; with `ckpt_dir`, also the source alone (for KL(source || checkpoint))."""
    import torch.nn.functional as F

    from .numerics import load_dequantized, load_model

    def logprobs(model):
        with torch.no_grad():
            return [F.log_softmax(model(s.reshape(1, -1).to(dev)).logits.float()[0], -1).double().cpu()
                    for s in samples]

    out: dict = {}
    if ckpt_dir is not None:
        say("reference: the source in transformers (float32)")
        src = load_model(ref_dir, dev, torch.float32)
        out["source"] = logprobs(src)
        del src
        say("reference: the checkpoint's dequantized weights in transformers (float32)")
        model = load_dequantized(ref_dir, ckpt_dir, dev, torch.float32)
    else:
        say("reference: the source in transformers (float32)")
        model = load_model(ref_dir, dev, torch.float32)
    out["ref"] = logprobs(model)
    out["prompts"], out["continuations"] = greedy_continuations(model, samples, gen_tokens, dev)
    del model
    return out


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, nats."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def run_worker(python: str, request: dict, tmp: Path, timeout: int, say) -> dict:
    req, res = tmp / "request.json", tmp / "result.json"
    req.write_text(json.dumps(request))
    log = tmp / "engine.log"
    env = {**os.environ, "QUANTKIT_ENGINE_LOG": str(log)}
    env.pop("PYTHONPATH", None)
    say(f"engine: starting llama.cpp under {python}")
    return worker.run_worker(python, WORKER, req, res, log, env, timeout, "llama.cpp",
                             "is llama-cpp-python installed for that Python? try `PY -c 'import llama_cpp'`")


def _engine_logits(res: dict, tmp: Path, samples: list[torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """The worker's per-sample logits, checked: one file per sample inside `tmp`, float32 [L, vocab], finite."""
    per = res.get("samples")
    if not isinstance(per, list) or len(per) != len(samples):
        raise EngineError(f"llama.cpp returned {len(per) if isinstance(per, list) else 'no'} sample results for "
                          f"{len(samples)} samples")
    out = []
    for s, r in zip(samples, per):
        path = Path(r.get("logits", "")) if isinstance(r, dict) and isinstance(r.get("logits"), str) else None
        if path is None or path.resolve().parent != tmp.resolve() or not path.is_file():
            raise EngineError("llama.cpp's result names a logits file outside its exchange folder")
        try:
            a = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise EngineError(f"llama.cpp's logits file is unreadable: {str(e)[:120]}") from None
        if a.dtype != np.float32 or a.shape != (s.numel(), vocab):
            raise EngineError(f"llama.cpp returned logits {a.dtype} {a.shape}; expected float32 ({s.numel()}, {vocab})")
        if not np.isfinite(a).all():
            raise EngineError("llama.cpp returned non-finite logits")
        out.append(torch.from_numpy(a).double().log_softmax(-1))
    return out


def _ids(x, n: int | None = None) -> list[list[int]]:
    if not isinstance(x, list) or (n is not None and len(x) != n) or not all(
            isinstance(r, list) and all(type(t) is int for t in r) for r in x):
        raise EngineError("llama.cpp's result holds token lists of the wrong shape or type")
    return x


def run(gguf: Path, ref_dir: Path, ckpt_dir: Path | None, inputs: RunInputs, engine: EngineRun = EngineRun()
        ) -> tuple[dict, list[Check]]:
    """Run the GGUF in llama.cpp and compare with the reference (transformers on `ref_dir`, with `ckpt_dir`'s
    dequantized weights when given). Returns (the engine_run document, its checks)."""
    samples, gen_tokens, thresholds, say = inputs.samples, inputs.gen_tokens, inputs.thresholds, inputs.say
    timeout = engine.timeout or DEFAULT_TIMEOUT_S
    py = locate_python(engine.python)
    files = gguf_files(gguf)
    meta = _gguf_meta(files[0])
    vocab = meta["vocab"]
    if any(int(s.max()) >= vocab for s in samples):
        raise EngineError(f"token ids reach {max(int(s.max()) for s in samples)}, beyond the GGUF's {vocab} tokens")
    if sum(s.numel() for s in samples) * vocab * 4 > MAX_LOGIT_BYTES:
        raise EngineError(f"{len(samples)} samples x vocabulary {vocab} of float32 logits exceed "
                          f"{MAX_LOGIT_BYTES >> 20} MiB", hint="use fewer --num-samples or a shorter --seq-len")
    ref = reference_logprobs(Path(ref_dir), ckpt_dir, samples, gen_tokens, inputs.dev, say)
    if ref["ref"][0].shape[-1] != vocab:
        raise EngineError(f"the reference has {ref['ref'][0].shape[-1]} logits, the GGUF {vocab} tokens")
    longest = max([s.numel() for s in samples] + [len(p) + len(c) for p, c in zip(ref["prompts"], ref["continuations"])])
    threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="quantkit-llamacpp-") as tmp:
        tmp = Path(tmp)
        request = {"model": str(files[0].resolve()), "n_ctx": max(64, longest + 1), "threads": threads,
                   "samples": [s.tolist() for s in samples], "prompts": ref["prompts"], "gen_tokens": gen_tokens,
                   "forced": [p + c for p, c in zip(ref["prompts"], ref["continuations"])],
                   "prompt_lens": [len(p) for p in ref["prompts"]], "out_dir": str(tmp)}
        if meta.get("yarn_betas"):
            request["yarn_beta_fast"], request["yarn_beta_slow"] = meta["yarn_betas"]
        t0 = time.perf_counter()
        res = run_worker(py, request, tmp, timeout, say)
        doc = {"engine": f"llama.cpp (llama-cpp-python {res.get('llama_cpp_version')})", "python": py,
               "gguf": [str(f) for f in files], "status": res.get("status"), "seconds": res.get("seconds"),
               "wall_seconds": round(time.perf_counter() - t0, 1), "architecture": meta.get("architecture"),
               "note": meta.get("note")}
        if res["status"] != "ok":
            reason = str(res.get("reason") or "unknown")[:400]
            if res["status"] == "error":
                raise EngineError(f"llama.cpp could not be started under {py} ({res.get('stage')}): {reason}",
                                  hint="install llama-cpp-python in that environment (bench/setup_llamacpp.sh)")
            line = f"this llama.cpp build cannot run {files[0].name} on this machine: {reason}"
            doc.update(status="cannot_run", stage=res.get("stage"), reason=reason, line=line)
            return doc, [Check("engine_llamacpp_run", None, line)]
        eng = _engine_logits(res, tmp, samples, vocab)
        generated = _ids(res.get("generated") or [], len(ref["prompts"]))
        forced = _ids(res.get("forced_top1") or [], len(ref["prompts"]))
    checks: list[Check] = []
    nll_e = nll_r = 0.0
    n = 0
    kl, agree = [], []
    for s, e, r in zip(samples, eng, ref["ref"]):
        tgt = s[1:].long()
        nll_e -= float(e[:-1].gather(-1, tgt[:, None]).sum())
        nll_r -= float(r[:-1].gather(-1, tgt[:, None]).sum())
        n += tgt.numel()
        kl.append(_kl(r, e))
        agree.append((r[:-1].argmax(-1) == e[:-1].argmax(-1)).double())
    if n == 0:
        raise EngineError("no position to measure (every sample is a single token)")
    ppl_e, ppl_r = math.exp(min(700.0, nll_e / n)), math.exp(min(700.0, nll_r / n))
    kl_m = float(torch.cat(kl).mean())
    top1 = float(torch.cat(agree).mean())
    doc.update(positions=n, perplexity_engine=finite(ppl_e), perplexity_reference=finite(ppl_r),
               perplexity_ratio=finite(ppl_e / ppl_r), kl_divergence=finite(kl_m), top1_agreement=finite(top1),
               reference="checkpoint (source + its dequantized weights)" if ckpt_dir is not None else "source")
    checks.append(Check("engine_llamacpp_run", True, f"{doc['engine']} ran {files[0].name}: perplexity {ppl_e:.4g} "
                        f"over {n} positions"))
    if "source" in ref:
        kl_q = float(torch.cat([_kl(s_, r) for s_, r in zip(ref["source"], ref["ref"])]).mean())
        kl_se = float(torch.cat([_kl(s_, e) for s_, e in zip(ref["source"], eng)]).mean())
        nll_s = -sum(float(s_[:-1].gather(-1, s[1:].long()[:, None]).sum()) for s, s_ in zip(samples, ref["source"]))
        doc.update(kl_source_checkpoint=finite(kl_q), kl_source_engine=finite(kl_se),
                   kl_engine_vs_quantization=finite(kl_m / kl_q) if kl_q > 0 else None,
                   perplexity_source=finite(math.exp(min(700.0, nll_s / n))))
    from .numerics import limit_check

    what = "the checkpoint in transformers" if ckpt_dir is not None else "the source in transformers"
    checks.append(limit_check("engine_perplexity_ratio", ppl_e / ppl_r, thresholds.max_ppl_ratio, upper=True,
                         what=f"perplexity in llama.cpp {ppl_e:.4g} vs {what} {ppl_r:.4g}"))
    checks.append(limit_check("engine_kl", kl_m, thresholds.max_kl, upper=True,
                         what=f"mean next-token KL({what} || llama.cpp) over {sum(k.numel() for k in kl)} positions"
                              + (f"; KL(source || checkpoint) {doc['kl_source_checkpoint']:.3g}" if "source" in ref
                                 else "")))
    checks.append(limit_check("engine_top1_agreement", top1, thresholds.min_top1, upper=False,
                         what=f"llama.cpp's next-token top-1 vs {what}'s over {n} positions"))
    if ref["continuations"]:
        doc["generation"], check = generation_check("llama.cpp", forced, generated, ref["continuations"], gen_tokens,
                                                    thresholds.min_generation_agreement)
        checks.append(check)
    return doc, checks


def _gguf_meta(path: Path) -> dict:
    """What the run needs from the GGUF's own metadata: vocabulary size, architecture, YaRN betas, the note."""
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency
        raise EngineError("the gguf package is not installed", hint="pip install gguf") from None
    try:
        r = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise EngineError(f"{path.name} is not a readable GGUF: {str(e)[:160]}") from None

    def field(name):
        f = r.fields.get(name)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    if not isinstance(arch, str) or tokens is None:
        raise EngineError(f"{path.name} has no general.architecture or tokenizer.ggml.tokens")
    betas = (field(f"{arch}.rope.scaling.yarn_beta_fast"), field(f"{arch}.rope.scaling.yarn_beta_slow"))
    return {"architecture": arch, "vocab": len(tokens.data),
            "yarn_betas": [float(b) for b in betas] if all(isinstance(b, float) for b in betas) else None,
            "note": ("llama.cpp multiplies 4-bit and 8-bit GGML weights with 8-bit quantized activations: close to "
                     "W4A8")}



def run_gguf(gguf, reference: Path, checkpoint: Path | None = None, opts: VerifyOptions = VerifyOptions(),
             say=lambda _s: None) -> dict:
    """The whole `verify OUT.gguf --engine llama.cpp --run` (token data from the reference, as verify's numerics
    take it): `opts` gives the token data, device, generation tokens and thresholds, and `opts.engine_run` the
    Python llama-cpp-python is installed in and the timeout. Returns {passed, engine_run, checks, data, seconds}."""
    from ..read.checkpoint import Checkpoint
    from .common import resolve_device
    from .numerics import token_data

    t0 = time.perf_counter()
    thresholds = opts.thresholds if opts.thresholds is not None else Thresholds()
    ref_ck = Checkpoint.open(reference)
    if checkpoint is not None:
        Checkpoint.open(checkpoint)  # raises for an unusable one
    samples, data = token_data(ref_ck, opts.dataset, opts.num_samples, opts.seq_len, opts.seed)
    inputs = RunInputs(samples, resolve_device(opts.device), opts.generation_tokens, thresholds, say)
    doc, checks = run(Path(gguf), ref_ck.root, Path(checkpoint) if checkpoint is not None else None, inputs,
                      opts.engine_run or EngineRun())
    return {"passed": all(c.ok is not False for c in checks), "engine_run": doc,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks], "data": data,
            "thresholds": {"max_kl": thresholds.max_kl, "max_ppl_ratio": thresholds.max_ppl_ratio,
                           "min_top1": thresholds.min_top1,
                           "min_generation_agreement": thresholds.min_generation_agreement},
            "seconds": round(time.perf_counter() - t0, 2)}
