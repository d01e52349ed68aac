"""A runner that plays twiceshy's protocol against a script of the commands it must yield.

A script is a list of steps. A command step (``now``, ``claim``, ``write``, ``run``, ``wait``,
``note``, ``sleep``, ``reconcile``) names the command the protocol must yield next, what its
fields must be, and how it is answered; a step in between (``tick``, ``elsewhere``) moves the
store's clock or lets another actor write, before the next command is answered. Claims, writes
and waits are answered from a model record under the reference semantics of stores
(``guard_holds``, ``apply_change``), so a script's answers are consistent by construction. The
runner checks what holds of every call whatever the script: each write the protocol yields is
allowed by ``TRANSITIONS`` for the actor it writes as, and for the tool's effect class; the tool
runs only under a live CLAIMED record this call owns; an UNSAFE tool runs at most once under a
fence (and the table checks keep an UNSAFE intent from a new fence unless it was RELEASED).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

import pytest

from twiceshy._codec import ResultCodec
from twiceshy._protocol import (
    CallPlan,
    Claim,
    Command,
    Commands,
    Note,
    Now,
    Policy,
    Ran,
    Reconcile,
    Run,
    Sleep,
    Wait,
    Write,
    exponential_backoff,
    protect,
)
from twiceshy._records import (
    Change,
    Effect,
    Outcome,
    Record,
    Snapshot,
    State,
    apply_change,
    guard_holds,
    is_live,
    new_claim,
)
from twiceshy._rules import TRANSITIONS, Actor

T0: Final = 1_700_000_000.0
"""The store's clock when a script starts (seconds since the epoch)."""
OWNER: Final = "owner-of-this-call"
OTHER: Final = "another-caller"
KEY: Final = "5e" * 32
FINGERPRINT: Final = "f1" * 32
LEASE: Final = 30.0
TRUST: Final = LEASE / 2
"""How long a fresh claim's lease is trusted, from when the claim was sent."""


class Declined(Exception):
    """A certain failure: the policies below list it as ``definite=``."""


def policy(effect: Effect, **changes: Any) -> Policy:
    """A tool's policy: a 30 s lease, wait 10 s, a day's ttl, 3 attempts (UNSAFE: 1), a
    backoff of 0.1 s doubling with no jitter, ``Declined`` definite; ``changes`` replace any."""
    fields: dict[str, Any] = {
        "tool": "charge",
        "effect": effect,
        "lease": LEASE,
        "wait": 10.0,
        "ttl": 86_400.0,
        "attempts": 1 if effect is Effect.UNSAFE else 3,
        "backoff": exponential_backoff(0.1, 2.0, jitter=False),
        "definite": (Declined,),
        "not_applied": (),
        "codec": ResultCodec(),
        "reconcile": False,
    }
    fields.update(changes)
    return Policy(**fields)


def plan(effect: Effect, **changes: Any) -> CallPlan:
    """One call of a tool with :func:`policy` (``changes`` go to the policy), owned by OWNER."""
    return CallPlan(
        policy(effect, **changes),
        namespace="tests",
        key=KEY,
        fingerprint=FINGERPRINT,
        owner=OWNER,
    )


def stored(call: CallPlan, state: State, **fields: Any) -> Record:
    """A record of the call's key already in the store: another caller's, fence 1, made a
    minute before T0; a CLAIMED one lapses at T0 + 20. ``fields`` replace any."""
    record = new_claim(
        call.namespace,
        call.key,
        fingerprint=call.fingerprint,
        tool=call.policy.tool,
        effect=call.policy.effect,
        owner=OTHER,
        lease=80.0,
        now=T0 - 60.0,
    )
    if state is not State.CLAIMED:
        record = dataclasses.replace(record, state=state, lease_deadline=None)
    return dataclasses.replace(record, **fields)


def states(*members: State) -> frozenset[State]:
    """A ``from_states`` value."""
    return frozenset(members)


def actor_of(change: Change) -> Actor:
    """Who a write is written as: the owner names its token; a caller claims (a new owner, or
    a lapsed lease); a reconciler does neither."""
    if change.owner is not None:
        return Actor.OWNER
    if change.new_owner is not None or change.lapsed:
        return Actor.CALLER
    return Actor.RECONCILER


# -- steps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """A command the protocol must yield next, the fields it must have, and its answer."""

    kind: type
    fields: dict[str, Any]
    respond: Callable[[Script, Any], Any] = field(repr=False)

    def __str__(self) -> str:
        said = ", ".join(f"{name}={value!r}" for name, value in self.fields.items())
        return f"{self.kind.__name__}({said})"


@dataclass(frozen=True)
class Meanwhile:
    """Something that happens between two commands: the store's clock moves, or another actor
    writes."""

    what: str
    apply: Callable[[Script], None] = field(repr=False)

    def __str__(self) -> str:
        return self.what


Step = Expect | Meanwhile


def now(monotonic: float = 0.0) -> Expect:
    """``Now``, answered with this monotonic time."""
    return Expect(Now, {}, lambda script, command: monotonic)


def claim() -> Expect:
    """``Claim``, answered by the model: an insert when it holds no live record."""
    return Expect(Claim, {}, lambda script, command: script.answer_claim())


def write(to: State, *, won: bool = True, **fields: Any) -> Expect:
    """``Write`` of a change to ``to`` with these fields; the model must apply it (``won``) or
    refuse it, and answers the record as it then is."""
    return Expect(
        Write, {"to": to, **fields}, lambda script, command: script.answer_write(command, won)
    )


def run(ran: Ran, **fields: Any) -> Expect:
    """``Run`` (``fence=``, ``attempt=``, ``trusted_until=`` as given), answered with ``ran``."""
    return Expect(Run, fields, lambda script, command: script.answer_run(command, ran))


def wait(timeout: float, *, elapsed: float = 0.0, **fields: Any) -> Expect:
    """``Wait`` of ``timeout`` seconds; the store's clock moves ``elapsed``, and the model
    answers the record as it then is."""
    return Expect(
        Wait,
        {"timeout": timeout, **fields},
        lambda script, command: script.answer_wait(command, elapsed),
    )


def note(outcome: Outcome) -> Expect:
    """``Note(outcome)``."""
    return Expect(Note, {"outcome": outcome}, lambda script, command: None)


def sleep(seconds: float, *, interrupted: BaseException | None = None) -> Expect:
    """``Sleep(seconds)``, cut short by ``interrupted`` when given."""
    return Expect(Sleep, {"seconds": seconds}, lambda script, command: interrupted)


def reconcile(answer: object) -> Expect:
    """``Reconcile``, answered with the reconciler's ``answer``."""
    return Expect(Reconcile, {}, lambda script, command: answer)


def tick(seconds: float) -> Meanwhile:
    """The store's clock moves on."""
    return Meanwhile(f"tick({seconds})", lambda script: script.tick(seconds))


def elsewhere(change: Change, *, by: Actor | None = None) -> Meanwhile:
    """Another actor's write (``by``, else as :func:`actor_of` reads it), which the table
    must allow and which must apply to the model record."""
    return Meanwhile(f"elsewhere({change})", lambda script: script.apply_elsewhere(change, by))


# -- the runner ----------------------------------------------------------------------------


class Script:
    """Plays a protocol against steps, answering store commands from a model record.

    Attributes:
        plan: the call (``None`` for a SAFE tool kept out of the ledger: no store commands).
        record: the model record, as the store holds it (past its retention included).
        now: the store's clock.
        commands: every command the protocol yielded, in order.
    """

    def __init__(self, call: CallPlan | None, record: Record | None = None) -> None:
        self.plan = call
        self.record = record
        self.now = T0
        self.commands: list[Command] = []
        self._seen: Snapshot | None = None  # the last snapshot the protocol was answered
        self._fences: set[int] = set()  # the fences the tool ran under

    @property
    def changes(self) -> list[Change]:
        """The writes the protocol yielded, in order."""
        return [command.change for command in self.commands if isinstance(command, Write)]

    @property
    def runs(self) -> list[Run]:
        """The runs the protocol yielded, in order."""
        return [command for command in self.commands if isinstance(command, Run)]

    def play(self, steps: Sequence[Step], protocol: Commands | None = None) -> Any:
        """Play ``protocol`` (by default ``protect(plan)``) through ``steps``: what it returns,
        or what it raises once every step was taken."""
        __tracebackhide__ = True
        if protocol is None:
            assert self.plan is not None
            protocol = protect(self.plan)
        pending = list(steps)
        answer: Any = None
        try:
            while True:
                try:
                    command = protocol.send(answer)
                except StopIteration as stop:
                    self._ended(pending, f"returned {stop.value!r}")
                    return stop.value
                except BaseException as exc:
                    self._ended(pending, f"raised {exc!r}")
                    raise
                self.commands.append(command)
                answer = self._answer(pending, command)
        finally:
            protocol.close()

    # -- answering ---------------------------------------------------------------------

    def _answer(self, pending: list[Step], command: Command) -> Any:
        __tracebackhide__ = True
        self._between(pending)
        if not pending:
            self._fail(f"the script has ended, and the protocol yielded {command!r}")
        step = pending.pop(0)
        assert isinstance(step, Expect)
        if type(command) is not step.kind:
            self._fail(f"expected {step}, the protocol yielded {command!r}")
        subject = command.change if isinstance(command, Write) else command
        for name, want in step.fields.items():
            got = getattr(subject, name)
            if got != want:
                self._fail(f"expected {step}, but its {name} is {got!r} in {command!r}")
        return step.respond(self, command)

    def _between(self, pending: list[Step]) -> None:
        while pending and isinstance(step := pending[0], Meanwhile):
            pending.pop(0)
            step.apply(self)

    def _ended(self, pending: list[Step], how: str) -> None:
        self._between(pending)
        if pending:
            self._fail(f"the protocol {how} before {pending[0]}")

    def _fail(self, message: str) -> NoReturn:
        __tracebackhide__ = True
        history = "".join(f"\n  {command!r}" for command in self.commands)
        pytest.fail(f"{message}\nthe commands so far:{history}\nthe model record: {self.record}")

    def _snap(self, record: Record | None, won: bool) -> Snapshot:
        self._seen = Snapshot(record, self.now, won)
        return self._seen

    def _live(self) -> Record | None:
        record = self.record
        return record if record is not None and is_live(record, self.now) else None

    def _call(self) -> CallPlan:
        if self.plan is None:
            self._fail("a call kept out of the ledger yielded a store command")
        return self.plan

    def answer_claim(self) -> Snapshot:
        """As a store claims: an insert when no record is live (fence 1, or the expired
        record's fence + 1); else the record, won only when this call owns its claim."""
        call = self._call()
        live = self._live()
        if live is not None:
            return self._snap(live, live.state is State.CLAIMED and live.owner == call.owner)
        self.record = new_claim(
            call.namespace,
            call.key,
            fingerprint=call.fingerprint,
            tool=call.policy.tool,
            effect=call.policy.effect,
            owner=call.owner,
            lease=call.policy.lease,
            now=self.now,
            fence=self.record.fence + 1 if self.record is not None else 1,
        )
        return self._snap(self.record, True)

    def answer_write(self, command: Write, won: bool) -> Snapshot:
        """As a store writes, after checking the write against the table and the call."""
        call = self._call()
        change = command.change
        actor = actor_of(change)
        if actor is Actor.RECONCILER and not (
            len(self.commands) > 1 and isinstance(self.commands[-2], Reconcile)
        ):
            self._fail(f"a write that names no owner follows no reconciler's answer: {change}")
        for name in ("owner", "new_owner"):
            if getattr(change, name) not in (None, call.owner):
                self._fail(f"the protocol wrote as another caller ({name}): {change}")
        self._check_allowed(change, actor, call.policy.effect)
        live = self._live()
        holds = live is not None and guard_holds(live, change, self.now)
        if holds != won:
            self._fail(
                f"the script says {change} {'wins' if won else 'is refused'}, but the model "
                f"record {'takes' if holds else 'refuses'} it"
            )
        if live is not None and holds:
            self.record = apply_change(live, change, self.now)
        return self._snap(self._live(), holds)

    def _check_allowed(self, change: Change, actor: Actor, effect: Effect | None) -> None:
        """The table allows the write for ``actor`` from each of its states; and, with the
        tool's ``effect``, the effect class allows it (docs/design.md §3)."""
        for source in change.from_states:
            if actor not in TRANSITIONS.get((source, change.to), frozenset()):
                self._fail(f"{actor.value} may not write {source} -> {change.to}: {change}")
        if effect is None:
            return
        takes_over = actor is Actor.CALLER and change.to is State.CLAIMED and change.lapsed
        marks = actor is Actor.CALLER and change.to is State.UNKNOWN
        reruns = actor is Actor.CALLER and State.UNKNOWN in change.from_states
        takes_back = actor is Actor.OWNER and State.UNKNOWN in change.from_states
        if marks and effect is not Effect.UNSAFE:
            self._fail(f"only an UNSAFE tool's lapse is marked UNKNOWN: {change}")
        if (takes_over or reruns) and effect is Effect.UNSAFE:
            self._fail(f"an UNSAFE tool's intent is never run again by a caller: {change}")
        if takes_back and change.to is State.CLAIMED and effect is not Effect.UNSAFE:
            self._fail(f"only an UNSAFE owner takes back its record marked UNKNOWN: {change}")

    def answer_run(self, command: Run, ran: Ran) -> Ran:
        """The tool's run: only under a live claim this call owns at the run's fence."""
        call = self.plan
        if call is not None:
            live = self._live()
            if (
                live is None
                or live.state is not State.CLAIMED
                or live.owner != call.owner
                or live.fence != command.fence
                or live.lease_deadline is None
                or live.lease_deadline <= self.now
            ):
                self._fail(f"the tool ran with no live claim of this call's: {command!r}")
            if call.policy.effect is Effect.UNSAFE and command.fence in self._fences:
                self._fail(f"an UNSAFE tool ran a second time under one fence: {command!r}")
        self._fences.add(command.fence)
        return ran

    def answer_wait(self, command: Wait, elapsed: float) -> Snapshot:
        """The wait on the claim last seen; the store's clock moves on by ``elapsed``."""
        self._call()
        seen = self._seen.record if self._seen is not None else None
        if seen is None or seen.state is not State.CLAIMED or seen.fence != command.fence:
            self._fail(f"the protocol waits on no claim it saw: {command!r}, last seen {seen}")
        self.now += elapsed
        return self._snap(self._live(), False)

    # -- in between --------------------------------------------------------------------

    def tick(self, seconds: float) -> None:
        """The store's clock moves on."""
        self.now += seconds

    def apply_elsewhere(self, change: Change, by: Actor | None) -> None:
        """Another actor's write: allowed by the table, and applying to the model record."""
        self._check_allowed(change, by or actor_of(change), None)
        live = self._live()
        if live is None or not guard_holds(live, change, self.now):
            self._fail(f"the script's own write does not apply to the model record: {change}")
        self.record = apply_change(live, change, self.now)
