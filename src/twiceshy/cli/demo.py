"""``demo``: the double charge this library exists for, re-enacted, and twiceshy preventing it.

The command checks the ledger as every command does, runs the three acts of
:mod:`twiceshy.cli.double_charge` and exits 0 only when the story comes out as told. The acts
(a payment provider double, an HTTP server) are imported when the command runs: the other
commands do not pay for them.
"""

from __future__ import annotations

import click

from .._redaction import redacted, scrubbed
from ..errors import StoreError
from .exits import LedgerUnavailable
from .ledger import open_ledger_store
from .render import PipedConsole

__all__ = ["demo"]


@click.command()
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
    from .double_charge import run_demo  # the demo's provider double is for this command only

    if ledger_url is not None:
        # Refuse a bad or unreachable ledger as every command does (exit 2 or 3), before the acts;
        # the demo may make a new ledger.
        open_ledger_store(ledger_url, create=True).close()
    try:
        result = run_demo(ledger_url, console=PipedConsole())
    except (ValueError, StoreError) as exc:
        which = redacted(ledger_url) if ledger_url is not None else "(temporary)"
        message = scrubbed(str(exc), ledger_url) if ledger_url is not None else str(exc)
        raise LedgerUnavailable(f"cannot use the ledger {which}: {message}") from exc
    if not result.ok:
        raise SystemExit(1)
