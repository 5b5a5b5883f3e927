# %% [markdown]
# # Tool calls
#
# > Qwen3 calls a tool by writing `<tool_call>{"name": ..., "arguments": ...}</tool_call>`: the grammar that makes it (when a call is required) and the parser that turns it into OpenAI's `tool_calls`, whole or streamed.

# %% [markdown]
# Chapter 02 renders the tools a request offers into the prompt, as Qwen3 was trained to read
# them, and renders earlier calls and their results. The model answers either with text, or with
# one or more blocks
#
# ```
# <tool_call>
# {"name": "get_weather", "arguments": {"city": "Paris"}}
# </tool_call>
# ```
#
# This chapter does the two other halves of OpenAI's `tools`:
#
# - **`tool_choice`.** `auto` lets the model choose, and its text is parsed afterwards. `none`
#   parses nothing. `required` (at least one call) and a named function (exactly that one) are
#   *enforced*, not hoped for: a Lark grammar (chapter 06a) whose only sentences are
#   `<tool_call>` blocks, each holding a JSON object whose `name` is one of the tools and whose
#   `arguments` follow that tool's `parameters` schema. `parallel_tool_calls: false` allows one
#   block, else several.
# - **Parsing.** The text before the first block is the message's `content`; each block that
#   parses into a name and an object of arguments becomes a call with an id, its arguments as a
#   JSON string; a reply with calls ends with `finish_reason: "tool_calls"`. A block that does not
#   parse is left in the text, as the model wrote it. Streamed, the text goes out as it comes,
#   except what might be the start of `<tool_call>`, and each call goes out as one
#   `delta.tool_calls` entry the moment its block closes.

# %%
#| default_exp tool_calls

# %%
#| export
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from forge_engine.generate import StructuredOutput
from forge_engine.grammar import JSON_FORMAT

# %%
#| hide
import pytest

# %% [markdown]
# ## What a request may offer
#
# `tools` as OpenAI defines them, checked here so that a bad one is a clear error (the server
# maps it to a 400 naming `tools` or `tool_choice`).

# %%
#| export
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


def check_tools(tools: Any) -> list[dict]:
    "The tools of a request, each `{'type': 'function', 'function': {'name', 'description'?, 'parameters'?}}`."
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ValueError(f"tools must be a list of 1 to {MAX_TOOLS} tools")
    names = []
    for i, tool in enumerate(tools):
        function = (
            tool.get("function")
            if isinstance(tool, dict) and tool.get("type") == "function"
            else None
        )
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not NAME.fullmatch(function["name"])
        ):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of "
                f"1-64 letters, digits, '_' or '-'"
            )
        if not isinstance(function.get("parameters", {}), dict) or not isinstance(
            function.get("description", ""), str
        ):
            raise ValueError(
                f"tools[{i}]: parameters must be a JSON schema object, description a string"
            )
        names.append(function["name"])
    if len(set(names)) < len(names):
        raise ValueError(
            f"tools name a function twice: {sorted(n for n in names if names.count(n) > 1)[0]}"
        )
    return tools


def chosen_tool(tool_choice: Any, tools: Sequence[dict]) -> str | None:
    "'none', 'auto' or 'required' as they are, or the name a `{'type': 'function', 'function': {'name'}}` choice names."
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if tool_choice is None or not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    if name not in [t["function"]["name"] for t in tools]:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    return name


# %% [markdown]
# ## A call that must come: the grammar
#
# One JSON schema per tool, `{"name": <that name>, "arguments": <its parameters>}`, the tools
# joined by `anyOf`, inside Lark's `%json` with chapter 06a's fixed whitespace, between the tags.
# In Qwen3's vocabulary `<tool_call>` and `</tool_call>` are tokens of their own, which a grammar
# names as tokens (`<tool_call>` unquoted), not as the eleven characters.

# %%
#| export
def call_schema(tools: Sequence[dict], name: str | None = None) -> dict:
    "The JSON schema of one call: of the tool called `name`, or of any of them."
    options = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
        }
        for t in tools
        if name is None or t["function"]["name"] == name
    ]
    return {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_FORMAT}


def tool_call_output(
    tools: Sequence[dict], tool_choice: str, parallel: bool = True
) -> StructuredOutput | None:
    "The grammar `tool_choice` asks for ('required' or a tool's name): only calls; None for 'auto' and 'none'."
    if tool_choice in ("auto", "none"):
        return None
    schema = call_schema(tools, None if tool_choice == "required" else tool_choice)
    calls = 'call ("\\n" call)*' if parallel and tool_choice == "required" else "call"
    # the tags are single tokens of Qwen3's vocabulary, written as tokens (`<...>`), not as text
    lark = f'start: {calls}\ncall: {OPEN} "\\n" %json {json.dumps(schema)} "\\n" {CLOSE}\n'
    return StructuredOutput("grammar", lark)


# %% [markdown]
# ## Reading calls out of the text

# %%
#| export
@dataclass
class ToolCall:
    "One call, as OpenAI's `tool_calls` entry wants it."

    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def openai(self, index: int | None = None) -> dict:
        d = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return d if index is None else {"index": index, **d}


def parse_call(block: str) -> ToolCall | None:
    "The call inside one block's text, or None when it is not a name and an object of arguments."
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("name"), str)
        and isinstance(data.get("arguments", {}), dict)
    ):
        return None
    return ToolCall(data["name"], json.dumps(data.get("arguments", {}), ensure_ascii=False))


# %% [markdown]
# Streamed: `ToolCallStream.add(delta)` returns the text that can go out now and the calls that
# just closed. It holds back only what could still be the start of `<tool_call>` and the newlines
# before it (the text before a call ends without them); once a call was made, text of nothing
# but newlines between and after calls is dropped. A block that does not parse stays in the text.

# %%
#| export
class ToolCallStream:
    "A reply's text delta by delta: content as it comes, each call when its block closes."

    def __init__(self):
        self.pending, self.in_call, self.calls = "", False, 0

    @staticmethod
    def _held(text: str) -> int:
        "How many characters at the end of `text` could still begin a block: a prefix of `<tool_call>`, newlines."
        keep = next(
            (k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])),
            0,
        )
        rest = text[: len(text) - keep]
        return keep + len(rest) - len(rest.rstrip("\n"))

    def add(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += delta
        pieces, calls = [], []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                if end < 0:
                    if final:
                        pieces.append(OPEN + self.pending)
                        self.pending = ""  # never closed: text
                    break
                block, self.pending, self.in_call = (
                    self.pending[:end],
                    self.pending[end + len(CLOSE) :],
                    False,
                )
                if (call := parse_call(block)) is None:
                    pieces.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
                    self.calls += 1
                continue
            at = self.pending.find(OPEN)
            if at >= 0:
                pieces.append(self.pending[:at].rstrip("\n"))
                self.pending, self.in_call = self.pending[at + len(OPEN) :], True
                continue
            cut = len(self.pending) - (0 if final else self._held(self.pending))
            pieces.append(self.pending[:cut])
            self.pending = self.pending[cut:]
            break
        if self.calls:
            pieces = [p for p in pieces if p.strip("\n")]
        return "".join(pieces), calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    "A whole reply's `(content, calls)`: what `ToolCallStream` gives for it in one piece."
    return ToolCallStream().add(text, final=True)


# %%
reply = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
content, calls = parse_tool_calls(reply)
assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
assert (
    json.loads(calls[0].arguments) == {"city": "Paris"}
    and calls[0].id.startswith("call_")
    and calls[0].id != calls[1].id
)
assert parse_tool_calls("no calls here") == ("no calls here", [])
broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
assert parse_tool_calls(broken) == (broken, [])
assert parse_tool_calls("plain text\n") == ("plain text\n", [])


# %%
def streamed(text, size):
    stream, content, calls = ToolCallStream(), "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        c, k = stream.add(piece, final=i == len(pieces) - 1)
        content, calls = content + c, calls + k
    return content, [(k.name, k.arguments) for k in calls]


for size in (
    1,
    3,
    7,
    1000,
):  # however the text is cut, the same content and calls as the whole reply's
    assert streamed(reply, size) == (
        "Let me check.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ), size
    assert streamed("a < b and <tool", size) == ("a < b and <tool", [])
    assert streamed(broken, size)[1] == []

# %% [markdown]
# The grammar, with chapter 06a's compiler and random logits: under `required` every output is
# one or more calls of the offered tools with arguments that follow their schemas; a named
# choice calls that tool alone.

# %%
import torch
import jsonschema
from forge_engine.grammar import GrammarCompiler
from forge_engine.registry import fetch
from forge_engine.tokenizer import Tokenizer

tokenizer = Tokenizer.from_file(fetch("qwen3-tokenizer"))
compiler = GrammarCompiler(tokenizer, 151_936, tokenizer.eos_token_ids)
weather = {
    "type": "object",
    "required": ["city"],
    "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
}
tools = check_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            },
        },
    ]
)


def random_calls(choice, seed, parallel=True):
    matcher = compiler.compile(tool_call_output(tools, choice, parallel))
    generator, out, mask = (
        torch.Generator().manual_seed(seed),
        [],
        torch.zeros(1, compiler.words, dtype=torch.int32),
    )
    from forge_engine.sampling import unpack_bits

    for _ in range(300):
        compiler.fill_masks([matcher], mask)
        logits = torch.randn(compiler.vocab_size, generator=generator).masked_fill(
            ~unpack_bits(mask, compiler.vocab_size)[0], -1e9
        )
        token = int(logits.argmax())
        if token in tokenizer.eos_token_ids:
            return parse_tool_calls(tokenizer.decode(out))
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(tokenizer.decode(out))


for seed in range(6):
    content, calls = random_calls("required", seed)
    assert content == "" and calls, content
    for call in calls:
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), weather)
        else:
            assert call.name == "get_time" and json.loads(call.arguments) == {}
    assert [c.name for c in random_calls("get_weather", seed)[1]] == ["get_weather"]
    assert len(random_calls("required", seed, parallel=False)[1]) == 1
assert tool_call_output(tools, "auto") is None and tool_call_output(tools, "none") is None
assert chosen_tool({"type": "function", "function": {"name": "get_time"}}, tools) == "get_time"
for bad, why in [
    ({"type": "function", "function": {"name": "nope"}}, "not one of the tools"),
    ("sometimes", "must be"),
]:
    with pytest.raises(ValueError, match=why):
        chosen_tool(bad, tools)
for bad, why in [
    ([], "1 to 128"),
    ([{"type": "function", "function": {"name": "a b"}}], "letters"),
    ([tools[0], tools[0]], "twice: get_weather"),
]:
    with pytest.raises(ValueError, match=why):
        check_tools(bad)
