"""Every command and flag of the parser has help text; `deploy` has a flag for every field of
FunctionSpec a user sets."""

from __future__ import annotations

import argparse
import dataclasses

from flashpoint.cli import parser
from flashpoint.spec import FunctionSpec


def _walk(p: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action, str]]:
    """(command path, action, the help of the subcommand it belongs to) for every action."""
    out = []
    for action in p._actions:  # argparse keeps no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sp in action.choices.items():
                out.append((f"{path} {name}", action, helps.get(name) or ""))
                out += _walk(sp, f"{path} {name}")
        else:
            out.append((path, action, action.help or ""))
    return out


def test_every_command_and_flag_has_help() -> None:
    entries = _walk(parser.build(), "flashpoint")
    missing = [(path, a.option_strings or a.dest) for path, a, text in entries
               if not text.strip() or text == argparse.SUPPRESS]
    assert missing == []
    assert len(entries) > 80  # the walk did reach the subcommands' flags


def test_deploy_has_a_flag_for_every_settable_field() -> None:
    p = parser.build()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    deploy = sub.choices["deploy"]
    dests = {a.dest for a in deploy._actions}
    settable = {f.name for f in dataclasses.fields(FunctionSpec)} - {"name", "model"}
    assert settable <= dests
    assert {"function", "model"} <= dests
    assert set(parser.SPEC_FLAGS) == settable  # no flag for a field that is gone


def test_ranges_are_checked_by_the_parser() -> None:
    int_type = parser.int_in(1, 64)
    assert int_type("1") == 1 and int_type("64") == 64
    for bad in ("0", "65", "-1", "x", "1.5"):
        try:
            int_type(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"{bad!r} accepted")
    frac = parser.number_in(0, 1)
    assert frac("0") == 0.0 and frac("1") == 1.0
    for bad in ("-0.1", "1.01", "nan", "x"):
        try:
            frac(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"{bad!r} accepted")
