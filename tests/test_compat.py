"""The compatibility claims agree: setup.cfg's bounds admit every combination of the matrix (noxfile.py), its
lower bounds are the oldest combination's versions, and the table of docs/compatibility.md lists the matrix as it is."""

from __future__ import annotations

import configparser
import functools
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@functools.cache  # nox registers its sessions once per process
def noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["noxfile"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def claims() -> dict[str, Any]:
    """The requirement setup.cfg states for each package of the matrix (install_requires and the extras)."""
    # Imported here: the matrix's environments collect this module without the development tools.
    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    for extra in ("redis", "django", "suite"):
        lines += config["options.extras_require"][extra].splitlines()
    found: dict[str, Any] = {}
    for line in lines:
        if not line.strip() or line.strip().startswith("#"):
            continue
        requirement = Requirement(line.strip())
        name = requirement.name.lower()
        if name in found:
            assert str(found[name].specifier) == str(requirement.specifier), f"{name}: two different claims"
        found[name] = requirement
    return found


PACKAGES = {"celery": "celery", "kombu": "kombu", "django": "django", "beat": "django-celery-beat", "redis": "redis"}


def test_every_combination_is_within_the_claims() -> None:
    stated = claims()
    for combination in noxfile().COMBINATIONS:
        for field, package in PACKAGES.items():
            version = getattr(combination, field)
            assert stated[package].specifier.contains(version), f"{combination.name}: {package} {version}"


def test_the_lower_bounds_are_the_oldest_combinations_versions() -> None:
    stated = claims()
    oldest = noxfile().BY_NAME["oldest"]
    for field, package in PACKAGES.items():
        lower = [spec.version for spec in stated[package].specifier if spec.operator == ">="]
        assert lower, f"{package} has no lower bound"
        version = getattr(oldest, field)
        # the claimed minimum is the oldest tested, or its line (Django 4.2: its newest patch is tested)
        assert version == lower[0] or version.startswith(lower[0] + "."), f"{package}: {lower[0]} vs {version}"


def test_the_compatibility_page_lists_the_matrix() -> None:
    page = (ROOT / "docs" / "compatibility.md").read_text()
    table = page.split("<!-- compat:start -->", 1)[1].split("<!-- compat:end -->", 1)[0]
    rows = [line for line in table.strip().splitlines()[2:]]
    combinations = noxfile().COMBINATIONS
    assert len(rows) == len(combinations)
    for row, combination in zip(rows, combinations, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        expected = [combination.name, combination.python, combination.celery, combination.kombu]
        assert cells[:4] == expected
        assert cells[4:7] == [combination.django, combination.beat, combination.redis]
        assert re.fullmatch(r"passed \(\d{4}-\d{2}-\d{2}\)", cells[7]), f"{combination.name}: {cells[7]}"
