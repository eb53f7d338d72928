"""`verify OUT.gguf --engine llama.cpp --run`: quantkit's GGUFs run in the real llama.cpp (llama-cpp-python, built by
.ci/run when missing) for every exported architecture, measured against transformers; and the worker's answers
treated as hostile input (stand-in "engine Pythons" that lie, hang or crash)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from quantkit.convert import ConvertOptions, convert
from quantkit.verify import EngineRun, VerifyOptions, llamacpp_run
from quantkit.errors import EngineError
from quantkit.export import ExportOptions, export

REQUIRE = os.environ.get("QUANTKIT_REQUIRE_LLAMACPP") == "1"
try:
    import llama_cpp  # noqa: F401 (only whether it imports)

    HAVE = True
except ImportError:
    HAVE = False
needs_llama = pytest.mark.skipif(not HAVE and not REQUIRE, reason="llama-cpp-python is not installed "
                                 "(bench/setup_llamacpp.sh builds it; .ci/run does and sets QUANTKIT_REQUIRE_LLAMACPP)")
ARCH_KW = {"qwen3_moe": {"norm_topk_prob": True}, "mixtral": {}, "deepseek_v3": {}, "glm4_moe": {},
           "glm_moe_dsa": {"index_head_dim": 64, "index_topk": 256, "rms_norm_eps": 1e-6}, "kimi_k25": {}}


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    cache = {}

    def get(arch, recipe="int4-experts-rtn", **opts):
        key = (arch, recipe, tuple(sorted(opts.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"lcpp_{arch}")
            src = tiny_models(arch, **ARCH_KW[arch])
            convert(src, d / "q", ConvertOptions(recipe=recipe, model_card=False))
            export(d / "q", d / "m.gguf", ExportOptions(**opts))
            cache[key] = (src, d / "q", d / "m.gguf")
        return cache[key]

    return get


def _run(gguf, src, q, **kw):
    return llamacpp_run.run_gguf(gguf, src, q, VerifyOptions(num_samples=4, seq_len=64, generation_tokens=16, **kw))


@needs_llama
@pytest.mark.parametrize("arch", list(ARCH_KW))
def test_every_architecture_runs_in_llama_cpp(exported, arch):
    """llama.cpp's logits against the checkpoint in transformers: what llama.cpp adds (8-bit activations, its sums)
    is well below what the quantization itself costs (KL(source || checkpoint))."""
    src, q, gguf = exported(arch)
    doc = _run(gguf, src, q)
    e = doc["engine_run"]
    assert doc["passed"] and e["status"] == "ok", doc["checks"]
    assert e["positions"] == 4 * 63 and e["kl_source_checkpoint"] > 0
    assert e["kl_divergence"] <= 0.25 * e["kl_source_checkpoint"], e
    assert abs(e["perplexity_ratio"] - 1) < 0.02 and e["top1_agreement"] > 0.95
    assert e["generation"]["agreement"] > 0.9


@needs_llama
def test_mxfp4_nvfp4_and_a_wrong_gguf_is_caught(exported, tmp_path):
    for recipe in ("mxfp4-experts", "nvfp4-experts"):  # NVFP4: llama.cpp applies each expert's global scale
        src, q, gguf = exported("qwen3_moe", recipe)
        e = _run(gguf, src, q)["engine_run"]
        assert e["kl_divergence"] <= 0.25 * e["kl_source_checkpoint"], (recipe, e)
    src, q, gguf = exported("qwen3_moe", "mxfp4-experts")
    # the same GGUF measured against another model's weights fails: the comparison can fail
    other, _, _ = exported("qwen3_moe")
    src2 = tmp_path / "src2"
    from quantkit.tiny import make_tiny_model

    make_tiny_model("qwen3_moe", src2, seed=7, norm_topk_prob=True)
    doc = llamacpp_run.run_gguf(gguf, src2, None, VerifyOptions(num_samples=2, seq_len=32, generation_tokens=0))
    assert not doc["passed"] and any(c["name"] == "engine_kl" and c["ok"] is False for c in doc["checks"])


@needs_llama
def test_cannot_run_is_one_line_exit_3(exported, tmp_path):
    """A GGUF this llama.cpp refuses at load (an unknown pre-tokenizer) ends in exit 3 and llama.cpp's own reason."""
    src, q, _ = exported("mixtral")
    export(q, tmp_path / "bad.gguf", ExportOptions(pre_tokenizer="no-such-pretokenizer"))
    p = subprocess.run([sys.executable, "-m", "quantkit", "verify", str(tmp_path / "bad.gguf"), "--reference", str(src),
                        "--engine", "llama.cpp", "--run", "--num-samples", "1", "--seq-len", "16"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("this llama.cpp build cannot run bad.gguf on this machine") and "pre-tokenizer" in last


# ---- the worker's answers are input ----------------------------------------------------------------------
def _fake(tmp_path, body: str) -> Path:
    """An 'engine Python' that ignores the worker and runs `body` (sh) with $3 = the result path, $2 = request."""
    p = tmp_path / "python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return p


def _ok_result(tmp_path, samples_json: str) -> str:
    return f"""python3 - "$2" "$3" <<'EOF'
import json, sys
req = json.load(open(sys.argv[1]))
json.dump({{"status": "ok", "samples": {samples_json}, "generated": [], "forced_top1": []}}, open(sys.argv[2], "w"))
EOF"""


@pytest.mark.parametrize("body,match", [
    ('echo "not json" > "$3"', "not valid JSON"),
    ('echo \'{"status": "fine"}\' > "$3"', "no valid status"),
    ("exit 0", "without a result"),
    ("kill -SEGV $$", "without a result"),
    (None, "0 sample results"),  # success over nothing
    ("outside", "outside its exchange folder"),
])
def test_worker_answers_are_checked(exported, tmp_path, body, match):
    src, q, gguf = exported("qwen3_moe")
    if body is None:
        body = _ok_result(tmp_path, "[]")
    elif body == "outside":
        body = _ok_result(tmp_path, '[{"logits": "/etc/passwd", "positions": 16}] * len(req["samples"])')
    with pytest.raises(EngineError, match=match):
        llamacpp_run.run_gguf(gguf, src, None, VerifyOptions(num_samples=2, seq_len=16, generation_tokens=0,
                                                             engine_run=EngineRun(python=_fake(tmp_path, body))))


def test_worker_logits_of_wrong_shape_or_nan(exported, tmp_path):
    src, q, gguf = exported("qwen3_moe")
    for arr, match in (("np.zeros((3, 7), np.float32)", "expected float32"),
                       ("np.full((16, 512), np.nan, np.float32)", "non-finite")):
        body = f"""python3 - "$2" "$3" <<'EOF'
import json, sys, os, numpy as np
req = json.load(open(sys.argv[1]))
out = []
for i, s in enumerate(req["samples"]):
    p = os.path.join(req["out_dir"], f"l{{i}}.npy"); np.save(p, {arr}); out.append({{"logits": p}})
json.dump({{"status": "ok", "samples": out}}, open(sys.argv[2], "w"))
EOF"""
        with pytest.raises(EngineError, match=match):
            llamacpp_run.run_gguf(gguf, src, None, VerifyOptions(num_samples=2, seq_len=16, generation_tokens=0,
                                                                 engine_run=EngineRun(python=_fake(tmp_path, body))))


def test_a_hanging_worker_is_ended_with_its_children(exported, tmp_path):
    src, q, gguf = exported("qwen3_moe")
    pidfile = tmp_path / "child.pid"
    body = f'sleep 300 & echo $! > "{pidfile}"\nwait'
    engine = EngineRun(python=_fake(tmp_path, body), timeout=3)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="did not finish within 3 s"):
        llamacpp_run.run_gguf(gguf, src, None, VerifyOptions(num_samples=1, seq_len=16, generation_tokens=0,
                                                             engine_run=engine))
    assert time.monotonic() - t0 < 60
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    stat = Path(f"/proc/{pid}/stat")
    # gone, or a zombie waiting for this machine's init to reap it: no longer running either way
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_gguf_inputs_that_are_not_ggufs(tmp_path, tiny_models):
    src = tiny_models("mixtral")
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    (tmp_path / "y.gguf").write_text("hello")
    for f, match in (("x.gguf", "not a readable GGUF"), ("y.gguf", "no GGUF magic"), ("z.gguf", "not a file")):
        with pytest.raises(EngineError, match=match):
            llamacpp_run.run_gguf(tmp_path / f, src, None, VerifyOptions(num_samples=1, seq_len=8, generation_tokens=0))
