# The README's two commands. Both create .venv if needed and install what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgespec-installed
# llama-cpp-python compiles llama.cpp; pip caches the built wheel for the next run.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# llama.cpp's AMX kernels (compiled in by -march=native on Intel Xeons that have AMX) crash in
# their matrix multiply on this llama.cpp (a known, unfixed llama.cpp bug): every llama.cpp
# build here leaves them out. The same flags as edgespec/llama_lib.py's CPU_FLAGS (a test checks).
# CMAKE_ARGS given by the caller come after them (their own compiler flags win).
LLAMA_CPU_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CMAKE_ARGS := -DCMAKE_C_FLAGS='$(LLAMA_CPU_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPU_FLAGS)' $(CMAKE_ARGS)

.PHONY: setup demo test test-fast llama-lib llama-tools browser speculators optimum clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[train,smollm2,serve,dev,plot]'
	touch $(STAMP)

# llama.cpp built once more, with the flags that make small batches give one-token numbers
# (bit-exact speculative greedy decoding; edgespec/llama_lib.py), into edgespec's cache. Opt-in:
# `make test` builds it (the suite runs on it); the demo does not use it.
llama-lib: $(STAMP)
	$(BIN)/edgespec build-llama-lib >/dev/null

setup: $(STAMP)

demo: setup
	$(BIN)/edgespec generate --target gemma3-270m --draft default --compare --max-tokens 96 \
	  --prompt "The history of the Roman Empire"

# Stock llama.cpp's llama-server, llama-speculative-simple and llama-bench, built once from the
# llama.cpp that llama-cpp-python vendors, into edgespec's cache (the peer in `bench --peers`).
llama-tools: setup
	scripts/build_llama_tools.sh $(BIN)/python

# vLLM's `speculators` library (the format `edgespec export speculators` writes), in a venv of
# its own: its pins (transformers <= 5.19) differ from edgespec's. Its torchvision/torchaudio
# wheels do not load with this CPU torch and nothing here needs them: removed.
SPEC_VENV := .venv-speculators
$(SPEC_VENV)/.installed:
	$(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SPEC_VENV)/bin/python -m pip install --quiet "speculators==0.9.0" "torch==2.13.0"
	$(SPEC_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio
	touch $@

speculators: $(SPEC_VENV)/.installed

# optimum-onnx (Hugging Face's ONNX exporter), in a venv of its own: it pins transformers < 4.58,
# edgespec's venv has transformers 5. Only for scripts/optimum_compare.py's comparison of its
# Gemma 3 export with edgespec's ONNX target (docs/export.md); torch pinned to the CPU build.
OPT_VENV := .venv-optimum
$(OPT_VENV)/.installed:
	$(PYTHON) -m venv $(OPT_VENV)
	$(OPT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OPT_VENV)/bin/python -m pip install --quiet "optimum-onnx[onnxruntime]==0.1.0" "torch==2.13.0"
	touch $@

optimum: $(OPT_VENV)/.installed

# Headless Chromium for the chat page's browser test (Debian's `chromium`), from the system's
# package manager where this user may use it; without it that one test is skipped, saying so.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "chromium could not be installed: the chat page's browser test will be skipped"

# Everything: unit tests and the integration tests on the real Gemma 3 270M and SmolLM2, and the
# tests that run the stock llama.cpp tools (built first, once).
test: llama-lib llama-tools browser speculators
	EDGESPEC_LLAMA_LIB=invariant EDGESPEC_LLAMA_TOOLS="$$(scripts/build_llama_tools.sh $(BIN)/python)" \
	  EDGESPEC_SPECULATORS_PYTHON="$(CURDIR)/$(SPEC_VENV)/bin/python" $(BIN)/python -m pytest tests

# The everyday tier: mock targets, tiny GGUF files and tiny heads only (well under 2 minutes).
test-fast: setup
	$(BIN)/python -m pytest tests -m "not integration"

clean:
	rm -rf $(VENV) $(SPEC_VENV) $(OPT_VENV) build *.egg-info
