"""The test kit's own bad days: a worker that cannot start, a store it cannot cut (no worker needed)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from celery_guardrails.testing import Kit, KitError, WorkerFailed
from tests.kit_proj import tasks
from tests.kit_proj.app import app


def test_a_worker_that_cannot_start_says_why(tmp_path: Path) -> None:
    # Given an app path the worker cannot import
    kit = Kit(celery_app=app, app_path="tests.kit_proj.no_such_module:app", folder=tmp_path)
    # When it starts: the worker's own error, not a time-out
    with pytest.raises(WorkerFailed, match=r"(?s)exited with 2.*No module named 'tests.kit_proj.no_such_module'"):
        kit.start()
    kit.close()


def test_store_outage_on_a_store_it_cannot_cut_says_why(tmp_path: Path) -> None:
    # Given the Django store on a SQLite file (no connection a proxy could cut)
    sqlite = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "/tmp/kit.sqlite3"}}
    kit = Kit(celery_app=app, app_path="tests.kit_proj.app:app", folder=tmp_path, databases=sqlite)
    # Then store_outage refuses at once, naming the reason (no worker was needed to tell)
    with pytest.raises(KitError, match="SQLite database: a file, with no connection to cut"):
        kit.store_outage(tasks.swallow_guarded, uuid.uuid4().hex)
    kit.close()
