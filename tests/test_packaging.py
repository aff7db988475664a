"""Packaging: the wheel installs into a fresh virtual environment, and the core never imports Django."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_wheel_installs_into_a_fresh_venv_and_both_packages_import(tmp_path: Path) -> None:
    # Given a wheel built from the source tree
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", ROOT, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("celery_guardrails-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in (
        "celery_guardrails/py.typed",
        "django_celery_guardrails/py.typed",
        "django_celery_guardrails/migrations/__init__.py",
        "django_celery_guardrails/apps.py",
    ):
        assert expected in names
    assert not [name for name in names if name.startswith(("tests/", "example_project/", "django_app/"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: celery<6,>=5.5" in metadata
    assert 'Requires-Dist: Django<6,>=4.2; extra == "django"' in metadata
    # When it is installed (without dependencies) into a fresh venv whose dependencies come from this one
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp_path)
    site = Path(
        run(
            venv / "bin" / "python",
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            cwd=tmp_path,
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Then both packages import from the installed wheel, not from the source tree
    out = run(
        venv / "bin" / "python",
        "-c",
        textwrap.dedent("""
        import celery_guardrails, django_celery_guardrails, django_celery_guardrails.apps
        from celery_guardrails import GuardedTask, tenant_context, current_tenant
        print(celery_guardrails.__file__)
        print(django_celery_guardrails.__file__)
        print(django_celery_guardrails.apps.GuardrailsConfig.label)
    """),
        cwd=tmp_path,
    )
    core, app, label = out.split()
    assert core.startswith(str(site)) and app.startswith(str(site))
    assert label == "guardrails"


def test_core_imports_no_django(tmp_path: Path) -> None:
    # kombu imports django.utils.functional when Django is installed (to serialise lazy strings), so the
    # check is that the core adds no Django module to what Celery itself loads.
    out = run(
        sys.executable,
        "-c",
        textwrap.dedent("""
        import importlib, pkgutil, sys
        import celery, celery.bootsteps, celery.signals, kombu
        django = lambda: {m for m in sys.modules if m == "django" or m.startswith("django.")}
        before = django()
        import celery_guardrails
        for module in pkgutil.walk_packages(celery_guardrails.__path__, "celery_guardrails."):
            importlib.import_module(module.name)
        print(sorted(django() - before))
    """),
        cwd=tmp_path,
    )
    assert out.strip() == "[]"
