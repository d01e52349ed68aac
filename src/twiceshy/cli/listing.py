"""``ls`` and ``show``: the ledger's live records as a table, and one record whole.

Both read the ledger only. ``ls`` finds records by state, tool and age (a key is a hash of scope,
tool and arguments, so there is no filter by scope); ``show`` takes a key or a unique prefix of
one. Under ``--json`` each prints every field (:mod:`twiceshy.cli.json_forms`).
"""

from __future__ import annotations

import json
from typing import Final

import click
from rich import box
from rich.highlighter import JSONHighlighter
from rich.table import Table
from rich.text import Text

from .._protocol import KEY_NOT_HANDED, LAPSED, MARK_THE_EFFECT
from .._records import Effect, Record, State
from ..errors import clearing
from .json_forms import error_of, record_json
from .ledger import find_record, lease_lapsed, opened, store_now
from .options import duration, ledger_options
from .render import (
    PipedConsole,
    echo,
    echo_json,
    iso,
    json_text,
    short_width,
    shortened,
    span,
    text,
    when,
)

__all__ = ["ls", "show"]

_NO_HISTORY: Final = "the ledger keeps a count of attempts, not a history of them"
_NO_ARGS: Final = "not kept (keep_args=False, or a record from before arguments were kept)"
_REASON_WIDTH: Final = 40  # characters of an unknown record's reason in ls; show has all of it
_STATE_STYLES: Final = {
    State.CLAIMED: "yellow",
    State.SUCCEEDED: "green",
    State.FAILED: "magenta",
    State.RELEASED: "cyan",
    State.UNKNOWN: "bold red",
}


def _state_text(record: Record, now: float) -> Text:
    """The record's state, coloured, and why it is unknown or that its lease lapsed."""
    label = record.state.value
    if record.state is State.CLAIMED and lease_lapsed(record, now):
        label += " (lease lapsed)"
    if record.state is State.UNKNOWN:
        # A lapse is not a crash: the owner may only have been paused, and may still act.
        label += " (a lapsed lease)" if record.reason == LAPSED else " (its owner's error)"
    return text(label, style=_STATE_STYLES[record.state])


def _way_out(record: Record) -> str:
    """How the tool itself can keep such a doubt from needing an operator next time."""
    reason = record.reason or ""
    if reason.endswith(KEY_NOT_HANDED):
        return (
            "Next time: the tool is KEYED but did not hand its idempotency key to its provider; "
            "pass twiceshy.current_key() as the provider's idempotency key (or send through a "
            "twiceshy HTTP transport), and its retries are then safe."
        )
    if record.effect is Effect.UNSAFE and reason != LAPSED and not reason.startswith(_CUT_SHORT):
        return f"Next time: {MARK_THE_EFFECT}."
    return ""


_CUT_SHORT: Final = "interrupted by "
"""How the reason of an attempt cut short begins: no error of the tool's own to say more of."""


def _reason_text(record: Record) -> Text:
    """Why an unknown record is unknown, on one line and shortened; nothing for the rest."""
    if record.state is not State.UNKNOWN or record.reason is None:
        return Text("")
    return shortened(record.reason, _REASON_WIDTH)


@click.command("ls")
@ledger_options
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
    callback=duration,
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

    An unknown record's reason is shown shortened; ``show KEY`` gives it whole.

    Records are found by key, tool, state and age. They do not keep the scope (run id) of the
    call: a key is a hash of scope, tool and arguments, so there is no --scope filter.
    """
    with opened(ledger_url) as store:
        now = store_now(store, namespace)
        found = store.records(
            namespace,
            states=[State(s) for s in states] if states else None,
            tool=tool,
            limit=limit,
        )
    if since is not None:
        found = [r for r in found if r.created_at >= now - since]
    if as_json:
        echo_json([record_json(r, now) for r in found])
        return
    if not found:
        echo(f"no records in namespace {namespace!r}")
        return
    width = short_width([r.key for r in found])
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("key", no_wrap=True)
    table.add_column("tool", overflow="fold")
    table.add_column("effect")
    table.add_column("state")
    table.add_column("age", justify="right")
    table.add_column("attempts", justify="right")
    table.add_column("fence", justify="right")
    table.add_column("reason", no_wrap=True)
    for r in found:
        table.add_row(
            text(r.key[:width]),
            text(r.tool),
            text(r.effect.value),
            _state_text(r, now),
            text(span(now - r.created_at)),
            text(str(r.attempts)),
            text(str(r.fence)),
            _reason_text(r),
        )
    console = PipedConsole(highlight=False)
    console.print(table)
    plural = "" if len(found) == 1 else "s"
    console.print(text(f"{len(found)} record{plural} in namespace {namespace!r}"), soft_wrap=True)


def _print_json(console: PipedConsole, stored: str) -> None:
    """A stored JSON text, pretty-printed; a text that is not JSON, as it is (both escaped)."""
    try:
        data = json.loads(stored)
    except (ValueError, RecursionError):
        console.print(text(stored, lines=True))
        return
    # rich's JSON would dump it again, C1 controls raw: highlight the escaped text.
    pretty = JSONHighlighter()(json_text(data))
    pretty.no_wrap, pretty.overflow = True, None
    console.print(pretty)


@click.command()
@ledger_options
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The record as one JSON object.")
def show(ledger_url: str | None, namespace: str, key: str, as_json: bool) -> None:
    """Show one whole record: KEY, or a unique prefix of it, with the arguments it kept."""
    with opened(ledger_url) as store:
        record, now = find_record(store, namespace, key)
    if as_json:
        echo_json(record_json(record, now))
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")

    def row(label: str, value: Text | str, *, lines: bool = False) -> None:
        grid.add_row(label, value if isinstance(value, Text) else text(value, lines=lines))

    row("key", record.key)
    row("namespace", repr(record.namespace))
    row("fingerprint", record.fingerprint)
    row("tool", record.tool)
    row("effect", record.effect.value)
    row("state", _state_text(record, now))
    row("fence", str(record.fence))
    row("owner", record.owner)
    if record.lease_deadline is not None:
        status = "lapsed" if lease_lapsed(record, now) else "live"
        row("lease", f"{status}, deadline {when(record.lease_deadline, now)}")
    else:
        row("lease", "-")
    row("attempts", f"{record.attempts} ({_NO_HISTORY})")
    error = error_of(record.error)
    if error is not None:
        message = f"{error['type']}: {error['message']}" if error["type"] else error["message"]
        row("error", message, lines=True)
    if record.reason is not None:
        row("reason", record.reason, lines=True)
    row("created", when(record.created_at, now))
    row("updated", when(record.updated_at, now))
    row("expires", when(record.expires_at, now) if record.expires_at is not None else "never")
    if record.args is None:
        row("arguments", _NO_ARGS)
    console = PipedConsole(highlight=False)
    console.print(grid)
    if record.args is not None:
        console.print(text("arguments", style="bold"))
        _print_json(console, record.args)
    if record.result is not None:
        console.print(text("result", style="bold"))
        _print_json(console, record.result)
    if record.state is State.UNKNOWN:
        if record.reason == LAPSED:
            console.print(
                text(
                    f"Marked unknown when its owner's lease lapsed, at {iso(record.updated_at)}: "
                    "the owner may only have been paused and may still take effect; check the "
                    "provider once more before releasing it."
                )
            )
        console.print(text(clearing(record.key)))
        way_out = _way_out(record)
        if way_out:
            console.print(text(way_out))
