"""What the doubles record: one :class:`ProviderRequest` per request, and how it was handled."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Handling", "ProviderRequest", "shown_key"]


class Handling(enum.Enum):
    """What a double did with one request."""

    APPLIED = "applied"
    """It took effect (a charge made, a mail sent; a wrapped function that returned)."""
    DEDUPLICATED = "deduplicated"
    """Its idempotency key was seen before with the same request: the first answer, no effect."""
    REFUSED = "refused"
    """Its idempotency key was seen before with another request: refused, no effect."""
    FAILED = "failed"
    """It failed before taking effect (a wrapped function that raised: its own error)."""
    READ = "read"
    """A lookup (an HTTP ``GET``): nothing changes."""


@dataclass(frozen=True, slots=True)
class ProviderRequest:
    """One request a double saw, in the order it saw them.

    Attributes:
        operation: what was asked: ``"charge"``, ``"send_mail"``, the name given to
            :meth:`FakeProvider.request <twiceshy.testing.FakeProvider.request>`, a wrapped
            function's qualified name, or over HTTP the method and path (``"POST /v1/charges"``).
        fields: the request's arguments (over HTTP, its JSON or form body).
        key: the idempotency key it carried, or ``None``.
        handling: what the double did with it.
        answer: what it answered (or would have, when the answer was lost).
        answer_lost: whether the answer was lost after the request was handled.
        error: the error raised to the caller, as ``"Type: message"``, or ``None``.
    """

    operation: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    key: str | None = None
    handling: Handling = Handling.APPLIED
    answer: Any = None
    answer_lost: bool = False
    error: str | None = None

    @property
    def took_effect(self) -> bool:
        """Whether this request took effect."""
        return self.handling is Handling.APPLIED

    def __str__(self) -> str:
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.fields.items())
        shown = f"{self.operation}({arguments}) key={shown_key(self.key)}: {self.handling.value}"
        if self.answer_lost:
            shown += ", answer lost"
        if self.error is not None and not self.answer_lost:
            shown += f" ({self.error})"
        return shown


def shown_key(key: str | None) -> str:
    """A key as a failure message shows it: short enough to read, long enough to tell apart."""
    if key is None:
        return "none"
    return key if len(key) <= 20 else f"{key[:16]}…"
