"""A rollout with old and new workers side by side, on real workers and the Django dead letters: what a new
publisher sends in version 2 is dead-lettered by an old worker (accepts 1) with its reason, nothing is lost,
and once a new worker runs, a replay of those records processes each once, in version 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from django_celery_guardrails.models import DeadLetter
from django_celery_guardrails.replay import replay_dead_letters
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_old_worker_dead_letters_version_2_and_a_replay_on_a_new_one_runs_it(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    sinks = {"dead_letter_sinks": ["django"], "store": "django"}
    # Given a new publisher sending version 2 of the payload, and version 1 messages already queued
    old_messages = [tasks.versioned.delay(sink.key, n) for n in range(2)]
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, **sinks, "payload_version": 2}
    new_messages = [tasks.versioned.delay(sink.key, 100 + n) for n in range(5)]
    # When an old worker (sends and accepts version 1) takes them all
    old_env = proj_env(queue=queue_name, django=True, GUARDRAILS_TEST_GUARDRAILS=json.dumps(sinks))
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "old.log", env=old_env):
        for result in old_messages:
            result.get(timeout=60)
        for result in new_messages:
            with pytest.raises(Exception, match="payload version 2 is not one this worker accepts"):
                result.get(timeout=60)
        new_ids = {result.id for result in new_messages}
        wait_for("five dead letters", lambda: DeadLetter.objects.filter(task_id__in=new_ids).count() == 5)
    # Then the version 1 messages ran; each version 2 one is a dead letter with its reason, none ran
    assert sorted(r["order_id"] for r in sink.items()) == [0, 1]
    records = DeadLetter.objects.filter(task_id__in=new_ids)
    assert {record.reason for record in records} == {"unknown_payload_version"}
    # When new workers run (accepting 1 and 2) and the records are replayed
    new_env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({**sinks, "payload_version": 2, "accepts_versions": [1, 2]}),
    )
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "new.log", env=new_env):
        replayed = replay_dead_letters(DeadLetter.objects.filter(reason="unknown_payload_version", task_id__in=new_ids))
        for _, task_id in replayed.replayed:
            celery_app.AsyncResult(task_id).get(timeout=60)
    # Then each ran once, in version 2, and nothing was lost
    runs = sorted((r["order_id"], r["pv"]) for r in sink.items() if r["order_id"] >= 100)
    assert runs == [(100 + n, 2) for n in range(5)]
    assert len(replayed.replayed) == 5
    assert set(DeadLetter.objects.filter(task_id__in=new_ids).values_list("status", flat=True)) == {"replayed"}
