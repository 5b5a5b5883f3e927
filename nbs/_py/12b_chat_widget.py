# %% [markdown]
# # Chat in a notebook: the widget
#
# > `ChatWidget`: a chat window in a notebook cell, over an in-process `LLM` or a server, with Stop, sampling sliders and tool calls.

# %% [markdown]
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
#
# The widget is a view over chapter 12's pieces: a chat source (`LocalChat`, `RemoteChat`)
# streams the reply into a `Reply`, and tool calls are shown and answered as the terminal loop
# does it. `ipywidgets` is imported when a widget is made, so the package does not need it.

# %%
#| default_exp chat_widget

# %%
#| export
from __future__ import annotations

import os
import threading

from forge_engine.chat import (
    API_KEY_ENV,
    LocalChat,
    RemoteChat,
    Reply,
    reply_ending,
    tool_message,
)

# %%
#| hide
import time

import pytest
from forge_engine.chat import call_line
from forge_engine.llm import LLM


# %%
#| export
class ChatWidget:
    """A chat in a notebook cell over an in-process `LLM`, a server URL, or any chat source.
    `seed`: every reply sampled from it (the same conversation, the same replies)."""

    def __init__(
        self,
        source,
        system: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        seed: int | None = None,
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
        self.tools, self.tool_choice, self.seed = tools, tool_choice, seed
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
            seed=self.seed,
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
# ## Trying it
#
# Over the tiny random Qwen3 of chapter 12 (real tokenizer and chat template, gibberish text),
# with a tool whose call a forced `tool_choice` makes the model write:

# %%
llm = LLM("random:qwen3-tiny", device="cpu", progress=False)
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

# %% [markdown]
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
tool_widget = ChatWidget(llm, tools=[weather], tool_choice="get_weather", seed=0)  # (repeatable)
tool_widget.max_tokens.value, tool_widget.temperature.value = 120, 1.0
assert tool_widget.params().seed == 0 and tool_widget.params().temperature == 1.0
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
# The widget is the same over a URL: `ChatWidget(url, api_key=...)`. Here the server of
# chapter 11, on a free loopback port in this process, over the same tiny model.

# %%
from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.server.app import create_app
from forge_engine.server.serve import ServerThread

served = AsyncEngine(LLMEngine(llm.loaded, EngineConfig(kv_cache_bytes=2**22)))
server = ServerThread(create_app(served, "qwen3-tiny", api_key="secret"))
url = server.__enter__()
remote_widget = ChatWidget(url, api_key="secret")
remote_widget.max_tokens.value = 6
assert remote_widget.send("Hello!")
assert (
    remote_widget.wait(60).error is None
    and remote_widget.replies[-1].text in remote_widget.transcript
)
remote_widget.chat.close()
server.__exit__(None, None, None)
served.close()
