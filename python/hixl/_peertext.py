"""Reading what peers supply: notification texts, etcd entries, metadata documents.

Peers are not trusted, so every parser of their text is built from these pieces, and each
piece returns a value or raises :class:`Malformed` (a ``ValueError``) that names what was
wrong, never anything else: JSON without ``NaN`` / ``Infinity`` and within a size and depth,
integers that are integers (not floats, not booleans) within bounds, strings within a length
and free of control characters. A thread that serves many peers' messages catches
``Malformed`` and, for safety, any other ``Exception`` a handler raises (see
``hixl._kvcore._notify.Router.serve``): one message can never end it.

Peer-supplied text is logged with ``%r`` (or :func:`shown`), so that no newline or escape
sequence a peer chose reaches a log line as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

#: the largest JSON document a parser here reads unless told otherwise
MAX_JSON_BYTES = 1 << 20
#: the deepest nesting of JSON arrays and objects accepted
MAX_JSON_DEPTH = 32
#: the most characters of peer text a log line shows
SHOWN_CHARS = 200


class Malformed(ValueError):
    """Peer-supplied text that is refused; the message says what and why."""


def _no_constant(name: str) -> Any:
    raise Malformed(f"{name} is not a number hixl accepts")


def _depth(text: str) -> int:
    """The deepest nesting of brackets outside strings (a bound checked before parsing, so
    that a deep document cannot exhaust the parser's recursion)."""
    depth = most = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    return most


def loads(data: str | bytes, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of `data` (a peer's `what`), or Malformed: over `max_bytes`, not UTF-8,
    not JSON, nested deeper than MAX_JSON_DEPTH, or holding NaN / Infinity (``1e999`` too)."""
    if len(data) > max_bytes:
        raise Malformed(f"{what}: {len(data)} bytes, over the {max_bytes} accepted")
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise Malformed(f"{what}: not UTF-8 ({exc.reason})") from None
    if _depth(text) > MAX_JSON_DEPTH:
        raise Malformed(f"{what}: nested deeper than {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except Malformed as exc:
        raise Malformed(f"{what}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"{what}: not JSON ({type(exc).__name__}: {shown(str(exc))})") from None


def _finite(s: str) -> float:
    v = float(s)
    if v != v or v in (float("inf"), float("-inf")):
        raise Malformed(f"{s[:40]!r} is not a finite number")
    return v


def integer(v: Any, what: str, lo: int, hi: int) -> int:
    """`v` when it is an int (not a bool, not a float) with ``lo <= v <= hi``; else Malformed."""
    if type(v) is not int:
        raise Malformed(f"{what} must be an integer, not {type(v).__name__} {shown(v)}")
    if not lo <= v <= hi:
        raise Malformed(f"{what} {v} is outside [{lo}, {hi}]")
    return v


_DECIMAL = re.compile(r"-?[0-9]{1,40}")


def decimal(v: Any, what: str, lo: int, hi: int) -> int:
    """An integer given as an int or as a string of decimal digits (ASCII digits, an optional
    ``-``; no ``+``, no space, no ``_``, at most 40 digits: how text such as "3:kv:7" carries
    numbers, and how protobuf's JSON mapping writes 64-bit integers, e.g. etcd's gateway),
    with ``lo <= value <= hi``; else Malformed."""
    if isinstance(v, str):
        if _DECIMAL.fullmatch(v) is None:
            raise Malformed(f"{what} must be a decimal integer, not {shown(v)}")
        v = int(v)
    return integer(v, what, lo, hi)


def text(v: Any, what: str, max_chars: int = 4096) -> str:
    """`v` when it is a string of at most `max_chars` without control characters; else
    Malformed."""
    if not isinstance(v, str):
        raise Malformed(f"{what} must be a string, not {type(v).__name__} {shown(v)}")
    if len(v) > max_chars:
        raise Malformed(f"{what} has {len(v)} characters, over the {max_chars} accepted")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in v):
        raise Malformed(f"{what} {shown(v)} holds control characters")
    return v


def obj(v: Any, what: str) -> Mapping[str, Any]:
    """`v` when it is a JSON object; else Malformed."""
    if not isinstance(v, dict):
        raise Malformed(f"{what} must be a JSON object, not {type(v).__name__} {shown(v)}")
    return v


def array(v: Any, what: str, max_items: int) -> list[Any]:
    """`v` when it is a JSON array of at most `max_items`; else Malformed."""
    if not isinstance(v, list):
        raise Malformed(f"{what} must be a JSON array, not {type(v).__name__} {shown(v)}")
    if len(v) > max_items:
        raise Malformed(f"{what} has {len(v)} items, over the {max_items} accepted")
    return v


def shown(v: Any) -> str:
    """`v` as a log line may show it: repr-escaped (no newline, no escape sequence) and cut to
    SHOWN_CHARS."""
    r = repr(v)
    return r if len(r) <= SHOWN_CHARS else r[:SHOWN_CHARS] + "...(cut)"
