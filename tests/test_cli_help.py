"""Every `tierserve ... --help` stands on its own: each flag described, nothing that points
outside the repository or reads as a note to maintainers."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from tierserve.cli import build_parser

OUTSIDE_OR_INTERNAL = (
    "DESIGN.md",
    "../shared",
    "/work/",
    "Importing this module",
    "TorchExecutor",
    "`Engine",
)


def commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    stack = [build_parser()]
    while stack:
        parser = stack.pop()
        yield parser.prog, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())


PROGS = [prog for prog, _ in commands()]


def test_every_command_is_covered() -> None:
    names = {prog for prog, _ in commands()}
    assert {"tierserve serve", "tierserve generate", "tierserve profile", "tierserve bench engine"} <= names
    assert len(names) >= 10


@pytest.mark.parametrize("prog", PROGS)
def test_help_describes_every_flag_and_stays_inside_the_repository(prog: str) -> None:
    parser = dict(commands())[prog]
    text = parser.format_help()
    for words in OUTSIDE_OR_INTERNAL:
        assert words not in text, f"{prog} --help mentions {words!r}"
    undescribed = [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
        and not (action.help or "").strip()
    ]
    assert undescribed == [], f"{prog}: {undescribed} have no help"


@pytest.mark.parametrize("prog", [p for p in PROGS if p.startswith("tierserve bench ")])
def test_every_benchmark_says_what_it_runs(prog: str) -> None:
    """A paragraph under the usage, not only the list of flags (bench gateway, fleet and vllm
    had none)."""
    parser = dict(commands())[prog]
    assert parser.description and len(parser.description.split()) >= 12, prog
