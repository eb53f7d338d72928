"""Hostile and broken input through the command line: every case exits 1 with one `error:` line (plus
an optional `hint:` line), no traceback, nothing on stdout, no temporary file left behind, and no
manifest that says "complete". The library raises the named error class the case expects.

The cases run in processes forked from a small server that has already imported quantkit (and torch),
so each costs a fork instead of a 3-5 s interpreter start: the child calls `quantkit.cli.main(argv)`,
exactly what the `quantkit` console script does, with its own stdout/stderr, exit status, environment,
resource limits and (for the resume tests) fault injection. `test_fork_harness_matches_real_cli` checks
that a real `python -m quantkit.cli` gives the same result as the harness.

The harness (the fork server, `cli`, `src18`, `reference`, `tree`) is tests/harness.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit import errors as E
from quantkit.convert import ConvertOptions, convert

from harness import (GROUP48, Result, assert_clean_failure, cli, manifest_status, reference,  # noqa: F401
                     run_bounded, src18, tree)


# ---- building broken checkpoints --------------------------------------------------------------------
def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: dict | str, data: bytes) -> None:
    hb = (header if isinstance(header, str) else json.dumps(header)).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def edit_header(path: Path, edit) -> None:
    """Rewrite a shard's header with `edit(header_dict)` (which mutates it or returns text); data kept."""
    h, data = split(path)
    new = edit(h)
    write_st(path, h if new is None else new, data)


def index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def shard_of(src: Path, tensor: str) -> Path:
    return src / index(src)["weight_map"][tensor]


def tensors_sorted(h: dict) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])


EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


def poke_weight(src: Path, tensor: str, value: bytes) -> None:
    """Overwrite the first element of `tensor` with raw bytes (bf16: NaN 0x7fc0, +Inf 0x7f80)."""
    p = shard_of(src, tensor)
    raw = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    at = 8 + n + h[tensor]["data_offsets"][0]
    raw[at:at + len(value)] = value
    p.write_bytes(bytes(raw))


def _truncate(src):
    p = src / "model-00005-of-00018.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def _header_over_cap(src):
    p = src / "model-00005-of-00018.safetensors"
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def _header_not_json(src):
    p = src / "model-00005-of-00018.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8] = ord("x")  # '{' -> 'x'
    p.write_bytes(bytes(raw))


def _header_huge_int(src):  # 5000 digits: json parses it, Python refuses to convert it (ValueError)
    edit_header(src / "model-00005-of-00018.safetensors",
                lambda h: json.dumps(h).replace('"data_offsets": [0,', '"data_offsets": [' + "1" * 5000 + ",", 1))


def _header_duplicate_key(src):
    def dup(h):
        name = tensors_sorted(h)[0]
        text = json.dumps(h)
        return text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(h[name]) + "}"
    edit_header(src / "model-00005-of-00018.safetensors", dup)


def _overlap(src):
    def ov(h):
        a, b = tensors_sorted(h)[:2]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
    edit_header(src / "model-00005-of-00018.safetensors", ov)


def _negative_offset(src):
    def neg(h):
        h[tensors_sorted(h)[0]]["data_offsets"][0] = -8
    edit_header(src / "model-00005-of-00018.safetensors", neg)


def _offsets_past_end(src):
    def past(h):
        last = h[tensors_sorted(h)[-1]]
        b, e = last["data_offsets"]
        last["shape"][0] *= 2
        last["data_offsets"] = [b, b + 2 * (e - b)]
    edit_header(src / "model-00005-of-00018.safetensors", past)


def _shape_mismatch(src):
    def sh(h):
        h[tensors_sorted(h)[0]]["shape"][-1] += 1
    edit_header(src / "model-00005-of-00018.safetensors", sh)


def _dtype_mismatch(src):
    def dt(h):
        t = next(t for t in tensors_sorted(h) if h[t]["dtype"] == "BF16")
        h[t]["dtype"] = "F32"
    edit_header(src / "model-00005-of-00018.safetensors", dt)


def _unknown_dtype(src):
    def dt(h):
        h[tensors_sorted(h)[0]]["dtype"] = "C64"
    edit_header(src / "model-00005-of-00018.safetensors", dt)


def _f64_expert(src):
    """A routed expert stored as F64: a dtype the quantizer does not take. It must not be copied
    through silently as if the recipe had not targeted it."""
    p = shard_of(src, EXPERT)
    h, data = split(p)
    import torch

    tensors = {}
    for name in tensors_sorted(h):
        b, e = h[name]["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:e]), dtype=torch.bfloat16).reshape(h[name]["shape"])
        tensors[name] = t.double() if name == EXPERT else t
    from quantkit.write.writer import write_safetensors

    write_safetensors(p, tensors, metadata={"format": "pt"})


def _duplicate_tensor(src):
    """The first tensor of shard 1 appears again in shard 2 (the index still says shard 1)."""
    h1, d1 = split(src / "model-00001-of-00018.safetensors")
    name = tensors_sorted(h1)[0]
    b, e = h1[name]["data_offsets"]
    p2 = src / "model-00002-of-00018.safetensors"
    h2, d2 = split(p2)
    h2[name] = {**h1[name], "data_offsets": [len(d2), len(d2) + e - b]}
    write_st(p2, h2, d2 + d1[b:e])


def _missing_shard(src):
    (src / "model-00007-of-00018.safetensors").unlink()


def _set_index_name(src, name):
    idx = index(src)
    k = sorted(idx["weight_map"])[0]
    idx["weight_map"][k] = name
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def _index_escape(src):
    outside = src.parent / "evil.safetensors"
    shutil.copy(src / "model-00001-of-00018.safetensors", outside)
    _set_index_name(src, "../evil.safetensors")


def _index_absolute(src):
    _set_index_name(src, str(src / "model-00001-of-00018.safetensors"))


def _index_newline(src):  # `re.match(...$)` accepts a trailing newline; fullmatch does not
    _set_index_name(src, "model-00001-of-00018.safetensors\n")


def _index_symlink_out(src):
    p = src / "model-00003-of-00018.safetensors"
    outside = src.parent / "outside.safetensors"
    shutil.move(p, outside)
    p.symlink_to(outside)


def _index_symlink_loop(src):
    p = src / "model-00003-of-00018.safetensors"
    p.unlink()
    p.symlink_to(p.name)


def _index_duplicate_key(src):
    text = (src / "model.safetensors.index.json").read_text()
    k = sorted(index(src)["weight_map"])[0]
    text = text.replace('"weight_map": {', '"weight_map": {' + json.dumps(k) + ': "model-00002-of-00018.safetensors", ', 1)
    (src / "model.safetensors.index.json").write_text(text)


def _index_not_json(src):
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')


def _index_markup_name(src):  # a name that is also rich console markup must print as text
    _set_index_name(src, "[/x].safetensors")


def _pickle_only(src):
    for p in src.glob("*.safetensors"):
        p.unlink()
    (src / "model.safetensors.index.json").unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pretend pickle")


def _nan(src):
    poke_weight(src, EXPERT, b"\xc0\x7f")


def _inf(src):
    poke_weight(src, EXPERT, b"\x80\x7f")


def _config_missing(src):
    (src / "config.json").unlink()


def _config_malformed(src):
    (src / "config.json").write_text('{"model_type": "qwen3_moe", ')


def _config_not_object(src):
    (src / "config.json").write_text("[1, 2, 3]")


def _config_lone_surrogate(src):  # parses, but cannot be written back as UTF-8
    cfg = json.loads((src / "config.json").read_text())
    cfg["_name_or_path"] = "\ud800"
    (src / "config.json").write_text(json.dumps(cfg))



# id, breaks the source copy, expected error class, extra CLI args
CASES = [
    ("truncated_shard", _truncate, E.TruncatedShard, ()),
    ("header_over_cap", _header_over_cap, E.HeaderTooLarge, ()),
    ("header_not_json", _header_not_json, E.HeaderNotJSON, ()),
    ("header_huge_int", _header_huge_int, E.HeaderNotJSON, ()),
    ("header_duplicate_key", _header_duplicate_key, E.DuplicateKey, ()),
    ("offsets_overlap", _overlap, E.InvalidOffsets, ()),
    ("offsets_negative", _negative_offset, E.InvalidOffsets, ()),
    ("offsets_past_end", _offsets_past_end, E.TruncatedShard, ()),
    ("shape_size_mismatch", _shape_mismatch, E.TensorSizeMismatch, ()),
    ("dtype_size_mismatch", _dtype_mismatch, E.TensorSizeMismatch, ()),
    ("dtype_unknown", _unknown_dtype, E.UnsupportedDtype, ()),
    ("dtype_unsupported_for_expert", _f64_expert, E.UnsupportedDtype, ()),
    ("duplicate_tensor_across_shards", _duplicate_tensor, E.DuplicateTensor, ()),
    ("index_missing_shard", _missing_shard, E.MissingShard, ()),
    ("index_dotdot_escape", _index_escape, E.UnsafeShardName, ()),
    ("index_absolute_path", _index_absolute, E.UnsafeShardName, ()),
    ("index_newline_name", _index_newline, E.UnsafeShardName, ()),
    ("index_symlink_outside", _index_symlink_out, E.UnsafeShardName, ()),
    ("index_symlink_loop", _index_symlink_loop, E.UnsafeShardName, ()),
    ("index_duplicate_key", _index_duplicate_key, E.IndexError_, ()),
    ("index_not_json", _index_not_json, E.IndexError_, ()),
    ("index_name_is_markup", _index_markup_name, E.UnsafeShardName, ()),
    ("pickle_only", _pickle_only, E.UnsafeCheckpoint, ()),
    ("nan_in_expert", _nan, E.NonFiniteWeight, ()),
    ("inf_in_expert", _inf, E.NonFiniteWeight, ()),
    ("config_missing", _config_missing, E.ConfigMissing, ()),
    ("config_malformed", _config_malformed, E.ConfigError, ()),
    ("config_not_object", _config_not_object, E.ConfigError, ()),
    ("config_lone_surrogate", _config_lone_surrogate, E.ConfigError, ()),
    ("group_size_does_not_divide", None, E.GroupSizeError, ("--recipe", "{tmp}/g48.yaml")),
]


def _params():
    for c in CASES:
        yield c if isinstance(c, type(pytest.param(None))) else pytest.param(*c, id=c[0])  # ParameterSet as is


@pytest.mark.parametrize("case,breaker,expected,args", list(_params()))
def test_bad_input_cli(cli, src18, tmp_path, case, breaker, expected, args):
    src = tmp_path / "src"
    shutil.copytree(src18, src, symlinks=True)
    if breaker:
        breaker(src)
    (tmp_path / "g48.yaml").write_text(GROUP48)
    args = [a.format(tmp=tmp_path) for a in args]
    # the library raises the named error
    recipe = args[1] if args else "int4-experts-rtn"
    with pytest.raises(expected) as ei:
        convert(src, tmp_path / "lib", ConvertOptions(recipe=recipe))
    assert "\n" not in ei.value.message and len(ei.value.message) < 400
    assert manifest_status(tmp_path / "lib") != "complete"
    # the CLI prints it as one line + its hint, exit 1, nothing that looks finished
    out = tmp_path / "out"
    r = cli.convert(src, out, "--json", *args)
    line = assert_clean_failure(r, out, ei.value.hint)
    assert line == f"error: {ei.value.message}"


def test_output_not_empty_refused_without_overwrite(cli, src18, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = cli.convert(src18, out, "--json")
    assert_clean_failure(r, out, E.OutputExists.hint)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    r = cli.convert(src18, out / "notes.txt", "--json")  # OUT is a file
    assert_clean_failure(r, out / "notes.txt", E.OutputExists.hint)
    r = cli.convert(src18, out, "--overwrite", "--json")
    assert r.rc == 0 and manifest_status(out) == "complete" and not (out / "notes.txt").exists()


def test_overwrite_never_deletes_the_source(cli, src18, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(src18, src)
    before = tree(src)
    for out in (src, tmp_path):  # OUT is SRC, OUT contains SRC
        r = cli.convert(src, out, "--overwrite")
        assert r.rc == 1 and "Traceback" not in r.stderr, r.stderr
        assert tree(src) == before


def test_hf_cache_snapshot_symlinks_are_allowed(src18, tmp_path):
    """A Hugging Face cache snapshot is all symlinks into the repository's blobs/: those are followed
    (shards and the tokenizer/generation files that are copied), a link anywhere else is not."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(src18.iterdir())):
        blob = blobs / f"{i:064x}"
        shutil.copy(p, blob)
        (snap / p.name).symlink_to(Path("../../blobs") / blob.name)
    from quantkit.read.checkpoint import Checkpoint

    ck = Checkpoint.open(snap)
    assert len(ck.shards) == 18
    assert [p.name for p in ck.non_weight_files()] == ["generation_config.json"]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(src18 / "model-00004-of-00018.safetensors", elsewhere)
    (snap / "model-00004-of-00018.safetensors").unlink()
    (snap / "model-00004-of-00018.safetensors").symlink_to(elsewhere)
    with pytest.raises(E.UnsafeShardName):
        Checkpoint.open(snap)


# ---- disk full --------------------------------------------------------------------------------------
def test_disk_full_efbig_then_resume(cli, src18, reference, tmp_path):
    """RLIMIT_FSIZE in the child (SIGXFSZ ignored): the first shard (131 KB) fails with EFBIG after
    100 KB were written. DiskFull, its temporary removed; after "freeing space" (no limit) the same
    command resumes and the result is byte-identical to an uninterrupted run. (Writes failing at every
    other point, shards and final files, are injected in test_resume.py::test_enospc_*.)"""
    ref_out, _ = reference
    out = tmp_path / "out"
    r = cli.convert(src18, out, "--json", fsize=100_000)
    line = assert_clean_failure(r, out, E.DiskFull.hint)
    assert "no space left writing model-00001-of-00018.safetensors" in line
    r = cli.convert(src18, out, "--json")
    assert r.rc == 0, r.stderr
    assert tree(out) == tree(ref_out)


def _mount_tmpfs(d: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    d.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("size", ["300k", "1000k"])
def test_disk_full_enospc_on_tmpfs_then_resume(cli, src18, reference, tmp_path, size):
    """A real ENOSPC: the output on a small tmpfs (root only; skipped where mount is not allowed). At
    300 KB the disk fills a few shards in, at 1000 KB on the last shard. After the tmpfs is grown (space
    freed) the same command resumes and the result equals an uninterrupted run."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, size):
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "out"
        r = cli.convert(src18, out, "--json")
        assert_clean_failure(r, out, E.DiskFull.hint)
        assert "No space left on device" in r.stderr
        subprocess.run(["mount", "-o", "remount,size=8m", str(mnt)], check=True)
        r = cli.convert(src18, out, "--json")
        assert r.rc == 0, r.stderr
        assert tree(out) == tree(reference[0])
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ---- the harness itself -----------------------------------------------------------------------------
def test_fork_harness_matches_real_cli(cli, src18, tmp_path):
    """The same failing command through the real console entry point and through the fork harness."""
    src = tmp_path / "src"
    shutil.copytree(src18, src)
    _overlap(src)
    real = run_bounded([sys.executable, "-m", "quantkit.cli", "convert", str(src), str(tmp_path / "o"), "--json"],
                       timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"})
    forked = cli.convert(src, tmp_path / "o", "--json")
    assert (real.returncode, real.stdout, real.stderr) == (forked.rc, forked.stdout, forked.stderr)
    assert_clean_failure(forked, tmp_path / "o", E.InvalidOffsets.hint)
