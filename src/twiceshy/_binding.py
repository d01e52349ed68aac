"""Binding a call's arguments to the tool's signature by name (docs/design.md §2).


Positional and keyword spellings of one call give one mapping, an omitted parameter with a
default gives the default, and injected parameters (framework contexts, the key itself) are left
out. ``key_args=`` narrows what names the intent, the other arguments kept as the fingerprint;
``ignore_args=`` leaves volatile arguments out of both.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ._canonical import MAX_BYTES, MAX_DEPTH, _canonical, canonical_digest
from .errors import UnkeyableValue

__all__ = [
    "Binder",
    "BoundCall",
    "calls_point_of_no_return",
    "names_its_key",
    "refuse_generator",
    "warn_if_keyless",
]

log = logging.getLogger("twiceshy")


def _names(fn: Callable[..., Any], wanted: str) -> bool | None:
    """Whether the code of ``fn`` (or of a function defined inside it) names ``wanted``;
    ``None`` when ``fn`` has no Python code to read (a builtin, a C extension's callable)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:  # an object whose __call__ is the tool
        call = getattr(type(fn), "__call__", None)  # noqa: B004 - the method, not callable()
        code = getattr(call, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    pending = [code]
    while pending:
        code = pending.pop()
        if wanted in code.co_names:
            return True
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def calls_point_of_no_return(fn: Callable[..., Any]) -> bool:
    """Whether the code of ``fn`` (or of a function defined inside it) names
    ``point_of_no_return``: such a tool says where its effect starts (``effect_at="mark"``)."""
    return _names(fn, "point_of_no_return") is True


def names_its_key(fn: Callable[..., Any], key_param: str | None = None) -> bool:
    """Whether a KEYED tool's code can hand its key on: it has the key parameter, or its code
    (or a function defined inside it) names ``current_key``. ``True`` when there is no code to
    read: only a tool that visibly never mentions its key is worth a warning."""
    if key_param is not None:
        return True
    return _names(fn, "current_key") is not False


def warn_if_keyless(
    fn: Callable[..., Any], tool: str, *, key_param: str | None = None, effect_at: str | None
) -> bool:
    """Log a warning, at declaration, for a KEYED tool whose code never mentions its key (no key
    parameter, no ``current_key``) and that sends through no twiceshy transport
    (``effect_at="http"``): its provider cannot deduplicate what it does. Whether it warned."""
    if effect_at == "http" or names_its_key(fn, key_param):
        return False
    log.warning(
        "twiceshy: the tool %r is declared KEYED, but its code never reads its idempotency key: "
        "hand twiceshy.current_key() to its provider (or take an idempotency_key parameter, or "
        "send through a twiceshy HTTP transport and declare effect_at='http'); a KEYED tool "
        "whose attempt did not hand its key on is not retried, and answers as an UNSAFE one",
        tool,
    )
    return True


def refuse_generator(
    fn: Callable[..., Any] | None,
    tool: str,
    *,
    error: type[Exception] = TypeError,
    consumed: Literal["sync", "async"] | None = None,
    wrapped: bool = False,
) -> None:
    """Refuse a generator or async-generator function as a recorded tool: calling it runs none
    of its body, so its call would be recorded as done before its effects, which would then run
    as its caller iterates, outside any claim (docs/design.md §4).

    Args:
        fn: the tool's function (an object whose ``__call__`` is the tool is read so); ``None``
            passes.
        tool: its name, for the message.
        error: the kind of error to raise (an adapter's own ``TypeError``).
        consumed: the kind a framework consumes inside the call the ledger wraps, whose body
            therefore runs within the claim: it passes.
        wrapped: also read the function ``fn`` wraps (``__wrapped__``), for a framework that
            looks through wrappers itself. Off by default: a wrapper that collects a
            generator's items is no generator, and one that returns a generator is caught when
            called (the intent is released, nothing ran).

    Raises:
        TypeError: ``fn`` is such a function (``error``).
    """
    if fn is None:
        return
    kinds = {_generates(fn)}
    if wrapped:
        with contextlib.suppress(ValueError):  # a cycle of __wrapped__: fn is all there is
            kinds.add(_generates(inspect.unwrap(fn)))
    if kinds - {None, consumed}:
        raise error(
            f"the tool {tool!r} is a generator function: calling it runs none of its body, so "
            "twiceshy would record it as done before its effects, which would then run as its "
            "caller iterates, outside any claim. Return a list (collect the items inside the "
            "tool), or protect the function that makes the effect"
        )


def _generates(fn: Callable[..., Any]) -> Literal["sync", "async"] | None:
    """Which kind of generator function ``fn`` is, if it is one."""
    if not (inspect.isroutine(fn) or isinstance(fn, functools.partial)):
        fn = getattr(type(fn), "__call__", fn)  # noqa: B004 - an object whose __call__ is the tool
    if inspect.isasyncgenfunction(fn):
        return "async"
    return "sync" if inspect.isgeneratorfunction(fn) else None


# Made per call and never changed, but not frozen: a frozen dataclass pays a setattr per field.
@dataclass(slots=True)
class BoundCall:
    """One call's arguments, by parameter name.

    Attributes:
        arguments: every argument but the injected ones, defaults applied.
        keyed: the arguments that name the intent (all of them unless narrowed).
        fingerprinted: the arguments a retry must repeat: all but the ignored ones.
        explicit_key: a key the caller passed through the key parameter, if any.
    """

    arguments: dict[str, Any]
    keyed: dict[str, Any]
    fingerprinted: dict[str, Any]
    explicit_key: str | None

    @classmethod
    def of(
        cls,
        arguments: Mapping[str, Any],
        *,
        key_args: frozenset[str] | None = None,
        ignore_args: frozenset[str] = frozenset(),
        explicit_key: str | None = None,
    ) -> BoundCall:
        """A call given by its arguments' mapping, narrowed by ``key_args`` / ``ignore_args``."""
        full = arguments if type(arguments) is dict else dict(arguments)
        if key_args is not None:
            keyed = {k: v for k, v in full.items() if k in key_args}
            return cls(full, keyed, full, explicit_key)
        if ignore_args:
            kept = {k: v for k, v in full.items() if k not in ignore_args}
            return cls(full, kept, kept, explicit_key)
        return cls(full, full, full, explicit_key)

    def identity(
        self,
        scope: str | None,
        tool: str,
        *,
        max_depth: int = MAX_DEPTH,
        max_bytes: int = MAX_BYTES,
    ) -> tuple[str | None, str]:
        """The intent's key (``None`` without a scope) and the arguments' fingerprint.

        The key is :func:`~twiceshy.idempotency_key` of ``(scope, tool, keyed)``; the fingerprint
        is the SHA-256 of ``f"{tool}:{canonical_json(fingerprinted)}"``. Where both name the same
        arguments the canonical text is made once. Narrowed by ``key_args=``, only the keyed
        arguments are bounded by ``max_bytes``: the others are hashed as their text is written,
        never held whole.

        Raises:
            UnkeyableArgument: an argument has no canonical form (or is beyond ``max_depth`` /
                ``max_bytes``), or the scope cannot be hashed.
        """
        text, data = _canonical(self.keyed, max_depth, max_bytes)
        body = text.encode() if data is None else data
        if self.keyed is self.fingerprinted:
            digest = hashlib.sha256(f"{tool}:".encode())
            digest.update(body)
            fingerprint = digest.hexdigest()
        else:
            head = f"{tool}:".encode()
            fingerprint = canonical_digest(self.fingerprinted, head, max_depth=max_depth)
        if scope is None:
            return None, fingerprint
        try:
            head = f"{scope}:{tool}:".encode()
        except UnicodeEncodeError:
            raise UnkeyableValue("scope", f"contains a lone surrogate: {scope!r}") from None
        digest = hashlib.sha256(head)
        digest.update(body)
        return digest.hexdigest(), fingerprint


class Binder:
    """Binds calls of one function; built once per tool.

    Args:
        fn: the tool.
        key_param: the parameter through which the key is injected (and may be passed
            explicitly), or ``None``.
        inject: other parameters the framework fills in, left out of the key.
        key_args: checked to name parameters of the tool (the guard narrows the key by them).
        ignore_args: checked likewise.

    Raises:
        ValueError: ``key_args`` or ``ignore_args`` name parameters the tool does not have, or
            both are given.
    """

    __slots__ = (
        "_count",
        "_defaults",
        "_in_order",
        "_injected",
        "_key_param",
        "_positional",
        "_signature",
        "_simple",
    )

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
        params = list(self._signature.parameters.values())
        plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        # Most tools take plain named parameters: bind those without inspect's general machinery.
        self._simple = all(p.kind in plain for p in params)
        self._positional = tuple(
            p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._in_order = tuple(p.name for p in params if p.kind in by_position)
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self._count = len(params)

    @property
    def key_param(self) -> str | None:
        """The parameter the key is injected through, if the tool has one."""
        return self._key_param

    def bind(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], str | None]:
        """Bind one call: its arguments by name (injected ones left out), and an explicit key.

        Raises:
            TypeError: the arguments do not fit the signature.
        """
        simple = self._bind_simple(args, kwargs) if self._simple else None
        if simple is None:
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            named = bound.arguments
        else:
            named = simple
        explicit = None
        if self._key_param is not None:
            given = named.get(self._key_param)
            # The parameter's own default (None, or "" in a typed spelling) is "no key given".
            if given is not None and given is not self._defaults.get(self._key_param):
                if not isinstance(given, str) or not given:
                    raise TypeError(f"{self._key_param} must be a non-empty string")
                explicit = given
        if simple is not None:
            # Plain named parameters (no *args): the mapping is this call's own, made above.
            for name in self._injected:
                simple.pop(name, None)
            return simple, explicit
        arguments: dict[str, Any] = {}
        for name, value in named.items():
            if name in self._injected:
                continue
            kind = self._signature.parameters[name].kind
            # A tuple of *args is a list to the key; **kwargs stays one nested mapping.
            arguments[name] = list(value) if kind is inspect.Parameter.VAR_POSITIONAL else value
        return arguments, explicit

    def _bind_simple(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Bind plain named parameters; ``None`` sends the call to ``inspect`` for its error."""
        if len(args) > len(self._positional):
            return None
        named = dict(zip(self._positional, args, strict=False))
        for name, value in kwargs.items():
            if name in named or name not in self._signature.parameters:
                return None
            named[name] = value
        if len(named) < self._count:
            for name, default in self._defaults.items():
                named.setdefault(name, default)
            if len(named) < self._count:
                return None
        return named

    def with_injected(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with a stand-in for each injected parameter given neither way:
        a framework may keep its injected values to itself, and they name nothing anyway."""
        given = set(kwargs) | set(self._in_order[: len(args)])
        parameters = self._signature.parameters
        missing = [
            name
            for name in self._injected
            if name in parameters
            and name not in given
            and parameters[name].kind
            not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if not missing:
            return args, dict(kwargs)
        # A positional-only injected parameter (a context first) takes its place in args.
        named = dict(kwargs)
        positional = list(args)
        for name in missing:
            kind = self._signature.parameters[name].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.insert(self._in_order.index(name), None)
            else:
                named[name] = None
        return tuple(positional), named

    def call_args(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], key: str
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments to run the tool with, the key injected through its key parameter."""
        if self._key_param is None:
            return args, dict(kwargs)
        if self._simple:
            if self._key_param in self._positional:
                index = self._positional.index(self._key_param)
                if index < len(args):
                    return (*args[:index], key, *args[index + 1 :]), dict(kwargs)
            return args, {**kwargs, self._key_param: key}
        bound = self._signature.bind(*args, **kwargs)
        bound.arguments[self._key_param] = key
        return bound.args, bound.kwargs
