# heliotrope: `make demo` runs the broker on its embedded default; `make test` runs the whole suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "heliotrope needs Python 3.11 or newer; set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/heliotrope demo

test: $(STAMP)
	bash scripts/test-deps
	$(BIN)/python -m pytest

bench: $(STAMP)
	bash scripts/bench-deps
	$(BIN)/python bench/submit_throughput.py
	$(BIN)/python bench/decisions.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/mqtt_telemetry.py
	$(BIN)/python bench/failover.py
	$(BIN)/python bench/simulate.py
	$(BIN)/python bench/green_sensitivity.py
	$(BIN)/python bench/auth.py

clean:
	rm -rf $(VENV) var .pytest_cache
