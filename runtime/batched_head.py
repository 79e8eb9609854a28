"""The target's own LM head, every row of a verify pass in one onnxruntime call.

llama.cpp's CPU kernels compute a Q8_0 LM head well for one row (a matrix-vector product, bound
by reading the matrix) but badly for several: on Gemma 3 270M (262,144 x 640) one row costs
~5.5 ms and each further row ~7 ms more (`scripts/verify_cost.py`), so checking 4 drafted tokens
pays more for the LM head than for the whole transformer. onnxruntime's `MatMulNBits` (8-bit or
4-bit blocks of 32, int8 activations at accuracy level 4) reads the matrix once for all rows:
~3 ms for one row, ~5.5 ms for four.

The blocks are llama.cpp's own, re-laid: a Q8_0 block (f16 scale d, 32 x int8 q) is d * (u - 128)
with u = q + 128; a Q4_0 block d * (u - 8). Each activation row is rounded to Q8_0 blocks as
llama.cpp rounds it (its block scale kept in f16, which onnxruntime would keep in f32: the row
is pre-scaled so that onnxruntime's integers and scale are llama.cpp's), so the logits are the
ones llama.cpp computes to float rounding (sums in another order; measured ~1e-5).

The re-laid weights are derived from the target file once and kept in edgespec's cache
(edgespec/cache.py, keyed by the file's content): ~190 MB for Gemma 3 270M.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from edgespec.cache import built_folder, file_identity
from edgespec.errors import EdgespecError
from edgespec.gguf_meta import GGMLQuantizationType, TensorRows, read_header

# GGUF block type -> (bits, bytes per block, zero point): 32 values a block, f16 scale first
LAYOUTS = {GGMLQuantizationType.Q8_0: (8, 34, 128), GGMLQuantizationType.Q4_0: (4, 18, 8)}
BLOCK = 32
CHUNK = 16384  # LM-head rows per step while re-laying the blocks


def supports(spec) -> bool:
    """Whether the target's LM head has a block type this head computes as llama.cpp does."""
    return GGMLQuantizationType.__members__.get(spec.lm_head_type) in LAYOUTS


def pays(spec) -> bool:
    """Whether `lm_head="auto"` takes this head: where the target's LM head holds at least half
    of its weight bytes. A small head does not win back what reading the trunk's output and
    running the head in onnxruntime cost a one-row decode, and most passes are one row. Measured
    one-row decodes: SmolLM2-135M (head 31% of the file) 6.7-7.0 ms with it, 6.4-6.9 ms with
    llama.cpp's head; Gemma 3 270M (74%) 9.2 ms against 10.9 ms. With the probe's C gate (no
    Python call per graph node any more) SmolLM2 still loses at one row, 7.0 ms against 6.3, and
    gains only ~1 ms at 2-4 rows, where its Q4_1 trunk costs most of the pass
    (results/verify-cost-smollm2-135m-run2.json)."""
    from edgespec.runtime.lowrank import lm_head_tensor

    if not supports(spec):
        return False
    tensors = read_header(spec.path).tensors
    return 2 * tensors[lm_head_tensor(spec)].nbytes >= sum(t.nbytes for t in tensors.values())


def _relay(raw: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks [n, blocks * bytes] -> MatMulNBits blob [n, blocks, 32 * bits / 8] uint8
    and scales [n, blocks] float32."""
    bits, size, zp = LAYOUTS[qtype]
    b = raw.reshape(raw.shape[0], -1, size)
    scales = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if bits == 8:
        blob = (b[..., 2:].view(np.int8).astype(np.int16) + zp).astype(np.uint8)
    else:  # Q4_0 packs value j in the low nibble of byte j and value j + 16 in its high nibble
        lo, hi = b[..., 2:] & 0x0F, b[..., 2:] >> 4
        vals = np.concatenate([lo, hi], axis=-1)  # values 0..31 in order, 4-bit unsigned
        blob = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)  # MatMulNBits: pairs
    return blob, scales


def _build(folder, spec, rows: TensorRows) -> None:
    from onnx import TensorProto, helper

    bits, _size, _zp = LAYOUTS[rows.qtype]
    n, k = rows.n_rows, rows.n_cols
    with open(folder / "blob.bin", "wb") as fb, open(folder / "scales.bin", "wb") as fs:
        for s in range(0, n, CHUNK):
            blob, scales = _relay(np.asarray(rows._raw[s:s + CHUNK]), rows.qtype)
            fb.write(blob.tobytes())
            fs.write(scales.tobytes())

    def external(name, dtype, dims, file, length):
        t = TensorProto()
        t.name, t.data_type = name, dtype
        t.dims.extend(dims)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", file), ("offset", "0"), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = key, value
        return t

    nb = k // BLOCK
    w = external("w", TensorProto.UINT8, [n, nb, BLOCK * bits // 8], "blob.bin", n * nb * BLOCK * bits // 8)
    sc = external("s", TensorProto.FLOAT, [n * nb], "scales.bin", n * nb * 4)
    node = helper.make_node("MatMulNBits", ["h", "w", "s"], ["logits"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4)
    g = helper.make_graph([node], "edgespec-batched-lm-head",
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["T", k])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", n])],
                          [w, sc])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    (folder / "model.onnx").write_bytes(model.SerializeToString())


def as_llama_rounds(h: np.ndarray) -> np.ndarray:
    """Rows [T, K] pre-scaled per block of 32 by f16(d) / d (d = the block's max |x| / 127), so
    that a quantizer keeping d in f32 gets llama.cpp's integers and its f16 scale."""
    x = np.ascontiguousarray(h, dtype=np.float32).reshape(len(h), -1, BLOCK)
    d = np.abs(x).max(-1) / np.float32(127)
    ratio = np.divide(d.astype(np.float16).astype(np.float32), d, out=np.ones_like(d), where=d > 0)
    return (x * ratio[..., None]).reshape(len(h), -1)


class BatchedHead:
    """logits(h [T, n_embd]) -> [T, n_vocab] float32, the LM head llama.cpp would apply."""

    def __init__(self, spec, n_threads: int = 1, log=None):
        from edgespec.runtime.lowrank import lm_head_tensor
        from edgespec.runtime.onnx_session import open_session

        rows = TensorRows(read_header(spec.path), lm_head_tensor(spec))
        if rows.qtype not in LAYOUTS:
            raise EdgespecError(f"{spec.name}: its LM head is {rows.qtype.name}; the batched LM "
                                "head takes Q8_0 or Q4_0")
        if rows.n_cols % BLOCK:
            raise EdgespecError(f"{spec.name}: n_embd {rows.n_cols} is not a multiple of {BLOCK}")
        self.n_vocab, self.qtype = rows.n_rows, rows.qtype.name
        key = hashlib.sha256(f"{file_identity(spec.path)}|{lm_head_tensor(spec)}|v1".encode()).hexdigest()[:16]
        say = log or (lambda m: print(m, file=sys.stderr))
        self.folder = built_folder("batched-head", key, lambda tmp: _build(tmp, spec, rows),
                                   need_bytes=rows.n_rows * rows.n_cols * 9 // 8,
                                   log=lambda m: say(f"batched LM head for {spec.name}: {m}"))
        # takes turns with llama.cpp on the same cores (see LowRankHead)
        self.sess = open_session(self.folder / "model.onnx", n_threads, spin=False)

    def describe(self) -> str:
        return f"{self.qtype}, every row in one onnxruntime pass"

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.sess.run(["logits"], {"h": as_llama_rounds(hidden)})[0]
