"""``reconcile``: ask the tools' reconcilers about their parked (unknown) records.

Each target is ``module:attribute``, imported as ``python -m`` would (the current directory on
the path), naming a protected tool, a :class:`~twiceshy.Guard`, or a list, tuple or dict of them.
Each unknown record of a tool with a ``reconcile=`` function is settled through a guard on the
command's ledger, as the reconciler answers: succeeded, released, or still unknown when it cannot
tell (or raised, reported as an error with its secrets hidden).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import click
from rich import box
from rich.table import Table

import twiceshy

from .._records import Record, State
from .._redaction import hide_secrets
from .exits import CommandError
from .ledger import opened
from .options import ledger_options
from .render import PipedConsole, echo, echo_json, short_width, text

__all__ = ["reconcile"]


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


@click.command()
@click.argument("targets", metavar="TARGET...", nargs=-1, required=True)
@ledger_options
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
    with opened(ledger_url) as store:
        ledger = twiceshy.Ledger(store=store, namespace=namespace)
        for name, (guard, _) in guards.items():
            if guard.reconciler is None:  # policy.reconcile says it has one
                continue
            asked = _Asked(guard.reconciler)
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
                        else hide_secrets(f"{type(asked.error).__name__}: {asked.error}"),
                    )
                rows.append(row)
    if as_json:
        echo_json(rows)
        return
    tools = ", ".join(guards)
    if not rows:
        echo(f"no unknown records of {tools} in namespace {namespace!r}")
        return
    width = short_width([r["key"] for r in rows])
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
            text(r["key"][:width]),
            text(r["tool"]),
            text(r["result"], style=styles.get(r["result"], "")),
        ]
        if errors:
            cells.append(text(r["error"] or ""))
        table.add_row(*cells)
    console = PipedConsole(highlight=False)
    console.print(table)
    what = "would ask about" if dry_run else "asked about"
    console.print(
        text(f"{what} {len(rows)} unknown records of {tools} in namespace {namespace!r}"),
        soft_wrap=True,
    )
