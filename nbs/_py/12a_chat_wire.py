# %% [markdown]
# # Chat: the OpenAI stream, as a client reads it
#
# > Server-sent events read line by line, request bodies from `SamplingParams`, and what each streamed chunk says: the wire format the chat clients and the load client speak.

# %% [markdown]
# Chapter 11f writes OpenAI's replies; this chapter reads them, as a client of any
# OpenAI-compatible server does. It does no I/O: it turns lines into events, events into
# `Chunk`s, and sampling parameters into a request body, so `RemoteChat` (chapter 12, over a
# blocking HTTP client) and the load client (chapter 13a, over asyncio) read the stream with the
# same code.

# %%
#| default_exp chat_wire

# %%
#| export
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

# %%
#| hide
import pytest


# %% [markdown]
# ## What the client sees on the wire
#
# `POST /v1/chat/completions` with `"stream": true` answers `200` with
# `Content-Type: text/event-stream`, then keeps the connection open and writes *events*.
# An event is one or more `field: value` lines ended by a blank line; the only field that
# matters here is `data`. Each `data` is one JSON *chunk*; the stream ends with the literal
# `data: [DONE]`:
#
# ```
# data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}
#
# data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Par"},"finish_reason":null}]}
#
# data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"is"},"finish_reason":"stop"}]}
#
# data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":14,"completion_tokens":2,"total_tokens":16}}
#
# data: [DONE]
#
# ```
#
# The first chunk often carries only the role; the last `choices` chunk carries the
# `finish_reason` (`stop`, `length`, ...); a usage chunk with empty `choices` comes only when
# the request asked for it with `"stream_options": {"include_usage": true}`. Lines starting
# with `:` are comments (servers send them as keep-alives), and a `data` field may be split
# over several lines, which the reader joins with newlines. `/v1/completions` streams the same
# way with `choices[0].text` instead of `choices[0].delta.content`.
#
# A reply that calls tools (chapter 06b) sends them as `delta.tool_calls` entries and ends with
# `finish_reason: "tool_calls"`. Each entry names the call it belongs to by `index`; the first
# entry of a call brings its `id` and function `name`, later ones pieces of its `arguments` (a
# JSON object, as text), to be joined in order:
#
# ```
# data: {..."delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",
#                                   "function":{"name":"get_weather","arguments":""}}]}...}
#
# data: {..."delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\": "}}]}...}
#
# data: {..."delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]}...}
#
# data: {..."delta":{},"finish_reason":"tool_calls"}
# ```
#
# (Our server sends each call whole, in one entry, when its `</tool_call>` closes; OpenAI and
# vLLM send the pieces. A client that joins pieces reads both.)
#
# `SSEDecoder` takes the stream one line at a time and hands back each event's data when the
# blank line ends it. It keeps no I/O of its own, so the synchronous client of chapter 12 and
# the asyncio load client of chapter 13a share it.

# %%
#| export
class SSEDecoder:
    """Server-sent events, one line at a time: `feed(line)` returns an event's data when the
    blank line that ends it comes."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: do not matter to an OpenAI stream

    def flush(self) -> str | None:
        "The pending event's data (a stream may end without the final blank line)."
        data, self._data = "\n".join(self._data), []
        return data or None


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    "The data of each event in a stream of lines, up to (not including) `[DONE]`."
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data == "[DONE]":
            return
        if data is not None:
            yield data
    if (data := decoder.flush()) not in (None, "[DONE]"):
        yield data  # the stream left its last event open


# %%
wire = """: keep-alive
data: {"choices":[{"delta":{"content":"Hel"}}]}

data: {"choices":[{"delta":{"content":"lo"}}]}\r
\r
event: message
data: line one
data: line two

data: [DONE]

data: never read
""".split("\n")
assert list(sse_data(wire)) == [
    '{"choices":[{"delta":{"content":"Hel"}}]}',
    '{"choices":[{"delta":{"content":"lo"}}]}',
    "line one\nline two",
]
assert list(sse_data(iter(["data: no blank line at the end"]))) == ["no blank line at the end"]
assert list(sse_data(["", ": only comments", ""])) == []

# %% [markdown]
# ## Requests and chunks
#
# A request body carries the sampling parameters under OpenAI's names. Parameters OpenAI
# does not have (`top_k`, `min_p`, `ignore_eos`, ...) are vLLM's extensions; they are sent
# only when they differ from their neutral value, so a strict server never sees them unless
# they matter. The model's name is part of every request; `GET /v1/models` lists the names a
# server takes.

# %%
#| export
_EXTENSIONS = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "ignore_eos": False,
}


def openai_tool_choice(choice: str | dict) -> str | dict:
    "`tool_choice` as OpenAI spells it: 'auto', 'required', 'none', or a function name's object."
    if isinstance(choice, dict) or choice in ("auto", "required", "none"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def request_body(
    params,
    model: str,
    messages: list[dict] | None = None,
    prompt: str | None = None,
    stream: bool = True,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
) -> dict:
    """The JSON body of a chat (`messages`) or completion (`prompt`) request from `SamplingParams`;
    a chat may offer `tools`, and say which it wants called (`tool_choice`: a name will do)."""
    if (messages is None) == (prompt is None):
        raise ValueError("pass either messages (chat) or prompt (completion)")
    body = {
        "model": model,
        **({"messages": messages} if messages is not None else {"prompt": prompt}),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            body[name] = getattr(params, name)
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    body.update(
        {
            k: getattr(params, k)
            for k, neutral in _EXTENSIONS.items()
            if getattr(params, k) != neutral
        }
    )
    if tools:
        body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = openai_tool_choice(tool_choice)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


class ChatError(RuntimeError):
    """A reply failed: the server refused the request, could not be reached, broke the stream, or
    the engine failed."""


@dataclass
class Chunk:
    "What one streamed chunk says: a piece of text, a finish reason, the usage, tool call pieces."

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    tool_calls: list[dict] = field(default_factory=list)  # `delta.tool_calls` entries


def parse_chunk(data: str) -> Chunk:
    "One `data:` payload of a chat or completion stream; an error object raises `ChatError`."
    try:
        obj = json.loads(data)
    except ValueError:
        raise ChatError(f"the server sent a chunk that is not JSON: {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise ChatError(f"the server sent an unexpected chunk: {data[:200]!r}")
    if "error" in obj:
        raise ChatError(f"the server failed the request mid-stream: {error_text(obj)}")
    choices = obj.get("choices") or [{}]
    choice, delta = choices[0], choices[0].get("delta") or {}
    text = delta.get("content") or choice.get("text") or ""
    calls = delta.get("tool_calls") or []
    if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise ChatError(
            f"the server sent tool_calls that are not a list of objects: {data[:200]!r}"
        )
    return Chunk(text, choice.get("finish_reason"), obj.get("usage"), calls)


def error_text(body) -> str:
    """The message of an error body: OpenAI's `{"error": {"message": ...}}`, FastAPI's
    `{"detail": ...}`, or the raw text."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body.strip()[:500] or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)[:500]


# %%
class Params:  # any object with SamplingParams' attributes will do (chapter 04's in practice)
    max_tokens, temperature, top_p, top_k, min_p, seed, stop = 8, 0.0, 1.0, -1, 0.0, None, []
    presence_penalty = frequency_penalty = 0.0
    repetition_penalty, min_tokens, ignore_eos = 1.0, 0, False


body = request_body(Params(), "m", messages=[{"role": "user", "content": "hi"}])
assert body == {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "temperature": 0.0,
    "top_p": 1.0,
    "stream": True,
    "stream_options": {"include_usage": True},
}
p = Params()
p.top_k, p.ignore_eos, p.seed = 5, True, 3
assert request_body(p, "m", prompt="x", stream=False) == {
    "model": "m",
    "prompt": "x",
    "max_tokens": 8,
    "temperature": 0.0,
    "top_p": 1.0,
    "seed": 3,
    "top_k": 5,
    "ignore_eos": True,
}
with pytest.raises(ValueError, match="either messages"):
    request_body(p, "m")

assert parse_chunk('{"choices":[{"delta":{"role":"assistant","content":""}}]}') == Chunk()
assert parse_chunk('{"choices":[{"delta":{"content":"is"},"finish_reason":"stop"}]}') == Chunk(
    "is", "stop"
)
assert parse_chunk('{"choices":[{"text":"x","finish_reason":null}]}') == Chunk("x")
assert parse_chunk('{"choices":[],"usage":{"completion_tokens":2}}') == Chunk(
    usage={"completion_tokens": 2}
)
with pytest.raises(ChatError, match="mid-stream: engine died"):
    parse_chunk('{"error":{"message":"engine died"}}')
with pytest.raises(ChatError, match="not JSON"):
    parse_chunk("Paris")
assert (
    error_text('{"detail":"Not Found"}') == "Not Found"
    and error_text("<html>bad gateway") == "<html>bad gateway"
)
weather_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
body = request_body(
    Params(), "m", [], stream=False, tools=[weather_tool], tool_choice="get_weather"
)
assert body["tools"] == [weather_tool] and body["tool_choice"] == {
    "type": "function",
    "function": {"name": "get_weather"},
}
required = request_body(Params(), "m", [], tools=[weather_tool], tool_choice="required")
assert required["tool_choice"] == "required" and required["stream"]
assert "tools" not in request_body(Params(), "m", [], tool_choice="required")
piece = '{"index":0,"id":"call_1","function":{"name":"get_weather","arguments":""}}'
assert parse_chunk('{"choices":[{"delta":{"tool_calls":[' + piece + "]}}]}").tool_calls == [
    json.loads(piece)
]
with pytest.raises(ChatError, match="not a list of objects"):
    parse_chunk('{"choices":[{"delta":{"tool_calls":"get_weather()"}}]}')
