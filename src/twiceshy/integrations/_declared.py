"""How an adapter reads what the user declared for each tool: an effect class or a guard.

Every adapter that takes ``effects={name: SAFE | KEYED | UNSAFE | Guard}`` and ``default=``
asks :class:`Declarations` for each tool's guard, and for the names ``effects`` gave that no
tool carries, so that a tool with no class, a guard named for another tool and a name that
matches nothing are refused in the same words everywhere, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .. import Effect, Guard
from ..errors import EffectNotDeclared

__all__ = ["Declarations"]

_CLASSES = "twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE"


class Declarations:
    """The ``effects=`` and ``default=`` an adapter was given, checked once.

    Raises:
        TypeError: ``default`` is not an effect class.
    """

    def __init__(self, effects: Mapping[str, Any] | None, default: object) -> None:
        if default is not None and not isinstance(default, Effect):
            raise TypeError(f"default= must be {_CLASSES}")
        self.effects = dict(effects or {})
        self.default = default
        self._named: set[str] = set()

    def names(self, name: str) -> bool:
        """Whether ``effects`` names ``name``."""
        return name in self.effects

    def guard(
        self,
        name: str,
        make: Callable[[Effect], Guard],
        *,
        shown: str = "",
        guard_names: tuple[str, ...] = (),
    ) -> Guard:
        """The guard of the tool ``name``: the one given, or ``make(effect)`` for its class.

        ``shown``: how the tool is named in an error, when not by ``name``; ``guard_names``:
        the names a guard given for it may carry, when not ``name`` alone.

        Raises:
            EffectNotDeclared: neither ``effects`` nor ``default`` gives it a class.
            ValueError: the guard given is named for another tool.
            TypeError: what ``effects`` gives it is neither an effect class nor a guard.
        """
        shown = shown or name
        declared = self.effects.get(name, self.default)
        if name in self.effects:
            self._named.add(name)
        if declared is None:
            raise EffectNotDeclared(
                f"the tool {shown!r} has no effect class: name it in effects= ({_CLASSES}) or "
                "give default="
            )
        if isinstance(declared, Guard):
            if declared.name not in (guard_names or (name,)):
                raise ValueError(f"the guard for the tool {shown!r} is named {declared.name!r}")
            return declared
        if isinstance(declared, Effect):
            return make(declared)
        raise TypeError(
            f"the effect of {shown!r} must be an effect class ({_CLASSES}) or a "
            f"twiceshy.Guard, not {type(declared).__name__}"
        )

    def check_all_used(self) -> None:
        """Raise ``ValueError`` when ``effects`` names a tool that none of the tools was."""
        unknown = sorted(set(self.effects) - self._named)
        if unknown:
            raise ValueError(f"effects= names tools that are not given: {', '.join(unknown)}")
