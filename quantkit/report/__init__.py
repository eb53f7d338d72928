"""`quantkit report`: one self-contained HTML page that shows where a converted checkpoint's error went.

Reads what `convert` wrote and nothing else: `quantkit_manifest.json` (per-module SQNR, calibration
tokens and fallbacks), `config.json`, the shards' headers (bytes per tensor) and the KV-scale tensors
(a few floats per layer). Draws, each in its own section with a caption:
- per MoE layer x routed expert, the SQNR of the expert's worst projection (one heatmap), and per
  layer the min / median / max SQNR of every quantized module (experts or not);
- per MoE layer x expert, the calibration tokens routed to it, fallbacks and starved experts marked;
- per layer (and per KV head with `attn_head`), the FP8 KV-cache scales k and v;
- bytes by scheme, labelled as `quantkit inspect` labels them;
- `quantkit verify`'s checks, metrics and per-layer SQNR, when its `--json` object is passed or
  `verify.json` lies in the output directory.
It is not a verifier: it dequantizes no tensor and loads no model (`verify` measures, this shows).

Plotting: matplotlib rendered to inline SVG: well maintained, no JavaScript, nothing fetched, and
byte-deterministic with a fixed `svg.hashsalt` and no date. Heatmaps are drawn with
`interpolation="none"`, i.e. one embedded PNG at one pixel per cell, so 61 layers x 384 experts is a
single element, not 23k rectangles.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFound, ConfigError
from ..read.checkpoint import Checkpoint, read_json_file, read_manifest
from ..pack.manifest import MANIFEST_NAME
from .model import DEFAULT_OUTPUT_NAME, SQNR_CAP_DB, VERIFY_NAME, _number, _shown, collect_modules
from .page import _Page, _mpl
from .timeline import read_timeline, section_timeline
from .sections import (_section_bytes, _section_fit, _section_input_scales, _section_kv, _section_sqnr,
                       _section_tables, _section_tokens, _section_verify)


# ---- result ------------------------------------------------------------------------------------------
@dataclass
class ReportResult:
    output: str  # the HTML file written
    figures: list[str]  # ids of the <svg> elements drawn, in page order
    bytes: int  # size of the HTML file
    skipped: dict[str, str] = field(default_factory=dict)  # section -> why it shows no figure
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Contract keys `output`, `figures`, `bytes`, then extras."""
        return {"output": self.output, "figures": list(self.figures), "bytes": self.bytes,
                "skipped": dict(self.skipped), "seconds": round(self.seconds, 3)}


# ---- entry point --------------------------------------------------------------------------------------
def build_report(qmodel_dir: str | os.PathLike, reference: str | os.PathLike | None = None,
                 output: str | os.PathLike | None = None,
                 verify_json: dict | str | os.PathLike | None = None,
                 timeline: dict | str | os.PathLike | None = None) -> ReportResult:
    """Write the HTML report of the converted checkpoint in `qmodel_dir` and return what was written.

    reference: the source checkpoint, only shown (nothing is computed from it). output: the HTML path
    (default `<qmodel_dir>/quantkit_report.html`). verify_json: the object `quantkit verify --json`
    printed, or the path of a file holding it; default `<qmodel_dir>/verify.json` when present.
    timeline: what `quantkit convert --json` printed (or a file holding it, or its `timeline` object): adds
    the per-rank, per-phase section (report/timeline.py).
    """
    # fail early, before reading anything, when the plotting library is missing; and never read `$...$` in a
    # scheme or module name (the manifest is input) as mathtext: no parse errors, no silent math rendering
    with _mpl().rc_context({"text.parse_math": False}):
        return _build_report(qmodel_dir, reference, output, verify_json, timeline)


def _build_report(qmodel_dir, reference, output, verify_json, timeline=None) -> ReportResult:
    t0 = time.perf_counter()
    root = Path(qmodel_dir)
    ck = Checkpoint.open(root)  # CheckpointNotFound / ConfigMissing / header errors for unusable input
    manifest = _read_manifest(root)
    if reference is not None and not Path(reference).is_dir():
        raise CheckpointNotFound(f"reference checkpoint directory {str(reference)!r} does not exist",
                                 hint="pass the source directory the output was converted from, or omit --reference")
    verify_doc, verify_origin = _read_verify(root, verify_json)
    ranks = read_timeline(timeline) if timeline is not None else None  # checked before anything is drawn

    tensors = manifest.get("tensors") or {}
    modules = collect_modules(tensors)
    threshold = _sqnr_threshold(verify_doc)
    page = _Page()
    page.header(root, ck, manifest, reference, verify_origin)
    _section_sqnr(page, modules, threshold)
    _section_tokens(page, manifest, modules)
    _section_kv(page, ck, tensors)
    _section_bytes(page, ck, tensors)
    _section_fit(page, manifest)
    _section_verify(page, verify_doc, verify_origin)
    if ranks is not None:
        section_timeline(page, ranks)
    _section_tables(page, modules, manifest)
    _section_input_scales(page, manifest)
    doc = page.render(title=f"quantkit report: {root.resolve().name}")

    out = Path(output) if output is not None else root / DEFAULT_OUTPUT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    data = doc.encode("utf-8")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ReportResult(output=str(out), figures=page.figures, bytes=len(data), skipped=page.skipped,
                        seconds=time.perf_counter() - t0)


# The report parses the whole manifest in Python (~80 ms and several bytes of RAM per byte): it reads up to
# 256 MiB (Kimi K2's is ~110 MB) unless QUANTKIT_REPORT_MAX_MANIFEST_MB says more; convert and verify keep
# pack/manifest.py's own limit.
REPORT_MAX_MANIFEST_BYTES = 256 << 20
REPORT_MANIFEST_ENV = "QUANTKIT_REPORT_MAX_MANIFEST_MB"
REPORT_MAX_MANIFEST_MB_BOUND = 1 << 16  # what it may say: 64 GiB, far above any release (~90 minutes of parsing)


def _report_manifest_limit() -> int:
    raw = os.environ.get(REPORT_MANIFEST_ENV)
    if raw is None or not raw.strip():  # unset or empty: the default
        return REPORT_MAX_MANIFEST_BYTES
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not 0 < mib <= REPORT_MAX_MANIFEST_MB_BOUND:  # NaN, inf, 1e400 (inf), 0 and negatives fail this
        raise ConfigError(f"{REPORT_MANIFEST_ENV}={raw[:40]!r} is not a number of MiB in (0, "
                          f"{REPORT_MAX_MANIFEST_MB_BOUND}]",
                          hint=f"set {REPORT_MANIFEST_ENV} to the largest manifest the report may read, in MiB "
                               f"(e.g. 512; the default is {REPORT_MAX_MANIFEST_BYTES >> 20}), or unset it")
    return max(1, int(mib * (1 << 20)))


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointNotFound(f"{root} has no {MANIFEST_NAME}: it is not an output of `quantkit convert`",
                                 hint="run `quantkit convert SRC OUT --recipe R` first; the report reads what convert wrote")
    hint = "the manifest is damaged; re-run `quantkit convert` with --overwrite"
    limit = _report_manifest_limit()
    size = path.stat().st_size
    if size > limit:  # refused from its size, before a parse that would take ~80 ms per MB
        raise ConfigError(f"{path} is {size:,} bytes, over the {limit:,} bytes the report reads (a Kimi K2 "
                          "manifest is ~110 MB)", hint=f"if this output is really that large, set "
                                                         f"{REPORT_MANIFEST_ENV}=<MiB> to read it")
    try:
        manifest = read_manifest(root, ConfigError)  # pack/manifest.py: the size limit for manifests
    except ConfigError as e:
        raise ConfigError(e.message, hint=hint) from None
    if manifest.get("status") != "complete":
        raise CheckpointNotFound(f"{path}: status is {manifest.get('status')!r}, not 'complete': the conversion "
                                 "did not finish", hint="run the same `quantkit convert` command again to resume it")
    if not isinstance(manifest.get("tensors"), dict):
        raise ConfigError(f"{path}: 'tensors' is missing or not an object", hint=hint)
    # the other fields the page reads, each of the type convert writes (a string where an object belongs is
    # this one line, not an internal error halfway through drawing)
    cal = manifest.get("calibration")
    for where, doc, key, kind in (
            ("", manifest, "recipe", dict), ("", manifest, "summary", dict), ("", manifest, "source", dict),
            ("", manifest, "calibration", dict), ("", manifest, "kv_cache", dict), ("", manifest, "notes", list),
            ("", manifest, "tool", dict), ("calibration.", cal, "expert_tokens", dict),
            ("calibration.", cal, "fallbacks", dict), ("calibration.", cal, "input_scale_fallbacks", dict),
            ("calibration.", cal, "notes", list)):
        if isinstance(doc, dict) and doc.get(key) is not None and not isinstance(doc[key], kind):
            raise ConfigError(f"{path}: '{where}{key}' is not {'a list' if kind is list else 'an object'}", hint=hint)
    return manifest


def _read_verify(root: Path, verify_json) -> tuple[dict | None, str | None]:
    hint = "pass the object `quantkit verify OUT --json` prints (or a file holding it)"
    if verify_json is None:
        path = root / VERIFY_NAME
        if not os.path.lexists(path):
            return None, None
        verify_json = path
    if isinstance(verify_json, dict):
        doc, origin = verify_json, "passed in"
    else:
        path = Path(verify_json)
        if not os.path.lexists(path):
            raise ConfigError(f"verify JSON {str(path)!r} does not exist", hint=hint)
        # every field the page draws is checked below, a 1000-digit layer number left out, not the whole file
        doc, origin = read_json_file(path, path.name, ConfigError, hint=hint, int_digits=4300), str(path)
    if not isinstance(doc, dict) or not ({"passed", "checks"} & set(doc)):
        raise ConfigError(f"verify JSON ({origin}) is not a `quantkit verify --json` object "
                          "(no 'passed' or 'checks')", hint=hint)
    _check_verify(doc, f"verify JSON ({origin})", hint)
    return doc, origin


def _finite(x) -> bool:
    """A measured number: an integer (one too large to draw is left out) or a finite float, never a boolean."""
    return not isinstance(x, bool) and (isinstance(x, int) or (isinstance(x, float) and math.isfinite(x)))


def _limit(x) -> bool:
    """A threshold: any number but NaN (verify takes `--max-kl inf` as "no limit")."""
    return not isinstance(x, bool) and (isinstance(x, int) or (isinstance(x, float) and not math.isnan(x)))


# What the page reads from each row of verify's `checks` and `layers`: field -> (test, what it must be).
# A field absent or null is "not measured" (verify writes null for a skipped check's value); `name` is required.
_OBJECT, _LIST = (lambda x: isinstance(x, dict), "an object"), (lambda x: isinstance(x, list), "a list")
_FINITE = (_finite, "a finite number or null")
_CHECK_FIELDS = {"name": (lambda x: isinstance(x, str), "a string"),
                 "ok": (lambda x: isinstance(x, bool), "true, false or null"),
                 "value": _FINITE, "threshold": (_limit, "a number or null"),
                 "detail": (lambda x: isinstance(x, str), "a string or null")}
_LAYER_FIELDS = {"layer": (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer or null"),
                 "min_sqnr_db": _FINITE, "mean_sqnr_db": _FINITE,
                 "modules": (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer or null"),
                 "worst_module": (lambda x: isinstance(x, str), "a string or null"),
                 "ok": (lambda x: isinstance(x, bool), "true, false or null")}


def _check_verify(doc: dict, where: str, hint: str) -> None:
    """Every field of a verify JSON object the page reads, of the type `quantkit verify --json` writes; the
    first that is not is one ConfigError naming it (the file is input: `"passed": "false"` is not a result)."""
    def bad(name: str, want: str, got) -> ConfigError:
        return ConfigError(f"{where}: {name!r} is not {want} (got {_shown(got)})", hint=hint)

    if "passed" in doc and not isinstance(doc["passed"], bool):
        raise bad("passed", "true or false", doc["passed"])
    for key, (test, want) in (("checks", _LIST), ("layers", _LIST), ("metrics", _OBJECT), ("generation", _OBJECT),
                              ("thresholds", _OBJECT), ("integrity", _OBJECT), ("format", _OBJECT),
                              ("data", _OBJECT), ("engine", _OBJECT), ("engine_run", _OBJECT), ("pair", _OBJECT)):
        if doc.get(key) is not None and not test(doc[key]):
            raise bad(key, want, doc[key])
    for key, fields in (("checks", _CHECK_FIELDS), ("layers", _LAYER_FIELDS)):
        for i, row in enumerate(doc.get(key) or ()):
            if not isinstance(row, dict):
                raise bad(f"{key}[{i}]", "an object", row)
            if key == "checks" and not isinstance(row.get("name"), str):
                raise bad(f"{key}[{i}].name", "a string", row.get("name"))
            for name, (test, want) in fields.items():
                if row.get(name) is not None and not test(row[name]):
                    raise bad(f"{key}[{i}].{name}", want, row[name])
    for key in ("metrics", "generation"):
        for name, v in (doc.get(key) or {}).items():
            if v is not None and not _finite(v):
                raise bad(f"{key}.{str(name)[:40]}", "a finite number or null", v)
    for name, v in (doc.get("thresholds") or {}).items():
        if name == "min_sqnr_db":  # the one the page draws: a line on the SQNR axes
            if not (_number(v) is not None and abs(_number(v)) <= SQNR_CAP_DB):
                raise ConfigError(f"{where}: thresholds.min_sqnr_db is not a number of dB within "
                                  f"+-{SQNR_CAP_DB:g} (got {_shown(v)})", hint=hint)
        elif not _limit(v):
            raise bad(f"thresholds.{str(name)[:40]}", "a number", v)


def _sqnr_threshold(verify_doc: dict | None) -> float:
    """verify's `min_sqnr_db`: the one the verify JSON ran with, else verify's default."""
    t = _number(((verify_doc or {}).get("thresholds") or {}).get("min_sqnr_db"))
    if t is not None:
        return t
    from ..options import Thresholds

    return Thresholds().min_sqnr_db


