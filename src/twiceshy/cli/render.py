"""What reaches the operator's terminal: ledger text with its control characters escaped.

Tool names, keys, owners, errors, reasons and results come from the ledger, where any caller (or
anyone who can write to the store) may have put an OSC or CSI sequence. Every line, table cell
and JSON text a command prints is made here, from text passed through :func:`printable`, so that
stored text cannot retitle, clear or rewrite the terminal. Also here: how times, lengths of time
and shortened keys are shown, and the console that leaves a closed pipe to the command group.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Final

import click
from rich.console import Console
from rich.text import Text

__all__ = [
    "PipedConsole",
    "echo",
    "echo_json",
    "iso",
    "json_text",
    "printable",
    "shortened",
    "short_width",
    "span",
    "text",
    "when",
]

_SHORT_KEY: Final = 12

# What a terminal acts on instead of showing, or what makes one text look like another: C0
# controls and DEL (ESC opens OSC and CSI sequences), C1 controls (U+009B is a CSI on its own),
# the line and paragraph separators, the bidirectional marks, embeddings, overrides and
# isolates, and lone surrogates (which have no UTF-8 form). Tab and newline are listed apart.
_CONTROLS: Final = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
)
_UNSAFE: Final = re.compile(f"[\t\n{_CONTROLS}]")
_UNSAFE_IN_LINES: Final = re.compile(f"[{_CONTROLS}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` as the command line shows it: each control character written as an escape.

    Shown as ``\\x1b`` or ``\\u009b`` text, an OSC or CSI sequence cannot act on the terminal.
    Backslashes are left as they are.

    Args:
        text: the text to show.
        lines: keep newlines and tabs, where the layout has room for several lines.
    """
    return (_UNSAFE_IN_LINES if lines else _UNSAFE).sub(_escape, text)


def json_text(data: Any) -> str:
    """``data`` as indented JSON in which every control character is a ``\\u`` escape.

    ``json.dumps`` escapes C0 controls itself but not DEL, C1 controls or the rest; outside its
    strings there are only brackets, digits, spaces and newlines, so each of those characters
    is inside a string, where its ``\\u`` escape is the same character: the same JSON value.
    """
    dumped = json.dumps(data, indent=2, ensure_ascii=False)
    return _UNSAFE_IN_LINES.sub(lambda m: f"\\u{ord(m[0]):04x}", dumped)


def text(value: str, style: str = "", *, lines: bool = False) -> Text:
    """A rich text of ``value``, its control characters escaped (and no markup read in it)."""
    return Text(printable(value, lines=lines), style=style)


def shortened(value: str, width: int) -> Text:
    """A rich text of ``value`` escaped (:func:`printable`), cut to ``width`` characters.

    Escaped first, so a cut cannot leave a control character whole; what is cut is marked
    with an ellipsis.
    """
    shown = printable(value)
    if len(shown) > width:
        shown = shown[: width - 1] + "\u2026"
    return Text(shown)


def echo(line: str) -> None:
    """Print one line, its control characters escaped."""
    click.echo(printable(line))


def echo_json(data: Any) -> None:
    """Print ``data`` as JSON: exact, its control characters (and lone surrogates) escaped."""
    click.echo(json_text(data))


class PipedConsole(Console):
    """rich's console, leaving a closed pipe to the command group (rich itself exits 1)."""

    def on_broken_pipe(self) -> None:
        # Called inside rich's ``except BrokenPipeError``: raise that error on.
        self.quiet = True
        raise


# -- times and keys ---------------------------------------------------------------------------


def iso(seconds: float | None) -> str | None:
    """A store time (seconds since the epoch) as ISO 8601 in UTC."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def span(seconds: float) -> str:
    """A length of time, short: ``0.4s``, ``42s``, ``5m``, ``3h``, ``2d``."""
    s = abs(seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 2 * 3600:
        return f"{s / 60:.0f}m"
    if s < 2 * 86400:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def when(seconds: float | None, now: float) -> str:
    """A store time as ISO 8601 and relative to the store's ``now``."""
    if seconds is None:
        return "-"
    delta = seconds - now
    relative = f"in {span(delta)}" if delta > 0 else f"{span(delta)} ago"
    return f"{iso(seconds)} ({relative})"


def short_width(keys: list[str]) -> int:
    """The shortest prefix length, at least 12, that tells the keys apart."""
    width = _SHORT_KEY
    longest = max((len(k) for k in keys), default=0)
    while width < longest and len({k[:width] for k in keys}) < len(set(keys)):
        width += 1
    return width
