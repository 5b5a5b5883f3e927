# %% [markdown]
# # Decode with CUDA graphs
#
# > Record the decode forward once per batch size, then replay it: one launch instead of hundreds.

# %% [markdown]
# A decode step of Qwen3-4B is about 700 small GPU kernels. Launched one by one from Python,
# the CPU takes far longer to launch them than the GPU takes to run them: measured on an H200,
# the eager engine decodes 21.6 tokens/s at batch 1 (46 ms a step) when reading the weights
# takes under 2 ms. A **CUDA graph** records the kernels of one forward once, with their
# arguments pointing at fixed ("static") buffers; afterwards a single `replay()` launches the
# whole recorded sequence.
#
# What that asks of the code:
#
# - **static shapes and addresses**: inputs are copied into preallocated buffers before each
#   replay; one graph per *bucket* of batch sizes (1, 2, 4, 8, 16, 24, ...), a batch padded up
#   to its bucket, and per bucket of block-table width (512, 2K, 8K, 32K tokens, the whole
#   context): the decode kernel sizes its split work from the width, and measured on an H200, 256
#   sequences of ~600 tokens took 48 ms a step through tables as wide as Qwen3-4B's 262,144-token
#   context. The 512-token width is one split of chapter 09's decode kernel: a short chat's
#   steps then skip the merge kernel and the empty splits a 2K table launches in every layer;
# - **no host synchronisation inside**: attention must not loop over sequences in Python or
#   read context lengths back; it reads block tables and lengths from device tensors
#   (`paged_decode_attention_torch` of chapter 05 here; the Triton kernel of chapter 09 on a
#   GPU);
# - **padding must be harmless**: padded rows write their K/V into a scratch block no sequence
#   owns, and their outputs are dropped.
#
# Steps with prefill tokens get graphs of their own, per bucket of token counts, up to 512
# tokens (the last section, "Mixed steps"); longer prefill chunks stay eager: each of their
# launches does enough work.
#
# `DecodeRunner(use_graphs=False)` runs exactly the same static-buffer forward without
# recording, which is how this chapter tests the logic on a CPU.

# %%
#| default_exp cuda_graphs

# %%
#| export
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np
import torch

from forge_engine.kernels.cpu import cpu_decode_attention
from forge_engine.kv_cache import PagedKVCache, paged_decode_attention_torch
from forge_engine.model import Transformer
from forge_engine.offload import OffloadedTransformer, SplitAttention
from forge_engine.state_pool import StatePool, StepStates

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.kv_cache import PagedAttention, build_step_layout
from forge_engine.model import empty_model, init_random_weights

# %%
#| export
DecodeAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def decode_buckets(max_num_seqs: int) -> list[int]:
    "Batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to 64, then every 32."
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 32)
    return sizes + [max_num_seqs]


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Block-table widths (in blocks) that get a graph: 512 (one decode split), 2K, 8K and 32K tokens, then the whole
    context. The decode kernel sizes its work from the table's width, so a batch of short sequences must not run the
    graph recorded for 262,144-token tables."""
    tokens = [t for t in (512, 2048, 8192, 32768) if t < max_model_len] + [max_model_len]
    return [-(-t // block_size) for t in tokens]


def decode_attention_for(device: torch.device) -> DecodeAttentionFn:
    """The fastest graph-safe decode attention for `device`: the Triton kernel on a CUDA GPU when Triton works; on a
    CPU chapter 09's C kernel (as the engine's other decodes there), where it is built."""
    if torch.device(device).type == "cuda":
        from forge_engine.kernels.backend import kernels_available
        from forge_engine.kernels.prefill_attention import KernelDecodeAttention

        if kernels_available(device):
            return KernelDecodeAttention()
    return paged_decode_attention_cpu


def paged_decode_attention_cpu(q, k_layer, v_layer, block_tables, context_lens) -> torch.Tensor:
    "`cpu_decode_attention` where it runs (a float32 pool on a CPU, a compiler here), else the PyTorch reference."
    out = cpu_decode_attention(q, k_layer, v_layer, block_tables, context_lens)
    if out is None:
        return paged_decode_attention_torch(q, k_layer, v_layer, block_tables, context_lens)
    return out


class StaticDecodeAttention:
    """Attention backend over static buffers: write K/V through the slots, attend through the block tables. An
    attention that `stores_kv` (chapter 09's kernel) gets the new K/V and their slots and stores them itself. `verify`:
    rows may be positions of one sequence (a verify step, chapter 08c) that read each other's K/V; an attention that
    `attends_step_rows` then takes them from the step's rows (`verify=True`), for any other every row's K/V is stored
    before any row attends."""

    def __init__(
        self,
        cache: PagedKVCache,
        slots,
        block_tables,
        context_lens,
        attention: DecodeAttentionFn,
        verify: bool = False,
    ):
        self.cache, self.slots, self.tables, self.lens = cache, slots, block_tables, context_lens
        self.attention, self.verify = attention, verify
        self.fused_store = getattr(attention, "stores_kv", False) and (
            not verify or getattr(attention, "attends_step_rows", False)
        )

    @property
    def rope_inside(
        self,
    ) -> bool:  # the fused attention then hands over q and k unrotated, with `rope` (chapter 09a)
        return self.fused_store and getattr(self.attention, "rope_inside", False)

    def __call__(self, layer: int, q, k, v, rope=None) -> torch.Tensor:
        k_layer, v_layer = self.cache.k_cache[layer], self.cache.v_cache[layer]
        if self.fused_store:
            step_rows = {"verify": True} if self.verify else {}
            return self.attention(
                q,
                k_layer,
                v_layer,
                self.tables,
                self.lens,
                new_kv=(k, v, self.slots),
                rope=rope,
                **step_rows,
            )
        self.cache.write(layer, self.slots, k, v)
        return self.attention(q, k_layer, v_layer, self.tables, self.lens)


# %%
assert decode_buckets(1) == [1] and decode_buckets(20) == [1, 2, 4, 8, 16, 20]
assert context_buckets(262144, 16) == [32, 128, 512, 2048, 16384] and context_buckets(64, 4) == [16]
assert decode_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40] and decode_buckets(256)[-2:] == [
    224,
    256,
]


# %% [markdown]
# ## The runner
#
# One static input buffer sized for the largest bucket and the longest context; per step only
# the layout of the step's (b, w) graph is written and copied in (the kernel never reads past a
# sequence's length, so a table's columns past it are left 0).

# %% [markdown]
# A step's inputs reach the GPU in **one copy**. Each copy queued on the GPU costs a few
# microseconds whatever its size, and a step has six inputs: the token ids, positions, K/V slots
# and state slots (int64; the last for a model with recurrent layers, chapter 05a), the context
# lengths and the block tables (int32). So they share one byte
# buffer: for the graph of batch bucket b and table width w, they lie back to back from its
# start, and the host writes the same layout into one host tensor (padding rows included)
# before one copy. The graphs of other (b, w) read other layouts of the same buffer; one step
# runs at a time.

# %%
#| export
def decode_inputs_bytes(b: int, w: int) -> int:
    "Bytes of a decode step's inputs for b rows and block tables w wide (see `decode_inputs`)."
    return 4 * 8 * b + 4 * b + 4 * b * w


def decode_inputs(buffer: torch.Tensor, b: int, w: int) -> tuple[torch.Tensor, ...]:
    """Views of a uint8 `buffer` as (ids, positions, K/V slots, state slots [b] int64, context lengths [b] int32,
    block tables [b, w] int32), back to back from its start (every view aligned to its element)."""
    longs = buffer[: 32 * b].view(torch.int64)
    ints = buffer[32 * b : decode_inputs_bytes(b, w)].view(torch.int32)
    return (
        *longs.view(4, b),
        ints[:b],
        ints[b:].view(b, w),
    )


# %%
buffer = torch.zeros(decode_inputs_bytes(4, 3), dtype=torch.uint8)
ids, positions, slots, state_slots, lens, tables = decode_inputs(buffer, 4, 3)
ids[:], slots[:], tables[:] = 7, -1, 5
assert (
    positions.eq(0).all()
    and state_slots.eq(0).all()
    and lens.eq(0).all()
    and tables.shape == (4, 3)
)  # no view overlaps another
assert buffer.numel() == ids.numel() * 8 * 4 + lens.numel() * 4 + tables.numel() * 4


# %% [markdown]
# The host side of that copy is itself **written in place**: each runner owns a few pinned
# (page-locked) host buffers and lays a step's inputs out in the next one, in turn. A copy from
# pinned memory is queued behind the GPU's work instead of waiting for it (chapter 05), and a
# buffer is written again only once the copy out of it is done (an event), which with three in
# turn is always long past. Pinning a fresh host tensor each step would do the same work through
# PyTorch's pinned-memory cache, which hands out blocks of a mixed step's size (~0.5-1 MB) in
# milliseconds at times: measured on an H200 under W3 at 16 req/s, with the engine built on a
# loader thread as `forge-engine serve` builds it, the mixed steps' `pin_memory()` took 6-10 ms at
# worst and the steps 10-18 ms instead of 3 (ITL p99 16-18 ms against 6-7 ms).

# %%
#| export
class HostStaging:
    """Pinned host buffers that a runner lays out its steps' inputs in, `depth` of them in turn; `copy` queues the
    copy to the device without waiting for the GPU. (On a CPU: plain host buffers, plain copies.)"""

    def __init__(self, nbytes: int, device: torch.device, depth: int = 3):
        self.on_gpu = torch.device(device).type == "cuda"
        self.buffers = [
            torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.on_gpu) for _ in range(depth)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * depth  # each buffer's last copy out
        self.turn = 0

    def take(self, nbytes: int) -> torch.Tensor:
        "The next buffer's first `nbytes`, zeroed, once the copy out of it last time is done."
        self.turn = (self.turn + 1) % len(self.buffers)
        if (copied := self.copied[self.turn]) is not None:
            copied.synchronize()
        buffer = self.buffers[self.turn][:nbytes]
        # numpy's fill, on this thread: a PyTorch fill this size wakes its thread pool
        buffer.numpy().fill(0)
        return buffer

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        "`dst.copy_(src)` for `src` from the last `take`, queued behind the GPU's work."
        dst.copy_(src, non_blocking=self.on_gpu)
        if self.on_gpu:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()


# %%
staging = HostStaging(64, "cpu", depth=2)
first = staging.take(16)
first[:] = 7
second = staging.take(8)
assert second.data_ptr() != first.data_ptr() and staging.take(16).eq(0).all()  # in turn, zeroed
dst = torch.empty(16, dtype=torch.uint8)
staging.copy(dst, second.fill_(3)[:8].repeat(2))
assert dst.eq(3).all()

# %% [markdown]
# A greedy request's token is the argmax of its logits. Taken by the sampler after the replay,
# that is one more launch per step, outside the graph; recorded into the graph (chapter 09's
# `argmax_rows`, two short launches), it rides with the replay, and the sampler takes it where
# every row of the step is greedy and nothing adjusts the logits (`greedy_tokens`, chapter 06's
# `sample(..., greedy=)`). Measured on an H200 in `kernels_lab/greedy_in_graph.py` (one
# W1 request of random Qwen3-4B, the lab's version of this): 413.4 tok/s against 411.6 /
# 412.5 (BF16), 623.5 against 620.8 / 620.8 (int8). A step that samples pays for the argmax
# without using it (not measured; the two launches read the logits once, a few µs at a few
# rows), so only the graphs of up to `GREEDY_IN_GRAPH_MAX_ROWS` rows take it.

# %%
#| export
GREEDY_IN_GRAPH = (
    True  # the decode graphs take each row's argmax too (for all-greedy steps; measured faster) ...
)
GREEDY_IN_GRAPH_MAX_ROWS = (
    8  # ... those of up to this many rows (larger: a long read either way, and a sampled step
)
#                                would pay for it too)
VERIFY_MAX_ROWS = (
    64  # verify steps (chapter 08c) of up to this many rows get graphs; larger ones run eager
)


def fill_tables(tables: np.ndarray, block_tables: Sequence[Sequence[int]]) -> None:
    """Write ragged block tables into the first rows of a padded host array (the rest of each row untouched): by
    one mask, ~7x faster than building a tensor from the lists."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    tables[: len(block_tables)][np.arange(tables.shape[1])[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=tables.dtype, count=int(lens.sum())
    )


class DecodeRunner:
    """Decode steps (one new token per sequence) over static buffers, replayed from CUDA graphs per bucket. With
    `verify_rows`, also verify steps of up to that many rows, where rows may be positions of one sequence (a
    sequence's last token and its drafts, chapter 08c): graphs of their own that store K/V before attention. With
    `states` (a model with recurrent layers, chapter 05a), each row also reads and writes its sequence's state slot;
    the pool's last slot is the padding rows' scratch slot."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        scratch_block: int,
        attention: DecodeAttentionFn = paged_decode_attention_torch,
        use_graphs: bool | None = None,
        verify_rows: int = 0,
        states: StatePool | None = None,
    ):
        if states is not None and verify_rows:
            raise ValueError(
                "verify steps of a model with recurrent state: not supported (chapter 05a)"
            )
        self.model, self.cache, self.attention, self.states = model, cache, attention, states
        self.device = next(model.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets, self.widths = (
            decode_buckets(max_num_seqs),
            context_buckets(max_model_len, cache.block_size),
        )
        self.verify_buckets = decode_buckets(verify_rows) if verify_rows else []
        b, width = max(self.buckets + self.verify_buckets), self.widths[-1]
        self.scratch_slot = scratch_block * cache.block_size
        self.inputs = torch.zeros(
            decode_inputs_bytes(b, width), dtype=torch.uint8, device=self.device
        )
        self.staging = HostStaging(self.inputs.numel(), self.device)
        # (batch bucket, table width, verify) -> graph
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.greedy: dict[
            int, torch.Tensor
        ] = {}  # a graph's logits (their address) -> their argmax, recorded too
        if self.use_graphs:
            self.capture()

    @torch.no_grad()
    def _forward(self, b: int, w: int, verify: bool = False) -> torch.Tensor:
        ids, positions, slots, state_slots, lens, tables = decode_inputs(self.inputs, b, w)
        backends = (
            StaticDecodeAttention(self.cache, slots, tables, lens, self.attention, verify=verify),
        )
        if self.states is not None:  # every row a decode from its sequence's state slot
            backends += (StepStates.decodes(self.states, state_slots[:b]),)
        return self.model.compute_logits(self.model(ids, positions, *backends))

    def graph_keys(self) -> list[tuple[int, int, bool]]:
        "(batch bucket, table width, verify) of every graph, largest first."
        return [
            (b, w, verify)
            for verify, buckets in ((False, self.buckets), (True, self.verify_buckets))
            for b in reversed(buckets)
            for w in reversed(self.widths)
        ]

    def row_limit(self, drafts: bool) -> int:
        "The most rows a step takes: a decode step's, or a verify step's (`drafts`; 0: none)."
        buckets = self.verify_buckets if drafts else self.buckets
        return buckets[-1] if buckets else 0

    def capture(self) -> None:
        "Record one graph per (batch bucket, table width, verify), largest first, sharing one memory pool."
        from forge_engine.kernels.elementwise import (
            argmax_rows,
        )  # (Triton's kernels: imported where a GPU records graphs)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (autotuning, lazy init) outside the recording
            for b, w, verify in self.graph_keys():
                if b == max(self.verify_buckets if verify else self.buckets):
                    self._write_inputs(b, w, [], [], [], [], [], [])  # padding rows only
                    logits = self._forward(b, w, verify)
                    if GREEDY_IN_GRAPH:
                        argmax_rows(
                            logits
                        )  # (compiled and loaded here: no module loads while recording)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for key in self.graph_keys():
            self._write_inputs(*key[:2], [], [], [], [], [], [])
            pool = self._record(key, pool)
        torch.cuda.synchronize(self.device)

    def _record(self, key: tuple[int, int, bool], pool) -> tuple:
        "Record graph `key` into the memory pool `pool` (None: a new one); returns the pool."
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._record_logits(key, self._forward(*key))
        self.graphs[key] = graph
        return graph.pool()

    def _record_logits(self, key: tuple[int, int, bool], logits: torch.Tensor) -> None:
        "Keep graph `key`'s logits, and record their argmax after them (GREEDY_IN_GRAPH)."
        from forge_engine.kernels.elementwise import argmax_rows

        self.logits[key] = logits
        if GREEDY_IN_GRAPH and key[0] <= GREEDY_IN_GRAPH_MAX_ROWS:
            self.greedy[logits.data_ptr()] = argmax_rows(logits)

    def _replay(self, key: tuple[int, int, bool]) -> None:
        self.graphs[key].replay()

    def bucket_for(self, n: int, verify: bool = False) -> int:
        return next(b for b in (self.verify_buckets if verify else self.buckets) if b >= n)

    def release_graphs(self) -> None:
        """Destroy the graphs now (their memory pool goes back to PyTorch's cache); `run` refuses from then on.
        Graphs that recorded NCCL collectives must go before their communicator can (chapter 09c)."""
        self.graphs, self.logits, self.greedy = {}, {}, {}

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `logits` as `run` returned them from a graph (GREEDY_IN_GRAPH: taken in the same
        replay, no launch of its own); None for logits of an eager run."""
        tokens = self.greedy.get(logits.data_ptr())
        return None if tokens is None else tokens[: logits.shape[0]]

    def _write_inputs(
        self, b: int, w: int, token_ids, positions, slots, block_tables, context_lens, state_slots
    ) -> torch.Tensor:
        """Lay out a step's inputs on the host as `decode_inputs` reads them for graph (b, w), then copy them in with
        one copy, queued behind the GPU's work (chapter 05); returns the host's copy. Rows past the n given are
        padding: one token at position 0, written to the scratch slot, attending to itself (and updating the scratch
        state slot)."""
        n = len(token_ids)
        host = self.staging.take(decode_inputs_bytes(b, w))
        ids, pos, slot, state, lens, tables = (t.numpy() for t in decode_inputs(host, b, w))
        ids[:n], pos[:n], slot[:n], lens[:n] = token_ids, positions, slots, context_lens
        ids[n:], pos[n:], slot[n:], lens[n:] = 0, 0, self.scratch_slot, 1
        if self.states is not None:
            state[:n], state[n:] = state_slots, self.states.num_slots - 1
        tables[n:, 0] = self.scratch_slot // self.cache.block_size
        fill_tables(tables, block_tables)
        self.staging.copy(self.inputs[: host.numel()], host)
        return host

    @torch.no_grad()
    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        fill_ids: Callable[[torch.Tensor], None] | None = None,
        verify: bool = False,
        state_slots: Sequence[int] = (),
    ) -> torch.Tensor:
        """Logits [n, vocab] for n rows: one per decoding sequence, or with `verify`, a sequence's rows at
        consecutive positions (its last token and its drafts). `fill_ids(ids)` may then write, on the device, input
        tokens the host does not know yet (the engine's overlapped steps, chapter 08). `state_slots`: each row's
        sequence's slot of the state pool (a model with recurrent layers)."""
        n = len(token_ids)
        if not 1 <= n <= self.row_limit(verify):
            kind = "verify" if verify else "decode"
            raise ValueError(
                f"a {kind} step of this runner takes 1 to {self.row_limit(verify)} rows, got {n}"
            )
        b = self.bucket_for(n, verify)
        w = next(x for x in self.widths if x >= max(map(len, block_tables)))
        self._write_inputs(
            b, w, token_ids, positions, slots, block_tables, context_lens, state_slots
        )
        if fill_ids is not None:
            fill_ids(decode_inputs(self.inputs, b, w)[0][:n])
        if self.use_graphs:
            if not self.graphs:
                raise RuntimeError("this decode runner's CUDA graphs were released")
            self._replay((b, w, verify))
            return self.logits[b, w, verify][:n]
        return self._forward(b, w, verify)[:n]


# %% [markdown]
# ## Same logits as the paged reference
#
# Three sequences of different lengths, prefilled through the paged reference, then one
# decode step through the static runner (padded to the bucket of 4) and through the
# reference: the logits agree, and the scratch block took the padding's writes.

# %%
config = preset("qwen3-tiny")
model = init_random_weights(empty_model(config), seed=0, std=0.1)
block_size, num_blocks = 4, 32
cache = PagedKVCache(config, num_blocks + 1, block_size)  # the last block is the scratch block
prompts = [[5, 6, 7, 8, 9], list(range(20, 31)), [3, 3]]
tables = [[0, 1], [2, 3, 4], [5]]
with torch.no_grad():
    seqs = [(t, 0, len(p)) for t, p in zip(tables, prompts)]
    layout = build_step_layout(seqs, block_size)
    model(torch.tensor(sum(prompts, [])), layout.positions, PagedAttention(cache, layout))
next_tokens = [11, 12, 13]
positions = [len(p) for p in prompts]
slots = [t[pos // block_size] * block_size + pos % block_size for t, pos in zip(tables, positions)]
runner = DecodeRunner(
    model, cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks, use_graphs=False
)
before = cache.k_cache.clone()
static_logits = runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions])
written = (cache.k_cache != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
assert written == sorted({s // block_size for s in slots} | {num_blocks}), (
    written
)  # the 3 real slots + scratch
with torch.no_grad():
    cache.k_cache.copy_(before)  # undo, then the reference step
    layout = build_step_layout([(t, pos, 1) for t, pos in zip(tables, positions)], block_size)
    reference = model.compute_logits(
        model(torch.tensor(next_tokens), layout.positions, PagedAttention(cache, layout))
    )
# fp32: the static step's attention sums in another order (~1e-7 relative) through 2 layers: measured 2e-6 on logits
# of O(4), so 1e-5; the same below
torch.testing.assert_close(static_logits, reference, rtol=1e-5, atol=1e-5)
assert (
    runner.greedy_tokens(static_logits) is None
)  # (no graph recorded an argmax: the sampler takes its own)

# %% [markdown]
# With chapter 09_kernels_paged_attention's decode kernel (here interpreted), which is handed the
# new K/V and stores them itself, inside the attention kernel (one launch fewer a layer; its
# PyTorch path stores them by `write_kv` first). The model's layers are chapter 09a's fused ones,
# as on a GPU: they hand the kernel q and k unrotated, to normalise and rotate itself. Both paths
# give the reference's logits and write the same slots.

# %%
import copy
from forge_engine.fused_layers import install_fused_layers
from forge_engine.kernels.prefill_attention import KernelDecodeAttention

fused_model = install_fused_layers(
    copy.deepcopy(model), force=True
)  # (forced: on a CPU, their PyTorch paths)
for impl in ("torch", "triton"):
    cache.k_cache.copy_(before)
    kernel_runner = DecodeRunner(
        fused_model,
        cache,
        max_num_seqs=8,
        max_model_len=64,
        scratch_block=num_blocks,
        attention=KernelDecodeAttention(impl=impl),
        use_graphs=False,
    )
    logits = kernel_runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions])
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert (cache.k_cache != before).any(
        dim=(0, 2, 3, 4)
    ).nonzero().flatten().tolist() == written, impl

# %% [markdown]
# ## Verify steps: rows of one sequence
#
# A verify step (chapter 08c) feeds a sequence's last token and its k drafts as k + 1 rows at
# consecutive positions: row j attends to the drafts before it, so it reads K/V that other rows
# of the same step write. The fused kernel above stores each row's K/V inside the launch that
# attends, so a row could read a slot before its writer stored it. A runner given `verify_rows`
# therefore records graphs of its own for such steps (`run(..., verify=True)`), whose attention
# is told so (`verify`): chapter 09's verify kernel then gives a sequence's rows one program,
# which takes the step's K/V from the step's inputs, not the pool, and stores them
# (`attends_step_rows`); an
# attention that cannot has every row's K/V stored through the slots first, the layers rotating
# q and k themselves. Storing first costs two launches a layer: measured on an H200
# (`PYTHONPATH=. python3 kernels_lab/verify_step.py`, random Qwen3-4B in BF16, one sequence of
# 512 tokens), a verify graph of 1 row so took 2.62 ms against the decode graph's 2.51; chapter
# 08c gives what more rows cost.
#
# Below: sequence 0's last token and two drafts, beside sequence 2's decode row, through the
# interpreted kernel, against the paged reference that runs sequence 0's three tokens as a chunk.

# %%
verify_tokens, verify_rows = [11, 21, 22, 13], [(0, 5), (0, 6), (0, 7), (2, 2)]
verify_args = (
    verify_tokens,
    [p for _, p in verify_rows],
    [tables[s][p // block_size] * block_size + p % block_size for s, p in verify_rows],
    [tables[s] for s, _ in verify_rows],
    [p + 1 for _, p in verify_rows],
)
with torch.no_grad():
    cache.k_cache.copy_(before)
    layout = build_step_layout([(tables[0], 5, 3), (tables[2], 2, 1)], block_size)
    verify_reference = model.compute_logits(
        model(torch.tensor(verify_tokens), layout.positions, PagedAttention(cache, layout))
    )
cache.k_cache.copy_(before)
verifier = DecodeRunner(
    fused_model,
    cache,
    max_num_seqs=2,
    max_model_len=64,
    scratch_block=num_blocks,
    attention=KernelDecodeAttention(impl="triton"),
    use_graphs=False,
    verify_rows=4,
)
assert (verifier.row_limit(False), verifier.row_limit(True)) == (2, 4)
torch.testing.assert_close(
    verifier.run(*verify_args, verify=True), verify_reference, rtol=1e-5, atol=1e-5
)
with pytest.raises(ValueError, match="decode step of this runner takes 1 to 2 rows, got 4"):
    verifier.run(*verify_args)

# %% [markdown]
# On a GPU the same runner records graphs (the cell below runs only with the `gpu` flag):

# %%
#| gpu
gpu_model = install_fused_layers(
    init_random_weights(empty_model(config, "cuda", torch.bfloat16), seed=0, std=0.1)
)
gpu_cache = PagedKVCache(config, num_blocks + 1, block_size, "cuda", torch.bfloat16)
gpu_cache.k_cache.copy_(cache.k_cache)
gpu_cache.v_cache.copy_(cache.v_cache)
graphed = DecodeRunner(
    gpu_model, gpu_cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks
)
eager = DecodeRunner(
    gpu_model,
    gpu_cache,
    max_num_seqs=8,
    max_model_len=64,
    scratch_block=num_blocks,
    use_graphs=False,
)
args = (next_tokens, positions, slots, tables, [p + 1 for p in positions])
# bf16: recorded, the step may fold each norm into the GEMVs (a rounding fewer): logits of O(4) a few 2^-8 apart
torch.testing.assert_close(graphed.run(*args).clone(), eager.run(*args), rtol=2e-2, atol=2e-2)
# a verify step through the Triton kernel, recorded and eager: sequence 0's three rows as above
graphed_verify, eager_verify = (
    DecodeRunner(
        gpu_model,
        gpu_cache,
        max_num_seqs=2,
        max_model_len=64,
        scratch_block=num_blocks,
        attention=KernelDecodeAttention(),
        use_graphs=use_graphs,
        verify_rows=4,
    )
    for use_graphs in (True, False)
)
torch.testing.assert_close(
    graphed_verify.run(*verify_args, verify=True).clone(),
    eager_verify.run(*verify_args, verify=True),
    rtol=2e-2,
    atol=2e-2,
)


# %% [markdown]
# ## A model split with the CPU
#
# A model whose last layers run on the CPU (chapter 10h) cannot be one graph: its CPU layers are
# the host's work. Its decode step is two graphs per bucket with those layers between them. The
# first records the embedding and the GPU's layers and leaves the residual stream (and the rotary
# tables) in its outputs; the host copies them to the CPU and runs the CPU's layers eagerly over
# their own pool, reading the step's slots, block tables and lengths from the host's copy of the
# inputs; their output goes into the second graph's inputs, which records the final norm, the
# head and the greedy argmax. So the GPU's part of a step is two launches, as a whole model's is
# one.

# %%
#| export
class SplitDecodeRunner(DecodeRunner):
    """`DecodeRunner` for an `OffloadedTransformer` (chapter 10h): per (batch bucket, table width), the embedding and
    the GPU's layers as one graph, the CPU's layers eagerly over their pool `offload`, the final norm and the head as
    a second graph. Decode steps only: no verify rows, no recurrent state."""

    def __init__(
        self,
        model: OffloadedTransformer,
        cache: PagedKVCache,
        offload: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        scratch_block: int,
        attention: DecodeAttentionFn = paged_decode_attention_torch,
        use_graphs: bool | None = None,
    ):
        self.offload, self.cpu_attention = offload, decode_attention_for(offload.k_cache.device)
        self.fronts: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        # per graph key: what the first graph leaves (x, residual, cos, sin), what the second reads (x, residual)
        self.crossing: dict[tuple[int, int, bool], tuple[torch.Tensor, ...]] = {}
        self.returning: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.host_inputs: tuple[torch.Tensor, ...] = ()  # the step's inputs as the host wrote them
        super().__init__(
            model, cache, max_num_seqs, max_model_len, scratch_block, attention, use_graphs
        )

    def _write_inputs(self, b: int, w: int, *rows) -> torch.Tensor:
        host = super()._write_inputs(b, w, *rows)
        self.host_inputs = decode_inputs(host, b, w)
        return host

    @torch.no_grad()
    def _front(self, b: int, w: int) -> tuple[torch.Tensor, ...]:
        "The embedding and the GPU's layers: (x, residual, cos, sin) where the residual stream leaves the GPU."
        ids, positions, slots, _, lens, tables = decode_inputs(self.inputs, b, w)
        attention = StaticDecodeAttention(self.cache, slots, tables, lens, self.attention)
        x, cos, sin = self.model.embed_tokens(ids, positions)
        return (*self.model.run_gpu_layers(x, cos, sin, attention), cos, sin)

    @torch.no_grad()
    def _cpu_layers(self, *crossing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        "The CPU's layers over their pool, the step's layout read from the host's copy of the inputs."
        _, _, slots, _, lens, tables = self.host_inputs
        there = StaticDecodeAttention(self.offload, slots, tables, lens, self.cpu_attention)
        attention = SplitAttention(
            None, there, self.model.gpu_layers
        )  # (layers numbered from the pool's first)
        where = self.offload.k_cache.device
        return self.model.run_cpu_layers(*(t.to(where) for t in crossing), attention)

    @torch.no_grad()
    def _back(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model.final_norm(x, residual))

    @torch.no_grad()
    def _forward(self, b: int, w: int, verify: bool = False) -> torch.Tensor:
        x, residual = self._cpu_layers(*self._front(b, w))
        return self._back(x.to(self.device), residual.to(self.device))

    def _record(self, key: tuple[int, int, bool], pool) -> tuple:
        front, back = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(front, pool=pool):
            self.crossing[key] = self._front(*key[:2])
        self.returning[key] = x, residual = tuple(map(torch.empty_like, self.crossing[key][:2]))
        with torch.cuda.graph(back, pool=front.pool()):
            self._record_logits(key, self._back(x, residual))
        self.fronts[key], self.graphs[key] = front, back
        return back.pool()

    def _replay(self, key: tuple[int, int, bool]) -> None:
        self.fronts[key].replay()
        for into, out in zip(self.returning[key], self._cpu_layers(*self.crossing[key])):
            into.copy_(out)
        self.graphs[key].replay()

    def release_graphs(self) -> None:
        super().release_graphs()
        self.fronts, self.crossing, self.returning = {}, {}, {}


# %% [markdown]
# Both devices are the CPU in this test, which checks the bookkeeping: the tiny model split after
# its first layer, its second layer over a pool of its own, gives the logits of the model whole
# through the plain runner, and each pool took its layers' K/V.

# %%
from forge_engine.offload import offload_pool, place_layers

split_model = place_layers(copy.deepcopy(model), 1, "cpu")
cpu_pool = offload_pool(split_model, num_blocks + 1, block_size, torch.float32)
split_cache = PagedKVCache(
    config.replace(num_layers=1), num_blocks + 1, block_size
)  # the "GPU's" pool: layer 0
with torch.no_grad():
    cache.k_cache.copy_(before)
    split_cache.k_cache.copy_(cache.k_cache[:1]), split_cache.v_cache.copy_(cache.v_cache[:1])
    cpu_pool.k_cache.copy_(cache.k_cache[1:]), cpu_pool.v_cache.copy_(cache.v_cache[1:])
split_runner = SplitDecodeRunner(
    split_model,
    split_cache,
    cpu_pool,
    max_num_seqs=8,
    max_model_len=64,
    scratch_block=num_blocks,
    use_graphs=False,
)
whole_logits = runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions])
torch.testing.assert_close(
    split_runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions]),
    whole_logits,
    rtol=1e-5,
    atol=1e-5,
)
torch.testing.assert_close(split_cache.k_cache, cache.k_cache[:1])
torch.testing.assert_close(cpu_pool.v_cache, cache.v_cache[1:])

# %% [markdown]
# ## Mixed steps: prefill chunks beside decodes
#
# Under a server, a new request's prompt joins a batch of running decodes: that step has a
# prefill chunk and 16 decodes, say, 96 tokens, and so far ran eager. Measured on an H200
# (random Qwen3-4B, `kernels_lab` has none of this: the engine-only probe of the serving
# benchmark), the eager step took 24-28 ms for 6 ms of GPU work, while a decode step of the 16
# takes 3.2 ms in its graph: every running stream waits that long for its next token whenever a
# request arrives, which is the online p99 inter-token latency.
#
# A mixed step can be recorded too, once its shapes are fixed: the step's tokens padded to a
# bucket of T (64, 128, 256, 512), its sequences to S = min(max_num_seqs, T) (a sequence has at
# least one token), the block tables to the width of `MIXED_CONTEXT` tokens, and the prefill
# kernel's tiles to a padded tile map (chapter 09_kernels_prefill_attention): T / BLOCK_M tiles
# plus one partial tile a sequence. Padded tokens write their K/V to the scratch slot and belong
# to no sequence, so no tile reads them and their rows are dropped; padded sequences have no
# tiles. Larger steps (long prompts' chunks of up to the token budget) still run eager: they do
# enough work per launch.

# %%
#| export
MIXED_TOKENS = (64, 128, 256, 512)  # token counts of the mixed-step graphs; larger steps run eager
MIXED_CONTEXT = 8192  # tokens of context a mixed-step graph's block tables hold; longer: eager


def mixed_buckets(max_num_batched_tokens: int) -> list[int]:
    "Token counts that get a mixed-step graph: `MIXED_TOKENS` under the step's token budget, then the budget."
    budget = min(max_num_batched_tokens, MIXED_TOKENS[-1])
    return [t for t in MIXED_TOKENS if t < budget] + [budget]


def mixed_inputs_bytes(t: int, s: int, tiles: int, w: int) -> int:
    "Bytes of a mixed step's inputs for t tokens, s sequences, a tile map of `tiles` and tables w wide."
    return 8 * (3 * t + 3 * s + 1 + s * w) + 4 * 2 * tiles


def mixed_inputs(
    buffer: torch.Tensor, t: int, s: int, tiles: int, w: int
) -> tuple[torch.Tensor, ...]:
    """Views of a uint8 `buffer` as (ids, positions, slots [t], logit rows [s], query starts [s+1], context lengths
    [s], block tables [s, w], all int64, then the tile map [2, tiles] int32), back to back from its start. (The
    dtypes are the eager step's, chapter 05's layout: the prefill kernel then compiles once for both paths.)"""
    n = 3 * t + 3 * s + 1 + s * w
    longs, ints = (
        buffer[: 8 * n].view(torch.int64),
        buffer[8 * n : mixed_inputs_bytes(t, s, tiles, w)],
    )
    ends = itertools.accumulate((t, t, t, s, s + 1, s, s * w))
    ids, positions, slots, rows, starts, lens, tables = (
        longs[end - size : end] for end, size in zip(ends, (t, t, t, s, s + 1, s, s * w))
    )
    return (
        ids,
        positions,
        slots,
        rows,
        starts,
        lens,
        ints.view(torch.int32).view(2, tiles),
        tables.view(s, w),
    )


class StaticPrefillAttention:
    "Attention over a mixed step's static buffers: K/V written through the slots, then the prefill kernel."

    rope_inside = (
        False  # (the fused layers rotate q and k themselves for a step with prefill tokens)
    )

    def __init__(self, cache: PagedKVCache, slots, starts, lens, tile_map, tables, impl="auto"):
        self.cache, self.slots, self.starts, self.lens = cache, slots, starts, lens
        self.tile_map, self.tables, self.impl = tile_map, tables, impl
        self.scale = cache.config.head_dim**-0.5

    def __call__(self, layer: int, q, k, v, rope=None) -> torch.Tensor:
        from forge_engine.kernels.prefill_attention import paged_prefill_attention

        self.cache.write(layer, self.slots, k, v)
        k_layer, v_layer = self.cache.k_cache[layer], self.cache.v_cache[layer]
        return paged_prefill_attention(
            q, k_layer, v_layer, self.tables, self.starts, self.lens, q.shape[0], self.scale,
            self.impl, tiles=self.tile_map,
        )  # fmt: skip


class MixedStepRunner:
    """Steps with prefill tokens, of up to `MIXED_TOKENS[-1]` tokens, over static buffers, replayed from one CUDA
    graph per token bucket (on a CPU, `use_graphs=False`: the same forward, run eagerly)."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        scratch_block: int,
        impl: str = "auto",
        use_graphs: bool | None = None,
    ):
        from forge_engine.kernels.prefill_attention import prefill_block_m

        self.model, self.cache, self.impl = model, cache, impl
        self.device = next(model.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = mixed_buckets(max_num_batched_tokens)
        self.max_num_seqs, self.scratch_slot = max_num_seqs, scratch_block * cache.block_size
        self.width = -(-min(max_model_len, MIXED_CONTEXT) // cache.block_size)
        self.block_m = prefill_block_m(model.config.num_heads, model.config.num_kv_heads)
        self.inputs = torch.zeros(
            max(mixed_inputs_bytes(*self.shape(t)) for t in self.buckets),
            dtype=torch.uint8,
            device=self.device,
        )
        self.staging = HostStaging(self.inputs.numel(), self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if self.use_graphs:
            self.capture()

    def shape(self, t: int) -> tuple[int, int, int, int]:
        "(tokens, sequences, tiles, table width) of bucket t."
        s = min(self.max_num_seqs, t)
        return t, s, -(-t // self.block_m) + s, self.width

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        "Whether a step of these sizes has a bucket (else it runs eager)."
        return (
            num_tokens <= self.buckets[-1]
            and num_seqs <= self.max_num_seqs
            and max_blocks <= self.width
        )

    @torch.no_grad()
    def _forward(self, t: int) -> torch.Tensor:
        ids, positions, slots, rows, starts, lens, tile_map, tables = mixed_inputs(
            self.inputs, *self.shape(t)
        )
        attention = StaticPrefillAttention(
            self.cache, slots, starts, lens, tile_map, tables, self.impl
        )
        return self.model.compute_logits(self.model(ids, positions, attention)[rows])

    def capture(self) -> None:
        "Record one graph per token bucket, largest first, sharing one memory pool."
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (compilation, lazy init) outside the recording
            self._write_inputs(self.buckets[-1], [])
            self._forward(self.buckets[-1])
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for t in reversed(self.buckets):
            self._write_inputs(t, [])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[t] = self._forward(t)
            pool = graph.pool()
            self.graphs[t] = graph
        torch.cuda.synchronize(self.device)

    def release_graphs(self) -> None:
        "Destroy the graphs now; `run` refuses from then on."
        self.graphs, self.logits = {}, {}

    def _write_inputs(self, t: int, seqs, rows: Sequence[int] = ()) -> None:
        """Lay out a step's inputs on the host for bucket t and copy them in with one copy. `seqs`: per sequence
        (block table, tokens computed, its new token ids). Padding: tokens at position 0 written to the scratch slot,
        sequences with no tokens, tiles of sequence -1, logit rows 0."""
        from forge_engine.kernels.prefill_attention import prefill_tiles

        shape = self.shape(t)
        host = self.staging.take(mixed_inputs_bytes(*shape))
        ids, pos, slot, row, starts, lens, tile_map, tables = (
            x.numpy() for x in mixed_inputs(host, *shape)
        )
        # whole arrays at once, not a loop over sequences: at 64 sequences that is the step's host time
        b, size = len(seqs), self.cache.block_size
        counts = np.fromiter((len(s[2]) for s in seqs), dtype=np.int64, count=b)
        computed = np.fromiter((s[1] for s in seqs), dtype=np.int64, count=b)
        n, seq_of = int(counts.sum()), np.repeat(np.arange(b), counts)
        firsts = np.cumsum(counts) - counts
        ids[:n] = np.fromiter(itertools.chain.from_iterable(s[2] for s in seqs), np.int64, n)
        pos[:n] = p = computed[seq_of] + np.arange(n) - firsts[seq_of]
        fill_tables(tables, [s[0] for s in seqs])
        slot[:n], slot[n:] = tables[seq_of, p // size] * size + p % size, self.scratch_slot
        starts[:b], starts[b:], lens[:b] = firsts, n, computed + counts
        row[: len(rows)] = rows
        tile_map[:] = prefill_tiles(counts.tolist(), self.block_m, shape[2]).numpy()
        self.staging.copy(self.inputs[: host.numel()], host)

    @torch.no_grad()
    def run(
        self,
        seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        rows: Sequence[int],
        fill_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [len(rows), vocab] of the step's tokens at `rows` (flattened in `seqs` order). `seqs`: per sequence
        (block table, tokens computed, new token ids). `fill_ids(ids)` may then write input tokens on the device."""
        t = next(b for b in self.buckets if b >= sum(len(s[2]) for s in seqs))
        self._write_inputs(t, seqs, rows)
        if fill_ids is not None:
            fill_ids(mixed_inputs(self.inputs, *self.shape(t))[0])
        if self.use_graphs:
            if not self.graphs:
                raise RuntimeError("this mixed-step runner's CUDA graphs were released")
            self.graphs[t].replay()
            return self.logits[t][: len(rows)]
        return self._forward(t)[: len(rows)]


# %% [markdown]
# A mixed step through the static buffers, interpreted: a new prompt of 6 tokens, a chunk of 3
# after the first sequence's cached 5, and a decode, in the bucket of 64 tokens; the logits of
# each sequence's last token are the paged reference's, and only their slots and the scratch
# block were written.

# %%
k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
step = [([6, 7], 0, [1, 2, 3, 4, 5, 6]), ([0, 1, 8], 5, [21, 22, 23]), ([5], 2, [9])]
last_rows = [5, 8, 9]  # each sequence's last token in the flattened step
with torch.no_grad():
    want_layout = build_step_layout([(t, c, len(i)) for t, c, i in step], block_size)
    want_ids = torch.tensor([i for _, _, ids in step for i in ids])
    want = model.compute_logits(
        model(want_ids, want_layout.positions, PagedAttention(cache, want_layout))[last_rows]
    )
    cache.k_cache.copy_(k_before), cache.v_cache.copy_(v_before)
mixed = MixedStepRunner(
    model, cache, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
    scratch_block=num_blocks, impl="triton", use_graphs=False,
)  # fmt: skip
assert mixed.buckets == [64] and mixed.shape(64) == (64, 8, 64 // mixed.block_m + 8, 16)
got = mixed.run(step, last_rows)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
written = (cache.k_cache != k_before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
assert written == [1, 5, 6, 7, num_blocks], written  # the step's slots and the scratch block
assert mixed.fits(64, 8, 16) and not mixed.fits(65, 1, 1) and not mixed.fits(8, 9, 1)
