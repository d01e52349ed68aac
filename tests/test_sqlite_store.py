"""What the SQLite store promises beyond the contract: settings, files, and races for real."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from twiceshy._records import Change, Effect, Snapshot, State
from twiceshy.errors import LedgerNotFound, StoreError, StoreUnavailable
from twiceshy.stores import open_store
from twiceshy.stores.sqlite import SQLiteStore, has_wal_reset_bug

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Barrier

NS = "ns"
KEY = "key"
BUGGY = has_wal_reset_bug(sqlite3.sqlite_version_info)


def _claim(store: SQLiteStore, owner: str, key: str = KEY, lease: float = 60.0) -> Snapshot:
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.KEYED, owner=owner, lease=lease
    )


def _file_journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A path for a ledger file that does not exist yet."""
    return tmp_path / "state" / "ledger.db"


# -- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "buggy"),
    [
        ((3, 7, 0), True),
        ((3, 40, 1), True),
        ((3, 44, 5), True),
        ((3, 44, 6), False),
        ((3, 44, 9), False),
        ((3, 45, 0), True),
        ((3, 50, 6), True),
        ((3, 50, 7), False),
        ((3, 51, 0), True),
        ((3, 51, 2), True),
        ((3, 51, 3), False),
        ((3, 52, 0), False),
        ((4, 0, 0), False),
    ],
)
def test_wal_reset_bug_versions(version: tuple[int, int, int], buggy: bool) -> None:
    """The WAL-reset bug is recognised exactly in the affected SQLite releases."""
    assert has_wal_reset_bug(version) is buggy


def test_default_journal_mode_falls_back_on_buggy_sqlite(db: Path) -> None:
    """By default the store picks DELETE on a SQLite with the WAL-reset bug, else WAL."""
    store = SQLiteStore(db)
    try:
        expected = "delete" if BUGGY else "wal"
        assert store.journal_mode == expected
        assert _file_journal_mode(db) == expected
    finally:
        store.close()


def test_this_machine_gets_the_rollback_journal(db: Path) -> None:
    """This machine's SQLite has the WAL-reset bug, so the rollback journal runs here."""
    if not BUGGY:
        pytest.skip(f"SQLite {sqlite3.sqlite_version} is fixed")
    store = SQLiteStore(db)
    try:
        assert store.journal_mode == "delete"
    finally:
        store.close()


def test_wal_when_forced(db: Path) -> None:
    """journal_mode='wal' forces WAL, even on a SQLite with the WAL-reset bug."""
    store = SQLiteStore(db, journal_mode="WAL")
    try:
        assert store.journal_mode == "wal"
        assert _file_journal_mode(db) == "wal"
        assert _claim(store, "alice").won
    finally:
        store.close()


def test_synchronous_is_full_by_default(db: Path) -> None:
    """Every connection runs with synchronous=FULL unless told otherwise."""
    store = SQLiteStore(db)
    try:
        assert store.synchronous == "FULL"
        with store._connection() as conn:
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
            assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000
    finally:
        store.close()


def test_from_url_paths_and_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sqlite:///rel is relative, sqlite:////abs absolute; query parameters become settings."""
    monkeypatch.chdir(tmp_path)
    relative = SQLiteStore.from_url("sqlite:///rel/ledger.db")
    try:
        assert relative.path == "rel/ledger.db"
        assert (tmp_path / "rel" / "ledger.db").is_file()
    finally:
        relative.close()
    absolute = tmp_path / "abs dir" / "ledger.db"
    url = f"sqlite:///{absolute}?journal_mode=wal&synchronous=extra&busy_timeout=2.5"
    assert url.startswith("sqlite:////")
    store = SQLiteStore.from_url(url)
    try:
        assert store.path == str(absolute)
        assert store.journal_mode == "wal"
        assert store.synchronous == "EXTRA"
        with store._connection() as conn:
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == 3
            assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 2_500
    finally:
        store.close()


def test_open_store_builds_sqlite(tmp_path: Path) -> None:
    """open_store('sqlite:///...') answers an SQLiteStore and its async twin."""
    blocking, twin = open_store(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        assert isinstance(blocking, SQLiteStore)
        assert _claim(blocking, "alice").won
    finally:
        blocking.close()
    del twin


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///",
        "sqlite://host/ledger.db",
        "sqlite:///ledger.db?cache=shared",
        "sqlite:///ledger.db?busy_timeout=soon",
        "sqlite:///ledger.db?synchronous=full&synchronous=off",
        "sqlite:///:memory:",
        "postgresql:///ledger",
    ],
)
def test_from_url_refuses_bad_urls(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL with no file, a host, or an unknown parameter is refused before opening anything."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"."):
        SQLiteStore.from_url(url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "settings",
    [{"synchronous": "sometimes"}, {"journal_mode": "off"}, {"journal_mode": "memory"}],
)
def test_bad_settings_are_refused(db: Path, settings: dict[str, Any]) -> None:
    """Settings that would weaken the ledger or mean nothing are refused."""
    with pytest.raises(ValueError, match=r"."):
        SQLiteStore(db, **settings)


# -- files ----------------------------------------------------------------------------------


def test_unreachable_path_raises_at_construction(tmp_path: Path) -> None:
    """A path under a regular file cannot be created: StoreUnavailable, chained, at once."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(StoreUnavailable) as caught:
        SQLiteStore(blocker / "ledger.db")
    assert isinstance(caught.value.__cause__, OSError)


def test_unopenable_file_raises_at_construction(tmp_path: Path) -> None:
    """A path SQLite cannot open raises StoreUnavailable chained from the sqlite3 error."""
    directory = tmp_path / "ledger.db"
    directory.mkdir()
    with pytest.raises(StoreUnavailable) as caught:
        SQLiteStore(directory)
    assert isinstance(caught.value.__cause__, sqlite3.OperationalError)


def test_not_a_database_raises_store_error(tmp_path: Path) -> None:
    """A file that is not a database raises StoreError chained from the driver."""
    path = tmp_path / "ledger.db"
    path.write_bytes(b"definitely not sqlite" * 500)
    with pytest.raises(StoreError) as caught:
        SQLiteStore(path)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)


def test_schema_version_is_recorded_and_checked(db: Path) -> None:
    """The file records schema version 1; a file of another version is refused."""
    SQLiteStore(db).close()
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        row = conn.execute("SELECT value FROM twiceshy_meta WHERE name = 'schema_version'")
        assert row.fetchone()[0] == "1"
        conn.execute("UPDATE twiceshy_meta SET value = '2' WHERE name = 'schema_version'")
    finally:
        conn.close()
    with pytest.raises(StoreError, match="schema version"):
        SQLiteStore(db)


def test_two_stores_on_one_file_see_each_other(db: Path) -> None:
    """Two store objects on one file share records, and a waiter sees the other's write."""
    first, second = SQLiteStore(db), SQLiteStore(db)
    try:
        claimed = _claim(first, "alice").record
        assert second.get(NS, KEY).record == claimed
        assert not _claim(second, "bob").won

        def settle() -> None:
            time.sleep(0.05)
            change = Change(
                1, frozenset({State.CLAIMED}), State.SUCCEEDED, owner="alice", result="7"
            )
            assert first.write(NS, KEY, change).won

        worker = threading.Thread(target=settle)
        started = time.monotonic()
        worker.start()
        try:
            snap = second.wait(NS, KEY, 1, timeout=10.0)
        finally:
            worker.join()
        assert snap.record is not None
        assert snap.record.result == "7"
        assert time.monotonic() - started < 1.0
    finally:
        first.close()
        second.close()


def test_busy_file_raises_unavailable_and_leaves_no_transaction(db: Path) -> None:
    """A writer locked out past busy_timeout gets StoreUnavailable; the store then recovers."""
    store = SQLiteStore(db, busy_timeout=0.1)
    blocker = sqlite3.connect(db, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable) as caught:
            _claim(store, "alice")
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        blocker.execute("ROLLBACK")
        assert _claim(store, "alice").won
        # The pool holds no connection with a transaction left open.
        with store._connection() as conn:
            assert not conn.in_transaction
    finally:
        blocker.close()
        store.close()


def test_closed_store_refuses_operations(db: Path) -> None:
    """After close, every operation raises StoreError; closing twice is harmless."""
    store = SQLiteStore(db)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get(NS, KEY)


# -- races ----------------------------------------------------------------------------------


def _thread_race(store: SQLiteStore, key: str, threads: int) -> list[Snapshot]:
    barrier = threading.Barrier(threads)
    snaps: list[Snapshot | None] = [None] * threads

    def run(i: int) -> None:
        barrier.wait(timeout=10)
        snaps[i] = _claim(store, f"owner-{i}", key=key)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert all(snap is not None for snap in snaps)
    return [snap for snap in snaps if snap is not None]


def test_thread_race_has_exactly_one_winner(db: Path) -> None:
    """16 threads released together claim one key: exactly one wins, all see its record."""
    store = SQLiteStore(db)
    try:
        for trial in range(5):
            snaps = _thread_race(store, f"key-{trial}", 16)
            winners = [snap.record.owner for snap in snaps if snap.won and snap.record]
            assert len(winners) == 1
            assert {(s.record.owner, s.record.fence) for s in snaps if s.record} == {
                (winners[0], 1)
            }
            assert len(snaps) == 16
    finally:
        store.close()


def _race_worker(
    paths: list[str],
    start: Barrier,
    go: Barrier,
    results: Queue[tuple[Any, ...]],
    owner: str,
    journal_mode: str | None,
) -> None:
    for trial, path in enumerate(paths):
        try:
            start.wait(timeout=20)
            # Opening races too: journal mode, schema creation.
            store = SQLiteStore(path, journal_mode=journal_mode)
            try:
                go.wait(timeout=20)
                snap = _claim(store, owner)
                record = snap.record
                assert record is not None
                results.put((trial, owner, snap.won, record.owner, record.fence))
            finally:
                store.close()
        except BaseException as exc:
            start.abort()
            go.abort()
            results.put((trial, owner, "error", repr(exc), None))
            return


@pytest.mark.slow
@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
@pytest.mark.parametrize("journal_mode", [None, "wal"], ids=["default", "wal"])
def test_process_race_has_exactly_one_winner(tmp_path: Path, journal_mode: str | None) -> None:
    """8 processes released by a barrier open one fresh file and claim one key: one winner.

    Repeated over 20 files, in the default journal mode and in WAL.
    """
    processes, trials = 8, 20
    ctx = multiprocessing.get_context("fork")
    paths = [str(tmp_path / f"race-{trial}" / "ledger.db") for trial in range(trials)]
    start, go = ctx.Barrier(processes), ctx.Barrier(processes)
    results: Queue[tuple[Any, ...]] = ctx.Queue()
    workers = [
        ctx.Process(target=_race_worker, args=(paths, start, go, results, f"p{i}", journal_mode))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        answers = [results.get(timeout=30) for _ in range(processes * trials)]
        for worker in workers:
            worker.join(timeout=10)
            assert worker.exitcode == 0
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        results.close()
        results.join_thread()
    errors = [a for a in answers if a[2] == "error"]
    assert errors == []
    for trial in range(trials):
        got = [a for a in answers if a[0] == trial]
        assert len(got) == processes
        winners = [owner for _, owner, won, _, _ in got if won]
        assert len(winners) == 1, (trial, got)
        assert {(record_owner, fence) for _, _, _, record_owner, fence in got} == {(winners[0], 1)}
        store = SQLiteStore(paths[trial])
        try:
            record = store.get(NS, KEY).record
            assert record is not None
            assert record.owner == winners[0]
        finally:
            store.close()


def _in_forked_child(target: Callable[..., None], *args: Any) -> tuple[Any, ...]:
    """Run ``target(*args, results)`` in a forked child; what it put on ``results``."""
    ctx = multiprocessing.get_context("fork")
    results: Queue[tuple[Any, ...]] = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
    child.start()
    try:
        answer = results.get(timeout=20)
        child.join(timeout=10)
        assert child.exitcode == 0
        return answer
    finally:
        if child.is_alive():
            child.terminate()
            child.join(timeout=5)
        results.close()
        results.join_thread()


def _child_claims(store: SQLiteStore, results: Queue[tuple[Any, ...]]) -> None:
    try:
        snap = _claim(store, "child", key="from-child")
        results.put((snap.won, store._pid == os.getpid()))
    except BaseException as exc:
        results.put(("error", repr(exc)))


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_forked_child_opens_its_own_connections(db: Path) -> None:
    """A store inherited across fork works in the child on fresh connections."""
    store = SQLiteStore(db)
    try:
        assert _claim(store, "parent").won  # the pool now holds a parent connection
        assert _in_forked_child(_child_claims, store) == (True, True)
        snap = store.get(NS, "from-child")
        assert snap.record is not None
        assert snap.record.owner == "child"
        assert store._pid == os.getpid()
    finally:
        store.close()


def test_text_that_is_not_utf8_raises_store_error(db: Path) -> None:
    """A lone surrogate cannot be stored as UTF-8: StoreError, and the record is unchanged."""
    store = SQLiteStore(db)
    try:
        record = _claim(store, "alice").record
        change = Change(1, frozenset({State.CLAIMED}), State.SUCCEEDED, result='"\ud800"')
        with pytest.raises(StoreError) as caught:
            store.write(NS, KEY, change)
        assert isinstance(caught.value.__cause__, UnicodeEncodeError)
        assert store.get(NS, KEY).record == record
    finally:
        store.close()


# -- opening without creating ---------------------------------------------------------------


def test_create_false_refuses_a_missing_file_and_creates_nothing(db: Path) -> None:
    """create=False on a path with no file raises LedgerNotFound; no file, no directory made."""
    with pytest.raises(LedgerNotFound, match=r"no twiceshy ledger at .*: there is no such file"):
        open_store(f"sqlite:///{db}", create=False)
    assert not db.parent.exists()


def _other_application(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO users (name) VALUES ('ada')")
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        pytest.param(_other_application, "holds no twiceshy tables", id="other-app"),
        pytest.param(lambda path: path.write_bytes(b""), "holds no twiceshy tables", id="empty"),
        pytest.param(
            lambda path: path.write_bytes(b"not sqlite" * 500),
            "is not an SQLite database",
            id="not-a-database",
        ),
    ],
)
def test_create_false_leaves_a_file_without_a_ledger_untouched(
    tmp_path: Path, make: Callable[[Path], object], why: str
) -> None:
    """create=False on a file that is no ledger raises LedgerNotFound and changes no byte of it."""
    path = tmp_path / "app.db"
    make(path)
    before = path.read_bytes()
    with pytest.raises(LedgerNotFound, match=f"no twiceshy ledger at .*app.db'.*: the file {why}"):
        SQLiteStore(path, create=False)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no -wal, no -journal


def test_create_false_opens_an_existing_ledger_as_before(db: Path) -> None:
    """create=False opens a ledger that is there, and adds the call counts table older ones lack."""
    SQLiteStore(db).close()
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("DROP TABLE twiceshy_counts")
    finally:
        conn.close()
    store, _ = open_store(f"sqlite:///{db}", create=False)
    try:
        assert isinstance(store, SQLiteStore)
        assert store.journal_mode == ("delete" if BUGGY else "wal")
        assert _claim(store, "alice").won
        store.add_counts(NS, {("charge", "executed"): 1})
        assert store.counts(NS) == {("charge", "executed"): 1}
    finally:
        store.close()
    again = SQLiteStore(db, create=False)
    try:
        assert again.get(NS, KEY).record is not None
    finally:
        again.close()


def test_create_false_never_makes_the_file_again(db: Path) -> None:
    """A create=False store whose file is deleted fails its next claim and makes no new file."""
    SQLiteStore(db).close()
    store = SQLiteStore(db, create=False)
    try:
        _remove_ledger_files(db)
        with pytest.raises(LedgerNotFound, match="there is no such file"):
            _claim(store, "alice")
        assert list(db.parent.iterdir()) == []
    finally:
        store.close()


# -- the file under the store ---------------------------------------------------------------


def _remove_ledger_files(path: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def test_a_deleted_ledger_file_is_not_claimed_in_by_a_store_that_had_it_open(
    db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After ``rm``, an open store claims in the file a new process makes, not the unlinked one."""
    old = SQLiteStore(db)
    try:
        assert _claim(old, "early", key="warm").won  # the pool holds a connection to the file
        _remove_ledger_files(db)
        new = SQLiteStore(db)  # a process started after the rm: a fresh ledger
        try:
            assert _claim(new, "new-process").won
            snap = _claim(old, "old-process")
            assert not snap.won  # without the check, it won a claim in the unlinked file
            assert snap.record is not None
            assert snap.record.owner == "new-process"
            assert "deleted or replaced" in caplog.text
            # What the old store writes from now on, the new one reads.
            assert _claim(old, "old-process", key="later").won
            later = new.get(NS, "later").record
            assert later is not None
            assert later.owner == "old-process"
        finally:
            new.close()
    finally:
        old.close()


def test_a_replaced_ledger_file_is_followed_by_an_open_store(db: Path) -> None:
    """A file moved into place (a restore) is the one an open store writes to from then on."""
    store = SQLiteStore(db)
    try:
        assert _claim(store, "before").won
        restored = db.with_name("restored.db")
        other = SQLiteStore(restored)
        try:
            assert _claim(other, "restored", key="from-backup").won
        finally:
            other.close()
        os.replace(restored, db)
        snap = _claim(store, "after", key="from-backup")
        assert not snap.won
        assert snap.record is not None
        assert snap.record.owner == "restored"
        assert store.get(NS, KEY).record is None  # the old file's record went with it
    finally:
        store.close()


def _chdir_and_claim(store: SQLiteStore, where: str, results: Queue[tuple[Any, ...]]) -> None:
    os.chdir(where)
    snap = _claim(store, "child")
    results.put((snap.won, snap.record.owner if snap.record else None))


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_relative_path_names_one_file_after_the_process_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked daemon that does ``chdir("/")`` goes on using the ledger it was given."""
    monkeypatch.chdir(tmp_path)
    store = SQLiteStore("ledger.db")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        assert _claim(store, "parent").won
        # The child's fresh connections open the parent's file: the claim is the parent's.
        assert _in_forked_child(_chdir_and_claim, store, str(elsewhere)) == (False, "parent")
        assert not (elsewhere / "ledger.db").exists()
    finally:
        store.close()


def test_a_journal_mode_other_processes_hold_is_refused_with_a_clear_error(db: Path) -> None:
    """A store asking another journal mode than a file open in WAL says why it cannot open."""
    wal = SQLiteStore(db, journal_mode="wal")
    try:
        assert _claim(wal, "alice").won
        with pytest.raises(StoreUnavailable, match="one journal mode") as caught:
            SQLiteStore(db, journal_mode="delete", busy_timeout=0.2)
        assert "'wal'" in str(caught.value)
        assert "'delete'" in str(caught.value)
        assert _claim(wal, "bob", key="other").won  # the store that holds the file goes on
    finally:
        wal.close()
