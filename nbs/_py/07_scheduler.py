# %% [markdown]
# # The scheduler
#
# > Which sequences run in the next step, and how many of their tokens: continuous, bounded, token-budgeted batching.

# %% [markdown]
# Every engine step the scheduler picks a batch under two limits: at most `max_num_seqs`
# sequences, at most `max_num_batched_tokens` tokens. A sequence needs
# `num_tokens - num_computed` tokens processed: one for a sequence that is decoding (its last
# sampled token), the rest of the prompt for one that is prefilling. The rules:
#
# 1. **Decodes first.** Every running sequence that is decoding gets its one token. A long
#    prompt can never stall them.
# 2. **Then prefills, in chunks.** Running sequences still in their prompt take what budget is
#    left (**chunked prefill**), oldest first.
# 3. **Then new arrivals, first come first served.** The oldest waiting request is admitted
#    when its next chunk fits the budget and the KV pool; if it does not fit, nobody behind it
#    jumps the queue (no starvation). Its prompt is first looked up in the prefix cache.
# 4. **Preemption by recompute.** When a running sequence needs a block and none is free, the
#    *youngest* running sequence gives all its blocks back and returns to the front of the
#    waiting queue. Later it is admitted again and recomputes its prompt and output so far
#    (usually from the prefix cache), then continues exactly where it stopped. A sequence
#    that has grown past the whole pool (it cannot fit even alone) ends with reason `length`.
#
# A model with recurrent layers (chapter 03b's Qwen3.5) also needs a **state slot** per running
# sequence (chapter 05a's pool): handed out at admission, given back with the blocks. There are
# as many slots as `max_num_seqs`, so admission never waits for one.
#
# The scheduler only does bookkeeping: it never runs the model and knows nothing about text.

# %%
#| default_exp scheduler

# %%
#| export
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import BlockAllocator

# %%
#| hide
import random
import pytest


# %% [markdown]
# ## A sequence
#
# One request on its way through the engine: its tokens, its blocks, how much of it is in
# the KV cache, and where it is in its life.

# %%
#| export
class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    "A request inside the engine."

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # admission order: lower is older
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = (
        None  # its row of chapter 05a's state pool while it runs (models with recurrent layers)
    )
    block_hashes: list[int | None] = field(
        default_factory=list
    )  # chain hashes of the registered full blocks
    num_computed: int = 0  # tokens whose K/V is in the cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # the request's own RNG when it has a seed
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # served by the prefix cache at the last admission
    draft_ids: list[int] = field(
        default_factory=list
    )  # proposed next tokens, scored after its last one this step (chapter 08c); not yet its tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1 and self.num_computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


# %% [markdown]
# ## The plan of one step
#
# For each scheduled sequence: how many new tokens it processes, and whether this finishes
# its uncomputed tokens, in which case the engine samples its next token from the logits of
# the last one.

# %%
#| export
@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens processed this step, starting at seq.num_computed
    samples: bool  # True when this step reaches the end of its tokens: a next token is sampled
    num_draft: int = (
        0  # of num_new, the sequence's draft tokens after its last one: each gets logits too
    )


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(
        default_factory=list
    )  # ended by the scheduler: grew past the whole pool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class QueueFullError(RuntimeError):
    "The waiting queue is at its bound: the request is refused, nothing was queued."


# %% [markdown]
# ## The scheduler

# %%
#| export
class Scheduler:
    "Continuous batching under a sequence bound and a per-step token budget, with chunked prefill and preemption."

    def __init__(
        self,
        config: EngineConfig,
        allocator: BlockAllocator,
        max_model_len: int,
        state_slots: int = 0,
    ):
        """`state_slots`: the rows of chapter 05a's state pool (0: the model keeps no recurrent state). With them the
        prefix cache must be off: a cached block holds K/V, not the recurrent state after its tokens."""
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({config.max_num_seqs}) so every running sequence can decode each step"
            )
        if state_slots and state_slots < config.max_num_seqs:
            raise ValueError(
                f"{state_slots} state slots for up to {config.max_num_seqs} running sequences: one each"
            )
        if state_slots and allocator.enable_prefix_caching:
            raise ValueError("a model with recurrent state runs without the prefix cache")
        self.config, self.allocator, self.max_model_len = config, allocator, max_model_len
        self.num_state_slots = state_slots
        self.free_state_slots = list(range(state_slots))[::-1]  # popped from the end: slot 0 first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self._arrivals = itertools.count()

    # -- requests in and out --
    def check_prompt_len(self, n: int) -> None:
        "Refuse (with both numbers) a prompt that could never run: longer than the context or than the whole KV pool."
        if n == 0:
            raise ValueError("prompt is empty")
        if n + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; the context holds {self.max_model_len} (prompt + at least 1 new token)"
            )
        pool_tokens = self.allocator.num_blocks * self.allocator.block_size
        if n + 1 > pool_tokens:
            raise ValueError(
                f"prompt has {n} tokens; the KV pool holds {pool_tokens} tokens in all, "
                f"so it can never run (give the cache more memory)"
            )

    def add(self, seq: Sequence) -> None:
        "Queue a new request, or refuse it (with the numbers) when it could never run or the queue is full."
        self.check_prompt_len(len(seq.prompt_ids))
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full ({len(self.waiting)} of {self.config.max_waiting} requests); "
                f"try again later"
            )
        seq.arrival, seq.status = next(self._arrivals), Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        "End a sequence in any state (stop, length, abort, error) and give its blocks back now."
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        seq.block_table, seq.block_hashes, seq.num_computed, seq.draft_ids = [], [], 0, []

    # -- one step --
    def _blocks_for(self, seq: Sequence, num_new: int) -> int:
        return max(
            0, self.allocator.blocks_needed(seq.num_computed + num_new) - len(seq.block_table)
        )

    def _preempt_youngest(self, plan: StepPlan) -> Sequence:
        victim = self.running.pop()  # youngest: running is in arrival order
        self._release(victim)
        victim.status, victim.num_preemptions = Status.WAITING, victim.num_preemptions + 1
        self.waiting.appendleft(
            victim
        )  # the older a victim, the later it is pushed: arrival order kept
        plan.preempted.append(victim)
        return victim

    def schedule(self) -> StepPlan:
        "Choose this step's sequences and token counts, allocating (or preempting for) their blocks."
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        decoding = [s for s in self.running if s.is_decoding]
        prefilling = [s for s in self.running if not s.is_decoding]
        # drafts take what the decodes leave of the budget: every decoding sequence still gets its token
        draft_budget = budget - len(decoding)
        for seq in decoding + prefilling:  # oldest first within each group
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if self._outgrew_pool(seq, plan):
                continue
            if seq.draft_ids:
                seq.draft_ids = seq.draft_ids[: max(0, draft_budget)]
                draft_budget -= len(seq.draft_ids)
            uncomputed = seq.num_uncomputed + len(seq.draft_ids)
            num_new = min(uncomputed, budget)
            if num_new == 0:
                continue
            need = self._blocks_for(
                seq, num_new
            )  # most decode steps need none: the last block has room
            if seq.draft_ids and need and not self.allocator.can_allocate(need):
                seq.draft_ids = []  # drafts never preempt anyone
                uncomputed = num_new = seq.num_uncomputed
                need = self._blocks_for(seq, num_new)
            while need and not self.allocator.can_allocate(need):
                if self._preempt_youngest(plan) is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if need:
                seq.block_table += self.allocator.allocate(need)
            plan.scheduled.append(
                ScheduledSeq(seq, num_new, num_new == uncomputed, len(seq.draft_ids))
            )
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._outgrew_pool(seq, plan):
                continue
            if not self._admit(seq, budget, plan):
                break  # FCFS: nobody jumps the queue
            budget -= plan.scheduled[-1].num_new
        return plan

    def outgrows_pool(self, seq: Sequence) -> bool:
        "Whether a sequence's tokens no longer fit the whole pool: it could never run again."
        return self.allocator.blocks_needed(seq.num_tokens) > self.allocator.num_blocks

    def _outgrew_pool(self, seq: Sequence, plan: StepPlan) -> bool:
        "End (reason `length`) a sequence that `outgrows_pool`."
        if not self.outgrows_pool(seq):
            return False
        self.finish(seq, "length")
        plan.finished.append(seq)
        return True

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> bool:
        cached = self.allocator.match_prefix(seq.token_ids)
        seq.block_table, seq.num_computed = cached, len(cached) * self.allocator.block_size
        seq.block_hashes = [self.allocator.hash_of(b) for b in cached]
        num_new = min(seq.num_uncomputed, budget)
        need = self._blocks_for(seq, num_new)
        if not self.allocator.can_allocate(need):
            self.allocator.cancel_match(
                cached, seq.num_tokens
            )  # it will be looked up again when it fits
            seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
            return False
        seq.block_table += self.allocator.allocate(need)
        seq.num_cached_prompt_tokens = seq.num_computed
        if self.num_state_slots:  # admission keeps running <= max_num_seqs <= slots: one is free
            seq.state_slot = self.free_state_slots.pop()
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self._insert_running(seq)
        plan.scheduled.append(ScheduledSeq(seq, num_new, num_new == seq.num_uncomputed))
        return True

    def _insert_running(self, seq: Sequence) -> None:
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > seq.arrival:
            i -= 1
        self.running.insert(i, seq)

    def step_done(self, plan: StepPlan) -> None:
        """After the model ran: the scheduled tokens are computed; offer newly full blocks to the prefix cache.
        A sequence with drafts waits for `advance` with what was accepted of them (chapter 08c)."""
        for item in plan.scheduled:
            if not item.num_draft:
                self.advance(item.seq, item.num_new)

    def advance(self, seq: Sequence, num_computed: int) -> None:
        "`num_computed` more of `seq`'s tokens have their K/V in the cache; newly full blocks join the prefix cache."
        if seq.finished:
            return  # aborted while the step ran; its blocks are already back
        size = self.allocator.block_size
        seq.num_computed += num_computed
        newly_full = range(len(seq.block_hashes), seq.num_computed // size)
        tokens = (
            seq.token_ids if newly_full else None
        )  # building the list costs O(length): only when needed
        for i in newly_full:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(
                self.allocator.register_full_block(
                    seq.block_table[i], parent, tokens[i * size : (i + 1) * size]
                )
            )


# %% [markdown]
# ## Driving it without a model
#
# To see the scheduler work we only need something that "samples" a token for every sequence
# that asks for one. `simulate` runs steps until everything is finished and records, per
# step, who ran a prefill chunk and who decoded: the scheduler timeline.

# %%
def simulate(scheduler, seqs_by_step, max_steps=500, next_token=lambda seq: 7):
    "Add the sequences listed for each step, run steps to the end; return the timeline."
    timeline = []
    for step in range(max_steps):
        for seq in seqs_by_step.get(step, []):
            scheduler.add(seq)
        if not scheduler.has_unfinished():
            if step > max(seqs_by_step, default=0):
                break
            continue
        plan = scheduler.schedule()
        scheduler.step_done(plan)
        for item in plan.scheduled:
            kind = (
                "decode"
                if item.num_new == 1 and item.seq.num_computed > len(item.seq.prompt_ids)
                else "prefill"
            )
            timeline.append((step, item.seq.request_id, kind, item.num_new))
            if item.samples:
                item.seq.output_ids.append(next_token(item.seq))
                if len(item.seq.output_ids) >= item.seq.params.max_tokens:
                    scheduler.finish(item.seq, "length")
        for seq in plan.preempted:
            timeline.append((step, seq.request_id, "preempted", 0))
        for seq in plan.finished:
            timeline.append((step, seq.request_id, "ended: pool too small", 0))
    return timeline


def make_seq(rid, prompt_len, max_tokens):
    return Sequence(
        rid,
        list(range(1000 * len(rid), 1000 * len(rid) + prompt_len)),
        SamplingParams(max_tokens=max_tokens),
    )


# %% [markdown]
# Three short requests decode while a long prompt (100 tokens, budget 32 per step) is
# prefilled in chunks around them:

# %%
alloc = BlockAllocator(num_blocks=64, block_size=4)
sched = Scheduler(
    EngineConfig(max_num_seqs=8, max_num_batched_tokens=32), alloc, max_model_len=4096
)
arrivals = {
    0: [make_seq("a", 5, 12), make_seq("b", 7, 12), make_seq("c", 3, 12)],
    2: [make_seq("long", 100, 4)],
}
timeline = simulate(sched, arrivals)
alloc.check_idle()

import matplotlib.pyplot as plt

rows = ["a", "b", "c", "long"]
colors = {"prefill": "tab:orange", "decode": "tab:blue", "preempted": "tab:red"}
fig, ax = plt.subplots(figsize=(9, 1.8))
for step, rid, kind, n in timeline:
    ax.barh(rows.index(rid), 1, left=step, color=colors[kind], edgecolor="white")
    if kind == "prefill":
        ax.text(step + 0.5, rows.index(rid), str(n), ha="center", va="center", fontsize=7)
ax.set(
    yticks=range(4),
    yticklabels=rows,
    xlabel="engine step",
    title="orange: prefill chunk (tokens), blue: decode",
)
plt.show()

# %%
steps_of = lambda rid, kind: [s for s, r, k, _ in timeline if r == rid and k == kind]
long_chunks = [n for s, r, k, n in timeline if r == "long" and k == "prefill"]
assert sum(long_chunks) == 100 and len(long_chunks) > 1  # chunked
for rid in (
    "abc"
):  # every decode of the short requests ran in consecutive steps: never stalled by the long prompt
    d = steps_of(rid, "decode")
    assert d == list(range(d[0], d[0] + len(d))), (rid, d)
assert all(
    sum(n for s, _, _, n in timeline if s == step) <= 32 for step in range(60)
)  # the token budget holds

# %% [markdown]
# ## Preemption by recompute
#
# A pool of 10 blocks of 4 tokens cannot hold three sequences that each grow to 20 tokens.
# The youngest is preempted, waits, comes back and finishes. Every request finishes exactly
# once and the pool is empty at the end.

# %%
alloc = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
sched = Scheduler(
    EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), alloc, max_model_len=4096
)
seqs = [make_seq(r, 8, 12) for r in ("x", "yy", "zzz")]
timeline = simulate(sched, {0: seqs})
preempted = [r for _, r, k, _ in timeline if k == "preempted"]
print("preempted:", preempted)
assert preempted and preempted[0] == "zzz"  # the youngest goes first
assert all(s.finished and len(s.output_ids) == 12 for s in seqs)
alloc.check_idle()

# %% [markdown]
# The same with state slots, as for a model with recurrent layers: each running sequence holds a
# slot of its own, a preempted one gives it back with its blocks (it recomputes its state from its
# first token when it comes back), and every slot is free at the end.

# %%
alloc = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64)
sched = Scheduler(config, alloc, max_model_len=4096, state_slots=3)


def slots_of_running(seq):
    "simulate's token: checks first that the running sequences hold distinct slots, none of them free."
    slots = [s.state_slot for s in sched.running]
    assert None not in slots and len(set(slots)) == len(slots), slots
    assert not set(slots) & set(sched.free_state_slots)
    return 7


seqs = [make_seq(r, 8, 12) for r in ("x", "yy", "zzz")]
timeline = simulate(sched, {0: seqs}, next_token=slots_of_running)
assert [r for _, r, k, _ in timeline if k == "preempted"]
assert sorted(sched.free_state_slots) == [0, 1, 2] and all(s.state_slot is None for s in seqs)
with pytest.raises(ValueError, match="without the prefix cache"):
    Scheduler(config, BlockAllocator(num_blocks=10, block_size=4), 4096, state_slots=3)
with pytest.raises(ValueError, match="one each"):
    Scheduler(config, alloc, 4096, state_slots=2)

# %% [markdown]
# FCFS: a request that does not fit yet blocks the ones behind it, so it cannot starve:

# %%
alloc = BlockAllocator(num_blocks=6, block_size=4, enable_prefix_caching=False)
sched = Scheduler(
    EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), alloc, max_model_len=4096
)
big, small = make_seq("big", 20, 2), make_seq("small", 2, 2)
first = make_seq("first", 10, 2)
sched.add(first)
sched.schedule()  # first holds 3 blocks
sched.add(big)
sched.add(small)
plan = sched.schedule()
assert [i.seq.request_id for i in plan.scheduled] == [
    "first"
]  # big (5 blocks) waits, small must not overtake

# %% [markdown]
# Bad input is refused before anything is queued, with the numbers:

# %%
alloc = BlockAllocator(num_blocks=4, block_size=4)
sched = Scheduler(
    EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, max_waiting=1), alloc, max_model_len=64
)
with pytest.raises(ValueError, match="prompt has 70 tokens; the context holds 64"):
    sched.add(make_seq("p", 70, 1))
with pytest.raises(ValueError, match="prompt has 20 tokens; the KV pool holds 16 tokens"):
    sched.add(make_seq("p", 20, 1))
sched.add(make_seq("ok", 3, 1))
with pytest.raises(QueueFullError, match="waiting queue is full"):
    sched.add(make_seq("more", 3, 1))
with pytest.raises(ValueError, match="max_num_batched_tokens"):
    Scheduler(EngineConfig(max_num_seqs=16, max_num_batched_tokens=8), alloc, 64)


# %% [markdown]
# Random workloads: random arrivals, lengths, aborts and a tiny pool. Every request finishes
# exactly once, the budget always holds, and the pool is idle at the end.

# %%
def random_workload(seed):
    rng = random.Random(seed)
    alloc = BlockAllocator(num_blocks=rng.randint(8, 24), block_size=rng.choice([2, 4, 8]))
    cfg = EngineConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(8, 40))
    sched = Scheduler(cfg, alloc, max_model_len=4096)
    seqs, finished = [], {}
    for step in range(400):
        if step < 40 and rng.random() < 0.4:
            n = rng.randint(1, min(alloc.num_blocks * alloc.block_size - 1, 30))
            seq = Sequence(
                f"r{step}",
                [rng.randint(0, 3) for _ in range(n)],
                SamplingParams(max_tokens=rng.randint(1, 10)),
            )
            sched.add(seq)
            seqs.append(seq)
        if seqs and rng.random() < 0.05:
            victim = rng.choice(seqs)
            if not victim.finished:
                sched.finish(victim, "abort")
                finished[victim.request_id] = finished.get(victim.request_id, 0) + 1
        plan = sched.schedule()
        for seq in plan.finished:
            finished[seq.request_id] = finished.get(seq.request_id, 0) + 1
        assert (
            plan.num_tokens <= cfg.max_num_batched_tokens and len(sched.running) <= cfg.max_num_seqs
        )
        sched.step_done(plan)
        for item in plan.scheduled:
            if item.samples and not item.seq.finished:
                item.seq.output_ids.append(rng.randint(0, 3))
                if len(item.seq.output_ids) >= item.seq.params.max_tokens:
                    sched.finish(item.seq, "length")
                    finished[item.seq.request_id] = finished.get(item.seq.request_id, 0) + 1
        alloc.check_invariants()
        if step >= 40 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), f"seed {seed}: work left"
    assert all(finished.get(s.request_id) == 1 and s.finished for s in seqs), f"seed {seed}"
    alloc.check_idle()


for seed in range(30):
    random_workload(seed)

# %% [markdown]
# A sequence that outgrows the whole pool ends with `length` instead of preempting others, or
# itself, forever:

# %%
alloc = BlockAllocator(num_blocks=3, block_size=4, enable_prefix_caching=False)
sched = Scheduler(
    EngineConfig(max_num_seqs=2, max_num_batched_tokens=16), alloc, max_model_len=4096
)
lone = make_seq("lone", 8, 20)
timeline = simulate(sched, {0: [lone]})
assert (
    lone.finish_reason == "length" and len(lone.output_ids) == 4 + 1
)  # 12 slots: 8 prompt + 4 computed outputs, +1 sampled
alloc.check_idle()

# a preempted sequence whose recompute no longer fits must not come back in chunks forever
alloc = BlockAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
sched = Scheduler(
    EngineConfig(max_num_seqs=2, max_num_batched_tokens=11), alloc, max_model_len=4096
)
pair = [make_seq("u", 1, 7), make_seq("vv", 7, 12)]
timeline = simulate(sched, {0: pair}, max_steps=200)
assert all(s.finished for s in pair) and pair[1].finish_reason == "length"
alloc.check_idle()
