import os
import tempfile

os.environ.setdefault("EDGESPEC_NO_PROGRESS", "1")
# With EDGESPEC_LLAMA_LIB=invariant (make test), importing edgespec loads llama.cpp's batch-
# invariant build from the user's cache, where `make setup` built it (read, never written),
# before the cache moves to the test folder below.
import edgespec  # noqa: E402,F401
# Tests never write to the user's caches: every cache entry (the assembled Gemma file, low-rank
# heads, verify-cost curves) goes to a folder of this test session.
os.environ["EDGESPEC_CACHE"] = tempfile.mkdtemp(prefix="edgespec-test-cache-")

import atexit  # noqa: E402
import shutil  # noqa: E402

atexit.register(shutil.rmtree, os.environ["EDGESPEC_CACHE"], True)
