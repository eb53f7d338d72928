"""Rules of the interface that hold across the package, checked from the source and the signatures:
every error raised is a named QuantkitError subclass with a one-line hint, and a default the CLI and the
library share is written once (quantkit/options.py), so the two cannot drift apart."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from quantkit import cli, errors, options

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"


def bare_raises(root: Path = PACKAGE) -> list[str]:
    """`raise QuantkitError(...)` sites: the base class says nothing about what failed."""
    out = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "QuantkitError":
                    out.append(f"{p.relative_to(root.parent)}:{node.lineno}")
    return out


def test_every_raise_names_its_error():
    assert bare_raises() == []


def test_the_check_sees_a_bare_raise(tmp_path):
    pkg = tmp_path / "quantkit"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    raise errors.QuantkitError('x')\n\n\ndef g():\n    raise ConfigError('y')\n")
    assert bare_raises(pkg) == ["quantkit/m.py:2"]


def test_every_error_has_a_one_line_hint():
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.QuantkitError) and c is not errors.QuantkitError]
    assert len(classes) > 40
    for c in classes:
        assert isinstance(c.hint, str) and c.hint.strip() and "\n" not in c.hint, c.__name__


@pytest.mark.parametrize("command, library", [
    ("plan", "quantkit.plan:PlanOptions"),
    ("verify", "quantkit.verify:VerifyOptions"),
    ("demo", "quantkit.demo:run_demo"),
    ("calibrate", "quantkit.calibrate:CalibrateOptions"),
])
def test_cli_and_library_defaults_agree(command, library):
    """Every option the command and its library function share has one default (from options.py)."""
    import importlib

    mod, _, fn = library.partition(":")
    lib = inspect.signature(getattr(importlib.import_module(mod), fn)).parameters
    cmd = inspect.signature(getattr(cli, command)).parameters
    shared = [n for n in cmd if n in lib and cmd[n].default is not inspect.Parameter.empty
              and lib[n].default is not inspect.Parameter.empty and cmd[n].default is not None]
    assert shared, f"{command} shares no defaulted option with {library}"
    for n in shared:
        if command == "calibrate" and n in ("num_samples", "seq_len"):
            continue  # the CLI's None means "the recipe's, then options'": resolved in cli.calibrate
        assert cmd[n].default == lib[n].default, f"{command} --{n}: cli {cmd[n].default!r} != {lib[n].default!r}"


def test_int4_default_group_size_is_the_options_one():
    from quantkit.match.recipe import Scheme

    assert Scheme(num_bits=4, type="int", symmetric=True, strategy="group").group_size == options.INT4_GROUP_SIZE
