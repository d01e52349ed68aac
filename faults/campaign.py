"""A fault campaign against twiceshy's stores, run on demand.

    .venv/bin/python faults/campaign.py [--short] [--stores memory,sqlite,postgres,redis]
                                        [--seed N] [--keep]

For every store and fault it prints trials, calls checked, duplicate executions (an UNSAFE
tool's effect counted twice for one intent, or a KEYED tool's provider double seeing two keys
for one intent), lost outcomes (an acknowledged result or claim that a later call does not find:
another result replayed, or the tool run again), hung calls (answered after the bound, or never)
and wrong errors (an answer the protocol does not allow in that state). It exits 1 when any of
those is seen, 2 when the campaign itself could not run.

The faults: racing processes at a barrier; SIGKILL of the process running a call at the
protocol's points (after the claim, inside the tool before and after its effect, after
recording) and at random instants, then a restart that retries; SIGSTOP past the lease, then
SIGCONT (with and without ``point_of_no_return()``, and with a reconciler); restarts and kills
of the campaign's own PostgreSQL and Redis servers; a loopback proxy that drops or stalls the
reply to a forwarded request; a full disk and power cuts for SQLite, where the machine allows.
PostgreSQL and Redis are the campaign's own servers on free loopback ports, stopped at the end.
See faults/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from harness import STORE, Tally, verdict  # noqa: E402

import servers  # noqa: E402

CTX = mp.get_context("forkserver")
LEASE = 0.6  # short, so that lapses come quickly; the heartbeat renews it while a tool runs
WAIT = 4 * LEASE + 2  # a retry waits out a dead owner's lease instead of answering InProgress
HUNG = 30.0  # a call answered later than this is hung (every timeout of the stores is shorter)
CHILD_BOUND = 120.0  # a child process still running after this is killed, its calls hung
POINTS = ("after-claim", "before-effect", "after-effect", "after-record")
KINDS = ("UNSAFE", "KEYED")
CONTROL = "server kill -9, no AOF (control)"


@dataclass(frozen=True)
class Plan:
    """How many trials of each fault."""

    racers: int
    race_rounds: int
    kills: int
    pauses: int
    server: int
    proxy: int
    disk: int
    cuts: int


SHORT = Plan(racers=4, race_rounds=6, kills=1, pauses=1, server=2, proxy=3, disk=2, cuts=2)
FULL = Plan(racers=6, race_rounds=300, kills=25, pauses=10, server=25, proxy=30, disk=20, cuts=20)


class Child:
    """One child process running :func:`harness.child`, with its two pipes."""

    def __init__(self, spec: dict[str, Any], barrier: Any = None) -> None:
        rx, tx = CTX.Pipe(duplex=False)
        go_rx, self._go = CTX.Pipe(duplex=False)
        self.proc = CTX.Process(target=harness.child, args=(spec, tx, go_rx, barrier), daemon=True)
        self.proc.start()
        tx.close()  # the parent's copies: a dead child's pipe then reads as closed
        go_rx.close()
        self._rx = rx

    def expect(self, kind: str, timeout: float = 60) -> tuple[Any, ...] | None:
        """The next message of this kind, or None (the child died, or the time ran out)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                if not self._rx.poll(left):
                    return None
                message = self._rx.recv()
            except (EOFError, OSError):
                return None
            if message[0] == "failed":
                raise RuntimeError(f"a child could not open its ledger: {message[1]}")
            if message[0] == kind:
                return tuple(message)
        return None

    def go(self) -> None:
        """Let the child go on past where it waits."""
        with contextlib.suppress(OSError):
            self._go.send(("go",))

    def signal(self, sig: int) -> None:
        """Send a signal to the child (by its own pid)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid or 0, sig)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.proc.exitcode is None:
            self.signal(signal.SIGKILL)
        self.proc.join(10)
        self.close()

    def finish(self, timeout: float = CHILD_BOUND) -> bool:
        """Wait for the child to end; one still running then is killed (False)."""
        self.proc.join(timeout)
        ended = self.proc.exitcode is not None
        if not ended:
            self.signal(signal.SIGCONT)
            self.kill()
        self.close()
        return ended

    def close(self) -> None:
        """Close the parent's ends of the pipes."""
        self._rx.close()
        self._go.close()


class Trial:
    """One trial's events file and scope, and the specs of its children."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.scope = secrets.token_hex(6)
        self.log = str(store.work / f"{name}-{self.scope}.jsonl")
        self.name = name
        self.unanswered = 0

    def spec(self, phase: str, calls: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        """A child's spec on this trial's ledger and events file."""
        base = {"url": self.store.url, "log": self.log, "phase": phase, "lease": LEASE}
        return {**base, "wait": WAIT, "calls": calls, **more}

    def calls(self, count: int, kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
        """``count`` intents of this trial, the kinds taking turns."""
        return [{"scope": self.scope, "kind": kinds[n % len(kinds)], "n": n} for n in range(count)]

    def retry(self, calls: list[dict[str, Any]], times: int = 2, **more: Any) -> bool:
        """The restart: a fresh process retries every intent ``times`` times (phase "final")."""
        child = Child(self.spec("final", calls * times, **more))
        done = child.expect("done", CHILD_BOUND) is not None
        self.unanswered += not done
        return child.finish(10) and done

    def judge(self, hung: int = 0, **options: Any) -> Tally:
        """The verdict on this trial (plus calls that never answered)."""
        tally = verdict(
            self.log, hung_after=HUNG, trial=f"{self.store.name}/{self.name}", **options
        )
        tally.trials = 1
        hung += self.unanswered
        tally.hung += hung
        if tally.calls == 0:  # the trial itself went wrong: never a silent pass
            tally.wrong += 1
            tally.notes.append(f"{self.store.name}/{self.name}: no call answered")
        if hung:
            tally.notes.append(f"{self.store.name}/{self.name}: {hung} call(s) never answered")
        return tally


class Store:
    """A store under test: its name, URL, and the servers and proxies the faults use."""

    def __init__(self, name: str, url: str, work: Path, server: Any = None) -> None:
        self.name, self.url, self.work, self.server = name, url, work, server


# -- the faults ----------------------------------------------------------------------------------


def race(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """Racing processes (threads, for memory) at a barrier, every round on new intents."""
    trial = Trial(store, "race")
    rounds = [
        [{"scope": f"{trial.scope}-{r}", "kind": kind, "n": r} for kind in KINDS]
        for r in range(plan.race_rounds)
    ]
    spec = trial.spec("race", [], rounds=rounds, lease=5.0, wait=60.0)
    hung = 0
    if store.name == "memory":
        spec["threads"] = plan.racers
        hung += not Child(spec).finish()
    else:
        barrier = CTX.Barrier(plan.racers)
        racers = [Child(spec, barrier) for _ in range(plan.racers)]
        hung += sum(not racer.finish() for racer in racers)
        trial.retry([call for calls in rounds for call in calls], times=1, lease=5.0)
    tally = trial.judge(hung=hung, unknown_ok=False)
    tally.trials = plan.race_rounds * len(KINDS)
    expected = tally.trials * (plan.racers + (store.name != "memory"))
    if tally.calls < expected:
        tally.hung += expected - tally.calls
        tally.notes.append(f"{store.name}/race: {expected - tally.calls} calls never answered")
    return tally


def kill(store: Store, plan: Plan, rng: random.Random, point: str) -> Tally:
    """SIGKILL the process running a call at ``point`` (or at a random instant), then retry."""
    total = Tally()
    for _ in range(plan.kills):
        for kind in KINDS:
            trial = Trial(store, f"kill-{point}")
            if point == "random":
                calls = trial.calls(6)
                child = Child(trial.spec("fault", calls, hold=True))
                child.expect("ready")
                child.go()
                time.sleep(rng.uniform(0, 0.12))
            else:
                calls = trial.calls(1, (kind,))
                child = Child(trial.spec("fault", calls, stops=[[0, point]]))
                if child.expect("at") is None:
                    total.wrong += 1
                    total.notes.append(f"{store.name}/kill-{point}: never reached {point}")
            child.kill()
            trial.retry(calls)
            total.add(trial.judge())
            if point == "random":
                break
    return total


def pause(store: Store, plan: Plan, rng: random.Random, variant: str) -> Tally:
    """SIGSTOP the owner inside its tool past the lease; another caller comes; SIGCONT.

    ``ponr``: stopped before ``point_of_no_return()``, which must then refuse the effect;
    ``no-ponr``: stopped right before the effect, which it takes on resuming; ``reconcile``:
    as ``no-ponr``, and every caller has a reconciler that asks the provider double.
    """
    total = Tally()
    ponr, reconcile = variant == "ponr", variant == "reconcile"
    for _ in range(plan.pauses):
        for kind in KINDS:
            trial = Trial(store, f"pause-{variant}")
            calls = trial.calls(1, (kind,))
            more = {"ponr": ponr, "reconcile": reconcile}
            stop_at = "after-claim" if ponr else "before-effect"
            owner = Child(trial.spec("fault", calls, stops=[[0, stop_at]], **more))
            if owner.expect("at") is None:
                total.wrong += 1
                total.notes.append(f"{store.name}/pause-{variant}: the owner never got going")
            owner.signal(signal.SIGSTOP)
            try:
                time.sleep(LEASE * 1.6)
                hung = not Child(trial.spec("fault", calls, **more)).finish()
            finally:
                owner.signal(signal.SIGCONT)
            owner.go()
            hung += not owner.finish()
            trial.retry(calls, **more)
            allows = frozenset({"FencedOut"})
            total.add(trial.judge(hung=hung, fault_allows=allows, releases=reconcile))
    return total


def server_fault(store: Store, plan: Plan, rng: random.Random, action: str) -> Tally:
    """Restart (clean) or kill -9 the store's own server while a process makes calls."""
    total = Tally()
    for _ in range(plan.server):
        trial = Trial(store, f"server-{action}")
        calls = trial.calls(10)
        child = Child(trial.spec("fault", calls, hold=True, pause=0.03))
        child.expect("ready")
        child.go()
        time.sleep(rng.uniform(0, 0.3))
        getattr(store.server, action)(down=rng.uniform(0, 0.8))  # calls meanwhile fail
        hung = not child.finish()
        trial.retry(calls)
        total.add(trial.judge(hung=hung, fault_allows=frozenset({STORE})))
    return total


def proxy_fault(store: Store, plan: Plan, rng: random.Random, mode: str) -> Tally:
    """Through a loopback proxy that loses (``drop``) or holds (``stall``) one reply."""
    total = Tally()
    proxy = servers.Proxy(store.server.port)
    stall = 2.5 if store.name == "redis" else 3.0  # Redis: past the URL's socket_timeout=1
    try:
        for _ in range(plan.proxy):
            trial = Trial(store, f"proxy-{mode}")
            calls = trial.calls(8)
            spec = trial.spec("fault", calls, hold=True)
            spec["url"] = proxy.url(store.url)
            child = Child(spec)
            child.expect("ready")
            fired = proxy.fired
            proxy.arm(mode, rng.randint(1, 14), stall)
            child.go()
            hung = not child.finish()
            proxy.disarm()
            trial.retry(calls)
            tally = trial.judge(hung=hung, fault_allows=frozenset({STORE}))
            tally.trials = proxy.fired - fired  # an arm that found no request is no trial
            total.add(tally)
    finally:
        proxy.close()
    return total


# -- disks (SQLite, root only) ---------------------------------------------------------------------


def _sh(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(args, check=True, timeout=timeout, capture_output=True, text=True)
    return done.stdout.strip()


def disk_full(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """A full disk: the ledger on a small tmpfs, filled up while a process makes calls."""
    total = Tally()
    mount = store.work / "full"
    mount.mkdir()
    _sh("mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount))
    try:
        for t in range(plan.disk):
            here = mount / f"t{t}"
            here.mkdir()
            trial = Trial(store, "disk-full")
            trial.store = Store("sqlite", f"sqlite:///{here / 'ledger.db'}", store.work)
            calls = trial.calls(40)
            child = Child(trial.spec("fault", calls, hold=True, result_bytes=4096))
            child.expect("ready")
            filler = mount / "filler"
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                for _ in range(10_000):
                    f.write(b"\0" * 65536)
                    f.flush()
            size = filler.stat().st_size
            os.truncate(filler, max(0, size - rng.randint(0, 160_000)))
            child.go()
            hung = not child.finish()
            filler.unlink()
            trial.retry(calls)
            tally = trial.judge(hung=hung, fault_allows=frozenset({STORE}))
            total.add(tally)
            shutil.rmtree(here)
    finally:
        _sh("umount", str(mount))
    return total


def power_cut(store: Store, plan: Plan, rng: random.Random, query: str = "") -> Tally:
    """Power cuts: the ledger on ext4 on a loop device; at the cut every writer is SIGKILLed
    and the loop device's backing image is copied as it is (what reached the device); the copy
    is then mounted (ext4 replays its journal) and every intent retried on it.

    Mounted with ``commit=60`` so that no periodic journal commit runs while the image is copied.
    """
    total = Tally()
    for t in range(plan.cuts):
        with contextlib.ExitStack() as undo:
            tally = _one_cut(store, rng, query, store.work / f"cut{t}", undo)
        tally.notes = [f"{note} (cut {t})" for note in tally.notes]
        total.add(tally)
    return total


def _one_cut(
    store: Store, rng: random.Random, query: str, here: Path, undo: contextlib.ExitStack
) -> Tally:
    image, cut, live, after = here / "ext4.img", here / "cut.img", here / "live", here / "after"
    live.mkdir(parents=True)
    after.mkdir()
    undo.callback(shutil.rmtree, here, True)
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    _sh("mkfs.ext4", "-q", "-F", str(image))
    loop = _sh("losetup", "-f", "--show", str(image))
    undo.callback(_sh, "losetup", "-d", loop)
    _sh("mount", "-o", "commit=60", loop, str(live))
    mounted = undo.enter_context(contextlib.ExitStack())
    mounted.callback(_sh, "umount", str(live))
    trial = Trial(store, f"power-cut{query}")
    trial.store = Store("sqlite", f"sqlite:///{live / 'ledger.db'}{query}", store.work)
    writers = []
    for w in range(2):
        # Calls come with pauses, as an agent's do: the cut mostly finds a ledger at rest.
        scope = f"{trial.scope}w{w}"
        spec = trial.spec("race", [], hold=True, forever=20.0, scope=scope, pause=0.02)
        writers.append(Child(spec))
    for writer in writers:
        writer.expect("ready")
    for writer in writers:
        writer.go()
    time.sleep(rng.uniform(0.3, 1.2))
    for writer in writers:
        writer.signal(signal.SIGKILL)  # the cut: every writer at once
    for writer in writers:
        writer.kill()
    time.sleep(0.05)  # I/O already submitted completes, as on a device that had taken it
    shutil.copyfile(image, cut)
    mounted.close()
    loop2 = _sh("losetup", "-f", "--show", str(cut))
    undo.callback(_sh, "losetup", "-d", loop2)
    _sh("mount", loop2, str(after))
    undo.callback(_sh, "umount", str(after))
    seen = {e["intent"] for e in harness.events(trial.log) if "intent" in e}
    calls = []
    for intent in sorted(seen):
        scope, kind, n = intent.split("/")
        calls.append({"scope": scope, "kind": kind, "n": int(n)})
    trial.store = Store("sqlite", f"sqlite:///{after / 'ledger.db'}{query}", store.work)
    trial.retry(calls, times=1)
    return trial.judge()


def disk_support(work: Path) -> tuple[str | None, str | None]:
    """Why the disk faults cannot run here (None where they can): (full disk, power cut)."""
    if os.getuid() != 0:
        why = "not running as root (mounting a tmpfs and loop devices needs it)"
        return why, why
    full = None
    probe = work / "probe"
    probe.mkdir()
    try:
        _sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
        _sh("umount", str(probe))
    except (subprocess.SubprocessError, OSError) as exc:
        full = f"cannot mount a tmpfs ({exc})"
    cut = None
    for tool in ("losetup", "mkfs.ext4", "mount"):
        if shutil.which(tool) is None:
            cut = f"{tool} is not installed"
    if cut is None:
        try:
            image = work / "probe.img"
            with open(image, "wb") as f:
                f.truncate(8 << 20)
            _sh("mkfs.ext4", "-q", "-F", str(image))
            loop = _sh("losetup", "-f", "--show", str(image))
            try:
                _sh("mount", loop, str(probe))
                _sh("umount", str(probe))
            finally:
                _sh("losetup", "-d", loop)
            image.unlink()
        except (subprocess.SubprocessError, OSError) as exc:
            cut = f"cannot mount ext4 on a loop device ({exc})"
    probe.rmdir()
    return full, cut


def device_mapper() -> str:
    """What the kernel offers for dm-flakey / dm-log-writes (said beside the power cut rows).

    Read from sysfs: ``dmsetup`` itself would create /dev/mapper/control as a side effect.
    """
    if not Path("/sys/class/misc/device-mapper").exists():
        modules = Path("/lib/modules") / os.uname().release
        loadable = "" if modules.exists() else f", and no modules to load ({modules} is missing)"
        return (
            f"the kernel has no device-mapper (/sys/class/misc/device-mapper is missing{loadable})"
        )
    targets = Path("/proc/device-mapper-targets")  # not a real file on every kernel
    return "device-mapper is there" + (f": {targets.read_text()}" if targets.exists() else "")


def eio_support() -> str:
    """Why the campaign has no EIO fault here."""
    offered = [
        name
        for name, path in (
            ("device-mapper", "/sys/class/misc/device-mapper"),
            ("fail_make_request", "/sys/block/loop0/make-it-fail"),
        )
        if Path(path).exists()
    ]
    if offered:
        return f"the kernel offers {' and '.join(offered)}, which the campaign does not use yet"
    return (
        "this kernel has neither device-mapper (dm-error, dm-flakey) nor fail_make_request, and "
        "a loop device set read-only still takes writes (the kernel only warns)"
    )


# -- running it --------------------------------------------------------------------------------


Fault = tuple[str, Callable[[], Tally]]


def faults_of(store: Store, plan: Plan, rng: random.Random, disks: tuple[str | None, ...]) -> list:  # type: ignore[type-arg]
    """The faults that apply to a store, each as (name, run), and skip lines."""
    out: list[Fault] = []
    skips: list[str] = []

    def add(name: str, fn: Callable[..., Tally], *args: Any) -> None:
        out.append((name, lambda: fn(store, plan, rng, *args)))

    racers = f"{plan.racers} {'threads' if store.name == 'memory' else 'processes'}"
    add(f"race ({racers})", race)
    if store.name == "memory":
        skips.append(
            "memory: kill, pause, server and disk faults do not apply: the ledger lives "
            "and dies with its one process"
        )
        return [out, skips]
    for point in (*POINTS, "random"):
        add(f"kill -9 {point}", kill, point)
    for variant in ("ponr", "no-ponr", "reconcile"):
        add(f"SIGSTOP past lease, {variant}", pause, variant)
    if store.server is not None:
        add("server restart", server_fault, "restart")
        add("server kill -9", server_fault, "kill")
        add("proxy drops reply", proxy_fault, "drop")
        add("proxy stalls reply", proxy_fault, "stall")
    if store.name == "sqlite":
        full, cut = disks
        if full is None:
            add("disk full (tmpfs)", disk_full)
        else:
            skips.append(f"sqlite: disk full skipped: {full}")
        if cut is None:
            add("power cut (default URL)", power_cut)
            if plan is FULL:  # the old default, which loses the last commit: the cut bites
                add("power cut, synchronous=FULL (control)", power_cut, "?synchronous=FULL")
        else:
            skips.append(f"sqlite: power cut skipped: {cut}")
        skips.append(f"sqlite: a failing disk (EIO) is not tried: {eio_support()}")
        skips.append(
            f"sqlite: power cuts copy the loop device's image at the cut: {device_mapper()}, so "
            "dm-flakey / dm-log-writes cannot be used; writes the device had accepted survive "
            "the cut (no volatile device cache is modelled)"
        )
    return [out, skips]


def run_store(store: Store, faults: list[Fault], results: dict[tuple[str, str], Tally]) -> None:
    """Run a store's faults one after another, recording each tally (or the error that ended it)."""
    for name, fn in faults:
        started = time.monotonic()
        try:
            tally = fn()
        except Exception as exc:  # the campaign's own trouble: reported, and the exit code says so
            tally = Tally(notes=[f"{store.name}/{name}: the campaign failed: {exc!r}"])
            tally.wrong = -1
        tally.seconds = time.monotonic() - started
        results[(store.name, name)] = tally
        print(f"  done: {store.name:8} {name:38} {tally.seconds:6.1f} s", file=sys.stderr)


@contextlib.contextmanager
def own_servers(names: list[str], work: Path) -> Iterator[dict[str, Any]]:
    """Start the campaign's own servers, and always stop them."""
    started: dict[str, Any] = {}
    try:
        if "postgres" in names:
            started["postgres"] = servers.PostgresServer(work)
        if "redis" in names:
            started["redis"] = servers.RedisServer(work, appendonly=True)
            started["redis-noaof"] = servers.RedisServer(work, appendonly=False)
        with ThreadPoolExecutor() as pool:  # initdb takes seconds: start them side by side
            for future in [pool.submit(server.start) for server in started.values()]:
                future.result(180)
        yield started
    finally:
        for server in started.values():
            with contextlib.suppress(Exception):
                server.stop()


def table(results: dict[tuple[str, str], Tally], order: list[str]) -> str:
    """The campaign's table."""
    head = f"{'store':9}{'fault':38}{'trials':>7}{'calls':>7}{'dup':>5}{'lost':>6}{'hung':>6}"
    lines = [head + f"{'wrong':>7}{'secs':>7}", "-" * (len(head) + 14)]
    for store in order:
        for (name, fault), t in results.items():
            if name == store:
                wrong = "ERROR" if t.wrong < 0 else str(t.wrong)
                counts = f"{t.trials:>7}{t.calls:>7}{t.duplicates:>5}{t.lost:>6}{t.hung:>6}"
                lines.append(f"{name:9}{fault:38}{counts}{wrong:>7}{t.seconds:>7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; 0 when nothing the protocol forbids was seen."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a few trials per fault (for CI)")
    parser.add_argument("--stores", default="memory,sqlite,postgres,redis")
    parser.add_argument("--seed", type=int, default=None, help="the random seed (default: new)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.stores.split(",") if n.strip()]
    unknown = set(names) - {"memory", "sqlite", "postgres", "redis"}
    if unknown:
        parser.error(f"unknown stores {sorted(unknown)}: choose from memory,sqlite,postgres,redis")
    seed = args.seed if args.seed is not None else secrets.randbelow(1 << 30)
    plan = SHORT if args.short else FULL
    print(f"fault campaign: {'short' if args.short else 'full'}, seed {seed}", file=sys.stderr)
    CTX.set_forkserver_preload(["harness", "twiceshy.stores.postgres", "twiceshy.stores.redis"])
    work = Path(tempfile.mkdtemp(prefix="twiceshy-faults-"))
    os.chmod(work, 0o755)  # the PostgreSQL cluster below runs as its own user
    started = time.monotonic()
    results: dict[tuple[str, str], Tally] = {}
    skips: list[str] = []
    try:
        disks = disk_support(work) if "sqlite" in names else (None, None)
        with own_servers(names, work) as own:
            stores = []
            for name in names:
                (work / name).mkdir()
                url = {
                    "memory": "memory://",
                    "sqlite": f"sqlite:///{work / name / 'ledger.db'}",
                    "postgres": own.get("postgres") and f"{own['postgres'].url}?connect_timeout=2",
                    "redis": own.get("redis") and f"{own['redis'].url}?socket_timeout=1",
                }[name]
                stores.append(Store(name, str(url), work / name, own.get(name)))
            threads = []
            for i, store in enumerate(stores):
                rng = random.Random(seed + i)
                faults, why = faults_of(store, plan, rng, disks)
                skips += why
                if store.name == "redis":
                    noaof = own["redis-noaof"]
                    control = Store("redis", f"{noaof.url}?socket_timeout=1", store.work, noaof)
                    faults.append((CONTROL, partial(server_fault, control, plan, rng, "kill")))
                thread = threading.Thread(target=run_store, args=(store, faults, results))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results, names))
    for line in skips:
        print(f"skipped: {line}")
    control = results.get(("redis", CONTROL))
    if control is not None:
        print(
            "control: Redis without persistence loses acknowledged claims when killed, as the "
            f"README says ({control.lost} lost): the campaign sees a loss where one happens"
        )
    failed = False
    for (_, fault), tally in results.items():
        if fault.endswith("(control)"):
            continue
        if tally.failed:
            failed = True
            for note in tally.notes:
                print(f"FOUND {note}")
    verdict_line = "FAILURES SEEN" if failed else "nothing the protocol forbids was seen"
    print(f"seed {seed}; {time.monotonic() - started:.0f} s; {verdict_line}")
    if any(t.wrong < 0 for t in results.values()):
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
