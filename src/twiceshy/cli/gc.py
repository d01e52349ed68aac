"""``gc``: remove the expired outcomes of a ledger; never a claimed or unknown record.

Expired outcomes are already invisible to every read, so only the removal itself can count them:
``--dry-run`` says what gc keeps instead. Redis drops expired outcomes by itself, so there gc
often finds none.
"""

from __future__ import annotations

import click

from .._records import State
from .ledger import opened, store_now
from .options import ledger_options
from .render import echo, span

__all__ = ["gc"]


@click.command()
@ledger_options
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
        with opened(ledger_url) as store:
            removed = store.purge_expired(None if all_namespaces else namespace)
        plural = "" if removed == 1 else "s"
        echo(f"removed {removed} expired outcome{plural} from {where}")
        return
    with opened(ledger_url) as store:
        now = store_now(store, namespace)
        found = store.records(namespace)
    parked = [r for r in found if r.state in (State.CLAIMED, State.UNKNOWN)]
    expiries = [r.expires_at for r in found if r.expires_at is not None]
    echo(
        "dry run: nothing removed. Expired outcomes are already invisible to every read, so "
        "only gc itself can count them."
    )
    echo(f"{where}: {len(parked)} claimed or unknown records, never removed by gc")
    if expiries:
        echo(
            f"{where}: {len(expiries)} outcomes within their retention; the next expires "
            f"in {span(min(expiries) - now)}"
        )
    else:
        echo(f"{where}: no outcome within its retention")
