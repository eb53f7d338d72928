"""Prefill/decode pairs against hostile edits and crashes (convert/pair.py, verify/pair.py).

- `verify DECODE --pair PREFILL` holds every shard, config.json and other file of BOTH halves to the sizes and
  sha256 their manifests recorded at write, refuses a file neither manifest records, and names what differs.
- `convert --pair` plans and checks the whole pair before it writes anything; killed at any I/O event, the same
  command resumes and ends with both halves byte-identical to an uninterrupted run, and OUT never says complete
  while its prefill half does not (the one window where exactly one half does: between the two final renames,
  prefill first).
- Manifests that are FIFOs, /dev/zero, symlinks to them, huge, or of the wrong JSON types end in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from quantkit.pack import kv as kvrules
from quantkit.pack.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, manifest_digest
from quantkit.read.safetensors import SafetensorsFile
from quantkit.write.writer import write_safetensors

from harness import cli, manifest_status, tree  # noqa: F401  (cli: the fixture)

SIGKILLED = -9
DEC, PRE = "dec", "dec-prefill"


@pytest.fixture(scope="module")
def src(tiny_models):
    return tiny_models("qwen3_moe")


@pytest.fixture(scope="module")
def kvfile(src, tmp_path_factory):
    """FP8 KV scales for the tiny model (what `quantkit calibrate` writes): no calibration in these tests."""
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    t = {}
    for i in range(layers):
        t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.05 + i / 64], dtype=torch.float32)
        t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.03 + i / 64], dtype=torch.float32)
    p = tmp_path_factory.mktemp("kv") / "kv.safetensors"
    write_safetensors(p, t)
    return p


def assert_clean_failure(r, out, was_complete=False) -> str:
    """The contract for bad input: exit 1, no traceback, nothing on stdout, and on stderr one `error:` line and
    at most a `hint:` line (besides progress: verify's indented steps, convert's bar, and `note:` lines); OUT
    does not look complete unless it was, and holds no temporary. Returns the error line."""
    assert r.rc == 1, (r.rc, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-3000:]
    assert r.stdout == "", r.stdout[:2000]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("  ", "note: ", "converting"))
             and "━" not in ln]
    assert len(lines) in (1, 2) and lines[0].startswith("error: "), r.stderr[-3000:]
    assert len(lines) == 1 or lines[1].startswith("hint: "), r.stderr[-3000:]
    assert (manifest_status(out) == "complete") == was_complete
    if out.is_dir():
        assert not list(out.rglob("*.tmp")), "a temporary file was left behind"
    return lines[0]


def _args(src, base, kvfile):
    return ("convert", src, base / DEC, "-r", "int4-experts-rtn", "--pair", "fp8-prefill", "--kv-scales", kvfile)


@pytest.fixture(scope="module")
def reference(cli, src, kvfile, tmp_path_factory):
    """An uninterrupted pair conversion: its two trees and the I/O events it made (one label per line)."""
    base = tmp_path_factory.mktemp("pairref")
    log = base / "events.log"
    r = cli.run(*_args(src, base, kvfile), faults={"kill_at": 0, "log": str(log)})
    assert r.rc == 0, r.stderr
    return base, log.read_text().splitlines(), tree(base / DEC), tree(base / PRE)


def _at(events, label, nth=0):
    """The 1-based index of the nth event with this label (negative nth: from the end)."""
    return [i for i, e in enumerate(events, 1) if e == label][nth]


def _kill_points(events) -> list[int]:
    """A spread of the uninterrupted run's events: each step of the pair (the decode half's first manifest, the
    journal's removal, the card, its pending manifest; a torn prefill shard; both pending; the final flip
    before, between and after its two renames). Torn shards and journal records of one conversion are
    tests/write/test_resume.py's."""
    m_dec, m_pre = f"{DEC}/{MANIFEST_NAME}", f"{PRE}/{MANIFEST_NAME}"
    named = {
        _at(events, f"before-replace {m_dec}"),  # nothing but temporaries yet
        _at(events, f"after-rmtree {DEC}/.quantkit-journal"),  # decode: full manifest in progress, no journal
        _at(events, f"before-replace {DEC}/README.md"),  # the card's temporary (a random name)
        _at(events, f"after-replace {m_dec}", -2),  # the decode half pending, the prefill half not begun
        _at(events, "emit model-00002-of-00003.safetensors", -2),  # a prefill shard torn
        _at(events, f"after-replace {m_pre}", -2),  # both halves pending
        _at(events, f"before-replace {m_pre}", -1),  # the flip's first temporary
        _at(events, f"after-replace {m_pre}", -1),  # the window: prefill complete, OUT pending
        _at(events, f"before-replace {m_dec}", -1),  # the window, OUT's temporary written
        len(events),  # after the last rename: complete
    }
    return sorted(named)


def test_kill_anywhere_then_the_same_command_completes_the_pair(cli, src, kvfile, reference, tmp_path):
    """SIGKILL at a spread of I/O events (every one of the pair's own steps); after each kill OUT never says
    complete unless its prefill half does, exactly one half says complete only between the two final renames,
    and the same command run again ends with both halves byte-identical to an uninterrupted run."""
    _, events, ref_dec, ref_pre = reference
    window = set(range(_at(events, f"after-replace {PRE}/{MANIFEST_NAME}", -1),
                       _at(events, f"before-replace {DEC}/{MANIFEST_NAME}", -1) + 1))
    assert len(window) == 2  # the prefill half's final rename done, OUT's not yet
    seen_window = 0
    for k in _kill_points(events):
        base = tmp_path / str(k)
        base.mkdir()
        r = cli.run(*_args(src, base, kvfile), faults={"kill_at": k})
        assert r.rc == SIGKILLED, (k, events[k - 1], r.stderr[-2000:])
        sd, sp = manifest_status(base / DEC), manifest_status(base / PRE)
        assert not (sd == "complete" and sp != "complete"), (k, events[k - 1], sd, sp)
        if (sd == "complete") != (sp == "complete"):
            assert k in window, (k, events[k - 1], sd, sp)
            seen_window += 1
            r = cli.run("verify", base / DEC, "--pair", base / PRE, "--no-save")  # OUT pending: no pair yet
            assert r.rc == 1 and "error: the decode checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = cli.run(*_args(src, base, kvfile), "--json")
        if k == len(events):  # killed after the last write: complete, and the rerun says so
            assert_clean_failure(r, base / DEC, was_complete=True)
        else:
            assert r.rc == 0, (k, events[k - 1], r.stderr[-3000:])
            doc = json.loads(r.stdout)
            assert doc["pair"]["kv_shard_sha256"] and doc["pair"]["prefill"]["output"] == str(base / PRE)
        assert tree(base / DEC) == ref_dec, (k, events[k - 1])
        assert tree(base / PRE) == ref_pre, (k, events[k - 1])
    assert seen_window == 2


# ---- verify --pair: every file of both halves --------------------------------------------------------
@pytest.fixture(scope="module")
def pair_dirs(reference):
    base, _, _, _ = reference
    return base


def _copy(pair_dirs, tmp_path):
    for n in (DEC, PRE):
        shutil.copytree(pair_dirs / n, tmp_path / n)
    return tmp_path / DEC, tmp_path / PRE


def _manifest(d):
    return json.loads((d / MANIFEST_NAME).read_text())


def _write_manifest(d, m):
    (d / MANIFEST_NAME).write_text(json.dumps(m, indent=2))


def _flip_byte(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 1
    p.write_bytes(bytes(b))


def _edit_json(p, **kw):
    doc = json.loads(p.read_text())
    doc.update(kw)
    p.write_text(json.dumps(doc, indent=2))


def _extra_tensor(d):
    """A tensor added to a shard, and every record of that shard made to match (the manifest's shard entry,
    the index's total_size and the index's recorded hash): only the tensor table against the header is left."""
    from quantkit.write.writer import sha256_file

    name, index = "model-00001-of-00003.safetensors", d / "model.safetensors.index.json"
    with SafetensorsFile(d / name) as f:
        t = {n: f.get(n).clone() for n in f.header.tensors}
    t["model.layers.0.mlp.experts.0.backdoor"] = torch.ones(4)
    before = (d / name).stat().st_size
    (d / name).unlink()
    write_safetensors(d / name, t, metadata={"format": "pt"})
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += (d / name).stat().st_size - before
    index.write_text(json.dumps(doc, indent=2))
    m = _manifest(d)
    for s in m["shards"]:
        if s["name"] == name:
            s["size"], s["sha256"] = (d / name).stat().st_size, sha256_file(d / name)
    m["pair"]["files"][index.name] = {"size": index.stat().st_size, "sha256": sha256_file(index)}
    _write_manifest(d, m)


EDITS = {
    # name: (half, edit, what the error must name)
    "shard_byte": (PRE, lambda d: _flip_byte(d / "model-00002-of-00003.safetensors"), "model-00002-of-00003"),
    "config": (PRE, lambda d: _edit_json(d / "config.json", rope_theta=1.0), "config.json"),
    "index": (PRE, lambda d: _edit_json(d / "model.safetensors.index.json", extra=1), "model.safetensors.index.json"),
    "copied_file": (PRE, lambda d: _edit_json(d / "generation_config.json", top_k=1), "generation_config.json"),
    "missing_file": (PRE, lambda d: (d / "generation_config.json").unlink(), "generation_config.json"),
    "extra_file": (PRE, lambda d: (d / "modeling_evil.py").write_text("import os\n"), "modeling_evil.py"),
    "extra_shard": (PRE, lambda d: shutil.copy(d / "model-00001-of-00003.safetensors",
                                               d / "model-00009-of-00009.safetensors"), "model-00009-of-00009"),
    "extra_tensor": (PRE, _extra_tensor, "model.layers.0.mlp.experts.0.backdoor"),
    "decode_config": (DEC, lambda d: _edit_json(d / "config.json", rope_theta=1.0), "config.json"),
    "decode_kv": (DEC, lambda d: _flip_byte(d / kvrules.KV_SHARD_NAME), kvrules.KV_SHARD_NAME),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_check_pair_checks_every_file_of_both_halves(pair_dirs, tmp_path, name):
    """An edited shard, config.json, index or copied file of either half, a missing or an extra file, or a
    tensor added to a shard with every hash re-forged to match: refused in one line naming it and the half."""
    from quantkit.errors import PairMismatch
    from quantkit.verify.pair import check_pair

    dec, pre = _copy(pair_dirs, tmp_path)
    half, edit, named = EDITS[name]
    edit(tmp_path / half)
    with pytest.raises(PairMismatch) as e:
        check_pair(dec, pre)
    msg = e.value.message
    assert named in msg and "\n" not in msg and f"the {'decode' if half == DEC else 'prefill'} checkpoint" in msg, msg


@pytest.mark.parametrize("name", ["config", "decode_kv"])
def test_verify_cli_refuses_an_edited_half(cli, pair_dirs, tmp_path, name):
    """Through the command line: one line, exit 1, and no verify.json saying anything passed."""
    dec, pre = _copy(pair_dirs, tmp_path)
    half, edit, named = EDITS[name]
    edit(tmp_path / half)
    r = cli.run("verify", dec, "--pair", pre, timeout=60)
    assert named in assert_clean_failure(r, dec, was_complete=True)
    assert not (dec / "verify.json").exists()


def test_untouched_pair_passes_with_what_later_commands_write(pair_dirs, tmp_path):
    """The untouched copy is a pair (so the refusals above are the edits'), and the files later commands write
    into a checkpoint (verify.json, the refreshed card, the HTML report) do not break it."""
    from quantkit.verify.pair import check_pair

    dec, pre = _copy(pair_dirs, tmp_path)
    assert check_pair(dec, pre)["kv_tensors"] == 4
    for d in (dec, pre):
        (d / "verify.json").write_text("{}")
        (d / "quantkit_report.html").write_text("<html></html>")
        (d / "README.md").write_text((d / "README.md").read_text() + "\nverified\n")
    assert check_pair(dec, pre)["kv_tensors"] == 4


def _forge(dec, pre, edit_pre):
    """Edit the prefill manifest and re-forge the decode manifest's record of it, so that the manifests still
    record each other: only the field itself can be refused."""
    mp = _manifest(pre)
    edit_pre(mp)
    _write_manifest(pre, mp)
    md = _manifest(dec)
    md["pair"]["partner_manifest_sha256"] = manifest_digest(mp)
    _write_manifest(dec, md)


def _special(kind):
    def make(d):
        p = d / MANIFEST_NAME
        p.unlink()
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dev_zero":
            p.symlink_to("/dev/zero")
        elif kind == "link_to_fifo":
            os.mkfifo(d / "fifo")
            p.symlink_to(d / "fifo")
        elif kind == "huge":
            with open(p, "wb") as f:
                f.truncate(MAX_MANIFEST_BYTES + 1)
    return make


def _json(value):
    return lambda d: (d / MANIFEST_NAME).write_text(json.dumps(value))


def _field(**kw):
    return lambda d: _edit_json(d / MANIFEST_NAME, **kw)


def _pair_field(**kw):
    def edit(d):
        m = _manifest(d)
        m["pair"].update(kw)
        _write_manifest(d, m)
    return edit


SPECIAL = {  # through the command line: a hang or a crash must fail the test, not the run
    "fifo": (PRE, _special("fifo")),
    "dev_zero": (PRE, _special("dev_zero")),
    "link_to_fifo": (PRE, _special("link_to_fifo")),
    "huge": (PRE, _special("huge")),
    "decode_fifo": (DEC, _special("fifo")),
    "pair_string": (PRE, _field(pair="decode")),
}

WRONG_TYPES = {
    "list": _json([1, 2]),
    "string": _json("complete"),
    "pair_string": _field(pair="decode"),
    "pair_missing": lambda d: _write_manifest(d, {k: v for k, v in _manifest(d).items() if k != "pair"}),
    "role_number": _pair_field(role=5),
    "role_list": _pair_field(role=["prefill"]),
    "files_numbers": _pair_field(files={"config.json": 5}),
    "files_list": _pair_field(files=["config.json"]),
    "files_escape": _pair_field(files={"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}),
    "files_size_string": _pair_field(files={"config.json": {"size": "1", "sha256": "0" * 64}}),
    "partner_number": _pair_field(partner=7),
    "kv_sha_number": _pair_field(kv_shard_sha256=7),
    "status_number": _field(status=1),
    "source_string": _field(source="src"),
    "source_shards_string": _field(source={"config_sha256": "x", "shards": "x"}),
    "shards_string": _field(shards="model.safetensors"),
    "shard_entry_numbers": _field(shards=[{"name": 1, "size": "2", "sha256": 3}]),
    "quantization_config_list": _field(quantization_config=[]),
    "tensors_list": _field(tensors=["x"]),
}


@pytest.mark.parametrize("name", list(SPECIAL))
def test_verify_cli_hostile_manifest_is_one_line(cli, pair_dirs, tmp_path, name):
    """A manifest that is a FIFO, /dev/zero, a symlink to a FIFO, over the size limit, or of the wrong JSON type:
    one line, exit 1, at once (the harness fails a run past its timeout), and no verify.json."""
    dec, pre = _copy(pair_dirs, tmp_path)
    half, edit = SPECIAL[name]
    edit(tmp_path / half)
    t0 = time.monotonic()
    r = cli.run("verify", dec, "--pair", pre, timeout=30)
    assert time.monotonic() - t0 < 15, name
    assert_clean_failure(r, dec, was_complete=half != DEC)
    assert not (dec / "verify.json").exists()


@pytest.mark.parametrize("half", [PRE, DEC])
@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_check_pair_wrong_json_types(pair_dirs, tmp_path, name, half):
    """Every field of either manifest of the wrong JSON type: PairMismatch in one line, never another error."""
    from quantkit.errors import PairMismatch
    from quantkit.verify.pair import check_pair

    dec, pre = _copy(pair_dirs, tmp_path)
    WRONG_TYPES[name](tmp_path / half)
    with pytest.raises(PairMismatch) as e:
        check_pair(dec, pre)
    assert "\n" not in e.value.message and len(e.value.message) < 800


@pytest.mark.parametrize("partner,why", [("/tmp", "absolute"), ("../" * 12 + "x", "which is not"),
                                         ("../other", "which is not"), ("", "no partner"), ("a\0b", "no partner")])
def test_partner_path_must_name_the_partner(pair_dirs, tmp_path, partner, why):
    """A recorded partner path that is absolute, escapes, names another directory or is empty is refused even
    when the manifests are re-forged to record each other."""
    from quantkit.errors import PairMismatch
    from quantkit.verify.pair import check_pair

    dec, pre = _copy(pair_dirs, tmp_path)
    _forge(dec, pre, lambda m: m["pair"].update(partner=partner))
    with pytest.raises(PairMismatch, match=why):
        check_pair(dec, pre)


def test_kv_scales_differ_even_when_the_manifest_is_reforged(pair_dirs, tmp_path):
    """The prefill KV shard rewritten one ulp off, its manifest entry made to match (so every file matches its
    own manifest): the KV comparison still refuses it by name."""
    from quantkit.errors import PairMismatch
    from quantkit.verify.pair import check_pair
    from quantkit.write.writer import sha256_file

    dec, pre = _copy(pair_dirs, tmp_path)
    path = pre / kvrules.KV_SHARD_NAME
    with SafetensorsFile(path) as f:
        t = {n: f.get(n).clone() for n in f.header.tensors}
    n0 = sorted(t)[0]
    t[n0] = torch.nextafter(t[n0], torch.full_like(t[n0], float("inf")))
    path.unlink()
    write_safetensors(path, t, metadata={"format": "pt"})

    def entry(m):
        for s in m["shards"]:
            if s["name"] == kvrules.KV_SHARD_NAME:
                s["sha256"], s["size"] = sha256_file(path), path.stat().st_size

    _forge(dec, pre, entry)
    with pytest.raises(PairMismatch, match=f"KV scales differ: {n0}"):
        check_pair(dec, pre)


# ---- convert --pair: the whole pair planned and checked before anything is written -----------------------
FP8_NOWHERE = ("name: fp8-nowhere\ngroups:\n  fp8:\n    targets: ['re:.*\\.no_such_module$']\n    method: rtn\n"
               "    scheme: {num_bits: 8, type: float, symmetric: true, strategy: channel}\n")


def _nothing_written(base):
    assert not (base / DEC).exists() or not any((base / DEC).iterdir()), sorted((base / DEC).iterdir())


def _pair_in_process(src, base, kvfile, pair_recipe="fp8-prefill", pair_out=None):
    from quantkit.convert import ConvertOptions
    from quantkit.convert.pair import convert_pair

    return convert_pair(src, base / DEC, ConvertOptions(recipe="int4-experts-rtn", kv_scales=str(kvfile)),
                        pair_recipe, pair_out)


def test_prefill_recipe_refused_before_the_decode_half(cli, src, kvfile, tmp_path):
    """A prefill recipe that matches no module of the source, or has no FP8 group: one line, and OUT is not
    written (the first was found only after the whole decode half was written)."""
    (tmp_path / "r.yaml").write_text(FP8_NOWHERE)
    for recipe, said in ((tmp_path / "r.yaml", "match no module"), ("int4-experts-rtn", "no FP8 weight group")):
        args = list(_args(src, tmp_path, kvfile))
        args[args.index("fp8-prefill")] = recipe
        r = cli.run(*args)
        assert said in assert_clean_failure(r, tmp_path / DEC) + r.stderr
        _nothing_written(tmp_path)


@pytest.mark.parametrize("case,said", [("pair_out_inside", "nest"), ("out_inside", "nest"),
                                       ("pair_out_file", "not a directory"), ("foreign_prefill_dir", "not empty"),
                                       ("complete_plain_prefill", "complete conversion"),
                                       ("complete_pair_prefill", "complete prefill half"),
                                       ("prefill_manifest_list", "must hold a JSON object")])
def test_pair_directories_checked_before_anything_is_written(src, kvfile, pair_dirs, tmp_path, case, said):
    """The prefill directory nested in OUT (or OUT in it), a file, a foreign directory, a complete conversion or
    another pair's complete prefill half there, a manifest there of the wrong type: refused before OUT is written."""
    from quantkit.errors import QuantkitError

    pre, pair_out = tmp_path / PRE, None
    if case == "pair_out_inside":
        pair_out = tmp_path / DEC / "p"
    elif case == "out_inside":
        pair_out = tmp_path
    elif case == "pair_out_file":
        pre.write_text("x")
    elif case == "foreign_prefill_dir":
        pre.mkdir()
        (pre / "notes.txt").write_text("mine")
    elif case.startswith("complete"):
        shutil.copytree(pair_dirs / PRE, pre)
        if case == "complete_plain_prefill":
            _write_manifest(pre, {k: v for k, v in _manifest(pre).items() if k != "pair"})
    else:
        pre.mkdir()
        (pre / MANIFEST_NAME).write_text("[]")
    with pytest.raises(QuantkitError, match=said) as e:
        _pair_in_process(src, tmp_path, kvfile, pair_out=pair_out)
    assert "\n" not in e.value.message
    _nothing_written(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_cli_prefill_manifest_special_file(cli, src, kvfile, tmp_path, kind):
    """The prefill directory's manifest a FIFO or /dev/zero: one line at once, OUT not written."""
    (tmp_path / PRE).mkdir()
    p = tmp_path / PRE / MANIFEST_NAME
    os.mkfifo(p) if kind == "fifo" else p.symlink_to("/dev/zero")
    r = cli.run(*_args(src, tmp_path, kvfile), timeout=30)
    assert_clean_failure(r, tmp_path / DEC)
    _nothing_written(tmp_path)


@pytest.fixture(scope="module")
def decode_pending(cli, src, kvfile, reference, tmp_path_factory):
    """A pair killed right after its decode half was written whole (pending), before the prefill half."""
    _, events, _, _ = reference
    base = tmp_path_factory.mktemp("pending")
    r = cli.run(*_args(src, base, kvfile), faults={"kill_at": _at(events, f"after-replace {DEC}/{MANIFEST_NAME}", -2)})
    assert r.rc == SIGKILLED, r.stderr
    assert manifest_status(base / DEC) == "pair_pending" and not (base / PRE).exists()
    return base


RESUME_EDITS = {
    # name: (edit of the pending decode half, what the refusal says)
    "pair_string": (_field(pair="decode"), "not an object"),
    "pair_list": (_field(pair=[]), "not an object"),
    "role_prefill": (_pair_field(role="prefill"), "prefill half, not the decode half"),
    "files_numbers": (_pair_field(files={"config.json": 5}), "no size and sha256"),
    "files_escape": (_pair_field(files={"../x": {"size": 1, "sha256": "0" * 64}}), "not a plain file name"),
    "status_number": (_field(status=2), "status .2."),
    "identity_list": (_field(identity=[]), "different source"),
    "config_edited": (lambda d: _edit_json(d / "config.json", rope_theta=1.0), "config.json"),
    "shard_byte": (lambda d: _flip_byte(d / "model-00002-of-00003.safetensors"), "model-00002-of-00003"),
    "extra_file": (lambda d: (d / "modeling_evil.py").write_text("import os\n"), "modeling_evil.py"),
}


def test_resume_of_the_pending_half_is_this_pair(src, kvfile, decode_pending, tmp_path):
    """The control for the refusals below: the untouched pending half is taken as it is, and the pair finished."""
    shutil.copytree(decode_pending / DEC, tmp_path / DEC)
    before = (tmp_path / DEC / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    res = _pair_in_process(src, tmp_path, kvfile)
    assert res.decode["seconds"] == 0.0 and manifest_status(tmp_path / DEC) == "complete"
    assert (tmp_path / DEC / "model-00001-of-00003.safetensors").stat().st_mtime_ns == before  # not rewritten


@pytest.mark.parametrize("name", list(RESUME_EDITS))
def test_resume_refuses_an_edited_pending_half(src, kvfile, decode_pending, tmp_path, name):
    """The pending decode half of a killed pair edited (its manifest of the wrong type, a file that no longer
    matches it, a file it does not record): one line naming it, no prefill half written, nothing complete."""
    from quantkit.errors import QuantkitError

    shutil.copytree(decode_pending / DEC, tmp_path / DEC)
    edit, said = RESUME_EDITS[name]
    edit(tmp_path / DEC)
    with pytest.raises(QuantkitError, match=said) as e:
        _pair_in_process(src, tmp_path, kvfile)
    assert "\n" not in e.value.message
    assert not (tmp_path / PRE).exists() and manifest_status(tmp_path / DEC) != "complete"


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_cli_resume_pending_manifest_special_file(cli, src, kvfile, decode_pending, tmp_path, kind):
    shutil.copytree(decode_pending / DEC, tmp_path / DEC)
    _special(kind)(tmp_path / DEC)
    r = cli.run(*_args(src, tmp_path, kvfile), timeout=30)
    assert_clean_failure(r, tmp_path / DEC)
    assert not (tmp_path / PRE).exists()


def test_resume_refuses_other_kv_scales(cli, src, kvfile, decode_pending, tmp_path):
    """Resumed with another --kv-scales file than the pending decode half was written with: one line before
    the prefill half is written (the two halves would not share a KV cache)."""
    shutil.copytree(decode_pending / DEC, tmp_path / DEC)
    with SafetensorsFile(kvfile) as f:
        t = {n: f.get(n).clone() * 2 for n in f.header.tensors}
    write_safetensors(tmp_path / "kv2.safetensors", t)
    r = cli.run(*_args(src, tmp_path, tmp_path / "kv2.safetensors"), timeout=30)
    line = assert_clean_failure(r, tmp_path / DEC)
    assert "other KV-cache scales" in line and not (tmp_path / PRE).exists()


def test_verify_does_not_import_convert():
    """verify reads what convert wrote through pack/ and read/ (docs/code.md): the pair's names come from
    pack/manifest.py."""
    import ast
    from pathlib import Path

    import quantkit.verify.pair as vp

    mods = [n.module or "" for n in ast.walk(ast.parse(Path(vp.__file__).read_text())) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in mods if "convert" in m], mods
