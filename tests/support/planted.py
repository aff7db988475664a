"""Planted secrets: one of each kind redaction must find by its value, and where each may not show up.

``SECRETS`` are the parts that must never be seen (a URL's password, not its user or host). ``MESSAGE`` holds
all of them the way an exception's message would; ``ARGUMENTS`` holds them as a task's arguments would, each
under a name that is not sensitive (``dsn``, ``note``, ``headers``), so that only redaction by value finds
them.
"""

from __future__ import annotations

import json
from typing import Any

PG_PASSWORD = "Sup3rS3cretPg"
REDIS_PASSWORD = "R3disPassw0rdX"
AMQP_PASSWORD = "AmqpS3cr3tX"
HTTPS_PASSWORD = "HttpsS3cr3tX"
STRIPE_KEY = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GITHUB_TOKEN = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"
SLACK_TOKEN = "xoxb-2048-1337-AbCdEfGhIjKlMnOp"
GOOGLE_KEY = "AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM_BODY = "MIIEowIBAAKCAQEAplantedPrivateKeyBody0123456789abcdefXYZ"
BEARER_TOKEN = "pl4nted-b3arer-t0ken"
PAIR_TOKEN = "ListPairTok3n"
DSN_PASSWORD = "DsnArgPassw0rd"

PG_URL = f"postgresql://app:{PG_PASSWORD}@db/shop"
REDIS_URL = f"redis://:{REDIS_PASSWORD}@cache:6379/0"
AMQP_URL = f"amqp://rabbit:{AMQP_PASSWORD}@mq:5672//"
HTTPS_URL = f"https://deploy:{HTTPS_PASSWORD}@git.example.com/shop.git"
PEM = f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n{PEM_BODY[::-1]}\n-----END RSA PRIVATE KEY-----"

SECRETS = (
    PG_PASSWORD,
    REDIS_PASSWORD,
    AMQP_PASSWORD,
    HTTPS_PASSWORD,
    STRIPE_KEY,
    AWS_KEY_ID,
    AWS_SECRET,
    GITHUB_TOKEN,
    SLACK_TOKEN,
    GOOGLE_KEY,
    JWT,
    PEM_BODY,
    BEARER_TOKEN,
    PAIR_TOKEN,
    DSN_PASSWORD,
)

#: Every secret, as an exception's message says them.
MESSAGE = (
    f"could not connect to {PG_URL} (cache {REDIS_URL}, broker {AMQP_URL}, repository {HTTPS_URL}); "
    f"invalid key {STRIPE_KEY}; aws {AWS_KEY_ID} {AWS_SECRET}; github {GITHUB_TOKEN}; slack {SLACK_TOKEN}; "
    f"maps {GOOGLE_KEY}; session {JWT}; sent Authorization: Bearer {BEARER_TOKEN}; "
    f"headers [('authorization', '{PAIR_TOKEN}')]; with key:\n{PEM}\nand dsn postgresql://app:{DSN_PASSWORD}@db/x"
)

#: Every secret, as a task's arguments hold them under names that are not sensitive.
ARGUMENTS: dict[str, Any] = {
    "dsn": f"postgresql://app:{DSN_PASSWORD}@db/x",
    "headers": [["authorization", PAIR_TOKEN], ["X-Api-Key", STRIPE_KEY]],
    "note": f"keys {AWS_KEY_ID} {AWS_SECRET}, {GITHUB_TOKEN}, {SLACK_TOKEN}, {GOOGLE_KEY}, {JWT}",
    "urls": [PG_URL, REDIS_URL, AMQP_URL, HTTPS_URL],
    "pem": PEM,
    "auth": f"Bearer {BEARER_TOKEN}",
}


def leaked(anything: Any) -> list[str]:
    """The planted secrets found in ``anything`` (text, bytes, or a value shown as JSON)."""
    if isinstance(anything, bytes):
        text = anything.decode("utf-8", "backslashreplace")
    elif isinstance(anything, str):
        text = anything
    else:
        text = json.dumps(anything, default=repr)
    # JSON escapes "/" nowhere, but a newline as \n: both spellings of a secret are looked for.
    return [secret for secret in SECRETS if secret in text or json.dumps(secret)[1:-1] in text]
