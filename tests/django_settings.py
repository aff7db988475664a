"""Django settings for the tests: the example project, on PostgreSQL or SQLite (GUARDRAILS_TEST_DB)."""

import hashlib
import os
import tempfile

from tests.support.services import REDIS_URL

# The example project's Celery app publishes to the test Redis, on a queue of this test session only, so a
# worker subprocess started by a test (with the same environment) consumes exactly what the test enqueued.
os.environ.setdefault("EXAMPLE_BROKER_URL", REDIS_URL)
os.environ.setdefault("EXAMPLE_RESULT_BACKEND", REDIS_URL)
os.environ.setdefault("EXAMPLE_QUEUE", f"example-tests-{os.getpid()}")

from example_project.settings import *  # noqa: F403

DB = os.environ.get("GUARDRAILS_TEST_DB", "sqlite")
_PASS = f"_{os.environ['GUARDRAILS_TEST_PASS']}" if os.environ.get("GUARDRAILS_TEST_PASS") else ""
_CHECKOUT = hashlib.sha256(os.path.dirname(os.path.dirname(os.path.abspath(__file__))).encode()).hexdigest()[:8]
if DB == "postgres":
    DATABASES = {
        "default": {
            # Django's backend, emptying the tables between tests with DELETE (tests/support/postgresql).
            "ENGINE": "tests.support.postgresql",
            # A test can route a worker through a proxy it cuts, to take the database away from it.
            "CONN_MAX_AGE": 0,
            "NAME": "guardrails",
            "USER": os.environ.get("GUARDRAILS_TEST_PGUSER", "postgres"),
            "HOST": "127.0.0.1",
            "PORT": os.environ.get("GUARDRAILS_TEST_DB_PORT", "5432"),
            # One test database per checkout: two suites run from two clones (a flake hunt in one, work in
            # the other) would otherwise drop each other's database. And per pass: make test runs the matrix's
            # environments from this checkout beside the PostgreSQL pass (GUARDRAILS_TEST_PASS names them).
            "TEST": {"NAME": f"test_guardrails_{_CHECKOUT}{_PASS}"},
        }
    }
elif DB == "sqlite":
    # A file, not :memory:, so that worker threads and processes share it; IMMEDIATE transactions make
    # concurrent writers wait for the lock (as the Django store's docs ask) instead of failing.
    _path = os.path.join(tempfile.gettempdir(), f"guardrails-tests-{os.getpid()}.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _path,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
            "TEST": {"NAME": _path},
        }
    }
else:
    raise RuntimeError(f"GUARDRAILS_TEST_DB must be 'postgres' or 'sqlite', not {DB!r}")

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405

# A worker subprocess started by a test uses the test database itself (its name comes from the test process).
if os.environ.get("GUARDRAILS_TEST_DB_NAME"):
    DATABASES["default"]["NAME"] = DATABASES["default"]["TEST"]["NAME"] = os.environ["GUARDRAILS_TEST_DB_NAME"]
