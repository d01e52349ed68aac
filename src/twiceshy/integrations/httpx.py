"""``Idempotency-Key`` on outbound ``httpx`` requests made inside KEYED tools.

    client = httpx.Client(transport=IdempotencyKeyTransport())

Every POST/PUT/PATCH/DELETE sent inside a protected KEYED call carries a header derived from the
call's key and the request's method, URL and body (see :mod:`twiceshy.integrations._http`): an
SDK's retry of one request repeats it, two different requests differ (a multipart body is hashed
without its random boundary). A header already set by the caller is left alone; a request made
outside a protected KEYED call is sent without one. The call is found through context variables:
they reach asyncio tasks and ``asyncio.to_thread``, not a bare thread, a ``ThreadPoolExecutor`` or
``run_in_executor`` (run the work in ``contextvars.copy_context()`` there). The body of a request
that gets a header is read into memory first. Install with ``pip install 'twiceshy[httpx]'``.
"""

from __future__ import annotations

import httpx

from ._http import make_transports

__all__ = ["AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport"]

IdempotencyKeyTransport, AsyncIdempotencyKeyTransport = make_transports(httpx)
