# %% [markdown]
# # The OpenAI-compatible server: the app
#
# > The HTTP app around an `AsyncEngine`: chat and text completions (streamed over SSE or whole), backpressure, cancellation, models, health, metrics and the chat page.

# %% [markdown]
# Chapter 11 checked what comes in; this one turns a checked request into engine requests
# and relays their outputs, written as OpenAI's JSON by chapter 11f's `Reply`, whole or as
# server-sent events. The event loop only parses, checks, formats and waits: the engine thread
# (chapter 08a) does all model work.

# %%
#| default_exp server.app

# %%
#| export
# Why one module of ~650 lines: it is one concept, an HTTP request carried to the engine and back:
# the generation in flight, the streamed body, the server's state, its two guards (the 500 that keeps
# the connection, the browser check) and the routes call one another and share one state. The JSON it
# writes is chapter 11f's, what it reads chapter 11's.
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Sequence
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from forge_engine.async_engine import AsyncEngine, EngineDeadError
from forge_engine.engine import EngineStats, RequestOutput
from forge_engine.generate import SamplingParams
from forge_engine.grammar import GrammarError
from forge_engine.scheduler import QueueFullError
from forge_engine.server.chat_page import CHAT_PAGE, CHAT_PAGE_HEADERS
from forge_engine.server.metrics import ServerMetrics
from forge_engine.server.openapi import openapi_schema
from forge_engine.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    chat_prompt_ids,
    check_fields,
    choice_params,
    choices_asked,
    completion_prompt_ids,
    get_field,
    output_error,
    read_json,
    sampling_params,
    structured_output,
    submit_error,
    tool_request,
)
from forge_engine.server.replies import Reply, sse, whole_reply

logger = logging.getLogger("forge_engine.server")

# %%
#| hide
from fastapi.testclient import TestClient


# %% [markdown]
# ## One request in flight
#
# `Generation` submits a request and hands out its outputs, feeding the metrics on the way.
# Until the first output arrives, nothing has been sent to the client, so every failure
# (queue full, prompt refused, engine gone) can still become a proper HTTP status; after
# the first token, a failure can only be told inside the stream.
#
# **Cancellation.** A client that goes away must not keep the engine busy. While we wait
# for the first output (or for the whole reply, without streaming), `unless_disconnected`
# races the wait against the ASGI `http.disconnect` message. While streaming, Starlette
# itself listens for the disconnect and cancels the response's generator; cancelling the
# wait inside `AsyncEngine.stream` aborts the request, and `abandon()` makes sure of it and
# counts the abort. The engine thread reads its inbox before every step, so the KV blocks are
# back within one step.
#
# **Shutdown.** Every request in flight is in `live`. When the server shuts down it refuses
# new requests (503), gives the open ones a grace period, then `cut_off()` aborts the rest: a
# stream then ends properly, with a chunk whose `finish_reason` is `abort`, an error event
# saying the server shut down, and `[DONE]`; a whole reply becomes a 503.

# %%
#| export
class ClientGone(Exception):
    "The client disconnected before its reply began."


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable):
    "Await `awaitable`, but cancel it and raise ClientGone as soon as the client disconnects."
    work, gone = (
        asyncio.ensure_future(awaitable),
        asyncio.ensure_future(wait_for_disconnect(request)),
    )
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if (
            not work.done()
        ):  # the client went first: cancel the work and wait until it is cancelled (or done)
            work.cancel()
            await asyncio.wait((work,))
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    # (a gather of n choices, cancelled, ends with a CancelledError as its exception rather than cancelled)
    if work.cancelled() or isinstance(work.exception(), asyncio.CancelledError):
        raise ClientGone()
    return work.result()


class Generation:
    "One request in flight: submitted to the engine, its outputs counted in the metrics, aborted if abandoned."

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        live: set | None = None,
        grammar=None,
    ):
        self.engine, self.metrics, self.request_id = engine, metrics, request_id
        self._outputs = engine.stream(prompt_ids, params, request_id=request_id, grammar=grammar)
        self.last: RequestOutput | None = None
        self._tokens_at: float | None = None
        self.live = (
            live if live is not None else set()
        )  # the requests in flight, which shutdown cuts off
        self.submitted = self.was_cut_off = False

    async def next(self) -> RequestOutput:
        "The next output. Before the first, refusals and engine errors raise APIError."
        if self.last is None:
            self.live.add(self)
            self.submitted = True  # the first call submits, unless refused
        try:
            out = await anext(self._outputs)
        except (QueueFullError, EngineDeadError, ValueError) as e:
            self.live.discard(self)
            self.submitted = False
            raise submit_error(e) from None
        now = time.perf_counter()
        if self.last is None:
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        since = (
            now - self._tokens_at if self._tokens_at is not None and out.delta_token_ids else None
        )
        self.metrics.observe(out, since)
        if out.delta_token_ids:
            self._tokens_at = now
        first, self.last = self.last is None, out
        if out.finished:
            self.live.discard(self)
        if first and out.finish_reason == "error":
            raise output_error(out, self.engine)
        return out

    async def final(self, out: RequestOutput | None = None) -> RequestOutput:
        "The last output (from `out`, an output already taken, on)."
        out = out or await self.next()
        while not out.finished:
            out = await self.next()
        return out

    def abandon(self) -> None:
        "Nobody listens any more: abort the request unless it finished (its blocks come back within one step)."
        self.live.discard(self)
        if not self.submitted or (self.last is not None and self.last.finished):
            return
        try:
            self.engine.abort(self.request_id)
        except (
            ValueError
        ):  # its abort is through already: AsyncEngine.stream's, when the wait was cancelled
            pass
        self.submitted = False  # counted once
        self.metrics.requests.labels("abort").inc()

    def cut_off(self) -> None:
        "The server shuts down: abort this request; its stream then ends with finish_reason 'abort'."
        self.was_cut_off = True
        try:
            self.engine.abort(self.request_id)
        except ValueError:  # it finished meanwhile
            pass


async def first_outputs(generations: list[Generation]) -> list[RequestOutput]:
    """The first output of each of n choices. The first choice goes alone: its first output comes after its prompt's
    prefill, whose full blocks are then in the prefix cache, so the other choices compute only the rest."""
    first = await generations[0].next()
    return [first, *await asyncio.gather(*(g.next() for g in generations[1:]))]


async def final_outputs(generations: list[Generation]) -> list[RequestOutput]:
    "The last output of each of n choices, their prompt computed once (`first_outputs`)."
    firsts = await first_outputs(generations)
    return await asyncio.gather(*(g.final(out) for g, out in zip(generations, firsts)))


SHUTDOWN_ERROR = APIError(
    503, "the server is shutting down: this reply was cut off", code="server_shutting_down"
)


async def choice_outputs(
    generations: list[Generation], firsts: list[RequestOutput]
) -> AsyncIterator[list[tuple[int, RequestOutput | Exception]]]:
    """Batches of (choice index, its next output, or the exception that ended it) as they come, from the first
    outputs on. One choice is read directly; n choices through a task each, a batch being what arrived meanwhile."""
    if len(generations) == 1:
        out = firsts[0]
        while True:
            yield [(0, out)]
            if out.finished:
                return
            try:
                out = await generations[0].next()
            except Exception as e:  # (reported in the stream)
                yield [(0, e)]
                return
    arrived: asyncio.Queue = asyncio.Queue()

    async def follow(i: int) -> None:  # one choice's outputs into the queue
        out = firsts[i]
        try:
            while True:
                await arrived.put((i, out))
                if out.finished:
                    return
                out = await generations[i].next()
        except Exception as e:
            await arrived.put((i, e))

    followers = [asyncio.create_task(follow(i)) for i in range(len(generations))]
    try:
        while True:
            batch = [await arrived.get()]
            while not arrived.empty():
                batch.append(arrived.get_nowait())
            yield batch
    finally:
        for follower in followers:
            follower.cancel()


async def sse_events(
    replies: list[Reply],
    generations: list[Generation],
    firsts: list[RequestOutput],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The body of a streamed reply of one choice or n, from their first outputs on: each choice's chunks as its
    outputs come (interleaved, told apart by `index`; what arrived together goes out in one write), then the usage
    of all, then `[DONE]`."""
    finals: list[RequestOutput | None] = [None] * len(replies)
    outputs = choice_outputs(generations, firsts)
    try:
        if replies[0].kind == "chat":
            for reply in replies:
                yield sse(reply.role_chunk(include_usage))
        failed = False
        while None in finals and not failed:
            events = []
            for i, out in await anext(outputs):
                if isinstance(out, Exception):
                    error = APIError(500, f"{type(out).__name__}: {out}", code="internal_error")
                    events.append(sse(error.body()))
                    failed = True
                    break
                if (
                    out.finish_reason == "error"
                ):  # the status line is long gone: say it in the stream
                    events.append(sse(output_error(out, generations[i].engine).body()))
                    failed = True
                    break
                chunks = replies[i].chunks(out, include_usage, usage_chunk=len(replies) == 1)
                events += [sse(chunk) for chunk in chunks]
                if out.finish_reason == "abort" and generations[i].was_cut_off:
                    events.append(sse(SHUTDOWN_ERROR.body()))
                if out.finished:
                    finals[i] = out
            if events:
                yield "".join(events)
        if not failed and include_usage and len(replies) > 1:
            yield sse(replies[0].usage_chunk(finals))
        yield sse("[DONE]")
    finally:  # also on cancellation (the client disconnected) and when the generator is closed early
        await outputs.aclose()
        for generation in generations:
            generation.abandon()


# %% [markdown]
# ## The app
#
# `create_app` takes an engine that is already running (or None while a model loads: set
# `app.state.forge.engine` when it is ready) and wires the routes. `/v1/*` needs the API
# key when one is set (`Authorization: Bearer KEY`, the scheme in any case, the key compared
# in constant time); `/health`, `/metrics`, `/openapi.json` and the chat page do not. CORS
# headers are only sent for the origins named.
#
# **Web pages.** Without an API key, a server on loopback is still reachable by every web
# page the user visits: a page may POST to `http://127.0.0.1:8000` with `Content-Type:
# text/plain` (a "simple" request, no CORS preflight), and a page on a domain that resolves
# to 127.0.0.1 (DNS rebinding) is even same-origin with it. So without a key the server
# refuses (403) a `Host` header that is not `localhost`, `127.0.0.1`, `[::1]`, the bound
# address or one of `--allowed-hosts`, refuses (403) a request whose `Origin` is neither
# the server itself (the chat page) nor a `--cors-origin`, and wants (415) `Content-Type:
# application/json` on `POST /v1/*`, which a page can only send to another origin after a
# preflight the server does not grant.
#
# **Unexpected errors** become a 500 in OpenAI's shape, logged with their traceback. They are
# caught by a middleware that answers and returns normally: Starlette's own last-resort
# handler re-raises after answering, and uvicorn then drops the keep-alive connection without
# a `Connection: close`, so a pooling client's *next* request would fail.

# %%
#| export
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass
class ServerState:
    "What the HTTP side knows: the served model name, the engine once it is there, the limits and the metrics."

    model_name: str
    engine: AsyncEngine | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    load_error: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    allowed_hosts: frozenset[str] = (
        LOCAL_HOSTS  # Host header names (no port) answered without an API key
    )
    cors_origins: frozenset[str] = frozenset()
    live: set = field(default_factory=set)  # the Generations in flight
    shutting_down: bool = False

    def ready_engine(self) -> AsyncEngine:
        "The engine, or a 503 saying why there is none."
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if self.load_error is not None:
            raise APIError(503, self.load_error, code="engine_unavailable")
        if self.engine is None:
            raise APIError(
                503,
                f"model {self.model_name!r} is still loading; retry when GET /health says ok",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        if not self.engine.alive:
            why = (
                f"{type(self.engine.error).__name__}: {self.engine.error}"
                if self.engine.error
                else "it was closed"
            )
            raise APIError(503, f"the engine has stopped ({why})", code="engine_unavailable")
        return self.engine

    def model_card(self) -> dict:
        "An OpenAI model object, plus the loaded model's metadata from the registry once it is loaded."
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "forge-engine",
        }
        if self.engine is not None:
            card["max_model_len"] = self.engine.engine.max_model_len
            card.update(
                {k: v for k, v in self.engine.engine.loaded.metadata.items() if k not in card}
            )
        return card

    async def drain(self, grace: float) -> None:
        "Shut down: refuse new requests, give those in flight `grace` seconds, then cut the rest off."
        self.shutting_down = True
        deadline = time.monotonic() + grace
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            logger.warning(
                "cutting off %d request(s) still running after %.1f s", len(self.live), grace
            )
        for generation in list(self.live):
            generation.cut_off()

    def browser_error(self, scope: dict) -> APIError | None:
        "Without an API key: why a request that a web page could have made is refused (None: it is not)."
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        name = (
            host[1 : host.index("]")]
            if host.startswith("[") and "]" in host
            else host.rsplit(":", 1)[0]
        )
        if host and "*" not in self.allowed_hosts and name.lower() not in self.allowed_hosts:
            return APIError(
                403,
                f"Host {host[:100]!r} is not a name this server answers to without an API key (a page "
                f"on that domain could use it: DNS rebinding); start it with --allowed-hosts "
                f"{name[:100]} or with --api-key",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if (
            origin is not None
            and origin not in self.cors_origins
            and urlsplit(origin).netloc.lower() != host.lower()
        ):
            return APIError(
                403,
                f"requests from web pages at {origin[:100]!r} are refused: without an API key any page "
                f"could use this server; start it with --cors-origin {origin[:100]} or with --api-key",
                code="origin_not_allowed",
            )
        if scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return APIError(
                    415,
                    f"the body must be sent as 'Content-Type: application/json', not "
                    f"{media_type[:100] or 'without one'!r}",
                    code="unsupported_media_type",
                )
        return None

    def check_model(self, body: dict) -> None:
        model = get_field(body, "model", str)
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


def engine_stats_json(stats: EngineStats) -> dict:
    "The engine snapshot for the chat page's live panel."
    kv = stats.kv
    return {
        "running": stats.running,
        "waiting": stats.waiting,
        "steps": stats.steps,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": stats.tokens_per_s,
        "kv": {
            "hit_tokens": kv.hit_tokens,
            "query_tokens": kv.query_tokens,
            "total_blocks": kv.total_blocks,
            "used_blocks": kv.used_blocks,
            "cached_blocks": kv.cached_blocks,
            "free_blocks": kv.free_blocks,
            "usage": kv.usage,
            "prefix_hit_rate": kv.hit_rate,
        },
        "block_map": stats.block_map,
    }


async def complete(state: ServerState, request: Request, kind: str) -> Response:
    "POST /v1/chat/completions (kind 'chat') and /v1/completions ('text')."
    body = await read_json(request, state.max_body_bytes)
    engine = state.ready_engine()
    state.check_model(body)
    check_fields(body, kind)
    stream = get_field(body, "stream", bool, False)
    include_usage = stream and get_field(
        get_field(body, "stream_options", dict, {}), "include_usage", bool, False
    )
    tokenizer = engine.engine.loaded.tokenizer
    ids = await run_in_threadpool(
        chat_prompt_ids if kind == "chat" else completion_prompt_ids, tokenizer, body
    )
    try:
        ids = engine.engine.check_prompt(ids)  # reads constants only: safe off the engine thread
    except ValueError as e:
        raise submit_error(e) from None
    params = sampling_params(
        body, kind, len(ids), engine.engine.max_model_len, engine.engine.loaded.config.vocab_size
    )
    grammar = None
    if (
        params.structured is not None
    ):  # compiled off the event loop: a large schema takes a while (chapter 06a)
        try:
            start = time.perf_counter()
            grammar = await run_in_threadpool(engine.engine.compile_grammar, params.structured)
            state.metrics.grammar_time.observe(time.perf_counter() - start)
        except GrammarError as e:
            raise APIError(400, str(e), param=structured_output(body)[1] or "tools") from None
    n = choices_asked(body)
    tools = tool_request(body) if kind == "chat" else None
    replies = [Reply(kind, state.model_name, tokenizer, params.logprobs, tools)]
    replies += [
        Reply(kind, state.model_name, tokenizer, params.logprobs, tools, i, replies[0])
        for i in range(1, n)
    ]
    # n choices are n requests of the same prompt (its blocks shared through the prefix cache: `first_outputs`),
    # each with its own seed when one was given, so that seeded choices differ and repeat
    generations = [
        Generation(
            engine,
            state.metrics,
            ids,
            choice_params(params, i),
            replies[0].id if n == 1 else f"{replies[0].id}-{i}",
            state.live,
            grammar if i == 0 or grammar is None else grammar.deep_copy(),
        )
        for i in range(n)
    ]
    try:
        if not stream:
            outs = await unless_disconnected(request, final_outputs(generations))
            for out, generation in zip(outs, generations):
                if out.finish_reason == "error":
                    raise output_error(out, engine)
                if out.finish_reason == "abort" and generation.was_cut_off:
                    raise SHUTDOWN_ERROR
            return JSONResponse(whole_reply(replies, outs))
        firsts = await unless_disconnected(request, first_outputs(generations))
    except ClientGone:
        for generation in generations:
            generation.abandon()
        return Response(status_code=499)  # nobody reads it
    except APIError:
        for generation in generations:  # (one choice refused: the others are not wanted either)
            generation.abandon()
        raise
    return StreamingResponse(
        sse_events(replies, generations, firsts, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class CatchAll:
    "ASGI middleware: an exception before the response began becomes a 500 in OpenAI's shape, the connection kept."

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started or scope["type"] != "http":
                raise  # half a response: only closing the connection tells
            logger.exception("internal error on %s %s", scope["method"], scope["path"])
            await APIError(
                500, f"internal error: {type(e).__name__}: {e}"[:500], code="internal_error"
            ).response()(scope, receive, send)


class BrowserGuard:
    "ASGI middleware: `ServerState.browser_error` refusals, when no API key is set."

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.state.api_key is None
            and (e := self.state.browser_error(scope))
        ):
            return await e.response()(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(
    engine: AsyncEngine | None,
    model_name: str,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: Sequence[str] = (),
) -> FastAPI:
    """The HTTP app around a running `AsyncEngine` (None while it loads: set `app.state.forge.engine` later).
    `allowed_hosts`: Host names answered without an API key besides localhost, 127.0.0.1 and ::1 ('*': any)."""
    state = ServerState(
        model_name,
        engine,
        api_key or None,
        max_body_bytes,
        allowed_hosts=LOCAL_HOSTS | {h.lower().strip("[]") for h in allowed_hosts},
        cors_origins=frozenset(cors_origins),
    )
    app = FastAPI(title="forge-engine", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.forge = state

    def openapi() -> dict:
        "The schema, with the loaded model's vocabulary and context once it is there."
        e = state.engine.engine if state.engine is not None else None
        return openapi_schema(
            model_name,
            max_body_bytes,
            e and e.loaded.config.vocab_size,
            e and e.max_model_len,
            api_key=state.api_key is not None,
        )

    app.openapi = openapi
    app.add_middleware(CatchAll)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(BrowserGuard, state=state)

    async def api_error(request, e: APIError):
        return e.response()

    async def http_error(request, e: HTTPException):
        message = {
            404: f"no route {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return APIError(e.status_code, message[:300], headers=e.headers).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)

    async def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (
            scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), state.api_key.encode())
        ):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await complete(state, request, "chat")

    @v1.post("/completions")
    async def completions(request: Request):
        return await complete(state, request, "text")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        state.check_model({"model": model})
        return state.model_card()

    @v1.get("/engine/stats")
    async def engine_stats():
        return engine_stats_json(state.ready_engine().stats())

    app.include_router(v1)

    @app.get("/health")
    async def health():
        try:
            state.ready_engine()
        except APIError as e:
            status = "loading" if e.code == "model_loading" else "unavailable"
            return JSONResponse({"status": status, "message": e.message}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        stats = state.engine.stats() if state.engine is not None else None
        return Response(state.metrics.exposition(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def chat_page():
        return HTMLResponse(CHAT_PAGE, headers=CHAT_PAGE_HEADERS)

    return app


# %% [markdown]
# Without an engine yet (the model still loading), the app already answers: `/health` is
# 503 until the engine is there, `/v1/*` too, and errors keep OpenAI's shape. FastAPI's
# `TestClient` calls the app in-process, no socket needed:

# %%
loading = TestClient(
    create_app(None, "qwen3-tiny", api_key="secret", cors_origins=["http://localhost:3000"])
)
r = loading.get("/health")
assert r.status_code == 503 and r.json()["status"] == "loading"
r = loading.post(
    "/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer secret"}
)
assert (
    r.status_code == 503
    and r.json()["error"]["code"] == "model_loading"
    and r.headers["retry-after"] == "5"
)
assert loading.get("/v1/models").status_code == 401  # no key
assert (
    loading.get("/v1/models", headers={"Authorization": "Bearer nope"}).json()["error"]["code"]
    == "invalid_api_key"
)
assert (
    loading.get("/v1/models", headers={"Authorization": "Bearer secret"}).json()["data"][0]["id"]
    == "qwen3-tiny"
)
assert loading.get("/nothing/here").json()["error"]["message"] == "no route GET /nothing/here"
r = loading.post(
    "/v1/completions",
    content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1),
    headers={"Authorization": "Bearer secret"},
)
assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
r = loading.post(
    "/v1/completions", content=b"{not json", headers={"Authorization": "Bearer secret"}
)
assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
page = loading.get("/")
assert (
    page.headers["content-security-policy"].startswith("default-src 'none'")
    and 'id="stop"' in page.text
)
cors = loading.options(
    "/v1/models",
    headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "GET"},
)
assert cors.headers["access-control-allow-origin"] == "http://localhost:3000"
plain = TestClient(
    create_app(None, "m"), base_url="http://localhost"
)  # without a key: only local Host names
assert (
    "access-control-allow-origin"
    not in plain.get("/health", headers={"Origin": "http://localhost:3000"}).headers
)
assert plain.get("/v1/models").status_code == 200  # no key set: none needed

assert (
    loading.get("/v1/models", headers={"Authorization": "bearer secret"}).status_code == 200
)  # any case of the scheme
schema = loading.get("/openapi.json").json()
assert schema["openapi"].startswith("3.1") and "/v1/chat/completions" in schema["paths"]
assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]

# %% [markdown]
# Without an API key, what a web page could send is refused, and the chat page's own
# requests (same origin, JSON) are not:

# %%
local = TestClient(
    create_app(None, "m", cors_origins=["http://localhost:5173"], allowed_hosts=["forge.lan"]),
    base_url="http://127.0.0.1:8000",
)
r = local.post(
    "/v1/chat/completions", content=b'{"messages": []}', headers={"Content-Type": "text/plain"}
)
assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
r = local.post("/v1/chat/completions", json={}, headers={"Origin": "http://evil.test"})
assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
r = local.get(
    "/health", headers={"Host": "evil.test:8000"}
)  # DNS rebinding: evil.test resolves to 127.0.0.1
assert (
    r.status_code == 403
    and r.json()["error"]["code"] == "host_not_allowed"
    and "--allowed-hosts evil.test" in r.text
)
for host in ["localhost:8000", "127.0.0.1", "[::1]:8000", "forge.lan:8000", "LOCALHOST"]:
    assert local.get("/v1/models", headers={"Host": host}).status_code == 200, host
assert (
    local.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://127.0.0.1:8000"}
    ).status_code
    == 503
)
assert (
    local.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://localhost:5173"}
    ).status_code
    == 503
)
assert (
    TestClient(create_app(None, "m", allowed_hosts=["*"]))
    .get("/health", headers={"Host": "a.b"})
    .status_code
    == 503
)

# %% [markdown]
# An unexpected exception is a 500 in OpenAI's shape, and the connection stays usable (the
# real-socket side of that is tested in chapter 11d):

# %%
broken = create_app(None, "m")


@broken.get("/boom")
async def boom():
    raise RuntimeError("kaboom")


r = TestClient(broken, base_url="http://localhost").get("/boom")
assert r.status_code == 500 and r.json()["error"] == {
    "message": "internal error: RuntimeError: kaboom",
    "type": "server_error",
    "param": None,
    "code": "internal_error",
}
