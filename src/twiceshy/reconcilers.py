"""Ready reconcilers: find out at the provider what became of a parked (UNKNOWN) call.

A reconciler is the ``reconcile=`` function of a tool (``reconcile(key, arguments)``): it answers
``twiceshy.Happened(result)``, ``twiceshy.DidNotHappen()`` or ``None`` (cannot tell). It runs at
the next call of a parked intent and from ``twiceshy reconcile`` (with ``arguments=None``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._protocol import DidNotHappen, Happened

__all__ = ["SUCCEEDED_STATUSES", "stripe_like"]

log = logging.getLogger("twiceshy")

SUCCEEDED_STATUSES: Final = frozenset({"succeeded", "processing", "requires_capture"})
"""Statuses of a Stripe PaymentIntent that mean the charge took effect (or is taking it)."""

StripeReconciler = Callable[[str, Mapping[str, Any] | None], Happened | DidNotHappen | None]


def _status_succeeded(obj: Mapping[str, Any]) -> bool:
    return obj.get("status") in SUCCEEDED_STATUSES


def _identity(obj: Mapping[str, Any]) -> Any:
    return obj


def stripe_like(
    find: Callable[[str], Mapping[str, Any] | None],
    *,
    succeeded: Callable[[Mapping[str, Any]], bool] = _status_succeeded,
    result: Callable[[Mapping[str, Any]], Any] = _identity,
    absent_means_not_applied: bool = False,
) -> StripeReconciler:
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

    Args:
        find: looks the object up at the provider by the key; ``None`` when there is none.
        succeeded: whether a found object took effect. Default: its ``status`` is
            ``succeeded``, ``processing`` or ``requires_capture``. A found object that did not
            (``canceled``, ``requires_payment_method``, ...) means the effect did not take place.
        result: the tool's result made from the found object (default: the object itself). It
            is stored and replayed as the tool's own result would be.
        absent_means_not_applied: the provider is authoritative: when ``find`` finds nothing,
            the call certainly did not happen. Default ``False``: nothing found cannot tell.

    Returns:
        ``reconcile(key, arguments)``: ``Happened(result(obj))`` for a found object that
        succeeded, ``DidNotHappen()`` for one that failed (or for none, when the provider is
        authoritative), ``None`` when it cannot tell — ``find`` raised, or found nothing.
    """

    def reconcile(key: str, arguments: Mapping[str, Any] | None) -> Happened | DidNotHappen | None:
        try:
            obj = find(key)
        except Exception:
            # A lookup that fails tells nothing: the record stays parked.
            log.warning("twiceshy: looking up key %s at the provider failed", key, exc_info=True)
            return None
        if obj is None:
            return DidNotHappen() if absent_means_not_applied else None
        if succeeded(obj):
            return Happened(result(obj))
        return DidNotHappen()

    return reconcile
