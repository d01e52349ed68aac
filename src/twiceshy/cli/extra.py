"""Whether the ``cli`` extra is installed, and what the command says when it is not.

``pip install twiceshy`` installs the console script ``twiceshy`` but not click and rich, which
come with ``pip install 'twiceshy[cli]'``. Without them, ``twiceshy ...`` and
``python -m twiceshy`` must still start: they print one line naming the extra and exit 2 (usage),
instead of a traceback. This module uses the standard library only, so it can tell them.
"""

from __future__ import annotations

import sys
from typing import Final, NoReturn

__all__ = [
    "INSTALL",
    "MISSING",
    "main_without_the_extra",
    "missing_extra_message",
    "needs_the_extra",
]

INSTALL: Final = "pip install 'twiceshy[cli]'"
"""The command that installs what the command line needs."""

EXIT_USAGE: Final = 2  # as twiceshy.cli.exits.EXIT_USAGE, which needs click to be imported


def _missing() -> ImportError | None:
    """The error of importing click or rich, or ``None`` when both import."""
    try:
        import click  # noqa: F401
        import rich  # noqa: F401
    except ImportError as exc:
        return exc
    return None


MISSING: Final = _missing()
"""Why click or rich cannot be imported (``None`` when the ``cli`` extra is installed)."""


def missing_extra_message(exc: ImportError) -> str:
    """The one line the command prints without the extra, naming what is missing."""
    return f"twiceshy: the command line needs the cli extra: {INSTALL} ({exc})"


def main_without_the_extra() -> NoReturn:
    """The ``twiceshy`` command where click or rich is missing: one line on stderr, exit 2."""
    assert MISSING is not None
    print(missing_extra_message(MISSING), file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def needs_the_extra(name: str) -> NoReturn:
    """Refuse one of ``twiceshy.cli``'s other public names without the extra.

    Args:
        name: the name asked for.

    Raises:
        ImportError: naming the extra and what is missing.
    """
    assert MISSING is not None
    raise ImportError(
        f"twiceshy.cli.{name} needs the cli extra: {INSTALL} ({MISSING})", name=name
    ) from MISSING
