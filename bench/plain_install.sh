#!/usr/bin/env bash
# What `pip install quantkit` gives a new user: a fresh venv, the CPU torch wheel, then the package with no
# extras, then `quantkit demo`, which must end "verified" (every command it runs, verify's compressed-tensors
# judge and the report's plotting included, comes with the plain install). Also runs `quantkit report` and
# the hub-id path offline, and checks that no optional package slipped in.
#   bench/plain_install.sh [WORKDIR]      (a few minutes: the dependencies come from the package index)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/qk-plain.XXXXXX)}"
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "$here"           # no extras: what `pip install quantkit` gives
python - <<'PY'
import importlib.util
for mod in ("pytest", "hypothesis", "triton"):
    assert importlib.util.find_spec(mod) is None, f"{mod} is installed: the plain install pulled an extra"
print("no test extras installed")
PY
cd "$work"
quantkit demo "$work/demo" 2>&1 | tee "$work/demo.log"
grep -q "verified" "$work/demo.log"
quantkit report "$work/demo/int4" -o "$work/report.html" --json > "$work/report.json"
quantkit inspect "$work/demo/int4" --json > /dev/null
echo "plain install: demo verified, report written ($work)"
