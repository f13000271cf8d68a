# The two README commands: `make demo` and `make test` (each sets up .venv first).
# `make test` = `make lint test-torch2.13 test-torch2.14`: ruff and mypy once, the whole suite on torch 2.13
# (.venv), then the core tests on torch 2.14 (.venv-torch2.14).
PY := .venv/bin/python
PY214 := .venv-torch2.14/bin/python
# Two pytest-xdist workers for this 2-core machine (tests/conftest.py gives each worker cores/workers torch
# threads); loadgroup keeps the tests conftest.py groups together (one launch port, shared expensive fixtures).
PYTEST := -m pytest -q -n 2 --dist loadgroup
# The core tests, also run on torch 2.14: capture, planning, the runtime and the integrations end to end on real
# models, the fast files among them.  The one list of them.
CORE_TESTS := tests/test_api.py tests/test_programs_table.py tests/test_session.py tests/test_model_families.py \
	tests/test_memory.py tests/test_lightning.py tests/test_accelerate_hook.py tests/test_ddp.py tests/test_layers.py

.venv/ready: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.venv-torch2.14/ready: pyproject.toml
	python3 -m venv .venv-torch2.14
	$(PY214) -m pip install -q --upgrade pip
	$(PY214) -m pip install -q torch==2.14.1
	$(PY214) -m pip install -q -e ".[test]"
	touch $@

demo: .venv/ready
	$(PY) examples/plain_pytorch.py

lint: .venv/ready
	$(PY) -m ruff check remat_plugin integrations
	$(PY) -m mypy remat_plugin integrations

test-torch2.13: .venv/ready
	$(PY) $(PYTEST)

test-torch2.14: .venv-torch2.14/ready
	$(PY214) $(PYTEST) $(CORE_TESTS)

test: lint test-torch2.13 test-torch2.14

.PHONY: demo lint test test-torch2.13 test-torch2.14
