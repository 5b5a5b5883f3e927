# %% [markdown]
# # Chat
#
# > Talking to the engine: the OpenAI stream on the wire, a terminal chat loop and a notebook chat widget, in-process or against any OpenAI-compatible server.

# %% [markdown]
# This is the end of the flow of a request: text deltas arrive and a person reads them. The
# same conversation can run in two places:
#
# - **in-process**: the engine lives in this Python process (`LLM` from chapter 08b) and we
#   step it ourselves;
# - **remote**: the engine lives behind an OpenAI-compatible HTTP server (ours from chapter
#   11, or any other) and the reply streams over server-sent events.
#
# Both look the same to the rest of this chapter: a *chat source* has one method,
# `stream(messages, params, reply)`, a generator of text pieces. Closing the generator early
# aborts the reply; `reply` (a `Reply`) collects the text, the token count and the timings
# on the way. The terminal loop, the notebook widget and the load client of chapter 13a are
# all written against that one shape.

# %%
#| default_exp chat

# %%
#| export
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator
from urllib.parse import urlsplit

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
# blank line ends it. It keeps no I/O of its own, so the synchronous client here and the
# asyncio load client of chapter 13a share it.

# %%
#| export
class SSEDecoder:
    "Server-sent events, one line at a time: `feed(line)` returns an event's data when the blank line that ends it comes."

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
    "A reply failed: the server refused the request, could not be reached, broke the stream, or the engine failed."


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
    'The message of an error body: OpenAI\'s `{"error": {"message": ...}}`, FastAPI\'s `{"detail": ...}`, or the raw text.'
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
class Params:  # any object with SamplingParams' attributes will do; the real one comes later
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


# %% [markdown]
# ## A reply and its timings
#
# A `Reply` is filled while the text streams. It keeps the arrival time of every chunk that
# carried output (text, or a piece of a tool call); that is all the latency figures need:
#
# - **TTFT**, time to first token: from sending the request to the first piece of output;
# - **ITL**, inter-token latency: the gaps between consecutive pieces;
# - **E2E**: from sending the request to the end of the stream;
# - **TPOT**, time per output token after the first: `(E2E - TTFT) / (tokens - 1)`.
#
# The token count comes from the server's `usage` when it sends one, else from the number of
# pieces (one per token for most servers; a piece can hold more than one token). A piece of a
# tool call counts as a piece: a reply may be nothing but calls.
#
# A reply that calls tools keeps its calls in `tool_calls`, OpenAI's shape (`id`, `type`,
# `function.name`, `function.arguments`), joined from their pieces as they come;
# `message()` is what the reply adds to the conversation: its text, and its calls.

# %%
#| export
@dataclass
class Reply:
    "A streamed reply: its text, how it ended, and when each piece arrived (seconds since `start`)."

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    start: float = field(default_factory=time.perf_counter)
    piece_times: list[float] = field(default_factory=list)
    pieces_tokens: int = (
        0  # tokens counted from the pieces (exact in-process, one per piece remotely)
    )
    e2e_s: float | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, text: str, num_tokens: int = 1) -> None:
        "Record a piece that carried `num_tokens` new tokens, now."
        self.text += text
        self.pieces_tokens += num_tokens
        self.piece_times.append(time.perf_counter() - self.start)

    def take(self, chunk: Chunk) -> str:
        "Record one chunk of a server's stream; its text."
        if chunk.usage:
            self.usage = chunk.usage
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        for piece in chunk.tool_calls:
            self.take_call(piece)
        if chunk.text or chunk.tool_calls:  # a call is output too: it may come first, or alone
            self.add(chunk.text)
        return chunk.text

    def take_call(self, piece: dict) -> None:
        "Join a `delta.tool_calls` entry: a call's index, id and name, then its arguments' pieces."
        index = piece.get("index", len(self.tool_calls))
        if not isinstance(index, int) or not 0 <= index <= len(self.tool_calls):
            raise ChatError(f"the server sent a tool call piece with a bad index: {piece!r:.200}")
        if index == len(self.tool_calls):
            self.tool_calls.append(
                {
                    "id": f"call_{index}",
                    "type": "function",
                    "function": {"name": "", "arguments": ""},
                }
            )
        call, function = self.tool_calls[index], piece.get("function") or {}
        call["id"] = piece.get("id") or call["id"]
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""

    def message(self) -> dict:
        "The assistant message this reply adds: its text, and its tool calls unless it was stopped."
        if self.tool_calls and self.finish_reason != "abort":
            return {
                "role": "assistant",
                "content": self.text or None,
                "tool_calls": self.tool_calls,
            }
        return {"role": "assistant", "content": self.text}

    def finish_stream(self) -> None:
        "The server's stream is over: it must have said how the reply finished."
        if self.finish_reason is None:
            raise ChatError("the stream ended before the reply finished (no finish_reason)")
        self.end()

    def end(self, finish_reason: str | None = None) -> None:
        "The stream is over (the first call counts)."
        if self.e2e_s is None:
            self.e2e_s = time.perf_counter() - self.start
        self.finish_reason = self.finish_reason or finish_reason

    @property
    def num_tokens(self) -> int:
        return (
            int(self.usage["completion_tokens"])
            if self.usage and "completion_tokens" in self.usage
            else self.pieces_tokens
        )

    @property
    def ttft_s(self) -> float | None:
        return self.piece_times[0] if self.piece_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.piece_times, self.piece_times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2 or self.e2e_s is None or len(self.piece_times) < 2:
            return None  # a rate needs two arrivals (a call held back until it closed comes in one)
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)

    def summary(self) -> str:
        if self.error:
            return f"[error: {self.error}]"
        parts = [f"{self.num_tokens} tokens"]
        if self.tpot_s:
            parts.append(f"{1 / self.tpot_s:.1f} tok/s")
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s * 1000:.0f} ms")
        return f"[{', '.join(parts)}, {self.finish_reason}]"


# %%
r = Reply(start=time.perf_counter())
for piece in ["Par", "is", "."]:
    time.sleep(0.01)
    r.add(piece)
r.end("stop")
# sleep(0.01) waits 10 ms or more: each gap over half of it; TPOT is the same float64 division
assert (
    r.text == "Paris."
    and r.num_tokens == 3
    and len(r.itl_s) == 2
    and all(x > 0.005 for x in r.itl_s)
)
assert 0 < r.ttft_s <= r.e2e_s and r.tpot_s == (r.e2e_s - r.ttft_s) / 2
r.usage = {"completion_tokens": 5}
assert r.num_tokens == 5 and r.summary().startswith("[5 tokens,") and r.summary().endswith("stop]")
assert Reply(error="boom").summary() == "[error: boom]" and Reply().tpot_s is None
assert Reply(usage={"completion_tokens": 9}, piece_times=[0.1], e2e_s=0.1).tpot_s is None
r = Reply()
assert r.take(Chunk()) == "" and r.take(Chunk("a")) == "a" and r.take(Chunk("b", "length")) == "b"
r.take(Chunk(usage={"prompt_tokens": 3, "completion_tokens": 2}))
r.finish_stream()
assert (r.text, r.finish_reason, r.num_tokens, len(r.piece_times)) == ("ab", "length", 2, 2)
with pytest.raises(ChatError, match="ended before the reply finished"):
    Reply().finish_stream()
assert r.message() == {"role": "assistant", "content": "ab"}

# %% [markdown]
# A call in pieces, as OpenAI streams it: the pieces join into one call, and the reply's message
# carries it (a reply stopped in the middle of its calls keeps only its text).

# %%
r = Reply()
for piece in [
    {"index": 0, "id": "call_7", "type": "function", "function": {"name": "get_weather"}},
    {"index": 0, "function": {"arguments": '{"city": '}},
    {"index": 0, "function": {"arguments": '"Paris"}'}},
    {"index": 1, "id": "call_8", "function": {"name": "get_time", "arguments": "{}"}},
]:
    r.take(Chunk(tool_calls=[piece]))
r.take(Chunk(finish_reason="tool_calls"))
r.end()
assert len(r.piece_times) == 4 and r.summary().endswith("tool_calls]")  # the calls' times count
assert r.message() == {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_8", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ],
}
with pytest.raises(ChatError, match="bad index"):
    r.take_call({"index": 5, "function": {"arguments": "{}"}})
r.finish_reason = "abort"
assert r.message() == {"role": "assistant", "content": ""}


# %% [markdown]
# ## Tool calls, as a person reads them
#
# A chat shows each call on a line of its own, the function and its arguments as compact JSON,
# `→ get_weather({"city": "Paris"})`, never the `<tool_call>` markup the model wrote. The
# person (or their program) answers each call with its result, which goes back as a `tool`
# message naming the call's id; the model then answers from the results.

# %%
#| export
def call_line(call: dict) -> str:
    'A tool call as a person reads it: `get_weather({"city": "Paris"})` (not JSON: as given).'
    function = call["function"]
    try:
        arguments = json.dumps(json.loads(function["arguments"]), ensure_ascii=False)
    except ValueError:
        arguments = function["arguments"]
    return f"{function['name']}({arguments})"


def reply_ending(reply: Reply) -> str:
    "What a chat shows after a reply's text: the end of its line, then each tool call on a line."
    calls = "".join(f"→ {call_line(c)}\n" for c in reply.message().get("tool_calls", []))
    return ("\n" if reply.text or not calls else "") + calls


def tool_message(call: dict, result: str) -> dict:
    "The message that gives a tool call's result back to the model."
    return {"role": "tool", "tool_call_id": call["id"], "content": result}


# %%
call = {"id": "call_7", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
assert call_line(call) == 'get_weather({"city": "Paris"})'
assert call_line({"function": {"name": "f", "arguments": "{broken"}}) == "f({broken)"
r = Reply(text="Let me look.", finish_reason="tool_calls", tool_calls=[call])
assert reply_ending(r) == '\n→ get_weather({"city": "Paris"})\n'
assert reply_ending(Reply(text="Hi")) == reply_ending(Reply()) == "\n"
assert tool_message(call, "18 C") == {"role": "tool", "tool_call_id": "call_7", "content": "18 C"}


# %% [markdown]
# ## Chat sources
#
# `LocalChat` steps an in-process engine itself: it queues the conversation, steps the
# engine and yields each step's text. While it streams it owns the engine, so do not run
# `llm.generate` from another thread at the same time. When the consumer stops early
# (Ctrl+C, a Stop button, a `break`), the generator's `finally` aborts the request, and the
# engine gives the blocks back at once.
#
# Offered `tools`, it does what the server does with them, with the same code (chapter 06b):
# the chat template lists the tools, `tool_choice` 'required' or a function's name becomes the
# grammar that forces a call, and `ToolCallStream` takes the calls out of the text as it comes.

# %%
#| export
class LocalChat:
    "A chat source over an in-process `LLM` (chapter 08b)."

    def __init__(self, llm):
        if getattr(llm, "tokenizer", None) is None:
            raise ValueError(
                "this LLM has no tokenizer, so no chat template: load a model with one"
            )
        self.llm = llm
        self.model = llm.loaded.name

    def stream(
        self,
        messages: list[dict],
        params,
        reply: Reply,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
    ) -> Iterator[str]:
        engine, calls = self.llm.engine, None
        if tools:
            from forge_engine.tool_calls import (
                ToolCallStream,
                check_tools,
                chosen_tool,
                tool_call_output,
            )

            choice = chosen_tool(openai_tool_choice(tool_choice), check_tools(tools))
            if (forced := tool_call_output(tools, choice)) is not None:
                if params.structured is not None:
                    raise ValueError(f"tool_choice {choice!r} already fixes the output")
                params = replace(params, structured=forced)
            calls = ToolCallStream() if choice != "none" else None
        reply.start = time.perf_counter()
        rid = engine.add_request(self.llm.tokenizer.encode_chat(messages, tools=tools), params)
        try:
            while True:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    text, made = (
                        calls.add(out.delta_text, final=out.finished)
                        if calls is not None
                        else (out.delta_text, [])
                    )
                    reply.tool_calls += [call.openai() for call in made]
                    if out.delta_token_ids:
                        reply.add(text, len(out.delta_token_ids))
                    elif text:
                        reply.text += text  # text held back until the end
                    if out.finished:
                        called = reply.tool_calls and out.finish_reason == "stop"
                        reply.end("tool_calls" if called else out.finish_reason)
                        if out.finish_reason == "error":
                            raise ChatError(f"the engine failed the request: {out.error}")
                        yield text
                        return
                    yield text  # every step, so a consumer can stop between any two
        finally:
            if rid in engine.requests:  # left early: abort, the blocks are free when this returns
                engine.abort(rid)
                reply.end("abort")


# %% [markdown]
# `RemoteChat` speaks the OpenAI wire format to a server. `url` is the server's address with
# or without the `/v1` suffix. The model is the server's first model unless one is named.
# Every failure becomes a `ChatError` with a message a person can act on: the address that
# cannot be reached, the status and message of a refused request, a stream that broke off.
# Closing the generator closes the connection, which is how a client aborts a request: the
# server sees the disconnect and frees the request's blocks.

# %%
#| export
def api_base(url: str) -> str:
    "`http://host:port` or `http://host:port/v1` -> the `/v1` base every OpenAI route hangs from."
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"server URL must look like http://host:port, got {url!r}")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def api_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class RemoteChat:
    "A chat source over any OpenAI-compatible server."

    def __init__(
        self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 300.0
    ):
        import httpx

        self.base, self._model = api_base(url), model
        self.client = httpx.Client(
            headers=api_headers(api_key), timeout=httpx.Timeout(timeout, connect=10.0)
        )

    def _call(self, method: str, path: str, **kw):
        import httpx

        try:
            return self.client.request(method, self.base + path, **kw)
        except httpx.TransportError as e:
            raise ChatError(
                f"cannot reach the server at {self.base}: {type(e).__name__}: {e}"
            ) from None

    @property
    def model(self) -> str:
        "The model name to send: the one given, else the server's first."
        if self._model is None:
            response = self._call("GET", "/models")
            if response.status_code != 200:
                raise ChatError(
                    f"GET {self.base}/models: HTTP {response.status_code}: {error_text(response.text)}"
                )
            models = [m["id"] for m in response.json().get("data", [])]
            if not models:
                raise ChatError(f"the server at {self.base} lists no models")
            self._model = models[0]
        return self._model

    def stream(
        self,
        messages: list[dict],
        params,
        reply: Reply,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
    ) -> Iterator[str]:
        import httpx

        body = request_body(
            params, self.model, messages=messages, tools=tools, tool_choice=tool_choice
        )
        reply.start = time.perf_counter()
        try:
            with self.client.stream("POST", self.base + "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ChatError(f"HTTP {response.status_code}: {error_text(response.text)}")
                for data in sse_data(response.iter_lines()):
                    yield reply.take(parse_chunk(data))
        except httpx.TransportError as e:
            raise ChatError(
                f"the stream from {self.base} broke off: {type(e).__name__}: {e}"
            ) from None
        reply.finish_stream()

    def close(self):
        self.client.close()


# %% [markdown]
# ## The terminal loop
#
# Read a line, stream the reply, keep the conversation. Ctrl+C while a reply streams stops
# that reply (the partial answer stays in the conversation) and the loop goes on; Ctrl+D, a
# closed stdin, `/exit` or Ctrl+C at the prompt leave. `/reset` starts over. A failed reply is
# shown and dropped from the conversation, with the message it answered; the next line is a
# fresh try.
#
# Offered `tools`, a reply may call them: each call is shown on its line, the loop asks for its
# result (`result of get_weather: `), and the model answers from the results, maybe with more
# calls. A `tool_choice` that forces a call ('required' or a name) holds for the reply to the
# person's message; the replies to results choose for themselves ('auto'), else a forced call
# would follow every result forever.

# %%
#| export
def _stdout_write(s: str):
    sys.stdout.write(s)
    sys.stdout.flush()


def chat_loop(
    chat,
    params,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = _stdout_write,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    tools: list[dict] | None = None,
    tool_choice: str | dict = "auto",
) -> list[Reply]:
    "Chat over a chat source (`LocalChat` / `RemoteChat`) until end of input; returns the replies."
    history = [{"role": "system", "content": system}] if system else []
    replies = []
    while True:
        try:
            line = read(">>> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return replies
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return replies
        if command == "/reset":
            del history[int(bool(system)) :]
            write("(new conversation)\n")
            continue
        start, choice = len(history), tool_choice
        history.append({"role": "user", "content": line})
        while True:
            reply = _write_reply(chat, history, params, write, tools, choice)
            log(reply.summary())
            replies.append(reply)
            if reply.error:
                del history[start:]
                break
            history.append(message := reply.message())
            if "tool_calls" not in message:
                break
            try:
                for call in message["tool_calls"]:
                    result = read(f"result of {call['function']['name']}: ")
                    history.append(tool_message(call, result))
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return replies
            choice = "auto"


def _write_reply(chat, history, params, write, tools, tool_choice) -> Reply:
    "Stream a reply to `write`, then its tool calls; Ctrl+C stops it, a failure is `reply.error`."
    reply = Reply()
    offered = {"tools": tools, "tool_choice": tool_choice} if tools else {}
    pieces = chat.stream(history, params, reply, **offered)
    try:
        for piece in pieces:
            write(piece)
    except KeyboardInterrupt:
        pieces.close()  # aborts the request if it is still running
        reply.end("abort")
    except ChatError as e:
        reply.error = str(e)
    write("\n" if reply.error else reply_ending(reply))
    return reply


# %% [markdown]
# ## From the command line
#
# `forge-engine chat --url http://127.0.0.1:8000` chats with a server; without `--url` the
# model runs in-process. The API key comes from `--api-key` or the environment variable
# `FORGE_API_KEY`. `--model auto` (the default) takes the server's first model.
#
# `--tools FILE` offers the tools of a JSON file holding an OpenAI `tools` list, either way;
# the file is read and checked (chapter 06b's `check_tools`, what the server checks) when the
# command line is, so a bad one is an error naming the problem before anything loads.
# `--tool-choice` is `auto` (the default), `required`, `none` or a tool's name.

# %%
#| export
API_KEY_ENV = "FORGE_API_KEY"


def load_tools(path: str) -> list[dict]:
    "The OpenAI `tools` list in a JSON file, checked; a `ValueError` says what is wrong with it."
    from forge_engine.tool_calls import check_tools

    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the tools file {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"the tools file {path} is not JSON: {e}") from None
    try:
        return check_tools(tools)
    except ValueError as e:
        raise ValueError(f"the tools file {path}: {e}") from None


def _tools_argument(path: str) -> list[dict]:
    import argparse

    try:
        return load_tools(path)
    except ValueError as e:  # argparse shows this message (a plain ValueError, only the flag)
        raise argparse.ArgumentTypeError(str(e)) from None


def chat_tool_options(args) -> dict:
    "`chat_loop`'s `tools` and `tool_choice` from the command line (none without `--tools`)."
    tools, choice = getattr(args, "tools", None), getattr(args, "tool_choice", None)
    if tools is None:
        if choice not in (None, "none"):
            raise ValueError("--tool-choice needs --tools to choose from")
        return {}
    names = [tool["function"]["name"] for tool in tools]
    if choice not in (None, "auto", "required", "none", *names):
        raise ValueError(
            f"--tool-choice {choice!r} is none of auto, required, none or a tool: "
            + ", ".join(names)
        )
    return {"tools": tools, "tool_choice": choice or "auto"}


def add_chat_url_arguments(parser) -> None:
    "The flags of `forge-engine chat` read here: a server to chat with instead of a model; tools."
    parser.add_argument(
        "--url",
        default=None,
        help="chat with an OpenAI-compatible server at this address instead "
        "of loading the model here (e.g. http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--api-key", default=None, help=f"Bearer key for --url (default: ${API_KEY_ENV})"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the server (with --url)"
    )
    parser.add_argument(
        "--tools",
        type=_tools_argument,
        default=None,
        metavar="FILE",
        help="offer the tools of this JSON file (an OpenAI tools list); "
        "you answer each call the model makes",
    )
    parser.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default), required, none, or a tool's name (with --tools)",
    )


def run_remote_chat(args, params) -> int:
    "`forge-engine chat --url ...`: 0 at end of input, 2 when the server or tool flags will not do."
    model = None if getattr(args, "model", "auto") in (None, "auto") else args.model
    try:
        offered = chat_tool_options(args)
        chat = RemoteChat(
            args.url, args.api_key or os.environ.get(API_KEY_ENV), model, args.timeout
        )
        print(f"chatting with {chat.model} at {chat.base}", file=sys.stderr)
    except (ValueError, ChatError) as e:
        print(f"forge-engine: error: {e}", file=sys.stderr)
        return 2
    try:
        chat_loop(chat, params, system=getattr(args, "system", None), **offered)
    finally:
        chat.close()
    return 0


# %%
import argparse
import contextlib
import io
import tempfile

folder = tempfile.mkdtemp()


def tools_file(text):
    path = os.path.join(folder, "tools.json")
    with open(path, "w") as f:
        f.write(text)
    return path


parser = argparse.ArgumentParser()
add_chat_url_arguments(parser)
args = parser.parse_args(
    ["--tools", tools_file(json.dumps([weather_tool])), "--tool-choice", "get_weather"]
)
assert chat_tool_options(args) == {"tools": [weather_tool], "tool_choice": "get_weather"}
assert chat_tool_options(parser.parse_args([])) == {}
for text, why in [
    ("[{", "is not JSON: Expecting"),
    ('{"name": "get_weather"}', "tools must be a list"),
    ('[{"type": "function", "function": {"name": "get weather"}}]', r"tools\[0\] must be"),
]:
    with pytest.raises(ValueError, match=why):
        load_tools(tools_file(text))
with pytest.raises(ValueError, match="cannot read the tools file .*missing.json"):
    load_tools(os.path.join(folder, "missing.json"))
args.tool_choice = "get_time"
with pytest.raises(ValueError, match="none of auto, required, none or a tool: get_weather"):
    chat_tool_options(args)
with pytest.raises(ValueError, match="needs --tools"):
    chat_tool_options(parser.parse_args(["--tool-choice", "required"]))
# on the command line, argparse says which flag and what is wrong, and exits with 2
stderr = io.StringIO()
with pytest.raises(SystemExit) as exit, contextlib.redirect_stderr(stderr):
    parser.parse_args(["--tools", tools_file("[1]")])
assert exit.value.code == 2 and "argument --tools: the tools file " in stderr.getvalue()
assert "tools[0] must be" in stderr.getvalue()


# %% [markdown]
# ## In a notebook: `ChatWidget`
#
# A text box, Send and Stop buttons, sliders for temperature, top-p and the token limit, and
# the conversation rendered as plain text (a model's output is never interpreted as HTML).
# `ChatWidget(llm)` chats in-process, `ChatWidget("http://127.0.0.1:8000")` with a server.
#
# The reply streams on a background thread so the notebook stays responsive; Stop sets an
# event that the thread checks between pieces, and it then closes the stream, which aborts
# the request. The handlers are plain methods (`send`, `stop`, `wait`), so a test can drive
# the widget without a browser.
#
# `ChatWidget(..., tools=[...], tool_choice=...)` offers tools. A reply's calls show as the
# terminal shows them, `→ get_weather({"city": "Paris"})`, and wait for their results: type
# one in the box and Send (it answers the first call still waiting; the box's placeholder
# says which), or call `answer_tool(call_id, result)`. When every call has its result, the model
# answers from them (choosing for itself whether to call again, as in the terminal).

# %%
#| export
class ChatWidget:
    "A chat in a notebook cell over an in-process `LLM`, a server URL, or any chat source."

    def __init__(
        self,
        source,
        system: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
    ):
        import ipywidgets as w

        if tools:
            from forge_engine.tool_calls import check_tools

            check_tools(tools)
        if isinstance(source, str):
            source = RemoteChat(source, api_key or os.environ.get(API_KEY_ENV), model)
        elif not hasattr(source, "stream"):
            source = LocalChat(source)
        self.chat, self.system = source, system
        self.tools, self.tool_choice = tools, tool_choice
        self.history: list[dict] = [{"role": "system", "content": system}] if system else []
        self.replies: list[Reply] = []
        self.waiting: list[dict] = []  # the last reply's tool calls that have no result yet
        self._results: list[dict] = []  # the tool messages of those that have one
        self._start = len(
            self.history
        )  # where the exchange in progress starts (a failure drops it)
        self.transcript = ""
        self._stop, self._thread = threading.Event(), None
        self.prompt = w.Textarea(placeholder="Your message", rows=2, layout=w.Layout(width="100%"))
        self.send_button = w.Button(description="Send", button_style="primary")
        self.stop_button = w.Button(description="Stop", disabled=True)
        self.temperature = w.FloatSlider(
            value=0.7, min=0.0, max=2.0, step=0.05, description="temperature"
        )
        self.top_p = w.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top-p")
        self.max_tokens = w.IntSlider(value=256, min=1, max=2048, description="max tokens")
        self.output = w.Output(layout=w.Layout(border="1px solid #ccc", min_height="6em"))
        self.status = w.Label()
        self.send_button.on_click(lambda _: self.send())
        self.stop_button.on_click(lambda _: self.stop())
        self.box = w.VBox(
            [
                self.output,
                self.prompt,
                w.HBox([self.send_button, self.stop_button, self.status]),
                w.HBox([self.temperature, self.top_p, self.max_tokens]),
            ]
        )

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def params(self):
        from forge_engine.generate import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens.value,
            temperature=self.temperature.value,
            top_p=self.top_p.value,
        )

    def send(self, text: str | None = None) -> bool:
        """Send the text box's message (or `text`), or the result of the first tool call waiting for
        one; False when a reply is still streaming or there is nothing to send."""
        text = self.prompt.value if text is None else text
        if self.busy or not text.strip():
            return False
        self.prompt.value = ""
        if self.waiting:
            return self.answer_tool(self.waiting[0]["id"], text)
        self._start = len(self.history)
        self.history.append({"role": "user", "content": text})
        self._show(f"you: {text}\n")
        self._reply(self.tool_choice)
        return True

    def answer_tool(self, call_id: str, result: str) -> bool:
        "The result of a tool call of the last reply; once every call has one, the model answers."
        call = next((c for c in self.waiting if c["id"] == call_id), None)
        if call is None:
            waiting = [c["id"] for c in self.waiting]
            raise ValueError(f"no tool call {call_id!r} waits for a result; waiting: {waiting}")
        self.waiting.remove(call)
        self._results.append(tool_message(call, result))
        self._show(f"result of {call['function']['name']}: {result}\n")
        if self.waiting:
            self._ask_results()
            return True
        self.history += self._results
        self._results = []
        self.prompt.placeholder = "Your message"
        self._reply("auto")  # a forced choice was for the reply to the person's message
        return True

    def _ask_results(self) -> None:
        name = self.waiting[0]["function"]["name"]
        self.prompt.placeholder = f"result of {name}"
        self.status.value = f"waiting for {len(self.waiting)} tool result(s): {name} first"

    def _reply(self, tool_choice) -> None:
        self._show("assistant: ")
        self._stop.clear()
        self.send_button.disabled, self.stop_button.disabled = True, False
        self.status.value = "streaming..."
        self._thread = threading.Thread(
            target=self._stream_reply, args=(self.params(), tool_choice), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        "Abort the reply that is streaming (the thread stops at the next piece)."
        self._stop.set()

    def wait(self, timeout: float | None = None) -> Reply | None:
        "Block until the current reply is done; the last reply."
        if self._thread is not None:
            self._thread.join(timeout)
        return self.replies[-1] if self.replies else None

    def _show(self, text: str) -> None:
        self.transcript += text
        self.output.outputs = (
            {"output_type": "stream", "name": "stdout", "text": self.transcript},
        )

    def _stream_reply(self, params, tool_choice) -> None:
        reply = Reply()
        offered = {"tools": self.tools, "tool_choice": tool_choice} if self.tools else {}
        pieces = self.chat.stream(self.history, params, reply, **offered)
        try:
            for piece in pieces:
                if self._stop.is_set():
                    break
                if piece:
                    self._show(piece)
        except Exception as e:  # shown, never raised on a thread nobody joins
            reply.error = str(e)
        finally:
            pieces.close()
            if self._stop.is_set():
                reply.end("abort")
        ending = "\n" if reply.error else reply_ending(reply)
        self._show(f"{ending}{reply.summary()}\n\n")
        if reply.error:
            del self.history[self._start :]
        else:
            self.history.append(message := reply.message())
            self.waiting = list(message.get("tool_calls", []))
        self.replies.append(reply)
        self.status.value = "error" if reply.error else reply.finish_reason or ""
        if self.waiting:
            self._ask_results()
        self.send_button.disabled, self.stop_button.disabled = False, True


# %% [markdown]
# ## Trying it in-process
#
# A tiny random Qwen3 (real tokenizer and chat template, gibberish text) is enough to check
# the plumbing: the pieces add up to the reply, the timings are in order, and leaving early
# leaves the engine idle.

# %%
from forge_engine.llm import LLM
from forge_engine.generate import SamplingParams

llm = LLM("random:qwen3-tiny", device="cpu", progress=False)
local = LocalChat(llm)
reply = Reply()
pieces = list(
    local.stream(
        [{"role": "user", "content": "Hello!"}],
        SamplingParams(max_tokens=12, ignore_eos=True),
        reply,
    )
)
assert "".join(pieces) == reply.text and reply.num_tokens == 12 and reply.finish_reason == "length"
assert 0 < reply.ttft_s <= reply.e2e_s and len(reply.itl_s) == len(reply.piece_times) - 1
print(repr(reply.text), reply.summary())

stream = local.stream(
    [{"role": "user", "content": "Hello!"}],
    SamplingParams(max_tokens=500, ignore_eos=True),
    reply := Reply(),
)
for _ in range(3):
    next(stream)
stream.close()  # what Ctrl+C or the Stop button do
assert reply.finish_reason == "abort" and not llm.engine.has_unfinished()
llm.engine.allocator.check_idle()

# %% [markdown]
# The loop, driven by a scripted "keyboard": two questions, then end of input.

# %%
lines, shown = iter(["Hi there", "/reset", "Another question"]), []


def read(prompt):
    try:
        return next(lines)
    except StopIteration:
        raise EOFError


replies = chat_loop(
    local,
    SamplingParams(max_tokens=6, ignore_eos=True),
    system="Be brief.",
    read=read,
    write=shown.append,
    log=shown.append,
)
assert len(replies) == 2 and all(r.num_tokens == 6 for r in replies)
assert "(new conversation)\n" in shown and replies[0].text in "".join(shown)

# %% [markdown]
# Ctrl+C in the middle of a reply stops that reply and the loop goes on to the next line:

# %%
lines, written, pressed = iter(["first", "second"]), [], []


def write(s):
    written.append(s)
    if s and not pressed and len(written) > 2:
        pressed.append(True)
        raise KeyboardInterrupt


replies = chat_loop(
    local,
    SamplingParams(max_tokens=24, ignore_eos=True),
    read=read,
    write=write,
    log=lambda s: None,
)
assert [r.finish_reason for r in replies] == ["abort", "length"] and replies[0].num_tokens < 24
llm.engine.allocator.check_idle()

# %% [markdown]
# ## Tool calls in-process
#
# The random model would never call a tool by itself, but under `tool_choice` 'required' or a
# tool's name the grammar leaves it nothing else to write: its reply is calls of the offered
# tools, with arguments that follow their schemas, and no text.

# %%
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"type": "string", "maxLength": 12}},
        },
    },
}
ask = [{"role": "user", "content": "Weather in Paris?"}]
tool_params = SamplingParams(max_tokens=120, temperature=1.0, seed=1)
for choice in ("required", "get_weather"):
    reply = Reply()
    text = "".join(local.stream(ask, tool_params, reply, tools=[weather], tool_choice=choice))
    assert text == reply.text == "" and reply.finish_reason == "tool_calls" and reply.tool_calls
    for call in reply.tool_calls:
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        assert list(json.loads(call["function"]["arguments"])) == ["city"]
    print(f"{choice}: " + ", ".join(call_line(call) for call in reply.tool_calls))
with pytest.raises(ValueError, match="not one of the tools"):
    next(local.stream(ask, tool_params, Reply(), tools=[weather], tool_choice="get_time"))
llm.engine.allocator.check_idle()

# %% [markdown]
# The loop shows the call on its line, asks for its result, sends it back as a `tool` message
# with the call's id, and the model answers. `Recorded` keeps what each request sent.

# %%
import copy


class Recorded:
    "A chat source that remembers the messages and tool options of each request."

    def __init__(self, chat):
        self.chat, self.sent = chat, []

    def stream(self, messages, params, reply, **offered):
        self.sent.append((copy.deepcopy(messages), offered))
        return self.chat.stream(messages, params, reply, **offered)


def scripted(*answers):
    "A keyboard that types `answers`, one a prompt, then Ctrl+D; `prompts` keeps what it was asked."
    lines, prompts = iter(answers), []

    def read(prompt):
        prompts.append(prompt)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    return read, prompts


read, prompts = scripted("Weather in Paris?", '{"temperature": 18}')
recorded, shown = Recorded(local), []
replies = chat_loop(
    recorded,
    tool_params,
    read=read,
    write=shown.append,
    log=shown.append,
    tools=[weather],
    tool_choice="get_weather",
)
[call] = replies[0].tool_calls
print("".join(shown))
assert f"\n→ {call_line(call)}\n" in "\n" + "".join(shown) and "<tool_call>" not in "".join(shown)
assert prompts == [">>> ", "result of get_weather: ", ">>> "]
(first, asked), (then, answered) = recorded.sent
assert asked["tool_choice"] == "get_weather" and answered == {
    "tools": [weather],
    "tool_choice": "auto",
}
assert then == first + [
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
]
assert replies[1].finish_reason in ("stop", "length") and not replies[1].tool_calls
llm.engine.allocator.check_idle()

# %% [markdown]
# ## The widget
#
# Displayed, it looks like a small chat window. Here we press its buttons from code: send a
# message, watch the text arrive in the output, press Stop in the middle of a long reply.

# %%
chat_widget = ChatWidget(llm)
chat_widget

# %%
chat_widget.max_tokens.value = 8
assert chat_widget.send("Hello!")
reply = chat_widget.wait(60)
shown = chat_widget.output.outputs[0]["text"]
assert (
    reply.finish_reason in ("length", "stop")
    and reply.text in shown
    and shown.startswith("you: Hello!\nassistant: ")
)
assert chat_widget.history[-1] == {"role": "assistant", "content": reply.text}

chat_widget.max_tokens.value = 2048
assert chat_widget.send("Tell me a long story.") and not chat_widget.send(
    "too early"
)  # one reply at a time
deadline = time.monotonic() + 60
while len(chat_widget.transcript) < len(shown) + 60 and time.monotonic() < deadline:
    time.sleep(0.01)  # some text came
chat_widget.stop_button.click()
reply = chat_widget.wait(60)
assert reply.finish_reason == "abort" and reply.num_tokens < 2048 and not chat_widget.busy
assert not llm.engine.has_unfinished()
llm.engine.allocator.check_idle()
assert chat_widget.status.value == "abort" and not chat_widget.send_button.disabled

# %% [markdown]
# With tools: the call shows as the terminal shows it and waits; its result, given with
# `answer_tool` (or typed in the box), goes into the history as a `tool` message, and the model
# answers.

# %%
tool_widget = ChatWidget(llm, tools=[weather], tool_choice="get_weather")
tool_widget.max_tokens.value, tool_widget.temperature.value = 120, 1.0
assert tool_widget.send("Weather in Paris?")
reply = tool_widget.wait(60)
[call] = tool_widget.waiting
assert reply.finish_reason == "tool_calls" and reply.tool_calls == [call]
assert f"assistant: → {call_line(call)}\n[" in tool_widget.transcript
assert tool_widget.prompt.placeholder == "result of get_weather"
with pytest.raises(ValueError, match="no tool call 'call_nope' waits"):
    tool_widget.answer_tool("call_nope", "18 C")
assert tool_widget.answer_tool(call["id"], "18 C, clear")
reply = tool_widget.wait(60)
assert tool_widget.history[-3:] == [
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": call["id"], "content": "18 C, clear"},
    reply.message(),
]
assert "result of get_weather: 18 C, clear\nassistant: " in tool_widget.transcript
assert reply.error is None and not tool_widget.waiting
print(tool_widget.transcript)
llm.engine.allocator.check_idle()

# %% [markdown]
# ## Against a server
#
# The server of chapter 11, on a free loopback port in this process, over the same tiny
# model. First the raw wire: the lines of one streamed reply, exactly as they arrive.

# %%
import httpx
from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.server.app import create_app
from forge_engine.server.serve import ServerThread

served = AsyncEngine(LLMEngine(llm.loaded, EngineConfig(kv_cache_bytes=2**22)))
server = ServerThread(create_app(served, "qwen3-tiny", api_key="secret"))
url = server.__enter__()
body = request_body(
    SamplingParams(max_tokens=4, temperature=0),
    "qwen3-tiny",
    messages=[{"role": "user", "content": "Hi"}],
)
with httpx.stream(
    "POST", url + "/v1/chat/completions", json=body, headers=api_headers("secret")
) as response:
    lines = list(response.iter_lines())
for line in lines:
    print(line)

# %%
chunks = [parse_chunk(data) for data in sse_data(lines)]
assert lines[-2:] == ["data: [DONE]", ""] and chunks[-1].usage["completion_tokens"] == 4
assert any(c.finish_reason == "length" for c in chunks)

# %% [markdown]
# The same conversation through `RemoteChat`: the reply streams, and closing it early
# disconnects, which the server turns into an abort.

# %%
remote = RemoteChat(url, api_key="secret")
reply = Reply()
text = "".join(
    remote.stream(
        [{"role": "user", "content": "Hello!"}],
        SamplingParams(max_tokens=8, ignore_eos=True),
        reply,
    )
)
assert (
    remote.model == "qwen3-tiny"
    and text == reply.text
    and reply.num_tokens == 8
    and reply.finish_reason == "length"
)
print(reply.summary())

stream = remote.stream(
    [{"role": "user", "content": "Hello!"}],
    SamplingParams(max_tokens=1000, ignore_eos=True),
    Reply(),
)
for _ in range(3):
    next(stream)
stream.close()
deadline = time.monotonic() + 10
while served.engine.has_unfinished():  # the server saw the disconnect and aborted
    assert time.monotonic() < deadline, "the server did not abort the request"
    time.sleep(0.05)
served.engine.allocator.check_idle()

# %% [markdown]
# Refusals come back as the server's own words:

# %%
with pytest.raises(ChatError, match="HTTP 401"):
    list(
        RemoteChat(url, api_key="wrong", model="qwen3-tiny").stream(
            [{"role": "user", "content": "hi"}], SamplingParams(), Reply()
        )
    )
with pytest.raises(ChatError, match=r"HTTP 400: .*max_tokens asks for 100000"):
    list(
        remote.stream(
            [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=100000), Reply()
        )
    )
try:
    RemoteChat("http://127.0.0.1:9").model
except ChatError as e:
    print(e)

# %% [markdown]
# Tool calls over the wire: the server forces the named call with its grammar and streams it as
# a `delta.tool_calls` entry; `RemoteChat` joins it into `reply.tool_calls`, and the result goes
# back in the next request.

# %%
reply = Reply()
text = "".join(remote.stream(ask, tool_params, reply, tools=[weather], tool_choice="get_weather"))
[call] = reply.tool_calls
assert text == "" and reply.finish_reason == "tool_calls" and call["id"].startswith("call_")
assert list(json.loads(call["function"]["arguments"])) == ["city"]
answer = Reply()
history = ask + [reply.message(), tool_message(call, "18 C")]
list(remote.stream(history, SamplingParams(max_tokens=5), answer, tools=[weather]))
assert (
    answer.finish_reason in ("stop", "length")
    and answer.usage["prompt_tokens"] > reply.usage["prompt_tokens"]
)  # the call and its result are in the prompt

# %% [markdown]
# The widget is the same over a URL: `ChatWidget(url, api_key=...)`.

# %%
remote_widget = ChatWidget(url, api_key="secret")
remote_widget.max_tokens.value = 6
assert remote_widget.send("Hello!")
assert (
    remote_widget.wait(60).error is None
    and remote_widget.replies[-1].text in remote_widget.transcript
)
remote.close()
remote_widget.chat.close()
server.__exit__(None, None, None)
served.close()
