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
from dataclasses import dataclass, field
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


def request_body(
    params,
    model: str,
    messages: list[dict] | None = None,
    prompt: str | None = None,
    stream: bool = True,
) -> dict:
    "The JSON body of a chat (`messages`) or completion (`prompt`) request from `SamplingParams`."
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
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


class ChatError(RuntimeError):
    "A reply failed: the server refused the request, could not be reached, broke the stream, or the engine failed."


@dataclass
class Chunk:
    "What one streamed chunk says: a piece of text, maybe a finish reason, maybe the token usage."

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


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
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return Chunk(text, choice.get("finish_reason"), obj.get("usage"))


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


# %% [markdown]
# ## A reply and its timings
#
# A `Reply` is filled while the text streams. It keeps the arrival time of every chunk that
# carried text; that is all the latency figures need:
#
# - **TTFT**, time to first token: from sending the request to the first piece of text;
# - **ITL**, inter-token latency: the gaps between consecutive pieces;
# - **E2E**: from sending the request to the end of the stream;
# - **TPOT**, time per output token after the first: `(E2E - TTFT) / (tokens - 1)`.
#
# The token count comes from the server's `usage` when it sends one, else from the number of
# text pieces (one per token for most servers; a piece can hold more than one token).

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
        if chunk.text:
            self.add(chunk.text)
        return chunk.text

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
        if self.num_tokens < 2 or self.e2e_s is None:
            return None
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
r = Reply()
assert r.take(Chunk()) == "" and r.take(Chunk("a")) == "a" and r.take(Chunk("b", "length")) == "b"
r.take(Chunk(usage={"prompt_tokens": 3, "completion_tokens": 2}))
r.finish_stream()
assert (r.text, r.finish_reason, r.num_tokens, len(r.piece_times)) == ("ab", "length", 2, 2)
with pytest.raises(ChatError, match="ended before the reply finished"):
    Reply().finish_stream()


# %% [markdown]
# ## Chat sources
#
# `LocalChat` steps an in-process engine itself: it queues the conversation, steps the
# engine and yields each step's text. While it streams it owns the engine, so do not run
# `llm.generate` from another thread at the same time. When the consumer stops early
# (Ctrl+C, a Stop button, a `break`), the generator's `finally` aborts the request, and the
# engine gives the blocks back at once.

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

    def stream(self, messages: list[dict], params, reply: Reply) -> Iterator[str]:
        engine = self.llm.engine
        reply.start = time.perf_counter()
        rid = engine.add_request(self.llm.tokenizer.encode_chat(messages), params)
        try:
            while True:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    if out.delta_token_ids:
                        reply.add(out.delta_text, len(out.delta_token_ids))
                    elif out.delta_text:
                        reply.text += out.delta_text  # text held back until the end
                    if out.finished:
                        reply.end(out.finish_reason)
                        if out.finish_reason == "error":
                            raise ChatError(f"the engine failed the request: {out.error}")
                        yield out.delta_text
                        return
                    yield out.delta_text  # every step, so a consumer can stop between any two
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

    def stream(self, messages: list[dict], params, reply: Reply) -> Iterator[str]:
        import httpx

        body = request_body(params, self.model, messages=messages)
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
# shown and dropped from the conversation; the next line is a fresh try.

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
        history.append({"role": "user", "content": line})
        reply = Reply()
        pieces = chat.stream(history, params, reply)
        try:
            for piece in pieces:
                write(piece)
        except KeyboardInterrupt:
            pieces.close()  # aborts the request if it is still running
            reply.end("abort")
        except ChatError as e:
            reply.error = str(e)
            history.pop()
        write("\n")
        log(reply.summary())
        if not reply.error:
            history.append({"role": "assistant", "content": reply.text})
        replies.append(reply)


# %% [markdown]
# ## From the command line
#
# `forge-engine chat --url http://127.0.0.1:8000` chats with a server; without `--url` the
# model runs in-process. The API key comes from `--api-key` or the environment variable
# `FORGE_API_KEY`. `--model auto` (the default) takes the server's first model.

# %%
#| export
API_KEY_ENV = "FORGE_API_KEY"


def add_chat_url_arguments(parser) -> None:
    "The flags `forge-engine chat` needs to talk to a server instead of loading a model."
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


def run_remote_chat(args, params) -> int:
    "`forge-engine chat --url ...`: 0 at end of input, 2 when the server cannot be used."
    model = None if getattr(args, "model", "auto") in (None, "auto") else args.model
    try:
        chat = RemoteChat(
            args.url, args.api_key or os.environ.get(API_KEY_ENV), model, args.timeout
        )
        print(f"chatting with {chat.model} at {chat.base}", file=sys.stderr)
    except (ValueError, ChatError) as e:
        print(f"forge-engine: error: {e}", file=sys.stderr)
        return 2
    try:
        chat_loop(chat, params, system=getattr(args, "system", None))
    finally:
        chat.close()
    return 0


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
    ):
        import ipywidgets as w

        if isinstance(source, str):
            source = RemoteChat(source, api_key or os.environ.get(API_KEY_ENV), model)
        elif not hasattr(source, "stream"):
            source = LocalChat(source)
        self.chat, self.system = source, system
        self.history: list[dict] = [{"role": "system", "content": system}] if system else []
        self.replies: list[Reply] = []
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
        "Send the text box's message (or `text`); False when a reply is still streaming or there is nothing to send."
        text = self.prompt.value if text is None else text
        if self.busy or not text.strip():
            return False
        self.prompt.value = ""
        self.history.append({"role": "user", "content": text})
        self._show(f"you: {text}\nassistant: ")
        self._stop.clear()
        self.send_button.disabled, self.stop_button.disabled = True, False
        self.status.value = "streaming..."
        self._thread = threading.Thread(
            target=self._stream_reply, args=(self.params(),), daemon=True
        )
        self._thread.start()
        return True

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

    def _stream_reply(self, params) -> None:
        reply = Reply()
        pieces = self.chat.stream(self.history, params, reply)
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
        self._show(f"\n{reply.summary()}\n\n")
        if reply.error:
            self.history.pop()
        else:
            self.history.append({"role": "assistant", "content": reply.text})
        self.replies.append(reply)
        self.status.value = "error" if reply.error else reply.finish_reason or ""
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
