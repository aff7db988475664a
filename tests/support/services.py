"""The real services the tests use, and what a test does when one is missing.

Locally a missing service skips the test with a message saying how to start it; with ``CI`` set it fails,
so a green CI run always means the services were there.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
PORTS = {"redis": 6379, "postgres": 5432, "rabbitmq": 5672}

# One Redis database per running suite (1 to 11; the bench uses 12, the demo 14): two suites run at once from
# two checkouts (a flake hunt in one, work in the other, helpers in worktrees) would otherwise share keys whose
# names are fixed (alert throttles, kombu's unacked index: a worker of one suite with a 3 s visibility timeout
# gave back the other suite's held messages). pytest-xdist runs the suite in several processes (gw0, gw1, ...):
# each claims a database of its own too. A claim is a key in database 0 (SET NX, three hours: a run that dies
# without releasing it frees it then, or at once a process of the same host that finds it dead); the checkout's
# hashed choice is tried first. Processes the tests start
# inherit GUARDRAILS_TEST_REDIS_URL and claim nothing (see _CLAIMANT below).
_CHECKOUT = Path(__file__).resolve().parents[2]
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_DATABASES = range(1, 12)
_CLAIM_SECONDS = 3 * 3600


_TOKEN = f"{socket.gethostname()}:{os.getpid()}:{_CHECKOUT}"


def _claim_database() -> int:
    preferred = _DATABASES[(int(hashlib.sha256(str(_CHECKOUT).encode()).hexdigest(), 16) + _WORKER) % len(_DATABASES)]
    try:
        import redis

        client = redis.Redis(host=HOST, port=PORTS["redis"], db=0, socket_timeout=2, socket_connect_timeout=2)
        order = [preferred, *(n for n in _DATABASES if n != preferred)]
        for take in (_take_free, _take_stale):
            for database in order:
                if take(client, f"guardrails-test-db:{database}"):
                    atexit.register(_release, client, database, _TOKEN)
                    return database
    except Exception:  # no Redis (the tests that need it say so), or every database claimed: share the hashed one
        pass
    return preferred


def _take_free(client: Any, key: str) -> bool:
    return bool(client.set(key, _TOKEN, nx=True, ex=_CLAIM_SECONDS))


def _take_stale(client: Any, key: str) -> bool:
    """Take a claim whose process, on this host, has ended without releasing it (a process killed, or one
    whose exit ran no atexit handler): it would keep the database for three hours."""
    import redis

    with client.pipeline() as pipe:
        try:
            pipe.watch(key)
            held = pipe.get(key)
            host, pid, _ = (held or b"::").decode().split(":", 2)
            if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
                return False
            pipe.multi()
            pipe.set(key, _TOKEN, ex=_CLAIM_SECONDS)
            pipe.execute()
            return True
        except redis.WatchError:  # another process took it first
            return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def release_claim() -> None:
    """Give this process's database back now: when pytest-xdist's controller starts (it runs no test, and make
    test runs passes side by side, eight test processes that each need one of their own), and when a test process
    ends (pytest-xdist's processes end without running atexit handlers)."""
    import redis

    with contextlib.suppress(Exception):  # a URL set by hand names what it likes; _release checks the claim
        client = redis.Redis(host=HOST, port=PORTS["redis"], db=0, socket_timeout=2, socket_connect_timeout=2)
        _release(client, int(REDIS_URL.rsplit("/", 1)[-1]), _TOKEN)


def _release(client: Any, database: int, token: str) -> None:
    with contextlib.suppress(Exception):
        if client.get(f"guardrails-test-db:{database}") == token.encode():
            client.delete(f"guardrails-test-db:{database}")


# Who claimed the database in GUARDRAILS_TEST_REDIS_URL: xdist's workers inherit the environment of the process
# that started them (which claimed one too), and must claim their own; the processes a test starts inherit their
# test process's, and keep it. A URL set by hand (no claimant) is kept everywhere.
_CLAIMANT = os.environ.get("PYTEST_XDIST_WORKER", "main")
_claimed_by = os.environ.get("GUARDRAILS_TEST_REDIS_CLAIMANT")
if "GUARDRAILS_TEST_REDIS_URL" not in os.environ or (_claimed_by is not None and _claimed_by != _CLAIMANT):
    os.environ["GUARDRAILS_TEST_REDIS_URL"] = f"redis://{HOST}:{PORTS['redis']}/{_claim_database()}"
    os.environ["GUARDRAILS_TEST_REDIS_CLAIMANT"] = _CLAIMANT
REDIS_URL = os.environ["GUARDRAILS_TEST_REDIS_URL"]
BROKER_URLS = {
    "redis": REDIS_URL,
    "amqp": os.environ.get("GUARDRAILS_TEST_AMQP_URL", f"amqp://guest:guest@{HOST}:5672//"),
}
BROKER_SERVICE = {"redis": "redis", "amqp": "rabbitmq"}


def answers(service: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((HOST, PORTS[service]), timeout=timeout):
            return True
    except OSError:
        return False


def require(service: str) -> None:
    """Skip (locally) or fail (CI) the calling test when ``service`` does not answer."""
    if answers(service):
        return
    # (pytest imported here: the test settings import this module in every worker subprocess, which runs no test;
    # pytest was a fifth of a second of each one's start.)
    import pytest

    message = f"{service} is not answering on {HOST}:{PORTS[service]}; start it with `make services`"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure)", pytrace=False)
    pytest.skip(message)
