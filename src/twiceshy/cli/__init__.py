"""The ``twiceshy`` command line (the ``cli`` extra: click and rich).

An operator's view of a ledger: list records (``ls``), inspect one (``show``), settle a parked one
(``resolve``), remove expired outcomes (``gc``) and count what is there (``stats``); ``reconcile``
asks the tools' reconcilers about parked records; and ``demo``, the re-enacted double charge.
Every ledger command takes ``--ledger URL`` (or ``TWICESHY_LEDGER``) and ``--namespace NS``.

Exit codes:
    0: done.
    1: refused or not found: an unknown key, an ambiguous prefix, a record that may not be
       resolved, a resolve that lost a race, a ledger URL naming a file or schema that holds no
       twiceshy ledger.
    2: usage: a bad option, a bad ledger URL (click's own usage errors included).
    3: the ledger cannot be reached or used.
    141: the reader of the output went away (``twiceshy ls | head -1``): the command stops
       quietly, as a Unix tool killed by ``SIGPIPE`` does (128 + 13).

Every error is one line on stderr; no traceback; no URL's password or secret query parameter.
What the ledger holds is printed with its control characters escaped (``\\x1b``, ``\\u009b``;
JSON's ``\\u`` escapes under ``--json``): stored text cannot drive the operator's terminal. The
ledger commands never create a ledger: they open the store with ``create=False``.

Installed without the extra (``pip install twiceshy``), the package still imports and
:func:`main` is a stand-in that prints one line naming the extra (``pip install
'twiceshy[cli]'``) and exits 2; the other names raise :class:`ImportError` saying the same
(:mod:`twiceshy.cli.extra`).

The modules: ``group`` (the command group), ``options`` (the shared options), one per command
family (``listing``: ls and show; ``resolving``, ``gc``, ``stats``, ``reconcile``, ``demo``, with
``double_charge`` the story it re-enacts), and what they share: ``ledger`` (opening the store,
finding a record), ``render`` (the terminal), ``json_forms`` (``--json``)
and ``exits`` (exit codes and errors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .extra import MISSING

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_REFUSED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "RESOLVE_ERROR_TYPE",
    "BadUsage",
    "CommandError",
    "LedgerUnavailable",
    "main",
    "parse_duration",
]

# mypy reads the first branch only (TYPE_CHECKING is true for it); the second is what an install
# without click or rich runs.
if TYPE_CHECKING or MISSING is None:
    from .exits import (
        EXIT_BROKEN_PIPE,
        EXIT_REFUSED,
        EXIT_UNAVAILABLE,
        EXIT_USAGE,
        BadUsage,
        CommandError,
        LedgerUnavailable,
    )
    from .group import main
    from .options import parse_duration
    from .resolving import RESOLVE_ERROR_TYPE
else:
    # The console script and ``python -m twiceshy`` import main: it says which extra to install.
    from .extra import main_without_the_extra as main
    from .extra import needs_the_extra

    def __getattr__(name: str) -> object:
        if name in __all__:
            needs_the_extra(name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
