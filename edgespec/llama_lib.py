"""Which libllama llama-cpp-python loads: the batch-invariant build edgespec makes, or the stock one.

llama.cpp's CPU kernels change with the number of tokens in a batch (repacked quantized weights
and llamafile's sgemm take over for bigger batches), so a speculative pass over k + 1 tokens can
give other logits than k + 1 one-token decodes, and greedy text then drifts after a near-tie.
Built from the same vendored source with `INVARIANT_FLAGS`, the kernels are the same for small
batches: the engine checks, once per library and model, up to how many tokens one decode gives
bit-identical logits (`LlamaTarget.invariant_batch`), and greedy decoding with the full LM head
then verifies at most that many rows per pass, which makes its text equal plain decoding's.

`edgespec build-llama-lib` (run by `make llama-lib` and `make test`) builds that library with pip from the
llama-cpp-python sdist of the installed version into the cache (`llama-lib/<version>-invariant`).
It is opt-in: with `EDGESPEC_LLAMA_LIB=invariant`, importing edgespec points llama-cpp-python at
it (its `LLAMA_CPP_LIB_PATH`) before llama_cpp loads, and fails where it was not built. Without
the repacked kernels the transformer trunk's small batches run slower, which the low-rank LM
head's passes (never exact anyway) feel most (results/llama-lib-cost-*.json), so the stock
library stays the default. A folder holding the build carries `MARKER`, so anyone can tell which
library a process runs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from edgespec.cache import built_folder, cache_root
from edgespec.errors import EdgespecError

INVARIANT_FLAGS = ("-DGGML_CPU_REPACK=OFF", "-DGGML_LLAMAFILE=OFF")
# Every llama.cpp build edgespec makes (the binding in `make setup`, this library, the stock
# tools) leaves out llama.cpp's AMX kernels: -march=native compiles them in on Intel Xeons with
# AMX, and their matrix multiply crashes on this llama.cpp in the first batch of two or more
# tokens (a known llama.cpp bug). The Makefile and scripts/build_llama_tools.sh use the same.
CPU_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cpu_cmake_args() -> tuple[str, str]:
    """CMake arguments that compile llama.cpp with `CPU_FLAGS`."""
    return (f"-DCMAKE_C_FLAGS={CPU_FLAGS}", f"-DCMAKE_CXX_FLAGS={CPU_FLAGS}")
KIND = "llama-lib"
MARKER = "edgespec-invariant-build.txt"
SELECT_ERROR: str | None = None  # why `select` at import failed (raised where llama.cpp loads)


def binding_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def invariant_lib_dir(version: str | None = None) -> Path:
    return cache_root() / KIND / f"{version or binding_version()}-invariant"


def _has_lib(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (any(folder.glob("libllama.*"))
                                             or any(folder.glob("llama.dll")))


def select() -> str:
    """With EDGESPEC_LLAMA_LIB=invariant, point llama-cpp-python at the invariant build before
    it loads a library (see the module doc). Returns what was chosen: "invariant", "stock", or
    "preset" (llama_cpp was already imported, or LLAMA_CPP_LIB_PATH was set by the user)."""
    choice = os.environ.get("EDGESPEC_LLAMA_LIB", "stock").strip().lower() or "stock"
    if choice not in ("stock", "invariant"):
        raise EdgespecError(f"EDGESPEC_LLAMA_LIB={choice}: choose stock (default) or invariant")
    if choice == "stock":
        return "stock"
    folder = invariant_lib_dir()
    preset = os.environ.get("LLAMA_CPP_LIB_PATH")
    if "llama_cpp" in sys.modules or preset:
        if preset and (Path(preset) / MARKER).is_file():  # an invariant build (a parent chose it)
            return "invariant"
        raise EdgespecError("EDGESPEC_LLAMA_LIB=invariant: llama_cpp was imported (or "
                            "LLAMA_CPP_LIB_PATH set) before edgespec; import edgespec first")
    if not _has_lib(folder):
        raise EdgespecError(f"EDGESPEC_LLAMA_LIB=invariant but {folder} holds no library; "
                            "run: edgespec build-llama-lib")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(folder)
    return "invariant"


def select_at_import() -> None:
    """`select`, keeping its error for the engine to raise (importing edgespec never fails)."""
    global SELECT_ERROR
    try:
        select()
    except EdgespecError as e:
        SELECT_ERROR = str(e)


def loaded_lib_dir() -> Path:
    """The folder the imported llama_cpp took its libllama from."""
    from llama_cpp import llama_cpp as binding

    return Path(binding._base_path).resolve()


def loaded_is_invariant() -> bool:
    """Whether this process's llama.cpp is an invariant build (it carries `MARKER`)."""
    return (loaded_lib_dir() / MARKER).is_file()


def build(python: str = sys.executable, log=print) -> Path:
    """The invariant libllama (and its ggml libraries) for the installed llama-cpp-python,
    built once into the cache: pip builds a wheel from the sdist with `INVARIANT_FLAGS`
    (multimodal library off), and its `llama_cpp/lib` folder is kept."""
    version = binding_version()
    if version is None:
        raise EdgespecError("llama-cpp-python is not installed; run: pip install edgespec")

    def make(dest: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="edgespec-llama-lib.") as work:
            args = (*INVARIANT_FLAGS, "-DLLAVA_BUILD=OFF", *(shlex.quote(a) for a in cpu_cmake_args()))
            env = dict(os.environ, CMAKE_ARGS=" ".join(args))
            env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
            cmd = [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-cache-dir",
                   "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}", "-w", work]
            log(f"building llama.cpp {version} with {' '.join(INVARIANT_FLAGS)} (several minutes)")
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
                raise EdgespecError(f"building llama-cpp-python {version} failed: {tail}")
            wheels = list(Path(work).glob("llama_cpp_python-*.whl"))
            if not wheels:
                raise EdgespecError("pip built no llama-cpp-python wheel")
            with zipfile.ZipFile(wheels[0]) as z:
                for name in z.namelist():
                    if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
                        out = dest / Path(name).name
                        out.write_bytes(z.read(name))
                        out.chmod(0o755)
            (dest / MARKER).write_text(f"llama-cpp-python {version} built with "
                                       f"{' '.join(INVARIANT_FLAGS)}, compiler flags {CPU_FLAGS}\n")
            if not _has_lib(dest):
                raise EdgespecError("the built wheel holds no libllama")

    return built_folder(KIND, f"{version}-invariant", make, keep=2, log=log)
