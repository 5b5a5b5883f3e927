# %% [markdown]
# # The step message
#
# > What rank 0 sends the workers each step: the scheduled sequences in a few bytes, and the tokens not yet read back, on the GPU.
#
# Part of tensor parallelism: chapter 09c says how the model is split and what crosses the wire.

# %%
#| default_exp tensor_parallel.step_message

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from forge_engine.runner import PendingTokens

# %%
#| hide
import tempfile
from pathlib import Path
import pytest
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.model import (
    causal_attention,
    empty_model,
    hf_state_dict,
    init_random_weights,
    rope_cos_sin,
)


# ## The step, as the workers see it
#
# Rank 0's `ModelRunner` reads, per scheduled sequence, its new tokens, how many tokens are
# already in the cache, its block table and whether it samples. That is all a worker needs to
# run the same step. Sending all of it every step is wasteful: at 256 decoding sequences the
# block tables are ~13,000 numbers, and all but a few are the ones sent the step before. So
# each worker keeps a **mirror** of every running sequence's block table, and a step carries
# only what changed:
#
# - per scheduled sequence: a small integer key, its cached-token count, its new-token count,
#   whether it samples, and its table's length (the worker checks its mirror against it);
# - the new tokens, all in one array (one per decoding sequence);
# - table updates: whole tables for sequences just admitted (or re-admitted after a
#   preemption), the appended blocks for the others (most decode steps: none);
# - the keys of sequences that finished, so the mirrors do not grow for ever.
#
# Every part is a flat `int32` numpy array (pickled with its bytes copied once), not a list of
# Python objects. `StepWriter` on rank 0 makes them; `StepReader` in a worker applies them and
# dresses the step as the scheduler's plan for the worker's own `ModelRunner`.
#
# How rank 0 knows what changed: the scheduler only ever *appends* to a running sequence's
# `block_table` list; admitting (or re-admitting) a sequence gives it a new list. So the writer
# keeps, per sequence, the list object it last sent and how long it was then: the same object,
# longer, means "append the tail"; another object means "replace".

# %%
#| export
StepMessage = tuple[np.ndarray, ...]  # the arrays of `StepWriter.encode`, in its order


class StepWriter:
    "Rank 0's side: each `StepPlan` as what changed since the last one (see above)."

    def __init__(self):
        self.sent: dict = {}  # Sequence -> [key, the block_table list last sent, its length then, last step sent]
        self.next_key, self.steps = 0, 0

    def encode(self, plan, unread: Sequence[int] = ()) -> StepMessage:
        "`unread`: the items whose last input token is still on rank 0's GPU (chapter 08's overlapped steps)."
        self.steps += 1
        keys, done, counts, samples, lengths, tokens = [], [], [], [], [], []
        updated, starts, update_lens, blocks = [], [], [], []
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new
            state = self.sent.get(seq)
            if state is None:
                state = self.sent[seq] = [self.next_key, None, 0, 0]
                self.next_key += 1
            table, computed = seq.block_table, seq.num_computed
            if (
                table is not state[1] or len(table) > state[2]
            ):  # a new table (admitted again), or blocks appended
                start = 0 if table is not state[1] else state[2]
                updated.append(state[0])
                starts.append(start)
                update_lens.append(len(table) - start)
                blocks += table[start:]
                state[1], state[2] = table, len(table)
            state[3] = self.steps
            if n == 1:  # decodes: one token, found without building the whole token list
                prompt = seq.prompt_ids
                tokens.append(
                    prompt[computed]
                    if computed < len(prompt)
                    else seq.output_ids[computed - len(prompt)]
                )
            else:
                tokens += seq.token_ids[computed : computed + n]
            keys.append(state[0])
            done.append(computed)
            counts.append(n)
            samples.append(item.samples)
            lengths.append(len(table))
        gone = []
        if len(self.sent) > len(
            plan.scheduled
        ):  # someone was not scheduled: finished ones are forgotten
            finished = [
                seq for seq, state in self.sent.items() if state[3] != self.steps and seq.finished
            ]
            gone = [self.sent.pop(seq)[0] for seq in finished]
        as_array = lambda values: np.array(values, dtype=np.int32)
        return tuple(
            map(
                as_array,
                (
                    keys,
                    done,
                    counts,
                    samples,
                    lengths,
                    tokens,
                    updated,
                    starts,
                    update_lens,
                    blocks,
                    gone,
                    unread,
                ),
            )
        )


class _Tokens:
    "A sequence's token ids from `offset` on: sliced with absolute positions, as the runner slices a sequence."

    __slots__ = ("offset", "tokens")

    def __init__(self, offset: int, tokens: list[int]):
        self.offset, self.tokens = offset, tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.offset : s.stop - self.offset]


@dataclass(slots=True, eq=False)  # (eq=False: hashed by identity, as a `Sequence` is)
class _SeqView:
    "A worker's mirror of one sequence: what its `ModelRunner` reads of a `Sequence`."

    block_table: list[int]
    num_computed: int = 0
    token_ids: _Tokens | None = None
    last_token: int = 0


@dataclass(slots=True)
class _Scheduled:
    seq: _SeqView
    num_new: int
    samples: bool
    num_draft: int = 0  # (no drafts under tensor parallelism: the engine refuses speculation there)


@dataclass
class _Plan:
    scheduled: list[_Scheduled]
    unread: list[int] = field(
        default_factory=list
    )  # items whose last input token rank 0 broadcasts


class StepReader:
    "A worker's side: applies each `StepMessage` to its mirrors and returns the plan its `ModelRunner` runs."

    def __init__(self):
        self.seqs: dict[int, _SeqView] = {}

    def decode(self, message: StepMessage) -> _Plan:
        (
            keys,
            done,
            counts,
            samples,
            lengths,
            tokens,
            updated,
            starts,
            update_lens,
            blocks,
            gone,
            unread,
        ) = (a.tolist() for a in message)
        for key in gone:
            del self.seqs[key]
        at = 0
        for key, start, n in zip(updated, starts, update_lens):
            view = self.seqs.get(key) or self.seqs.setdefault(key, _SeqView([]))
            view.block_table[start:] = blocks[
                at : at + n
            ]  # in place: the same list, replaced or extended
            at += n
        scheduled, end = [], 0
        for key, computed, n, sample, length in zip(keys, done, counts, samples, lengths):
            view = self.seqs[key]
            if len(view.block_table) != length:
                raise RuntimeError(
                    f"tensor-parallel worker: sequence {key}'s block table has {len(view.block_table)} "
                    f"blocks, rank 0's has {length}: the mirrors are out of step"
                )
            new, end = tokens[end : end + n], end + n
            view.num_computed, view.token_ids, view.last_token = (
                computed,
                _Tokens(computed, new),
                new[-1],
            )
            scheduled.append(_Scheduled(view, n, bool(sample)))
        return _Plan(scheduled, unread)


def broadcast_pending(tokens: torch.Tensor) -> torch.Tensor:
    """All ranks together: rank 0's pending input tokens of this step (chapter 08), in the order of the message's
    `unread` items, to every rank. Queued on the GPU like the all-reduces: no rank waits for it on the host."""
    dist.broadcast(tokens, src=0)
    return tokens


def received_pending(plan: _Plan, device: torch.device) -> PendingTokens:
    "A worker's side: this step's pending input tokens, received, as its `ModelRunner` takes them."
    tokens = broadcast_pending(torch.empty(len(plan.unread), dtype=torch.long, device=device))
    return PendingTokens(tokens, {plan.scheduled[k].seq: j for j, k in enumerate(plan.unread)})


# %% [markdown]
# Three steps of a small batch, through a writer and a reader: the first carries the whole
# tables, the second none (every sequence still has room in its last block), the third the
# blocks appended and the key of the sequence that finished. The reader's plan reads the same
# as the scheduler's.

# %%
from forge_engine.scheduler import ScheduledSeq, Sequence, StepPlan, Status


def fake_seq(i, prompt_len, table):
    seq = Sequence(str(i), list(range(1, prompt_len + 1)), SamplingParams())
    seq.block_table, seq.status = table, Status.RUNNING
    return seq


writer, reader = StepWriter(), StepReader()
seqs = [fake_seq(0, 5, [3, 4]), fake_seq(1, 9, [7, 8, 9])]


def same_plan(plan, read):
    for a, b in zip(plan.scheduled, read.scheduled, strict=True):
        s, v, n = a.seq, b.seq, a.num_new
        assert (v.block_table, v.num_computed, b.num_new, b.samples) == (
            s.block_table,
            s.num_computed,
            n,
            a.samples,
        )
        assert (
            v.token_ids[s.num_computed : s.num_computed + n]
            == s.token_ids[s.num_computed : s.num_computed + n]
        )
    return sum(a.nbytes for a in message)


plan = StepPlan(
    [ScheduledSeq(seqs[0], 5, True), ScheduledSeq(seqs[1], 4, False)]
)  # a prefill and a chunk of one
message = writer.encode(plan)
print("step 1:", same_plan(plan, reader.decode(message)), "bytes")
seqs[0].num_computed, seqs[1].num_computed = 5, 4
seqs[0].output_ids = [42]
plan = StepPlan([ScheduledSeq(seqs[0], 1, True), ScheduledSeq(seqs[1], 5, True)])
message = writer.encode(plan)
print("step 2:", same_plan(plan, reader.decode(message)), "bytes")
assert message[6].size == 0  # no table changed
seqs[0].num_computed, seqs[1].num_computed = 6, 9
seqs[0].output_ids.append(43)
seqs[0].block_table += [11]  # seq 0 grew a block
seqs[1].status = Status.FINISHED
plan = StepPlan([ScheduledSeq(seqs[0], 1, True)])
message = writer.encode(plan)
print("step 3:", same_plan(plan, reader.decode(message)), "bytes")
assert message[6].tolist() == [0] and message[9].tolist() == [11] and message[10].tolist() == [1]
assert list(reader.seqs) == [0] and len(writer.sent) == 1
seqs[0].block_table = [20, 21]  # preempted and re-admitted: a new list, sent whole
seqs[0].num_computed = 0
plan = StepPlan([ScheduledSeq(seqs[0], 7, True)])
assert same_plan(plan, reader.decode(writer.encode(plan)))

# %% [markdown]
#
