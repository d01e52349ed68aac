"""How a command ends: the exit codes, and the one-line errors that carry them.

Every command fails by raising one of the errors here: click prints its message as one line on
stderr (no traceback) and exits with its code. The message is folded into one line, the secrets
of any URL in it hidden and its control characters escaped, wherever it was written.
"""

from __future__ import annotations

from typing import Final

import click

from .._redaction import hide_secrets
from .render import printable

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "BadUsage",
    "CommandError",
    "LedgerUnavailable",
]

EXIT_REFUSED: Final = 1
"""Refused or not found: an unknown key, an ambiguous prefix, a refused resolve, a lost race."""
EXIT_USAGE: Final = 2
"""Usage: a bad option or a bad ledger URL (click uses 2 for its own usage errors)."""
EXIT_UNAVAILABLE: Final = 3
"""The ledger cannot be reached or used."""
EXIT_BROKEN_PIPE: Final = 128 + 13
"""The output's reader went away: what a shell reports for a tool killed by SIGPIPE (13)."""


class CommandError(click.ClickException):
    """How every command fails: one line on stderr, exit code 1 (refused or not found).

    Args:
        message: what went wrong; newlines and runs of spaces are folded into one line, the
            secrets of any URL in it hidden (:func:`~twiceshy._redaction.hide_secrets`),
            control characters escaped (:func:`~twiceshy.cli.render.printable`).
    """

    exit_code = EXIT_REFUSED

    def __init__(self, message: str) -> None:
        super().__init__(printable(hide_secrets(" ".join(message.split()))))


class BadUsage(CommandError):
    """A bad value the command could not use, such as an unknown ledger URL: exit code 2."""

    exit_code = EXIT_USAGE


class LedgerUnavailable(CommandError):
    """The ledger cannot be reached or used: exit code 3."""

    exit_code = EXIT_UNAVAILABLE
