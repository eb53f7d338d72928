"""Hostile sources and side inputs (issue 26): compressed-tensors source modules checked before anything is
written, implausible KV scales, and the smaller cases (a non-UTF-8 verify.json, a `--kv-scales`
directory). Each case exits 1 with one `error:` line naming the tensor and the rule, nothing that looks
complete, or converts correctly. Hub ids (long ones, hostile refs) are in test_hub.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from quantkit import errors as E
from quantkit.report import build_report

from harness import assert_clean_failure, cli, reference, src18  # noqa: F401


# ---- smaller cases (issue 26, item 7) ---------------------------------------------------------------
def test_non_utf8_verify_json_gets_a_hint_about_verify_json(reference, tmp_path):
    out, _ = reference
    bad = tmp_path / "verify.json"
    bad.write_bytes(b'{"passed": true, "checks": "\xff\xfe"}')
    with pytest.raises(E.ConfigError) as e:
        build_report(out, output=tmp_path / "r.html", verify_json=bad)
    assert "not valid JSON" in e.value.message and "UnicodeDecodeError" in e.value.message
    assert "config.json" not in e.value.hint and "quantkit verify" in e.value.hint


def test_kv_scales_directory_is_called_a_directory(cli, src18, tmp_path):
    d = tmp_path / "scales"
    d.mkdir()
    r = cli.convert(src18, tmp_path / "out", "--kv-scales", d)
    line = assert_clean_failure(r, tmp_path / "out")
    assert "is a directory" in line and "does not exist" not in line, line
