"""The tokenizer keys of an exported GGUF (`tokenizer.ggml.*`), from the checkpoint's tokenizer.json.

llama.cpp takes the token list's length as the vocabulary: it must equal the embedding's rows exactly, every
token distinct. A BPE tokenizer.json gives tokens, merges, special tokens and types; ids the tokenizer does not
use (transformers pads embeddings) become `[PAD<i>]` (unused). Without a tokenizer.json the GGUF gets distinct
placeholder tokens: token ids fed to the engine are exact, text is not tokenized as transformers would (the report
says so). A tokenizer.json is never replaced by placeholders: one that is not a tokenizers file is an error, and
one of a kind llama.cpp's BPE vocabulary cannot take (WordLevel, WordPiece, Unigram) is refused by name.

The pre-tokenizer (llama.cpp's regex set for splitting text) is named, never guessed: `default` unless the
caller names one llama.cpp knows (e.g. qwen2, deepseek-v3, glm4, kimi-k2); an unknown name fails at load.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..read.files import parse_json, read_bytes, read_text
from ..errors import ExportError, NotRepresentable

MAX_TOKENIZER_BYTES = 256 << 20
PRE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
OTHER_MODELS = ("WordLevel", "WordPiece", "Unigram")  # the tokenizers library's other model kinds


def _read_json(path: Path, what: str):
    if not os.path.lexists(path):
        return None
    text = read_text(path, path.name, ExportError, MAX_TOKENIZER_BYTES)
    return parse_json(text, path.name, ExportError)


def placeholder(rows: int) -> tuple[list[str], list[int], list[str]]:
    return [f"<t{i}>" for i in range(rows)], [NORMAL] * rows, ["<t0> <t1>"]


def bpe_vocab(tok, rows: int) -> tuple[list[str], list[int], list[str]]:
    """tokens, types, merges of a BPE tokenizer.json padded to `rows`. ExportError when it is not a tokenizers
    file; NotRepresentable, naming the kind, when it is one whose model is not BPE."""
    if not isinstance(tok, dict):
        raise ExportError(f"tokenizer.json must hold a JSON object (a tokenizers file), got {type(tok).__name__}")
    model = tok.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"tokenizer.json has no model object (got {type(model).__name__}): not a tokenizers file")
    kind = model.get("type", "BPE" if "merges" in model else None)  # old tokenizers files leave BPE's type out
    if kind in OTHER_MODELS:
        raise NotRepresentable(f"tokenizer.json is a {kind} tokenizer: llama.cpp's gpt2 vocabulary takes BPE only",
                               hint="export a copy of the checkpoint without tokenizer.json to get placeholder "
                                    "tokens (token ids exact, text not tokenized)")
    if kind != "BPE":
        raise ExportError(f"tokenizer.json model type {str(kind)[:40]!r} is not a tokenizers model (BPE, "
                          f"{', '.join(OTHER_MODELS)})")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise ExportError("tokenizer.json: a BPE model needs a vocab object and a merges list")
    tokens: list[str | None] = [None] * rows
    types = [UNUSED] * rows

    def put(text, i, kind):
        if not isinstance(text, str) or type(i) is not int or i < 0:
            raise ExportError(f"tokenizer.json: token {str(text)[:40]!r} has id {str(i)[:20]}, not a non-negative "
                              "integer")
        if i >= rows:
            raise NotRepresentable(f"tokenizer.json has token id {i}, beyond the embedding's {rows} rows: llama.cpp "
                                   "takes the token list as the vocabulary")
        tokens[i], types[i] = text, kind

    for text, i in vocab.items():
        put(text, i, NORMAL)
    added = tok.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(a, dict) for a in added):
        raise ExportError("tokenizer.json: added_tokens must be a list of objects")
    for a in added:
        put(a.get("content"), a.get("id"), CONTROL if a.get("special") is True else USER_DEFINED)
    seen = set()
    for i, t in enumerate(tokens):
        if t is None:
            t = tokens[i] = f"[PAD{i}]"
        if t in seen:
            raise NotRepresentable(f"tokenizer.json names token {t[:40]!r} twice: llama.cpp needs distinct tokens")
        seen.add(t)
    out_merges = []
    for m in merges:
        if isinstance(m, str):
            out_merges.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m):
            out_merges.append(f"{m[0]} {m[1]}")
        else:
            raise ExportError("tokenizer.json: a merge is neither 'a b' nor ['a', 'b']")
    return tokens, types, out_merges or ["<t0> <t1>"]


def special_ids(text_cfg, rows: int) -> dict[str, int]:
    """bos / eos / pad token ids of the transformers config (eos: the first of a list), each an integer within
    the embedding's rows; absent (null) ids are left out, any other value is an ExportError naming the field."""
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(text_cfg, key, None)
        seq = v if isinstance(v, list) else [v]
        for x in seq:
            if x is not None and (type(x) is not int or not 0 <= x < rows):
                shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
                raise ExportError(f"config.json {key} = {shown}: a token id is an integer below the embedding's "
                                  f"{rows} rows", hint="config.json was edited or is corrupt; restore the "
                                                       "checkpoint's own")
        if seq and seq[0] is not None:
            ids[key] = seq[0]
    return ids


def chat_template(root: Path) -> str | None:
    p = root / "chat_template.jinja"
    if os.path.lexists(p):
        return read_bytes(p, p.name, ExportError, 16 << 20).decode("utf-8", errors="replace")
    cfg = _read_json(root / "tokenizer_config.json", "tokenizer_config.json")
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    return t if isinstance(t, str) else None


def write_vocab(w, root: Path, rows: int, text_cfg, pre: str | None) -> dict:
    """tokenizer.ggml.* onto GGUFWriter `w`; returns what was written, for the report."""
    if pre is not None and not PRE_NAME.match(pre):
        raise ExportError(f"--pre-tokenizer {pre[:40]!r} is not a llama.cpp pre-tokenizer name (e.g. qwen2, glm4)")
    ids = special_ids(text_cfg, rows)
    tok = _read_json(root / "tokenizer.json", "tokenizer.json")
    if tok is None:
        tokens, types, merges = placeholder(rows)
        kind = "placeholder (no tokenizer.json)"
    else:
        tokens, types, merges = bpe_vocab(tok, rows)
        kind = "BPE from tokenizer.json"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if key in ids:
            add(ids[key])
    w.add_add_bos_token(False)  # token ids are passed as given
    tmpl = chat_template(root)
    if tmpl:
        w.add_chat_template(tmpl)
    return {"tokenizer": kind, "tokens": rows, "pre_tokenizer": pre or "default", "special": ids,
            "chat_template": bool(tmpl)}
