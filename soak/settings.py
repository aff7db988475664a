"""Django settings of the soak's workers and of its orchestrator (``soak/run.py`` sets the environment).

SOAK_DB_PORT / SOAK_DB_NAME: the soak's own PostgreSQL (workers may reach it through a forwarder the soak
cuts); SOAK_STORE: ``django`` or a Redis URL.
"""

import os

SECRET_KEY = "soak-only-not-a-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_celery_beat",
    "django_celery_guardrails",
]
# The admin is installed for its LogEntry (a replay writes one); nothing is served.
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True, "OPTIONS": {}}]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
# No requests are served and no secrets travel in the jobs.
SILENCED_SYSTEM_CHECKS = ["admin.E402", "admin.E404", "admin.W411", "guardrails.W001", "guardrails.W002"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("SOAK_DB_PORT", "5432"),
        "NAME": os.environ.get("SOAK_DB_NAME", "postgres"),
        "USER": "postgres",
        # A worker whose database went away fails its statement within seconds instead of hanging.
        "OPTIONS": {"connect_timeout": 5},
    }
}
CELERY_GUARDRAILS = {
    "store": os.environ.get("SOAK_STORE", "django"),
    "store_timeout": 5.0,
    "alert_channels": ["log"],
    "owners": {"soak.*": "soak"},
    # make soak --kombu-pop: kombu's own BRPOP, to see what the atomic pop saves (celery/kombu#305)
    "broker_atomic_pop": os.environ.get("SOAK_KOMBU_POP") != "1",
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("SOAK_LOG_LEVEL", "WARNING")},
}
