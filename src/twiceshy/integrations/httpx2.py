"""``Idempotency-Key`` on outbound ``httpx2`` requests (the openai, anthropic and mcp SDKs' client).

    client = openai.OpenAI(http_client=httpx2.Client(transport=IdempotencyKeyTransport()))

The same transports as :mod:`twiceshy.integrations.httpx`, for the ``httpx2`` fork, with the same
rules (a request outside a protected KEYED call, or sent from a bare thread, gets no header).
Install with ``pip install 'twiceshy[httpx2]'``.
"""

from __future__ import annotations

import httpx2

from ._http import make_transports

__all__ = ["AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport"]

IdempotencyKeyTransport, AsyncIdempotencyKeyTransport = make_transports(httpx2)
