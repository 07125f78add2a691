# Two commands a fresh machine needs: `make run` (install + default training), `make test` (install + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench-op bench-step clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/neorec train $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check neorec tests
	$(BIN)/ruff format --check neorec tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info
