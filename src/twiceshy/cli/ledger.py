"""The ledger a command works on: opening its store, reading its clock, finding a record.

The commands never create a ledger: a store is opened with ``create=False`` and a SQLite URL
naming no file is refused, so an operator's typo cannot become a new, empty ledger. A bad URL,
no ledger there, or a store that cannot be reached becomes a one-line error (exit 2, 1 or 3),
its secrets hidden.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

from .._records import Record
from .._redaction import redacted, scrubbed
from ..errors import LedgerNotFound, StoreError
from ..stores import Store, default_url, open_store
from ..stores.sqlite._errors import slash_rule
from .exits import BadUsage, CommandError, LedgerUnavailable
from .render import short_width

__all__ = ["find_record", "lease_lapsed", "open_ledger_store", "opened", "store_now"]


def open_ledger_store(url: str, *, create: bool = False) -> Store:
    """Open the store ``url`` names; a bad URL, no ledger there, or an unreachable store
    becomes a :class:`~twiceshy.cli.exits.CommandError` (exit 2, 1 or 3)."""
    shown = redacted(url)
    try:
        store, _ = open_store(url, create=create)
    except (ValueError, TypeError) as exc:
        # A driver refuses parameters it does not know with a TypeError (redis-py's from_url).
        raise BadUsage(f"bad ledger URL {shown}: {scrubbed(str(exc), url)}") from exc
    except ImportError as exc:
        raise LedgerUnavailable(f"cannot open the ledger {shown}: {exc}") from exc
    except LedgerNotFound as exc:
        # Nothing was created: an operator's typo must not become a new, empty ledger.
        raise CommandError(f"{scrubbed(str(exc), url)} ({shown})") from exc
    except StoreError as exc:
        message = scrubbed(str(exc), url)
        raise LedgerUnavailable(f"cannot open the ledger {shown}: {message}") from exc
    return store


@contextmanager
def opened(ledger_url: str | None) -> Iterator[Store]:
    """Open the ledger's store for one command; store failures become one-line errors."""
    url = ledger_url or default_url()
    shown = redacted(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise BadUsage(f"bad ledger URL {shown}: {scrubbed(str(exc), url)}") from exc
    if parts.scheme.lower() == "memory":
        raise BadUsage(
            f"{shown} is a ledger inside one process: the command line cannot see its records"
        )
    if parts.scheme.lower() == "sqlite" and not parts.netloc and parts.path.startswith("/"):
        # Opening a file creates it: an operator's typo must not become a new, empty ledger.
        path = unquote(parts.path[1:])
        if path and not os.path.exists(path):
            where = os.path.abspath(path)
            # A mistyped URL: say which file was looked for, and how URLs spell paths.
            rule = "" if os.path.isdir(os.path.dirname(where)) else f"; {slash_rule()}"
            raise LedgerUnavailable(f"no ledger file at {where!r} ({shown}){rule}")
    store = open_ledger_store(url)
    try:
        yield store
    except StoreError as exc:
        message = scrubbed(str(exc), url)
        raise LedgerUnavailable(f"the ledger {shown} failed: {message}") from exc
    finally:
        store.close()


def store_now(store: Store, namespace: str) -> float:
    """The store's clock: every answer of a store carries it, a read of no key included."""
    return store.get(namespace, "").now


def find_record(store: Store, namespace: str, key: str) -> tuple[Record, float]:
    """The live record whose key is ``key`` or starts with it, and the store's clock.

    Raises:
        CommandError: no such record, or the prefix matches several.
    """
    if not key:
        raise BadUsage("give a key, or the first characters of one")
    snap = store.get(namespace, key)
    if snap.record is not None:
        return snap.record, snap.now
    matches = [r for r in store.records(namespace) if r.key.startswith(key)]
    if not matches:
        raise CommandError(f"no record with a key starting {key!r} in namespace {namespace!r}")
    if len(matches) > 1:
        width = short_width([r.key for r in matches])
        shown = ", ".join(r.key[:width] for r in matches[:5])
        more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        raise CommandError(
            f"the key prefix {key!r} is ambiguous: it matches {len(matches)} records "
            f"({shown}{more}); give more characters"
        )
    return matches[0], snap.now


def lease_lapsed(record: Record, now: float) -> bool | None:
    """Whether the record's lease has lapsed on the store's clock (``None``: it has none)."""
    if record.lease_deadline is None:
        return None
    return record.lease_deadline <= now
