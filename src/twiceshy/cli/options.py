"""The options several commands share: ``--ledger URL`` and ``--namespace NS``, and durations.

A duration option (``--since``, ``--grace``, ``--ttl``) is written ``90``, ``90s``, ``10m``,
``2h`` or ``3d`` and reaches its command in seconds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import click

__all__ = ["duration", "ledger_options", "parse_duration"]

F = TypeVar("F", bound=Callable[..., Any])

_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)", re.IGNORECASE)
_UNITS: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def ledger_options(fn: F) -> F:
    """Add ``--ledger`` and ``--namespace`` to a command."""
    fn = click.option(
        "--namespace",
        metavar="NS",
        default="",
        help="The ledger's namespace (tenant). Default: the empty namespace.",
    )(fn)
    return click.option(
        "--ledger",
        "ledger_url",
        metavar="URL",
        envvar="TWICESHY_LEDGER",
        show_envvar=True,
        help=(
            "The ledger: sqlite:///path, postgresql://..., redis://... Default: the library's "
            "default, the embedded file $XDG_STATE_HOME/twiceshy/ledger.db."
        ),
    )(fn)


def parse_duration(text: str) -> float:
    """A duration such as ``90`` or ``90s``, ``10m``, ``2h``, ``3d`` (``1.5h`` too), in seconds.

    Raises:
        ValueError: the text is no such duration.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 90s, 10m, 2h or 3d")
    return float(match[1]) * _UNITS[match[2].lower()]


def duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """An option's duration, in seconds (a click callback)."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
