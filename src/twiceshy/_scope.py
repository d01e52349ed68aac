"""The run scope and the key of the call in progress, as context variables.

Context variables follow the code through ``await``, ``asyncio`` tasks and ``asyncio.to_thread``;
a bare thread starts with none, so a tool that hands work to a thread passes the key itself.
"""

from __future__ import annotations

import contextvars
from types import TracebackType
from typing import NamedTuple

from ._records import Effect

__all__ = ["Current", "current_call", "current_key", "current_scope", "run"]

_scope: contextvars.ContextVar[str | None] = contextvars.ContextVar("twiceshy_scope", default=None)

# The tokens of the scopes entered in this context, innermost last. Kept in the context itself,
# not in the run object: one object entered by concurrent tasks (each in its own context) must
# give each task back its own previous scope.
_entered: contextvars.ContextVar[tuple[contextvars.Token[str | None], ...]] = (
    contextvars.ContextVar("twiceshy_entered", default=())
)


class Current(NamedTuple):
    """The protected call running in this context."""

    key: str
    tool: str
    effect: Effect


_call: contextvars.ContextVar[Current | None] = contextvars.ContextVar(
    "twiceshy_call", default=None
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
        _entered.set((*_entered.get(), _scope.set(self._scope)))
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
    """The scope set by the innermost ``twiceshy.run(...)``, or ``None`` outside any."""
    return _scope.get()


def current_key() -> str | None:
    """The idempotency key of the protected call running now, or ``None`` outside one.

    Inside a KEYED tool, hand it to the provider as its idempotency key: it is the same on every
    attempt of the intent, takeovers after a crash included.
    """
    call = _call.get()
    return call.key if call is not None else None


def current_call() -> Current | None:
    """The key, tool name and effect class of the protected call running now, if any."""
    return _call.get()


def set_call(call: Current) -> contextvars.Token[Current | None]:
    """Set the current call (for drivers)."""
    return _call.set(call)


def reset_call(token: contextvars.Token[Current | None]) -> None:
    """Undo :func:`set_call` (for drivers)."""
    _call.reset(token)
