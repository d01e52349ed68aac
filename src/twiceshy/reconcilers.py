"""Ready reconcilers: find out at the provider what became of a parked (UNKNOWN) call.

A reconciler is the ``reconcile=`` function of a tool (``reconcile(key, arguments)``): it answers
``twiceshy.Happened(result)``, ``twiceshy.DidNotHappen()`` or ``None`` (cannot tell). It runs at
the next call of a parked intent and from ``twiceshy reconcile`` (with ``arguments=None``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeAlias, overload

from ._protocol import DidNotHappen, Happened

__all__ = ["FAILED_STATUSES", "SUCCEEDED_STATUSES", "stripe_like"]

log = logging.getLogger("twiceshy")

SUCCEEDED_STATUSES: Final = frozenset({"succeeded", "processing", "requires_capture", "pending"})
"""Statuses of a Stripe object that mean its effect took place (or is taking place)."""

FAILED_STATUSES: Final = frozenset({"canceled", "requires_payment_method", "failed"})
"""Statuses of a Stripe object that mean its effect did not take place.

Any other status (``requires_action``: a PaymentIntent waiting for 3-D Secure, which the customer
may still complete; ``requires_confirmation``; one this list does not know) cannot tell.
"""

Answer: TypeAlias = Happened | DidNotHappen | None
StripeReconciler: TypeAlias = Callable[[str, Mapping[str, Any] | None], Answer]
AsyncStripeReconciler: TypeAlias = Callable[[str, Mapping[str, Any] | None], Awaitable[Answer]]


def _status_succeeded(obj: Mapping[str, Any]) -> bool | None:
    status = obj.get("status")
    if status in SUCCEEDED_STATUSES:
        return True
    if status in FAILED_STATUSES:
        return False
    return None


def _identity(obj: Mapping[str, Any]) -> Any:
    return obj


@overload
def stripe_like(
    find: Callable[[str], Awaitable[Mapping[str, Any] | None]],
    *,
    succeeded: Callable[[Mapping[str, Any]], bool | None] = ...,
    result: Callable[[Mapping[str, Any]], Any] = ...,
    absent_means_not_applied: bool = ...,
) -> AsyncStripeReconciler: ...


@overload
def stripe_like(
    find: Callable[[str], Mapping[str, Any] | None],
    *,
    succeeded: Callable[[Mapping[str, Any]], bool | None] = ...,
    result: Callable[[Mapping[str, Any]], Any] = ...,
    absent_means_not_applied: bool = ...,
) -> StripeReconciler: ...


def stripe_like(
    find: Callable[[str], Any],
    *,
    succeeded: Callable[[Mapping[str, Any]], bool | None] = _status_succeeded,
    result: Callable[[Mapping[str, Any]], Any] = _identity,
    absent_means_not_applied: bool = False,
) -> StripeReconciler | AsyncStripeReconciler:
    """A reconciler for providers that can look an object up by the call's key.

    The tool must put the key in the object it creates, where ``find`` can look for it: as the
    provider's idempotency key, or in the object's metadata (``twiceshy.current_key()`` while the
    tool runs). For Stripe::

        @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(find_intent))
        def charge(amount: int, customer: str) -> dict[str, Any]:
            return stripe.PaymentIntent.create(
                amount=amount, currency="eur", customer=customer, confirm=True,
                metadata={"twiceshy_key": twiceshy.current_key()},
            ).to_dict()

        def find_intent(key: str) -> Mapping[str, Any] | None:
            found = stripe.PaymentIntent.search(query=f"metadata['twiceshy_key']:'{key}'")
            return found.data[0].to_dict() if found.data else None

    (Stripe's search index lags a few seconds behind writes: an object created a moment ago may
    not be found yet, which is why "not found" means "cannot tell" by default.)

    An ``async def`` ``find`` (an async provider client) makes an ``async`` reconciler, for an
    ``async def`` tool and for ``twiceshy reconcile``.

    Args:
        find: looks the object up at the provider by the key; ``None`` when there is none.
        succeeded: whether a found object took effect: ``True``, ``False`` (it certainly did
            not), or ``None`` (cannot tell yet). Default: its ``status`` is in
            :data:`SUCCEEDED_STATUSES` (``succeeded``, ``processing``, ``requires_capture``,
            ``pending``): ``True``; in :data:`FAILED_STATUSES` (``canceled``,
            ``requires_payment_method``, ``failed``): ``False``; any other (``requires_action``,
            waiting for the customer): ``None``.
        result: the tool's result made from the found object (default: the object itself). It
            is stored and replayed as the tool's own result would be.
        absent_means_not_applied: the provider is authoritative: when ``find`` finds nothing,
            the call certainly did not happen. Default ``False``: nothing found cannot tell.

    Returns:
        ``reconcile(key, arguments)``: ``Happened(result(obj))`` for a found object that
        succeeded, ``DidNotHappen()`` for one that failed (or for none, when the provider is
        authoritative), ``None`` when it cannot tell — ``find`` raised, found nothing, or found
        an object still under way.
    """

    def answer(obj: Mapping[str, Any] | None) -> Answer:
        if obj is None:
            return DidNotHappen() if absent_means_not_applied else None
        took = succeeded(obj)
        if took is None:
            return None
        return Happened(result(obj)) if took else DidNotHappen()

    def failed(key: str) -> None:
        # A lookup that fails tells nothing: the record stays parked.
        log.warning("twiceshy: looking up key %s at the provider failed", key, exc_info=True)

    async def answer_later(key: str, found: Awaitable[Mapping[str, Any] | None]) -> Answer:
        try:
            obj = await found
        except Exception:
            failed(key)
            return None
        return answer(obj)

    if inspect.iscoroutinefunction(find):

        async def areconcile(key: str, arguments: Mapping[str, Any] | None) -> Answer:
            return await answer_later(key, find(key))

        return areconcile

    def reconcile(key: str, arguments: Mapping[str, Any] | None) -> Any:
        try:
            obj = find(key)
        except Exception:
            failed(key)
            return None
        if inspect.isawaitable(obj):  # a find that is no async def, answering an awaitable
            return answer_later(key, obj)
        return answer(obj)

    return reconcile
