"""What `verify` takes besides the checkpoint: `VerifyOptions`, and `EngineRun` for a run in an engine (vLLM,
llama.cpp). Defaults come from quantkit/options.py, shared with the CLI. Light: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import options
from ..options import Thresholds


@dataclass(frozen=True)
class EngineRun:
    """How QMODEL (or a GGUF) is run in an engine's own process (verify/vllm_run.py, verify/llamacpp_run.py)."""

    python: str | Path | None = None  # the engine environment's interpreter (or venv directory); None: this one
    timeout: int | None = None  # seconds the run may take; None: the runner's DEFAULT_TIMEOUT_S
    # vLLM's --kv-cache-dtype: "served" (fp8 when the checkpoint has KV scales, as its model card serves it), or
    # vLLM's values ("auto", "bfloat16", "fp8")
    kv_cache_dtype: str = "served"
    engine_args: dict | None = None  # extra vllm.LLM keyword arguments


@dataclass(frozen=True)
class VerifyOptions:
    """Everything `verify` takes besides the checkpoint directory; the CLI's defaults are these.

    reference: the source checkpoint QMODEL was converted from; without it the numerics are skipped and
    `passed` depends on integrity and format only. dataset/num_samples/seq_len/seed: the token data for the
    model-level metrics (quantkit.calib.data formats; default: the shipped calibration set through the
    reference's tokenizer, or seeded random ids when it has none). generation_tokens: greedy steps per prompt (0:
    skip). device: where the models run. kernels: "torch", or "triton" to also check the runtime's INT4 GEMM
    kernel against its torch reference on a few modules. engine: "vllm" to also check the rules vLLM applies
    when it loads the checkpoint (quantkit/engine/vllm.py), at tensor parallelism `tp`. engine_run: with engine
    "vllm", also run QMODEL in vLLM and measure it there (quantkit/verify/vllm_run.py). pair: the prefill
    checkpoint of a prefill/decode pair whose decode half is QMODEL (convert --pair): checked to belong together
    (PairMismatch otherwise, before anything else) and, with a reference, measured as served: FP8 prefill into
    the KV cache, decode reading it (verify/pair.py)."""

    reference: str | Path | None = None
    dataset: str | None = None
    num_samples: int = options.VERIFY_NUM_SAMPLES
    seq_len: int = options.VERIFY_SEQ_LEN
    device: str = options.VERIFY_DEVICE
    kernels: str = options.VERIFY_KERNELS
    thresholds: Thresholds = Thresholds()
    generation_tokens: int = options.VERIFY_GENERATION_TOKENS
    engine: str | None = None
    tp: int = options.VERIFY_TP
    seed: int = 0
    engine_run: EngineRun | None = None
    pair: str | Path | None = None
