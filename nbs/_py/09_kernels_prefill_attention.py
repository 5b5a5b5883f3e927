# %% [markdown]
# # Kernels: prefill attention, and the attention backends
#
# > Varlen causal prefill attention over the paged pool, and the attention backends that run chapter 09_kernels_paged_attention's decode kernel and this one for the engine; what they are worth, measured.

# %%
#| default_exp kernels.prefill_attention

# %%
#| export
import math
from typing import Sequence

import torch

from forge_engine.kernels.backend import (
    INTERPRETED,
    _dot_precision,
    _pow2,
    _stages,
    kernel_backend,
    tl,
    triton,
)
from forge_engine.kernels.elementwise import NormRope
from forge_engine.kernels.paged_attention import (
    _attend_keys,
    _check_attention_args,
    paged_attention_reference,
    paged_decode_attention,
)

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.kernels.elementwise import add_rmsnorm, add_rmsnorm_reference
from forge_engine.kernels.paged_attention import random_paged_kv

gen = torch.Generator().manual_seed(4)

# %% [markdown]
# ## Prefill attention over the varlen batch
#
# Many query tokens per sequence, causal. A program takes `BLOCK_M` consecutive new tokens of
# one sequence and *all* the query heads of one KV head: its rows are (token, head in group)
# pairs, so the K/V tiles it reads serve `BLOCK_M x group` rows (the same GQA packing as decode).
# It walks the keys from 0 to the position of its last token; the causal mask cuts the rest.
# Which tiles exist is a *tile map*: tile i is (sequence, first token), one program per tile and
# KV head. The engine builds the exact map on the host, where it knows each sequence's new tokens;
# a map may also hold more tiles than the step needs, padded with sequence -1, whose programs
# return at once: that is what lets one CUDA graph serve every step of up to T tokens and S
# sequences (chapter 09b). `kernels_lab/prefill_attention.py` has the naive one-row-per-program
# version and a one-head-per-program tiled one this beat.
#
# Triton compiles a kernel once per *specialisation* of its integer arguments: a value of 1, or a
# multiple of 16, each get their own compiled code. The block table's row stride is its width,
# which follows the longest sequence of the step: 1 in a warm-up of short prompts, then a multiple
# of 16 or not in a real batch, so the first steps of a run compiled the kernel twice more, over a
# second each, inside the run (two H200s: a W2 run's prefill steps of 1.48 s and 1.31 s
# against ~0.1 s). `do_not_specialize` keeps one compiled kernel for every width. Pointers are
# specialised too, on whether their address is a multiple of 16 bytes: the step's small inputs
# (query starts, context lengths, the tile map) are views into one copied buffer at offsets that
# change with the number of sequences, and a W2 run on an H200 met a new combination in its
# second step (991 ms against ~100 ms). They are read one number at a time, so they are not
# specialised either.

# %%
#| export
PREFILL_ROWS = 64  # rows of a program's query tile: tokens x heads of the group
PREFILL_BLOCK_N = 64  # keys per tile


@triton.jit(
    do_not_specialize=[
        "stride_tb",
        "tables_ptr",
        "query_start_ptr",
        "context_lens_ptr",
        "tile_seq_ptr",
        "tile_first_ptr",
    ]
)  # the table's width and the small inputs' alignment change from step to step: one kernel for all
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    if seq < 0:  # a padding tile of a map sized for more tokens than this step has
        return
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    if first >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = first + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (token < q_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = row_mask[:, None] & d_mask[None, :]
    row_t = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    row_pos = ctx - q_len + token
    full_end = (
        (ctx - q_len + first) // BLOCK_N * BLOCK_N
    )  # keys every row of the tile sees: no mask
    end = tl.minimum(ctx, ctx - q_len + first + BLOCK_M)  # one past the last token's position
    k_ptr, v_ptr, tables_ptr = (
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_kh,
        tables_ptr + seq * stride_tb,
    )
    acc, m_i, l_i = _attend_keys(
        q,
        row_pos,
        acc,
        m_i,
        l_i,
        k_ptr,
        v_ptr,
        tables_ptr,
        0,
        full_end,
        stride_kb,
        stride_kt,
        offs_d,
        d_mask,
        qk_scale,
        False,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    acc, m_i, l_i = _attend_keys(
        q,
        row_pos,
        acc,
        m_i,
        l_i,
        k_ptr,
        v_ptr,
        tables_ptr,
        full_end,
        end,
        stride_kb,
        stride_kt,
        offs_d,
        d_mask,
        qk_scale,
        True,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + row_t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def prefill_block_m(q_heads: int, kv_heads: int, rows: int = PREFILL_ROWS) -> int:
    "Tokens of one tile: `rows` (token, head) rows of a KV head's group; tensor-core tiles need >= 16 rows."
    group_pad = _pow2(q_heads // kv_heads)
    return max(1, rows // group_pad, -(-16 // group_pad))


def prefill_tiles(
    num_new: Sequence[int], block_m: int, num_tiles: int | None = None
) -> torch.Tensor:
    """The tile map of a step whose sequences have `num_new` new tokens: [2, N] int32 on the host, row 0 the
    sequence (-1: a padding tile), row 1 its first token. N is the tiles needed, or `num_tiles` (padded)."""
    seqs = [b for b, n in enumerate(num_new) for _ in range(-(-n // block_m))]
    firsts = [t * block_m for n in num_new for t in range(-(-n // block_m))]
    size = len(seqs) if num_tiles is None else num_tiles
    if size < len(seqs):
        raise ValueError(
            f"the step needs {len(seqs)} tiles of {block_m} tokens, the map has {size}"
        )
    tiles = torch.full((2, size), -1, dtype=torch.int32)
    tiles[0, : len(seqs)], tiles[1, : len(seqs)] = torch.tensor(seqs), torch.tensor(firsts)
    return tiles


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    impl: str = "auto",
    rows: int = PREFILL_ROWS,
    block_n: int = PREFILL_BLOCK_N,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention: q [T, Hq, D], sequence b's rows query_start[b]:query_start[b+1] -> [T, Hq, D].
    `tiles`: the tile map on q's device (`prefill_tiles`); without one, every sequence gets the tiles of
    `max_query_len` tokens."""
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if query_start.shape != (block_tables.shape[0] + 1,):
        raise ValueError(
            f"query_start must be [B+1] = [{block_tables.shape[0] + 1}], got {tuple(query_start.shape)}"
        )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if kernel_backend(q.device, impl) == "torch":
        return paged_attention_reference(
            q, k_cache, v_cache, block_tables, query_start, context_lens, scale
        )
    q_heads, head_dim = q.shape[1:]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    group_pad = _pow2(group)
    block_m = prefill_block_m(q_heads, kv_heads, rows)
    if tiles is None:
        tiles = prefill_tiles([max_query_len] * block_tables.shape[0], block_m).to(q.device)
    out = torch.empty_like(q)
    _prefill_kernel[(tiles.shape[1], kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        context_lens,
        tiles[0],
        tiles[1],
        out,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * math.log2(math.e),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        UPCAST=INTERPRETED,
        PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or (4 if block_m * group_pad <= 64 else 8),
        **_stages(num_stages),
    )
    return out


# %% [markdown]
# A step that mixes a whole prompt of 20 tokens, a chunk of 7 after 30 cached tokens (a later
# chunk, or a prefix hit) and a decode: one launch, compared with the reference.

# %%
num_new, lens = [20, 7, 1], [20, 37, 58]
k_cache, v_cache, tables = random_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=16, seed=2)
q = torch.randn(sum(num_new), 8, 32, generator=gen)
query_start, ctx = torch.tensor([0, 20, 27, 28]), torch.tensor(lens)
want = paged_attention_reference(q, k_cache, v_cache, tables, query_start, ctx, 32**-0.5)
got = paged_prefill_attention(
    q, k_cache, v_cache, tables, query_start, ctx, max(num_new), 32**-0.5, impl="triton"
)
torch.testing.assert_close(
    got, want, rtol=1e-5, atol=1e-5
)  # fp32: as for decode, sums in another order
with pytest.raises(ValueError, match=r"query_start must be \[B\+1\] = \[4\]"):
    paged_prefill_attention(q, k_cache, v_cache, tables, query_start[:3], ctx, 20, 1.0)

# %% [markdown]
# The same step through tile maps: the exact one (2 tiles of 16 tokens for the prompt, one each for
# the chunk and the decode), and one padded to more tiles than needed, as a graph's map is.

# %%
block_m = prefill_block_m(8, 2)
tiles = prefill_tiles(num_new, block_m)
assert block_m == 16 and tiles.tolist() == [[0, 0, 1, 2], [0, 16, 0, 0]]
for t in (tiles, prefill_tiles(num_new, block_m, num_tiles=9)):
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start, ctx, max(num_new), 32**-0.5, "triton", tiles=t
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
with pytest.raises(ValueError, match="the step needs 4 tiles of 16 tokens, the map has 3"):
    prefill_tiles(num_new, block_m, num_tiles=3)


# %% [markdown]
# ## An attention backend for the engine
#
# `KernelPagedAttention` is chapter 05's `PagedAttention` with the kernels inside, the same
# `(layer, q, k, v) -> out` contract: write the step's K/V through the slot mapping, then one
# launch. A step of decodes only takes the decode kernel; any step with a prefill chunk takes
# the prefill kernel for all its tokens (decodes are queries of length one there).

# %%
#| export
class KernelPagedAttention:
    "Attention backend over the paged pool (see `forge_engine.kv_cache.PagedAttention`) running this chapter's kernels."

    def __init__(self, cache, layout, impl: str = "auto"):
        self.cache, self.layout, self.impl = cache, layout, impl
        self.max_query_len = max(layout.num_new)
        self.scale = cache.config.head_dim**-0.5
        self.tiles = None  # the step's tile map, copied once for all layers (a prefill step's)
        if self.max_query_len > 1:
            block_m = prefill_block_m(cache.config.num_heads, cache.config.num_kv_heads)
            tiles, device = prefill_tiles(layout.num_new, block_m), cache.k_cache[0].device
            self.tiles = (
                tiles.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tiles
            )

    @property
    def rope_inside(self) -> bool:
        "Decodes only: the decode kernel applies q/k-norm and RoPE too (chapter 09a hands over q and k unrotated)."
        return self.max_query_len == 1

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: NormRope | None = None,
    ) -> torch.Tensor:
        layout, cache = self.layout, self.cache
        if rope is not None and self.max_query_len != 1:
            raise ValueError("rope (q/k-norm and RoPE inside attention) is for decode steps only")
        if q.shape[0] != layout.num_tokens:
            raise ValueError(f"the step has {layout.num_tokens} tokens, attention got {q.shape[0]}")
        k_cache, v_cache = cache.k_cache[layer], cache.v_cache[layer]
        if (
            self.max_query_len == 1
        ):  # decodes only: the decode attention stores their K/V (chapter 09b's graphs too)
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                layout.block_tables,
                layout.context_lens,
                self.scale,
                self.impl,
                new_kv=(k, v, layout.slot_mapping),
                rope=rope,
            )
        cache.write(layer, layout.slot_mapping, k, v)
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            layout.block_tables,
            layout.query_start,
            layout.context_lens,
            self.max_query_len,
            self.scale,
            self.impl,
            tiles=self.tiles,
        )


class KernelDecodeAttention:
    """Chapter 09b's graph-safe decode attention on a GPU: `paged_decode_attention`, which also stores the step's new
    K/V (`new_kv`) in the same launch and applies q/k-norm and RoPE (`rope`); `verify`: the rows of a verify step, each
    attending to its sequence's rows before it (`attends_step_rows`)."""

    stores_kv = attends_step_rows = True

    def __init__(self, impl: str = "auto"):
        self.impl, self.counters = (
            impl,
            None,
        )  # the last-split-merges counters: zeros, kept across calls and graphs

    def _counters(self, needed: int, device: torch.device) -> torch.Tensor:
        "Counters for `needed` (sequence, KV head) pairs. They grow only outside a CUDA graph recording (chapter 09b warms up at its largest batch first)."
        if (
            self.counters is None
            or self.counters.numel() < needed
            or self.counters.device != device
        ):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"decode attention: {needed} merge counters needed while a CUDA graph records; "
                    "call it once at the largest batch before recording"
                )
            self.counters = torch.zeros(needed, device=device, dtype=torch.int32)
        return self.counters

    rope_inside = True  # the decode kernel normalises and rotates q and the new K (chapter 09a hands them unrotated)

    def __call__(
        self,
        q,
        k_layer,
        v_layer,
        block_tables,
        context_lens,
        new_kv=None,
        rope: NormRope | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            k_layer,
            v_layer,
            block_tables,
            context_lens,
            q.shape[-1] ** -0.5,
            self.impl,
            new_kv=new_kv,
            rope=rope,
            counters=self._counters(q.shape[0] * k_layer.shape[2], q.device),
            verify=verify,
        )


# %% [markdown]
# The test that matters again: the tiny Qwen3 gives the same logits through the kernels as
# through chapter 05's reference backend, over a chunked prompt, a mixed step and decodes.

# %%
from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
from forge_engine.model import empty_model, init_random_weights

model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
caches = {
    name: PagedKVCache(model.config, num_blocks=12, block_size=4)
    for name in ("reference", "kernels")
}
backends = {
    "reference": PagedAttention,
    "kernels": lambda c, lay: KernelPagedAttention(c, lay, impl="triton"),
}
steps = [
    ([([7, 2, 9, 4], 0, 6)], [3, 14, 15, 92, 65, 35]),
    ([([7, 2, 9, 4], 6, 4), ([1, 5], 0, 3)], [89, 79, 32, 38, 7, 8, 9]),
    ([([7, 2, 9, 4], 10, 1), ([1, 5], 3, 1)], [46, 26]),
]
with torch.no_grad():
    for seqs, ids in steps:
        logits = {}
        for name, cache in caches.items():
            layout = build_step_layout(seqs, 4)
            hidden = model(torch.tensor(ids), layout.positions, backends[name](cache, layout))
            logits[name] = model.compute_logits(hidden)
        # fp32: attention's sums in another order (~1e-7 relative) through 2 layers, logits of O(4): measured 2.4e-6
        torch.testing.assert_close(logits["kernels"], logits["reference"], rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## What they are worth, measured
#
# One H200, Triton 3.6, bf16, Qwen3-4B shapes (32 query heads, 8 KV heads, head_dim 128, block
# 16), one layer; median time of a CUDA-graph replay with the L2 cache flushed before each
# (`kernels_lab/`, which has every variant and the command). "PyTorch" is the path of chapters
# 03 and 05 the engine runs without these kernels.
#
# | kernel | case | PyTorch | kernel | vs ceiling |
# |---|---|---|---|---|
# | add + RMSNorm | 1 token | 16.7 µs | 6.0 µs | launch-bound |
# | add + RMSNorm | 16,384 tokens | 599 µs | 85 µs | 94% of 4.19 TB/s |
# | decode | 1 sequence x 512 tokens | 26.9 µs | 15.5 µs | latency-bound (2 MB) |
# | decode | 1 x 32,768 | 134 µs | 55 µs | 58% of 4.19 TB/s |
# | decode | 64 x 1,024 | 233 µs | 86 µs | 75% |
# | decode | 256 x 2,048 | 1,655 µs | 553 µs | 93% |
# | prefill | 1 prompt of 2,048 | 3,759 µs | 144 µs | 238 TFLOP/s, 30% of 790 (PyTorch's flash kernel on contiguous K/V: 86 µs) |
# | prefill | chunk of 512 after 3,584 cached | 2,100 µs | 113 µs | 286 TFLOP/s, 36% |
#
# Decode is near the bandwidth ceiling once the batch fills the GPU; at batch 1 and short
# contexts it is latency (one program walks its split tile after tile). Prefill runs at 60% of
# the speed of PyTorch's flash kernel on unpaged K/V: the next place to look.
#
# **Triton or CUDA C++ for decode?** `kernels_lab/decode_attention_cuda.py` builds a paged
# decode kernel in CUDA C++ just in time (a warp per key, or eight keys in flight per warp,
# fp32 dot products with shuffle reductions) and times it against this one: at 256 x 2,048 it
# took 1,300 µs against 551 µs, at 1 x 512 50-126 µs against 15 µs. The Triton kernel, which
# multiplies a 64-key tile with the group's query rows on the tensor cores, stays; the lab
# keeps the contender and the numbers.

# %% [markdown]
# ## On the GPU, at Qwen3-4B's shapes
#
# Skipped on CPU (cells flagged `gpu`): bf16, 32 query heads over 8 KV heads, head_dim 128,
# block size 16, against the reference. Timings are in `kernels_lab/`.

# %%
#| gpu
if torch.cuda.is_available():  # also harmless where the `gpu` flag is not skipped
    q4b = preset("qwen3-4b")
    lens = [1, 100, 1000, 2048]
    k_cache, v_cache, tables = random_paged_kv(
        lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda"
    )
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    ctx = torch.tensor(lens, device="cuda")
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, device="cuda"), ctx, 128**-0.5
    )
    # bf16: the softmax weights rounded before P·V and the output rounded (2^-8 each); the norm: the normalised row
    # and the output rounded: as in tests/test_kernels.py's TOL
    torch.testing.assert_close(
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 128**-0.5),
        want,
        rtol=5e-2,
        atol=1e-2,
    )
    x, r, w = (
        torch.randn(n, q4b.hidden_size, device="cuda", dtype=torch.bfloat16) for n in (64, 64, 1)
    )
    torch.testing.assert_close(
        add_rmsnorm(x, r, w[0], 1e-6)[0],
        add_rmsnorm_reference(x, r, w[0], 1e-6)[0],
        rtol=5e-2,
        atol=1e-2,
    )
