"""twiceshy's pytest plugin: a ledger and a provider double as fixtures.

``pip install twiceshy`` registers it (the ``pytest11`` entry point
``twiceshy.testing.plugin``, named as its module, so that ``pytest_plugins =
["twiceshy.testing.plugin"]`` finds it loaded; ``-p no:twiceshy.testing.plugin`` turns it off).
Loading it imports nothing but pytest and twiceshy's core and kit: a test that asks for none of
its fixtures runs as it would without the plugin.

Fixtures:

- ``twiceshy_ledger``: a fresh :class:`~twiceshy.Ledger`, closed after the test. In memory by
  default; ``@pytest.mark.twiceshy_ledger("sqlite")`` gives a SQLite file in the test's
  ``tmp_path``, ``@pytest.mark.twiceshy_ledger("postgresql://...", remember=100)`` any URL and
  ledger options, and the ini option ``twiceshy_ledger`` sets the default for a whole run.
- ``twiceshy_ledger_factory``: opens more ledgers, ``twiceshy_ledger_factory(url, **options)``,
  closed after the test; two ledgers on one URL act as two processes sharing it.
- ``fake_provider``: a fresh :class:`~twiceshy.testing.FakeProvider`;
  ``@pytest.mark.fake_provider(deduplicate=True)`` makes it deduplicate by key.

A ledger on a server (any URL but ``memory://`` and the test's own SQLite file) gets a namespace
of the test's own unless ``namespace=`` is given, so runs and tests sharing one server never
replay each other's records; those records stay until their retention ends. An async test that
used a server ledger's async connections closes them itself (``await ledger.aclose()``) on its
own event loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported by the fixtures that use them, not when the plugin loads
    from twiceshy import Ledger
    from twiceshy.testing import FakeProvider

__all__ = ["fake_provider", "twiceshy_ledger", "twiceshy_ledger_factory"]

_INI = "twiceshy_ledger"
_DEFAULT = "memory://"


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ini option ``twiceshy_ledger``: the ``twiceshy_ledger`` fixture's default URL."""
    parser.addini(
        _INI,
        "the ledger URL of the twiceshy_ledger fixture: memory:// (the default), sqlite (a "
        "file in the test's tmp_path), or any ledger URL",
        default=_DEFAULT,
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the plugin's markers (so ``--strict-markers`` accepts them)."""
    config.addinivalue_line(
        "markers",
        "twiceshy_ledger(url='memory://', **options): the URL ('memory', 'sqlite' or a ledger "
        "URL) and twiceshy.Ledger options of the twiceshy_ledger fixture",
    )
    config.addinivalue_line(
        "markers",
        "fake_provider(deduplicate=False): the options of the fake_provider fixture",
    )


@pytest.fixture
def twiceshy_ledger_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Ledger]]:
    """Opens ledgers: ``twiceshy_ledger_factory(url="memory://", **options)``.

    ``url`` may be ``"memory"``, ``"sqlite"`` (the file ``ledger.db`` in the test's
    ``tmp_path``: every ledger opened on it shares it) or any ledger URL; ``options`` are
    :class:`~twiceshy.Ledger`'s. Every ledger it opened is closed after the test.
    """
    from twiceshy import Ledger

    opened: list[Ledger] = []
    namespace = f"test-{secrets.token_hex(6)}"

    def open_ledger(url: str = _DEFAULT, **options: Any) -> Ledger:
        if not isinstance(url, str):
            raise TypeError(f"the ledger URL must be a str, not {url!r}")
        if url in ("memory", _DEFAULT):
            url = _DEFAULT
        elif url == "sqlite":
            url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'ledger.db'}"
        else:  # a server others may share: records of their own
            options.setdefault("namespace", namespace)
        ledger = Ledger(url, **options)
        opened.append(ledger)
        return ledger

    yield open_ledger
    for ledger in reversed(opened):
        ledger.close()


@pytest.fixture
def twiceshy_ledger(
    request: pytest.FixtureRequest, twiceshy_ledger_factory: Callable[..., Ledger]
) -> Ledger:
    """A fresh ledger for the test, closed afterwards: ``memory://`` unless told otherwise.

    ``@pytest.mark.twiceshy_ledger(url, **options)`` names another URL (``"sqlite"``: a file in
    the test's ``tmp_path``) and :class:`~twiceshy.Ledger` options; the ini option
    ``twiceshy_ledger`` sets the URL for every test that names none.
    """
    url = str(request.config.getini(_INI) or _DEFAULT)
    options: dict[str, Any] = {}
    marker = request.node.get_closest_marker("twiceshy_ledger")
    if marker is not None:
        options = dict(marker.kwargs)
        url = options.pop("url", url)
        if len(marker.args) > 1:
            raise TypeError("@pytest.mark.twiceshy_ledger takes one URL; options by name")
        if marker.args:
            url = marker.args[0]
    return twiceshy_ledger_factory(url, **options)


@pytest.fixture
def fake_provider(request: pytest.FixtureRequest) -> FakeProvider:
    """A fresh provider double; ``@pytest.mark.fake_provider(deduplicate=True)`` for KEYED."""
    from twiceshy.testing import FakeProvider

    marker = request.node.get_closest_marker("fake_provider")
    return FakeProvider(**(marker.kwargs if marker is not None else {}))
