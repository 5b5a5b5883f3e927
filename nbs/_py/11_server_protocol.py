# %% [markdown]
# # The OpenAI-compatible server: the protocol
#
# > What a client may send and what it gets back when it is wrong: OpenAI-style errors, a bounded JSON body, request fields checked into `SamplingParams`, prompts into token ids.

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
#
# The server is five chapters, one module each in `forge_engine.server`: this one (the
# protocol: errors, request checks, prompts), 11a (Prometheus metrics), 11b (the browser chat
# page), 11c (the app: replies, one request in flight, the routes) and 11d (`forge-engine
# serve`, and a real server with a real stream).

# %%
#| default_exp server.protocol

# %%
#| export
from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse

from forge_engine.async_engine import AsyncEngine, EngineDeadError
from forge_engine.engine import RequestOutput
from forge_engine.generate import SamplingParams
from forge_engine.scheduler import QueueFullError
from forge_engine.tokenizer import Tokenizer

# %%
#| hide
import pytest

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
