"""bench/README.md's figure tables, generated from the committed results in bench/results/.

A generated section sits between two marker comments:

    <!-- bench:NAME cols=a,b,c -->
    ... (written by `python -m bench readme`; do not edit by hand)
    <!-- /bench:NAME -->

NAME is the result file's stem (bench/results/NAME.json); `cols` picks and orders the rows' columns (default:
every column whose values are numbers, strings or booleans, in the order they first appear). Each section
starts with the line that names the run: commit, date, machine, load average and the command, so that every
figure says where it came from.

    python -m bench readme           # rewrite the sections in place
    python -m bench readme --check   # exit 1 (and say which) when a section differs from what would be written
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.harness import BENCH_DIR, RESULTS, load_result, machine_line

README = BENCH_DIR / "README.md"
SECTION = re.compile(r"(<!-- bench:(?P<name>[a-z0-9_-]+)(?P<opts>[^>]*?) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)",
                     re.S)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v + 0.0:.4g}"  # no "-0"
    if isinstance(v, (list, dict)):
        return "-"
    return str(v).replace("|", "\\|")


def _scalar(v) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def section(name: str, opts: str, results: Path = RESULTS) -> str:
    """The text between the markers for result NAME."""
    doc = load_result(results / f"{name}.json")
    cols = None
    m = re.search(r"cols=(\S+)", opts)
    if m:
        cols = m.group(1).split(",")
    else:
        cols = []
        for r in doc["rows"]:
            for k, v in r.items():
                if k not in cols and _scalar(v) and all(_scalar(x.get(k)) for x in doc["rows"]):
                    cols.append(k)
    mach = doc["machine"]
    lines = [f"Generated from `bench/results/{name}.json` (`python -m bench readme`): commit {doc['commit'][:10]}"
             f"{' (uncommitted changes)' if doc['dirty'] else ''}, {doc['date']}, {machine_line(mach)}; "
             f"load average {doc['loadavg']['start'][0]} -> {doc['loadavg']['end'][0]}; "
             f"`{' '.join(doc['command'])}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["rows"]:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    if doc.get("summary"):
        flat = {k: v for k, v in doc["summary"].items() if _scalar(v) and "\n" not in str(v)}
        if flat:
            lines += ["", "Summary: " + ", ".join(f"{k} {_cell(v)}" for k, v in flat.items()) + "."]
    return "\n".join(lines) + "\n"


def render(text: str, results: Path = RESULTS) -> str:
    """`text` with every generated section rewritten."""
    return SECTION.sub(lambda m: m.group(1) + section(m.group("name"), m.group("opts"), results) + m.group(5), text)


def names(text: str) -> list[str]:
    return [m.group("name") for m in SECTION.finditer(text)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check: exit 1 when a section is stale")
    a = ap.parse_args(argv)
    text = README.read_text()
    new = render(text)
    if a.check:
        stale = [n for n, (x, y) in zip(names(text), zip(SECTION.finditer(text), SECTION.finditer(new)))
                 if x.group(0) != y.group(0)]
        if new != text:
            print(f"bench/README.md: stale generated sections: {', '.join(stale) or '?'}; run `python -m bench readme`",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new)
        print(f"bench/README.md: {len(names(new))} generated sections rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
