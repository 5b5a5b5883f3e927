# %% [markdown]
# # Tensor parallelism
#
# > One model over N processes (one GPU each): every rank holds a slice of every weight, and two all-reduces per layer put the pieces together.

# %% [markdown]
# When one GPU is not enough (a bigger Qwen3, a longer context, more users at once), the
# engine splits *each weight matrix* over N processes, Megatron-style, and keeps everything
# else as it is: one scheduler, one tokenizer, one sampler, on rank 0.
#
# A linear layer `y = x W^T` can be split two ways:
#
# - **column-parallel**: each rank holds a slice of W's *rows* (output features) and computes
#   its slice of `y` from the whole `x`. No communication: the outputs are simply disjoint.
# - **row-parallel**: each rank holds a slice of W's *columns* (input features), receives the
#   matching slice of `x`, and computes a *partial sum* of the whole `y`; an **all-reduce**
#   (every rank sends its partial sum and receives the total) finishes it.
#
# A transformer layer chains them so that the slices line up without any communication in
# between: QKV is column-parallel by *heads* (a rank owns whole heads, so attention runs on
# them with no help), the attention output projection `o` is row-parallel over the same
# heads; gate/up is column-parallel over the intermediate features, `down` row-parallel over
# them. So each layer costs exactly **two all-reduces** of a `[tokens, hidden]` tensor.
#
# ## Who holds what (Qwen3-4B, N = 2)
#
# ```
#                      rank 0                              rank 1
# embed   [151936,2560]  rows (tokens)      0 .. 75967      rows 75968 .. 151935     vocab-parallel
#   -> each rank looks up the ids it owns, zeros elsewhere; all-reduce (sum) = the embedding
# per layer (x36):
#   attn_norm, mlp_norm, q_norm, k_norm          whole (replicated, tiny)
#   qkv  q rows: heads  0..15 (2048 rows)        q rows: heads 16..31                column-parallel
#        k,v rows: kv heads 0..3 (512 rows each)  k,v rows: kv heads 4..7
#   attention on 16 query heads / 4 kv heads, over this rank's own KV pool (its kv heads only)
#   o    [2560, 4096] columns 0..2047            columns 2048..4095                  row-parallel
#   -> all-reduce #1: [tokens, 2560], finished by mlp_norm (with the residual add)
#   gate_up  gate rows 0..4863, up rows 0..4863  gate rows 4864..9727, up rows 4864..9727  column-parallel
#   down [2560, 9728] columns 0..4863            columns 4864..9727                  row-parallel
#   -> all-reduce #2: [tokens, 2560], finished by the next layer's attn_norm (or the final norm)
# final norm                                     whole
# LM head (tied: the embedding's rows)  logits 0 .. 75967   logits 75968 .. 151935   vocab-parallel
#   -> all-gather: every rank gets [tokens, 151936]; rank 0 samples
# ```
#
# When there are fewer KV heads than ranks (a 1-KV-head model on 2 ranks), each rank keeps a
# copy of the KV head its query heads use: KV heads are *replicated*, not split.
#
# ## What crosses the wire per step
#
# Per decode step of `b` sequences, in BF16: `2 x 36 + 1 = 73` all-reduces of `b x 2560 x 2`
# bytes (**5 KiB at b = 1**, 320 KiB at b = 64) and one all-gather of each rank's
# `b x 75968 x 2` bytes of logits (148 KiB at b = 1). That volume is nothing for NVLink
# (hundreds of GB/s); what costs is the *latency* of 74 small collectives (microseconds each),
# so the decode step is recorded as a CUDA graph *with the collectives inside* (chapter 09b): one
# replay launches the matmuls and the NCCL kernels together.
#
# ## Processes
#
# Rank 0 is the engine process: scheduler, tokenizer, block allocation, sampling. Ranks
# 1..N-1 are started with `torch.multiprocessing` (spawn) and run a loop: receive a step's
# description, run the same forward on their slice, over their own KV pool (the same number
# of blocks, the same block tables: the allocator on rank 0 decides for everyone). The engine
# itself does not change: it gets a runner whose `run(plan)` first sends the plan to the
# workers. The model's collectives go through `torch.distributed` (NCCL on GPUs, gloo on
# CPUs); the step descriptions go through a plain `multiprocessing` pipe per worker (see
# *why a pipe* below).

# %%
#| default_exp tensor_parallel

# %%
#| export
from __future__ import annotations

import datetime
import faulthandler
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from forge_engine.config import EngineConfig, ModelConfig
from forge_engine.engine import ModelRunner, PendingTokens, build_runner
from forge_engine.fused_layers import FusedRMSNorm, linear
from forge_engine.kernels import INTERPRETED, _let_next_start, _pdl_args, _pow2
from forge_engine.kv_cache import to_device
from forge_engine.loader import LoadedModel, finish_stats, model_config_of, random_checkpoint, resolve_device, resolve_dtype
from forge_engine.loading import LoadStats, TensorEntry, checkpoint_shards, read_safetensors_header, read_tensor, rss_bytes
from forge_engine.model import Transformer, checkpoint_target, load_weights
from forge_engine.registry import ResolvedModel, describe_model, resolve
from forge_engine.tokenizer import Tokenizer

# %%
#| hide
import tempfile
from pathlib import Path
import pytest
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.model import causal_attention, empty_model, hf_state_dict, init_random_weights, rope_cos_sin

# %% [markdown]
# ## The plan: which slice a rank holds
#
# Everything about the split is arithmetic on the config: `ShardPlan` says, for a checkpoint
# tensor name, which dimension is cut and which range this rank keeps, and gives the
# *shard config*: the config of the model a rank actually builds (its heads, its share of the
# intermediate features). The vocabulary stays whole in the shard config (the engine checks
# token ids against it); the embedding and LM head modules know their own range.

# %%
#| export
_SPLIT_LAYER = {  # HF name inside model.layers.{i} -> (dimension cut, which range)
    "self_attn.q_proj": (0, "q"), "self_attn.k_proj": (0, "kv"), "self_attn.v_proj": (0, "kv"),
    "self_attn.o_proj": (1, "q"), "mlp.gate_proj": (0, "mlp"), "mlp.up_proj": (0, "mlp"), "mlp.down_proj": (1, "mlp"),
}
_SPLIT_TOP = {"model.embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab")}
_LAYER_TENSOR = re.compile(r"model\.layers\.\d+\.(.+)\.(?:weight|bias)$")


@dataclass(frozen=True)
class ShardPlan:
    "The slices rank `rank` of `world` holds of a model with (full) `config`."
    config: ModelConfig
    rank: int
    world: int

    def __post_init__(self):
        c, n = self.config, self.world
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside 0..{n - 1}")
        for what, size in (("num_heads", c.num_heads), ("intermediate_size", c.intermediate_size),
                           ("vocab_size", c.vocab_size)):
            if size % n:
                raise ValueError(f"tensor_parallel_size {n} does not divide the model's {what} ({size})")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {n} and the model's {c.num_kv_heads} KV heads: one must divide the other")

    @property
    def kv_heads(self) -> range:
        "This rank's KV heads: its share, or (fewer KV heads than ranks) the one its query heads use."
        kv, n, r = self.config.num_kv_heads, self.world, self.rank
        return range(r * kv // n, (r + 1) * kv // n) if kv >= n else range(r * kv // n, r * kv // n + 1)

    @property
    def shard_config(self) -> ModelConfig:
        c, n = self.config, self.world
        return c.replace(num_heads=c.num_heads // n, num_kv_heads=len(self.kv_heads),
                         intermediate_size=c.intermediate_size // n)

    @property
    def vocab_part(self) -> int: return self.config.vocab_size // self.world

    def _range(self, which: str) -> tuple[int, int]:
        c, r, n = self.config, self.rank, self.world
        if which == "q": return r * c.q_size // n, (r + 1) * c.q_size // n
        if which == "kv": return self.kv_heads.start * c.head_dim, self.kv_heads.stop * c.head_dim
        if which == "mlp": return r * c.intermediate_size // n, (r + 1) * c.intermediate_size // n
        return r * self.vocab_part, (r + 1) * self.vocab_part

    def slice_for(self, hf_name: str) -> tuple[int, int, int] | None:
        "(dimension, start, stop) of checkpoint tensor `hf_name` this rank keeps; None: the whole tensor."
        if hf_name in _SPLIT_TOP:
            dim, which = _SPLIT_TOP[hf_name]
        elif (m := _LAYER_TENSOR.match(hf_name)) and m.group(1) in _SPLIT_LAYER:
            dim, which = _SPLIT_LAYER[m.group(1)]
        else:
            return None  # norms: every rank has them whole
        return (dim, *self._range(which))


def shard_tensors(plan: ShardPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    "Each (hf_name, full tensor) as (hf_name, this rank's slice of it): a view, copied later by `load_weights`."
    for hf_name, tensor in named_tensors:
        cut = plan.slice_for(hf_name)
        yield hf_name, tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1])


# %% [markdown]
# Qwen3-4B on two ranks: 16 of the 32 query heads and 4 of the 8 KV heads each; a model with
# one KV head keeps it on both ranks.

# %%
q4b = preset("qwen3-4b")
p1 = ShardPlan(q4b, rank=1, world=2)
assert (p1.shard_config.num_heads, p1.shard_config.num_kv_heads, p1.shard_config.intermediate_size) == (16, 4, 4864)
assert p1.slice_for("model.layers.3.self_attn.q_proj.weight") == (0, 2048, 4096)
assert p1.slice_for("model.layers.3.self_attn.k_proj.weight") == (0, 512, 1024)
assert p1.slice_for("model.layers.3.self_attn.o_proj.weight") == (1, 2048, 4096)
assert p1.slice_for("model.layers.3.mlp.down_proj.weight") == (1, 4864, 9728)
assert p1.slice_for("model.embed_tokens.weight") == (0, 75968, 151936)
assert p1.slice_for("model.layers.3.input_layernorm.weight") is None
one_kv = preset("qwen2-tiny")  # 4 heads, 1 KV head
assert [ShardPlan(one_kv, r, 2).kv_heads for r in (0, 1)] == [range(0, 1), range(0, 1)]
assert [ShardPlan(q4b, r, 16).kv_heads for r in (0, 1, 2, 15)] == [range(0, 1), range(0, 1), range(1, 2), range(7, 8)]
with pytest.raises(ValueError, match="does not divide the model's num_heads"):
    ShardPlan(preset("llama-tiny"), 0, 4)  # 6 heads

# %% [markdown]
# The algebra, without any processes: split one layer's weights per the plan, run each
# rank's piece, and add the partial outputs of the row-parallel projections (what the
# all-reduce does). The result is the unsplit layer's, to rounding.

# %%
cfg = preset("llama-tiny")  # 6 heads, 2 KV heads, hidden 48
full = init_random_weights(empty_model(cfg), seed=3, std=0.2)
x, pos = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0)), torch.arange(5)
cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
no_cache = lambda layer, q, k, v: causal_attention(q, k, v)
want_attn, want_mlp = full.layers[0].attn(x, cos, sin, no_cache), full.layers[0].mlp(x)
got_attn = got_mlp = 0
for rank in range(2):
    plan = ShardPlan(cfg, rank, 2)
    part = empty_model(plan.shard_config)  # plain modules, no all-reduce: we add the partial outputs by hand
    tensors = dict(shard_tensors(plan, hf_state_dict(full).items()))
    tensors.update({n: t for n, t in hf_state_dict(full).items() if n in ("model.embed_tokens.weight", "lm_head.weight")})
    load_weights(part, tensors.items())  # (the vocabulary stays whole here: a plain embedding has no all-reduce)
    got_attn = got_attn + part.layers[0].attn(x, cos, sin, no_cache)
    got_mlp = got_mlp + part.layers[0].mlp(x)
# fp32: each rank sums half of each dot product, the halves added after: the same products summed in another order,
# a few roundings of 2^-24 on outputs of O(5) (measured 1.9e-6)
torch.testing.assert_close(got_attn, want_attn, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-5, atol=1e-6)


# %% [markdown]
# ## The parallel modules
#
# Four module swaps turn a `Transformer` of the shard config into a rank's part of the whole
# model. Their parameter names stay those of the modules they replace (`attn.o.weight`,
# `embed.weight`), so `load_weights` of chapter 03 fills them unchanged, and the layers'
# `forward` code is not touched at all:
#
# - `RowParallelLinear` (for `attn.o` and `mlp.down`): the linear over this rank's inputs, whose
#   output is a partial sum;
# - `ReducingRMSNorm` (every RMSNorm of the residual stream): the layers hand the partial sums to
#   the norms that add them to the residual (`add_and_norm`), and these finish the all-reduce
#   first (one kernel for all three on GPUs, see *Small all-reduces* below);
# - `VocabParallelEmbedding`: look up the ids this rank owns, zeros for the others, all-reduce;
# - the LM head computes this rank's slice of the logits; an all-gather assembles the row.
#
# On a GPU the engine swaps the layers chapter 03 made for chapter 09a's fused ones
# (`install_fused_layers`). These four are not among them and stay; they run the same kernels
# themselves (the GEMV for a decode row through `linear`, the norms as `FusedRMSNorm`s).
#
# The model's all-reduces all go through one `AllReduce` object: `torch.distributed` (NCCL on
# GPUs, gloo on CPUs), or, for small messages between GPUs that can reach each other's memory,
# the faster path of *Small all-reduces through peer memory* below, once it is set up.

# %%
#| export
class AllReduce:
    "Sum a tensor over the ranks, in place: through `fast` (set up later, GPUs only) when it takes it, else torch.distributed."
    def __init__(self, group=None):
        self.group, self.fast = group, None
        self.path = "torch.distributed"  # what runs, in words (see `setup_all_reduce`)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is None or not self.fast.all_reduce_(x):
            dist.all_reduce(x, group=self.group)
        return x

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, half: int = 0) -> torch.Tensor | None:
        """Where the fast path stages a message of this shape (a layer may write its output there: no copy), in half
        `half` (0 or 1) of its buffer; None where it does not take such a message."""
        return self.fast.staging(shape, dtype, half) if self.fast is not None else None

    def add_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        "The fast path's all-reduce + residual add + RMSNorm in one kernel, where it staged `partial`; else None."
        return self.fast.add_rmsnorm(partial, residual, weight, eps) if self.fast is not None else None


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features: this rank's *partial* output. The sum over the
    ranks is finished by the norm that takes it (`ReducingRMSNorm.add_and_norm`). `half`: where in the fast path's
    buffer it stages (the output projections 0, the down projections 1: consecutive layers alternate)."""
    def __init__(self, in_features: int, out_features: int, all_reduce: AllReduce, half: int):
        super().__init__(in_features, out_features, bias=False)
        self.all_reduce, self.half = all_reduce, half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the GEMV kernel for one row on a GPU, like every other layer; its output straight into the fast path's
        # buffer where that takes the message (every rank asks with the same shape, so all take the same path)
        return linear(x, self.weight, out=self.all_reduce.staging((*x.shape[:-1], self.out_features), x.dtype, self.half))


class ReducingRMSNorm(FusedRMSNorm):
    """The norm after a row-parallel layer: `add_and_norm` gets that layer's partial output, sums it over the ranks,
    adds the residual and normalises. One kernel where the fast path staged the message; else an all-reduce first,
    then chapter 09a's fused add + norm (its PyTorch path on a CPU)."""
    def __init__(self, dim: int, eps: float, all_reduce: AllReduce):
        super().__init__(dim, eps)
        self.all_reduce = all_reduce

    def add_and_norm(self, partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.all_reduce.add_rmsnorm(partial, residual, self.weight, self.eps)
        return fused if fused is not None else super().add_and_norm(self.all_reduce(partial), residual)


class VocabParallelEmbedding(nn.Embedding):
    "This rank's rows of the embedding; ids outside them give zeros, and an all-reduce fills in the rest."
    def __init__(self, vocab_start: int, vocab_part: int, hidden: int, all_reduce: AllReduce):
        super().__init__(vocab_part, hidden)
        self.vocab_start, self.all_reduce = vocab_start, all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        return self.all_reduce(F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype))


def all_gather_columns(x: torch.Tensor, world: int, group=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[n, v] on every rank -> [n, world * v] (in `dtype`, default x's): rank r's columns at r * v (the logits row put
    back together)."""
    x = x.contiguous()
    out = x.new_empty(world, *x.shape)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=group)  # one NCCL call, safe inside a CUDA graph
    else:
        dist.all_gather(list(out.unbind(0)), x, group=group)
    rows = torch.empty(x.shape[0], world, x.shape[1], dtype=dtype or x.dtype, device=x.device)
    return rows.copy_(out.permute(1, 0, 2)).view(x.shape[0], world * x.shape[1])  # one copy: reorder and convert


class ShardedTransformer(Transformer):
    "Rank `plan.rank`'s part of the model: the shard config's layers, with the parallel modules swapped in."
    def __init__(self, plan: ShardPlan, group=None):
        super().__init__(plan.shard_config)
        self.plan, self.group = plan, group
        self.all_reduce = AllReduce(group)  # one for every layer: the fast path is set up once, for all of them
        c = plan.shard_config
        self.embed = VocabParallelEmbedding(plan.rank * plan.vocab_part, plan.vocab_part, c.hidden_size, self.all_reduce)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(c.hidden_size, plan.vocab_part, bias=False)
        for layer in self.layers:
            layer.attn.o = RowParallelLinear(c.q_size, c.hidden_size, self.all_reduce, half=0)
            layer.mlp.down = RowParallelLinear(c.intermediate_size, c.hidden_size, self.all_reduce, half=1)
            # the norms that take their outputs (the next layer's attn_norm, and the final norm, take down's)
            layer.attn_norm, layer.mlp_norm = (ReducingRMSNorm(c.hidden_size, c.rms_norm_eps, self.all_reduce)
                                               for _ in range(2))
        self.norm = ReducingRMSNorm(c.hidden_size, c.rms_norm_eps, self.all_reduce)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        "hidden [N, hidden] -> the whole logits [N, vocab] in fp32, on every rank."
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return all_gather_columns(linear(hidden, weight), self.plan.world, self.group, torch.float32)


def empty_sharded_model(plan: ShardPlan, device="cpu", dtype=torch.float32, group=None) -> ShardedTransformer:
    "A rank's part, with allocated but uninitialised weights: built on `meta`, then given real storage."
    with torch.device("meta"):
        model = ShardedTransformer(plan, group)
    return model.to(dtype=dtype).to_empty(device=device).eval()


# %% [markdown]
# ## Loading: each rank reads only its slices
#
# - **safetensors**: a *row* slice of a row-major tensor is a contiguous byte range of the
#   file, so q/k/v, gate/up, the embedding and the LM head are read straight from their file
#   offsets, 1/N of the bytes. Column slices (`o_proj`, `down_proj`) are read whole into the
#   staging buffer (one tensor, chapter 01) and narrowed. No rank ever holds the full model.
# - **GGUF**: tensors are dequantized one at a time (chapter 01a) and narrowed.
# - **random weights**: every rank draws the *same* full tensors as a single-process model
#   (the same generator, the same order, one tensor at a time) and keeps its slices. So a
#   `random:` model under tensor parallelism is the very model a single process runs, and
#   greedy tokens can be compared.

# %%
#| export
def read_checkpoint_shard(directory, plan: ShardPlan, stats: LoadStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    "Yield (hf_name, this rank's slice) for every tensor the model uses; row slices read only their bytes."
    files = [(path, read_safetensors_header(path)) for path in checkpoint_shards(directory)]
    staging = torch.empty(max((e.nbytes for _, entries in files for e in entries), default=0), dtype=torch.uint8)
    stats = stats if stats is not None else LoadStats()
    for path, entries in files:
        with open(path, "rb") as f:
            for entry in entries:
                if checkpoint_target(plan.config, entry.name) is None: continue  # tied lm_head, inv_freq
                cut = plan.slice_for(entry.name)
                if cut is not None and cut[0] == 0:  # rows: a contiguous byte range of the file
                    row_bytes = entry.nbytes // entry.shape[0]
                    entry = TensorEntry(entry.name, entry.dtype, (cut[2] - cut[1], *entry.shape[1:]),
                                        entry.begin + cut[1] * row_bytes, (cut[2] - cut[1]) * row_bytes)
                    cut = None
                tensor = read_tensor(f, entry, staging)
                stats.bytes_read += entry.nbytes
                stats.tensors += 1
                yield entry.name, tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1])


def load_shard(resolved: ResolvedModel, plan: ShardPlan, device, dtype: torch.dtype, seed: int = 0,
               group=None, stats: LoadStats | None = None) -> ShardedTransformer:
    "This rank's part of the model, filled from its slices of the checkpoint."
    model = empty_sharded_model(plan, device, dtype, group)
    if resolved.format == "random":
        tensors = shard_tensors(plan, random_checkpoint(plan.config, seed, device, dtype))
    elif resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile
        tensors = shard_tensors(plan, GGUFFile(resolved.path).tensors(dtype=dtype))
    else:
        tensors = read_checkpoint_shard(resolved.path, plan, stats)
    load_weights(model, tensors)
    return model


# %% [markdown]
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
            if table is not state[1] or len(table) > state[2]:  # a new table (admitted again), or blocks appended
                start = 0 if table is not state[1] else state[2]
                updated.append(state[0]); starts.append(start); update_lens.append(len(table) - start)
                blocks += table[start:]
                state[1], state[2] = table, len(table)
            state[3] = self.steps
            if n == 1:  # decodes: one token, found without building the whole token list
                prompt = seq.prompt_ids
                tokens.append(prompt[computed] if computed < len(prompt) else seq.output_ids[computed - len(prompt)])
            else:
                tokens += seq.token_ids[computed:computed + n]
            keys.append(state[0]); done.append(computed); counts.append(n); samples.append(item.samples)
            lengths.append(len(table))
        gone = []
        if len(self.sent) > len(plan.scheduled):  # someone was not scheduled: finished ones are forgotten
            finished = [seq for seq, state in self.sent.items() if state[3] != self.steps and seq.finished]
            gone = [self.sent.pop(seq)[0] for seq in finished]
        as_array = lambda values: np.array(values, dtype=np.int32)
        return tuple(map(as_array, (keys, done, counts, samples, lengths, tokens,
                                    updated, starts, update_lens, blocks, gone, unread)))


class _Tokens:
    "A sequence's token ids from `offset` on: sliced with absolute positions, as the runner slices a sequence."
    __slots__ = ("offset", "tokens")
    def __init__(self, offset: int, tokens: list[int]): self.offset, self.tokens = offset, tokens
    def __getitem__(self, s: slice) -> list[int]: return self.tokens[s.start - self.offset:s.stop - self.offset]


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


@dataclass
class _Plan:
    scheduled: list[_Scheduled]
    unread: list[int] = field(default_factory=list)  # items whose last input token rank 0 broadcasts


class StepReader:
    "A worker's side: applies each `StepMessage` to its mirrors and returns the plan its `ModelRunner` runs."
    def __init__(self): self.seqs: dict[int, _SeqView] = {}

    def decode(self, message: StepMessage) -> _Plan:
        keys, done, counts, samples, lengths, tokens, updated, starts, update_lens, blocks, gone, unread = \
            (a.tolist() for a in message)
        for key in gone: del self.seqs[key]
        at = 0
        for key, start, n in zip(updated, starts, update_lens):
            view = self.seqs.get(key) or self.seqs.setdefault(key, _SeqView([]))
            view.block_table[start:] = blocks[at:at + n]  # in place: the same list, replaced or extended
            at += n
        scheduled, end = [], 0
        for key, computed, n, sample, length in zip(keys, done, counts, samples, lengths):
            view = self.seqs[key]
            if len(view.block_table) != length:
                raise RuntimeError(f"tensor-parallel worker: sequence {key}'s block table has {len(view.block_table)} "
                                   f"blocks, rank 0's has {length}: the mirrors are out of step")
            new, end = tokens[end:end + n], end + n
            view.num_computed, view.token_ids, view.last_token = computed, _Tokens(computed, new), new[-1]
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
        assert (v.block_table, v.num_computed, b.num_new, b.samples) == (s.block_table, s.num_computed, n, a.samples)
        assert v.token_ids[s.num_computed:s.num_computed + n] == s.token_ids[s.num_computed:s.num_computed + n]
    return sum(a.nbytes for a in message)

plan = StepPlan([ScheduledSeq(seqs[0], 5, True), ScheduledSeq(seqs[1], 4, False)])  # a prefill and a chunk of one
message = writer.encode(plan); print("step 1:", same_plan(plan, reader.decode(message)), "bytes")
seqs[0].num_computed, seqs[1].num_computed = 5, 4
seqs[0].output_ids = [42]
plan = StepPlan([ScheduledSeq(seqs[0], 1, True), ScheduledSeq(seqs[1], 5, True)])
message = writer.encode(plan); print("step 2:", same_plan(plan, reader.decode(message)), "bytes")
assert message[6].size == 0  # no table changed
seqs[0].num_computed, seqs[1].num_computed = 6, 9
seqs[0].output_ids.append(43); seqs[0].block_table += [11]  # seq 0 grew a block
seqs[1].status = Status.FINISHED
plan = StepPlan([ScheduledSeq(seqs[0], 1, True)])
message = writer.encode(plan); print("step 3:", same_plan(plan, reader.decode(message)), "bytes")
assert message[6].tolist() == [0] and message[9].tolist() == [11] and message[10].tolist() == [1]
assert list(reader.seqs) == [0] and len(writer.sent) == 1
seqs[0].block_table = [20, 21]  # preempted and re-admitted: a new list, sent whole
seqs[0].num_computed = 0
plan = StepPlan([ScheduledSeq(seqs[0], 7, True)])
assert same_plan(plan, reader.decode(writer.encode(plan)))


# %% [markdown]
# ## Measuring the collectives
#
# A step of `b` decoding sequences runs `2 x layers + 1` all-reduces of `[b, hidden]` and one
# all-gather of logits. `time_collectives` runs exactly those on every rank, through the
# model's own `AllReduce` and `ReducingRMSNorm` (the path the decode step takes: where the
# all-reduce, the residual add and the norm are one kernel, the add and the norm are counted
# with it), recorded in a CUDA graph on a GPU as the decode step is, and returns the seconds per
# step of each kind.

# %%
#| export
def _seconds_per_call(fn, device: torch.device, repeats: int, group=None) -> float:
    "Wall seconds of one `fn()`: replayed from a CUDA graph on a GPU, called as it is on a CPU."
    fn()  # warm up (the communicator's first use)
    run = fn
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(repeats): run()
    if device.type == "cuda": torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def time_collectives(config: ModelConfig, world: int, batch: int, device, dtype: torch.dtype, repeats: int = 20,
                     all_reduce: AllReduce | None = None, group=None) -> dict[str, float]:
    "Seconds per decode step of its all-reduces and of its logits all-gather at `batch` sequences (every rank together)."
    all_reduce, device = all_reduce or AllReduce(group), torch.device(device)
    x = torch.zeros(batch, config.hidden_size, device=device, dtype=dtype)
    logits = torch.zeros(batch, config.vocab_size // world, device=device, dtype=dtype)
    norm = ReducingRMSNorm(config.hidden_size, config.rms_norm_eps, all_reduce).to(device, dtype)
    staged = [all_reduce.staging(x.shape, x.dtype, half) for half in (0, 1)]
    def all_reduces():  # the embedding's, then each row-parallel layer's as its norm finishes it (add and norm included)
        all_reduce(x)
        for i in range(2 * config.num_layers): norm.add_and_norm(x if staged[i % 2] is None else staged[i % 2], x)
    return {"all_reduce_s": _seconds_per_call(all_reduces, device, repeats, group),
            "all_gather_s": _seconds_per_call(lambda: all_gather_columns(logits, world, group, torch.float32), device, repeats, group)}


# %% [markdown]
# For the benchmarks (`forge-engine bench w1|w2 --tensor-parallel-size N`): the all-reduce
# time per decode step (and the all-gather's) next to the step time the workload measured,
# and its share of that step. W1 decodes one sequence, so its step is `1 / decode tok/s`.
# W2's decode steps run up to `max_num_seqs` sequences; `max_num_seqs / output tok/s`
# over-estimates such a step (the wall time includes the prefills), so the W2 shares are lower
# bounds.

# %%
#| export
def tensor_parallel_report(loaded: LoadedModel, config: EngineConfig, result: dict) -> dict:
    "All-reduce (and all-gather) time per decode step at batch 1 and at `max_num_seqs`, and its share of the step."
    parallel = loaded.parallel
    full, p = parallel.model.plan.config, next(parallel.model.parameters())
    report = {"size": parallel.world, "backend": parallel.backend, "all_reduce_path": parallel.all_reduce_path,
              "per_step": {"all_reduce": 2 * full.num_layers + 1, "all_gather": 1}}
    for batch in sorted({1, config.max_num_seqs}):
        times = parallel.time_collectives(batch)
        report[f"batch_{batch}"] = {
            **times, "collectives_s": times["all_reduce_s"] + times["all_gather_s"],
            "all_reduce_bytes": batch * full.hidden_size * p.element_size(),
            "all_gather_bytes_per_rank": batch * full.vocab_size // parallel.world * p.element_size()}
    steps = {}
    if "decode_tok_s" in result: steps["w1", 1, ""] = 1 / result["decode_tok_s"]
    if "output_tok_s" in result:
        steps["w2", config.max_num_seqs, "_lower_bound"] = config.max_num_seqs / result["output_tok_s"]
    for (workload, batch, bound), step in steps.items():
        times = report[f"batch_{batch}"]
        report[f"{workload}_step_s" if not bound else f"{workload}_decode_step_upper_bound_s"] = step
        report[f"{workload}_all_reduce_share{bound}"] = times["all_reduce_s"] / step
        report[f"{workload}_collective_share{bound}"] = times["collectives_s"] / step
    return report


# %% [markdown]
# ## Small all-reduces through peer memory
#
# At batch 1 a decode step's 73 all-reduces move 5 KiB each, and their time (the report's
# `batch_1.all_reduce_s`, next to `w1_all_reduce_share`) is latency, not bandwidth: divided by
# 73 it is microseconds per all-reduce, for bytes that NVLink moves in nanoseconds. NCCL's
# all-reduce is built for every size, topology and rank count: a ring (or tree) of steps, each
# a protocol exchange between neighbours.
#
# Between GPUs that can read each other's memory (NVLink, or PCIe peer access), a **one-shot
# all-reduce** does less. PyTorch's *symmetric memory* (`torch.distributed._symmetric_memory`)
# allocates one buffer per rank and, once (`rendezvous`, a collective), maps every peer's
# buffer into each rank's address space. Then one all-reduce is: copy this rank's partial sum
# into its buffer; one kernel raises a flag in every peer's *signal pad* and waits for theirs
# (everyone has written), reads all N buffers straight over NVLink and adds them, and
# handshakes again (everyone has read, so the buffers may be written again). One exchange
# instead of a ring's 2(N - 1). The **two-shot** variant (`two_shot_all_reduce_out`) has each
# rank add only its 1/N of the elements and then gathers the sums: it reads N times fewer
# bytes, for one more handshake, and wins as messages grow. (Both leave NVLink *multicast*
# alone: the `multimem_*` operations, which need it, are not used.)
#
# The buffer is allocated once, at startup, twice as large as the largest message the fast path
# takes (two halves, see the fused kernel below), so its address never moves: a CUDA graph that
# recorded the copy and the kernel replays them as they are. The largest message
# (`symm_mem_buffer_bytes`) is the larger of `SYMM_MEM_MAX_BYTES`
# and a decode step of `SYMM_MEM_ROWS` sequences of the model: 256 sequences of Qwen3-4B are
# 256 x 2560 x 2 bytes = 1.25 MiB, of Qwen3-14B (5,120 wide) 2.5 MiB. With a fixed 2 MiB the
# 14B's decode steps at 256 sequences went through NCCL: measured on two H200s
# (`forge-engine bench all --model random:qwen3-14b --workloads w1,w2 --tensor-parallel-size 2`),
# 3.70 ms of all-reduces a step at 256 rows against 0.61 ms at one; with the buffer sized by the model,
# 1.71 ms, and W2 10,563 → 10,841 output tok/s. The row-parallel layers (output and down projections)
# write their partial sums straight into the buffer (`AllReduce.staging`: the GEMV kernel or the GEMM
# takes it as its output), so no copy into it precedes the kernel. Larger messages (prefills) and anything
# the kernels do not handle (fp16, an odd size, a rank count other than 2, 4 or 8) go
# through NCCL; every rank decides from the message's shape and dtype alone, so all ranks
# always take the same path.
#
# **The all-reduce, the residual add and the norm in one kernel.** Each row-parallel
# layer's sum goes straight into the residual add and the next RMSNorm, so the three are one
# kernel here: `_all_reduce_add_rmsnorm_kernel`, called by the norm that takes the layer's
# partial output (`ReducingRMSNorm`). One program a row (up to as many programs as a signal pad
# has slots): a handshake with its namesake program on every peer (everyone's partial sums are
# written), then the row of every rank's buffer read over NVLink and added in rank order (so
# every rank gets the same bits), the residual added, the row normalised, both stored. No second
# handshake ("everyone has read, the buffer may be written again"): the buffer has two halves,
# the output projections stage in one and the down projections in the other, so consecutive
# calls alternate, and the next write into a half comes after the next call's handshake, which a
# peer reaches only once it has finished everything before, its reads of that half included
# (`SymmMemAllReduce.add_rmsnorm`). The handshakes are PyTorch's protocol, slot for slot, so the
# release below frees this kernel too. Against PyTorch's kernel followed by the norm it saves a
# launch and a handshake, and keeps more programs in flight (PyTorch's one- and two-shot kernels
# launch at most 24 blocks). Measured on two H200s (`kernels_lab/tp_allreduce.py`, a
# decode step's worth in one CUDA graph): at 256 rows 12.1 µs a call against 18.6 for the
# all-reduce and the norm kernel (15.7 with a second handshake), at one row 7.1 against 9.0.
# In the engine (`kernels_lab/tp_step_profile.py --tp=2`, 256 sequences) rank 0's decode step
# went from 7.49 to 6.88 ms, its all-reduces from 1.30 to 0.98 ms plus 0.18 ms of norms gone;
# W1 at TP=2 from 419 to 460 tok/s; W2 1.50-1.52× TP=1, unchanged (what
# limits it: `docs/benchmarks.md`).
#
# **When a rank dies.** An NCCL collective waiting for a dead rank returns once rank 0 aborts
# the communicator. The symmetric-memory kernels have no abort: they would wait for the dead
# peer's flag for ever, and so would the engine's wait for the step's tokens. So after a
# failure rank 0 keeps writing the dead peers' half of every handshake into the signal pads
# (`release_waiters`, a background thread, until the group is closed): each waiting kernel
# finishes, on garbage that the failed step never delivers (see *a step's GPU work* below).
# A worker whose rank 0 died exits at once (`_exit_when_orphaned`): ending its process ends
# its kernels.
#
# Releasing from the host needs a launch every round, and a host thread's launches can wait
# behind another thread's blocking call: with the host's fills alone the symmetric-memory variant of the
# killed-worker test hung in all four runs on two H200s (the NCCL variant passed), with rank 0's
# release thread waiting for its own fills, the abort thread inside NCCL's abort, and the engine
# waiting for the step, while a kernel of the step waited for the dead rank. So the release
# starts on the GPU: `_release_kernel`, one program, plays the dead rank's side of every slot
# over and over for `RELEASE_ON_GPU_S` seconds of the GPU's clock (`%globaltimer`, a microsecond's
# `nanosleep` between rounds), needing no host call while NCCL's abort runs; it is compiled when
# the fast path is set up, and the abort waits until it is queued. The host's fills take over
# afterwards. Checked here under the interpreter (its indexing); on two H200s the killed-worker
# test (`tests/test_tp_gpu.py`) passes with it under both paths.
#
# **On by default.** Measured on two H200s (`kernels_lab/tp_allreduce.py`, 73
# all-reduces of one decode step in one CUDA graph): 535 µs through symmetric memory against
# 1,375 µs through NCCL at one sequence, 1,187 against 2,155 µs at 256. Without the
# release above the killed-worker test (`tests/test_tp_gpu.py`) hangs with it; with the
# release it fails cleanly under both paths (both variants of the test on
# two H200s), and the engine's W1 with TP=2 went from 382.7-383.1 tok/s (NCCL) to 393.0-393.4
# (the all-reduces 0.54 ms of a 2.54 ms step, 21%, against NCCL's 1.86 ms of 2.61, 71%). So the
# small all-reduces take the fast path wherever every rank can; `FORGE_TP_ALL_REDUCE=nccl` in
# the environment sends all of them through NCCL. `kernels_lab/tp_allreduce.py` checks the fast
# path against NCCL and times both, eager and inside a CUDA graph, at 1 to 256 rows of 2560.

# %%
#| export
SYMM_MEM_MAX_BYTES = 2 * 2**20  # the fast path's buffer at least: above its size (prefills), NCCL
SYMM_MEM_ROWS = 512  # ... and as large as a decode step of this many sequences of the model
ONE_SHOT_MAX_BYTES = 256 * 2**10  # one-shot up to here, two-shot above
ALL_REDUCE_ENV = "FORGE_TP_ALL_REDUCE"  # "nccl": every all-reduce through NCCL (default: small ones through peer memory)
ALL_REDUCE_CHOICES = ("symmetric-memory", "nccl")  # (unset or empty: symmetric memory where every rank can)


def all_reduce_choice() -> str:
    "The all-reduce path asked for in the environment: 'symmetric-memory' (the default) or 'nccl'."
    choice = os.environ.get(ALL_REDUCE_ENV, "").strip().lower() or "symmetric-memory"
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(f"{ALL_REDUCE_ENV}={os.environ[ALL_REDUCE_ENV]!r}: expected one of {', '.join(ALL_REDUCE_CHOICES)}")
    return choice


def symm_mem_buffer_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    "The fast path's largest message: SYMM_MEM_MAX_BYTES, or a decode step's all-reduce of SYMM_MEM_ROWS rows if larger."
    return max(SYMM_MEM_MAX_BYTES, SYMM_MEM_ROWS * hidden_size * dtype.itemsize)


def symm_mem_takes(x: torch.Tensor, max_bytes: int = SYMM_MEM_MAX_BYTES) -> bool:
    "Whether the symmetric-memory kernels take `x`: bf16 or fp32, contiguous, a multiple of 4 bytes, at most `max_bytes`."
    return x.is_contiguous() and symm_mem_takes_shape(x.shape, x.dtype, max_bytes)


def symm_mem_takes_shape(shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int = SYMM_MEM_MAX_BYTES) -> bool:
    "Whether the symmetric-memory kernels take a contiguous message of this shape and dtype (see `symm_mem_takes`)."
    nbytes = math.prod(shape) * dtype.itemsize
    return dtype in (torch.bfloat16, torch.float32) and 0 < nbytes <= max_bytes and nbytes % 4 == 0


RELEASE_ON_GPU_S = 2.0  # how long the release kernel plays a dead rank's side: the steps in flight, an abort's wait
RELEASE_LAUNCH_WAIT_S = 2.0  # after a failure, how long at most the abort waits for that kernel to be queued


@triton.jit
def _clock_ns(tick, ON_GPU: tl.constexpr):
    "On the GPU: wait about a microsecond, then read the GPU's global clock (ns). Interpreted: 0 (no clock there)."
    if ON_GPU:
        return tl.inline_asm_elementwise("{ nanosleep.u32 1000; mov.u64 $0, %globaltimer; }", "=l,r", [tick],
                                         dtype=tl.int64, is_pure=False, pack=1)
    return tick.to(tl.int64) * 0


# (no integer argument specialised: the launch at setup, with nothing to do, compiles the one a failure launches)
@triton.jit(do_not_specialize=["slots", "world", "peer", "rank", "duration_us", "rounds"])
def _release_kernel(mine_ptr, theirs_ptr, slots, world, peer, rank, duration_us, rounds,
                    BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    """Play dead rank `peer`'s side of every handshake slot (see `release_waiters`) over and over, for `duration_us`
    of the GPU's clock and at most `rounds` times: "peer has arrived" in our pad, "peer took our signal" in theirs."""
    i = 0
    start = _clock_ns(i, ON_GPU)
    now = start
    while (i < rounds) & (now - start < duration_us.to(tl.int64) * 1000):
        for first in range(0, slots, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < slots
            tl.atomic_xchg(mine_ptr + offs * world + peer, 1, mask=ok, sem="relaxed", scope="sys")
            tl.atomic_xchg(theirs_ptr + offs * world + rank, 0, mask=ok, sem="relaxed", scope="sys")
        i += 1
        now = _clock_ns(i, ON_GPU)


def release_on_device(mine: torch.Tensor, theirs: torch.Tensor, world: int, peer: int, rank: int,
                      seconds: float = RELEASE_ON_GPU_S, rounds: int = 2**31 - 1) -> None:
    "Launch `_release_kernel` (one program) on the current stream over signal pads `mine` (this rank's) and `theirs`."
    _release_kernel[(1,)](mine, theirs, mine.numel() // world, world, peer, rank, int(seconds * 1e6), rounds,
                          BLOCK=128, ON_GPU=not INTERPRETED)


@triton.jit
def _put_signal(pad_ptr, slot):
    "Raise flag `slot` of a rank's signal pad (0 -> 1), once the last raise was taken: our writes before it go first."
    while tl.atomic_cas(pad_ptr + slot, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def _take_signal(pad_ptr, slot):
    "Wait for flag `slot` of our own pad, and take it (1 -> 0): the raiser's writes before it are visible after."
    while tl.atomic_cas(pad_ptr + slot, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _handshake(pads_ptr, rank, channel, WORLD: tl.constexpr):
    """Program `channel` of every rank meets its namesakes: signal each peer p (slot channel * WORLD + rank of p's
    pad), then wait for each peer's signal (slot channel * WORLD + p of ours), PyTorch's kernels' protocol, which
    `release_waiters` plays for a dead rank."""
    for p in tl.static_range(WORLD):
        if p != rank:
            _put_signal(tl.load(pads_ptr + p).to(tl.pointer_type(tl.int32)), channel * WORLD + rank)
    mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            _take_signal(mine, channel * WORLD + p)


@triton.jit
def _all_reduce_add_rmsnorm_kernel(buffers_ptr, pads_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, offset, rows, H, eps,
                                   rank, WORLD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
                                   WAIT: tl.constexpr):
    """Rows of [rows, H] partial sums, one at element `offset` of each rank's symmetric buffer (`buffers_ptr`: their
    addresses): res_out = sum over ranks + res, out = rmsnorm(res_out) * w. A program a row at a time, after a
    handshake (no second one: see `SymmMemAllReduce.add_rmsnorm`)."""
    _let_next_start(PDL, WAIT)
    channel = tl.program_id(0)
    _handshake(pads_ptr, rank, channel, WORLD)  # every rank's partial sums are written
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    dtype = res_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(channel, rows, tl.num_programs(0)):
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
            part = tl.load(buffers_ptr + r).to(tl.pointer_type(dtype))
            total += tl.load(part + offset + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        # rounded as the unfused path rounds: the all-reduce's output, the new residual, the normalised row
        h = (total.to(dtype).to(tl.float32) + tl.load(res_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(dtype)
        tl.store(res_out_ptr + row * H + offs, h, mask=mask)
        h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        tl.store(out_ptr + row * H + offs, (w * (h * rstd).to(dtype).to(tl.float32)).to(dtype), mask=mask)


def all_reduce_add_rmsnorm(buffer_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, offset: int, rows: int,
                           residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           max_programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s + residual) * weight, s + residual), s the sum over the ranks of the [rows, H] messages at element
    `offset` of their symmetric buffers (addresses `buffer_ptrs`, signal pads `pad_ptrs`: int64, one a rank). Every
    rank calls it together; at most `max_programs` programs (a pad's slots for each peer)."""
    hidden = residual.shape[-1]
    if residual.shape != (rows, hidden) or not residual.is_contiguous() or weight.shape != (hidden,):
        raise ValueError(f"all_reduce_add_rmsnorm needs a contiguous residual [{rows}, H] and a weight [H], "
                         f"got {tuple(residual.shape)} and {tuple(weight.shape)}")
    out, res_out = torch.empty_like(residual), torch.empty_like(residual)
    block = _pow2(hidden)
    _all_reduce_add_rmsnorm_kernel[(max(1, min(rows, max_programs)),)](
        buffer_ptrs, pad_ptrs, residual, weight, out, res_out, offset, rows, hidden, eps, rank, WORLD=buffer_ptrs.numel(),
        BLOCK_H=block, **_pdl_args(residual.device, rows=rows), num_warps=min(8, max(1, block // 512)))
    return out, res_out


class SymmMemAllReduce:
    "Sum over the ranks of small CUDA tensors through peer memory (PyTorch symmetric memory). Every rank builds one, together."
    def __init__(self, group_name: str, device: torch.device, rank: int, world: int, max_bytes: int = SYMM_MEM_MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem
        self.group_name, self.device, self.rank, self.world, self.max_bytes = group_name, device, rank, world, max_bytes
        self.buffer = symm_mem.empty(2 * max_bytes, dtype=torch.uint8, device=device)  # two halves (`add_rmsnorm`)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)  # a collective: maps every peer's buffer here
        self.two_shot = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out")
        # every rank's buffer and signal pad, as this rank addresses them: what the fused kernel reads and signals
        if self.handle.buffer_ptrs[rank] != self.buffer.data_ptr():
            raise RuntimeError("the symmetric buffer does not start where the rendezvous says this rank's buffer starts")
        self.buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        mine = self.handle.get_signal_pad(rank, dtype=torch.int32)
        self.channels = mine.numel() // world  # slots a peer has in a pad: the programs of one kernel, at most
        # the release kernel compiled and loaded now, with nothing to do: after a failure its launch must not wait for
        # a compiler. Where it cannot run, only the release from the host is left (the fast path itself is unaffected)
        try:
            release_on_device(mine, mine, world, rank, rank, seconds=0.0, rounds=0)
            self.release_kernel_error = None
        except Exception as e:
            self.release_kernel_error = f"{type(e).__name__}: {e}"

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, half: int = 0) -> torch.Tensor | None:
        "The start of half `half` of the buffer as a tensor of this shape, where this path takes such a message (else None)."
        if not symm_mem_takes_shape(shape, dtype, self.max_bytes): return None
        start = half * self.max_bytes
        return self.buffer[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def _reduce(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        # each kernel ends with a handshake (every rank has read every buffer): the next message may be staged at once
        if staged.numel() * staged.element_size() <= ONE_SHOT_MAX_BYTES or not self.two_shot:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)

    def add_rmsnorm(self, staged: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(s + residual) * weight, s + residual), s the sum over the ranks of what each wrote into its
        `staging` view, in one kernel; None (nothing done) where `staged` is not such a view.
        The kernel handshakes once, before it reads: a rank may leave it while its peers still read its buffer. That
        is safe as long as consecutive calls alternate between the buffer's halves, as the output (half 0) and down
        (half 1) projections do: the next write into a half comes after the next call's handshake, and a peer that
        has reached that handshake has finished every kernel before it, its reads of the half included. (The
        embedding's all-reduce, PyTorch's kernel, stages in half 0 and handshakes again at its end.)"""
        start = staged.data_ptr() - self.buffer.data_ptr()
        if start not in (0, self.max_bytes): return None
        if staged.dim() != 2 or staged.shape != residual.shape or staged.dtype != residual.dtype:
            raise ValueError(f"a staged message {staged.dtype} {tuple(staged.shape)} cannot be added to a residual "
                             f"{residual.dtype} {tuple(residual.shape)}")
        return all_reduce_add_rmsnorm(self.buffer_ptrs, self.pad_ptrs, self.rank, start // staged.element_size(),
                                      staged.shape[0], residual.contiguous(), weight, eps, self.channels)

    def all_reduce_(self, x: torch.Tensor) -> bool:
        "Sum `x` over the ranks, in place; False (and nothing done) when `x` is not for this path."
        if not symm_mem_takes(x, self.max_bytes): return False
        self._reduce(self.staging(x.shape, x.dtype).copy_(x), x)
        return True

    def release_waiters(self, stop, launched: threading.Event | None = None) -> None:
        """After a rank died: until `stop()`, play every peer's side of the kernels' handshakes, so that none waits
        for ever. A kernel's block b signals peer p by setting slot b * world + rank of p's pad (0 -> 1), and
        waits until p has set slot b * world + p of its own pad (1 -> 0). First on the GPU (`_release_kernel`, for
        RELEASE_ON_GPU_S; `launched` is set once it is queued), then from here with small fills."""
        mine = self.handle.get_signal_pad(self.rank, dtype=torch.int32)
        peers = [p for p in range(self.world) if p != self.rank]
        theirs = [self.handle.get_signal_pad(p, dtype=torch.int32) for p in peers]
        if self.release_kernel_error is None:
            with torch.cuda.stream(torch.cuda.Stream(self.device)):  # a stream of its own: it runs for seconds
                for p, pad in zip(peers, theirs):
                    release_on_device(mine, pad, self.world, p, self.rank)
        if launched is not None: launched.set()
        mine, theirs = mine.view(-1, self.world), [pad.view(-1, self.world) for pad in theirs]
        stream = torch.cuda.Stream(self.device)  # beside the stream whose kernels wait
        with torch.cuda.stream(stream):
            while not stop():
                for p, pad in zip(peers, theirs):
                    mine[:, p].fill_(1)  # "p has arrived", in every block's slot
                    pad[:, self.rank].fill_(0)  # "p took our signal"
                stream.synchronize()
                time.sleep(0.001)


# PyTorch keeps its symmetric-memory registry per group *name* for the life of the process, and a
# destroyed group's name ("0" for the default group) comes back with the next group: a second
# rendezvous under it waits on the first group's store for ever (measured: a second engine in one
# process hung there). So a process sets the fast path up once; this set is that fact, not a cache.
_SYMM_MEM_GROUP_NAMES: set[str] = set()


def _symm_mem_unavailable(device: torch.device, world: int) -> str | None:
    "Why this rank cannot take the fast path (None: it can)."
    if all_reduce_choice() == "nccl":
        return f"{ALL_REDUCE_ENV}=nccl"
    if dist.group.WORLD.group_name in _SYMM_MEM_GROUP_NAMES:
        return (f"symmetric memory was set up for a group named {dist.group.WORLD.group_name!r} earlier in this process, "
                f"and PyTorch cannot set it up again under that name")
    if world not in (2, 4, 8): return f"the symmetric-memory kernels are built for 2, 4 or 8 ranks, not {world}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        torch.ops.symm_mem.one_shot_all_reduce_out
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this PyTorch has no symmetric-memory all-reduce ({type(e).__name__})"
    if not all(torch.cuda.can_device_access_peer(device.index, g) for g in range(world) if g != device.index):
        return "the GPUs cannot read each other's memory (no NVLink or PCIe peer access)"
    return None


def setup_all_reduce(model: ShardedTransformer) -> str:
    "Every rank together: the fast path for small all-reduces when every rank can take it. Says which path runs."
    reduce, world = model.all_reduce, model.plan.world
    device = next(model.parameters()).device
    if device.type != "cuda":
        reduce.path = f"torch.distributed ({dist.get_backend()}) for every all-reduce"
        return reduce.path
    # these all-reduces never use NVLink multicast: the allocator need not set it up
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    why = _symm_mem_unavailable(device, world)
    if _agree_min(int(why is None)):  # every rank can: build it together
        try:
            _SYMM_MEM_GROUP_NAMES.add(dist.group.WORLD.group_name)  # (tried: a failed rendezvous spoils the name too)
            reduce.fast = SymmMemAllReduce(dist.group.WORLD.group_name, device, model.plan.rank, world,
                                           symm_mem_buffer_bytes(model.plan.config.hidden_size, model.embed.weight.dtype))
        except Exception as e:  # (a rank that fails here may leave the others to the store's timeout)
            why = f"symmetric memory failed to set up: {type(e).__name__}: {e}"
        if not _agree_min(int(reduce.fast is not None)):
            reduce.fast, why = None, why or "symmetric memory failed to set up on another rank"
    else:
        why = why or "another rank cannot use symmetric memory"
    reduce.path = (f"symmetric memory up to {reduce.fast.max_bytes // 1024} KiB (one-shot up to "
                   f"{ONE_SHOT_MAX_BYTES // 1024} KiB, then {'two' if reduce.fast.two_shot else 'one'}-shot), NCCL above"
                   if reduce.fast is not None else f"NCCL for every all-reduce ({why})")
    if reduce.fast is not None and reduce.fast.release_kernel_error is not None:
        reduce.path += f"; after a failure released from the host only ({reduce.fast.release_kernel_error})"
    return reduce.path


# %% [markdown]
# Which messages the fast path takes (the CPU run at the end of the chapter says which path it took):

# %%
assert symm_mem_takes(torch.zeros(1, 2560, dtype=torch.bfloat16)) and symm_mem_takes(torch.zeros(256, 2560, dtype=torch.bfloat16))
assert not symm_mem_takes(torch.zeros(512, 2560, dtype=torch.bfloat16))  # 2.5 MiB: NCCL, with the smallest buffer
assert symm_mem_buffer_bytes(2560, torch.bfloat16) == 2.5 * 2**20 and symm_mem_buffer_bytes(5120, torch.bfloat16) == 5 * 2**20
assert symm_mem_buffer_bytes(64, torch.float32) == SYMM_MEM_MAX_BYTES  # (a tiny model: the floor)
assert symm_mem_takes(torch.zeros(512, 5120, dtype=torch.bfloat16), symm_mem_buffer_bytes(5120, torch.bfloat16))
assert not symm_mem_takes(torch.zeros(4, 8, dtype=torch.float16))  # no fp16 kernel
assert not symm_mem_takes(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes
assert not symm_mem_takes(torch.zeros(8, 8, dtype=torch.bfloat16).t())  # not contiguous
if INTERPRETED:  # the release kernel's slots (on a GPU it loops on the clock; here a few rounds): rank 0 of 2, peer 1
    # (the exported kernel: Triton's interpreter copies its own globals, `__file__` among them, into the kernel's, and
    # in this notebook's namespace that `__file__` would send the ranks spawned further down to run the interpreter)
    from forge_engine import tensor_parallel as exported
    mine, theirs = torch.zeros(10, 2, dtype=torch.int32), torch.ones(10, 2, dtype=torch.int32)
    exported.release_on_device(mine.view(-1), theirs.view(-1), 2, 1, 0, rounds=2)
    assert (mine[:, 1] == 1).all() and (mine[:, 0] == 0).all()  # "1 has arrived" in every block's slot, ours untouched
    assert (theirs[:, 0] == 0).all() and (theirs[:, 1] == 1).all()  # "1 took our signal"; its own slots untouched

# the path asked for in the environment: symmetric memory unless FORGE_TP_ALL_REDUCE=nccl; anything else is an error
for value, want in (("", "symmetric-memory"), ("NCCL", "nccl"), ("symmetric-memory", "symmetric-memory")):
    os.environ[ALL_REDUCE_ENV] = value
    assert all_reduce_choice() == want
os.environ[ALL_REDUCE_ENV] = "gloo"
try:
    all_reduce_choice()
    raise AssertionError("an unknown FORGE_TP_ALL_REDUCE was taken")
except ValueError as e:
    assert "FORGE_TP_ALL_REDUCE='gloo': expected one of symmetric-memory, nccl" in str(e), e
finally:
    del os.environ[ALL_REDUCE_ENV]

# %% [markdown]
# The fused kernel, run by two ranks: two processes forked from this one, over buffers and
# signal pads in shared CPU memory, under the interpreter (whose atomics are the machine's). Every
# rank gets the same bits, the sum and the norm are right, and every signal raised was taken
# (the pads are clean for the next kernel). Then rank 0 alone, its peer dead, released by
# `_release_kernel` playing the peer's side: it finishes.

# %%
if INTERPRETED:
    import multiprocessing
    from forge_engine.kernels import add_rmsnorm_reference
    world, rows, hidden, eps, channels = 2, 5, 40, 1e-6, 3  # 3 programs for 5 rows: programs take rows in turn
    g = torch.Generator().manual_seed(0)
    buffers = [torch.randn(2 * rows, hidden, generator=g).share_memory_() for _ in range(world)]  # two halves of 5 rows
    pads = [torch.zeros(channels * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    residual, weight = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    results = torch.zeros(world, 2, rows, hidden).share_memory_()
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers])  # (forked: the same addresses in every process)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads])

    def fused_rank(rank, halves=(1, 0)):  # (the last call's result kept)
        for half in halves:
            out, res_out = exported.all_reduce_add_rmsnorm(buffer_ptrs, pad_ptrs, rank, half * rows * hidden, rows,
                                                           residual, weight, eps, channels)
        results[rank, 0], results[rank, 1] = out, res_out

    def run_processes(targets, timeout=120):
        procs = [multiprocessing.get_context("fork").Process(target=t, args=a) for t, a in targets]
        for proc in procs: proc.start()
        for proc in procs: proc.join(timeout)
        hung = [proc.pid for proc in procs if proc.is_alive()]
        for proc in procs: proc.kill()
        assert not hung and all(proc.exitcode == 0 for proc in procs), (hung, [proc.exitcode for proc in procs])

    run_processes([(fused_rank, (r,)) for r in range(world)])
    want_residual = buffers[0][:rows] + buffers[1][:rows] + residual
    assert torch.equal(results[0], results[1])  # the same bits on both ranks
    torch.testing.assert_close(results[0, 1], want_residual, rtol=0, atol=0)  # (0 + b0 + b1) + residual: the same adds
    # (the default fp32 tolerance, rtol 1.3e-6: 40 squares summed in another order)
    torch.testing.assert_close(results[0, 0], add_rmsnorm_reference(want_residual, None, weight, eps)[0])
    assert all((pad == 0).all() for pad in pads)  # every raise taken
    results.zero_()

    def release_until_done():  # rank 1 dead: the release kernel plays its side, ten rounds a launch
        while results[0, 1].abs().sum() == 0: exported.release_on_device(pads[0], pads[1], world, 1, 0, rounds=10)

    run_processes([(fused_rank, (0, (0,))), (release_until_done, ())])
    torch.testing.assert_close(results[0, 1], want_residual, rtol=0, atol=0)  # (rank 1's buffer still holds its message)


# %% [markdown]
# ## Rank 0's side: workers, their pipes, and a watch on them
#
# **Why a pipe for the step descriptions.** The workers spend their idle time waiting for the
# next step. A `torch.distributed` receive waits at most its timeout (and a server may be idle
# for hours), while a `multiprocessing` pipe waits for ever and reports a dead peer at once
# (`EOFError` in a worker whose engine died, `BrokenPipeError` on rank 0's side). A step's
# message is a few hundred bytes of arrays (a few KB when many sequences are admitted at
# once). The *model's* collectives, which carry tensors, go through `torch.distributed`.
#
# **CUDA graphs before communicators.** A CUDA graph that recorded NCCL collectives holds a
# reference on the communicator, and (since NCCL 2.26) destroying *or aborting* the
# communicator waits until every such graph is destroyed. A process that leaves the group
# while its engine's decode graphs are still alive therefore hangs for ever. So every rank
# destroys its decode graphs first (`DecodeRunner.release_graphs`): a worker before it leaves,
# rank 0 for every runner it built, on `close()` and on failure alike.
#
# **Failure.** A watcher thread waits on the workers' process sentinels. When one dies, it
# records why, starts releasing the symmetric-memory kernels that wait for the dead rank (see
# *small all-reduces through peer memory*), destroys rank 0's decode graphs (a replay in
# flight finishes first), aborts the communicator (on NCCL) so that no NCCL call waits on the
# dead rank, and stops the others. From
# then on every `run` raises at once with that reason; the engine fails the step's requests,
# then every later step's, so each open request ends with an error and nothing hangs. A step
# that raises on rank 0 after the workers have started it poisons the group too: the ranks
# can no longer be trusted to meet in the same collective.
#
# **A step's GPU work.** On a GPU, `run` only *queues* the step: the engine samples, and does
# its host work, while the GPU computes (chapter 08). A collective aborted because a rank died
# returns early, with garbage in its output, and what follows it on the stream runs on that
# garbage; nothing on the GPU says so. What does say so is the order of events on rank 0: the
# watcher records the failure *before* it aborts anything, and an aborted collective can only
# end after the abort. So once a step's GPU work has ended, a group with no failure recorded ran
# it whole. `run` records an event after each step; the engine (chapter 08), once it has a
# step's tokens and before it applies them, calls `check_step()`, which waits for that step's
# event (free: the tokens came later on the same stream) and checks the group. So the step
# that was running when a rank died fails its requests there, each with the dead worker's
# exit code, and no token of it reaches them. Waiting for the GPU inside every `run`, as this
# chapter first did, cost each step the overlap of chapter 08.
#
# **Overlapped steps.** The engine launches step N+1 before it has read step N's tokens back
# (chapter 08); their places in step N+1's inputs hold a placeholder, in the step message too.
# Rank 0 then broadcasts those tokens, straight from its GPU, before the step's forward
# (`broadcast_pending`): one small NCCL call queued like the all-reduces, so no rank waits on
# the host, and each worker copies them into its inputs as rank 0 does. Measured on 2 H200s
# (`random:qwen3-4b`, TP=2, NCCL all-reduces): W1 355.2 tok/s and W2 15,958 tok/s with overlapped
# steps, against 262.7 and 9,893 without (an earlier build); so steps overlap under tensor
# parallelism by default too, as on one GPU. Against one GPU in one run: TP=2 W1 355.3 tok/s (2.81 ms a
# token) and W2 17,870 tok/s against one GPU's 330.3 (3.03 ms) and 13,872: a token comes sooner
# on two GPUs, but W2 is 1.29 times one GPU's, not twice. With the fast all-reduce path,
# the row-parallel outputs written into its buffer and the prefill kernel compiled once (chapter 09):
# TP=2 W1 417.9 tok/s and W2 21,417, against one GPU's W2 15,058 in the same call (1.42 times).
# Rank 0's GPU in a decode step of 256 sequences (`kernels_lab/tp_step_profile.py`, before the
# staging change): 7.88 ms at TP=2 against 10.38 at TP=1; the attention and the GEMMs split
# (5.77 → 3.19 and 3.43 → 2.05 ms), the collectives add 1.33 ms, and the rest (sampling over the
# whole vocabulary on rank 0, the norms, the embedding) does not split. (When a worker is killed while steps
# overlap, rank 0 may find its pipe broken first; the requests fail with the dead worker's exit
# code, or, where none is found dead within the wait, naming the worker whose pipe broke.)
#
# **One engine at a time.** A worker keeps the runner (KV pool, graphs, mirrors) of the newest
# engine built on the model; an older engine's runner on rank 0 refuses to run a step.
#
# **Shutdown.** `close()` asks the workers to stop, destroys the graphs, leaves the group (the
# workers leave at the same time), then waits for the workers and terminates whatever is
# left. When the handle is garbage collected or the interpreter exits (`weakref.finalize`),
# the workers are terminated. The workers are daemonic, so they cannot outlive a rank 0 that
# exits normally, and a worker whose pipe breaks (rank 0 killed) exits.
#
# **Where a hang is.** With `FORGE_TP_STACKS=S` in the environment, every rank dumps its
# Python stacks (all threads) on `SIGUSR1`, and a worker dumps them by itself when one message
# (loading, building an engine, a step, leaving) takes more than `S` seconds.

# %%
#| export
class TensorParallelError(RuntimeError):
    "A worker process died (or a step failed midway): the tensor-parallel group cannot run any more steps."


STACKS_ENV = "FORGE_TP_STACKS"


def _stack_dump_seconds() -> float | None:
    "With FORGE_TP_STACKS=S: Python stacks on SIGUSR1 from now on, and S (None without it)."
    seconds = os.environ.get(STACKS_ENV)
    if not seconds or sys.__stderr__ is None: return None
    if hasattr(signal, "SIGUSR1"):  # (the process's own stderr: a test runner may have swapped sys.stderr)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    return float(seconds)


@contextmanager
def _stacks_if_slower_than(seconds: float | None):
    "Dump every thread's stack (to stderr) every `seconds` while the block runs (nothing when None)."
    if seconds is None:
        yield
        return
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _stop_workers(processes, timeout: float = 10.0) -> None:
    "Terminate every worker still running and wait for it."
    for p in processes:
        if p.is_alive(): p.terminate()
    for p in processes:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()


def _abort_collectives(backend: str, wait_s: float = 30.0) -> None:
    """Make a collective that waits on a dead rank return (NCCL; gloo notices a closed socket by itself).
    The abort raises NCCL's abort flag at once, then reclaims the communicator; it runs on a helper
    thread so that a slow reclaim cannot hold up the caller past `wait_s`."""
    if backend != "nccl" or not dist.is_initialized(): return
    def abort():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # best effort: the failure is already recorded
            pass
    helper = threading.Thread(target=abort, name="forge-tp-abort", daemon=True)
    helper.start()
    helper.join(wait_s)


class _Group:
    "What rank 0's handle, its watcher thread and its finalizer share (not the handle itself: it must stay collectable)."
    def __init__(self, processes, backend: str, fast: SymmMemAllReduce | None = None):
        self.processes, self.backend, self.fast = processes, backend, fast
        self.failure: str | None = None
        self.closing = False
        self.lock = threading.Lock()
        # one thread reaps at a time: a second waitpid on a child another thread is reaping finds none (ECHILD),
        # and `exitcode` then says None, so a report raced by the watcher lost the dead worker's exit code
        self.reaping = threading.Lock()
        self.graph_owners = weakref.WeakSet()  # rank 0's decode runners: their graphs hold NCCL collectives
        self.releaser: threading.Thread | None = None

    def check(self) -> None:
        if self.failure is not None: raise TensorParallelError(self.failure)
        if self.closing: raise TensorParallelError("the tensor-parallel group is closed")

    def release_graphs(self) -> None:
        for runner in list(self.graph_owners): runner.release_graphs()

    def death_report(self, wait_s: float = 0.0) -> str | None:
        "Which worker died and how, waiting up to `wait_s` for a dying one to be reaped; None when all live."
        from multiprocessing.connection import wait
        ended = wait([p.sentinel for p in self.processes], timeout=wait_s)
        with self.reaping:
            for p in self.processes:  # an exiting worker's pipe closes a moment before it can be reaped: wait that out
                if p.sentinel in ended: p.join()  # (or rank 0, failing at the same moment, names the socket, not it)
            dead = next((p for p in self.processes if p.exitcode is not None), None)
        return None if dead is None else f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"

    def fail(self, why: str) -> None:
        "Record the first failure, then: graphs, abort, stop the workers (in that order: see above). Once."
        with self.lock:
            if self.failure is not None or self.closing: return
            self.failure = why
            if self.fast is not None:  # symmetric-memory kernels waiting for the dead rank: let them finish
                launched = threading.Event()
                self.releaser = threading.Thread(target=self.fast.release_waiters, args=(lambda: self.closing, launched),
                                                 name="forge-tp-release", daemon=True)
                self.releaser.start()
                launched.wait(RELEASE_LAUNCH_WAIT_S)  # the release kernel queued before anything here may block launches
            self.release_graphs()
            _abort_collectives(self.backend)
            _stop_workers(self.processes)


def _watch_workers(group: _Group) -> None:
    while not group.closing:
        report = group.death_report(wait_s=0.5)
        if report is not None:
            group.fail(report)
            return


def _finalize_group(group: _Group) -> None:
    group.closing = True
    _stop_workers(group.processes)


class TensorParallel:
    "Rank 0's handle on the other ranks: sends them work, watches them, stops them."
    def __init__(self, model: ShardedTransformer, processes, pipes, backend: str):
        self.model, self.processes, self.pipes, self.backend = model, processes, pipes, backend
        self.world = model.plan.world
        self.all_reduce_path = model.all_reduce.path  # which path the model's all-reduces take, in words
        self.group = _Group(processes, backend, model.all_reduce.fast)
        self.engines = 0  # engines built: the workers keep the newest one's runner only
        self._watcher = threading.Thread(target=_watch_workers, args=(self.group,), name="forge-tp-watch", daemon=True)
        self._watcher.start()
        self._finalize = weakref.finalize(self, _finalize_group, self.group)

    def send(self, kind: str, payload=None) -> None:
        "Send one message to every worker."
        self.group.check()
        message = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe, process in zip(self.pipes, self.processes):
            try:
                pipe.send_bytes(message)
            except OSError as e:  # (when no worker is found dead within _fail's wait, this names the one)
                self._fail(f"tensor-parallel worker {process.name} (pid {process.pid}) is gone: its pipe broke "
                           f"({type(e).__name__}: {e})")

    def _fail(self, why: str):
        "Record the failure (a dead worker's exit code when one died: the root cause), stop the rest, raise."
        # a killed GPU worker can take seconds to exit (its CUDA context is torn down): wait to name the cause
        self.group.fail(self.group.death_report(wait_s=10.0) or why)
        self.group.check()

    def _collective(self, kind: str, payload, work):
        "Run `work` here while the workers run the same message: collectives inside meet."
        self.send(kind, payload)
        try:
            return work()
        except Exception as e:
            try:
                self._fail(f"tensor-parallel {kind} failed on rank 0: {type(e).__name__}: {e}")
            except TensorParallelError as failure:
                raise failure from e

    def build_runner(self, config: EngineConfig) -> "ParallelRunner":
        "Every rank builds its KV pool and decode graphs; the number of blocks is the smallest any rank can hold."
        runner = self._collective("engine", config, lambda: build_runner(self.model, config, _agree_min))
        if runner.decode is not None: self.group.graph_owners.add(runner.decode)
        self.engines += 1
        return ParallelRunner(runner, self, self.engines)

    def time_collectives(self, batch: int, repeats: int = 20) -> dict[str, float]:
        "Seconds per decode step of its all-reduces and of its logits all-gather at `batch` sequences (see above)."
        p = next(self.model.parameters())
        args = (self.model.plan.config, self.world, batch, p.device, p.dtype, repeats)
        return self._collective("time_collectives", args, lambda: time_collectives(*args, self.model.all_reduce))

    def close(self) -> None:
        "Stop the workers, destroy the decode graphs, leave the process group (see Shutdown above)."
        if self._finalize.alive:
            with self.group.lock:  # a failure being handled finishes first; later ones are ours, not failures
                self.group.closing = True
            for pipe in self.pipes:
                try: pipe.send_bytes(pickle.dumps(("stop", None)))
                except OSError: pass
            self._watcher.join(5.0)
            if self.group.releaser is not None: self.group.releaser.join(5.0)
            self.group.release_graphs()
            if dist.is_initialized() and (self.group.failure is None or self.backend != "nccl"):
                dist.destroy_process_group()  # while the workers leave too (a failed NCCL group was aborted instead)
            for p in self.processes: p.join(15.0)  # a clean exit; whoever is still there is then terminated
            self._finalize()

    @property
    def alive(self) -> bool: return self._finalize.alive and self.group.failure is None


class ParallelRunner:
    "Rank 0's runner: sends each step (what changed since the last one) to the workers, then runs its own part of it."
    def __init__(self, runner: ModelRunner, parallel: TensorParallel, engine_number: int):
        self.inner, self.parallel, self.engine_number = runner, parallel, engine_number
        self.cache, self.decode = runner.cache, runner.decode
        self.writer = StepWriter()
        self.step_ends: deque[torch.cuda.Event] = deque()  # the end of each launched step's GPU work, oldest first

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None: return self.inner.greedy_tokens(logits)

    def run(self, plan, pending: PendingTokens | None = None) -> torch.Tensor:
        if self.engine_number != self.parallel.engines:
            raise TensorParallelError("a newer engine was built on this tensor-parallel model: this one cannot run steps")
        self.parallel.group.check()
        unread = pending.inputs_of(plan.scheduled) if pending is not None else None
        def step():
            if unread: broadcast_pending(pending.token_ids[to_device(torch.tensor(unread[1]), pending.token_ids.device)])
            return self.inner.run(plan, pending)
        logits = self.parallel._collective("step", self.writer.encode(plan, unread[0] if unread else ()), step)
        if logits.is_cuda:  # no wait here: the engine samples while the GPU still runs this step
            self.step_ends.append(torch.cuda.Event())
            self.step_ends[-1].record(torch.cuda.current_stream(logits.device))
        self.parallel.group.check()
        return logits

    def check_step(self) -> None:
        """Raise if the group failed before the oldest unchecked step's GPU work ended (see *a step's GPU work* above).
        The engine calls it once it has that step's tokens, which came after it on the same stream: the wait is free."""
        if self.step_ends: self.step_ends.popleft().synchronize()
        self.parallel.group.check()


def _agree_min(n: int) -> int:
    "The smallest `n` of all ranks (an all-reduce with MIN): the number of KV blocks every rank can hold, a yes from all."
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# %% [markdown]
# ## Starting the ranks
#
# Rank 0 opens a `TCPStore` on a free port, starts ranks 1..N-1 (spawned: a fresh
# interpreter, as CUDA requires), and all join one process group: NCCL on CUDA, gloo on the
# CPU. Rank `r` uses GPU `r`. Each rank then loads its slices at the same time.

# %%
#| export
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)  # startup, loading and one step at most


@dataclass(frozen=True)
class _WorkerSpec:
    resolved: ResolvedModel
    config: ModelConfig
    world: int
    device_type: str
    dtype: torch.dtype
    seed: int
    store_port: int


def _rank_device(device_type: str, rank: int) -> torch.device:
    if device_type != "cuda": return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _join_group(spec: _WorkerSpec, rank: int, store) -> None:
    dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=spec.world, timeout=COLLECTIVE_TIMEOUT)


def _worker_main(rank: int, spec: _WorkerSpec, pipe) -> None:
    "Ranks 1..N-1: join, load this rank's slices, then run what rank 0 sends until it says stop."
    if spec.device_type == "cpu":  # the ranks share the CPU cores
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    slow = _stack_dump_seconds()
    device = _rank_device(spec.device_type, rank)
    runner, stopped = None, False
    try:
        with _stacks_if_slower_than(slow):
            _join_group(spec, rank, dist.TCPStore("127.0.0.1", spec.store_port, spec.world, is_master=False))
            model = load_shard(spec.resolved, ShardPlan(spec.config, rank, spec.world), device, spec.dtype, spec.seed)
            dist.barrier()  # loaded
            setup_all_reduce(model)
            if model.all_reduce.fast is not None: _exit_when_orphaned()
        while True:
            kind, payload = pickle.loads(pipe.recv_bytes())  # EOFError when rank 0 is gone: we leave
            if kind == "stop":
                stopped = True
                break
            with torch.no_grad(), _stacks_if_slower_than(slow):
                if kind == "engine":
                    _release(runner)
                    runner = None  # free the previous engine's pool first
                    runner, reader = build_runner(model, payload, _agree_min), StepReader()
                elif kind == "step":
                    plan = reader.decode(payload)
                    runner.run(plan, received_pending(plan, device) if plan.unread else None)
                elif kind == "time_collectives":
                    time_collectives(*payload[:3], device, *payload[4:], model.all_reduce)
    finally:
        _release(runner)  # graphs first: NCCL will not destroy a communicator they still use
        if stopped:  # otherwise rank 0 is gone, or this rank failed: the other ranks cannot be met, just exit
            with _stacks_if_slower_than(slow):
                dist.destroy_process_group()


def _exit_when_orphaned() -> None:
    "A background thread that ends this worker when rank 0's process ends (its kernels may wait for rank 0 for ever)."
    import multiprocessing
    def watch(parent):
        from multiprocessing.connection import wait
        wait([parent.sentinel])
        print(f"{multiprocessing.current_process().name}: rank 0 is gone; exiting", file=sys.__stderr__, flush=True)
        os._exit(1)
    parent = multiprocessing.parent_process()
    if parent is not None: threading.Thread(target=watch, args=(parent,), name="forge-tp-orphan", daemon=True).start()


def _release(runner: ModelRunner | None) -> None:
    if runner is not None and runner.decode is not None: runner.decode.release_graphs()


def load_model_parallel(name: str, device: str | None = None, dtype: str | torch.dtype | None = None, seed: int = 0,
                        world: int = 2) -> LoadedModel:
    """`load_model` (chapter 04a) split over `world` processes: start ranks 1..world-1, load rank 0's slices here,
    and return rank 0's model with the handle on the others."""
    import torch.multiprocessing as mp
    device = resolve_device(device)
    dtype, resolved = resolve_dtype(dtype, device), resolve(name)
    if world < 1: raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; torch sees {torch.cuda.device_count()}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not {device.type!r}")
    if dist.is_initialized():
        raise ValueError("this process already belongs to a tensor-parallel group: close the other model first "
                         "(loaded.parallel.close())")
    all_reduce_choice()  # a bad FORGE_TP_ALL_REDUCE fails here, before any process starts
    config = model_config_of(resolved)
    plan = ShardPlan(config, 0, world)  # checks divisibility before any process starts
    stats, start = LoadStats(rss_before_bytes=rss_bytes()), time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    spec = _WorkerSpec(resolved, config, world, device.type, dtype, seed, store.port)
    ctx = mp.get_context("spawn")
    processes, pipes = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker_main, args=(rank, spec, ours), name=f"forge-tp-rank{rank}", daemon=True)
        p.start()
        ours.close()
        processes.append(p)
        pipes.append(theirs)
    _stack_dump_seconds()  # (workers time their messages; rank 0 only dumps on SIGUSR1)
    try:
        device = _rank_device(device.type, 0)
        _join_group(spec, 0, store)
        model = load_shard(resolved, plan, device, dtype, seed, stats=stats)
        dist.barrier()  # every rank has loaded
        setup_all_reduce(model)
    except BaseException:
        _stop_workers(processes)
        if dist.is_initialized(): dist.destroy_process_group()
        raise
    tokenizer = None
    if resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile
        tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(resolved.path).metadata)
    if resolved.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(resolved.tokenizer_path)
    finish_stats(stats, model, start, device)
    parallel = TensorParallel(model, processes, pipes, dist.get_backend())
    return LoadedModel(resolved.name, model, tokenizer, stats, parallel=parallel, metadata=describe_model(resolved))


# %% [markdown]
# ## Two ranks on the CPU
#
# `random:llama-tiny` (6 query heads and 2 KV heads: 3 and 1 per rank; an untied LM head) in
# one process and over two (gloo). The engine, scheduler and sampler are the same objects;
# only the model and the runner underneath are split. Greedy tokens and their
# log-probabilities agree (the partial sums are added in a different order, so to fp32
# rounding, not bit for bit).

# %%
from forge_engine.engine import LLMEngine
from forge_engine.loader import load_model
from forge_engine.tensor_parallel import load_model_parallel  # the module's: spawned workers find their code there

def run_all(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished: finals[out.request_id] = out
    return [finals[i] for i in ids]

prompts = [[5, 6, 7], list(range(100, 130)), [9] * 11]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
small = dict(kv_cache_bytes=2**20, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, cuda_graphs=True)
alone = run_all(LLMEngine(load_model("random:llama-tiny", "cpu", progress=False), EngineConfig(**small)), prompts, greedy)
split = load_model_parallel("random:llama-tiny", "cpu", world=2)
engine = LLMEngine(split, EngineConfig(**small, tensor_parallel_size=2))
together = run_all(engine, prompts, greedy)
for a, b in zip(alone, together):
    print(a.token_ids, "\n", b.token_ids)
    assert a.token_ids == b.token_ids
    # fp32: the ranks' partial sums added after: a few roundings of 2^-24 on logprobs up to ~11 (measured 9.5e-7)
    assert all(abs(x[t] - y[t]) < 1e-5 for x, y in zip(a.logprobs, b.logprobs) for t in x)
engine.allocator.check_idle()
print("all-reduces:", split.parallel.all_reduce_path)
assert split.parallel.all_reduce_path.startswith("torch.distributed (gloo)")
times = split.parallel.time_collectives(1)
print(f"gloo on this CPU, one decode step at batch 1: all-reduces {times['all_reduce_s'] * 1e3:.2f} ms, "
      f"logits all-gather {times['all_gather_s'] * 1e3:.2f} ms")
assert times["all_reduce_s"] > 0 and times["all_gather_s"] > 0

# %% [markdown]
# Closing stops the worker; nothing is left behind.

# %%
workers = split.parallel.processes
split.parallel.close()
assert workers and not any(p.is_alive() for p in workers)
print("worker exit codes:", [p.exitcode for p in workers])
assert not split.parallel.alive
