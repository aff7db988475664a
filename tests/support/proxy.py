"""The TCP proxy the tests cut services with: the test kit's own (celery_guardrails.testing.proxy)."""

from celery_guardrails.testing.proxy import TcpProxy

__all__ = ["TcpProxy"]
