"""Redis clients from a URL — one server or a Redis Cluster — and how their failures are told to an operator.

- ``redis://``, ``rediss://``, ``unix://``: one server (``redis.asyncio.Redis.from_url``).
- ``redis+cluster://[user:password@]host:port[,host:port…][/0]`` (``rediss+cluster://`` with TLS): a Redis
  Cluster (``redis.asyncio.cluster.RedisCluster``) with every listed node as a startup node; any reachable one
  is enough to discover the others.

Every key fairgate writes carries a hash tag (``{<namespace>}``), so each Lua script, pipeline and transaction
touches one slot: the cluster client routes ``EVALSHA`` by its keys and loads scripts on every primary
(``register_script`` works as on one server; tests/test_redis_cluster.py).

A ``redis://`` URL that names a cluster node is refused by the shared state's sync (its KV budgets span the
cluster's slots), and a call at a node that does not own its slot is answered ``MOVED``; ``explain`` says
"use redis+cluster://" for both (the gateway is then not ready: storage/shared_state.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.exceptions import (AskError, ClusterCrossSlotError, ClusterDownError, RedisClusterException,
                              RedisError)

SINGLE = ("redis", "rediss", "unix")
CLUSTER = ("redis+cluster", "rediss+cluster")
# what a Redis call may raise: RedisClusterException (e.g. no startup node reachable) is not a RedisError
ERRORS = (RedisError, RedisClusterException, OSError)
Client = aioredis.Redis | RedisCluster


class RedisURLError(ValueError):
    pass


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_cluster_url(url: str) -> ClusterURL:
    """``redis+cluster://[user:password@]host:port[,host:port…][/0]``; IPv6 hosts in brackets."""
    u = urlsplit(url)
    if u.scheme not in CLUSTER:
        raise RedisURLError(f"{redacted(url)}: not a {' or '.join(CLUSTER)} URL")
    if u.path not in ("", "/", "/0"):
        raise RedisURLError(f"{redacted(url)}: a Redis Cluster has one database (0)")
    if u.query or u.fragment:
        raise RedisURLError(f"{redacted(url)}: options in the URL are not supported with a cluster")
    userinfo, _, hosts = u.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    nodes = []
    for item in hosts.split(","):
        node = _node(item)
        if node is None:
            raise RedisURLError(f"{redacted(url)}: expected host:port[,host:port…], got {item!r}")
        nodes.append(node)
    ssl = u.scheme == "rediss+cluster"
    return ClusterURL(tuple(nodes), unquote(user) or None, unquote(password) or None, ssl)


def _node(item: str) -> tuple[str, int] | None:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif item.count(":") == 1:
        host, _, port = item.partition(":")
    else:
        host, port = item, ""
    port = port or "6379"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check_url(url: str) -> None:
    """Raise ``RedisURLError`` (at startup) for a URL no client can be made from."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER:
        parse_cluster_url(url)
    elif scheme in SINGLE:
        try:
            parse_url(url)
        except ValueError as e:
            raise RedisURLError(f"{redacted(url)}: {e}") from None
    else:
        raise RedisURLError(f"redis_url {redacted(url)!r}: unknown scheme {scheme!r}; expected "
                            "redis://host:port (one server) or redis+cluster://host:port[,host:port…] "
                            "(Redis Cluster)")


MAX_CONNECTIONS = 64  # per client (one per replica, and one for the prefix index's subscriber)


def redis_client(url: str, timeout_s: float) -> Client:
    """A client for ``url``: each call waits at most ``timeout_s`` for a connection and for an answer."""
    check_url(url)
    if urlsplit(url).scheme in SINGLE:
        # a pool that waits for a free connection (up to the timeout) rather than failing the call: every
        # request's limits go to Redis, and a burst past the pool must queue, not fall back to local shares
        pool = aioredis.BlockingConnectionPool.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                        max_connections=MAX_CONNECTIONS, timeout=timeout_s)
        return aioredis.Redis.from_pool(pool)  # (the client owns its pool: aclose() closes both)
    c = parse_cluster_url(url)
    # one retry (after re-reading the slot map): the callers try again on their next tick anyway, and a
    # client's own long retry series would only delay the verdict "Redis is not answering"
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in c.nodes], username=c.username,
                        password=c.password, ssl=c.ssl, socket_timeout=timeout_s,
                        socket_connect_timeout=timeout_s,
                        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=1))


def is_cluster(client: Client) -> bool:
    return isinstance(client, RedisCluster)


async def single_at_cluster_node(client: Client) -> bool:
    """A one-server client whose server is a Redis Cluster node (it works while that node owns the slot)."""
    if is_cluster(client):
        return False
    try:
        return bool((await client.info("cluster")).get("cluster_enabled"))
    except ERRORS:
        return False


class NodeOfCluster(RedisError):
    """A ``redis://`` URL names one node of a Redis Cluster: the shared state spans the cluster's slots."""


def explain(error: BaseException) -> str:
    """One line for an operator: what failed and, where it is clear, what to do."""
    if isinstance(error, NodeOfCluster):
        return str(error)
    if isinstance(error, AskError):  # MovedError is an AskError
        return (f"a Redis Cluster node answered {type(error).__name__.removesuffix('Error').upper()} (slot "
                f"{error.slot_id} is at {error.host}:{error.port}): the URL names one node of a cluster; use "
                "redis+cluster://host:port[,host:port…]")
    if isinstance(error, ClusterCrossSlotError):
        return f"keys in several cluster slots ({error}): a key without the namespace's hash tag"
    if isinstance(error, ClusterDownError):
        return f"the Redis Cluster is down ({error})"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def redacted(url: str) -> str:
    """``url`` without its password (for logs and /ready)."""
    u = urlsplit(url)
    userinfo, at, rest = u.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return u._replace(netloc=f"{userinfo.partition(':')[0]}:***@{rest}").geturl()


class Link:
    """Whether a client's last call worked: logged once per change (never on every failed attempt), with the
    reason kept for /ready."""

    def __init__(self, what: str, log: logging.Logger, effect: str = ""):
        self.what, self.log, self.effect = what, log, effect  # effect: what a failure means, for the log
        self.up: bool | None = None  # None: not tried yet
        self.reason: str | None = "not synchronised yet"

    def worked(self) -> None:
        if self.up is not True:
            self.log.info("%s: Redis answers%s", self.what, " again" if self.up is False else "")
        self.up, self.reason = True, None

    def failed(self, error: BaseException) -> None:
        self.reason = explain(error)
        if self.up is not False:
            self.log.warning("%s: %s%s", self.what, self.reason, f" — {self.effect}" if self.effect else "")
        self.up = False
