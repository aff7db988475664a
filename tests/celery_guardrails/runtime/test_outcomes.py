"""What a re-publish may ask of the broker."""

from __future__ import annotations

import math

from celery import Celery

from celery_guardrails.runtime.outcomes import longest_countdown


def test_a_countdown_stays_inside_the_redis_visibility_timeout() -> None:
    # Given apps on a Redis broker (default and a short visibility timeout) and on RabbitMQ
    default = Celery("a", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    short = Celery("b", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    short.conf.broker_transport_options = {"visibility_timeout": 300}
    rabbit = Celery("c", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    # Then a re-published message never waits longer than nine tenths of Redis's visibility timeout (past it,
    # kombu hands the waiting message to a second worker); RabbitMQ has no such bound
    assert [longest_countdown(app) for app in (default, short)] == [3240.0, 270.0]
    assert math.isinf(longest_countdown(rabbit))
