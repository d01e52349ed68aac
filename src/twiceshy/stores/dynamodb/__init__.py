"""``dynamodb://TABLE?region=...``: a ledger in a DynamoDB table, shared by every process and
machine of an AWS stack (boto3, and aiobotocore for async callers: the ``dynamodb`` extra).

:class:`DynamoDBStore` blocks, :class:`AsyncDynamoDBStore` awaits, and :func:`open_dynamodb`
opens both for one URL (options ``region``, ``endpoint_url``, ``prefix``, ``profile``,
credentials for servers that are not AWS, timeouts and ``max_attempts``, ``poll_interval``,
``create_timeout``). One record is one item; every guarded transition is one conditional
``UpdateItem`` whose condition is the transition's guard on state, fence and owner; every read
is strongly consistent; no transactions. Leases and expiry are on the callers' clocks (DynamoDB
has none to offer); expiry is checked on every read, and the ``ttl`` attribute only lets
DynamoDB delete settled items an hour later. Waiters poll with backoff. The table is created on
first use, on-demand, with a schema item. The design — item layout, each condition, consistency,
clocks, polling, capacity and the IAM permissions needed — is in ``docs/stores/dynamodb.md``.

The package: ``_items`` (the item layout and every request's expressions), ``_errors`` (the
SDK's errors as twiceshy's), ``_core`` (settings and URL options), ``_ops`` (each operation once,
as a generator of requests) and ``_stores`` (the two stores, thin loops that carry the requests
out).
"""

from __future__ import annotations

from ._core import split_url as split_url
from ._items import SCHEMA_VERSION as SCHEMA_VERSION  # the item layout this version reads
from ._stores import AsyncDynamoDBStore, DynamoDBStore, open_dynamodb

__all__ = ["AsyncDynamoDBStore", "DynamoDBStore", "open_dynamodb"]
