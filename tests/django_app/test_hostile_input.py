"""Hostile input through the whole final-failure path, on real solo and prefork workers (issue #28).

A seeded fuzzer writes messages as another producer could: arguments nested past the recursion limit, huge
strings, NUL, lone surrogates, bidi controls, types JSON does not have, bodies no decoder reads, and secrets of
every well-known shape, under innocent names and in exception messages. Every message must end as a dead letter,
and no planted secret may be found in any table of the guardrails app, the Redis store and result backend, the
worker's log, the alert mail and webhook, the admin's pages or the command's output.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.apps import apps
from django.core.management import call_command
from django.test import Client

from django_celery_guardrails.models import DeadLetter
from tests.conftest import unacked, waiting_messages
from tests.proj import tasks
from tests.support.messages import publish_body, publish_raw
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)


def planted(nonce: str) -> dict[str, str]:
    """Secrets of every shape the redaction knows, each with the part that must never be seen again; made unique
    by ``nonce`` (another test's planted secrets, left in Redis on purpose by a plain Celery task, are not ours),
    each of its kind's length (an AWS key id is AKIA and 16 characters, a Google key AIza and 35)."""
    n, upper = nonce, nonce.upper()
    jwt_signature = f"dozjgNryP4J3jVmNHl0w5N_{n}XgL0n3I9PlFUP0THsR8U"
    pem_body = f"MIIEowIBAAKCAQEA0Z3VS5JJcds3xfnygWyF8Pbn{n}Gy0AHB7MhgHcTz6sE2I2yPB"
    return {
        f"postgresql://app:Pg{n}Passw0rd@db.internal:5432/shop": f"Pg{n}Passw0rd",
        f"redis://:R3dis{n}S3cret@cache.internal:6379/0": f"R3dis{n}S3cret",
        f"amqp://guest:Amqp{n}S3cret@rabbit.internal:5672//": f"Amqp{n}S3cret",
        f"https://deploy:Https{n}S3cret@git.example.com/repo.git": f"Https{n}S3cret",
        f"invalid key sk_live_4eC39Hq{n}Dar": f"4eC39Hq{n}Dar",
        f"AKIA{upper}ODNN7EXA wJalrXUtnFEMI/K7MDENG/bPxRfi{n}CYEX": f"wJalrXUtnFEMI/K7MDENG/bPxRfi{n}CYEX",
        f"token ghp_16C7e42F292c6912E7710c83{n}Ae17": f"16C7e42F292c6912E7710c83{n}Ae17",
        f"xoxb-123456789012-1234567890123-AbCdEfGh{n}QrStUvWx": f"AbCdEfGh{n}QrStUvWx",
        f"AIzaSyA1b2C3d4E5f6G7h8I9j0K{n}pQrS": f"SyA1b2C3d4E5f6G7h8I9j0K{n}pQrS",
        f"eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{jwt_signature}": jwt_signature,
        f"-----BEGIN RSA PRIVATE KEY-----\n{pem_body}\n-----END RSA PRIVATE KEY-----": pem_body,
        f"Authorization: Bearer Zm9vYmFy{n}cXV1eDEy": f"Zm9vYmFy{n}cXV1eDEy",
        f"password=Hunter2{n}Hunter2": f"Hunter2{n}Hunter2",
    }


#: This run's secrets (the nonce: 8 hex digits, so that every pattern's shape is kept).
PLANTED = planted(uuid.uuid4().hex[:8])
SECRETS = tuple(PLANTED.values())
#: Characters a page or a terminal must never show as they are (they reorder or hide text).
BIDI = "\u202e"
MESSAGES_PER_POOL = 24


@dataclass(frozen=True)
class Sent:
    task_id: str
    what: str


def nested(levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value] if levels % 2 else {"k": value}
    return value


def hostile_values(rng: random.Random) -> list[tuple[str, Any]]:
    """(what, value): values JSON carries that a record must survive."""
    secret = rng.choice(list(PLANTED))
    return [
        ("nested 150 (over max_payload_depth)", nested(150, secret)),
        ("nested 90 with a secret at the bottom", nested(90, secret)),
        ("a huge string", "x" * rng.randint(100_000, 2_000_000) + secret),
        ("NUL", f"a\x00b{secret}\x00"),
        ("a lone surrogate", f"\ud800{secret}\udfff"),
        ("bidi controls", f"RTL{BIDI}gnp.exe {secret} \u2066x\u2069 \u200b"),
        ("a list-pair header", [["authorization", f"Bearer {SECRETS[-2]}"], ["x-trace", "1"]]),
        ("a DSN under an innocent name", {"dsn": next(iter(PLANTED))}),
        ("a secret under a secret's name", {"password": SECRETS[-1], "api_key": secret}),
        ("many keys", {f"k{n}\x00": secret for n in range(rng.randint(1, 2000))}),
    ]


def pickled_values(secret: str) -> list[tuple[str, Any]]:
    """Values only pickle carries (sets, bytes, dates, decimals, complex numbers)."""
    return [
        ("a set and bytes", {"tags": {1, 2, 3}, "raw": secret.encode()}),
        ("a date, a decimal and a complex", [dt.datetime(2026, 12, 1, tzinfo=dt.UTC), decimal.Decimal("1.5"), 2j]),
        ("an object that pickles once", tasks.TravelsOnce()),
    ]


def send_hostile(app: Any, queue: str, rng: random.Random) -> list[Sent]:
    """MESSAGES_PER_POOL messages, each a hostile value and an exception text with planted secrets, plus bodies
    no decoder reads."""
    name = tasks.fail_loudly.name
    sent: list[Sent] = []
    for number in range(MESSAGES_PER_POOL):
        what, value = rng.choice(hostile_values(rng))
        secrets = rng.sample(list(PLANTED), 3)
        text = f"call {number} failed: " + " | ".join(secrets) + rng.choice(["", "\x00", BIDI, "\ud800"])
        kind = rng.choice(["value", "value", "runtime", "unprintable"])
        if rng.random() < 0.2:
            what, value = rng.choice(pickled_values(secrets[0]))
            task_id = publish_raw(app, queue, name, args=[text, value], kwargs={"kind": kind}, serializer="pickle")
        else:
            task_id = publish_raw(app, queue, name, args=[text, value], kwargs={"kind": kind, "note": secrets[1]})
        sent.append(Sent(task_id, what))
    deep = b'["' + rng.choice(list(PLANTED)).replace("\n", "\\n").encode() + b'", ' + b"[" * 3000 + b"]" * 3000
    sent.append(Sent(publish_body(app, queue, name, deep + b"], {}, {}]"), "a body nested 3,000 deep"))
    cut_short = b'[["' + rng.choice(list(PLANTED)).replace("\n", "\\n").encode()
    sent.append(Sent(publish_body(app, queue, name, cut_short), "a body cut short"))
    return sent


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_hostile_messages_all_end_as_dead_letters_and_no_planted_secret_is_found_anywhere(
    celery_app: Any,
    queue_name: str,
    tmp_path: Path,
    webhook: tuple[str, list[dict[str, Any]]],
    admin_client: Client,
    pool: str,
) -> None:
    url, posted = webhook
    settings = {
        "dead_letter_sinks": ["django"],
        "alert_channels": ["log", "mail", "webhook"],
        "alert_webhooks": [url],
        "alert_throttle": 0.001,
        "owner_emails": {"fuzz": ["fuzz@example.com"]},
        "seal_keys": ["Zm9vYmFyYmF6cXV1eDEyMzQ1Njc4OTAxMjM0NTY3ODk="],
    }
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings),
        GUARDRAILS_TEST_ACCEPT=json.dumps(["json", "pickle"]),
        C_FORCE_ROOT="1",  # Celery refuses pickle to a worker running as root, as CI's does
        EXAMPLE_VAR_DIR=str(tmp_path),  # the alert mail, as files
    )
    rng = random.Random(f"issue-28-{pool}")
    # Given hostile messages another producer wrote, waiting for a real worker
    sent = send_hostile(celery_app, queue_name, rng)
    log_path = tmp_path / "worker.log"
    with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=log_path, env=env, pool=pool) as worker:
        # When it has taken every one of them
        ids = [message.task_id for message in sent]
        wait_for(
            "a dead letter for every message",
            lambda: DeadLetter.objects.filter(task_id__in=ids).count() == len(ids),
            timeout=180,
        )
        wait_for(
            "every message acked", lambda: waiting_messages("redis", queue_name) == 0 and not any(map(unacked, ids))
        )
        # Then the worker is alive, and every message is a dead letter
        assert worker.process is not None and worker.process.poll() is None
        wait_for("the alerts sent", lambda: len(list((tmp_path / "mail").glob("*"))) > 0 and len(posted) > 0)
    records = {record.task_id: record for record in DeadLetter.objects.filter(task_id__in=ids)}
    missing = [message for message in sent if message.task_id not in records]
    assert missing == []
    # And no planted secret is anywhere: the guardrails' tables ...
    surfaces: dict[str, str] = {}
    for model in apps.get_app_config("guardrails").get_models():
        rows = list(model.objects.values())
        surfaces[f"table {model._meta.db_table}"] = json.dumps(rows, default=str)
    # ... the Redis store and the result backend ...
    client = redis.Redis.from_url(REDIS_URL)
    surfaces["redis"] = "\n".join(_redis_text(client))
    # ... the worker's log, the mail and the webhook ...
    surfaces["worker log"] = log_path.read_text(errors="backslashreplace")
    surfaces["mail"] = "\n".join(path.read_text(errors="backslashreplace") for path in (tmp_path / "mail").glob("*"))
    surfaces["webhook"] = json.dumps(posted)
    # ... the admin's list and each record's page, and the command's output
    for page in range(0, 3):
        surfaces[f"admin list {page}"] = admin_client.get("/admin/guardrails/deadletter/", {"p": page}).content.decode()
    for record in records.values():
        response = admin_client.get(f"/admin/guardrails/deadletter/{record.pk}/change/")
        assert response.status_code == 200, record.task_id
        surfaces[f"admin page {record.pk}"] = response.content.decode()
        out = StringIO()
        call_command("guardrails_deadletters", "show", str(record.pk), stdout=out)
        surfaces[f"show {record.pk}"] = out.getvalue()
    found = {(where, secret) for where, text in surfaces.items() for secret in SECRETS if secret in text}
    # (said by kind of surface, and the secret's start: a failure lists every place at once)
    assert sorted({(where.rstrip("0123456789 "), secret[:12]) for where, secret in found}) == []
    # And no page shows a bidi control as it is (it would reverse what follows it)
    assert [where for where, text in surfaces.items() if where.startswith("admin") and BIDI in text] == []


def _redis_text(client: redis.Redis) -> Iterator[str]:
    """Every string and hash value of the test's Redis database (the store, the result backend)."""
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"string":
            yield repr(client.get(key))
        elif kind == b"hash":
            yield repr(client.hgetall(key))
        elif kind == b"list":
            yield repr(client.lrange(key, 0, -1))
        elif kind == b"stream":
            yield repr(client.xrange(key))
