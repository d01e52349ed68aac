"""The lost-answer transports for ``httpx2``, the client of the openai, anthropic and mcp SDKs.

    http_client = httpx2.Client(transport=IdempotencyKeyTransport(LostAnswerTransport()))
    client = openai.OpenAI(http_client=http_client)

They do what :mod:`twiceshy.testing.httpx` describes: the request takes effect, and its answer
is lost to an ``httpx2.ReadTimeout``, which the SDKs retry (``max_retries=2`` by default).
Install with ``pip install 'twiceshy[httpx2]'``.
"""

from __future__ import annotations

import httpx2

from ._transports import make_fault_transports

__all__ = ["AsyncLostAnswerTransport", "LostAnswerTransport"]

LostAnswerTransport, AsyncLostAnswerTransport = make_fault_transports(httpx2)
