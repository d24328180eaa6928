# Fulcrum: every target sets up .venv on first use, so `make run` and `make test` are the
# only two commands a fresh machine needs. `make run` installs what running needs (the
# package and its runtime dependencies); `make test` and `make lint` add the dev extra.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard proto/fulcrum/v1/*.proto)
# One image tag for `make docker` and deploy/kubernetes (kustomization.yaml `images:`);
# tests/deploy/test_image.py checks they agree with the package version.
IMAGE  := fulcrum:0.1.0
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: run test lint proto bench bench-quick docker check-proto clean venv configref

venv: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
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

configref: $(STAMP)
	$(BIN)/python -m fulcrum.tools.configref --write docs/configuration.md

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out BENCHMARKS.md

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run.py --quick --out /tmp/BENCHMARKS.quick.md

docker:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
