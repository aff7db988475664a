"""Messages published as another producer would: a Celery envelope (protocol 2) with fields of the test's
choosing, including ones Celery's own publisher refuses to write."""

from __future__ import annotations

import uuid
from typing import Any


def publish_raw(
    app: Any,
    queue: str,
    task_name: str,
    *,
    args: Any = (),
    kwargs: Any = None,
    serializer: str = "json",
    **envelope: Any,
) -> str:
    """Publish ``task_name`` to ``queue`` with ``envelope`` header fields set as given (the body encoded with
    ``serializer``); the task id."""
    task_id = str(uuid.uuid4())
    message = app.amqp.as_task_v2(task_id, task_name, args=list(args), kwargs=dict(kwargs or {}))
    headers = {**message.headers, **envelope}
    with app.producer_or_acquire() as producer:
        producer.publish(
            message.body,
            routing_key=queue,
            exchange="",
            headers=headers,
            serializer=serializer,
            **{k: v for k, v in message.properties.items() if k in ("correlation_id", "reply_to")},
        )
    return task_id


def publish_body(app: Any, queue: str, task_name: str, body: bytes, *, content_type: str = "application/json") -> str:
    """Publish a Celery envelope for ``task_name`` whose body is ``body`` as given (bytes no decoder may read);
    the task id."""
    task_id = str(uuid.uuid4())
    message = app.amqp.as_task_v2(task_id, task_name, args=[], kwargs={})
    with app.producer_or_acquire() as producer:
        producer.publish(
            body,
            routing_key=queue,
            exchange="",
            headers=message.headers,
            content_type=content_type,
            content_encoding="utf-8",
            **{k: v for k, v in message.properties.items() if k in ("correlation_id", "reply_to")},
        )
    return task_id
