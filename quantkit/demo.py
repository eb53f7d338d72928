"""`quantkit demo`: the whole pipeline on a tiny generated MoE model, with no downloads.

1. build a tiny random-weight model of `arch` from a transformers config and save it sharded;
2. `convert` it with the `int4-experts-rtn` recipe;
3. `inspect` the result;
4. load the output with transformers (compressed-tensors decompresses it) and compare logits with the
   original on random tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from .errors import OutputExists


def run_demo(out: str | Path, arch: str = "qwen3_moe", overwrite: bool = False,
             log: Callable[[str], None] = print) -> dict:
    import torch

    from .convert import ConvertOptions, convert
    from .inspect import inspect_checkpoint
    from .testing import ARCHS, make_tiny_model

    out = Path(out)
    if arch not in ARCHS:
        from .errors import QuantkitError

        raise QuantkitError(f"unknown demo architecture {arch!r}", hint=f"choose one of: {', '.join(ARCHS)}")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise OutputExists(f"demo directory {str(out)!r} is not empty")
        shutil.rmtree(out)
    src, dst = out / "source-bf16", out / "int4"
    log(f"[1/4] generating a tiny {arch} model in {src}")
    make_tiny_model(arch, src, layers=4, experts=8)
    log("[2/4] quantkit convert --recipe int4-experts-rtn")
    res = convert(src, dst, ConvertOptions(recipe="int4-experts-rtn"))
    log(f"      {res.tensors_quantized} expert Linears -> INT4 g32; {res.bytes_read:,} B -> {res.bytes_written:,} B "
        f"in {res.seconds:.2f} s")
    log("[3/4] quantkit inspect")
    rep = inspect_checkpoint(dst)
    for label, s in rep["schemes"].items():
        log(f"      {label:>18}: {s['tensors']:4d} tensors, {s['bytes']:,} B")
    log("[4/4] loading the INT4 checkpoint with transformers and comparing logits")
    metrics = compare_logits(src, dst)
    log(f"      KL(bf16 || int4) = {metrics['kl_divergence']:.2e}, top-1 agreement = {metrics['top1_agreement']:.3f}")
    return {"source": str(src), "output": str(dst), "convert": res.to_json(), "inspect": rep, "metrics": metrics}


def compare_logits(reference: str | Path, quantized: str | Path, tokens: int = 64, seed: int = 0) -> dict:
    """Load both checkpoints with transformers on CPU and compare next-token distributions on random
    tokens: mean KL(reference || quantized), top-1 agreement, max |logit difference|."""
    import torch
    import torch.nn.functional as F

    from .testing import load_model

    ref = load_model(reference).eval()
    qnt = load_model(quantized).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ref.config.vocab_size, (2, tokens), generator=gen)
    with torch.no_grad():
        a = ref(ids).logits.double()
        b = qnt(ids).logits.double()
    kl = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="none").sum(-1).mean()
    return {"kl_divergence": float(kl), "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "max_abs_logit_diff": float((a - b).abs().max()), "logit_scale": float(a.abs().max())}
