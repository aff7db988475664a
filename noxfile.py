"""The compatibility matrix: every combination of Python, Celery, kombu, Django, django-celery-beat and redis-py
that the table of docs/compatibility.md lists, each in a virtual environment of its own, running the suite's
smoke subset (``pytest -m smoke``: a real worker on Redis and RabbitMQ, context, retries, idempotency, dead letters, a
scheduled run, the migrations, the test kit) on the real services.

``make matrix`` runs every combination, then writes the table of docs/compatibility.md from the results
(``compat/results.json``). ``make test`` runs the oldest and the newest. ``nox -s "smoke(newest)"`` runs one.

The combinations cover each version of each line at least once (pairwise, not every product: 108 products
would take hours on two cores), with the oldest and the newest of everything together at both ends. Python
interpreters come from pyenv (``~/.pyenv/versions/3.x.*``) or the PATH.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "compat" / "results.json"
TABLE_PAGE = ROOT / "docs" / "compatibility.md"

nox.options.sessions = ["smoke", "table"]
nox.options.error_on_missing_interpreters = True


@dataclass(frozen=True)
class Combination:
    name: str
    python: str
    celery: str
    kombu: str
    django: str
    beat: str
    redis: str


COMBINATIONS = [
    # The oldest of every line the metadata allows.
    Combination("oldest", "3.11", "5.5.3", "5.5.4", "4.2.30", "2.7.0", "5.0.8"),
    # The one the whole suite runs on (make test), as the development environment has it.
    Combination("primary", "3.11", "5.7.0", "5.7.0", "5.2.19", "2.9.0", "6.4.0"),
    Combination("py312-celery56", "3.12", "5.6.3", "5.6.2", "5.2.19", "2.8.1", "6.4.0"),
    Combination("py312-django60-celery55", "3.12", "5.5.3", "5.5.4", "6.0.10", "2.9.0", "5.0.8"),
    Combination("py313-celery56-redis5", "3.13", "5.6.3", "5.6.2", "5.2.19", "2.8.1", "5.0.8"),
    # The newest of everything.
    Combination("newest", "3.13", "5.7.0", "5.7.0", "6.0.10", "2.9.0", "6.4.0"),
]
BY_NAME = {combination.name: combination for combination in COMBINATIONS}


def interpreter(version: str) -> str:
    """The newest pyenv build of ``version`` (``~/.pyenv/versions/3.12.*``), else ``python3.12`` on the PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(glob.glob(str(root / f"{version}.*" / "bin" / f"python{version}")), key=_release)
    return found[-1] if found else shutil.which(f"python{version}") or f"python{version}"


def install_into(python: Path) -> tuple[str, ...]:
    """The install command into the environment of ``python``: uv's pip, beside this environment's Python (the
    test extra has it; about 2 s a combination against pip's 15 to 20 s of CPU, beside make test's passes), else
    this environment's pip."""
    uv = Path(sys.executable).with_name("uv")
    if uv.exists():
        return (str(uv), "pip", "install", "--python", str(python))
    return (sys.executable, "-m", "pip", "--python", str(python), "install")


def _release(path: str) -> tuple[int, ...]:
    match = re.search(r"versions/(\d+)\.(\d+)\.(\d+)", path)
    return tuple(int(part) for part in match.groups()) if match else (0,)


def _record(combination: Combination, outcome: str, detail: str = "") -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[combination.name] = {
        **asdict(combination),
        "outcome": outcome,
        "detail": detail[-500:],
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


@nox.session(name="smoke", python=False)
@nox.parametrize("combination", [c.name for c in COMBINATIONS], ids=[c.name for c in COMBINATIONS])
def smoke(session: nox.Session, combination: str) -> None:
    """The smoke subset on one combination."""
    chosen = BY_NAME[combination]
    # Kept between runs (installing takes a minute); the pins below make it exact each time.
    venv = ROOT / ".nox" / f"smoke-{chosen.name}"
    python = venv / "bin" / "python"
    if not python.exists():
        # No copy of pip in it: this environment's installer installs into it (--python), which spares setting
        # up and upgrading one per combination (make test makes two fresh ones beside the suite's passes).
        session.run(interpreter(chosen.python), "-m", "venv", "--without-pip", str(venv), external=True)
    session.run(
        *install_into(python),
        "--quiet",
        "-e",
        f"{ROOT}[suite]",
        f"celery=={chosen.celery}",
        f"kombu=={chosen.kombu}",
        f"Django=={chosen.django}",
        f"django-celery-beat=={chosen.beat}",
        f"redis[hiredis]=={chosen.redis}",
        external=True,
    )
    versions = session.run(
        str(python),
        "-c",
        "import sys, celery, kombu, django, django_celery_beat, redis; "
        "print(sys.version.split()[0], celery.__version__, kombu.__version__, django.get_version(), "
        "django_celery_beat.__version__, redis.__version__)",
        external=True,
        silent=True,
    )
    session.log(f"{chosen.name}: Python, Celery, kombu, Django, django-celery-beat, redis-py = {versions}")
    try:
        session.run(
            str(python),
            "-m",
            "pytest",
            "-m",
            "smoke",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            *session.posargs,
            external=True,
            # A test database of the combination's own: make test runs it beside the PostgreSQL pass.
            env={"GUARDRAILS_TEST_DB": "postgres", "GUARDRAILS_TEST_PASS": chosen.name.replace("-", "_")},
        )
    except nox.command.CommandFailed:
        _record(chosen, "failed", "pytest -m smoke failed")
        raise
    _record(chosen, "passed")


@nox.session(python=False)
def table(session: nox.Session) -> None:
    """Write the compatibility table of docs/compatibility.md from the last results (between its markers)."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows = [
        "| combination | Python | Celery | kombu | Django | django-celery-beat | redis-py | result (date) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for combination in COMBINATIONS:
        found = results.get(combination.name)
        result = f"{found['outcome']} ({found['date']})" if found else "not run"
        rows.append(
            f"| {combination.name} | {combination.python} | {combination.celery} | {combination.kombu} | "
            f"{combination.django} | {combination.beat} | {combination.redis} | {result} |"
        )
    text = TABLE_PAGE.read_text()
    start, end = "<!-- compat:start -->", "<!-- compat:end -->"
    if start not in text or end not in text:
        session.error("docs/compatibility.md has no compatibility table markers")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    TABLE_PAGE.write_text(before + start + "\n" + "\n".join(rows) + "\n" + end + after)
    session.log(f"docs/compatibility.md: {len(COMBINATIONS)} combinations")
