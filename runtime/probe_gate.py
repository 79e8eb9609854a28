"""A C gate in front of the hidden-state probe (LlamaTarget's eval callback).

llama.cpp asks an installed eval callback about every node of every graph it computes, so a
Python callback costs each decode ~1,000 trips into Python whether or not anything is read
(~0.15 ms a decode on SmolLM2, ~2% of its one-token pass). The gate (probe_gate.c, compiled
once into edgespec's cache with the system C compiler) answers those questions in C while the
engine reads nothing and calls the Python probe only while it reads. Where no compiler is at
hand (or the build fails) `gate_library` returns None and the probe is installed as it is.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("probe_gate.c")
_LIB: ctypes.CDLL | None | bool = False  # False: not looked for yet; None: none to be had


NAMES, NAME_LEN = 8, 64  # as GATE_NAMES and GATE_NAME_LEN in probe_gate.c


class Gate(ctypes.Structure):
    """The gate's state, handed to llama.cpp as the callback's user data (see probe_gate.c)."""

    _fields_ = [("on", ctypes.c_int), ("stop", ctypes.c_int), ("n", ctypes.c_int),
                ("inner", ctypes.c_void_p), ("get_name", ctypes.c_void_p),
                ("names", (ctypes.c_char * NAME_LEN) * NAMES)]

    def set(self, on: bool, stop: bool, names) -> None:
        """Read nothing (on False), or the final norm (stop) and the tensors named."""
        if not on:  # the gate then reads nothing else
            self.on = 0
            return
        names = list(names)
        if len(names) <= NAMES and all(len(n) < NAME_LEN for n in names):
            for i, n in enumerate(names):
                self.names[i].value = n
            self.n = len(names)
        else:  # more than the gate holds: the probe answers every question
            self.n = -1
        self.stop = int(stop)
        self.on = 1  # last: the gate reads the rest only once it is on


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def gate_library() -> ctypes.CDLL | None:
    """The compiled gate (built into the cache the first time), or None where it cannot be."""
    global _LIB
    if _LIB is not False:
        return _LIB
    _LIB = None
    if os.environ.get("EDGESPEC_PROBE_GATE", "1") == "0":  # opt out: the Python probe alone
        return None
    cc = _compiler()
    if cc is None:
        return None
    from edgespec.cache import built_folder
    from edgespec.errors import EdgespecError

    src = SOURCE.read_bytes()
    key = hashlib.sha256(src).hexdigest()[:16]

    def build(tmp: Path) -> None:
        out = tmp / "probe_gate.so"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
                       check=True, capture_output=True, timeout=120)

    try:
        lib = ctypes.CDLL(str(built_folder("probe-gate", key, build) / "probe_gate.so"))
    except (EdgespecError, OSError, subprocess.SubprocessError):
        return None
    lib.edgespec_gate_cb.restype = ctypes.c_bool
    lib.edgespec_gate_cb.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
    _LIB = lib
    return lib
