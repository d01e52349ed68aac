"""Transports that let a request take effect and then lose its answer, for httpx and httpx2.

Made from one definition for each module's own base classes, as twiceshy's own transports are
(:mod:`twiceshy.integrations._http`); :mod:`twiceshy.testing.httpx` and
:mod:`twiceshy.testing.httpx2` hold them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["CHANGING_METHODS", "make_fault_transports"]

CHANGING_METHODS: frozenset[str] = frozenset({"POST", "PUT", "PATCH", "DELETE"})
"""The methods whose answers are lost by default: those that change something."""


class _Countdown:
    """How many answers are still to lose, and the requests whose answers were lost."""

    def __init__(self, times: int, methods: Collection[str]) -> None:
        if not isinstance(times, int) or isinstance(times, bool):
            raise TypeError(f"times= must be a whole number of requests, not {times!r}")
        if times < 0:
            raise ValueError(f"times= must be 0 or more, not {times}")
        # A lone string is a collection too, of letters: methods="POST" would match no request.
        if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
            raise TypeError(f"methods= must be a collection of method names, not {methods!r}")
        self.left = times
        self.methods = frozenset(m.upper() for m in methods)
        self.lost: list[Any] = []
        self._lock = threading.Lock()

    def take(self, request: Any) -> bool:
        """Whether ``request``'s answer is to be lost (and if so, note it)."""
        if request.method.upper() not in self.methods:
            return False
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            self.lost.append(request)
            return True


def make_fault_transports(module: Any) -> tuple[type[Any], type[Any]]:
    """The sync and async lost-answer transports for ``module`` (``httpx`` or ``httpx2``)."""

    def timeout(request: Any) -> BaseException:
        error: BaseException = module.ReadTimeout(
            f"timed out reading the answer to {request.method} {request.url} (twiceshy.testing "
            "lost it after it was sent and answered)",
            request=request,
        )
        return error

    class LostAnswerTransport(module.BaseTransport):  # type: ignore[misc]
        """Sends each request on, then loses the answers of the first ``times`` of them.

        The request reaches the server and is answered (the effect happens); the answer is
        read and thrown away, and the client gets a ``ReadTimeout`` instead, as when the
        answer does not come back in time. Later requests pass as usual. Put it under
        twiceshy's transport, so that the requests it sends on carry their headers::

            IdempotencyKeyTransport(LostAnswerTransport(times=1))

        Args:
            transport: the transport that sends the request (default: the module's own).
            times: how many answers to lose.
            methods: the methods whose answers are lost; other requests always pass.
            error: makes the error to raise, given the request (a ``ReadTimeout`` by default).

        Attributes:
            lost: the requests whose answers were lost, in order.
        """

        def __init__(
            self,
            transport: Any = None,
            *,
            times: int = 1,
            methods: Collection[str] = CHANGING_METHODS,
            error: Callable[[Any], BaseException] = timeout,
        ) -> None:
            self._transport = transport if transport is not None else module.HTTPTransport()
            self._countdown = _Countdown(times, methods)
            self._error = error
            self.lost = self._countdown.lost

        @property
        def left(self) -> int:
            """How many answers are still to be lost."""
            return self._countdown.left

        def handle_request(self, request: Any) -> Any:
            response = self._transport.handle_request(request)
            if not self._countdown.take(request):
                return response
            try:
                response.read()  # the whole answer came back; only the caller never sees it
            finally:
                response.close()
            raise self._error(request)

        def close(self) -> None:
            self._transport.close()

    class AsyncLostAnswerTransport(module.AsyncBaseTransport):  # type: ignore[misc]
        """The async twin of :class:`LostAnswerTransport`."""

        def __init__(
            self,
            transport: Any = None,
            *,
            times: int = 1,
            methods: Collection[str] = CHANGING_METHODS,
            error: Callable[[Any], BaseException] = timeout,
        ) -> None:
            self._transport = transport if transport is not None else module.AsyncHTTPTransport()
            self._countdown = _Countdown(times, methods)
            self._error = error
            self.lost = self._countdown.lost

        @property
        def left(self) -> int:
            """How many answers are still to be lost."""
            return self._countdown.left

        async def handle_async_request(self, request: Any) -> Any:
            response = await self._transport.handle_async_request(request)
            if not self._countdown.take(request):
                return response
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise self._error(request)

        async def aclose(self) -> None:
            await self._transport.aclose()

    LostAnswerTransport.__module__ = AsyncLostAnswerTransport.__module__ = (
        f"twiceshy.testing.{module.__name__}"
    )
    return LostAnswerTransport, AsyncLostAnswerTransport
