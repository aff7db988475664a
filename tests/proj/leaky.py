"""Tasks that fail with secrets in their exception and their arguments (tests/support/planted.py): a guarded one
and a plain Celery one, which must fail exactly as Celery makes it."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from celery_guardrails import GuardedTask, TransientError
from tests.support.planted import MESSAGE


class LeakyError(Exception):
    """A deterministic failure whose message says every planted secret."""


class ProviderError(Exception):
    """An exception with attributes of its own, as an HTTP client's are: a custom ``__init__`` and ``__str__``."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(status, url)
        self.status, self.url = status, url

    def __str__(self) -> str:
        return f"{self.status} from {self.url}"


@shared_task(
    base=GuardedTask, bind=True, owner="security", idempotent=True, backoff_base=0.05, permanent_errors=(LeakyError,)
)
def leak(self: GuardedTask, dsn: str, headers: Any, note: str = "", **more: Any) -> None:
    """Fails transiently on its first attempt (a retry: Celery logs and stores RETRY), then for good."""
    if self.request.retries == 0:
        raise TransientError(MESSAGE)
    raise LeakyError(MESSAGE)


@shared_task(base=GuardedTask, bind=True, owner="security", permanent_errors=(ProviderError,))
def leak_provider(self: GuardedTask, url: str) -> None:
    raise ProviderError(401, url)


@shared_task(bind=True)
def plain_leak(self: Any) -> None:
    raise LeakyError(MESSAGE)


@shared_task(base=GuardedTask, bind=True, idempotency_key="leak:{order_id}", permanent_errors=(LeakyError,))
def leak_keyed(self: GuardedTask, order_id: str) -> None:
    raise LeakyError(MESSAGE)
