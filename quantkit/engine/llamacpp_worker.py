"""Run a GGUF in llama.cpp (llama-cpp-python) and write what it computed. Started by quantkit/verify/llamacpp_run.py
under the engine's Python, as `python llamacpp_worker.py REQUEST.json RESULT.json`; imports nothing of quantkit.

Request: {"model": first GGUF file, "n_ctx", "threads", "samples": [[ids]], "prompts": [[ids]], "gen_tokens",
"forced": [[ids]], "prompt_lens": [int], "yarn_beta_fast"?, "yarn_beta_slow"?, "out_dir"}.
Result: {"status": "ok" | "cannot_run" | "error", "stage", "reason", "llama_cpp_version", "n_vocab", "samples":
[{"logits": FILE.npy, "positions": L}], "generated": [[ids]], "forced_top1": [[ids]], "seconds"}.
Logits are float32 .npy files [L, n_vocab], one per sample (every position's, llama.cpp's own output).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _last_error(log_path: str | None) -> str:
    """llama.cpp's own words for a load failure: its last error line on stderr."""
    if not log_path or not os.path.isfile(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f.read()[-20000:].splitlines() if ln.strip()]
    for ln in lines:  # llama.cpp's loader says why first ("llama_model_load: error loading model: ...")
        if "error loading model" in ln:
            return ln[:400]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln[:400]
    return lines[-1][:400] if lines else ""


def main(req_path: str, res_path: str) -> int:
    with open(req_path) as f:
        req = json.load(f)
    res: dict = {"status": "error", "stage": "import"}

    def done(**kw) -> int:
        res.update(kw)
        tmp = res_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, res_path)
        return 0

    try:
        import numpy as np

        import llama_cpp
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return done(reason=f"{type(e).__name__}: {e}")
    res["llama_cpp_version"] = getattr(llama_cpp, "__version__", "unknown")
    t0 = time.perf_counter()
    kw = dict(model_path=req["model"], n_ctx=int(req["n_ctx"]), n_batch=int(req["n_ctx"]),
              n_ubatch=int(req["n_ctx"]), logits_all=True, verbose=True, seed=0, n_threads=int(req["threads"]),
              n_threads_batch=int(req["threads"]))
    for k in ("yarn_beta_fast", "yarn_beta_slow"):
        if req.get(k) is not None:
            kw[k] = float(req[k])
    try:
        llm = llama_cpp.Llama(**kw)
    except Exception as e:  # noqa: BLE001
        return done(status="cannot_run", stage="load",
                    reason=_last_error(os.environ.get("QUANTKIT_ENGINE_LOG")) or f"{type(e).__name__}: {e}")
    res["n_vocab"] = int(llm.n_vocab())
    res["stage"] = "run"
    out_dir = req["out_dir"]
    samples = []
    for i, ids in enumerate(req["samples"]):
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
        path = os.path.join(out_dir, f"logits_{i}.npy")
        np.save(path, logits, allow_pickle=False)
        samples.append({"logits": path, "positions": len(ids)})
    generated = []
    for p in req.get("prompts") or []:
        llm.reset()
        llm.eval(p)
        toks = []
        for _ in range(int(req.get("gen_tokens") or 0)):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            toks.append(t)
            llm.eval([t])
        generated.append(toks)
    forced = []
    for seq, plen in zip(req.get("forced") or [], req.get("prompt_lens") or []):
        llm.reset()
        llm.eval(seq)
        sc = np.asarray(llm.scores[: len(seq)], dtype=np.float32)
        forced.append([int(x) for x in sc[plen - 1: len(seq) - 1].argmax(-1)])
    return done(status="ok", samples=samples, generated=generated, forced_top1=forced,
                seconds=round(time.perf_counter() - t0, 3))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
