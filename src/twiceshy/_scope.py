"""The run scope and the call in progress, as context variables.

Context variables follow the code through ``await``, ``asyncio`` tasks and ``asyncio.to_thread``;
a bare thread starts with none, so a tool that hands work to a thread passes the key itself.

While a protected call runs, the scope is one derived from its key (docs/design.md §2, "Scope of
nested runs"): an agent run started inside the tool (a sub-agent, a handoff, a subgraph) names
its intents inside the outer intent, so every retry of the outer call names the same inner ones,
and two different outer calls never share one. A ``twiceshy.run(...)`` entered inside the tool
gives the nested runs another scope.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from types import TracebackType

from ._records import Effect, Outcome
from .errors import FencedOut

__all__ = [
    "Current",
    "current_call",
    "current_key",
    "current_scope",
    "entered_scope",
    "handed_on",
    "inherited_scope",
    "last_outcome",
    "point_of_no_return",
    "run",
    "told",
    "was_replayed",
]


class Deferred:
    """A nested scope worked out only if a nested run asks for it: a SAFE call kept out of the
    ledger derives no key unless something inside it needs one."""

    __slots__ = ("_make", "_text")

    def __init__(self, make: Callable[[], str]) -> None:
        self._make = make
        self._text: str | None = None

    def text(self) -> str:
        """The scope, worked out on first use."""
        if self._text is None:
            self._text = self._make()
        return self._text


_Entered = tuple["str | Deferred", bool]

# The innermost scope, and whether a protected call set it (a nested run's inherited scope).
_scope: contextvars.ContextVar[_Entered | None] = contextvars.ContextVar(
    "twiceshy_scope", default=None
)

# The tokens of the scopes entered in this context, innermost last. Kept in the context itself,
# not in the run object: one object entered by concurrent tasks (each in its own context) must
# give each task back its own previous scope.
_entered: contextvars.ContextVar[tuple[contextvars.Token[_Entered | None], ...]] = (
    contextvars.ContextVar("twiceshy_entered", default=())
)


class Current:
    """One attempt of the protected call running in this context, and what it has done so far.

    Made by the driver for each attempt; the HTTP transports and
    :func:`point_of_no_return` read and mark it.

    Attributes:
        key: the intent's key.
        tool: the tool's name.
        effect: its effect class.
        effect_at: where its effect happens (``"mark"``, ``"http"``), if it says.
        marked: whether the attempt has passed its point of no return.
        handed: whether the attempt handed its key on: the tool read :func:`current_key` or
            was given it through its key parameter, or a twiceshy transport sent a request
            with it. A KEYED attempt that did not may have made an effect its provider cannot
            recognise again (docs/design.md §4).
        sent: the digests of the requests the attempt sent through a twiceshy transport.
        closed: the attempt has ended; a thread or task it left behind may no longer start
            its effect.
    """

    __slots__ = (
        "closed",
        "confirm",
        "effect",
        "effect_at",
        "handed",
        "key",
        "marked",
        "sent",
        "tool",
    )

    def __init__(
        self,
        key: str,
        tool: str,
        effect: Effect,
        effect_at: str | None = None,
        confirm: Callable[[], None] | None = None,
    ) -> None:
        self.key = key
        self.tool = tool
        self.effect = effect
        self.effect_at = effect_at
        #: Raises ``FencedOut`` unless the attempt still holds its lease (renewing it if in doubt).
        self.confirm = confirm
        self.marked = False
        self.handed = False
        self.sent: set[str] = set()
        self.closed = False


_call: contextvars.ContextVar[Current | None] = contextvars.ContextVar(
    "twiceshy_call", default=None
)

# How the last protected call made in this context was answered.
_last: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar(
    "twiceshy_last_outcome", default=None
)


class run:
    """Set the run scope of the protected calls made inside it.

    The scope names the agent's run: the same text across retries and process restarts (a
    LangGraph thread id, a Pydantic AI ``run_id``, an id the application chose). Two runs calling a
    tool with the same arguments are two intents; one run calling it twice is one.

    Works as ``with twiceshy.run("run-42"):`` in sync and async code alike (``async with`` too).

    Args:
        scope: a non-empty string.

    Raises:
        ValueError: the scope is empty or not a string.
    """

    __slots__ = ("_scope",)

    def __init__(self, scope: str) -> None:
        if not isinstance(scope, str) or not scope:
            raise ValueError(f"a run scope must be a non-empty string, not {scope!r}")
        self._scope = scope

    @property
    def scope(self) -> str:
        """The scope this context sets."""
        return self._scope

    def __enter__(self) -> run:
        _entered.set((*_entered.get(), _scope.set((self._scope, False))))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        *outer, token = _entered.get()
        _entered.set(tuple(outer))
        _scope.reset(token)

    async def __aenter__(self) -> run:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def current_scope() -> str | None:
    """The scope of the protected calls made here, or ``None`` outside any.

    That is the innermost ``twiceshy.run(...)``'s, or inside a protected call the scope its
    nested runs inherit (see :func:`inherited_scope`), whichever was entered last.
    """
    entered = entered_scope()
    if entered is None:
        return None
    if entered[1]:
        handed_on()
    return entered[0]


def handed_on() -> None:
    """Note that the protected call running here handed its key on: a nested run read the
    scope derived from it, so the intents inside are keyed by it (for drivers and guards)."""
    call = _call.get()
    if call is not None:
        call.handed = True


def entered_scope() -> tuple[str, bool] | None:
    """The innermost scope and whether a protected call set it (its nested runs' scope)."""
    entered = _scope.get()
    if entered is None or type(entered[0]) is str:
        return entered  # type: ignore[return-value]
    return entered[0].text(), entered[1]  # type: ignore[union-attr]


def inherited_scope() -> str | None:
    """The scope a run started here inherits from the protected call it runs in, if any.

    It is derived from that call's key, so every retry of the outer intent names the same inner
    intents. ``None`` outside a protected call, or where a ``twiceshy.run(...)`` entered inside
    it names the scope. Framework adapters prefer it to the framework's own run id.
    """
    entered = entered_scope()
    if entered is None or not entered[1]:
        return None
    handed_on()
    return entered[0]


def nested_scope(key: str) -> str:
    """The scope inherited by the runs started inside the protected call ``key``."""
    return key


def current_key() -> str | None:
    """The idempotency key of the protected call running now, or ``None`` outside one.

    Inside a KEYED tool, hand it to the provider as its idempotency key: it is the same on every
    attempt of the intent, takeovers after a crash included.
    """
    call = _call.get()
    if call is None:
        return None
    call.handed = True  # read inside the tool: it may hand it to its provider
    return call.key


def last_outcome() -> Outcome | None:
    """How the last protected call made in this context (this thread, or this task and the
    code it awaits) was answered, or ``None`` before any.

    ``last_outcome().replayed`` says whether the caller got an earlier call's outcome (replayed,
    joined, waited for, or a reconciler's answer) rather than one of its own run: for code that
    reports or bills what it did, or marks a replayed answer to its own callers.
    """
    return _last.get()


def was_replayed() -> bool:
    """Whether the last protected call made in this context was answered without running its
    tool: an earlier call's outcome, replayed, joined or waited for, or a reconciler's answer."""
    outcome = _last.get()
    return outcome is not None and outcome.replayed


def told(outcome: Outcome) -> None:
    """Say how a protected call was answered, for :func:`last_outcome` (for the call)."""
    _last.set(outcome)


def current_call() -> Current | None:
    """The key, tool name and effect class of the protected call running now, if any."""
    return _call.get()


def point_of_no_return() -> None:
    """Say, inside a tool, that its effect starts now.

    For a tool declared ``effect_at="mark"`` (the default for a tool whose own code calls this
    function), an exception raised before this call means that nothing happened: the intent is
    released and the next call runs it. After it, an exception is read as the tool's class says
    (ambiguous unless ``definite=`` / ``not_applied=`` say otherwise).

    It first checks that the call still holds its lease (on this process's clock, renewing it
    under the call's fence when in doubt), and refuses to pass if another caller may have taken
    the intent over.

    Outside a protected call it does nothing.

    Raises:
        FencedOut: the call no longer holds its lease, or its attempt has ended (this is a
            thread it left behind): its effect must not start.
        StoreError: the lease could not be confirmed; the effect must not start.
    """
    call = _call.get()
    if call is None:
        return
    if call.closed:
        # A thread or task the attempt left behind (a timed-out tool's): the intent may have
        # been run again since.
        raise FencedOut(call.tool, call.key)
    if call.confirm is not None:
        call.confirm()
    call.marked = True


CallTokens = tuple[contextvars.Token[Current | None], contextvars.Token[_Entered | None]]


def set_call(call: Current) -> CallTokens:
    """Make ``call`` the current call, and its nested scope the scope (for drivers)."""
    return _call.set(call), _scope.set((nested_scope(call.key), True))


def reset_call(tokens: CallTokens) -> None:
    """Undo :func:`set_call`, the attempt having ended (for drivers)."""
    call, scope = tokens
    current = _call.get()
    if current is not None:
        current.closed = True
    _scope.reset(scope)
    _call.reset(call)


def set_nested(deferred: Deferred) -> contextvars.Token[_Entered | None]:
    """Give the runs started here a nested scope worked out on demand (for drivers)."""
    return _scope.set((deferred, True))


def reset_nested(token: contextvars.Token[_Entered | None]) -> None:
    """Undo :func:`set_nested` (for drivers)."""
    _scope.reset(token)
