PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv run test test-fast bench clean

$(BIN)/fairgate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

venv: $(BIN)/fairgate

run: venv
	$(BIN)/fairgate serve

test: venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

bench: venv
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache fairgate.db
