# %% [markdown]
# # Drafts from a smaller model
#
# > Chapter 08c's proposers: prompt lookup, and a smaller model with the same tokenizer, run by the engine's own model runner over a small KV pool of its own.

# %% [markdown]
# Prompt lookup (chapter 08c) drafts only what the text already contains. A *draft model* guesses
# anywhere: a smaller model of the same family (Qwen3-0.6B for Qwen3-4B: the same tokenizer)
# runs `k` greedy steps ahead of the target, and the target checks them in one step as before.
# Its cost is `k` of its own decode steps a verify step, so it pays where it is much cheaper than
# the target and agrees with it often.
#
# A proposer is anything with `propose(wanted)` (for each `(sequence, k)` of a step, up to `k`
# next tokens) and `forget(request_id)` (the sequence has ended). The draft model keeps a copy of
# each sequence: its tokens, its own block table in its own pool, and how many of them it has
# computed. Before drafting it compares each copy with the sequence's tokens now: what the target
# rejected since is rolled back (only the common prefix stays computed), what the target added
# is fed in one chunk, then greedy steps of one token each. All the step's copies run together:
# one model step catches every copy up, and each further step gives every copy that still wants
# one its next draft, so drafting for a batch of sequences costs `k` steps of the draft model,
# not `k` per sequence. The copies run through chapter 07a's `ModelRunner` like any sequences:
# the C decode step on a CPU, graphs on a GPU. Their
# blocks are its own (no prefix cache: the copy is rolled back often); when the pool is short it
# drafts fewer tokens, never evicts anything. Future proposers (an EAGLE head reading the target's
# hidden states, Qwen3.5's MTP layer) take the same two calls.

# %%
#| default_exp draft_model

# %%
#| export
from __future__ import annotations

from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import BlockAllocator
from forge_engine.loader import LoadedModel
from forge_engine.runner import build_runner
from forge_engine.scheduler import ScheduledSeq, Sequence, StepPlan
from forge_engine.speculative import propose_ngram

# %%
#| hide
import pytest


# %%
#| export
class PromptLookup:
    "Chapter 08c's n-gram proposer, as a proposer: drafts from the sequence's own tokens, no state to keep."

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids, k) for seq, k in wanted]

    def forget(self, request_id: str) -> None:
        pass


DRAFT_KV_BYTES = (
    256 * 2**20
)  # the draft model's KV pool when the engine's config does not size pools


class DraftModel:
    "Drafts from a smaller model with the target's tokenizer: each sequence's copy, caught up and run k greedy steps."

    def __init__(self, loaded: LoadedModel, config: EngineConfig, target_vocab_size: int):
        if loaded.model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {loaded.model.config.vocab_size} tokens, the target's "
                f"{target_vocab_size}: a draft model must share the target's tokenizer"
            )
        own = config.replace(
            speculative_tokens=0,
            enable_prefix_caching=False,
            kv_cache_bytes=config.kv_cache_bytes or DRAFT_KV_BYTES,
        )
        self.runner = build_runner(loaded.model, own)
        self.allocator = BlockAllocator(self.runner.cache.num_blocks - 1, own.block_size, False)
        self.copies: dict[str, Sequence] = {}

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        "Up to k drafts for each (sequence, k): the copies caught up in one step, then one step per draft for all."
        copies = [self._caught_up(seq) for seq, _ in wanted]
        active = [(copy, k) for copy, (_, k) in zip(copies, wanted) if k > 0]
        while active:
            items = []
            for copy, k in active:
                need = self.allocator.blocks_needed(copy.num_tokens) - len(copy.block_table)
                if need > 0 and not self.allocator.can_allocate(need):
                    continue  # its pool is short: this copy drafts no more
                if need > 0:
                    copy.block_table += self.allocator.allocate(need)
                items.append((ScheduledSeq(copy, copy.num_tokens - copy.num_computed, True), k))
            if not items:
                break
            tokens = self.runner.run(StepPlan([item for item, _ in items])).argmax(-1).tolist()
            for (item, _), token in zip(items, tokens):
                item.seq.num_computed += item.num_new
                item.seq.output_ids.append(token)
            active = [(item.seq, k) for item, k in items if len(item.seq.output_ids) < k]
        return [list(copy.output_ids) for copy in copies]

    def _caught_up(self, seq: Sequence) -> Sequence:
        "The sequence's copy holding its tokens now, computed up to the longest prefix it still shares with them."
        copy = self.copies.get(seq.request_id)
        if copy is None:
            copy = self.copies[seq.request_id] = Sequence(
                seq.request_id, [], SamplingParams(temperature=0)
            )
        tokens, known = seq.token_ids, copy.token_ids
        common = 0  # the tokens the copy computed that are still the sequence's, but the last (fed for its logits)
        while common < min(copy.num_computed, len(tokens) - 1) and known[common] == tokens[common]:
            common += 1
        copy.prompt_ids, copy.output_ids, copy.num_computed = list(tokens), [], common
        return copy

    def forget(self, request_id: str) -> None:
        copy = self.copies.pop(request_id, None)
        if copy is not None:
            self.allocator.free(copy.block_table)


# %% [markdown]
# The engine takes a draft model as `LLMEngine(loaded, config, draft=draft_loaded)` with
# `speculative_tokens` set (chapter 08). The tests, on tiny random models:
#
# - the target as its own draft model: every draft is right, so each verify step gives `k + 1`
#   tokens (but at the end, where `max_tokens` leaves less room), and the tokens are the target's;
# - another random model as the draft: few drafts are right, and the tokens are still the
#   target's, with a KV pool small enough to preempt;
# - every block of both pools is free afterwards; a draft model with another vocabulary is refused.

# %%
import torch

from forge_engine.config import preset
from forge_engine.engine import LLMEngine
from forge_engine.kv_cache import PagedKVCache
from forge_engine.model import empty_model, init_random_weights

tiny = preset("qwen3-tiny").replace(vocab_size=32, num_layers=2)
target = LoadedModel("target", init_random_weights(empty_model(tiny), seed=3, std=0.2), None, None)
other = LoadedModel("draft", init_random_weights(empty_model(tiny), seed=8, std=0.2), None, None)
prompts = [[5, 9, 2, 7, 1] * 3, [3, 3, 8], list(range(1, 30))]
params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run(config, draft=None):
    engine = LLMEngine(target, config, draft=draft)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    assert engine.allocator.stats().used_blocks == 0
    if draft is not None:
        assert engine.proposer.allocator.stats().used_blocks == 0 and not engine.proposer.copies
    return out, engine.stats().speculation


size = 13 * PagedKVCache.bytes_per_block(
    tiny, 8, torch.float32
)  # 12 blocks of 8 and the scratch block
for kv in (None, size):
    config = EngineConfig(block_size=8, max_num_seqs=3, kv_cache_bytes=kv)
    want, _ = run(config)
    same, counts = run(config.replace(speculative_tokens=4), draft=target)
    assert same == want and counts.accepted == counts.proposed > 0, counts
    got, counts = run(config.replace(speculative_tokens=4), draft=other)
    assert got == want and counts.accepted < counts.proposed, counts
    print(kv, counts)


# drafting for several sequences at once gives each the drafts it gets alone
def copies_of(prompts):
    return [Sequence(str(i), list(p), params) for i, p in enumerate(prompts)]


def draft_model():
    pool = 64 * PagedKVCache.bytes_per_block(tiny, 8, torch.float32)
    return DraftModel(
        other, EngineConfig(block_size=8, max_num_seqs=3, kv_cache_bytes=pool), tiny.vocab_size
    )


together = draft_model()
wanted = list(zip(copies_of(prompts), (4, 1, 3)))
drafts = together.propose(wanted)
for (seq, k), got in zip(wanted, drafts):
    assert len(got) == k and draft_model().propose([(seq, k)]) == [got]
seq = wanted[0][0]
seq.output_ids = drafts[0][:2] + [
    (drafts[0][2] + 1) % tiny.vocab_size
]  # two drafts kept, then another token
assert together.propose([(seq, 4)]) == draft_model().propose(
    [(seq, 4)]
)  # its copy rolled back: as if new
for seq, _ in wanted:
    together.forget(seq.request_id)
assert together.allocator.stats().used_blocks == 0
with pytest.raises(ValueError, match="must share the target's tokenizer"):
    wide = LoadedModel(
        "wide", init_random_weights(empty_model(tiny.replace(vocab_size=64)), seed=1), None, None
    )
    LLMEngine(target, EngineConfig(speculative_tokens=2), draft=wide)
