"""Settings of the example project. Every service address can be changed with an environment variable."""

import json
import os
from pathlib import Path
from typing import Any

from celery.schedules import crontab

BASE_DIR = Path(__file__).resolve().parent
VAR_DIR = Path(os.environ.get("EXAMPLE_VAR_DIR", BASE_DIR / "var"))

SECRET_KEY = "example-project-only-not-a-secret"
DEBUG = True
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "django_celery_guardrails",
    "example_project.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_celery_guardrails.middleware.GuardrailsContextMiddleware",
]

ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES: dict[str, dict[str, Any]] = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_SQLITE_PATH", str(VAR_DIR / "db.sqlite3")),
        # Web, worker and beat write to one SQLite file: writers wait for the lock instead of failing.
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Celery: Redis by default; demo.py switches to a server-less broker when no Redis answers.
CELERY_BROKER_URL = os.environ.get("EXAMPLE_BROKER_URL", "redis://127.0.0.1:6379/14")
CELERY_RESULT_BACKEND = os.environ.get("EXAMPLE_RESULT_BACKEND", "redis://127.0.0.1:6379/14")
CELERY_BROKER_TRANSPORT_OPTIONS = json.loads(os.environ.get("EXAMPLE_BROKER_TRANSPORT_OPTIONS", "{}"))
# (demo.py without Redis: kombu's filesystem transport, each message file written whole; filesystem_broker.py)
CELERY_BROKER_TRANSPORT = os.environ.get("EXAMPLE_BROKER_TRANSPORT") or None
# (demo.py gives each run its own key prefix here and above: a Redis database shared with another run is safe.)
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = json.loads(os.environ.get("EXAMPLE_RESULT_BACKEND_TRANSPORT_OPTIONS", "{}"))
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("EXAMPLE_QUEUE", "example")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Django's LOGGING (below) formats the worker's log lines too, with the guardrails context on each line.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Keep a worker's database connection across tasks: Celery's Django fixup otherwise closes it before and after
# every task, and the guardrails' Django store pays a new connection per task on a database server (the system
# check guardrails.W006; docs/performance.md has the cost). A connection the server dropped is closed before
# the next task all the same (django_celery_guardrails.signals).
CELERY_DB_REUSE_MAX = 1000

# The external payments provider (the demo starts a flaky stand-in and points this at it).
PAYMENTS_URL = os.environ.get("EXAMPLE_PAYMENTS_URL", "http://127.0.0.1:8765")

# Scheduled work: run beat with -S django_celery_guardrails.schedulers:GuardedDatabaseScheduler.
CELERY_BEAT_SCHEDULE = {
    "settle-payments": {"task": "example_project.shop.tasks.settle_payments", "schedule": crontab(minute="*")},
}

# Who hears of dead letters and missed runs: every shop task has an owner (charge_order and settle_payments name
# "payments" themselves), and each owner an address; the example's mail goes to files beside its database.
EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
EMAIL_FILE_PATH = str(VAR_DIR / "mail")

CELERY_GUARDRAILS: dict[str, Any] = {
    "tenant_resolver": "example_project.shop.tenants.tenant_from_header",
    "owners": {"example_project.shop.*": "shop"},
    "owner_emails": {
        "payments": ["payments@example.com"],
        "shipping": ["shipping@example.com"],
        "shop": ["shop@example.com"],
    },
    "schedules": {
        # Every minute, Berlin time; never two settlements at once; after beat downtime settle once for all
        # the missed minutes, from the end of the last successful settlement (read from the run ledger).
        "settle-payments": {
            "timezone": "Europe/Berlin",
            "overlap": "skip",
            "catch_up": "latest",
            "grace": 30,
            "max_runtime": 300,
            "since": True,
            "owner": "payments",
        },
    },
}
# Dead letters keep their original message sealed for replay (a redacted card token replays with the real one).
# In production the key comes from the environment; the example makes one once, beside its database.
if os.environ.get("GUARDRAILS_SEAL_KEY"):
    CELERY_GUARDRAILS["seal_keys"] = [os.environ["GUARDRAILS_SEAL_KEY"]]
else:
    from cryptography.fernet import Fernet

    _seal_key = VAR_DIR / "seal.key"
    if not _seal_key.exists():  # written whole, then linked: a worker starting alongside never reads half a key
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        _draft = VAR_DIR / f"seal.key.{os.getpid()}"
        _draft.write_bytes(Fernet.generate_key())
        _draft.chmod(0o600)
        try:
            os.link(_draft, _seal_key)
        except FileExistsError:
            pass
        finally:
            _draft.unlink()
    CELERY_GUARDRAILS["seal_keys"] = [_seal_key.read_text().strip()]
# The demo runs a minute in a few seconds (see celery_guardrails.scheduling.beat.accelerated_clock) and checks often.
if os.environ.get("GUARDRAILS_CLOCK"):
    CELERY_GUARDRAILS["clock"] = "celery_guardrails.scheduling.beat.accelerated_clock"
if os.environ.get("EXAMPLE_WATCHDOG_INTERVAL"):
    CELERY_GUARDRAILS["watchdog_interval"] = float(os.environ["EXAMPLE_WATCHDOG_INTERVAL"])
# The demo's workers add their activity counts every couple of seconds (default 30).
if os.environ.get("EXAMPLE_ACTIVITY_FLUSH_INTERVAL"):
    CELERY_GUARDRAILS["activity_flush_interval"] = float(os.environ["EXAMPLE_ACTIVITY_FLUSH_INTERVAL"])
# The demo lets an ordering gap and an unpublishable outbox message run their course in seconds (the defaults:
# an alert after 5 minutes, the gap given up after an hour; 12 tries spanning about 18 minutes).
if os.environ.get("EXAMPLE_ORDERING_GAP_TIMEOUT"):
    CELERY_GUARDRAILS["ordering_gap_timeout"] = float(os.environ["EXAMPLE_ORDERING_GAP_TIMEOUT"])
if os.environ.get("EXAMPLE_ORDERING_GAP_ALERT_AFTER"):
    CELERY_GUARDRAILS["ordering_gap_alert_after"] = float(os.environ["EXAMPLE_ORDERING_GAP_ALERT_AFTER"])
if os.environ.get("EXAMPLE_OUTBOX_MAX_ATTEMPTS"):
    CELERY_GUARDRAILS["outbox_max_attempts"] = int(os.environ["EXAMPLE_OUTBOX_MAX_ATTEMPTS"])

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"guardrails": {"()": "celery_guardrails.log.ContextFilter"}},
    "formatters": {
        "context": {
            "format": "%(asctime)s %(levelname)s %(name)s "
            "[tenant=%(tenant)s cid=%(correlation_id)s task=%(task_name)s/%(task_id)s] %(message)s"
        }
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["guardrails"], "formatter": "context"}},
    "root": {"handlers": ["console"], "level": os.environ.get("EXAMPLE_LOG_LEVEL", "INFO")},
}
