"""A scripted model behind the Messages API, for the Claude Agent SDK and ``anthropic`` tests.

Neither SDK ships a fake model. :class:`MessagesAPI` answers ``POST /v1/messages`` (streamed as
server-sent events, or whole) with the next scripted turn - tool calls (:func:`tool_use`) or
text - and keeps every request, so a test reads what the model was told. It serves on a free
port of 127.0.0.1 (the Agent SDK's ``claude`` CLI, a process of its own, calls it there), or as
a ``MockTransport`` for the ``anthropic`` client. No network: nothing else is reached.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from typing import Any

# anthropic 1.0 moved from httpx to httpx2, which has the same transport API: ``http`` is the one
# the installed anthropic client takes.
if int(metadata.version("anthropic").split(".")[0]) >= 1:
    import httpx2 as http
else:  # pragma: no cover - anthropic before 1.0, run by .ci/frameworks.sh
    import httpx as http  # type: ignore[no-redef]

Block = dict[str, Any]
Turn = list[Block] | int
"""A turn: the content blocks of one answer, or an HTTP status to fail the request with."""

_MODEL = "claude-scripted"


def tool_use(name: str, args: dict[str, Any], *ids: str) -> list[Block]:
    """One turn calling the tool ``name`` with ``args``, once per tool-use id."""
    return [{"type": "tool_use", "id": i, "name": name, "input": dict(args)} for i in ids]


class MessagesAPI:
    """Answers each request with the next scripted turn; a spent script answers "done"."""

    def __init__(self, *turns: Turn) -> None:
        self._turns = list(turns)
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> tuple[int, list[Block]]:
        """The status and blocks of the next turn, recording the request."""
        with self._lock:
            self.requests.append(body)
            if len(self.requests) > 40:
                raise AssertionError("the model was asked more often than any test scripts")
            turn = self._turns.pop(0) if self._turns else [{"type": "text", "text": "done"}]
        if isinstance(turn, int):
            return turn, []
        return 200, turn

    def results(self) -> dict[str, tuple[str, bool]]:
        """What the model read for each tool call, by tool-use id, as first read: the text of
        the result and whether it was an error."""
        read: dict[str, tuple[str, bool]] = {}
        for request in self.requests:
            for message in request.get("messages", []):
                content = message.get("content")
                if message.get("role") != "user" or not isinstance(content, list):
                    continue
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "tool_result":
                        read.setdefault(
                            block["tool_use_id"], (_text(block), bool(block.get("is_error")))
                        )
        return read

    # -- over HTTP, on loopback ------------------------------------------------------------

    @contextmanager
    def serve(self) -> Iterator[str]:
        """Serve on a free port of 127.0.0.1 while the block runs; yields the base URL."""
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                status, blocks = api.answer(body)
                if status != 200:
                    data = json.dumps({"type": "error", "error": {"type": "api_error"}})
                    self._send(status, "application/json", data.encode())
                elif body.get("stream"):
                    self._send(200, "text/event-stream", _events(blocks))
                else:
                    self._send(200, "application/json", json.dumps(_message(blocks)).encode())

            def _send(self, status: int, kind: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)

    # -- in process, as the client's transport ---------------------------------------------

    def transport(self) -> http.MockTransport:
        """A transport answering as the Messages API (whole messages)."""

        def handle(request: http.Request) -> http.Response:
            status, blocks = self.answer(json.loads(request.content or b"{}"))
            if status != 200:
                return http.Response(status, json={"type": "error", "error": {"type": "x"}})
            return http.Response(200, json=_message(blocks))

        return http.MockTransport(handle)


def _text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _stop(blocks: list[Block]) -> str:
    return "tool_use" if any(block["type"] == "tool_use" for block in blocks) else "end_turn"


def _message(blocks: list[Block]) -> dict[str, Any]:
    return {
        "id": "msg_scripted",
        "type": "message",
        "role": "assistant",
        "model": _MODEL,
        "content": blocks,
        "stop_reason": _stop(blocks),
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }


def _events(blocks: list[Block]) -> bytes:
    """The turn as the Messages API streams it."""
    events: list[str] = []

    def event(kind: str, data: dict[str, Any]) -> None:
        events.append(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n")

    start = {**_message([]), "stop_reason": None}
    event("message_start", {"message": start})
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            event("content_block_start", {"index": index, "content_block": {**block, "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        event("content_block_delta", {"index": index, "delta": delta})
        event("content_block_stop", {"index": index})
    stopped = {"stop_reason": _stop(blocks), "stop_sequence": None}
    event("message_delta", {"delta": stopped, "usage": {"output_tokens": 1}})
    event("message_stop", {})
    return "".join(events).encode()
