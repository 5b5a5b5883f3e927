# %% [markdown]
# # Structured outputs: a grammar as a token mask
#
# > JSON that parses, a regex that matches, one of a list: whatever the weights, because every step may only pick a token the grammar allows next.

# %% [markdown]
# A request may say what its output must look like: `response_format` with a JSON schema, a
# regular expression, a grammar, one of a few strings, or (chapter 15) a call of one of the
# tools it offers. Asking the model nicely is not enough: a small or quantized model, or a long
# answer, sooner or later writes a stray comma. **Constrained decoding** makes the constraint
# hold by construction. Before each token is sampled, a grammar engine says which tokens of the
# vocabulary may come next, and the sampler (chapter 06) sets every other logit to `-inf`:
#
# ```
# grammar  ──compile──▶  matcher (a parser state)
#                          │  ▲
#               mask(state)│  │consume(token)
#                          ▼  │
# logits [V] ──▶ masked_fill(~allowed, -inf) ──▶ sample ──▶ token
#
# after `{"name": "Al`, a schema {"name": string, "age": integer}:
#   allowed: any token that continues the string ("ice", "an", "\""...)   e.g. 150,000 of 151,936
# after `{"name": "Alice", "age": `:
#   allowed: "-", "0".."9", "12", "4"...   (tokens made only of digits)    a few thousand
# after `{"name": "Alice", "age": 42}`:
#   allowed: the end-of-turn token alone
# ```
#
# **Why the mask needs the tokenizer's byte view.** A grammar speaks of characters, the model
# of tokens, and a token is a run of *bytes*: `"},` is one Qwen3 token that closes a string, an
# object and starts the next item at once; a token may also hold half of a UTF-8 character. So
# "may token t come next" means "may the grammar's parser consume all of t's bytes from here".
# Checking 151,936 tokens one by one every step would take milliseconds; a grammar engine walks
# the vocabulary as a trie of byte strings and prunes whole subtrees at once (every token that
# starts with a letter, when a digit is due).
#
# We do not write that engine. `llguidance` (the Rust core behind Guidance, used by llama.cpp
# and vLLM) compiles JSON schemas, regular expressions and Lark grammars, keeps one matcher per
# request, and writes a mask as a bitmask: 32 tokens to an `int32` word, the layout chapter 06's
# `AllowedTokens` reads. This chapter is the glue: the tokenizer in its byte view, a
# `StructuredOutput` (chapter 04) turned into a grammar, the masks of a batch's rows, and the
# decisions that make outputs end.
#
# **What it costs a step:** a mask is computed on the host, per row, while the GPU runs the
# step's forward (chapter 08 launches the forward first); then one small copy and one
# `masked_fill` of the row. Measured below on this chapter's JSON schema, with Qwen3's vocabulary;
# on an H200 with random Qwen3-4B, 16 streams each under a JSON schema decode at 3.34 ms a step
# (median; p90 3.55) against 3.21 ms (p90 3.27) without one, +4%
# (`PYTHONPATH=. python3 kernels_lab/grammar_step_cost.py`).

# %%
#| default_exp grammar

# %%
#| export
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from forge_engine.generate import StructuredOutput
from forge_engine.kv_cache import (
    to_device,
)  # host tensors to the GPU without waiting for it (chapter 05)
from forge_engine.sampling import AllowedTokens
from forge_engine.tokenizer import Tokenizer

# %%
#| hide
import time

import jsonschema
import pytest

from forge_engine.registry import fetch
from forge_engine.sampling import SamplingBatch, SamplingRow, sample, unpack_bits
from forge_engine.generate import SamplingParams

# %% [markdown]
# ## From a `StructuredOutput` to a grammar
#
# `llguidance` takes a JSON schema, a regex or a Lark grammar; a choice among strings is a regex
# of the escaped strings joined by `|`, and `json_object` (OpenAI's JSON mode) is the schema
# `{"type": "object"}`.
#
# **JSON whitespace is fixed, not free.** JSON allows any run of spaces and newlines between
# tokens, and a grammar that allows it lets a model (a random one for certain, a real one when
# it is unsure) write whitespace forever, never reaching the closing brace. We allow none but
# one space after `,` and `:` (`{"name": "Alice", "age": 42}`, what `json.dumps` writes), so
# every token the model picks moves the document on. A string in a schema may still be as long
# as the model likes: give it `maxLength` when that matters.

# %%
#| export
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    "A schema, regex or grammar that cannot constrain decoding; the message says what is wrong with it."


def grammar_of(structured: StructuredOutput) -> str:
    "The llguidance grammar (its JSON form) for a `StructuredOutput`."
    from llguidance import LLMatcher  # optional until a request asks for a format

    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        except ValueError as e:
            raise GrammarError(f"json_schema: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec))
    return LLMatcher.grammar_from_lark(spec)


# %% [markdown]
# ## Grammars for one tokenizer
#
# A `GrammarCompiler` holds the tokenizer in llguidance's byte view (built once: about two
# seconds for Qwen3's vocabulary, on first use) and compiles each request's grammar into a
# **matcher**, the parser state that follows that request's tokens. Compiling checks the
# grammar: a regex that does not parse, or a schema keyword llguidance does not implement, is
# refused here with the reason, before the request is queued.
#
# The mask covers the *model's* vocabulary, which may be larger than the tokenizer's (Qwen3's
# LM head has 151,936 rows for 151,669 tokens): rows past the tokenizer's are never allowed.
#
# Clients send the same schema again and again (one per tool set, one per response format), so
# the last `CACHED_GRAMMARS` compiled grammars are kept: a request whose grammar is among them
# gets a copy of its fresh matcher instead of a compile.

# %%
#| export
CACHED_GRAMMARS = 64


class GrammarCompiler:
    """Grammars compiled against one tokenizer's byte view of the vocabulary. Thread-safe: `compile` may run on any
    thread (a complex schema takes a while, so the server compiles beside the engine's thread)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance  # optional until a request asks for a format

        self._llg = llguidance
        self.vocab_size, self.words = vocab_size, (vocab_size + 31) // 32
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._compiled: OrderedDict[str, Any] = (
            OrderedDict()
        )  # grammar text -> a fresh matcher, newest last
        self._lock = threading.Lock()
        self.compiles = self.reuses = 0

    def compile(self, structured: StructuredOutput):
        "A fresh matcher for one request; `GrammarError` naming the problem if the grammar is refused."
        text = grammar_of(structured)
        with self._lock:
            if (fresh := self._compiled.get(text)) is not None:
                self._compiled.move_to_end(text)
                self.reuses += 1
                return fresh.deep_copy()
        fresh = self._llg.LLMatcher(
            self.tokenizer, text, log_level=0
        )  # (outside the lock: it may take a while)
        if fresh.is_error():
            raise GrammarError(f"{structured.kind}: {fresh.get_error()}")
        with self._lock:
            self._compiled[text] = fresh
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            self.compiles += 1
        return fresh.deep_copy()

    def fill_masks(self, matchers: Sequence[Any], out: torch.Tensor) -> None:
        "Row i of `out` (int32 `[len(matchers), words]`, on the host) := the tokens matcher i allows next."
        if (
            out.dtype != torch.int32
            or out.device.type != "cpu"
            or tuple(out.shape) != (len(matchers), self.words)
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"masks go to a contiguous int32 host tensor of shape ({len(matchers)}, {self.words})"
            )
        for row, matcher in zip(out, matchers):
            matcher.unsafe_compute_mask_ptr(
                row.data_ptr(), self.words * 4
            )  # (checked: this row's bytes, above)

    def allowed_tokens(self, rows: Sequence[int], matchers: Sequence[Any], device) -> AllowedTokens:
        "The masks of a step's rows under a grammar, on `device` (the copy queued, the host does not wait)."
        bits = torch.empty(
            len(matchers),
            self.words,
            dtype=torch.int32,
        )
        self.fill_masks(matchers, bits)
        return AllowedTokens(to_device(torch.tensor(list(rows)), device), to_device(bits, device))


# %% [markdown]
# `fill_masks` writes through a pointer into a row of a pinned host tensor (no copy of 19 KB per
# row in Python), after checking shape, dtype and device itself: a wrong pointer would write
# into someone else's memory.
#
# One matcher, one token at a time, with the real Qwen3 tokenizer: the mask of an empty output
# under the regex `[0-9]{3}` allows exactly the tokens made only of digits, and consuming
# one moves the state on.

# %%
tokenizer = Tokenizer.from_file(fetch("qwen3-tokenizer"))
eos = tokenizer.eos_token_ids
start = time.perf_counter()
compiler = GrammarCompiler(tokenizer, vocab_size=151_936, eos_token_ids=eos)
print(f"the tokenizer's byte view: {time.perf_counter() - start:.1f} s")

three_digits = compiler.compile(StructuredOutput("regex", "[0-9]{3}"))
mask = torch.zeros(1, compiler.words, dtype=torch.int32)
compiler.fill_masks([three_digits], mask)
allowed = unpack_bits(mask, compiler.vocab_size)[0].nonzero().squeeze(1).tolist()
texts = [tokenizer.decode([t]) for t in allowed]
assert texts and all(t.isdigit() and len(t) <= 3 for t in texts), texts[:10]
assert tokenizer.encode("7")[0] in allowed and tokenizer.encode("a")[0] not in allowed
assert not any(t >= tokenizer.vocab_size for t in allowed)  # padding rows of the LM head: never
assert three_digits.consume_token(tokenizer.encode("12")[0])  # two digits in one token
compiler.fill_masks([three_digits], mask)
after = [
    tokenizer.decode([t])
    for t in unpack_bits(mask, compiler.vocab_size)[0].nonzero().squeeze(1).tolist()
]
assert after and all(len(t) == 1 and t.isdigit() for t in after)  # one digit is left
print(len(allowed), "tokens may start the number,", len(after), "may end it")

# the same grammar again: a copy of the cached matcher, its own state
again = compiler.compile(StructuredOutput("regex", "[0-9]{3}"))
assert compiler.reuses == 1 and again is not three_digits
assert again.consume_token(tokenizer.encode("7")[0]) and not again.consume_token(
    tokenizer.encode("a")[0]
)
for bad, why in [
    (StructuredOutput("regex", "[0-9"), "regex"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("grammar", "start: undefined_rule"), "grammar"),
]:
    with pytest.raises(GrammarError, match=why):
        compiler.compile(bad)

# %% [markdown]
# ## When the output ends
#
# A grammar says when a document is complete: then its mask allows the end-of-turn token (and
# nothing else, once nothing may follow: `{"age": 42}` after its brace). So the request stops the
# usual way, on an eos token, with `finish_reason: "stop"`; the engine also stops a request
# whose matcher says it is done, for a grammar that ends inside a token. An output cut by
# `max_tokens` is cut as always (`finish_reason: "length"`): it is a prefix of a valid document,
# not a document. A stop string still applies and may end the output early: it is the caller's
# to choose stop strings that do not cut a document.
#
# The decisive test: **random logits under a schema still give a valid document.** With random
# numbers in place of a model, 20 seeds, the output parses and validates against the schema
# every time (the strings bounded by `maxLength`, so random picks end in a few dozen tokens).

# %%
schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "pet"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "pet": {"enum": ["cat", "dog", None]},
    },
}


def random_document(
    seed: int, structured: StructuredOutput, max_tokens: int = 200
) -> tuple[str, float]:
    "Sample under the grammar from random logits (chapter 06's sampler), until eos; the text and mask time per token."
    matcher, generator = compiler.compile(structured), torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    out, mask_s = [], 0.0
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        allowed = compiler.allowed_tokens([0], [matcher], "cpu")
        mask_s += time.perf_counter() - t0
        logits = torch.randn(1, compiler.vocab_size, generator=generator) * 3
        batch = SamplingBatch.build(
            [SamplingRow(params, [], out, generator)], compiler.vocab_size, eos, allowed=allowed
        )
        token = int(sample(logits, batch).token_ids[0])
        if token in eos:
            return tokenizer.decode(out), mask_s / (len(out) + 1)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    raise AssertionError(f"no end in {max_tokens} tokens: {tokenizer.decode(out)!r}")


mask_times = []
for seed in range(20):
    text, per_token = random_document(seed, StructuredOutput("json_schema", schema))
    jsonschema.validate(json.loads(text), schema)
    mask_times.append(per_token)
print(text)
print(
    f"mask per token, this machine: median {sorted(mask_times)[10] * 1e3:.2f} ms (Qwen3's 151,936 tokens)"
)
for seed in range(5):
    text, _ = random_document(seed, StructuredOutput("choice", ["yes", "no", "not sure"]))
    assert text in ("yes", "no", "not sure"), text

# %% [markdown]
# JSON mode (`json_object`) bounds nothing: a random key may run for ever, so it is tested with
# given tokens instead. An object is accepted token by token; an array is refused at its first.

# %%
json_mode = compiler.compile(StructuredOutput("json_object"))
assert (
    json_mode.consume_tokens(tokenizer.encode('{"a": [1, "x"], "b": {"c": null}}'))
    and json_mode.is_accepting()
)
assert not compiler.compile(StructuredOutput("json_object")).consume_token(tokenizer.encode("[")[0])
