import os

os.environ.setdefault("EDGESPEC_NO_PROGRESS", "1")
