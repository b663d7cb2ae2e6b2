# Everything runs from the project's own virtual environment in .venv/.
# The Megatron-core adapter's tests need megatron-core 0.19, which needs Python 3.12: use a
# 3.12 interpreter when the machine has one (pyenv's included), else python3 (>= 3.11).
PYTHON ?= $(firstword $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 python3; do \
	$$p -c 'import sys' >/dev/null 2>&1 && echo $$p; done))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The kustomize the manifests' tests render deploy/k8s with (tests/test_deploy.py): the
# one kubectl 1.32 embeds, built from the Go module proxy into .venv/bin (~35 s, once).
KUSTOMIZE_VERSION := v5.5.0
KUSTOMIZE := $(BIN)/kustomize

.PHONY: install bytecode chromium kustomize demo test test-fast lint bench clean

install: $(STAMP) chromium kustomize

# The HTML report is checked in a real headless Chromium: Debian's package, installed here
# when missing (CI and the dev machines run as root; elsewhere install it yourself).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "chromium is missing: install Debian's chromium package (apt-get install chromium)" >&2; exit 1; fi; }

kustomize: $(VENV)/.kustomize-$(KUSTOMIZE_VERSION)

$(VENV)/.kustomize-$(KUSTOMIZE_VERSION): | $(STAMP)
	@command -v go >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go >/dev/null; \
		else echo "go is missing: install Debian's golang-go package to build kustomize" >&2; exit 1; fi; }
	GOBIN=$(abspath $(BIN)) GOFLAGS=-mod=mod go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)
	touch $@

# Re-installs only when the project's declared dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(MAKE) --no-print-directory bytecode
	touch $(STAMP)

# An editable install leaves the sources uncompiled, and with PYTHONDONTWRITEBYTECODE set
# (common in containers and CI) every command would compile its modules again at each
# start: compile them once, as pip does for a regular install. Stale files are recompiled
# on import as usual.
bytecode:
	@$(BIN)/python -m compileall -q lagscope producers simulator stream_app store dashboards deploy >/dev/null

# The main job: a generated 128-GPU job with stragglers through timers, logs, the embedded
# pipeline and chDB, ending in a summary and out/demo/report.html.
demo: install
	$(BIN)/lagscope demo --out out/demo

# ruff, and the folders' import contracts (.importlinter) checked by import-linter.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m tests.import_layers

# The whole suite; the 20 slowest tests' durations at the end, so a test that grows slow
# is seen (and marked `slow` when it belongs out of the edit loop). Most of a test's time
# is spent waiting on its processes (a broker, workers, a torch job), so two pytest
# processes share the 2 cores (pytest-xdist; whole files each, so a module's shared job
# runs once); the tests marked `alone`, which timing decides (a live run's latencies, a
# planted straggler in a real job), run by themselves afterwards.
test: install lint
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not alone" --durations=20
	$(BIN)/python -m pytest -m alone --durations=10

# The edit loop: everything but the tests marked `slow` (a real Kafka broker, real torch
# jobs, live runs, a browser, the demo end to end): a few minutes on a 2-core machine.
# `make test` (and CI) still runs them all.
test-fast: install lint
	$(BIN)/python -m pytest -m "not slow" --durations=10

# The benchmarks (tests/bench/*_bench.py) as a table and bench-results/bench.json; the
# dated measurements behind the sizing rules of deploy/README.md are in tests/bench/NOTES.md.
bench: install bytecode
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) out .pytest_cache
