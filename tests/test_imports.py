"""The package's import graph, read from the source with ast (nothing is imported): no import circle, nothing
in calib/ imports a command module, and no library module imports the fixtures module (quantkit/testing.py).

Every import counts, module-level or inside a function: a lazy import only hides a circle until the day
someone moves it. `from . import x` is an edge to the submodule `x` where one exists, else to the package.

    python tests/test_imports.py        # prints the circles and rule breaks it finds; exit 1 if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quantkit"
# the command modules: each implements a CLI command (and may use the library below it, never the reverse)
COMMANDS = ("quantkit.cli", "quantkit.__main__", "quantkit.convert", "quantkit.calibrate", "quantkit.verify",
            "quantkit.plan", "quantkit.inspect", "quantkit.demo", "quantkit.report")
FIXTURES = "quantkit.testing"


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if pkg else parts)] = (p, pkg)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its source)."""
    mods = modules(root)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        if m.startswith("quantkit.calib."):
            out += [f"{m} imports the command module {d}" for d in sorted(deps) if _under(d, COMMANDS)]
        if m != FIXTURES:
            out += [f"{m} imports the fixtures module {FIXTURES}" for d in deps if d == FIXTURES]
    return out


def test_no_import_circles():
    found = circles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_import_rules():
    assert rule_breaks(import_graph()) == []


def test_the_check_sees_a_circle(tmp_path):
    """The check itself can fail: a planted two-module circle (and a lazy one) is found."""
    pkg = tmp_path / "quantkit"
    (pkg / "calib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "calib" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .calib import b\n")
    (pkg / "calib" / "b.py").write_text("def f():\n    from ..a import g\n    from .. import calibrate\n")
    (pkg / "calibrate.py").write_text("import quantkit.testing\n")
    (pkg / "testing.py").write_text("")
    graph = import_graph(pkg)
    assert circles(graph) == [["quantkit.a", "quantkit.calib.b"]]
    assert rule_breaks(graph) == ["quantkit.calib.b imports the command module quantkit.calibrate",
                                  "quantkit.calibrate imports the fixtures module quantkit.testing"]


if __name__ == "__main__":
    g = import_graph()
    problems = [" <-> ".join(c) for c in circles(g)] + rule_breaks(g)
    print("\n".join(problems) or f"{len(g)} modules: no import circle, no rule broken")
    sys.exit(1 if problems else 0)
