"""A low-rank stand-in for a large LM head: each position's top token for greedy decoding.

Gemma 3 270M's LM head (262,144 x 640, tied to the token embeddings) is half the work of every
position llama.cpp decodes, and verifying k drafted tokens needs k rows of it. Greedy decoding
only reads each row's argmax. With U the top-r principal directions of the target's own final
hidden states (a basis shipped per target, or made with `edgespec export lowrank-basis`),
W h ~ (W U)(U^T h): r x V multiply-adds instead of E x V. The scores (W U) are int8 (one scale:
only their ranking is read) and picked by onnxruntime's integer GEMM + TopK; the C best ids are
then rescored from the GGUF's own LM-head rows as llama.cpp computes them (activations rounded
to Q8_0 blocks, for a Q8_0 head). Where llama.cpp's top token is among the C candidates the
result is its argmax; where it is not, the output differs from llama.cpp's (measured:
`edgespec export lowrank-basis` reports the agreement on prompts it did not calibrate on).

The int8 scores are derived from the target file and the basis once and kept in edgespec's
cache (edgespec/cache.py, keyed by the target file's content), ~67 MB for Gemma 3 270M at rank 256.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from edgespec.cache import built_folder, file_identity

CHUNK = 16384  # LM-head rows per step while building the scores


@dataclass(frozen=True)
class LowRankInfo:
    """What a low-rank LM head is, for reports and cache keys."""

    rank: int
    candidates: int
    rescore: str  # the GGUF tensor whose rows give the candidates' exact logits

    @property
    def key(self) -> str:
        return f"lowrank-r{self.rank}-c{self.candidates}"

    def describe(self, rescored_as: str) -> str:
        return f"greedy: rank-{self.rank} search, {self.candidates} candidates rescored {rescored_as}"


def lm_head_tensor(spec) -> str:
    return "token_embd.weight" if spec.tied_embeddings else "output.weight"


def read_basis(path: str | Path, spec=None) -> np.ndarray:
    """A basis file -> U [n_embd, rank] float32; checks it was made for this target's tokenizer."""
    path = Path(path)
    try:
        with np.load(path) as z:
            basis, fp = z["basis"].astype(np.float32), str(z["target_fingerprint"])
    except Exception as e:  # untrusted bytes: zip, npy and zlib each fail their own way
        raise EdgespecError(f"{path}: not a low-rank basis file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None
    if basis.ndim != 2 or not np.isfinite(basis).all():
        raise EdgespecError(f"{path}: not a low-rank basis file (basis of shape {basis.shape})")
    if spec is not None:
        if fp != spec.tokenizer_fingerprint:
            raise EdgespecError(f"{path} was made for another target than {spec.name}")
        if basis.ndim != 2 or basis.shape[0] != spec.n_embd:
            raise EdgespecError(f"{path}: basis shape {basis.shape} does not fit n_embd={spec.n_embd}")
    return basis


def calibrate_basis(engine, sequences, rank: int, log=print) -> tuple[np.ndarray, int]:
    """Top-`rank` principal directions of the engine's final hidden states over token
    `sequences` (uncentred: the scores must approximate W h itself)."""
    e = engine.n_embd
    cov, seen = np.zeros((e, e), np.float64), 0
    for ids in sequences:
        if len(ids) < 2:
            continue
        engine.reset()
        h = engine.hidden_states(ids).astype(np.float64)
        cov += h.T @ h
        seen += len(ids)
    engine.reset()
    if seen < 4 * rank:
        raise EdgespecError(f"only {seen} calibration tokens for rank {rank}; give more text")
    _, vecs = np.linalg.eigh(cov)
    log(f"low-rank basis: rank {rank} from {seen} calibration tokens")
    return np.ascontiguousarray(vecs[:, ::-1][:, :rank]).astype(np.float32), seen


def _graph(n_embd: int, rank: int, n_vocab: int, candidates: int, basis: np.ndarray):
    """h [T, E] -> candidates [T, C]: TopK of int8 (U^T h) x int8 (W U)^T. Ranking only, so
    the integer scores are compared as they are (one scale each side)."""
    from onnx import TensorProto, helper, numpy_helper

    scores = TensorProto()
    scores.name, scores.data_type = "scores", TensorProto.INT8
    scores.dims.extend([rank, n_vocab])
    scores.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "scores.bin"), ("offset", "0"), ("length", str(rank * n_vocab))):
        entry = scores.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("MatMul", ["h", "basis"], ["a"]),
             helper.make_node("DynamicQuantizeLinear", ["a"], ["a_q", "a_scale", "a_zero"]),
             helper.make_node("MatMulInteger", ["a_q", "scores", "a_zero"], ["s"]),
             helper.make_node("TopK", ["s", "k"], ["top", "candidates"], axis=-1)]
    inits = [numpy_helper.from_array(basis, "basis"),
             numpy_helper.from_array(np.array([candidates], np.int64), "k"), scores]
    g = helper.make_graph(nodes, "edgespec-lowrank-lm-head",
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["T", n_embd])],
                          [helper.make_tensor_value_info("candidates", TensorProto.INT64, ["T", candidates])],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _build(folder: Path, spec, rows: TensorRows, basis: np.ndarray, candidates: int) -> None:
    """Write model.onnx + scores.bin (raw int8 [rank, V]) into `folder`. Two passes over the
    LM head: the int8 scale needs the largest score first. The scores are built in RAM and
    written with ordinary writes (a memory map dies of SIGBUS on a full disk)."""
    rank, v = basis.shape[1], rows.n_rows
    top = 0.0
    for s in range(0, v, CHUNK):
        top = max(top, float(np.abs(rows[s:s + CHUNK] @ basis).max()))
    scale = np.float32(top / 127 if top > 0 else 1.0)
    q = np.empty((rank, v), np.int8)
    for s in range(0, v, CHUNK):
        q[:, s:s + CHUNK] = np.clip(np.rint((rows[s:s + CHUNK] @ basis) / scale), -127, 127).T
    with open(folder / "scores.bin", "wb") as f:
        f.write(q.tobytes())
    (folder / "model.onnx").write_bytes(_graph(spec.n_embd, rank, v, candidates, basis).SerializeToString())


class LowRankHead:
    """Candidates for each hidden state's top token, and their exact logits (see module doc)."""

    def __init__(self, spec, basis: np.ndarray, candidates: int = 128, n_threads: int = 1,
                 log=None):
        from edgespec.runtime.onnx_session import open_session

        self.n_vocab = spec.n_vocab
        tensor = lm_head_tensor(spec)
        self.info = LowRankInfo(basis.shape[1], candidates, tensor)
        self.rows = TensorRows(read_header(spec.path), tensor)
        key = hashlib.sha256(f"{file_identity(spec.path)}|{candidates}|".encode()
                             + basis.tobytes()).hexdigest()[:16]
        say = log or (lambda m: print(m, file=sys.stderr))
        self.folder = built_folder(
            "lowrank", key,
            lambda tmp: _build(tmp, spec, self.rows, basis, candidates),
            need_bytes=basis.shape[1] * spec.n_vocab + basis.nbytes,
            log=lambda m: say(f"low-rank LM head for {spec.name}: {m}"))
        # takes turns with llama.cpp on the same cores: spinning onnxruntime threads slow
        # llama.cpp's decodes down
        self.sess = open_session(self.folder / "model.onnx", n_threads, spin=False)
        self.top = TopRows(self.rows, self.n_vocab, q8_x=True)  # llama.cpp's numerics

    def candidates(self, hidden: np.ndarray) -> np.ndarray:
        return self.sess.run(["candidates"], {"h": np.ascontiguousarray(hidden, dtype=np.float32)})[0]

    def top_logits(self, hidden: np.ndarray) -> np.ndarray:
        """See TopRows: exact logits at each row's candidates, -inf elsewhere."""
        return self.top(self.candidates(hidden), hidden)


class TopRows:
    """Rows of -inf with the exact logits of each row's candidates (from the GGUF's LM-head
    rows): each row's argmax is the target's wherever the top token is among the candidates.
    One buffer, reused (valid until the next call): only the entries set last time are cleared."""

    def __init__(self, rows: TensorRows, n_vocab: int, q8_x: bool = False):
        self.rows, self.n_vocab, self.q8_x = rows, n_vocab, q8_x
        self._buf = np.empty((0, n_vocab), np.float32)
        self._set: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, cand: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        n = len(cand)
        if len(self._buf) < n:
            self._buf = np.full((n, self.n_vocab), -np.inf, np.float32)
            self._set = None
        buf = self._buf
        if self._set is not None:
            buf[self._set] = -np.inf
        r, c = np.repeat(np.arange(n), cand.shape[1]), cand.ravel()
        buf[r, c] = self.rows.dot_rows(cand, hidden, q8_x=self.q8_x).ravel()
        self._set = (r, c)
        return buf[:n]
