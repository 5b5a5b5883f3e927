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
# Prefill steps (many tokens of one sequence) stay eager: their shapes vary and each step does
# enough work per launch.
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

from forge_engine.kv_cache import PagedKVCache, copy_to_device, paged_decode_attention_torch
from forge_engine.model import Transformer

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.kv_cache import PagedAttention, build_step_layout
from forge_engine.model import empty_model, init_random_weights

# %%
#| export
DecodeAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    "The fastest graph-safe decode attention for `device`: the Triton kernel on a CUDA GPU when Triton works."
    if torch.device(device).type == "cuda":
        from forge_engine.kernels import KernelDecodeAttention, kernels_available
        if kernels_available(device):
            return KernelDecodeAttention()
    return paged_decode_attention_torch


class StaticDecodeAttention:
    """Attention backend over static buffers: write K/V through the slots, attend through the block tables. An
    attention that `stores_kv` (chapter 09's kernel) gets the new K/V and their slots and stores them itself."""
    def __init__(self, cache: PagedKVCache, slots, block_tables, context_lens, attention: DecodeAttentionFn):
        self.cache, self.slots, self.tables, self.lens, self.attention = cache, slots, block_tables, context_lens, attention

    @property
    def rope_inside(self) -> bool:  # the model then hands over q and k unrotated, with `rope` (chapter 09)
        return getattr(self.attention, "rope_inside", False)

    def __call__(self, layer: int, q, k, v, rope=None) -> torch.Tensor:
        k_layer, v_layer = self.cache.k_cache[layer], self.cache.v_cache[layer]
        if getattr(self.attention, "stores_kv", False):
            return self.attention(q, k_layer, v_layer, self.tables, self.lens, new_kv=(k, v, self.slots), rope=rope)
        self.cache.write(layer, self.slots, k, v)
        return self.attention(q, k_layer, v_layer, self.tables, self.lens)


# %%
assert decode_buckets(1) == [1] and decode_buckets(20) == [1, 2, 4, 8, 16, 20]
assert context_buckets(262144, 16) == [32, 128, 512, 2048, 16384] and context_buckets(64, 4) == [16]
assert decode_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40] and decode_buckets(256)[-2:] == [224, 256]


# %% [markdown]
# ## The runner
#
# Static buffers sized for the largest bucket and the longest context; per step only the used
# part of the block tables is copied in (the kernel never reads past a sequence's length).

# %%
#| export
class DecodeRunner:
    "Decode steps (one new token per sequence) over static buffers, replayed from CUDA graphs per bucket."
    def __init__(self, model: Transformer, cache: PagedKVCache, max_num_seqs: int, max_model_len: int,
                 scratch_block: int, attention: DecodeAttentionFn = paged_decode_attention_torch,
                 use_graphs: bool | None = None):
        self.model, self.cache, self.attention = model, cache, attention
        self.device = next(model.parameters()).device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets, self.widths = decode_buckets(max_num_seqs), context_buckets(max_model_len, cache.block_size)
        b, width = self.buckets[-1], self.widths[-1]
        make = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=self.device)
        self.ids, self.positions, self.slots = make(b), make(b), make(b)
        self.tables, self.lens = make(b, width, dtype=torch.int32), make(b, dtype=torch.int32)
        self.scratch_slot = scratch_block * cache.block_size
        self.tables.fill_(scratch_block)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch bucket, table width) -> graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        if self.use_graphs: self.capture()

    @torch.no_grad()
    def _forward(self, b: int, w: int) -> torch.Tensor:
        attention = StaticDecodeAttention(self.cache, self.slots[:b], self.tables[:b, :w], self.lens[:b], self.attention)
        return self.model.compute_logits(self.model(self.ids[:b], self.positions[:b], attention))

    def capture(self) -> None:
        "Record one graph per (batch bucket, table width), largest first, sharing one memory pool."
        self.lens.fill_(1)
        self.slots.fill_(self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (autotuning, lazy init) outside the recording
            for w in self.widths: self._forward(self.buckets[-1], w)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for b in reversed(self.buckets):
            for w in reversed(self.widths):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b, w] = self._forward(b, w)
                pool = graph.pool()
                self.graphs[b, w] = graph
        torch.cuda.synchronize(self.device)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def release_graphs(self) -> None:
        """Destroy the graphs now (their memory pool goes back to PyTorch's cache); `run` refuses from then on.
        Graphs that recorded NCCL collectives must go before their communicator can (chapter 09c)."""
        self.graphs, self.logits = {}, {}

    @torch.no_grad()
    def run(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
            fill_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [n, vocab] for n decoding sequences. `fill_ids(ids)` may then write, on the device, input tokens
        the host does not know yet (the engine's overlapped steps, chapter 08)."""
        n = len(token_ids)
        b = self.bucket_for(n)
        table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
        width = int(table_lens.max())
        w = next(x for x in self.widths if x >= width)
        # small host tensors, queued behind the GPU's work (chapter 05); cheaper than any bookkeeping to avoid them
        copy_to_device(self.ids[:n], torch.tensor(token_ids))
        if fill_ids is not None: fill_ids(self.ids[:n])
        copy_to_device(self.positions[:n], torch.tensor(positions))
        copy_to_device(self.slots[:n], torch.tensor(slots))
        copy_to_device(self.lens[:n], torch.tensor(context_lens, dtype=torch.int32))
        # the ragged tables as one padded array; numpy builds it ~7x faster than torch.tensor from lists
        rows = np.zeros((n, width), dtype=np.int32)
        rows[np.arange(width)[None, :] < table_lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(table_lens.sum()))
        copy_to_device(self.tables[:n, :width], torch.from_numpy(rows))
        if b > n:  # padding rows: one token at position 0 written to the scratch slot, attending to itself
            self.ids[n:b].zero_(); self.positions[n:b].zero_(); self.slots[n:b].fill_(self.scratch_slot)
            self.lens[n:b].fill_(1); self.tables[n:b, 0].fill_(self.scratch_slot // self.cache.block_size)
        if self.use_graphs:
            if not self.graphs: raise RuntimeError("this decode runner's CUDA graphs were released")
            self.graphs[b, w].replay()
            return self.logits[b, w][:n]
        return self._forward(b, w)[:n]


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
runner = DecodeRunner(model, cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks, use_graphs=False)
before = cache.k_cache.clone()
static_logits = runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions])
written = (cache.k_cache != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
assert written == sorted({s // block_size for s in slots} | {num_blocks}), written  # the 3 real slots + scratch
with torch.no_grad():
    cache.k_cache.copy_(before)  # undo, then the reference step
    layout = build_step_layout([(t, pos, 1) for t, pos in zip(tables, positions)], block_size)
    reference = model.compute_logits(model(torch.tensor(next_tokens), layout.positions, PagedAttention(cache, layout)))
torch.testing.assert_close(static_logits, reference, rtol=1e-5, atol=1e-5)

# %% [markdown]
# With chapter 09's decode kernel (here interpreted), which is handed the new K/V and stores
# them itself: by `write_kv` first, or with `FUSED_KV_STORE` inside the attention kernel (one
# launch fewer a layer). Both give the reference's logits and write the same slots.

# %%
import forge_engine.kernels as kernels
from forge_engine.kernels import KernelDecodeAttention

for fused in (False, True):
    kernels.FUSED_KV_STORE = fused
    cache.k_cache.copy_(before)
    kernel_runner = DecodeRunner(model, cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks,
                                 attention=KernelDecodeAttention(impl="triton"), use_graphs=False)
    logits = kernel_runner.run(next_tokens, positions, slots, tables, [p + 1 for p in positions])
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert (cache.k_cache != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist() == written, fused
kernels.FUSED_KV_STORE = True  # (the default)

# %% [markdown]
# On a GPU the same runner records graphs (the cell below runs only with the `gpu` flag):

# %%
#| gpu
gpu_model = init_random_weights(empty_model(config, "cuda", torch.bfloat16), seed=0, std=0.1)
gpu_cache = PagedKVCache(config, num_blocks + 1, block_size, "cuda", torch.bfloat16)
gpu_cache.k_cache.copy_(cache.k_cache); gpu_cache.v_cache.copy_(cache.v_cache)
graphed = DecodeRunner(gpu_model, gpu_cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks)
eager = DecodeRunner(gpu_model, gpu_cache, max_num_seqs=8, max_model_len=64, scratch_block=num_blocks, use_graphs=False)
args = (next_tokens, positions, slots, tables, [p + 1 for p in positions])
torch.testing.assert_close(graphed.run(*args).clone(), eager.run(*args), rtol=2e-2, atol=2e-2)
