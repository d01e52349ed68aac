"""The ``twiceshy`` command line (the ``cli`` extra: click and rich).

An operator's view of a ledger: list records (``ls``), inspect one (``show``), settle a parked one
(``resolve``), remove expired outcomes (``gc``) and count what is there (``stats``); and ``demo``,
the re-enacted double charge; ``reconcile`` asks the tools' reconcilers about parked records.
Every ledger command takes ``--ledger URL`` (or
``TWICESHY_LEDGER``) and ``--namespace NS``.

Exit codes:
    0: done.
    1: refused or not found: an unknown key, an ambiguous prefix, a record that may not be
       resolved, a resolve that lost a race, a ledger URL naming a file or schema that holds no
       twiceshy ledger.
    2: usage: a bad option, a bad ledger URL (click's own usage errors included).
    3: the ledger cannot be reached or used.
    141: the reader of the output went away (``twiceshy ls | head -1``): the command stops
       quietly, as a Unix tool killed by ``SIGPIPE`` does (128 + 13).

Every error is one line on stderr; no traceback; no URL's password or secret query parameter.
What the ledger holds is printed with its control characters escaped (``\\x1b``, ``\\u009b``;
JSON's ``\\u`` escapes under ``--json``): stored text cannot drive the operator's terminal. The
ledger commands never create a ledger: they open the store with ``create=False``.
"""

from __future__ import annotations

try:
    import click
    from rich import box
    from rich.console import Console
    from rich.highlighter import JSONHighlighter
    from rich.table import Table
    from rich.text import Text
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"the twiceshy command line needs the cli extra: pip install 'twiceshy[cli]' ({exc})"
    ) from exc

import importlib
import inspect
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, NoReturn, TypeVar
from urllib.parse import unquote, unquote_plus, urlsplit

import twiceshy

from ._codec import ResultCodec
from ._protocol import LAPSED, TRANSITIONS, Actor
from ._records import Change, Outcome, Record, State
from .errors import LedgerNotFound, ResultNotStorable, StoreError, clearing
from .stores import CallCounts, Store, default_url, open_store

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_REFUSED", "EXIT_UNAVAILABLE", "EXIT_USAGE", "main"]

EXIT_REFUSED: Final = 1
"""Refused or not found: an unknown key, an ambiguous prefix, a refused resolve, a lost race."""
EXIT_USAGE: Final = 2
"""Usage: a bad option or a bad ledger URL (click uses 2 for its own usage errors)."""
EXIT_UNAVAILABLE: Final = 3
"""The ledger cannot be reached or used."""
EXIT_BROKEN_PIPE: Final = 128 + 13
"""The output's reader went away: what a shell reports for a tool killed by SIGPIPE (13)."""

RESOLVE_ERROR_TYPE: Final = "twiceshy.resolve"
"""The error type recorded by ``resolve --failed`` (replayed as ``ReplayedError``)."""

_SHORT_KEY: Final = 12
_NO_COUNTS: Final = "This ledger's store keeps no call counts."
_COUNTS_NOTE: Final = (
    "Each process adds its call counts every counts_interval (10 s by default) and when its "
    "ledger closes."
)
# Outcomes that answered a repeat of an intent without running it again.
_DUPLICATES: Final = (Outcome.REPLAYED, Outcome.JOINED, Outcome.WAITED)
_NO_HISTORY: Final = "the ledger keeps a count of attempts, not a history of them"
_STATE_STYLES: Final = {
    State.CLAIMED: "yellow",
    State.SUCCEEDED: "green",
    State.FAILED: "magenta",
    State.RELEASED: "cyan",
    State.UNKNOWN: "bold red",
}

F = TypeVar("F", bound=Callable[..., Any])


# -- what reaches the terminal ----------------------------------------------------------------

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


def _printable(text: str, *, lines: bool = False) -> str:
    """``text`` as the command line shows it: each control character written as an escape.

    Tool names, keys, owners, errors, reasons and results come from the ledger, where any caller
    (or anyone who can write to the store) may have put an OSC or CSI sequence; shown as
    ``\\x1b`` or ``\\u009b`` text, they cannot retitle, clear or rewrite the operator's terminal.
    Backslashes are left as they are.

    Args:
        text: the text to show.
        lines: keep newlines and tabs, where the layout has room for several lines.
    """
    return (_UNSAFE_IN_LINES if lines else _UNSAFE).sub(_escape, text)


def _json_text(data: Any) -> str:
    """``data`` as indented JSON in which every control character is a ``\\u`` escape.

    ``json.dumps`` escapes C0 controls itself but not DEL, C1 controls or the rest; outside its
    strings there are only brackets, digits, spaces and newlines, so each of those characters
    is inside a string, where its ``\\u`` escape is the same character: the same JSON value.
    """
    text = json.dumps(data, indent=2, ensure_ascii=False)
    return _UNSAFE_IN_LINES.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _text(text: str, style: str = "", *, lines: bool = False) -> Text:
    """A rich text of ``text``, its control characters escaped (and no markup read in it)."""
    return Text(_printable(text, lines=lines), style=style)


def _echo(line: str) -> None:
    """Print one line, its control characters escaped."""
    click.echo(_printable(line))


# -- secrets ----------------------------------------------------------------------------------

_HIDDEN: Final = "***"
_SHORTEST_SCRUBBED: Final = 4
# A name=value setting: a URL's query parameter, a key=value connection string's keyword. Each
# pattern starts only where a run of its characters starts: a long message is read once.
_SETTING: Final = re.compile(
    r"(?<![A-Za-z0-9_.%-])(?P<head>(?P<name>[A-Za-z_%][A-Za-z0-9_.%-]*) *= *)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'?|[^\s&#]*)"
)
# The settings whose value is a secret: libpq's password and sslpassword, redis-py's password,
# and the like (a name is read percent-decoded, as the drivers read it).
_SECRET_NAME: Final = re.compile(r"pass|pwd|secret|token|auth", re.IGNORECASE)
# What a message puts after a value it quotes: a value already hidden, followed by these, is
# left alone.
_ALREADY_HIDDEN: Final = re.compile(r"\*\*\*['\")\]},:;.]*")


def _passwords(text: str) -> Iterator[tuple[int, int]]:
    """Where the passwords of the URLs in ``text`` are, as ``(start, end)`` offsets.

    A URL's password follows ``user:`` up to the last ``@`` before its query: found even in a
    URL that does not parse (a bad host or port; a password with a ``/`` left unencoded, as
    base64 has one), and in any text quoting one. Read piece by piece, so that a long message
    is read once (a pattern would try every ``://`` against the rest of the text).
    """
    offset = 0
    for token in re.split(r"(\s+)", text):
        pieces = token.split("://")
        at = offset + len(pieces[0]) + 3  # where the piece after a "://" starts in the text
        for piece in pieces[1:]:
            authority = re.split(r"[?#]", piece, maxsplit=1)[0]
            user, colon, password = authority[: max(authority.rfind("@"), 0)].partition(":")
            if colon and "/" not in user and not _ALREADY_HIDDEN.fullmatch(password):
                start = at + len(user) + 1
                yield start, start + len(password)
            at += len(piece) + 3
        offset += len(token)


def _hide_passwords(text: str) -> str:
    kept: list[str] = []
    last = 0
    for start, end in _passwords(text):
        kept += [text[last:start], _HIDDEN]
        last = end
    return "".join(kept) + text[last:]


def _hide_setting(match: re.Match[str]) -> str:
    if not _SECRET_NAME.search(unquote(match["name"])) or _ALREADY_HIDDEN.fullmatch(
        match["secret"]
    ):
        return match[0]
    return match["head"] + _HIDDEN


def _secrets(url: str) -> set[str]:
    """The secrets of a URL, as written and as a driver may quote them (percent-decoded)."""
    found = {url[start:end] for start, end in _passwords(url)}
    found |= {
        m["secret"] for m in _SETTING.finditer(url) if _SECRET_NAME.search(unquote(m["name"]))
    }
    forms = set()
    for secret in found:
        bare = secret.strip("'")
        forms |= {secret, bare, unquote(bare), unquote_plus(bare)}
    return {s for s in forms if s and not _ALREADY_HIDDEN.fullmatch(s)}


def _hide_secrets(text: str, url: str | None = None) -> str:
    """``text`` without secrets, for every line the command line prints about a ledger.

    The password of every URL in it, and the value of every setting named like a secret
    (``password=``, ``sslpassword=``, ``token=``...), whether a URL's query parameter or a
    connection string's keyword, become ``***``; so do the secrets of ``url`` wherever they
    appear, percent-decoded too (a driver may quote them so).

    Args:
        text: a URL, or a message that may quote one.
        url: the ledger URL the message is about, if known.
    """
    if url is not None:
        # The longest first: a secret may contain a shorter one. One of a few characters is
        # left to the URL-shaped passes: hiding every "1" of a message would garble its ports
        # and counts, and so short a password hides nothing anyway.
        for secret in sorted(_secrets(url), key=len, reverse=True):
            if len(secret) >= _SHORTEST_SCRUBBED:
                text = text.replace(secret, _HIDDEN)
    return _SETTING.sub(_hide_setting, _hide_passwords(text))


class CommandError(click.ClickException):
    """How every command fails: one line on stderr, exit code 1 (refused or not found).

    Args:
        message: what went wrong; newlines and runs of spaces are folded into one line, the
            secrets of any URL in it hidden (:func:`_hide_secrets`), control characters escaped
            (:func:`_printable`).
    """

    exit_code = EXIT_REFUSED

    def __init__(self, message: str) -> None:
        super().__init__(_printable(_hide_secrets(" ".join(message.split()))))


class BadUsage(CommandError):
    """A bad value the command could not use, such as an unknown ledger URL: exit code 2."""

    exit_code = EXIT_USAGE


class LedgerUnavailable(CommandError):
    """The ledger cannot be reached or used: exit code 3."""

    exit_code = EXIT_UNAVAILABLE


# -- durations and times ----------------------------------------------------------------------

_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)", re.IGNORECASE)
_UNITS: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """A duration such as ``90`` or ``90s``, ``10m``, ``2h``, ``3d`` (``1.5h`` too), in seconds.

    Raises:
        ValueError: the text is no such duration.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 90s, 10m, 2h or 3d")
    return float(match[1]) * _UNITS[match[2].lower()]


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """An option's duration, in seconds."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _iso(seconds: float | None) -> str | None:
    """A store time (seconds since the epoch) as ISO 8601 in UTC."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def _span(seconds: float) -> str:
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


def _when(seconds: float | None, now: float) -> str:
    """A store time as ISO 8601 and relative to the store's ``now``."""
    if seconds is None:
        return "-"
    delta = seconds - now
    relative = f"in {_span(delta)}" if delta > 0 else f"{_span(delta)} ago"
    return f"{_iso(seconds)} ({relative})"


# -- the ledger ---------------------------------------------------------------------------------


def _ledger_options(fn: F) -> F:
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


def _redacted(url: str) -> str:
    """The URL without its secrets."""
    return _hide_secrets(url, url)


def _scrubbed(message: str, url: str) -> str:
    """A message about the ledger ``url`` without the URL's secrets."""
    return _hide_secrets(message, url)


def _open_store(url: str, *, create: bool = False) -> Store:
    """Open the store ``url`` names; a bad URL, no ledger there, or an unreachable store
    becomes a :class:`CommandError` (exit 2, 1 or 3)."""
    shown = _redacted(url)
    try:
        store, _ = open_store(url, create=create)
    except (ValueError, TypeError) as exc:
        # A driver refuses parameters it does not know with a TypeError (redis-py's from_url).
        raise BadUsage(f"bad ledger URL {shown}: {_scrubbed(str(exc), url)}") from exc
    except ImportError as exc:
        raise LedgerUnavailable(f"cannot open the ledger {shown}: {exc}") from exc
    except LedgerNotFound as exc:
        # Nothing was created: an operator's typo must not become a new, empty ledger.
        raise CommandError(f"{_scrubbed(str(exc), url)} ({shown})") from exc
    except StoreError as exc:
        message = _scrubbed(str(exc), url)
        raise LedgerUnavailable(f"cannot open the ledger {shown}: {message}") from exc
    return store


@contextmanager
def _opened(ledger_url: str | None) -> Iterator[Store]:
    """Open the ledger's store for one command; store failures become :class:`CommandError`."""
    url = ledger_url or default_url()
    shown = _redacted(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise BadUsage(f"bad ledger URL {shown}: {_scrubbed(str(exc), url)}") from exc
    if parts.scheme.lower() == "memory":
        raise BadUsage(
            f"{shown} is a ledger inside one process: the command line cannot see its records"
        )
    if parts.scheme.lower() == "sqlite" and not parts.netloc and parts.path.startswith("/"):
        # Opening a file creates it: an operator's typo must not become a new, empty ledger.
        path = unquote(parts.path[1:])
        if path and not os.path.exists(path):
            raise LedgerUnavailable(f"no ledger file at {path!r} ({shown})")
    store = _open_store(url)
    try:
        yield store
    except StoreError as exc:
        message = _scrubbed(str(exc), url)
        raise LedgerUnavailable(f"the ledger {shown} failed: {message}") from exc
    finally:
        store.close()


def _store_now(store: Store, namespace: str) -> float:
    """The store's clock: every answer of a store carries it, a read of no key included."""
    return store.get(namespace, "").now


def _find(store: Store, namespace: str, key: str) -> tuple[Record, float]:
    """The live record whose key is ``key`` or starts with it, and the store's clock.

    Raises:
        CommandError: no such record, or the prefix matches several.
    """
    if not key:
        raise BadUsage("give a key, or the first characters of one")
    snap = store.get(namespace, key)
    if snap.record is not None:
        return snap.record, snap.now
    matches = [r for r in store.records(namespace) if r.key.startswith(key)]
    if not matches:
        raise CommandError(f"no record with a key starting {key!r} in namespace {namespace!r}")
    if len(matches) > 1:
        width = _short_width([r.key for r in matches])
        shown = ", ".join(r.key[:width] for r in matches[:5])
        more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        raise CommandError(
            f"the key prefix {key!r} is ambiguous: it matches {len(matches)} records "
            f"({shown}{more}); give more characters"
        )
    return matches[0], snap.now


def _short_width(keys: list[str]) -> int:
    """The shortest prefix length, at least 12, that tells the keys apart."""
    width = _SHORT_KEY
    longest = max((len(k) for k in keys), default=0)
    while width < longest and len({k[:width] for k in keys}) < len(set(keys)):
        width += 1
    return width


# -- records as data ----------------------------------------------------------------------------


def _json_value(text: str | None) -> Any:
    """A stored JSON text as its value (the text itself where it is not JSON, or nested too
    deeply for Python's parser: no tool's result is, only a text written to the store)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _error(text: str | None) -> dict[str, str] | None:
    """A stored error as ``{"type": ..., "message": ...}``."""
    if text is None:
        return None
    data = _json_value(text)
    if isinstance(data, dict):
        return {"type": str(data.get("type", "")), "message": str(data.get("message", ""))}
    return {"type": "", "message": str(data)}


def _lapsed(record: Record, now: float) -> bool | None:
    """Whether the record's lease has lapsed on the store's clock (``None``: it has none)."""
    if record.lease_deadline is None:
        return None
    return record.lease_deadline <= now


def _as_json(record: Record, now: float) -> dict[str, Any]:
    """Every field of a record, for scripts: enums by value, times in ISO 8601 UTC."""
    return {
        "namespace": record.namespace,
        "key": record.key,
        "fingerprint": record.fingerprint,
        "tool": record.tool,
        "effect": record.effect.value,
        "state": record.state.value,
        "fence": record.fence,
        "owner": record.owner,
        "lease_deadline": _iso(record.lease_deadline),
        "lease_lapsed": _lapsed(record, now),
        "attempts": record.attempts,
        "result": _json_value(record.result),
        "error": _error(record.error),
        "reason": record.reason,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
        "expires_at": _iso(record.expires_at),
    }


def _echo_json(data: Any) -> None:
    """Print ``data`` as JSON: exact, its control characters (and lone surrogates) escaped."""
    click.echo(_json_text(data))


def _state_text(record: Record, now: float) -> Text:
    label = record.state.value
    if record.state is State.CLAIMED and _lapsed(record, now):
        label += " (lease lapsed)"
    if record.state is State.UNKNOWN:
        # A lapse is not a crash: the owner may only have been paused, and may still act.
        label += " (a lapsed lease)" if record.reason == LAPSED else " (its owner's error)"
    return _text(label, style=_STATE_STYLES[record.state])


# -- the commands -------------------------------------------------------------------------------


class _Console(Console):
    """rich's console, leaving a closed pipe to :class:`_Commands` (rich itself exits 1)."""

    def on_broken_pipe(self) -> None:
        # Called inside rich's ``except BrokenPipeError``: raise that error on.
        self.quiet = True
        raise


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


@click.group(cls=_Commands)
@click.version_option(twiceshy.__version__, prog_name="twiceshy")
def main() -> None:
    """twiceshy: side-effecting tool calls of AI agents, safe to retry.

    The ledger commands (ls, show, resolve, gc, stats, reconcile) take --ledger URL (or
    TWICESHY_LEDGER) and --namespace NS. Exit codes: 0 done, 1 refused or not found, 2 usage,
    3 the ledger cannot be reached or used.
    """


@main.command()
@click.option(
    "--ledger",
    "ledger_url",
    metavar="URL",
    default=None,
    help=(
        "The ledger to use (memory://, sqlite:///path, postgresql://..., redis://...). "
        "Default: a fresh temporary SQLite file."
    ),
)
def demo(ledger_url: str | None) -> None:
    """Re-enact a double charge, and twiceshy preventing it.

    Exits 0 when the story comes out as told: two charges for the plain retry loop, one for the
    KEYED tool, one for the UNSAFE tool.
    """
    from ._demo import run_demo  # the demo's provider double is for this command only

    if ledger_url is not None:
        # Refuse a bad or unreachable ledger as every command does (exit 2 or 3), before the acts;
        # the demo may make a new ledger.
        _open_store(ledger_url, create=True).close()
    try:
        result = run_demo(ledger_url, console=_Console())
    except (ValueError, twiceshy.StoreError) as exc:
        which = _redacted(ledger_url) if ledger_url is not None else "(temporary)"
        message = _scrubbed(str(exc), ledger_url) if ledger_url is not None else str(exc)
        raise LedgerUnavailable(f"cannot use the ledger {which}: {message}") from exc
    if not result.ok:
        raise SystemExit(1)


@main.command("ls")
@_ledger_options
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in State], case_sensitive=False),
    help="Only records in this state (repeat for several).",
)
@click.option("--tool", metavar="NAME", help="Only records of this tool.")
@click.option(
    "--since",
    callback=_duration,
    metavar="DURATION",
    help="Only records created within this long (10m, 2h, 3d), on the store's clock.",
)
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="At most N records.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of full records.")
def ls(
    ledger_url: str | None,
    namespace: str,
    states: tuple[str, ...],
    tool: str | None,
    since: float | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List the ledger's live records, newest first.

    Records are found by key, tool, state and age. They do not keep the scope (run id) of the
    call: a key is a hash of scope, tool and arguments, so there is no --scope filter.
    """
    with _opened(ledger_url) as store:
        now = _store_now(store, namespace)
        found = store.records(
            namespace,
            states=[State(s) for s in states] if states else None,
            tool=tool,
            limit=limit,
        )
    if since is not None:
        found = [r for r in found if r.created_at >= now - since]
    if as_json:
        _echo_json([_as_json(r, now) for r in found])
        return
    if not found:
        _echo(f"no records in namespace {namespace!r}")
        return
    width = _short_width([r.key for r in found])
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("key", no_wrap=True)
    table.add_column("tool", overflow="fold")
    table.add_column("effect")
    table.add_column("state")
    table.add_column("age", justify="right")
    table.add_column("attempts", justify="right")
    table.add_column("fence", justify="right")
    for r in found:
        table.add_row(
            _text(r.key[:width]),
            _text(r.tool),
            _text(r.effect.value),
            _state_text(r, now),
            _text(_span(now - r.created_at)),
            _text(str(r.attempts)),
            _text(str(r.fence)),
        )
    console = _Console(highlight=False)
    console.print(table)
    plural = "" if len(found) == 1 else "s"
    console.print(_text(f"{len(found)} record{plural} in namespace {namespace!r}"), soft_wrap=True)


@main.command()
@_ledger_options
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The record as one JSON object.")
def show(ledger_url: str | None, namespace: str, key: str, as_json: bool) -> None:
    """Show one whole record: KEY, or a unique prefix of it."""
    with _opened(ledger_url) as store:
        record, now = _find(store, namespace, key)
    if as_json:
        _echo_json(_as_json(record, now))
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")

    def row(label: str, value: Text | str, *, lines: bool = False) -> None:
        grid.add_row(label, value if isinstance(value, Text) else _text(value, lines=lines))

    row("key", record.key)
    row("namespace", repr(record.namespace))
    row("fingerprint", record.fingerprint)
    row("tool", record.tool)
    row("effect", record.effect.value)
    row("state", _state_text(record, now))
    row("fence", str(record.fence))
    row("owner", record.owner)
    if record.lease_deadline is not None:
        status = "lapsed" if _lapsed(record, now) else "live"
        row("lease", f"{status}, deadline {_when(record.lease_deadline, now)}")
    else:
        row("lease", "-")
    row("attempts", f"{record.attempts} ({_NO_HISTORY})")
    error = _error(record.error)
    if error is not None:
        text = f"{error['type']}: {error['message']}" if error["type"] else error["message"]
        row("error", text, lines=True)
    if record.reason is not None:
        row("reason", record.reason, lines=True)
    row("created", _when(record.created_at, now))
    row("updated", _when(record.updated_at, now))
    row("expires", _when(record.expires_at, now) if record.expires_at is not None else "never")
    console = _Console(highlight=False)
    console.print(grid)
    if record.result is not None:
        console.print(_text("result", style="bold"))
        try:
            data = json.loads(record.result)
        except (ValueError, RecursionError):
            console.print(_text(record.result, lines=True))
        else:
            # rich's JSON would dump it again, C1 controls raw: highlight the escaped text.
            pretty = JSONHighlighter()(_json_text(data))
            pretty.no_wrap, pretty.overflow = True, None
            console.print(pretty)
    if record.state is State.UNKNOWN:
        if record.reason == LAPSED:
            console.print(
                _text(
                    f"Marked unknown when its owner's lease lapsed, at {_iso(record.updated_at)}: "
                    "the owner may only have been paused and may still take effect; check the "
                    "provider once more before releasing it."
                )
            )
        console.print(_text(clearing(record.key)))


def _parse_result(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--succeeded``: strict JSON (no NaN or Infinity), answered as the text to store."""
    if value is None:
        return None

    def refuse(constant: str) -> NoReturn:
        raise ValueError(f"{constant} is not JSON")

    try:
        data = json.loads(value, parse_constant=refuse)
        return ResultCodec().encode(data)
    except (ValueError, ResultNotStorable) as exc:
        raise click.BadParameter(f"not a JSON value: {exc}", ctx, param) from exc


def _resolution(
    record: Record, now: float, to: State, force: bool, grace: float, **kw: Any
) -> Change:
    """The guarded write that resolves ``record`` to ``to``, or a refusal that says why."""
    state = record.state
    if (
        state is State.UNKNOWN
        and to is State.RELEASED
        and record.reason == LAPSED
        and now < record.updated_at + grace
        and not force
    ):
        raise CommandError(
            f"refused: the record {record.key} was marked unknown when its owner's lease lapsed, "
            f"{_span(now - record.updated_at)} ago: a lapse is not a crash, and a paused owner "
            "may still take effect, which the provider may not show yet. Check again after "
            f"{_iso(record.updated_at + grace)} (--grace), or use --force"
        )
    if state is State.UNKNOWN:
        if Actor.RECONCILER not in TRANSITIONS.get((state, to), frozenset()):
            raise AssertionError(f"a reconciler may not move a record from {state} to {to}")
        return Change(fence=record.fence, from_states=frozenset({state}), to=to, **kw)
    if state is State.CLAIMED:
        deadline = record.lease_deadline
        lapsed = deadline is not None and deadline <= now
        if not force:
            lease = (
                "its lease has lapsed"
                if lapsed
                else f"its lease is live for {_span((deadline or now) - now)}"
            )
            raise CommandError(
                f"refused: the record {record.key} is claimed ({lease}); an owner may still "
                "be running the call. Use --force to resolve a claimed record whose lease lapsed"
            )
        if not lapsed:
            left = f" for {_span(deadline - now)}" if deadline is not None else ""
            raise CommandError(
                f"refused: the record {record.key} is claimed under a live lease{left}: its owner "
                "is still running the call; resolve it only once the lease has lapsed"
            )
        # A lapsed lease, on the store's clock: the store checks that again as it writes.
        return Change(fence=record.fence, from_states=frozenset({state}), to=to, lapsed=True, **kw)
    raise CommandError(
        f"refused: the record {record.key} is already {state.value}; only unknown records "
        "(and, with --force, claimed ones whose lease lapsed) can be resolved"
    )


@main.command()
@_ledger_options
@click.argument("key")
@click.option("--released", is_flag=True, help="It certainly did not happen: the next call runs.")
@click.option(
    "--succeeded",
    "result",
    metavar="JSON",
    callback=_parse_result,
    help="It happened, with this result (JSON): the next call replays it.",
)
@click.option(
    "--failed",
    "message",
    metavar="MESSAGE",
    help="It ran and failed for certain: the next call gets this error.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Also resolve a claimed record whose lease has lapsed (a crashed owner), or release an "
    "unknown one within its grace.",
)
@click.option(
    "--grace",
    callback=_duration,
    default="60s",
    show_default=True,
    metavar="DURATION",
    help="How long after a lapse marked a record unknown --released is refused (the owner may "
    "only be paused).",
)
@click.option(
    "--ttl",
    callback=_duration,
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="How long the resolved outcome is kept.",
)
def resolve(
    ledger_url: str | None,
    namespace: str,
    key: str,
    released: bool,
    result: str | None,
    message: str | None,
    force: bool,
    grace: float | None,
    ttl: float | None,
) -> None:
    """Settle a parked record, as a reconciler: KEY or a unique prefix of it.

    Only an unknown record can be resolved (with --force, also a claimed record whose lease has
    lapsed on the store's clock). The write is fenced: when the record changed meanwhile,
    nothing is written and the command fails.
    """
    given = [released, result is not None, message is not None]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --released, --succeeded JSON, --failed MESSAGE")
    if ttl is None or ttl <= 0:
        raise click.BadParameter("the resolved outcome must be kept a while", param_hint="--ttl")
    fields: dict[str, str] = {}
    if released:
        to = State.RELEASED
    elif result is not None:
        to, fields["result"] = State.SUCCEEDED, result
    else:
        error = json.dumps({"type": RESOLVE_ERROR_TYPE, "message": message})
        to, fields["error"] = State.FAILED, error
    with _opened(ledger_url) as store:
        record, now = _find(store, namespace, key)
        change = _resolution(record, now, to, force, grace or 0.0, ttl=ttl, **fields)
        snap = store.write(namespace, record.key, change)
    after = snap.record
    if after is None:
        raise CommandError(f"the record {record.key} expired meanwhile; nothing was written")
    if not snap.won:
        raise CommandError(
            f"lost a race: the record {record.key} changed meanwhile (now {after.state.value}, "
            f"fence {after.fence}); nothing was written"
        )
    _echo(
        f"resolved {after.key}: {record.state.value} -> {after.state.value} "
        f"(tool {after.tool}, fence {after.fence}); kept until {_iso(after.expires_at)}"
    )
    if after.result is not None:
        _echo(f"result: {after.result}")
    if message is not None:
        _echo(f"error: {RESOLVE_ERROR_TYPE}: {message}")


@main.command()
@_ledger_options
@click.option("--dry-run", is_flag=True, help="Remove nothing; say what gc keeps.")
@click.option("--all-namespaces", is_flag=True, help="Remove expired outcomes of every namespace.")
def gc(ledger_url: str | None, namespace: str, dry_run: bool, all_namespaces: bool) -> None:
    """Remove expired outcomes; never a claimed or unknown record.

    Says how many outcomes were removed. Redis drops expired outcomes by itself, so there gc
    often finds none.
    """
    if dry_run and all_namespaces:
        raise click.UsageError("--dry-run looks at one namespace; drop --all-namespaces")
    where = "every namespace" if all_namespaces else f"namespace {namespace!r}"
    if not dry_run:
        with _opened(ledger_url) as store:
            removed = store.purge_expired(None if all_namespaces else namespace)
        plural = "" if removed == 1 else "s"
        _echo(f"removed {removed} expired outcome{plural} from {where}")
        return
    with _opened(ledger_url) as store:
        now = _store_now(store, namespace)
        found = store.records(namespace)
    parked = [r for r in found if r.state in (State.CLAIMED, State.UNKNOWN)]
    expiries = [r.expires_at for r in found if r.expires_at is not None]
    _echo(
        "dry run: nothing removed. Expired outcomes are already invisible to every read, so "
        "only gc itself can count them."
    )
    _echo(f"{where}: {len(parked)} claimed or unknown records, never removed by gc")
    if expiries:
        _echo(
            f"{where}: {len(expiries)} outcomes within their retention; the next expires "
            f"in {_span(min(expiries) - now)}"
        )
    else:
        _echo(f"{where}: no outcome within its retention")


@main.command()
@_ledger_options
@click.option("--json", "as_json", is_flag=True, help="The counts as one JSON object.")
def stats(ledger_url: str | None, namespace: str, as_json: bool) -> None:
    """Count the live records by state and tool, and the calls by how they were answered."""
    with _opened(ledger_url) as store:
        found = store.records(namespace)
        counts = store.counts(namespace) if isinstance(store, CallCounts) else None
    by_state = Counter(r.state for r in found)
    by_tool: dict[str, Counter[State]] = {}
    for r in found:
        by_tool.setdefault(r.tool, Counter())[r.state] += 1
    answered: dict[str, Counter[str]] = {}
    for (tool, outcome), n in (counts or {}).items():
        answered.setdefault(tool, Counter())[outcome] += n
    duplicates = (
        None
        if counts is None
        else {o.value: sum(tc[o.value] for tc in answered.values()) for o in _DUPLICATES}
    )
    if as_json:
        _echo_json(
            {
                "namespace": namespace,
                "records": len(found),
                "by_state": {s.value: by_state[s] for s in State},
                "by_tool": {
                    t: {"records": sum(c.values()), "by_state": {s.value: c[s] for s in State}}
                    for t, c in sorted(by_tool.items())
                },
                "calls": None
                if counts is None
                else {t: dict(sorted(tc.items())) for t, tc in sorted(answered.items())},
                "duplicates_answered": None
                if duplicates is None
                else {**duplicates, "total": sum(duplicates.values())},
                "note": _NO_COUNTS if counts is None else _COUNTS_NOTE,
            }
        )
        return
    table = Table(box=box.SIMPLE_HEAD, show_footer=True)
    table.add_column("tool", footer="all tools", overflow="fold")
    for s in State:
        table.add_column(s.value, footer=str(by_state[s]), justify="right")
    table.add_column("records", footer=str(len(found)), justify="right")
    for t, c in sorted(by_tool.items()):
        table.add_row(_text(t), *(str(c[s]) for s in State), str(sum(c.values())))
    console = _Console(highlight=False)
    console.print(_text(f"namespace {namespace!r}: {len(found)} live records"), soft_wrap=True)
    console.print(table)
    if duplicates is None:
        console.print(_text(_NO_COUNTS), soft_wrap=True)
        return
    calls = Table(box=box.SIMPLE_HEAD, show_footer=True)
    calls.add_column("tool", footer="all tools", overflow="fold")
    totals: Counter[str] = Counter()
    for per_tool in answered.values():
        totals.update(per_tool)
    # The outcomes that happened, and always those of a first call and of its duplicates.
    shown = [o for o in Outcome if totals[o.value] or o is Outcome.EXECUTED or o in _DUPLICATES]
    for o in shown:
        calls.add_column(o.value, footer=str(totals[o.value]), justify="right")
    for t, per_tool in sorted(answered.items()):
        calls.add_row(_text(t), *(str(per_tool[o.value]) for o in shown))
    total = sum(duplicates.values())
    detail = ", ".join(f"{n} {name}" for name, n in duplicates.items())
    console.print(_text(f"calls by how they were answered: {sum(totals.values())}"), soft_wrap=True)
    console.print(calls)
    console.print(
        _text(f"duplicates answered without running again: {total} ({detail})"), soft_wrap=True
    )
    console.print(_text(_COUNTS_NOTE), soft_wrap=True)


# -- reconcile ----------------------------------------------------------------------------------


def _guard_of(value: Any) -> twiceshy.Guard | None:
    """The guard of a decorated tool, or the guard itself; ``None`` for anything else."""
    if isinstance(value, twiceshy.Guard):
        return value
    guard = getattr(value, "twiceshy", None)
    return guard if isinstance(guard, twiceshy.Guard) else None


def _load_target(target: str) -> list[twiceshy.Guard]:
    """The guards ``module:attribute`` names: a tool, a guard, or a list, tuple or dict of them.

    Raises:
        CommandError: the target cannot be imported, or names no protected tool.
    """
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise CommandError(f"{target!r} is not module:attribute (e.g. myapp.tools:charge)")
    # As `python -m` does: modules of the current directory can be named.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise CommandError(
            f"cannot import {module_name!r} (target {target}): {type(exc).__name__}: {exc}"
        ) from exc
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError as exc:
            raise CommandError(f"{target}: {module_name!r} has no attribute {attribute!r}") from exc
    items = list(value.values()) if isinstance(value, Mapping) else value
    if not isinstance(items, list | tuple):
        items = [value]
    guards = []
    for item in items:
        guard = _guard_of(item)
        if guard is None:
            raise CommandError(
                f"{target}: {item!r} is not a tool protected by twiceshy (nor a twiceshy.Guard)"
            )
        guards.append(guard)
    return guards


class _Asked:
    """A tool's reconciler, remembering whether it raised (the guard logs it and goes on)."""

    def __init__(self, reconcile: Callable[..., Any]) -> None:
        self.reconcile = reconcile
        self.error: BaseException | None = None

    def __call__(self, key: str, arguments: Mapping[str, Any] | None) -> Any:
        self.error = None
        try:
            answer = self.reconcile(key, arguments)
        except Exception as exc:
            self.error = exc
            raise
        if inspect.isawaitable(answer):
            return self._awaited(answer)
        return answer

    async def _awaited(self, answer: Awaitable[Any]) -> Any:
        try:
            return await answer
        except Exception as exc:
            self.error = exc
            raise


def _on(ledger: twiceshy.Ledger, guard: twiceshy.Guard, asked: _Asked) -> twiceshy.Guard:
    """The tool's guard on the command's ledger, asking ``asked`` (a new guard; same policy).

    The tool's own guard is bound to the ledger its module made, which need not be the one the
    command was given; settling uses only the policy (the tool's name, ttl and result codec) and
    the reconciler, so those are what is carried over.
    """
    return twiceshy.Guard(
        ledger,
        guard.policy,
        recorded=guard.recorded,
        reconcile=asked,
        scope=None,
        key_args=None,
        ignore_args=(),
    )


def _settled_as(after: Record | None, error: BaseException | None) -> str:
    if error is not None:
        return "error"
    if after is None:
        return "gone"
    return {
        State.SUCCEEDED: "succeeded",
        State.RELEASED: "released",
        State.UNKNOWN: "still unknown",
    }.get(after.state, f"now {after.state.value}")


@main.command()
@click.argument("targets", metavar="TARGET...", nargs=-1, required=True)
@_ledger_options
@click.option(
    "--dry-run", is_flag=True, help="Ask no reconciler; list the records it would ask about."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array, a row per record.")
def reconcile(
    targets: tuple[str, ...],
    ledger_url: str | None,
    namespace: str,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Ask the tools' reconcilers about their parked (unknown) records.

    Each TARGET is module:attribute (the module imported with the current directory on the
    path), naming a tool protected by twiceshy, a twiceshy.Guard, or a list, tuple or dict of
    them. For every tool with a reconcile= function, each of its unknown records is settled
    as the reconciler answers: succeeded, released, or still unknown when it cannot tell (or
    raised, reported as error).
    """
    guards: dict[str, tuple[twiceshy.Guard, str]] = {}
    for target in targets:
        found = [g for g in _load_target(target) if g.policy.reconcile]
        if not found:
            raise CommandError(f"{target} names no protected tool with a reconcile= function")
        for guard in found:
            guards.setdefault(guard.name, (guard, target))
    rows: list[dict[str, Any]] = []
    with _opened(ledger_url) as store:
        ledger = twiceshy.Ledger(store=store, namespace=namespace)
        for name, (guard, _) in guards.items():
            if guard._reconcile is None:  # policy.reconcile says it has one
                continue
            asked = _Asked(guard._reconcile)
            on_ledger = _on(ledger, guard, asked)
            for record in store.records(namespace, states=[State.UNKNOWN], tool=name):
                row: dict[str, Any] = {"key": record.key, "tool": name}
                if dry_run:
                    row.update(result="would ask", state=record.state.value, error=None)
                else:
                    after = on_ledger.settle(record.key)
                    # A reconciler's error may quote a URL of its provider's: hide its secrets.
                    row.update(
                        result=_settled_as(after, asked.error),
                        state=None if after is None else after.state.value,
                        error=None
                        if asked.error is None
                        else _hide_secrets(f"{type(asked.error).__name__}: {asked.error}"),
                    )
                rows.append(row)
    if as_json:
        _echo_json(rows)
        return
    tools = ", ".join(guards)
    if not rows:
        _echo(f"no unknown records of {tools} in namespace {namespace!r}")
        return
    width = _short_width([r["key"] for r in rows])
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("key", no_wrap=True)
    table.add_column("tool", overflow="fold")
    table.add_column("result")
    errors = any(r["error"] for r in rows)
    if errors:
        table.add_column("error", overflow="fold")
    styles = {"succeeded": "green", "released": "cyan", "error": "bold red"}
    for r in rows:
        cells = [
            _text(r["key"][:width]),
            _text(r["tool"]),
            _text(r["result"], style=styles.get(r["result"], "")),
        ]
        if errors:
            cells.append(_text(r["error"] or ""))
        table.add_row(*cells)
    console = _Console(highlight=False)
    console.print(table)
    what = "would ask about" if dry_run else "asked about"
    console.print(
        _text(f"{what} {len(rows)} unknown records of {tools} in namespace {namespace!r}"),
        soft_wrap=True,
    )
