"""Store rule tests run once per real store (``kind``: "redis", "redis-cluster" or "django")."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.services import require
from tests.support.stores import KINDS, make_store


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        require("redis")
    if request.param == "redis-cluster":
        request.getfixturevalue("redis_cluster")  # started once per session, on first use
    return str(request.param)


@pytest.fixture
def store(kind: str) -> Any:
    return make_store(kind)
