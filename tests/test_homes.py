"""Each kind of knowledge has one home, read from the source with ast (nothing is imported):

- the compressed-tensors vocabulary (tensor suffixes such as `weight_packed`, format names such as
  `pack-quantized`) is spelled only in quantkit/pack/ (`pack.names.Tensor` / `Format` everywhere else);

Strings with a space are messages (prose may name a tensor) and docstrings are documentation: neither counts.

    python tests/test_homes.py        # prints every literal it finds outside its home; exit 1 if any
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"

FORMAT_WORDS = re.compile(r"weight_packed|weight_scale|weight_zero_point|weight_global_scale|weight_shape|weight_g_idx"
                          r"|input_global_scale|pack-quantized|float-quantized|naive-quantized")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def literals(root: Path, pattern: re.Pattern, home: str) -> list[tuple[str, int, str]]:
    """(file, line, literal) for every string constant under `root` (f-string parts included) that matches
    `pattern`, outside files whose path relative to `root` starts with `home`, docstrings and messages excepted."""
    found = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(home):
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and " " not in node.value and pattern.search(node.value)):
                found.append((rel, node.lineno, node.value))
    return sorted(found)


def test_format_names_live_in_pack():
    found = literals(PACKAGE, FORMAT_WORDS, "pack/")
    assert found == [], "format literals outside pack/: " + "; ".join(f"{f}:{n} {v!r}" for f, n, v in found)


def test_the_check_sees_a_literal(tmp_path):
    """The check itself can fail: a planted tensor name in code is found; the same word in a message, in a
    docstring or under the home is not."""
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "layout.py").write_text('X = "weight_packed"\n')
    (tmp_path / "a.py").write_text('"""Reads weight_packed."""\n\ndef f(m):\n    """weight_scale"""\n'
                                   '    raise ValueError(f"{m}: no weight_packed here")\n\n'
                                   'def g(m):\n    return f"{m}.weight_scale"\n')
    assert literals(tmp_path, FORMAT_WORDS, "pack/") == [("a.py", 8, ".weight_scale")]


if __name__ == "__main__":
    hits = literals(PACKAGE, FORMAT_WORDS, "pack/")
    for f, n, v in hits:
        print(f"quantkit/{f}:{n}: {v!r}")
    print(f"{len(hits)} format literal(s) outside pack/")
    sys.exit(1 if hits else 0)
