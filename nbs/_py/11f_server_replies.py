# %% [markdown]
# # The OpenAI-compatible server: the replies
#
# > OpenAI's JSON for a request's outputs: a chat or text completion, whole or streamed as server-sent events, with log-probabilities, usage and tool calls.

# %% [markdown]
# The app (chapter 11c) gets `RequestOutput`s from the engine (chapter 08) and must send what
# an OpenAI client expects. This chapter writes that JSON and nothing else: no engine, no
# HTTP, so every shape is tested here on hand-made outputs.
#
# A whole chat completion (`stream: false`) is one object:
#
# ```
# {"id": "chatcmpl-…", "object": "chat.completion", "created": 1700000000, "model": "qwen3-0.6b",
#  "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"},
#               "logprobs": null, "finish_reason": "stop"}],
#  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
#            "prompt_tokens_details": {"cached_tokens": 0}}}
# ```
#
# Streamed, the same reply is a series of chunks (`"object": "chat.completion.chunk"`, the same
# `id`, `created` and `model` in each) whose choices carry a `delta` instead of a `message`: a
# first chunk with the role, one per engine output that added text (`{"content": " there"}`),
# one with the `finish_reason` and an empty delta, and, when the request set
# `stream_options.include_usage`, a last one with no choices and the `usage` (the chunks before
# it then say `"usage": null`). A text completion (`/v1/completions`) is the same with `"object":
# "text_completion"`, a choice's `text` in place of its message or delta, no role chunk, and
# log-probabilities in the older shape (lists of tokens, of their log-probabilities, and of
# dicts of the top alternatives) rather than a chat's list of `{token, logprob, bytes,
# top_logprobs}`.
#
# **Tool calls.** When a request offers `tools` (and `tool_choice` is not `none`), the model
# writes each call as a `<tool_call>` block of JSON in its text, and chapter 06b's parser takes
# the blocks out. Whole, the message's `content` is the text around them (null when there is
# none), `tool_calls` lists them (`{id, type: "function", function: {name, arguments}}`, the
# arguments a JSON string) and the finish reason is `tool_calls` instead of `stop`. Streamed, the
# text around the blocks goes out as content while the block is held back, and each call goes
# out whole, in one chunk (`{"tool_calls": [{"index": 0, ...}]}`), when its block closes:
# OpenAI sends the arguments in fragments that clients join by `index`, so a single fragment
# reads the same.
#
# **Text chunks from a template.** Almost every chunk of a stream is new text and nothing else:
# the same id, object, creation time, model, index, null log-probabilities and null finish
# reason, only the text changes. The event loop writes every chunk of every stream, one engine
# output at a time, so `text_chunk` keeps that chunk as a template made once (the chunk dumped
# with a placeholder for the text, cut in two there) and only dumps the text into it: about a
# third of the cost of building the chunk's dict and dumping it whole. Every other chunk (the
# role, log-probabilities, tool calls, the finish reason, the usage) is built as a dict.
#
# **n choices** are one `Reply` each (`index` 0 to n-1) sharing the first one's id, and the
# usage counts the prompt once and every choice's tokens (`whole_reply`, `usage_chunk`).

# %%
#| default_exp server.replies

# %%
#| export
from __future__ import annotations

import json
import time
import uuid

from forge_engine.engine import RequestOutput
from forge_engine.server.protocol import ToolRequest
from forge_engine.tokenizer import Tokenizer
from forge_engine.tool_calls import ToolCallStream, parse_tool_calls


# %% [markdown]
# ## Server-sent events
#
# A stream is a series of *server-sent events*: each event is a line `data: <json>` and a
# blank line, and the stream ends with `data: [DONE]`. `json.dumps` escapes newlines, so one
# line per event is always enough.

# %%
#| export
def sse(data: dict | str) -> str:
    "One server-sent event."
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# %% [markdown]
# ## A request's reply
#
# `Reply` writes one choice's JSON: `whole` from the final output, `chunks` from each output
# of a stream (`text_chunk` for the common case), `role_chunk` and `usage_chunk` for the ends
# of a stream, `logprobs` and `usage` in the shape its kind wants.

# %%
#| export
class Reply:
    """OpenAI JSON for the outputs of one request: a chat completion (`kind='chat'`) or a text
    completion ('text'). With `n` choices, one `Reply` a choice (`index`), each sharing the first
    one's id (`of`)."""

    def __init__(
        self,
        kind: str,
        model: str,
        tokenizer: Tokenizer | None,
        top_logprobs: int | None = None,
        tools: ToolRequest | None = None,
        index: int = 0,
        of: Reply | None = None,
    ):
        self.kind, self.model, self.tokenizer, self.top_logprobs = (
            kind,
            model,
            tokenizer,
            top_logprobs,
        )
        # tool calls are read out of the text (chapter 06b), unless the request offers none or
        # chose 'none'
        self.calls = ToolCallStream() if tools is not None and tools.choice != "none" else None
        self.calls_sent = 0
        self._text_template: list[str] | None = None  # `text_chunk`'s, made on first use
        self.index = index
        self.id = of.id if of else ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = of.created if of else int(time.time())

    def _head(self, streamed: bool) -> dict:
        obj = (
            ("chat.completion.chunk" if streamed else "chat.completion")
            if self.kind == "chat"
            else "text_completion"
        )
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None,
        streamed: bool,
        role: bool = False,
    ) -> dict:
        if self.kind == "text":
            return {
                "index": self.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        if not streamed:
            message = {"role": "assistant", "content": text}
        else:
            message = (
                {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            )
        return {
            "index": self.index,
            "delta" if streamed else "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def logprobs(self, out: RequestOutput, start: int) -> dict | None:
        "Log-probabilities of `out.token_ids[start:]`, shaped as this kind of reply wants them."
        if self.top_logprobs is None or out.logprobs is None:
            return None
        rows = []
        for token, alternatives in zip(out.token_ids[start:], out.logprobs[start:]):
            top = sorted(alternatives.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            rows.append(
                (
                    self.token_text(token),
                    alternatives[token],
                    [(self.token_text(t), lp) for t, lp in top],
                )
            )
        if self.kind == "text":
            return {
                "tokens": [s for s, _, _ in rows],
                "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(top) for _, _, top in rows],
            }
        entry = lambda s, lp: {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {
            "content": [
                {**entry(s, lp), "top_logprobs": [entry(*a) for a in top]} for s, lp, top in rows
            ]
        }

    def usage(self, *outs: RequestOutput) -> dict:
        "Tokens of the prompt (once) and of every choice's output."
        n, m = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
        return {
            "prompt_tokens": n,
            "completion_tokens": m,
            "total_tokens": n + m,
            "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens},
        }

    def _finish_reason(self, out: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason

    def whole(self, out: RequestOutput) -> dict:
        "The reply to a request with stream=false, from its final output."
        content, calls = parse_tool_calls(out.text) if self.calls is not None else (out.text, [])
        choice = self._choice(
            content, self._finish_reason(out, bool(calls)), self.logprobs(out, 0), False
        )
        if calls:
            choice["message"].update(
                content=content or None, tool_calls=[c.openai() for c in calls]
            )
        return {**self._head(False), "choices": [choice], "usage": self.usage(out)}

    def text_chunk(self, text: str, include_usage: bool) -> str:
        """The chunk of new text alone, as JSON: the most frequent chunk by far, written from a
        template made once (about a third of the cost of building and dumping its dict)."""
        if self._text_template is None:
            choice = self._choice("\0", None, None, True)
            chunk = {
                **self._head(True),
                "choices": [choice],
                **({"usage": None} if include_usage else {}),
            }
            self._text_template = json.dumps(chunk, ensure_ascii=False).split('"\\u0000"')
        before, after = self._text_template
        return before + json.dumps(text, ensure_ascii=False) + after

    def role_chunk(self, include_usage: bool) -> dict:
        return {
            **self._head(True),
            "choices": [self._choice("", None, None, True, role=True)],
            **({"usage": None} if include_usage else {}),
        }

    def chunks(
        self, out: RequestOutput, include_usage: bool, usage_chunk: bool = True
    ) -> list[dict]:
        """The stream chunks one output adds: its new text, then (when it is the last) the finish
        reason and, unless `usage_chunk` is off (n choices: the usage of all comes once, at the
        end), the usage."""
        head, usage = self._head(True), {"usage": None} if include_usage else {}
        start = len(out.token_ids) - len(out.delta_token_ids)
        logprobs = self.logprobs(out, start) if out.delta_token_ids else None
        if not out.finished and logprobs is None and self.calls is None:
            return [self.text_chunk(out.delta_text, include_usage)] if out.delta_text else []
        chunks, text, calls = [], out.delta_text, []
        if self.calls is not None:
            text, calls = self.calls.add(out.delta_text, final=out.finished)
        if text or logprobs:
            chunks.append({**head, "choices": [self._choice(text, None, logprobs, True)], **usage})
        for call in calls:  # each call whole, in one chunk, when its block closes
            delta = {"tool_calls": [call.openai(index=self.calls_sent)]}
            self.calls_sent += 1
            chunks.append(
                {
                    **head,
                    "choices": [
                        {
                            "index": self.index,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage,
                }
            )
        if out.finished:
            chunks.append(
                {
                    **head,
                    "choices": [
                        self._choice("", self._finish_reason(out, self.calls_sent > 0), None, True)
                    ],
                    **usage,
                }
            )
            if include_usage and usage_chunk:
                chunks.append({**head, "choices": [], "usage": self.usage(out)})
        return chunks

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage(*outs)}


def whole_reply(replies: list[Reply], outs: list[RequestOutput]) -> dict:
    """The reply to a request of n choices with stream=false: each choice as its `Reply` writes
    it, the usage of all."""
    parts = [reply.whole(out) for reply, out in zip(replies, outs)]
    return {
        **parts[0],
        "choices": [part["choices"][0] for part in parts],
        "usage": replies[0].usage(*outs),
    }


# %% [markdown]
# A chat and a text completion of the same output, whole and streamed, with log-probabilities
# and usage:

# %%
out = RequestOutput(
    "r",
    None,
    [1, 2, 3],
    "Hi there",
    [7, 8],
    finished=True,
    finish_reason="stop",
    delta_text=" there",
    delta_token_ids=[8],
    logprobs=[{7: -0.1, 9: -3.0}, {8: -0.5, 7: -1.5, 9: -2.0}],
)
chat = Reply("chat", "m", None, top_logprobs=1)
whole = chat.whole(out)
assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {
    "role": "assistant",
    "content": "Hi there",
}
assert whole["usage"] == {
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "total_tokens": 5,
    "prompt_tokens_details": {"cached_tokens": 0},
}
assert whole["choices"][0]["logprobs"]["content"][1] == {
    "token": "8",
    "logprob": -0.5,
    "bytes": [56],
    "top_logprobs": [{"token": "8", "logprob": -0.5, "bytes": [56]}],
}
text, finish, usage = chat.chunks(out, include_usage=True)
assert text["choices"][0]["delta"] == {"content": " there"} and text["usage"] is None
assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
completion = Reply("text", "m", None, top_logprobs=2).whole(out)
assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == "Hi there"
assert completion["choices"][0]["logprobs"]["top_logprobs"][1] == {"8": -0.5, "7": -1.5}
assert (
    sse({"a": "line\nbreak"}) == 'data: {"a": "line\\nbreak"}\n\n'
    and sse("[DONE]") == "data: [DONE]\n\n"
)

# %% [markdown]
# A reply with tool calls (chapter 06b), whole and streamed in pieces: the content, one chunk
# a call, the finish reason `tool_calls`; with `tool_choice` `none` the text is left as it is:

# %%
tools = ToolRequest([{"type": "function", "function": {"name": "get_weather"}}], "auto")
said = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
whole = Reply("chat", "m", None, tools=tools).whole(
    RequestOutput("r", None, [1], said, [5], finished=True, finish_reason="stop")
)
message = whole["choices"][0]["message"]
assert message["content"] == "Checking." and whole["choices"][0]["finish_reason"] == "tool_calls"
assert message["tool_calls"][0]["function"] == {
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
streaming, chunks = Reply("chat", "m", None, tools=tools), []
for i in range(0, len(said), 5):
    piece = RequestOutput(
        "r",
        None,
        [1],
        said[: i + 5],
        [5],
        finished=i + 5 >= len(said),
        finish_reason="stop",
        delta_text=said[i : i + 5],
        delta_token_ids=[5],
    )
    chunks += streaming.chunks(piece, include_usage=False)
deltas = [c["choices"][0]["delta"] for c in chunks]
assert "".join(d.get("content", "") for d in deltas) == "Checking."
assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0]
assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
plain = Reply("chat", "m", None, tools=ToolRequest(tools.tools, "none")).whole(
    RequestOutput("r", None, [1], said, [5], finished=True, finish_reason="stop")
)
assert plain["choices"][0]["message"]["content"] == said  # tool_choice none: the text as it is
