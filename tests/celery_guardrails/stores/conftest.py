"""Store rule tests run once per real store (``kind``: "redis" or "django")."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.services import require
from tests.support.stores import make_store


@pytest.fixture(params=["redis", "django"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        require("redis")
    return str(request.param)


@pytest.fixture
def store(kind: str) -> Any:
    return make_store(kind)
