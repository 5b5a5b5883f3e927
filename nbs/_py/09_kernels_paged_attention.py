# %% [markdown]
# # Kernels: decode attention over the paged pool
#
# > The paged attention reference, the inner loop both attention kernels share, and paged GQA decode attention (flash-decoding, splits merged by the last split to finish; it also stores the step's K/V and applies q/k-norm and RoPE).

# %%
#| default_exp kernels.paged_attention

# %%
#| export
# Why one module of ~830 lines: most of it is one kernel and its launcher. `_decode_kernel` is
# one program of ~280 lines with 54 parameters (each fold a flag: the K/V store, q/k-norm and
# RoPE, the split merge, the dependent launch), and `paged_decode_attention` (~170 lines) picks
# the folds, sizes the splits and their partial buffers and passes 55 launch arguments; the
# formatter puts each parameter and argument on a line of its own, over a third of the module.
# What comes before them, the reference and the inner loop both attention kernels share (the
# prefill kernel imports it from here), is ~160 lines: split off, it would leave the decode
# kernel alone at ~640 lines and take the loop away from the chapter that explains it.
import math

import torch

from forge_engine.kernels.backend import (
    DEPENDENT_LAUNCH_MAX_ROWS,
    INTERPRETED,
    _dot,
    _dot_precision,
    _let_next_start,
    _pdl_args,
    _pow2,
    _stages,
    _wait_for_previous,
    kernel_backend,
    pdl_supported,
    tl,
    triton,
)
from forge_engine.kernels.elementwise import NormRope, norm_rope, write_kv

# %%
#| hide
import pytest
from forge_engine.kernels.elementwise import norm_rope_reference, write_kv_reference
from forge_engine.model import causal_attention

gen = torch.Generator().manual_seed(3)


# %% [markdown]
# ## Attention over the paged pool: the reference
#
# Both attention kernels read K/V from one layer of chapter 05's pool, `k_cache`, `v_cache`
# `[num_blocks, block_size, kv_heads, head_dim]`, through block tables `[B, max_blocks]` padded
# with -1. The queries of a step are flattened (varlen): sequence `b` owns rows
# `query_start[b]:query_start[b+1]` of `q [T, q_heads, head_dim]`, its `context_lens[b]` tokens
# (cached + new) are in the pool already, and its new tokens are the *last* ones: query `i` of
# `n` sits at position `context_len - n + i` and sees keys `0..` that position. That one rule
# covers a whole prompt, a chunk of a prompt, a prompt after a prefix-cache hit, and a decode
# step (`n = 1`: one query that sees everything).
#
# The reference gathers each sequence's K/V and computes softmax attention in fp32. It is also
# the PyTorch path of both kernels.

# %%
#| export
def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    "q [T, Hq, D] over the paged pool -> [T, Hq, D]; the new tokens of sequence b are the last of its context."
    out = torch.empty_like(q)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b, (start, end, ctx) in enumerate(
        zip(query_start[:-1].tolist(), query_start[1:].tolist(), context_lens.tolist())
    ):
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = (
            k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        )  # [ctx, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        positions = torch.arange(ctx - (end - start), ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def random_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=torch.float32,
    device="cpu",
    spare_blocks: int = 3,
    pad_columns: int = 1,
    seed: int = 0,
):
    "Random K/V pools with each sequence's blocks scattered: (k_cache, v_cache, block_tables int32 padded with -1)."
    gen = torch.Generator(device=device).manual_seed(
        seed
    )  # on the device: a GPU pool can be gigabytes
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (
        torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(needed) + pad_columns
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n] + [-1] * (width - n))
        used += n
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device)


# %% [markdown]
# The reference agrees with chapter 03's `causal_attention` (which uses PyTorch's own
# attention) on a chunk of 3 new tokens after 5 cached ones, blocks scattered:

# %%
k_cache, v_cache, tables = random_paged_kv([8, 3], num_kv_heads=2, head_dim=16, block_size=4)
q = torch.randn(3 + 1, 4, 16, generator=gen)  # sequence 0: 3 new tokens, sequence 1: 1 (a decode)
out = paged_attention_reference(
    q, k_cache, v_cache, tables, torch.tensor([0, 3, 4]), torch.tensor([8, 3]), 16**-0.5
)
k0 = k_cache[tables[0, :2].long()].flatten(0, 1)
# (the default fp32 tolerance, rtol 1.3e-6 and atol 1e-5: PyTorch's attention sums the same products in another order)
torch.testing.assert_close(
    out[:3], causal_attention(q[:3], k0, v_cache[tables[0, :2].long()].flatten(0, 1), q_offset=5)
)
assert tables[1].tolist()[1:] == [-1, -1] and out.shape == q.shape


# %% [markdown]
# ## The inner loop both kernels share
#
# A program holds a tile of query rows `q [R, D]` that all read the *same* KV head, each row
# with its position. It walks the keys of one sequence from `start` to `end` in tiles of
# `BLOCK_N` tokens. Key `n` lives in block `block_table[n // block_size]` at offset
# `n % block_size`; the tile's addresses are gathered from the block table, and each token's
# head vector (`D` contiguous values) is one coalesced read. Online softmax in base 2
# (`qk_scale` includes `log2 e`): keep the running max `m` and sum `l` per row, rescale the
# accumulator when the max grows. Rows that can see no key of a tile keep `m = -inf` safely.
# Callers walk their range in two parts: the whole tiles every row sees without any mask
# (`MASKED=False`: no compare, no select), then the tail tile(s) and the causal diagonal.

# %%
#| export
@triton.jit
def _attend_keys(
    q,
    row_pos,
    acc,
    m_i,
    l_i,
    k_ptr,
    v_ptr,
    table_ptr,
    start,
    end,
    stride_kb,
    stride_kt,
    offs_d,
    d_mask,
    qk_scale,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:  # a tile that may cross `end` or the causal diagonal
            n_mask = offs_n < end
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:  # every key of the tile is visible to every row
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]
        token = (
            block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
        )  # [BLOCK_N] offsets into the pool
        k = tl.load(k_ptr + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        p, alpha, m_i, l_i = _softmax_step(
            q, k, offs_n, end, row_pos, m_i, l_i, qk_scale, MASKED, UPCAST, PRECISION
        )
        v = tl.load(v_ptr + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _softmax_step(
    q,
    k,
    offs_n,
    end,
    row_pos,
    m_i,
    l_i,
    qk_scale,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    "One tile's online softmax: (p, the factor alpha that rescales what came before, the new m, the new l)."
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale  # [R, BLOCK_N]
    if MASKED:
        s = tl.where(
            (offs_n[None, :] < end) & (offs_n[None, :] <= row_pos[:, None]), s, float("-inf")
        )
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


def _check_attention_args(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [tokens, q_heads, head_dim] and k_cache [num_blocks, block_size, kv_heads, "
            f"head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have the same shape and strides, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)}: head_dim must match and "
            f"q_heads be a multiple of kv_heads"
        )
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need unit stride in head_dim")
    if block_tables.dim() != 2 or context_lens.shape != block_tables.shape[:1]:
        raise ValueError(
            f"block_tables must be [B, max_blocks] and context_lens [B], got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )


# %% [markdown]
# ## Paged decode attention (flash-decoding)
#
# One query token per sequence. A program takes one sequence, one KV head and one *split* of
# the context: it loads the group's query heads together (rows of the tile, padded to 16 for
# the tensor cores), so each KV head is read once for all of them, and walks its split.
#
# Why splits: with a few long sequences, `B x kv_heads` programs leave most of the GPU idle
# (one sequence x 8 heads = 8 programs for 132 SMs). Each split writes its unnormalised
# output with its `m` and `l`, and the splits are merged: weights `2^(m_s - M)` (by a second
# kernel, or by the split that finishes last: below). With a fixed split length
# (`split_tokens`; it grows only for tables wider than 64 splits) a sequence's splits, and the
# order of its additions, don't depend on what else is in the batch (the tests check the bits
# under the interpreter); without one the split length follows the batch's size, which trades that for speed (below). The number of
# splits comes from the block tables' *width* (and the batch's size), shapes: no value is read
# back to the host, and the launch can be captured in a CUDA graph. Splits past a sequence's end
# do nothing. The number of splits is a run-time argument, so a growing context never triggers
# a recompilation.
#
# ```
# grid = (sequences b, KV heads h, splits s): program (b, h, s) holds the query heads of KV head h
# (a GQA group: the rows of one tile) and walks keys [s·L, (s+1)·L) of sequence b (L: the split length)
#
#   sequence b, 1,400 keys, L = 512:
#   keys   0 ............ 511 | 512 ........... 1023 | 1024 ..... 1399
#          split 0            | split 1              | split 2 (partial; splits past the end do nothing)
#          tiles of DECODE_BLOCK_N keys: scores, running max m, running sum l, accumulator
#               ↓                       ↓                      ↓
#          (acc_0, m_0, l_0)       (acc_1, m_1, l_1)      (acc_2, m_2, l_2)
#   merge: M = max_s m_s;   out = Σ_s 2^(m_s − M) · acc_s  /  Σ_s 2^(m_s − M) · l_s
# ```
#
# At batch 1 and a few hundred keys this kernel is latency, not bandwidth: 8 programs, each a
# chain of loads (the context length, the block table, then K and V) per tile. Measured on an
# H200 it costs ~6 µs plus ~2.4 µs per 128 keys (`kernels_lab/decode_attention.py`), 0.36 ms of
# a 2.8 ms Qwen3-4B step. So what depends on nothing is loaded first, all at once (q, the new
# K/V), and the kernel walks every tile in one masked loop, so the compiler's software
# pipeline can fetch a partial last tile while the whole ones are summed: one sequence at 300
# keys 12.7 µs against 13.8 with the partial tile in a loop of its own
# (`kernels_lab/decode_attention.py`).

# %%
#| export
DECODE_BLOCK_N = (
    128  # keys per tile; with 512-key splits the best overall in kernels_lab on an H200
)
DECODE_SPLIT_TOKENS = (
    512  # keys per split, when the split is fixed (`split_tokens`, or no batch size to go by)
)
MAX_DECODE_SPLITS = 64  # caps the partial-result buffer; past it splits get longer
DECODE_TARGET_PROGRAMS = (
    256  # (sequence, KV head, split) programs the rule aims for: about two per SM of an H200
)
DECODE_MIN_SPLIT = (
    64  # keys; a split shorter than DECODE_BLOCK_N is one tile of its own length (measured faster)
)
DECODE_MAX_WORK_SPLITS = (
    16  # the rule's cap: the merging program reads the splits one after another
)
DECODE_SEQUENCE_ROWS = (
    8  # `verify`: the most rows of one sequence a step may hold (1 + chapter 08c's most drafts)
)
DECODE_UNROLL_MERGE = 16  # the merging program's loop over up to this many splits unrolled (0: a loop): measured faster


@triton.jit
def _fence_gpu(x, ON: tl.constexpr):
    "Order this thread's earlier memory operations before its later ones, for the whole GPU (ON: compiled, not interpreted)."
    if ON:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _store_partials(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    part,
    acc,
    m_i,
    l_i,
    offs_d,
    mask,
    row_mask,
    HEAD_DIM: tl.constexpr,
):
    "A split's unnormalised output and its m and l, at `part` ([rows]) of the partials [B, Hq, num_splits, (HEAD_DIM)]."
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
    tl.store(part_m_ptr + part, m_i, mask=row_mask)
    tl.store(part_l_ptr + part, l_i, mask=row_mask)


@triton.jit
def _merge_split(
    acc_all,
    m_all,
    l_all,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    part,
    offs_d,
    row_mask,
    mask,
    HEAD_DIM: tl.constexpr,
):
    "The running merge (acc, m, l) with one more split's partials (at `part`); a split masked out changes nothing."
    m_s = tl.load(part_m_ptr + part, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + part, mask=row_mask, other=0.0, cache_modifier=".cg")
    a_s = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask,
        other=0.0,
        cache_modifier=".cg",
    )  # past L1: written by other SMs
    m_new = tl.maximum(m_all, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha, beta = tl.exp2(m_all - m_use), tl.exp2(m_s - m_use)
    return acc_all * alpha[:, None] + a_s * beta[:, None], m_new, l_all * alpha + l_s * beta


@triton.jit
def _store_normalised(out_rows, acc, l_i, mask):
    "A finished softmax: acc / l (a row with no visible key: 0) stored in the output's dtype."
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=mask)


@triton.jit
def _pair_weights(w_ptr, offs_d, pair, d_mask, QK_NORM: tl.constexpr):
    "A q/k-norm weight at each element and at its rotation partner, in fp32 (QK_NORM false: no norm, 1.0)."
    if QK_NORM:
        return (
            tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32),
            tl.load(w_ptr + pair, mask=d_mask, other=0.0).to(tl.float32),
        )
    return tl.full(offs_d.shape, 1.0, tl.float32), tl.full(offs_d.shape, 1.0, tl.float32)


@triton.jit
def _norm_rope_rows(
    x, x_pair, w, w_pair, cos, sin, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr
):
    """Rows x [R, BLOCK_D] (x_pair: each element's partner in its rotated pair; w, cos, sin [1, BLOCK_D]) ->
    RoPE(rmsnorm(x) * w) in fp32, as `_norm_rope_kernel` computes it; `sin` carries the sign of each half."""
    x, x_pair = x.to(tl.float32), x_pair.to(tl.float32)
    if QK_NORM:
        inv = (1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps))[:, None]
        x, x_pair = x * inv * w, x_pair * inv * w_pair
    return x * cos + x_pair * sin


@triton.jit
def _finish_split(
    acc,
    m_i,
    l_i,
    out_rows,
    part,
    mask,
    row_mask,
    offs_d,
    split,
    active,
    counter,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    FENCE: tl.constexpr,
    UNROLL_MERGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """A split's (acc, m, l) for its rows of the output (`out_rows`, `part`: each row's first partial; `active`: the
    splits that hold keys, `counter`: where they count in): stored normalised when the split is the whole answer, else
    stored as partials, and the last split of the (rows, KV head) to finish merges them all (MERGE; else
    `_merge_splits_kernel` does)."""
    if not SPLIT:
        _store_normalised(out_rows, acc, l_i, mask)
    elif not MERGE:  # every split's partials, for `_merge_splits_kernel`
        _store_partials(
            part_acc_ptr,
            part_m_ptr,
            part_l_ptr,
            part + split,
            acc,
            m_i,
            l_i,
            offs_d,
            mask,
            row_mask,
            HEAD_DIM,
        )
    else:  # the splits that hold keys (split 0 at least: an empty context gives zeros) count in; the last merges
        if active == 1:  # the one split is the whole answer
            if split == 0:
                _store_normalised(out_rows, acc, l_i, mask)
        elif split < active:
            _store_partials(
                part_acc_ptr,
                part_m_ptr,
                part_l_ptr,
                part + split,
                acc,
                m_i,
                l_i,
                offs_d,
                mask,
                row_mask,
                HEAD_DIM,
            )
            _fence_gpu(
                split, FENCE
            )  # each thread's partials visible GPU-wide before the count says they are there
            tl.debug_barrier()
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == active - 1:  # the last to finish: every other split's partials are written
                _fence_gpu(done, FENCE)
                m_all = tl.zeros_like(m_i) - float("inf")
                l_all = tl.zeros_like(l_i)
                acc_all = tl.zeros_like(acc)
                if (
                    UNROLL_MERGE > 0
                ):  # every split's loads in one unrolled run: none waits for the one before
                    for s in tl.static_range(
                        UNROLL_MERGE
                    ):  # (past `active`: masked, they change nothing)
                        acc_all, m_all, l_all = _merge_split(
                            acc_all,
                            m_all,
                            l_all,
                            part_acc_ptr,
                            part_m_ptr,
                            part_l_ptr,
                            part + s,
                            offs_d,
                            row_mask & (s < active),
                            mask & (s < active),
                            HEAD_DIM,
                        )
                else:
                    for s in range(
                        0, active
                    ):  # in split order, whoever merges: the bits do not depend on timing
                        acc_all, m_all, l_all = _merge_split(
                            acc_all,
                            m_all,
                            l_all,
                            part_acc_ptr,
                            part_m_ptr,
                            part_l_ptr,
                            part + s,
                            offs_d,
                            row_mask,
                            mask,
                            HEAD_DIM,
                        )
                _store_normalised(out_rows, acc_all, l_all, mask)
                tl.atomic_xchg(
                    counter, 0, sem="relaxed", scope="gpu"
                )  # zero again for the next call (graphs replay)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    count_ptr,
    new_k_ptr,
    new_v_ptr,
    slots_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_cos,
    eps,
    qk_scale,
    num_q_heads,
    split_len,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
    STORE: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    MERGE: tl.constexpr,
    FENCE: tl.constexpr,
    EARLY_TILE: tl.constexpr,
    WAIT_LATE: tl.constexpr,
    UNROLL_MERGE: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    seq, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.maximum(tl.minimum(start + split_len, ctx), start)
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k_head, v_head, tables_ptr = (
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_kh,
        tables_ptr + seq * stride_tb,
    )
    if EARLY_TILE:  # the split's first tile of K/V, written by earlier steps: asked for before waiting for q (WAIT_LATE)
        offs_n0 = start + tl.arange(0, BLOCK_N)
        n0_mask = offs_n0 < end
        token0 = (
            tl.load(tables_ptr + offs_n0 // BLOCK_SIZE, mask=n0_mask, other=0).to(tl.int64)
            * stride_kb
            + (offs_n0 % BLOCK_SIZE) * stride_kt
        )
        kv0_mask = n0_mask[:, None] & d_mask[None, :]
        k0 = tl.load(k_head + token0[:, None] + offs_d[None, :], mask=kv0_mask, other=0.0)
        v0 = tl.load(v_head + token0[:, None] + offs_d[None, :], mask=kv0_mask, other=0.0)
        _wait_for_previous(WAIT_LATE)
    # everything that depends on no other load is asked for at once, before the first barrier (a reduction's, or the
    # store's below; the compiler moves no load over one): q, with ROPE what normalising and rotating needs, with
    # STORE the new K/V and their slot
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if ROPE:  # q (and the new K) as the QKV projection left them: normalised and rotated here, with what this needs
        half: tl.constexpr = HEAD_DIM // 2
        pair = (offs_d + half) % HEAD_DIM  # each element's partner in its rotated pair
        in_half = offs_d % half
        if half % 8 == 0:  # runs of 8 stay contiguous: vector loads
            pair, in_half = (
                tl.max_contiguous(tl.multiple_of(pair, 8), 8),
                tl.max_contiguous(tl.multiple_of(in_half, 8), 8),
            )
        pair, in_half, d_row = (
            pair[None, :],
            in_half[None, :],
            d_mask[None, :],
        )  # [1, BLOCK_D]: q's 2-D layout
        cos = tl.load(cos_ptr + seq * stride_cos + in_half, mask=d_row, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + seq * stride_cos + in_half, mask=d_row, other=0.0).to(tl.float32)
        q_pair = tl.load(q_rows + pair, mask=q_mask, other=0.0)
        q_w, q_w_pair = _pair_weights(q_norm_ptr, offs_d[None, :], pair, d_row, QK_NORM)
    if STORE:  # the step's new K/V, stored by the program whose split holds the new (last) position, before it reads
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        new_k_row = new_k_ptr + seq * stride_nkb + kv_head * stride_nkh
        new_k = tl.load(new_k_row + offs_d[None, :], mask=d_mask[None, :])  # [1, BLOCK_D]
        new_v = tl.load(
            new_v_ptr + seq * stride_nvb + kv_head * stride_nvh + offs_d[None, :],
            mask=d_mask[None, :],
        )
        if ROPE:
            new_k_pair = tl.load(new_k_row + pair, mask=d_row)
            k_w, k_w_pair = _pair_weights(k_norm_ptr, offs_d[None, :], pair, d_row, QK_NORM)
    if ROPE:
        sin = tl.where(
            offs_d[None, :] < half, -sin, sin
        )  # first half: x1 c - x2 s; second: x2 c + x1 s
        q = _norm_rope_rows(q, q_pair, q_w, q_w_pair, cos, sin, eps, HEAD_DIM, QK_NORM).to(q.dtype)
    if STORE:
        if ROPE:
            new_k = _norm_rope_rows(
                new_k, new_k_pair, k_w, k_w_pair, cos, sin, eps, HEAD_DIM, QK_NORM
            ).to(new_v.dtype)
        mine = d_mask[None, :] & ((ctx - 1) // split_len == split)
        at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + offs_d[None, :]
        tl.store(k_head + at, new_k, mask=mine)
        tl.store(v_head + at, new_v, mask=mine)
        tl.debug_barrier()  # every thread of the program sees them
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    row_pos = tl.full([BLOCK_G], 0, tl.int32) + ctx - 1
    if EARLY_TILE:  # (with STORE) the tile loaded early; the new position's K/V from registers
        new_row = (offs_n0 == ctx - 1)[:, None]
        k0, v0 = tl.where(new_row, new_k, k0), tl.where(new_row, new_v.to(v0.dtype), v0)
        p, alpha, m_i, l_i = _softmax_step(
            q, k0, offs_n0, end, row_pos, m_i, l_i, qk_scale, True, UPCAST, PRECISION
        )
        acc = acc * alpha[:, None] + _dot(p.to(v0.dtype), v0, UPCAST, PRECISION)
        acc, m_i, l_i = _attend_keys(
            q,
            row_pos,
            acc,
            m_i,
            l_i,
            k_head,
            v_head,
            tables_ptr,
            start + BLOCK_N,
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
    else:  # every tile masked: a last, partial tile is in the same software-pipelined loop as the others
        acc, m_i, l_i = _attend_keys(
            q,
            row_pos,
            acc,
            m_i,
            l_i,
            k_head,
            v_head,
            tables_ptr,
            start,
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
    mask = row_mask[:, None] & d_mask[None, :]
    out_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    part = (
        seq * num_q_heads + heads
    ) * num_splits  # [BLOCK_G] each head's first partial: [B, Hq, num_splits, (D)]
    _finish_split(
        acc,
        m_i,
        l_i,
        out_rows,
        part,
        mask,
        row_mask,
        offs_d,
        split,
        tl.maximum(tl.cdiv(ctx, split_len), 1),  # (split 0 at least: an empty context gives zeros)
        count_ptr + seq * (num_q_heads // GROUP) + kv_head,
        part_acc_ptr,
        part_m_ptr,
        part_l_ptr,
        SPLIT,
        MERGE,
        FENCE,
        UNROLL_MERGE,
        HEAD_DIM,
    )


@triton.jit
def _verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    count_ptr,
    new_k_ptr,
    new_v_ptr,
    slots_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    stride_cos,
    eps,
    qk_scale,
    num_q_heads,
    split_len,
    num_splits,
    num_rows,
    GROUP: tl.constexpr,
    SEQUENCE_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    STEP_KEYS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    FENCE: tl.constexpr,
    UNROLL_MERGE: tl.constexpr,
):
    """A verify step: a sequence's rows (up to SEQUENCE_ROWS consecutive rows at consecutive positions) in chunks
    of CHUNK, each taken by the program of its first row for KV head program_id(1) and split program_id(2): q tile
    row i is the chunk's row i // GROUP, query head i % GROUP. The programs of a chunk's later rows, and of splits past
    the sequence's keys, return at once. The program whose split holds the sequence's first step position first
    normalises, rotates and stores the chunk's new K/V and attends to the step's K/V up to the chunk's last row from
    registers (normalising and rotating the earlier chunks' again); then every split reads the pool below that
    position. The splits merge in the kernel."""
    _let_next_start(PDL, WAIT)
    row, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + row).to(tl.int32)  # this row sees ctx keys, its own the last
    # rows row - b continue into this one where they sit at position ctx - 1 - b and this row's table puts that
    # position at their slot (no other sequence's table holds it): their count is this row's index in the step
    b = tl.arange(0, SEQUENCE_ROWS)
    back_pos = ctx - 1 - b
    maybe = (b <= row) & (back_pos >= 0)
    back_block = tl.load(
        tables_ptr + row * stride_tb + back_pos // BLOCK_SIZE, mask=maybe, other=0
    ).to(tl.int64)
    before = (b == 0) | (
        maybe
        & (
            tl.load(slots_ptr + row - b, mask=maybe, other=-1).to(tl.int64)
            == back_block * BLOCK_SIZE + back_pos % BLOCK_SIZE
        )
    )
    index = tl.sum(before.to(tl.int32), 0) - 1
    # the sequence's first step row's length: the pool holds its first_ctx - 1 earlier keys
    first_ctx = ctx - index
    # the rows row + j (j < CHUNK) that continue this one: at position ctx - 1 + j, with this row's slot where
    # their table puts position ctx - 1
    j = tl.arange(0, SEQUENCE_ROWS)
    later = row + j
    later_ok = (
        (j < CHUNK)
        & (later < num_rows)
        & (tl.load(context_lens_ptr + later, mask=later < num_rows, other=0) == ctx + j)
    )
    later_block = tl.load(
        tables_ptr + later * stride_tb + (ctx - 1) // BLOCK_SIZE, mask=later_ok, other=0
    ).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    continues = (j == 0) | (later_ok & (later_block * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE == slot))
    # a chunk starts at every CHUNK-th row of a sequence
    rows_here = tl.where(index % CHUNK == 0, tl.sum(continues.to(tl.int32), 0), 0)
    start = split * split_len
    # a chunk's later rows, and splits past the sequence's keys, have nothing to do
    if (rows_here == 0) | (start >= first_ctx):
        return
    # launched as a dependent wherever PDL runs (`_pdl_args(waits_late=True)`): the scans above read only the step's
    # tables, slots and lengths; q and the step's K/V come from the projection before
    _wait_for_previous(PDL)

    i = tl.arange(0, BLOCK_G)
    r, heads = i // GROUP, kv_head * GROUP + i % GROUP
    row_mask = r < rows_here
    q_row = row + r
    row_pos = ctx - 1 + r  # each row's position: it sees the keys up to it
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_kh
    # the pool's keys of this split below the step's first position
    end = tl.maximum(tl.minimum(start + split_len, first_ctx - 1), start)
    q_mask = row_mask[:, None] & d_mask[None, :]
    q_at = q_ptr + q_row[:, None] * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_at + offs_d[None, :], mask=q_mask, other=0.0)
    # q as the QKV projection left it: each row at its own position's angles
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        pair = (offs_d + half) % HEAD_DIM
        in_half = offs_d % half
        if half % 8 == 0:  # runs of 8 stay contiguous: vector loads
            pair = tl.max_contiguous(tl.multiple_of(pair, 8), 8)
            in_half = tl.max_contiguous(tl.multiple_of(in_half, 8), 8)
        d_row = d_mask[None, :]
        # first half: x1 c - x2 s; second: x2 c + x1 s
        sign = tl.where(offs_d[None, :] < half, -1.0, 1.0)
        q_w, q_w_pair = _pair_weights(q_norm_ptr, offs_d[None, :], pair[None, :], d_row, QK_NORM)
        q_angle = q_row[:, None] * stride_cos + in_half[None, :]
        q = _norm_rope_rows(
            q,
            tl.load(q_at + pair[None, :], mask=q_mask, other=0.0),
            q_w,
            q_w_pair,
            tl.load(cos_ptr + q_angle, mask=q_mask, other=0.0).to(tl.float32),
            tl.load(sin_ptr + q_angle, mask=q_mask, other=0.0).to(tl.float32) * sign,
            eps,
            HEAD_DIM,
            QK_NORM,
        ).to(q.dtype)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    # the split that holds the step's first position takes the step's K/V first (the online softmax takes keys in
    # any order), those of the sequence's rows up to the chunk's last (step_j: a row's index in the step): it
    # normalises, rotates and stores the chunk's own and attends to them all from registers; the other splits skip it
    if (first_ctx - 1) // split_len == split:
        step_j = tl.arange(0, STEP_KEYS)  # SEQUENCE_ROWS, at least 16: tl.dot's least
        step_ok = step_j < index + rows_here
        step_row = row - index + step_j
        step_mask = step_ok[:, None] & d_mask[None, :]
        step_k_at = new_k_ptr + step_row[:, None] * stride_nkb + kv_head * stride_nkh
        step_k = tl.load(step_k_at + offs_d[None, :], mask=step_mask, other=0.0)
        step_v = tl.load(
            new_v_ptr + step_row[:, None] * stride_nvb + kv_head * stride_nvh + offs_d[None, :],
            mask=step_mask,
            other=0.0,
        )
        step_slot = tl.load(slots_ptr + step_row, mask=step_ok, other=0).to(tl.int64)
        if ROPE:
            k_w, k_w_pair = _pair_weights(
                k_norm_ptr, offs_d[None, :], pair[None, :], d_row, QK_NORM
            )
            k_angle = step_row[:, None] * stride_cos + in_half[None, :]
            step_k = _norm_rope_rows(
                step_k,
                tl.load(step_k_at + pair[None, :], mask=step_mask, other=0.0),
                k_w,
                k_w_pair,
                tl.load(cos_ptr + k_angle, mask=step_mask, other=0.0).to(tl.float32),
                tl.load(sin_ptr + k_angle, mask=step_mask, other=0.0).to(tl.float32) * sign,
                eps,
                HEAD_DIM,
                QK_NORM,
            ).to(step_v.dtype)
        at = (step_slot // BLOCK_SIZE) * stride_kb + (step_slot % BLOCK_SIZE) * stride_kt
        mine = step_mask & (step_j >= index)[:, None]
        tl.store(k_head + at[:, None] + offs_d[None, :], step_k, mask=mine)
        tl.store(v_head + at[:, None] + offs_d[None, :], step_v, mask=mine)
        # each step key seen by its own row and the rows after it
        step_pos = tl.where(step_ok, first_ctx - 1 + step_j, 2**30)
        p, alpha, m_i, l_i = _softmax_step(
            q, step_k, step_pos, 2**30, row_pos, m_i, l_i, qk_scale, True, UPCAST, PRECISION
        )
        acc = acc * alpha[:, None] + _dot(p.to(step_v.dtype), step_v, UPCAST, PRECISION)
    acc, m_i, l_i = _attend_keys(
        q,
        row_pos,
        acc,
        m_i,
        l_i,
        k_head,
        v_head,
        tables_ptr + row * stride_tb,
        start,
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
    out_rows = out_ptr + q_row[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    _finish_split(
        acc,
        m_i,
        l_i,
        out_rows,
        (q_row * num_q_heads + heads) * num_splits,
        q_mask,
        row_mask,
        offs_d,
        split,
        tl.cdiv(first_ctx, split_len),  # the splits that hold keys
        count_ptr + row * (num_q_heads // GROUP) + kv_head,
        part_acc_ptr,
        part_m_ptr,
        part_l_ptr,
        SPLIT,
        True,
        FENCE,
        UNROLL_MERGE,
        HEAD_DIM,
    )


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part = (seq * num_q_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def _merge_counters(
    counters: torch.Tensor | None, needed: int, device: torch.device
) -> torch.Tensor:
    "The last-split-merges counters: the caller's (checked) or fresh zeros."
    if counters is None:
        return torch.zeros(needed, device=device, dtype=torch.int32)
    if counters.dtype != torch.int32 or counters.numel() < needed or counters.device != device:
        raise ValueError(
            f"counters must be int32 zeros on {device} with at least {needed} (sequences x KV heads) "
            f"elements, got {counters.dtype} [{counters.numel()}] on {counters.device}"
        )
    return counters


def decode_split_len(
    max_blocks: int,
    block_size: int,
    split_tokens: int | None = None,
    block_n: int | None = None,
    pairs: int | None = None,
) -> tuple[int, int]:
    """(keys per split, number of splits) for block tables of `max_blocks` columns: from shapes only. `split_tokens`:
    a fixed length (a sequence's bits then never depend on its batch). Else, given the number of (sequence, KV head)
    `pairs`, as many splits as bring the programs to DECODE_TARGET_PROGRAMS (at most DECODE_MAX_WORK_SPLITS, none
    below DECODE_MIN_SPLIT keys); without `pairs`, DECODE_SPLIT_TOKENS."""
    width, block_n = max(1, max_blocks * block_size), block_n or DECODE_BLOCK_N
    if split_tokens is None and pairs is not None:
        splits = min(DECODE_MAX_WORK_SPLITS, -(-DECODE_TARGET_PROGRAMS // max(1, pairs)))
        split_len = max(DECODE_MIN_SPLIT, -(-width // splits))
        block_n = min(block_n, max(16, _pow2(split_len)))  # a short split: one tile of its length
    else:
        split_len = max(split_tokens or DECODE_SPLIT_TOKENS, -(-width // MAX_DECODE_SPLITS))
    split_len = -(-split_len // block_n) * block_n
    return split_len, -(-width // split_len)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    impl: str = "auto",
    split_tokens: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rope: NormRope | None = None,
    merge: bool = True,
    counters: torch.Tensor | None = None,
    early_tile: bool | None = None,
    verify: bool = False,
) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] attends to its context_lens[b] keys in the pool -> [B, Hq, D].
    `new_kv` (k, v [B, Hkv, D], slots [B]): the step's new K/V, stored in the pool first, each at its sequence's last
    position; by the kernel itself where Triton runs and k and v have unit stride in D, else by `write_kv`. `rope`:
    q and the new K are as the QKV projection left them; they are normalised and rotated first (by the kernel itself
    where it stores the new K/V, else by `norm_rope`). `split_tokens`: keys per split, fixed (default:
    `decode_split_len`'s rule). `block_n`: keys per tile (default DECODE_BLOCK_N; the rule's splits shorter than that
    take a tile of their length). `merge`: the last split of a (sequence, KV head) to finish merges the splits, no
    second launch (measured faster; False: `_merge_splits_kernel` after it); its loop over up to DECODE_UNROLL_MERGE
    splits unrolled, all their loads at once; it counts on `counters`, int32 zeros [>= B x Hkv] that it leaves at
    zero, kept by the caller from call to call (None: fresh zeros each call, one memset more). `early_tile` (default:
    for at most DEPENDENT_LAUNCH_MAX_ROWS sequences; with the fused store only, not in a verify step of several rows): launched as a dependent of the
    kernel before, each program asks for its first K/V tile before it waits for q, and takes the new position's K/V
    from registers. `num_warps`: default 4, 8 with the early tile (at 4
    its K and V spill registers, compiled for an H200). `verify` (with `new_kv`): consecutive rows may be consecutive
    positions of one sequence, up to DECODE_SEQUENCE_ROWS (a verify step, chapter 08c; each row with the table, length
    and slot of its own position): each row attends to its sequence's earlier rows too. Where the kernel stores the
    new K/V, one program takes a chunk of a sequence's rows (`_verify_kernel`: as many as their query heads fill a
    16-row tile, the keys read once for them all), takes the step's K/V from `new_kv` rather than the pool it stores
    them in, and merges the splits itself (`merge` is then True)."""
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"decode has one query per sequence: q has {q.shape[0]} rows for {block_tables.shape[0]} sequences"
        )
    if rope is not None and new_kv is None:
        raise ValueError(
            "rope: q/k-norm and RoPE apply to the step's new K too, so they need new_kv"
        )
    backend = kernel_backend(q.device, impl)
    fused = (
        new_kv is not None and backend == "triton" and all(t.stride(-1) == 1 for t in new_kv[:2])
    )
    rope_inside = (
        fused
        and rope is not None
        and rope.cos.stride(-1) == 1
        and rope.cos.stride() == rope.sin.stride()
    )
    if rope is not None and not rope_inside:
        q, k = (
            norm_rope(x, w, rope.eps, rope.cos, rope.sin, impl)
            for x, w in ((q, rope.q_weight), (new_kv[0], rope.k_weight))
        )
        new_kv = (k, *new_kv[1:])
    if new_kv is not None and not fused:
        write_kv(k_cache, v_cache, new_kv[2], new_kv[0], new_kv[1], impl)
    if backend == "torch":
        query_start = torch.arange(q.shape[0] + 1, device=q.device)
        return paged_attention_reference(
            q, k_cache, v_cache, block_tables, query_start, context_lens, scale
        )
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    # a verify step's rows: one program takes a chunk of a sequence's rows (`_verify_kernel`), as many as their
    # query heads fill a 16-row tile, merging in the kernel
    rows_of_sequences = verify and fused and batch > 1
    block_g = max(16, _pow2(group))  # a tile of query rows: a KV head's query heads, padded
    chunk = block_g // group if rows_of_sequences else 1
    merge = merge or rows_of_sequences
    split_len, num_splits = decode_split_len(
        block_tables.shape[1],
        block_size,
        split_tokens,
        block_n,
        kv_heads * -(-batch // chunk),  # (the step's chunks: at least this many)
    )
    block_n = min(
        block_n or DECODE_BLOCK_N, split_len
    )  # (the rule's short splits take tiles of their length)
    out = torch.empty_like(q)
    if (
        early_tile is None
    ):  # (a batch of 256 launched early held SMs that the projection before it needed)
        early_tile = batch <= DEPENDENT_LAUNCH_MAX_ROWS
    early = early_tile and fused and not rows_of_sequences
    num_warps = num_warps or (8 if early else 4)
    if num_splits > 1:
        part_acc = torch.empty(
            batch, q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32
        )
        part_m, part_l = (
            torch.empty(batch, q_heads, num_splits, device=q.device, dtype=torch.float32)
            for _ in range(2)
        )
    else:
        part_acc = part_m = part_l = out  # unused
    if num_splits > 1 and merge:
        counters = _merge_counters(counters, batch * kv_heads, q.device)
    else:
        counters = context_lens  # unused
    new_k, new_v, slots = new_kv if fused else (q, q, context_lens)  # (unused without STORE)
    rope = rope if rope_inside else NormRope(None, None, 0.0, q, q)  # (unused without ROPE)
    q_weight = rope.q_weight if rope.q_weight is not None else q
    # what both kernels take: the tensors and strides, then the tile's shape and what the launch does
    args = (
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l, counters, new_k, new_v,
        slots, q_weight, rope.k_weight if rope.k_weight is not None else q_weight, rope.cos, rope.sin,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        rope.cos.stride(0), rope.eps, scale * math.log2(math.e), q_heads, split_len, num_splits,
    )  # fmt: skip
    constants = dict(
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1,
        UPCAST=INTERPRETED,
        PRECISION=_dot_precision(q.dtype),
        ROPE=rope_inside,
        QK_NORM=rope.q_weight is not None,
        FENCE=not INTERPRETED,
        UNROLL_MERGE=_pow2(num_splits) if merge and 1 < num_splits <= DECODE_UNROLL_MERGE else 0,
        num_warps=num_warps,
        **_stages(num_stages),
    )
    if rows_of_sequences:
        _verify_kernel[(batch, kv_heads, num_splits)](
            *args,
            batch,
            SEQUENCE_ROWS=DECODE_SEQUENCE_ROWS,
            CHUNK=chunk,
            STEP_KEYS=max(16, DECODE_SEQUENCE_ROWS),
            **_pdl_args(q.device, waits_late=True, rows=batch),
            **constants,
        )
        return out
    _decode_kernel[(batch, kv_heads, num_splits)](
        *args,
        **_pdl_args(q.device, early, batch),
        STORE=fused,
        MERGE=merge,
        EARLY_TILE=early,
        WAIT_LATE=early and pdl_supported(q.device),
        **constants,
    )
    if num_splits > 1 and not merge:
        _merge_splits_kernel[(batch, q_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            q_heads,
            num_splits,
            BLOCK_S=_pow2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, _pow2(head_dim)),
            **_pdl_args(q.device, rows=batch),
            num_warps=4,
        )
    return out


# %% [markdown]
# Three sequences, 4 query heads per KV head, block size 8, forced to short splits so the
# merge runs; then the same without splits. Both match the reference.
#
# A decode step's new K/V have to reach the pool before the attention reads them: the K/V
# store is a kernel of its own, one launch a layer. `new_kv` hands them to the decode
# attention instead: the program whose split holds a sequence's last
# position stores that sequence's new K/V for its KV head, waits at a barrier for its
# threads, then attends (a program's own global writes are visible to its threads after the
# barrier); its PyTorch path runs `write_kv` first. The BF16 decode step: 2.777 ms against 2.814
# with `write_kv` launched (`kernels_lab/decode_overlap.py`, random:qwen3-4b, one sequence's
# decode step as a CUDA graph, one H200).
#
# The new K the program stores must be normalised (Qwen3's q/k-norm) and rotated (RoPE) first,
# and so must q: one more launch a layer (`norm_rope`, above) whose only job is to prepare
# these few hundred numbers. With `rope` (a `NormRope`: the norm weights, eps, each query's
# cos and sin) the attention does it itself: it loads each element's
# partner in its rotated pair (`d ± D/2`) next to the element, normalises each row in fp32 and
# rotates, exactly the arithmetic of `_norm_rope_kernel`. Every program redoes it for its group's
# q heads (4 rows of 128 for Qwen3-4B), cheaper than a launch. All of it is asked for before the
# first reduction: the compiler moves no load over the barriers a reduction brings, and each
# load behind one would be another round trip. The model learns that a backend does this from
# its `rope_inside` and hands it q and k as the QKV projection left them (chapter 09a). The BF16
# step: 2.715 ms against 2.742 with `norm_rope` launched (the same lab).

# %%
lens = [1, 37, 150]
k_cache, v_cache, tables = random_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=8, seed=1)
q = torch.randn(3, 8, 32, generator=gen)
ctx = torch.tensor(lens)
want = paged_attention_reference(q, k_cache, v_cache, tables, torch.arange(4), ctx, 32**-0.5)
assert decode_split_len(tables.shape[1], 8, split_tokens=64) == (
    128,
    2,
)  # rounded up to whole tiles
for split_tokens in (64, 10_000):
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens
    )
    # fp32: the scores and the softmax's sums over <= 150 keys in another order (tiles, splits): ~1e-7 on outputs of
    # O(1) (measured 3e-7), so 1e-5; the same below
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # tiles of 16: 37 and 150 keys end in a partial one, in the same masked loop
    got = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        32**-0.5,
        impl="triton",
        split_tokens=split_tokens,
        block_n=16,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

# %% [markdown]
# ### The last split merges
#
# A merge kernel would be a second launch a layer that reads every split's partials, the empty
# ones too (a 2K-wide table holds 4 splits; a 600-key sequence fills 2). With `merge=True` (the
# default) the decode kernel merges itself: a sequence whose keys fit one split writes its output
# directly; otherwise each split that holds keys writes its partials and counts itself in on an
# atomic counter per (sequence, KV head), and the one that counts last merges them all, in split
# order, and sets the counter back to zero for the next call (a CUDA graph replays the same
# counters). Empty splits write nothing. Which program merges depends on timing; what it computes
# does not: the same partials, summed in the same order. (`merge=False` launches
# `_merge_splits_kernel` after it; the lab's baseline.)
#
# Memory order: every thread fences its partials (`fence.acq_rel.gpu`) before the program's
# barrier and the acquire-release atomic, and the merging program reads the partials past its
# L1 (`.cg`). Measured (H200, `kernels_lab/decode_attention.py`, v7 against v3): 256 sequences of
# 600 keys in 2K-wide tables 197 µs against 210; at batch 1 no different.
#
# The merging program's loop over the splits is unrolled (`tl.static_range` over the table's
# splits rounded up to a power of two, up to `DECODE_UNROLL_MERGE`; the splits past `active`
# masked, so they change nothing). Each split is merged into the running (acc, m, l) in split
# order, the same bits as a loop, but none of its loads waits for the split before, so the
# compiler asks for all of them at once: one round trip where there were `active`. The int8
# decode step: 1.548 ms against 1.563 with a loop (`LAB_VARIANTS="defaults,merge split by split"
# kernels_lab/decode_overlap.py int8`). (Reading the splits as one 3-D `[splits, heads, D]` tile
# instead costs more in its reductions than the round trips save: 2.564 ms against 2.468 for
# BF16.)
#
# **How long a split.** Without a second launch, short splits cost little, and how many a batch
# wants depends on how many programs it already has. Given the batch's size (`pairs`: sequences x
# KV heads), `decode_split_len` takes as many splits as bring the `(sequence, KV head, split)`
# programs to about two per SM (`DECODE_TARGET_PROGRAMS`), at most `DECODE_MAX_WORK_SPLITS` (the
# merging program reads them one after another), none shorter than `DECODE_MIN_SPLIT` keys. One
# sequence with Qwen3-4B's 8 KV heads gets splits of 64 keys in a 512-wide table (one 64-key tile
# each: a split shorter than `DECODE_BLOCK_N` takes a tile of its own length), 256 sequences none
# at all. The price: a sequence's bits then depend on the batch's size (as the GEMMs' already
# do), so a fixed `split_tokens` turns the rule off, and the tests that compare bits pass one.
# Measured against fixed 512-key splits (`kernels_lab/decode_attention.py`, v8 against v7): 256
# sequences of 600 keys 166.9 µs against 197.1, one sequence of 1,000 keys in a 2K table 13.1
# against 17.9; 64 sequences of 1,500 keys, the one shape that loses, 120.0 against 117.2.
#
# **The first tile early** (`early_tile`: at most `DEPENDENT_LAUNCH_MAX_ROWS` sequences). At batch
# 1 the kernel is a chain of memory latencies after the QKV projection ends: its launch, the
# context length, the block table, K and V, the partials and the merge. Only q and the new K/V
# come from the projection; the rest of the pool was written by earlier steps. So the kernel is
# launched as a programmatic dependent of the projection and asks for its split's first tile (the
# block table, K and V) before it waits (`gdc_wait`) for q. The new position's K/V, which that
# tile may hold, is not in the pool yet: it comes from registers, as stored. Later tiles are read
# after the store. The tests check the bits against the plain launch. Compiled for an H200
# (`kernels_lab/decode_sass.py`), the held tiles spill registers at 4 warps, none at 8: this
# launch takes 8. Measured (64-key splits at batch 1, so a split's first tile is all of it): the
# batch-1 step 2.391 ms against 2.429 without (`kernels_lab/decode_overlap.py`), int8 1.702
# against 1.752. Only for small batches: a 256-sequence kernel launched early holds SMs the
# projection before it still needs (W2 11,222 output tok/s against 15,154).

# %%
counters = torch.zeros(3 * 2, dtype=torch.int32)
for split_tokens, block_n in ((64, 16), (64, 128), (10_000, 128)):
    for call in range(2):  # the second call finds the counters back at zero
        got = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            tables,
            ctx,
            32**-0.5,
            impl="triton",
            split_tokens=split_tokens,
            block_n=block_n,
            merge=True,
            counters=counters,
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not counters.any(), counters
    # a sequence's bits do not depend on the batch around it (150 keys: 3 splits of 64, merged by the last)
    alone = paged_decode_attention(
        q[2:],
        k_cache,
        v_cache,
        tables[2:],
        ctx[2:],
        32**-0.5,
        impl="triton",
        split_tokens=split_tokens,
        block_n=block_n,
        merge=True,
    )
    assert torch.equal(alone, got[2:]), split_tokens
# the merging program's loop unrolled (DECODE_UNROLL_MERGE, here the notebook's copy of the switch): the same bits
merged = {}
for unroll in (0, 16):  # (ends on the default)
    DECODE_UNROLL_MERGE = unroll
    merged[unroll] = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        32**-0.5,
        impl="triton",
        split_tokens=64,
        block_n=16,
        merge=True,
    )
assert torch.equal(merged[0], merged[16])
# the rule: a 512-wide table for one sequence of 8 KV heads, 2K, 4K; 8 sequences; 256 (no split)
assert [
    decode_split_len(w // 16, 16, pairs=p)
    for w, p in ((512, 8), (2048, 8), (4096, 8), (2048, 64), (2048, 2048))
] == [(64, 8), (128, 16), (256, 16), (512, 4), (2048, 1)]
assert decode_split_len(32, 16, split_tokens=256, pairs=8) == (256, 2)  # a fixed split stays fixed
assert decode_split_len(128, 16) == (512, 4)  # no batch size to go by: the fixed rule
with pytest.raises(ValueError, match=r"counters must be int32 zeros .* at least 6"):
    paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        32**-0.5,
        impl="triton",
        split_tokens=64,
        merge=True,
        counters=torch.zeros(5, dtype=torch.int32),
    )

# %%
# The step's new K/V (`new_kv`): stored by the program whose split holds the last position, before it attends (on the
# PyTorch path, by `write_kv` first). Both leave the pool and the output of storing by hand, then attending.
new_k, new_v = torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen)
last = ctx - 1
slots = tables[torch.arange(3), last // 8].long() * 8 + last % 8
by_hand = (k_cache.clone(), v_cache.clone())
write_kv_reference(*by_hand, slots, new_k, new_v)
want = paged_attention_reference(q, *by_hand, tables, torch.arange(4), ctx, 32**-0.5)
for impl, split_tokens, merge in (
    ("torch", 64, False),
    ("triton", 64, False),
    ("triton", 64, True),
    ("triton", 10_000, False),
):
    pools = (k_cache.clone(), v_cache.clone())
    got = paged_decode_attention(
        q,
        *pools,
        tables,
        ctx,
        32**-0.5,
        impl=impl,
        split_tokens=split_tokens,
        new_kv=(new_k, new_v, slots),
        merge=merge,
    )
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-5
    )  # fp32: as above, sums in another order
    assert torch.equal(pools[0], by_hand[0]) and torch.equal(pools[1], by_hand[1]), (
        impl,
        split_tokens,
    )
# `early_tile`: a split's first tile read before the new K/V is stored, the new position's K/V taken from registers;
# the same bits and pool, whether the new position is in a split's first tile (16-key splits) or a later one
for split_tokens in (16, 64, 10_000):
    outs = []
    for early in (False, True):
        pools = (k_cache.clone(), v_cache.clone())
        outs.append(
            paged_decode_attention(
                q,
                *pools,
                tables,
                ctx,
                32**-0.5,
                impl="triton",
                split_tokens=split_tokens,
                block_n=16,
                new_kv=(new_k, new_v, slots),
                early_tile=early,
            )
        )
        assert torch.equal(pools[0], by_hand[0]) and torch.equal(pools[1], by_hand[1]), (
            split_tokens,
            early,
        )
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0], outs[1]), split_tokens

# `rope`: q and the new K come as the QKV projection leaves them (Qwen3's q/k-norm weights, or none as in Llama); the
# kernel normalises and rotates both (on the PyTorch path `norm_rope` runs first). Both as by hand.
angles = (
    torch.arange(3.0)[:, None] * 10 + torch.rand(16, generator=gen)[None, :]
)  # one position per sequence
for norm_weights in (
    (torch.rand(32, generator=gen) + 0.5, torch.rand(32, generator=gen) + 0.5),
    (None, None),
):
    rope = NormRope(*norm_weights, 1e-6, angles.cos(), angles.sin())
    by_hand = (k_cache.clone(), v_cache.clone())
    roped_k = norm_rope_reference(new_k, rope.k_weight, 1e-6, rope.cos, rope.sin)
    write_kv_reference(*by_hand, slots, roped_k, new_v)
    want = paged_attention_reference(
        norm_rope_reference(q, rope.q_weight, 1e-6, rope.cos, rope.sin),
        *by_hand,
        tables,
        torch.arange(4),
        ctx,
        32**-0.5,
    )
    for impl, split_tokens, early in (
        ("torch", 64, False),
        ("triton", 64, False),
        ("triton", 16, True),
        ("triton", 10_000, True),
    ):
        pools = (k_cache.clone(), v_cache.clone())
        got = paged_decode_attention(
            q,
            *pools,
            tables,
            ctx,
            32**-0.5,
            impl=impl,
            split_tokens=split_tokens,
            block_n=16,
            new_kv=(new_k, new_v, slots),
            rope=rope,
            early_tile=early,
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the new K normalised and rotated in the kernel, 32 squares summed in another order: a few 2^-24 of O(1)
        torch.testing.assert_close(pools[0], by_hand[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(pools[1], by_hand[1])
with pytest.raises(ValueError, match="need new_kv"):
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, 1.0, rope=rope)
with pytest.raises(ValueError, match="one query per sequence"):
    paged_decode_attention(q[:2], k_cache, v_cache, tables, ctx, 1.0)
with pytest.raises(ValueError, match="multiple of kv_heads"):
    paged_decode_attention(q[:, :3], k_cache, v_cache, tables, ctx, 1.0)

# %% [markdown]
# A verify step (chapter 08c) gives a sequence several rows at consecutive positions, each
# attending to the rows before it. With the store inside the launch, row j's program could read
# row i's slot before row i's program stored it; and each row's program would read the
# sequence's keys again. With `verify`, `_verify_kernel` gives a sequence's rows one program per
# (KV head, split): the program of its first row finds the rows after it (a row of the same
# sequence sits one position further and its table gives the first row's position the first
# row's slot: no other sequence's table holds that slot) and takes them all, their query heads
# as the rows of one tile (Qwen3's 4 heads a KV head fill a 16-row tile with 4 positions; the
# one row of a decode step leaves 12 of 16 as padding). The split that holds the step's first
# position normalises, rotates and stores the step's K/V and attends to them from registers,
# each row to its own and those before it; every split reads the pool only below that
# position; the last split to finish merges. A sequence of more rows than a tile holds (1 + 4
# for Qwen3-4B) goes in chunks: each chunk's program attends to the step's keys up to its own
# last row and stores only its own rows' K/V.
#
# The split that holds the step's first position takes the step's K/V first, before the pool's
# keys (the online softmax takes keys in any order): their registers are free again before the
# pool's loop (a 4-row chunk at 128-key tiles compiles to 168 registers, against 244 with the
# step's keys last: `kernels_lab/decode_sass.py`), and the other splits skip that work; programs
# with nothing to do return at once. The launch is a dependent of the projection before it at
# every row count: its programs find their rows and return early before they wait,
# since the scans read only the step's lengths, tables and slots, which the host writes before
# the graph's first kernel; q and the step's K/V, which the projection writes, are read after the
# wait. Measured: the BF16 verify graph of random Qwen3-4B, one sequence of 512 tokens, against a
# decode step on one H100, two runs in one call (`LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1 PYTHONPATH=.
# python3 kernels_lab/verify_step.py bf16`): 1 + 1 to 1 + 3 rows 1.117-1.126x, 1 + 4 (a 4-row and
# a 1-row chunk) **1.132-1.133x**, against 1.127-1.132x and 1.145x waiting for the projection before
# the scans (1 + 4 was then not launched early at all: five rows, past
# `DEPENDENT_LAUNCH_MAX_ROWS`). Slower, in the same kind of run: one 32-row tile for 1 + 4 rows
# (1.277x) and splits that follow each sequence's length rather than the table's width (1.180x).
# Below: a sequence's rows beside another sequence's, in several layouts and splits (16-key
# splits put a sequence's rows across two), against storing every row first and attending row
# by row.

# %%
from forge_engine.config import MAX_SPECULATIVE_TOKENS

assert (
    1 + MAX_SPECULATIVE_TOKENS <= DECODE_SEQUENCE_ROWS
)  # a verify step's rows of one sequence fit the tile
# the pool holds every position the step writes (what it holds there now is overwritten)
step_lens = [40, 161]
k_cache, v_cache, tables = random_paged_kv(
    step_lens, num_kv_heads=2, head_dim=32, block_size=8, seed=2
)
for rows in (
    [(1, 158), (1, 159), (1, 160), (0, 39)],  # (sequence, position)
    [(0, 39), (1, 156), (1, 157), (1, 158), (1, 159), (1, 160)],
    [(0, 38), (0, 39), (1, 159), (1, 160)],
):
    n = len(rows)
    row_tables = tables[[seq for seq, _ in rows]]
    row_lens = torch.tensor([pos + 1 for _, pos in rows])
    slots = torch.tensor([int(tables[seq, pos // 8]) * 8 + pos % 8 for seq, pos in rows])
    q = torch.randn(n, 8, 32, generator=gen)
    new_k, new_v = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
    angles = (
        torch.tensor([float(pos) for _, pos in rows])[:, None]
        * torch.rand(16, generator=gen)[None, :]
    )
    for norm_weights in (
        (torch.rand(32, generator=gen) + 0.5, torch.rand(32, generator=gen) + 0.5),
        None,
    ):
        rope = (
            None
            if norm_weights is None
            else NormRope(*norm_weights, 1e-6, angles.cos(), angles.sin())
        )
        roped_q, roped_k = (
            (q, new_k)
            if rope is None
            else (
                norm_rope_reference(x, w, 1e-6, rope.cos, rope.sin)
                for x, w in ((q, rope.q_weight), (new_k, rope.k_weight))
            )
        )
        by_hand = (k_cache.clone(), v_cache.clone())
        write_kv_reference(*by_hand, slots, roped_k, new_v)
        want = paged_attention_reference(
            roped_q, *by_hand, row_tables, torch.arange(n + 1), row_lens, 32**-0.5
        )
        for impl, split_tokens in (
            ("torch", 64),
            ("triton", 16),
            ("triton", 64),
            ("triton", 10_000),
            ("triton", None),  # splits by the batch (`decode_split_len`'s rule)
        ):
            pools = (k_cache.clone(), v_cache.clone())
            counters = torch.zeros(n * 2, dtype=torch.int32)
            for call in range(2):  # the second call finds the counters back at zero
                got = paged_decode_attention(
                    q, *pools, row_tables, row_lens, 32**-0.5, impl=impl, split_tokens=split_tokens,
                    block_n=16, new_kv=(new_k, new_v, slots), rope=rope, counters=counters, verify=True,
                )  # fmt: skip
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(pools[0], by_hand[0], rtol=1e-6, atol=1e-6)
                assert torch.equal(pools[1], by_hand[1]), (rows, impl, split_tokens)
                assert not counters.any()
