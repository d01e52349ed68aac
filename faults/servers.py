"""The campaign's own servers (PostgreSQL, PgBouncer, Redis, a Redis Cluster, dynalite), and a
loopback proxy that loses replies.

The servers listen on free ports of 127.0.0.1 with their data in a temporary directory, so that
restarting or killing them never touches the shared servers the tests use (PostgreSQL 5432,
Redis 6379, the Redis Cluster on 7101-7106, PgBouncer 6432, dynalite 4567). Every wait here is
bounded; :meth:`stop` is safe to call more than once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(Path(stat).parent.name))
    return found


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
    return False


class PostgresServer:
    """A throwaway PostgreSQL cluster (initdb + pg_ctl) under ``root``, on a free port.

    Run as the ``postgres`` user when the campaign runs as root (initdb refuses root). ``fsync``
    is off: the faults here kill processes, never the machine, and the OS keeps what they wrote.
    """

    def __init__(self, root: Path, name: str = "server-postgres") -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not bins:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.bin = Path(bins[-1]).parent
        self.root = root / name
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._user: dict[str, Any] = {}
        if os.getuid() == 0:
            self._user = {"user": "postgres", "group": "postgres"}
        self.root.mkdir(parents=True)
        if self._user:
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            **self._user,
        )

    def start(self) -> None:
        """Create the cluster on first use, then start it and wait until it accepts."""
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                      "-E", "UTF8", "--no-sync")  # fmt: skip
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
            " -c fsync=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                  "-w", "-t", "60", "start")  # fmt: skip

    def restart(self, down: float = 0.0) -> None:
        """A clean restart: ``pg_ctl stop -m fast`` (sessions are ended), ``down`` s, start."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        time.sleep(down)
        self.start()

    def kill(self, down: float = 0.0) -> None:
        """SIGKILL the postmaster and every backend at once; ``down`` s later, start again
        (crash recovery)."""
        pid = self._postmaster()
        if pid is not None:
            victims = [pid, *_children(pid)]
            for victim in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            for victim in victims:
                _gone(victim, 10)
        time.sleep(down)
        self.start()

    def _postmaster(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    def stop(self) -> None:
        """Stop the cluster (immediately) if it runs."""
        if self._postmaster() is None:
            return
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")


class _Server:
    """What the campaign's servers of one process share: a clean restart (the server's own
    shutdown signal, :attr:`gentle`) and a kill -9, each started again ``down`` s later."""

    gentle: int = signal.SIGTERM

    def start(self) -> None:
        raise NotImplementedError

    def _end(self, sig: int) -> None:
        raise NotImplementedError

    def restart(self, down: float = 0.0) -> None:
        """Shut down cleanly; ``down`` s later, start."""
        self._end(self.gentle)
        time.sleep(down)
        self.start()

    def kill(self, down: float = 0.0) -> None:
        """SIGKILL; ``down`` s later, start."""
        self._end(signal.SIGKILL)
        time.sleep(down)
        self.start()

    def stop(self) -> None:
        """Stop the server if it runs."""
        self._end(signal.SIGKILL)


class _ChildServer(_Server):
    """A server that runs as this process's child (``proc``)."""

    proc: subprocess.Popen[bytes] | None = None

    def _end(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class RedisServer(_ChildServer):
    """A ``redis-server`` of the campaign's own on a free port, with or without AOF.

    With AOF, ``appendfsync always``: an acknowledged write is on disk (``everysec`` loses up to
    a second of acknowledged outcomes to a kill on a slow disk, which is no fault of twiceshy's).
    A restart is Redis's clean shutdown (SIGTERM, its AOF flushed); after a kill the AOF, if
    any, is replayed.
    """

    def __init__(self, root: Path, *, appendonly: bool) -> None:
        self.appendonly = appendonly
        self.dir = root / f"server-redis-{'aof' if appendonly else 'noaof'}"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        """Start the server and wait (up to 30 s) until it answers."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
             "--dir", str(self.dir),
             "--logfile", str(self.dir / "log"), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if _ping(self.port):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 30 s")


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Proxy:
    """A TCP proxy on 127.0.0.1 that, when armed, loses the reply to one request.

    ``arm("drop", n)``: the n-th chunk a client sends from then on is forwarded to the server,
    the server's reply to it is read and thrown away, and both connections are closed: the
    request took effect, its answer never came. ``arm("stall", n, seconds)``: that reply is held
    for ``seconds`` before it is forwarded (the client may have given up meanwhile).
    ``arm("reset", n)``: right after forwarding that request, both connections are reset
    (SO_LINGER 0: a RST to the client and to the server, whatever the server was doing).
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self._lock = threading.Lock()
        self._armed: tuple[str, int, float] | None = None
        self.fired = 0
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` pointed at this proxy."""
        return url.replace(f"127.0.0.1:{self.target[1]}", f"127.0.0.1:{self.port}", 1)

    def arm(self, mode: str, nth: int, seconds: float = 0.0) -> None:
        """Lose (``"drop"``) or delay (``"stall"``) the reply to the ``nth`` request from now."""
        with self._lock:
            self._armed = (mode, nth, seconds)

    def disarm(self) -> None:
        """Forward everything from now on."""
        with self._lock:
            self._armed = None

    def close(self) -> None:
        """Close the listener and every connection."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            victim: dict[str, tuple[str, float]] = {}
            threading.Thread(target=self._up, args=(client, server, victim), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, victim), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, victim: dict) -> None:  # type: ignore[type-arg]
        """Client to server; marks the connection whose reply is to be lost."""
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                with self._lock:
                    if self._armed is not None:
                        mode, nth, seconds = self._armed
                        if nth <= 1:
                            self._armed = None
                            self.fired += 1
                            victim["fault"] = (mode, seconds)  # before forwarding: seen in _down
                        else:
                            self._armed = (mode, nth - 1, seconds)
                server.sendall(data)
                if victim.get("fault", ("",))[0] == "reset":
                    time.sleep(0.01)  # the server has the request: reset both ends under it
                    _reset(client, server)
                    return
        except OSError:
            pass
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, victim: dict) -> None:  # type: ignore[type-arg]
        """Server to client; loses or holds the reply to the marked request."""
        try:
            while True:
                data = server.recv(65536)
                if not data:
                    break
                fault = victim.pop("fault", None)
                if fault is not None and fault[0] == "drop":
                    break
                if fault is not None:
                    self._closed.wait(fault[1])
                client.sendall(data)
        except OSError:
            pass
        _close(client, server)


def _reset(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            sock.close()


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


def sh(*args: str, timeout: float = 30) -> str:
    """Run a command; its standard output."""
    done = subprocess.run(args, check=True, timeout=timeout, capture_output=True, text=True)
    return done.stdout


def _wait(what: str, check: Any, timeout: float = 30.0, every: float = 0.05) -> None:
    """Wait until ``check()`` is true, up to ``timeout`` s, or raise naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(every)
    raise RuntimeError(f"{what} did not happen within {timeout:g} s")


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class PgBouncerServer(_Server):
    """A PgBouncer of the campaign's own in transaction mode, on a free port, in front of a
    PostgreSQL server of the campaign's own (:class:`PostgresServer`).

    PgBouncer refuses to run as root: as root it runs as the ``postgres`` user (``-u``). A
    restart is its safe shutdown (SIGINT: running transactions end first).
    """

    gentle = signal.SIGINT

    def __init__(self, root: Path, postgres: PostgresServer) -> None:
        if shutil.which("pgbouncer") is None:
            raise RuntimeError("pgbouncer is not installed (apt-get install -y pgbouncer)")
        self.postgres = postgres
        self.dir = root / "server-pgbouncer"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.ini = self.dir / "pgbouncer.ini"
        self.pid_file = self.dir / "pgbouncer.pid"
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        self.ini.write_text(
            "[databases]\n"
            f"postgres = host=127.0.0.1 port={postgres.port} dbname=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 20\nmax_client_conn = 1000\n"
            f"pidfile = {self.pid_file}\nlogfile = {self.dir / 'log'}\n"
            "server_connect_timeout = 2\nserver_login_retry = 0\n"
        )
        self._as: list[str] = []
        if os.getuid() == 0:
            for path in (self.dir, *self.dir.iterdir()):
                shutil.chown(path, "postgres", "postgres")
            self._as = ["-u", "postgres"]

    def _pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_file.read_text().split()[0])
            os.kill(pid, 0)
            return pid
        return None

    def start(self) -> None:
        """Start PgBouncer (a daemon) and wait (up to 30 s) until it accepts connections."""
        self.pid_file.unlink(missing_ok=True)
        subprocess.run(
            ["pgbouncer", "-d", *self._as, str(self.ini)],
            check=True,
            timeout=30,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _wait(f"PgBouncer on port {self.port} answering", lambda: _connects(self.port))

    def _end(self, sig: int) -> None:
        pid = self._pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if not _gone(pid, 10):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _gone(pid, 10)


DYNALITE_VERSION = "4.0.0"
CI_SERVERS = Path(__file__).resolve().parent.parent / ".ci" / "servers"


class DynaliteServer(_ChildServer):
    """dynalite (a DynamoDB-protocol server, in memory) on a free port, started by the launcher
    ``.ci/servers/dynalite-server.js``, which keeps it alive when a client resets a connection
    (dynalite's own cli.js exits then). The package is installed by ``.ci/servers/dynalite.sh
    install`` if missing. A restart loses every table: nothing is on disk.
    """

    def __init__(self, root: Path) -> None:
        if shutil.which("node") is None:
            raise RuntimeError("node is not installed")
        home = os.environ.get(
            "TWICESHY_DYNALITE_HOME", f"/tmp/twiceshy-dynalite-{DYNALITE_VERSION}"
        )
        self.module = Path(home) / "node_modules" / "dynalite"
        if not (self.module / "index.js").exists():
            subprocess.run(
                ["bash", str(CI_SERVERS / "dynalite.sh"), "install"],
                check=True,
                timeout=300,
                stdout=subprocess.DEVNULL,
            )
        self.dir = root / "server-dynalite"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        """Start dynalite and wait (up to 30 s) until it accepts connections."""
        with open(self.dir / "log", "ab") as log:
            self.proc = subprocess.Popen(
                ["node", str(CI_SERVERS / "dynalite-server.js"), str(self.module), "127.0.0.1",
                 str(self.port)],
                stdout=log,
                stderr=log,
            )  # fmt: skip
        proc = self.proc
        _wait(
            f"dynalite on port {self.port} answering",
            lambda: proc.poll() is None and _connects(self.port),
        )

    def alive(self) -> bool:
        """Whether the server process still runs (a reset connection must not end it)."""
        return self.proc is not None and self.proc.poll() is None


class RedisCluster:
    """A Redis Cluster of the campaign's own: ``primaries`` primaries with one replica each on
    free ports, every node with ``appendonly yes`` and ``appendfsync always``.

    Each node's cluster bus has a free port of its own (``cluster-port``: the default, the port
    plus 10000, may be taken or past 65535). ``cluster-node-timeout`` is 1 s, so that a killed
    or stopped primary is replaced in about two. Nodes run in the foreground (``daemonize no``),
    each from its own config file, so that a killed node is started again the same way and
    rejoins from its AOF and nodes.conf.
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(self, root: Path, primaries: int = 3) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.dir = root / "server-redis-cluster"
        taken: list[int] = []
        while len(taken) < 4 * primaries:  # a port and a bus port a node; free_port may repeat
            if (port := free_port()) not in taken:
                taken.append(port)
        self.ports = taken[: 2 * primaries]
        bus = dict(zip(self.ports, taken[2 * primaries :], strict=True))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for port in self.ports:
            (self.dir / str(port)).mkdir(parents=True)
            (self.dir / str(port) / "redis.conf").write_text(
                f"bind 127.0.0.1\nport {port}\ndaemonize no\ndir {self.dir / str(port)}\n"
                f'logfile {self.dir / str(port) / "log"}\nsave ""\n'
                "appendonly yes\nappendfsync always\ncluster-enabled yes\n"
                f"cluster-port {bus[port]}\n"
                f"cluster-config-file nodes.conf\ncluster-node-timeout {self.NODE_TIMEOUT_MS}\n"
                "maxmemory-policy noeviction\n"
            )
        seeds = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        self.url = f"redis+cluster://{seeds}"

    def start_node(self, port: int) -> None:
        """Start one node from its config file, and wait until it answers PING."""
        self.procs[port] = subprocess.Popen(
            ["redis-server", str(self.dir / str(port) / "redis.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(f"Redis Cluster node {port} answering", lambda: _ping(port))

    def start(self) -> None:
        """Start every node, create the cluster, and wait until it is healthy."""
        for port in self.ports:
            self.start_node(port)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            timeout=60,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        self.wait_healthy()

    def command(self, port: int, *args: str, timeout: float = 2.0) -> Any:
        """One command to one node (a connection of its own)."""
        import redis

        client = redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        try:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def shards(self) -> list[tuple[int, int]]:
        """(primary port, replica port) of every shard, as the first live node sees them."""
        for port in self.ports:
            with contextlib.suppress(Exception):
                return _shards(_nodes_text(self.command(port, "CLUSTER", "NODES", timeout=1.0)))
        raise RuntimeError("no node of the Redis Cluster answers")

    def _healthy(self) -> bool:
        """Every node up, cluster_state ok everywhere, every primary with a replica in sync."""
        shards = self.shards()
        if len(shards) != len(self.ports) // 2:
            return False
        for port in self.ports:
            info = self.command(port, "CLUSTER", "INFO", timeout=1.0)
            if b"cluster_state:ok" not in (info if isinstance(info, bytes) else str(info).encode()):
                return False
        for primary, replica in shards:
            role = self.command(replica, "ROLE", timeout=1.0)
            if role[0] != b"slave" or role[3] != b"connected":
                return False
            mine = self.command(primary, "ROLE", timeout=1.0)
            if mine[0] != b"master" or not mine[2]:
                return False
            if int(mine[2][0][2]) < int(mine[1]):  # the replica's offset has caught up
                return False
        return True

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until the cluster is healthy again (see :meth:`_healthy`)."""
        _wait("the Redis Cluster being healthy", self._healthy, timeout, every=0.1)

    def pause(self, port: int) -> None:
        """SIGSTOP a node."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a node."""
        with contextlib.suppress(ProcessLookupError):
            self.procs[port].send_signal(signal.SIGCONT)

    def kill_node(self, port: int) -> None:
        """SIGKILL a node and reap it."""
        proc = self.procs.pop(port, None)
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        """Kill every node (also stopped ones)."""
        for port in list(self.procs):
            self.resume(port)
            self.kill_node(port)


def _nodes_text(reply: Any) -> str:
    """CLUSTER NODES as text, from what redis-py made of it (a dict per node, or text)."""
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, dict):
        lines = []
        for address, node in reply.items():
            flags = node.get("flags", "")
            master = node.get("master_id", "-")
            lines.append(f"{node.get('node_id')} {address} {flags} {master}")
        return "\n".join(lines)
    return str(reply)


def _shards(text: str) -> list[tuple[int, int]]:
    """(primary port, replica port) pairs from CLUSTER NODES (primaries without a live
    replica are left out)."""
    ids: dict[str, int] = {}
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        ids[fields[0]] = port
        rows.append((fields[0], port, fields[2], fields[3]))
    pairs = []
    for _, port, flags, master in rows:
        if ("slave" in flags or "replica" in flags) and "fail" not in flags and master in ids:
            pairs.append((ids[master], port))
    return sorted(pairs)
