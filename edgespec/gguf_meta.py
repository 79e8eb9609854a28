"""A fast, validating reader for a GGUF file's header: metadata and tensor table.

`gguf.GGUFReader` builds a Python object per array element, which takes tens of seconds on a
262k-token vocabulary; this reader keeps string arrays as raw byte spans (decoded on demand) and
checks that every tensor's data lies inside the file, so a truncated download is caught up front.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from edgespec.errors import EdgespecError

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class StringArray:
    """A GGUF array of strings kept as its raw bytes; `raw` is what the fingerprint hashes."""

    raw: bytes
    offsets: np.ndarray  # start of each string's bytes inside raw
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> str:
        o = int(self.offsets[i])
        return self.raw[o:o + int(self.lengths[i])].decode("utf-8", errors="replace")


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_name: str
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    data_offset: int
    value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # (type, item type)


MAX_COUNT = 1 << 32  # no GGUF header holds an array or string this long


def printable(text: str, limit: int = 60) -> str:
    """A name read from a file, safe for a one-line message."""
    out = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return out + ("..." if len(text) > limit else "")
MAX_DEPTH = 4  # arrays of arrays nest this deep at most


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def corrupt(self, what: str) -> EdgespecError:
        return EdgespecError(f"{self.path}: corrupt GGUF header ({printable(what, 160)} at byte "
                             f"{self.pos}); download or export it again")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise EdgespecError(f"{self.path}: GGUF file is truncated (header ends early); "
                                "download or export it again")
        out = self.buf[self.pos:self.pos + n]  # a copy: no view outlives the mmap
        self.pos += n
        return out

    def count(self, min_item_bytes: int) -> int:
        """A u64 count of items of at least `min_item_bytes` each, bounded by what the file can
        hold: an impossible count is corruption, one that runs past the end truncation."""
        n = self.scalar(10)
        if n > MAX_COUNT:
            raise self.corrupt(f"impossible count {n}")
        if self.pos + n * min_item_bytes > len(self.buf):
            self.take(len(self.buf) + 1)  # raises the truncation error
        return n

    def scalar(self, t: int):
        fmt = _SCALAR[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.count(1)).decode("utf-8", errors="replace")

    def value(self, t: int, depth: int = 0):
        if t in _SCALAR:
            return self.scalar(t)
        if t == _STRING:
            return self.string()
        if t == _ARRAY:
            if depth >= MAX_DEPTH:
                raise self.corrupt("arrays nested too deep")
            et = self.scalar(4)
            if et in _NUMPY:
                dt = np.dtype(_NUMPY[et])
                return np.frombuffer(self.take(self.count(dt.itemsize) * dt.itemsize), dtype=dt)
            if et == _STRING:
                return self._string_array(self.count(8))
            if et == _ARRAY:
                return [self.value(et, depth + 1) for _ in range(self.count(12))]
            raise self.corrupt(f"unknown GGUF array item type {et}")
        raise self.corrupt(f"unknown GGUF value type {t}")

    def _string_array(self, count: int) -> StringArray:
        start = self.pos
        offsets = np.empty(count, dtype=np.int64)
        lengths = np.empty(count, dtype=np.int64)
        unpack = struct.Struct("<Q").unpack_from
        buf, pos, end = self.buf, self.pos, len(self.buf)
        for i in range(count):
            if pos + 8 > end:
                self.take(end)  # raises the truncation error
            (n,) = unpack(buf, pos)
            if n > MAX_COUNT:
                self.pos = pos
                raise self.corrupt(f"impossible string length {n}")
            offsets[i], lengths[i] = pos + 8 - start, n
            pos += 8 + n
        self.pos = start
        raw = self.take(pos - start)
        return StringArray(raw, offsets, lengths)


def read_header(path: str | Path) -> GGUFHeader:
    """Parse metadata and the tensor table; raise EdgespecError on a missing, foreign or cut file."""
    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"{path}: no such file; give a .gguf path or a known target name")
    size = path.stat().st_size
    if size < 24:
        raise EdgespecError(f"{path}: not a GGUF file (too small)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf, path)
        if cur.take(4) != b"GGUF":
            raise EdgespecError(f"{path}: not a GGUF file (bad magic bytes)")
        version = cur.scalar(4)
        if version not in (2, 3):
            raise EdgespecError(f"{path}: unsupported GGUF version {version} (need 2 or 3)")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise cur.corrupt(f"implausible counts ({n_tensors} tensors, {n_kv} keys)")
        metadata, value_types = {}, {}
        for _ in range(n_kv):
            key = cur.string()
            vt = cur.scalar(4)
            item = None
            if vt == _ARRAY and cur.pos + 4 <= len(cur.buf):  # peek at the item type
                item = struct.unpack_from("<I", cur.buf, cur.pos)[0]
            metadata[key] = cur.value(vt)
            value_types[key] = (vt, item)
        raw_tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(4)
            if not 1 <= n_dims <= 4:  # ggml tensors have 1 to 4 dimensions
                raise cur.corrupt(f"tensor {name} with {n_dims} dimensions")
            shape = tuple(cur.scalar(10) for _ in range(n_dims))
            if min(shape) < 1 or int(np.prod(shape, dtype=object)) > 1 << 48:
                raise cur.corrupt(f"tensor {name} with shape {shape}")
            raw_tensors.append((name, shape, cur.scalar(4), cur.scalar(10)))
        align = metadata.get("general.alignment", 32)
        if not isinstance(align, (int, np.integer)) or align < 1 or align & (align - 1):
            raise cur.corrupt(f"alignment {align}")
        align = int(align)
        data_offset = (cur.pos + align - 1) // align * align
        tensors = {}
        for name, shape, t, off in raw_tensors:
            try:
                qt = GGMLQuantizationType(t)
            except ValueError:
                raise EdgespecError(f"{path}: tensor {printable(name)} has unknown type {t}") from None
            block, type_size = GGML_QUANT_SIZES[qt]
            if shape[0] % block:
                raise EdgespecError(f"{path}: corrupt GGUF file (tensor {printable(name)} rows of {shape[0]} "
                                    f"values do not fill {qt.name} blocks of {block})")
            nbytes = int(np.prod(shape, dtype=object)) // block * type_size
            info = TensorInfo(name, shape, qt.name, data_offset + off, nbytes)
            if info.offset + nbytes > size:
                raise EdgespecError(f"{path}: GGUF file is truncated (tensor {printable(name)} runs past the "
                                    f"end, {size} bytes); download or export it again")
            tensors[name] = info
        return GGUFHeader(path, version, metadata, tensors, data_offset, value_types)
    finally:
        buf.close()


class TensorRows:
    """Row access to a 2-D GGUF tensor, memory-mapped and dequantized on demand (numpy)."""

    def __init__(self, header: GGUFHeader, name: str):
        if name not in header.tensors:
            raise EdgespecError(f"{header.path}: no tensor {printable(name)}")
        from gguf.quants import dequantize

        self._dequantize = dequantize
        info = header.tensors[name]
        self.qtype = GGMLQuantizationType[info.type_name]
        self.n_cols, self.n_rows = info.shape[0], int(np.prod(info.shape[1:]))
        raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset,
                        shape=(info.nbytes,))
        self._raw = raw.reshape(self.n_rows, -1)

    def __getitem__(self, rows) -> np.ndarray:
        """rows: int array or slice -> float32 [n, n_cols]."""
        out = self._dequantize(np.asarray(self._raw[rows]), self.qtype).astype(np.float32, copy=False)
        return out if out.flags.writeable else out.copy()  # F32 rows are views of the file

    def dot_rows(self, rows: np.ndarray, x: np.ndarray, q8_x: bool = False) -> np.ndarray:
        """rows [T, m] int, x [T, n_cols] -> [T, m]: row rows[t, j] of the tensor dotted with x[t],
        from the stored values (Q8_0 blocks are read in place, other types dequantized).
        q8_x: on Q8_0 rows, first round x to Q8_0 blocks as llama.cpp's CPU kernels do (the
        logits then match llama.cpp's to float rounding, near-ties included)."""
        rows = np.asarray(rows)
        t, m = rows.shape
        x = np.asarray(x, dtype=np.float32)
        if self.qtype == GGMLQuantizationType.Q8_0:  # 32 values a block: f16 scale + 32 x int8
            blocks = self._raw[rows.ravel()].reshape(t, m, -1, 34)
            scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
            q = blocks[..., 2:].view(np.int8).astype(np.float32)
            xb = x.reshape(t, -1, 32)
            if q8_x:
                d = np.abs(xb).max(-1) / 127
                inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
                xb = np.rint(xb * inv[..., None])  # the integers llama.cpp multiplies
                scale = scale * d.astype(np.float16).astype(np.float32)[:, None, :]
            return (np.einsum("tmbk,tbk->tmb", q, xb) * scale).sum(-1)
        w = self[rows.ravel()].reshape(t, m, self.n_cols)
        return np.einsum("tmk,tk->tm", w, x)
