"""A payment or mail provider in the test's own process, which counts every effect."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ._errors import AnswerLost, IdempotencyKeyReused, ProviderDown
from ._requests import Handling, ProviderRequest

__all__ = ["FakeProvider"]

_PREFIXES = {"charge": "ch", "charges": "ch", "send_mail": "msg", "messages": "msg"}
"""The id prefix of each operation's answers, by name or by the last part of an HTTP path
(``POST /v1/charges``); other operations' ids start with ``obj``."""

ErrorFactory = Callable[[str], BaseException]
"""Makes the error to raise for one request, given its operation."""


def _times(times: int) -> int:
    if not isinstance(times, int) or isinstance(times, bool):
        raise TypeError(f"times= must be a whole number of requests, not {times!r}")
    if times < 0:
        raise ValueError(f"times= must be 0 or more, not {times}")
    return times


def _prefix(operation: str) -> str:
    found = _PREFIXES.get(operation)
    return found or _PREFIXES.get(operation.rstrip("/").rsplit("/", 1)[-1], "obj")


def _late(late: object) -> float | None:
    if late is None:
        return None
    if isinstance(late, bool) or not isinstance(late, (int, float)) or not late >= 0:
        raise ValueError(f"late= must be a number of seconds, 0 or more, or None, not {late!r}")
    return float(late)


def _key(key: object) -> str | None:
    if key is not None and not isinstance(key, str):
        raise TypeError(f"idempotency_key= must be a str or None, not {type(key).__name__}")
    return key


class FakeProvider:
    """A provider double: it takes requests, records each one, and can lose their answers.

    Every request is recorded (:attr:`requests`), and those that took effect are
    :attr:`effects`. It answers each effect with a mapping holding an ``id`` (``ch_1``,
    ``msg_2``, ...: numbered by effect), ``"status": "succeeded"`` and the request's fields.

    Args:
        deduplicate: whether it deduplicates by idempotency key, as Stripe does: a request whose
            key took effect before is answered the first answer and takes no new effect, and one
            whose key was used for another request is refused (:class:`IdempotencyKeyReused`).
            A tool is KEYED only against such a provider. Without it (the default) every request
            takes effect, whatever key it carries, as most mail and SMS gateways do.

    A tool calls it as it would call the provider's client::

        provider = FakeProvider(deduplicate=True)

        @ledger.tool(effect=twiceshy.KEYED)
        def charge(amount: int, customer: str) -> str:
            made = provider.charge(amount, customer, idempotency_key=twiceshy.current_key())
            return made["id"]

    Thread-safe; :meth:`serve` puts it behind HTTP on loopback for tools that use an HTTP
    client.
    """

    def __init__(self, *, deduplicate: bool = False) -> None:
        if not isinstance(deduplicate, bool):
            raise TypeError(f"deduplicate= must be True or False, not {deduplicate!r}")
        self.deduplicate = deduplicate
        self._lock = threading.Lock()
        self._requests: list[ProviderRequest] = []
        self._by_key: dict[str, ProviderRequest] = {}
        self._effects = 0
        self._lose: list[tuple[ErrorFactory, float | None]] = []
        self._fail: list[ErrorFactory] = []

    def __repr__(self) -> str:
        return (
            f"FakeProvider(deduplicate={self.deduplicate}, requests={len(self.requests)}, "
            f"effects={len(self.effects)})"
        )

    # What a tool calls.

    def charge(
        self,
        amount: int,
        customer: str,
        *,
        currency: str = "usd",
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Charge ``amount`` (in the currency's smallest unit) to ``customer``.

        Returns:
            The charge: ``{"id": "ch_1", "status": "succeeded", "amount": ..., ...}``.

        Raises:
            AnswerLost: it took effect, and its answer was lost (:meth:`lose_answers`).
            ProviderDown: it was not taken (:meth:`fail_next`).
            IdempotencyKeyReused: the key was used before for another request.
        """
        fields: dict[str, Any] = {"amount": amount, "customer": customer, "currency": currency}
        if metadata is not None:
            fields["metadata"] = dict(metadata)
        return self.request("charge", fields, idempotency_key=idempotency_key)

    def send_mail(
        self,
        to: str,
        subject: str,
        body: str = "",
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Send a mail to ``to``.

        Returns:
            The message: ``{"id": "msg_1", "status": "succeeded", "to": ..., ...}``.

        Raises:
            AnswerLost: it took effect, and its answer was lost (:meth:`lose_answers`).
            ProviderDown: it was not taken (:meth:`fail_next`).
            IdempotencyKeyReused: the key was used before for another request.
        """
        fields = {"to": to, "subject": subject, "body": body}
        return self.request("send_mail", fields, idempotency_key=idempotency_key)

    def request(
        self,
        operation: str,
        fields: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Any other operation: ``request("create_refund", {"charge": "ch_1"})``.

        Returns:
            What the provider answers: ``{"id": ..., "status": "succeeded", **fields}``.

        Raises:
            AnswerLost: it took effect, and its answer was lost (:meth:`lose_answers`).
            ProviderDown: it was not taken (:meth:`fail_next`).
            IdempotencyKeyReused: the key was used before for another request.
        """
        if not isinstance(operation, str) or not operation:
            raise TypeError(f"operation must be a non-empty str, not {operation!r}")
        seen, error, late = self._handle(operation, dict(fields or {}), _key(idempotency_key))
        if error is not None:
            if late:
                time.sleep(late)
            raise error
        return dict(seen.answer)

    def _handle(
        self, operation: str, fields: dict[str, Any], key: str | None
    ) -> tuple[ProviderRequest, BaseException | None, float | None]:
        # Take one request and record it: the one step behind request() and the HTTP face.
        # Answers the request as recorded, the error for its caller, and how late a lost
        # answer comes (None: never).
        with self._lock:
            seen, error, late = self._decide(operation, fields, key)
            self._requests.append(seen)
            if seen.took_effect and key is not None:
                self._by_key.setdefault(key, seen)
        return seen, error, late

    def _record(self, seen: ProviderRequest) -> None:
        with self._lock:
            self._requests.append(seen)

    def _decide(
        self, operation: str, fields: dict[str, Any], key: str | None
    ) -> tuple[ProviderRequest, BaseException | None, float | None]:
        if self._fail:
            error = self._fail.pop(0)(operation)
            failed = ProviderRequest(operation, fields, key, Handling.FAILED, error=_text(error))
            return failed, error, None
        first = self._by_key.get(key) if self.deduplicate and key is not None else None
        if first is not None and (first.operation, first.fields) != (operation, fields):
            error = IdempotencyKeyReused(operation, first.key or "")
            refused = ProviderRequest(operation, fields, key, Handling.REFUSED, error=_text(error))
            return refused, error, None
        if first is not None:
            handling, answer = Handling.DEDUPLICATED, first.answer
        else:
            self._effects += 1
            handling = Handling.APPLIED
            answer = {
                "id": f"{_prefix(operation)}_{self._effects}",
                "status": "succeeded",
                **fields,
            }
        if not self._lose:
            return ProviderRequest(operation, fields, key, handling, answer), None, None
        make, late = self._lose.pop(0)
        error = make(operation)
        lost = ProviderRequest(operation, fields, key, handling, answer, True, _text(error))
        return lost, error, late

    # Faults.

    def lose_answers(
        self, times: int = 1, *, error: ErrorFactory = AnswerLost, late: float | None = None
    ) -> None:
        """Lose the answers of the next ``times`` requests, after they were handled.

        Each takes effect (or is deduplicated) as usual, and then the caller gets ``error``
        instead of the answer: :class:`AnswerLost`, a :class:`TimeoutError`, by default. Over
        HTTP (:meth:`serve`) the connection is closed without an answer, or with ``late`` the
        answer is sent that many seconds late: a client whose read timeout is shorter gets its
        own timeout for a request that took effect, the incident of a slow provider.

        Args:
            times: how many requests lose their answer.
            error: makes the error to raise, given the request's operation.
            late: seconds to hold each answer first (in the process, before ``error``).
        """
        entry = (error, _late(late))
        with self._lock:
            self._lose.extend([entry] * _times(times))

    def fail_next(self, times: int = 1, *, error: ErrorFactory = ProviderDown) -> None:
        """Refuse the next ``times`` requests before they take effect.

        The caller gets ``error`` (:class:`ProviderDown`, a :class:`ConnectionError`, by
        default), and nothing happened; over HTTP (:meth:`serve`) the answer is a 503. Faults
        are taken in order: failures first, then lost answers.

        Args:
            times: how many requests fail.
            error: makes the error to raise, given the request's operation.
        """
        with self._lock:
            self._fail.extend([error] * _times(times))

    # What the test looks at.

    @property
    def requests(self) -> list[ProviderRequest]:
        """Every request it saw, in order: effects, deduplicated repeats, refusals, failures."""
        with self._lock:
            return list(self._requests)

    @property
    def effects(self) -> list[ProviderRequest]:
        """The requests that took effect, in order."""
        return [seen for seen in self.requests if seen.took_effect]

    def find(self, key: str) -> dict[str, Any] | None:
        """What the effect made under ``key`` answered, as a provider's lookup finds it.

        ``key`` is looked for as the request's idempotency key, and as a value of its
        ``metadata``; ``None`` when no effect carries it. It suits
        :func:`twiceshy.reconcilers.stripe_like`: ``reconcile=stripe_like(provider.find)``.
        """
        for seen in self.effects:
            metadata = seen.fields.get("metadata")
            tagged = isinstance(metadata, Mapping) and key in metadata.values()
            if seen.key == key or tagged:
                return dict(seen.answer)
        return None

    # Over HTTP.

    @contextmanager
    def serve(self, *, header: str = "Idempotency-Key") -> Iterator[str]:
        """Serve this provider over HTTP on a free loopback port while the block runs.

        Yields the base URL (``http://127.0.0.1:PORT``). Every ``POST``, ``PUT``, ``PATCH`` and
        ``DELETE`` is one request, named by method and path (``"POST /v1/charges"``), with the
        JSON object, form or multipart fields of its body as fields and its ``header`` as
        idempotency key. A lost answer closes the connection without answering; a failure
        answers 503, a reused key 400. A ``GET`` is recorded as a read and answers every
        effect's answer (``{"data": [...]}``).

        Args:
            header: the header that carries the idempotency key.
        """
        from ._served import serve  # http.server, only for the tests that serve

        with serve(self, header) as base:
            yield base


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
