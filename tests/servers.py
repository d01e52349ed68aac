"""The PostgreSQL and Redis servers the tests use, and what happens when one is missing.

Tests that need a server ask :func:`require`: where the server does not answer, the test is
skipped with a message naming what is missing — unless ``TWICESHY_REQUIRE_SERVERS=1`` (set by
``.ci/run``), which turns the skip into a failure so CI always tests the real servers.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlsplit

import pytest

POSTGRES_URL = os.environ.get("TWICESHY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TWICESHY_TEST_REDIS", "redis://127.0.0.1:6379/0")

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@functools.cache
def _answers(url: str) -> str | None:
    """``None`` when a TCP connection to the URL's host and port succeeds, else why not."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    if host not in _LOOPBACK:
        return f"{host} is not a loopback address; tests only ever use loopback servers"
    try:
        with socket.create_connection((host, port or 0), timeout=2):
            return None
    except OSError as exc:
        return f"nothing answers on {host}:{port} ({exc})"


def require(kind: str) -> str:
    """The URL of the server ``kind`` ("postgres" or "redis"), or skip (fail in CI) without it."""
    url = {"postgres": POSTGRES_URL, "redis": REDIS_URL}[kind]
    missing = _answers(url)
    if missing is None:
        return url
    message = f"{kind} server needed: {missing}"
    if os.environ.get("TWICESHY_REQUIRE_SERVERS") == "1":
        pytest.fail(f"{message} (TWICESHY_REQUIRE_SERVERS=1)")
    pytest.skip(message)


def drop_schema(url: str, schema: str) -> None:
    """Drop a test's PostgreSQL schema and everything in it."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def delete_prefix(url: str, prefix: str) -> None:
    """Delete a test's Redis keys: every key under ``prefix``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
