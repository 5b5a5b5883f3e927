# %% [markdown]
# # Speculative decoding
#
# > Propose a few next tokens cheaply, score them all in one step of the model, keep the longest run the model agrees with: more than one token a step, and the same tokens as without.

# %% [markdown]
# A decode step reads every weight to produce one token per sequence. At batch 1 the step is bound
# by that reading, not by arithmetic, so scoring 5 tokens of one sequence costs about what scoring
# one does on a GPU. Speculative decoding uses that slack: a *proposer* guesses the next `k`
# tokens `x1..xk`; the engine feeds `[last, x1, ..., xk]` to the model at positions `p..p+k` in one
# step, as a decode step whose rows are positions of the same sequence (each row attends to the
# rows before it, whose K/V the step writes first). Row `r`'s logits give the model's own next
# token `g_r` after `x_r`. With greedy decoding:
#
# ```
# inputs   last   x1    x2    x3    x4
# greedy   g0     g1    g2    g3    g4
# accept   x1 == g0?  x2 == g1?  ...   the longest agreeing prefix x1..xj, then g_j: j + 1 tokens
# ```
#
# The new tokens `g0..gj` are exactly what `j + 1` plain greedy steps would have produced, so the
# output is the same token for token. The K/V written for the rejected `x_{j+1}..x_k` sit past the
# sequence's end: the next step overwrites them, and its blocks stay its own until it ends.
#
# **The arithmetic.** If each proposed token is right with probability `a` (independently), a step
# yields on average `E = (1 − a^(k+1)) / (1 − a)` tokens: `a = 0.7, k = 4` gives 2.8. The speed-up is
# `E` divided by the verify step's cost in decode steps: on a GPU at batch 1 that cost should be
# close to 1 (the step reads the same weights); on a 2-core CPU, where chapter 10f's C step is
# bound by its integer dot products, 4 rows cost about 2 single-row steps, so it takes `E` well
# above 2.
#
# Measured on a 2-core AMD EPYC, SmolLM2-135M-Instruct (GGUF, chapter 10f's C step) asked to
# rewrite a given text, batch 1, greedy, two runs of `PYTHONPATH=. python3
# kernels_lab/speculative_cpu.py` (medians of 3 interleaved rounds each): 3 drafts accept 69% and
# give 3.04 tokens a verify step, **1.81× and 1.62×** the tokens per second without speculation;
# 7 drafts accept 55%, 4.78 tokens a step, 1.62× and 1.36×. The tokens are the same in every run.
#
# On a GPU a verify step replays a CUDA graph of its own (chapter 09b). Its rows cannot take the
# one-row GEMV: on cuBLAS a verify step of 1 + 4 rows cost 1.31× a decode step on an H100, about
# 0.47 ms of matmuls more (`kernels_lab/few_rows_matmul.py`) and the norms the GEMV folds in as
# launches of their own. So the rows go to a tensor-core matmul that folds them in as the GEMV
# does (chapter 09_kernels_rows_matmul), and the attention (chapter 09's `_verify_kernel`) gives a
# sequence's rows one program that reads the keys once for them all and takes the step's own K/V
# from registers. Measured on an H100, random Qwen3-4B in BF16, one sequence of 512 tokens
# (`LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 PYTHONPATH=. python3 kernels_lab/verify_step.py bf16`): 1 + 1
# to 1 + 3 rows cost 1.117-1.126× a decode step and 1 + 4 rows **1.132-1.133×** (two runs). With a proposer that
# is always right (`E = 5`) that bounds the speed-up at about 4.4×.
#
# **Proposing by prompt lookup** (n-grams, no extra weights): find the most recent earlier place
# where the sequence's last `n` tokens occurred (longest `n` first) and propose what followed
# there. It shines where the output copies its input: rewriting or summarising a given text,
# editing code, answering from a document.

# %%
#| default_exp speculative

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from forge_engine.generate import SamplingParams

# %%
#| hide
import pytest


# %%
#| export
def propose_ngram(
    token_ids: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the sequence's last n tokens, for the
    longest n in [min_ngram, max_ngram] that occurred before; [] when none did."""
    n_tokens = len(token_ids)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = list(token_ids[n_tokens - n :])
        for start in range(n_tokens - n - 1, -1, -1):  # the most recent match first
            if token_ids[start] == tail[0] and list(token_ids[start : start + n]) == tail:
                return list(token_ids[start + n : start + n + k])
    return []


def accepted_length(draft: Sequence[int], greedy: Sequence[int]) -> int:
    "How many leading draft tokens the model agrees with: draft[i] == greedy[i] (greedy[i]: its token after draft[:i])."
    j = 0
    while j < len(draft) and draft[j] == greedy[j]:
        j += 1
    return j


def speculates(params: SamplingParams, num_output: int) -> bool:
    """Whether a sequence's next tokens can be drafted and checked exactly: its sampler's choice at a position does
    not depend on the tokens before it (no penalties, no min_tokens still to reach, no logprobs, no grammar).
    Greedy or sampled: see "Sampled rows" below."""
    return (
        params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.min_tokens <= num_output
        and params.logprobs is None
        and params.structured is None
    )


@dataclass
class SpeculationCounts:
    "What speculation did: draft tokens proposed, accepted, and the verify steps of one sequence each."

    proposed: int = 0
    accepted: int = 0
    verified: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        "Tokens a verify step gave a sequence, on average: its accepted drafts and the model's own token."
        return (self.accepted + self.verified) / self.verified if self.verified else 0.0


# %% [markdown]
# The proposer on a sentence that repeats itself, and the acceptance rule:

# %%
ids = [5, 6, 7, 8, 9, 5, 6, 7]
assert propose_ngram(ids, 3) == [8, 9, 5]  # "5 6 7" seen before: what came next
assert propose_ngram(ids, 10) == [8, 9, 5, 6, 7]  # no more than the sequence holds
assert propose_ngram([1, 2, 3, 4], 2) == []  # the last token never occurred before
assert propose_ngram([1, 2, 1, 3, 1], 2) == [3, 1]  # the most recent earlier "1"
assert propose_ngram([4, 1, 2, 9, 1, 2, 7, 1, 2], 1, max_ngram=2) == [7]
assert accepted_length([8, 9, 5], [8, 9, 4, 1]) == 2 and accepted_length([], [3]) == 0
assert accepted_length([8, 9], [8, 9, 2]) == 2
assert speculates(SamplingParams(temperature=0), 0) and speculates(
    SamplingParams(temperature=0.7), 0
)
assert not speculates(SamplingParams(temperature=0, repetition_penalty=1.1), 0)
assert not speculates(SamplingParams(temperature=0, min_tokens=4), 2)
counts = SpeculationCounts(proposed=8, accepted=6, verified=2)
assert counts.acceptance_rate == 0.75 and counts.mean_accepted_length == 4.0

# %% [markdown]
# ## In the engine
#
# `EngineConfig(speculative_tokens=k)` turns it on (chapter 08). Before each step the engine drafts
# up to `k` tokens for every decoding sequence that `speculates`, within what its `max_tokens` and
# the context leave; the scheduler (chapter 07) gives drafts only what the step's token budget
# leaves after every decoding sequence's own token, and never preempts anyone for them. The model
# runner (chapter 07a) scores a sequence's `1 + k` tokens as rows of chapter 10f's C decode step on
# a CPU, or as a chunk of the eager step elsewhere, and returns logits for each. Once the tokens are
# read, the engine applies the accepted ones in order (a stop string or `max_tokens` can end the
# sequence part way), and only then counts their K/V as computed (`Scheduler.advance`), so the
# prefix cache registers real tokens only. Speculation needs each step's tokens on the host before
# the next is drafted, so it runs the steps one after the other (chapter 08's overlap is off).
#
# The test: greedy outputs with speculation equal those without, token for token, on a tiny random
# model (its greedy outputs fall into loops that prompt lookup catches), with the prefix cache on,
# a KV pool small enough to preempt, an abort, and prompts that cross block boundaries; every block
# is free afterwards, and both accepted and rejected drafts happened.

# %%
import random

import torch

from forge_engine.config import EngineConfig, preset
from forge_engine.kv_cache import PagedKVCache
from forge_engine.engine import LLMEngine
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights


def run_all(engine, prompts, params, abort=None):
    "Every prompt to its end (one aborted after 3 steps); the token lists by request id."
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if abort is not None and steps == 3:
            engine.abort(abort)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    engine.allocator.check_idle()
    assert engine.allocator.stats().used_blocks == 0
    return finals


tiny = preset("qwen3-tiny").replace(vocab_size=64, num_layers=2)
loaded = LoadedModel("tiny", init_random_weights(empty_model(tiny), seed=3, std=0.2), None, None)
rng = random.Random(0)
prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(3, 40))] * 2 for _ in range(6)]
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
for kv_blocks in (64, 12):  # 12 blocks of 8: preemption
    base = dict(kv_cache_bytes=None, block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    size = (kv_blocks + 1) * PagedKVCache.bytes_per_block(
        tiny, 8, torch.float32
    )  # (+1: the graphs' scratch)
    plain = LLMEngine(loaded, EngineConfig(**{**base, "kv_cache_bytes": size}))
    want = run_all(plain, prompts, params, abort="2")
    spec = LLMEngine(
        loaded, EngineConfig(**{**base, "kv_cache_bytes": size, "speculative_tokens": 4})
    )
    got = run_all(spec, prompts, params, abort="2")
    assert got == want, kv_blocks
    counts = spec.stats().speculation
    assert 0 < counts.accepted < counts.proposed, counts  # both outcomes happened
    print(kv_blocks, "blocks:", counts, f"mean accepted length {counts.mean_accepted_length:.2f}")

# %% [markdown]
# On a CPU a GGUF model's verify steps go through chapter 10f's C decode step, the drafts as more
# rows of their sequence. SmolLM2 asked to repeat a passage: the same greedy tokens with and
# without speculation, with verify steps of several rows.

# %%
from forge_engine.loader import load_model

smol = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf")
passage = (
    "The river begins as snow on the northern slopes, melts in late spring, and runs for three hundred "
    "kilometres before it reaches the sea."
)
prompt = smol.tokenizer.encode(
    f"{passage}\nRepeat the sentence above word for word.\n{passage[:40]}"
)
outputs = {}
for k in (0, 4):
    engine = LLMEngine(smol, EngineConfig(max_num_seqs=4, speculative_tokens=k))
    rows = []
    engine.runner.decode.run = lambda *args, run=engine.runner.decode.run, **kw: (
        rows.append(len(args[0])) or run(*args, **kw)
    )
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            outputs[k] = out.token_ids
    assert engine.allocator.stats().used_blocks == 0
assert outputs[4] == outputs[0] and max(rows) > 1, (rows, engine.stats().speculation)
print(smol.tokenizer.decode(outputs[4]), engine.stats().speculation)

# %% [markdown]
# ## Sampled rows
#
# With sampling, the rule that keeps the target distribution (speculative sampling) accepts a draft
# `x` with probability `min(1, p(x) / q(x))`, `q` the proposer's distribution, and on a rejection
# samples from `(p − q)+`, renormalised. Prompt lookup proposes one token for sure: `q(x) = 1`. So
# `x` is accepted with probability `p(x)`, and a rejection samples `p` without `x`. The engine gets
# both by sampling every row as it would without drafts (row `r` from the model's distribution after
# `x_1..x_r`, temperature, top-k, top-p, min-p and all) and keeping drafts while the sample *equals*
# the draft: the sample is `x` with probability `p(x)`, and when it is not, it is a sample of `p`
# without `x`, the token the step emits. The acceptance rule is the greedy one, unchanged; a seeded
# request stays reproducible, but draws its noise in another order than without drafts.
#
# The test: a tiny model over 8 tokens (so that prompt lookup always finds the last token before)
# sampled at temperature 1 for 5 tokens, 3,000 times with drafts and 3,000 without. The
# distribution of each position's token is the same: a chi-square test of the two samples at each
# position, at 0.1% (from position 2 on, drafts decide).

# %%
eight = preset("qwen3-tiny").replace(vocab_size=8, num_layers=2)
small = LoadedModel("eight", init_random_weights(empty_model(eight), seed=5, std=0.5), None, None)


def sampled_tokens(drafts: int, n: int = 3000) -> torch.Tensor:
    "n runs of 5 tokens at temperature 1, the global generator seeded: [n, 5]."
    torch.manual_seed(11)
    config = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=1024, max_waiting=n, speculative_tokens=drafts
    )
    engine = LLMEngine(small, config)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    for i in range(n):
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], params, str(i))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[int(o.request_id)] = o.token_ids
    return torch.tensor([out[i] for i in range(n)]), engine.stats().speculation


plain, _ = sampled_tokens(0)
drafted, counts = sampled_tokens(3)
print(counts)
assert 0 < counts.accepted < counts.proposed, counts  # drafts were tried: some accepted, some not
for position in range(5):
    a, b = (torch.bincount(t[:, position], minlength=8).double() for t in (plain, drafted))
    seen = (a + b) > 0
    chi2 = (((a - b) ** 2) / (a + b))[seen].sum().item()  # two samples of equal size
    df = int(seen.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # 0.1% (Wilson-Hilferty)
    print(
        f"position {position + 1}: chi-square {chi2:.1f} at {df} degrees of freedom (0.1%: {critical:.1f})"
    )
    assert chi2 < critical, (position, chi2, df)
