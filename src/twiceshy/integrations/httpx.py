"""Transports that make outbound ``httpx`` requests inside protected tools safe to retry.

    client = httpx.Client(transport=IdempotencyKeyTransport())

Inside a protected call (see :mod:`twiceshy.integrations._http` and ``docs/http.md``):

- KEYED: every POST/PUT/PATCH/DELETE carries an ``Idempotency-Key`` derived from the call's key
  and the request's method, URL and body: an SDK's retry of one request repeats it, two
  different requests differ (a multipart body is hashed without its random boundary). A header
  already set by the caller is left alone.
- UNSAFE: the same request is sent at most once; a second send (an SDK or a retry loop trying
  again after a lost answer) raises :class:`~twiceshy.RepeatedRequest` and never leaves, unless
  the request carries its own idempotency key.
- ``effect_at="http"``: the first request of an attempt calls
  :func:`twiceshy.point_of_no_return` before it leaves (a lost lease stops it).

A request made outside a protected call passes untouched. The call is found through context
variables: they reach asyncio tasks and ``asyncio.to_thread``, not a bare thread, a
``ThreadPoolExecutor`` or ``run_in_executor`` (run the work in ``contextvars.copy_context()``
there). The body of a request that is hashed is read into memory first. Install with
``pip install 'twiceshy[httpx]'``.
"""

from __future__ import annotations

import httpx

from ._http import make_transports

__all__ = ["AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport"]

IdempotencyKeyTransport, AsyncIdempotencyKeyTransport = make_transports(httpx)
