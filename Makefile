# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REFERENCE_TRACES ?= ../shared/reference-traces

.PHONY: install demo test lint bench clean

install: $(STAMP)

# Re-installs only when the project's declared dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The main job: a generated 128-GPU job with stragglers through timers, logs, the embedded
# pipeline and chDB, ending in a summary and out/demo/report.html.
demo: install
	$(BIN)/lagscope demo --out out/demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) out .pytest_cache
