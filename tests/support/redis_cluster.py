"""A real three-node Redis Cluster the tests start for themselves (no replicas), on free ports in a temp dir.

The shared Redis on 6379 is never touched: these are private ``redis-server --cluster-enabled yes``
processes, joined with ``redis-cli --cluster create``, stopped (by their own pids) when the session ends.
Locally, missing ``redis-server``/``redis-cli`` skips the tests that need a cluster; with ``CI`` set it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.support.private_redis import require_redis_server
from tests.support.waiting import wait_for

HOST = "127.0.0.1"
NODES = 3
#: Set by the ``redis_cluster`` fixture: the store URL of the running cluster (forked test processes read it).
URL: str | None = None


@dataclass
class Cluster:
    """A running cluster: its store URL, and its nodes' ports."""

    url: str
    ports: list[int]
    folder: Path
    commands: list[list[str]] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (no redirections followed)."""
        return redis.Redis(host=HOST, port=port, socket_timeout=10)

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host=HOST, port=self.ports[0], socket_timeout=10)

    def port_of(self, key: str | bytes) -> int:
        """The port of the node that serves ``key``'s slot."""
        node = self.client().get_node_from_key(key)
        return int(node.port)

    def state(self, port: int) -> str:
        """``cluster_state`` as the node on ``port`` sees it: "ok" or "fail"."""
        return str(self.node(port).cluster("INFO")["cluster_state"])

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (its slots have no replica: the cluster goes down)."""
        process = self.processes[self.ports.index(port)]
        process.kill()
        process.wait()

    def restart(self, port: int) -> None:
        """Start the node on ``port`` again, from its nodes file (it rejoins with its slots)."""
        index = self.ports.index(port)
        self.processes[index] = subprocess.Popen(self.commands[index], cwd=self.folder)
        wait_for(f"cluster node on {port}", lambda: pings(port))


def binaries_or_skip() -> tuple[str, str]:
    """redis-server and redis-cli (which joins the nodes); skip (locally) or fail (CI) without them."""
    server, cli = require_redis_server(), shutil.which("redis-cli")
    if cli is not None:
        return server, cli
    message = "redis-cli is not installed (Debian package redis-tools); it joins the local Redis Cluster"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure)", pytrace=False)
    pytest.skip(message)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now (each bound at once, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.create_server((HOST, 0))) for _ in range(count)]
        return [s.getsockname()[1] for s in sockets]


def pings(port: int) -> bool:
    try:
        return bool(redis.Redis(host=HOST, port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _state_ok(port: int) -> bool:
    info = redis.Redis(host=HOST, port=port, socket_timeout=1).cluster("INFO")
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == NODES


def start(*, node_timeout_ms: int = 5000) -> Cluster:
    """Three nodes joined into one cluster, every slot served; ``node_timeout_ms``: how long a node may be
    silent before the others count it failed (and, without replicas, the cluster down)."""
    server, cli = binaries_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="guardrails-cluster-"))
    ports = free_ports(2 * NODES)
    cluster = Cluster(url="", ports=ports[:NODES], folder=folder)
    try:
        for port, bus in zip(ports[:NODES], ports[NODES:], strict=True):
            command = [server, "--port", str(port), "--cluster-port", str(bus), "--bind", HOST]
            command += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            command += ["--cluster-node-timeout", str(node_timeout_ms), "--save", "", "--appendonly", "no"]
            command += ["--dir", str(folder), "--logfile", f"redis-{port}.log", "--daemonize", "no"]
            cluster.commands.append(command)
            cluster.processes.append(subprocess.Popen(command, cwd=folder))
        for port in cluster.ports:
            wait_for(f"cluster node on {port}", lambda port=port: pings(port))
        nodes = [f"{HOST}:{port}" for port in cluster.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        for port in cluster.ports:
            wait_for(f"cluster_state:ok on {port}", lambda port=port: _state_ok(port))
    except BaseException:
        stop(cluster)
        raise
    cluster.url = ";".join(f"redis+cluster://{HOST}:{port}" for port in cluster.ports)
    return cluster


def stop(cluster: Cluster) -> None:
    for process in cluster.processes:
        process.terminate()
    for process in cluster.processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(cluster.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A three-node Redis Cluster for the session (started on first use)."""
    global URL
    cluster = start()
    URL = cluster.url
    try:
        yield cluster
    finally:
        URL = None
        stop(cluster)
