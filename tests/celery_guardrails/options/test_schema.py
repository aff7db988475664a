"""The option schema is declared by the modules that own the options, complete once the package is imported,
free of import cycles, and mirrored exactly by ``GuardedTask``'s attributes."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_guardrails import GuardedTask
from celery_guardrails.options import OPTIONS, TASK, declare

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "celery_guardrails"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def declaring_modules() -> set[str]:
    """The core's modules that call ``declare(...)`` or register a ``@task_check`` at module level, read from
    their source."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign | ast.Expr) else None
            declares = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "declare"
            decorators = node.decorator_list if isinstance(node, ast.FunctionDef) else []
            if declares or any(getattr(d, "id", None) == "task_check" for d in decorators):
                found.add(module_name(path))
    return found


def test_importing_the_package_completes_the_schema_with_every_declaring_module() -> None:
    # Given a fresh interpreter that imports only the options package (which runs celery_guardrails/__init__.py)
    script = (
        "import json, sys; from celery_guardrails.options import OPTIONS; "
        "print(json.dumps({'options': sorted(OPTIONS), 'modules': sorted(sys.modules)}))"
    )
    # When it lists the declared options and the modules it imported
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = json.loads(result.stdout)
    # Then every module that declares options (or a task check) was imported, and the schema is the one this
    # process sees, which is the settings page's table (tests/test_docs.py)
    owners = declaring_modules()
    assert len(owners) >= 20
    assert owners - set(loaded["modules"]) == set()
    assert loaded["options"] == sorted(OPTIONS)
    rows = re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "settings.md").read_text(), re.M)
    assert sorted(rows) == loaded["options"]


def test_the_options_package_imports_no_module_that_declares_options() -> None:
    # Given the options package's modules
    modules = sorted((PACKAGE / "options").glob("*.py"))
    # When their imports of the core are read (at module level, inside functions and under TYPE_CHECKING alike)
    imported = {
        node.module
        for path in modules
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("celery_guardrails")
    }
    # Then they are the package's own and the exceptions only: any module may import it without a cycle
    assert {name for name in imported if not name.startswith("celery_guardrails.options")} == {
        "celery_guardrails.exceptions"
    }


def test_guarded_task_has_one_unset_attribute_per_task_option() -> None:
    # Given the options a task may set, and GuardedTask's attributes named like an option
    task_options = {name for name, option in OPTIONS.items() if TASK in option.scopes}
    attributes = {name: value for name, value in vars(GuardedTask).items() if name in OPTIONS}
    # When they are compared
    # Then each task option has its attribute, no app-only option has one, and each is None ("not set here": the
    # lookup goes on to the app config and the default), with a type annotation for the type checker
    assert set(attributes) == task_options
    assert all(value is None for value in attributes.values())
    assert task_options <= set(GuardedTask.__annotations__)


def test_an_option_declared_twice_is_refused() -> None:
    # Given an option already in the schema
    option = OPTIONS["owner"]
    # When another module declares the same name
    # Then it is refused, and the schema keeps the first declaration
    with pytest.raises(ValueError, match="'owner' is declared twice"):
        declare(option)
    assert OPTIONS["owner"] is option
