"""`edgespec serve`: an OpenAI-compatible HTTP server over one SpeculativeLlama.

    edgespec serve --target gemma3-270m --draft default --port 8080
    curl localhost:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events or
not, the request fields of `SpeculativeLlama`), GET /v1/models, /health, /metrics (Prometheus
text) and / (a chat page). With `--parallel N` the target holds N sequences in one cache
(runtime/batching.py): up to N requests generate at once, their drafts verified together in
one batched decode per step; each request takes the free slot whose cache shares the longest
prefix with its prompt. Past N, at most `max_queue` wait, more get 503. Errors are
OpenAI-style JSON with the right status, never a traceback; a client that disconnects
mid-stream frees its slot at once.
"""

import asyncio
import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

from edgespec.errors import EdgespecError, one_line
from edgespec.runtime.decoding import common_prefix
from edgespec.runtime.spec import SpecConfig

PAGE = Path(__file__).with_name("chat_page.html")

# The request fields each endpoint passes on (OpenAI's names where they differ are mapped).
COMPLETION_FIELDS = {"prompt", "suffix", "max_tokens", "temperature", "top_p", "min_p", "typical_p",
                     "logprobs", "echo", "stop", "frequency_penalty", "presence_penalty",
                     "repeat_penalty", "top_k", "stream", "seed", "mirostat_mode", "logit_bias",
                     "model", "grammar"}
CHAT_FIELDS = {"messages", "functions", "function_call", "tools", "tool_choice", "temperature",
               "top_p", "top_k", "min_p", "typical_p", "stream", "stop", "seed", "response_format",
               "max_tokens", "presence_penalty", "frequency_penalty", "repeat_penalty",
               "mirostat_mode", "model", "logit_bias", "logprobs", "top_logprobs", "grammar"}
IGNORED_FIELDS = {"n", "user", "stream_options", "best_of", "parallel_tool_calls"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Metrics:
    """Counters since start, as Prometheus text."""

    def __init__(self):
        self.requests = 0
        self.errors = 0
        self.tokens = 0
        self.decode_s = 0.0
        self.verify_passes = 0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []

    def add(self, stats: dict, drafted_at: list[int], accepted_at: list[int]) -> None:
        self.tokens += stats.get("tokens", 0)
        self.decode_s += stats.get("decode_s", 0.0)
        self.verify_passes += stats.get("verify_passes", 0)
        for i, (d, a) in enumerate(zip(drafted_at, accepted_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    def text(self, queue: int) -> str:
        rate = self.tokens / self.decode_s if self.decode_s else 0.0
        per_pass = self.tokens / self.verify_passes if self.verify_passes else 0.0
        lines = [
            "# TYPE edgespec_requests_total counter", f"edgespec_requests_total {self.requests}",
            "# TYPE edgespec_request_errors_total counter", f"edgespec_request_errors_total {self.errors}",
            "# TYPE edgespec_tokens_total counter", f"edgespec_tokens_total {self.tokens}",
            "# TYPE edgespec_tokens_per_second gauge", f"edgespec_tokens_per_second {rate:.3f}",
            "# TYPE edgespec_tokens_per_verify_pass gauge",
            f"edgespec_tokens_per_verify_pass {per_pass:.4f}",
            "# TYPE edgespec_queue_length gauge", f"edgespec_queue_length {queue}",
            "# TYPE edgespec_acceptance gauge",
        ]
        for i, (d, a) in enumerate(zip(self.drafted_at, self.accepted_at)):
            lines.append(f'edgespec_acceptance{{position="{i + 1}"}} {a / d if d else 0.0:.4f}')
        return "\n".join(lines) + "\n"


def make_app(llms, model_name: str, api_key: str | None = None, max_queue: int = 8,
             batcher=None):
    """The FastAPI app serving `llms` (a SpeculativeLlama, or one per slot of `batcher`)
    under `model_name`. (No postponed annotations in this module: FastAPI reads the
    handlers' `Request` annotation at runtime.)"""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    app = FastAPI(title="edgespec", docs_url=None, redoc_url=None)
    metrics = Metrics()
    pool = list(llms) if isinstance(llms, (list, tuple)) else [llms]
    llm = pool[0]  # tokenizer and context size (the same for every slot)
    free = list(pool)  # slots with no request
    waiting = {"n": 0}  # requests holding or waiting for a slot
    created = int(time.time())

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        metrics.errors += 1
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": status}}, status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return error(e.status, e.message, e.kind)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, e: HTTPException):
        return error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(_request, e: Exception):
        return error(500, f"internal error: {one_line(e)}", "server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "invalid API key", "authentication_error")
        return await call_next(request)

    async def body_of(request: Request, allowed: set[str]) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - allowed - IGNORED_FIELDS)
        if unknown:
            raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n = 1 is supported")
        return {k: v for k, v in body.items() if k in allowed and k != "model"}

    def check_fits(ids_len: int) -> None:
        if ids_len >= llm.n_ctx():
            raise ApiError(413, f"the prompt is {ids_len} tokens; the context holds {llm.n_ctx()}")

    count = threading.Lock()  # guards waiting and free (released from worker threads too)

    def busy() -> int:
        return len(pool) - len(free)

    def take(ids: list[int]):
        """The free slot whose cache shares the longest prefix with `ids` (None: none free)."""
        with count:
            if not free:
                return None
            best = max(free, key=lambda s: common_prefix(s.engine.tokens, ids))
            free.remove(best)
            return best

    async def acquire(ids: list[int]):
        with count:
            if waiting["n"] >= max_queue + len(pool):
                raise ApiError(503, "the server is busy: too many requests waiting", "server_busy")
            waiting["n"] += 1
        try:
            while (slot := take(ids)) is None:
                await asyncio.sleep(0.005)
            return slot
        except BaseException:
            with count:
                waiting["n"] -= 1
            raise

    def release(slot) -> None:
        if batcher is not None:
            batcher.deactivate(slot.engine.seq)
        with count:
            waiting["n"] -= 1
            free.append(slot)

    def call(fn, kwargs):
        try:
            return fn(**kwargs)
        except NotImplementedError as e:
            raise ApiError(400, str(e)) from None
        except (EdgespecError, TypeError, ValueError) as e:
            raise ApiError(400, one_line(e)) from None

    def record(slot, final: dict) -> None:
        sp = final.get("speculative") or {}
        metrics.add(sp, slot.last_drafted_at, slot.last_accepted_at)

    async def respond(method: str, kwargs: dict, ids: list[int]):
        metrics.requests += 1
        slot = await acquire(ids)
        fn = getattr(slot, method)
        if not kwargs.get("stream"):
            try:
                out = await run_in_threadpool(call, fn, kwargs)
            finally:
                release(slot)
            record(slot, out)
            return JSONResponse(out)
        try:
            chunks = await run_in_threadpool(call, fn, kwargs)
        except BaseException:
            release(slot)
            raise
        # A worker thread drives the generation and hands chunks over; when the client goes
        # away the worker stops after the current step and frees the slot.
        out: asyncio.Queue = asyncio.Queue()  # filled from the worker through the event loop
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # the loop has closed (shutdown): nobody is reading
                stop.set()

        threading.Thread(target=_pump, args=(chunks, put, stop, lambda: release(slot)),
                         daemon=True).start()

        async def events():
            last = None
            try:
                while True:
                    kind, item = await out.get()
                    if kind == "end":
                        break
                    if kind == "error":
                        metrics.errors += 1
                        yield f"data: {json.dumps({'error': {'message': item, 'type': 'server_error'}})}\n\n"
                        continue
                    last = item
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"
                if last is not None:
                    record(slot, last)
            finally:
                stop.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        kw = await body_of(request, COMPLETION_FIELDS)
        if not isinstance(kw.get("prompt"), (str, list)):
            raise ApiError(400, "'prompt' must be a string or a list of token ids")
        if isinstance(kw["prompt"], list) and kw["prompt"] and isinstance(kw["prompt"][0], str):
            if len(kw["prompt"]) != 1:
                raise ApiError(400, "only one prompt per request is supported")
            kw["prompt"] = kw["prompt"][0]
        ids = kw["prompt"] if isinstance(kw["prompt"], list) else llm.engine.tokenize(kw["prompt"])
        check_fits(len(ids))
        return await respond("create_completion", kw, ids)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        kw = await body_of(request, CHAT_FIELDS)
        msgs = kw.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
        ids = llm.chat_prompt_ids(msgs)
        check_fits(len(ids))
        return await respond("create_chat_completion", kw, ids)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "edgespec"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "busy": busy() == len(pool),
                "slots": len(pool), "slots_busy": busy(), "queue": max(0, waiting["n"] - busy())}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.text(max(0, waiting["n"] - busy()))
        text += (f"# TYPE edgespec_slots gauge\nedgespec_slots {len(pool)}\n"
                 f"# TYPE edgespec_slots_busy gauge\nedgespec_slots_busy {busy()}\n")
        if batcher is not None:
            rows = batcher.rows / batcher.batches if batcher.batches else 0.0
            text += (f"# TYPE edgespec_batches_total counter\nedgespec_batches_total {batcher.batches}\n"
                     f"# TYPE edgespec_rows_per_batch gauge\nedgespec_rows_per_batch {rows:.3f}\n")
        return PlainTextResponse(text)

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    return app


def _pump(chunks, put, stop: threading.Event, release) -> None:
    """Run a streaming generation in this thread, chunk by chunk, until it ends or `stop`;
    `put` hands each (kind, item) to the response."""
    try:
        for chunk in chunks:
            put(("chunk", chunk))
            if stop.is_set():
                break
    except Exception as e:  # the stream has started: the error goes out as an event
        put(("error", one_line(e)))
    finally:
        chunks.close()
        release()
        put(("end", None))


def open_slots(target: str, spec: SpecConfig, parallel: int, n_ctx: int, threads: int | None):
    """(one SpeculativeLlama per slot, the Batcher or None): `parallel` slots of n_ctx tokens
    each on one llama.cpp context, their batch costs known before the first request."""
    from edgespec.runtime.api import SpeculativeLlama

    if parallel < 1:
        raise EdgespecError(f"--parallel must be >= 1, got {parallel}")
    if parallel == 1:
        # llama.cpp chooses the attention kernel, as for the batched slots below
        return [SpeculativeLlama(target, n_ctx=n_ctx, n_threads=threads, flash_attn=None,
                                 **asdict(spec))], None
    from edgespec.runtime.batching import Batcher
    from edgespec.runtime.drafters import reads_kv
    from edgespec.runtime.llama_target import LlamaTarget

    if reads_kv(spec.draft):
        raise EdgespecError("shared-KV heads read the target's keys and values one request at a "
                            "time; serve them with --parallel 1")
    if Path(str(target)).expanduser().is_dir():
        raise EdgespecError("--parallel > 1 runs GGUF targets on llama.cpp; serve an ONNX "
                            "target with --parallel 1")
    engine = LlamaTarget(target, n_ctx=n_ctx * parallel, n_threads=threads, n_seq=parallel,
                         lm_head=spec.lm_head)
    batcher = Batcher(engine, parallel)
    llms = [SpeculativeLlama(batcher.slot(i), **asdict(spec)) for i in range(parallel)]
    drafting = llms[0].drafter is not None
    for greedy in (True, False):
        batcher.prepare_cost(spec.draft_k(engine, greedy, drafting), greedy=greedy)
    return llms, batcher


def serve(target: str, spec: SpecConfig | None = None, host: str = "127.0.0.1", port: int = 8080,
          n_ctx: int = 4096, threads: int | None = None, api_key: str | None = None,
          max_queue: int = 8, parallel: int = 1) -> None:
    """Load the target and drafter, then serve until interrupted. n_ctx: per slot."""
    import uvicorn

    llms, batcher = open_slots(target, spec or SpecConfig(), parallel, n_ctx, threads)
    app = make_app(llms, llms[0].engine.spec.name, api_key=api_key, max_queue=max_queue,
                   batcher=batcher)
    uvicorn.run(app, host=host, port=port, log_level="warning")
