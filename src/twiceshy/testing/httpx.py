"""Transports that let an ``httpx`` request take effect and then lose its answer.

    client = httpx.Client(transport=IdempotencyKeyTransport(LostAnswerTransport(times=1)))

:class:`LostAnswerTransport` sends each request on to the real transport (the server gets it
and answers: the effect happens), then reads the answer, throws it away and raises
``httpx.ReadTimeout``, for the first ``times`` requests that change something. Under twiceshy's
:class:`~twiceshy.integrations.httpx.IdempotencyKeyTransport` the requests it sends on carry
their ``Idempotency-Key``; a client's or SDK's retry of a lost answer then goes out with the
same header. Install with ``pip install 'twiceshy[httpx]'``; the same classes for ``httpx2``
are in :mod:`twiceshy.testing.httpx2`.
"""

from __future__ import annotations

import httpx

from ._transports import make_fault_transports

__all__ = ["AsyncLostAnswerTransport", "LostAnswerTransport"]

LostAnswerTransport, AsyncLostAnswerTransport = make_fault_transports(httpx)
