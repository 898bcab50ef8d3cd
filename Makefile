# heliotrope: `make demo` runs the broker on its embedded default; `make test` runs the whole suite.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "heliotrope needs Python 3.11 ($(PYTHON) not found; set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/heliotrope demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	bash scripts/bench-deps
	$(BIN)/python bench/submit_throughput.py
	$(BIN)/python bench/decisions.py

clean:
	rm -rf $(VENV) var .pytest_cache
