"""edgespec: speculative decoding for CPUs and phones.

Train draft heads (`edgespec.training.train`), export them (`edgespec.exporters`), run draft-and-verify
(`edgespec.runtime`) and measure it (`edgespec.measure.bench`). Importing this package pulls in neither
torch nor transformers.
"""

import os
import sys

from edgespec.errors import EdgespecError
from edgespec.llama_lib import select_at_import

# before anything imports llama_cpp: its batch-invariant build where EDGESPEC_LLAMA_LIB asks for it
select_at_import()
# llama.cpp's OpenMP threads spin ~300,000 rounds after each decode (libgomp's default), which
# takes the cores from the onnxruntime LM heads that run right after it (runtime/batched_head.py):
# measured on Gemma 3 270M, a 1-row verify 10.9 -> 9.2 ms with 10,000, plain llama.cpp decoding
# unchanged. Read when libgomp loads: an app that imported llama_cpp first keeps its own.
# How llama.cpp's OpenMP threads were set up: "edgespec" (libgomp loads after this, with the
# spin count above, or the caller's own) or "preloaded" (llama_cpp came first: libgomp read its
# environment then); the caller's GOMP_SPINCOUNT after the colon. The engine's choice of LM
# head depends on it (runtime/llama_target.py, `_batched_pays_here`).
GOMP_AT_IMPORT = (("preloaded" if "llama_cpp" in sys.modules else "edgespec") + ":"
                  + os.environ.get("GOMP_SPINCOUNT", ""))
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
__all__ = ["EdgespecError", "__version__"]
