"""Each kind of knowledge has one home, read from the source with ast (nothing is imported):

- the compressed-tensors vocabulary (tensor suffixes such as `weight_packed`, format names such as
  `pack-quantized`) is spelled only in quantkit/pack/ (`pack.names.Tensor` / `Format` everywhere else);
- module names (`self_attn`, `gate_proj`, `block_sparse_moe`, `experts`, ...) only in quantkit/arch/
  (`arch.layout`: the vocabulary, `LayerNames`, the expert parsers). tiny.py is the one exception: it writes
  fake releases (a Kimi K2.5 vision tower, its quantization_config's ignore list) as those releases spell them.

Strings with a space are messages (prose may name a tensor) and docstrings are documentation: neither counts.

    python tests/test_homes.py        # prints every literal it finds outside its home; exit 1 if any
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"

MODULE_WORDS = re.compile(
    r"(?:^|[.\\^]|\b)(?:block_sparse_moe|w[123]|gate_up_proj|shared_experts?|gate_proj|up_proj|down_proj|q_a_proj"
    r"|kv_a_proj_with_mqa|kv_b_proj|q_b_proj|[qkvo]_proj|self_attn|mlp|experts|e_score_correction_bias|lm_head"
    r"|embed_tokens|post_attention_layernorm|input_layernorm|[q]_a_layernorm|kv_a_layernorm|language_model"
    r"|vision_tower|mm_projector)(?:$|[.\\]|\b)")
RECIPE_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)+$")  # int4-experts-rtn: a recipe, not a module
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


def literals(root: Path, pattern: re.Pattern, home: str, exempt: tuple[str, ...] = ()) -> list[tuple[str, int, str]]:
    """(file, line, literal) for every string constant under `root` (f-string parts included) that matches
    `pattern`, outside files whose path relative to `root` starts with `home` (or is in `exempt`), docstrings,
    messages and recipe names excepted."""
    found = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(home) or rel in exempt:
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and " " not in node.value and not RECIPE_NAME.match(node.value) and pattern.search(node.value)):
                found.append((rel, node.lineno, node.value))
    return sorted(found)


def test_format_names_live_in_pack():
    found = literals(PACKAGE, FORMAT_WORDS, "pack/")
    assert found == [], "format literals outside pack/: " + "; ".join(f"{f}:{n} {v!r}" for f, n, v in found)


def test_module_names_live_in_arch():
    found = literals(PACKAGE, MODULE_WORDS, "arch/", exempt=("tiny.py",))
    assert found == [], "module-name literals outside arch/: " + "; ".join(f"{f}:{n} {v!r}" for f, n, v in found)


def test_the_check_sees_a_literal(tmp_path):
    """The check itself can fail: a planted tensor name in code is found; the same word in a message, in a
    docstring or under the home is not."""
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "layout.py").write_text('X = "weight_packed"\n')
    (tmp_path / "a.py").write_text('"""Reads weight_packed."""\n\ndef f(m):\n    """weight_scale"""\n'
                                   '    raise ValueError(f"{m}: no weight_packed here")\n\n'
                                   'def g(m):\n    return f"{m}.weight_scale"\n')
    assert literals(tmp_path, FORMAT_WORDS, "pack/") == [("a.py", 8, ".weight_scale")]
    (tmp_path / "b.py").write_text('R = "int4-experts-rtn"\nP = r"\\.mlp\\.experts\\.(\\d+)"\n')
    assert literals(tmp_path, MODULE_WORDS, "arch/") == [("b.py", 2, r"\.mlp\.experts\.(\d+)")]


if __name__ == "__main__":
    bad = 0
    for what, pattern, home, exempt in (("format", FORMAT_WORDS, "pack/", ()),
                                        ("module-name", MODULE_WORDS, "arch/", ("tiny.py",))):
        hits = literals(PACKAGE, pattern, home, exempt)
        for f, n, v in hits:
            print(f"quantkit/{f}:{n}: {v!r}")
        print(f"{len(hits)} {what} literal(s) outside {home}")
        bad += len(hits)
    sys.exit(1 if bad else 0)
