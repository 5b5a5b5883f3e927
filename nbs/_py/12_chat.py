# %% [markdown]
# # Chat
#
# > Talking to the engine: a reply and its timings, chat sources in-process or against any OpenAI-compatible server, and the terminal chat loop with its command line.

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
#
# Two pieces have chapters of their own: the OpenAI stream as a client reads it (server-sent
# events, request bodies, chunks: chapter 12a), which `RemoteChat` and the load client share,
# and the notebook widget (chapter 12b), a view over the chat sources of this chapter.

# %%
#| default_exp chat

# %%
#| export
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator
from urllib.parse import urlsplit

from forge_engine.chat_wire import (
    ChatError,
    Chunk,
    error_text,
    openai_tool_choice,
    parse_chunk,
    request_body,
    sse_data,
)

# %%
#| hide
import pytest


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

weather_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
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
remote.close()
server.__exit__(None, None, None)
served.close()
