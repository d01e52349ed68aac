"""The HTTP face of :class:`~twiceshy.testing.FakeProvider`: a loopback server, stdlib only.

Any HTTP client can talk to it (httpx, httpx2 and the SDKs on them, requests, urllib), so a
tool is tested through the client it really uses, twiceshy's transports included.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from email.message import Message
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ._errors import IdempotencyKeyReused
from ._requests import Handling, ProviderRequest

if TYPE_CHECKING:
    from ._provider import FakeProvider

__all__ = ["fields_of", "serve"]


def fields_of(content_type: str | None, body: bytes) -> dict[str, Any]:
    """A request body as fields: a JSON object, a form, or multipart parts (files as text).

    Multipart parts are read by name, so two sends of one upload (each with its own random
    boundary) have equal fields. Anything else is ``{"body": text}``.
    """
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    elif kind == "application/x-www-form-urlencoded":
        pairs = urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
        return dict(pairs)
    elif kind == "multipart/form-data":
        head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
        message: Message = BytesParser().parsebytes(head + body)
        if message.is_multipart():
            parts: dict[str, Any] = {}
            for part in message.get_payload():
                if not isinstance(part, Message):
                    continue
                name = part.get_param("name", header="content-disposition")
                data = part.get_payload(decode=True)
                if isinstance(name, str) and isinstance(data, bytes):
                    parts[name] = data.decode("utf-8", "replace")
            return parts
    return {"body": body.decode("utf-8", "replace")}


def _handler(provider: FakeProvider, header: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # a test's output stays its own
            pass

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client stopped waiting (a late answer): nobody reads it
                self.close_connection = True

        def do_GET(self) -> None:
            operation = f"GET {urllib.parse.urlsplit(self.path).path}"
            answers = [seen.answer for seen in provider.effects]
            read = ProviderRequest(operation, {}, self.headers.get(header), Handling.READ)
            provider._record(read)
            self._answer(200, {"data": answers})

        def _change(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            operation = f"{self.command} {urllib.parse.urlsplit(self.path).path}"
            fields = fields_of(self.headers.get("Content-Type"), body)
            seen, error, late = provider._handle(operation, fields, self.headers.get(header))
            if seen.answer_lost and late is not None:  # it took effect; the answer comes late
                time.sleep(late)
                self._answer(200, seen.answer)
                self.close_connection = True
            elif seen.answer_lost:  # it took effect; the answer never comes
                self.close_connection = True
            elif isinstance(error, IdempotencyKeyReused):
                self._answer(400, {"error": {"type": "idempotency_error", "message": str(error)}})
            elif error is not None:
                self._answer(503, {"error": {"type": "unavailable", "message": str(error)}})
            else:
                self._answer(200, seen.answer)

        do_POST = do_PUT = do_PATCH = do_DELETE = _change

    return Handler


class _Server(ThreadingHTTPServer):
    """The HTTP server, bound without the host name lookup ``HTTPServer`` makes (``getfqdn``:
    a machine without DNS would wait on it for a loopback address)."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        self.server_name = "127.0.0.1"
        self.server_port = self.socket.getsockname()[1]


@contextmanager
def serve(provider: FakeProvider, header: str) -> Iterator[str]:
    """Serve ``provider`` on a free port of 127.0.0.1 while the block runs; yields its URL."""
    server = _Server(("127.0.0.1", 0), _handler(provider, header))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="twiceshy-fake-provider")
    thread.daemon = True
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
