#!/usr/bin/env bash
# The long fuzz run of every reader of untrusted bytes (`make test` runs a short one):
#   scripts/fuzz.sh [EXAMPLES]      default 5000 per reader
# A crash it finds becomes a named case in tests/test_fuzz.py.
set -euo pipefail
cd "$(dirname "$0")/.."
EDGESPEC_FUZZ_EXAMPLES=${1:-5000} .venv/bin/python -m pytest tests/test_fuzz.py -q -p no:cacheprovider
