"""The campaign's own PostgreSQL and Redis servers, and a loopback proxy that loses replies.

The servers listen on free ports of 127.0.0.1 with their data in a temporary directory, so that
restarting or killing them never touches the shared servers on 5432 and 6379 that the tests use.
Every wait here is bounded; :meth:`stop` is safe to call more than once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


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

    def __init__(self, root: Path) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not bins:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.bin = Path(bins[-1]).parent
        self.root = root / "server-postgres"
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._user: dict[str, str] = {}
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
            **self._user,  # type: ignore[arg-type]
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


class RedisServer:
    """A ``redis-server`` of the campaign's own on a free port, with or without AOF."""

    def __init__(self, root: Path, *, appendonly: bool) -> None:
        self.appendonly = appendonly
        self.dir = root / f"server-redis-{'aof' if appendonly else 'noaof'}"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait (up to 30 s) until it answers."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
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

    def restart(self, down: float = 0.0) -> None:
        """SIGTERM (Redis shuts down cleanly, flushing its AOF); ``down`` s later, start."""
        self._end(signal.SIGTERM)
        time.sleep(down)
        self.start()

    def kill(self, down: float = 0.0) -> None:
        """SIGKILL; ``down`` s later, start (the AOF, if any, is replayed)."""
        self._end(signal.SIGKILL)
        time.sleep(down)
        self.start()

    def stop(self) -> None:
        """Stop the server if it runs."""
        self._end(signal.SIGKILL)


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


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
