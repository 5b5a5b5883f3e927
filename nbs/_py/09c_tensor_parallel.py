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
#| default_exp tensor_parallel.shards

# %%
#| export
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from forge_engine.config import ModelConfig
from forge_engine.fused_layers import FusedRMSNorm, linear
from forge_engine.loader import random_checkpoint
from forge_engine.loading import (
    LoadStats,
    TensorEntry,
    checkpoint_shards,
    read_safetensors_header,
    read_tensor,
)
from forge_engine.model import Transformer, checkpoint_target, load_weights
from forge_engine.registry import ResolvedModel

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
    "self_attn.q_proj": (0, "q"),
    "self_attn.k_proj": (0, "kv"),
    "self_attn.v_proj": (0, "kv"),
    "self_attn.o_proj": (1, "q"),
    "mlp.gate_proj": (0, "mlp"),
    "mlp.up_proj": (0, "mlp"),
    "mlp.down_proj": (1, "mlp"),
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
        for what, size in (
            ("num_heads", c.num_heads),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        ):
            if size % n:
                raise ValueError(
                    f"tensor_parallel_size {n} does not divide the model's {what} ({size})"
                )
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {n} and the model's {c.num_kv_heads} KV heads: one must divide the other"
            )

    @property
    def kv_heads(self) -> range:
        "This rank's KV heads: its share, or (fewer KV heads than ranks) the one its query heads use."
        kv, n, r = self.config.num_kv_heads, self.world, self.rank
        return (
            range(r * kv // n, (r + 1) * kv // n)
            if kv >= n
            else range(r * kv // n, r * kv // n + 1)
        )

    @property
    def shard_config(self) -> ModelConfig:
        c, n = self.config, self.world
        return c.replace(
            num_heads=c.num_heads // n,
            num_kv_heads=len(self.kv_heads),
            intermediate_size=c.intermediate_size // n,
        )

    @property
    def vocab_part(self) -> int:
        return self.config.vocab_size // self.world

    def _range(self, which: str) -> tuple[int, int]:
        c, r, n = self.config, self.rank, self.world
        if which == "q":
            return r * c.q_size // n, (r + 1) * c.q_size // n
        if which == "kv":
            return self.kv_heads.start * c.head_dim, self.kv_heads.stop * c.head_dim
        if which == "mlp":
            return r * c.intermediate_size // n, (r + 1) * c.intermediate_size // n
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


def shard_tensors(
    plan: ShardPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
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
assert (
    p1.shard_config.num_heads,
    p1.shard_config.num_kv_heads,
    p1.shard_config.intermediate_size,
) == (16, 4, 4864)
assert p1.slice_for("model.layers.3.self_attn.q_proj.weight") == (0, 2048, 4096)
assert p1.slice_for("model.layers.3.self_attn.k_proj.weight") == (0, 512, 1024)
assert p1.slice_for("model.layers.3.self_attn.o_proj.weight") == (1, 2048, 4096)
assert p1.slice_for("model.layers.3.mlp.down_proj.weight") == (1, 4864, 9728)
assert p1.slice_for("model.embed_tokens.weight") == (0, 75968, 151936)
assert p1.slice_for("model.layers.3.input_layernorm.weight") is None
one_kv = preset("qwen2-tiny")  # 4 heads, 1 KV head
assert [ShardPlan(one_kv, r, 2).kv_heads for r in (0, 1)] == [range(0, 1), range(0, 1)]
assert [ShardPlan(q4b, r, 16).kv_heads for r in (0, 1, 2, 15)] == [
    range(0, 1),
    range(0, 1),
    range(1, 2),
    range(7, 8),
]
with pytest.raises(ValueError, match="does not divide the model's num_heads"):
    ShardPlan(preset("llama-tiny"), 0, 4)  # 6 heads

# %% [markdown]
# The algebra, without any processes: split one layer's weights per the plan, run each
# rank's piece, and add the partial outputs of the row-parallel projections (what the
# all-reduce does). The result is the unsplit layer's, to rounding.

# %%
cfg = preset("llama-tiny")  # 6 heads, 2 KV heads, hidden 48
full = init_random_weights(empty_model(cfg), seed=3, std=0.2)
x, pos = (
    torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0)),
    torch.arange(5),
)
cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
no_cache = lambda layer, q, k, v: causal_attention(q, k, v)
want_attn, want_mlp = full.layers[0].attn(x, cos, sin, no_cache), full.layers[0].mlp(x)
got_attn = got_mlp = 0
for rank in range(2):
    plan = ShardPlan(cfg, rank, 2)
    part = empty_model(
        plan.shard_config
    )  # plain modules, no all-reduce: we add the partial outputs by hand
    tensors = dict(shard_tensors(plan, hf_state_dict(full).items()))
    tensors.update(
        {
            n: t
            for n, t in hf_state_dict(full).items()
            if n in ("model.embed_tokens.weight", "lm_head.weight")
        }
    )
    load_weights(
        part, tensors.items()
    )  # (the vocabulary stays whole here: a plain embedding has no all-reduce)
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

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, half: int = 0
    ) -> torch.Tensor | None:
        """Where the fast path stages a message of this shape (a layer may write its output there: no copy), in half
        `half` (0 or 1) of its buffer; None where it does not take such a message."""
        return self.fast.staging(shape, dtype, half) if self.fast is not None else None

    def add_rmsnorm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        "The fast path's all-reduce + residual add + RMSNorm in one kernel, where it staged `partial`; else None."
        return (
            self.fast.add_rmsnorm(partial, residual, weight, eps) if self.fast is not None else None
        )


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
        return linear(
            x,
            self.weight,
            out=self.all_reduce.staging((*x.shape[:-1], self.out_features), x.dtype, self.half),
        )


class ReducingRMSNorm(FusedRMSNorm):
    """The norm after a row-parallel layer: `add_and_norm` gets that layer's partial output, sums it over the ranks,
    adds the residual and normalises. One kernel where the fast path staged the message; else an all-reduce first,
    then chapter 09a's fused add + norm (its PyTorch path on a CPU)."""

    def __init__(self, dim: int, eps: float, all_reduce: AllReduce):
        super().__init__(dim, eps)
        self.all_reduce = all_reduce

    def add_and_norm(
        self, partial: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.all_reduce.add_rmsnorm(partial, residual, self.weight, self.eps)
        return (
            fused if fused is not None else super().add_and_norm(self.all_reduce(partial), residual)
        )


class VocabParallelEmbedding(nn.Embedding):
    "This rank's rows of the embedding; ids outside them give zeros, and an all-reduce fills in the rest."

    def __init__(self, vocab_start: int, vocab_part: int, hidden: int, all_reduce: AllReduce):
        super().__init__(vocab_part, hidden)
        self.vocab_start, self.all_reduce = vocab_start, all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        return self.all_reduce(
            F.embedding(torch.where(mine, local, 0), self.weight)
            * mine[:, None].to(self.weight.dtype)
        )


def _agree_min(n: int) -> int:
    "The smallest `n` of all ranks (an all-reduce with MIN): the number of KV blocks every rank can hold, a yes from all."
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_gather_columns(
    x: torch.Tensor, world: int, group=None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[n, v] on every rank -> [n, world * v] (in `dtype`, default x's): rank r's columns at r * v (the logits row put
    back together)."""
    x = x.contiguous()
    out = x.new_empty(world, *x.shape)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=group)  # one NCCL call, safe inside a CUDA graph
    else:
        dist.all_gather(list(out.unbind(0)), x, group=group)
    rows = torch.empty(x.shape[0], world, x.shape[1], dtype=dtype or x.dtype, device=x.device)
    return rows.copy_(out.permute(1, 0, 2)).view(
        x.shape[0], world * x.shape[1]
    )  # one copy: reorder and convert


class ShardedTransformer(Transformer):
    "Rank `plan.rank`'s part of the model: the shard config's layers, with the parallel modules swapped in."

    def __init__(self, plan: ShardPlan, group=None):
        super().__init__(plan.shard_config)
        self.plan, self.group = plan, group
        self.all_reduce = AllReduce(
            group
        )  # one for every layer: the fast path is set up once, for all of them
        c = plan.shard_config
        self.embed = VocabParallelEmbedding(
            plan.rank * plan.vocab_part, plan.vocab_part, c.hidden_size, self.all_reduce
        )
        if self.lm_head is not None:
            self.lm_head = nn.Linear(c.hidden_size, plan.vocab_part, bias=False)
        for layer in self.layers:
            layer.attn.o = RowParallelLinear(c.q_size, c.hidden_size, self.all_reduce, half=0)
            layer.mlp.down = RowParallelLinear(
                c.intermediate_size, c.hidden_size, self.all_reduce, half=1
            )
            # the norms that take their outputs (the next layer's attn_norm, and the final norm, take down's)
            layer.attn_norm, layer.mlp_norm = (
                ReducingRMSNorm(c.hidden_size, c.rms_norm_eps, self.all_reduce) for _ in range(2)
            )
        self.norm = ReducingRMSNorm(c.hidden_size, c.rms_norm_eps, self.all_reduce)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        "hidden [N, hidden] -> the whole logits [N, vocab] in fp32, on every rank."
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return all_gather_columns(
            linear(hidden, weight), self.plan.world, self.group, torch.float32
        )


def empty_sharded_model(
    plan: ShardPlan, device="cpu", dtype=torch.float32, group=None
) -> ShardedTransformer:
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
def read_checkpoint_shard(
    directory, plan: ShardPlan, stats: LoadStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    "Yield (hf_name, this rank's slice) for every tensor the model uses; row slices read only their bytes."
    files = [(path, read_safetensors_header(path)) for path in checkpoint_shards(directory)]
    staging = torch.empty(
        max((e.nbytes for _, entries in files for e in entries), default=0), dtype=torch.uint8
    )
    stats = stats if stats is not None else LoadStats()
    for path, entries in files:
        with open(path, "rb") as f:
            for entry in entries:
                if checkpoint_target(plan.config, entry.name) is None:
                    continue  # tied lm_head, inv_freq
                cut = plan.slice_for(entry.name)
                if cut is not None and cut[0] == 0:  # rows: a contiguous byte range of the file
                    row_bytes = entry.nbytes // entry.shape[0]
                    entry = TensorEntry(
                        entry.name,
                        entry.dtype,
                        (cut[2] - cut[1], *entry.shape[1:]),
                        entry.begin + cut[1] * row_bytes,
                        (cut[2] - cut[1]) * row_bytes,
                    )
                    cut = None
                tensor = read_tensor(f, entry, staging)
                stats.bytes_read += entry.nbytes
                stats.tensors += 1
                yield (
                    entry.name,
                    tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1]),
                )


def load_shard(
    resolved: ResolvedModel,
    plan: ShardPlan,
    device,
    dtype: torch.dtype,
    seed: int = 0,
    group=None,
    stats: LoadStats | None = None,
) -> ShardedTransformer:
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
#
