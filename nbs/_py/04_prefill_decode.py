# %% [markdown]
# # Prefill and decode
#
# > Generate text explicitly: one forward over the prompt (prefill), then one token per step (decode) over a KV cache.

# %% [markdown]
# Without a cache, producing token `n+1` re-runs the model over all `n` tokens. But the keys
# and values of earlier tokens never change, so we keep them: a **KV cache**. Then:
#
# - **prefill**: one forward over the whole prompt, writing its K/V into the cache; the last
#   position's logits give the first new token. Compute-bound: many tokens per weight read.
# - **decode**: one forward per new token, reading all cached K/V. Memory-bound: the whole
#   model is read from memory to produce one token.
#
# This chapter's cache is *contiguous*: one sequence, one preallocated buffer. Chapter 05 makes
# it paged so many sequences share one pool. Here we also define what a request asks for,
# `SamplingParams`, and the plain per-sequence sampler that the batched one (chapter 06) is
# tested against.

# %%
#| default_exp generate

# %%
#| export
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from forge_engine.config import ModelConfig
from forge_engine.model import Transformer, causal_attention
from forge_engine.tokenizer import IncrementalDetokenizer, Tokenizer

# %%
#| hide
import random

import pytest
from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights


# %% [markdown]
# ## The contiguous KV cache
#
# Per layer a `[max_len, kv_heads, head_dim]` buffer for K and one for V. As an attention
# backend it writes the new tokens' K/V after the `length` already cached, then attends over
# everything up to them. The caller advances `length` once the whole forward is done.

# %%
#| export
class ContiguousKVCache:
    "K/V of one sequence in preallocated buffers; an attention backend for `Transformer.forward`."

    def __init__(self, config: ModelConfig, max_len: int, device="cpu", dtype=torch.float32):
        shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len, self.length = max_len, 0

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        start, end = self.length, self.length + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens do not fit in {self.max_len}")
        self.k[layer, start:end], self.v[layer, start:end] = k, v
        return causal_attention(q, self.k[layer, :end], self.v[layer, :end], q_offset=start)

    def advance(self, n: int):
        self.length += n


@torch.no_grad()
def prefill(model: Transformer, cache: ContiguousKVCache, token_ids: Sequence[int]) -> torch.Tensor:
    "Run the prompt (or the next chunk of it) through the model; logits of its last token."
    device = cache.k.device
    ids = torch.as_tensor(token_ids, device=device)
    positions = torch.arange(cache.length, cache.length + len(ids), device=device)
    hidden = model(ids, positions, cache)
    cache.advance(len(ids))
    return model.compute_logits(hidden[-1:])[0]


def decode_step(model: Transformer, cache: ContiguousKVCache, token_id: int) -> torch.Tensor:
    "One new token in, the next token's logits out. A prefill of length one."
    return prefill(model, cache, [token_id])


# %% [markdown]
# The cache must not change the answer: logits from prefill + decode equal those of a full
# forward over the same tokens.

# %%
tiny = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0)
tokens = [3, 14, 15, 92, 65, 35, 89, 79]
with torch.no_grad():
    full = tiny.compute_logits(tiny(torch.tensor(tokens), torch.arange(8)))
cache = ContiguousKVCache(tiny.config, max_len=16)
stepwise = [prefill(tiny, cache, tokens[:5])] + [decode_step(tiny, cache, t) for t in tokens[5:]]
# fp32: the cached steps sum the same products in another order (~1e-7 relative each) through 2 layers: measured 4e-7
torch.testing.assert_close(torch.stack(stepwise), full[4:], rtol=1e-5, atol=1e-5)
assert cache.length == 8
with pytest.raises(ValueError, match="KV cache full"):
    prefill(tiny, cache, list(range(9)))

# %% [markdown]
# ## What a request asks for: `SamplingParams`
#
# The names follow vLLM (and so the OpenAI API). Every parameter is checked here, before a
# request is queued anywhere, and the error names the parameter.
#
# `structured` asks for an output that matches a JSON schema, a regex, a grammar or one of a few
# strings (`StructuredOutput`): chapter 06a turns it into a mask of the tokens allowed at each step.

# %%
#| export
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (chapter 06a makes a token mask of it). `spec` by `kind`: json_schema, the schema
    (a dict, or its JSON text); json_object, None (any JSON object); regex, a pattern; grammar, a Lark grammar;
    choice, a list of strings (the output is one of them)."""

    kind: str
    spec: Any = None

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"invalid structured output kind {self.kind!r}: one of {', '.join(STRUCTURED_KINDS)}"
            )
        wanted = {
            "json_schema": (dict, str),
            "regex": str,
            "grammar": str,
            "choice": (list, tuple),
        }.get(self.kind)
        if wanted is None and self.spec is not None:
            raise ValueError(
                f"structured output {self.kind} takes no spec, got {type(self.spec).__name__}"
            )
        if wanted is not None and not (isinstance(self.spec, wanted) and self.spec):
            raise ValueError(
                f"structured output {self.kind} needs a non-empty spec, got {self.spec!r}"
            )
        if self.kind == "choice" and not all(isinstance(c, str) and c for c in self.spec):
            raise ValueError("structured output choice needs non-empty strings")


@dataclass
class SamplingParams:
    "How to pick tokens and when to stop. Names follow vLLM."

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 (or 0): off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # how many top alternatives to report per token
    skip_special_tokens: bool = True
    n: int = 1
    structured: StructuredOutput | None = (
        None  # the output must match a schema, regex, grammar or choice
    )

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            ("n", self.n == 1, "only n=1 is supported"),
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "must be an integer >= 1",
            ),
            (
                "temperature",
                self.temperature >= 0 and math.isfinite(self.temperature),
                "must be >= 0",
            ),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be -1 (off) or >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            (
                "min_tokens",
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "must be in [0, max_tokens]",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "logit_bias",
                all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()),
                "values must be in [-100, 100]",
            ),
            (
                "structured",
                self.structured is None or isinstance(self.structured, StructuredOutput),
                "must be a StructuredOutput",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(
                    f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# %%
assert SamplingParams(stop="\n").stop == ["\n"]
for bad in [
    dict(temperature=-1),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_k=-2),
    dict(max_tokens=0),
    dict(n=2),
    dict(structured={"type": "object"}),
]:
    with pytest.raises(ValueError, match=f"invalid sampling parameter {next(iter(bad))}="):
        SamplingParams(**bad)
assert SamplingParams(structured=StructuredOutput("regex", "[0-9]+")).structured.spec == "[0-9]+"
for kind, spec, why in [
    ("xml", None, "invalid structured output kind"),
    ("regex", "", "needs a non-empty spec"),
    ("json_object", {"type": "object"}, "takes no spec"),
    ("choice", ["a", 1], "non-empty strings"),
]:
    with pytest.raises(ValueError, match=why):
        StructuredOutput(kind, spec)


# %% [markdown]
# ## The plain sampler
#
# One sequence, one step, each rule written the obvious way. This is the reference the batched
# sampler of chapter 06 must agree with. The order is vLLM's: adjust the logits (bias,
# penalties, forbidden tokens), then temperature, then cut the distribution (top-k, top-p,
# min-p), then draw.
#
# We draw with the *exponential race*: `argmax(p / E)` with `E ~ Exp(1)` picks token `i` with
# probability `p_i`. It needs one random number per token from the request's own generator,
# so a request's seed gives the same tokens whatever else is in the batch.

# %%
#| export
def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> torch.Tensor:
    "Logit bias, repetition penalty (prompt + output) and presence/frequency penalties (output)."
    logits = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        logits[int(token)] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device
        )
        if len(seen):
            x = logits[seen]
            logits[seen] = torch.where(
                x > 0, x / params.repetition_penalty, x * params.repetition_penalty
            )
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(output_ids, device=logits.device), minlength=logits.numel()
        ).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def filter_probs(
    probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    "Zero out tokens outside top-k, outside the top-p nucleus, or below min_p x the top probability; renormalise."
    probs = probs.clone()
    if top_k > 0 and top_k < probs.numel():
        probs[probs < torch.topk(probs, top_k).values[-1]] = 0
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly more likely tokens
        probs[order[mass_before >= top_p * sorted_probs.sum()]] = 0
    if min_p > 0:
        probs[probs < min_p * probs.max()] = 0
    return probs / probs.sum()


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    "Greedy, or temperature + filters + an exponential race drawn from `generator`."
    if params.greedy:
        return int(logits.argmax())
    probs = filter_probs(
        torch.softmax(logits / params.temperature, dim=-1), params.top_k, params.top_p, params.min_p
    )
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())


# %% [markdown]
# A next-token distribution before and after each filter (the temperature sharpens it first):

# %%
import matplotlib.pyplot as plt

torch.manual_seed(0)
logits = torch.randn(40) * 2
probs = torch.softmax(logits / 0.8, -1)
steps = {
    "softmax(logits / 0.8)": probs,
    "top_k=10": filter_probs(probs, top_k=10),
    "top_p=0.8": filter_probs(probs, top_p=0.8),
    "min_p=0.1": filter_probs(probs, min_p=0.1),
}
fig, axes = plt.subplots(1, 4, figsize=(12, 2.2), sharey=True)
order = probs.argsort(descending=True)
for ax, (title, p) in zip(axes, steps.items()):
    ax.bar(range(40), p[order])
    ax.set_title(f"{title}: {(p > 0).sum()} left", fontsize=9)
plt.show()

# %%
p = torch.tensor([0.5, 0.3, 0.15, 0.05])
assert torch.equal(filter_probs(p, top_k=2) > 0, torch.tensor([True, True, False, False]))
assert torch.equal(filter_probs(p, top_p=0.8) > 0, torch.tensor([True, True, False, False]))
assert torch.equal(filter_probs(p, top_p=0.81) > 0, torch.tensor([True, True, True, False]))
assert torch.equal(filter_probs(p, min_p=0.5) > 0, torch.tensor([True, True, False, False]))
# fp32: 0.3 rounded, then the sum and each quotient: three roundings of 2^-24 at most
assert torch.allclose(
    filter_probs(p, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), rtol=1e-6, atol=0
)
# the race draws in proportion to p, and a seed repeats it
draws = [
    sample_token(p.log(), SamplingParams(temperature=1.0), torch.Generator().manual_seed(s))
    for s in range(4000)
]
freq = torch.bincount(torch.tensor(draws), minlength=4) / 4000
assert torch.allclose(freq, p, atol=0.03), (
    freq
)  # 4000 draws: standard errors <= sqrt(0.25 / 4000) = 0.008
assert sample_token(p.log(), SamplingParams(), torch.Generator().manual_seed(7)) == draws[7]
pen = apply_penalties(
    torch.tensor([2.0, -2.0, 1.0, 0.0]),
    SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 5.0}
    ),
    prompt_ids=[0],
    output_ids=[1, 1],
)
assert torch.equal(
    pen, torch.tensor([1.0, -4.0 - 0.5 - 0.5, 1.0, 5.0])
)  # halves and quarters: exact in binary


# %% [markdown]
# ## Stop strings without leaking them
#
# When streaming, text that *might* be the start of a stop string must be held back: if the
# stop string is `"###"` and the text so far ends in `"#"`, we cannot send that `"#"` yet.
#
# This runs on the engine thread for every token, so its cost must not grow with the square
# of a stop string's length (a client chooses that length). For each stop string the matcher
# keeps a Knuth-Morris-Pratt state: the length of the longest prefix of the stop string that
# ends the text so far. A new character moves that state in amortized constant time, using
# the stop string's failure table (built once, linear in its length). A state equal to the
# stop string's length is a match; the largest state is exactly the text to hold back.

# %%
#| export
def failure_table(s: str) -> list[int]:
    "Knuth-Morris-Pratt: `table[i]` is the length of the longest proper prefix of `s[:i + 1]` that also ends it."
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


class StopStringMatcher:
    "Feeds streamed text; releases only text that can no longer become part of a stop string. Linear time."

    def __init__(self, stops: Sequence[str]):
        self.stops, self.pending, self.stopped = list(stops), "", False
        self._tables = [failure_table(s) for s in self.stops]
        self._states = [0] * len(
            self.stops
        )  # per stop string: its longest prefix that ends the text fed so far

    def feed(self, delta: str) -> str:
        "New text in; the part now safe to emit out. Sets `stopped` when a stop string appears."
        if self.stopped:
            return ""
        text, first = (
            self.pending + delta,
            None,
        )  # first: where the earliest stop string found starts in `text`
        for j, (s, table) in enumerate(zip(self.stops, self._tables)):
            k = self._states[j]
            for i, c in enumerate(delta, len(self.pending)):
                while k and s[k] != c:
                    k = table[k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):
                    first = i + 1 - k if first is None else min(first, i + 1 - k)
                    break
            self._states[j] = k
        if first is not None:
            self.stopped, self.pending = True, ""
            return text[:first]
        hold = max(self._states, default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        "At the end of generation what was held back is safe."
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


# %%
m = StopStringMatcher(["###", "\nUser:"])
out = [m.feed(d) for d in ["Hello", " world", "#", "#", " no", "\nUse", "r: hi"]]
assert out == ["Hello", " world", "", "", "## no", "", ""] and m.stopped
m = StopStringMatcher(["###"])
assert m.feed("a#") == "a" and m.flush() == "#"
assert failure_table("abacabab") == [0, 0, 1, 0, 1, 2, 3, 2]
m = StopStringMatcher(["aab", "xaaaz"])  # a stop string found after the other fell back
assert m.feed("xaa") == "" and m.feed("aab!") == "xaa" and m.stopped


# %% [markdown]
# It agrees with the obvious quadratic definition (find each stop string, hold back the
# longest stop-string prefix that ends the text) on random text cut at random places:

# %%
def reference(stops, deltas):
    "The definition, quadratic in the stop strings' lengths: what the matcher must return."
    out, pending = [], ""
    for delta in deltas:
        text = pending + delta
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return out + [text[: min(hits)]]
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        pending = text[len(text) - hold :] if hold else ""
        out.append(text[: len(text) - hold])
    return out + [pending]


rng = random.Random(0)
for _ in range(500):
    stops = [
        "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        for _ in range(rng.randint(1, 3))
    ]
    deltas = [
        "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
        for _ in range(rng.randint(1, 8))
    ]
    m = StopStringMatcher(stops)
    got = []
    for d in deltas:
        got.append(m.feed(d))
        if m.stopped:
            break
    assert got + ([] if m.stopped else [m.flush()]) == reference(stops, deltas), (stops, deltas)

# %% [markdown]
# And a stop string of 200,000 characters that the text keeps almost matching costs a few
# steps per character, not a scan of the stop string per token (the quadratic version took
# minutes here):

# %%
t0 = time.perf_counter()
m = StopStringMatcher(["a" * 200_000 + "b"])
assert "".join(m.feed("a" * 50) for _ in range(1000)) == "" and len(m.pending) == 50_000
assert m.flush() == "a" * 50_000 and time.perf_counter() - t0 < 10


# %% [markdown]
# Text for a user comes out of two filters in a row: the incremental detokenizer (chapter 02:
# never half a UTF-8 character) and the stop-string matcher (never a piece of a stop string).
# `TextStream` chains them; what it returns is safe to show at once.

# %%
#| export
class TextStream:
    "Token ids in, displayable text deltas out; notices stop strings."

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()
    ):
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.stops = StopStringMatcher(params.stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def add(self, token_id: int) -> str:
        delta = self.stops.feed(self.detokenizer.add(token_id))
        self.text += delta
        return delta

    def finish(self) -> str:
        "The held-back rest, once generation is over."
        delta = self.stops.feed(self.detokenizer.flush()) + self.stops.flush()
        self.text += delta
        return delta


# %%
from forge_engine.registry import fetch

qwen_tok = Tokenizer.from_file(fetch("qwen3-tokenizer"))
ids = qwen_tok.encode("Stars 🌟 are far. ### The end")
stream = TextStream(qwen_tok, SamplingParams(stop=["###"]))
deltas = [stream.add(t) for t in ids]
assert stream.stopped and stream.text == "Stars 🌟 are far. " and "".join(deltas) == stream.text
assert all("\ufffd" not in d and "#" not in d for d in deltas)


# %% [markdown]
# ## The generation loop
#
# Prefill, then: sample, check the stop rules, decode the new token, repeat. `on_token` is
# called with each new token id as it is produced: it is how a caller streams.

# %%
#| export
@dataclass
class Completion:
    "What came out of one request."

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end token, stop token or stop string) or "length"
    logprobs: list[dict[int, float]] | None = (
        None  # per token: its own and the top-N log-probabilities
    )
    ttft_seconds: float | None = None
    seconds: float | None = None


def finish_reason_for(
    token: int, num_generated: int, params: SamplingParams, eos_ids: Sequence[int]
) -> str | None:
    "Token-level stop rules, applied after `token` became the `num_generated`-th output (stop tokens are masked before `min_tokens`)."
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    "Log-probability of the chosen token and of the top_n most likely ones (under the raw logits)."
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(top_n) if top_n else None
    result = {token: float(logp[token])}
    if top is not None:
        result.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
    return result


def generate_tokens(
    model: Transformer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int] = (),
    max_model_len: int | None = None,
    on_token: Callable[[int], bool | None] | None = None,
) -> Completion:
    "Generate for one prompt over a contiguous cache. `on_token` returning True stops early (stop string)."
    prompt_ids = list(prompt_ids)
    limit = max_model_len or model.config.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; the context holds {limit} (prompt + at least 1 new token)"
        )
    if not prompt_ids:
        raise ValueError("prompt is empty")
    param = next(model.parameters())
    cache = ContiguousKVCache(
        model.config, min(limit, len(prompt_ids) + params.max_tokens), param.device, param.dtype
    )
    generator = (
        torch.Generator(device=param.device).manual_seed(params.seed)
        if params.seed is not None
        else None
    )
    never_early = [*eos_ids, *params.stop_token_ids] if params.min_tokens else []
    out = Completion(prompt_ids, logprobs=[] if params.logprobs is not None else None)
    start = time.perf_counter()
    logits = prefill(model, cache, prompt_ids)
    while True:
        adjusted = apply_penalties(logits, params, prompt_ids, out.token_ids)
        if len(out.token_ids) < params.min_tokens and never_early:
            adjusted[never_early] = -math.inf
        token = sample_token(adjusted, params, generator)
        out.token_ids.append(token)
        if out.ttft_seconds is None:
            out.ttft_seconds = time.perf_counter() - start
        if out.logprobs is not None:
            out.logprobs.append(token_logprobs(logits, token, params.logprobs))
        out.finish_reason = finish_reason_for(token, len(out.token_ids), params, eos_ids)
        if on_token is not None and on_token(token):
            out.finish_reason = "stop"
        if out.finish_reason is None and cache.length >= cache.max_len:
            out.finish_reason = "length"
        if out.finish_reason:
            break
        logits = decode_step(model, cache, token)
    out.seconds = time.perf_counter() - start
    return out


# %% [markdown]
# The cache makes no difference to greedy output: the loop's tokens equal the ones we get by
# re-running the model over the whole sequence at every step.

# %%
def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(
                int(
                    model.compute_logits(
                        model(torch.tensor(ids), torch.arange(len(ids)))[-1:]
                    ).argmax()
                )
            )
    return ids[len(prompt) :]


for name in ["qwen3-tiny", "qwen2-tiny", "llama-tiny"]:
    m = init_random_weights(empty_model(preset(name)), seed=3, std=0.1)
    done = generate_tokens(m, tokens, SamplingParams(max_tokens=10, temperature=0))
    assert (
        done.token_ids == greedy_without_cache(m, tokens, 10) and done.finish_reason == "length"
    ), name

# %% [markdown]
# Stop rules, seeds and errors:

# %%
greedy10 = generate_tokens(tiny, tokens, SamplingParams(max_tokens=10, temperature=0)).token_ids
stop_at = greedy10[3]
done = generate_tokens(
    tiny, tokens, SamplingParams(max_tokens=10, temperature=0), eos_ids=[stop_at]
)
assert done.token_ids == greedy10[: greedy10.index(stop_at) + 1] and done.finish_reason == "stop"
done = generate_tokens(
    tiny, tokens, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), eos_ids=[stop_at]
)
assert done.token_ids == greedy10
done = generate_tokens(
    tiny, tokens, SamplingParams(max_tokens=10, temperature=0, min_tokens=10), eos_ids=[stop_at]
)
assert len(done.token_ids) == 10 and stop_at not in done.token_ids
seeded = [
    generate_tokens(tiny, tokens, SamplingParams(max_tokens=8, temperature=1.0, seed=s)).token_ids
    for s in (1, 1, 2)
]
assert seeded[0] == seeded[1] != seeded[2]
done = generate_tokens(tiny, tokens, SamplingParams(max_tokens=3, temperature=0, logprobs=2))
assert all(len(lp) in (2, 3) and t in lp for lp, t in zip(done.logprobs, done.token_ids))
with pytest.raises(ValueError, match="prompt has 4096 tokens; the context holds 4096"):
    generate_tokens(tiny, [1] * 4096, SamplingParams())
