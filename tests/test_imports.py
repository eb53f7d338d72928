"""The package's import graph, read from the source with ast (nothing is imported): no import circle, nothing
in calib/ imports a command module, no library module imports the fixtures module (quantkit/testing.py), the
packages are layered (`LAYERS`: each imports only from the layers below it, docs/code.md), and no package imports
another's private names (`_x`, or a module `_x.py`).

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
# quantkit's packages and top-level modules, lowest first: each may import only from the layers before it (the
# members of one layer not from each other). Pure math at the bottom, then the format, the files, matching and
# writing, the calibrated pass, the engines' rules, the judges, and the commands on top (docs/code.md).
LAYERS = (
    ("errors",), ("options", "signals", "allocator"), ("timeline",), ("dist",), ("arch",), ("hf",),
    ("quant",), ("pack",), ("read",), ("hub",), ("match",), ("write",), ("calib",), ("runtime",),
    ("engine",), ("verify",), ("card",), ("calibrate",), ("convert",), ("export",), ("inspect",), ("plan",),
    ("report",), ("tiny",), ("demo",), ("testing",), ("cli",), ("__main__",),
)


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if pkg else parts)] = (p, pkg)
    return out


def imports(name: str, path: Path, is_pkg: bool):
    """(module, name or None) for every import in the module `name`'s source, relative ones resolved."""
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield from ((target, a.name) for a in node.names)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its source)."""
    mods = modules(root)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        found = set()
        for target, item in imports(name, path, is_pkg):
            found.add(f"{target}.{item}" if item and f"{target}.{item}" in mods else target)
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


def unit(module: str) -> str:
    """The package or top-level module of quantkit that `module` belongs to ("" for quantkit itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_breaks(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a unit from its own layer's other members or from a layer above it; every unit missing
    from `layers`."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    out = sorted({f"{unit(m)} is in no layer of LAYERS" for m in graph if unit(m) and unit(m) not in rank})
    for m, deps in sorted(graph.items()):
        mu = unit(m)
        for d in sorted(deps):
            du = unit(d)
            if mu and du and du != mu and mu in rank and du in rank and rank[du] >= rank[mu]:
                out.append(f"{m} imports {d}: {du} is not below {mu}")
    return out


def private_imports(root: Path = PACKAGE) -> list[str]:
    """Imports of another package's private names: `from quantkit.x.y import _z`, or a module `quantkit.x._y`
    imported from outside x. Within one package, its modules share what they like."""
    out = []
    for name, (path, is_pkg) in modules(root).items():
        for mod, item in imports(name, path, is_pkg):
            if not mod.startswith("quantkit") or unit(mod) == unit(name):
                continue
            segs = mod.split(".")[1:] + ([item] if item else [])
            private = [s for s in segs if s.startswith("_") and not (s.startswith("__") and s.endswith("__"))]
            if private:
                out.append(f"{name} imports {mod}{'.' + item if item else ''}: {private[0]} is private to "
                           f"{unit(mod)}")
    return out


def test_no_import_circles():
    found = circles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_import_rules():
    assert rule_breaks(import_graph()) == []


def test_packages_are_layered():
    assert layer_breaks(import_graph()) == []


def test_no_private_imports_across_packages():
    assert private_imports() == []


def test_the_layer_checks_can_fail(tmp_path):
    """A planted upward import (quant importing pack, lazily), a peer import, an unlisted unit and a private
    name reached across packages are all found."""
    pkg = tmp_path / "quantkit"
    for d in ("quant", "pack"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "quant" / "int4.py").write_text("def f():\n    from ..pack.layout import g\n")
    (pkg / "pack" / "layout.py").write_text("from ..quant._native import h\nfrom ..quant.int4 import _f\n")
    (pkg / "quant" / "_native.py").write_text("from . import int4\nfrom ._x import y\n")
    (pkg / "options.py").write_text("from . import signals\n")
    (pkg / "signals.py").write_text("")
    (pkg / "newthing.py").write_text("")
    graph = import_graph(pkg)
    assert layer_breaks(graph) == [
        "newthing is in no layer of LAYERS",
        "quantkit.options imports quantkit.signals: signals is not below options",
        "quantkit.quant.int4 imports quantkit.pack.layout: pack is not below quant",
    ]
    assert sorted(private_imports(pkg)) == [
        "quantkit.pack.layout imports quantkit.quant._native.h: _native is private to quant",
        "quantkit.pack.layout imports quantkit.quant.int4._f: _f is private to quant",
    ]


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
    problems = [" <-> ".join(c) for c in circles(g)] + rule_breaks(g) + layer_breaks(g) + private_imports()
    print("\n".join(problems) or f"{len(g)} modules: no import circle, no rule broken")
    sys.exit(1 if problems else 0)
