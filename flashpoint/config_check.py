"""Type and range checks of configuration values, applied when a TOML file (or overrides)
becomes the frozen dataclasses of :mod:`flashpoint.config`.

The checks follow the house naming rule (units in names): ``*_port`` is a TCP port,
``*_s`` a duration, ``*_bytes`` a size, ``*_bps`` a rate, any other integer a count. Each
failure is one :class:`~flashpoint.errors.BadRequest` naming the file, the key, the value
and what is expected, e.g.::

    c.toml: [controller] listen_port = 'eighty': expected an integer port in 0..65535

An unknown key is refused with the closest known one ("did you mean ...?"). The dataclasses'
own ``__post_init__`` checks (relations between fields) still run after these.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from flashpoint.errors import BadRequest

MAX_PORT = 65535
# Durations where 0 has a meaning (none, never, at once): every other ``*_s`` must be > 0.
ZERO_DURATIONS = frozenset({
    "drain_margin_s", "kaas_object_ttl_s", "mig_drain_grace_s", "partition_overhead_s",
    "partition_link_latency_s", "refill_hold_s", "orphan_grace_s", "completion_hold_s",
    "migration_park_wait_s",  # 0: single-round live migration
})
# Counts that must be at least 1 (a zero would stall or divide by zero); others are >= 0.
POSITIVE_COUNTS = frozenset({"max_queued_per_function", "max_start_failures",
                             "migration_park_rounds"})
# Numbers that are fractions in [0, 1] (PROTEAN's BE occupancy thresholds).
FRACTIONS = frozenset({"protean_t_low", "protean_t_high"})
# Keys whose values are one of a fixed set (a typo would otherwise surface much later).
CHOICES: dict[str, tuple[str, ...]] = {
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "registry.kind": ("local", "s3"),
    "host.kind": ("ondemand", "spot"),
    "controller.cloud": ("aws", "azure", "gcp"),
    "controller.slice_dispatch": ("protean", "least_loaded"),
    "gateway.api_keys.*": ("invoke", "admin"),  # each key's role
}


def did_you_mean(word: str, known: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, or an empty string."""
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown(keys: typing.Iterable[str], known: typing.Iterable[str], where: str) -> None:
    """BadRequest for the first key of ``keys`` not in ``known``, with a suggestion."""
    known = sorted(known)
    for key in sorted(set(keys) - set(known)):
        hint = did_you_mean(key, known) or (
            f"; known keys: {', '.join(known)}" if len(known) <= 8
            else "; every key is documented in flashpoint/config.py")
        raise BadRequest(f"unknown key {key!r} in {where}{hint}")


def check_section(cls: type, data: Any, section: str) -> dict[str, Any]:
    """The keyword arguments of dataclass ``cls`` from the TOML table ``data`` of
    ``[section]``, every value checked (nested dataclasses recursively); BadRequest
    (one line, no file name: :func:`flashpoint.config.load_config` adds it) otherwise."""
    if not isinstance(data, dict):
        raise BadRequest(f"[{section}] must be a table, not {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    refuse_unknown(data, fields, f"[{section}]")
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for name, value in data.items():
        kw[name] = check_value(f"{section}.{name}", hints.get(name, Any), value)
    return kw


def check_value(key: str, hint: Any, value: Any, where: str = "") -> Any:
    """``value`` checked against the type ``hint`` and the range ``key``'s name implies;
    returned converted (an integer where a float is expected becomes a float). A key
    ending in ``.*`` is an item of a table of free keys (autoscaler parameters, API keys):
    no range by name (its owner checks it), ``where`` names it for the message."""
    section, _, name = key.rpartition(".")
    where = where or (f"[{section}] {name}" if section else name)
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint(**check_section(hint, value, key))
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return check_value(key, inner[0], value) if len(inner) == 1 else value
    if hint is bool:
        if not isinstance(value, bool):
            raise _expected(where, value, "true or false")
        return value
    if hint is int:
        return _check_int(where, name, value)
    if hint is float:
        return _check_float(where, name, value)
    if hint is str:
        if not isinstance(value, str):
            raise _expected(where, value, "a string (in quotes)")
        choices = CHOICES.get(key) or CHOICES.get(name)
        if choices and value not in choices and value.upper() not in choices:
            raise _expected(where, value, f"one of {', '.join(choices)}"
                            + did_you_mean(value, choices))
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _expected(where, value, "a list, e.g. [\"a\", \"b\"]")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return type(value)(check_value(f"{key}.*", item, v, f"{where} item") for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise _expected(where, value, "a table of key = value")
        if f"{key}.*" not in CHOICES:  # free parameters (an autoscaler's): their owner checks
            return dict(value)
        _, item = typing.get_args(hint) or (Any, Any)
        return {k: check_value(f"{key}.*", item, v, f"[{key}] {k!r}") for k, v in value.items()}
    return value  # a type with no generic check (Any, a Literal): its class checks it


def _check_int(where: str, name: str, value: Any) -> int:
    if name == "*":
        if not _is_int(value):
            raise _expected(where, value, "an integer")
        return int(value)
    if name.endswith("_port"):
        if not _is_int(value) or not 0 <= value <= MAX_PORT:
            raise _expected(where, value, f"an integer port in 0..{MAX_PORT} (0 = any free port)")
        return int(value)
    if not _is_int(value):
        raise _expected(where, value, "an integer")
    if name.endswith("_bytes"):
        if value < 0:
            raise _expected(where, value, "a size in bytes >= 0")
    elif name in POSITIVE_COUNTS:
        if value < 1:
            raise _expected(where, value, "a count >= 1")
    elif value < 0:
        raise _expected(where, value, "a count >= 0")
    return int(value)


def _check_float(where: str, name: str, value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise _expected(where, value, "a number")
    if name == "*":
        return float(value)
    if name.endswith("_s") and name not in ZERO_DURATIONS:
        if value <= 0:
            raise _expected(where, value, "a duration in seconds > 0")
    elif name.endswith("_bps"):
        if value <= 0:
            raise _expected(where, value, "a rate in bytes (or bits) per second > 0")
    elif name in FRACTIONS:
        if not 0 <= value <= 1:
            raise _expected(where, value, "a fraction in [0, 1]")
    elif value < 0:
        raise _expected(where, value, "a number >= 0")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SECRET_KEYS = frozenset({"secret"})  # never echoed in an error message


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expected(where: str, value: Any, what: str) -> BadRequest:
    if where in SECRET_KEYS:
        return BadRequest(f"{where}: expected {what}")
    return BadRequest(f"{where} = {_show(value)}: expected {what}")
