"""Tools with reconcilers, for ``twiceshy reconcile`` (``tests.reconcile_tools:tools``).

The provider is a double: a dict of objects by id, kept in the JSON file named by
``TWICESHY_TEST_PROVIDER`` so that a ``twiceshy reconcile`` subprocess sees what the test's calls
created. Every tool "creates" an object there with the call's key in its metadata, as a Stripe
tool would; the test can make the next call time out before or after creating it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import twiceshy
from twiceshy.reconcilers import stripe_like

PROVIDER_ENV = "TWICESHY_TEST_PROVIDER"


class Provider:
    """The provider double: objects by id, runs by tool, a scripted timeout for the next call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists():
            self._save({"objects": {}, "runs": {}, "timeout": None})

    def _load(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.path.read_text())
        return data

    def _save(self, data: dict[str, Any]) -> None:
        self.path.write_text(json.dumps(data))

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        """The objects the provider holds, by id."""
        objects: dict[str, dict[str, Any]] = self._load()["objects"]
        return objects

    def runs(self, tool: str) -> int:
        """How often ``tool`` really ran."""
        return int(self._load()["runs"].get(tool, 0))

    def time_out(self, when: str) -> None:
        """Make the next call raise ``TimeoutError`` ``"before"`` or ``"after"`` creating."""
        data = self._load()
        data["timeout"] = when
        self._save(data)

    def create(self, tool: str, amount: int, *, status: str = "succeeded") -> dict[str, Any]:
        """Run ``tool`` at the provider: an object with the call's key in its metadata."""
        data = self._load()
        data["runs"][tool] = data["runs"].get(tool, 0) + 1
        timeout, data["timeout"] = data["timeout"], None
        if timeout == "before":
            self._save(data)
            raise TimeoutError("the provider did not answer")
        obj = {
            "id": f"pi_{len(data['objects']) + 1}",
            "amount": amount,
            "status": status,
            "metadata": {"twiceshy_key": twiceshy.current_key()},
        }
        data["objects"][obj["id"]] = obj
        self._save(data)
        if timeout == "after":
            raise TimeoutError("the provider did not answer")
        return obj

    def find(self, key: str) -> Mapping[str, Any] | None:
        """The object whose metadata holds ``key``, as Stripe's search by metadata finds it."""
        for obj in self.objects.values():
            if obj["metadata"]["twiceshy_key"] == key:
                return obj
        return None


def provider() -> Provider:
    """The provider double of this process (its file from ``TWICESHY_TEST_PROVIDER``)."""
    return Provider(Path(os.environ[PROVIDER_ENV]))


def find(key: str) -> Mapping[str, Any] | None:
    """Look the key up at the provider double."""
    return provider().find(key)


def unreachable(key: str, arguments: Mapping[str, Any] | None) -> Any:
    """A reconciler whose provider is down (its error names the arguments it was given)."""
    raise ConnectionError(f"provider API unreachable, asked about {arguments}")


def make_tools(ledger: twiceshy.Ledger) -> dict[str, Any]:
    """The tools, protected by ``ledger``."""

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(find))
    def charge(amount: int) -> dict[str, Any]:
        return provider().create("charge", amount)

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(find, absent_means_not_applied=True))
    def wire(amount: int) -> dict[str, Any]:
        return provider().create("wire", amount)

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=unreachable)
    def refund(amount: int) -> dict[str, Any]:
        return provider().create("refund", amount)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def mail(amount: int) -> dict[str, Any]:
        return provider().create("mail", amount)

    return {"charge": charge, "wire": wire, "refund": refund, "mail": mail}


# What the command line imports. This module's own ledger is in memory: `twiceshy reconcile`
# must settle the records of the ledger it is given, not of the one the tools were made with.
tools = make_tools(twiceshy.Ledger("memory://"))
refund = tools["refund"]
guards = [tools["charge"].twiceshy, tools["wire"].twiceshy]
unreconciled = [tools["mail"]]
not_tools = [tools["charge"], 42]
