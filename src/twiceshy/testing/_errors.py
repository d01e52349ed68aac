"""The errors the doubles raise, as a provider's client would.

None of them is a :class:`~twiceshy.TwiceshyError`: they stand for the provider's errors, which
twiceshy reads as it reads any tool's exception (docs/design.md, section 4)::

    AnswerLost(TimeoutError)            it took effect; the answer never came (ambiguous)
    ProviderDown(ConnectionError)       it was not taken: nothing happened (ambiguous too,
                                        unless the tool lists it as not_applied=)
    IdempotencyKeyReused(ValueError)    the key was used before for another request: refused
"""

from __future__ import annotations

__all__ = ["AnswerLost", "IdempotencyKeyReused", "ProviderDown"]


class AnswerLost(TimeoutError):
    """The request took effect, and its answer was lost (a read timeout, as the caller sees it).

    Args:
        operation: what was asked.
    """

    def __init__(self, operation: str) -> None:
        super().__init__(f"{operation}: timed out waiting for the answer (it took effect)")
        self.operation = operation


class ProviderDown(ConnectionError):
    """The provider did not take the request: nothing happened.

    Args:
        operation: what was asked.
    """

    def __init__(self, operation: str) -> None:
        super().__init__(f"{operation}: the provider is unavailable (nothing happened)")
        self.operation = operation


class IdempotencyKeyReused(ValueError):
    """The idempotency key was used before for another request; this one was refused.

    What a provider that deduplicates answers (Stripe: "Keys for idempotent requests can only
    be used with the same parameters they were first used with"): a tool whose key names less
    than its intent.

    Args:
        operation: what was asked.
        key: the reused key.
    """

    def __init__(self, operation: str, key: str) -> None:
        super().__init__(
            f"{operation}: the idempotency key {key!r} was used before for another request"
        )
        self.operation = operation
        self.key = key
