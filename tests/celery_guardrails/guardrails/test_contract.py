"""The payload contract on a real broker: what is refused at publish (and that nothing is sent then), on every
publish path; the version stamped; a retry in flight not refused by a setting changed since; a version the
worker does not accept dead-lettered unrun, a malformed one too."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, chord, group

from celery_guardrails.exceptions import (
    EntityInPayloadError,
    PayloadTooDeepError,
    PayloadTooLargeError,
    SensitivePayloadError,
)
from celery_guardrails.guardrails.contract import nesting_over
from celery_guardrails.guardrails.sensitive import SENSITIVE_KEYS, matches
from celery_guardrails.options import TaskOptions
from celery_guardrails.runtime import headers
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of, has_dead_letter
from tests.support.messages import publish_raw
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env


def queued(queue: str) -> int:
    return int(redis.Redis.from_url(REDIS_URL).llen(queue))


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("password", True),
        ("new_password", True),
        ("passwordHash", True),
        ("stripe_api_key", True),
        ("apiKey", True),
        ("client-secret", True),
        ("card_number", True),
        ("card_token", False),
        ("passport_id", False),
        ("order_id", False),
        ("keys", False),
    ],
)
def test_which_names_the_default_sensitive_keys_refuse(name: str, refused: bool) -> None:
    assert (matches(name, SENSITIVE_KEYS) is not None) is refused


def test_a_password_argument_is_refused_at_publish_and_nothing_is_sent(celery_app: Any, queue_name: str) -> None:
    # When a task taking a password is published, by keyword or by position
    with pytest.raises(SensitivePayloadError, match=r"argument 'password' .*\(sensitive_keys entry 'password'\)"):
        tasks.log_in.delay(7, password="hunter2")
    with pytest.raises(SensitivePayloadError, match="argument 'password'"):
        tasks.log_in.delay(7, "hunter2")
    # or a secret hides as a key deep in an argument
    with pytest.raises(SensitivePayloadError, match=r"key 'cvv' in script\[1\]\['card'\]"):
        tasks.behave.delay("sink", ["ok", {"card": {"cvv": "123"}}])
    # Then nothing reached the queue
    assert queued(queue_name) == 0


def test_a_task_that_says_why_may_carry_one(celery_app: Any, celery_worker: Any, sink: Sink) -> None:
    # Given a task with an allow_sensitive_payload reason, When it is published with a password
    result = tasks.legacy_log_in.delay(7, "hunter2", sink.key)
    # Then it runs
    assert result.get(timeout=30)["user_id"] == 7


@pytest.mark.django_db
def test_a_model_instance_or_queryset_is_refused_at_publish(celery_app: Any, queue_name: str) -> None:
    from tests.testapp.models import Effect

    with pytest.raises(EntityInPayloadError, match=r"sink is a Effect: send identifiers, not entities"):
        tasks.behave.delay(Effect(key="k"), ["ok"])
    with pytest.raises(EntityInPayloadError, match=r"script\[0\] is a QuerySet"):
        tasks.behave.delay("sink", [Effect.objects.all()])
    assert queued(queue_name) == 0


def test_an_oversize_payload_is_refused_with_its_size_and_nothing_is_sent(celery_app: Any, queue_name: str) -> None:
    # Given the default limit of 64 KiB, When 100 KB of arguments are published
    with pytest.raises(
        PayloadTooLargeError,
        match=r"arguments are 100,\d{3} bytes serialised \(json\), over max_payload_bytes 65,536: store the data",
    ):
        tasks.behave.delay("sink", ["x" * 100_000])
    # Then nothing was sent; a per-call limit raises it for one publish
    assert queued(queue_name) == 0
    tasks.behave.apply_async(("sink", ["x" * 100_000]), max_payload_bytes=200_000)
    assert queued(queue_name) == 1


def nested(levels: int) -> Any:
    """A value ``levels`` lists deep (a list of a string is 1 level)."""
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_arguments_nested_deeper_than_max_payload_depth_are_refused_and_nothing_is_sent(
    celery_app: Any, queue_name: str
) -> None:
    # Given the default max_payload_depth of 100 levels
    # When arguments 101 levels deep are published (one argument, a keyword argument, a chain's later step)
    for publish in (
        lambda: tasks.behave.delay("sink", nested(101)),
        lambda: tasks.behave.delay("sink", script=[{"a": nested(100)}]),
        lambda: chain(tasks.observe.s(), tasks.behave.si("sink", nested(101))).apply_async(),
    ):
        # Then each is refused, naming the limit, and nothing is sent
        with pytest.raises(PayloadTooDeepError, match=r"nested more than 100 levels deep, over max_payload_depth 100"):
            publish()
    assert queued(queue_name) == 0
    # And 100 levels, or 5,000 levels of an argument past the recursion limit refused just the same, behave
    tasks.behave.delay("sink", nested(100))
    assert queued(queue_name) == 1
    with pytest.raises(PayloadTooDeepError):
        tasks.behave.delay("sink", nested(5000))


class _Mapping(Mapping[str, Any]):
    """A mapping that is not a dict (its depth is walked as a dict's)."""

    def __init__(self, **items: Any) -> None:
        self.items_ = items

    def __getitem__(self, name: str) -> Any:
        return self.items_[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.items_)

    def __len__(self) -> int:
        return len(self.items_)


@pytest.mark.parametrize(
    ("values", "limit", "expected"),
    [
        # Given values of every kind of container, nested to a known depth (a list of scalars is 1 level)
        ((1, "x", b"y", None, 2.5, True), 1, None),
        (([],), 1, None),
        (([[]],), 1, 2),
        (({"a": {"b": [1]}},), 2, 3),
        (({"a": {"b": [1]}},), 3, None),
        (((("t",),),), 1, 2),
        (({frozenset({1})},), 1, 2),
        ((_Mapping(a=_Mapping(b=[{}])),), 3, 4),
        ((_Mapping(a=_Mapping(b=[{}])),), 4, None),
        (([1, [2, [3, [4]]]], {"k": [5]}), 3, 4),
    ],
)
def test_nesting_over_tells_the_first_depth_past_the_limit(values: tuple[Any, ...], limit: int, expected: Any) -> None:
    # When their depth is checked against the limit
    # Then the depth reached past it is told (None: none goes deeper), whatever the containers' types
    assert nesting_over(values, limit) == expected


def test_every_publish_path_is_checked(celery_app: Any, queue_name: str) -> None:
    # Signatures, chains and groups publish through the task's apply_async: each refuses the secret
    # (a chain's later steps, a chord's body and callbacks are published by the worker: checked at the first)
    for publish in (
        lambda: tasks.log_in.s(7, password="x").apply_async(),
        lambda: chain(tasks.observe.s(), tasks.log_in.si(7, password="x")).apply_async(),
        lambda: chain(tasks.observe.s(), group(tasks.observe.si(), tasks.log_in.si(7, password="x"))).apply_async(),
        lambda: group(tasks.log_in.s(7, password="x"), tasks.observe.s()).apply_async(),
        lambda: chord([tasks.observe.s()], tasks.log_in.si(7, password="x")).apply_async(),
        lambda: tasks.observe.apply_async(link=tasks.log_in.si(7, password="x")),
    ):
        with pytest.raises(SensitivePayloadError):
            publish()
    assert queued(queue_name) == 0


def test_the_version_is_stamped_and_a_retry_keeps_it_under_settings_changed_since(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a message published as version 3 whose first attempt fails, and a worker whose settings changed
    # since: it sends version 4, accepts 3 and 4, and now counts "fail_first" as a sensitive key (not "order": its
    # key template names order_id, and a template naming a sensitive argument stops the worker at start-up)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "payload_version": 3}
    result = tasks.versioned.delay(sink.key, 42, fail_first=True)
    settings = {"payload_version": 4, "accepts_versions": [3, 4], "sensitive_keys": ["fail_first"]}
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings))
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env):
        # When it runs and is retried by the worker
        report = result.get(timeout=60)
    # Then the retry was published (not refused for the key that became sensitive) and kept version 3
    assert [(r["pv"], r["order_id"]) for r in sink.items()] == [(3, 42), (3, 42)]
    assert report["pv"] == 3


def test_a_version_the_worker_does_not_accept_is_dead_lettered_unrun(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given an old worker (sends and accepts version 1) and a new publisher sending version 2
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "payload_version": 2}
    new = [tasks.versioned.delay(sink.key, n) for n in range(3)]
    # and a message whose version is malformed
    malformed = publish_raw(
        celery_app, queue_name, tasks.versioned.name, args=[sink.key, 9], guardrails={headers.PAYLOAD_VERSION: "two"}
    )
    env = proj_env(queue=queue_name)
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env):
        # Then each ends FAILED without running, dead-lettered with its reason
        for result in new:
            with pytest.raises(Exception, match=r"payload version 2 is not one this worker accepts \(1,\)"):
                result.get(timeout=60)
        with pytest.raises(Exception, match="malformed payload version"):
            celery_app.AsyncResult(malformed).get(timeout=60)
        ids = [*(result.id for result in new), malformed]
        wait_for("four dead letters", lambda: all(has_dead_letter(celery_app, task_id) for task_id in ids))
    assert sink.items() == []
    reasons = [dead_letter_of(celery_app, task_id)["reason"] for task_id in ids]
    assert reasons == [*["unknown_payload_version"] * 3, "malformed_message"]


@pytest.mark.parametrize(
    "arguments",
    [
        ((1, "plain"), {}),
        (("é" * 50, "😀" * 50, '"\\\n\t'), {"nested": {"k\u00fc": [1.5, None, True, -(10**30)]}}),
        ((), {"rows": [{"id": n, "name": f"n{n}"} for n in range(200)]}),
        (([[[[[[[[["deep"]]]]]]]]],), {}),
    ],
)
def test_the_size_bound_that_spares_a_second_serialisation_is_never_below_the_real_size(
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    # Given arguments of every JSON type, non-ASCII text and nesting, When their bound is taken
    from kombu.serialization import dumps

    from celery_guardrails.guardrails.contract import PayloadContract

    args, kwargs = arguments
    bound = PayloadContract()._check_values(TaskOptions(task=tasks.behave), args, kwargs)
    # Then it is None (measure it) or at least the size the serialiser writes
    _, _, body = dumps((args, kwargs), serializer="json")
    assert bound is None or bound >= len(body), (bound, len(body))
