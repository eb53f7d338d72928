"""`quantkit demo`: the whole pipeline on a tiny generated MoE model, with no downloads.

1. build a tiny random-weight model of `arch` from a transformers config and save it sharded;
2. `calibrate` FP8 KV-cache scales on the shipped calibration set, layer by layer;
3. `convert` it with the `int4-experts-rtn` recipe and the KV scales;
4. `inspect` the result;
5. `verify` it against the source: shard hashes, format (compressed-tensors as judge), per-layer SQNR,
   logits KL, top-1, perplexity and greedy agreement (transformers loads the INT4 checkpoint);
6. `plan` the memory of the result.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Callable

from . import options
from .errors import DemoError, OutputExists, VerificationFailed


DEMO_MARKER = ".quantkit-demo"
DEMO_ENTRIES = {DEMO_MARKER, "source-bf16", "int4", "kv-scales.safetensors", ".kv-scales.safetensors.tmp"}


def _earlier_demo(out: Path) -> bool:
    """`out` holds only what an earlier `quantkit demo` wrote (its marker included): safe to replace, so
    that running the README's first command twice works."""
    names = {p.name for p in out.iterdir()}
    return DEMO_MARKER in names and names <= DEMO_ENTRIES and not out.is_symlink()


def run_demo(out: str | Path, arch: str = options.DEMO_ARCH, overwrite: bool = False,
             log: Callable[[str], None] = print) -> dict:
    from .calibrate import CalibrateOptions, calibrate, write_scales
    from .card import VERIFY_JSON, write_model_card
    from .report import build_report
    from .write.writer import write_json_atomic
    from .convert import ConvertOptions, convert
    from .inspect import inspect_checkpoint
    from .plan import plan
    from .tiny import ARCHS, make_tiny_model
    from .verify import VerifyOptions, verify

    out = Path(out)
    if arch not in ARCHS:
        raise DemoError(f"unknown demo architecture {arch!r}", hint=f"choose one of: {', '.join(ARCHS)}")
    if out.exists() and any(out.iterdir()):
        if not (overwrite or _earlier_demo(out)):
            raise OutputExists(f"demo directory {str(out)!r} is not empty")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("written by `quantkit demo`; a new demo run replaces this directory\n")
    src, dst, scales = out / "source-bf16", out / "int4", out / "kv-scales.safetensors"
    log(f"[1/7] generating a tiny {arch} model in {src}")
    make_tiny_model(arch, src, layers=4, experts=8)
    log("[2/7] quantkit calibrate (FP8 KV-cache scales)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model has no tokenizer: bytes stand in for tokens
        cal = calibrate(src, CalibrateOptions(num_samples=8, seq_len=128))
    write_scales(cal, scales)
    log(f"      {len(cal.layers)} layers, k_scale of layer 0 = {cal.layers[0].k_scale:.3g}")
    log("[3/7] quantkit convert --recipe int4-experts-rtn --kv-scales")
    res = convert(src, dst, ConvertOptions(recipe="int4-experts-rtn", kv_scales=str(scales)))
    log(f"      {res.tensors_quantized} expert Linears -> INT4 g32; {res.bytes_read:,} B -> {res.bytes_written:,} B "
        f"in {res.seconds:.2f} s")
    log("[4/7] quantkit inspect")
    rep = inspect_checkpoint(dst)
    for label, s in rep["schemes"].items():
        log(f"      {label:>18}: {s['tensors']:4d} tensors, {s['bytes']:,} B")
    log("[5/7] quantkit verify --reference (transformers loads the INT4 checkpoint)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ver = verify(dst, VerifyOptions(reference=src, num_samples=4, seq_len=64, generation_tokens=16))
    for c in ver.checks:
        log(f"      {'ok  ' if c.ok else ('skip' if c.ok is None else 'FAIL')} {c.name}: {c.detail}")
    write_json_atomic(dst / VERIFY_JSON, {**ver.to_json(), "reference": str(src)})  # as `quantkit verify` keeps it
    write_model_card(dst, verify_report=ver.to_json())
    log("[6/7] quantkit plan")
    pl = plan(dst).to_json()
    log(f"      checkpoint {pl['checkpoint_bytes']['source']:,} B; KV bytes/token bf16 "
        f"{pl['kv_bytes_per_token']['bfloat16']:,} -> fp8 {pl['kv_bytes_per_token']['float8_e4m3']:,}")
    log("[7/7] quantkit report (the pictures) and the model card")
    html = build_report(dst, reference=src)
    log(f"      {html.output} ({len(html.figures)} figures), {dst / 'README.md'}")
    doc = {"source": str(src), "output": str(dst), "calibrate": cal.to_json(), "convert": res.to_json(),
           "inspect": rep, "verify": ver.to_json(), "plan": pl, "report": html.to_json()}
    if not ver.passed:
        raise VerificationFailed(f"the demo's conversion failed verification: "
                                 f"{', '.join(c.name for c in ver.failed_checks())}")
    log(f"done: {dst} verified")
    return doc
