"""What the audit (:mod:`celery_guardrails.operations.audit`) reads of the project's own Python source, with :mod:`ast`.

The source is parsed, never imported: importing a project's modules runs their code, and a deploy check must
not. Two readings, for two axes of the rubric:

placement (:func:`read_placement`)
    where a request hands work over: a publish (``.delay(...)``, ``.apply_async(...)``) inside a database
    transaction (``with transaction.atomic():`` or a function decorated ``@transaction.atomic``) that does not
    wait for the commit (``delay_on_commit``, ``apply_async_on_commit``, ``transaction.on_commit(...)``,
    ``enqueue_in_transaction`` or ``apply_async(..., outbox=True)`` do); and code that waits on a task's result
    (``.get(`` / ``.wait(`` on what ``.delay()``, ``.apply_async()``, ``enqueue_in_transaction()`` or
    ``AsyncResult(...)`` returned: a direct chain, or a name last assigned from one earlier in the same
    function). Test files are not read for either; task modules (``tasks.py``, a ``tasks`` package) and task
    functions (decorated ``@shared_task`` / ``@app.task``) are not read for waits. A wait in a script (a module
    with ``if __name__ == "__main__":``) or a management command is told apart: it holds no request.
tests (:func:`read_tests`)
    which test files (``test_*.py``, ``*_test.py``, ``tests.py``, ``conftest.py``, or any file below a ``tests``
    folder) use the test kit (:mod:`celery_guardrails.testing`: they import it, list it in ``pytest_plugins``,
    take its fixtures or carry its marker), and the names each of those files mentions (imported, read as an
    attribute, written as a short string, or used and never assigned).

What is read, and what it costs: the walk skips virtualenvs (a folder holding ``pyvenv.cfg``),
``site-packages``, migrations, ``node_modules``, ``__pycache__`` and hidden folders; it stops after
:data:`MAX_FILES` Python files or :data:`MAX_FOLDERS` folders, skips files over :data:`MAX_BYTES`, and parses a
file only when its bytes contain a word the reading looks for. A file that does not parse is skipped (the audit
is not a linter). What was cut short is said (``complete``), never silently dropped.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

#: Python files read at most per walk: a repository's worth, so that a huge tree cannot hang a deploy check.
MAX_FILES = 5000
#: Folders entered at most per walk (a data folder of many small files costs listings, not parses).
MAX_FOLDERS = 20000
#: Bytes above which a file is not read (generated code, vendored bundles).
MAX_BYTES = 1_000_000
#: Folder names never entered (hidden folders, whose names start with a dot, are not entered either).
SKIPPED_FOLDERS = frozenset({"node_modules", "site-packages", "dist-packages", "migrations", "__pycache__"})

#: Calls that publish a message and return its AsyncResult, by attribute name.
PUBLISH_CALLS = frozenset({"delay", "apply_async", "enqueue_in_transaction"})
#: Of those, the ones that publish at once (inside a transaction, before its commit).
IMMEDIATE_CALLS = frozenset({"delay", "apply_async"})
#: Calls that wait for a result.
WAIT_CALLS = frozenset({"get", "wait"})
#: A file is parsed for placement only when its bytes hold one of these.
PLACEMENT_WORDS = (b"delay(", b"apply_async(", b"AsyncResult(", b"enqueue_in_transaction(")

#: The test kit, as a test file names it (kept equal to celery_guardrails.testing by the audit's tests).
KIT_MODULE = "celery_guardrails.testing"
KIT_FIXTURES = frozenset({"guardrails_kit", "guarded_worker"})
KIT_MARKER = "guardrails"
KIT_HELPERS = (
    "deliver_twice",
    "crash_mid_task",
    "poison",
    "out_of_order",
    "deploy_during_processing",
    "store_outage",
    "assert_single_effect",
    "assert_dead_lettered",
    "assert_no_loss",
    "assert_job",
)
#: A test file is parsed only when its bytes hold one of these.
KIT_WORDS = (
    b"celery_guardrails.testing",
    b"celery_guardrails import testing",
    b"guardrails_kit",
    b"guarded_worker",
    b"mark.guardrails",
)
#: String constants longer than this are not kept as names (docstrings, SQL, fixtures' data).
LONGEST_NAME = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class Walk:
    """The Python files below ``root`` (paths relative to it, in POSIX form), and whether the walk saw them all."""

    root: Path
    files: tuple[str, ...]
    complete: bool = True
    why_incomplete: str = ""

    def tests(self) -> tuple[str, ...]:
        return tuple(path for path in self.files if is_test_file(path))

    def sources(self) -> tuple[str, ...]:
        return tuple(path for path in self.files if not is_test_file(path))


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One place in the source: ``path`` relative to the root, its line, and the function around it."""

    path: str
    line: int
    function: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """What :func:`read_placement` found: publishes in a transaction, waits in request code, waits in scripts."""

    in_transaction: tuple[Site, ...] = ()
    waits: tuple[Site, ...] = ()
    waits_in_scripts: tuple[Site, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KitFile:
    """A test file that uses the kit, and every identifier and short string constant it mentions."""

    path: str
    names: frozenset[str] = field(default_factory=frozenset)


def _skipped(folder: Path, name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_FOLDERS or (folder / name / "pyvenv.cfg").exists()


def walk(root: Path, *, max_files: int = MAX_FILES, max_folders: int = MAX_FOLDERS) -> Walk:
    """The Python files below ``root`` (sorted, so a cut-short walk cuts the same files every time)."""
    if not root.is_dir():
        return Walk(root=root, files=(), complete=False, why_incomplete=f"{root} is not a folder")
    found: list[str] = []
    folders = 0
    for folder, names, files in os.walk(root):
        here = Path(folder)
        folders += 1
        if folders > max_folders:
            return Walk(root=root, files=tuple(found), complete=False, why_incomplete=f"over {max_folders} folders")
        names[:] = sorted(name for name in names if not _skipped(here, name))
        relative = here.relative_to(root).as_posix()
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            if len(found) >= max_files:
                return Walk(
                    root=root, files=tuple(found), complete=False, why_incomplete=f"over {max_files} Python files"
                )
            found.append(name if relative == "." else f"{relative}/{name}")
    return Walk(root=root, files=tuple(found))


def is_test_file(path: str) -> bool:
    """``path`` (relative to the walked root) is a test file: by its name, or below a ``tests`` folder."""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name in ("tests.py", "conftest.py")
        or "tests" in parts[:-1]
    )


def _read(root: Path, path: str, words: Iterable[bytes]) -> ast.Module | None:
    """The parsed file, or None when it is too big, holds none of ``words``, or does not parse."""
    try:
        location = root / path
        if location.stat().st_size > MAX_BYTES:
            return None
        data = location.read_bytes()
    except OSError:
        return None
    if not any(word in data for word in words):
        return None
    try:
        return ast.parse(data, filename=path)
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a NUL byte
        return None


# -- placement ------------------------------------------------------------------------------------------------


def _callee(node: ast.expr) -> ast.expr:
    """``x`` of ``x(...)``, else the node itself: a decorator or context manager with or without arguments."""
    return node.func if isinstance(node, ast.Call) else node


def _named(node: ast.expr, *names: str) -> bool:
    """``node`` is ``name`` or ``something.name`` for one of ``names``."""
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)


def _is_atomic(node: ast.expr) -> bool:
    return _named(_callee(node), "atomic")


def _is_task_decorator(node: ast.expr) -> bool:
    return _named(_callee(node), "task", "shared_task")


def _is_publish(node: ast.expr | None) -> bool:
    """``node`` is a call that returns a task's AsyncResult."""
    if not isinstance(node, ast.Call):
        return False
    return (isinstance(node.func, ast.Attribute) and node.func.attr in PUBLISH_CALLS) or _named(
        node.func, "AsyncResult"
    )


def _through_outbox(node: ast.Call) -> bool:
    """``apply_async(..., outbox=<anything but False/None>)``: written in the transaction, published after."""
    return any(
        keyword.arg == "outbox"
        and not (isinstance(keyword.value, ast.Constant) and keyword.value.value in (False, None))
        for keyword in node.keywords
    )


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node of a scope, without the bodies of the functions, lambdas and classes defined in it."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _assignments(nodes: Iterable[ast.AST]) -> dict[str, list[tuple[int, bool]]]:
    """Per name assigned in the scope: (line, assigned from a publish) of each assignment, in line order."""
    found: dict[str, list[tuple[int, bool]]] = {}
    for node in _own_nodes(nodes):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.AugAssign | ast.For | ast.AsyncFor):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets, value = [node.optional_vars], node.context_expr
        for target in targets:
            if isinstance(target, ast.Name):
                found.setdefault(target.id, []).append((target.lineno, _is_publish(value)))
    for lines in found.values():
        lines.sort()
    return found


@dataclass(slots=True)
class _Scope:
    function: str
    atomic: bool
    task: bool
    assigned: dict[str, list[tuple[int, bool]]]


class _PlacementReader:
    """One file's publishes in a transaction and waits on a result (see the module docstring)."""

    def __init__(self, path: str, *, waits_read: bool) -> None:
        self.path = path
        self.waits_read = waits_read
        self.in_transaction: list[Site] = []
        self.waits: list[Site] = []

    def read(self, module: ast.Module) -> None:
        self._scope(module.body, _Scope("<module>", atomic=False, task=False, assigned={}))

    def _scope(self, body: list[ast.stmt] | list[ast.expr], scope: _Scope) -> None:
        scope.assigned = _assignments(body)
        self._walk(body, scope)

    def _walk(self, nodes: Iterable[ast.AST], scope: _Scope) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                # Decorators and defaults run here; the body runs when called: outside any block around the def.
                defaults = [default for default in node.args.kw_defaults if default is not None]
                self._walk([*node.decorator_list, *node.args.defaults, *defaults], scope)
                name = node.name if scope.function == "<module>" else f"{scope.function}.{node.name}"
                inner = _Scope(
                    name,
                    atomic=any(_is_atomic(decorator) for decorator in node.decorator_list),
                    task=scope.task or any(_is_task_decorator(decorator) for decorator in node.decorator_list),
                    assigned={},
                )
                self._scope(node.body, inner)
            elif isinstance(node, ast.Lambda):
                self._scope([node.body], _Scope(scope.function, atomic=False, task=scope.task, assigned={}))
            elif isinstance(node, ast.ClassDef):
                self._walk(node.decorator_list, scope)
                name = node.name if scope.function == "<module>" else f"{scope.function}.{node.name}"
                self._scope(node.body, _Scope(name, atomic=False, task=scope.task, assigned={}))
            elif isinstance(node, ast.With | ast.AsyncWith):
                self._walk(node.items, scope)
                atomic = scope.atomic or any(_is_atomic(item.context_expr) for item in node.items)
                self._walk(node.body, _Scope(scope.function, atomic=atomic, task=scope.task, assigned=scope.assigned))
            else:
                if isinstance(node, ast.Call):
                    self._call(node, scope)
                self._walk(ast.iter_child_nodes(node), scope)

    def _call(self, node: ast.Call, scope: _Scope) -> None:
        if not isinstance(node.func, ast.Attribute):
            return
        site = Site(path=self.path, line=node.lineno, function=scope.function)
        attribute = node.func.attr
        if attribute in IMMEDIATE_CALLS and scope.atomic and not _through_outbox(node):
            self.in_transaction.append(site)
        elif attribute in WAIT_CALLS and self.waits_read and not scope.task and self._waits_on_result(node, scope):
            self.waits.append(site)

    @staticmethod
    def _waits_on_result(node: ast.Call, scope: _Scope) -> bool:
        assert isinstance(node.func, ast.Attribute)
        receiver = node.func.value
        if _is_publish(receiver):
            return True
        if not isinstance(receiver, ast.Name):
            return False
        earlier = [published for line, published in scope.assigned.get(receiver.id, ()) if line <= node.lineno]
        return bool(earlier) and earlier[-1]


def _is_script(module: ast.Module) -> bool:
    """The module runs as a script: it has ``if __name__ == "__main__":``."""
    for node in module.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            sides = [node.test.left, *node.test.comparators]
            if any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) and any(
                isinstance(side, ast.Constant) and side.value == "__main__" for side in sides
            ):
                return True
    return False


def _is_task_module(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return parts[-1] == "tasks.py" or "tasks" in parts[:-1]


def _is_command(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return any(parts[i : i + 2] == ("management", "commands") for i in range(len(parts) - 1))


def read_placement(walked: Walk) -> Placement:
    """The placement reading of the walked root's non-test files (see the module docstring)."""
    in_transaction: list[Site] = []
    waits: list[Site] = []
    in_scripts: list[Site] = []
    for path in walked.sources():
        module = _read(walked.root, path, PLACEMENT_WORDS)
        if module is None:
            continue
        reader = _PlacementReader(path, waits_read=not _is_task_module(path))
        try:
            reader.read(module)
        except RecursionError:  # an absurdly nested expression: not graded
            continue
        in_transaction += reader.in_transaction
        (in_scripts if _is_script(module) or _is_command(path) else waits).extend(reader.waits)
    return Placement(in_transaction=tuple(in_transaction), waits=tuple(waits), waits_in_scripts=tuple(in_scripts))


# -- tests ----------------------------------------------------------------------------------------------------


def _uses_kit(module: ast.Module) -> bool:
    for node in ast.walk(module):
        if isinstance(node, ast.Import) and any(
            alias.name == KIT_MODULE or alias.name.startswith(f"{KIT_MODULE}.") for alias in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == KIT_MODULE or node.module.startswith(f"{KIT_MODULE}."):
                return True
            if node.module == "celery_guardrails" and any(alias.name == "testing" for alias in node.names):
                return True
        # pytest_plugins = ["celery_guardrails.testing"]; @pytest.mark.usefixtures("guardrails_kit")
        if isinstance(node, ast.Constant) and node.value in (KIT_MODULE, *KIT_FIXTURES):
            return True
        if isinstance(node, ast.arg) and node.arg in KIT_FIXTURES:
            return True
        if (
            isinstance(node, ast.Attribute)
            and node.attr == KIT_MARKER
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        ):
            return True
    return False


def _names(module: ast.Module) -> frozenset[str]:
    """The names a test file mentions: what it imports, the attributes it reads, short string constants, and the
    names it uses but never assigns (``report = deliver_twice(...)`` does not name a task called ``report``)."""
    found: set[str] = set()
    used: set[str] = set()
    assigned: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            (assigned if isinstance(node.ctx, ast.Store | ast.Del) else used).add(node.id)
        elif isinstance(node, ast.arg):
            assigned.add(node.arg)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
            if node.asname:
                found.add(node.asname)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) <= LONGEST_NAME:
            found.add(node.value)
    return frozenset(found | (used - assigned))


def read_tests(walked: Walk) -> tuple[int, tuple[KitFile, ...]]:
    """How many test files the walked root holds, and those of them that use the kit, with their names."""
    tests = walked.tests()
    kit_files = []
    for path in tests:
        module = _read(walked.root, path, KIT_WORDS)
        if module is not None and _uses_kit(module):
            kit_files.append(KitFile(path=path, names=_names(module)))
    return len(tests), tuple(kit_files)


__all__ = [
    "KIT_FIXTURES",
    "KIT_HELPERS",
    "KIT_MARKER",
    "KIT_MODULE",
    "KitFile",
    "Placement",
    "Site",
    "Walk",
    "is_test_file",
    "read_placement",
    "read_tests",
    "walk",
]
