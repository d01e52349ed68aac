"""In-process state a forked child must not inherit, reset in the child right after the fork.

A child forked while calls run in other threads of its parent gets copies of their in-process
state: locks that may be held (by threads that do not exist in the child, so never released),
flights that never land, leases of calls that are not running there. Objects that keep such
state register here and are reset in the child by ``os.register_at_fork``, before the child
runs anything else. (The stores keep their own connections apart by process id.)
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    """An object whose state is reset in a forked child."""

    def _after_fork_in_child(self) -> None: ...


_TRACKED: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def reset_in_children(obj: ForkAware) -> None:
    """Have ``obj._after_fork_in_child()`` called in every child forked from now on."""
    _TRACKED.add(obj)


def _reset() -> None:
    for obj in list(_TRACKED):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # every POSIX system; Windows has no fork
    os.register_at_fork(after_in_child=_reset)
