"""Binding a call's arguments to the tool's signature by name (DESIGN.md §2, "Which arguments").

Positional and keyword spellings of one call give one mapping, an omitted parameter with a
default gives the default, and injected parameters (framework contexts, the key itself) are left
out. ``key_args=`` / ``ignore_args=`` narrow what names the intent; the full mapping is always kept
as the fingerprint.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ._canonical import canonical_json

__all__ = ["Binder", "BoundCall"]


@dataclass(frozen=True, slots=True)
class BoundCall:
    """One call's arguments, by parameter name.

    Attributes:
        arguments: every argument but the injected ones, defaults applied.
        keyed: the arguments that name the intent (all of them unless narrowed).
        explicit_key: a key the caller passed through the key parameter, if any.
    """

    arguments: dict[str, Any]
    keyed: dict[str, Any]
    explicit_key: str | None

    def fingerprint(self, tool: str) -> str:
        """The SHA-256 of the tool name and the full canonical arguments."""
        text = f"{tool}:{canonical_json(self.arguments)}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Binder:
    """Binds calls of one function; built once per tool.

    Args:
        fn: the tool.
        key_param: the parameter through which the key is injected (and may be passed
            explicitly), or ``None``.
        inject: other parameters the framework fills in, left out of the key.
        key_args: when given, only these parameters name the intent.
        ignore_args: parameters left out of the intent (volatile ones: a timestamp, a trace id).

    Raises:
        ValueError: ``key_args`` or ``ignore_args`` name parameters the tool does not have, or
            both are given.
    """

    __slots__ = ("_ignored", "_injected", "_key_param", "_keyed", "_signature")

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        key_param: str | None = None,
        inject: Collection[str] = (),
        key_args: Collection[str] | None = None,
        ignore_args: Collection[str] = (),
    ) -> None:
        self._signature = inspect.signature(fn)
        names = set(self._signature.parameters)
        if key_args is not None and ignore_args:
            raise ValueError("give key_args= or ignore_args=, not both")
        for option, given in (("key_args", key_args or ()), ("ignore_args", ignore_args)):
            unknown = sorted(set(given) - names)
            if unknown:
                raise ValueError(f"{option}= names parameters the tool does not have: {unknown}")
        self._key_param = key_param if key_param in names else None
        self._injected = frozenset(inject) | (
            {self._key_param} if self._key_param is not None else frozenset()
        )
        self._keyed = frozenset(key_args) if key_args is not None else None
        self._ignored = frozenset(ignore_args)

    @property
    def key_param(self) -> str | None:
        """The parameter the key is injected through, if the tool has one."""
        return self._key_param

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BoundCall:
        """Bind one call.

        Raises:
            TypeError: the arguments do not fit the signature.
        """
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        explicit = None
        if self._key_param is not None:
            given = bound.arguments.get(self._key_param)
            if given is not None:
                if not isinstance(given, str) or not given:
                    raise TypeError(f"{self._key_param} must be a non-empty string")
                explicit = given
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if name in self._injected:
                continue
            kind = self._signature.parameters[name].kind
            # A tuple of *args is a list to the key; **kwargs stays one nested mapping.
            arguments[name] = list(value) if kind is inspect.Parameter.VAR_POSITIONAL else value
        if self._keyed is not None:
            keyed = {k: v for k, v in arguments.items() if k in self._keyed}
        elif self._ignored:
            keyed = {k: v for k, v in arguments.items() if k not in self._ignored}
        else:
            keyed = arguments
        return BoundCall(arguments, keyed, explicit)

    def call_args(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], key: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments to run the tool with, the key injected through its key parameter."""
        if self._key_param is None:
            return args, dict(kwargs)
        bound = self._signature.bind(*args, **kwargs)
        bound.arguments[self._key_param] = key
        return bound.args, bound.kwargs
