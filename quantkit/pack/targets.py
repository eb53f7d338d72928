"""compressed-tensors' target rule, and the bounds that keep it safe on hostile patterns and names.

A target is an exact module name or `re:<regex>` applied with re.match (compressed-tensors' own rule).
Recipes and checkpoints' `quantization_config` groups (sources are input) are matched with the same
function: every pattern passes `check_regex` before its first use (no quantifier or alternation inside an
unbounded repeat, at most MAX_UNBOUNDED unbounded repeats, MAX_CHOICES combinations, MAX_PATTERN_CHARS
characters), and names longer than MAX_MATCH_NAME are never matched against a pattern.
"""

from __future__ import annotations

import re
import re._constants as _sre
import re._parser as _sre_parse

from ..errors import RecipeError

_RE_CACHE: dict[str, re.Pattern] = {}
MAX_PATTERN_CHARS = 1000
MAX_UNBOUNDED = 3  # unbounded repeats (*, +, {n,}) per pattern: matching costs at most ~n^3 steps
MAX_MATCH_NAME = 512  # module names matched against `re:` patterns (real ones are < 200 characters)
MAX_CHOICES = 4096  # product of the options of ?, {m,n} and | in a pattern
_REPEAT_OPS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def check_regex(rx: str) -> None:
    """Refuse a target/ignore regex whose matching time can explode (catastrophic backtracking), by
    inspecting its parsed form: a repeated part (`*`, `+`, `{m,n}` with n > 1) may hold no quantifier and
    no alternation (`(.*)*`, `(a|a)*`, `(\\w+\\.)*`, `(a?){30}`: exponential); at most MAX_UNBOUNDED
    unbounded repeats (`.*.*.*.*Z$` is quartic in the name's length); the choices of `?`, `{m,n}` and `|`
    multiply to at most MAX_CHOICES. Also refuses invalid patterns. Raises ValueError with the rule broken."""
    if len(rx) > MAX_PATTERN_CHARS:
        raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
    try:
        tree = _sre_parse.parse(rx)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"not a regex: {str(e)[:80]}") from None
    unbounded, choices = 0, 1

    def walk(items, repeated: bool):
        nonlocal unbounded, choices
        for op, av in items:
            if op in _REPEAT_OPS:
                lo, hi, sub = av
                if repeated:
                    raise ValueError("a quantifier inside a repeated group (catastrophic backtracking)")
                if hi == _sre.MAXREPEAT:
                    unbounded += 1
                elif hi > lo:
                    choices *= hi - lo + 1
                walk(sub, hi > 1)
            elif op is _sre.BRANCH:
                if repeated:
                    raise ValueError("an alternation inside a repeated group (catastrophic backtracking)")
                choices *= len(av[1])
                for sub in av[1]:
                    walk(sub, repeated)
            elif op is _sre.SUBPATTERN:
                walk(av[-1], repeated)
            elif op is _sre.ATOMIC_GROUP:
                walk(av, repeated)
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                walk(av[1], repeated)
            elif op is _sre.GROUPREF_EXISTS:
                choices *= 2
                walk(av[1], repeated)
                if av[2] is not None:
                    walk(av[2], repeated)
            if choices > MAX_CHOICES:
                raise ValueError(f"its ?, {{m,n}} and | make over {MAX_CHOICES} combinations")

    walk(tree, False)
    if unbounded > MAX_UNBOUNDED:
        raise ValueError(f"{unbounded} unbounded repeats (*, +, {{n,}}), at most {MAX_UNBOUNDED} allowed")


def matches(pattern: str, name: str, error=RecipeError, hint: str | None = None) -> bool:
    """compressed-tensors target rule: exact name, or `re:<regex>` with re.match. Patterns are checked
    (check_regex) before their first use; a refused pattern, or a name over MAX_MATCH_NAME characters, is
    `error` (RecipeError for recipes; the caller's for a checkpoint's config), with `hint` when given."""
    if pattern.startswith("re:"):
        rx = _RE_CACHE.get(pattern)
        if rx is None:
            try:
                check_regex(pattern[3:])
            except ValueError as e:
                raise error(f"refused regex {_short(pattern)}: {e}", hint=hint) from None
            rx = _RE_CACHE[pattern] = re.compile(pattern[3:])
        if len(name) > MAX_MATCH_NAME:
            raise error(f"module name of {len(name)} characters ({_short(name)}) is longer than "
                        f"{MAX_MATCH_NAME}: target patterns are not matched against such names",
                        hint=hint or "the checkpoint's tensor names are implausible; check its source")
        return rx.match(name) is not None
    return pattern == name


def _short(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")
