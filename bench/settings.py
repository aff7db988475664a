"""Django settings of ``make bench``'s Django-store workers: the example project's, with the bench's database.

BENCH_PG_NAME: a PostgreSQL database on BENCH_PG_HOST:BENCH_PG_PORT (user BENCH_PG_USER), else the SQLite file
EXAMPLE_SQLITE_PATH. BENCH_CONN_MAX_AGE: Django's CONN_MAX_AGE for PostgreSQL (default 0); BENCH_PG_POOL: Django's
connection pool on (Django 5.1+, psycopg_pool). DEBUG is off, as on a production worker.
"""

import os

from example_project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405  (the Effect model the bench INSERTs)

# A worker runs with DEBUG off in production. The example project's DEBUG = True gives every query Django's debug
# cursor (timed, its SQL formatted, logged and kept in connection.queries): tens of microseconds a statement here,
# a cost neither plain Celery's nor the guarded task's INSERT has in production.
DEBUG = False

if os.environ.get("BENCH_PG_NAME"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ["BENCH_PG_NAME"],
            "USER": os.environ.get("BENCH_PG_USER", "postgres"),
            "HOST": os.environ.get("BENCH_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("BENCH_PG_PORT", "5432"),
            "CONN_MAX_AGE": int(os.environ.get("BENCH_CONN_MAX_AGE", "0")),
            "OPTIONS": {"pool": True} if os.environ.get("BENCH_PG_POOL") else {},
        }
    }
