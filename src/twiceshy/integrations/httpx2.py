"""The same transports for ``httpx2``, the client of the openai, anthropic and mcp SDKs.

    client = openai.OpenAI(http_client=httpx2.Client(transport=IdempotencyKeyTransport()))

They do what :mod:`twiceshy.integrations.httpx` describes, with the same rules: a KEYED call's
requests carry a derived ``Idempotency-Key``, an UNSAFE call never sends one request twice (the
SDK's own retries, ``max_retries=2`` by default, are refused with
:class:`~twiceshy.RepeatedRequest`), ``effect_at="http"`` marks the point of no return at the
first request, and a request outside a protected call, or sent from a bare thread, passes
untouched. Install with ``pip install 'twiceshy[httpx2]'``.
"""

from __future__ import annotations

import httpx2

from ._http import make_transports

__all__ = ["AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport"]

IdempotencyKeyTransport, AsyncIdempotencyKeyTransport = make_transports(httpx2)
