"""The argument parser of `shoal` and `shoal-worker`: argparse's, except that a misspelt option
or command is named with the near one ("unknown option --modle; did you mean --model?")."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence

NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class CommandParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors name an unknown option before anything else: a
    misspelt --model otherwise reads as "--model is required". Its subparsers are of this
    class too (argparse makes them of the parent's class)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        known, extras = super().parse_known_args(args, namespace)
        if not self._subcommands() and (wrong := unknown_option(self._given, self._options())):
            self.error(self._unknown_message(wrong))
        return known, extras

    def error(self, message: str):  # type: ignore[override]
        given = getattr(self, "_given", [])
        wrong = unknown_option(self._before_command(given), self._options())
        if wrong:
            message = self._unknown_message(wrong)
        elif (command := self._misspelt_command(given)) is not None:
            message = command
        super().error(message)

    def _options(self) -> list[str]:
        return list(self._option_string_actions)

    def _subcommands(self) -> list[str]:
        return [name for action in self._actions
                if isinstance(action, argparse._SubParsersAction) for name in action.choices]

    def _before_command(self, given: list[str]) -> list[str]:
        """The tokens this parser reads itself: those before its subcommand's name."""
        commands = self._subcommands()
        for i, token in enumerate(given):
            if token in commands:
                return given[:i]
        return given

    def _unknown_message(self, wrong: str) -> str:
        near = difflib.get_close_matches(wrong, [o for o in self._options() if o[:2] == "--"],
                                         n=1, cutoff=0.6)
        return f"unknown option {wrong}" + (f"; did you mean {near[0]}?" if near else "")

    def _misspelt_command(self, given: list[str]) -> str | None:
        commands = self._subcommands()
        first = next((t for t in given if not t.startswith("-")), None)
        if not commands or first is None or first in commands:
            return None
        near = difflib.get_close_matches(first, commands, n=1, cutoff=0.6)
        return (f"unknown command {first!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                + f" (`{self.prog} --help` lists them)")


def unknown_option(given: list[str], known: list[str]) -> str | None:
    """The first token of `given` that looks like an option and is none of `known` (nor a
    prefix of one, which argparse accepts), or None."""
    for token in given:
        if token == "--":
            return None
        if not token.startswith("-") or token == "-" or NUMBER.match(token):
            continue
        name = token.split("=", 1)[0]
        if name in known or (name[:2] == "--" and any(k.startswith(name) for k in known)):
            continue
        if name[:2] != "--" and name[:2] in known:  # -n5, -vv
            continue
        return name
    return None
