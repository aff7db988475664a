"""The documentation site stays true: it builds with warnings as errors, its code blocks are run or checked the
way the Quick start is, and every setting is on its settings page.

The pages are docs/*.md (mkdocs.yml); the README's Quick start is a page of the site too (included), so the
README's blocks are checked here with the pages'. What is checked of a block depends on what it is:

- every ``python`` block compiles; the names it imports from Celery, kombu, Django and this project exist; the
  options it gives a ``GuardedTask`` exist and take the values shown; each ``CELERY_GUARDRAILS`` it assigns is
  valid (``celery_guardrails.options.validate``, as a worker checks it at start-up);
- the blocks that are complete settings or configuration are run: the ``LOGGING`` dict configures logging and
  formats a record, the quorum-queue settings configure a Celery app whose countdowns are whole seconds;
- every command of a shell block is parsed by the command's own parser (``manage.py`` commands by Django's,
  ``celery`` by Celery's click group), names a Makefile target (``make``), or installs extras setup.cfg has.
"""

from __future__ import annotations

import ast
import configparser
import importlib
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails.options import OPTIONS, TASK, validate

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: where it is (for the test id), its language and its text."""

    source: str
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def fenced_blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a Markdown file, with the line their fence opens on."""
    lines = path.read_text().split("\n")
    source = str(path.relative_to(ROOT))
    n = 0
    while n < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[n])
        if opening:
            end = next(i for i in range(n + 1, len(lines)) if lines[i].startswith("```"))
            yield Block(source, n + 1, opening.group(1), "\n".join(lines[n + 1 : end]) + "\n")
            n = end
        n += 1


PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [block for path in [*PAGES, README] for block in fenced_blocks(path)]
PYTHON = [block for block in BLOCKS if block.lang == "python"]
SHELL = [block for block in BLOCKS if block.lang in ("", "bash", "sh", "shell", "console")]
#: Modules whose names a block may import and that must then exist (a user's own modules are not checked).
CHECKED_IMPORTS = ("celery", "kombu", "django", "celery_guardrails", "django_celery_guardrails")


def by_id(blocks: list[Block]) -> Any:
    return pytest.mark.parametrize("block", blocks, ids=[block.id for block in blocks])


def syntax(block: Block) -> ast.Module:
    return ast.parse(block.text, filename=block.id)


def test_the_pages_have_code_blocks_of_each_kind() -> None:
    # Given the pages and the README
    # When their fenced blocks are read
    # Then there are Python, shell and ini blocks to check, from the pages and from the README's Quick start
    assert len(PYTHON) >= 20 and len(SHELL) >= 4
    assert {block.source for block in PYTHON} >= {"README.md", "docs/index.md", "docs/guardrails/retries.md"}
    assert any(block.lang == "ini" for block in BLOCKS)


@by_id(PYTHON)
def test_every_python_block_compiles(block: Block) -> None:
    # Given a Python block of the docs
    # When it is compiled
    # Then it is valid Python (a fragment may leave names undefined, but not break the syntax)
    compile(block.text, block.id, "exec")


@by_id(PYTHON)
def test_what_a_python_block_imports_exists(block: Block) -> None:
    # Given a Python block's imports from Celery, kombu, Django and this project
    names = []
    for node in ast.walk(syntax(block)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in CHECKED_IMPORTS:
            names += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in CHECKED_IMPORTS]
    # When each module is imported
    # Then it and every name taken from it exist
    for module, name in names:
        imported = importlib.import_module(module)
        if name is not None:
            assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), f"{module}.{name}"


#: What a task decorator may take besides the guardrail options: Celery's own task options.
CELERY_TASK_OPTIONS = {
    "base",
    "bind",
    "name",
    "autoretry_for",
    "dont_autoretry_for",
    "retry_kwargs",
    "retry_backoff",
    "retry_backoff_max",
    "retry_jitter",
    "max_retries",
    "acks_late",
    "reject_on_worker_lost",
    "time_limit",
    "soft_time_limit",
    "ignore_result",
    "rate_limit",
    "serializer",
    "queue",
}


def task_decorators(block: Block) -> Iterator[ast.Call]:
    """The ``shared_task(...)`` / ``app.task(...)`` calls of a block that make a ``GuardedTask``."""
    for node in ast.walk(syntax(block)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        base = next((kw.value for kw in node.keywords if kw.arg == "base"), None)
        if name in ("shared_task", "task") and isinstance(base, ast.Name) and base.id == "GuardedTask":
            yield node


@by_id([block for block in PYTHON if any(task_decorators(block))])
def test_the_options_a_guarded_task_is_given_exist(block: Block) -> None:
    # Given the task decorators of a Python block that make a GuardedTask
    for call in task_decorators(block):
        for keyword in call.keywords:
            # When each keyword is looked up
            # Then it is a guardrail option that a task may set, or one of Celery's task options
            assert keyword.arg in CELERY_TASK_OPTIONS or (
                keyword.arg in OPTIONS and TASK in OPTIONS[keyword.arg].scopes
            ), f"{block.id}: unknown task option {keyword.arg!r}"
            # and a literal value is one the option takes
            if keyword.arg in OPTIONS and isinstance(keyword.value, ast.Constant):
                OPTIONS[keyword.arg].check(keyword.value.value)


def assigned(block: Block, name: str) -> ast.expr | None:
    for node in ast.walk(syntax(block)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
    return None


def evaluated(block: Block, name: str) -> Any:
    """The value a block assigns to ``name``, worked out with what the block imports. And ``os``: the Quick
    start's settings read the seal key from the environment; that its block imports ``os`` is checked where the
    Quick start is run as printed (tests/example_project)."""
    namespace: dict[str, Any] = {"os": os}
    imports = [node for node in syntax(block).body if isinstance(node, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(imports, []), block.id, "exec"), namespace)
    expression = assigned(block, name)
    assert expression is not None
    return eval(compile(ast.Expression(expression), block.id, "eval"), namespace)


@by_id([block for block in PYTHON if assigned(block, "CELERY_GUARDRAILS") is not None])
def test_every_celery_guardrails_setting_shown_is_valid(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.fernet import Fernet

    # Given a block that sets CELERY_GUARDRAILS, in an environment holding the seal key the Quick start reads
    monkeypatch.setenv("GUARDRAILS_SEAL_KEY", Fernet.generate_key().decode())
    settings = evaluated(block, "CELERY_GUARDRAILS")
    # When it is validated as a worker validates it at start-up
    checked = validate(settings)
    # Then every key is known and every value accepted
    assert set(checked) == set(settings)
    # and a policy names a beat entry of the same block, when the block has a schedule
    if assigned(block, "CELERY_BEAT_SCHEDULE") is not None:
        assert set(checked.get("schedules", {})) <= set(evaluated(block, "CELERY_BEAT_SCHEDULE"))


@by_id([block for block in PYTHON if "MIDDLEWARE +=" in block.text])
def test_the_django_settings_shown_name_real_apps_and_middleware(block: Block) -> None:
    from django.utils.module_loading import import_string

    # Given a settings block that adds apps and middleware, its additions run on empty lists
    namespace: dict[str, Any] = {"INSTALLED_APPS": [], "MIDDLEWARE": [], "os": os}
    for node in syntax(block).body:
        if isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) in ("INSTALLED_APPS", "MIDDLEWARE"):
            exec(compile(ast.Module([node], []), block.id, "exec"), namespace)
    # When its apps are imported and its middleware resolved
    # Then each exists
    assert namespace["MIDDLEWARE"]
    for app in namespace["INSTALLED_APPS"]:
        if app in USER_APPS:  # the user's own app, made by `manage.py startapp` (the Quick start's test runs it)
            continue
        importlib.import_module(app)
    for middleware in namespace["MIDDLEWARE"]:
        assert callable(import_string(middleware))


def test_the_logging_settings_shown_format_a_record_with_its_context() -> None:
    # Given the Logging block of the context page, as a settings module would hold it
    (block,) = [block for block in PYTHON if assigned(block, "LOGGING") is not None]
    program = (
        block.text
        + "\nimport logging, logging.config\nlogging.config.dictConfig(LOGGING)\n"
        + "from celery_guardrails import tenant_context\n"
        + "with tenant_context('acme'):\n    logging.getLogger('shop').info('charged %s', 42)\n"
    )
    # When a program configures logging with it and logs inside a tenant context
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    # Then the line carries the tenant, and '-' where there is no correlation id or task
    assert result.returncode == 0, result.stderr
    assert "INFO shop [tenant=acme cid=" in result.stderr
    assert "task=-/-] charged 42" in result.stderr


def test_the_quorum_queue_settings_shown_make_countdowns_whole_seconds() -> None:
    from celery import Celery

    from celery_guardrails.broker.delays import countdown_for

    # Given the quorum-queue block of the brokers page, run against a Celery app on RabbitMQ
    (block,) = [block for block in PYTHON if "x-queue-type" in block.text]
    app = Celery("docs", broker="amqp://guest:guest@127.0.0.1:5672//", set_as_current=False)
    exec(compile(block.text, block.id, "exec"), {"app": app})
    # When the guardrails work out what countdowns the app's broker takes
    # Then the queue is the default, declared quorum, and waits are rounded up to whole seconds as documented
    assert app.conf.task_default_queue == "orders"
    assert app.conf.task_queues[0].queue_arguments == {"x-queue-type": "quorum"}
    assert [countdown_for(app, wait) for wait in (0.05, 0.2, 1.5, 0)] == [1, 1, 2, 0]


def test_the_kit_settings_shown_are_the_plugins_ini_options(pytestconfig: pytest.Config) -> None:
    # Given the ini block of the test kit's guide
    (block,) = [block for block in BLOCKS if block.lang == "ini"]
    parser = configparser.ConfigParser(inline_comment_prefixes=(";",))
    parser.read_string(block.text)
    # When each key is looked up among the ini options pytest knows (the kit's entry point adds them)
    # Then each is one (getini raises ValueError for an unknown name)
    assert set(parser["pytest"]) == {
        "guardrails_app",
        "guardrails_pool",
        "guardrails_concurrency",
        "guardrails_launcher",
    }
    for name in parser["pytest"]:
        pytestconfig.getini(name)


@dataclass(frozen=True, slots=True)
class Command:
    """One command line of a shell block."""

    block: Block
    words: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.block.id}:{' '.join(self.words[:4])}"


def commands(blocks: list[Block]) -> Iterator[Command]:
    for block in blocks:
        for line in block.text.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                yield Command(block, tuple(words))


COMMANDS = list(commands(SHELL))
#: Apps the docs tell the user to make themselves (``startapp NAME`` in their text): not importable here.
USER_APPS = {match.group(1) for path in [*PAGES, README] for match in re.finditer(r"startapp (\w+)", path.read_text())}


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {match.group(1) for match in re.finditer(r"^([\w.-]+):", text, re.M)}


def extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return set(config["options.extras_require"])


def parse_manage_py(words: list[str]) -> None:
    """Parse ``manage.py NAME ARGS`` with the command's own parser (its options, its choices)."""
    from django.core.management import get_commands, load_command_class

    name, *arguments = words
    available = get_commands()
    assert name in available, f"no management command {name!r}"
    command = load_command_class(available[name], name)
    command.create_parser("manage.py", name).parse_args(arguments)


def parse_celery(words: list[str]) -> None:
    """Parse ``celery ARGS`` with Celery's own click group, down to the subcommand (nothing is run)."""
    import click
    from celery import Celery
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery

    obj = CLIContext(app=Celery("docs", set_as_current=False), no_color=True, workdir=None, quiet=True)
    group: click.Command = celery
    context = group.make_context("celery", list(words), obj=obj)
    while isinstance(group, click.Group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2: protected_args is read by name
            rest = [*context.protected_args, *context.args]
        if not rest:
            break
        name, command, arguments = group.resolve_command(context, rest)
        assert command is not None and name is not None
        group, context = command, command.make_context(name, arguments, parent=context)
    scheduler = context.params.get("scheduler")
    if scheduler:
        from celery.utils.imports import symbol_by_name

        symbol_by_name(scheduler)


@pytest.mark.parametrize("command", COMMANDS, ids=[command.id for command in COMMANDS])
def test_every_command_shown_exists_with_its_options(command: Command) -> None:
    import click

    words = list(command.words)
    # Given a command line of a shell block
    # When it is parsed by the command's own parser
    # Then it names a command and options that exist
    if words[0] == "make":
        assert set(words[1:]) <= makefile_targets(), command.id
    elif words[:2] == ["pip", "install"]:
        for spec in words[2:]:
            named = re.search(r"\[([\w,]+)\]", spec)
            assert named and set(named.group(1).split(",")) <= extras(), spec
    elif "manage.py" in words[:2]:
        parse_manage_py(words[words.index("manage.py") + 1 :])
    elif words[0] == "export":
        # A variable set from a one-line program: the program runs and prints a value
        name, _, value = words[1].partition("=")
        program = re.fullmatch(r"\$\(python -c '(.+)'\)", value)
        assert name and program, command.id
        printed = subprocess.run(
            [sys.executable, "-c", program.group(1)], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        if name == "GUARDRAILS_SEAL_KEY":  # a key the seal accepts
            from cryptography.fernet import Fernet

            Fernet(printed)
    elif words[0] == "celery":
        try:
            parse_celery(words[1:])
        except click.UsageError as exc:
            pytest.fail(f"{command.id}: {exc}")
    else:
        pytest.fail(f"{command.id}: a command the docs tests do not know how to check: {words[0]!r}")


def test_every_management_command_named_in_the_docs_exists() -> None:
    from django.core.management import get_commands

    # Given every `manage.py NAME` in the pages' text (inline code too)
    text = "\n".join(path.read_text() for path in [*PAGES, README])
    named = set(re.findall(r"manage\.py (\w+)", text))
    # When they are looked up among Django's commands
    # Then each exists
    assert named and named - set(get_commands()) == set()


def settings_rows() -> list[str]:
    page = (DOCS / "settings.md").read_text()
    return re.findall(r"^\| `(\w+)` \|", page, re.M)


def test_every_setting_is_documented_on_the_settings_page() -> None:
    # Given the settings page's table
    rows = settings_rows()
    # When it is compared with the options the code declares
    # Then each option has its row, each row is an option, and none twice
    assert sorted(rows) == sorted(OPTIONS)


def test_the_site_builds_with_warnings_as_errors_and_the_readme_links_into_it(tmp_path: Path) -> None:
    # Given the site's sources and the README's links into docs/
    site = tmp_path / "site"
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # When the site is built as `make docs` builds it (strict: a broken link or anchor, a page out of the nav)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment,
        check=False,
    )
    # Then it builds
    assert result.returncode == 0, result.stderr[-3000:]
    # and the Quick start page is the README's own section
    quick_start = (site / "quick-start" / "index.html").read_text()
    assert "Quick start for a Django project" in quick_start and "--8&lt;--" not in quick_start
    # and every README link into docs/ reaches a page of the site, and its anchor on that page
    links = re.findall(r"\]\((docs/[^)#\s]*)(?:#([^)\s]+))?\)", README.read_text())
    assert len(links) >= 20
    for target, anchor in links:
        page = target.removeprefix("docs/").removesuffix(".md").removesuffix("index")
        built = site / page / "index.html"
        assert built.exists(), target
        if anchor:
            assert f'id="{anchor}"' in built.read_text(), f"{target}#{anchor}"


def test_every_guardrail_of_the_readme_table_links_to_its_page() -> None:
    # Given the README's guardrails table
    readme = README.read_text()
    table = readme.split("| guardrail | status |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.strip().splitlines()[1:]]
    # When its first cells are read
    # Then each opens with a link into the docs, and every page it links to exists (anchors: the build test)
    assert len(rows) >= 10
    for row in rows:
        assert re.match(r"\| \[[^\]]+\]\(docs/", row), row
        for target in re.findall(r"\]\((docs/[^)#]+)", row.split(" | ")[0]):
            assert (ROOT / target).exists(), target


def test_the_time_format_the_docs_state_is_the_one_logs_commands_and_the_admin_write() -> None:
    from datetime import UTC, datetime

    from celery_guardrails.log import MOMENT_FORMAT, moment_text

    # Given the section of the commands page that states how times read
    page = (DOCS / "operations" / "commands.md").read_text()
    section = page.split("## How times read", 1)[1].split("\n## ", 1)[0]
    samples = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", section)
    assert len(samples) >= 3, section
    # Then each moment it shows is what the code writes for that moment, in logs, commands and the admin (UTC)
    for sample in samples:
        instant = datetime.strptime(sample, MOMENT_FORMAT).replace(tzinfo=UTC)
        assert moment_text(instant.timestamp()) == sample
        assert instant.strftime("%Y-%m-%d %H:%M:%S %Z") == sample  # django_celery_guardrails.display.MOMENT_FORMAT
    # And the admin page's statement of its format links to it
    assert "commands.md#how-times-read" in (DOCS / "operations" / "admin.md").read_text()
