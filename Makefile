# The two commands of the README: `make demo` and `make test`. Everything installs into .venv from
# setup.cfg; nothing is installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: demo test services lint check bench clean

$(INSTALLED): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(INSTALLED)

demo: $(INSTALLED)
	$(PY) example_project/demo.py

services:
	bash scripts/services.sh
	bash scripts/browser.sh

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The whole suite: lint, then everything on PostgreSQL, then what uses the database again on SQLite.
test: $(INSTALLED) services lint
	GUARDRAILS_TEST_DB=postgres $(PY) -m pytest
	GUARDRAILS_TEST_DB=sqlite $(PY) -m pytest tests/django_app tests/example_project/test_shop.py tests/celery_guardrails/stores

clean:
	rm -rf $(VENV) build dist *.egg-info example_project/var

# What the guardrails cost: ratios against plain Celery in the same run (needs Redis on 127.0.0.1:6379).
bench: $(INSTALLED)
	$(PY) bench/bench.py
