"""Workers whose broker and guardrails store are one Redis (the ack on the store, the claim with the pop), and the
effects their keyed charges count: shared by the tests of both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Sink
from tests.support.services import REDIS_URL
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

#: The charge whose result is ignored (its completion may ride the ack).
QUIET = "tests.proj.tasks.charge_quietly"


def shared_worker(
    queue: str,
    tmp_path: Path,
    *,
    url: str = REDIS_URL,
    pool: str = "solo",
    concurrency: int = 1,
    name: str = "worker",
    env: dict[str, str] | None = None,
    **guardrails: Any,
) -> WorkerProcess:
    """A worker of ``pool`` whose broker and store are ``url`` (the same Redis), with a 6 s idempotency lease and
    these other guardrails settings, and ``env`` beside."""
    settings = {"store": url, "idempotency_lease": 6.0, **guardrails}
    worker_env = proj_env(
        queue=queue, GUARDRAILS_TEST_BROKER_URL=url, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings), **(env or {})
    )
    log = tmp_path / f"{name}.log"
    return WorkerProcess(app=PROJ_APP, queue=queue, pool=pool, concurrency=concurrency, log_path=log, env=worker_env)


def key_of(oid: int, tenant: str = "-") -> str:
    """The scoped key of ``charge_quietly`` for order ``oid``."""
    return f"{QUIET}:{tenant}:charge:{oid}"


def effects(sink: Sink) -> int:
    """The effects the charges of ``sink`` counted."""
    return int(sink.client.get(f"{sink.key}:effects") or 0)


__all__ = ["QUIET", "effects", "key_of", "shared_worker"]
