"""``resolve``: an operator settles a parked record, as a reconciler would.

Only an unknown record can be resolved (with ``--force``, also a claimed record whose lease has
lapsed on the store's clock), and only into the states the protocol's transitions let a
reconciler write. The write is one fenced :class:`~twiceshy.Change`: when the record changed
since it was read, nothing is written and the command fails.
"""

from __future__ import annotations

import json
from typing import Any, Final, NoReturn

import click

from .._codec import ResultCodec
from .._protocol import LAPSED
from .._records import Change, Record, State
from .._rules import TRANSITIONS, Actor
from ..errors import ResultNotStorable
from .exits import CommandError
from .ledger import find_record, opened
from .options import duration, ledger_options
from .render import echo, iso, span

__all__ = ["RESOLVE_ERROR_TYPE", "resolve"]

RESOLVE_ERROR_TYPE: Final = "twiceshy.resolve"
"""The error type recorded by ``resolve --failed`` (replayed as ``ReplayedError``)."""


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
            f"{span(now - record.updated_at)} ago: a lapse is not a crash, and a paused owner "
            "may still take effect, which the provider may not show yet. Check again after "
            f"{iso(record.updated_at + grace)} (--grace), or use --force"
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
                else f"its lease is live for {span((deadline or now) - now)}"
            )
            raise CommandError(
                f"refused: the record {record.key} is claimed ({lease}); an owner may still "
                "be running the call. Use --force to resolve a claimed record whose lease lapsed"
            )
        if not lapsed:
            left = f" for {span(deadline - now)}" if deadline is not None else ""
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


@click.command()
@ledger_options
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
    callback=duration,
    default="60s",
    show_default=True,
    metavar="DURATION",
    help="How long after a lapse marked a record unknown --released is refused (the owner may "
    "only be paused).",
)
@click.option(
    "--ttl",
    callback=duration,
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
    with opened(ledger_url) as store:
        record, now = find_record(store, namespace, key)
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
    echo(
        f"resolved {after.key}: {record.state.value} -> {after.state.value} "
        f"(tool {after.tool}, fence {after.fence}); kept until {iso(after.expires_at)}"
    )
    if after.result is not None:
        echo(f"result: {after.result}")
    if message is not None:
        echo(f"error: {RESOLVE_ERROR_TYPE}: {message}")
