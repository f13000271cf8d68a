# The two README commands: `make demo` and `make test` (each sets up .venv first).
PY := .venv/bin/python

.venv/ready: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch .venv/ready

demo: .venv/ready
	$(PY) examples/plain_pytorch.py

test: .venv/ready
	$(PY) -m ruff check remat_plugin integrations
	$(PY) -m mypy remat_plugin integrations
	$(PY) -m pytest -q

.PHONY: demo test
