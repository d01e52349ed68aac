"""The PostgreSQL store under faults: silent networks, unreachable servers, closed event loops,
and a write whose answer is lost after its record expired. Against a real server.

Every test works in a schema of its own, dropped afterwards; proxies listen on 127.0.0.1 only;
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
import time
from typing import Any

import psycopg
import pytest

from twiceshy import Change, Effect, State
from twiceshy.errors import StoreError, StoreUnavailable
from twiceshy.stores.postgres import AsyncPostgresStore, PostgresStore, open_postgres
from twiceshy.stores.postgres._ops import ConnectionLost, write_op

pytestmark = pytest.mark.postgres

NS = "tenant"
KEY = "key-1"
CLAIMED = frozenset({State.CLAIMED})
# Short libpq TCP settings: a connection whose bytes go unacknowledged fails after 1 s.
FAST_TCP = "tcp_user_timeout=1000&keepalives_idle=1&keepalives_interval=1&keepalives_count=1"


class StallProxy:
    """A TCP proxy on 127.0.0.1 to the test server; ``stall()`` makes it a silent network.

    Once stalled it reads nothing more from either side. Its receive buffers are small, so a
    peer's further bytes go unacknowledged, as over a partition (a proxy that went on reading
    would acknowledge them itself, and no TCP setting of the client could tell).
    """

    def __init__(self, url: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(url)
        self.target = (str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.stalled = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` pointed at this proxy."""
        host, port = self.target
        return url.replace(f"{host}:{port}", f"127.0.0.1:{self.port}", 1)

    def stall(self) -> None:
        """Stop forwarding in both directions, without closing anything."""
        self.stalled.set()

    def refuse(self) -> None:
        """Stop listening: new connections are refused."""
        # shutdown() wakes the accept() blocked in the proxy's thread; close() alone would not.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def close(self) -> None:
        """Close every socket and release the forwarding threads."""
        self.closed.set()
        self.stalled.set()
        self.refuse()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.stalled.is_set():
                data = a.recv(4096)
                if not data or self.stalled.is_set():
                    break
                b.sendall(data)
        except OSError:
            return
        self.closed.wait(60)  # stalled: read nothing more until the test ends


def in_thread(call: Any, timeout: float) -> tuple[bool, Any, float]:
    """Run ``call`` in a thread for at most ``timeout``: (finished, result or error, seconds)."""
    got: list[Any] = []
    started = time.monotonic()

    def run() -> None:
        try:
            got.append(call())
        except Exception as exc:
            got.append(exc)
        got.append(time.monotonic() - started)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, None, timeout
    return True, got[0], got[1]


def tcp_options(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """The TCP options the kernel holds for a connection's socket."""
    sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        return {
            "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        }
    finally:
        sock.close()


def backends(url: str, application_name: str) -> int:
    """How many server backends carry ``application_name``."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def claim(store: PostgresStore, key: str = KEY, fingerprint: str = "fp") -> Any:
    """Claim ``key`` in the test namespace."""
    return store.claim(
        NS, key, fingerprint=fingerprint, tool="t", effect=Effect.KEYED, owner="o", lease=30
    )


# -- silent networks ---------------------------------------------------------------------------


def test_connections_carry_tcp_keepalives_and_a_user_timeout(pg: tuple[str, str]) -> None:
    """Every connection gives up on a silent peer after about 30 s unless the URL says else."""
    url, schema = pg
    expected = {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 4,
        "tcp_user_timeout": 30_000,
    }
    store = PostgresStore(url, schema=schema)
    try:
        with store._pool.connection() as conn:
            assert tcp_options(conn) == expected
    finally:
        store.close()

    async def main() -> dict[str, int]:
        twin = AsyncPostgresStore(url, schema=schema)
        try:
            state = await twin._state()
            async with state.pool.connection() as conn:
                return tcp_options(conn)
        finally:
            await twin.close()

    assert asyncio.run(main()) == expected


def test_libpq_parameters_in_the_url_win_over_keyword_defaults(pg: tuple[str, str]) -> None:
    """A URL's own application_name, connect_timeout and TCP settings are kept, not replaced."""
    url, schema = pg
    app = f"twiceshy-own-{secrets.token_hex(4)}"
    store = PostgresStore(
        f"{url}?application_name={app}&connect_timeout=3&tcp_user_timeout=1234", schema=schema
    )
    try:
        assert claim(store).won
        assert backends(url, app) >= 1
        with store._pool.connection() as conn:
            params = conn.info.get_parameters()
            options = tcp_options(conn)
        assert params["connect_timeout"] == "3"
        assert options["tcp_user_timeout"] == 1234
        assert options["keepalives_idle"] == 10  # the store's default where the URL is silent
    finally:
        store.close()


def test_claim_and_wait_during_a_partition_fail_within_seconds(pg: tuple[str, str]) -> None:
    """Over a network gone silent, a claim and a wait raise StoreError within seconds.

    The statements are large so that their bytes go unacknowledged (see StallProxy); libpq's
    TCP settings from the URL then end them.
    """
    url, schema = pg
    proxy = StallProxy(url)
    store = PostgresStore(f"{proxy.url(url)}?{FAST_TCP}", schema=schema, connect_timeout=2)
    try:
        assert claim(store).won
        proxy.stall()
        big = "x" * 1_000_000
        finished, answer, seconds = in_thread(lambda: claim(store, "k2", fingerprint=big), 20)
        assert finished, "the claim blocked over a silent network"
        assert isinstance(answer, StoreError), answer
        assert seconds < 15
        finished, answer, seconds = in_thread(lambda: store.wait(NS, big, 1, 2.0), 20)
        assert finished, "the wait blocked over a silent network"
        assert isinstance(answer, StoreError), answer
        assert seconds < 15
    finally:
        proxy.close()
        store.close()


# -- the async store's first calls and event loops ----------------------------------------------


def test_concurrent_first_async_calls_on_an_unreachable_server_raise_unavailable(
    pg: tuple[str, str],
) -> None:
    """Calls waiting together for a pool that cannot open all raise StoreUnavailable.

    Not psycopg's PoolClosed, nor "closed": the calls queued behind the failed open share its
    error.
    """
    url, schema = pg
    proxy = StallProxy(url)
    try:
        store, twin = open_postgres(f"{proxy.url(url)}?schema={schema}&connect_timeout=1")
        store.close()
        proxy.refuse()

        async def main() -> list[Any]:
            try:
                calls = asyncio.gather(
                    *(twin.get(NS, KEY) for _ in range(3)), return_exceptions=True
                )
                return list(await asyncio.wait_for(calls, 20))
            finally:
                await twin.close()

        started = time.monotonic()
        answers = asyncio.run(main())
        assert time.monotonic() - started < 10
    finally:
        proxy.close()
    assert len(answers) == 3
    assert all(isinstance(answer, StoreUnavailable) for answer in answers), answers


def test_async_store_closes_its_connections_with_each_event_loop(pg: tuple[str, str]) -> None:
    """After 10 asyncio.run calls the server holds none of the store's connections."""
    url, schema = pg
    app = f"twiceshy-loops-{secrets.token_hex(4)}"
    store = AsyncPostgresStore(url, schema=schema, application_name=app, min_size=2)

    async def once(i: int) -> int:
        snap = await store.claim(
            NS, f"k{i}", fingerprint="fp", tool="t", effect=Effect.KEYED, owner="o", lease=30
        )
        assert snap.won
        await store.wait(NS, f"k{i}", 1, 0.05)  # starts this loop's listener
        return backends(url, app)

    inside = [asyncio.run(once(i)) for i in range(10)]
    assert min(inside) >= 1  # each loop did connect
    left = backends(url, app)
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # a backend leaves pg_stat_activity just after its client closes
        left = backends(url, app)
    assert left == 0
    assert max(inside) <= 3  # never the connections of earlier loops


# -- a lost write on an expired record -----------------------------------------------------------


def test_lost_write_recognised_even_after_its_record_expired(pg: tuple[str, str]) -> None:
    """G9/G10: a write that committed, lost its answer, and expired before the retry is won."""
    url, schema = pg
    now = [1_700_000_000.0]
    store = PostgresStore(url, schema=schema, clock=lambda: now[0])
    try:
        assert claim(store).won
        change = Change(1, CLAIMED, State.SUCCEEDED, owner="o", result='"ok"', ttl=0.5)
        op = write_op(store._st, store._now, NS, KEY, change)
        with psycopg.connect(url, autocommit=True) as conn:
            step = next(op)
            conn.execute(step.query, step.params)  # committed; its answer never arrives
            now[0] += 1.0  # past the retention before the retry
            step = op.throw(ConnectionLost("cut"))
            rows = conn.execute(step.query, step.params).fetchall()
        with pytest.raises(StopIteration) as stop:
            op.send(rows)
        snap = stop.value.value
        assert snap.won  # not "gone", which would claim afresh and run the work again
        assert snap.record is not None
        assert (snap.record.state, snap.record.result) == (State.SUCCEEDED, '"ok"')
        # Another outcome is not mistaken for this one after a lost connection.
        other = Change(1, CLAIMED, State.SUCCEEDED, owner="o", result='"other"', ttl=0.5)
        op = write_op(store._st, store._now, NS, KEY, other)
        with psycopg.connect(url, autocommit=True) as conn:
            next(op)
            step = op.throw(ConnectionLost("cut"))
            rows = conn.execute(step.query, step.params).fetchall()
        with pytest.raises(StopIteration) as stop:
            op.send(rows)
        assert not stop.value.value.won
    finally:
        store.close()
