"""A ledger URL's secrets never reach a repr, a log line or an error."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

import twiceshy
from twiceshy.stores import redacted_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cr@t@db:5432/ledger", "postgresql://app:***@db:5432/ledger"),
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        (
            "postgresql://app@db/ledger?password=hunter2&sslmode=require",
            "postgresql://app@db/ledger?password=***&sslmode=require",
        ),
        ("redis://h:99999999/0?PASSWORD=x#top", "redis://h:99999999/0?PASSWORD=***#top"),
        ("rediss://h/0?ssl_password=x&ssl=1", "rediss://h/0?ssl_password=***&ssl=1"),
        ("sqlite:///var/lib/ledger.db", "sqlite:///var/lib/ledger.db"),
        ("postgresql://app@db/ledger", "postgresql://app@db/ledger"),
    ],
)
def test_a_url_is_shown_without_its_secrets(url: str, shown: str) -> None:
    """The user part's password and secret query parameters become ***, even in a URL that
    does not parse; everything else is kept."""
    assert redacted_url(url) == shown


def test_a_mistyped_scheme_does_not_show_the_password() -> None:
    """The ValueError of an unknown scheme names the URL redacted."""
    with pytest.raises(ValueError, match="unknown ledger URL") as refused:
        twiceshy.Ledger("postgersql://app:hunter2@db/ledger")
    assert "hunter2" not in str(refused.value)
    assert "postgersql://app:***@db/ledger" in str(refused.value)


@pytest.mark.postgres
def test_a_ledger_and_its_guards_show_no_password(pg: tuple[str, str]) -> None:
    """repr(Ledger) and repr(Guard) of a ledger opened with a password keep it out."""
    url, schema = pg
    parts = urlsplit(url)
    user = parts.username or "postgres"
    netloc = f"{user}:hunter2@{parts.hostname}:{parts.port or 5432}"
    query = f"{parts.query}&schema={schema}" if parts.query else f"schema={schema}"
    with twiceshy.Ledger(urlunsplit(parts._replace(netloc=netloc, query=query))) as ledger:
        guard = ledger.guard("wire", effect=twiceshy.UNSAFE)
        for text in (repr(ledger), repr(guard)):
            assert "hunter2" not in text
            assert f"{user}:***@" in text
