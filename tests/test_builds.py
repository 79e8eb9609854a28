"""The llama.cpp builds edgespec makes (the binding, the invariant library, the stock tools)
all leave out llama.cpp's AMX kernels, which crash on this llama.cpp (edgespec/llama_lib.py)."""

import re
from pathlib import Path

import pytest

from edgespec import llama_lib

ROOT = Path(__file__).resolve().parents[1]


def test_every_build_uses_the_same_cpu_flags():
    make = (ROOT / "Makefile").read_text()
    flags = re.search(r"^LLAMA_CPU_FLAGS := (.*)$", make, re.M)
    assert flags and flags.group(1).strip() == llama_lib.CPU_FLAGS
    assert "CMAKE_C_FLAGS='$(LLAMA_CPU_FLAGS)'" in make and "CMAKE_CXX_FLAGS='$(LLAMA_CPU_FLAGS)'" in make
    tools = (ROOT / "scripts" / "build_llama_tools.sh").read_text()
    assert "from edgespec.llama_lib import CPU_FLAGS" in tools
    assert '-DCMAKE_C_FLAGS="$CPU_FLAGS"' in tools and '-DCMAKE_CXX_FLAGS="$CPU_FLAGS"' in tools
    assert all(f.startswith("-mno-amx") for f in llama_lib.CPU_FLAGS.split())
    assert llama_lib.cpu_cmake_args() == (f"-DCMAKE_C_FLAGS={llama_lib.CPU_FLAGS}",
                                          f"-DCMAKE_CXX_FLAGS={llama_lib.CPU_FLAGS}")


@pytest.mark.integration
def test_the_loaded_llama_cpp_has_no_amx_kernels():
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "CPU" in info, info  # the feature list is there to read
    assert not re.search(r"AMX_\w+ = 1", info), info
