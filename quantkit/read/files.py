"""Every file a user hands in, read one way: a regular file (never a FIFO, a device such as /dev/zero, a socket
or a directory, whatever a symlink points at), at most `limit` bytes read, decoded as UTF-8, and JSON parsed
with bounded nesting and bounded integers. Every failure is one line through the caller's error class.

Why each bound: `open()` on a FIFO blocks until a writer appears and /dev/zero never ends, so the file is
opened non-blocking and its type checked on the open descriptor (no race with a rename); Python's JSON reader
recurses once per nesting level and converts integers of up to 4300 digits, numbers that later overflow a
float or take seconds to format, so depth and digits are capped here (real configs, indexes, manifests and
calibration rows nest a few levels and hold 64-bit integers at most).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "check_regular", "read_bytes", "read_text", "parse_json", "check_depth"]

MAX_DEPTH = 64  # JSON nesting levels: objects and arrays
MAX_INT_DIGITS = 40  # a JSON integer with more digits is refused (2**64 has 20)

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _shown(path: Path) -> str:
    s = str(path)
    return repr(s[:200]) if not s.isprintable() or len(s) > 200 else s


def _open(path: Path, what: str, error, hint: str | None) -> int:
    """A read-only descriptor of `path`, opened non-blocking (a FIFO must not block), or `error`."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} not found: {_shown(path)}", hint=hint) from None
    except OSError as e:
        raise error(f"{what} cannot be opened: {_shown(path)} ({e.strerror or type(e).__name__})", hint=hint) from None


def check_regular(path: str | os.PathLike, what: str, error, limit: int, hint: str | None = None) -> int:
    """The size of the regular file `path` (at most `limit`), or `error` as `read_bytes` raises it; for files a
    third-party reader opens itself (parquet)."""
    path = Path(path)
    fd = _open(path, what, error, hint)
    try:
        return _regular_size(fd, path, what, error, limit, hint)
    finally:
        os.close(fd)


def _regular_size(fd: int, path: Path, what: str, error, limit: int, hint: str | None) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(f"{what} {_shown(path)} is {kind}, not a regular file", hint=hint)
    if st.st_size > limit:
        raise error(f"{what} is {st.st_size} bytes, over the {limit}-byte limit: {_shown(path)}", hint=hint)
    return st.st_size


def read_bytes(path: str | os.PathLike, what: str, error, limit: int, hint: str | None = None) -> bytes:
    """The bytes of the regular file `path` (at most `limit`), or `error` in one line: missing, not a regular
    file, over the limit, unreadable."""
    path = Path(path)
    fd = _open(path, what, error, hint)
    try:
        _regular_size(fd, path, what, error, limit, hint)
        os.set_blocking(fd, True)
        chunks, got = [], 0
        while got <= limit:  # the size may change under us: never read past limit + 1
            b = os.read(fd, min(1 << 24, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise error(f"{what} grew past the {limit}-byte limit while it was read", hint=hint)
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{what} cannot be read: {_shown(path)} ({e.strerror or type(e).__name__})", hint=hint) from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, what: str, error, limit: int, hint: str | None = None) -> str:
    """`read_bytes` decoded as UTF-8 (a byte-order mark is dropped), or `error` naming the first bad byte."""
    data = read_bytes(path, what, error, limit, hint)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} {_shown(path)} is not UTF-8 text ({e.reason} at byte {e.start})", hint=hint) from None


def _int_parser(digits: int):
    def parse(s: str) -> int:
        if len(s.lstrip("-")) > digits:
            raise ValueError(f"an integer of {len(s.lstrip('-'))} digits (at most {digits})")
        return int(s)
    return parse


def check_depth(doc, max_depth: int = MAX_DEPTH) -> None:
    """ValueError if `doc` nests lists/dicts deeper than `max_depth` (iterative: no recursion)."""
    stack = [(doc, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))


def parse_json(text: str, what: str, error, hint: str | None = None, object_pairs_hook=None, surrogates: bool = False,
               int_digits: int = MAX_INT_DIGITS):
    """`text` as JSON with nesting and integer digits bounded; `error` in one line otherwise. Lone surrogates
    ("\\ud800" escapes, which parse but cannot be encoded as UTF-8) are refused unless `surrogates`.
    `int_digits`: a reader that checks every number itself may allow more (up to Python's own 4300)."""
    try:
        doc = json.loads(text, parse_int=_int_parser(int_digits), object_pairs_hook=object_pairs_hook)
        check_depth(doc)
        if not surrogates:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
    # ValueError: JSONDecodeError, the digit bound, the depth bound; UnicodeError: a lone surrogate
    except (UnicodeError, ValueError, RecursionError) as e:
        msg = "a lone UTF-16 surrogate (\\ud800-\\udfff) in a string" if isinstance(e, UnicodeError) else str(e)
        raise error(f"{what} is not valid JSON: {msg[:160]}".replace("\n", " "), hint=hint) from None
    return doc
