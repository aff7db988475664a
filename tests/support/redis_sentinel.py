"""A real Redis master, its replica and one Sentinel watching them, private to a test, on free ports.

Started with ``redis-server`` (``--sentinel`` for the Sentinel) in a temp dir and stopped by their own pids:
the shared Redis on 6379 is never touched. Missing binaries skip locally and fail with ``CI`` set.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.support.redis_cluster import HOST, binaries_or_skip, free_ports, pings
from tests.support.waiting import wait_for

MASTER_NAME = "guardrails-test"


@dataclass
class Sentinel:
    """A running master, replica and Sentinel: their ports, and the store URL through the Sentinel."""

    master: int
    replica: int
    sentinel: int
    folder: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"sentinel://{HOST}:{self.sentinel}/0?master_name={MASTER_NAME}"

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=10)

    def master_port(self) -> int:
        """The master's port as the Sentinel tells it."""
        _, port = self.node(self.sentinel).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return int(port)

    def role(self, port: int) -> str:
        """The node's role; "" while it cannot say (a master being demoted closes its clients' connections:
        seen as "Connection closed by server" on a CI run, the probe then asks again)."""
        try:
            return str(self.node(port).info("replication")["role"])
        except redis.ConnectionError:
            return ""


def _server(server: str, folder: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = [server, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    command += ["--dir", str(folder), "--logfile", f"redis-{port}.log", "--daemonize", "no", *extra]
    return subprocess.Popen(command, cwd=folder)


def start() -> Sentinel:
    server, _ = binaries_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="guardrails-sentinel-"))
    master, replica, sentinel = free_ports(3)
    setup = Sentinel(master=master, replica=replica, sentinel=sentinel, folder=folder)
    try:
        setup.processes.append(_server(server, folder, master))
        setup.processes.append(_server(server, folder, replica, "--replicaof", HOST, str(master)))
        wait_for("the replica in sync", lambda: pings(replica) and _linked(setup))
        # Sentinel rewrites its configuration file: a file of its own, in the temp dir.
        config = folder / "sentinel.conf"
        config.write_text(
            f"port {sentinel}\nbind {HOST}\ndir {folder}\nlogfile sentinel.log\n"
            f"sentinel monitor {MASTER_NAME} {HOST} {master} 1\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 2000\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
        )
        setup.processes.append(subprocess.Popen([server, str(config), "--sentinel"], cwd=folder))
        wait_for("the Sentinel to know the replica", lambda: pings(sentinel) and _knows_replica(setup))
    except BaseException:
        stop(setup)
        raise
    return setup


def _linked(setup: Sentinel) -> bool:
    return setup.node(setup.replica).info("replication").get("master_link_status") == "up"


def _knows_replica(setup: Sentinel) -> bool:
    """The Sentinel has talked to the replica itself (it promotes no replica it only heard of)."""
    replicas = setup.node(setup.sentinel).sentinel_slaves(MASTER_NAME)
    return any(
        int(r["port"]) == setup.replica and not r["is_disconnected"] and r["master-link-status"] == "ok" and r["runid"]
        for r in replicas
    )


def stop(setup: Sentinel) -> None:
    for process in setup.processes:
        process.terminate()
    for process in setup.processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(setup.folder, ignore_errors=True)


@pytest.fixture
def redis_sentinel() -> Iterator[Sentinel]:
    """A master, a replica and a Sentinel of this test's own."""
    setup = start()
    try:
        yield setup
    finally:
        stop(setup)
