# Fulcrum: every target sets up .venv on first use, so `make run` and `make test` are the
# only two commands a fresh machine needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard proto/fulcrum/v1/*.proto)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: run test lint proto bench bench-quick docker check-proto clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fulcrum serve $(ARGS)

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src
	$(BIN)/buf lint proto
	$(BIN)/hadolint Dockerfile
	$(BIN)/python -m fulcrum.tools.genproto --check

proto: $(STAMP)
	$(BIN)/python -m fulcrum.tools.genproto

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out BENCHMARKS.md

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run.py --quick --out /tmp/BENCHMARKS.quick.md

docker:
	docker build -t fulcrum:dev .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
