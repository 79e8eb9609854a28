"""edgespec: speculative decoding for CPUs and phones.

Train draft heads (`edgespec.training.train`), export them (`edgespec.exporters`), run draft-and-verify
(`edgespec.runtime`) and measure it (`edgespec.measure.bench`). Importing this package pulls in neither
torch nor transformers.
"""

from edgespec.errors import EdgespecError
from edgespec.llama_lib import select_at_import

# before anything imports llama_cpp: its batch-invariant build where EDGESPEC_LLAMA_LIB asks for it
select_at_import()

__version__ = "0.1.0"
__all__ = ["EdgespecError", "__version__"]
