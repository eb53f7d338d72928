"""A Hugging Face model card (`README.md`) for a converted checkpoint, written from its manifest.

`write_model_card(out_dir)` reads what `convert` wrote (`quantkit_manifest.json`, `config.json`) and, when
present, what `verify` measured (`verify.json` in OUT, or a report passed in), and writes `OUT/README.md`:

- YAML front matter the Hub indexes: `base_model` (the source's hub id when known, else its directory
  name), `base_model_relation: quantized` (the Hub lists the checkpoint under the base model's
  "Quantizations"), `library_name: transformers`, `pipeline_tag`, `tags`. `library_name` is transformers
  because that is the library that loads the output as written (`AutoModelForCausalLM.from_pretrained`,
  compressed-tensors decompressing it; docs/format.md) and the one the Hub's code snippets key on;
  vLLM needs no library tag, it reads the compressed-tensors `quantization_config` itself.
  `quantized_by` is left to the user as a commented placeholder line, so the YAML stays valid and no
  empty value reaches the Hub; a value already present in an existing card is kept.
- a body section between `<!-- quantkit:card:start -->` and `<!-- quantkit:card:end -->`: the schemes
  (module counts, bytes, methods), calibration, KV-cache scales, bytes before/after, measured quality and
  the vLLM command. If OUT already has a README.md (the source's, copied by convert, or an earlier card),
  its text is kept and the section is appended after it (or replaced, on a re-run), and its metadata is
  merged: the source's license, language, datasets, ... stay; `model-index` (the base model's evaluation
  results, which would be misattributed to the quantized one) is dropped. Front matter that is not valid
  YAML is dropped.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import yaml

from . import __version__
from .arch.layout import expert_module
from .errors import QuantkitError
from .pack.manifest import MANIFEST_NAME as MANIFEST
from .read.files import parse_json, read_text

README = "README.md"
VERIFY_JSON = "verify.json"
OUT_NAME = "MODEL"  # how the card names this directory in commands (never its real, local name)
START, END = "<!-- quantkit:card:start -->", "<!-- quantkit:card:end -->"

LIBRARY_NAME = "transformers"
DEFAULT_PIPELINE_TAG = "text-generation"
QUANTIZED_BY_PLACEHOLDER = "# quantized_by: YOUR_HF_USERNAME   # uncomment and fill in (who made this quantization)"
LICENSE_PLACEHOLDER = "# license: LICENSE_OF_THE_BASE_MODEL   # uncomment and fill in: it inherits the base model's"
BASE_MODEL_PLACEHOLDER = "# base_model: ORG/NAME   # uncomment and fill in: the hub id of the source model"

# Shown under the vLLM command when the model uses MLA attention (config `kv_lora_rank`: DeepSeek-V3, Kimi K2,
# GLM-5) and KV-cache scales were shipped. To refine as engine support changes; `write_model_card(...,
# mla_kv_caveat=...)` overrides it per call (None: no caveat).
MLA_KV_SCALES_CAVEAT = (
    "vLLM 0.33.0 does not load KV-cache scales for MLA attention layers: it runs the FP8 latent cache with scale "
    "1.0, so the `k_scale` shipped here is not in use there. Installing quantkit in vLLM's environment adds a "
    "vLLM plugin (`quantkit.engine.vllm_plugin`) that makes it load them (`quantkit verify --engine vllm` "
    "says which rules your checkpoint meets).")

# Tags this module writes: on a re-run they are recomputed, not accumulated from the previous card.
OWN_TAGS = {"compressed-tensors", "quantkit", "int4", "w4a16", "fp8", "w8a8", "fp8-kv", "moe", "gptq", "awq", "rtn"}
# Source metadata that does not describe the quantized model.
DROPPED_KEYS = {"model-index", "base_model_relation", "new_version"}

_DTYPE_BYTES = {"float64": 8, "int64": 8, "uint64": 8, "float32": 4, "int32": 4, "uint32": 4, "bfloat16": 2,
                "float16": 2, "int16": 2, "uint16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
                "int8": 1, "uint8": 1, "bool": 1, "float4_e2m1fn_x2": 1}
_FRONT_MATTER = re.compile(r"\A\s*---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.S)


class ModelCardError(QuantkitError):
    hint = "run `quantkit convert` to completion first: the card is written from OUT/quantkit_manifest.json"


def write_model_card(out_dir: str | os.PathLike, src_dir: str | os.PathLike | None = None, *,
                     source_id: str | None = None, verify_report: Any = None, model_ref: str | None = None,
                     mla_kv_caveat: str | None = MLA_KV_SCALES_CAVEAT, manifest: dict | None = None) -> Path:
    """Write OUT/README.md (see the module docstring) and return its path.

    `src_dir`: the source checkpoint directory (names the base model when `source_id` is not given: a hub
    cache snapshot gives its hub id, any other directory its name). `source_id`: the source's hub id.
    `verify_report`: a `quantkit verify --json` document (dict), a path to one, or a VerifyReport; default
    OUT/verify.json when it exists. `model_ref`: what the serve command names (default
    `./MODEL`, so that the card does not depend on where OUT happens to be: outputs stay byte-identical).
    `manifest`: the manifest as `convert` is about to write it last (default: read from OUT).
    """
    from .read.checkpoint import read_manifest

    out = Path(out_dir)
    manifest = manifest if manifest is not None else read_manifest(out, ModelCardError)
    if manifest.get("status") != "complete":
        raise ModelCardError(f"{out / MANIFEST} does not say status complete: the conversion has not finished")
    config = _read_json(out / "config.json", "config.json")
    report = _verify_report(out, verify_report)
    base = source_id or _source_name(src_dir)

    old_meta, old_body = {}, ""
    if (out / README).is_file():
        old_meta, old_body = split_front_matter((out / README).read_text(encoding="utf-8"))
    elif src_dir is not None and (Path(src_dir) / README).is_file():
        old_meta, old_body = split_front_matter((Path(src_dir) / README).read_text(encoding="utf-8"))
    generated_before = START in old_body
    if base is None and generated_before and isinstance(old_meta.get("base_model"), str):
        base = old_meta["base_model"]  # a re-run without the source's name keeps the earlier card's
    kept = _outside_section(old_body)

    facts = _Facts(manifest, config)
    meta = card_metadata(facts, base, old_meta, drop_own_tags=generated_before)
    section = card_section(facts, out, base, report, model_ref or f"./{OUT_NAME}", mla_kv_caveat,
                           title=not kept.strip())
    text = _render_front_matter(meta, old_meta) + "\n" + (kept.rstrip() + "\n\n" if kept.strip() else "") + section
    path = out / README
    _write_text_atomic(path, text)
    return path


# --- reading ---------------------------------------------------------------------------------------
def _read_json(path: Path, what: str) -> dict:
    doc = parse_json(read_text(path, what, ModelCardError, 64 << 20), str(path), ModelCardError)
    if not isinstance(doc, dict):
        raise ModelCardError(f"{path} must hold a JSON object")
    return doc


def _verify_report(out: Path, report: Any) -> dict | None:
    if report is None:
        return _read_json(out / VERIFY_JSON, VERIFY_JSON) if (out / VERIFY_JSON).is_file() else None
    if hasattr(report, "to_json"):
        return report.to_json()
    if isinstance(report, (str, os.PathLike)):
        return _read_json(Path(report), "the verify report")
    if isinstance(report, dict):
        return report
    raise ModelCardError(f"verify_report must be a dict, a path or a VerifyReport, got {type(report).__name__}")


def _source_name(src_dir: str | os.PathLike | None) -> str | None:
    if src_dir is None:
        return None
    from .hub import snapshot_repo_id

    return snapshot_repo_id(src_dir) or Path(os.path.abspath(src_dir)).name


def split_front_matter(text: str) -> tuple[dict, str]:
    """(metadata, body) of a model card. No front matter, or front matter that is not a YAML mapping: ({},
    the body without it)."""
    m = _FRONT_MATTER.match(text)
    if m is None:
        return {}, text
    try:
        meta = yaml.safe_load(m[1])
    except yaml.YAMLError:
        meta = None
    return (meta if isinstance(meta, dict) else {}), text[m.end():]


def _outside_section(body: str) -> str:
    """The body without a previously generated quantkit section."""
    i = body.find(START)
    if i < 0:
        return body
    j = body.find(END, i)
    return body[:i] + (body[j + len(END):] if j >= 0 else "")


class _Facts:
    """What the manifest and config say, tallied once for the metadata and the body."""

    def __init__(self, manifest: dict, config: dict):
        notes = manifest.get("notes")
        self.manifest = {**manifest, **{k: _obj(manifest.get(k)) for k in ("recipe", "tool", "quantization_config")},
                         "notes": notes if isinstance(notes, list) else []}
        self.config = config
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        self.cfg = {**config, **text}  # multimodal wrappers keep the language model's keys in text_config
        self.schemes: dict[str, dict] = {}  # label -> {modules: set, methods: Counter, bytes: int}
        self.kept_bytes: Counter = Counter()  # dtype -> bytes of tensors stored as in the source
        self.kv_bytes = 0
        shown = lambda v: v if isinstance(v, str) else "?"  # noqa: E731
        for name, e in _obj(manifest.get("tensors")).items():
            if not isinstance(e, dict):
                continue
            size = _nbytes(e)
            if e.get("kv_cache"):
                self.kv_bytes += size
            elif "scheme" in e:
                s = self.schemes.setdefault(shown(e["scheme"]), {"modules": {}, "bytes": 0})
                s["modules"][name.rsplit(".", 1)[0]] = shown(e.get("method"))
                s["bytes"] += size
            else:
                self.kept_bytes[shown(e.get("dtype"))] += size
        self.methods = Counter(m for s in self.schemes.values() for m in s["modules"].values())
        self.kv = manifest.get("kv_cache") if isinstance(manifest.get("kv_cache"), dict) else None
        self.calibration = manifest.get("calibration") if isinstance(manifest.get("calibration"), dict) else None
        self.summary = _obj(manifest.get("summary"))

    @property
    def moe(self) -> bool:
        return any(isinstance(self.cfg.get(k), int) and self.cfg[k] > 1
                   for k in ("num_experts", "n_routed_experts", "num_local_experts"))

    @property
    def mla(self) -> bool:
        return bool(self.cfg.get("kv_lora_rank"))

    @property
    def custom_code(self) -> bool:
        return bool(self.config.get("auto_map"))


def _nbytes(e: dict) -> int:
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n * _DTYPE_BYTES.get(str(e.get("dtype")), 0)


def _line(x: Any, n: int = 300, code: bool = False) -> str:
    """A manifest string as one line of the card (a newline would end its list item), cut to `n` characters;
    `code`: it goes inside a code span, which a backtick would close (made a quote)."""
    s = str(x).replace("`", "'") if code else str(x)
    return " ".join(s.split())[:n]


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in `text`, so that the text cannot close it."""
    runs = re.findall(r"`+", text)
    return "`" * max(3, 1 + max((len(r) for r in runs), default=0))


def _obj(x: Any) -> dict:
    """`x` when it is an object, else an empty one: the manifest is read as hostile input, and the card
    describes what it can instead of failing on a field of the wrong type."""
    return x if isinstance(x, dict) else {}


# --- metadata --------------------------------------------------------------------------------------
def card_metadata(facts: _Facts, base: str | None, old: dict, drop_own_tags: bool = False) -> dict:
    """The front matter: ours first, then the source card's keys that still hold for the quantized model."""
    tags = ["compressed-tensors", "quantkit"]
    labels = list(facts.schemes)
    if any(lb.startswith("int4") for lb in labels):
        tags += ["int4", "w4a16"]
    if any(lb.startswith("fp8") for lb in labels):
        tags += ["fp8", "w8a8"]
    if facts.kv:
        tags.append("fp8-kv")
    if facts.moe:
        tags.append("moe")
    tags += sorted(m for m in facts.methods if m in ("gptq", "awq"))
    old_tags = old.get("tags") if isinstance(old.get("tags"), list) else []
    old_tags = [t for t in old_tags if isinstance(t, str) and not (drop_own_tags and t in OWN_TAGS)]
    meta: dict[str, Any] = {}
    if base:
        meta["base_model"] = base
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = LIBRARY_NAME
    meta["pipeline_tag"] = old.get("pipeline_tag") if isinstance(old.get("pipeline_tag"), str) \
        else DEFAULT_PIPELINE_TAG
    meta["tags"] = list(dict.fromkeys(tags + old_tags))
    for k, v in old.items():
        if k not in meta and k not in DROPPED_KEYS and k != "base_model":
            meta[k] = v
    return meta


def _render_front_matter(meta: dict, old: dict) -> str:
    text = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False, width=120)
    extra = []
    if "base_model" not in meta:
        extra.append(BASE_MODEL_PLACEHOLDER)
    if "license" not in meta:
        extra.append(LICENSE_PLACEHOLDER)
    if not meta.get("quantized_by"):
        extra.append(QUANTIZED_BY_PLACEHOLDER)
    return "---\n" + text + "".join(line + "\n" for line in extra) + "---\n"


# --- body ------------------------------------------------------------------------------------------
def describe_scheme(label: str) -> str:
    """`int4-g32-sym` -> `INT4 weights, group 32, symmetric; activations unquantized (W4A16)`."""
    core, _, origin = label.partition("+")
    suffix = " (as stored in the source)" if origin == "source" else ""
    m = re.fullmatch(r"int(\d{1,9})-(?:g(\d{1,9})|(channel))-(sym|asym)", core)
    if m:
        gran = f"group {m[2]}" if m[2] else "per channel"
        sym = "symmetric" if m[4] == "sym" else "asymmetric"
        return f"INT{m[1]} weights, {gran}, {sym}; activations unquantized (W{m[1]}A16){suffix}"
    m = re.fullmatch(r"fp8-(block(\d{1,9})x(\d{1,9})|channel|tensor)", core)
    if m:
        gran = f"{m[2]}x{m[3]} blocks" if m[2] else f"per {m[1]}"
        return f"FP8 (e4m3) weights, {gran}; dynamic FP8 activations (W8A8){suffix}"
    m = re.fullmatch(r"(nvfp4|mxfp4)-g(\d{1,9})(-a4)?", core)
    if m:
        scales = ("an FP8 (e4m3) scale per group and an FP32 global scale per matrix" if m[1] == "nvfp4"
                  else "an E8M0 (power-of-two) scale per group")
        acts = ("NVFP4 activations, an FP8 scale per 16 values computed at run time under a calibrated static "
                "input_global_scale per module (W4A4)" if m[3] else "activations unquantized (W4A16)")
        return f"{m[1].upper()} weights (FP4 E2M1), group {m[2]}, {scales}; {acts}{suffix}"
    return label


def _size(n: int | float | None) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "n/a"


def card_section(facts: _Facts, out: Path, base: str | None, report: dict | None, model_ref: str,
                 mla_kv_caveat: str | None, title: bool = True) -> str:
    m, lines = facts.manifest, []
    recipe = _line(m["recipe"].get("name", "?"), 80, code=True)
    version = _line(m["tool"].get("version", __version__), 40, code=True)
    src = (f"[{base}](https://huggingface.co/{base})" if base and "/" in base else f"`{base}`" if base
           else "the source model")
    fmt = (facts.manifest.get("quantization_config") or {}).get("format")
    lines += [START]
    if title:
        lines += [f"# {base or 'Model'}, quantized with quantkit", ""]
    lines += ["## Quantization (quantkit)", "",
              f"{src} converted with quantkit {version}, recipe `{recipe}`, into the "
              f"[compressed-tensors](https://github.com/neuralmagic/compressed-tensors) format"
              + (f" (`{_line(fmt, 60, code=True)}`)" if fmt else "")
              + ". `quantkit_manifest.json` records every tensor: its scheme, method, source tensor and error.", ""]

    lines += ["### What was quantized", "", "| scheme | what | modules | method | bytes |", "|---|---|---|---|---|"]
    for label, s in sorted(facts.schemes.items(), key=lambda kv: -len(kv[1]["modules"])):
        methods = ", ".join(f"{k} {v}" for k, v in Counter(s["modules"].values()).most_common())
        lines.append(f"| `{label}` | {describe_scheme(label)} | {len(s['modules'])} | {methods} | "
                     f"{_size(s['bytes'])} |")
    if facts.kept_bytes:
        dtypes = ", ".join(f"{d} {_size(b)}" for d, b in facts.kept_bytes.most_common())
        lines.append(f"| (kept) | everything else, stored as in the source ({dtypes}) | | | "
                     f"{_size(sum(facts.kept_bytes.values()))} |")
    if facts.kv:
        lines.append(f"| (kv scales) | FP8 KV-cache scales, strategy `{facts.kv.get('strategy')}` | | | "
                     f"{_size(facts.kv_bytes)} |")
    read, written = facts.summary.get("bytes_read"), facts.summary.get("bytes_written")
    ratio = f", {read / written:.2f}x smaller" if isinstance(read, int) and isinstance(written, int) and written else ""
    lines += ["", f"Checkpoint size: {_size(read)} (source shards) -> {_size(written)} (output shards){ratio}.", ""]
    if not facts.schemes:
        lines += ["No weights were quantized.", ""]

    lines += ["### Calibration", ""] + _calibration_lines(facts) + [""]
    lines += ["### KV cache", ""] + _kv_lines(facts) + [""]
    lines += ["### Measured quality", ""] + _quality_lines(report, out) + [""]

    serve = f"vllm serve {model_ref}" + (" --kv-cache-dtype fp8" if facts.kv else "")
    lines += ["### Serve with vLLM", "", "```bash", serve, "```", "",
              f"`{model_ref}` is this directory; once uploaded, use its hub id. vLLM reads the compressed-tensors "
              "`quantization_config` from config.json, so no `--quantization` flag is needed "
              "(`--quantization compressed-tensors` is accepted and changes nothing)."
              + (" `--kv-cache-dtype fp8` makes vLLM cache K/V in FP8 with the shipped scales." if facts.kv else "")]
    if facts.kv and facts.mla and mla_kv_caveat:
        lines += ["", f"> **Caveat (MLA):** {mla_kv_caveat}"]
    if facts.custom_code:
        lines += ["", "> The base model ships custom code (`auto_map` in config.json); engines may need "
                  "`--trust-remote-code` for its config or tokenizer. Review that code first: quantkit never ran it."]
    notes = [n for n in m.get("notes") or [] if isinstance(n, str)]
    if notes:
        lines += ["", "Conversion notes:", ""] + [f"- {_line(n)}" for n in notes[:10]]
        if len(notes) > 10:
            lines.append(f"- ... and {len(notes) - 10} more (see `quantkit_manifest.json`)")

    lines += ["", "### Reproduce", "", "```bash",
              f"quantkit convert {base or 'SOURCE'} {OUT_NAME} --recipe {recipe}" + _kv_flag(facts), "```"]
    text = (m.get("recipe") or {}).get("text")
    if isinstance(text, str) and text.strip():
        fence = _fence(text)
        lines += ["", "<details><summary>recipe</summary>", "", f"{fence}yaml", text.rstrip(), fence, "", "</details>"]
    lines += [END, ""]
    return "\n".join(lines)


def _kv_flag(facts: _Facts) -> str:
    origin = _obj((facts.kv or {}).get("origin"))
    return f" --kv-scales {Path(origin['file']).name}" if isinstance(origin.get("file"), str) else ""


def _calibration_lines(facts: _Facts) -> list[str]:
    cal = facts.calibration
    methods = ", ".join(f"{k} ({v} modules)" for k, v in facts.methods.most_common()) or "none"
    if not isinstance(cal, dict):
        return [f"Methods: {methods}. No calibration data: round-to-nearest needs none."]
    out = [f"Methods: {methods}.",
           f"Data: `{cal.get('source')}`, {cal.get('num_samples')} samples x {cal.get('seq_len')} tokens"
           + (f" ({cal['num_tokens']} tokens)" if isinstance(cal.get("num_tokens"), int) else "")
           + (f", tokenizer `{cal['tokenizer']}`" if cal.get("tokenizer") else "")
           + (f", layers computed in {cal['compute_dtype']}" if cal.get("compute_dtype") in ("float32", "bfloat16")
              else "") + "."]
    counts = [c for per in _obj(cal.get("expert_tokens")).values() if isinstance(per, list) for c in per
              if type(c) is int]
    if counts:
        counts.sort()
        out.append(f"Routed experts: {len(counts)}, calibration tokens per expert min {counts[0]}, median "
                   f"{counts[len(counts) // 2]}, max {counts[-1]}; {sum(c == 0 for c in counts)} saw none.")
    fallbacks = _obj(cal.get("fallbacks"))
    experts = defaultdict(set)  # reason -> experts (a module's parent when it is an expert's projection)
    for module, reason in fallbacks.items():
        experts[str(reason)].add(expert_module(module))
    starved = set().union(*experts.values()) if experts else set()
    if starved:
        why = "; ".join(f"{r}: {len(e)}" for r, e in sorted(experts.items(), key=lambda kv: -len(kv[1])))
        out.append(f"Starved experts (too few calibration tokens, fallback used): {len(starved)} ({why}); "
                   "per module in the manifest's `calibration.fallbacks`.")
    elif not cal.get("input_scale_fallbacks"):
        out.append("Starved experts: none (every expert saw enough calibration tokens).")
    inputs = _obj(cal.get("input_scale_fallbacks"))
    if inputs:  # NVFP4 W4A4 (calib/emit.py): experts no token reached take their layer's largest input amax
        n = len({expert_module(mod) for mod in inputs})
        out.append(f"NVFP4 input scales: {n} expert(s) saw no calibration token and use their layer's largest "
                   "input amax (finite, positive); per module in the manifest's `calibration.input_scale_fallbacks`.")
    return [" ".join(out)]


def _kv_lines(facts: _Facts) -> list[str]:
    kv = facts.kv
    if not kv:
        return ["No KV-cache scales: engines cache K/V in the model dtype (or compute FP8 scales themselves)."]
    origin = _obj(kv.get("origin"))
    if isinstance(origin.get("calibrate"), dict):
        c = origin["calibrate"]
        where = f"calibrated by convert on `{c.get('dataset')}` ({c.get('num_samples')} x {c.get('seq_len')} tokens)"
    elif origin.get("file"):
        where = f"from `{Path(str(origin['file'])).name}` (sha256 {str(origin.get('sha256', ''))[:12]}...)"
    else:
        where = "kept from the source"
    what = " For MLA attention the engine caches one latent, scaled by `k_scale`." if facts.mla else ""
    return [f"FP8 (e4m3) KV-cache scales, strategy `{kv.get('strategy')}`, {kv.get('tensors')} tensors in "
            f"`{kv.get('shard')}`, {where}.{what}"]


def _quality_lines(report: dict | None, out: Path) -> list[str]:
    if not report:
        return [f"Not measured. `quantkit verify {OUT_NAME} --reference SOURCE` measures it and records the "
                "results here."]
    mt = report.get("metrics") or {}
    data = report.get("data") or {}
    rows = ["| metric | value |", "|---|---|",
            f"| verify | {'passed' if report.get('passed') else 'FAILED'} |",
            f"| mean next-token KL divergence | {_num(mt.get('kl_divergence'), '.3g')} |",
            f"| top-1 agreement | {_num(mt.get('top1_agreement'), '.2%')} |",
            f"| perplexity, reference -> quantized | {_num(mt.get('perplexity_reference'), '.4g')} -> "
            f"{_num(mt.get('perplexity_quantized'), '.4g')} |"]
    layers = [x.get("min_sqnr_db") for x in report.get("layers") or [] if isinstance(x, dict)]
    layers = [x for x in layers if isinstance(x, (int, float))]
    if layers:
        rows.append(f"| weight SQNR, worst layer | {min(layers):.1f} dB |")
    gen = report.get("generation")
    if isinstance(gen, dict) and isinstance(gen.get("agreement"), (int, float)):
        rows.append(f"| greedy generation agreement | {gen['agreement']:.2%} |")
    pm = (report.get("pair") or {}).get("metrics") if isinstance(report.get("pair"), dict) else None
    if isinstance(pm, dict):  # verify --pair: the prefill/decode pair beside each model alone
        for k, what in (("pair", "pair: FP8 prefill -> KV cache -> this model decodes"),
                        ("decode", "this model alone"), ("prefill", "prefill model alone")):
            v = pm.get(k) if isinstance(pm.get(k), dict) else {}
            rows.append(f"| {what}: KL / top-1 | {_num(v.get('kl_divergence'), '.3g')} / "
                        f"{_num(v.get('top1_agreement'), '.2%')} |")
    src = f"`{data['source']}`" if data.get("source") else "token data"
    return rows + ["", f"Measured by `quantkit verify` against the source on {src}, {data.get('num_samples', '?')} "
                       f"samples x {data.get('seq_len', '?')} tokens."] + _engine_run_lines(report.get("engine_run"))


def _engine_run_lines(run: Any) -> list[str]:
    """`verify --engine vllm --run`: what the engine measured, or the one line saying it cannot run it here."""
    if not isinstance(run, dict) or not run.get("status"):
        return []
    where = f"{run.get('engine', 'vLLM')} ({run.get('platform') or 'unknown platform'})"
    if run["status"] != "ok":
        return ["", f"Run in {where}: {run.get('line') or run.get('reason')}"]
    rows = ["", f"Run in {where} (`quantkit verify --engine vllm --run`):", "", "| metric | value |", "|---|---|",
            f"| perplexity in the engine | {_num(run.get('perplexity_engine'), '.4g')} |"]
    if run.get("perplexity_ratio") is not None:
        rows.append(f"| perplexity ratio, engine / reference | {_num(run.get('perplexity_ratio'), '.4f')} |")
        rows.append(f"| top-1 agreement with the reference | {_num(run.get('top1_agreement'), '.2%')} |")
    gen = run.get("generation")
    if isinstance(gen, dict) and isinstance(gen.get("agreement"), (int, float)):
        rows.append(f"| greedy agreement (teacher-forced) | {gen['agreement']:.2%} |")
    kv = run.get("kv_scales")
    if isinstance(kv, dict) and kv.get("equal") is not None:
        dtypes = sorted({str(r.get("kv_cache_dtype")) for r in kv.get("layers") or []})
        rows.append(f"| KV scales held by the engine = the file's | {'yes' if kv['equal'] else 'NO'} "
                    f"({kv.get('compared')}/{kv.get('file_layers')} layers, cache {', '.join(dtypes)}) |")
    return rows


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["write_model_card", "split_front_matter", "describe_scheme", "MLA_KV_SCALES_CAVEAT", "ModelCardError",
           "LIBRARY_NAME"]
