"""``stats``: the live records counted by state and tool, and the calls by how they were answered.

The call counts come from stores that keep them (:class:`~twiceshy.stores.CallCounts`); each
process adds its counts every ``counts_interval`` and when its ledger closes, so they trail the
records a little. The duplicates are the calls answered without running again: replayed, joined
or waited. Beside how each call was answered, ``ran`` counts the calls that ran the tool: a call
that ran and lost its reply answers ``unknown``, and so do the retries that find its record.
"""

from __future__ import annotations

from collections import Counter
from typing import Final

import click
from rich import box
from rich.table import Table

from .._records import Outcome, State
from .._tally import RAN
from ..stores import CallCounts
from .ledger import opened
from .options import ledger_options
from .render import PipedConsole, echo_json, text

__all__ = ["stats"]

_NO_COUNTS: Final = "This ledger's store keeps no call counts."
_COUNTS_NOTE: Final = (
    "Each process adds its call counts every counts_interval (10 s by default) and when its "
    "ledger closes."
)
# Outcomes that answered a repeat of an intent without running it again.
_DUPLICATES: Final = (Outcome.REPLAYED, Outcome.JOINED, Outcome.WAITED)


@click.command()
@ledger_options
@click.option("--json", "as_json", is_flag=True, help="The counts as one JSON object.")
def stats(ledger_url: str | None, namespace: str, as_json: bool) -> None:
    """Count the live records by state and tool, and the calls by how they were answered.

    The ran column counts the calls that ran the tool, whatever they answered.
    """
    with opened(ledger_url) as store:
        found = store.records(namespace)
        counts = store.counts(namespace) if isinstance(store, CallCounts) else None
    by_state = Counter(r.state for r in found)
    by_tool: dict[str, Counter[State]] = {}
    for r in found:
        by_tool.setdefault(r.tool, Counter())[r.state] += 1
    answered: dict[str, Counter[str]] = {}
    ran: Counter[str] = Counter()
    for (tool, outcome), n in (counts or {}).items():
        if outcome == RAN:
            ran[tool] += n
        else:
            answered.setdefault(tool, Counter())[outcome] += n
    for tool in ran:
        answered.setdefault(tool, Counter())
    duplicates = (
        None
        if counts is None
        else {o.value: sum(tc[o.value] for tc in answered.values()) for o in _DUPLICATES}
    )
    if as_json:
        echo_json(
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
                "ran": None if counts is None else {t: ran[t] for t in sorted(answered)},
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
        table.add_row(text(t), *(str(c[s]) for s in State), str(sum(c.values())))
    console = PipedConsole(highlight=False)
    console.print(text(f"namespace {namespace!r}: {len(found)} live records"), soft_wrap=True)
    console.print(table)
    if duplicates is None:
        console.print(text(_NO_COUNTS), soft_wrap=True)
        return
    calls = Table(box=box.SIMPLE_HEAD, show_footer=True)
    calls.add_column("tool", footer="all tools", overflow="fold")
    calls.add_column(RAN, footer=str(sum(ran.values())), justify="right")
    totals: Counter[str] = Counter()
    for per_tool in answered.values():
        totals.update(per_tool)
    # The outcomes that happened, and always those of a first call and of its duplicates.
    shown = [o for o in Outcome if totals[o.value] or o is Outcome.EXECUTED or o in _DUPLICATES]
    for o in shown:
        calls.add_column(o.value, footer=str(totals[o.value]), justify="right")
    for t, per_tool in sorted(answered.items()):
        calls.add_row(text(t), str(ran[t]), *(str(per_tool[o.value]) for o in shown))
    total = sum(duplicates.values())
    detail = ", ".join(f"{n} {name}" for name, n in duplicates.items())
    console.print(text(f"calls by how they were answered: {sum(totals.values())}"), soft_wrap=True)
    console.print(calls)
    console.print(
        text(f"calls that ran the tool: {sum(ran.values())} (the ran column)"), soft_wrap=True
    )
    console.print(
        text(f"duplicates answered without running again: {total} ({detail})"), soft_wrap=True
    )
    console.print(text(_COUNTS_NOTE), soft_wrap=True)
