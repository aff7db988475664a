# The two commands of the README: `make demo` and `make test`. Everything installs into .venv from
# setup.cfg; nothing is installed by hand.
PYTHON ?= python3
# Python caches each module's bytecode (__pycache__, git-ignored) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, set on the machines we run on): the suite starts hundreds of Python processes (workers,
# beat, the CLI, the matrix's), and each compiled the project's 200 modules from source again, about 0.35 s of
# CPU time per process.
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: demo test test-postgres test-sqlite matrix matrix-edges services lint docs check bench flaky soak clean

# The environment is installed by uv (from the package index, as pip would: the same versions, measured
# against pip's freeze), pip kept in it for what the suite does as a user would (the wheel into fresh venvs,
# with pip). A fresh clone's install took 27 s with pip and 4 s with uv, on the path every pass waits for; the
# matrix's environments are installed by it too (noxfile.py).
UV_REQUIREMENT := $(shell sed -n 's/^ *\(uv[<>=].*\)/\1/p' setup.cfg)
UV := $(VENV)/bin/uv
$(INSTALLED): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(UV_REQUIREMENT)'
	$(UV) pip install --quiet --python $(PY) --upgrade-package pip pip -e '.[test]'
	touch $(INSTALLED)

demo: $(INSTALLED)
	$(PY) example_project/demo.py

services:
	bash scripts/services.sh
	bash scripts/browser.sh
	bash scripts/promtool.sh

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml, docs/) into site/, git-ignored: --strict makes every warning an error (a
# page left out of the nav, a link to a page or an anchor that does not exist). A few seconds. (Not --quiet: it hides
# the warnings --strict counts, and the build passes. Material prints an end-of-life notice about MkDocs 2 on
# every build unless NO_MKDOCS_2_WARNING is set.)
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The whole suite: lint and the docs beside three passes: everything on PostgreSQL, what uses the database again
# on SQLite, and the matrix's oldest and newest combinations. They mostly wait on workers and
# services (a PostgreSQL pass alone used about half of the two cores), so side by side they fill both cores:
# one after the other they took 963 + 213 + 240 s in CI. Side by side on this 2-core host, while other suites ran
# (load average 7 to 16): 1,104 s for the three (PostgreSQL 1,097 s, SQLite 560 s, matrix about 600 s), where
# the PostgreSQL pass alone had taken 1,411 s under like load. Each pass's output is printed whole when it ends
# (--output-sync), and a pass that fails makes make test fail once the others have finished. The passes do not
# share a Redis database (each test process claims its own: tests/support/services.py) nor a test database
# (PostgreSQL: one per checkout, pass and process; SQLite: a file per process).
# PYTEST_ARGS: more pytest arguments for the two passes (make flaky adds a JUnit report); by default the slowest
# tests are listed, so that a CI log shows where a pass spent its time.
PYTEST_ARGS ?= --durations=25
# Test processes per pass (pytest-xdist): most of a test's time is spent waiting on real workers and services,
# so more processes than cores keep both busy (measured on 2 cores: the PostgreSQL pass took 780 s with two,
# 566 s with three; with the tests of #29, 724 s with three on a loaded host and 526 s with five on a quiet one,
# using about 55% of the two cores' time, but timing-bound tests failed more often: four). Each has its own Redis
# database and test database.
# After the fork server (tests/support/zygote.py) the pass waits more than it computes: a clean-clone make test
# took 691 s with four processes and 601 s with six, the PostgreSQL pass 632 s and 570 s, no failure.
WORKERS ?= 6
# The SQLite pass, beside the PostgreSQL one: fewer processes, its 378 tests are a quarter of the other's work.
SQLITE_WORKERS ?= 2
# (A fourth pass of the tests that build an environment of their own (the wheel's fresh venvs, startproject,
# the demo, the short soaks), beside the others, made the whole suite slower, not faster: 833 s in CI against
# 635 s, the PostgreSQL pass 873 s against about 590 s. Two more processes on two cores slowed every pass; those
# tests are the first the PostgreSQL pass hands out instead (tests/conftest.py SLOW_FIRST).)
# loadgroup: the tests marked xdist_group (the two of the fresh venv from the package index) share one process,
# and so one copy of their module's fixtures; the others are handed out one by one in collection order, the
# slowest modules first (tests/conftest.py).
DIST := --dist loadgroup
# How many of the jobs run at once: lint, the docs and the three passes (1: one after the other).
PASSES ?= 5
test: $(INSTALLED) services
	$(MAKE) --no-print-directory -j$(PASSES) --output-sync=target lint docs test-postgres test-sqlite matrix-edges

test-postgres: $(INSTALLED)
	GUARDRAILS_TEST_DB=postgres $(PY) -m pytest -n $(WORKERS) $(DIST) $(PYTEST_ARGS)

# (The store tests' Redis and Redis Cluster cases touch no database: they run in the PostgreSQL pass only; of
# the test kit's, those that show it on the Django store.)
KIT_TESTS := tests/celery_guardrails/testing/test_kit.py
KIT_ON_SQLITE := $(KIT_TESTS)::test_deliver_twice_passes_the_keyed_task \
	$(KIT_TESTS)::test_crash_half_way_passes_the_job_in_one_transaction_with_its_key \
	$(KIT_TESTS)::test_poison_passes_the_guarded_task_which_dead_letters_it \
	$(KIT_TESTS)::test_deploy_passes_versioned_payloads
# (Left to the PostgreSQL pass: what does not depend on the database behind the ORM: the admin's layout and
# clicks in Chromium, the audit reading the project's source, the hostile-input fuzz of the final-failure path,
# the jobs' HTTP views, admin pages, command and metrics. The jobs' states and completions, written by workers
# through the job book, run on both: SQLite's one writer changes what a cancel and a progress write meet.)
SQLITE_SKIPS := --ignore=tests/django_app/test_admin_browser.py --ignore=tests/django_app/test_audit.py \
	--ignore=tests/django_app/test_hostile_input.py --ignore=tests/django_app/test_job_views.py \
	--ignore=tests/django_app/test_job_admin.py --ignore=tests/django_app/test_job_operations.py
test-sqlite: $(INSTALLED)
	GUARDRAILS_TEST_DB=sqlite $(PY) -m pytest -n $(SQLITE_WORKERS) $(DIST) $(PYTEST_ARGS) tests/django_app tests/example_project/test_shop.py \
		tests/celery_guardrails/stores $(KIT_ON_SQLITE) $(SQLITE_SKIPS) -k "not redis or django_app or example_project"

# The compatibility matrix (noxfile.py): the smoke subset on every combination, then the table of
# docs/compatibility.md.
matrix: $(INSTALLED) services
	$(VENV)/bin/nox -f noxfile.py -s smoke table

# The oldest and the newest combinations, one after the other (make test runs them beside the two passes: 240 s
# in CI, well within the PostgreSQL pass; two at once would add two more test processes to the eight).
matrix-edges: $(INSTALLED)
	$(VENV)/bin/nox -f noxfile.py -s "smoke(oldest)" "smoke(newest)"

# A flake hunt: the whole suite RUNS times in a row (default 5) with LOAD busy loops alongside (default one per
# core); lists every test that failed at least once, its output kept in test-artifacts/flaky/.
RUNS ?= 5
LOAD ?= $(shell nproc 2>/dev/null || echo 2)
flaky: $(INSTALLED) services
	$(PY) scripts/flaky.py --runs $(RUNS) --load $(LOAD)

clean:
	rm -rf $(VENV) build dist site *.egg-info example_project/var

# What the guardrails cost: ratios against plain Celery in the same run (Redis and PostgreSQL on 127.0.0.1),
# then the Django app at scale (1,000,000 dead letters on PostgreSQL; SCALE_ROWS=... for a smaller run).
bench: $(INSTALLED) services
	$(PY) bench/bench.py
	$(PY) bench/scale.py

# The chaos soak: JOBS logical jobs (default 10000) per store while workers are SIGKILLed every 20 s, the
# broker's Redis and PostgreSQL restarted once, the store cut for 10 s; exits non-zero on a loss, a doubled
# effect with the Django store, a misfiled dead letter, a key left claimed or a duplicate added by replay.
# SOAK_ARGS: more arguments (e.g. --broker both for the RabbitMQ variant too; --queue-type quorum --exchange both
# for RabbitMQ quorum queues on a topic and a direct exchange; --help lists them).
JOBS ?= 10000
SOAK_ARGS ?=
soak: $(INSTALLED) services
	$(PY) -m soak.run --jobs $(JOBS) $(SOAK_ARGS)
