"""Assertions over what a double saw, whose failures say what happened and what it means."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

from ._requests import ProviderRequest, shown_key

__all__ = ["Recorded", "assert_no_effect", "assert_same_key", "assert_took_effect_once"]


class Recorded(Protocol):
    """Anything that records requests: a :class:`FakeProvider`, a :class:`LoseAnswers`."""

    @property
    def requests(self) -> Sequence[ProviderRequest]:
        """Every request it saw, in order."""
        ...


Source: TypeAlias = Recorded | Iterable[ProviderRequest]


def _requests(source: Source) -> list[ProviderRequest]:
    if isinstance(source, Iterable):
        seen = list(source)
    elif isinstance(getattr(source, "requests", None), Iterable):
        seen = list(source.requests)
    else:
        raise TypeError(
            f"give a FakeProvider, a LoseAnswers or a list of ProviderRequest, not {source!r}"
        )
    for one in seen:
        if not isinstance(one, ProviderRequest):
            raise TypeError(f"not a ProviderRequest: {one!r}")
    return seen


def _matching(
    source: Source, operation: str | None, where: Mapping[str, Any] | None
) -> tuple[list[ProviderRequest], str]:
    """The requests of ``operation`` whose fields hold ``where``, and how to name them
    (``" of charge with amount=1"``)."""
    seen = [
        one
        for one in _requests(source)
        if (operation is None or one.operation == operation)
        and all(name in one.fields and one.fields[name] == v for name, v in (where or {}).items())
    ]
    of = f" of {operation}" if operation is not None else ""
    if where:
        of += " with " + ", ".join(f"{name}={value!r}" for name, value in where.items())
    return seen, of


def _listing(seen: list[ProviderRequest], source: Source) -> str:
    everything = _requests(source)
    if not everything:
        return "It saw no request at all."
    lines = [f"It saw {len(everything)} request{'s' if len(everything) != 1 else ''}:"]
    lines += [f"  {number}. {one}" for number, one in enumerate(everything, 1)]
    if len(seen) != len(everything):
        lines.append(f"({len(seen)} of them match.)")
    return "\n".join(lines)


def _why(effects: list[ProviderRequest]) -> str:
    """What a double effect tells about the tool, read from the keys its effects carried."""
    keys = [one.key for one in effects]
    if all(key is None for key in keys):
        return (
            "None of them carried an idempotency key, so nothing could tell a retry from a new "
            "request: protect the tool with twiceshy, and hand the provider "
            "twiceshy.current_key() (KEYED) or declare the tool UNSAFE."
        )
    if len(set(keys)) == len(keys):
        return (
            "Each carried another key: a key made per attempt (a fresh uuid4(), a timestamp) names "
            "a new request every time; hand the provider twiceshy.current_key() instead."
        )
    if len(set(keys)) == 1:
        return (
            "They all carried one key, and the provider took each: a provider that does not "
            "deduplicate by the key makes the tool UNSAFE, not KEYED."
        )
    return "Some carried a key and some another, or none."


def assert_took_effect_once(
    source: Source, /, *, operation: str | None = None, where: Mapping[str, Any] | None = None
) -> ProviderRequest:
    """Assert that exactly one request took effect, however many were made.

    Args:
        source: a :class:`FakeProvider`, a :class:`LoseAnswers`, or their requests.
        operation: count only this operation's requests (``"charge"``).
        where: count only requests whose fields hold these values (``{"amount": 4900}``).

    Returns:
        The one request that took effect.

    Raises:
        AssertionError: none or several took effect; the message lists every request seen,
            with its key and what became of it, and what the keys say about the tool.
    """
    __tracebackhide__ = True
    seen, of = _matching(source, operation, where)
    effects = [one for one in seen if one.took_effect]
    if len(effects) == 1:
        return effects[0]
    if not effects:
        message = f"expected one effect{of}, saw none."
    else:
        message = f"expected one effect{of}, saw {len(effects)}. {_why(effects)}"
    raise AssertionError(f"{message}\n{_listing(seen, source)}")


def assert_no_effect(
    source: Source, /, *, operation: str | None = None, where: Mapping[str, Any] | None = None
) -> None:
    """Assert that no request took effect (they may have been made, refused, or failed).

    Args:
        source: a :class:`FakeProvider`, a :class:`LoseAnswers`, or their requests.
        operation: look only at this operation's requests.
        where: look only at requests whose fields hold these values.

    Raises:
        AssertionError: some took effect; the message lists every request seen.
    """
    __tracebackhide__ = True
    seen, of = _matching(source, operation, where)
    effects = [one for one in seen if one.took_effect]
    if effects:
        message = f"expected no effect{of}, saw {len(effects)}."
        raise AssertionError(f"{message}\n{_listing(seen, source)}")


def assert_same_key(
    source: Source,
    /,
    *,
    key: str | None = None,
    operation: str | None = None,
    where: Mapping[str, Any] | None = None,
) -> str:
    """Assert that every request carried one and the same idempotency key.

    Every attempt counts: retries in place, takeovers, deduplicated repeats, failed and
    refused requests.

    Args:
        source: a :class:`FakeProvider`, a :class:`LoseAnswers`, or their requests.
        key: the key they must all carry (``twiceshy.idempotency_key(scope, tool, args)``).
        operation: look only at this operation's requests.
        where: look only at requests whose fields hold these values.

    Returns:
        The key.

    Raises:
        AssertionError: no request was made, one carried no key, or they carried several (or
            not ``key``); the message lists every request seen.
    """
    __tracebackhide__ = True
    seen, of = _matching(source, operation, where)
    keys = list(dict.fromkeys(one.key for one in seen))
    wanted = "one key" if key is None else f"the key {shown_key(key)}"
    if not seen:
        message = f"expected {wanted} on every request{of}; no request was made."
    elif None in keys:
        missing = sum(one.key is None for one in seen)
        message = f"expected {wanted} on every request{of}; {missing} of {len(seen)} had none."
    elif len(keys) > 1:
        shown = ", ".join(shown_key(one) for one in keys)
        message = f"expected {wanted} on every request{of}; they had {len(keys)}: {shown}."
    elif key is not None and keys[0] != key:
        message = f"expected {wanted} on every request{of}; they had {shown_key(keys[0])}."
    else:
        return str(keys[0])
    raise AssertionError(f"{message}\n{_listing(seen, source)}")
