"""The HTTP routes (starlette): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, llama-server's
/health, /tokenize, /detokenize and /metrics. Handlers validate the request (schemas), hand one job to the
engine's queue and relay its events, as one JSON body or as SSE. Every failure is a JSON error body: a 4xx
for the client's mistakes, 503 while loading or when the queue is full, 500 (logged, never a traceback to
the client) for our own."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from streamer.chat import EMPTY_THINK
from streamer.server import metrics, schemas
from streamer.server.engine import Engine, Job, QueueFull, Result
from streamer.server.schemas import APIError, GenRequest, Limits
from streamer.server.text import render_chat, thinking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    alias: str = "model"
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)


class State:
    """The engine once loaded (None before), or the error that stopped the load."""

    def __init__(self):
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.closing = False
        self.created = int(time.time())


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(load: Callable[[], Engine], opts: ServerOptions, on_fatal: Callable[[BaseException], None] = None):
    """load() builds the Engine (opens the model); it runs in a background thread once the server is up, so
    /health answers 503 until it returns. If it raises, on_fatal(error) is called (the CLI stops the server)."""
    api = Api(load, opts, on_fatal)
    auth, public = api.endpoint, api.public
    routes = [
        Route("/health", public(api.health), methods=["GET"]),
        Route("/v1/health", public(api.health), methods=["GET"]),
        Route("/v1/models", auth(api.models), methods=["GET"]),
        Route("/models", auth(api.models), methods=["GET"]),
        Route("/v1/chat/completions", auth(api.chat), methods=["POST"]),
        Route("/chat/completions", auth(api.chat), methods=["POST"]),
        Route("/v1/completions", auth(api.completions), methods=["POST"]),
        Route("/completions", auth(api.completions), methods=["POST"]),
        Route("/tokenize", auth(api.tokenize), methods=["POST"]),
        Route("/detokenize", auth(api.detokenize), methods=["POST"]),
        Route("/metrics", auth(api.prometheus), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=api.lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = api.state
    return app


class Api:
    """The handlers over one State: each validates its request, then answers or runs a generation job."""

    def __init__(self, load: Callable[[], Engine], opts: ServerOptions, on_fatal=None):
        self.load, self.opts, self.on_fatal = load, opts, on_fatal
        self.state = State()

    def _loader(self) -> None:
        state = self.state
        try:
            engine = self.load()
        except BaseException as e:  # noqa: BLE001 - reported through on_fatal, never swallowed
            state.error = e
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        if state.closing:
            engine.close()
        else:
            state.engine = engine

    @asynccontextmanager
    async def lifespan(self, app):
        threading.Thread(target=self._loader, name="serve-loader", daemon=True).start()
        yield
        self.state.closing = True
        if self.state.engine is not None:
            await run_in_threadpool(self.state.engine.close)

    def endpoint(self, fn, public: bool = False):
        """fn as a route handler: the API key checked (unless public), errors as JSON bodies."""
        key = self.opts.api_key

        async def handler(request: Request):
            try:
                if key is not None and not public:
                    got = request.headers.get("authorization", "")
                    if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                        raise APIError(
                            401,
                            "invalid or missing API key (send 'Authorization: Bearer KEY')",
                            "authentication_error",
                            "invalid_api_key",
                        )
                return await fn(request)
            except APIError as e:
                return error_response(e)
            except Exception:  # our bug: logged, and a JSON 500 for the client
                log.error("request failed:\n%s", traceback.format_exc())
                return error_response(
                    APIError(500, "internal server error (see the server log)", "server_error", "internal_error")
                )

        return handler

    def public(self, fn):
        return self.endpoint(fn, public=True)

    async def _body(self, request: Request) -> dict:
        return await body_of(request, self.opts.limits.max_body_bytes)

    def engine(self) -> Engine:
        if self.state.engine is None:
            raise APIError(503, "Loading model", "unavailable_error", "loading")
        return self.state.engine

    # ---- plain endpoints ----
    async def health(self, request):
        if self.state.engine is None:
            return error_response(APIError(503, "Loading model", "unavailable_error", "loading"))
        return JSONResponse({"status": "ok"})

    async def models(self, request):
        e = self.state.engine
        meta = {"n_ctx": e.n_ctx, "n_vocab": e.n_vocab} if e is not None else {}
        model = {"id": self.opts.alias, "object": "model", "created": self.state.created, "owned_by": "stream-run"}
        return JSONResponse({"object": "list", "data": [{**model, "meta": meta}]})

    async def tokenize(self, request):
        body, eng = await self._body(request), self.engine()
        content = schemas.string(body, "content")
        if content is None:
            raise schemas.bad("'content' is required", "missing_field")
        add_special, pieces = schemas.boolean(body, "add_special"), schemas.boolean(body, "with_pieces")
        ids = await run_in_threadpool(eng.tok.encode if add_special else eng.tok.encode_raw, content)
        if not pieces:
            return JSONResponse({"tokens": ids})
        out = []
        for t in ids:
            b = eng.tok.token_bytes(t)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)  # part of a character: its bytes, as llama-server
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, request):
        body, eng = await self._body(request), self.engine()
        ids = schemas.token_ids(body.get("tokens", []), eng.n_vocab)
        return JSONResponse({"content": eng.tok.decode(ids)})

    async def prometheus(self, request):
        engine = self.state.engine
        return PlainTextResponse(metrics.render(engine, engine is not None), media_type="text/plain; version=0.0.4")

    # ---- generation ----
    async def chat(self, request):
        body, eng, lim = await self._body(request), self.engine(), self.opts.limits
        msgs = schemas.messages(body, lim)
        think = thinking(msgs, schemas.enable_thinking(body))
        params, com = schemas.chat_sampling(body, think), schemas.common(body, lim, eng.n_ctx)
        text = render_chat(msgs, think, eng.reply_memory())
        ids = await run_in_threadpool(eng.tok.encode_raw, text)
        check_context(eng, len(ids))
        req = GenRequest(
            ids=tuple(ids), params=params, text=text, think=think, head="" if think else EMPTY_THINK, **com
        )
        return await run_job(request, eng, req, ChatShape(self.opts.alias))

    async def completions(self, request):
        body, eng = await self._body(request), self.engine()
        p = schemas.prompt(body, eng.n_vocab)
        params, com = schemas.completion_sampling(body), schemas.common(body, self.opts.limits, eng.n_ctx)
        ids = await run_in_threadpool(eng.tok.encode, p) if isinstance(p, str) else p
        if not ids:
            raise schemas.bad("the prompt is empty")
        check_context(eng, len(ids))
        req = GenRequest(ids=tuple(ids), params=params, **com)
        return await run_job(request, eng, req, CompletionShape(self.opts.alias))


async def body_of(request: Request, limit: int) -> dict:
    """The request's JSON body, refused with a 413 past `limit` bytes (declared or streamed)."""
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", "invalid_request_error", "request_too_large"
    )
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise too_large
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large
        chunks.append(chunk)
    return schemas.parse_json(b"".join(chunks))


def check_context(eng: Engine, n: int) -> None:
    if n > eng.n_ctx:
        raise APIError(
            400,
            f"the prompt has {n} tokens, more than the context size {eng.n_ctx}",
            "invalid_request_error",
            "context_length_exceeded",
        )


async def run_job(request: Request, eng: Engine, req: GenRequest, shape):
    """Queue the generation and answer with its result (one JSON body) or its events (SSE)."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def emit(kind, payload):
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    job = Job(req, emit)
    try:
        eng.submit(job)
    except QueueFull as e:
        raise APIError(503, f"the server is busy: {e}; try again later", "unavailable_error", "queue_full") from None
    if req.stream:
        return SSEResponse(sse(events, job, req, shape), on_close=lambda: eng.cancel(job))
    try:
        return await collect(request, events, eng, job, shape)
    finally:
        eng.cancel(job)  # no-op once finished; stops it if this handler was cancelled


async def collect(request, events, eng, job, shape):
    """Wait for the job's result, checking every 0.25 s that the client is still there."""
    loop = asyncio.get_running_loop()
    checked = loop.time()
    while True:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=0.25)
        except TimeoutError:
            kind = payload = None
        if loop.time() - checked >= 0.25:
            checked = loop.time()
            if await request.is_disconnected():
                eng.cancel(job)
                return JSONResponse({}, status_code=499)  # nobody reads it
        if kind == "error":
            return error_response(payload)
        if kind == "done":
            return JSONResponse(shape.whole(payload))


async def sse(events, job, req, shape):
    if isinstance(shape, ChatShape):
        yield data(shape.chunk(role=True))
    while True:
        kind, payload = await events.get()
        if kind == "delta":
            yield data(shape.chunk(delta=payload))
        elif kind == "error":
            yield data(payload.body())
            break
        else:
            if payload.finish_reason == "cancelled":
                break
            yield data(shape.chunk(result=payload))
            if req.include_usage:
                yield data(shape.usage_chunk(payload))
            break
    yield "data: [DONE]\n\n"


async def http_error(request, exc: HTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    return error_response(
        APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind, str(exc.status_code))
    )


def data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events; on_close runs however the response ends (finished, client gone, shutdown)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # the client went away mid-write
            pass
        finally:
            self.on_close()


def _usage(r: Result) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }


def _timings(r: Result) -> dict:
    """llama-server's timings: cache_n reused, prompt_n prefilled, predicted_n generated."""
    return {
        "cache_n": r.cached_tokens,
        "prompt_n": r.prefilled,
        "prompt_ms": 1e3 * r.prompt_s,
        "prompt_per_second": r.prefilled / r.prompt_s if r.prompt_s > 0 else 0.0,
        "predicted_n": r.completion_tokens,
        "predicted_ms": 1e3 * r.gen_s,
        "predicted_per_second": (r.completion_tokens - 1) / r.gen_s if r.gen_s > 0 else 0.0,
    }


class _Shape:
    object = ""
    chunk_object = ""
    prefix = ""

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, r: Result) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": _usage(r)}


class ChatShape(_Shape):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def whole(self, r: Result) -> dict:
        msg = {"role": "assistant", "content": r.content}
        if r.reasoning:
            msg["reasoning_content"] = r.reasoning
        return {
            **self.head(self.object),
            "choices": [{"index": 0, "message": msg, "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": _usage(r),
            "timings": _timings(r),
        }

    def chunk(self, role: bool = False, delta=None, result: Result | None = None) -> dict:
        if role:
            d, finish = {"role": "assistant", "content": ""}, None
        elif delta is not None:
            reasoning, content = delta
            d = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
            finish = None
        else:
            d, finish = {}, result.finish_reason
        out = {
            **self.head(self.chunk_object),
            "choices": [{"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}],
        }
        if result is not None:
            out["usage"], out["timings"] = _usage(result), _timings(result)
        return out


class CompletionShape(_Shape):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def whole(self, r: Result) -> dict:
        return {
            **self.head(self.object),
            "choices": [{"index": 0, "text": r.content, "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": _usage(r),
            "timings": _timings(r),
        }

    def chunk(self, role: bool = False, delta=None, result: Result | None = None) -> dict:
        text = "" if delta is None else delta[1]
        out = {
            **self.head(self.chunk_object),
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": None if result is None else result.finish_reason,
                }
            ],
        }
        if result is not None:
            out["usage"], out["timings"] = _usage(result), _timings(result)
        return out
