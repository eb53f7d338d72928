"""Fuzzing the safetensors header parser and the checkpoint index parser.

`parse_header_bytes(raw, file_size)` is pure; it may raise only HeaderError (and its subclasses) or
UnsupportedDtype, and whatever it accepts must describe a buffer that the file really holds: tensors that
tile [0, file_size - data_start) exactly, each exactly dtype size x numel bytes. A seeded loop mutates
real headers 10,000 times (bit flips, truncations, length-prefix and file-size lies, JSON field edits with
hostile values, duplicate keys, deep nesting, numbers too long to convert, broken UTF-8), and hypothesis
builds headers from scratch. The index parser (`Checkpoint.open` on a directory) gets hostile weight_map
names and bytes: it may raise only QuantkitError subclasses, and every shard it accepts is a plain file
inside the directory. Bounded: a few seconds in all (10,000 + 800 seeded cases, 650 hypothesis examples).
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.errors import HeaderError, QuantkitError, UnsupportedDtype
from quantkit.read.checkpoint import INDEX_NAME, Checkpoint, _shard_names
from quantkit.read.safetensors import DTYPES, MAX_NDIM, parse_header_bytes
from quantkit.write.writer import write_safetensors

N_MUTATIONS = 10_000
N_INDEX = 800
ALLOWED = (HeaderError, UnsupportedDtype)


def _seed_files(d: Path) -> list[bytes]:
    """Real safetensors files from our writer: several dtypes, 0-size and 0-d tensors, metadata."""
    g = torch.Generator().manual_seed(0)
    sets = [
        {"a.weight": torch.randn(4, 8, generator=g).bfloat16(), "a.bias": torch.zeros(4),
         "experts.0.down_proj.weight": torch.randn(2, 32, generator=g).half()},
        {"empty": torch.zeros(0, 3), "scalar": torch.tensor(3.0), "ids": torch.arange(5),
         "mask": torch.ones(3, dtype=torch.bool), "fp8": torch.zeros(2, 2).to(torch.float8_e4m3fn),
         "u8": torch.arange(7, dtype=torch.uint8)},
        {f"model.layers.{i}.mlp.experts.{j}.gate_proj.weight": torch.randn(2, 4, generator=g)
         for i in range(3) for j in range(4)},
    ]
    out = []
    for i, tensors in enumerate(sets):
        p = d / f"seed{i}.safetensors"
        write_safetensors(p, tensors, metadata={"format": "pt"} if i != 1 else None)
        out.append(p.read_bytes())
    return out


def check_accepted(raw: bytes, file_size: int) -> None:
    """Parse; on success the header must be self-consistent with the file it describes."""
    try:
        h = parse_header_bytes(raw, file_size)
    except ALLOWED as e:
        assert "\n" not in e.message and len(e.message) < 400, e.message
        raise
    pos = 0
    for info in sorted(h.tensors.values(), key=lambda i: (i.begin, i.end)):
        assert info.begin == pos and info.end >= info.begin
        assert len(info.shape) <= MAX_NDIM and all(isinstance(s, int) and s >= 0 for s in info.shape)
        esize = next(sz for dt, sz in DTYPES.values() if dt == info.dtype)
        assert info.nbytes == info.numel * esize
        pos = info.end
    assert h.data_start + pos == file_size and h.data_start <= len(raw)


# ---- hostile values and mutations -------------------------------------------------------------------
HOSTILE = [
    -1, -(2 ** 63), 2 ** 63, 2 ** 64, 2 ** 64 + 1, 2 ** 100, 1.5, 0.0, -0.0, float("inf"), True, False, None,
    "1", "", "0x10", [], {}, [1], [[1, 2]], [1, 2, 3], [2, 1], [0, 2 ** 64], [-8, 8], [0, 1.0], [0, "8"],
    [2 ** 32] * 4, [2 ** 31, 2 ** 31, 2 ** 31, 2 ** 31], list(range(20)), [0] * 17,
]
DTYPE_JUNK = ["C64", "F4", "f32", "bf16", "", "BF16 ", "I128", 4, None, ["F32"], {"F32": 1}, "F8_E4M3FNUZ"]


def _header_span(raw: bytes) -> int:
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n


def _json_edit(rng: random.Random, raw: bytes) -> bytes:
    end = _header_span(raw)
    doc = json.loads(raw[8:end])
    names = [k for k in doc if k != "__metadata__"]
    op = rng.randrange(9)
    if op == 0 and names:  # a hostile value in a field
        t = doc[rng.choice(names)]
        field = rng.choice(["shape", "data_offsets", "dtype"])
        t[field] = rng.choice(DTYPE_JUNK if field == "dtype" and rng.random() < 0.7 else HOSTILE)
    elif op == 1 and names:  # huge dims whose product overflows int64, with matching-looking offsets
        t = doc[rng.choice(names)]
        t["shape"] = [2 ** rng.randrange(16, 40) for _ in range(rng.randrange(2, 6))]
        b = t["data_offsets"][0]
        t["data_offsets"] = [b, b + rng.choice([0, 2 ** 64, 2 ** 63 - 1, 4096])]
    elif op == 2 and names:  # a key removed or added
        t = doc[rng.choice(names)]
        if rng.random() < 0.5:
            t.pop(rng.choice(list(t)), None)
        else:
            t["extra"] = 1
    elif op == 3:  # hostile metadata
        doc["__metadata__"] = rng.choice([None, 0, [], "x", {"a": 1}, {"a": None}, {"a": {"b": "c"}}, {"": ""}])
    elif op == 4 and names:  # an entry that is not an object
        doc[rng.choice(names)] = rng.choice(HOSTILE)
    elif op == 5 and len(names) >= 2:  # offsets swapped between two tensors
        a, b = rng.sample(names, 2)
        doc[a]["data_offsets"], doc[b]["data_offsets"] = doc[b]["data_offsets"], doc[a]["data_offsets"]
    elif op == 6 and names:  # a dtype changed to another real one (size mismatch unless same width)
        doc[rng.choice(names)]["dtype"] = rng.choice(sorted(DTYPES))
    elif op == 7 and names:  # a tensor renamed to something odd
        k = rng.choice(names)
        doc[rng.choice(["", "\n", "\x00", "__metadata__", "[/x]", "\ud7ff" * 50, "a" * 5000])] = doc.pop(k)
    else:  # an entry duplicated under a fresh name (overlap)
        if names:
            doc[rng.choice(names) + "_dup"] = dict(doc[rng.choice(names)])
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text)) + text


def _text_edit(rng: random.Random, raw: bytes) -> bytes:
    end = _header_span(raw)
    text = raw[8:end].decode("utf-8", "replace")
    op = rng.randrange(8)
    if op == 0:  # a duplicated key (json would silently keep the last)
        i = text.index('"', 1)
        j = text.index('":', i + 1)
        key = text[1:j] if text.startswith('{"') else "k"
        body = text.rstrip().rstrip("}")
        text = body + f', "{key}": {{"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}}}'
    elif op == 1:  # deep nesting
        depth = rng.choice([100, 5000, 200_000])
        text = '{"a": ' + "[" * depth + "]" * depth + "}"
    elif op == 2:  # a number too long for int() (ValueError in json)
        text = text.replace("[0,", "[" + "9" * rng.choice([4301, 10_000]) + ",", 1)
    elif op == 3:  # NaN / Infinity / huge float literals
        text = text.replace("[0,", "[" + rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-0", "1e2"]) + ",", 1)
    elif op == 4:  # BOM, NUL, lone surrogate escapes
        text = rng.choice(["\ufeff" + text, text.replace('"', '"\x00', 1), text.replace('"', '"\\ud800', 1)])
    elif op == 5:  # not an object at all
        text = rng.choice(["[]", "null", "1", '"x"', "", " ", "{", "}", "{}", "{}{}", '{"a":1}'])
    elif op == 6:  # invalid UTF-8
        b = bytearray(text.encode())
        b[rng.randrange(len(b))] = rng.choice([0x80, 0xC0, 0xFF, 0xED])
        return struct.pack("<Q", len(b)) + bytes(b)
    else:  # trailing garbage after the object
        text = text + rng.choice([" ", "\x00", "x", "}", "\n\n"])
    b = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(b)) + b


def mutate(rng: random.Random, seed: bytes) -> tuple[bytes, int]:
    """One mutated (raw, file_size) from a real file's bytes."""
    end = _header_span(seed)
    data_len = len(seed) - end
    kind = rng.randrange(7)
    if kind == 0:  # bit flips anywhere in the length prefix or header
        b = bytearray(seed[:end])
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), len(b) + data_len
    if kind == 1:  # truncation: the header read is cut, the file may be cut too
        cut = rng.randrange(0, end + 1)
        return seed[:cut], rng.choice([cut, len(seed), cut + data_len])
    if kind == 2:  # the length prefix lies
        (n,) = struct.unpack("<Q", seed[:8])
        n2 = rng.choice([0, 1, n - 1, n + 1, n + 8, 2 ** 27, 100_000_001, 2 ** 63, 2 ** 64 - 1, rng.randrange(2 ** 64)])
        return struct.pack("<Q", n2) + seed[8:end], len(seed)
    if kind == 3:  # the file size lies
        return seed[:end], rng.choice([0, 7, 8, end - 1, end, len(seed) - 1, len(seed) + 1, len(seed) + 4096, 2 ** 64])
    if kind in (4, 5):
        raw = _json_edit(rng, seed)
    else:
        raw = _text_edit(rng, seed)
    return raw, len(raw) + data_len + rng.choice([0, 0, 0, -1, 1, 8])


def test_header_mutations_seeded(tmp_path):
    seeds = _seed_files(tmp_path)
    rng = random.Random(0x5AFE)
    outcomes: Counter[str] = Counter()
    for _ in range(N_MUTATIONS):
        raw, size = mutate(rng, rng.choice(seeds))
        try:
            check_accepted(raw, size)
            outcomes["accepted"] += 1
        except ALLOWED as e:
            outcomes[type(e).__name__] += 1
    assert sum(outcomes.values()) == N_MUTATIONS
    # the mutations reach every kind of check (and some still parse: edits that keep the file valid)
    assert set(outcomes) >= {"accepted", "HeaderError", "TruncatedShard", "HeaderTooLarge", "HeaderNotJSON",
                             "DuplicateKey", "InvalidOffsets", "TensorSizeMismatch", "UnsupportedDtype"}, outcomes


def test_seed_headers_parse(tmp_path):
    for raw in _seed_files(tmp_path):
        check_accepted(raw, len(raw))


# ---- hypothesis: headers built from scratch ---------------------------------------------------------
ints = st.one_of(st.integers(-4, 64), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([2 ** 63, 2 ** 64]))
values = st.recursive(st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=8)),
                      lambda c: st.one_of(st.lists(c, max_size=5), st.dictionaries(st.text(max_size=5), c, max_size=4)),
                      max_leaves=12)
entry = st.one_of(
    st.fixed_dictionaries({"dtype": st.one_of(st.sampled_from(sorted(DTYPES)), values),
                           "shape": st.one_of(st.lists(ints, max_size=5), values),
                           "data_offsets": st.one_of(st.lists(ints, min_size=2, max_size=2), values)}),
    values)
headers = st.dictionaries(st.text(max_size=12), entry, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=headers, data_len=st.integers(0, 512), slack=st.sampled_from([0, 0, -1, 1, 7]))
def test_header_hypothesis(doc, data_len, slack):
    raw = json.dumps(doc).encode()
    raw = struct.pack("<Q", len(raw)) + raw
    try:
        check_accepted(raw, len(raw) + data_len + slack)
    except ALLOWED:
        pass


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=256), size=st.integers(0, 2 ** 66))
def test_header_hypothesis_raw_bytes(blob, size):
    for raw in (blob, struct.pack("<Q", len(blob)) + blob):
        try:
            check_accepted(raw, max(size, len(raw)) if size % 2 else len(raw))
        except ALLOWED:
            pass


# ---- the index parser -------------------------------------------------------------------------------
HOSTILE_NAMES = [
    "../x.safetensors", "../../etc/passwd", "/etc/passwd", "/tmp/x.safetensors", "a/b.safetensors",
    "a\\b.safetensors", "x.safetensors\n", "x.safetensors\x00", "\x00", "", ".", "..", "...safetensors",
    ".hidden.safetensors", "x" * 300 + ".safetensors", "\u00fc.safetensors", "%2e%2e/x.safetensors",
    "~/x.safetensors", "C:\\x.safetensors", "x.safetensors/", " x.safetensors", "[/x].safetensors",
    "x.bin", "pytorch_model.bin", "link_out.safetensors", "loop.safetensors", "dir.safetensors",
    "dangling.safetensors", "missing.safetensors", "config.json", INDEX_NAME, "s1.safetensors", "s2.safetensors",
]
TENSOR_NAMES = ["a", "b", "c", "d", "", "\n", "a" * 1000, "__metadata__", "[/x]", "\ud800"]


@pytest.fixture(scope="module")
def ckdir(tmp_path_factory):
    """config.json, two shards (s1: a, b; s2: c, d) and symlinks: out of the directory, a loop, to a
    directory, dangling."""
    root = tmp_path_factory.mktemp("fuzzidx") / "ck"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "x"}')
    write_safetensors(root / "s1.safetensors", {"a": torch.zeros(2), "b": torch.ones(3)})
    write_safetensors(root / "s2.safetensors", {"c": torch.zeros(1), "d": torch.ones(2, 2)})
    outside = root.parent / "outside.safetensors"
    write_safetensors(outside, {"a": torch.zeros(2)})
    (root / "link_out.safetensors").symlink_to(outside)
    (root / "loop.safetensors").symlink_to("loop.safetensors")
    (root / "sub").mkdir()
    (root / "dir.safetensors").symlink_to("sub")
    (root / "dangling.safetensors").symlink_to("nowhere.safetensors")
    return root


def _open_index(root: Path, index_bytes: bytes) -> None:
    (root / INDEX_NAME).write_bytes(index_bytes)
    try:
        names = _shard_names(root)
        ck = Checkpoint.open(root)
    except QuantkitError as e:
        assert "\n" not in e.message and len(e.message) < 400, e.message
        return
    base = root.resolve()
    for n in names:
        assert "/" not in n and "\\" not in n and ".." not in n and not n.startswith(".")
        assert (root / n).resolve().is_relative_to(base) and (root / n).is_file()
    assert set(ck.location.values()) <= set(names)


def _random_index(rng: random.Random) -> bytes:
    real = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors", "d": "s2.safetensors"}
    wm = dict(real) if rng.random() < 0.6 else {}
    for _ in range(rng.randrange(0, 4)):
        wm[rng.choice(TENSOR_NAMES)] = rng.choice(HOSTILE_NAMES + [1, None, [], {}, 2 ** 70])
    doc = rng.choice([{"weight_map": wm}, {"metadata": {"total_size": 1}, "weight_map": wm}, {"weight_map": list(wm)},
                      {"weight_map": None}, {}, [wm], {"weight_map": wm, "x": float("nan")}])
    raw = json.dumps(doc).encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.2:  # bit flips
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        raw = bytes(b)
    elif r < 0.3:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif r < 0.35 and raw.startswith(b'{"weight_map": {'):  # a duplicated key
        raw = raw.replace(b'{"weight_map": {', b'{"weight_map": {"a": "s2.safetensors", ', 1)
    return raw


def test_index_mutations_seeded(ckdir):
    rng = random.Random(1234)
    n = 0
    for _ in range(N_INDEX):
        _open_index(ckdir, _random_index(rng))
        n += 1
    assert n == N_INDEX


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wm=st.dictionaries(st.one_of(st.sampled_from(TENSOR_NAMES), st.text(max_size=6)),
                          st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=20), st.integers(), st.none()),
                          max_size=6))
def test_index_hypothesis(ckdir, wm):
    _open_index(ckdir, json.dumps({"weight_map": wm}).encode("utf-8", "surrogatepass"))
