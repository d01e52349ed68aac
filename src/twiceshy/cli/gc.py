"""``gc``: remove the expired outcomes of a ledger; never a claimed or unknown record.

Expired outcomes are invisible to every read of the store protocol, so ``--dry-run`` asks the
store for them apart (:class:`~twiceshy.stores.ExpiredOutcomes`): how many a purge would remove
now, and with ``-v`` which. Redis drops expired outcomes by itself, so there gc often finds none.
"""

from __future__ import annotations

import click

from .._records import State
from ..stores import ExpiredOutcomes, Store
from .ledger import opened, store_now
from .options import ledger_options
from .render import echo, span

__all__ = ["gc"]


def _outcomes(n: int) -> str:
    return f"{n} expired outcome{'' if n == 1 else 's'}"


@click.command()
@ledger_options
@click.option("--dry-run", is_flag=True, help="Remove nothing; say what gc would remove.")
@click.option("-v", "--verbose", is_flag=True, help="With --dry-run, name each outcome's key.")
@click.option("--all-namespaces", is_flag=True, help="Remove expired outcomes of every namespace.")
def gc(
    ledger_url: str | None, namespace: str, dry_run: bool, verbose: bool, all_namespaces: bool
) -> None:
    """Remove expired outcomes; never a claimed or unknown record.

    Says how many outcomes were removed (with --dry-run, how many would be, and with -v which).
    Redis drops expired outcomes by itself, so there gc often finds none.
    """
    if verbose and not dry_run:
        raise click.UsageError("-v names what --dry-run would remove; add --dry-run")
    where = "every namespace" if all_namespaces else f"namespace {namespace!r}"
    if not dry_run:
        with opened(ledger_url) as store:
            removed = store.purge_expired(None if all_namespaces else namespace)
        echo(f"removed {_outcomes(removed)} from {where}")
        return
    with opened(ledger_url) as store:
        _dry_run(store, namespace, all_namespaces, verbose, where)


def _dry_run(store: Store, namespace: str, all_namespaces: bool, verbose: bool, where: str) -> None:
    """What gc would remove, and what it keeps, read from the store; nothing removed."""
    now = store_now(store, namespace)
    if isinstance(store, ExpiredOutcomes):
        expired = store.expired(None if all_namespaces else namespace)
        echo(f"dry run: nothing removed; gc would remove {_outcomes(len(expired))} from {where}")
        if verbose:
            for r in expired:
                shown = f"{r.namespace!r} " if all_namespaces else ""
                age = span(now - (r.expires_at if r.expires_at is not None else now))
                echo(f"  {shown}{r.key}  {r.tool}  {r.state.value}, expired {age} ago")
    else:
        echo(
            "dry run: nothing removed. This ledger's store cannot list expired outcomes, so "
            "only gc itself can count them."
        )
    if all_namespaces:
        return
    found = store.records(namespace)
    parked = [r for r in found if r.state in (State.CLAIMED, State.UNKNOWN)]
    expiries = [r.expires_at for r in found if r.expires_at is not None]
    echo(f"{where}: {len(parked)} claimed or unknown records, never removed by gc")
    if expiries:
        echo(
            f"{where}: {len(expiries)} outcomes within their retention; the next expires "
            f"in {span(min(expiries) - now)}"
        )
    else:
        echo(f"{where}: no outcome within its retention")
