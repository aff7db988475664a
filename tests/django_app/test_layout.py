"""The Django app's store and models are split by feature (as the Redis store is) and still read as one."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "django_app"


def test_every_model_of_the_app_is_imported_by_the_models_package() -> None:
    from django.apps import apps

    from django_celery_guardrails import models

    # A model in a new module that models/__init__.py forgets would still be registered once something imports
    # it, but not be importable as django_celery_guardrails.models.X: the package lists each one.
    registered = {model.__name__ for model in apps.get_app_config("guardrails").get_models()}
    assert registered == set(models.__all__)
    assert all(getattr(models, name)._meta.app_label == "guardrails" for name in models.__all__)


def test_the_django_store_has_every_operation_of_the_redis_store() -> None:
    from celery_guardrails.stores.redis import RedisStore
    from django_celery_guardrails.store import DjangoStore

    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    # The database-only ones: a helper thread's connection, whether a release would be rolled back, and a key
    # written in the effect's own transaction (celery_guardrails.guardrails.effect_keys).
    assert public(DjangoStore) - public(RedisStore) == {
        "close_thread",
        "in_transaction",
        "written_with_the_effect",
        "fail_with_the_effect",
    }
    # The Redis-only ones: the ack of a message on the broker's own Redis, alone or with a key's completion, each
    # read when asked (celery_guardrails.guardrails.acks), and the server's clock the claim with the pop hands its
    # script (celery_guardrails.guardrails.pop_claims).
    assert public(RedisStore) - public(DjangoStore) == {"send_ack", "send_complete_and_ack", "server_now"}


def test_each_module_of_the_store_and_the_models_names_the_redis_file_it_mirrors() -> None:
    for package in ("store", "models"):
        for path in sorted((APP / package).glob("*.py")):
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert docstring, path
            if path.stem not in ("__init__", "database", "dead_letters", "outbox", "dashboard", "jobs"):
                assert "celery_guardrails/stores/redis" in docstring.replace("\n", " "), path
