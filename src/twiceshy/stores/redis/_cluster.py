"""What a Redis Cluster changes: its URL of seed nodes, its clients, the checks made on every node,
and the one batch that must stay on one connection.

``redis+cluster://[user[:password]@]host:port[,host:port...][/][?options]`` names a cluster by
some of its nodes; redis-py's cluster clients (``redis.cluster.RedisCluster`` and its asyncio
twin) find the others, send each command to the primary of its key's slot, and follow
``MOVED`` and ``ASK``. Every script touches one key, whose hash tag it shares with the record's
wake channel, so one record is one slot: a cluster runs the same scripts as one server.

:class:`ClusterCore` is the :class:`~twiceshy.stores.redis._core.Core` of a cluster's stores:
its clients, the eviction policy of every node (primaries and replicas: a replica is a primary
after a failover), scripts loaded on every node, and a subscriber that listens on any one node
(a plain ``PUBLISH`` reaches the subscribers of every node of a cluster). :func:`one_node` and
:func:`async_one_node` carry a claim or a write with its ``WAIT`` to the record's primary on one
connection, which a cluster pipeline does not promise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Final, cast
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.connection import parse_url
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ._core import AsyncClient, Core, SyncClient, split_url
from ._lua import SCRIPTS
from ._subscriber import PubSubConnection

SCHEME: Final = "redis+cluster"

CLUSTER_URL_OPTIONS: Final = Core.url_options | {"failover_wait"}

# The query parameters of a cluster URL that are redis-py's: those both cluster clients take.
_CLIENT_OPTIONS: Final = frozenset(
    {"client_name", "socket_timeout", "socket_connect_timeout", "max_connections", "protocol"}
)
_REDIRECTS: Final = 16  # as many redirections as redis-py follows for one command
_DEFAULT_PORT: Final = 6379


def _seed(item: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` as a node's address."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, ""
        if ":" in host:
            raise ValueError(
                f"Redis cluster URL names a node with a bad port: {item!r} (an IPv6 address "
                "goes in brackets: [::1]:7000)"
            )
    if not host:
        raise ValueError(f"Redis cluster URL names a node without a host: {item!r}")
    try:
        number = int(port) if port else _DEFAULT_PORT
    except ValueError:
        raise ValueError(f"Redis cluster URL names a node with a bad port: {item!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"Redis cluster URL names a node with a bad port: {item!r}")
    return host, number


def split_cluster_url(url: str) -> tuple[str, dict[str, Any]]:
    """Take twiceshy's own options out of a ``redis+cluster://`` URL (see ``split_url``)."""
    return split_url(url, CLUSTER_URL_OPTIONS)


def cluster_target(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The seed nodes of a ``redis+cluster://`` URL, and redis-py's options from it.

    Args:
        url: the URL, without twiceshy's options (see :func:`split_cluster_url`).

    Returns:
        ``(host, port)`` of every node the URL names, and the keyword arguments of a cluster
        client: ``username`` and ``password`` from the URL, and the query's parameters.

    Raises:
        ValueError: the URL is not a cluster's, names no node, a database, or a parameter
            the cluster clients do not take.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != SCHEME:
        raise ValueError(f"a Redis cluster URL starts with {SCHEME}://")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    seeds = [_seed(item.strip()) for item in hosts.split(",") if item.strip()]
    if not seeds:
        raise ValueError(f"Redis cluster URL names no node: expected {SCHEME}://host:port,...")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(
            f"Redis cluster URL names database {parts.path.lstrip('/')!r}: a cluster has only "
            "database 0; leave the path out"
        )
    host, port = seeds[0]
    shown = f"[{host}]" if ":" in host else host
    query = f"?{parts.query}" if parts.query else ""
    options: dict[str, Any] = parse_url(  # type: ignore[no-untyped-call]
        f"redis://{userinfo}{at}{shown}:{port}/0{query}"
    )
    for name in ("host", "port", "db"):
        options.pop(name, None)
    unknown = sorted(set(options) - _CLIENT_OPTIONS - {"username", "password"})
    if unknown:
        raise ValueError(
            f"Redis cluster URL parameter {unknown[0]!r} is not one twiceshy passes to a "
            f"cluster; expected one of {', '.join(sorted(_CLIENT_OPTIONS))} (and twiceshy's "
            f"{', '.join(sorted(CLUSTER_URL_OPTIONS))})"
        )
    return seeds, options


class ClusterCore(Core):
    """The :class:`Core` of a cluster's stores: the clients of a cluster, every node checked."""

    url_options = CLUSTER_URL_OPTIONS
    opener = "RedisClusterStore.from_url() or open_redis_cluster()"

    def open_client(self) -> SyncClient:
        """A ``RedisCluster`` on the URL's seeds, without retries of its own."""
        self._seeds, self._options = cluster_target(self.url)
        self._turn = itertools.count()
        node: Any = redis.cluster.ClusterNode  # redis-py's cluster module is untyped
        return redis.cluster.RedisCluster(
            startup_nodes=[node(h, p) for h, p in self._seeds], **self._client_options(Retry)
        )

    def _client_options(self, retry: type[Retry] | type[AsyncRetry]) -> dict[str, Any]:
        # The store decides what is sent again (see _ops._guarded): the cluster client
        # retries nothing itself; it still follows MOVED, ASK and TRYAGAIN, which ran nothing.
        # Each node's pool holds what the gate lets through, unless the URL sizes it itself.
        sized = {"max_connections": self.pool_size}
        return {**self.connection_options(retry), **sized, **self._options}

    @property
    def cluster(self) -> Any:
        """The blocking client (``Any``: redis-py's cluster client is not typed)."""
        return self.client

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """Every node, primaries and replicas: a replica takes its primary's place on failover."""
        cluster = self.cluster
        return [(node.name, cluster.get_redis_connection(node)) for node in cluster.get_nodes()]

    def load_scripts(self) -> None:
        """Load every script on every node (a promoted replica then has them too)."""
        for lua in SCRIPTS:
            self.cluster.execute_command(
                "SCRIPT LOAD", lua.text, target_nodes=redis.cluster.RedisCluster.ALL_NODES
            )

    def pubsub_connection(self) -> PubSubConnection:
        """A connection to the next node in turn: any node hears every ``PUBLISH``, and a node
        that does not answer is passed over at the subscriber's next attempt."""
        cluster = self.cluster
        nodes = cluster.get_nodes()
        pool = cluster.get_redis_connection(nodes[next(self._turn) % len(nodes)]).connection_pool
        return cast(PubSubConnection, pool.connection_class(**pool.connection_kwargs))

    def async_client(self) -> AsyncClient:
        """An asyncio ``RedisCluster`` on the seeds and the nodes known now."""
        known = [(node.host, int(node.port)) for node in self.cluster.get_nodes()]
        nodes = dict.fromkeys([*self._seeds, *known])
        return redis.asyncio.RedisCluster(
            startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in nodes],
            **self._client_options(AsyncRetry),
        )

    def disconnect(self) -> None:
        """Close every connection of the blocking client."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


# -- a batch on one connection ------------------------------------------------------------------


def _key(commands: Sequence[tuple[Any, ...]]) -> Any:
    """The key of the first command: an ``EVALSHA``'s or ``EVAL``'s first key, or a ``SET``'s."""
    first = commands[0]
    return first[1] if first[0] == "SET" else first[3]


def one_node(client: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one pipeline on one connection to the primary of the first
    command's key; follow ``MOVED`` and ``ASK`` as the cluster client does for one command.

    A redirection means the script did not run there: the batch is sent again where the slot
    is. A lost node or a cluster that is down makes the client learn the slots again before
    the error goes to the operation, which decides whether to try again (as it does after
    ``TRYAGAIN``).
    """
    asking: Any = None  # the node an ASK sends the batch to
    for _ in range(_REDIRECTS):
        node = asking or client.get_node_from_key(_key(commands))
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        if asking is not None:
            pipe.execute_command("ASKING")
        for command in commands:
            pipe.execute_command(*command)
        try:
            replies: list[Any] = pipe.execute()
        except MovedError:
            client.nodes_manager.initialize()  # learn where the slot went (rare: no patching)
            asking = None
            continue
        except AskError as exc:
            asking = client.get_node(host=exc.host, port=exc.port)
            if asking is None:
                client.nodes_manager.initialize()
            continue
        except (RedisConnectionError, RedisTimeoutError, ClusterDownError):
            client.nodes_manager.initialize()
            raise
        return replies[1:] if asking is not None else replies
    raise RedisClusterException(f"the slot of {_key(commands)!r} moved {_REDIRECTS} times")


async def async_one_node(
    client: redis.asyncio.RedisCluster, commands: Sequence[tuple[Any, ...]]
) -> list[Any]:
    """:func:`one_node` for the asyncio cluster client."""
    await client.initialize()  # a loop's new client knows no slot before its first command
    asking: redis.asyncio.cluster.ClusterNode | None = None
    for _ in range(_REDIRECTS):
        node = asking or client.get_node_from_key(_key(commands))
        assert node is not None  # the client knows every slot (require_full_coverage)
        prefix = [("ASKING",)] if asking is not None else []
        batch = [
            redis.asyncio.cluster.PipelineCommand(position, *command)
            for position, command in enumerate([*prefix, *commands])
        ]
        try:
            await node.execute_pipeline(batch)
        except (RedisConnectionError, RedisTimeoutError):
            await client.nodes_manager.initialize()
            raise
        error = next((c.result for c in batch if isinstance(c.result, Exception)), None)
        if isinstance(error, MovedError):
            await client.nodes_manager.initialize()
            asking = None
        elif isinstance(error, AskError):
            asking = client.get_node(host=error.host, port=error.port)
            if asking is None:
                await client.nodes_manager.initialize()
        elif isinstance(error, ClusterDownError):
            await client.nodes_manager.initialize()
            raise error
        elif error is not None:
            raise error
        else:
            return [c.result for c in batch[len(prefix) :]]
    raise RedisClusterException(f"the slot of {_key(commands)!r} moved {_REDIRECTS} times")
