"""What runs in the campaign's child processes, the provider double, and the verdict on a trial.

Every child appends what it sees to one events file per trial, one JSON object a line written
with a single ``write`` on an ``O_APPEND`` descriptor, so a process killed with SIGKILL cannot
hide what it did before: ``start`` (the tool began: its claim was acknowledged), ``req`` (the
provider double was asked, with the key), ``effect`` (the provider double took effect) and
``answer`` (what a call answered, with how long it took). :func:`verdict` reads the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import twiceshy

# The families of answers a call can give; the protocol allows each only in some states.
STORE = "store"  # StoreError and its subclasses: the ledger failed or could not be reached


def append(log: str, **event: Any) -> None:
    """Append one event; one write on O_APPEND, atomic between processes for lines this short."""
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def events(log: str | Path) -> list[dict[str, Any]]:
    """Every event of a trial, in the order they were written."""
    try:
        text = Path(log).read_text()
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # a line cut by a full disk is not an event
            found.append(json.loads(line))
    return found


def _provided(log: str, key: str) -> Any:
    """The result the provider double recorded under ``key``, or None."""
    try:
        text = Path(log).read_text()
    except FileNotFoundError:
        return None
    needle = f'"effect_key":"{key}"'
    for line in text.splitlines():
        if needle in line:
            return json.loads(line)["result"]
    return None


def provider(log: str, intent: str, kind: str, key: str) -> Any:
    """The provider double: a KEYED call with a key it has seen takes no new effect."""
    append(log, ev="req", intent=intent, key=key, pid=os.getpid())
    if kind == "KEYED":
        seen = _provided(log, key)
        if seen is not None:
            return seen
    result = {"intent": intent, "by": os.getpid(), "at": time.time_ns()}
    append(log, ev="effect", intent=intent, effect_key=key, result=result)
    return result


def _reconciler(log: str) -> Any:
    """A reconciler that asks the provider double, which is authoritative."""

    def reconcile(key: str, args: Any) -> Any:
        seen = _provided(log, key)
        return twiceshy.DidNotHappen() if seen is None else twiceshy.Happened(seen)

    return reconcile


class _Points:
    """Where a child tells its parent it has reached a protocol point, and waits to go on."""

    def __init__(self, tx: Any, go: Any, stops: Iterable[tuple[int, str]]) -> None:
        self.tx, self.go = tx, go
        self.stops = set(stops)
        self.call = -1

    def reach(self, point: str) -> None:
        if (self.call, point) not in self.stops:
            return
        self.tx.send(("at", self.call, point))
        # Bounded: a parent that meant to kill this process has done so long before.
        if self.go.poll(60):
            self.go.recv()


def intent_of(scope: str, kind: str, n: int) -> str:
    """The name a trial gives an intent in its events."""
    return f"{scope}/{kind}/{n}"


def _tools(ledger: twiceshy.Ledger, spec: dict[str, Any], points: _Points | None) -> dict:  # type: ignore[type-arg]
    log, ponr = spec["log"], spec.get("ponr", False)
    pad = "x" * spec.get("result_bytes", 0)
    reconcile = _reconciler(log) if spec.get("reconcile") else None
    tools = {}
    for kind in ("UNSAFE", "KEYED"):

        def body(n: int, scope: str, kind: str = kind) -> dict[str, Any]:
            intent = intent_of(scope, kind, n)
            key = twiceshy.current_key()
            append(log, ev="start", intent=intent, key=key, pid=os.getpid())
            if points:
                points.reach("after-claim")
            if ponr:
                twiceshy.point_of_no_return()
            if points:
                points.reach("before-effect")
            result = provider(log, intent, kind, key or "")
            if points:
                points.reach("after-effect")
            return {**result, "pad": pad} if pad else result

        tools[kind] = ledger.tool(
            effect=getattr(twiceshy, kind),
            name=f"charge_{kind.lower()}",
            lease=spec["lease"],
            wait=spec["wait"],
            effect_at="mark" if ponr else None,
            reconcile=reconcile,
        )(body)
    return tools


def _call(tools: dict, spec: dict[str, Any], call: dict[str, Any], who: str) -> None:  # type: ignore[type-arg]
    scope, kind, n = call["scope"], call["kind"], call["n"]
    started = time.monotonic()
    try:
        with twiceshy.run(scope):
            result = tools[kind](n, scope)
        answer: list[Any] = ["ok", result]
    except Exception as exc:
        family = STORE if isinstance(exc, twiceshy.StoreError) else type(exc).__name__
        answer = ["err", family, type(exc).__name__, str(exc)[:200]]
    append(
        spec["log"],
        ev="answer",
        intent=intent_of(scope, kind, n),
        phase=spec["phase"],
        answer=answer,
        secs=round(time.monotonic() - started, 3),
        who=who,
    )


def child(spec: dict[str, Any], tx: Any, go: Any, barrier: Any = None) -> None:
    """A child process: open the ledger, say ready, wait for go if asked, make the calls.

    ``spec``: ``url``, ``log``, ``phase``, ``lease``, ``wait``, ``calls`` (each ``scope``,
    ``kind``, ``n``), and optionally ``stops`` (``[call index, point]`` pairs to stop at),
    ``hold`` (wait for go before the calls), ``ponr``, ``reconcile``, ``result_bytes``,
    ``pause`` (seconds between calls), ``rounds`` with a ``barrier`` (racers), ``threads``
    (racing threads in this one process), ``forever`` (new intents until killed, bounded).
    """
    # The drivers' and twiceshy's warnings go to a file beside the events, not the table.
    logging.basicConfig(filename=spec["log"] + ".log", level=logging.WARNING, force=True)
    points = _Points(tx, go, [tuple(s) for s in spec.get("stops", [])])
    try:
        ledger = twiceshy.Ledger(spec["url"], counts_interval=None)
        tools = _tools(ledger, spec, points)
    except Exception as exc:
        tx.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    tx.send(("ready",))
    if spec.get("hold") and go.poll(60):
        go.recv()
    if spec.get("threads"):
        _threads(tools, spec)
    elif spec.get("rounds"):
        for calls in spec["rounds"]:
            barrier.wait(60)
            for call in calls:
                _call(tools, spec, call, str(os.getpid()))
    elif spec.get("forever"):
        deadline = time.monotonic() + spec["forever"]
        n = 0
        while time.monotonic() < deadline and n < 100_000:
            kind = ("UNSAFE", "KEYED")[n % 2]
            _call(tools, spec, {"scope": spec["scope"], "kind": kind, "n": n}, str(os.getpid()))
            n += 1
            time.sleep(spec.get("pause", 0))
    else:
        for index, call in enumerate(spec["calls"]):
            points.call = index
            _call(tools, spec, call, str(os.getpid()))
            points.reach("after-record")
            if spec.get("pause"):
                time.sleep(spec["pause"])
    ledger.close()
    tx.send(("done",))


def _threads(tools: dict, spec: dict[str, Any]) -> None:  # type: ignore[type-arg]
    """Racing threads of one process, for the memory store, which one process holds."""
    barrier = threading.Barrier(spec["threads"])

    def racer(i: int) -> None:
        for calls in spec["rounds"]:
            barrier.wait(60)
            for call in calls:
                _call(tools, spec, call, f"{os.getpid()}:{i}")

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(spec["threads"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)


@dataclass
class Tally:
    """What one fault against one store came to."""

    trials: int = 0
    calls: int = 0
    duplicates: int = 0
    lost: int = 0
    hung: int = 0
    wrong: int = 0
    unknowns: int = 0  # OutcomeUnknown answers the row allowed
    allowance: str = ""  # why the row allows OutcomeUnknown ("": it does not)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        """Add another tally's counts (and a few of its notes) to this one."""
        self.trials += other.trials
        self.calls += other.calls
        self.duplicates += other.duplicates
        self.lost += other.lost
        self.hung += other.hung
        self.wrong += other.wrong
        self.unknowns += other.unknowns
        self.allowance = self.allowance or other.allowance
        self.notes += other.notes[: max(0, 6 - len(self.notes))]

    @property
    def failed(self) -> bool:
        """Whether anything the protocol does not allow was seen."""
        return bool(self.duplicates or self.lost or self.hung or self.wrong)


def verdict(
    log: str | Path,
    *,
    fault_allows: frozenset[str] = frozenset(),
    releases: bool = False,
    hung_after: float = 30.0,
    unknown: str | None = None,
    trial: str = "",
) -> Tally:
    """Judge a trial by its events.

    A duplicate is an intent the provider double took effect for more than once: for an UNSAFE
    tool, two runs of its effect; for a KEYED one, two effects the provider executed (it dedups
    by key, so a second effect means a second key reached it, or a call ran past its key).

    Args:
        log: the trial's events file.
        fault_allows: the error families a call may answer while the fault lasts (phase
            "fault"), besides a result. After the fault (phase "final") nothing else is allowed.
        releases: a reconciler may release an UNSAFE intent, so a second start is no lost
            claim by itself (a second effect still is a duplicate).
        hung_after: a call answered later than this many seconds counts as hung.
        unknown: why ``OutcomeUnknown`` may answer an UNSAFE call in this row (an owner died
            or lost its outcome write); None: it may not, and each one counts as wrong.
        trial: named in the notes.
    """
    tally = Tally(allowance=unknown or "")
    by_intent: dict[str, list[dict[str, Any]]] = {}
    for event in events(log):
        if "intent" in event:
            by_intent.setdefault(event["intent"], []).append(event)
    for intent, seen in by_intent.items():
        kind = intent.split("/")[-2]
        effects = [e for e in seen if e["ev"] == "effect"]
        if len(effects) > 1:
            keys = {e["effect_key"] for e in effects}
            tally.duplicates += 1
            tally.notes.append(
                f"{trial} {intent}: the provider took effect {len(effects)} times "
                f"({len(keys)} key(s))"
            )
        acknowledged: Any = None  # the first result a caller was given
        starts = 0
        for event in seen:
            if event["ev"] == "start":
                starts += 1
                if acknowledged is not None or (kind == "UNSAFE" and starts > 1 and not releases):
                    tally.lost += 1
                    what = "result" if acknowledged is not None else "claim"
                    tally.notes.append(
                        f"{trial} {intent}: ran again (start {starts}) after its {what} was "
                        "acknowledged"
                    )
            if event["ev"] != "answer":
                continue
            tally.calls += 1
            answer = event["answer"]
            if event["secs"] > hung_after:
                tally.hung += 1
                tally.notes.append(f"{trial} {intent}: answered after {event['secs']} s")
            if answer[0] == "ok":
                if acknowledged is None:
                    acknowledged = answer[1]
                elif answer[1] != acknowledged:
                    tally.lost += 1
                    tally.notes.append(f"{trial} {intent}: another result than the first")
                continue
            family = answer[1]
            if acknowledged is not None and family != STORE:
                tally.lost += 1
                tally.notes.append(f"{trial} {intent}: {answer[2]} after a result was given")
                continue
            if family == "OutcomeUnknown" and kind == "UNSAFE" and unknown is not None:
                tally.unknowns += 1
                continue
            if event["phase"] == "fault" and family in fault_allows:
                continue
            tally.wrong += 1
            tally.notes.append(f"{trial} {intent} ({event['phase']}): {answer[2]}: {answer[3]}")
    return tally


def self_check(work: Path) -> list[str]:
    """Feed :func:`verdict` trials it must fail, and say which it passed (none, or the checks
    are blind): a KEYED intent the provider executed twice, an OutcomeUnknown in a row that
    allows none, a result replayed differently, and an UNSAFE tool started again after its
    claim was acknowledged."""
    cases: dict[str, list[dict[str, Any]]] = {
        "KEYED effect twice": [
            {"ev": "effect", "intent": "s/KEYED/0", "effect_key": "k", "result": 1},
            {"ev": "effect", "intent": "s/KEYED/0", "effect_key": "k", "result": 2},
        ],
        "OutcomeUnknown not allowed": [
            {"ev": "answer", "intent": "s/UNSAFE/0", "phase": "final", "secs": 0.1,
             "answer": ["err", "OutcomeUnknown", "OutcomeUnknown", ""]},
        ],
        "another result replayed": [
            {"ev": "answer", "intent": "s/KEYED/0", "phase": "final", "secs": 0.1,
             "answer": ["ok", 1]},
            {"ev": "answer", "intent": "s/KEYED/0", "phase": "final", "secs": 0.1,
             "answer": ["ok", 2]},
        ],
        "UNSAFE started twice": [
            {"ev": "start", "intent": "s/UNSAFE/0", "key": "k", "pid": 1},
            {"ev": "start", "intent": "s/UNSAFE/0", "key": "k", "pid": 2},
        ],
    }  # fmt: skip
    blind: list[str] = []
    for name, lines in cases.items():
        log = work / f"self-check-{len(blind)}-{abs(hash(name))}.jsonl"
        for line in lines:
            append(str(log), **line)
        if not verdict(log).failed:
            blind.append(name)
        log.unlink()
    return blind
