"""The test DynamoDB server (dynalite, started by .ci/servers/dynalite.sh) outlives clients that
reset their connections: the DynamoDB fault tests kill clients and cut connections, and a server
that died at the first reset would take every later DynamoDB test with it.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

import servers
import twiceshy

pytestmark = pytest.mark.dynamodb

BODY = b'{"Limit": 1}'
HEAD = (
    b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Amz-Target: DynamoDB_20120810.ListTables\r\n"
    b"Content-Type: application/x-amz-json-1.0\r\nContent-Length: %d\r\n\r\n" % len(BODY)
)
#: What a client sent before it reset the connection: part of the headers, the headers and part
#: of the body, a whole request (reset before its answer is read).
SENT = (HEAD[:40], HEAD + BODY[:3], HEAD + BODY)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own in the shared table; its items are deleted afterwards."""
    with servers.dynamodb_prefix() as name:
        yield name


def reset_after(sent: bytes) -> None:
    """Connect to the test server, send ``sent``, then reset the connection (SO_LINGER 0)."""
    parts = urlsplit(servers.DYNAMODB_URL)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), 5) as sock:
        sock.sendall(sent)
        time.sleep(0.05)  # the server has read it and is waiting for the rest (or answering)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_the_server_answers_after_clients_reset_their_connections(prefix: str) -> None:
    """Connections reset mid-headers, mid-body and before the answer leave dynalite answering."""
    for _ in range(3):
        for sent in SENT:
            reset_after(sent)
    time.sleep(0.2)  # a server that dies of the resets is gone by now
    ledger = twiceshy.Ledger(servers.dynamodb_url(prefix=prefix), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> int:
        runs.append(amount)
        return amount

    try:
        with twiceshy.run("reset"):
            assert charge(5) == 5
            assert charge(5) == 5
    finally:
        ledger.close()
    assert runs == [5]
