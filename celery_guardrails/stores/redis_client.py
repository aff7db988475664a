"""The redis-py client of a Redis URL, for the store and the dead-letter stream.

Three kinds of URL:

* one server, redis-py's own grammar: ``redis://[[user]:password@]host:6379/1``, ``rediss://...`` (TLS),
  ``unix:///path/redis.sock?db=1``;
* a Redis Cluster: ``redis+cluster://[[user]:password@]host:7000`` (``rediss+cluster://`` for TLS), more
  seed nodes after ``;`` (``redis+cluster://a:7000;redis+cluster://b:7000``): the client asks a seed for the
  slot map and follows MOVED/ASK itself. No database number (a cluster has only database 0). Query options
  (``client_name=...``, TLS options) are redis-py's, on the first node;
* Sentinel, the way Celery writes it for its broker and result backend: ``sentinel://host:26379/1;
  sentinel://host2:26379/1?master_name=mymaster``, the master's name in ``master_name`` (Celery reads it from
  ``broker_transport_options``). User, password and database on the first address are the master's;
  ``sentinel_password`` is the Sentinels' own, if they ask for one. The client asks the Sentinels for the
  master on every new connection, so a failover is followed.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from celery_guardrails.exceptions import StoreError, StoreUnavailableError
from celery_guardrails.options import masked

SERVER_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEME = "sentinel://"
SCHEMES = (*SERVER_SCHEMES, *CLUSTER_SCHEMES, SENTINEL_SCHEME)


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def check_url(url: str) -> str:
    """``url`` if the store can connect with it; ValueError saying what is wrong otherwise (at start-up)."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"a Redis URL starts with one of {', '.join(SCHEMES)}, got {url!r:.80}")
    if is_cluster(url):
        _cluster_nodes(url)
    elif url.startswith(SENTINEL_SCHEME):
        _sentinel_parts(url)
    return url


def connect(url: str, *, timeout: float | None) -> Any:
    """A client for ``url`` (see the module docstring) whose sockets time out after ``timeout`` seconds.

    No connection is made here, for any kind: a store made while its Redis is down fails in its first
    operation, where the failure is reported as an outage (not where the store is made, for every caller).
    """
    import redis

    sockets: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if is_cluster(url):
        return LazyCluster(url, sockets)
    if url.startswith(SENTINEL_SCHEME):
        from redis.sentinel import Sentinel

        hosts, master, options = _sentinel_parts(url)
        sentinel_kwargs: dict[str, Any] = dict(sockets)
        if options.get("sentinel_password"):
            sentinel_kwargs["password"] = options["sentinel_password"]
        sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **sockets)
        credentials = {name: options[name] for name in ("username", "password") if options.get(name)}
        return sentinel.master_for(master, db=int(options.get("db") or 0), **credentials)
    return redis.Redis.from_url(url, **sockets)


class LazyCluster:
    """A :class:`redis.cluster.RedisCluster` made at its first command.

    RedisCluster's constructor connects: it asks the seed nodes for the slot map, and raises when none
    answers. Made at first use, a store made while the cluster is down reports an outage from the operation
    that needed it (redis-py's ``ConnectionError``), and tries again at the next one.
    """

    def __init__(self, url: str, sockets: dict[str, Any]) -> None:
        self.url = url
        self._sockets = sockets
        self._client: Any = None
        self._lock = threading.Lock()

    def register_script(self, script: str) -> Any:
        """A script that runs on this client (connecting at its first call, like any command)."""
        from redis.commands.core import Script

        return Script(self, script)

    def get_encoder(self) -> Any:
        """The encoder redis-py's ``Script`` asks for when it is registered (no connection needed)."""
        from redis.connection import Encoder

        return Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)

    def connected(self) -> Any:
        client = self._client
        if client is not None:
            return client
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        with self._lock:
            if self._client is None:
                first, others = _cluster_nodes(self.url)
                seeds = [ClusterNode(host, port) for host, port in others]
                try:
                    self._client = RedisCluster.from_url(first, startup_nodes=seeds, **self._sockets)
                except redis.exceptions.RedisClusterException as exc:  # no seed answered, or slots uncovered
                    raise redis.ConnectionError(f"Redis Cluster not reachable: {exc}") from exc
            return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connected(), name)


def _cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """The first node as a redis-py URL, then every other seed's (host, port)."""
    chunks = [chunk for chunk in url.split(";") if chunk]
    first = chunks[0].replace("+cluster://", "://", 1)
    parts = urlsplit(first)
    if parts.path.strip("/") not in ("", "0") or parse_qs(parts.query).get("db", ["0"]) != ["0"]:
        raise ValueError(f"a Redis Cluster has only database 0; remove it from {url!r:.80}")
    others = []
    for chunk in chunks[1:]:
        if not chunk.startswith(CLUSTER_SCHEMES):
            raise ValueError(f"each node of a cluster URL starts with redis+cluster://, got {chunk!r:.80}")
        node = urlsplit(chunk)
        others.append((node.hostname or "127.0.0.1", node.port or 6379))
    return first, others


_SENTINEL_OPTIONS = {"master_name", "sentinel_password", "db", "username", "password"}


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, dict[str, str]]:
    """The Sentinels' (host, port), the master's name, and the options (db, credentials, query)."""
    hosts: list[tuple[str, int]] = []
    options: dict[str, str] = {}
    for index, chunk in enumerate(chunk for chunk in url.split(";") if chunk):
        if not chunk.startswith(SENTINEL_SCHEME):
            raise ValueError(f"each address of a Sentinel URL starts with sentinel://, got {chunk!r:.80}")
        parts = urlsplit(chunk)
        hosts.append((parts.hostname or "127.0.0.1", parts.port or 26379))
        options.update({name: values[-1] for name, values in parse_qs(parts.query).items()})
        if index == 0:  # the master's database and credentials, as Celery reads them
            if parts.path.strip("/"):
                options.setdefault("db", parts.path.strip("/"))
            if parts.username:
                options["username"] = unquote(parts.username)
            if parts.password:
                options["password"] = unquote(parts.password)
    unknown = sorted(set(options) - _SENTINEL_OPTIONS)
    if unknown:  # e.g. ssl=true: silently ignored, it would connect in clear
        raise ValueError(f"a Sentinel URL takes master_name, sentinel_password and db; not {', '.join(unknown)}")
    master = options.pop("master_name", "")
    if not master:
        raise ValueError(f"a Sentinel URL names its master: add ?master_name=... to {url!r:.80}")
    if not options.get("db", "0").isdigit():
        raise ValueError(f"the database of a Sentinel URL is a number, got {options['db']!r:.20}")
    return hosts, master, options


#: Error replies of a server that cannot answer now but will (a cluster or replica in the middle of a change).
_NOT_YET = ("MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "LOADING")
#: How redis-py's cluster client says that no node answered while it reloaded the slot map (it raises a bare
#: RedisClusterException; a key-to-slot mistake of the caller is one too, and is refused).
_CLUSTER_UNREACHABLE = ("Redis Cluster cannot be connected", "All slots are not covered")


def failure(what: str, url: str, exc: BaseException) -> StoreError:
    """The error for a redis-py error of ``what`` (the store, a dead-letter sink) at ``url``: unavailable for a
    connection that failed or timed out, or a server that cannot answer yet (loading, read-only or without its
    master during a failover); refused for anything else."""
    import redis

    # redis-py raises MASTERDOWN, TRYAGAIN and CLUSTERDOWN replies as classes of their own, the code taken out of
    # the text (LOADING is a ConnectionError); a script's error reply keeps the code in its text. Its cluster
    # client follows MOVED and ASK itself; it gives up with ClusterError (redirected too often: slots moving),
    # SlotNotCoveredError, or a RedisClusterException when no node answers while it reloads the slot map.
    errors = redis.exceptions
    not_yet = (errors.MasterDownError, errors.TryAgainError, errors.ClusterError, errors.SlotNotCoveredError)
    unavailable = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError, OSError, *not_yet)
    text = str(exc)
    url = masked(url)  # the error is logged and alerted: never with the URL's password
    if not (
        isinstance(exc, unavailable)
        or text.startswith(_NOT_YET)
        or (isinstance(exc, errors.RedisClusterException) and text.startswith(_CLUSTER_UNREACHABLE))
    ):
        return StoreError(f"{what} at {url} refused: {exc}")
    return StoreUnavailableError(f"{what} at {url} unavailable: {exc}")
