"""The ``twiceshy`` command group: every command under one name, and how it meets a closed pipe.

A command that prints into a pipe whose reader went away (``twiceshy ls | head -1``) stops
quietly with exit code 141, as a Unix tool killed by ``SIGPIPE`` does, instead of a traceback:
the group catches the ``BrokenPipeError`` that the commands' consoles
(:class:`~twiceshy.cli.render.PipedConsole`) let through.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

import twiceshy

from .demo import demo
from .exits import EXIT_BROKEN_PIPE
from .gc import gc
from .listing import ls, show
from .reconcile import reconcile
from .resolving import resolve
from .stats import stats

__all__ = ["main"]


class _Commands(click.Group):
    """The command group, ending quietly when the output's reader goes away."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            answer = super().invoke(ctx)
            # Written out here, where a closed pipe can still be caught, not at exit.
            sys.stdout.flush()
        except BrokenPipeError:
            # Python's recipe (the signal module's note on SIGPIPE): stdout goes to devnull
            # so the interpreter's last flush cannot fail again and print a traceback.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None
        return answer


@click.group(cls=_Commands, commands=[demo, gc, ls, reconcile, resolve, show, stats])
@click.version_option(twiceshy.__version__, prog_name="twiceshy")
def main() -> None:
    """twiceshy: side-effecting tool calls of AI agents, safe to retry.

    The ledger commands (ls, show, resolve, gc, stats, reconcile) take --ledger URL (or
    TWICESHY_LEDGER) and --namespace NS. Exit codes: 0 done, 1 refused or not found, 2 usage,
    3 the ledger cannot be reached or used.
    """
