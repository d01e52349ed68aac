"""What ``--json`` prints: a record's every field as data, for scripts.

Enums are written by value, times in ISO 8601 UTC, and a stored result or error as the JSON value
it holds. The text itself is printed by :func:`~twiceshy.cli.render.echo_json`, its control
characters escaped.
"""

from __future__ import annotations

import json
from typing import Any

from .._records import Record
from .ledger import lease_lapsed
from .render import iso

__all__ = ["error_of", "json_value", "record_json"]


def json_value(text: str | None) -> Any:
    """A stored JSON text as its value (the text itself where it is not JSON, or nested too
    deeply for Python's parser: no tool's result is, only a text written to the store)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def error_of(text: str | None) -> dict[str, str] | None:
    """A stored error as ``{"type": ..., "message": ...}``."""
    if text is None:
        return None
    data = json_value(text)
    if isinstance(data, dict):
        return {"type": str(data.get("type", "")), "message": str(data.get("message", ""))}
    return {"type": "", "message": str(data)}


def record_json(record: Record, now: float) -> dict[str, Any]:
    """Every field of a record, for scripts: enums by value, times in ISO 8601 UTC."""
    return {
        "namespace": record.namespace,
        "key": record.key,
        "fingerprint": record.fingerprint,
        "tool": record.tool,
        "effect": record.effect.value,
        "state": record.state.value,
        "fence": record.fence,
        "owner": record.owner,
        "lease_deadline": iso(record.lease_deadline),
        "lease_lapsed": lease_lapsed(record, now),
        "attempts": record.attempts,
        "result": json_value(record.result),
        "error": error_of(record.error),
        "reason": record.reason,
        "created_at": iso(record.created_at),
        "updated_at": iso(record.updated_at),
        "expires_at": iso(record.expires_at),
        "args": json_value(record.args),
    }
