"""A fault for plain functions: the call happens, and then its answer is lost."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from .. import current_key
from ._errors import AnswerLost
from ._provider import ErrorFactory, _times
from ._requests import Handling, ProviderRequest

__all__ = ["LoseAnswers"]

F = TypeVar("F", bound=Callable[..., Any])


class LoseAnswers:
    """Wraps functions so that their calls take effect and then, ``times`` times, fail.

    A wrapped function is called as usual; for the first ``times`` calls (counted across every
    function this injector wrapped) its result is thrown away once it returned, and ``error``
    is raised instead: what a client sees when the provider did the work and the answer was lost
    to a timeout. Later calls answer as usual. Every call is recorded (:attr:`requests`): one
    that returned took effect, one that raised did not.

        lose = LoseAnswers(times=1)
        monkeypatch.setattr(payments, "charge", lose(payments.charge))

    Args:
        times: how many calls lose their answer.
        error: makes the error to raise, given the function's qualified name
            (:class:`AnswerLost`, a :class:`TimeoutError`, by default).
        key_param: the parameter that carries the idempotency key, if the function has one;
            otherwise a call's key is :func:`twiceshy.current_key` where it was made.
    """

    def __init__(
        self,
        times: int = 1,
        *,
        error: ErrorFactory = AnswerLost,
        key_param: str = "idempotency_key",
    ) -> None:
        self._left = _times(times)
        self._error = error
        self._key_param = key_param
        self._lock = threading.Lock()
        self._requests: list[ProviderRequest] = []

    def __repr__(self) -> str:
        return f"LoseAnswers(left={self._left}, requests={len(self.requests)})"

    def __call__(self, fn: F) -> F:
        """``fn``, wrapped: the same signature, sync or async as ``fn`` is."""
        if not callable(fn):
            raise TypeError(f"LoseAnswers wraps a function, not {fn!r}")
        operation = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one
            signature = None

        def seen(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            fields: dict[str, Any] = {"args": args, "kwargs": kwargs}
            if signature is not None:
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:  # the call itself will say why
                    pass
                else:
                    bound.apply_defaults()
                    fields = dict(bound.arguments)
            if self._key_param not in fields:  # no key of its own: the call's, if any
                return fields, current_key()
            given = fields.pop(self._key_param)
            return fields, None if given is None else str(given)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                fields, key = seen(args, kwargs)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    self._note(operation, fields, key, exc)
                    raise
                return self._answer(operation, fields, key, result)

            return cast(F, awrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            fields, key = seen(args, kwargs)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                self._note(operation, fields, key, exc)
                raise
            return self._answer(operation, fields, key, result)

        return cast(F, wrapper)

    def _note(self, operation: str, fields: Mapping[str, Any], key: str | None, exc: Any) -> None:
        text = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._requests.append(
                ProviderRequest(operation, fields, key, Handling.FAILED, error=text)
            )

    def _answer(
        self, operation: str, fields: Mapping[str, Any], key: str | None, result: Any
    ) -> Any:
        with self._lock:
            lose = self._left > 0
            self._left -= lose
            error = self._error(operation) if lose else None
            text = None if error is None else f"{type(error).__name__}: {error}"
            self._requests.append(
                ProviderRequest(operation, fields, key, Handling.APPLIED, result, lose, text)
            )
        if error is not None:
            raise error
        return result

    @property
    def requests(self) -> list[ProviderRequest]:
        """Every call of a wrapped function, in order."""
        with self._lock:
            return list(self._requests)

    @property
    def effects(self) -> list[ProviderRequest]:
        """The calls that returned (their answer lost or not): each took effect."""
        return [seen for seen in self.requests if seen.took_effect]

    @property
    def left(self) -> int:
        """How many of the next calls will still lose their answer."""
        with self._lock:
            return self._left
