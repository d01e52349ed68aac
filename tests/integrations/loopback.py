"""Loopback scaffolding for the provider doubles of test_http.py and test_http_unsafe.py.

:class:`JSONHandler` is a quiet request handler that answers JSON; :func:`serve` runs a handler
on a free port of 127.0.0.1; :func:`openai_client` is the OpenAI SDK pointed at it through
twiceshy's httpx2 transport.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
import openai

from twiceshy.integrations import httpx2 as tx2


class JSONHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers JSON."""

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        """Answer ``status`` with ``body`` as JSON."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free loopback port while the block runs; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def openai_client(base: str, **options: Any) -> openai.OpenAI:
    """The OpenAI SDK on httpx2 with twiceshy's transport, at the double's ``/v1``."""
    return openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="x",
        http_client=httpx2.Client(transport=tx2.IdempotencyKeyTransport()),
        **options,
    )
