"""The suite's soak (``python -m soak.run --short``): a few hundred jobs of every kind through two real prefork
workers (RabbitMQ) on the Django store with ``atomic=True``, one worker SIGKILLed mid-run, the store (the
database) cut for a few seconds; and a few dozen on a RabbitMQ quorum queue (topic exchange: Celery's native
delayed delivery carries every retry and wait), one worker SIGKILLed. ``make soak`` runs the long one, with
restarts of the broker and PostgreSQL and both stores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from soak.run import Result, judge, plan_jobs, tally
from tests.support.services import require
from tests.support.workers import ROOT


def test_the_job_plan_has_the_documented_mix() -> None:
    # Given 1,000 logical jobs
    kinds, messages = plan_jobs(1000, seed=1)
    # Then 1% are poison, 2% permanent, 10% transient, 5% wait twice (RetryLater), the rest ok; 20% of them are
    # published twice
    counts = {kind: list(kinds.values()).count(kind) for kind in ("poison", "permanent", "transient", "later", "ok")}
    assert counts == {"poison": 10, "permanent": 20, "transient": 100, "later": 50, "ok": 820}
    assert len(messages) == 1200 and set(messages) == set(kinds)
    assert sum(1 for job in kinds if messages.count(job) == 2) == 200


@pytest.mark.parametrize("store", ["redis", "django"])
def test_a_job_ended_not_idempotent_after_its_effect_is_reconciled_on_the_redis_store_only(store: str) -> None:
    from collections import Counter

    # Given three ok jobs: one done, one ended not_idempotent after its marked effect whose COMMIT was lost (no
    # effect: replayed with allow_not_idempotent, then done once), one ended not_idempotent whose effect had landed
    kinds = {"j1": "ok", "j2": "ok", "j3": "ok"}
    before = Counter({"j1": 1, "j3": 1})
    dead = [("j2", "not_idempotent"), ("j3", "not_idempotent")]
    result = Result(store=store, broker="rabbitmq", jobs=3, messages=3)
    # When the soak counts them (on the Redis store j2 was reconciled: replayed, and done once)
    reconciled = {"j2"} if store == "redis" else set()
    after = before + Counter(reconciled)
    tally(result, kinds, Counter(kinds), before, after, dead, reconciled)
    judge(result, kombu_pop=False)
    row = result.per_kind["ok"]
    if store == "redis":
        # Then on the Redis store (the key does not commit with the effect) none is lost, misfiled or doubled
        assert (row["lost"], row["doubled"], row["misfiled"], result.replay_duplicates) == (0, 0, 0, 0)
        assert result.failures == []
    else:
        # Then on the Django store (atomic=True: such a failure is safe to retry) they are misfiled, and j2 is lost
        assert result.failures == ["1 ok job(s) lost", "2 ok dead letter(s) misfiled: {'not_idempotent': 2}"]


def run_short_soak(tmp_path: Path, *arguments: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``python -m soak.run --short`` on the Django store and RabbitMQ with ``arguments``: its one result."""
    require("rabbitmq")
    require("postgres")
    command = [sys.executable, "-m", "soak.run", "--short", "--store", "django", "--broker", "rabbitmq", *arguments]
    done = subprocess.run(
        [*command, "--json", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "[" in done.stdout, done.stdout + done.stderr
    [result] = json.loads(done.stdout[done.stdout.index("\n[") :])
    return result, done


@pytest.mark.timeout(600)  # two workers start, one restarts, a database cut; on two shared cores
def test_a_short_soak_loses_nothing_doubles_nothing_and_files_every_dead_letter(tmp_path: Path) -> None:
    # Given 300 jobs on the Django store (atomic), two prefork workers on RabbitMQ, one SIGKILL and a 5 s
    # database cut (every loss fails)
    # When the soak runs them, fixes the permanent failures and replays their dead letters
    result, done = run_short_soak(tmp_path, "--jobs", "300", "--store-cut", "5")
    # Then the chaos happened: one worker killed, the store cut
    assert result["killed"] == 1 and any("store cut" in event for event in result["events"]), result["events"]
    # And no job was lost or doubled, before or after the replay, and every dead letter has the right reason
    for kind, row in result["per_kind"].items():
        assert (kind, row["lost"], row["doubled"], row["misfiled"]) == (kind, 0, 0, 0), result
    assert result["reasons"]["permanent"] == {"permanent": 6} and result["reasons"]["poison"] == {"poison": 3}
    # And nothing is left claimed, the replay added no duplicate, the soak passed
    assert (result["claimed_keys"], result["replay_duplicates"], result["failures"]) == (0, 0, [])
    assert done.returncode == 0, done.stdout[-3000:]


@pytest.mark.timeout(300)  # two workers start, one restarts; on two shared cores
def test_a_short_soak_on_a_quorum_queue_loses_nothing_and_loops_nothing(tmp_path: Path) -> None:
    # Given 40 jobs on a RabbitMQ quorum queue bound to a topic exchange (Celery's native delayed delivery carries
    # every retry and wait: 4 fail transiently twice with waits under a second, 2 wait 0.3 s then 3 s), on the
    # Django store (atomic), two prefork workers, one SIGKILL
    # When the soak runs them, fixes the permanent failure and replays its dead letter
    result, done = run_short_soak(tmp_path, "--jobs", "40", "--store-cut", "0", "--queue-type", "quorum")
    assert (result["queue_type"], result["exchange"], result["killed"]) == ("quorum", "topic", 1), result["events"]
    # Then no job was lost or doubled, and each failing one has its one dead letter with the right reason
    for kind, row in result["per_kind"].items():
        assert (kind, row["lost"], row["doubled"], row["misfiled"]) == (kind, 0, 0, 0), result
    assert result["reasons"] == {
        "ok": {},
        "transient": {},
        "later": {},
        "permanent": {"permanent": 1},
        "poison": {"poison": 1},
    }
    # And no job looped: every run was counted (at least 32 ok + 4 x 3 transient + 2 x 3 later + 2 permanent + 1
    # poison), and none ran more than 8 times (a poison job published twice: 4 deliveries per copy)
    assert result["runs"] >= 53 and result["most_runs"] <= 8, result
    assert (result["claimed_keys"], result["replay_duplicates"], result["failures"]) == (0, 0, [])
    assert done.returncode == 0, done.stdout[-3000:]
