"""The PostgreSQL and Redis servers the tests use, and what happens when one is missing.

Tests that need a server ask :func:`require`: where the server does not answer, the test is
skipped with a message naming what is missing — unless ``TWICESHY_REQUIRE_SERVERS=1`` (set by
``.ci/run``), which turns the skip into a failure so CI always tests the real servers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

POSTGRES_URL = os.environ.get("TWICESHY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TWICESHY_TEST_REDIS", "redis://127.0.0.1:6379/0")
#: Started by ``.ci/servers/redis-cluster.sh``: three masters and three replicas, 7101-7106.
REDIS_CLUSTER_URL = os.environ.get("TWICESHY_TEST_REDIS_CLUSTER", "redis+cluster://127.0.0.1:7101")
#: Started by ``.ci/servers/pgbouncer.sh``: transaction pooling in front of POSTGRES_URL's server.
PGBOUNCER_URL = os.environ.get(
    "TWICESHY_TEST_PGBOUNCER", "postgresql://postgres@127.0.0.1:6432/test"
)
#: Started by ``.ci/servers/dynalite.sh``: dynalite, a DynamoDB-protocol server, in memory.
DYNAMODB_URL = os.environ.get("TWICESHY_TEST_DYNAMODB", "http://127.0.0.1:4567")
#: The table the DynamoDB store tests share (each under a prefix of its own), and the region
#: and fake credentials every test gives (dynalite accepts any; nothing else reads them).
DYNAMODB_TABLE = "twiceshy_test"
DYNAMODB_OPTIONS = {
    "region": "us-east-1",
    "aws_access_key_id": "twiceshy-test",
    "aws_secret_access_key": "twiceshy-test-secret",
}

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
    """The URL of the server ``kind`` ("postgres", "redis", "redis-cluster", "pgbouncer" or
    "dynamodb"), or skip (fail in CI) without it."""
    url = {
        "postgres": POSTGRES_URL,
        "redis": REDIS_URL,
        "redis-cluster": REDIS_CLUSTER_URL,
        "pgbouncer": PGBOUNCER_URL,
        "dynamodb": DYNAMODB_URL,
    }[kind]
    missing = _answers(url.split(",", 1)[0])  # of several hosts, the first
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
    """Delete a test's Redis keys: every key under ``prefix`` (on every node of a cluster)."""
    import redis

    if url.startswith("redis+cluster://"):
        from redis.cluster import RedisCluster

        cluster = RedisCluster.from_url("redis://" + url.split("://", 1)[1].split(",", 1)[0])
        try:
            for key in list(cluster.scan_iter(match=f"{prefix}*", count=1000)):
                cluster.delete(key)  # one at a time: the keys lie in many slots
        finally:
            cluster.close()
        return
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def dynamodb_url(table: str = DYNAMODB_TABLE, **options: str) -> str:
    """A ``dynamodb://`` ledger URL for the test server, with the tests' region and credentials."""
    from urllib.parse import urlencode

    query = {"endpoint_url": DYNAMODB_URL, **DYNAMODB_OPTIONS, **options}
    return f"dynamodb://{table}?{urlencode(query)}"


@functools.cache
def dynamodb_client() -> Any:
    """A plain boto3 client of the test server, for looking behind a store's back (one per
    process: boto3's clients are thread-safe, and slow to make)."""
    import boto3

    return boto3.client(
        "dynamodb",
        endpoint_url=DYNAMODB_URL,
        region_name=DYNAMODB_OPTIONS["region"],
        aws_access_key_id=DYNAMODB_OPTIONS["aws_access_key_id"],
        aws_secret_access_key=DYNAMODB_OPTIONS["aws_secret_access_key"],
    )


def delete_dynamodb_prefix(prefix: str, table: str = DYNAMODB_TABLE) -> None:
    """Delete a test's DynamoDB items: every item whose key begins with ``prefix``."""
    client = dynamodb_client()
    pages = client.get_paginator("scan").paginate(
        TableName=table,
        FilterExpression="begins_with(pk, :p)",
        ExpressionAttributeValues={":p": {"S": prefix + "#"}},
        ProjectionExpression="pk",
    )
    try:
        for page in pages:
            for item in page["Items"]:
                client.delete_item(TableName=table, Key={"pk": item["pk"]})
    except client.exceptions.ResourceNotFoundException:
        pass  # the test failed before any store made the table


@contextlib.contextmanager
def dynamodb_prefix() -> Iterator[str]:
    """A key prefix of a test's own in the shared DynamoDB table (skips, or fails in CI,
    without a server); its items are deleted afterwards."""
    require("dynamodb")
    name = f"twiceshy-test-{secrets.token_hex(6)}"
    yield name
    delete_dynamodb_prefix(name)
