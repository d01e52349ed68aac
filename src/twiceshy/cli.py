"""The ``twiceshy`` command line (the ``cli`` extra: click and rich)."""

from __future__ import annotations

try:
    import click
    from rich.console import Console
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"the twiceshy command line needs the cli extra: pip install 'twiceshy[cli]' ({exc})"
    ) from exc

import twiceshy

from ._demo import run_demo

__all__ = ["main"]


@click.group()
@click.version_option(twiceshy.__version__, prog_name="twiceshy")
def main() -> None:
    """twiceshy: side-effecting tool calls of AI agents, safe to retry."""


@main.command()
@click.option(
    "--ledger",
    "ledger_url",
    metavar="URL",
    default=None,
    help="The ledger to use (memory://, sqlite:///path). Default: a fresh temporary SQLite file.",
)
def demo(ledger_url: str | None) -> None:
    """Re-enact a double charge, and twiceshy preventing it.

    Exits 0 when the story comes out as told: two charges for the plain retry loop, one for the
    KEYED tool, one for the UNSAFE tool.
    """
    try:
        result = run_demo(ledger_url, console=Console())
    except (ValueError, twiceshy.StoreError) as exc:
        which = repr(ledger_url) if ledger_url is not None else "(temporary)"
        raise click.ClickException(f"cannot use the ledger {which}: {exc}") from exc
    if not result.ok:
        raise SystemExit(1)
