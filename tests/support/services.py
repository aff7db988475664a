"""The real services the tests use, and what a test does when one is missing.

Locally a missing service skips the test with a message saying how to start it; with ``CI`` set it fails,
so a green CI run always means the services were there.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

HOST = "127.0.0.1"
PORTS = {"redis": 6379, "postgres": 5432, "rabbitmq": 5672}

# One Redis database per checkout (1 to 12; the demo uses 14): two suites run at once from two clones (a
# flake hunt in one, work in the other) would otherwise share keys whose names are fixed (alert throttles).
_CHECKOUT = Path(__file__).resolve().parents[2]
# pytest-xdist runs the suite in several processes (gw0, gw1, ...): each has a database of its own too, next to
# the checkout's (kombu's unacked index, its restore mutex and the fixed-name keys are per database).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_DB = 1 + (int(hashlib.sha256(str(_CHECKOUT).encode()).hexdigest(), 16) + _WORKER) % 12
REDIS_URL = os.environ.setdefault("GUARDRAILS_TEST_REDIS_URL", f"redis://{HOST}:6379/{_DB}")
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
    message = f"{service} is not answering on {HOST}:{PORTS[service]}; start it with `make services`"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure)", pytrace=False)
    pytest.skip(message)
