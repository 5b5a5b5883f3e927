# %% [markdown]
# # GGUF blocks repacked for a GPU
#
# > A GGUF file's Q8_0, Q6_K, Q4_K, Q4_0 and Q4_1 blocks regrouped at load into aligned planes of int8 or int4 values with one fp16 scale per group, and the GEMV that streams them.

# %% [markdown]
# Chapter 10d decodes a GGUF file's blocks inside the matmul as the file stores them. That suits a
# CPU (chapter 10da reads them the same way, as llama.cpp does) but not a GPU: a Q8_0 block is 34
# bytes and a Q6_K super-block 210, so a block's quants never start on a 4-byte boundary and the
# kernel reads them a byte at a time. On the H200 that GEMV moves 0.3-0.9 TB/s of a 4.8 TB/s
# memory. The same numbers regrouped fit the loads a GPU wants:
#
# | file type | bits a weight | repacked as | bits a weight | exact? |
# |---|---|---|---|---|
# | Q8_0 | 8.5 | int8 q, fp16 `d` per group of 32 | 8.5 | yes: the same bytes |
# | Q6_K | 6.56 | int8 q − 32, fp16 `d·sc` per group of 16 | 9 | `d·sc` rounded to fp16 (2^-11) |
# | Q4_K | 4.5 | chapter 10's int4, fp16 scale and minimum per group of 32 | 5 | `d·sc`, `dmin·m` rounded to fp16 |
# | Q4_0 | 4.5 | int4, scale `d`, minimum `−8d`, groups of 32 | 5 | yes |
# | Q4_1 | 5 | int4, scale `d`, minimum `m`, groups of 32 | 5 | yes |
#
# Q6_K grows by 37% (the LM head of Qwen3-4B, 151,936 × 2,560: 319 MB → 438 MB) and still comes
# out ahead: a 16-byte load of 16 int8 quants and one scale per load, against bytes assembled
# into 6-bit numbers one at a time. The int4 planes go through chapter 10c's GEMV; the int8 planes
# through the GEMV below. Q5_0, Q5_1 and Q5_K keep chapter 10d's kernel.
#
# **The int8 GEMV with group scales** follows chapter 10c's shape: a program takes `BLOCK_N` weight
# rows; each of its threads reads `CHUNK` (8 or 16) consecutive bytes of every row per step, all
# rows' loads issued before any arithmetic; a chunk never straddles a group (groups are 16 or 32),
# so a thread sums its chunk's products in FP32 and multiplies the sum by its group's scale
# once. The int8 → FP32 conversion goes through the float's bits (chapter 09's `_as_f32`), not the
# conversion unit, which runs at a quarter rate. Napkin math for one row of Qwen3-4B's `gate_up`
# in Q8_0 (19,456 × 2,560, 52.9 MB): 11 µs at the H200's ~4.8 TB/s, 13 µs at a realistic 4 TB/s.
# A decode step of 2-16 sequences on int8 planes goes to chapter 09's `rows_matmul`, which
# dequantizes each tile as it reads it and takes the GEMV's folds (below, `Int8GroupLinear`), and
# so do other calls of 5-16 rows of bf16 or fp16; the rest (fp32, 17-64 rows) go to a split-K
# kernel that dequantizes a tile in registers and multiplies it with `tl.dot`; prefill
# dequantizes tiles and calls the dense matmul.

# %%
#| default_exp quant.gguf_gpu

# %%
#| export
from __future__ import annotations

import itertools

import math

import torch
from torch import nn

from forge_engine.kernels.backend import (
    INTERPRETED,
    _pow2,
    kernel_backend,
    pdl_supported,
    tl,
    triton,
)
from forge_engine.kernels.gemv import GEMV_MAX_ROWS, _as_f32, _start_gemv, output_folds
from forge_engine.kernels.rows_matmul import (
    dequantized_groups,
    fits_rows_matmul,
    rows_matmul,
    rows_matmul_tiles,
)
from forge_engine.model import Transformer
from forge_engine.quant.gguf_blocks import KEPT_GGUF_TYPES
from forge_engine.quant.layers import (
    DENSE_TILE_WEIGHTS,
    GGUFLinear,
    Int4Linear,
    QuantLinear,
    QuantEmbedding,
    swap_layer_matrices,
)
from forge_engine.quant.split_k import (
    _accumulate,
    _program_tile,
    _skinny_matmul,
    _store_partial,
)

# %%
#| hide
import pytest
from gguf import GGMLQuantizationType as QType

from forge_engine.config import preset
from forge_engine.gguf_file import DEQUANTIZERS
from forge_engine.model import empty_model, init_random_weights
from forge_engine.kernels.gemv import gemv_folds_reference
from forge_engine.quant.formats import dequantize_int4
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul_reference
from forge_engine.quant.split_k import assert_matches


# %% [markdown]
# ## The repacks
#
# Each takes a matrix's rows of blocks, `[N, bytes a row]` as `GGUFLinear` keeps them, and returns
# the planes. They run once, at load, on the device the blocks are on.

# %%
#| export
def q8_0_as_int8(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "Q8_0 rows [N, K/32 x 34 bytes] -> (int8 quants [N, K], fp16 d [N, K/32]): the same bytes, regrouped."
    n, blocks = raw.shape[0], raw.reshape(-1, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).reshape(n, -1), blocks[
        :, :2
    ].contiguous().view(torch.float16).reshape(n, -1)


def q6_k_as_int8(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows [N, K/256 x 210 bytes] -> (int8 q − 32 [N, K], fp16 d·sc [N, K/16]): every quant kept, the
    product of the super-block's d and the group's int8 scale rounded to fp16."""
    from forge_engine.gguf_file import q6_k_quants_and_scales  # (chapter 01a's Q6_K decoding)

    n = raw.shape[0]
    q, scale = q6_k_quants_and_scales(raw.reshape(-1, 210))
    return q.reshape(n, -1), scale.half().reshape(n, -1)


def q4_k_as_int4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows [N, K/256 x 144 bytes] in chapter 10's int4 layout with groups of 32: (packed [N, K/2], fp16 scale
    and minimum [N, K/32]). A weight d·s_j·q − dmin·m_j is scale·q + minimum with the same nibble q: exact but for
    the fp16 rounding of the two products (2^-11 relative)."""
    from forge_engine.gguf_file import (
        _k_nibbles,
        _k_scales_and_mins,
    )  # (chapter 01a's Q4_K decoding)

    n, blocks = raw.shape[0], raw.reshape(-1, 144)
    d, dmin = (blocks[:, at : at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    q = _k_nibbles(blocks[:, 16:]).to(torch.uint8)  # [super-blocks, 8, 32]
    packed = q[..., :16] | (
        q[..., 16:] << 4
    )  # chapter 10's order: a group's first half in the low nibbles
    scale, minimum = (d * scales).half(), (-dmin * mins).half()
    return packed.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1)


def q4_0_q4_1_as_int4(
    raw: torch.Tensor, qtype: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (18-byte blocks, d·(q − 8)) or Q4_1 (20 bytes, d·q + m) rows in chapter 10's int4 layout, groups of 32:
    the 16 quant bytes of a block are already in its order (byte j: weights j and j + 16), the scale is d, the
    minimum −8d or m. Exact."""
    size = KEPT_GGUF_TYPES[qtype][2]
    n, blocks = raw.shape[0], raw.reshape(-1, size)
    d = blocks[:, :2].contiguous().view(torch.float16)
    minimum = -8 * d if size == 18 else blocks[:, 2:4].contiguous().view(torch.float16)
    packed = blocks[:, size - 16 :].contiguous()
    return packed.reshape(n, -1), d.reshape(n, -1), minimum.reshape(n, -1)


# %% [markdown]
# Q8_0 and Q4_0 / Q4_1 come back exactly as chapter 01a's dequantizers make them; Q6_K and Q4_K
# within the fp16 rounding of their products, at most 2^-11 of each weight's scale:

# %%
def _int8_planes_weights(q, scale):
    group = q.shape[1] // scale.shape[1]
    return q.float() * scale.float().repeat_interleave(group, dim=1)


def _file_weights(raw, qtype):
    return DEQUANTIZERS[qtype](raw.reshape(-1, KEPT_GGUF_TYPES[qtype][2])).reshape(raw.shape[0], -1)


raw = gguf_bytes(QType.Q8_0, 24, 512)
assert torch.equal(_int8_planes_weights(*q8_0_as_int8(raw)), _file_weights(raw, 8))
for qtype in (QType.Q4_0, QType.Q4_1):
    raw = gguf_bytes(qtype, 24, 512)
    assert torch.equal(dequantize_int4(*q4_0_q4_1_as_int4(raw, qtype)), _file_weights(raw, qtype))

raw = gguf_bytes(QType.Q6_K, 24, 512)
q, scale = q6_k_as_int8(raw)
assert q.shape == (24, 512) and scale.shape == (24, 32) and q.min() >= -32 and q.max() <= 31
bound = 2**-11 * 32 * scale.float().abs().repeat_interleave(16, dim=1) * 1.001
assert ((_int8_planes_weights(q, scale) - _file_weights(raw, 14)).abs() <= bound).all()

raw = gguf_bytes(QType.Q4_K, 24, 512)
packed, scale, minimum = q4_k_as_int4(raw)
assert packed.shape == (24, 256) and scale.shape == minimum.shape == (24, 16)
by_group = lambda t: t.float().abs().repeat_interleave(32, dim=1)  # noqa: E731
bound = 2**-11 * (15 * by_group(scale) + by_group(minimum)) * 1.001
assert ((dequantize_int4(packed, scale, minimum) - _file_weights(raw, 12)).abs() <= bound).all()


# %% [markdown]
# ## The int8 GEMV with group scales

# %%
#| export
@triton.jit
def _int8_group_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    """out[m, n] = Σ_k x[m, k] · q[n, k] · scale[n, k / GROUP] for BLOCK_N rows n: each of LANES threads reads
    CHUNK bytes of every row per step. EVEN: whole steps, whole programs and M == ROWS (no masks)."""
    _start_gemv(PDL, True)
    lane, inner = tl.arange(0, LANES), tl.arange(0, CHUNK)
    first_row = tl.program_id(0) * BLOCK_N
    accs = ()
    for _ in tl.static_range(BLOCK_N * ROWS):
        accs = accs + (tl.zeros([LANES], dtype=tl.float32),)
    for k0 in tl.range(0, K, LANES * CHUNK, num_stages=1):
        start = tl.multiple_of(k0 + lane * CHUNK, CHUNK)
        ok = (start < K) | EVEN
        ws = ()  # every row's chunk and scale asked for before any arithmetic: the loads overlap
        for r in tl.static_range(BLOCK_N):
            row = (first_row + r).to(tl.int64)  # the LM head: 389M weights, past int32
            row_ok = ok & ((row < N) | EVEN)
            w = tl.load(
                q_ptr + row * K + start[:, None] + inner[None, :], mask=row_ok[:, None], other=0
            )
            s = tl.load(scale_ptr + row * (K // GROUP) + start // GROUP, mask=row_ok, other=0.0)
            ws = ws + ((w, s),)
        xs = ()
        for m in tl.static_range(ROWS):
            x_ok = ok[:, None] & ((m < M) | EVEN)
            xs = xs + (
                tl.load(x_ptr + m * K + start[:, None] + inner[None, :], mask=x_ok, other=0.0).to(
                    tl.float32
                ),
            )
        new = ()
        for r in tl.static_range(BLOCK_N):
            w, s = ws[r]
            f, s = _as_f32(w, BYTE_ASM), s.to(tl.float32)
            for m in tl.static_range(ROWS):
                new = new + (accs[r * ROWS + m] + tl.sum(f * xs[m], axis=1) * s,)
        accs = new
    for r in tl.static_range(BLOCK_N):
        row = first_row + r
        for m in tl.static_range(ROWS):
            tl.store(
                out_ptr + m * N + row,
                tl.sum(accs[r * ROWS + m]).to(out_ptr.dtype.element_ty),
                mask=(row < N) & (m < M),
            )


# %% [markdown]
# The tile rule comes from the H200 sweep of `kernels_lab/int8_group_gemv.py` (one row, CUDA-graph
# replays, L2 flushed), over Qwen3-4B's matrices in Q8_0 and Q6_K and its LM head. The group scales
# cost next to nothing: the kernel runs within 3-8% of chapter 09's int8 GEMV with one scale a row
# on the same shapes (fewer bytes), and 2-6x faster than chapter 10d's GEMV on the file's blocks:
#
# | matrix | chapter 10d, blocks | int8 group planes | chapter 09, a scale a row |
# |---|---|---|---|
# | gate_up, Q8_0 | 53.7 µs | 24.5 µs (2.16 TB/s) | 22.9 µs |
# | down, Q8_0 | 32.6 µs | 15.4 µs (1.72 TB/s) | 14.9 µs |
# | down, Q6_K | 65.9 µs | 15.9 µs (1.77 TB/s) | 14.8 µs |
# | LM head, Q6_K | 698.4 µs | 111.9 µs (3.91 TB/s) | 105.1 µs |

# %%
#| export
def int8_group_gemv_config(n: int, k: int) -> tuple[int, int, int]:
    "(BLOCK_N, num_warps, CHUNK bytes) of the int8 group GEMV for an [n, k] weight (the H200 sweep's winners)."
    if k >= 4096:  # long rows (o, down): 4 warps along K
        return 4, 4, 16
    if n < 4096:  # few outputs (a Q6_K v): one row a program, for enough programs
        return 1, 4, 16
    return (2, 1, 16) if n < 65536 else (4, 1, 16)  # qkv, gate_up; the LM head


def int8_group_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [M <= GEMV_MAX_ROWS, K] @ (q [N, K] int8 times scale [N, K / group] fp16, per group of inputs).T -> [M, N]
    in x's dtype. `config`: (BLOCK_N, num_warps, CHUNK) (default `int8_group_gemv_config`)."""
    x = x.contiguous()
    m, k = x.shape
    n, group = q.shape[0], k // scale.shape[1]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"int8_group_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    if group % 16 or q.shape[1] != k:
        raise ValueError(
            f"int8_group_gemv: groups of a multiple of 16 inputs and q [N, {k}], got {list(q.shape)} and {list(scale.shape)}"
        )
    block_n, warps, chunk = config or int8_group_gemv_config(n, k)
    chunk = min(chunk, group)
    lanes = 32 * warps
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    pdl = pdl_supported(x.device) if pdl is None else pdl
    if m:
        _int8_group_gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            q,
            scale,
            out,
            m,
            n,
            k,
            ROWS=_pow2(m),
            BLOCK_N=block_n,
            LANES=lanes,
            CHUNK=chunk,
            GROUP=group,
            EVEN=k % (lanes * chunk) == 0 and n % block_n == 0 and m == _pow2(m),
            PDL=pdl,
            BYTE_ASM=not INTERPRETED,
            launch_pdl=pdl,
            num_warps=warps,
        )
    return out


# %% [markdown]
# More rows, up to chapter 10b's `SKINNY_MAX_ROWS`: the split-K launch of chapter 10b with a tile
# dequantized in registers (each int8 times its group's scale, broadcast over the group) and
# multiplied by `tl.dot`. The tile is `tl.dot`'s right operand, so Hopper's tensor cores read it
# from shared memory. Turned around, the weights on the left read straight from registers, and
# the loop issues fewer instructions a weight (6.3 against 10.0). It is no faster: on an H100, 16
# rows of Qwen3-4B's Q8_0 matrices take 0.89-1.05x this kernel's time
# (`PYTHONPATH=. LAB_TYPES=Q8_0 python3 kernels_lab/sixteen_rows_swap.py`). At these sizes the
# kernels are not bound by issuing instructions.
#
# What pays is what runs around them. A decode step of 16 sequences through this kernel spends,
# besides its 145 matmuls, 108 launches summing their splits, 73 of add + RMSNorm and 36 of
# SiLU-mul. So `Int8GroupLinear` sends a decode step of 2-16 rows to chapter 09's `rows_matmul`
# instead (`takes_decode_step`, `decode_gemv`): the same dequantized tiles, with the splits summed
# by the tile's last program, the norms handed from matmul to matmul, SiLU-mul and the residual in
# its epilogue, launched as a dependent. On an H100, random Qwen3-4B with every matrix as Q8_0
# planes: the 16-sequence decode graph **3.210 ms against 3.722**, S_TG 4,872 against 4,204
# tok/s (`PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py export,split`). One sequence
# keeps the int8 group GEMV (446.8 and 445.1 tok/s in the same runs). The other calls of 5-16
# rows of bf16 or fp16 x go there too (`int8_group_matmul`): the tied LM head at 16 rows took 214
# µs a step in two launches of this kernel and its sums, about 166 in `rows_matmul` (the graph
# 3.126 ms against 3.166, S_TG 5,039 against 4,948 tok/s: `sixteen_seqs_step.py export,head`).
# This kernel keeps fp32 x and 17-64 rows.

# %%
#| export
@triton.jit
def _int8_group_matmul_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(
        k_start, k_end, BLOCK_K
    ):  # k_per_split and K are whole steps (the launch checks)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=n_mask[:, None], other=0)
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(
            scale_ptr + rows * (K // GROUP) + offs_g[None, :], mask=n_mask[:, None], other=0.0
        )
        s = tl.reshape(
            tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)),
            (BLOCK_N, BLOCK_K),
        )
        acc = _accumulate(acc, x, _as_f32(q, False) * s, USE_DOT, UPCAST, PRECISION)
    _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k)


def int8_group_matmul_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    "Dense: the weights q · scale (per group) in x's dtype, one matmul."
    return x @ dequantized_groups(q, scale, x.dtype).T


@triton.jit
def _int8_group_dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, numel, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    "q [N, K] int8 times its group's scale -> [N, K] in out's dtype, rounded once from FP32."
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    q = tl.load(q_ptr + offs, mask=ok, other=0)
    s = tl.load(scale_ptr + offs // GROUP, mask=ok, other=0.0)  # rows are whole groups
    tl.store(
        out_ptr + offs, (q.to(tl.float32) * s.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok
    )


def int8_group_dense(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dense path for many rows (prefill): the weights in x's dtype, then one matmul. On a GPU the weights come
    from one Triton launch (3 bytes a weight of traffic) and are rounded once, from q · scale in FP32."""
    if kernel_backend(x.device) == "torch":
        return int8_group_matmul_reference(x, q, scale)
    w = torch.empty(q.shape, device=x.device, dtype=x.dtype)
    block = 2048
    _int8_group_dequantize_kernel[(triton.cdiv(q.numel(), block),)](
        q, scale, w, q.numel(), GROUP=q.shape[1] // scale.shape[1], BLOCK=block
    )
    return x @ w.T


def int8_group_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """x [M, K] @ (q · scale per group).T -> [M, N] in x's dtype: the GEMV up to GEMV_MAX_ROWS rows, chapter 09's
    `rows_matmul` up to its 16 rows of bf16 or fp16 x, chapter 10b's split-K launch above (`impl='torch'`, or a
    CPU: the dense reference)."""
    if kernel_backend(x.device, impl) == "torch":
        return int8_group_matmul_reference(x, q, scale)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return int8_group_gemv(x, q, scale)
    if fits_rows_matmul(x):
        return rows_matmul(x, q, scale=scale)  # (faster than split-K at 16 rows: the LM head below)
    group = q.shape[1] // scale.shape[1]
    block_k = next(b for b in (256, 128, 64, group) if x.shape[1] % b == 0 and b % group == 0)
    return _skinny_matmul(  # tiles of 32 outputs: 2-11% faster than 64 at 16 rows (kernels_lab/gguf_rows_sweep.py)
        _int8_group_matmul_kernel,
        x,
        (q, scale),
        q.shape[0],
        block_k,
        block_n=32,
        BLOCK_K=block_k,
        GROUP=group,
    )


# %% [markdown]
# The GEMV against the dense reference at one to four rows, with groups of 16 and 32, masked and
# whole steps; 5 and 16 rows of BF16 through chapter 09's `rows_matmul`, of FP32 (and 20 rows of
# either) through the split-K launch. In FP32 to 1e-4 (sums in another order), in BF16 to 1% of
# the norm (chapter 10b's `assert_matches`).

# %%
torch.manual_seed(0)
for n, k, group in [(24, 512, 32), (20, 384, 16), (8, 1024, 16)]:
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, k // group) * 0.01).half()
    for rows in (1, 2, 3, 4, 5, 16, 20):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, dtype=dtype)
            want = int8_group_matmul_reference(x, q, scale)
            assert_matches(
                int8_group_matmul(x, q, scale, impl="triton"),
                want,
                f"{n}x{k} g{group} M={rows}",
                atol=1e-3,
            )
    for config in [(1, 1, 8), (2, 2, 16), (8, 1, 16)]:  # other tiles give the same numbers
        x = torch.randn(1, k)
        assert_matches(
            int8_group_gemv(x, q, scale, config),
            int8_group_matmul_reference(x, q, scale),
            str(config),
            1e-3,
        )
    x = torch.randn(
        20, k, dtype=torch.bfloat16
    )  # the dense path's weights: one Triton launch, rounded once
    assert torch.equal(int8_group_dense(x, q, scale), int8_group_matmul_reference(x, q, scale))
with pytest.raises(ValueError, match="at most 4 rows"):
    int8_group_gemv(torch.randn(5, 512), q, scale)


# %% [markdown]
# ## The module

# %%
#| export
class Int8GroupLinear(QuantLinear):
    """int8 weights [N, K] with an fp16 scale per group of 16 or 32 inputs [N, K / group], as a GGUF file's Q8_0 and
    Q6_K blocks repack (`q8_0_as_int8`, `q6_k_as_int8`)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    def skinny(self, x):
        return int8_group_matmul(x, self.qweight, self.scale, impl="triton")

    def dense_rows(self, x, start, end):
        return int8_group_dense(x, self.qweight[start:end], self.scale[start:end])

    def takes_decode_step(self, x: torch.Tensor) -> bool:
        """Whether decode step x (on a GPU) goes through `decode_gemv` (chapter 09a's `takes_own_gemv`), its norms
        handed between the matmuls: 2-16 rows of bf16 or fp16. One row stays with the int8 group GEMV, which takes
        no folds."""
        return x.shape[0] > 1 and fits_rows_matmul(x)

    def decode_gemv(
        self, x, swiglu=False, residual=None, norm_sums=None, hand_off=None, eps=1e-6, tickets=None
    ):
        """This layer on a decode step's 2-16 rows by chapter 09's `rows_matmul` (the planes dequantized as it reads
        them), with `gemv`'s folds, which chapter 09a's `folded_gemv` passes, and its split-K `tickets`."""
        return rows_matmul(
            x, self.qweight, self.bias, scale=self.scale, swiglu=swiglu, residual=residual, norm_sums=norm_sums,
            hand_off=hand_off, eps=eps, tickets=tickets,
        )  # fmt: skip

    def rows_matmul_tiles(self) -> int:
        "The split-K tickets a `decode_gemv` launch takes (chapter 09's `rows_matmul_tiles`)."
        return rows_matmul_tiles(self.out_features)

    def rows(self, ids, dtype):
        return dequantized_groups(self.qweight[ids], self.scale[ids], dtype)

    def extra_repr(self):
        return super().extra_repr() + f", group={self.in_features // self.scale.shape[1]}"


class ConcatLinear(QuantLinear):
    "Layers side by side on the same inputs, their outputs concatenated: a GGUF matrix whose runs repack differently."

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None = None):
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias)
        self.parts = nn.ModuleList(parts)

    def skinny(self, x):
        return torch.cat([p.skinny(x) for p in self.parts], dim=-1)

    def dense(self, x, tile_weights=DENSE_TILE_WEIGHTS):
        return torch.cat([p.dense(x, tile_weights) for p in self.parts], dim=-1)

    def takes_decode_step(self, x: torch.Tensor) -> bool:
        "Whether decode step x goes through `decode_gemv` (chapter 09a's `takes_own_gemv`): each part takes it."
        return all(hasattr(p, "decode_gemv") and p.takes_decode_step(x) for p in self.parts)

    def decode_gemv(
        self, x, swiglu=False, residual=None, norm_sums=None, hand_off=None, eps=1e-6, tickets=None
    ):
        """Each part's `decode_gemv` with the handed norm (`norm_sums`), one launch after another on the same split-K
        `tickets` (each leaves them zero), the outputs concatenated; the folds that need the whole output (`swiglu`,
        `residual`, `hand_off`: chapter 09's `output_folds`) after it. A GGUF file's qkv is such a layer when its v
        rows are of another type (Q4_K_M's Q6_K ones), and it takes only the norm."""
        parts = [
            p.decode_gemv(x, norm_sums=norm_sums, eps=eps, tickets=tickets) for p in self.parts
        ]
        result = torch.cat(parts, dim=-1)
        result = result if self.bias is None else result + self.bias
        return output_folds(result, swiglu=swiglu, residual=residual, hand_off=hand_off)

    def rows_matmul_tiles(self) -> int:
        "The split-K tickets a part's `decode_gemv` launch takes at most."
        return max(
            (p.rows_matmul_tiles() for p in self.parts if hasattr(p, "rows_matmul_tiles")),
            default=0,
        )


# %% [markdown]
# A decode step of 2-16 sequences hands its norms from matmul to matmul when every layer matrix
# has a decode kernel that takes the step (chapter 09a asks `takes_decode_step`). A Q4_K_M file's
# matrices are int4 planes (`Int4Linear`, whose 2-16 rows go to chapter 09's `rows_matmul` too),
# int8 planes, and qkv's that mix the two (`ConcatLinear`: each part launched in turn on the
# handed norm, the outputs concatenated). On an H100, random Qwen3-4B with a Q4_K_M file's mix
# (every matrix Q4_K planes but every other layer's v rows and down as int8 ones, the head Q8_0;
# `LAB_PLANES=q4_k_m PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py export,split`), the
# 16-sequence decode graph: 4.129 ms through chapter 10's and 10g's split-K and the small kernels
# (S_TG 3,793 tok/s); 4.012 with the steps through `rows_matmul` in the BF16 tile; 3.461 (S_TG
# 4,441 tok/s) with every kind in int4's tile, 64, 128, 4, 3. As exported the int8 parts keep
# their own tile, which won on Q8_0 planes; that mix itself was not timed.
#
# Under the interpreter here, against the same folds on the weights dequantized
# (`gemv_folds_reference`):

# %%
concat_gen = torch.Generator().manual_seed(5)
packed = torch.randint(0, 256, (48, 64), generator=concat_gen, dtype=torch.uint8)
spread = (torch.rand(48, 4, generator=concat_gen) + 0.5) / 64
int4_part = Int4Linear.from_groups(packed, spread.half(), (-7.5 * spread).half())
q8 = torch.randint(-127, 128, (64, 128), generator=concat_gen, dtype=torch.int8)
int8_part = Int8GroupLinear(q8, (torch.rand(64, 4, generator=concat_gen) / 1000 + 1e-3).half())
qkv = ConcatLinear([int4_part, int8_part])
dense_qkv = torch.cat(
    [
        dequantize_int4(packed, int4_part.scale, int4_part.minimum, torch.bfloat16),
        dequantized_groups(q8, int8_part.scale, torch.bfloat16),
    ]
)
x = torch.randn(5, 128, generator=concat_gen).bfloat16()
qkv_bias = torch.randn(112, generator=concat_gen).bfloat16()
sums = torch.rand(5, generator=concat_gen) * 128 + 1
assert qkv.takes_decode_step(x) and int4_part.takes_decode_step(x)
assert (int4_part.rows_matmul_tiles(), int8_part.rows_matmul_tiles(), qkv.rows_matmul_tiles()) == (
    1,
    2,
    2,
)  # tiles of 64 and 32 rows
for got, want in (
    (
        int4_part.decode_gemv(x, norm_sums=sums),
        gemv_folds_reference(x, dense_qkv[:48], norm_sums=sums),
    ),
    (qkv.decode_gemv(x, norm_sums=sums), gemv_folds_reference(x, dense_qkv, norm_sums=sums)),
    (  # a bias (Qwen2's qkv has one): added after the parts
        ConcatLinear([int4_part, int8_part], bias=qkv_bias).decode_gemv(x, norm_sums=sums),
        gemv_folds_reference(x, dense_qkv, qkv_bias, norm_sums=sums),
    ),
):
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, err  # bf16 roundings (the interpreter truncates where a GPU rounds)
res, g = (
    torch.randn(5, 112, generator=concat_gen).bfloat16(),
    torch.rand(112, generator=concat_gen).bfloat16(),
)
got_sums, want_sums = torch.zeros(5), torch.zeros(5)
got = qkv.decode_gemv(x, residual=res, hand_off=(g, got_sums))
want = gemv_folds_reference(x, dense_qkv, residual=res, hand_off=(g, want_sums))
for a, b in zip((*got, got_sums), (*want, want_sums)):
    assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()

# %% [markdown]
# ## Repacking a model
#
# `gguf_layers_for_gpu` replaces each `GGUFLinear` of a model (the layer matrices and the LM head)
# by its repacked form, run by run: a matrix of one type becomes one module, a mixed one (a
# Q4_K_M file's `qkv` with a Q6_K `v`) a `ConcatLinear` of its runs. A tied embedding then reads
# its rows from the new head. The bias stays with its matrix.

# %%
#| export
REPACK_SLICE_BYTES = (
    2**24
)  # bytes of blocks repacked at a time: bounds the temporaries (the Q6_K head is 319 MB)
REPACKS = {  # GGML type -> (repack of rows of blocks, the module of its planes)
    8: (q8_0_as_int8, Int8GroupLinear),
    14: (q6_k_as_int8, Int8GroupLinear),
    12: (q4_k_as_int4, Int4Linear.from_groups),
    2: (lambda raw: q4_0_q4_1_as_int4(raw, 2), Int4Linear.from_groups),
    3: (lambda raw: q4_0_q4_1_as_int4(raw, 3), Int4Linear.from_groups),
}


def _repack_by_slices(repack, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    "`repack(raw)`, REPACK_SLICE_BYTES of rows at a time, into outputs allocated once."
    rows = max(1, REPACK_SLICE_BYTES // raw.shape[1])
    first = repack(raw[:rows])
    if rows >= raw.shape[0]:
        return first
    outs = [t.new_empty((raw.shape[0], *t.shape[1:])) for t in first]
    for start in range(0, raw.shape[0], rows):
        for out, part in zip(outs, first if start == 0 else repack(raw[start : start + rows])):
            out[start : start + part.shape[0]] = part
    return tuple(outs)


def repack_gguf_run(qtype: int, raw: torch.Tensor) -> QuantLinear | None:
    "One run of GGUF blocks [rows, bytes a row] as an `Int8GroupLinear` or `Int4Linear`; None for a type kept as is."
    if qtype not in REPACKS:
        return None
    repack, module = REPACKS[qtype]
    return module(*_repack_by_slices(repack, raw))


def repacked_bytes(qtype: int, rows: int, cols: int) -> int:
    "Bytes an [rows, cols] matrix of GGUF type `qtype` takes on a GPU once `repack_gguf_run` has run (else: as stored)."
    if qtype in (8, 14):  # int8 quants, an fp16 scale per group of 32 (Q8_0) or 16 (Q6_K)
        return rows * cols + 2 * rows * cols // (32 if qtype == 8 else 16)
    if qtype in REPACKS:  # int4: nibbles, an fp16 scale and minimum per group of 32
        return rows * cols // 2 + 4 * rows * cols // 32
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    return rows * cols // block * type_size


def repack_gguf_linear(layer: GGUFLinear) -> QuantLinear:
    "`layer` repacked run by run (`repack_gguf_run`); itself where any run keeps its blocks."
    parts = [repack_gguf_run(qtype, raw) for qtype, raw in layer.runs()]
    if any(p is None for p in parts):
        return layer
    if len(parts) == 1:
        part = parts[0]
        part.bias = layer.bias
        return part
    return ConcatLinear(parts, layer.bias)


def gguf_gpu_bytes(tensors, dtype_bytes: int) -> tuple[int, int]:
    """(bytes, loading peak) on a GPU of a GGUF model loaded with its blocks kept and repacked (chapter 10e's
    `load_gguf_quantized`, then `gguf_layers_for_gpu`), from its tensors' (GGUF name, GGML type, shape): the layer
    matrices, the LM head and the token embedding as `repacked_bytes` says, the rest dequantized to `dtype_bytes` a
    number. Every block
    comes to the GPU first, then each matrix is repacked in turn, the head last; planes take at least their blocks'
    bytes, so the peak is the weights, the largest matrix's blocks and one slice's temporaries (under 10 bytes a byte
    of blocks)."""
    from forge_engine.gguf_file import SKIPPED_TENSORS
    from forge_engine.quant.layers import _GGUF_PARTS

    parts = {part for names in _GGUF_PARTS.values() for part in names}
    tables = {
        "token_embd.weight",
        "output.weight",
    }  # the embedding and the head: kept where their type is
    total, largest = 0, 0
    for name, qtype, shape in tensors:
        qtype, numel = int(qtype), math.prod(shape)
        kept = name in tables and qtype in KEPT_GGUF_TYPES
        if name.split(".")[-2] in parts and name.startswith("blk."):
            if qtype not in KEPT_GGUF_TYPES:
                raise ValueError(f"{name}: GGUF type {qtype} cannot be kept quantized")
            kept = True
        if name in SKIPPED_TENSORS:
            continue
        if kept:
            _, block, type_size = KEPT_GGUF_TYPES[qtype]
            total += repacked_bytes(qtype, shape[0], shape[1])
            largest = max(largest, numel // block * type_size)  # the matrix's blocks
        else:
            total += numel * dtype_bytes
    return total, total + largest + 10 * REPACK_SLICE_BYTES


@torch.no_grad()
def gguf_layers_for_gpu(model: Transformer) -> Transformer:
    """Every `GGUFLinear` of `model` where its embedding is (layer matrices, LM head, an untied embedding's table: a
    model split with the CPU, chapter 10h, keeps its CPU layers' blocks for the CPU's kernels) replaced, in place, by
    `repack_gguf_linear`'s."""
    home = next(itertools.chain(model.embed.parameters(), model.embed.buffers())).device

    def at_home(child) -> bool:
        return isinstance(child, GGUFLinear) and next(child.buffers()).device == home

    swap_layer_matrices(
        model, lambda child, _: repack_gguf_linear(child) if at_home(child) else None
    )
    tied = isinstance(model.embed, QuantEmbedding) and model.embed.table is model.lm_head
    if at_home(model.lm_head):
        model.lm_head = repack_gguf_linear(model.lm_head)
        if tied:
            model.embed = QuantEmbedding(model.lm_head, model.embed.dtype)
    if not tied and isinstance(model.embed, QuantEmbedding) and at_home(model.embed.table):
        model.embed = QuantEmbedding(repack_gguf_linear(model.embed.table), model.embed.dtype)
    return model


# %% [markdown]
# A tiny model with every kind of matrix: Q8_0, Q6_K, Q4_K, Q4_0, Q4_1, a mixed `qkv` (Q4_K with a
# Q6_K `v`), a Q5_K matrix (kept), and a tied Q6_K head. Each repacked module computes what its
# blocks compute, at one row (the GEMVs), at 8 rows (split-K) and at 40 (dense), within the fp16
# rounding of the K types' scales.

# %%
wide = preset("qwen2-tiny").replace(
    vocab_size=1024, hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=True
)
model = init_random_weights(empty_model(wide), seed=4)
kinds = {
    (0, "qkv"): [QType.Q4_K, QType.Q6_K],
    (0, "o"): [QType.Q8_0],
    (0, "gate_up"): [QType.Q4_0],
    (0, "down"): [QType.Q6_K],
    (1, "qkv"): [QType.Q4_1],
    (1, "o"): [QType.Q5_K],
    (1, "gate_up"): [QType.Q4_K],
    (1, "down"): [QType.Q8_0],
}
for (i, name), types in kinds.items():
    parent = model.layers[i].attn if name in ("qkv", "o") else model.layers[i].mlp
    n, k = getattr(parent, name).weight.shape
    sizes = [n] if len(types) == 1 else [n - wide.kv_size, wide.kv_size]
    parts = [
        (f"{name}{j}", t, (r, k), gguf_bytes(t, r, k, seed=i + j))
        for j, (t, r) in enumerate(zip(types, sizes))
    ]
    setattr(parent, name, GGUFLinear(parts, getattr(parent, name).bias))
head_bytes = gguf_bytes(QType.Q6_K, wide.vocab_size, wide.hidden_size, seed=9)
model.lm_head = GGUFLinear([("head", QType.Q6_K, (wide.vocab_size, wide.hidden_size), head_bytes)])
model.embed = QuantEmbedding(model.lm_head, torch.float32)
before = {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}
gguf_layers_for_gpu(model)
after = dict(model.named_modules())
assert (
    isinstance(after["layers.0.attn.qkv"], ConcatLinear)
    and after["layers.0.attn.qkv"].bias is not None
)
assert isinstance(after["layers.0.attn.o"], Int8GroupLinear) and isinstance(
    after["layers.1.mlp.gate_up"], Int4Linear
)
assert isinstance(after["layers.1.attn.o"], GGUFLinear)  # Q5_K: chapter 10d's kernel
assert isinstance(model.lm_head, Int8GroupLinear) and model.embed.table is model.lm_head


def _with_bias(layer, y):
    return y if layer.bias is None else y + layer.bias


for name, blocks in before.items():
    layer = after[name]
    for rows in (1, 8, 40):
        x = torch.randn(rows, blocks.in_features)
        want = _with_bias(
            blocks,
            torch.cat([gguf_matmul_reference(x, raw, t) for t, raw in blocks.runs()], dim=-1),
        )
        if rows <= 16:  # the kernels, in FP32: within the fp16 rounding of the scales
            got = _with_bias(layer, layer.skinny(x))
            torch.testing.assert_close(
                got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item(), msg=name
            )
        else:  # the dense path (on a CPU: PyTorch's BF16 weight-only GEMMs for int4)
            got = _with_bias(layer, layer.dense(x))
            assert ((got - want).norm() / want.norm()).item() < 1e-2, name

# %% [markdown]
# An untied model's token embedding kept in its blocks (a Q4_K table, as a Q4_K_M file stores it)
# is repacked too, and reads the same rows.

# %%
table = GGUFLinear(
    [
        (
            "token_embd",
            QType.Q4_K,
            (wide.vocab_size, wide.hidden_size),
            gguf_bytes(QType.Q4_K, wide.vocab_size, wide.hidden_size, seed=5),
        )
    ]
)
model.embed = QuantEmbedding(table, torch.float32)  # untied: a table of its own
gguf_layers_for_gpu(model)
assert isinstance(model.embed.table, Int4Linear) and isinstance(model.lm_head, Int8GroupLinear)
tokens = torch.tensor([0, 5, wide.vocab_size - 1])
want = table.rows(tokens, torch.float32)
torch.testing.assert_close(  # within the fp16 rounding of Q4_K's scales
    model.embed(tokens), want, rtol=2e-3, atol=2e-3 * want.abs().max().item()
)
model.embed = QuantEmbedding(model.lm_head, torch.float32)  # tied again, for what follows

# %% [markdown]
# What the repacked model takes, from the file's types alone (`gguf_gpu_bytes`: what chapter
# 10a's memory plan is given for a GGUF file), is what its buffers and parameters take:

# %%
from forge_engine.loader import model_bytes

c = wide
gguf_types = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
rows = {
    "attn_q": c.q_size,
    "attn_k": c.kv_size,
    "attn_v": c.kv_size,
    "attn_output": c.hidden_size,
    "ffn_gate": c.intermediate_size,
    "ffn_up": c.intermediate_size,
    "ffn_down": c.hidden_size,
}
infos = [("token_embd.weight", QType.Q6_K, (c.vocab_size, c.hidden_size))]
for (i, name), types in kinds.items():
    for part in gguf_types[name]:
        t = types[-1] if part == "attn_v" else types[0]  # (layer 0's qkv: q and k Q4_K, v Q6_K)
        infos.append(
            (
                f"blk.{i}.{part}.weight",
                t,
                (rows[part], c.intermediate_size if part == "ffn_down" else c.hidden_size),
            )
        )
infos += [
    (f"dense.{n}", QType.F32, tuple(p.shape)) for n, p in model.named_parameters()
]  # norms, biases
weights, peak = gguf_gpu_bytes(infos, dtype_bytes=4)
assert weights == model_bytes(model) and peak > weights
with pytest.raises(ValueError, match="blk.0.attn_q.weight: GGUF type 10 cannot be kept"):
    gguf_gpu_bytes([("blk.0.attn_q.weight", QType.Q2_K, (256, 256))], 2)

# %% [markdown]
# Qwen3-8B's shape as a Q4_K_M file, under an 8 GiB budget (a consumer card). llama.cpp's
# `llama-quantize` gives that type Q4_K matrices, Q6_K for `attn_v` and `ffn_down` in the first
# and last eighth of the layers and every third between, a Q6_K head and a Q4_K token embedding.
# Kept in its blocks, the embedding costs 0.35 GB instead of 1.24 GB of BF16, and the model fits
# whole with more than the minimum KV cache; with the embedding in BF16 it would not.

# %%
from forge_engine.memory_plan import MIN_KV_BYTES, MemoryPlanError, plan_memory

c8 = preset("qwen3-8b")
n = c8.num_layers
more_bits = [i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 for i in range(n)]
h, q_rows, kv_rows = c8.hidden_size, c8.num_heads * c8.head_dim, c8.num_kv_heads * c8.head_dim
shapes = {
    "attn_q": (q_rows, h), "attn_k": (kv_rows, h), "attn_v": (kv_rows, h), "attn_output": (h, q_rows),
    "ffn_gate": (c8.intermediate_size, h), "ffn_up": (c8.intermediate_size, h), "ffn_down": (h, c8.intermediate_size),
}  # fmt: skip
q4_k_m = [
    ("token_embd.weight", QType.Q4_K, (c8.vocab_size, h)),
    ("output.weight", QType.Q6_K, (c8.vocab_size, h)),
]
for i in range(n):
    for part, shape in shapes.items():
        six_bits = part in ("attn_v", "ffn_down") and more_bits[i]
        q4_k_m.append((f"blk.{i}.{part}.weight", QType.Q6_K if six_bits else QType.Q4_K, shape))
q4_k_m += [("output_norm.weight", QType.F32, (h,))] + [
    (
        f"blk.{i}.{norm}.weight",
        QType.F32,
        (c8.head_dim if norm in ("attn_q_norm", "attn_k_norm") else h,),
    )
    for i in range(n)
    for norm in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm")
]
weights = gguf_gpu_bytes(q4_k_m, dtype_bytes=2)
plan = plan_memory(c8, 8 * 2**30, "gguf", weights=weights)
print(plan.describe())
assert plan.kv_cache >= MIN_KV_BYTES
embedding_in_bf16 = c8.vocab_size * h * 2 - repacked_bytes(int(QType.Q4_K), c8.vocab_size, h)
with pytest.raises(MemoryPlanError, match="under the"):
    plan_memory(c8, 8 * 2**30, "gguf", weights=tuple(w + embedding_in_bf16 for w in weights))

# %%
ids = torch.tensor([0, 7, wide.vocab_size - 1])
torch.testing.assert_close(
    model.embed(ids), _file_weights(head_bytes, 14)[ids], rtol=2e-3, atol=1e-4
)

# %% [markdown]
# ## What it buys
#
# End to end on the H200, Qwen3-4B's shape with random weights: the GGUF files written by
# llama.cpp's own converter and `llama-quantize`, against llama.cpp's CUDA build on the same files
# in the same lease (`PYTHONPATH=. python3 kernels_lab/llama_cpp_cuda_peer.py llama --source
# SRC.tar.gz`, then `... forge`; docs/benchmarks.md has the table and the result file):
#
# | file | llama.cpp tg128 | forge-engine W1 | llama.cpp pp512 | forge-engine, 512-token prompt |
# |---|---|---|---|---|
# | Q8_0 | 303.9 tok/s | 513.7 tok/s (1.69×) | 16,387 tok/s | 35,444 tok/s (2.16×) |
# | Q4_K_M | 337.4 tok/s | 644.8 tok/s (1.91×) | 13,596 tok/s | 36,001 tok/s (2.65×) |
#
# Before the repack the same files ran at 205.6 (Q8_0) and 285.7 (Q4_K_M, its Q4_K already as
# int4) tok/s: chapter 10d's GEMV on the blocks.
