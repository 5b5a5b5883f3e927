# %% [markdown]
# # Batched sampling
#
# > One call turns a `[B, V]` block of logits into `B` next tokens, each row with its own parameters and its own seed.

# %% [markdown]
# Where we are in the flow: the model runner has just produced, for every sequence scheduled
# this step, the logits of its last position: a `[B, V]` tensor (`V` = 151,936 for Qwen3).
# The sampler turns it into `B` token ids. Every row belongs to a different request, so every
# row may ask for something different: greedy, `temperature=0.7, top_p=0.9`, a repetition
# penalty, a seed.
#
# Chapter 04 wrote the plain sampler for one sequence (`apply_penalties`, `filter_probs`,
# `sample_token`, `token_logprobs`). Calling it `B` times in a Python loop works, but each call
# makes several passes over `V` numbers for one row. Here each step runs once for the whole
# batch, and the rule of the chapter is: **row by row, the batched sampler gives what the
# plain one gives** (the same probabilities up to float rounding, and the same tokens for the
# same seeds).
#
# In: the logits and a `SamplingBatch` (the per-row parameters as tensors, built once per
# step). Out: a `SampleResult` (token ids, and log-probabilities for the rows that asked).

# %%
#| default_exp sampling

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import (
    to_device,
    to_device_together,
)  # host tensors to the GPU without waiting for it (chapter 05)

# %%
#| hide
import pytest
from forge_engine.generate import apply_penalties, filter_probs, sample_token, token_logprobs


# %% [markdown]
# ## What one row brings
#
# For each sequence the engine hands over its parameters, the token ids it has seen (prompt
# and output so far: the penalties need them) and its random generator. A request with a
# `seed` owns a generator for its whole life, so its draws continue where the last step left
# them; a request without one draws from torch's global generator.

# %%
#| export
class SamplingRow(NamedTuple):
    "What the sampler needs to know about one sequence at this step."

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None  # None: torch's global generator


def make_generator(params: SamplingParams, device="cpu") -> torch.Generator | None:
    "A request's own random stream, seeded once when it arrives; None when it has no seed."
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


# %% [markdown]
# ## The batch as tensors
#
# Per-row numbers (temperature, top-k, top-p, min-p) become `[B]` tensors, so a filter is one
# broadcast operation with a `[B, 1]` column instead of a loop.
#
# Penalties are different: a request touches only the tokens it has seen or biased, a few
# hundred or thousand out of 151,936. A dense `[B, V]` mask would write `B x V` numbers every
# step to mark them. Instead we keep *sparse* lists of positions in the flattened logits,
# `row * V + token`, with one value per position (`SparseLogits`). They are built with one
# `torch.unique` over all rows together (which also counts output tokens for the frequency
# penalty) and applied with one gather and one scatter. And only when some row uses them: a
# batch without penalties builds and applies nothing.
#
# `min_tokens` is one more sparse list: for each row whose output is still shorter than
# `min_tokens`, the positions of the end-of-sequence ids and its `stop_token_ids`, set to
# `-inf`. (Like the reference, this masks the eos ids even with `ignore_eos=True`.)
#
# A grammar (chapter 06a) is the one dense case: a row that must continue a JSON object may be
# allowed one token (a quote) or most of the vocabulary (inside a string). Its mask is a bitmask,
# 32 tokens to an `int32` word (`AllowedTokens`: 4,748 words, 19 KB a row for Qwen3's 151,936),
# written on the host by the grammar engine and unpacked on the device into one `masked_fill`
# over that row's logits.

# %%
#| export
class AllowedTokens(NamedTuple):
    "The rows under a grammar and, for each, one bit per token of the vocabulary: 32 tokens to an int32 word."

    rows: torch.Tensor  # [G] long
    bits: torch.Tensor  # [G, ceil(V / 32)] int32: bit j of word w is token 32 w + j


def unpack_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    "`[G, W]` int32 words to `[G, vocab_size]` booleans, token 32 w + j from bit j of word w."
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


class SparseLogits(NamedTuple):
    "Values at a few positions of a `[B, V]` tensor, as indices into its flattened view (`row * V + token`)."

    index: torch.Tensor  # [n] long
    value: torch.Tensor  # [n] float32


def _positions(row: int, vocab_size: int, what: str, *token_ids) -> torch.Tensor:
    "Flat positions `row * V + token` of the given token ids; a clear error for an id outside the vocabulary."
    ids = torch.cat(
        [torch.as_tensor(t, dtype=torch.long, device="cpu").reshape(-1) for t in token_ids]
    )
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if len(bad):
        raise ValueError(
            f"{what} of row {row} has token id {int(bad[0])}, outside the vocabulary [0, {vocab_size})"
        )
    return ids + row * vocab_size


@dataclass
class SamplingBatch:
    """The per-row sampling parameters of one engine step, as tensors on the logits' `device`. A batch of greedy rows
    only keeps temperature, top_k, top_p, min_p and the row lists on the host: only sampled rows read them, and a GPU
    step spares two copies."""

    device: torch.device
    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    greedy_rows: torch.Tensor  # [G] long: rows with temperature 0
    sampled_rows: torch.Tensor  # [S] long: the others
    generators: list[torch.Generator | None]  # one per sampled row, in the order of sampled_rows
    logprobs: list[int | None]  # per row: how many alternatives to report; None = no logprobs
    bias: SparseLogits | None = None  # logit_bias, added
    repetition: SparseLogits | None = (
        None  # tokens seen in prompt or output: the row's penalty factor
    )
    output_penalty: SparseLogits | None = (
        None  # output tokens: frequency x count + presence, subtracted
    )
    forbidden: torch.Tensor | None = (
        None  # flat positions of eos and stop ids in rows under min_tokens
    )
    allowed: AllowedTokens | None = (
        None  # rows under a grammar: one bit per token, 1 = may come next (chapter 06a)
    )

    @property
    def size(self) -> int:
        return len(self.logprobs)

    @property
    def adjusts(self) -> bool:
        "Whether any row has a bias, a penalty or a min_tokens mask (else the logits are used as they are)."
        return not (
            self.bias is None
            and self.repetition is None
            and self.output_penalty is None
            and self.forbidden is None
            and self.allowed is None
        )

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        eos_ids: Sequence[int] = (),
        device="cpu",
        allowed: AllowedTokens | None = None,
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors; penalty lists only for the rows that use them. `allowed`: the
        bitmasks of the rows under a grammar, already on `device`."""
        if not rows:
            raise ValueError("a sampling batch needs at least one row")
        device, V = torch.device(device), vocab_size
        rows = [SamplingRow(*row) for row in rows]
        params = [row.params for row in rows]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        for i in sampled:
            g = rows[i].generator
            if g is not None and g.device.type != device.type:
                raise ValueError(f"row {i}: its generator is on {g.device}, the batch on {device}")
        per_row = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
        sparse = lambda index, value: SparseLogits(
            to_device(index, device), to_device(value, device)
        )

        bias = repetition = output_penalty = forbidden = None
        if biased := [i for i, p in enumerate(params) if p.logit_bias]:
            index = torch.cat(
                [
                    _positions(i, V, "logit_bias", [int(t) for t in params[i].logit_bias])
                    for i in biased
                ]
            )
            bias = sparse(
                index, torch.tensor([b for i in biased for b in params[i].logit_bias.values()])
            )
        if penalised := [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]:
            seen = torch.unique(
                torch.cat(
                    [
                        _positions(i, V, "prompt/output", rows[i].prompt_ids, rows[i].output_ids)
                        for i in penalised
                    ]
                )
            )
            repetition = sparse(seen, per_row("repetition_penalty")[seen // V])
        if counted := [
            i
            for i, (p, r) in enumerate(zip(params, rows))
            if (p.presence_penalty or p.frequency_penalty) and len(r.output_ids)
        ]:
            index, count = torch.unique(
                torch.cat([_positions(i, V, "output_ids", rows[i].output_ids) for i in counted]),
                return_counts=True,
            )
            row = (
                index // V
            )  # the reference's frequency x count + presence x (count > 0), per (row, token)
            amount = (
                per_row("frequency_penalty")[row] * count.float() + per_row("presence_penalty")[row]
            )
            output_penalty = sparse(index, amount)
        if early := [
            i for i, (p, r) in enumerate(zip(params, rows)) if len(r.output_ids) < p.min_tokens
        ]:
            forbidden = torch.cat(
                [
                    _positions(i, V, "eos/stop_token_ids", eos_ids, params[i].stop_token_ids)
                    for i in early
                ]
            )
            forbidden = to_device(forbidden, device)

        # two copies to the device (one per dtype), not six: each queued copy costs a GPU a few microseconds; none
        # where every row is greedy (nothing reads them then)
        to = device if sampled else torch.device("cpu")
        temperature, top_p, min_p = to_device_together(
            [
                torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
                for name in ("temperature", "top_p", "min_p")
            ],
            to,
        )
        top_k, greedy_rows, sampled_rows = to_device_together(
            [
                torch.tensor(values, dtype=torch.long)
                for values in (
                    [max(p.top_k, 0) for p in params],  # -1, 0: off
                    [i for i, p in enumerate(params) if p.greedy],
                    sampled,
                )
            ],
            to,
        )
        return cls(
            device=device,
            vocab_size=V,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            greedy_rows=greedy_rows,
            sampled_rows=sampled_rows,
            generators=[rows[i].generator for i in sampled],
            logprobs=[p.logprobs for p in params],
            bias=bias,
            repetition=repetition,
            output_penalty=output_penalty,
            forbidden=forbidden,
            allowed=allowed,
        )


# %%
rows = [
    SamplingRow(SamplingParams(temperature=0), [1, 2, 2], []),
    SamplingRow(SamplingParams(top_k=5, repetition_penalty=1.2, logit_bias={7: 3.0}), [4], [4, 9]),
    SamplingRow(
        SamplingParams(top_p=0.5, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3),
        [0],
        [9, 9],
    ),
]
batch = SamplingBatch.build(rows, vocab_size=10, eos_ids=[2])
assert (
    batch.size == 3 and batch.greedy_rows.tolist() == [0] and batch.sampled_rows.tolist() == [1, 2]
)
assert batch.top_k.tolist() == [0, 5, 0] and batch.generators == [None, None]
assert batch.bias.index.tolist() == [17] and batch.bias.value.tolist() == [3.0]
assert batch.repetition.index.tolist() == [
    14,
    19,
]  # row 1 saw tokens 4 and 9; the greedy row uses no penalty
assert batch.output_penalty.index.tolist() == [29] and batch.output_penalty.value.tolist() == [
    0.5 * 2 + 0.25
]
assert batch.forbidden.tolist() == [22]  # row 2 has 2 < min_tokens outputs: eos 2 forbidden
plain = SamplingBatch.build([SamplingRow(SamplingParams(), [1], [2])], vocab_size=10)
assert plain.bias is plain.repetition is plain.output_penalty is plain.forbidden is None
# for another device ("meta" stands in for a GPU): greedy rows only keep the per-row tensors on the host, no copy
for greedy_or_not, on_device in (
    ([SamplingRow(SamplingParams(temperature=0), [1], [])] * 2, False),
    (
        [
            SamplingRow(SamplingParams(temperature=0), [1], []),
            SamplingRow(SamplingParams(), [1], []),
        ],
        True,
    ),
):
    elsewhere = SamplingBatch.build(greedy_or_not, vocab_size=10, device="meta")
    assert elsewhere.device == torch.device("meta")
    assert all(
        (t.device.type == "meta") == on_device
        for t in (elsewhere.temperature, elsewhere.top_k, elsewhere.sampled_rows)
    )
with pytest.raises(
    ValueError, match=r"logit_bias of row 0 has token id 10, outside the vocabulary \[0, 10\)"
):
    SamplingBatch.build([SamplingRow(SamplingParams(logit_bias={10: 1.0}), [1], [])], vocab_size=10)
with pytest.raises(
    ValueError, match="logit_bias of row 0 has token id -1"
):  # would silently bias the last token
    SamplingBatch.build([SamplingRow(SamplingParams(logit_bias={-1: 1.0}), [1], [])], vocab_size=10)
with pytest.raises(ValueError, match="prompt/output of row 0 has token id 12"):
    SamplingBatch.build(
        [SamplingRow(SamplingParams(repetition_penalty=1.1), [12], [])], vocab_size=10
    )
with pytest.raises(ValueError, match="at least one row"):
    SamplingBatch.build([], vocab_size=10)


# %% [markdown]
# ## Adjusting the logits
#
# The order is the reference's: logit bias, repetition penalty (divide a positive logit,
# multiply a negative one, for every token seen in prompt or output), presence and frequency
# penalties (output tokens only), then the `min_tokens` mask. Each is one operation on the
# flattened logits at the positions the batch listed; rows that use none of them are never
# touched.

# %%
#| export
def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    "Logit bias, repetition / presence / frequency penalties, the min_tokens mask and a grammar's mask, on a float32 copy."
    out = logits.float().clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    if batch.bias is not None:
        flat.index_add_(0, batch.bias.index, batch.bias.value)
    if batch.repetition is not None:
        index, factor = batch.repetition
        seen = flat[index]
        flat[index] = torch.where(seen > 0, seen / factor, seen * factor)
    if batch.output_penalty is not None:
        index, amount = batch.output_penalty
        flat[index] = flat[index] - amount
    if batch.forbidden is not None:
        flat[batch.forbidden] = -math.inf
    if batch.allowed is not None:
        rows, bits = batch.allowed
        out[rows] = out[rows].masked_fill(~unpack_bits(bits, batch.vocab_size), -math.inf)
    return out


# %%
torch.manual_seed(0)
logits = torch.randn(3, 10)
adjusted = adjust_logits(logits, batch)
for i, row in enumerate(rows):
    expected = apply_penalties(logits[i], row.params, row.prompt_ids, row.output_ids)
    if len(row.output_ids) < row.params.min_tokens:
        expected[[2, *row.params.stop_token_ids]] = -math.inf
    torch.testing.assert_close(
        adjusted[i], expected, rtol=0, atol=0
    )  # the same float32 operations in the same order
assert not torch.equal(adjusted[1:], logits[1:]) and torch.equal(adjusted[0], logits[0])

# a grammar's bitmask on row 1 only: tokens 3 and 7 may come next (bits 3 and 7 of word 0), nothing else
bits = torch.tensor([[(1 << 3) | (1 << 7)]], dtype=torch.int32)
assert unpack_bits(bits, 10).nonzero()[:, 1].tolist() == [3, 7]
assert unpack_bits(
    torch.tensor([[-1]], dtype=torch.int32), 32
).all()  # bit 31, the sign bit, is token 31
masked = adjust_logits(
    logits,
    SamplingBatch.build(rows, 10, eos_ids=[2], allowed=AllowedTokens(torch.tensor([1]), bits)),
)
assert torch.isfinite(masked[1]).nonzero().squeeze(1).tolist() == [3, 7]
torch.testing.assert_close(
    masked[1, [3, 7]], adjusted[1, [3, 7]], rtol=0, atol=0
)  # the allowed keep their values
assert torch.equal(masked[[0, 2]], adjusted[[0, 2]])  # the other rows are not touched


# %% [markdown]
# ## The filters, vectorized
#
# After `softmax(logits / temperature)` (one division by a `[B, 1]` column), three cuts, each
# with the reference's exact tie rules, each applied only to the rows that switched it on:
#
# - **top-k** keeps every token whose probability is at least the row's k-th largest. One
#   `topk` with the largest `k` of the batch gives every row's k-th value by a `gather`. It is
#   a partial sort: for 64 rows of 151,936 it costs a few percent of a full sort.
# - **top-p** removes a token when the mass of the tokens before it in probability order is
#   already `>= top_p x` the row's total. That needs the cumulative sum in sorted order, so the
#   rows using top-p are sorted, once, with the same `sort` call as the reference (equal
#   probabilities then come out in the same order, which decides which of them stay). The cut
#   is computed in sorted order and scattered back to token order through the permutation.
# - **min-p** removes tokens below `min_p x` the row's largest probability: a row maximum and
#   a comparison, no sort. (The largest probability survives top-k and top-p, so its value is
#   the same before and after them.)
#
# Why not run every filter over every row with a neutral value (`k = V`, `p = 1`)? Because in
# floating point "neutral" is not exact: with `p = 1` the cumulative sum of the last tokens can
# round above the total and cut them. A row with a filter off must come out untouched, so it
# is left out of that filter.
#
# Then each row is renormalised, as the reference does. (Choosing the rows with `nonzero` makes
# a GPU wait for a few microseconds per filter; in exchange, rows that do not filter cost nothing.)

# %%
#| export
def filter_probs_batch(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    "Per-row top-k (0 = off), top-p (1 = off) and min-p (0 = off) cuts of `[N, V]` probabilities, renormalised."
    probs, vocab = probs.clone(), probs.shape[-1]
    rows = torch.nonzero((top_k > 0) & (top_k < vocab)).squeeze(1)
    if len(rows):
        kept, k = probs[rows], top_k[rows, None]
        kth_largest = kept.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        probs[rows] = kept.masked_fill(kept < kth_largest, 0)
    rows = torch.nonzero(top_p < 1).squeeze(1)
    if len(rows):
        kept = probs[rows]
        sorted_probs, order = kept.sort(dim=-1, descending=True)
        mass_before = (
            sorted_probs.cumsum(-1) - sorted_probs
        )  # mass of the tokens ahead in sort order
        cut_sorted = mass_before >= top_p[rows, None] * sorted_probs.sum(-1, keepdim=True)
        probs[rows] = kept.masked_fill(
            torch.empty_like(cut_sorted).scatter_(1, order, cut_sorted), 0
        )
    rows = torch.nonzero(min_p > 0).squeeze(1)
    if len(rows):
        kept = probs[rows]
        probs[rows] = kept.masked_fill(kept < min_p[rows, None] * kept.amax(-1, keepdim=True), 0)
    return probs / probs.sum(-1, keepdim=True)


# %% [markdown]
# Against the reference, row by row, with a filter off in some rows and ties in others
# (`[0.25] x 4` with `top_p = 0.5`: the tokens ahead in sort order decide, as in the reference):

# %%
p = torch.tensor(
    [[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]]
)
settings = [
    (2, 1.0, 0.0),
    (0, 0.5, 0.0),
    (-1, 0.55, 0.2),
    (3, 0.9, 0.15),
]  # (top_k, top_p, min_p) per row
got = filter_probs_batch(
    p,
    torch.tensor([max(k, 0) for k, _, _ in settings]),
    torch.tensor([t for _, t, _ in settings]),
    torch.tensor([m for _, _, m in settings]),
)
for row, (k, tp, mp) in enumerate(settings):
    torch.testing.assert_close(
        got[row], filter_probs(p[row], k, tp, mp)
    )  # (default fp32: the renormalising sums)
assert torch.equal(got[0] > 0, torch.tensor([True, True, False, False]))
unfiltered = filter_probs_batch(p, torch.zeros(4, dtype=torch.long), torch.ones(4), torch.zeros(4))
assert torch.equal(
    unfiltered, p / p.sum(-1, keepdim=True)
)  # all filters off: only the renormalisation

# %% [markdown]
# The picture: one next-token distribution, the same logits in every row of a batch, and each
# row with its own parameters. Columns show the row after temperature, then after each filter
# in turn (renormalised; the grey outline is the row before that filter). A row whose filter is
# off passes that column unchanged: the cuts are per row.

# %%
import matplotlib.pyplot as plt

torch.manual_seed(0)
V = 40
logits_row = torch.randn(V) * 2
examples = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 8, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.5, 0, 1.0, 0.1),
    (1.2, 20, 0.95, 0.1),
]
temperature, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*examples))
probs = torch.softmax(logits_row / temperature[:, None], dim=-1)
off_k, off_p, off_m = torch.zeros_like(top_k), torch.ones_like(top_p), torch.zeros_like(min_p)
stages = {
    "softmax(logits / T)": probs,
    "then top-k": filter_probs_batch(probs, top_k, off_p, off_m),
    "then top-p": filter_probs_batch(probs, top_k, top_p, off_m),
    "then min-p": filter_probs_batch(probs, top_k, top_p, min_p),
}
order = logits_row.argsort(descending=True)


def row_label(t, k, tp, mp):
    return "\n".join(
        [f"T={t}"]
        + [
            f"{name}={v}"
            for name, v, off in [("top_k", k, 0), ("top_p", tp, 1), ("min_p", mp, 0)]
            if v != off
        ]
    )


fig, axes = plt.subplots(len(examples), len(stages), figsize=(13, 8), sharex=True)
for r, (t, k, tp, mp) in enumerate(examples):
    before = probs[r]
    for c, (title, stage) in enumerate(stages.items()):
        ax = axes[r, c]
        ax.bar(range(V), before[order], color="none", edgecolor="0.7", linewidth=0.6)
        ax.bar(range(V), stage[r][order], color=f"C{r}")
        ax.set_yticks([])
        ax.text(
            0.98,
            0.85,
            f"{int((stage[r] > 0).sum())} left",
            transform=ax.transAxes,
            ha="right",
            fontsize=8,
        )
        if r == 0:
            ax.set_title(title, fontsize=10)
        if c == 0:
            ax.set_ylabel(row_label(t, k, tp, mp), fontsize=8, rotation=0, ha="right", va="center")
        before = stage[r]
fig.suptitle("one batch, five rows, five parameter sets (tokens in logit order)", fontsize=11)
plt.tight_layout()
plt.show()

# %%
kept = {title: (stage > 0).sum(-1).tolist() for title, stage in stages.items()}
assert kept["softmax(logits / T)"] == [V] * 5
assert kept["then top-k"] == [V, 8, V, V, 20]  # only the rows that asked for top-k
assert kept["then top-p"][0] == V and kept["then top-p"][1] == 8 and kept["then top-p"][2] < V
assert kept["then min-p"][:3] == kept["then top-p"][:3] and kept["then min-p"][3] < V


# %% [markdown]
# ## Drawing: one race per row, one generator per row
#
# The reference draws with the exponential race: token `argmax(p / E)` with one `E ~ Exp(1)`
# per token, from the request's own generator. Batched, the division and the `argmax` run over
# `[B, V]` at once, but the noise is drawn row by row, `V` numbers from each row's generator,
# exactly as the reference draws them. A single `[B, V]` draw would hand row `i` the numbers
# at offset `i x V` of one stream: then a request's tokens would depend on its position in the
# batch and on its neighbours. Drawn per row, **a seed gives the same tokens whatever else is
# in the batch**. Greedy rows draw nothing (like the reference), so they never move anyone's
# stream either.

# %%
#| export
def exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    "One token per row of `[N, V]` probabilities; row i's noise comes from generators[i] (None: the global one)."
    noise = torch.empty_like(probs)
    for row_noise, generator in zip(noise, generators, strict=True):
        row_noise.exponential_(generator=generator)
    return (probs / noise).argmax(-1)


# %% [markdown]
# ## Log-probabilities
#
# Reported from the *raw* logits, before bias, penalties and filters: what the model thinks,
# as `token_logprobs` does. One `log_softmax` over the rows that asked; the top-N per group of
# rows with the same N, because `topk(20)[:5]` and `topk(5)` may choose differently among equal
# values, and we want exactly the reference's choice.

# %%
#| export
def batch_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: Sequence[int | None]
) -> list[dict[int, float] | None] | None:
    "Per row: {token: logprob} for the chosen token and the top_n[row] most likely ones; None where not asked."
    wanted = [row for row, n in enumerate(top_n) if n is not None]
    if not wanted:
        return None
    logp = torch.log_softmax(logits[wanted].float(), dim=-1)
    chosen = token_ids[wanted].tolist()
    result: list[dict[int, float] | None] = [None] * len(top_n)
    for row, token, value in zip(
        wanted, chosen, logp.gather(1, token_ids[wanted, None]).squeeze(1).tolist()
    ):
        result[row] = {token: value}
    for n in sorted({top_n[row] for row in wanted} - {0}):
        group = [i for i, row in enumerate(wanted) if top_n[row] == n]
        top = logp[group].topk(n, dim=-1)
        for i, indices, values in zip(group, top.indices.tolist(), top.values.tolist()):
            result[wanted[i]].update(zip(indices, values))
    return result


# %% [markdown]
# ## `sample`: the whole step
#
# Adjust the logits; greedy rows take the `argmax`; the other rows go through temperature,
# the filters and the race. Then the log-probabilities of the rows that asked.
#
# A batch with nothing to adjust (the common case: no bias, penalty or `min_tokens`) skips the
# float32 copy: the greedy `argmax` reads the logits as the LM head left them (bf16 on a GPU; the
# conversion to float32 is exact and keeps their order, so the token is the same), and when every
# row is greedy it reads them in place rather than gathering the rows first. At 256 sequences of
# Qwen3's 151,936-word vocabulary each of those copies is 156 MB.

# %%
#| export
@dataclass
class SampleResult:
    "The next token of every row, and the log-probabilities of the rows that asked for them."

    token_ids: torch.Tensor  # [B] long, on the logits' device
    logprobs: list[dict[int, float] | None] | None  # per row; None when no row asked


@torch.no_grad()
def sample(
    logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor | None = None
) -> SampleResult:
    """Pick one token per row of `[B, V]` logits under the batch's per-row parameters. `greedy`: each row's argmax
    of these logits, already taken (chapter 09b's decode graphs): the tokens where every row is greedy and nothing
    adjusts the logits."""
    if logits.ndim != 2 or tuple(logits.shape) != (batch.size, batch.vocab_size):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match the batch: "
            f"{batch.size} rows x vocab {batch.vocab_size}"
        )
    if logits.device != batch.device:
        raise ValueError(f"logits are on {logits.device}, the sampling batch on {batch.device}")
    if greedy is not None and greedy.shape != (batch.size,):
        raise ValueError(f"greedy holds one token per row: {batch.size}, got {tuple(greedy.shape)}")
    adjusted = (
        adjust_logits(logits, batch) if batch.adjusts else logits
    )  # (nothing to adjust: no copy)
    if not len(batch.sampled_rows):  # every row greedy: the argmax in place, no rows gathered
        token_ids = greedy if greedy is not None and not batch.adjusts else adjusted.argmax(-1)
        return SampleResult(token_ids, batch_logprobs(logits, token_ids, batch.logprobs))
    token_ids = torch.empty(batch.size, dtype=torch.long, device=logits.device)
    if len(batch.greedy_rows):
        token_ids[batch.greedy_rows] = adjusted[batch.greedy_rows].argmax(-1)
    rows = batch.sampled_rows
    probs = torch.softmax(adjusted[rows].float() / batch.temperature[rows, None], dim=-1)
    probs = filter_probs_batch(probs, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
    token_ids[rows] = exponential_race(probs, batch.generators)
    return SampleResult(token_ids, batch_logprobs(logits, token_ids, batch.logprobs))


# %% [markdown]
# Every row against the plain sampler of chapter 04, with seeds: the same tokens, greedy rows
# included, and the same log-probabilities.

# %%
def reference_token(logits_row, row: SamplingRow, eos_ids) -> int:
    "Chapter 04's path for one sequence: penalties, the min_tokens mask, then sample_token."
    adjusted = apply_penalties(logits_row, row.params, row.prompt_ids, row.output_ids)
    if len(row.output_ids) < row.params.min_tokens:
        adjusted[[*eos_ids, *row.params.stop_token_ids]] = -math.inf
    return sample_token(adjusted, row.params, row.generator)


def seeded_rows(specs):
    "SamplingRows with fresh generators seeded from their params."
    return [SamplingRow(p, prompt, out, make_generator(p)) for p, prompt, out in specs]


V = 300
specs = [
    (SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3), [5, 6], [7]),
    (SamplingParams(temperature=0.8, top_k=20, seed=1, logprobs=0), [1], []),
    (
        SamplingParams(temperature=1.2, top_p=0.7, min_p=0.02, presence_penalty=1.0, seed=2),
        [3],
        [3, 4, 4],
    ),
    (
        SamplingParams(
            temperature=0.5, frequency_penalty=-0.5, logit_bias={11: 4.0}, seed=3, logprobs=3
        ),
        [],
        [11],
    ),
    (SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[9], seed=4), [2], []),
]
torch.manual_seed(1)
logits = torch.randn(len(specs), V) * 3
result = sample(logits, SamplingBatch.build(seeded_rows(specs), V, eos_ids=[0]))
reference_rows = seeded_rows(specs)
expected = [reference_token(logits[i], row, [0]) for i, row in enumerate(reference_rows)]
assert result.token_ids.tolist() == expected, (result.token_ids.tolist(), expected)
assert (
    result.token_ids[0]
    == adjust_logits(logits, SamplingBatch.build(seeded_rows(specs), V))[0].argmax()
)
for i, (p, _, _) in enumerate(specs):
    want = None if p.logprobs is None else token_logprobs(logits[i], expected[i], p.logprobs)
    assert result.logprobs[i] == want, i
assert (
    sample(logits, SamplingBatch.build(seeded_rows([(SamplingParams(), [], [])] * 5), V)).logprobs
    is None
)
# nothing to adjust: the logits read as they are (bf16 here), all greedy or mixed, give the tokens of the float32 copy
plain = [
    (SamplingParams(temperature=0, logprobs=1), [], []),
    (SamplingParams(temperature=0), [], []),
]
mixed = plain + [(SamplingParams(temperature=0.7, top_k=5, seed=9), [], [])]
for rows in (plain, mixed):
    logits16 = (torch.randn(len(rows), V) * 3).bfloat16()
    assert not SamplingBatch.build(seeded_rows(rows), V).adjusts
    got = sample(logits16, SamplingBatch.build(seeded_rows(rows), V))
    want = sample(logits16.float(), SamplingBatch.build(seeded_rows(rows), V))
    assert torch.equal(got.token_ids, want.token_ids) and got.logprobs == want.logprobs, (got, want)
    assert torch.equal(got.token_ids[:2], logits16[:2].float().argmax(-1))
with pytest.raises(
    ValueError, match=r"logits of shape \(5, 299\) do not match the batch: 5 rows x vocab 300"
):
    sample(logits[:, :299], SamplingBatch.build(seeded_rows(specs), V))
# `greedy` (the decode graph's argmax, taken already): the tokens of an all-greedy batch with nothing to adjust,
# logprobs as for them; ignored where a row samples or the logits are adjusted (a penalty)
logits2 = torch.randn(2, V)
handed = torch.tensor([3, 5])
got = sample(logits2, SamplingBatch.build(seeded_rows(plain), V), greedy=handed)
assert got.token_ids.tolist() == [3, 5] and got.logprobs[0] == token_logprobs(logits2[0], 3, 1)
penalised = [(SamplingParams(temperature=0, repetition_penalty=1.3), [4], []), plain[1]]
for rows in (mixed[1:], penalised):
    want = sample(logits2, SamplingBatch.build(seeded_rows(rows), V)).token_ids
    assert torch.equal(
        sample(logits2, SamplingBatch.build(seeded_rows(rows), V), greedy=handed).token_ids, want
    )
with pytest.raises(ValueError, match=r"greedy holds one token per row: 2, got \(3,\)"):
    sample(
        logits2, SamplingBatch.build(seeded_rows(plain), V), greedy=torch.zeros(3, dtype=torch.long)
    )

# %% [markdown]
# `min_tokens` and `logit_bias` do what they say: with a huge bias on the eos token, a row
# under `min_tokens` still never picks it, and picks it as soon as it may.

# %%
eos = 0


def eos_pick(outputs: int) -> int:
    p = SamplingParams(temperature=1.0, min_tokens=3, logit_bias={eos: 100.0}, seed=0)
    row = SamplingRow(p, [1], [5] * outputs, make_generator(p))
    return int(sample(torch.zeros(1, V), SamplingBatch.build([row], V, eos_ids=[eos])).token_ids[0])


assert [eos_pick(n) == eos for n in range(5)] == [False, False, False, True, True]
biased = SamplingBatch.build(
    [SamplingRow(SamplingParams(temperature=0, logit_bias={42: 10.0}), [], [])], V
)
assert sample(torch.randn(1, V), biased).token_ids.tolist() == [42]


# %% [markdown]
# ## Seeds do not depend on the batch
#
# The same seeded request, alone and then in two different batches at different positions,
# over several steps (its output, and so its penalties, growing as it goes): the same tokens.

# %%
def run_request(
    params, position: int, neighbours: int, steps: int = 6, vocab: int = 200
) -> list[int]:
    "Sample `steps` tokens for a seeded request placed at `position` among `neighbours` unseeded ones."
    torch.manual_seed(123)  # the request's logits at each step; the neighbours get other rows
    step_logits = torch.randn(steps, vocab) * 2
    mine = SamplingRow(params, [1, 2, 3], [], make_generator(params))
    for step in range(steps):
        others = [
            SamplingRow(SamplingParams(temperature=1.3, top_p=0.9), [4], [])
            for _ in range(neighbours)
        ]
        batch_rows = others[:position] + [mine] + others[position:]
        logits = torch.randn(len(batch_rows), vocab) * 2
        logits[position] = step_logits[step]
        token = int(sample(logits, SamplingBatch.build(batch_rows, vocab)).token_ids[position])
        mine = mine._replace(output_ids=[*mine.output_ids, token])
    return mine.output_ids


request = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=7)
alone = run_request(request, position=0, neighbours=0)
assert run_request(request, position=2, neighbours=5) == alone
assert run_request(request, position=7, neighbours=7) == alone
assert (
    run_request(
        SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=8), 0, 0
    )
    != alone
)
