"""Calibration data: formats, packing, pre-tokenized rows, deterministic sampling, chat templates, errors."""

import json
import os

import pytest
import torch

from quantkit.errors import DatasetError, DatasetNotFound
from quantkit.calib.data import (ByteTokenizer, CalibrationWarning, default_dataset_path, load_calibration_data,
                                 load_tokenizer, pack, read_rows)
from quantkit.errors import QuantkitError

V = 512
# The byte-tokenizer fallback warns on every call; tests that care use pytest.warns.
pytestmark = pytest.mark.filterwarnings("ignore::quantkit.calib.data.CalibrationWarning")


def _load(ds, **kw):
    kw.setdefault("vocab_size", V)
    with pytest.warns(CalibrationWarning):  # byte tokenizer (no tokenizer given)
        return load_calibration_data(ds, **kw)


def _bytes(text):
    return [b % V for b in text.encode()]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_text_is_packed_into_windows(tmp_path):
    docs = ["Hello world, this is document one.", "Zweites Dokument: Grüße!", "第三个文档。" * 5]
    ds = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    data = _load(ds, num_samples=100, seq_len=8)
    stream = [t for d in docs for t in _bytes(d)]
    assert all(s.shape == (8,) and s.dtype == torch.int64 for s in data.samples)
    assert data.num_samples == len(stream) // 8  # fewer windows than asked: all of them, in stream order
    assert torch.cat(data.samples).tolist() == stream[: data.num_samples * 8]
    d = data.describe()
    assert d["source"] == str(ds) and len(d["sha256"]) == 64 and d["tokenizer"] == "bytes-mod-vocab"
    assert d["num_tokens"] == data.num_samples * 8 and not d["pretokenized"]
    assert any("fewer" in n or "holds" in n for n in d["notes"])


def test_sampling_is_deterministic_and_seeded(tmp_path):
    ds = _jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}: " + "abcdefghij" * (i % 7 + 1)} for i in range(200)])
    a = _load(ds, num_samples=10, seq_len=16, seed=0)
    b = _load(ds, num_samples=10, seq_len=16, seed=0)
    c = _load(ds, num_samples=10, seq_len=16, seed=1)
    assert a.num_samples == 10 and all(torch.equal(x, y) for x, y in zip(a.samples, b.samples))
    assert not all(torch.equal(x, y) for x, y in zip(a.samples, c.samples))
    windows = pack([_bytes(r["text"]) for r in read_rows(ds).rows], 16)
    rows = {tuple(w.tolist()) for w in windows}
    assert all(tuple(s.tolist()) in rows for s in a.samples)  # every sample is a window of the stream


def test_txt_and_json_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("plain text file\nwith two lines\n", encoding="utf-8")
    data = _load(txt, num_samples=3, seq_len=10)  # 31 bytes: 3 windows
    assert torch.cat(data.samples).tolist() == _bytes("plain text file\nwith two lines\n")[:30]
    js = tmp_path / "a.json"
    js.write_text(json.dumps({"data": [{"text": "abcdefgh"}, "ijklmnop"]}))
    data = _load(js, num_samples=4, seq_len=4)
    assert torch.cat(data.samples).tolist() == _bytes("abcdefghijklmnop")


def test_input_ids_rows_are_used_as_is(tmp_path):
    rows = [{"input_ids": list(range(i, i + n))} for i, n in ((0, 5), (10, 40), (100, 12), (200, 3))]
    ds = _jsonl(tmp_path / "ids.jsonl", rows)
    with pytest.warns(CalibrationWarning, match="holds 4"):
        data = load_calibration_data(ds, vocab_size=V, num_samples=10, seq_len=32)
    assert data.pretokenized and data.tokenizer == "pre-tokenized"
    # one row = one sample: no packing; only the 40-token row is cut to seq_len
    assert [s.tolist() for s in data.samples] == [r["input_ids"][:32] for r in rows]
    two = load_calibration_data(ds, vocab_size=V, num_samples=2, seq_len=32, seed=5)
    assert two.num_samples == 2 and all(any(s.tolist() == r["input_ids"][:32] for r in rows) for s in two.samples)
    again = load_calibration_data(ds, vocab_size=V, num_samples=2, seq_len=32, seed=5)
    assert [s.tolist() for s in again.samples] == [s.tolist() for s in two.samples]


def test_input_ids_errors(tmp_path):
    with pytest.raises(DatasetError, match="outside"):
        load_calibration_data(_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, V]}]), vocab_size=V, num_samples=1,
                              seq_len=8)
    with pytest.raises(DatasetError, match="no `input_ids`"):
        load_calibration_data(_jsonl(tmp_path / "b.jsonl", [{"input_ids": [1, 2]}, {"text": "x"}]), vocab_size=V,
                              num_samples=1, seq_len=8)
    with pytest.raises(DatasetError, match="integer"):
        load_calibration_data(_jsonl(tmp_path / "c.jsonl", [{"input_ids": ["a"]}]), vocab_size=V, num_samples=1,
                              seq_len=8)


def _chat_tokenizer(model_dir):
    """A tiny word-level fast tokenizer with a chat template, saved like a model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "there", "how", "are", "you", "fine",
             "thanks", "?", ",", "!"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}")
    fast.save_pretrained(model_dir)
    return fast


def test_messages_use_the_chat_template(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    ref = _chat_tokenizer(model_dir)
    tok = load_tokenizer(model_dir)
    assert tok is not None and tok.chat_template
    msgs = [{"role": "user", "content": "hello there , how are you ?"},
            {"role": "assistant", "content": "fine , thanks !"}]
    ds = _jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}] * 3)
    text = ref.apply_chat_template(msgs, tokenize=False)
    one = ref(text, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]  # the template owns BOS
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # a real tokenizer: no fallback warning
        data = load_calibration_data(ds, tokenizer=tok, num_samples=3 * len(one) // 4, seq_len=4)
    assert one[:2] == [3, 5]  # <|user|> hello: the template was applied
    assert torch.cat(data.samples).tolist() == (one * 3)[: data.num_samples * 4]
    assert "PreTrainedTokenizerFast" in data.tokenizer or "Tokenizer" in data.tokenizer


def test_messages_without_template_fall_back_with_a_warning(tmp_path):
    ds = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.warns(CalibrationWarning, match="chat template"):
        data = load_calibration_data(ds, vocab_size=V, num_samples=1, seq_len=4)
    assert torch.cat(data.samples).tolist() == _bytes("user: hi\n")[:4]
    with pytest.raises(DatasetError, match="role, content"):
        load_calibration_data(_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}]), vocab_size=V,
                              num_samples=1, seq_len=4)


def test_model_dir_without_tokenizer_gives_none(tiny_models):
    assert load_tokenizer(tiny_models("qwen3_moe")) is None
    assert ByteTokenizer(7).encode("\x07\x08") == [0, 1]


def test_default_set():
    p = default_dataset_path()
    assert 100_000 <= p.stat().st_size <= 300_000
    rows = read_rows(None).rows
    assert len(rows) >= 100 and all(isinstance(r["text"], str) and r["text"] for r in rows)
    kinds = {r["kind"] for r in rows}
    langs = {r["lang"] for r in rows}
    assert {"prose", "code", "math", "dialogue"} <= kinds and len(langs - {"code", "data", "logs"}) >= 8
    data = _load(None, num_samples=4, seq_len=64)
    assert data.source == "quantkit:default.jsonl" and data.num_samples == 4


def test_errors(tmp_path):
    with pytest.raises(DatasetNotFound, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetNotFound):
        read_rows("./nope/data")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match="unsupported dataset file type"):
        read_rows(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "list.json").write_text('{"a": 1}')
    with pytest.raises(DatasetError, match="list of rows"):
        read_rows(tmp_path / "list.json")
    with pytest.raises(DatasetError, match="no `text`"):
        load_calibration_data(_jsonl(tmp_path / "f.jsonl", [{"body": "x"}]), vocab_size=V, num_samples=1, seq_len=4)
    with pytest.raises(DatasetError, match="positive"):
        load_calibration_data(None, vocab_size=V, num_samples=0, seq_len=4)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DatasetError, match="save_to_disk"):
        read_rows(tmp_path / "folder")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_calibration_data(tmp_path / "empty.jsonl", vocab_size=V, num_samples=1, seq_len=4)
    assert issubclass(DatasetError, QuantkitError) and DatasetError.hint


def _without(monkeypatch, *modules):
    """Import of `modules` fails, as on a machine without them (they are dependencies here)."""
    import sys

    for m in modules:
        for name in [n for n in sys.modules if n == m or n.startswith(m + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, m, None)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    _without(monkeypatch, "pyarrow")
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match="pyarrow") as e:
        read_rows(tmp_path / "d.parquet")
    assert "pip install pyarrow" in e.value.hint


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["abcd", "efgh"]}), tmp_path / "d.parquet")
    data = _load(tmp_path / "d.parquet", num_samples=2, seq_len=4)
    assert torch.cat(data.samples).tolist() == _bytes("abcdefgh")


def test_saved_dataset_and_hub_without_datasets_are_clear_errors(tmp_path, monkeypatch):
    _without(monkeypatch, "datasets")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    with pytest.raises(DatasetError, match="`datasets` package"):
        read_rows(tmp_path / "saved")
    with pytest.raises(DatasetError, match="not a local path.*`datasets` package"):
        read_rows("someone/some-dataset")


def _hub_dataset(cache, repo: str, files: dict[str, str], commit: str = "a" * 40):
    """A dataset repo in the hub cache's own layout: blobs, a snapshot of links to them, refs/main."""
    import hashlib

    root = cache / ("datasets--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for rel, text in files.items():
        blob = root / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_text(text)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root


def test_hub_dataset_id_resolves_offline_from_the_hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    rows = "".join(json.dumps({"text": t}) + "\n" for t in ("abcd", "efgh"))
    _hub_dataset(cache, "acme/calib", {"data/train.jsonl": rows, "data/test.jsonl": '{"text": "zz"}\n'})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    data = _load("acme/calib", num_samples=2, seq_len=4)
    assert torch.cat(data.samples).tolist() == _bytes("abcdefgh")  # the train split only
    assert data.describe()["source"].startswith("hub:acme/calib@")
    with pytest.raises(DatasetError, match="not in the local hub cache") as e:
        read_rows("acme/missing")
    assert "hf download" in e.value.hint


def test_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["abcd", "efgh"]}).save_to_disk(str(tmp_path / "saved"))
    data = _load(tmp_path / "saved", num_samples=2, seq_len=4)
    assert torch.cat(data.samples).tolist() == _bytes("abcdefgh")
