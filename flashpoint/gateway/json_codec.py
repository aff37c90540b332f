"""Bounded JSON for request and response bodies: parse with a nesting limit, dump fast.

Pure functions shared by the KServe v2 codec (:mod:`flashpoint.gateway.oip`), the native
``/v1`` routes and the gateway's request context. Parsing takes orjson's path only where it
provably gives what ``json.loads`` would, so results and error messages are the stdlib's;
anything malformed or nested deeper than the caller's limit is a
:class:`~flashpoint.errors.BadRequest`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import orjson

from flashpoint.errors import BadRequest


def load_json(raw: bytes | bytearray | str, max_depth: int) -> Any:
    """Parse JSON, bounding nesting depth; anything malformed is a BadRequest."""
    obj = _fast_loads(raw)
    if obj is _NOT_FAST:
        try:
            obj = json.loads(raw)
        except RecursionError:
            raise BadRequest(f"JSON nested deeper than {max_depth} levels") from None
        except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, int limits
            raise BadRequest(f"malformed JSON: {str(e)[:200]}") from None
    # Every list or object the parser made opened with a bracket in the text, so a body with
    # at most max_depth brackets (a bracket in a string counts too) cannot nest deeper.
    if _bracket_count(raw) > max_depth:
        check_depth(obj, max_depth)
    return obj


def _bracket_count(raw: bytes | bytearray | str) -> int:
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")


_NOT_FAST = object()
# orjson reads an integer literal outside [-2**63, 2**64) as a float where json.loads keeps
# the exact int (so a too-big INT64 is "does not fit", not "must be integers"). Such a
# literal has at least 19 digits; a body with a 19-digit run takes the stdlib path.
_LONG_DIGIT_RUN = re.compile(rb"[0-9]{19}")


def _fast_loads(raw: Any) -> Any:
    """``orjson.loads(raw)`` when it provably gives what ``json.loads`` would, else
    ``_NOT_FAST``. orjson refuses what the stdlib accepts beyond RFC 8259 (NaN, Infinity,
    numbers that overflow a double, lone surrogates, a UTF-8 BOM, UTF-16/32 bodies, nesting
    past 1024): those bodies, and every malformed one, go to ``json.loads``, so the result
    and every error message are the stdlib's."""
    if type(raw) is not bytes or _LONG_DIGIT_RUN.search(raw) is not None:
        return _NOT_FAST
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _NOT_FAST


def check_depth(obj: Any, max_depth: int) -> None:
    """Raise BadRequest when lists/objects nest deeper than ``max_depth`` (iterative)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise BadRequest(f"JSON nested deeper than {max_depth} levels")
        if _CONTAINERS.isdisjoint(map(type, children)):
            continue  # a flat tensor's data: one pass in C instead of a test per element
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


# json.loads and orjson make exactly these types, never subclasses, so ``type`` is enough here.
_CONTAINERS = frozenset((dict, list))


def dump_json(obj: Any) -> bytes:
    """Compact JSON of a response body, as ``json.dumps(obj, default=str)`` would write it.

    orjson writes the common body (str, int, float, bool, list, dict) several times faster.
    The stdlib writes what orjson cannot or would write differently: NaN and infinities
    (orjson writes ``null``, so any ``null`` in its output sends the body to the stdlib),
    ints past 64 bits, non-str keys, lone surrogates. Dataclasses, datetimes and float
    subclasses (numpy float64) go through ``_dump_default`` as the stdlib treats them.
    orjson writes non-ASCII text as UTF-8 instead of ``\\u`` escapes and short float forms
    (``0.00001`` for ``1e-05``): the same JSON values. (One difference is left: a plain
    ``Enum`` member, which no response body holds, is written as its value, not its str.)
    """
    try:
        data = orjson.dumps(obj, default=_dump_default, option=_DUMP_OPTIONS)
    except orjson.JSONEncodeError:
        data = None
    if data is None or b"null" in data:
        data = json.dumps(obj, separators=(",", ":"), default=str).encode()
    return data


_DUMP_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def _dump_default(obj: Any) -> Any:
    if isinstance(obj, float):  # numpy float64 subclasses float: the stdlib writes a number
        return float(obj)
    return str(obj)
