"""Calibration data: a dataset -> deterministic token samples for the executor.

Sources (docs/design.md, "D (dataset)"):
- a local `.jsonl` (one JSON object per line) or `.json` (a list of objects, or `{"data": [...]}`) whose
  rows carry `text` (a string), `messages` (a chat, rendered with the tokenizer's chat template) or
  `input_ids` (already tokenized);
- a `.txt` file (one document);
- a `.parquet` file (needs pyarrow) or a `datasets.save_to_disk` folder (needs `datasets`);
- a hub dataset id (needs `datasets` and a reachable hub);
- nothing: the calibration set shipped in `quantkit/data/calibration/`.

Text rows are tokenized one document at a time (BOS/EOS as the tokenizer adds them, EOS appended between
documents), concatenated into one stream and cut into windows of exactly `seq_len` tokens; `num_samples`
windows are drawn with a seeded generator and kept in stream order. Rows with `input_ids` are samples
as they are: one row, one sample, never packed, cut only if longer than `seq_len`.

Tokenizer: the model directory's own (AutoTokenizer, local files only, no remote code). When the
directory has none (the tiny test models), text is tokenized deterministically as UTF-8 bytes modulo
the vocabulary size, with a warning: fine for exercising the pipeline, meaningless for a real model.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import options
from ..write.writer import sha256_file
from ..errors import DatasetError, DatasetNotFound
from ..read.files import check_regular, parse_json, read_text

DEFAULT_DATASET_NAME = "default.jsonl"
DEFAULT_SEED = 0
SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")
MAX_DATASET_BYTES = 1 << 30  # a local dataset file is read whole: larger ones belong in a saved dataset folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class CalibrationWarning(UserWarning):
    """Calibration went ahead with a compromise (byte tokenizer, fewer samples than asked, ...)."""


def _warn(msg: str) -> None:
    warnings.warn(msg, CalibrationWarning, stacklevel=3)


# ---- tokenizers ---------------------------------------------------------------------------------------
class ByteTokenizer:
    """Deterministic stand-in for models without a tokenizer: UTF-8 bytes modulo `vocab_size`."""

    name = "bytes-mod-vocab"
    chat_template = None
    eos_token_id = None

    def __init__(self, vocab_size: int):
        if vocab_size <= 0:
            raise DatasetError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


def load_tokenizer(model_dir: str | os.PathLike):
    """The model's tokenizer from its directory (local files only), or None if it ships none."""
    root = Path(model_dir)
    if not any((root / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # a remote-code tokenizer (e.g. Kimi's tiktoken one) or broken files
        raise DatasetError(f"cannot load the tokenizer in {root} without remote code: {type(e).__name__}: "
                           f"{str(e)[:160]}",
                           hint="tokenize the calibration text yourself and pass a .jsonl with one "
                                "`input_ids` list per row as --dataset") from None


def tokenizer_name(tokenizer) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.name
    return f"{type(tokenizer).__name__}:{getattr(tokenizer, 'name_or_path', '')}"


def _encode_text(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of one document; `special=False` for chat-templated text (the template adds BOS)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)  # documents are separated by EOS in the packed stream
    return ids


def _render_messages(tokenizer, messages: list, where: str) -> tuple[str, bool]:
    """(text, templated). Uses the tokenizer's chat template; without one, plain `role: content` lines."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DatasetError(f"{where}: `messages` must be a list of {{role, content}} objects with string values")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n", False


# ---- reading rows ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rows:
    rows: list  # dicts (or plain strings = text)
    source: str
    sha256: str


def default_dataset_path() -> Path:
    return Path(str(resources.files("quantkit") / "data" / "calibration" / DEFAULT_DATASET_NAME))


_FILE_SUFFIXES = SUFFIXES + (".csv", ".tsv", ".gz", ".zip", ".arrow", ".xml", ".yaml", ".yml", ".md")


def _hub_like(s: str) -> bool:
    """`name` or `owner/name`, without a file suffix: what a hub dataset id looks like."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", s) is not None
            and Path(s).suffix.lower() not in _FILE_SUFFIXES)


def read_rows(dataset: str | os.PathLike | None) -> Rows:
    """Rows of `dataset` (see the module docstring), with a description of the source and its sha256."""
    if dataset is None:
        p = default_dataset_path()
        return Rows(_read_jsonl(p), f"quantkit:{DEFAULT_DATASET_NAME}", sha256_file(p))
    p = Path(dataset)
    if p.is_dir():
        return _read_saved_dataset(p)
    if p.is_file() or os.path.lexists(p):  # a FIFO or device too: refused by name when read
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(p)
        elif suffix == ".json":
            rows = _read_json(p)
        elif suffix == ".txt":
            rows = [_read_text(p)]
        elif suffix == ".parquet":
            rows = _read_parquet(p)
        else:
            raise DatasetError(f"unsupported dataset file type {p.suffix or '(none)'!r}: {p}",
                               hint="use .jsonl, .json, .txt or .parquet, or a `datasets.save_to_disk` folder")
        return Rows(rows, str(p), sha256_file(p))
    s = str(dataset)
    if not _hub_like(s):  # looks like a path (separators, a file suffix): it is simply missing
        raise DatasetNotFound(f"dataset {s!r} does not exist")
    return _read_hub(s)


def _read_text(p: Path) -> str:
    """A regular file of UTF-8 text, at most MAX_DATASET_BYTES (read/files.py: a FIFO or /dev/zero refused)."""
    return read_text(p, "dataset file", DatasetError, MAX_DATASET_BYTES,
                     hint=f"a dataset file is UTF-8 text of at most {MAX_DATASET_BYTES >> 30} GiB")


def _read_jsonl(p: Path) -> list:
    rows = []
    hint = "a .jsonl file holds one JSON object per line"
    for n, line in enumerate(_read_text(p).splitlines(), 1):
        if line.strip():  # bounded nesting and integers, no lone surrogates (read/files.py)
            rows.append(parse_json(line, f"{p}:{n}", DatasetError, hint=hint))
    return rows


def _read_json(p: Path) -> list:
    doc = parse_json(_read_text(p), str(p), DatasetError)
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise DatasetError(f"{p}: a .json dataset must hold a list of rows (or {{\"data\": [...]}})")
    return doc


def _read_parquet(p: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {p.name} needs pyarrow, which is not installed",
                           hint="pip install pyarrow, or convert the file to .jsonl") from None
    check_regular(p, "dataset file", DatasetError, MAX_DATASET_BYTES)
    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:  # third-party code on an untrusted file: its failure is the finding
        raise DatasetError(f"{p.name} is not a readable parquet file: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160] if str(e) else ''}",
                           hint="pass a parquet file written by pyarrow/datasets, or the rows as .jsonl") from None


def _read_saved_dataset(p: Path) -> Rows:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((p / m).is_file() for m in markers):
        raise DatasetError(f"{p} is a folder but not a `datasets.save_to_disk` folder (no {' / '.join(markers)})",
                           hint="pass a file, or a folder written by Dataset.save_to_disk")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"reading the saved dataset {p} needs the `datasets` package, which is not installed",
                           hint="pip install datasets, or export the rows to .jsonl") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(f.relative_to(p).as_posix().encode() + b"\0" + sha256_file(f).encode())
    return Rows(_columns(ds), str(p), h.hexdigest())


def _columns(ds) -> list:
    keep = [c for c in ("input_ids", "messages", "text") if c in ds.column_names]
    if not keep:
        raise DatasetError(f"the dataset has no text, messages or input_ids column (columns: {ds.column_names})")
    return ds.select_columns(keep).to_list()


def _read_hub(name: str) -> Rows:
    """A hub dataset by id: its snapshot in the hub cache (fetched unless HF_HUB_OFFLINE is set; from the
    cache alone when it is), then its `train` split as `datasets` reads a local folder (data files only: a
    repo's loading script is never run)."""
    from ..hub import hub_cache_dir, hub_offline

    hint = ("download it where the hub is reachable (`hf download --repo-type dataset NAME`) and copy that "
            "Hugging Face cache here, or pass a local file or save_to_disk folder")
    try:
        import datasets
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise DatasetError(f"dataset {name!r} is not a local path, and loading hub datasets needs the "
                           f"`{e.name}` package, which is not installed", hint="pip install datasets") from None
    offline = hub_offline() or os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", "")
    try:
        snap = Path(snapshot_download(name, repo_type="dataset", cache_dir=str(hub_cache_dir()),
                                      local_files_only=offline,
                                      allow_patterns=[f"*{x}" for x in SUFFIXES] + ["*.csv", "README.md"]))
    except Exception as e:  # not cached while offline, unreachable, no such repo
        where = "is not in the local hub cache and the hub is offline (HF_HUB_OFFLINE)" if offline else \
            f"cannot be fetched: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        raise DatasetError(f"dataset {name!r} is not a local path and {where}", hint=hint) from None
    files = sorted(q for q in snap.rglob("*") if q.is_file() and q.suffix.lower() in SUFFIXES + (".csv",))
    if not files:
        raise DatasetError(f"hub dataset {name!r} holds no data file quantkit reads ({', '.join(SUFFIXES)})",
                           hint=hint)
    try:
        ds = datasets.load_dataset(str(snap), split="train")
    except Exception as e:  # no train split, mixed formats, unreadable files
        raise DatasetError(f"cannot read hub dataset {name!r} ({snap}): {type(e).__name__}: {str(e)[:160]}",
                           hint=hint) from None
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(snap).as_posix().encode() + b"\0" + sha256_file(f).encode())
    return Rows(_columns(ds), f"hub:{name}@{snap.name}", h.hexdigest())


# ---- samples ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationData:
    samples: tuple[torch.Tensor, ...]  # int64 [T_i] each
    source: str
    sha256: str
    seq_len: int
    requested_samples: int
    tokenizer: str
    pretokenized: bool
    seed: int
    notes: tuple[str, ...] = field(default=())
    pool: int = 0  # the last `pool` samples are the top-up pool (GPTQOptions.balance_tokens), not calibration samples

    @property
    def num_samples(self) -> int:
        """Calibration samples (the pool not counted)."""
        return len(self.samples) - self.pool

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.samples[:self.num_samples])

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "sha256": self.sha256, "num_samples": self.num_samples,
                "requested_samples": self.requested_samples, "seq_len": self.seq_len, "num_tokens": self.num_tokens,
                "tokenizer": self.tokenizer, "pretokenized": self.pretokenized, "seed": self.seed,
                "notes": list(self.notes), **({"pool_samples": self.pool} if self.pool else {})}


def choose(n_available: int, n: int, seed: int) -> list[int]:
    """`n` of `n_available` indices drawn without replacement by a seeded generator, sorted."""
    if n >= n_available:
        return list(range(n_available))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n_available, generator=g)[:n].tolist())


def pack(docs: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Concatenate token documents and cut the stream into [W, seq_len] windows (the tail is dropped)."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    w = stream.numel() // seq_len
    return stream[: w * seq_len].view(w, seq_len)


def _pretokenized(rows: list, where: str, vocab_size: int | None, seq_len: int) -> list[torch.Tensor]:
    out = []
    for i, r in enumerate(rows):
        ids = r.get("input_ids") if isinstance(r, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise DatasetError(f"{where}: row {i} has no non-empty integer `input_ids` list, but other rows do",
                               hint="either every row is pre-tokenized (`input_ids`) or none is")
        top = vocab_size if vocab_size is not None else 1 << 63  # checked before torch sees them: no overflow
        if min(ids) < 0 or max(ids) >= top:
            bad = next(t for t in ids if not 0 <= t < top)
            raise DatasetError(f"{where}: row {i} holds token id {str(bad)[:24]}, outside [0, {vocab_size or top})",
                               hint="the rows were tokenized for a model with another vocabulary")
        out.append(torch.tensor(ids[:seq_len], dtype=torch.long))
    return out


def _pool(candidates: list[torch.Tensor], taken: list[int], n: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """Up to `n` of the full-length candidates not `taken`, drawn by a seeded generator: the top-up pool. Full
    length only, so that the pool's samples come after every calibration sample in the pass's batch order
    (calib/activations.py batch_plan: shortest first, then by index)."""
    skip = set(taken)
    rest = [i for i, t in enumerate(candidates) if i not in skip and int(t.numel()) == seq_len]
    return [candidates[rest[j]] for j in choose(len(rest), n, seed)]


def load_calibration_data(dataset: str | os.PathLike | None = None, *, tokenizer=None, vocab_size: int | None = None,
                          num_samples: int, seq_len: int, seed: int = DEFAULT_SEED,
                          pool_samples: int = 0) -> CalibrationData:
    """Token samples for calibration. `tokenizer`: a transformers tokenizer, or None for the byte
    fallback (then `vocab_size` is required and a CalibrationWarning says so). `pool_samples`: that many
    further full-length samples of the same data (none of the calibration samples) appended as the top-up
    pool (GPTQOptions.balance_tokens), fewer with a warning when the data holds fewer."""
    if (not all(isinstance(v, int) and not isinstance(v, bool) for v in (num_samples, seq_len))
            or not (0 < num_samples <= options.MAX_NUM_SAMPLES and 0 < seq_len <= options.MAX_SEQ_LEN)):
        raise DatasetError(f"num_samples and seq_len must be positive integers (got {str(num_samples)[:20]}, "
                           f"{str(seq_len)[:20]})", hint=f"pass --num-samples N (at most {options.MAX_NUM_SAMPLES}) "
                           f"and --seq-len L (at most {options.MAX_SEQ_LEN}) greater than 0")
    src = read_rows(dataset)
    rows = src.rows
    if not rows:
        raise DatasetError(f"{src.source} holds no rows")
    notes: list[str] = []
    has_ids = [isinstance(r, dict) and "input_ids" in r for r in rows]
    if any(has_ids):
        if not all(has_ids):
            bad = has_ids.index(False)
            raise DatasetError(f"{src.source}: row {bad} has no `input_ids`, but other rows do",
                               hint="either every row is pre-tokenized (`input_ids`) or none is")
        pool = _pretokenized(rows, src.source, vocab_size, seq_len)
        idx = choose(len(pool), num_samples, seed)
        samples = [pool[i] for i in idx]
        extra = _pool(pool, idx, pool_samples, seq_len, seed + 1) if pool_samples > 0 else []
        tok_name, pre = "pre-tokenized", True
    else:
        if tokenizer is None:
            if vocab_size is None:
                raise DatasetError("no tokenizer and no vocab_size to fall back on")
            tokenizer = ByteTokenizer(vocab_size)
            msg = ("the model directory has no tokenizer: calibration text is tokenized as UTF-8 bytes modulo "
                   f"vocab_size={vocab_size} (fine for tests, meaningless for a real model)")
            _warn(msg)
            notes.append(msg)
        docs, untemplated = [], 0
        for i, r in enumerate(rows):
            where = f"{src.source} row {i}"
            templated = False
            if isinstance(r, str):
                text = r
            elif isinstance(r, dict) and isinstance(r.get("text"), str):
                text = r["text"]
            elif isinstance(r, dict) and "messages" in r:
                text, templated = _render_messages(tokenizer, r["messages"], where)
                untemplated += not templated
            else:
                keys = sorted(r) if isinstance(r, dict) else type(r).__name__
                raise DatasetError(f"{where} has no `text`, `messages` or `input_ids` field (has {keys})")
            if text:
                docs.append(_encode_text(tokenizer, text, special=not templated))
        if untemplated:
            msg = (f"{untemplated} chat row(s) rendered as plain `role: content` lines: the tokenizer has no "
                   "chat template")
            _warn(msg)
            notes.append(msg)
        windows = pack(docs, seq_len)
        if windows.shape[0] == 0:
            stream = pack(docs, 1).reshape(-1)
            if stream.numel() == 0:
                raise DatasetError(f"{src.source} holds no text")
            msg = f"the data holds only {stream.numel()} tokens, fewer than seq_len={seq_len}: one shorter sample"
            _warn(msg)
            notes.append(msg)
            samples, extra = [stream], []
        else:
            idx = choose(windows.shape[0], num_samples, seed)
            samples = [windows[i].clone() for i in idx]
            extra = [t.clone() for t in _pool(list(windows), idx, pool_samples, seq_len, seed + 1)] \
                if pool_samples > 0 else []
        tok_name, pre = tokenizer_name(tokenizer), False
    if len(samples) < num_samples:
        msg = f"asked for {num_samples} samples, the data holds {len(samples)}: using all of them"
        _warn(msg)
        notes.append(msg)
    if len(extra) < pool_samples:
        msg = (f"asked for a top-up pool of {pool_samples} samples, the data holds {len(extra)} more full-length "
               f"ones: using {'all of them' if extra else 'none'}")
        _warn(msg)
        notes.append(msg)
    return CalibrationData(tuple(samples) + tuple(extra), src.source, src.sha256, seq_len, num_samples, tok_name,
                           pre, seed, tuple(notes), len(extra))
