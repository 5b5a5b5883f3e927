# %% [markdown]
# # The state pool
#
# > Per-sequence recurrent states beside the paged KV cache: a slot for each running sequence, and the backend that runs a step's Gated DeltaNet layers over the slots.

# %% [markdown]
# Chapter 03b's Qwen3.5 has two kinds of memory. Its full-attention layers keep K/V per token,
# which chapter 05's paged pool already serves (sized for those layers only: `kv_layers`). Its
# Gated DeltaNet layers keep, per sequence, a state of fixed size: the last few inputs of the
# short convolution and the recurrent matrix `S` of each value head. Fixed size means no paging:
# one **slot** per running sequence holds all of it, in two tensors for the whole model,
#
# - `conv [linear layers, slots, K-1, conv channels]` in the model's dtype, and
# - `recurrent [linear layers, slots, value heads, key dim, value dim]` in fp32 (the recurrence
#   adds a small correction to a decayed memory at every token: bf16 would lose it).
#
# There are `max_num_seqs` slots: the scheduler (chapter 07) hands one to a sequence when it is
# admitted and takes it back when the sequence finishes or is preempted, with its blocks.
#
# What the state changes elsewhere:
#
# - **Prefix caching is off** for these models. A cached block holds the K/V of its tokens, but
#   resuming after it also needs every linear layer's state at that token. At the shape of
#   `transformers`' default `Qwen3_5TextConfig` (24 linear layers of 32 heads of 128 × 128) a
#   state is 48 MiB in fp32, while a block of 16 tokens holds 512 KiB of K/V (chapter 03b): a
#   snapshot per block would take 96 times the memory of the cache it belongs to.
# - **Preemption recomputes from the first token**: a preempted sequence gives its slot back, and
#   when it returns its prompt and output so far run again from a zero state.
# - **No speculative decoding** (chapter 08c) yet: the rows of a rejected draft would leave their
#   update in the state, and undoing it needs a state per draft row.
#
# `StepStates` is the linear-attention backend (chapter 03b's protocol) of one engine step: the
# step's rows are flattened over several sequences, each a run of rows with its slot. A sequence
# with one new row after a state is a decode: all of those go to the one-token forms at once,
# their states gathered by slot. The others (prompts and their chunks) take the whole-sequence
# forms, from a zero state when they start, all of them in one call of each (flattened, with
# `cu_seqlens`): a layer is the same few launches however many prompts the step holds, and no
# loop on the host. Both call chapter 03c's functions, which run Triton kernels on a GPU and
# chapter 03b's PyTorch elsewhere.

# %%
#| default_exp state_pool

# %%
#| export
from __future__ import annotations

from typing import Sequence

import torch

from forge_engine.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    gated_delta_decode,
    gated_delta_prefill,
)
from forge_engine.qwen3_5 import Qwen35Config

# %%
#| hide
import pytest

from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
from forge_engine.qwen3_5 import QWEN35_TINY, Qwen35Model, init_random_qwen35


# %% [markdown]
# ## The pool

# %%
#| export
class StatePool:
    """The Gated DeltaNet states of up to `num_slots` sequences: `conv` [linear layers, slots, K-1, conv channels] in
    `dtype`, `recurrent` [linear layers, slots, value heads, key dim, value dim] in fp32. Zeros: a slot's state is
    written by the first step of its sequence before anything reads it."""

    def __init__(self, config: Qwen35Config, num_slots: int, device="cpu", dtype=torch.float32):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.config, self.num_slots = config, num_slots
        conv, recurrent = self.slot_shapes(config)
        self.conv = torch.zeros(
            (config.linear_layers, num_slots, *conv), device=device, dtype=dtype
        )
        self.recurrent = torch.zeros(
            (config.linear_layers, num_slots, *recurrent), device=device, dtype=torch.float32
        )

    @staticmethod
    def slot_shapes(config: Qwen35Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        "The shapes of one layer's conv and recurrent state of one sequence."
        c = config
        channels = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )
        return (
            (c.linear_conv_kernel_dim - 1, channels),
            (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
        )

    @staticmethod
    def bytes_per_slot(config: Qwen35Config, dtype: torch.dtype) -> int:
        "Bytes of one sequence's states over all linear layers."
        conv, recurrent = StatePool.slot_shapes(config)
        return config.linear_layers * (
            conv[0] * conv[1] * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4
        )

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


# %%
pool = StatePool(QWEN35_TINY, num_slots=4)
# the tiny model: 3 linear layers; conv 3 x (2*2*16 + 4*16) = 3 x 128, recurrent 4 heads of 16 x 16
assert pool.conv.shape == (3, 4, 3, 128) and pool.recurrent.shape == (3, 4, 4, 16, 16)
assert (
    pool.nbytes
    == 4 * StatePool.bytes_per_slot(QWEN35_TINY, torch.float32)
    == 4 * 3 * (384 + 1024) * 4
)
with pytest.raises(ValueError, match="at least one slot"):
    StatePool(QWEN35_TINY, 0)


# %% [markdown]
# ## One step over the pool
#
# The runner (chapter 07a) describes a step's sequences as `(rows, slot, fresh)` in row order:
# how many rows of the flattened batch are the sequence's, its slot, and whether it starts in
# this step (`fresh`: its slot holds a finished sequence's state, to be ignored). `StepStates`
# sorts them once into decodes and the rest, as row indices (a slice where they are one run of
# rows, as a step of decodes alone is), then serves every layer of the step.

# %%
#| export
def _rows(indices: list[int], device) -> slice | torch.Tensor:
    "Row indices as a slice when they are one run (no copy to index with), else a tensor."
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices, device=device)


class StepStates:
    """The linear-attention backend (chapter 03b) of one engine step: `segments` gives each sequence's
    (rows, slot, fresh) in row order; each sequence reads and writes its slot of `pool`."""

    def __init__(self, pool: StatePool, segments: Sequence[tuple[int, int, bool]]):
        self.pool, device = pool, pool.recurrent.device
        decode_rows, decode_slots, self.prefills, start = [], [], [], 0
        for rows, slot, fresh in segments:
            if not 0 <= slot < pool.num_slots:
                raise ValueError(f"state slot {slot} is outside the pool's {pool.num_slots}")
            if rows == 1 and not fresh:  # one token after a state: a decode
                decode_rows.append(start)
                decode_slots.append(slot)
            else:
                self.prefills.append((start, rows, slot, fresh))
            start += rows
        self.decode_rows = _rows(decode_rows, device) if decode_rows else None
        self.decode_slots = torch.tensor(decode_slots, device=device)
        if self.prefills:
            self.prefill_rows = _rows(
                [s + i for s, n, _, _ in self.prefills for i in range(n)], device
            )
            lengths = torch.tensor([0] + [n for _, n, _, _ in self.prefills])
            self.cu_seqlens = lengths.cumsum(0).to(device)
            self.prefill_slots = torch.tensor(
                [slot for *_, slot, _ in self.prefills], device=device
            )
            self.prefill_fresh = torch.tensor([fresh for *_, fresh in self.prefills], device=device)

    @classmethod
    def decodes(cls, pool: StatePool, slots: torch.Tensor) -> StepStates:
        """A step of decodes only, row b from slot `slots[b]` (a tensor on the pool's device): what chapter 09b's
        CUDA graphs record, with no host work per layer and nothing copied to the device."""
        step = cls.__new__(
            cls
        )  # (not __init__: it would make tensors from host lists, inside a graph's recording)
        step.pool, step.prefills = pool, []
        step.decode_rows, step.decode_slots = slice(0, len(slots)), slots
        return step

    def decodes_only(self) -> bool:
        "Whether every row of the step is a decode: then a kernel's output is the step's, with nothing to copy."
        return not self.prefills and self.decode_rows is not None

    def conv(self, index: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        states = self.pool.conv[index]
        if self.decodes_only():
            return causal_conv1d_decode(x, states, weight, self.decode_slots)
        y = torch.empty_like(x)
        if self.decode_rows is not None:
            rows = self.decode_rows
            y[rows] = causal_conv1d_decode(x[rows], states, weight, self.decode_slots)
        if self.prefills:  # prompts and their chunks: all of them at once
            r = self.prefill_rows
            y[r] = causal_conv1d_prefill(
                x[r], states, weight, self.cu_seqlens, self.prefill_slots, self.prefill_fresh
            )
        return y

    def delta_rule(self, index, q, k, v, g, beta) -> torch.Tensor:
        states = self.pool.recurrent[index]
        if self.decodes_only():
            return gated_delta_decode(q, k, v, g, beta, states, self.decode_slots)
        out = v.new_empty(v.shape, dtype=torch.float32)
        if self.decode_rows is not None:
            r = self.decode_rows
            out[r] = gated_delta_decode(q[r], k[r], v[r], g[r], beta[r], states, self.decode_slots)
        if self.prefills:
            r = self.prefill_rows
            out[r] = gated_delta_prefill(
                q[r],
                k[r],
                v[r],
                g[r],
                beta[r],
                self.cu_seqlens,
                states,
                self.prefill_slots,
                self.prefill_fresh,
            )
        return out


# %% [markdown]
# ## Many sequences at once, each as if alone
#
# A tiny model serves four sequences over several steps the way the engine will: decodes and
# prompt chunks flattened into one batch, the full-attention layers over chapter 05's paged pool,
# the linear ones over the state pool. Slot 2 belonged to a finished sequence (its state is
# garbage) and is handed to a new one. At every step each sequence's hidden states must equal
# those of its whole token sequence run alone from scratch, and the slot nobody uses must be left
# as it was.

# %%
model = init_random_qwen35(Qwen35Model(QWEN35_TINY), seed=0, std=0.1).eval()  # logits far apart

block_size = 4
cache = PagedKVCache(QWEN35_TINY, num_blocks=160, block_size=block_size)
pool = StatePool(QWEN35_TINY, num_slots=5)
pool.conv[:, 2].normal_()
pool.recurrent[:, 2].normal_()  # a finished sequence's state in slot 2
untouched = pool.conv[:, 4].clone(), pool.recurrent[:, 4].clone()
gen = torch.Generator().manual_seed(1)
tokens = {
    name: torch.randint(0, QWEN35_TINY.vocab_size, (n,), generator=gen).tolist()
    for name, n in [("a", 9), ("b", 150), ("c", 1), ("d", 70)]
}
slots = {"a": 0, "b": 1, "c": 2, "d": 3}
tables = {name: list(range(40 * i, 40 * i + 40)) for i, name in enumerate(tokens)}
# each step: (sequence, tokens computed before, new tokens); b's prompt in chunks, d's a chunk of 64 then 6
steps = [
    [("a", 0, 9), ("b", 0, 64)],
    [("a", 9, 1), ("b", 64, 64), ("c", 0, 1)],
    [("c", 1, 1), ("a", 10, 1), ("b", 128, 22), ("d", 0, 64)],
    [("a", 11, 1), ("b", 150, 1), ("c", 2, 1), ("d", 64, 6)],
]
worst = 0.0
with torch.no_grad():
    for step in steps:
        for (
            name,
            done,
            new,
        ) in step:  # the decodes' tokens: whatever came next (here: more random ids)
            while len(tokens[name]) < done + new:
                tokens[name].append(
                    int(torch.randint(0, QWEN35_TINY.vocab_size, (1,), generator=gen))
                )
        ids = torch.tensor([t for name, done, new in step for t in tokens[name][done : done + new]])
        layout = build_step_layout(
            [(tables[name], done, new) for name, done, new in step], block_size
        )
        states = StepStates(pool, [(new, slots[name], done == 0) for name, done, new in step])
        hidden = model(ids, layout.positions, PagedAttention(cache, layout), states)
        start = 0
        for name, done, new in step:
            alone = model(torch.tensor(tokens[name][: done + new]), torch.arange(done + new))[done:]
            got = hidden[start : start + new]
            # fp32: other matmul blockings for other batches, chunks cut elsewhere; the DeltaNet's output norm scales
            # its small outputs up, and their rounding with them (chapter 03b): 1.4e-5 of the largest output seen
            scale = alone.abs().max().item()
            torch.testing.assert_close(
                got, alone, rtol=0, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}"
            )
            worst, start = max(worst, (got - alone).abs().max().item() / scale), start + new
assert torch.equal(pool.conv[:, 4], untouched[0]) and torch.equal(
    pool.recurrent[:, 4], untouched[1]
)
print(f"4 steps, 4 sequences: max |hidden - alone| {worst:.1e} of the largest output")

# %%
with pytest.raises(ValueError, match="state slot 5 is outside the pool's 5"):
    StepStates(pool, [(1, 5, False)])

# a step of decodes only, from a tensor of slots: the same as the step laid out from a list
ids, positions = torch.tensor([7, 9]), torch.tensor([12, 3])  # the next token of a and of c
layout = build_step_layout([(tables["a"], 12, 1), (tables["c"], 3, 1)], block_size)
before = pool.conv.clone(), pool.recurrent.clone()
with torch.no_grad():
    listed = model(
        ids,
        positions,
        PagedAttention(cache, layout),
        StepStates(pool, [(1, 0, False), (1, 2, False)]),
    )
    pool.conv.copy_(before[0]), pool.recurrent.copy_(before[1])
    static = model(
        ids,
        positions,
        PagedAttention(cache, layout),
        StepStates.decodes(pool, torch.tensor([0, 2])),
    )
assert torch.equal(listed, static)
