"""Django settings for the tests: the example project, on PostgreSQL or SQLite (GUARDRAILS_TEST_DB)."""

import os

from example_project.settings import *  # noqa: F403

DB = os.environ.get("GUARDRAILS_TEST_DB", "sqlite")
if DB == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "guardrails",
            "USER": os.environ.get("GUARDRAILS_TEST_PGUSER", "postgres"),
            "HOST": "127.0.0.1",
            "PORT": "5432",
            "TEST": {"NAME": "test_guardrails"},
        }
    }
elif DB == "sqlite":
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
else:
    raise RuntimeError(f"GUARDRAILS_TEST_DB must be 'postgres' or 'sqlite', not {DB!r}")
