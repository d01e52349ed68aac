"""``redis://``: a ledger on a Redis server, shared by many processes and machines (redis-py).

:class:`RedisStore` is the blocking store, :class:`AsyncRedisStore` its ``redis.asyncio`` twin,
and :func:`open_redis` opens both for one URL (``redis://``, ``rediss://`` or ``unix://``, with
twiceshy's options ``prefix``, ``wait_replicas``, ``wait_timeout``, ``reread_interval``,
``pool_size``, ``pool_timeout`` and ``allow_eviction`` in its query).
:class:`RedisClusterStore`, :class:`AsyncRedisClusterStore` and :func:`open_redis_cluster` are
the same on a Redis Cluster
(``redis+cluster://host:port,host:port``, and ``failover_wait``). One record is one hash, in one
slot of a cluster; a claim, a guarded write and a read
are each one Lua script (:data:`CLAIM_SCRIPT`, :data:`WRITE_SCRIPT`, :data:`READ_SCRIPT`) in
one round trip, on the server's clock; waiters are woken by pub/sub. A server whose
``maxmemory-policy`` may evict records is refused unless the URL accepts it. The design — key
layout, clock, retention, eviction, waiters, lost replies, errors and the guarantee level — is
described in ``docs/stores/redis.md``.

The package: ``_lua`` (the scripts), ``_core`` (settings, key layout, opening checks),
``_cluster`` (what a cluster changes), ``_replies`` (answers read as records and errors),
``_ops`` (each operation once, as a generator of Redis commands), ``_subscriber`` (pub/sub
wake-ups) and ``_stores`` (the stores, thin loops that carry out the operations).
"""

from __future__ import annotations

from ...errors import EvictionPolicyRefused
from ._core import split_url as split_url
from ._lua import CLAIM_SCRIPT, PURGE_SCRIPT, READ_SCRIPT, WRITE_SCRIPT
from ._stores import (
    AsyncRedisClusterStore,
    AsyncRedisStore,
    RedisClusterStore,
    RedisStore,
    open_redis,
    open_redis_cluster,
)

__all__ = [
    "CLAIM_SCRIPT",
    "PURGE_SCRIPT",
    "READ_SCRIPT",
    "WRITE_SCRIPT",
    "AsyncRedisClusterStore",
    "AsyncRedisStore",
    "EvictionPolicyRefused",
    "RedisClusterStore",
    "RedisStore",
    "open_redis",
    "open_redis_cluster",
]
