# %% [markdown]
# # The OpenAI-compatible server
#
# > HTTP in, engine requests out: chat and text completions (streamed over SSE or whole), backpressure, cancellation, Prometheus metrics and a browser chat.

# %% [markdown]
# People already have tools that speak OpenAI's HTTP API: the `openai` Python client, curl,
# chat UIs. This chapter puts the engine behind that API. The server is a translator, and
# it must never do the engine's work: the HTTP event loop serves hundreds of connections,
# and one forward pass on it would freeze them all. So the flow of one request is
#
# ```
# HTTP POST ─► read the JSON body (bounded) ─► check key, model, parameters
#           ─► chat template + tokenizer (thread pool) ─► AsyncEngine.submit ──inbox──► engine thread
#                                                                       (schedule, run, sample, detokenize)
#  JSON or SSE ◄─ one RequestOutput per step ◄── per-request outbox ◄── call_soon_threadsafe
# ```
#
# The engine thread (chapter 08a) owns the model, the KV cache and the scheduler; the event
# loop only parses, checks, formats and waits. Everything a client can get wrong is refused
# *before* the engine sees it, with an OpenAI-style error object and the right HTTP status.

# %%
#| default_exp server

# %%
#| export
from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Sequence

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from forge_engine.async_engine import AsyncEngine, EngineDeadError
from forge_engine.config import EngineConfig
from forge_engine.engine import EngineStats, LLMEngine, RequestOutput
from forge_engine.generate import SamplingParams
from forge_engine.llm import load_model_over
from forge_engine.loader import add_memory_budget_flag, add_quantization_flag, pick_model
from forge_engine.scheduler import QueueFullError
from forge_engine.tokenizer import Tokenizer

logger = logging.getLogger("forge_engine.server")

# %%
#| hide
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

# %% [markdown]
# ## Errors the way OpenAI writes them
#
# Every error is `{"error": {"message", "type", "param", "code"}}` with an HTTP status the
# `openai` client maps to an exception class: 400 `BadRequestError`, 401
# `AuthenticationError`, 404 `NotFoundError`, 413, 429 `RateLimitError` (it also honours
# `Retry-After`), 500 and 503 (`InternalServerError`; the client retries those). The
# message says what was wrong and, where there are numbers, both of them.

# %%
#| export
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    "An error for the client: an HTTP status and OpenAI's error object."
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def submit_error(e: Exception) -> APIError:
    "What an exception raised by submitting a request means to the client."
    if isinstance(e, QueueFullError):  # backpressure: come back later rather than queue without bound
        return APIError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, ValueError):
        too_long = "context holds" in str(e) or "KV pool holds" in str(e)
        return APIError(400, str(e), param="messages" if too_long else None,
                        code="context_length_exceeded" if too_long else None)
    return APIError(500, f"{type(e).__name__}: {e}", code="internal_error")


def output_error(out: RequestOutput, engine: AsyncEngine) -> APIError:
    "The error of an output that finished with finish_reason 'error'."
    kind, _, message = (out.error or "unknown error").partition(": ")
    if kind in ("QueueFullError", "ValueError"):  # refused on the engine thread: the same as refused at submit
        return submit_error(QueueFullError(message) if kind == "QueueFullError" else ValueError(message))
    dead = not engine.alive or (out.error or "").startswith("the engine")
    return APIError(503 if dead else 500, out.error or "unknown error", code="engine_unavailable" if dead else "internal_error")


# %%
e = submit_error(QueueFullError("waiting queue is full (4 of 4 requests)"))
assert e.status == 429 and e.headers == {"Retry-After": "1"} and e.body()["error"]["type"] == "rate_limit_error"
e = submit_error(ValueError("prompt has 5000 tokens; the context holds 4096 (prompt + at least 1 new token)"))
assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages")
assert submit_error(EngineDeadError("gone")).status == 503
assert set(APIError(404, "no such model").body()["error"]) == {"message", "type", "param", "code"}

# %% [markdown]
# ## Reading a request
#
# The body is read in pieces and refused (413) as soon as it passes the limit, so a client
# cannot make the server buffer gigabytes. Then each field is checked for its JSON type;
# JSON `null` counts as absent, as OpenAI treats it. Fields the engine cannot honour
# (`n` > 1, `echo`, tools, JSON mode) are refused, not silently ignored: a client that asked
# for three choices and got one would be wrong without knowing it. `ignore_eos`,
# `min_tokens` and `stop_token_ids` are vLLM's extras, handy for benchmarks.

# %%
#| export
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


async def read_json(request: Request, limit: int) -> dict:
    "The request body as a JSON object; 413 as soon as it passes `limit` bytes, 400 if it is not a JSON object."
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {int(declared)} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list", dict: "an object"}


def get_field(body: dict, name: str, kind: type, default=None):
    "`body[name]` checked to be of `kind` (absent or null: `default`); a 400 naming the field otherwise."
    value = body.get(name)
    if value is None: return default
    ok = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise APIError(400, f"'{name}' must be {_KIND_NAMES[kind]}, got {json.dumps(value)[:40]}", param=name)
    return value


UNSUPPORTED = {  # field -> the values accepted (its defaults); anything else is refused, never ignored
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],),
    "response_format": ({"type": "text"},),
}
SAMPLING_FIELDS = {  # request fields that are SamplingParams fields of the same name
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "presence_penalty": float,
    "frequency_penalty": float, "repetition_penalty": float, "seed": int,
    "ignore_eos": bool, "min_tokens": int, "stop_token_ids": list,  # vLLM's extras
}


def sampling_params(body: dict, kind: str, prompt_len: int, max_model_len: int, vocab_size: int) -> SamplingParams:
    "SamplingParams for an OpenAI request body (`kind`: 'chat' or 'text'); a 400 naming the field on bad input."
    for name, accepted in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in accepted:
            raise APIError(400, f"{name}={json.dumps(body[name])[:40]} is not supported; this server "
                                f"only does {name}={json.dumps(accepted[0])}", param=name)
    options = {name: value for name, t in SAMPLING_FIELDS.items() if (value := get_field(body, name, t)) is not None}
    room = max_model_len - prompt_len
    max_tokens = get_field(body, "max_completion_tokens", int, get_field(body, "max_tokens", int))
    if max_tokens is None:  # OpenAI's defaults: the rest of the context for chat, 16 tokens for text
        max_tokens = room if kind == "chat" else min(16, room)
    elif max_tokens > room:
        raise APIError(400, f"this model's context holds {max_model_len} tokens; the prompt has {prompt_len}, "
                            f"so at most {room} more fit, but max_tokens asks for {max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise APIError(400, f"'stop' must be a string or a list of strings, got {json.dumps(stop)[:40]}", param="stop")
    bias = get_field(body, "logit_bias", dict)
    if bias:
        try:
            options["logit_bias"] = {int(t): float(b) for t, b in bias.items()}
        except (TypeError, ValueError):
            raise APIError(400, "'logit_bias' must map token ids to numbers", param="logit_bias") from None
        if bad := [t for t in options["logit_bias"] if not 0 <= t < vocab_size]:
            raise APIError(400, f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
    if kind == "chat":  # chat: logprobs is a switch, top_logprobs the count; text: logprobs is the count
        top = get_field(body, "top_logprobs", int)
        if get_field(body, "logprobs", bool, False): options["logprobs"] = top or 0
        elif top is not None: raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        options["logprobs"] = get_field(body, "logprobs", int)
    try:
        return SamplingParams(max_tokens=max_tokens, stop=stop, **options)
    except ValueError as e:  # SamplingParams names the bad field: "invalid sampling parameter top_p=..."
        name = re.match(r"invalid sampling parameter (\w+)", str(e))
        raise APIError(400, str(e), param=name.group(1) if name else None) from None


# %%
p = sampling_params({"temperature": 0, "max_tokens": 5, "stop": "\n", "logit_bias": {"42": -100}}, "chat", 10, 100, 500)
assert (p.temperature, p.max_tokens, p.stop, p.logit_bias, p.logprobs) == (0, 5, ["\n"], {42: -100.0}, None)
assert sampling_params({}, "chat", 10, 100, 500).max_tokens == 90 and sampling_params({}, "text", 10, 100, 500).max_tokens == 16
assert sampling_params({"logprobs": True, "top_logprobs": 3}, "chat", 1, 100, 500).logprobs == 3
assert sampling_params({"logprobs": 2, "max_completion_tokens": 7}, "text", 1, 100, 500).logprobs == 2


def refused(body, kind="chat"):
    with pytest.raises(APIError) as info: sampling_params(body, kind, 10, 100, 500)
    return info.value


assert refused({"n": 2}).param == "n" and "only does n=1" in refused({"n": 2}).message
assert refused({"temperature": "hot"}).message == "'temperature' must be a number, got \"hot\""
assert refused({"top_p": 0}).param == "top_p"  # SamplingParams' own check, mapped to its field
e = refused({"max_tokens": 200})
assert e.status == 400 and "holds 100 tokens" in e.message and "has 10" in e.message and "asks for 200" in e.message
assert refused({"logit_bias": {"900": 1}}).param == "logit_bias"
assert refused({"top_logprobs": 2}).param == "top_logprobs"
assert refused({"tools": [{"type": "function"}]}).param == "tools"


# %% [markdown]
# The prompt: a chat request goes through the model's chat template; a text completion
# takes a string or a list of token ids (one prompt per request, like `n`).

# %%
#| export
def chat_prompt_ids(tokenizer: Tokenizer | None, body: dict) -> list[int]:
    "Token ids of the templated conversation in `body['messages']`."
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: send token ids to /v1/completions",
                       param="messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    try:
        return tokenizer.encode_chat(messages)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None


def completion_prompt_ids(tokenizer: Tokenizer | None, body: dict) -> list[int]:
    "Token ids of `body['prompt']`: a string, a list of token ids, or a list holding one of those."
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)): prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                   param="prompt")


# %% [markdown]
# ## Writing the reply
#
# A reply is either one JSON object (`stream: false`), or a stream of *server-sent events*:
# each event is a line `data: <json>` and a blank line, and the stream ends with
# `data: [DONE]`. `json.dumps` escapes newlines, so one line per event is always enough. For
# a chat the chunks are: the role, one chunk per engine output that added text, a chunk with
# the `finish_reason`, and, when `stream_options.include_usage` is set, a last chunk with no
# choices and the `usage`.

# %%
#| export
def sse(data: dict | str) -> str:
    "One server-sent event."
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Reply:
    "OpenAI JSON for the outputs of one request: a chat completion (`kind='chat'`) or a text completion ('text')."
    def __init__(self, kind: str, model: str, tokenizer: Tokenizer | None, top_logprobs: int | None = None):
        self.kind, self.model, self.tokenizer, self.top_logprobs = kind, model, tokenizer, top_logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, streamed: bool) -> dict:
        obj = ("chat.completion.chunk" if streamed else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str, finish_reason: str | None, logprobs: dict | None, streamed: bool,
                role: bool = False) -> dict:
        if self.kind == "text":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not streamed: message = {"role": "assistant", "content": text}
        else: message = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
        return {"index": 0, "delta" if streamed else "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def logprobs(self, out: RequestOutput, start: int) -> dict | None:
        "Log-probabilities of `out.token_ids[start:]`, shaped as this kind of reply wants them."
        if self.top_logprobs is None or out.logprobs is None: return None
        rows = []
        for token, alternatives in zip(out.token_ids[start:], out.logprobs[start:]):
            top = sorted(alternatives.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            rows.append((self.token_text(token), alternatives[token], [(self.token_text(t), lp) for t, lp in top]))
        if self.kind == "text":
            return {"tokens": [s for s, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                    "top_logprobs": [dict(top) for _, _, top in rows]}
        entry = lambda s, lp: {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(s, lp), "top_logprobs": [entry(*a) for a in top]} for s, lp, top in rows]}

    def usage(self, out: RequestOutput) -> dict:
        n, m = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def whole(self, out: RequestOutput) -> dict:
        "The reply to a request with stream=false, from its final output."
        return {**self._head(False), "choices": [self._choice(out.text, out.finish_reason, self.logprobs(out, 0), False)],
                "usage": self.usage(out)}

    def role_chunk(self, include_usage: bool) -> dict:
        return {**self._head(True), "choices": [self._choice("", None, None, True, role=True)],
                **({"usage": None} if include_usage else {})}

    def chunks(self, out: RequestOutput, include_usage: bool) -> list[dict]:
        "The stream chunks one output adds: its new text, then (when it is the last) the finish reason and usage."
        head, usage = self._head(True), {"usage": None} if include_usage else {}
        start = len(out.token_ids) - len(out.delta_token_ids)
        logprobs = self.logprobs(out, start) if out.delta_token_ids else None
        chunks = []
        if out.delta_text or logprobs:
            chunks.append({**head, "choices": [self._choice(out.delta_text, None, logprobs, True)], **usage})
        if out.finished:
            chunks.append({**head, "choices": [self._choice("", out.finish_reason, None, True)], **usage})
            if include_usage: chunks.append({**head, "choices": [], "usage": self.usage(out)})
        return chunks


# %%
out = RequestOutput("r", None, [1, 2, 3], "Hi there", [7, 8], finished=True, finish_reason="stop",
                    delta_text=" there", delta_token_ids=[8], logprobs=[{7: -0.1, 9: -3.0}, {8: -0.5, 7: -1.5, 9: -2.0}])
chat = Reply("chat", "m", None, top_logprobs=1)
whole = chat.whole(out)
assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
assert whole["choices"][0]["logprobs"]["content"][1] == {"token": "8", "logprob": -0.5, "bytes": [56],
                                                          "top_logprobs": [{"token": "8", "logprob": -0.5, "bytes": [56]}]}
text, finish, usage = chat.chunks(out, include_usage=True)
assert text["choices"][0]["delta"] == {"content": " there"} and text["usage"] is None
assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
completion = Reply("text", "m", None, top_logprobs=2).whole(out)
assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == "Hi there"
assert completion["choices"][0]["logprobs"]["top_logprobs"][1] == {"8": -0.5, "7": -1.5}
assert sse({"a": "line\nbreak"}) == 'data: {"a": "line\\nbreak"}\n\n' and sse("[DONE]") == "data: [DONE]\n\n"

# %% [markdown]
# ## Metrics
#
# `/metrics` speaks Prometheus' text format. Latencies are histograms (so a dashboard can
# read p50 and p99), token and request counts are counters (they only grow), and the
# engine's load is a set of gauges read from its stats snapshot at scrape time. Each server
# has its own registry: no process-global state, so two apps in one process (a notebook,
# the tests) do not mix their numbers.

# %%
#| export
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    "The Prometheus metrics of one server, in a registry of its own."
    def __init__(self):
        self.registry = r = CollectorRegistry()
        histogram = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = histogram("forge_time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("forge_inter_token_latency_seconds", "Time between two outputs of one request.")
        self.e2e = histogram("forge_e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("forge_request_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = Counter("forge_prompt_tokens", "Prompt tokens of requests that started generating.",
                                     registry=r)
        self.generation_tokens = Counter("forge_generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter("forge_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS: self.requests.labels(reason)  # every series exists from the start
        self.running = Gauge("forge_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge("forge_requests_waiting", "Requests queued for admission.", registry=r)
        self.kv_used = Gauge("forge_kv_cache_used_blocks", "KV blocks held by requests.", registry=r)
        self.kv_usage = Gauge("forge_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", registry=r)
        self.prefix_hit_rate = Gauge("forge_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
                                     registry=r)

    def observe(self, out: RequestOutput, since_last_tokens: float | None) -> None:
        "One output of a request; `since_last_tokens`: seconds since its previous output with tokens."
        if out.delta_token_ids:
            self.generation_tokens.inc(len(out.delta_token_ids))
            if since_last_tokens is not None: self.itl.observe(since_last_tokens)
        if out.finished:
            self.requests.labels(out.finish_reason).inc()
            for histogram, key in ((self.queue, "queue_s"), (self.ttft, "ttft_s"), (self.e2e, "e2e_s")):
                if key in out.metrics: histogram.observe(out.metrics[key])

    def exposition(self, stats: EngineStats | None) -> bytes:
        "The text format, with the gauges read from `stats` (None: the engine is not there yet)."
        if stats is not None:
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
            self.kv_used.set(stats.kv.used_blocks)
            self.kv_usage.set(stats.kv.usage)
            self.prefix_hit_rate.set(stats.kv.hit_rate)
        return generate_latest(self.registry)


# %%
metrics = ServerMetrics()
metrics.observe(RequestOutput("a", None, [1], "", [5], delta_token_ids=[5]), None)
metrics.observe(RequestOutput("a", None, [1], "", [5, 6], finished=True, finish_reason="length", delta_token_ids=[6],
                              metrics={"queue_s": 0.01, "ttft_s": 0.2, "e2e_s": 0.3}), 0.05)
families = {f.name: f for f in text_string_to_metric_families(metrics.exposition(None).decode())}
assert families["forge_generation_tokens"].type == "counter" and families["forge_generation_tokens"].samples[0].value == 2
assert families["forge_time_to_first_token_seconds"].type == "histogram"
assert families["forge_requests_running"].type == "gauge"
by_reason = {s.labels["finish_reason"]: s.value for s in families["forge_requests"].samples if s.name.endswith("_total")}
assert by_reason == {"stop": 0, "length": 1, "abort": 0, "error": 0}
itl_count = [s.value for s in families["forge_inter_token_latency_seconds"].samples if s.name.endswith("_count")]
assert itl_count == [1]


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
# wait inside `AsyncEngine.stream` aborts the request, and `abandon()` makes sure of it. The
# engine thread reads its inbox before every step, so the KV blocks are back within one step.

# %%
#| export
class ClientGone(Exception):
    "The client disconnected before its reply began."


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect": pass


async def unless_disconnected(request: Request, awaitable: Awaitable):
    "Await `awaitable`, but cancel it and raise ClientGone as soon as the client disconnects."
    work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done(): work.cancel()
    if work.cancelled(): raise ClientGone()
    return work.result()


class Generation:
    "One request in flight: submitted to the engine, its outputs counted in the metrics, aborted if abandoned."
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompt_ids: list[int], params: SamplingParams,
                 request_id: str):
        self.engine, self.metrics, self.request_id = engine, metrics, request_id
        self._outputs = engine.stream(prompt_ids, params, request_id=request_id)
        self.last: RequestOutput | None = None
        self._tokens_at: float | None = None

    async def next(self) -> RequestOutput:
        "The next output. Before the first, refusals and engine errors raise APIError."
        try:
            out = await anext(self._outputs)  # the first call submits
        except (QueueFullError, EngineDeadError, ValueError) as e:
            raise submit_error(e) from None
        now = time.perf_counter()
        if self.last is None: self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        since = now - self._tokens_at if self._tokens_at is not None and out.delta_token_ids else None
        self.metrics.observe(out, since)
        if out.delta_token_ids: self._tokens_at = now
        first, self.last = self.last is None, out
        if first and out.finish_reason == "error": raise output_error(out, self.engine)
        return out

    async def final(self) -> RequestOutput:
        out = await self.next()
        while not out.finished: out = await self.next()
        return out

    def abandon(self) -> None:
        "Nobody listens any more: abort the request unless it finished (its blocks come back within one step)."
        if self.last is not None and self.last.finished: return
        try:
            self.engine.abort(self.request_id)
            was_queued = True
        except ValueError:  # unknown to the engine: never queued, or its abort is already through
            was_queued = self.last is not None
        if was_queued: self.metrics.requests.labels("abort").inc()


async def sse_events(reply: Reply, generation: Generation, first: RequestOutput, include_usage: bool) -> AsyncIterator[str]:
    "The body of a streamed reply, from its first output on."
    out = first
    try:
        if reply.kind == "chat": yield sse(reply.role_chunk(include_usage))
        while True:
            if out.finish_reason == "error":  # the status line is long gone: report it in the stream
                yield sse(output_error(out, generation.engine).body())
                break
            for chunk in reply.chunks(out, include_usage): yield sse(chunk)
            if out.finished: break
            out = await generation.next()
        yield sse("[DONE]")
    finally:  # also on cancellation (the client disconnected) and when the generator is closed early
        generation.abandon()


# %% [markdown]
# ## The app
#
# `create_app` takes an engine that is already running (or None while a model loads: set
# `app.state.forge.engine` when it is ready) and wires the routes. `/v1/*` needs the API
# key when one is set (compared in constant time); `/health`, `/metrics` and the chat page
# do not. CORS headers are only sent for the origins named.

# %%
#| export
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

    def ready_engine(self) -> AsyncEngine:
        "The engine, or a 503 saying why there is none."
        if self.load_error is not None: raise APIError(503, self.load_error, code="engine_unavailable")
        if self.engine is None:
            raise APIError(503, f"model {self.model_name!r} is still loading; retry when GET /health says ok",
                           code="model_loading", headers={"Retry-After": "5"})
        if not self.engine.alive:
            why = f"{type(self.engine.error).__name__}: {self.engine.error}" if self.engine.error else "it was closed"
            raise APIError(503, f"the engine has stopped ({why})", code="engine_unavailable")
        return self.engine

    def model_card(self) -> dict:
        "An OpenAI model object, plus the loaded model's metadata from the registry once it is loaded."
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "forge-engine"}
        if self.engine is not None:
            card["max_model_len"] = self.engine.engine.max_model_len
            card.update({k: v for k, v in self.engine.engine.loaded.metadata.items() if k not in card})
        return card

    def check_model(self, body: dict) -> None:
        model = get_field(body, "model", str)
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def engine_stats_json(stats: EngineStats) -> dict:
    "The engine snapshot for the chat page's live panel."
    kv = stats.kv
    return {"running": stats.running, "waiting": stats.waiting, "steps": stats.steps,
            "generated_tokens": stats.generated_tokens, "tokens_per_s": stats.tokens_per_s,
            "kv": {"total_blocks": kv.total_blocks, "used_blocks": kv.used_blocks, "cached_blocks": kv.cached_blocks,
                   "free_blocks": kv.free_blocks, "usage": kv.usage, "prefix_hit_rate": kv.hit_rate},
            "block_map": stats.block_map}


async def complete(state: ServerState, request: Request, kind: str) -> Response:
    "POST /v1/chat/completions (kind 'chat') and /v1/completions ('text')."
    body = await read_json(request, state.max_body_bytes)
    engine = state.ready_engine()
    state.check_model(body)
    get_field(body, "user", str)
    stream = get_field(body, "stream", bool, False)
    include_usage = stream and get_field(get_field(body, "stream_options", dict, {}), "include_usage", bool, False)
    tokenizer = engine.engine.loaded.tokenizer
    ids = await run_in_threadpool(chat_prompt_ids if kind == "chat" else completion_prompt_ids, tokenizer, body)
    try:
        ids = engine.engine.check_prompt(ids)  # reads constants only: safe off the engine thread
    except ValueError as e:
        raise submit_error(e) from None
    params = sampling_params(body, kind, len(ids), engine.engine.max_model_len, engine.engine.loaded.config.vocab_size)
    reply = Reply(kind, state.model_name, tokenizer, params.logprobs)
    generation = Generation(engine, state.metrics, ids, params, reply.id)
    try:
        if not stream:
            out = await unless_disconnected(request, generation.final())
            if out.finish_reason == "error": raise output_error(out, engine)
            return JSONResponse(reply.whole(out))
        first = await unless_disconnected(request, generation.next())
    except ClientGone:
        generation.abandon()
        return Response(status_code=499)  # nobody reads it
    return StreamingResponse(sse_events(reply, generation, first, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(engine: AsyncEngine | None, model_name: str, api_key: str | None = None,
               cors_origins: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    "The HTTP app around a running `AsyncEngine` (None while it loads: set `app.state.forge.engine` later)."
    state = ServerState(model_name, engine, api_key or None, max_body_bytes)
    app = FastAPI(title="forge-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.forge = state
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    async def api_error(request, e: APIError): return e.response()
    async def http_error(request, e: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return APIError(e.status_code, message).response()
    async def unexpected(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").response()
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)

    async def require_key(request: Request) -> None:
        if state.api_key is None: return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request): return await complete(state, request, "chat")

    @v1.post("/completions")
    async def completions(request: Request): return await complete(state, request, "text")

    @v1.get("/models")
    async def models(): return {"object": "list", "data": [state.model_card()]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        state.check_model({"model": model})
        return state.model_card()

    @v1.get("/engine/stats")
    async def engine_stats(): return engine_stats_json(state.ready_engine().stats())

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
    async def chat_page(): return HTMLResponse(CHAT_PAGE, headers=CHAT_PAGE_HEADERS)

    return app


# %% [markdown]
# ## The browser chat
#
# One static page at `/`: a conversation, a box to type in, *Stop*, the reply's tokens per
# second, and an engine panel (running and waiting requests, and the KV block map drawn one
# pixel per block: grey free, blue cached prefix, green held) polled from
# `/v1/engine/stats`. Model output is untrusted text: the page only ever sets
# `textContent`, never HTML, and its Content-Security-Policy allows no script but its own
# (pinned by hash), so even a mistake could not run a `<script>` the model wrote.

# %%
#| export
CHAT_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:0;display:flex;height:100vh;color:#222}
main{flex:1;display:flex;flex-direction:column;min-width:0}
aside{width:300px;border-left:1px solid #ddd;padding:0 14px;font-size:13px;overflow:auto}
#log{flex:1;overflow:auto;padding:12px}
.msg{white-space:pre-wrap;overflow-wrap:anywhere;margin:8px 0;padding:8px 10px;border-radius:8px;max-width:80ch}
.user{background:#e8f0fe;margin-left:auto}.assistant{background:#f3f3f3}.error{background:#fde8e8}
.stopped::after{content:" [stopped]";color:#999}
form{display:flex;gap:8px;padding:12px;border-top:1px solid #ddd}
textarea{flex:1;resize:none;height:3.2em;font:inherit}
#speed{padding:0 12px;color:#666;font-size:13px;min-height:1.2em}
label{display:block;margin:6px 0}input{width:7em}
canvas{image-rendering:pixelated;width:100%;border:1px solid #ddd}
"""

CHAT_SCRIPT = """
const $ = id => document.getElementById(id);
const history = [];
let model = null, controller = null;
function headers() {
  const h = {"Content-Type": "application/json"}, key = $("api-key").value;
  if (key) h.Authorization = "Bearer " + key;
  return h;
}
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;  // text, never HTML
  $("log").append(div);
  div.scrollIntoView();
  return div;
}
async function errorMessage(r) {
  try { return (await r.json()).error.message; } catch (e) { return r.status + " " + r.statusText; }
}
async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  const reply = bubble("assistant", "");
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let tokens = 0, start = performance.now(), first = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({model, messages: history, stream: true, stream_options: {include_usage: true},
                            max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value)})});
    if (!r.ok) throw new Error(await errorMessage(r));
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\\n\\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : "";
        if (delta) { reply.textContent += delta; tokens += 1; first = first || performance.now(); }
        const seconds = (performance.now() - (first || start)) / 1000;
        $("speed").textContent = tokens + " tokens, " + (seconds > 0 ? (tokens - 1) / seconds : 0).toFixed(1) + " tok/s";
      }
    }
  } catch (e) {
    if (e.name === "AbortError") reply.classList.add("stopped");
    else bubble("error", String(e.message || e));
  } finally {
    history.push({role: "assistant", content: reply.textContent});
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}
function drawBlocks(map) {
  const canvas = $("blocks"), cols = Math.min(256, Math.ceil(Math.sqrt(3 * map.length)) || 1);
  const rows = Math.ceil(map.length / cols);  // about three times wider than high
  canvas.width = cols; canvas.height = Math.max(rows, 1);
  const ctx = canvas.getContext("2d"), image = ctx.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < map.length; i++) {
    const c = map[i], rgb = c === "." ? [225, 225, 225] : c === "c" ? [140, 180, 240] : [40, 160 - 10 * Number(c), 60];
    image.data.set([...rgb, 255], 4 * i);
  }
  ctx.putImageData(image, 0, 0);
}
async function poll() {
  try {
    const r = await fetch("/v1/engine/stats", {headers: headers()});
    if (!r.ok) { $("engine").textContent = await errorMessage(r); return; }
    const s = await r.json(), kv = s.kv;
    $("running").textContent = s.running; $("waiting").textContent = s.waiting;
    $("kv").textContent = "KV blocks: " + kv.used_blocks + " used, " + kv.cached_blocks + " cached, " + kv.total_blocks +
      " in all (" + (100 * kv.usage).toFixed(1) + "%); prefix hits " + (100 * kv.prefix_hit_rate).toFixed(0) + "%";
    $("engine").textContent = s.tokens_per_s.toFixed(1) + " tok/s over recent steps, " + s.steps + " steps";
    drawBlocks(s.block_map);
  } catch (e) { $("engine").textContent = "engine stats unavailable"; }
}
$("form").addEventListener("submit", e => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(m => { model = m.data[0].id; $("model").textContent = model; })
  .catch(() => {});
poll();
setInterval(poll, 500);
"""

CHAT_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>forge-engine chat</title><link rel="icon" href="data:,"><style>%STYLE%</style></head>
<body><main><div id="log"></div><div id="speed"></div>
<form id="form"><textarea id="prompt" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
<button id="send" type="submit">Send</button><button id="stop" type="button" disabled>Stop</button></form></main>
<aside><h3 id="model">forge-engine</h3>
<label>max tokens <input id="max-tokens" type="number" value="512" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.7" min="0" step="0.1"></label>
<label>API key <input id="api-key" type="password" autocomplete="off"></label>
<h3>Engine</h3><div>running <b id="running">-</b>, waiting <b id="waiting">-</b></div>
<p id="kv"></p><canvas id="blocks" width="1" height="1"></canvas><p id="engine"></p></aside>
<script>%SCRIPT%</script></body></html>
"""


def csp_hash(code: str) -> str:
    "A Content-Security-Policy source that allows exactly this inline code."
    return "'sha256-" + base64.b64encode(hashlib.sha256(code.encode()).digest()).decode() + "'"


CHAT_PAGE = CHAT_HTML.replace("%STYLE%", CHAT_STYLE).replace("%SCRIPT%", CHAT_SCRIPT)
CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {csp_hash(CHAT_SCRIPT)}; "
                               f"style-src {csp_hash(CHAT_STYLE)}; connect-src 'self'; img-src data:; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
}

# %%
assert "innerHTML" not in CHAT_SCRIPT and "insertAdjacentHTML" not in CHAT_SCRIPT and "document.write" not in CHAT_SCRIPT
assert CHAT_PAGE.count("<script>") == 1 and csp_hash(CHAT_SCRIPT) in CHAT_PAGE_HEADERS["Content-Security-Policy"]

# %% [markdown]
# Without an engine yet (the model still loading), the app already answers: `/health` is
# 503 until the engine is there, `/v1/*` too, and errors keep OpenAI's shape. FastAPI's
# `TestClient` calls the app in-process, no socket needed:

# %%
loading = TestClient(create_app(None, "qwen3-tiny", api_key="secret", cors_origins=["http://localhost:3000"]))
r = loading.get("/health")
assert r.status_code == 503 and r.json()["status"] == "loading"
r = loading.post("/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer secret"})
assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"] == "5"
assert loading.get("/v1/models").status_code == 401  # no key
assert loading.get("/v1/models", headers={"Authorization": "Bearer nope"}).json()["error"]["code"] == "invalid_api_key"
assert loading.get("/v1/models", headers={"Authorization": "Bearer secret"}).json()["data"][0]["id"] == "qwen3-tiny"
assert loading.get("/nothing/here").json()["error"]["message"] == "no route GET /nothing/here"
r = loading.post("/v1/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1), headers={"Authorization": "Bearer secret"})
assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
r = loading.post("/v1/completions", content=b"{not json", headers={"Authorization": "Bearer secret"})
assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
page = loading.get("/")
assert page.headers["content-security-policy"].startswith("default-src 'none'") and 'id="stop"' in page.text
cors = loading.options("/v1/models", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "GET"})
assert cors.headers["access-control-allow-origin"] == "http://localhost:3000"
plain = TestClient(create_app(None, "m"))
assert "access-control-allow-origin" not in plain.get("/health", headers={"Origin": "http://localhost:3000"}).headers
assert plain.get("/v1/models").status_code == 200  # no key set: none needed


# %% [markdown]
# ## Serving
#
# `ServerThread` runs uvicorn on a background thread, for notebooks and tests.
# `forge-engine serve` (`run` below) instead runs uvicorn on the main thread and loads the
# model on another, so `/health` answers 503 from the first second and 200 once the engine
# is up and warmed up (`LLMEngine.warm_up`: one throwaway request, so the first real one does not
# wait for kernels to compile). It binds to 127.0.0.1 unless told otherwise, and says so loudly
# when it is told.

# %%
#| export
class ServerThread:
    "uvicorn serving `app` on a background thread: `with ServerThread(app) as url: ...`, or `start()` and `stop()`."
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):  # port 0: any free port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url: str | None = None

    @property
    def alive(self) -> bool: return self._thread.is_alive()

    def start(self) -> str:
        "Start serving; the base URL once the socket listens."
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (is the port taken?)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        "Finish open responses, close the socket, end the thread."
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> str: return self.start()
    def __exit__(self, *exc) -> None: self.stop()


def is_loopback(host: str) -> bool:
    "Whether binding `host` keeps the server reachable from this machine only."
    if host == "localhost": return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "max_waiting", "tensor_parallel_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    "The flags of `forge-engine serve`."
    parser.add_argument("--model", default="auto", help="registry name, local path, random:<preset>, or auto")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $FORGE_API_KEY, else none)")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let browser pages from ORIGIN call the API (repeatable; default: no CORS)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    for name in ENGINE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"EngineConfig.{name}")
    add_quantization_flag(parser)  # the same flags as generate / chat (chapter 04a)
    add_memory_budget_flag(parser)


def run(args: argparse.Namespace) -> int:
    "`forge-engine serve`: answer /health at once, load the model on a thread, serve until Ctrl-C."
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        options = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
        config = EngineConfig(dtype=args.dtype, quantization=args.quantization,
                              gpu_memory_budget=args.gpu_memory_budget, **options)
        model, device = pick_model(args.model, args.device, logger.info)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if not is_loopback(args.host):
        logger.warning("binding %s: the server is reachable from other machines%s", args.host,
                       "" if args.api_key or os.environ.get("FORGE_API_KEY") else ", and no --api-key is set")
    app = create_app(None, args.served_model_name or model, api_key=args.api_key or os.environ.get("FORGE_API_KEY"),
                     cors_origins=args.cors_origin)
    state: ServerState = app.state.forge
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, lifespan="off",
                                           timeout_graceful_shutdown=5))

    def load() -> None:
        try:
            loaded = load_model_over(model, device, args.dtype, seed=config.seed, progress=False,
                                     quantization=config.quantization, tensor_parallel_size=config.tensor_parallel_size,
                                     memory_budget=config.gpu_memory_budget)
            engine = LLMEngine(loaded, config.replace(device=device))
            logger.info("warmed up in %.2f s (kernels compiled before the first request)", engine.warm_up())
            state.engine = AsyncEngine(engine)
            logger.info("%s is ready: http://%s:%d (chat page at /)", state.model_name, args.host, args.port)
        except Exception as e:  # say why, then stop: a server that can never serve should not look alive
            state.load_error = f"loading {model!r} failed: {type(e).__name__}: {e}"
            logger.error("%s", state.load_error)
            server.should_exit = True

    threading.Thread(target=load, name="forge-load", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    finally:
        if state.engine is not None: state.engine.close()
    return 1 if state.load_error else 0


def main(argv: Sequence[str] | None = None) -> int:
    "`python -c 'from forge_engine.server import main; main()' --model ...`: the same as `forge-engine serve`."
    parser = argparse.ArgumentParser(prog="forge-engine serve", description="An OpenAI-compatible HTTP server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


# %%
assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.org")
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(["--model", "random:qwen3-tiny", "--cors-origin", "http://a", "--cors-origin", "http://b",
                          "--max-waiting", "8"])
assert (args.host, args.port, args.cors_origin, args.max_waiting, args.max_num_seqs) == \
    ("127.0.0.1", 8000, ["http://a", "http://b"], 8, None)
args = parser.parse_args(["--quantization", "int8", "--gpu-memory-budget", "8GiB"])
assert (args.quantization, args.gpu_memory_budget) == ("int8", 8 * 2**30)

# %% [markdown]
# From a terminal, the same server with a real model, and any OpenAI client against it:
#
# ```
# forge-engine serve --model smollm2-135m-instruct --port 8000      # add --api-key KEY to require one
# curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#      -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": true}'
# ```
#
# ```python
# from openai import OpenAI
# client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
# client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}])
# ```
#
# and a browser at http://127.0.0.1:8000/ for the chat page.

# %% [markdown]
# ## A real server, a real stream
#
# A tiny random Qwen3 (real tokenizer and chat template, gibberish text) behind the app, on
# a free loopback port. The engine takes one sequence at a time and queues at most one more,
# so backpressure is easy to see.

# %%
import httpx
from forge_engine.loader import load_model

loaded = load_model("random:qwen3-tiny", "cpu", progress=False)
engine = AsyncEngine(LLMEngine(loaded, EngineConfig(kv_cache_bytes=2**21, max_num_seqs=1, max_num_batched_tokens=256,
                                                    max_waiting=1)))
app = create_app(engine, "qwen3-tiny", api_key="secret")
server = ServerThread(app)
url = server.start()
client = httpx.Client(base_url=url, headers={"Authorization": "Bearer secret"}, timeout=60)
story = "Tell me a story about a forge, an anvil and a hammer, in three short sentences please."
hammer = loaded.tokenizer.encode(" hammer")[0]  # one token
question = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": story}], "temperature": 0, "max_tokens": 6,
            "logit_bias": {str(hammer): 100}}

# %% [markdown]
# `/v1/models` lists the one served model in OpenAI's shape, with what the registry knows of it:

# %%
card = client.get("/v1/models").json()["data"][0]
assert (card["id"], card["object"], card["owned_by"]) == ("qwen3-tiny", "model", "forge-engine")
assert (card["format"], card["architecture"], card["parameters"]) == ("random", "qwen3", loaded.config.num_parameters)
assert card["context_length"] == loaded.config.max_position_embeddings and client.get("/v1/models/qwen3-tiny").json() == card
card

# %% [markdown]
# A streamed chat completion, event by event. The random model's text is gibberish; a
# `logit_bias` of +100 on one token makes greedy decoding pick it every time, so what comes
# back is readable and the same on every run:

# %%
with client.stream("POST", "/v1/chat/completions", json={**question, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines() if line]
for line in events: print(line[:150])

# %%
assert events[-1] == "data: [DONE]"
chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
assert chunks[-1]["usage"]["completion_tokens"] == 6
streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
assert streamed == " hammer" * 6
whole = client.post("/v1/chat/completions", json=question).json()
assert whole["choices"][0]["message"]["content"] == streamed and whole["usage"]["completion_tokens"] == 6
assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again: its full blocks were cached

# %% [markdown]
# Bad requests never reach the engine, and the answer says what to fix:

# %%
too_long = {**question, "messages": [{"role": "user", "content": "hi " * 5000}]}
for body, status in [({**question, "n": 3}, 400), ({**question, "model": "gpt-4"}, 404), (too_long, 400),
                     ({**question, "max_tokens": 5000}, 400)]:
    r = client.post("/v1/chat/completions", json=body)
    print(r.status_code, r.json()["error"]["message"])
    assert r.status_code == status

# %% [markdown]
# **Backpressure.** One request streams (the engine's only running slot), a second waits in
# the queue; a third is refused with 429 and `Retry-After` instead of queueing without
# bound. Closing the first stream (a client that disconnects) aborts it: the waiting one
# then runs, and when all is done no KV block is in use.

# %%
long = {**question, "max_tokens": 1000, "ignore_eos": True, "stream": True}


def metric(name: str) -> float:
    "One sample of the server's /metrics, by its full name (labels included)."
    for line in client.get("/metrics").text.splitlines():
        if line.split(" ")[0] == name: return float(line.split(" ")[1])
    raise KeyError(name)


def wait_until(condition, seconds=20):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


first = client.send(client.build_request("POST", "/v1/chat/completions", json=long), stream=True)
first_lines = first.iter_lines()  # keep the iterator: dropping it would close the connection
next(first_lines)  # its role chunk: it is running
waiting = threading.Thread(target=lambda: client.post("/v1/chat/completions", json=question))
waiting.start()
wait_until(lambda: metric("forge_requests_waiting") == 1)
r = client.post("/v1/chat/completions", json=question)
print(r.status_code, r.headers["retry-after"], r.json()["error"]["message"])
assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
first.close()  # the client goes away mid-stream
waiting.join(timeout=30)
wait_until(lambda: metric("forge_requests_running") == 0 and metric("forge_kv_cache_used_blocks") == 0)
assert metric('forge_requests_total{finish_reason="abort"}') == 1
engine.engine.allocator.check_idle()

# %% [markdown]
# The metrics after all this, as Prometheus scrapes them (a few lines of many):

# %%
exposition = client.get("/metrics").text
print("\n".join(line for line in exposition.splitlines() if line.startswith(("forge_requests", "forge_generation"))))
families = {f.name: f.type for f in text_string_to_metric_families(exposition)}
assert families["forge_time_to_first_token_seconds"] == "histogram" and families["forge_prompt_tokens"] == "counter"
assert metric("forge_time_to_first_token_seconds_count") >= 3

# %% [markdown]
# When the engine stops, the server says so instead of hanging: `/health` turns 503, and so
# do new requests. Then we shut the server down.

# %%
engine.close()
assert client.get("/health").status_code == 503
assert client.post("/v1/chat/completions", json=question).status_code == 503
client.close()
server.stop()
assert not server.alive
