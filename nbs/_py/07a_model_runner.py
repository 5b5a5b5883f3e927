# %% [markdown]
# # The model runner
#
# > One scheduled step through the model: the KV pool sized from memory, the step's tokens flattened over the paged cache, the logits of the rows that sample.

# %% [markdown]
# The scheduler (chapter 07) decides *who* runs in a step and how many tokens each brings; the
# model runner makes it happen. It owns the model and the paged KV cache (chapter 05) and does
# one thing per step: `run(plan)` takes the scheduler's `StepPlan`, lays the new tokens of every
# scheduled sequence back to back, runs the model once over them (writing their K and V through
# the slot mapping, reading earlier ones through the block tables), and returns the logits of
# the sequences that are due a token. It does not sample, apply stop rules or know about
# requests: that is the engine's step (chapter 08), which calls the runner once per step.
#
# Three things sit around that one call:
#
# - **how big the KV pool is**: measured after the weights are loaded, from the activation
#   peak of the largest step (`kv_cache_budget`);
# - **which path runs the step**: the reference paged attention, the Triton kernels of chapter
#   09 on a GPU, CUDA graphs for decode steps and for steps of up to 512 tokens with prefill
#   chunks (chapter 09b), or a batch-invariant path that gives a request the same logits
#   whatever else is in its batch;
# - **tokens still on the device**: an input the host has not read back yet (`PENDING`), copied
#   into place on the GPU.
#
# A model with recurrent layers (chapter 03b's Qwen3.5) also gets chapter 05a's state pool, a
# slot per running sequence, and a step hands the model its `StepStates` next to the attention
# backend. Its decode steps replay chapter 09b's graphs on a GPU; its steps with prefill tokens
# run eager (no mixed-step graphs for it yet); no C decode step, no drafts.
#
# `build_runner` puts them together; the engine, and every rank of a tensor-parallel model
# (chapter 09c), build their runner with it.

# %%
#| default_exp runner

# %%
#| export
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from forge_engine.config import EngineConfig
from forge_engine.cuda_graphs import (
    VERIFY_MAX_ROWS,
    DecodeRunner,
    MixedStepRunner,
    SplitDecodeRunner,
    decode_attention_for,
    mixed_buckets,
)
from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout, to_device
from forge_engine.model import Transformer, no_cache_attention
from forge_engine.offload import (
    OffloadedTransformer,
    SplitAttention,
    StreamedTransformer,
    gpu_part,
    offload_pool,
)
from forge_engine.scheduler import ScheduledSeq, Sequence as Seq, StepPlan
from forge_engine.qwen3_5 import Qwen35Model
from forge_engine.state_pool import StatePool, StepStates

# %%
#| hide
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import BlockAllocator
from forge_engine.model import empty_model, init_random_weights
from forge_engine.scheduler import Scheduler

# %% [markdown]
# ## How much memory the KV cache gets
#
# On a GPU: what is left of `gpu_memory_utilization x total` once the weights are loaded and
# the activations of the largest step (`max_num_batched_tokens` tokens) have peaked. On a
# CPU there is no such fence, so the budget is explicit (`kv_cache_bytes`, default 512 MiB).

# %%
#| export
CPU_DEFAULT_KV_BYTES = 512 * 2**20


def budgeted_kv_bytes(model: Transformer, config: EngineConfig, peak: int, total: int) -> int:
    """The KV pool under `gpu_memory_budget`: what the measured peak, the graphs' pool and the
    overhead leave."""
    from forge_engine.memory_plan import (
        MIN_KV_BYTES,
        OVERHEAD_BYTES,
        MemoryPlanError,
        activation_bytes,
        format_gib,
    )

    budget, param = config.gpu_memory_budget, next(model.parameters())
    if budget > total:
        raise MemoryPlanError(
            f"gpu_memory_budget {format_gib(budget)} is more than the GPU's {format_gib(total)}"
        )
    torch.cuda.set_per_process_memory_fraction(
        budget / total, param.device
    )  # past the budget, allocations fail
    graphs, c = 0, model.config
    # the decode graphs' pool, the mixed-step graphs' and their logits (a streamed model has none; a model split with
    # the CPU, decode graphs only)
    if config.cuda_graphs is not False and not isinstance(model, StreamedTransformer):
        graphs = activation_bytes(c, config.max_num_seqs, config.max_num_seqs, param.element_size())
    if graphs and not isinstance(model, OffloadedTransformer):
        mixed = mixed_buckets(config.max_num_batched_tokens)
        rows = [min(config.max_num_seqs, t) for t in mixed]
        graphs += activation_bytes(c, mixed[-1], rows[-1], param.element_size())
        graphs += sum(rows) * c.vocab_size * 4
    # the cap counts what the allocator holds: what it cannot give back is not free either
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(param.device) - torch.cuda.memory_allocated(param.device)
    kv = budget - peak - held - graphs - OVERHEAD_BYTES
    if kv < MIN_KV_BYTES:
        raise MemoryPlanError(
            f"under the {format_gib(budget)} budget the KV cache would get {format_gib(kv)}: "
            "measured "
            f"peak of weights + activations {format_gib(peak)}, held in the allocator's fragments "
            f"{format_gib(held)}, CUDA graphs {format_gib(graphs)}, "
            f"overhead {format_gib(OVERHEAD_BYTES)} "
            f"(minimum {format_gib(MIN_KV_BYTES)})"
        )
    return kv


@torch.no_grad()
def kv_cache_budget(model: Transformer, config: EngineConfig) -> int:
    "Bytes for the KV pool on the model's device."
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    device = next(model.parameters()).device
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = config.max_num_batched_tokens  # the activation peak of the largest step
    # (a model split with the CPU, chapter 10h: its GPU part; the CPU's layers would take minutes on a whole batch)
    probe = gpu_part(model) if isinstance(model, OffloadedTransformer) else model
    probe.compute_logits(
        probe(
            torch.zeros(n, dtype=torch.long, device=device),
            torch.arange(n, device=device),
            no_cache_attention,
        )[-config.max_num_seqs :]
    )
    peak = torch.cuda.max_memory_allocated(device)
    _, total = torch.cuda.mem_get_info(device)
    if (
        config.gpu_memory_budget is not None
    ):  # a fixed budget (chapter 10a): the allocator is capped at it
        return budgeted_kv_bytes(model, config, peak, total)
    budget = int(total * config.gpu_memory_utilization) - peak
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {config.gpu_memory_utilization:.0%} of "
            f"{total / 2**30:.1f} GiB is less than the {peak / 2**30:.1f} GiB peak of "
            "weights + activations"
        )
    return budget


# %% [markdown]
# ## The model runner
#
# One flattened batch per step: the new tokens of every scheduled sequence back to back, their
# positions, and the paged attention backend that knows where each sequence's K/V lives.
# Only the last token of a sequence that is due a new token needs logits.
#
# **Batch invariance.** A CPU matmul does not compute row `i` of `X @ W` the same way for
# every number of rows: the kernel, and so the order of the additions, depends on the shape.
# So a request's logits can differ in the last bits depending on what else is in its batch,
# and once in a while a greedy choice flips. With `batch_invariant=True` the runner removes
# every shape that depends on the batch: it feeds the model tiles of exactly `ROW_TILE`
# tokens (the last one padded by repeating its last token, which rewrites the same K/V), and
# treats each token as its own query of length one, so attention for a token at position `p`
# is always one query against keys `0..p`. Every operation then sees the same shapes whatever
# the batch, and a request's greedy tokens are the same alone or batched. The price: each
# tile reads all the weights, so a long prefill is slower.

# %% [markdown]
# **Inputs the host has not seen yet.** On a GPU the engine (chapter 08) launches step N+1
# before it has read step N's sampled tokens back from the GPU. Those tokens are then
# `PENDING` on the host: a placeholder at the end of their sequence's `output_ids`. The runner
# builds the step's input ids as usual and then, on the device, copies each pending token from
# the previous step's output tensor into its place, so the host never waits for the GPU to
# build a step.

# %%
#| export
PENDING = -1  # an output token sampled on the device, not yet read back by the host


@dataclass
class PendingTokens:
    """A launched step's sampled tokens, on the device: inputs of the next step before the host has
    read them."""

    token_ids: torch.Tensor  # [rows] on the device
    row_of: dict[Seq, int]  # each sampling sequence's row

    def inputs_of(self, items) -> tuple[list[int], list[int]] | None:
        """(indices into `items`, rows of `token_ids`) of the scheduled sequences whose last token
        is pending. That token is an input only where the step reaches the sequence's end, which is
        where it samples."""
        which = [
            (k, self.row_of[i.seq])
            for k, i in enumerate(items)
            if i.samples and i.seq.last_token == PENDING
        ]
        return tuple(map(list, zip(*which))) if which else None

    def fill(self, ids: torch.Tensor, positions: list[int], rows: list[int]) -> None:
        """ids[positions] = the tokens of `rows`, copied on the device: the host does not wait for
        them."""
        n = len(rows)
        if (
            positions == rows == list(range(n))
        ):  # a decode step of the same sequences in the same order: one copy
            ids[:n].copy_(self.token_ids[:n])
        else:  # the index lists go to the device, then one gather and one scatter
            ids[to_device(torch.tensor(positions), ids.device)] = self.token_ids[
                to_device(torch.tensor(rows), ids.device)
            ]


# %%
#| export
ROW_TILE = 8


def _step_tokens(item: ScheduledSeq) -> list[int]:
    "The tokens a step feeds for a scheduled sequence: from its first uncomputed one, then its drafts (chapter 08c)."
    seq, start = item.seq, item.seq.num_computed
    tokens = seq.token_ids + seq.draft_ids if item.num_draft else seq.token_ids
    return tokens[start : start + item.num_new]


class ModelRunner:
    "Runs one scheduled step of the model over the paged KV cache."

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        batch_invariant: bool = False,
        decode: DecodeRunner | None = None,
        mixed: MixedStepRunner | None = None,
        states: StatePool | None = None,
        offload: PagedKVCache | None = None,
    ):
        self.model, self.cache, self.batch_invariant = model, cache, batch_invariant
        self.states = (
            states  # a model with recurrent layers: their per-sequence states (chapter 05a)
        )
        self.offload = (
            offload  # a model split with the CPU (chapter 10h): the pool of the CPU's layers
        )
        # decode: chapter 09b's CUDA graphs on a GPU, chapter 10f's C step on a CPU
        self.decode, self.mixed = decode, mixed
        self.device = next(model.parameters()).device
        self.attention = PagedAttention  # the reference; the Triton kernels of chapter 09 on a GPU
        if self.device.type == "cuda" and not batch_invariant:
            from forge_engine.kernels.backend import kernels_available
            from forge_engine.kernels.prefill_attention import KernelPagedAttention

            if kernels_available(self.device):
                self.attention = KernelPagedAttention

    @torch.no_grad()
    def run(self, plan: StepPlan, pending: PendingTokens | None = None) -> torch.Tensor:
        """Logits [number of sampling sequences, vocab] in plan order. `pending`: the previous
        step's tokens, still on the device; a sequence whose last token is `PENDING` reads it from
        there."""
        items = plan.scheduled
        unread = pending.inputs_of(items) if pending is not None else None
        drafts = any(
            i.num_draft for i in items
        )  # sequences with drafts (chapter 08c): logits for each
        if (
            self.decode is not None
            and all(i.num_new == 1 + i.num_draft and i.samples for i in items)
            and sum(i.num_new for i in items) <= self.decode.row_limit(drafts)
            # (with recurrent state: no one-token prompt, which starts from zeros, not from its slot)
            and (self.states is None or all(i.seq.num_computed for i in items))
        ):  # a pure decode step (a draft: one more row of its sequence): replay a CUDA graph
            return self._run_decode(items, pending, unread)
        if (
            self.mixed is not None
            and not drafts
            and self.mixed.fits(
                sum(i.num_new for i in items),
                len(items),
                max(len(i.seq.block_table) for i in items),
            )
        ):  # prefill chunks, maybe beside decodes: a graph of its token bucket
            return self._run_mixed(items, pending, unread)
        ids = [t for i in items for t in _step_tokens(i)]
        last_rows = torch.tensor([i.num_new for i in items]).cumsum(0) - 1
        due = [k for k, i in enumerate(items) if i.samples]
        if drafts:  # a sequence with drafts: the rows of its last token and of each draft
            logit_rows = [
                r for k in due for r in range(last_rows[k] - items[k].num_draft, last_rows[k] + 1)
            ]
        else:
            logit_rows = last_rows[due].tolist()
        ids = to_device(
            torch.tensor(ids, dtype=torch.long), self.device
        )  # without waiting for the GPU (chapter 05)
        if unread:
            pending.fill(
                ids, last_rows[unread[0]].tolist(), unread[1]
            )  # a pending token is its sequence's last
        if self.batch_invariant:
            return self._run_invariant(items, ids, logit_rows)
        specs = [(i.seq.block_table, i.seq.num_computed, i.num_new) for i in items]
        layout = build_step_layout(specs, self.cache.block_size, self.device)
        rows = to_device(torch.tensor(logit_rows, dtype=torch.long), self.device)
        backends = (self.attention(self.cache, layout),)
        if (
            self.offload is not None
        ):  # the CPU's layers over their pool, the same layout there (chapter 10h)
            there = build_step_layout(specs, self.cache.block_size, self.offload.k_cache.device)
            rest = PagedAttention(self.offload, there)
            backends = (SplitAttention(backends[0], rest, self.model.gpu_layers),)
        if self.states is not None:  # each sequence's rows read and write its state slot
            segments = [(i.num_new, i.seq.state_slot, i.seq.num_computed == 0) for i in items]
            backends += (StepStates(self.states, segments),)
        hidden = self.model(ids, layout.positions, *backends)
        return self.model.compute_logits(hidden[rows])

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `run`'s logits where a decode graph took it with them (chapter 09b),
        else None."""
        return None if self.decode is None else self.decode.greedy_tokens(logits)

    def check_step(self) -> None:
        """Raise if a finished step's device work cannot be trusted; alone, nothing fails behind the
        host's back (chapter 09c)."""

    def _run_decode(
        self, items, pending: PendingTokens | None, unread: tuple[list[int], list[int]] | None
    ):
        size = self.cache.block_size
        # a row per token: a sequence's last one, and each of its drafts at the positions after it
        rows = [(i, i.seq.num_computed + j) for i in items for j in range(i.num_new)]
        slots = [i.seq.block_table[p // size] * size + p % size for i, p in rows]
        fill = (
            (lambda ids: pending.fill(ids, *unread)) if unread else None
        )  # (pending tokens: only without drafts, where item k is row k)
        return self.decode.run(
            [t for i in items for t in _step_tokens(i)],
            [p for _, p in rows],
            slots,
            [i.seq.block_table for i, _ in rows],
            [p + 1 for _, p in rows],
            fill,
            verify=any(i.num_draft for i in items),
            state_slots=[i.seq.state_slot for i, _ in rows] if self.states is not None else (),
        )

    def _run_mixed(
        self, items, pending: PendingTokens | None, unread: tuple[list[int], list[int]] | None
    ):
        seqs = [
            (
                i.seq.block_table,
                i.seq.num_computed,
                i.seq.token_ids[i.seq.num_computed : i.seq.num_computed + i.num_new],
            )
            for i in items
        ]
        last_rows = list(itertools.accumulate(i.num_new for i in items))
        last_rows = [r - 1 for r in last_rows]
        fill = (
            (lambda ids: pending.fill(ids, [last_rows[k] for k in unread[0]], unread[1]))
            if unread
            else None
        )  # a pending token is its sequence's last
        return self.mixed.run(seqs, [r for r, i in zip(last_rows, items) if i.samples], fill)

    def _run_invariant(self, items, ids: torch.Tensor, due_rows: list[int]) -> torch.Tensor:
        # every token as its own query: (its sequence's block table, its position, 1 new token)
        queries = [
            (i.seq.block_table, i.seq.num_computed + j, 1) for i in items for j in range(i.num_new)
        ]
        hidden = []
        for start in range(0, len(ids), ROW_TILE):
            tile_ids, tile_queries = (
                ids[start : start + ROW_TILE],
                queries[start : start + ROW_TILE],
            )
            pad = ROW_TILE - len(tile_ids)
            tile_ids, tile_queries = (
                torch.cat([tile_ids, tile_ids[-1:].expand(pad)]),
                tile_queries + tile_queries[-1:] * pad,
            )
            layout = build_step_layout(tile_queries, self.cache.block_size, self.device)
            out = self.model(
                tile_ids, layout.positions, PagedAttention(self.cache, layout, batch_decodes=False)
            )
            hidden.append(out[: ROW_TILE - pad])
        rows = torch.cat(hidden)[torch.tensor(due_rows, device=self.device, dtype=torch.long)]
        padded = (
            torch.cat([rows, rows[-1:].expand(-len(rows) % ROW_TILE, -1)]) if len(rows) else rows
        )
        logits = [self.model.compute_logits(tile) for tile in padded.split(ROW_TILE)]
        return (
            torch.cat(logits)[: len(rows)]
            if logits
            else padded.new_empty(0, self.model.config.vocab_size)
        )


# %% [markdown]
# ## Building the runner
#
# The KV pool is sized from the budget, the decode graphs are recorded, and the runner is
# ready. `agree_num_blocks` lets several processes that each hold a slice of the model settle
# on one pool size (chapter 09c); alone, the number is what it is.

# %%
#| export
def build_runner(
    model: Transformer,
    config: EngineConfig,
    agree_num_blocks: Callable[[int], int] = lambda n: n,
    mixed_graphs: bool = True,
) -> ModelRunner:
    """The KV pool (one scratch block more than the allocator hands out), the graph runners and
    the model runner. `mixed_graphs=False`: steps with prefill tokens run eager."""
    param = next(model.parameters())
    # chapter 09a's fused layers on a GPU, its C-backed norm and SwiGLU on a CPU (a model built by hand too), before
    # the KV budget's run
    from forge_engine.fused_hybrid import install_fused_hybrid_layers
    from forge_engine.fused_layers import install_cpu_layers, install_fused_layers

    if param.device.type == "cuda":  # (chapter 09h's for a Qwen3.5 model)
        hybrid = isinstance(model, Qwen35Model)
        (install_fused_hybrid_layers if hybrid else install_fused_layers)(model)
    install_cpu_layers(model)  # (a model split with the CPU, chapter 10h: its CPU layers)
    states = None
    if (
        model.config.linear_layers
    ):  # recurrent layers (chapter 03b): a state slot per running sequence (chapter 05a)
        if config.batch_invariant or config.speculative_tokens:
            raise ValueError(
                "a model with recurrent layers runs each sequence's tokens in order and keeps every update of its "
                "state: not with batch_invariant (each token its own query) or speculative_tokens (a rejected "
                "draft's update cannot be taken back)"
            )
        if config.gpu_memory_budget is not None:
            raise ValueError(
                "gpu_memory_budget: chapter 10a's plan knows chapter 03's decoder, not recurrent layers"
            )
        # allocated before the KV budget's measurement, which then leaves room for it; the last slot is the decode
        # graphs' scratch slot, as the pool's last block is theirs (the scheduler hands out the others)
        states = StatePool(model.config, config.max_num_seqs + 1, param.device, param.dtype)
    offloaded = isinstance(model, OffloadedTransformer)  # layers split with the CPU (chapter 10h)
    if offloaded and (config.batch_invariant or config.speculative_tokens):
        raise ValueError(
            "a model split between the GPU and the CPU runs its steps over two pools: not with batch_invariant "
            "or speculative_tokens"
        )
    # the GPU's pool holds the GPU's layers; a split model's other layers get a pool of as many blocks where they run
    kv_config = model.config.replace(num_layers=model.gpu_layers) if offloaded else model.config
    budget = kv_cache_budget(model, config)
    num_blocks = agree_num_blocks(
        PagedKVCache.num_blocks_for(kv_config, budget, config.block_size, param.dtype)
    )
    # one block more than the allocator hands out: padded rows of a graphed decode write there
    cache = PagedKVCache(kv_config, num_blocks + 1, config.block_size, param.device, param.dtype)
    offload = (
        offload_pool(model, num_blocks + 1, config.block_size, param.dtype) if offloaded else None
    )
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    graphs = config.cuda_graphs if config.cuda_graphs is not None else param.device.type == "cuda"
    # (a streamed step copies weights between its kernels: eager)
    streamed = isinstance(model, StreamedTransformer)
    graphs = graphs and not config.batch_invariant and not streamed
    decode = None
    if (
        graphs and offloaded
    ):  # the GPU's layers, then the head, as graphs; the CPU's layers between them
        decode = SplitDecodeRunner(
            model,
            cache,
            offload,
            config.max_num_seqs,
            max_model_len,
            scratch_block=num_blocks,
            attention=decode_attention_for(param.device),
            use_graphs=param.device.type == "cuda",
        )
    elif graphs:
        decode = DecodeRunner(
            model,
            cache,
            config.max_num_seqs,
            max_model_len,
            scratch_block=num_blocks,
            attention=decode_attention_for(param.device),
            use_graphs=param.device.type == "cuda",
            # verify steps (chapter 08c): a sequence's last token and its drafts, graphed up to VERIFY_MAX_ROWS rows
            verify_rows=min(config.max_num_seqs * (1 + config.speculative_tokens), VERIFY_MAX_ROWS)
            if config.speculative_tokens
            else 0,
            states=states,
        )
    if (
        decode is None
        and param.device.type == "cpu"
        and not config.batch_invariant
        and not offloaded
        and not streamed
    ):
        # a GGUF model's decode steps as one C call (chapter 10f), where it runs (rows: a sequence and its drafts,
        # chapter 08c); else the eager step
        from forge_engine.cpu_decode import cpu_decode_runner

        decode = cpu_decode_runner(
            model, cache, config.max_num_seqs * (1 + config.speculative_tokens)
        )
    mixed = (
        MixedStepRunner(
            model,
            cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            scratch_block=num_blocks,
        )
        # (steps with prefill tokens of a model with recurrent state, or split with the CPU, run eager)
        if graphs
        and mixed_graphs
        and states is None
        and not offloaded
        and _prefill_kernel_runs(param.device)
        else None
    )
    return ModelRunner(model, cache, config.batch_invariant, decode, mixed, states, offload)


def _prefill_kernel_runs(device: torch.device) -> bool:
    "Whether chapter 09's prefill kernel runs natively here (what a mixed-step graph records)."
    if device.type != "cuda":
        return False
    from forge_engine.kernels.backend import kernels_available

    return kernels_available(device)


# %% [markdown]
# ## Trying it on a tiny model
#
# A random tiny Qwen3 and a scheduler over the runner's pool: one step prefills two prompts
# together, and each prompt's logits are those of the model run on that prompt alone, without
# any cache.

# %%
def tiny_runner(**config):
    model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
    config = EngineConfig(kv_cache_bytes=2**20, block_size=4, **config)
    runner = build_runner(model, config)
    allocator = BlockAllocator(runner.cache.num_blocks - 1, config.block_size)
    return runner, Scheduler(config, allocator, model.config.max_position_embeddings)


def prefill(runner, scheduler, prompts):
    "One step over fresh sequences of `prompts`: the logits of each prompt's last token."
    greedy = SamplingParams(temperature=0, max_tokens=4)
    for k, prompt in enumerate(prompts):
        scheduler.add(Seq(f"s{k}", prompt, greedy))
    plan = scheduler.schedule()
    assert len(plan.scheduled) == len(prompts) and all(i.samples for i in plan.scheduled)
    logits = runner.run(plan)
    scheduler.step_done(plan)
    return logits


prompts = [[5, 6, 7], list(range(100, 111))]
runner, scheduler = tiny_runner()
assert runner.decode is None and runner.cache.num_blocks == scheduler.allocator.num_blocks + 1
logits = prefill(runner, scheduler, prompts)
for row, prompt in zip(logits, prompts):
    n = len(prompt)
    hidden = runner.model(torch.tensor(prompt), torch.arange(n), no_cache_attention)
    torch.testing.assert_close(row, runner.model.compute_logits(hidden)[-1], rtol=1e-4, atol=1e-5)

# %% [markdown]
# With `batch_invariant=True` a prompt's logits are the same bits alone as beside another:

# %%
alone = prefill(*tiny_runner(batch_invariant=True), prompts[1:])
batched = prefill(*tiny_runner(batch_invariant=True), prompts)
assert torch.equal(alone[0], batched[1])

# %% [markdown]
# On a GPU, a step with prefill tokens replays one of chapter 09b's mixed-step graphs. The same
# static-buffer path, without recording and with the prefill kernel interpreted, gives the eager
# step's logits:

# %%
runner, scheduler = tiny_runner()
runner.mixed = MixedStepRunner(
    runner.model, runner.cache, 64, 2048, 4096, runner.cache.num_blocks - 1, "triton", False
)
torch.testing.assert_close(
    prefill(runner, scheduler, prompts), prefill(*tiny_runner(), prompts), rtol=1e-5, atol=1e-5
)

# %% [markdown]
# A pending token is copied into its place on the device: a decode step of the same sequences
# in the same order takes one copy, any other layout a gather and a scatter.

# %%
tokens = PendingTokens(torch.tensor([7, 8]), {})
ids = torch.tensor([PENDING, PENDING, 3])
tokens.fill(ids, [0, 1], [0, 1])
assert ids.tolist() == [7, 8, 3]
ids = torch.tensor([1, PENDING, 3, PENDING])
tokens.fill(ids, [1, 3], [1, 0])
assert ids.tolist() == [1, 8, 3, 7]
