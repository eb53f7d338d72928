"""`quantkit verify`: prove that a converted checkpoint is what its manifest says, loads as the format
says, and computes what the reference computes.

Three stages, each reading only what `convert` wrote (never its internals):

1. Integrity (no model code): `quantkit_manifest.json` is complete; every shard it lists exists with the
   recorded size and sha256; the index names no shard the manifest lacks and the directory holds no
   shard or leftover temporary file the manifest lacks; the manifest's tensor table matches the headers.
2. Format (headers + small tensors): `config.json`'s `quantization_config` against the tensors. Each
   module with `weight_packed` resolves to one config group (exact name > `re:` pattern > class name, as
   compressed-tensors matches), is not ignored, and carries `weight_scale` / `weight_shape` (and
   `weight_zero_point` iff asymmetric, `weight_g_idx` iff actorder "group") of the dtypes and shapes
   the group implies; compressed-tensors' own decompressor (the judge) must reproduce our dequantization
   bit for bit.
3. Numerics (needs `reference`, the source checkpoint): per-module weight SQNR of our dequantization
   against the reference tensor (read lazily, shard by shard), aggregated per decoder layer and compared
   with the SQNR the manifest recorded at conversion; then both models run with transformers on token
   data: mean next-token KL(ref || quant), top-1 agreement, perplexity of each, greedy-generation
   agreement. With `kernels="triton"` the runtime's INT4 GEMM kernel is checked on a few modules.

A failed check never raises: the report says `passed: false` and names the shard, tensor or layer.
Only unusable input raises a QuantkitError (a missing directory, an unreadable reference, an
unavailable device). Memory: stages 1-2 and the SQNR pass hold one module at a time (plus the mapped
pages of the shard being read); the model-level metrics load both models (see docs/verify.md).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import re
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import CheckpointNotFound, QuantkitError
from .io.checkpoint import INDEX_NAME, Checkpoint, read_json_file
from .io.safetensors import SafetensorsFile
from .io.writer import sha256_file
from .quant.int4 import dequantize, sqnr_db, unpack_int4
from .recipe import matches

MANIFEST_NAME = "quantkit_manifest.json"  # = convert.MANIFEST_NAME (not imported: verify reads, never converts)
JOURNAL_DIR = ".quantkit-journal"
MAX_LISTED = 100  # mismatches / problems listed in full; the rest are counted
SQNR_CAP_DB = 300.0  # an exact match (inf dB) is reported as this, so the report stays valid JSON
KERNEL_MODULES = 4  # modules the kernel check runs the INT4 GEMM on
KERNEL_RTOL = 2e-2  # |triton - torch| <= rtol * max|torch|: bf16 outputs, fp32 accumulation either way
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
SCALE_DTYPES = (torch.bfloat16, torch.float16)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PLAIN_SHARD = re.compile(r"[A-Za-z0-9._+-]+\.safetensors")
# Built-in text for token data when the reference has a tokenizer but no dataset is given (varied prose,
# code and numbers so that the distributions are not all trivially repetitive).
_BUILTIN_TEXT = (
    "The committee met on a grey Tuesday morning to review the harbour plans. Three proposals were on the "
    "table: widen the northern channel, rebuild the old breakwater, or do nothing until the survey was done. "
    "def moving_average(xs, n):\n    out = []\n    for i in range(len(xs) - n + 1):\n"
    "        out.append(sum(xs[i:i + n]) / n)\n    return out\n"
    "In 1869 the canal opened, cutting the voyage from London to Bombay by roughly 7,000 kilometres. "
    "Photosynthesis converts light energy into chemical energy stored in glucose; oxygen is released as a "
    "by-product. She asked whether the train to Lyon left at 14:05 or 14:35, and the clerk checked twice. "
    "Q: What is 17 times 23? A: 391. Q: Name a prime between 90 and 100. A: 97. "
    "Le marché ouvre à huit heures; les pêcheurs arrivent plus tôt avec la marée. "
    "A good error message says what went wrong, where, and what to do next. "
)


# ---- thresholds --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits. The defaults pass a correct int4-experts-rtn (g32) conversion with margin and
    fail a single tensor with a wrong scale; `docs/verify.md` says why each value was chosen. The CLI
    exposes one flag per field (`--max-kl`, ...) and builds the object with `with_overrides`."""

    max_kl: float = field(default=0.05, metadata={"help": "maximum mean next-token KL(reference || quantized), nats"})
    min_top1: float = field(default=0.85, metadata={"help": "minimum top-1 next-token agreement, 0..1"})
    max_ppl_ratio: float = field(default=1.10, metadata={
        "help": "maximum perplexity(quantized) / perplexity(reference)"})
    min_sqnr_db: float = field(default=10.0, metadata={"help": "minimum weight SQNR of every quantized module, dB"})
    max_sqnr_drift_db: float = field(default=0.1, metadata={
        "help": "maximum |SQNR measured now - SQNR the manifest recorded at conversion|, dB"})
    min_generation_agreement: float = field(default=0.80, metadata={
        "help": "minimum fraction of greedy-generation steps where the quantized model picks the reference's token"})

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise QuantkitError(f"threshold {f.name} must be a number, got {v!r}")
        for name in ("min_top1", "min_generation_agreement"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise QuantkitError(f"threshold {name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("max_kl", "max_ppl_ratio", "max_sqnr_drift_db"):
            if getattr(self, name) < 0:
                raise QuantkitError(f"threshold {name} must be >= 0, got {getattr(self, name)}")

    def with_overrides(self, **overrides: float | None) -> "Thresholds":
        """A copy with the given fields replaced; None means "keep" (an unset CLI flag)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise QuantkitError(f"unknown threshold(s) {unknown}; known: {sorted(known)}")
        return replace(self, **{k: float(v) for k, v in overrides.items() if v is not None})

    @classmethod
    def options(cls) -> list[tuple[str, float, str]]:
        """(field name, default, help) per threshold: what the CLI turns into flags."""
        return [(f.name, f.default, f.metadata["help"]) for f in fields(cls)]


# ---- the report ----------------------------------------------------------------------------------------
@dataclass
class Check:
    """One pass/fail decision. ok is None when the check was skipped (detail says why)."""

    name: str
    ok: bool | None
    detail: str
    value: float | None = None
    threshold: float | None = None


@dataclass
class VerifyReport:
    """What `verify` found. `to_json()` holds the contract keys (passed, integrity, format, metrics,
    layers) first, then extras (generation, checks, thresholds, data, seconds)."""

    passed: bool
    integrity: dict  # {ok, mismatches: [{file, problem}], files_checked, bytes_hashed}
    format: dict  # {ok, problems: [str], modules_checked, judge}
    metrics: dict  # {kl_divergence, top1_agreement, perplexity_reference, perplexity_quantized}
    layers: list  # [{layer, min_sqnr_db, mean_sqnr_db, modules, worst_module, ok}]
    generation: dict | None  # {tokens, prompts, agreement, matching_prefix}
    checks: list[Check]
    thresholds: Thresholds
    data: dict  # token data and run settings
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"passed": self.passed, "integrity": self.integrity, "format": self.format,
                "metrics": self.metrics, "layers": self.layers, "generation": self.generation,
                "checks": [asdict(c) for c in self.checks], "thresholds": asdict(self.thresholds),
                "data": self.data, "seconds": self.seconds}

    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]


class _Listing:
    """A list capped at MAX_LISTED entries; the overflow is counted and summarized at the end."""

    def __init__(self):
        self.items: list = []
        self.more = 0

    def add(self, item) -> None:
        if len(self.items) < MAX_LISTED:
            self.items.append(item)
        else:
            self.more += 1

    def __len__(self):
        return len(self.items) + self.more


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# ---- entry point ---------------------------------------------------------------------------------------
def verify(qmodel_dir, *, reference=None, dataset=None, num_samples: int = 8, seq_len: int = 128,
           device: str = "cpu", kernels: str = "torch", thresholds: Thresholds = Thresholds(),
           progress: Callable[[str], None] | None = None, generation_tokens: int = 32,
           seed: int = 0) -> VerifyReport:
    """Verify the converted checkpoint in `qmodel_dir` (see the module docstring).

    reference: the source checkpoint it was converted from; without it the numerics are skipped and
    `passed` depends on integrity and format only. dataset/num_samples/seq_len: the token data for the
    model-level metrics (quantkit.calib.data formats; default: the shipped calibration set through the
    reference's tokenizer, or seeded random ids when it has none). generation_tokens: greedy steps per prompt (0:
    skip). device: where the models run. kernels: "torch", or "triton" to also check the runtime's
    INT4 GEMM kernel against its torch reference on a few modules."""
    t0 = time.perf_counter()
    say = progress or (lambda _s: None)
    thresholds = thresholds if thresholds is not None else Thresholds()
    root = Path(qmodel_dir)
    if not root.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {str(root)!r} does not exist")
    if kernels not in ("torch", "triton"):
        raise QuantkitError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
    if not isinstance(num_samples, int) or num_samples <= 0 or not isinstance(seq_len, int) or seq_len < 2:
        raise QuantkitError(f"num_samples must be >= 1 and seq_len >= 2 (got {num_samples}, {seq_len})",
                            hint="pass --num-samples N and --seq-len L with L >= 2")
    if generation_tokens < 0:
        raise QuantkitError(f"generation_tokens must be >= 0, got {generation_tokens}")
    dev = _device(device)
    ref_ck = None
    if reference is not None:
        ref_ck = Checkpoint.open(reference)  # raises for an unusable reference (missing, corrupt headers)
        if ref_ck.quantization_config is not None and ref_ck.quantization_config.get("quant_method") != "fp8":
            raise QuantkitError(f"reference {str(reference)!r} is itself quantized "
                                f"({ref_ck.quantization_config.get('quant_method')!r})",
                                hint="pass the checkpoint the conversion started from (BF16/FP16/FP32 or block FP8)")
    if kernels == "triton":
        _require_triton(dev)

    checks: list[Check] = []
    # 1. integrity
    manifest, mismatches, hashed = _check_integrity(root, say)
    ck, open_error = _open(root)
    if ck is not None and manifest is not None:
        _check_manifest_tensors(ck, manifest, mismatches)
    integrity = {"ok": len(mismatches) == 0, "mismatches": _listed(mismatches, {"file": "*", "problem": None}),
                 "files_checked": len((manifest or {}).get("shards") or []), "bytes_hashed": hashed}
    checks.append(Check("integrity", integrity["ok"], "every shard matches the manifest" if integrity["ok"] else
                        f"{len(mismatches)} mismatch(es), first: {mismatches.items[0]['file']}: "
                        f"{mismatches.items[0]['problem']}"))

    # 2. format (+ the per-module SQNR pass, which reads the same tensors)
    problems = _Listing()
    sqnr: dict[str, float] = {}
    drift: list[tuple[str, float, float]] = []
    kernel_modules: list[tuple[str, dict]] = []
    ref_check = None
    judge = _Judge()
    modules_checked = 0
    if ck is None:
        problems.add(f"the checkpoint does not open: {open_error}")
    else:
        if ref_ck is not None:
            ref_check = _check_reference(ref_ck, manifest)
        modules_checked = _tensor_pass(ck, manifest, ref_ck, judge, problems, sqnr, drift, kernel_modules,
                                       want_kernels=kernels == "triton", say=say)
    fmt = {"ok": len(problems) == 0, "problems": _listed(problems, None), "modules_checked": modules_checked,
           "judge": judge.name}
    checks.append(Check("format", fmt["ok"], f"{modules_checked} quantized modules consistent with config.json"
                        if fmt["ok"] else f"{len(problems)} problem(s), first: {problems.items[0]}"))

    # 3. numerics
    metrics = {"kl_divergence": None, "top1_agreement": None, "perplexity_reference": None,
               "perplexity_quantized": None}
    layers: list[dict] = []
    generation = None
    data: dict[str, Any] = {"device": str(dev), "kernels": kernels, "source": None}
    if ref_ck is None:
        why = "no reference given: numerics skipped (pass the source checkpoint as reference)"
        checks += [Check(n, None, why) for n in ("weight_sqnr", "kl_divergence", "top1_agreement",
                                                 "perplexity_ratio", "generation_agreement")]
    elif ck is None:
        why = "the checkpoint does not open: numerics skipped"
        checks += [Check(n, None, why) for n in ("weight_sqnr", "kl_divergence", "top1_agreement",
                                                 "perplexity_ratio", "generation_agreement")]
    else:
        checks.append(ref_check)
        layers = _layer_summary(sqnr, thresholds.min_sqnr_db)
        awq = sum(1 for n, e in (manifest or {}).get("tensors", {}).items()
                  if n.endswith(".weight_packed") and isinstance(e, dict) and e.get("method") == "awq")
        checks.append(_sqnr_check(sqnr, layers, modules_checked - awq, thresholds, awq))
        checks.append(_drift_check(drift, thresholds))
        say("numerics: preparing token data")
        samples, data_info = _token_data(ref_ck, dataset, num_samples, seq_len, seed)
        data.update(data_info)
        m, generation, model_checks = _model_metrics(ref_ck.root, root, samples, dev, generation_tokens,
                                                     thresholds, say)
        metrics.update(m)
        checks += model_checks
    if kernels == "triton":
        say("kernels: INT4 GEMM (triton) against its torch reference")
        checks.append(_kernel_check(kernel_modules, dev) if kernel_modules else
                      Check("kernels", None, "no quantized module could be read: kernel check skipped"))

    passed = integrity["ok"] and fmt["ok"] and all(c.ok is not False for c in checks)
    return VerifyReport(passed, integrity, fmt, metrics, layers, generation, checks, thresholds, data,
                        round(time.perf_counter() - t0, 3))


def _listed(listing: _Listing, overflow_template) -> list:
    out = list(listing.items)
    if listing.more:
        msg = f"... and {listing.more} more"
        out.append(msg if overflow_template is None else {**overflow_template, "problem": msg})
    return out


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise QuantkitError(f"unknown device {device!r}", hint="use cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("device cuda requested but no CUDA device is available", hint="use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise QuantkitError(f"unsupported device {device!r}", hint="use cpu or cuda (cuda:N)")
    return dev


def _require_triton(dev: torch.device) -> None:
    from .runtime import interpreting, triton_available

    if not triton_available():
        raise QuantkitError("kernels=triton needs the triton package, which is not installed",
                            hint="pip install triton, or use --kernels torch")
    if dev.type != "cuda" and not interpreting():
        raise QuantkitError("kernels=triton runs on a CUDA device (or on CPU with TRITON_INTERPRET=1)",
                            hint="use --device cuda, set TRITON_INTERPRET=1, or use --kernels torch")


def _open(root: Path) -> tuple[Checkpoint | None, str | None]:
    try:
        return Checkpoint.open(root), None
    except QuantkitError as e:  # a corrupt header or index is a finding here, not a crash
        return None, f"{type(e).__name__}: {e.message}"


# ---- 1. integrity --------------------------------------------------------------------------------------
def _plain_name(name) -> bool:
    return (isinstance(name, str) and _PLAIN_SHARD.fullmatch(name) is not None and not name.startswith(".")
            and ".." not in name)


def _check_integrity(root: Path, say) -> tuple[dict | None, _Listing, int]:
    """(manifest or None, mismatches, bytes hashed). Reads JSON files and hashes shards; never parses
    a safetensors header, so a corrupt shard is reported by name rather than failing to open."""
    mm = _Listing()
    hashed = 0
    manifest = None
    try:
        manifest = read_json_file(root / MANIFEST_NAME, MANIFEST_NAME, QuantkitError)
    except QuantkitError as e:
        mm.add({"file": MANIFEST_NAME, "problem": e.message})
    shards: dict[str, dict] = {}
    if manifest is not None:
        if manifest.get("status") != "complete":
            mm.add({"file": MANIFEST_NAME, "problem": f"status is {manifest.get('status')!r}, not 'complete': "
                    "the conversion did not finish"})
        raw = manifest.get("shards")
        if not isinstance(raw, list) or not raw:
            mm.add({"file": MANIFEST_NAME, "problem": "lists no shards"})
            raw = []
        for s in raw:
            ok = (isinstance(s, dict) and _plain_name(s.get("name")) and type(s.get("size")) is int
                  and isinstance(s.get("sha256"), str))
            if not ok:
                mm.add({"file": MANIFEST_NAME, "problem": f"malformed shard entry {str(s)[:80]!r}"})
                continue
            if s["name"] in shards:
                mm.add({"file": s["name"], "problem": "listed twice in the manifest"})
            shards[s["name"]] = s
    for i, (name, s) in enumerate(sorted(shards.items())):
        p = root / name
        if not p.is_file():  # symlinks are followed: a Hugging Face cache snapshot links into blobs/
            mm.add({"file": name, "problem": "missing (listed in the manifest)" if not p.exists() else
                    "not a regular file"})
            continue
        size = p.stat().st_size
        if size != s["size"]:
            mm.add({"file": name, "problem": f"size {size} B, the manifest records {s['size']} B"})
            continue
        say(f"integrity: sha256 {name} ({i + 1}/{len(shards)})")
        digest = sha256_file(p)
        hashed += size
        if digest != s["sha256"]:
            mm.add({"file": name, "problem": f"sha256 {digest[:16]}... differs from the manifest's "
                    f"{s['sha256'][:16]}..."})

    # the index: every shard it names must exist and be in the manifest
    listed_in_index: set[str] = set()
    try:
        index = read_json_file(root / INDEX_NAME, INDEX_NAME, QuantkitError)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            mm.add({"file": INDEX_NAME, "problem": "has no weight_map"})
            wm = {}
        if not all(isinstance(f, str) for f in wm.values()):
            mm.add({"file": INDEX_NAME, "problem": "weight_map values must be shard file names"})
        for f in sorted({f for f in wm.values() if isinstance(f, str)}):
            if not _plain_name(f):
                mm.add({"file": INDEX_NAME, "problem": f"names {f[:80]!r}, not a plain shard file name"})
                continue
            listed_in_index.add(f)
            if manifest is not None and f not in shards:
                mm.add({"file": f, "problem": "named by the index but not listed in the manifest"})
            if f not in shards and not (root / f).is_file():
                mm.add({"file": f, "problem": "named by the index but missing"})
        total = (index.get("metadata") or {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
        if shards and total is not None and total != sum(s["size"] for s in shards.values()):
            mm.add({"file": INDEX_NAME, "problem": f"total_size {total} differs from the shards' "
                    f"{sum(s['size'] for s in shards.values())} B"})
    except QuantkitError as e:
        mm.add({"file": INDEX_NAME, "problem": e.message})
    for name in shards:
        if listed_in_index and name not in listed_in_index:
            mm.add({"file": name, "problem": "listed in the manifest but the index maps no tensor to it"})

    # nothing else that looks like weights, and nothing half-written
    for p in sorted(root.iterdir()):
        if p.name.endswith(".safetensors") and p.name not in shards:
            mm.add({"file": p.name, "problem": "extra shard not listed in the manifest"})
        elif p.name.startswith(".") and p.name.endswith(".tmp"):
            mm.add({"file": p.name, "problem": "leftover temporary file of an unfinished write"})
        elif p.name == JOURNAL_DIR:
            mm.add({"file": p.name, "problem": "the conversion journal is still there: the conversion did not finish"})
    return manifest, mm, hashed


def _check_manifest_tensors(ck: Checkpoint, manifest: dict, mm: _Listing) -> None:
    """The manifest's tensor table against the (validated) headers: same names, shards, shapes, dtypes."""
    table = manifest.get("tensors")
    if not isinstance(table, dict):
        mm.add({"file": MANIFEST_NAME, "problem": "has no tensor table"})
        return
    for name, e in table.items():
        where = ck.location.get(name)
        if where is None:
            mm.add({"file": e.get("shard", MANIFEST_NAME) if isinstance(e, dict) else MANIFEST_NAME,
                    "problem": f"tensor {name} is in the manifest but in no shard"})
            continue
        info = ck.info(name)
        if not isinstance(e, dict):
            mm.add({"file": MANIFEST_NAME, "problem": f"tensor {name}: malformed entry"})
            continue
        if e.get("shard") != where:
            mm.add({"file": where, "problem": f"tensor {name}: the manifest places it in {e.get('shard')}"})
        if e.get("shape") != list(info.shape) or e.get("dtype") != str(info.dtype).removeprefix("torch."):
            mm.add({"file": where, "problem": f"tensor {name}: header says {str(info.dtype).removeprefix('torch.')}"
                    f"{list(info.shape)}, the manifest {e.get('dtype')}{e.get('shape')}"})
    for name, where in ck.location.items():
        if name not in table:
            mm.add({"file": where, "problem": f"tensor {name} is not in the manifest"})


# ---- 2. format -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    weights: dict
    ok: bool  # the weights config is one this version can check (INT4 int group/channel)

    @property
    def symmetric(self) -> bool:
        return self.weights.get("symmetric", True) is not False

    @property
    def group_size(self) -> int | None:
        return self.weights.get("group_size") if self.weights.get("strategy") == "group" else None

    @property
    def label(self) -> str:
        part = f"g{self.group_size}" if self.weights.get("strategy") == "group" else "channel"
        return f"int{self.weights.get('num_bits')}-{part}-{'sym' if self.symmetric else 'asym'}"


def _config_groups(qc: dict | None, problems: _Listing, judge: "_Judge") -> tuple[list[_Group], list[str]]:
    """(groups, ignore) from config.json's quantization_config, reporting what makes it unloadable."""
    if not isinstance(qc, dict):
        problems.add("config.json has no quantization_config, but the shards hold packed weights")
        return [], []
    if qc.get("quant_method") != "compressed-tensors":
        problems.add(f"quantization_config.quant_method is {qc.get('quant_method')!r}, not 'compressed-tensors'")
    top_format = qc.get("format")
    if top_format not in ("pack-quantized", "mixed-precision"):
        problems.add(f"quantization_config.format is {top_format!r}; packed INT4 weights need 'pack-quantized'")
    if qc.get("quantization_status") != "compressed":
        problems.add(f"quantization_config.quantization_status is {qc.get('quantization_status')!r}, not "
                     "'compressed': loaders would not decompress the packed weights")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        problems.add("quantization_config.ignore must be a list of module names or 're:' patterns")
        ignore = []
    groups = []
    raw = qc.get("config_groups")
    if not isinstance(raw, dict) or not raw:
        problems.add("quantization_config.config_groups is missing or empty")
        raw = {}
    for gname, g in raw.items():
        where = f"quantization_config.config_groups.{gname}"
        if not isinstance(g, dict) or not isinstance(g.get("targets"), list) or not isinstance(g.get("weights"), dict):
            problems.add(f"{where} must hold `targets` (a list) and `weights` (an object)")
            continue
        w = g["weights"]
        ok = True
        fmt = g.get("format", top_format) if top_format == "mixed-precision" else top_format
        if fmt != "pack-quantized":
            continue  # another format (e.g. FP8 float-quantized): not packed INT4, not checked here
        if w.get("num_bits") != 4 or w.get("type") != "int":
            problems.add(f"{where}.weights: num_bits {w.get('num_bits')!r} type {w.get('type')!r}; this version "
                         "checks INT4 (num_bits 4, type int) pack-quantized weights")
            ok = False
        strategy = w.get("strategy")
        if strategy == "group":
            gs = w.get("group_size")
            if type(gs) is not int or gs <= 0:
                problems.add(f"{where}.weights.group_size must be a positive integer, got {gs!r}")
                ok = False
        elif strategy != "channel":
            problems.add(f"{where}.weights.strategy is {strategy!r}; pack-quantized INT4 uses group or channel")
            ok = False
        err = judge.args_error(w)
        if err:
            problems.add(f"{where}.weights: compressed-tensors rejects it: {err}")
            ok = False
        groups.append(_Group(gname, tuple(t for t in g["targets"] if isinstance(t, str)), w, ok))
    return groups, ignore


def _group_for(module: str, groups: list[_Group]) -> tuple[_Group | None, str | None]:
    """compressed-tensors' precedence: an exact name, then a `re:` pattern, then a class name (packed
    modules are Linear layers). Returns (group, problem)."""
    for level in ("exact", "regex", "class"):
        if level == "exact":
            hit = [g for g in groups if module in g.targets]
        elif level == "regex":
            hit = [g for g in groups if any(t.startswith("re:") and matches(t, module) for t in g.targets)]
        else:
            hit = [g for g in groups if "Linear" in g.targets]
        if len(hit) > 1:
            return None, (f"{module}: matched by several config groups at the same precedence "
                          f"({', '.join(g.name for g in hit)})")
        if hit:
            return hit[0], None
    return None, f"{module}: has weight_packed but no config group targets it"


def _expected(group: _Group, n: int, k: int) -> dict[str, tuple]:
    """suffix -> expected shape for a module with weight [n, k] under `group`."""
    gs = group.group_size
    ng = 1 if gs is None else math.ceil(k / gs)
    out = {"weight_packed": (n, math.ceil(k / 8)), "weight_scale": (n, ng), "weight_shape": (2,)}
    if not group.symmetric:
        out["weight_zero_point"] = (math.ceil(n / 8), ng)
    if group.weights.get("actorder") == "group":
        out["weight_g_idx"] = (k,)
    return out


def _header_problems(module: str, infos: dict, group: _Group) -> list[str]:
    """Problems visible in the headers alone (before weight_shape's value is known): presence and dtypes."""
    out = []
    for suffix, dtypes, what in (("weight_packed", (torch.int32,), "int32"),
                                 ("weight_scale", SCALE_DTYPES, "bfloat16 or float16"),
                                 ("weight_shape", (torch.int64,), "int64")):
        i = infos.get(suffix)
        if i is None:
            out.append(f"{module}.{suffix}: missing")
        elif i.dtype not in dtypes:
            out.append(f"{module}.{suffix}: dtype {str(i.dtype).removeprefix('torch.')}, expected {what}")
    zp = infos.get("weight_zero_point")
    if group.symmetric and zp is not None:
        out.append(f"{module}.weight_zero_point: present, but {group.name} is symmetric")
    if not group.symmetric:
        if zp is None:
            out.append(f"{module}.weight_zero_point: missing ({group.name} is asymmetric)")
        elif zp.dtype != torch.int32:
            out.append(f"{module}.weight_zero_point: dtype {str(zp.dtype).removeprefix('torch.')}, expected int32")
    gi = infos.get("weight_g_idx")
    if group.weights.get("actorder") == "group":
        if gi is None:
            out.append(f"{module}.weight_g_idx: missing (actorder 'group')")
        elif gi.dtype != torch.int32:
            out.append(f"{module}.weight_g_idx: dtype {str(gi.dtype).removeprefix('torch.')}, expected int32")
    elif gi is not None:
        out.append(f"{module}.weight_g_idx: present, but {group.name} has actorder {group.weights.get('actorder')!r}")
    ws = infos.get("weight_shape")
    if ws is not None and tuple(ws.shape) != (2,):
        out.append(f"{module}.weight_shape: shape {list(ws.shape)}, expected [2]")
    return out


class _Reader:
    """Lazy tensor reads across the shards of one checkpoint; `release()` drops every mapping."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.files: dict[str, SafetensorsFile] = {}

    def get(self, name: str) -> torch.Tensor:
        shard = self.ck.location[name]
        f = self.files.get(shard)
        if f is None:
            f = self.files[shard] = SafetensorsFile(self.ck.shard(shard).header)
        return f.get(name)

    def release(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


class _Judge:
    """compressed-tensors' own decompressor, when importable; else only our unpacking is exercised."""

    def __init__(self):
        self.ct = None
        self.name = "quantkit (compressed-tensors not importable)"
        self._schemes: dict[str, Any] = {}
        if importlib.util.find_spec("compressed_tensors") is None:
            return
        try:
            from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
            from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        except ImportError:  # an incompatible version: fall back to our own unpack
            return
        import compressed_tensors

        self.ct = (PackedQuantizationCompressor, QuantizationArgs, QuantizationScheme)
        self.name = f"compressed-tensors {getattr(compressed_tensors, '__version__', '?')}"

    def args_error(self, weights: dict) -> str | None:
        if self.ct is None:
            return None
        try:
            self.ct[1](**weights)
        except Exception as e:  # pydantic ValidationError and friends: the message is the finding
            return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return None

    def decompress(self, local: dict[str, torch.Tensor], group: _Group) -> torch.Tensor | None:
        if self.ct is None:
            return None
        compressor, args, scheme_cls = self.ct
        scheme = self._schemes.get(group.name)
        if scheme is None:
            scheme = self._schemes[group.name] = scheme_cls(targets=["Linear"], weights=args(**group.weights))
        return compressor.decompress(dict(local), scheme)["weight"]


def dequantize_module(t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our dequantization of one pack-quantized module from its tensors (local names: weight_packed,
    weight_scale, weight_shape, optional weight_zero_point / weight_g_idx): w = (q - zp) * scale."""
    n, k = (int(v) for v in t["weight_shape"].tolist())
    q = unpack_int4(t["weight_packed"], k)  # [N, K] int8
    scale = t["weight_scale"]  # [N, G]
    zp = t.get("weight_zero_point")
    if zp is not None:  # packed along the output dim: [ceil(N/8), G] -> [N, G]
        zp = unpack_int4(zp.transpose(0, 1).contiguous(), n).transpose(0, 1)
    g_idx = t.get("weight_g_idx")
    if g_idx is not None:  # actorder "group": column j uses group g_idx[j]
        cols = g_idx.long()
        qf = q.float() if zp is None else q.float() - zp.float()[:, cols]
        return (qf * scale.float()[:, cols]).to(dtype)
    return dequantize(q, scale, zp, dtype=dtype)


def _tensor_pass(ck: Checkpoint, manifest: dict | None, ref_ck: Checkpoint | None, judge: _Judge,
                 problems: _Listing, sqnr: dict, drift: list, kernel_modules: list, *, want_kernels: bool,
                 say) -> int:
    """Format checks of every quantized module, and (with a reference) its weight SQNR, in one read
    of each shard. Returns the number of quantized modules seen."""
    qc = ck.quantization_config
    groups, ignore = _config_groups(qc, problems, judge) if (qc is not None or _has_packed(ck)) else ([], [])
    by_module: dict[str, dict] = {}
    for name in ck.location:
        module, _, suffix = name.rpartition(".")
        if suffix in PACKED_SUFFIXES:
            by_module.setdefault(module, {})[suffix] = ck.info(name)
    quantized = sorted(m for m, s in by_module.items() if "weight_packed" in s)
    qset = set(quantized)
    for m, s in sorted(by_module.items()):
        if m not in qset and any(x in s for x in ("weight_shape", "weight_zero_point", "weight_g_idx")):
            problems.add(f"{m}: has {', '.join(sorted(s))} but no weight_packed")
        elif m not in qset and "weight_scale" in s and f"{m}.weight" not in ck.location:
            problems.add(f"{m}.weight_scale: no weight_packed or weight beside it")
    _check_dense_modules(ck, groups, ignore, qset, problems)
    if qc is None and not quantized:
        problems.add("config.json has no quantization_config and no shard holds weight_packed: "
                     "this is not a quantized checkpoint")
    elif isinstance(qc, dict):
        _check_kv_scales(ck, qc, problems)
    mtable = (manifest or {}).get("tensors") if isinstance((manifest or {}).get("tensors"), dict) else {}
    reader = _Reader(ck)
    ref_reader = _Reader(ref_ck) if ref_ck is not None else None
    shard_of = {m: ck.location[f"{m}.weight_packed"] for m in quantized}
    try:
        for si, shard in enumerate(ck.shards):
            todo = [m for m in quantized if shard_of[m] == shard.name]
            if todo:
                say(f"format{' + sqnr' if ref_reader else ''}: {shard.name} ({si + 1}/{len(ck.shards)}, "
                    f"{len(todo)} modules)")
            for m in todo:
                _check_module(m, by_module[m], ck, groups, ignore, mtable, reader, ref_reader, judge,
                              problems, sqnr, drift, kernel_modules if want_kernels else None)
            reader.release()  # bounded memory: the mapped pages of one shard at a time
            if ref_reader is not None:
                ref_reader.release()
    finally:
        reader.release()
        if ref_reader is not None:
            ref_reader.release()
    return len(quantized)


def _check_kv_scales(ck: Checkpoint, qc: dict, problems: _Listing) -> None:
    """FP8 KV-cache scales: `model.layers.L.self_attn.{k,v}_scale` float32 [1] ("tensor") or
    [num_kv_heads, 1, 1] ("attn_head") for every layer iff `kv_cache_scheme` is set (docs/formats.md)."""
    present = sorted(n for n in ck.location if n.endswith((".self_attn.k_scale", ".self_attn.v_scale")))
    scheme = qc.get("kv_cache_scheme")
    if scheme is None:
        if present:
            problems.add(f"{present[0]}: KV-cache scales present but quantization_config.kv_cache_scheme is null")
        return
    if not isinstance(scheme, dict):
        problems.add("quantization_config.kv_cache_scheme must be an object or null")
        return
    cfg = ck.config.get("text_config") if isinstance(ck.config.get("text_config"), dict) else ck.config
    layers = cfg.get("num_hidden_layers")
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if scheme.get("strategy") == "tensor":
        want = {(1,)}
    elif scheme.get("strategy") == "attn_head":
        want = {(heads, 1, 1)} if isinstance(heads, int) else None
        if "kv_lora_rank" in cfg:  # MLA caches one latent per token: one scale
            want = {(1,)} | (want or set())
    else:
        problems.add(f"quantization_config.kv_cache_scheme.strategy is {scheme.get('strategy')!r}; "
                     "expected 'tensor' or 'attn_head'")
        return
    prefix = next((n.split(".layers.")[0] for n in ck.location if ".layers." in n), "model")
    for layer in range(layers if isinstance(layers, int) else 0):
        for kind in ("k_scale", "v_scale"):
            name = f"{prefix}.layers.{layer}.self_attn.{kind}"
            info = ck.location.get(name) and ck.info(name)
            if not info:
                problems.add(f"{name}: missing (kv_cache_scheme is set)")
            elif info.dtype != torch.float32 or (want is not None and tuple(info.shape) not in want):
                problems.add(f"{name}: {str(info.dtype).removeprefix('torch.')}{list(info.shape)}, expected float32 "
                             f"{' or '.join(str(list(w)) for w in sorted(want or []))}")


def _has_packed(ck: Checkpoint) -> bool:
    return any(n.endswith(".weight_packed") for n in ck.location)


_EMBEDDING = re.compile(r".*(embed|wte|wpe)", re.IGNORECASE)


def _check_dense_modules(ck: Checkpoint, groups: list[_Group], ignore: list[str], qset: set, problems) -> None:
    """A 2-D float weight left dense must not be targeted: a loader would look for weight_packed."""
    if not groups:
        return
    for name in ck.location:
        if not name.endswith(".weight"):
            continue
        m = name[: -len(".weight")]
        info = ck.info(name)
        if m in qset:
            problems.add(f"{m}: holds both weight and weight_packed")
            continue
        if len(info.shape) != 2 or not info.dtype.is_floating_point or info.dtype.itemsize == 1:
            continue
        if any(matches(p, m) for p in ignore):
            continue
        g, _ = _group_for(m, groups)
        by_name = g is not None and (m in g.targets or any(t.startswith("re:") and matches(t, m) for t in g.targets))
        # a ["Linear"] class target cannot see module classes here: embeddings are not Linear, skip them
        if by_name or (g is not None and not _EMBEDDING.match(m)):
            problems.add(f"{m}.weight: stored unquantized, but {g.name} targets it and it is not in ignore "
                         "(loaders would expect weight_packed)")


def _check_module(m: str, infos: dict, ck: Checkpoint, groups, ignore, mtable: dict, reader: _Reader,
                  ref_reader: _Reader | None, judge: _Judge, problems: _Listing, sqnr: dict, drift: list,
                  kernel_modules: list | None) -> None:
    if any(matches(p, m) for p in ignore):
        problems.add(f"{m}: quantized (has weight_packed) but listed in quantization_config.ignore")
    group, why = _group_for(m, groups)
    if group is None:
        if groups or ck.quantization_config is not None:
            problems.add(why)
        return
    if not group.ok:
        return  # the group's config problem is already reported once
    found = _header_problems(m, infos, group)
    for p in found:
        problems.add(p)
    if found:
        return
    shape = reader.get(f"{m}.weight_shape")
    n, k = (int(v) for v in shape.tolist())
    if n <= 0 or k <= 0:
        problems.add(f"{m}.weight_shape: holds {[n, k]}, expected positive [out, in]")
        return
    bad = False
    for suffix, want in _expected(group, n, k).items():
        have = tuple(infos[suffix].shape)
        if have != want:
            problems.add(f"{m}.{suffix}: shape {list(have)}, expected {list(want)} for weight [{n}, {k}] under "
                         f"{group.name} ({group.label})")
            bad = True
    if group.group_size is not None and k % group.group_size:
        problems.add(f"{m}: in_features {k} is not a multiple of group_size {group.group_size}")
        bad = True
    entry = mtable.get(f"{m}.weight_packed") if isinstance(mtable.get(f"{m}.weight_packed"), dict) else {}
    if entry.get("scheme") and entry["scheme"] != group.label:
        problems.add(f"{m}: the manifest records scheme {entry['scheme']}, config.json gives {group.label} "
                     f"({group.name})")
    if bad:
        return
    local = {s: reader.get(f"{m}.{s}") for s in infos}
    scale = local["weight_scale"].float()
    if not torch.isfinite(scale).all() or (scale < 0).any():
        nbad = int((~torch.isfinite(scale) | (scale < 0)).sum())
        problems.add(f"{m}.weight_scale: {nbad} non-finite or negative value(s)")
        return
    g_idx = local.get("weight_g_idx")
    if g_idx is not None and g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= scale.shape[1]):
        problems.add(f"{m}.weight_g_idx: values outside [0, {scale.shape[1]})")
        return
    mine = dequantize_module(local, torch.float32)  # [N, K]
    try:
        theirs = judge.decompress(local, group)
    except Exception as e:  # third-party code on untrusted tensors: its failure is the finding
        problems.add(f"{m}: compressed-tensors cannot decompress it: {type(e).__name__}: {str(e)[:160]}")
        theirs = None
    else:
        if theirs is not None and (tuple(theirs.shape) != (n, k) or not torch.equal(theirs, mine.to(theirs.dtype))):
            diff = (theirs.float() - mine).abs().max().item() if tuple(theirs.shape) == (n, k) else float("nan")
            problems.add(f"{m}: compressed-tensors decompresses it differently from quantkit "
                         f"(shape {list(theirs.shape)}, max |diff| {diff:.3g})")
    if kernel_modules is not None and len(kernel_modules) < KERNEL_MODULES:
        kernel_modules.append((m, local))
    if ref_reader is not None:
        if entry.get("method") == "awq":
            # AWQ folds per-channel scales into the norm, router and up_proj: the stored weight is the
            # scaled one, so it is compared with the reference at the model level (KL, top-1), not here
            return
        ref = _reference_weight(m, entry, ref_reader)
        if isinstance(ref, str):
            problems.add(ref)
            return
        if tuple(ref.shape) != (n, k):
            problems.add(f"{m}: the reference weight is {list(ref.shape)}, weight_shape says {[n, k]}")
            return
        db = float(sqnr_db(ref, mine))
        # exact (inf) or an all-zero reference and weight (nan) -> the cap; all-zero reference only -> -cap
        sqnr[m] = SQNR_CAP_DB if math.isnan(db) else max(-SQNR_CAP_DB, min(SQNR_CAP_DB, db))
        recorded = entry.get("sqnr_db")
        if isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
            drift.append((m, db, float(recorded)))


def _reference_weight(m: str, entry: dict, ref_reader: _Reader) -> torch.Tensor | str:
    """The reference's float32 weight for module `m`, located through the manifest's `source_tensor` /
    `source_slice` (fused 3-D experts), else `m.weight`; block-FP8 references are dequantized. A string
    is a problem to report."""
    ck = ref_reader.ck
    src = entry.get("source_tensor") if isinstance(entry.get("source_tensor"), str) else f"{m}.weight"
    if src not in ck.location:
        return f"{m}: the reference holds no tensor {src}"
    w = ref_reader.get(src)
    sl = entry.get("source_slice")
    if isinstance(sl, dict):
        e, rows = sl.get("expert"), sl.get("rows")
        if w.ndim != 3 or type(e) is not int or not isinstance(rows, list) or len(rows) != 2 or not 0 <= e < w.shape[0]:
            return f"{m}: the manifest's source_slice {sl} does not fit reference tensor {src} {list(w.shape)}"
        w = w[e, rows[0]:rows[1]]
    if w.dtype.itemsize == 1 and w.dtype.is_floating_point:  # block FP8 (DeepSeek-V3 / Kimi K2 / GLM releases)
        sname = f"{src}_scale_inv"
        if sname not in ck.location or sl is not None:
            return f"{m}: the reference weight {src} is FP8 without a {sname} block scale"
        bs = (ck.quantization_config or {}).get("weight_block_size") or [128, 128]
        s = ref_reader.get(sname).float()  # [ceil(N/b0), ceil(K/b1)]; multiply despite the name
        n, k = w.shape
        return w.float() * s.repeat_interleave(bs[0], 0)[:n].repeat_interleave(bs[1], 1)[:, :k]
    return w.float()


# ---- 3. numerics ---------------------------------------------------------------------------------------
def _check_reference(ref_ck: Checkpoint, manifest: dict | None) -> Check:
    """Is `reference` the source the manifest records? Names, sizes and the config hash (shard contents
    are not hashed: that would read the whole source)."""
    src = (manifest or {}).get("source")
    if not isinstance(src, dict) or not isinstance(src.get("shards"), list):
        return Check("reference", None, "the manifest records no source: the reference cannot be matched to it")
    want = {s.get("name"): s.get("size") for s in src["shards"] if isinstance(s, dict)}
    have = {s.name: s.size for s in ref_ck.shards}
    diffs = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            diffs.append(f"{name} missing")
        elif name not in want:
            diffs.append(f"{name} not in the manifest's source")
        elif want[name] != have[name]:
            diffs.append(f"{name} is {have[name]} B, the source was {want[name]} B")
    cfg = hashlib.sha256((ref_ck.root / "config.json").read_bytes()).hexdigest()
    if src.get("config_sha256") and cfg != src["config_sha256"]:
        diffs.append("config.json differs from the source's")
    if diffs:
        return Check("reference", False, "the reference is not the source this checkpoint was converted from: "
                     + "; ".join(diffs[:5]) + (f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else ""))
    return Check("reference", True, f"shard names, sizes and config.json match the manifest's source "
                 f"({len(have)} shards; contents not hashed)")


def _layer_key(module: str) -> int | None:
    m = _LAYER.search(module)
    return int(m[1]) if m else None


def _layer_summary(sqnr: dict[str, float], min_db: float) -> list[dict]:
    by_layer: dict[int | None, list[tuple[float, str]]] = {}
    for m, db in sqnr.items():
        by_layer.setdefault(_layer_key(m), []).append((db, m))
    out = []
    for layer in sorted(by_layer, key=lambda x: (x is None, x or 0)):
        vals = by_layer[layer]
        worst = min(vals)
        mean = sum(v for v, _ in vals) / len(vals)
        out.append({"layer": layer, "min_sqnr_db": round(worst[0], 3), "mean_sqnr_db": round(mean, 3),
                    "modules": len(vals),
                    "worst_module": worst[1], "ok": bool(worst[0] >= min_db)})
    return out


def _sqnr_check(sqnr: dict, layers: list[dict], modules: int, t: Thresholds, awq: int = 0) -> Check:
    if not modules:
        if awq:
            return Check("weight_sqnr", None, f"{awq} AWQ module(s) store scaled weights: compared with the "
                                              "reference at the model level (KL, top-1) only")
        return Check("weight_sqnr", None, "the checkpoint holds no pack-quantized module")
    if not sqnr:
        return Check("weight_sqnr", False, "no quantized module could be compared with the reference")
    bad = [lay for lay in layers if not lay["ok"]]
    worst = min(layers, key=lambda lay: lay["min_sqnr_db"])
    if bad:
        named = ", ".join(f"layer {lay['layer']} ({lay['worst_module']}: {lay['min_sqnr_db']:.1f} dB)"
                          for lay in bad[:5])
        return Check("weight_sqnr", False, f"{len(bad)} layer(s) below {t.min_sqnr_db} dB: {named}",
                     worst["min_sqnr_db"], t.min_sqnr_db)
    return Check("weight_sqnr", True, f"{len(sqnr)} modules, worst {worst['min_sqnr_db']:.2f} dB "
                 f"({worst['worst_module']})", worst["min_sqnr_db"], t.min_sqnr_db)


def _drift_check(drift: list[tuple[str, float, float]], t: Thresholds) -> Check:
    if not drift:
        return Check("sqnr_vs_manifest", None, "the manifest records no per-module SQNR")
    off = sorted(((abs(now - rec), m, now, rec) for m, now, rec in drift), reverse=True)
    worst = off[0]
    bad = [o for o in off if not o[0] <= t.max_sqnr_drift_db]
    if bad:
        named = ", ".join(f"{m} ({now:.2f} dB now, {rec:.2f} recorded)" for _, m, now, rec in bad[:3])
        return Check("sqnr_vs_manifest", False, f"{len(bad)} module(s) differ from the SQNR recorded at conversion: "
                     f"{named}", round(worst[0], 4), t.max_sqnr_drift_db)
    return Check("sqnr_vs_manifest", True, f"{len(drift)} modules match the recorded SQNR "
                 f"(max drift {worst[0]:.4f} dB)", round(worst[0], 4), t.max_sqnr_drift_db)


def _token_data(ref_ck: Checkpoint, dataset, num_samples: int, seq_len: int, seed: int):
    """(samples: list of int64 [T] tensors, description of the data).

    With `dataset`: quantkit.calib.data reads it (its formats, its tokenizer rules). Without: the shipped
    calibration set through the reference's tokenizer (built-in text if that set is unavailable), or
    seeded random ids when the reference has no tokenizer (the tiny test models)."""
    vocab = _vocab_size(ref_ck.config)
    calib = importlib.import_module("quantkit.calib.data") if importlib.util.find_spec("quantkit.calib.data") else None
    if calib is not None and not hasattr(calib, "load_calibration_data"):
        calib = None
    if dataset is not None:
        if calib is None:
            raise QuantkitError("a dataset needs quantkit.calib.data, which this installation lacks",
                                hint="omit --dataset to use the built-in token data")
        return _calib_samples(calib, dataset, calib.load_tokenizer(ref_ck.root), vocab, num_samples, seq_len, seed)
    tok, notes = None, []
    if calib is not None:
        try:
            tok = calib.load_tokenizer(ref_ck.root)
        except QuantkitError as e:  # e.g. a remote-code tokenizer: random ids still compare the two models
            notes.append(f"the reference's tokenizer could not be loaded ({e.message}); using random token ids")
    if tok is not None:
        try:
            return _calib_samples(calib, None, tok, vocab, num_samples, seq_len, seed)
        except QuantkitError as e:  # the shipped set is missing or too small: fall back to built-in text
            notes.append(f"the shipped calibration set is unusable ({e.message}); using built-in text")
        ids = [i for i in tok(_BUILTIN_TEXT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab] or [0, 1]
        step = 37  # each sample starts at a different offset of the tiled text
        need = seq_len + (num_samples - 1) * step
        stream = torch.tensor((ids * (need // len(ids) + 1))[:need], dtype=torch.long)
        samples = [stream[i * step: i * step + seq_len].clone() for i in range(num_samples)]
        return samples, {"source": "quantkit built-in text", "tokenizer": type(tok).__name__,
                         "num_samples": num_samples, "seq_len": seq_len, "seed": seed, "notes": notes}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_samples, seq_len), generator=g)  # [N, L]
    notes = notes or ["the reference has no tokenizer: seeded random token ids (fine for random-weight test "
                      "models, weak evidence for a real one: pass a dataset)"]
    return list(ids), {"source": f"random token ids (seed {seed})", "tokenizer": None, "num_samples": num_samples,
                       "seq_len": seq_len, "seed": seed, "notes": notes}


def _calib_samples(calib, dataset, tok, vocab: int, num_samples: int, seq_len: int, seed: int):
    with warnings.catch_warnings(record=True) as caught:  # its CalibrationWarnings become report notes
        warnings.simplefilter("always")
        cd = calib.load_calibration_data(dataset, tokenizer=tok, vocab_size=vocab, num_samples=num_samples,
                                         seq_len=seq_len, seed=seed)
    samples = [s.long().reshape(-1) for s in cd.samples if s.numel() >= 2]
    if not samples:
        raise QuantkitError(f"dataset {str(dataset)!r} gives no sample of 2 or more tokens")
    info = cd.describe() if hasattr(cd, "describe") else {"source": str(dataset)}
    notes = list(info.get("notes") or [])
    info["notes"] = notes + [str(w.message) for w in caught if str(w.message) not in notes]
    return samples, info


def _vocab_size(config: dict) -> int:
    v = config.get("vocab_size")
    if not isinstance(v, int):
        v = (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(v, int) or v <= 0:
        raise QuantkitError("the reference's config.json has no vocab_size", hint="pass a dataset with input_ids")
    return v


def _load(path: Path, dev: torch.device):
    from .testing import load_model

    return load_model(path, torch.bfloat16).eval().to(dev)


def _model_metrics(ref_dir: Path, q_dir: Path, samples: list[torch.Tensor], dev: torch.device, gen_tokens: int,
                   t: Thresholds, say) -> tuple[dict, dict | None, list[Check]]:
    """Both models in bf16 (transformers keeps the decompressed experts in the scale dtype) on `samples`."""
    import torch.nn.functional as F

    names = ("kl_divergence", "top1_agreement", "perplexity_ratio", "generation_agreement")
    say("numerics: loading the reference model")
    try:
        ref = _load(ref_dir, dev)
    except Exception as e:  # transformers' errors are many and unnamed
        raise QuantkitError(f"transformers cannot load the reference {str(ref_dir)!r}: {type(e).__name__}: "
                            f"{str(e)[:160]}", hint="pass a checkpoint transformers can load") from None
    say("numerics: loading the quantized model (compressed-tensors decompresses it)")
    try:
        qnt = _load(q_dir, dev)
    except Exception as e:  # an unloadable output is a finding, not a crash
        del ref
        why = f"transformers cannot load the quantized checkpoint: {type(e).__name__}: {str(e)[:160]}"
        return {}, None, [Check(n, False, why) for n in names]

    vocab = None
    kl_sum = top1_sum = nll_ref = nll_q = 0.0
    positions = targets = 0
    say(f"numerics: logits on {len(samples)} samples")
    with torch.no_grad():
        for batch in _batches(samples, ref.config):
            ids = batch.to(dev)  # [B, L]
            la = F.log_softmax(ref(ids).logits.float(), -1)  # [B, L, V]
            lb = F.log_softmax(qnt(ids).logits.float(), -1)
            vocab = la.shape[-1]
            kl_sum += float((la.exp() * (la - lb)).sum(-1).double().sum())  # KL(ref || quant) per position
            top1_sum += float((la.argmax(-1) == lb.argmax(-1)).double().sum())
            positions += la.shape[0] * la.shape[1]
            nxt = ids[:, 1:, None]
            nll_ref -= float(la[:, :-1].gather(-1, nxt).double().sum())
            nll_q -= float(lb[:, :-1].gather(-1, nxt).double().sum())
            targets += nxt.numel()
        kl = kl_sum / positions
        top1 = top1_sum / positions
        ppl_r = math.exp(nll_ref / targets) if nll_ref / targets < 700 else float("inf")
        ppl_q = math.exp(nll_q / targets) if nll_q / targets < 700 else float("inf")
        generation = None
        if gen_tokens > 0:
            say(f"numerics: greedy generation ({gen_tokens} tokens)")
            generation = _generation(ref, qnt, samples, gen_tokens, dev)
    metrics = {"kl_divergence": _finite(kl), "top1_agreement": _finite(top1),
               "perplexity_reference": _finite(ppl_r), "perplexity_quantized": _finite(ppl_q)}
    checks = [
        _limit("kl_divergence", kl, t.max_kl, upper=True, what=f"mean next-token KL over {positions} positions"),
        _limit("top1_agreement", top1, t.min_top1, upper=False, what=f"top-1 agreement over {positions} positions"),
        _limit("perplexity_ratio", ppl_q / ppl_r if math.isfinite(ppl_r) and ppl_r > 0 else float("nan"),
               t.max_ppl_ratio, upper=True, what=f"perplexity {ppl_q:.4g} vs reference {ppl_r:.4g} (vocab {vocab})"),
    ]
    if generation is None:
        checks.append(Check("generation_agreement", None, "generation_tokens is 0: skipped"))
    else:
        checks.append(_limit("generation_agreement", generation["agreement"], t.min_generation_agreement,
                             upper=False, what=f"{generation['prompts']} prompts x {gen_tokens} greedy tokens, "
                                               f"mean matching prefix {generation['matching_prefix']:.2f}"))
    return metrics, generation, checks


def _limit(name: str, value: float, limit: float, *, upper: bool, what: str) -> Check:
    if not math.isfinite(value):
        return Check(name, False, f"{what}: not finite", None, limit)
    ok = value <= limit if upper else value >= limit
    return Check(name, ok, f"{what}: {value:.4g} ({'<=' if upper else '>='} {limit} {'ok' if ok else 'FAILED'})",
                 float(value), limit)


def _batches(samples: list[torch.Tensor], config, max_logit_bytes: int = 256 << 20):
    """Equal-length samples stacked into [B, L] batches whose float32 logits stay under max_logit_bytes."""
    vocab = getattr(config, "vocab_size", None) or 1
    by_len: dict[int, list[torch.Tensor]] = {}
    for s in samples:
        by_len.setdefault(int(s.numel()), []).append(s)
    for length, group in by_len.items():
        per = max(1, max_logit_bytes // (length * vocab * 4 * 3))  # log-probs of both models + a temporary
        for i in range(0, len(group), per):
            yield torch.stack(group[i:i + per])


def _generation(ref, qnt, samples: list[torch.Tensor], n: int, dev: torch.device) -> dict:
    """Greedy-generate n tokens with the reference from up to 4 prompts, then score the quantized model
    teacher-forced on that continuation: `agreement` = fraction of steps where its greedy token equals the
    reference's (immune to the divergence cascade of free-running generation); `matching_prefix` =
    mean fraction of tokens until the first disagreement, i.e. what free-running generation would share."""
    from transformers import GenerationConfig

    prompts = [s[: max(1, min(32, s.numel() // 2))] for s in samples[:4]]
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    agree = prefix = 0.0
    for p in prompts:
        ids = p.reshape(1, -1).to(dev)
        full = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)  # [1, P + n]
        cont = full[0, ids.shape[1]:]
        pred = qnt(full[:, :-1]).logits[0, ids.shape[1] - 1:].argmax(-1)  # quantized greedy choice per step
        same = (pred == cont).double()
        agree += float(same.mean())
        prefix += float(same.cumprod(0).sum()) / n
    return {"tokens": n, "prompts": len(prompts), "agreement": agree / len(prompts),
            "matching_prefix": prefix / len(prompts)}


def _kernel_check(modules: list[tuple[str, dict]], dev: torch.device) -> Check:
    """The runtime's Triton INT4 GEMM against its torch reference on a few real modules."""
    from .runtime.int4 import PackedInt4, int4_gemm, int4_gemm_ref

    worst, worst_m = 0.0, None
    for m, t in modules:
        w = PackedInt4.from_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                    t.get("weight_zero_point")).to(dev)
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
        want = int4_gemm_ref(x, w).float()
        got = int4_gemm(x, w, backend="triton").float()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not err <= worst:
            worst, worst_m = err, m
    ok = worst <= KERNEL_RTOL
    return Check("kernels", ok, f"triton INT4 GEMM vs torch on {len(modules)} modules: max relative error "
                 f"{worst:.2e}{f' ({worst_m})' if worst_m else ''}", worst, KERNEL_RTOL)
