"""The target on llama.cpp, through llama-cpp-python's low-level API.

One sequence, one context. The engine keeps the list of tokens that sit in the KV cache, decodes
batches with chosen output rows, returns logits and final hidden states (after the output norm:
the vector the draft head is fed), and rolls the cache back for rejected drafts.

Traps handled here: the high-level `Llama(draft_model=...)` path is avoided; hidden
states need `embeddings=True` with pooling NONE, which makes every token of a batch an output, so
prompt prefill runs with embeddings off; rolling a sliding-window cache back further than it holds
silently corrupts logits, so `truncate` checks `llama_memory_seq_pos_min` and re-decodes the
kept tokens when the cache no longer covers them.

Greedy decoding with a low-rank LM head (runtime/lowrank.py; `lm_head="auto"` takes it where a
basis ships for the target): an eval callback (`cb_eval`) copies the final hidden states
("result_norm", after the output norm) out of the graph and stops the computation there, so
llama.cpp never runs its 262k-wide LM head; the low-rank head picks each row's candidates and
computes their logits as llama.cpp would. Hidden states come out this way too, without
embeddings mode and without any logits (`hidden_states`). The callback runs Python for every
graph node of every decode, so it is installed only on engines that read hidden states this way.

Rows that need every logit (sampling; greedy with logprobs, grammar or penalties) take the same
cut and then the batched LM head (runtime/batched_head.py; `lm_head="auto"` where the target's
head is Q8_0 or Q4_0 and at least half the model: Gemma 3 270M, not SmolLM2-135M, whose trunk
dominates): llama.cpp's own LM-head rows in one onnxruntime pass for all rows of a verify
decode (llama.cpp's CPU kernels make each further row cost nearly a decode), with llama.cpp's
logits to float rounding, so sampled verification reads the target's true distribution.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np

from edgespec import llama_lib
from edgespec.runtime import probe_gate
from edgespec.cache import file_identity, put_json, read_json
from edgespec.errors import EdgespecError, one_line
from edgespec.io import utf8
from edgespec.runtime.assets import shipped_basis
from edgespec.runtime.batched_head import BatchedHead, pays as batched_pays, supports as batched_supported
from edgespec.runtime.engine import Engine
from edgespec.runtime.lowrank import LowRankHead, LowRankInfo, read_basis
from edgespec.targets import TargetSpec, load_target_spec

if llama_lib.SELECT_ERROR:
    raise EdgespecError(llama_lib.SELECT_ERROR)
try:
    import llama_cpp as lc
except ImportError as e:  # pragma: no cover - llama-cpp-python is a base dependency
    raise EdgespecError(f"llama-cpp-python is not importable ({e}); run: pip install edgespec") from None


WATCH = "watch"  # the probe's mode that copies tensors on the way and lets the graph finish


@lc.llama_log_callback
def _log_errors_only(level: int, text: bytes, user_data) -> None:
    # ggml's levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation.
    if level == 4:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


lc.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
_BACKEND_READY = False
_GGML = None


def _ggml():
    """ggml's C API from the library llama_cpp loaded (tensor names and data)."""
    global _GGML
    if _GGML is None:
        lib_dir = llama_lib.loaded_lib_dir()
        names = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
        if not names:
            raise EdgespecError(f"{lib_dir}: no libggml-base library; reinstall llama-cpp-python")
        lib = ctypes.CDLL(str(names[0]))
        lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        lib.ggml_nbytes.restype, lib.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                ctypes.c_size_t]
        _GGML = lib
    return _GGML


INVARIANCE_FILE = "batch_invariance.json"  # cache: LlamaTarget.invariant_batch per library+model
HEAD_CHOICE_FILE = "batched_head_choice.json"  # cache: whether "auto" takes the batched head here
# "auto" keeps the batched LM head only where a one-row sampled pass through it costs at most
# this much more than through llama.cpp's own head (rows past the first are far cheaper in it)
BATCHED_ONE_ROW_SLACK = 1.05

# llama.cpp hands layer inputs to a draft model (what EAGLE-3 reads) only for the architectures
# whose graph records them; the pinned version's `llama` graph does, its `gemma3` graph does not
# (enabling them there aborts the process), so edgespec enables them only where known to work.
LAYER_INPUT_ARCHS = ("llama",)
_LAYER_INP = None


def _layer_inputs_api():
    """llama.cpp's layer-input extraction (C++ linkage in this version: looked up by its
    mangled names in the binding's libllama)."""
    global _LAYER_INP
    if _LAYER_INP is None:
        lib = lc.llama_cpp._lib
        try:
            set_ = getattr(lib, "_Z30llama_set_embeddings_layer_inpP13llama_contextjb")
            get_ = getattr(lib, "_Z30llama_get_embeddings_layer_inpP13llama_contextj")
        except AttributeError:
            raise EdgespecError(f"this llama-cpp-python ({lc.__version__}) does not expose layer "
                                "inputs; EAGLE-3 heads need llama-cpp-python 0.3.36") from None
        set_.restype, set_.argtypes = None, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
        get_.restype, get_.argtypes = ctypes.POINTER(ctypes.c_float), [ctypes.c_void_p, ctypes.c_uint32]
        _LAYER_INP = (set_, get_)
    return _LAYER_INP


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _ensure_backend() -> None:
    global _BACKEND_READY
    if not _BACKEND_READY:
        lc.llama_backend_init()
        _BACKEND_READY = True


class LlamaVocab:
    """Tokenizing with llama.cpp's vocabulary of a GGUF file (needs `self._vocab`, `self.spec`)."""

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> token ids; `add_bos` defaults to what the GGUF file asks for."""
        add = self.spec.add_bos if add_bos is None else add_bos
        data = utf8(text)
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add, special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add, special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def token_nl(self) -> int:
        """The vocabulary's newline token (llama.cpp's choice)."""
        return int(lc.llama_vocab_nl(self._vocab))


class VocabOnly(LlamaVocab):
    """A target's tokenizer alone (llama.cpp's vocabulary of its GGUF file, no weights)."""

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self._model, self._vocab = load_vocab_only(spec)

    def close(self) -> None:
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()


def load_vocab_only(spec: TargetSpec):
    """A llama.cpp model handle with the vocabulary only (no weights): for other engines."""
    _ensure_backend()
    mparams = lc.llama_model_default_params()
    mparams.vocab_only = True
    model = lc.llama_model_load_from_file(str(spec.path).encode(), mparams)
    if not model:
        raise EdgespecError(f"{spec.path}: llama.cpp could not read this file's vocabulary")
    return model, lc.llama_model_get_vocab(model)


class LlamaChain:
    """llama.cpp's sampler chain for one request, as llama-cpp-python builds it (top-k, typical,
    top-p, min-p, temperature, dist seeded with `seed`), drawing from rows of the context's
    last decode: each `pick` consumes one draw of the stream, as each generated token does in
    llama_cpp.Llama, so called row by row up to the first rejected draft it gives the tokens
    plain decoding would (runtime/verify.SampledVerifier)."""

    def __init__(self, ctx, sp, seed: int):
        self._ctx = ctx
        self._chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        for s in (lc.llama_sampler_init_top_k(sp.top_k), lc.llama_sampler_init_typical(sp.typical_p, 1),
                  lc.llama_sampler_init_top_p(sp.top_p, 1), lc.llama_sampler_init_min_p(sp.min_p, 1),
                  lc.llama_sampler_init_temp(sp.temperature), lc.llama_sampler_init_dist(seed)):
            lc.llama_sampler_chain_add(self._chain, s)

    def pick(self, row: int) -> int:
        return int(lc.llama_sampler_sample(self._chain, self._ctx, row))

    def close(self) -> None:
        if getattr(self, "_chain", None):
            lc.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the binding may be gone already
            pass


class LlamaTarget(LlamaVocab, Engine):
    """A target model on llama.cpp with an explicit, roll-back-able KV cache."""

    engine = "llama.cpp"
    version = lc.__version__
    prefill_logits = True
    # Default for the most tokens drafted per step (set per engine): with llama.cpp's full LM
    # head checking k tokens costs nearly k decodes, so longer drafts rarely pay (3); with the
    # low-rank (greedy) or batched LM head verification costs far less (6).

    def __init__(self, target: str | Path, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = 512, swa_full: bool = False, spec: TargetSpec | None = None,
                 lm_head: str = "auto", probe: bool = False, n_seq: int = 1,
                 flash_attn: bool | None = None, drafts: bool = True):
        """lm_head: "auto" (greedy rows that need only their top token through the low-rank
        search where a basis ships; rows that need every logit (sampling, logprobs, grammar)
        through the batched head where the head's type allows and it is at least half the model
        (`batched_head.pays`); llama.cpp's own head for the rest), "full" (llama.cpp's own LM
        head, always), "batched" (the batched head for every row), "lowrank" (a basis must
        ship; other rows on llama.cpp's head), or a basis file (.npz) for the low-rank head. probe: read hidden states through the eval callback even without a
        low-rank head (`hidden_states`). n_seq: sequences the cache holds (`decode_parts`; the
        single-sequence methods use sequence 0); n_ctx cells are shared by all of them.
        flash_attn: None lets llama.cpp choose (it takes flash attention on CPUs), False is
        llama_cpp.Llama's default. drafts: False for an engine that will verify no drafts
        (every pass one row): "auto" then keeps llama.cpp's own head and sampler for rows that
        need every logit, as llama_cpp.Llama decodes, since the batched head pays only across
        rows."""
        self.spec = spec or load_target_spec(target)
        self.model_file = Path(self.spec.path)
        batched = lm_head == "batched" or (lm_head == "auto" and drafts and batched_pays(self.spec))
        basis = self._basis(lm_head)
        if lm_head == "batched" and not batched_supported(self.spec):
            raise EdgespecError(f"--lm-head batched: {self.spec.name}'s LM head is "
                                f"{self.spec.lm_head_type}; it takes Q8_0 or Q4_0 heads")
        _ensure_backend()
        mparams = lc.llama_model_default_params()
        self._model = lc.llama_model_load_from_file(self.spec.path.encode(), mparams)
        if not self._model:
            raise EdgespecError(f"{self.spec.path}: llama.cpp could not load this GGUF file")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.n_embd = lc.llama_model_n_embd(self._model)
        self.n_layer = lc.llama_model_n_layer(self._model)
        self.n_threads = n_threads or default_threads()
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        # one cache for every sequence: llama.cpp then keeps a batch in order (its split by
        # sequence reorders rows, which the eval callback would read out of order)
        cparams.kv_unified = True
        self.n_seq = n_seq
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.embeddings = False
        cparams.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        cparams.swa_full = swa_full
        self.flash_attn = flash_attn
        if flash_attn is not None:
            cparams.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                       else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._invariant: int | None = None
        self._gate = None  # the C gate in front of the probe (runtime/probe_gate.py), if built
        self._grab, self._grabbed, self._cb, self._grab_layers = False, [], None, set()
        if probe or basis is not None or batched:
            self._install_probe(cparams)
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise EdgespecError(f"{self.spec.path}: llama.cpp could not create a context "
                                f"(n_ctx={n_ctx}); try a smaller --n-ctx")
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._embeddings_on = False
        self.tokens: list[int] = []  # tokens whose K/V sit in the cache, position = index
        self.n_redecodes = 0  # times a rollback had to re-decode because the SWA cache was short
        self.lowrank_head = None
        if basis is not None:
            try:
                self.lowrank_head = LowRankHead(self.spec, basis, n_threads=self.n_threads)
            except EdgespecError as e:  # its cache cannot be built (disk full, read-only)
                if lm_head != "auto":
                    raise
                print(f"edgespec: warning: {one_line(e)}; decoding with llama.cpp's "
                      "full LM head instead", file=sys.stderr)
        self.lowrank: LowRankInfo | None = self.lowrank_head.info if self.lowrank_head else None
        self.batched_head = None
        if batched:
            try:
                self.batched_head = BatchedHead(self.spec, n_threads=self.n_threads)
            except EdgespecError as e:  # its cache cannot be built (disk full, read-only)
                if lm_head != "auto":
                    raise
                print(f"edgespec: warning: {one_line(e)}; decoding with llama.cpp's full LM head "
                      "instead", file=sys.stderr)
        self.feature_layers: tuple[int, ...] = ()  # layer inputs every hidden read carries too
        self.kv_layers: tuple[int, ...] = ()  # layers whose keys and values hidden reads carry
        if lm_head == "auto" and self.batched_head is not None and not self._batched_pays_here():
            self.batched_head = None
        self.draft_k = 6 if self.lowrank or self.batched_head else 3
        self.draft_k_sampled = 6 if self.batched_head else 3

    def _batched_pays_here(self) -> bool:
        """Whether the batched LM head's one-row sampled pass (decode, its head, the numpy chain)
        is no dearer than llama.cpp's own one-row pass here (BATCHED_ONE_ROW_SLACK): most
        sampled passes are one row, and where its head is not faster than llama.cpp's (memory
        bandwidth alike for both, or llama.cpp's OpenMP threads still spinning while
        onnxruntime runs: an app that imported llama_cpp before edgespec keeps libgomp's long
        spin, see edgespec/__init__.py) it would make sampling slower than llama_cpp.Llama.
        Measured once per library build, model, CPU, threads, attention and import state, in
        interleaved one-token decodes (about half a second), and kept in edgespec's cache."""
        from edgespec import GOMP_AT_IMPORT
        from edgespec.runtime.policies import cpu_model

        lib = llama_lib.loaded_lib_dir()
        libs = sorted(p for p in lib.iterdir() if p.name.startswith(("libllama.", "libggml")))
        key = "|".join([*(file_identity(p) for p in libs), file_identity(self.model_file),
                        cpu_model(), f"fa={self.flash_attn}", f"t={self.n_threads}",
                        f"gomp={GOMP_AT_IMPORT}"])
        cached = read_json(HEAD_CHOICE_FILE).get(key)
        if isinstance(cached, dict) and isinstance(cached.get("batched"), bool):
            return cached["batched"]
        ms = self.time_one_row_heads()
        pays = ms["batched"] <= BATCHED_ONE_ROW_SLACK * ms["llama.cpp"]
        put_json(HEAD_CHOICE_FILE, key, {"batched": pays, "ms": ms})
        return pays

    def time_one_row_heads(self, rounds: int = 12) -> dict[str, float]:
        """Median ms of a one-row sampled pass through the batched head and through llama.cpp's
        own (interleaved one-token decodes at the same position; empties the cache)."""
        import time

        from edgespec.runtime.sampling import SamplingParams, chain

        sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
        seq = self.tokenize("The river rose in the spring of that year, and the old mill by "
                            "the bridge turned again after a long winter.")
        head, times = self.batched_head, {"batched": [], "llama.cpp": []}
        self.reset()
        try:
            self.prefill(seq[:-1])
            for i in range(2 * rounds + 2):  # alternating, the first pair a warm-up
                which = "batched" if i % 2 == 0 else "llama.cpp"
                self.batched_head = head if which == "batched" else None
                t0 = time.perf_counter()
                logits, _ = self.decode(seq[-1:], copy=which == "batched")
                if which == "batched":  # the chain llama.cpp runs in C, edgespec in numpy
                    chain(logits[0], sp)
                dt = time.perf_counter() - t0
                self.truncate(len(self.tokens) - 1)
                if i >= 2:
                    times[which].append(dt)
        finally:
            self.batched_head = head
            self.reset()
        return {k: round(1000 * float(np.median(v)), 3) for k, v in times.items()}

    def metadata(self) -> dict[str, str]:
        """The GGUF metadata as llama.cpp reads it (key -> value as text)."""
        out, buf = {}, ctypes.create_string_buffer(1 << 16)
        for i in range(lc.llama_model_meta_count(self._model)):
            if lc.llama_model_meta_key_by_index(self._model, i, buf, len(buf)) < 0:
                continue
            key = buf.value.decode("utf-8", errors="replace")
            n = lc.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if n >= len(buf):  # a long value (a chat template): read it whole
                big = ctypes.create_string_buffer(n + 1)
                lc.llama_model_meta_val_str_by_index(self._model, i, big, len(big))
                out[key] = big.value.decode("utf-8", errors="replace")
            elif n >= 0:
                out[key] = buf.value.decode("utf-8", errors="replace")
        return out

    def describe_lm_head(self, greedy: bool = True) -> str:
        """The LM head verification uses (greedy passes may use the low-rank one), for reports."""
        head = self.spec.lm_head_type
        if greedy and self.lowrank:
            return f"{head}; {self.lowrank.describe('as llama.cpp computes them')}"
        if self.batched_head is not None:
            return self.batched_head.describe()
        return head

    def _basis(self, lm_head: str):
        if lm_head == "full":
            return None
        if lm_head in ("auto", "lowrank"):
            path = shipped_basis(self.spec)
            if path is None and lm_head == "lowrank":
                raise EdgespecError(f"no low-rank basis ships for {self.spec.name}; make one with "
                                    "`edgespec export lowrank-basis` and pass the file")
            return None if path is None else read_basis(path, self.spec)
        if lm_head == "batched":
            return None
        if not Path(lm_head).expanduser().is_file():
            raise EdgespecError(f"--lm-head {lm_head}: choose auto, full, lowrank, batched or a "
                                "basis file")
        return read_basis(Path(lm_head).expanduser(), self.spec)

    def _install_probe(self, cparams) -> None:
        """An eval callback that, while `_grab` is set, copies the final hidden states (the
        tensor "result_norm") and stops the graph there: what follows is the LM head. Tensors
        named in `_grab_layers` (the residual stream "l_out-i" entering layer i + 1, a layer's
        keys "Kcur-i" and values "Vcur-i") are copied on the way. With `_grab` set to WATCH
        only those are copied and the graph runs to its end (llama.cpp's own LM head). Where
        the C gate builds (runtime/probe_gate.py), it answers llama.cpp's question about each
        tensor and this callback only copies the ones it asked for."""
        lib, grabbed, layers = _ggml(), self._grabbed, self._grab_layers

        def cb(t, ask, _user):
            if not self._grab:
                return False
            name = lib.ggml_get_name(t)
            stop = self._grab is not WATCH
            if ask:
                return (stop and name == b"result_norm") or name in layers
            out = np.empty(lib.ggml_nbytes(t) // 4, np.float32)
            lib.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
            grabbed.append((name, out))
            return not stop or name != b"result_norm"

        self._cb = lc.ggml_backend_sched_eval_callback(cb)  # kept alive with the context
        gate = probe_gate.gate_library()
        if gate is None:  # the probe answers every node itself
            cparams.cb_eval = self._cb
            return
        # the C gate answers llama.cpp's questions; the probe copies what it asks for
        self._gate = probe_gate.Gate(0, 0, 0, ctypes.cast(self._cb, ctypes.c_void_p),
                                     ctypes.cast(lib.ggml_get_name, ctypes.c_void_p))
        cparams.cb_eval = ctypes.cast(gate.edgespec_gate_cb, lc.ggml_backend_sched_eval_callback)
        cparams.cb_eval_user_data = ctypes.cast(ctypes.pointer(self._gate), ctypes.c_void_p)

    @property
    def _grab(self):
        """What the probe reads now: False (nothing), True (up to the final norm) or WATCH."""
        return self._grab_mode

    @_grab.setter
    def _grab(self, mode) -> None:
        self._grab_mode = mode
        if self._gate is not None:  # the gate asks for what the probe would
            self._gate.set(bool(mode), mode is not WATCH, self._grab_layers)

    def _decode_grab(self, tokens: list[int], outputs: list[bool], layers: tuple[int, ...] = (),
                     kv_layers: tuple[int, ...] = ()):
        """Decode without the LM head; the hidden states of the output rows [n_out, n_embd], or
        with `layers` [n_out, n_embd * (1 + len(layers))]: the final hidden state, then the
        input of each listed layer (every row is an output then); with `kv_layers`, then each
        listed layer's keys and values as its cache holds them (`kv_width` each: keys after
        the norm and RoPE)."""
        self._check_room(len(tokens))
        out = self._grab_batch([(0, len(self.tokens), tokens, outputs)], layers, kv_layers)
        self.tokens.extend(tokens)
        return out

    def _decode_watch(self, tokens: list[int], outputs: list[bool], kv_layers: tuple[int, ...]):
        """Decode through llama.cpp's own LM head (its logits as usual); the keys and values of
        `kv_layers` for every token [n, 2 * kv_width * len(kv_layers)], read on the way."""
        names = self._kv_names(kv_layers)
        self._grab_layers.clear()
        self._grab_layers.update(names)
        self._grabbed.clear()
        self._grab = WATCH
        try:
            self._decode_chunk(tokens, outputs)
        finally:
            self._grab = False
            self._grab_layers.clear()
        got = self._collect()
        return np.concatenate([self._kv_rows(got, name, len(tokens)) for name in names], axis=1)

    @staticmethod
    def _kv_names(kv_layers: tuple[int, ...]) -> list[bytes]:
        return [b"%s-%d" % (kind, i) for i in kv_layers for kind in (b"Kcur", b"Vcur")]

    def _collect(self) -> dict[bytes, list[np.ndarray]]:
        got: dict[bytes, list[np.ndarray]] = {}
        for name, rows in self._grabbed:
            got.setdefault(name, []).append(rows)
        self._grabbed.clear()
        return got

    def _kv_rows(self, got: dict, name: bytes, n_tok: int) -> np.ndarray:
        """One layer's keys or values for the decode's n_tok tokens [n_tok, kv_width]. The
        graph names both the projection and the tensor the cache stores "Kcur-i" (the latter
        after the norm and RoPE, computed last): a decode is one ubatch (n_ubatch = n_batch),
        so the last one read is the cache's."""
        w = self.kv_width
        rows = got.get(name, [None])[-1]
        if rows is None or rows.size != n_tok * w:
            raise RuntimeError(f"hidden-state probe read no {name.decode()} rows for {n_tok} tokens")
        return rows.reshape(n_tok, w)

    @property
    def kv_width(self) -> int:
        """Floats of one token's keys (or values) in one layer: KV heads x head width."""
        return self.spec.n_head_kv * self.spec.head_dim

    def _grab_batch(self, pieces, layers: tuple[int, ...] = (),
                    kv_layers: tuple[int, ...] = ()) -> np.ndarray:
        """`_decode_grab` over (seq, first position, tokens, outputs) pieces in one decode."""
        if self._cb is None:
            raise RuntimeError("this engine was opened without the hidden-state probe")
        self._set_embeddings(False)
        names = [b"l_out-%d" % (i - 1) for i in layers]
        kv_names = self._kv_names(kv_layers)
        self._grab_layers.clear()
        self._grab_layers.update(names + kv_names)
        self._grabbed.clear()
        self._grab = True
        try:
            self._run_batch(pieces)
        finally:
            self._grab = False
            self._grab_layers.clear()
        got = self._collect()
        n_out = sum(sum(p[3]) for p in pieces)
        parts = []
        for name in [b"result_norm", *names]:
            rows = np.concatenate(got.get(name, [np.empty(0, np.float32)]))
            if rows.size != n_out * self.n_embd:
                raise RuntimeError(f"hidden-state probe read {rows.size} values of "
                                   f"{name.decode()} for {n_out} rows")
            parts.append(rows.reshape(-1, self.n_embd))
        n_tok = sum(len(p[2]) for p in pieces)
        if kv_names and n_out != n_tok:
            raise RuntimeError(f"keys and values are read with every row an output ({n_out} of "
                               f"{n_tok} here)")
        parts += [self._kv_rows(got, name, n_tok) for name in kv_names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def hidden_states(self, tokens: list[int], layers: tuple[int, ...] | None = None,
                      kv_layers: tuple[int, ...] | None = None) -> np.ndarray:
        """Decode tokens into the cache; their final hidden states [n, n_embd]. With the probe
        no logits are computed; without it embeddings mode computes them too. `layers` (probe
        only): also the input of each of these layers (1 .. n_layer - 1), concatenated after
        the final hidden state: [n, n_embd * (1 + len(layers))]. Default: `feature_layers`.
        `kv_layers` (probe only): then each of these layers' keys and values, `kv_width` each
        (what a shared-KV head attends: training/shared_kv.py). Default: `kv_layers`."""
        kv_layers = self.kv_layers if kv_layers is None else tuple(int(i) for i in kv_layers)
        if kv_layers:
            if self._cb is None:
                raise RuntimeError("keys and values need the hidden-state probe (probe=True)")
            bad = [i for i in kv_layers if not 0 <= i < self.n_layer]
            if bad:
                raise EdgespecError(f"layer {bad[0]} is not a layer of this target "
                                    f"(choose from 0 to {self.n_layer - 1})")
        if layers is not None and self._cb is None:  # no probe: llama.cpp's own extraction
            if tuple(layers) == self.feature_layers:
                layers = None
            elif layers:
                raise RuntimeError("layer inputs need the hidden-state probe (probe=True) or "
                                   "set_feature_layers")
            else:  # the final hidden states alone, while feature layers are on
                full = self.feature_layers
                self.set_feature_layers(())
                try:
                    return self.hidden_states(tokens)
                finally:
                    self.set_feature_layers(full)
        if layers is None:
            if self.feature_layers and self._cb is None:  # native extraction, embeddings mode
                out = [self.decode(tokens[s:s + self.n_batch], hidden=True)[1]
                       for s in range(0, len(tokens), self.n_batch)]
                return (np.concatenate(out) if out else
                        np.empty((0, self.n_embd * (1 + len(self.feature_layers))), np.float32))
            layers = self.feature_layers
        if layers and self._cb is None:
            raise RuntimeError("layer inputs need the hidden-state probe (probe=True)")
        bad = [i for i in layers if not 1 <= i < self.n_layer]
        if bad:
            raise EdgespecError(f"layer {bad[0]} is not a layer input this target has "
                                f"(choose from 1 to {self.n_layer - 1})")
        out = []
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s:s + self.n_batch]
            out.append(self._decode_grab(chunk, [True] * len(chunk), tuple(layers), kv_layers)
                       if self._cb is not None else self.decode(chunk, hidden=True)[1])
        width = self.n_embd * (1 + len(layers)) + 2 * self.kv_width * len(kv_layers)
        return np.concatenate(out) if out else np.empty((0, width), np.float32)

    # -- decoding ---------------------------------------------------------------------------
    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings_on:
            lc.llama_set_embeddings(self._ctx, on)
            self._embeddings_on = on

    def _check_room(self, n: int) -> None:
        if len(self.tokens) + n > self.n_ctx:
            raise EdgespecError(f"context is full ({self.n_ctx} tokens); use a larger n_ctx "
                                "or a shorter prompt")

    def _decode_chunk(self, tokens: list[int], outputs: list[bool]) -> None:
        self._check_room(len(tokens))
        self._run_batch([(0, len(self.tokens), tokens, outputs)])
        self.tokens.extend(tokens)

    def _run_batch(self, pieces) -> None:
        """One llama_decode over (seq, first position, tokens, outputs) pieces, in order."""
        b, i = self._batch, 0
        for seq, start, tokens, outputs in pieces:
            for j, (t, out) in enumerate(zip(tokens, outputs)):
                b.token[i] = t
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = out
                i += 1
        b.n_tokens = i
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def set_feature_layers(self, layers: tuple[int, ...] = ()) -> None:
        """From now on every hidden-state read also carries the inputs of these layers:
        [n, n_embd * (1 + len(layers))], the final hidden state first (EAGLE-3 heads read
        them). () turns it off. Through llama.cpp's own extraction (no callback), on targets
        whose graph records layer inputs (`LAYER_INPUT_ARCHS`)."""
        layers = tuple(int(i) for i in layers)
        if layers == self.feature_layers:
            return
        bad = [i for i in layers if not 1 <= i < self.n_layer]
        if bad:
            raise EdgespecError(f"layer {bad[0]} is not a layer input this target has "
                                f"(choose from 1 to {self.n_layer - 1})")
        if layers and self.spec.arch not in LAYER_INPUT_ARCHS:
            raise EdgespecError(f"EAGLE-3 heads run on targets whose llama.cpp graph hands out "
                                f"layer inputs ({', '.join(LAYER_INPUT_ARCHS)}); this "
                                f"{self.spec.arch} target's does not")
        set_, _ = _layer_inputs_api()
        for i in self.feature_layers:
            set_(self._ctx, i, False)
        for i in layers:
            set_(self._ctx, i, True)
        self.feature_layers = layers

    def can_hand_kv(self) -> bool:
        return self._cb is not None  # the probe reads the keys and values

    def set_kv_layers(self, layers: tuple[int, ...] = ()) -> None:
        """From now on every hidden-state read (`decode(hidden=True)`, `hidden_states`) also
        carries the keys and values of these layers, as the cache holds them (keys after the
        norm and RoPE): [n, n_embd + 2 * kv_width * len(layers)], per layer keys then values
        (shared-KV heads read them: the same decode that verifies hands them over). () turns
        it off. Needs the hidden-state probe (`probe=True`)."""
        layers = tuple(int(i) for i in layers)
        if layers == self.kv_layers:
            return
        if layers and self._cb is None:
            raise EdgespecError("this engine was opened without the hidden-state probe, which "
                                "reads the keys and values a shared-KV head needs (probe=True)")
        bad = [i for i in layers if not 0 <= i < self.n_layer]
        if bad:
            raise EdgespecError(f"layer {bad[0]} is not a layer of this target "
                                f"(choose from 0 to {self.n_layer - 1})")
        if layers and self.feature_layers:
            raise EdgespecError("a head reads either layer inputs (EAGLE-3) or keys and values "
                                "(shared-KV), not both")
        self.kv_layers = layers

    def _layer_rows(self, n: int, copy: bool) -> list[np.ndarray]:
        """The inputs of the feature layers for the last decode's n tokens (native extraction)."""
        _, get_ = _layer_inputs_api()
        return [self._rows(get_(self._ctx, i), n, self.n_embd, copy) for i in self.feature_layers]

    def hidden_free(self, top_only: bool) -> bool:
        """Whether decodes compute the final hidden states anyway: passes through the low-rank
        or the batched LM head read them (the probe) before the head."""
        return (top_only and self.lowrank_head is not None) or self.batched_head is not None

    def prefill(self, tokens: list[int], last_logits: bool = False) -> np.ndarray | None:
        """Decode prompt tokens into the cache (embeddings off) in n_batch chunks, with no
        outputs, or with `last_logits` the logits of the last token [V] (each chunk's last row
        an output, as llama_cpp.Llama prefills: the same batches give the same numbers)."""
        self._set_embeddings(False)
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s:s + self.n_batch]
            self._decode_chunk(chunk, [False] * (len(chunk) - 1) + [last_logits])
        if last_logits and tokens:
            return self._rows(lc.llama_get_logits(self._ctx), 1, self.n_vocab, True)[0]
        return None

    def prefill_hidden(self, tokens: list[int], n_last: int) -> np.ndarray:
        """Decode prompt tokens into the cache in its usual n_batch chunks, the last n_last of
        them outputs: with the probe, their hidden states read from the same batches (it stops
        before the LM head), where a decode of their own would cost a batch more (SmolLM2's
        Q4_1 batches here: about as much again as the rest of the prompt). Without the probe
        (embeddings mode makes every row an output, with logits), and for heads that read
        layer inputs or keys and values, `hidden_states`' way."""
        n_last = min(n_last, len(tokens))
        if self._cb is None or self.feature_layers or self.kv_layers or n_last == len(tokens):
            return super().prefill_hidden(tokens, n_last)
        first, out = len(tokens) - n_last, []
        for s in range(0, len(tokens), self.n_batch):
            chunk = tokens[s:s + self.n_batch]
            outputs = [s + j >= first for j in range(len(chunk))]
            if any(outputs):
                out.append(self._decode_grab(chunk, outputs))
            else:
                self._set_embeddings(False)
                self._decode_chunk(chunk, outputs)
        return np.concatenate(out) if out else np.empty((0, self.n_embd), np.float32)

    def native_sampler(self, sampling, seed: int):
        """llama.cpp's own chain where the last decode's logits sit in the context (no batched
        LM head) and the request needs no more than the chain's cuts (no bias, penalties,
        processors: those stay in numpy)."""
        if self.batched_head is not None or sampling.adjusts_logits:
            return None
        return LlamaChain(self._ctx, sampling, seed)

    def invariant_batch(self, most: int = 8) -> int:
        """The most tokens one decode may hold and still give each row the logits of one-token
        decodes, bit for bit, in and out of embeddings mode (1: no batch does). Measured once
        per library build, model, attention kind and thread count (about a second; it empties
        the cache) and remembered in edgespec's cache: see edgespec/llama_lib.py."""
        if self._invariant is None:
            lib = llama_lib.loaded_lib_dir()
            libs = sorted(p for p in lib.iterdir() if p.name.startswith(("libllama.", "libggml")))
            key = "|".join([*(file_identity(p) for p in libs), file_identity(self.model_file),
                            f"fa={self.flash_attn}", f"t={self.n_threads}", f"ub={self.n_batch}",
                            "head=batched" if self.batched_head is not None else "head=llama.cpp",
                            str(most)])
            cached = read_json(INVARIANCE_FILE).get(key)
            if isinstance(cached, int):
                self._invariant = cached
            else:
                self._invariant = self._measure_invariance(most)
                put_json(INVARIANCE_FILE, key, self._invariant)
        return self._invariant

    def _measure_invariance(self, most: int) -> int:
        text = ("The river rose in the spring of that year, and the old mill by the bridge "
                "turned again after a long winter. def area(r):\n    return 3.14159 * r * r\n")
        seq = self.tokenize(text)
        lead, n = 6, 2 * most
        while len(seq) < lead + n:
            seq = seq + seq
        seq = seq[:lead + n]
        self.reset()
        try:
            self.prefill(seq[:lead])
            ref = [self.decode([t])[0][0] for t in seq[lead:]]
            best = 1
            for k in range(2, most + 1):
                for hidden in (False, True):
                    self.truncate(lead)
                    rows = []
                    for s in range(lead, lead + n, k):
                        rows.extend(self.decode(seq[s:s + k], hidden=hidden)[0])
                    if not all(np.array_equal(a, b) for a, b in zip(ref, rows)):
                        return best
                best = k
            return best
        finally:
            self.reset()

    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Decode up to n_batch tokens; return logits [n_out, V] and hidden states [n, E] or None.

        With hidden=True every position is an output (llama.cpp's rule with embeddings on). With
        hidden=False and all_logits=False only the last position's logits are computed, which is
        much cheaper on a large vocabulary. copy=False returns views into llama.cpp's buffers,
        valid until the next decode (the decode loop reads them at once). top_only: the caller
        reads only argmaxes; with a low-rank LM head the rows are -inf but at each row's
        candidates, which hold exact logits (see the module doc).
        """
        if not tokens:
            raise ValueError("decode needs at least one token")
        if len(tokens) > self.n_batch:
            raise ValueError(f"decode takes at most n_batch={self.n_batch} tokens")
        n = len(tokens)
        every = all_logits or hidden
        layers = self.feature_layers if hidden else ()
        kv = self.kv_layers if hidden else ()
        if top_only and self.lowrank_head is not None:
            h = self._decode_grab(tokens, [True] * n if every else [False] * (n - 1) + [True],
                                  kv_layers=kv)
            if layers:
                h = np.concatenate([h, *self._layer_rows(n, True)], axis=1)
            return self.lowrank_head.top_logits(h[:, :self.n_embd]), (h if hidden else None)
        if self.batched_head is not None:
            h = self._decode_grab(tokens, [True] * n if every else [False] * (n - 1) + [True],
                                  kv_layers=kv)
            if layers:
                h = np.concatenate([h, *self._layer_rows(n, True)], axis=1)
            return self.batched_head.logits(h[:, :self.n_embd]), (h if hidden else None)
        # switching embeddings mode re-sizes llama.cpp's output buffers (~1 ms a switch on
        # SmolLM2): left on where it changes nothing (every row is an output anyway)
        if hidden or (n > 1 and not every):
            self._set_embeddings(hidden)
        outputs = [True] * n if every else [False] * (n - 1) + [True]
        kv_rows = self._decode_watch(tokens, outputs, kv) if kv else None
        if not kv:
            self._decode_chunk(tokens, outputs)
        n_out = n if every else 1
        logits = self._rows(lc.llama_get_logits(self._ctx), n_out, self.n_vocab, copy)
        hid = self._rows(lc.llama_get_embeddings(self._ctx), n, self.n_embd, copy) if hidden else None
        if hid is not None and (layers or kv):
            hid = np.concatenate([hid, *(self._layer_rows(n, True) if layers else []),
                                  *([kv_rows] if kv else [])], axis=1)
        return logits, hid

    @staticmethod
    def _rows(ptr, n: int, width: int, copy: bool) -> np.ndarray:
        if not ptr:
            raise RuntimeError("llama.cpp returned no outputs for this batch")
        view = np.ctypeslib.as_array(ptr, shape=(n, width))
        return view.copy() if copy else view

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first n tokens (exact, also on sliding-window caches)."""
        if n >= len(self.tokens):
            return
        kept = self.tokens[:n]
        self.seq_rollback(0, kept)
        self.tokens = kept

    # -- several sequences in one cache (runtime/batching.py) --------------------------------
    def seq_rollback(self, seq: int, kept: list[int]) -> None:
        """Drop sequence `seq`'s cache entries past `kept` (the tokens it keeps)."""
        n = len(kept)
        lc.llama_memory_seq_rm(self._mem, seq, n, -1)
        window = self.spec.sliding_window
        if window and n > 0:
            # The next token (position n) attends back to position n - window + 1 on sliding
            # layers; if the cache dropped cells in that range (or all: -1), re-decode.
            pos_min = lc.llama_memory_seq_pos_min(self._mem, seq)
            if pos_min < 0 or pos_min > max(0, n - window):
                self.n_redecodes += 1
                lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
                self._set_embeddings(False)
                for s in range(0, n, self.n_batch):
                    chunk = kept[s:s + self.n_batch]
                    self._run_batch([(seq, s, chunk, [False] * len(chunk))])

    def seq_clear(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def decode_parts(self, parts) -> list[tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]]:
        """Decode parts of several sequences (runtime.batching.Part: seq, start, tokens,
        outputs "none" | "last" | "all", hidden, logits, top_only) in as few llama_decode calls
        as their kinds allow (one, when they all verify greedily or all sample): per part
        (logits of its output rows, hidden states of its rows, low-rank candidates). Greedy
        parts on the low-rank LM head get no logits but their hidden states and candidates
        (the caller picks the exact logits, `LowRankHead.top`); parts with no outputs (prompt
        prefill) ride along with the others, and a part's first `lead` rows (its prompt, sent
        with its first decode) are prefill too: no outputs, nothing returned for them. Every
        array is the caller's own copy."""
        import copy

        grab = self._cb is not None

        def kind(p) -> str:
            if p.outputs == "none":
                return "prefill"
            if grab and (not p.logits or (p.top_only and self.lowrank_head is not None)):
                return "grab"
            return "emb" if p.hidden else "full"

        # embeddings mode makes every row an output: lead rows of such parts go first, alone
        early = [p for p in parts if p.lead and p.outputs != "none" and kind(p) == "emb"]
        if early:
            self._set_embeddings(False)
            self._run_batch([(p.seq, p.start, p.tokens[:p.lead], [False] * p.lead) for p in early])
            parts = list(parts)
            for i, p in enumerate(parts):
                if any(p is e for e in early):
                    q = copy.copy(p)
                    q.start, q.tokens, q.lead = p.start + p.lead, p.tokens[p.lead:], 0
                    parts[i] = q
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(parts):
            groups.setdefault(kind(p), []).append(i)
        prefill = groups.pop("prefill", [])
        if prefill:
            groups.setdefault("grab" if "grab" in groups else "full", []).extend(prefill)
        results: list = [None] * len(parts)
        for k, idx in groups.items():
            chunk, rows = [], 0
            for i in idx:
                n = len(parts[i].tokens)
                if chunk and rows + n > self.n_batch:
                    self._decode_group(k, [parts[j] for j in chunk], chunk, results)
                    chunk, rows = [], 0
                chunk.append(i)
                rows += n
            if chunk:
                self._decode_group(k, [parts[j] for j in chunk], chunk, results)
        return results

    def _decode_group(self, kind: str, parts, idx: list[int], results: list) -> None:
        pieces, n_out = [], []
        for p in parts:
            lead = p.lead
            n = len(p.tokens) - lead
            if p.outputs == "none":
                out = [False] * n
            elif p.outputs == "all" or kind == "emb":
                out = [True] * n
            else:
                out = [False] * (n - 1) + [True]
            out = [False] * lead + out
            pieces.append((p.seq, p.start, p.tokens, out))
            n_out.append(sum(out))
        at = np.cumsum([0] + n_out)
        if kind == "grab":
            h = self._grab_batch(pieces)
            want = self.lowrank_head is not None and any(p.logits for p in parts)
            cand = self.lowrank_head.candidates(h) if want and len(h) else None
            for j, (i, p) in enumerate(zip(idx, parts)):
                rows = slice(at[j], at[j + 1])
                results[i] = (None, h[rows].copy() if n_out[j] else None,
                              cand[rows].copy() if cand is not None and n_out[j] and p.logits else None)
            return
        self._set_embeddings(kind == "emb")
        self._run_batch(pieces)
        logits = self._rows(lc.llama_get_logits(self._ctx), int(at[-1]), self.n_vocab, False) if at[-1] else None
        hid = self._rows(lc.llama_get_embeddings(self._ctx), int(at[-1]), self.n_embd, False) \
            if kind == "emb" else None
        for j, (i, p) in enumerate(zip(idx, parts)):
            rows = slice(at[j], at[j + 1])
            results[i] = (logits[rows].copy() if n_out[j] and p.logits else None,
                          hid[rows].copy() if hid is not None and p.hidden else None, None)

    def reset(self) -> None:
        lc.llama_memory_clear(self._mem, True)
        self.tokens = []

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            lc.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
