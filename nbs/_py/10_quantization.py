# %% [markdown]
# # Quantized weights
#
# > Weight-only int8 and int4, and GGUF blocks kept as they are in the file: fewer bytes per token, dequantized inside the matmul.

# %% [markdown]
# Decoding one token reads every weight once and does two FLOPs per weight: it is limited by
# memory bandwidth, not arithmetic (chapter 13's ceilings: 8.045 GB of BF16 weights at
# 4.19 TB/s is 1.92 ms per token on an H200). Storing the weights in fewer bits and turning them
# back into numbers *in registers*, inside the matmul, cuts the bytes read per token. The
# activations stay in the compute dtype (BF16 on a GPU, FP32 on a CPU): this is *weight-only*
# quantization.
#
# | mode | what is stored per weight | bytes / weight | where it comes from |
# |---|---|---|---|
# | `int8` | one int8, one scale per output row | 1.0 (+ 4 / row) | quantized from the loaded BF16/FP32 weights |
# | `int4` | one 4-bit number, a scale and a minimum per 128 inputs | 0.5 + 4 / 128 = 0.53 | the same |
# | `gguf` | the GGUF file's blocks, byte for byte (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) | 0.56 - 1.06 | the file |
#
# **What is quantized:** the four matrices of every layer, `attn.qkv`, `attn.o`,
# `mlp.gate_up`, `mlp.down` (for Qwen3-4B 3.24 of its 4.02 billion parameters). **What is not:**
# the embedding (a lookup: it reads one row per token, so its size costs memory, not time) and
# therefore the *tied* LM head that shares it, the norms and the biases: they stay in the
# compute dtype. For Qwen3-4B the BF16 embedding / LM head is 778 MB, read once per decode step.
#
# After loading, `quantize_model` swaps each of those `nn.Linear` modules for a quantized module
# with the same `forward(x)`: the model code of chapter 03 calls `self.qkv(x)` and never knows.
#
# Every matmul has two paths, chosen per call from the number of rows `M` (tokens) in `x`:
#
# - **few rows** (`M <= SKINNY_MAX_ROWS`, decode): a Triton kernel reads each quantized weight
#   once, dequantizes it in registers and accumulates in FP32; split along K so that even 2,560
#   outputs keep every SM of the GPU busy (int4 and GGUF at 1 to 4 rows: a GEMV, one program per
#   few output rows over the whole of K, no split);
# - **many rows** (prefill): dequantize the whole matrix to the compute dtype and call the dense
#   matmul: then arithmetic, not bytes, is the limit, and cuBLAS is the best at arithmetic.
#
# On a CPU, or without Triton, PyTorch runs instead: its own weight-only GEMMs where it has them
# (`CPU_WEIGHT_GEMMS`: int8 as stored; int4 and GGUF's Q4_0 / Q4_1 in its tiled nibble order;
# Q8_0 a block at a time; bf16 inputs), else dequantize + matmul. Measured on a 2-core CPU with
# SmolLM2 (`forge-engine bench w4 --device cpu --quantization ...`, one machine): FP32
# 12.4 tok/s at batch 1 (50.1 with 8 requests), int8 19.0 (75.0), int4 21.5 (86.2), `gguf` 17.2
# (65.3); dequantizing every matrix on every call instead, int4 and `gguf` ran at
# 5.5 and 1.6 tok/s.

# %%
#| default_exp quant

# %%
#| export
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.kernels import (GEMV_MAX_ROWS, INTERPRETED, _dot, _dot_precision, _norm_scale, _pow2, _program_row,
                                  _rows_epilogue_operands, _silu_times, _start_gemv, _wait_for_previous,
                                  check_gemv_folds, gemv, gemv_hands_off_norms, gemv_loop_stages, gemv_prefetch,
                                  gemv_reference, hand_off_operands, kernel_backend, pdl_supported, silu_mul, tl,
                                  triton)
from forge_engine.model import Transformer, load_weights

# %%
#| hide
import copy
import time

import pytest
from forge_engine.config import preset
from forge_engine.loader import model_bytes
from forge_engine.model import empty_model, init_random_weights


# %% [markdown]
# ## int8: one scale per output row
#
# Symmetric: `w ≈ scale[n] · q[n, k]` with `q` in -127..127 and `scale[n] = max_k |w[n, k]| / 127`.
# A row's largest weight is exact, and every other is off by at most half a step. There is no
# zero point: LLM weight rows are centred near zero, and a symmetric code keeps the matmul a
# plain integer dot product times one number per output: `y[m, n] = scale[n] · Σ_k x[m, k] q[n, k]`.

# %%
#| export
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "w [N, K] -> (q int8 [N, K], scale fp32 [N]) with w ≈ scale[:, None] * q."
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / 127
    q = torch.round(w32 / scale.clamp_min(1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


@triton.jit
def _int8_rows_kernel(ids_ptr, q_ptr, scale_ptr, out_ptr, K, stride_qn, BLOCK: tl.constexpr):
    "Program (i, j): columns j * BLOCK... of row ids[i] of the int8 matrix, times its scale, in out's dtype."
    i, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + i).to(tl.int64)
    q = tl.load(q_ptr + row * stride_qn + cols, mask=cols < K, other=0)
    out = q.to(tl.float32) * tl.load(scale_ptr + row)  # as `dequantize_int8`: the product in fp32, rounded once
    tl.store(out_ptr + i.to(tl.int64) * K + cols, out.to(out_ptr.dtype.element_ty), mask=cols < K)


def int8_rows(ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32,
              impl: str = "auto") -> torch.Tensor:
    """`dequantize_int8(q[ids], scale[ids], dtype)` [len(ids), K]: the rows `ids` [n] of an int8 matrix, dequantized
    (a tied model's embedding read from its int8 LM head). On a GPU one Triton launch instead of five small ones."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"int8_rows takes a 1-D tensor of integer row ids, got {ids.dtype} {tuple(ids.shape)}")
    if kernel_backend(q.device, impl) == "torch":
        return dequantize_int8(q[ids], scale[ids], dtype)
    out = torch.empty(len(ids), q.shape[1], dtype=dtype, device=q.device)
    block = min(1024, triton.next_power_of_2(q.shape[1]))
    if len(ids):
        _int8_rows_kernel[(len(ids), triton.cdiv(q.shape[1], block))](ids.contiguous(), q, scale, out, q.shape[1],
                                                                      q.stride(0), BLOCK=block, num_warps=4)
    return out


# %%
w = torch.randn(48, 256)
w[3] = 0  # an all-zero row has scale 0 and stays exactly zero
q, scale = quantize_int8(w)
assert q.dtype == torch.int8 and scale.shape == (48,) and q.abs().max() == 127
err = (dequantize_int8(q, scale) - w).abs()
assert (err <= scale[:, None] / 2 + 1e-6).all()  # at most half a step (+ FP32's rounding of q · scale, ~2^-24 |w|)
assert torch.equal(dequantize_int8(q, scale)[3], torch.zeros(256))
# `int8_rows` (one Triton launch on a GPU, here interpreted): the same bits as dequantizing the gathered rows (in
# BF16 within one rounding here: the interpreter rounds to bf16 its own way; tests/test_quant_gpu.py: bit for bit)
ids = torch.tensor([5, 3, 5, 47])
assert torch.equal(int8_rows(ids, q, scale, impl="triton"), dequantize_int8(q[ids], scale[ids]))
torch.testing.assert_close(int8_rows(ids, q, scale, torch.bfloat16, impl="triton"),  # (truncation: under one BF16
                           dequantize_int8(q[ids], scale[ids], torch.bfloat16), rtol=2**-7, atol=0)  # step, 2^-7)
assert int8_rows(ids[:0], q, scale, impl="triton").shape == (0, 256)
with pytest.raises(ValueError, match=r"1-D tensor of integer row ids, got torch.float32 \(2,\)"):
    int8_rows(torch.zeros(2), q, scale)

# %% [markdown]
# ## int4: groups of 128, asymmetric
#
# Sixteen levels are few, so one scale per whole row (thousands of weights, with a few outliers)
# would waste most of them: we give every **group of 128 consecutive inputs** of a row its own
# scale and minimum, `w ≈ scale · q + minimum`, `q` in 0..15, `scale = (max − min) / 15`.
# (A layer whose input size 128 does not divide gets groups of 64 or 32: SmolLM2's hidden size
# is 576 = 4.5 × 128, so its `qkv` and `gate_up` use groups of 64; Qwen3-4B is all 128.)
#
# **Asymmetric, and why:** a symmetric 4-bit code has either 15 levels (−7..7) or a lopsided
# range (−8..7), and a group whose weights are not centred on zero wastes part of its range. The
# min/max code spends all 16 levels on the range the group actually has, for one more FP16
# number per group (4 bytes per 128 weights in all, 6% over the 64 bytes of nibbles). In the
# kernel the minimum costs almost nothing: `Σ_k x_k (s q_k + m) = s · Σ_k x_k q_k + m · Σ_k x_k`.
#
# **Packing:** two weights per byte. Within a group, byte `j` holds weight `j` in its low nibble
# and weight `j + 64` in its high nibble (the layout GGUF's Q4_0 uses for its 32-weight blocks),
# so a kernel reads 64 contiguous bytes and pairs them with two contiguous halves of `x`.
# Scale and minimum are FP16; `q` is computed against the *rounded* FP16 values, so the error
# stays within half a step.

# %%
#| export
INT4_GROUP = 128  # inputs per scale / minimum


def int4_group_size(k: int) -> int:
    "128, or for an input size that 128 does not divide the largest of 64 and 32 that does (SmolLM2's 576: 64)."
    for group in (INT4_GROUP, 64, 32):
        if k % group == 0: return group
    raise ValueError(f"int4 needs the input size to be a multiple of 32 (groups of 128, 64 or 32), got {k}")


def quantize_int4(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "w [N, K] -> (packed uint8 [N, K/2], scale fp16 [N, K/group], minimum fp16 [N, K/group])."
    n, k = w.shape
    group = group or int4_group_size(k)
    if group % 16 or k % group:  # the GEMV below reads a group as whole 8-byte chunks
        raise ValueError(f"int4 groups must be a multiple of 16 that divides the input size {k}, got {group}")
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale, minimum = ((hi - lo) / 15).half(), lo.half()
    if not (scale.isfinite().all() and minimum.isfinite().all()):
        raise ValueError("int4: a weight group does not fit float16 scales (|w| > 65504 or NaN)")
    s = scale.float()[..., None]
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))  # a constant group: every q = 0, w = minimum
    q = torch.round((g - minimum.float()[..., None]) * inv).clamp_(0, 15).to(torch.uint8)
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(n, k // 2), scale, minimum


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    dtype=torch.float32) -> torch.Tensor:
    n, groups = scale.shape
    b = packed.reshape(n, groups, -1)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()
    return (q * scale.float()[..., None] + minimum.float()[..., None]).reshape(n, -1).to(dtype)


# %%
w = torch.randn(16, 512) + torch.linspace(-1, 3, 512)  # groups not centred on zero
w[2, :128] = 0.25  # a constant group
packed, scale, minimum = quantize_int4(w)
assert packed.shape == (16, 256) and packed.dtype == torch.uint8 and scale.shape == minimum.shape == (16, 4)
back = dequantize_int4(packed, scale, minimum)
step = scale.float().repeat_interleave(128, dim=1)
# at most half a step: codes are rounded against the float16 scale and minimum they are stored with, so only FP32's
# rounding of q · scale + minimum adds (|w| < 8 here: ~2^-21)
assert ((back - w).abs() <= step / 2 + 1e-5).all()
assert torch.equal(back[2, :128], torch.full((128,), 0.25))  # scale 0, minimum 0.25 (exact in float16)
# byte j of a group: weight j low, weight j + 64 high
q0 = torch.round((w[0, :128] - minimum[0, 0].float()) / scale[0, 0].float()).clamp(0, 15).to(torch.uint8)
assert packed[0, 5] == q0[5] | (q0[69] << 4)
assert quantize_int4(torch.randn(4, 576))[1].shape == (4, 9)  # 576 = 9 groups of 64
with pytest.raises(ValueError, match="multiple of 32 .*, got 100"):
    quantize_int4(torch.randn(4, 100))
for bad in (8, 24, 64):  # not whole chunks, or not dividing 96
    with pytest.raises(ValueError, match=f"multiple of 16 that divides the input size 96, got {bad}"):
        quantize_int4(torch.randn(4, 96), bad)

# %% [markdown]
# ## Quantizing a few rows at a time, where it is fast
#
# Both codes treat every row on its own (int8: one scale a row; int4: groups inside a row), so a
# matrix can be quantized a slice of rows at a time, and each slice can be quantized on another
# device than the one holding the full-precision matrix. `quantize_rows` copies `QUANTIZE_CHUNK`
# weights' worth of rows at a time to `device`, quantizes them there and keeps only the result: a
# model staged on the CPU is quantized by the GPU (milliseconds a matrix, against about a third of a
# second for Qwen3-4B's `gate_up` on two CPU cores), while the GPU only ever holds the quantized
# matrices plus one slice's temporaries (16M weights: a few hundred MB in FP32). The result is the
# same bytes as quantizing the whole matrix at once.

# %%
#| export
QUANTIZE_CHUNK = 2**24  # weights per slice of rows: bounds the FP32 temporaries of quantizing


def quantize_rows(quantize, w: torch.Tensor, device=None, chunk: int = QUANTIZE_CHUNK, **options) -> tuple[torch.Tensor, ...]:
    """`quantize(w, **options)` (`quantize_int8` or `quantize_int4`), slice of rows by slice of rows on `device`
    (default: w's): each slice is copied there and quantized into the results, kept on `device`."""
    device = w.device if device is None else torch.device(device)
    rows = max(1, chunk // w.shape[1])
    if rows >= w.shape[0]: return quantize(w.to(device), **options)
    results = None
    for i in range(0, w.shape[0], rows):
        part = quantize(w[i:i + rows].to(device), **options)
        if results is None:  # allocated once, filled slice by slice: never the slices and their join at once
            results = tuple(torch.empty((w.shape[0], *p.shape[1:]), dtype=p.dtype, device=device) for p in part)
        for result, p in zip(results, part): result[i:i + rows] = p
    return results


# %% [markdown]
# Slices give the same bytes as the whole matrix (here in slices of 3 rows, or of 1 row of 512
# inputs), and a BF16 matrix the same as its values in FP32:

# %%
w = (torch.randn(40, 512) * 0.05 + torch.linspace(-0.1, 0.3, 512)).bfloat16()
for quantize, options in ((quantize_int8, {}), (quantize_int4, {}), (quantize_int4, dict(group=32))):
    whole = quantize(w, **options)
    for chunk in (3 * 512, 100):
        sliced = quantize_rows(quantize, w, "cpu", chunk, **options)
        assert len(sliced) == len(whole) and all(torch.equal(a, b) for a, b in zip(sliced, whole)), (quantize, chunk)
    assert all(torch.equal(a, b) for a, b in zip(quantize_rows(quantize, w.float(), **options), whole))


# %% [markdown]
# ## The skinny matmul kernels
#
# `y [M, N] = x [M, K] @ W.T` with `W` quantized and `M` small. One program computes a tile of
# `BLOCK_N` outputs for `BLOCK_M` rows over a *slice* of K: the `split` programs along K each
# write FP32 partial sums, which one small kernel adds up and casts (in a fixed order: the result
# does not depend on timing). Why split: Qwen3-4B's `down` and `o` have only 2,560 outputs; in tiles of 64 that is
# 40 programs for 132 SMs. With splits there are several programs per SM, each streaming its
# slice of the weight; the number of splits depends only on `N` and `K`, never on `M`.
#
# Inside, per step of K:
# - load the quantized tile `[BLOCK_N, BLOCK_K]` (int8 bytes, or packed nibbles) and turn it into
#   numbers in registers (exact: integers up to 255 are exact in BF16);
# - for 1 or 2 rows, multiply and sum (`x[:, None, :] * w[None, :, :]`): no tensor cores needed
#   to read memory at full speed; for more rows, `tl.dot` on a tile of 16+ rows;
# - apply the scale: per output row at the end (int8), per group on the way (int4).

# %%
#| export
@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    "acc [BM, BN] += x [BM, BK] @ w [BN, BK].T"
    if USE_DOT:
        if UPCAST:  # the interpreter: fp32 operands (see chapter 09; it also mangles int8 -> bf16 casts)
            acc += _dot(x, tl.trans(w.to(tl.float32)), UPCAST, PRECISION)
        else:
            acc += _dot(x, tl.trans(w.to(x.dtype)), UPCAST, PRECISION)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _program_tile(K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    "This program's rows, outputs, split index and slice [k_start, k_end) of K; the grid is (N tiles, splits, M tiles)."
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    return offs_m, offs_n, pid_k, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k):
    "Write this program's [BM, BN] partial sums into out[pid_k] ([split, M, N], or [M, N] without split)."
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_matmul_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, k_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(q_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        acc = _accumulate(acc, x, q, USE_DOT, UPCAST, PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    _store_partial(out_ptr, acc * scale[None, :], offs_m, offs_n, M, N, pid_k)


@triton.jit
def _int4_matmul_kernel(x_ptr, q_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, k_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                        USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    offs_j = tl.arange(0, GROUP // 2)
    STRIDE: tl.constexpr = 2 if PAIRED else 1  # PAIRED: scales and minimums side by side (`pair_scales`)
    m_mask, n_mask = offs_m < M, offs_n < N
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, GROUP):  # one group per step: one scale and minimum per output row
        g = k0 // GROUP
        b = tl.load(q_ptr + offs_n[:, None] * (K // 2) + g * (GROUP // 2) + offs_j[None, :], mask=n_mask[:, None], other=0)
        x_ptrs = x_ptr + offs_m[:, None] * K + k0 + offs_j[None, :]
        x_lo = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)  # inputs j of the group
        x_hi = tl.load(x_ptrs + GROUP // 2, mask=m_mask[:, None], other=0.0)  # inputs j + GROUP/2
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xq = _accumulate(_accumulate(zero, x_lo, b & 0x0F, USE_DOT, UPCAST, PRECISION), x_hi, b >> 4, USE_DOT, UPCAST, PRECISION)
        x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        scale = tl.load(scale_ptr + (offs_n * groups + g) * STRIDE, mask=n_mask, other=0.0).to(tl.float32)
        minimum = tl.load(min_ptr + (offs_n * groups + g) * STRIDE, mask=n_mask, other=0.0).to(tl.float32)
        acc += xq * scale[None, :] + x_sum[:, None] * minimum[None, :]
    _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k)


# %% [markdown]
# ## int4 at one to four rows: a GEMV
#
# At decode with a small batch the split-K kernel above made Qwen3-4B 2.5 times *slower* than
# BF16 on one H200 (115 tok/s against 300), though it reads a quarter of the bytes. It steps
# through K one group (64 bytes per output row) at a time, reduces every step, writes FP32
# partial sums and launches a second kernel to add them. Chapter 09's `_gemv_kernel` shows what
# reads memory at full speed for a few rows instead: a grid over the output rows only, each
# program streaming its `BLOCK_N` rows over the *whole* of K in wide loads, one launch, nothing
# written but the result.
#
# `_int4_gemv_kernel` is that kernel for packed nibbles. Per group it uses the identity
# `Σ_k x_k (s q_k + m) = s · Σ_k x_k q_k + m · Σ_k x_k`: the nibbles enter the dot product as
# they are, and scale and minimum cost two multiply-adds per group, not one per weight. It starts
# as chapter 09's GEMV does (`_start_gemv`): launched as a programmatic dependent on Hopper, so its
# programs start while the kernel before is finishing, and with `prefetch=True` they first ask for
# their weight rows into L2.
#
# Why count operations: at 4.19 TB/s an H200 reads 8.4 trillion 4-bit weights a second, and
# its 132 SMs issue about 33 trillion thread-instructions a second: four instructions per
# weight, for everything. A first version held the `[BLOCK_N, GROUPS, GROUP/2]` bytes of whole
# groups per step and summed each group across the threads that held it, every step: compiled
# for an H200 (`kernels_lab/gemv_sass.py`) its loop spent 13 instructions per weight, most of
# them warp shuffles and adds of those sums, and it ran at 0.69 × the BF16 decode speed.
#
# A second version gave each thread **chunks**: 8 bytes of a row, the 16 weights of one group
# that a byte `j` pairs as input `j` (low nibble) and `j + GROUP/2` (high), summed by that thread
# alone, scale and minimum applied per chunk, threads summed once at the end: 5.5 instructions a
# weight, 96 registers, and Qwen3-4B's four matrices of a layer in 47.5 µs on an H200 (1.0-1.3
# TB/s). What it still paid per weight: two byte permutes and an AND to make a float of a nibble,
# and, since a thread held one row's chunk, a conversion and a running sum of the *x* it
# multiplies, repeated for every row.
#
# `_int4_gemv_kernel` now:
#
# - gives a program `BLOCK_N` rows and each thread **the same chunk of every one of them**: x's
#   values are loaded, converted to FP32 and summed once a step for all `BLOCK_N` rows (the rows
#   are a tuple of tensors in the loop, unrolled: one load and one accumulator each);
# - lets a warp cover `32 × CHUNK` contiguous bytes of a row per step, the program's warps taking
#   interleaved slabs of K (summed across warps once, at the end);
# - makes floats of nibbles in 1.4 instructions a weight (`_nibbles_to_f32`). The float 128 is
#   0x43000000, and its mantissa's bit 16 counts ones. A byte sitting in bits 16-23, masked with
#   0x000F0000 and ORed with 0x43000000 (one LOP3), is 128 + its low nibble; a byte in bits 8-15
#   masked with 0x0000F000 is 128 + its high nibble / 16. The word itself has byte 2 in bits 16-23
#   and byte 1 in bits 8-15; shifted left by 8, bytes 1 and 0; right by 8, bytes 3 and 2; rotated
#   by 16, bytes 0 and 3: three shifts and eight LOP3s for eight weights. The offsets come out per
#   chunk with the sums the minimum needs anyway: `Σ x q = Σ x_lo (128 + q) + 16 Σ x_hi (128 + q/16)
#   − 128 Σ x_lo − 2048 Σ x_hi`. (The high nibbles sit 2^11 below their float's 128, so FP32 keeps
#   about 13 of their bits through a chunk's sum: far finer than int4's own steps.)
#
# Compiled offline for an H200 (`kernels_lab/int4_rows.py sass`): 4.1 instructions a weight at 4
# rows and 8-byte chunks (64 registers, 32 warps an SM), 3.6 at 16-byte chunks. In the chain lab
# on an H200 (36 distinct matrices per shape in one CUDA graph, one row) a layer's four matrices
# take **34.4 µs against 47.5**:
#
# | matrix | N × K | rows, warps, chunk bytes | µs a matrix | before (rows 8/4, K-tile, warps) |
# |---|---|---|---|---|
# | qkv | 6144 × 2560 | 4, 2, 8 | 6.93 | 10.30 |
# | o | 2560 × 4096 | 2, 4, 16 (4, 4, 16: 5.68) | 5.52 | 5.79 |
# | gate_up | 19456 × 2560 | 4, 1, 8 | 13.46 | 19.73 |
# | down | 2560 × 9728 | 4, 4, 16 | 8.46 | 11.64 |
#
# As chapter 09's GEMV, each program asks for its first step's weights (bytes, scales, minimums)
# before it waits for x (`early_weights`, `INT4_EARLY_WEIGHTS`; the loop compiles as before, the
# first step peeled): in the chain lab qkv 7.00 → 5.96 µs, o 5.72 → 3.75, gate-up 13.49 → 12.91,
# down 10.30 → 8.08 (a layer 36.5 → 30.7 µs); the decode step 1.851 → 1.770 ms
# (`kernels_lab/decode_overlap.py int4`), W1 522.6 → 545.6 tok/s in one call. On.
#
# Still 1.0-2.0 TB/s: at ~4 instructions a weight the loop needs the SMs' whole issue rate to
# keep up with 4.19 TB/s, so it is bound by its arithmetic and by the latency it cannot hide.
# Issuing the next step's loads before this step's arithmetic (registers double-buffered)
# measured slower (more registers and moves), and so did tensor-core (`mma`) versions in CUDA C++
# (`kernels_lab/int4_mma.py`: slower for every shape but qkv). What won is the same loop in
# integers (next section); the FP32 loop below stays as its reference (`int_dot=False`).

# %%
#| export
@triton.jit
def _nibbles_to_f32(b, BYTE_ASM: tl.constexpr):
    """A uint8 tile -> (128 + low nibble, 128 + high nibble / 16) in fp32, exactly: the low nibble in the mantissa
    bits 16-19 of 128 (0x43000000), the high one in bits 12-15."""
    if BYTE_ASM:  # compiled for an NVIDIA GPU: per four bytes three shifts, per weight one LOP3 (and + or)
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 l, r, t;
            shl.b32 l, $8, 8;
            shr.b32 r, $8, 8;
            prmt.b32 t, $8, 0, 0x1032;
            lop3.b32 $0, t, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $1, l, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $2, $8, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $3, r, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $4, l, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $5, $8, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $6, r, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $7, t, 0x0000F000, 0x43000000, 0xEA;
            }""", constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[b], dtype=(tl.float32, tl.float32), is_pure=True,
            pack=4)
    b = b.to(tl.int32)
    low = ((b & 0x0F) << 16) | 0x43000000
    high = ((b >> 4) << 12) | 0x43000000
    return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)


@triton.jit
def _x_chunk(b0, lane, K, GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """For a step at byte b0 of the rows: whether each thread's chunk is inside the row, and the first of x's inputs
    its low nibbles multiply (the high ones': GROUP / 2 further on)."""
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])
    # x's chunk starts at a multiple of CHUNK: said, so it comes in vector loads (one-warp tiles lost that: 2-byte loads)
    return (start < K // 2) | EVEN, tl.multiple_of((start // (GROUP // 2)) * GROUP + start % (GROUP // 2), [CHUNK, CHUNK])


@triton.jit
def _int4_step_floats(accs, ws, x_ptr, b0, lane, M, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr, BYTE_ASM: tl.constexpr):
    "`_int4_step` in FP32: nibbles made floats (`_nibbles_to_f32`), multiplied and added one by one."
    HALF: tl.constexpr = GROUP // 2  # bytes per group and row: byte j holds inputs j (low) and j + HALF (high)
    c_ok, x_first = _x_chunk(b0, lane, K, GROUP, CHUNK, EVEN)
    x_at = x_ptr + x_first[:, :, None] + tl.arange(0, CHUNK)[None, None, :]
    xs = ()  # the inputs of the chunk's low nibbles (and + HALF, the high ones), for each row m of x
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        x_lo = tl.load(x_at + m * K, mask=x_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_at + m * K + HALF, mask=x_ok, other=0.0).to(tl.float32)
        s_lo, s_hi = tl.sum(x_lo, axis=2), tl.sum(x_hi, axis=2)
        xs = xs + ((x_lo, x_hi, 128.0 * s_lo + 2048.0 * s_hi, s_lo + s_hi),)
    new = ()
    for r in tl.static_range(BLOCK_N):
        b, s, mn = ws[r]
        s, mn = s.to(tl.float32), mn.to(tl.float32)
        f_lo, f_hi = _nibbles_to_f32(b, BYTE_ASM)  # 128 + q_lo, 128 + q_hi / 16
        for m in tl.static_range(ROWS):
            x_lo, x_hi, offset, x_sum = xs[m]
            xq = tl.sum(x_lo * f_lo, axis=2) + 16.0 * tl.sum(x_hi * f_hi, axis=2) - offset  # Σ x q in the chunk
            new = new + (accs[r * ROWS + m] + xq * s + x_sum * mn,)
    return new


# %% [markdown]
# ### In integers
#
# Those ~3.8 instructions a weight were the limit: the FP32 loop could not issue fast enough to
# read its bytes (the gate-up at ~2 TB/s), and with its nibbles left unconverted (wrong values,
# the same loads: `kernels_lab/int4_step_bounds.py`) the decode step took 1.305 ms instead of
# 1.429. Integers make both halves of the per-weight work cheaper (`_int4_step_integers`):
#
# - a 32-bit word of eight nibbles becomes two words of four bytes, `w & 0x0F0F0F0F` and
#   `(w >> 4) & 0x0F0F0F0F`: three instructions for eight weights, against eleven;
# - `dp2a` multiplies two bytes by two 16-bit integers and adds both products to an int32: one
#   instruction for two weights, against two FFMAs (`_nibbles_dot`: four per word).
#
# x must then be 16-bit integers. Each thread takes its step's 2 × CHUNK inputs (the low and the
# high nibbles' halves of x), finds the largest power of two 2^e at most their largest magnitude,
# and multiplies them by 2^(13 − e): every value is now under 2^14. Adding 1.5 × 2^23 rounds it to
# an integer that sits in the float's low bits (the float's unit is 1 there), and a PRMT packs the
# low halves of two such floats into one word: the pairs `dp2a` takes (`_int16_pairs`). That is
# done once a step for all the program's rows (8 for the gate-up, 4 for the others). Each input
# keeps 14 bits of its chunk's largest; a row's int32 sum for the chunk (at most 16 × 15 × 2^14 <
# 2^22) becomes a float by the same trick backwards, and is scaled by `s × 2^(e − 13)`; the
# minimum multiplies the exact FP32 `Σx` as before. (A 16-byte chunk has twice the products: its
# inputs are scaled to under 2^13, one bit fewer. Under 2^14 the bound would break: 32
# products of inputs near 2^14 by nibbles of 15 pass 2^22, and the float trick then returns
# garbage; the test below feeds exactly that.)
#
# Compiled offline (`kernels_lab/gemv_sass.py`'s `int4_loop`): 2.73 instructions a weight at the
# gate-up's 8 × 1 × 8 against 3.77, 3.45 at qkv's 4 × 2 × 8 against 4.09, 2.88 at 4 × 4 × 16
# against 3.56. A 16-byte chunk is taken as two 8-byte tiles: in one tile of 16 BF16 inputs Triton
# spread x over two threads and moved the weights through shared memory every step to match.
# Measured on an H200 (`kernels_lab/int4_dp2a.py`, 36-matrix chains, µs a matrix, FP32
# → integers): qkv 5.74 → 4.93, o 3.73 → 3.88, gate-up 12.04 → 9.90, down 7.91 → 7.00; the
# int4 decode step **1.418 → 1.250 ms**; the bench's W1 786.5 / 787.4 tok/s against BF16's 423.0
# (1.86×; FP32: 1.66×). The relative error against the dequantized matmul moved from 3.37e-3 to
# 3.42e-3 (BF16 outputs). `INT4_INT_DOT` (on) or `int_dot=` chooses; packed rows that do not start
# at whole 32-bit words take the FP32 loop.
#
# More instructions come out of the step. In 8-byte chunks (qkv, gate-up) the high
# nibbles are used where they sit, `w & 0xF0F0F0F0` (bytes of 16·q), with the high inputs scaled
# by a further 1/16 to match: two LOP3 and four `dp2a` a word instead of three and four, at the
# price of four bits of the high inputs (10 bits of their chunk's largest; 16-byte chunks would
# keep 9, so they shift). `Σx` is summed from the same 16-bit integers by one `dp2a` a pair
# (bytes (1, 1), or (16, 16) for the high pairs) instead of FP32 adds (`_x_integers`), and BF16 x
# is read as 32-bit words whose halves become floats by a shift and a mask (`_x_as_floats`).
# `Int4Linear` also keeps each group's scale and minimum side by side (`pair_scales`), so a row's
# pair is one 4-byte load.
#
# Why instructions: with each shape's chain of 36 int4 GEMVs reading one matrix from L2 instead
# of 36 from DRAM, the GEMVs gained only 7-19% (the gate-up 9.16 → 7.43 µs: 3.56 TB/s from L2;
# `kernels_lab/int4_gemv_bound.py`), so the SM, not DRAM latency, held them; and with x's
# conversion left out, or the nibbles' split (bounds with wrong values,
# `kernels_lab/int4_int_bounds.py`), the decode step took ~1.15 ms against 1.22. Offline the
# gate-up's loop went from 350 to 319 instructions a step (2.73 → 2.49 a weight). Measured on an
# H200 (`bash kernels_lab/w1_checks.sh ab`, this kernel against one without these changes, each
# in its own process): the int4 decode step **1.223 / 1.225 / 1.223 / 1.224 → 1.182 / 1.179 ms**;
# the bench's W1 834.9 / 834.3 tok/s against BF16's 419.4 in the same call (1.99×; without them:
# 807.5, 1.93×). The relative error against the dequantized matmul (one row, BF16, random
# weights): qkv 1.66e-3 → 1.71e-3, gate-up 1.67e-3 → 1.72e-3.

# %%
#| export
ROUND_TO_INTEGER = tl.constexpr(1.5 * 2**23)  # v + this (|v| < 2^22) holds v rounded to an integer in its low bits


@triton.jit
def _x_as_floats(x_ptr, first, ok):
    """x's 8 inputs from `first` [SLABS, 32, 1] (a multiple of 8) as FP32 halves (inputs 0, 2, 4, 6; inputs 1, 3, 5,
    7), each [SLABS, 32, 4]. BF16 x comes as 32-bit words whose halves a shift and a mask make floats (Triton's own
    conversion spent a PRMT and a shift on each high half)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        at = tl.multiple_of(first // 2, [4, 4, 4]) + tl.arange(0, 4)[None, None, :]
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + at, mask=ok, other=0)
        return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)
    x = tl.load(x_ptr + first + tl.arange(0, 8)[None, None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (x.shape[0], 32, 4, 2)))


@triton.jit
def _int16_pairs(even, odd, scale, BYTE_ASM: tl.constexpr):
    """x's halves (`_x_as_floats`) times scale [SLABS, 32], rounded to integers, as 16-bit pairs in 32-bit words:
    (inputs 4i and 4i + 1, inputs 4i + 2 and 4i + 3), each [SLABS, 32, 2]."""
    even = (even * scale[:, :, None] + ROUND_TO_INTEGER).to(tl.int32, bitcast=True)  # the integer in the low 16 bits
    odd = (odd * scale[:, :, None] + ROUND_TO_INTEGER).to(tl.int32, bitcast=True)
    if BYTE_ASM:  # one PRMT: the low halves of both
        pairs = tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, $2, 0x5410;", constraints="=r,r,r", args=[even, odd],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        pairs = (even & 0xFFFF) | (odd << 16)
    return tl.split(tl.reshape(pairs, (pairs.shape[0], 32, 2, 2)))


@triton.jit
def _pairs_sum(pair, SIXTEEN: tl.constexpr, BYTE_ASM: tl.constexpr):
    "A word's two int16 added (SIXTEEN: each times 16), by one dp2a with the bytes (1, 1) or (16, 16)."
    ones = tl.full(pair.shape, 4112 if SIXTEEN else 257, tl.int32)  # (ptxas takes the constant as an immediate)
    if BYTE_ASM:
        return tl.inline_asm_elementwise(asm="dp2a.lo.s32.u32 $0, $1, $2, 0;", constraints="=r,r,r", args=[pair, ones],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return _pair_dot(pair, ones)


# a word's nibbles as two words of bytes (the high ones shifted down, or IN_PLACE as bytes of 16 q), then four dp2a
# (two bytes times two int16, added): `_nibbles_dot`'s PTX
_NIBBLE_BYTES = {False: "and.b32 lo, $1, 0x0F0F0F0F; shr.u32 t, $1, 4; and.b32 hi, t, 0x0F0F0F0F;",
                 True: "and.b32 lo, $1, 0x0F0F0F0F; and.b32 hi, $1, 0xF0F0F0F0;"}
_FOUR_DP2A = ("dp2a.lo.s32.u32 t, $2, lo, 0; dp2a.hi.s32.u32 t, $3, lo, t; dp2a.lo.s32.u32 t, $4, hi, t; "
              "dp2a.hi.s32.u32 $0, $5, hi, t;")
_NIBBLES_DOT_ASM = tl.constexpr("{ .reg .b32 lo, hi, t; " + _NIBBLE_BYTES[False] + _FOUR_DP2A + " }")
_NIBBLES_IN_PLACE_DOT_ASM = tl.constexpr("{ .reg .b32 lo, hi, t; " + _NIBBLE_BYTES[True] + _FOUR_DP2A + " }")


@triton.jit
def _nibbles_dot(w, lo01, lo23, hi01, hi23, IN_PLACE: tl.constexpr, BYTE_ASM: tl.constexpr):
    """Σ over a 32-bit word's 8 nibbles (byte j: input j low, input j + HALF high) times x's 16-bit integers
    (`_int16_pairs` of the low inputs, of the high ones): an int32. IN_PLACE: the high nibbles taken where they sit,
    as bytes of 16 q (their inputs scaled by a further 1/16): two instructions for the bytes instead of three."""
    if BYTE_ASM:
        return tl.inline_asm_elementwise(asm=_NIBBLES_IN_PLACE_DOT_ASM if IN_PLACE else _NIBBLES_DOT_ASM,
                                         constraints="=r,r,r,r,r,r", args=[w, lo01, lo23, hi01, hi23], dtype=tl.int32,
                                         is_pure=True, pack=1)
    lo, hi = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
    if IN_PLACE:
        hi = hi << 4
    return (_pair_dot(lo01, lo & 0xFFFF) + _pair_dot(lo23, (lo >> 16) & 0xFFFF)
            + _pair_dot(hi01, hi & 0xFFFF) + _pair_dot(hi23, (hi >> 16) & 0xFFFF))


@triton.jit
def _pair_dot(pair, two_bytes):
    "dp2a without the instruction: a word's two int16 times the two low bytes of `two_bytes`, added."
    return ((pair << 16) >> 16) * (two_bytes & 0xFF) + (pair >> 16) * ((two_bytes >> 8) & 0xFF)


@triton.jit
def _x_integers(x_ptr, b0, lane, M, K, ROWS: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                EVEN: tl.constexpr, IN_PLACE: tl.constexpr, BYTE_ASM: tl.constexpr):
    """For each row m of x, this thread's chunk of a step as `_int4_step_integers` takes it: (its 16-bit pairs per 8
    bytes of weights (low inputs 01, 23, high inputs 01, 23), 2^e / 2^SHIFT, Σx): scaled by a power of two (IN_PLACE:
    the high inputs by a further 1/16), summed from the same integers."""
    HALF: tl.constexpr = GROUP // 2
    # x * 2^(SHIFT - e) is under 2^(SHIFT + 1): a row's sum of the chunk's 2 x CHUNK products by q <= 15 stays under 2^22
    SHIFT: tl.constexpr = 13 if CHUNK == 8 else 12
    c_ok, x_first = _x_chunk(b0, lane, K, GROUP, CHUNK, EVEN)
    xs = ()
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        loaded = ()  # the halves (`_x_as_floats`) of the low inputs and of the high ones, for each 8 bytes of the chunk
        big = tl.zeros_like(c_ok.to(tl.float32))  # max |x| over the chunk
        for h in tl.static_range(CHUNK // 8):
            first = m * K + x_first[:, :, None] + 8 * h
            lo = _x_as_floats(x_ptr, first, x_ok)
            hi = _x_as_floats(x_ptr, first + HALF, x_ok)
            for half in tl.static_range(2):
                big = tl.maximum(big, tl.maximum(tl.max(tl.abs(lo[half]), axis=2), tl.max(tl.abs(hi[half]), axis=2)))
            loaded = loaded + ((lo, hi),)
        # 2^e <= max |x| with e >= -100 (a chunk of zeros, or below 2^-100: zeros); x * 2^(SHIFT - e) < 2^(SHIFT + 1)
        power = tl.maximum(big.to(tl.int32, bitcast=True) & 0x7F800000, 27 << 23)
        scale = (((127 + SHIFT) << 23) - (power - (127 << 23))).to(tl.float32, bitcast=True)
        unscale = power.to(tl.float32, bitcast=True) * (1.0 / (1 << SHIFT))
        pairs = ()
        sums = tl.zeros_like(lane)  # Σ x of the chunk as the dot takes it: its integers (IN_PLACE: the high ones' x 16)
        for h in tl.static_range(CHUNK // 8):
            lo, hi = loaded[h]
            lo01, lo23 = _int16_pairs(lo[0], lo[1], scale, BYTE_ASM)
            hi01, hi23 = _int16_pairs(hi[0], hi[1], scale * 0.0625 if IN_PLACE else scale, BYTE_ASM)
            sums += tl.sum(_pairs_sum(lo01, False, BYTE_ASM) + _pairs_sum(lo23, False, BYTE_ASM)
                           + _pairs_sum(hi01, IN_PLACE, BYTE_ASM) + _pairs_sum(hi23, IN_PLACE, BYTE_ASM), axis=2)
            pairs = pairs + ((lo01, lo23, hi01, hi23),)
        x_sum = ((sums + 0x4B400000).to(tl.float32, bitcast=True) - ROUND_TO_INTEGER) * unscale
        xs = xs + ((pairs, unscale, x_sum),)
    return xs


@triton.jit
def _int4_step_integers(accs, ws, x_ptr, b0, lane, M, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr, BYTE_ASM: tl.constexpr):
    """`_int4_step` in integers: x's chunk as 16-bit integers once for all rows (`_x_integers`), each weight word's
    nibbles multiplied and added by `_nibbles_dot`, 8 bytes of a chunk at a time."""
    IN_PLACE: tl.constexpr = CHUNK == 8  # (16-byte chunks would keep 9 bits of their high inputs: they shift instead)
    xs = _x_integers(x_ptr, b0, lane, M, K, ROWS, GROUP, CHUNK, EVEN, IN_PLACE, BYTE_ASM)
    new = ()
    for r in tl.static_range(BLOCK_N):
        chunk, s, mn = ws[r]
        s, mn = s.to(tl.float32), mn.to(tl.float32)
        for m in tl.static_range(ROWS):
            pairs, unscale, x_sum = xs[m]
            dots = tl.zeros_like(lane)
            for h in tl.static_range(CHUNK // 8):
                lo01, lo23, hi01, hi23 = pairs[h]
                dots += tl.sum(_nibbles_dot(chunk[h], lo01, lo23, hi01, hi23, IN_PLACE, BYTE_ASM), axis=2)
            # Σ (x scaled) q of the chunk, |.| < 2^22: a float by the rounding trick backwards
            xq = (dots + 0x4B400000).to(tl.float32, bitcast=True) - ROUND_TO_INTEGER
            new = new + (accs[r * ROWS + m] + xq * (s * unscale) + x_sum * mn,)
    return new


# %% [markdown]
# The kernel itself: a step's weights (bytes, or the same bytes as words for the integers), the
# step in either arithmetic, and chapter 09's epilogue.

# %%
#| export
@triton.jit
def _int4_weights(q_ptr, scale_ptr, min_ptr, b0, lane, first_col, N, K, stride_qn, BLOCK_N: tl.constexpr,
                  GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr, SWIGLU: tl.constexpr,
                  INT_DOT: tl.constexpr, PAIRED: tl.constexpr):
    """A step's weights of the program's rows: per row (this thread's chunk of bytes, its group's scale and minimum).
    INT_DOT: the chunk as CHUNK / 8 tiles of two 32-bit words each (`_int4_step_integers`). PAIRED: each scale
    followed by its minimum (`pair_scales`), both in one 4-byte load."""
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])  # [SLABS, 32] a thread's first byte in the row
    c_ok = (start < K // 2) | EVEN  # EVEN: whole steps, whole programs and ROWS == M: no masks
    g = start // (GROUP // 2)  # the chunk's group (a chunk never straddles two: half a group is whole chunks)
    ws = ()
    for r in tl.static_range(BLOCK_N):
        row, row_ok = _program_row(first_col, r, N, BLOCK_N // 2, SWIGLU)
        ok = c_ok & (row_ok | EVEN)
        at = row * (K // GROUP) + g
        if INT_DOT:  # 8 bytes a tile: 16 in one would be laid out over two threads, as x's 16 inputs are
            words = q_ptr.to(tl.pointer_type(tl.int32)) + tl.multiple_of(row * (stride_qn // 4) + start // 4, [2, 2])
            chunk = ()
            for h in tl.static_range(CHUNK // 8):
                chunk = chunk + (tl.load(words[:, :, None] + 2 * h + tl.arange(0, 2)[None, None, :],
                                         mask=ok[:, :, None], other=0),)
        else:
            chunk = tl.load(q_ptr + row * stride_qn + start[:, :, None] + tl.arange(0, CHUNK)[None, None, :],
                            mask=ok[:, :, None], other=0)
        if PAIRED:
            pair = tl.load(scale_ptr + tl.multiple_of(2 * at, [2, 2])[:, :, None] + tl.arange(0, 2)[None, None, :],
                           mask=ok[:, :, None], other=0.0)
            s, mn = tl.split(pair)
            ws = ws + ((chunk, s, mn),)
        else:
            ws = ws + ((chunk, tl.load(scale_ptr + at, mask=ok, other=0.0), tl.load(min_ptr + at, mask=ok, other=0.0)),)
    return ws


@triton.jit
def _int4_step(accs, ws, x_ptr, b0, lane, M, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
               CHUNK: tl.constexpr, EVEN: tl.constexpr, BYTE_ASM: tl.constexpr, INT_DOT: tl.constexpr):
    "accs + one step: x's chunk (loaded, converted and summed once for all rows) times each row's weights `ws`."
    if INT_DOT:
        new = _int4_step_integers(accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM)
    else:
        new = _int4_step_floats(accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM)
    return new


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, scale_ptr, min_ptr, out_ptr, res_ptr, sums_ptr, next_g_ptr, normed_ptr,
                      M, N, K, stride_qn, stride_rm, eps,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                      SLABS: tl.constexpr, EVEN: tl.constexpr, BYTE_ASM: tl.constexpr, PDL: tl.constexpr,
                      PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr, SWIGLU: tl.constexpr, EARLY_W: tl.constexpr,
                      RESIDUAL: tl.constexpr, NORM_SUMS: tl.constexpr, HAND_OFF: tl.constexpr,
                      EARLY_EPI: tl.constexpr, INT_DOT: tl.constexpr, PAIRED: tl.constexpr):
    _start_gemv(q_ptr, N, stride_qn, BLOCK_N, PDL, PREFETCH, not EARLY_W, SWIGLU)  # as chapter 09's GEMV: a dependent launch
    STEP: tl.constexpr = SLABS * 32 * CHUNK  # bytes of a row per step: a slab of 32 x CHUNK per warp
    lane = tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [SLABS, 32]: a thread's place in a step
    HALF_N: tl.constexpr = BLOCK_N // 2  # SWIGLU: rows r < HALF_N of the gate half, r >= HALF_N their up rows
    first_col = tl.program_id(0) * (HALF_N if SWIGLU else BLOCK_N)  # the program's first output column
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * (BLOCK_N * ROWS)  # [row r, x row m] at r * ROWS + m
    first = 0
    if EARLY_W:  # the first EARLY_W steps' weights asked for before waiting for x (as chapter 09's GEMV)
        early = ()
        for e in tl.static_range(EARLY_W):
            early = early + (_int4_weights(q_ptr, scale_ptr, min_ptr, e * STEP, lane, first_col, N, K, stride_qn,
                                           BLOCK_N, GROUP, CHUNK, EVEN, SWIGLU, INT_DOT, PAIRED),)
        _wait_for_previous(PDL)
        for e in tl.static_range(EARLY_W):
            accs = _int4_step(accs, early[e], x_ptr, e * STEP, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM,
                              INT_DOT)
        first = EARLY_W * STEP
    handed = ()  # NORM_SUMS: each row's squares summed by the GEMV before (chapter 09's `hand_off`), asked for once
    for m in tl.static_range(ROWS if NORM_SUMS else 0):  # x is there (as chapter 09's GEMV), used at the end
        handed = handed + (tl.load(sums_ptr + m, mask=m < M, other=0.0),)
    if EARLY_EPI:  # the epilogue's residual and norm weights asked for before the loop (as chapter 09's GEMV)
        residuals, next_gs = _rows_epilogue_operands(res_ptr, next_g_ptr, first_col, M, N, stride_rm, ROWS, BLOCK_N,
                                                     RESIDUAL, HAND_OFF)
    for b0 in tl.range(first, K // 2, STEP, num_stages=LOOP_STAGES):
        ws = _int4_weights(q_ptr, scale_ptr, min_ptr, b0, lane, first_col, N, K, stride_qn, BLOCK_N, GROUP, CHUNK, EVEN,
                           SWIGLU, INT_DOT, PAIRED)
        accs = _int4_step(accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM, INT_DOT)
    if not EARLY_EPI:
        residuals, next_gs = _rows_epilogue_operands(res_ptr, next_g_ptr, first_col, M, N, stride_rm, ROWS, BLOCK_N,
                                                     RESIDUAL, HAND_OFF)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):  # chapter 09's `gemv` epilogue, one output at a time
        rstd = _norm_scale(handed[m], K, eps) if NORM_SUMS else 1.0
        squares = 0.0  # HAND_OFF: this program's share of h's squares
        for r in tl.static_range(HALF_N if SWIGLU else BLOCK_N):
            row, row_ok = _program_row(first_col, r, N, HALF_N, SWIGLU)
            ok = row_ok & (m < M)
            total = tl.sum(tl.sum(accs[r * ROWS + m], axis=1), axis=0) * rstd
            if SWIGLU:  # silu(gate) * up, rounded as the GEMV's stores and `silu_mul` round them (chapter 09)
                up = tl.sum(tl.sum(accs[(r + HALF_N) * ROWS + m], axis=1), axis=0) * rstd
                tl.store(out_ptr + m * (N // 2) + row, _silu_times(total.to(dtype).to(tl.float32),
                                                                   up.to(dtype).to(tl.float32), dtype), mask=ok)
            else:
                if RESIDUAL:  # added as rounded, as a separate add would find it
                    total = total.to(dtype).to(tl.float32) + residuals[r * ROWS + m]
                tl.store(out_ptr + m * N + row, total.to(dtype), mask=ok)
                if HAND_OFF:  # the next norm but its 1 / rms: h x its weight stored, h's squares summed
                    h = total.to(dtype).to(tl.float32)
                    tl.store(normed_ptr + m * N + row, (h * next_gs[r]).to(dtype), mask=ok)
                    squares += tl.where(ok, h * h, 0.0)
        if HAND_OFF:
            if m < M:  # (M may be specialised to 1, so m < M a constant: an `if`, not a mask)
                tl.atomic_add(sums_ptr + m, squares, sem="relaxed")



# %% [markdown]
# Its configuration, like chapter 09's `gemv_config`, depends on the shape only (so results do
# not depend on the batch): the chain lab's winners above, as a rule. Long rows (o, down) take
# 16-byte chunks over four warps; short ones 8-byte chunks, one warp for the wide gate-up (the
# most programs), two for qkv. The gate-up takes 8 rows a program (4 gate rows with their up
# rows): in a chain of plain GEMVs 4 and 8 rows tie (12.88 and 12.98 µs a matrix), but inside the
# decode step, as the SiLU-mul GEMV it is there, 8 rows made the int4 step 1.469 ms against
# 1.496 / 1.494 with 4 (`kernels_lab/decode_overlap.py`; 6 rows 1.477). Compiled
# offline, 8 rows take 3.78 instructions a weight against 4.19 and have 64 bytes of weights a
# thread on their way against 32, at 128 registers a thread against 64. For smaller
# models (fewer outputs) `BLOCK_N` halves, down to 1, until there are at least 256 programs
# (two per SM of an H200); the halving itself is a rule, not a measurement. More rows of x (up
# to 4) take fewer weight rows a program, so the accumulators (`BLOCK_N × ROWS`) stay as many.
#
# Tiles take register caps (`INT4_TILE_MAXNREG`, by tile and arithmetic). In FP32 the gate-up's
# 8 × 1 × 8 compiles to 128 registers a thread, so 16 warps fit an SM; capped at 96 it spills
# nothing and 21 fit, and the int4 decode step took 1.426 ms against 1.470 / 1.467 uncapped
# (104 registers: 1.505). Caps that spill were slower (qkv at 56, o and down at 64).
# In integers the gate-up keeps that cap as measured (80 registers under it; uncapped 64, not
# measured), and qkv's 4 × 2 × 8 takes 80: uncapped, ptxas chose 72 registers and spilled six
# values around its early steps; at 80 it spills none and the step measured the same (1.254 ms
# against 1.250 / 1.254; at 96, 1.311). The caps hold at one row of x only, where they were measured.
# o's 4 × 2 × 16 in integers takes 66 registers uncapped (28 warps an SM). Under a cap of 80 ptxas
# uses 79 (25 warps) for the same 952 instructions a thread, under 96 it uses 87 (23 warps) for 928,
# and the step was faster for fewer warps: 1.174 ms at 80 against 1.183 / 1.181 uncapped (64: 1.180);
# then 1.173 at 96 against 1.182 / 1.181 / 1.183 uncapped and 1.176 / 1.177 at 80 (`kernels_lab/decode_overlap.py`,
# `bash kernels_lab/w1_checks.sh ab`); the bench's W1 at 96: 839.4 / 838.9 tok/s against BF16's
# 419.1 / 419.1 in the same call (2.00×). Lower caps elsewhere, which spill nothing in the integer
# step, were all slower: qkv at 64 or 72 1.215, the gate-up at 80 1.212 (88: 1.181), down at 80 1.207.
#
# Fewer registers are not a win in themselves. With K a constant of the kernel (each row a fixed
# offset from the first, no row stride) the gate-up compiled to 80 registers instead of 128 and o's
# to 56 instead of 96, with fewer instructions, yet the int4 step took 1.518 ms against 1.470 (1.812
# with each step's scales asked for a step ahead; `kernels_lab/decode_overlap.py`).
# Why is still open; only the measurement in the step decides.
#
# Two tiles ask for more than their first step of weights before they wait for x
# (`INT4_TILE_EARLY_STEPS`): qkv's 4 × 2 × 8 its whole row (three steps of 512 bytes: 95 registers,
# 20 warps an SM), down's 4 × 4 × 16 two of its three. A program that starts while the kernel before
# it still runs then has all (or most) of its weights on their way when x is ready, not one step of
# them. The int4 decode step: 1.417 / 1.420 ms against 1.429 / 1.429 / 1.428 / 1.429 without, the
# bench's W1 696.8 / 696.6 tok/s against BF16 419.4 (1.66×). More was not better: down's
# three steps 1.489 ms, the gate-up's five do not fit under its cap (they spill from two on), uncapped
# 1.431 at three. How much any of this can win is bounded: with the int4 GEMVs never waiting for the
# kernel before (wrong values, same work: `kernels_lab/int4_step_bounds.py`) the step takes 1.276 ms,
# with their nibbles also left unpacked 1.060; either alone saves about a tenth of the step.
#
# The tiles were chosen in FP32; in integers (the section above) they were measured again in the
# step (`bash kernels_lab/w1_checks.sh int4-tiles`). Offline, more rows a program pay
# off more in integers (x's conversion is shared by all of them: qkv's 8 × 2 × 8 2.75 instructions
# a weight against 4 × 2 × 8's 3.42), yet in the step every larger tile was slower (qkv 8 × 2 × 8
# 1.307 ms against 1.253 / 1.256). Two changes won: o's rows over two warps, 4 × 2 × 16 (two steps
# a row, 72 registers), 1.236 ms; and the gate-up asking for two of its five steps before its wait
# (96 registers under its cap, no spills), 1.243; together 1.225 against 1.252 / 1.247. Not taken:
# each step's weights asked for a step ahead in the loop (registers double-buffered; the gate-up
# 1.254, down 1.349) and an int4 LM head (1.234 ms: 18 µs a token for a coarser head).

# %%
#| export
GEMV_MIN_PROGRAMS = 256  # about two programs per SM of an H200 (132 SMs)
INT4_EARLY_WEIGHTS = 1  # steps of a program's weights asked for before it waits for x: the first measured faster (below)
INT4_EARLY_EPILOGUE = True  # the residual and norm weights of the epilogue asked for before the loop (chapter 09's GEMV)
# register caps a thread for tiles (BLOCK_N, warps, CHUNK, in integers) at one row of x: in FP32 the gate-up's 8 x 1 x 8
# compiles to 128, 16 warps an SM; at 96 it spills nothing and 21 fit, and the int4 decode step measured faster; in
# integers qkv's 4 x 2 x 8 with its three early steps takes 72 and spills six values, at 80 none (the step the same);
# o's 4 x 2 x 16 in integers takes 66 uncapped, 87 under a cap of 96: fewer warps an SM, yet the step measured faster
INT4_TILE_MAXNREG = {(8, 1, 8, False): 96, (8, 1, 8, True): 96, (4, 2, 8, True): 80, (4, 2, 16, True): 96}
# steps of weights a program asks for before its wait, for tiles (BLOCK_N, warps, CHUNK, in integers) at one row of x
# (others: INT4_EARLY_WEIGHTS): qkv's 4 x 2 x 8 its whole row (three steps), down's 4 x 4 x 16 two of its three; in
# integers the gate-up's 8 x 1 x 8 two of its five (96 registers, no spills; in FP32 they spill under its cap) (below)
INT4_TILE_EARLY_STEPS = {(4, 2, 8, False): 3, (4, 2, 8, True): 3, (4, 4, 16, False): 2, (4, 4, 16, True): 2,
                         (8, 1, 8, True): 2}
# the GEMV's arithmetic in integers (x as 16-bit integers, nibbles as bytes, dp2a: `_int4_step_integers`) where the
# packed rows are whole 32-bit words; else in FP32 (`_int4_step_floats`): measured faster (below)
INT4_INT_DOT = True


def quant_gemv_config(n: int, k: int) -> tuple[int, int, int]:
    "(BLOCK_N, num_warps, CHUNK bytes) for the int4 GEMV of an [n, k] weight at one row (the H200 labs' winners)."
    if k >= 4096:  # long rows (o, down): 16-byte chunks, K split over four warps; o's 4,096 inputs over two
        block_n, warps, chunk = 4, 4 if k > 4096 else 2, 16
    else:
        block_n, warps, chunk = (4, 2, 8) if n < 16384 else (8, 1, 8)
    while block_n > 1 and triton.cdiv(n, block_n) < GEMV_MIN_PROGRAMS:
        block_n //= 2
    return block_n, warps, chunk


# %%
assert [quant_gemv_config(n, k) for n, k in ((6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728))] == \
    [(4, 2, 8), (8, 1, 8), (4, 2, 16), (4, 4, 16)]  # Qwen3-4B: the labs' winners
assert quant_gemv_config(576, 576)[0] == 2 and quant_gemv_config(3072, 1024)[0] == 4  # SmolLM2's o, a 0.6B-sized qkv


# %%
#| export
def _gemv_launch(kernel, x: torch.Tensor, weights: tuple, n: int, block_n: int, num_warps: int,
                 pdl: bool | None = None, prefetch: bool | None = None, loop_stages: int | None = None,
                 maxnreg: int | None = None, swiglu: bool = False, residual: torch.Tensor | None = None,
                 norm_sums: torch.Tensor | None = None, hand_off: tuple | None = None, eps: float = 1e-6,
                 **constexprs):
    """Launch a quantized GEMV kernel (grid over output tiles; x [M <= GEMV_MAX_ROWS, K], weights[0] [N, bytes per row])
    -> [M, N] (`swiglu`: [M, N / 2], a program's BLOCK_N rows half gate, half up); as a dependent launch where the GPU
    has it (default) and with chapter 09's L2 prefetch where asked. `residual`, `norm_sums`, `hand_off`, `eps`: as
    chapter 09's `gemv` (with `hand_off`: -> (out, out x the norm's weight)).
    `maxnreg`: a cap on registers per thread for the compiler (the lab's knob: more warps resident per SM)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, n // 2 if swiglu else n), device=x.device, dtype=x.dtype)
    sums, next_g, normed = hand_off_operands(out, norm_sums, hand_off, out)
    folds = (out if residual is None else residual, sums, next_g, normed)
    pdl = pdl_supported(x.device) if pdl is None else pdl
    if m:
        kernel[(triton.cdiv(out.shape[1], block_n // 2 if swiglu else block_n),)](
                                           x, *weights, out, *folds, m, n, k, weights[0].stride(0),
                                           0 if residual is None else residual.stride(0), eps, ROWS=_pow2(m),
                                           BLOCK_N=block_n, PDL=pdl, launch_pdl=pdl,
                                           PREFETCH=gemv_prefetch(weights[0], pdl, num_warps, prefetch),
                                           LOOP_STAGES=gemv_loop_stages(loop_stages), num_warps=num_warps,
                                           **({"maxnreg": maxnreg} if maxnreg else {}), SWIGLU=swiglu,
                                           RESIDUAL=residual is not None, NORM_SUMS=norm_sums is not None,
                                           HAND_OFF=hand_off is not None, **constexprs)
    return out if hand_off is None else (out, normed)


def pair_scales(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """[N, groups, 2]: each group's scale followed by its minimum (`Int4Linear` keeps them so, and its `scale` and
    `minimum` are the two views): the GEMV then reads a row's pair with one 4-byte load instead of two 2-byte ones."""
    return torch.stack((scale, minimum), dim=-1)


def _scales_as_kernels_read(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(scale, minimum, paired): the two views of one `pair_scales` tensor as they are (paired), else each contiguous
    [N, groups], the layout the kernels index."""
    n, groups = scale.shape
    paired = (scale.dtype == minimum.dtype and scale.stride() == minimum.stride() == (2 * groups, 2)
              and minimum.data_ptr() - scale.data_ptr() == scale.element_size())
    return (scale, minimum, True) if paired else (scale.contiguous(), minimum.contiguous(), False)


def _early_steps(pdl: bool, early_weights: int | None, row_bytes: int, step_bytes: int) -> int:
    "Steps of weights a program asks for before its wait: none unless launched as a dependent, at most a row's steps."
    steps = INT4_EARLY_WEIGHTS if early_weights is None else int(early_weights)
    if steps < 0:
        raise ValueError(f"int4_gemv's early_weights is a number of steps, 0 or more, got {early_weights}")
    return min(steps, triton.cdiv(row_bytes, step_bytes)) if pdl else 0


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              block_n: int | None = None, num_warps: int | None = None, chunk: int | None = None,
              byte_asm: bool | None = None, pdl: bool | None = None, prefetch: bool | None = None,
              loop_stages: int | None = None, maxnreg: int | None = None, swiglu: bool = False,
              early_weights: int | None = None, residual: torch.Tensor | None = None,
              norm_sums: torch.Tensor | None = None, hand_off: tuple | None = None, eps: float = 1e-6,
              int_dot: bool | None = None):
    """x [M <= GEMV_MAX_ROWS, K] @ dequantize_int4(packed, scale, minimum).T through `_int4_gemv_kernel`; `swiglu`:
    the weight is a gate-up matrix [gate | up] and the result silu(gate) * up [M, N / 2], in the kernel's epilogue.
    `residual`, `norm_sums`, `hand_off` (-> (h, h x the norm's weight)), `eps`: the folds of chapter 09's `gemv`.
    `early_weights`: as a dependent launch, the steps of weights asked for before the wait (True: the first; default:
    `INT4_TILE_EARLY_STEPS`'s for the tile and arithmetic at one row, else INT4_EARLY_WEIGHTS)
    `block_n` weight rows a program, `num_warps` (each a slab of K), `chunk` bytes a thread takes of each row per step
    (8 or 16): default `quant_gemv_config`, with `block_n` divided by the rows of x.
    `byte_asm`: nibbles unpacked by `_nibbles_to_f32`'s PTX (default: whenever compiled, not interpreted).
    `pdl`, `prefetch`, `loop_stages`: as chapter 09's `gemv` (a dependent launch by default on Hopper); `maxnreg`:
    a register cap per thread (default: `INT4_TILE_MAXNREG`'s for the tile and arithmetic at one row, else the
    compiler's choice).
    `int_dot`: the arithmetic in integers (`_int4_step_integers`) or in FP32 (default: INT4_INT_DOT, where the packed
    rows start at whole 32-bit words)."""
    (m, k), n = x.shape, packed.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"int4_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}: use int4_matmul")
    pdl = pdl_supported(x.device) if pdl is None else pdl
    group = k // scale.shape[1]
    default = quant_gemv_config(n, k)
    if not block_n:
        block_n = max(2 if swiglu else 1, default[0] // _pow2(max(m, 1)))
        block_n += swiglu and block_n % 2  # (a tile of gate rows and their up rows: even)
    num_warps, chunk = num_warps or default[1], chunk or min(default[2], group // 2)  # (groups of 16: 8-byte chunks)
    if chunk not in (8, 16) or (group // 2) % chunk:
        raise ValueError(f"int4_gemv's chunk is 8 or 16 bytes, dividing half a group ({group // 2} bytes), got {chunk}")
    if packed.numel() >= 2**31:  # the kernel's offsets are 32-bit
        raise ValueError(f"int4_gemv takes weights of under 2^31 bytes, got {packed.numel()}: split the matrix")
    if swiglu and (n % 2 or block_n % 2):
        raise ValueError(f"int4_gemv with swiglu takes gate rows with their up rows: an even N and block_n, got "
                         f"{n} and {block_n}")
    check_gemv_folds("int4_gemv", x, n, swiglu, residual, norm_sums, hand_off)
    whole_words = packed.data_ptr() % 4 == 0 and packed.stride(0) % 4 == 0
    if int_dot and not whole_words:
        raise ValueError(f"int4_gemv's int_dot reads the packed rows as 32-bit words: they must start at multiples of "
                         f"4 bytes, got address {packed.data_ptr()} and row stride {packed.stride(0)}")
    int_dot = (INT4_INT_DOT and whole_words) if int_dot is None else int_dot
    tile = (block_n, num_warps, chunk, bool(int_dot))
    if maxnreg is None and m == 1 and not INTERPRETED:
        maxnreg = INT4_TILE_MAXNREG.get(tile)
    if early_weights is None and m == 1:
        early_weights = INT4_TILE_EARLY_STEPS.get(tile)
    step_bytes = 32 * chunk * num_warps  # of a row, per loop step
    even = n % block_n == 0 and (k // 2) % step_bytes == 0 and m == _pow2(max(m, 1))
    scale, minimum, paired = _scales_as_kernels_read(scale, minimum)
    return _gemv_launch(_int4_gemv_kernel, x, (packed, scale, minimum), n, block_n, num_warps, pdl, prefetch, loop_stages,
                        maxnreg, swiglu, residual, norm_sums, hand_off, eps, GROUP=group, CHUNK=chunk, SLABS=num_warps,
                        EVEN=even, EARLY_W=_early_steps(pdl, early_weights, k // 2, step_bytes),
                        EARLY_EPI=INT4_EARLY_EPILOGUE, BYTE_ASM=not INTERPRETED if byte_asm is None else byte_asm,
                        INT_DOT=bool(int_dot), PAIRED=paired)


# %% [markdown]
# The launcher picks the tiles and the split. Rows: 1 or 2 rows multiply-and-sum; 3 to 16 rows
# (and more, for the lab) take `tl.dot` tiles of at least 16. Split: enough programs for about
# four per SM (on a CPU, where the interpreter runs them one by one, a handful).
#
# Which kernel: `int4_matmul` and `gguf_matmul` send up to `GEMV_MAX_ROWS` (4) rows to their
# GEMV path and more rows to the split-K kernel; `kernel="gemv"` or `"split_k"` forces one (the
# tests and the lab compare them).

# %%
#| export
SKINNY_MAX_ROWS = 16  # up to this many rows the fused kernel runs; above, dequantize + dense matmul


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, size, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    "out = sum of the SPLIT fp32 partials [SPLIT, size], in order, cast to out's dtype: one launch, not two."
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + i * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _skinny_matmul(kernel, x: torch.Tensor, weights: tuple, n: int, k_step: int, block_n: int | None = None,
                   split: int | None = None, num_warps: int = 4, use_dot: bool | None = None,
                   **constexprs) -> torch.Tensor:
    "Launch one of the skinny kernels on x [M, K]; returns [M, N] in x's dtype. use_dot: tl.dot tiles (default: above 2 rows)."
    x = x.contiguous()
    m, k = x.shape
    use_dot = m > 2 if use_dot is None else use_dot
    block_m = max(16, min(_pow2(m), 64)) if use_dot else _pow2(m)
    block_n = block_n or (64 if use_dot else 64 // block_m)
    n_tiles, m_tiles, k_steps = triton.cdiv(n, block_n), triton.cdiv(m, block_m), triton.cdiv(k, k_step)
    if split is None:
        split = max(1, min(k_steps, _target_programs(x.device) // n_tiles))
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)  # no empty slices
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    partials = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    kernel[(n_tiles, split, m_tiles)](
        x, *weights, partials, m, n, k, steps_per_split * k_step, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_DOT=use_dot, UPCAST=INTERPRETED, PRECISION=_dot_precision(x.dtype), num_warps=num_warps, **constexprs)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](partials, out, m * n, SPLIT=split, BLOCK=1024)
    return out


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, impl: str = "auto", **launch) -> torch.Tensor:
    "x [M, K] @ (scale[:, None] * q).T -> [M, N] in x's dtype."
    if kernel_backend(x.device, impl) == "torch":
        return int8_matmul_reference(x, q, scale)
    block_k = launch.pop("block_k", 128)
    return _skinny_matmul(_int8_matmul_kernel, x, (q, scale), q.shape[0], block_k, BLOCK_K=block_k, **launch)


SKINNY_KERNELS = ("gemv", "split_k")


def _skinny_kernel(kernel: str | None, rows: int) -> str:
    "The kernel for `rows` rows: 'gemv' up to GEMV_MAX_ROWS, 'split_k' above, unless `kernel` names one."
    kernel = kernel or ("gemv" if rows <= GEMV_MAX_ROWS else "split_k")
    if kernel not in SKINNY_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(SKINNY_KERNELS)}")
    if kernel == "gemv" and rows > GEMV_MAX_ROWS:
        raise ValueError(f"the gemv kernels take at most {GEMV_MAX_ROWS} rows, got {rows}")
    return kernel


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                impl: str = "auto", kernel: str | None = None, **launch) -> torch.Tensor:
    "x [M, K] @ dequantize_int4(packed, scale, minimum).T -> [M, N] in x's dtype; `launch` goes to the kernel's launcher."
    if kernel_backend(x.device, impl) == "torch":
        return int4_matmul_reference(x, packed, scale, minimum)
    if _skinny_kernel(kernel, x.shape[0]) == "gemv":
        return int4_gemv(x, packed, scale, minimum, **launch)
    group = x.shape[1] // scale.shape[1]
    scale, minimum, paired = _scales_as_kernels_read(scale, minimum)
    return _skinny_matmul(_int4_matmul_kernel, x, (packed, scale, minimum), packed.shape[0], group, GROUP=group,
                          PAIRED=paired, **launch)


def int8_matmul_reference(x, q, scale):
    "Dense: the int8 matrix converted to x's dtype, one matmul, then the per-row scale (chapter 09's GEMV reference)."
    return gemv_reference(x, q, None, scale)


def int4_matmul_reference(x, packed, scale, minimum):
    return F.linear(x, dequantize_int4(packed, scale, minimum, x.dtype))


# %% [markdown]
# The kernels against the references, under Triton's interpreter on a CPU: 1, 2, 5 and 17 rows
# (multiply-and-sum, and `tl.dot` tiles), with and without splits, ragged N and K, FP32 and BF16.

# %%
def assert_matches(got, want, label, atol=1e-4):
    """fp32: elementwise to 1e-4 (or `atol`): sums of at most 1,280 FP32 products in another order, each addition
    rounded by 2^-24, stay far under it at these sizes; bf16: 1% of the output's norm (the reference rounds the
    weights to bf16, up to 2^-8 relative each, the kernels don't: errors of random sign, ~2^-8/√3 of the norm)."""
    assert got.dtype == want.dtype and got.shape == want.shape, label
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda s: f"{label}: {s}")
    else:
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-2, (label, rel)

def check_kernel(fn, reference, x, atol=1e-4, **launch):
    assert_matches(fn(x, impl="triton", **launch), reference(x), f"M={x.shape[0]} {x.dtype} {launch}", atol)

torch.manual_seed(0)
w = torch.randn(40, 384) * 0.1  # N = 40: not a multiple of the tiles
q8, s8 = quantize_int8(w)
q4 = quantize_int4(w)
for m, dtype, launch in [(1, torch.float32, {}), (1, torch.float32, dict(split=3)), (2, torch.float32, dict(split=1)),
                         (5, torch.float32, dict(split=2)), (17, torch.float32, {}), (1, torch.bfloat16, {}),
                         (8, torch.bfloat16, dict(split=3))]:
    x = torch.randn(m, 384, dtype=dtype)
    check_kernel(lambda x, **kw: int8_matmul(x, q8, s8, **kw), lambda x: int8_matmul_reference(x, q8, s8), x, **launch)
    check_kernel(lambda x, **kw: int4_matmul(x, *q4, kernel="split_k", **kw), lambda x: int4_matmul_reference(x, *q4),
                 x, **launch)
# K not a multiple of the int8 step: the last step is masked
q8b, s8b = quantize_int8(torch.randn(24, 200))
check_kernel(lambda x, **kw: int8_matmul(x, q8b, s8b, **kw), lambda x: int8_matmul_reference(x, q8b, s8b), torch.randn(3, 200), split=2)
assert int8_matmul(torch.randn(2, 200), q8b, s8b).shape == (2, 24)  # impl="auto" on a CPU: the reference

# %% [markdown]
# The int4 GEMV on 0 to 4 rows: groups of 128, 64 and 32; N not a multiple of `BLOCK_N`; K not a
# multiple of a step (the last step masked), whole steps (no masks); FP32 and BF16.

# %%
for group, k in ((128, 384), (128, 512), (64, 576), (32, 96)):  # 512: whole steps at one warp
    # N = 12 rows: not a multiple of 8 or 16, so those tiles end masked (each row costs the interpreter ~0.1 s)
    q4g = quantize_int4(torch.randn(12, k) * 0.1 + torch.linspace(-0.2, 0.5, k), group)
    reference = lambda x: int4_matmul_reference(x, *q4g)
    for m, dtype, launch in [(1, torch.float32, {}), (2, torch.float32, dict(block_n=16, num_warps=2)),
                             (3, torch.float32, dict(block_n=4, chunk=16 if group > 32 else 8)),
                             (4, torch.bfloat16, dict(block_n=1)), (1, torch.bfloat16, dict(block_n=8, num_warps=1)),
                             (2, torch.bfloat16, dict(maxnreg=64)), (1, torch.float32, dict(block_n=8, chunk=16)),
                             (1, torch.bfloat16, dict(int_dot=False)), (3, torch.float32, dict(int_dot=False, chunk=8))]:
        x = torch.randn(m, k, dtype=dtype)
        # in FP32 the high nibbles keep ~13 bits (above); in integers x keeps 13-14 bits of its chunk's largest input,
        # in 8-byte chunks the high nibbles' 10, with errors of either sign: here under 2^-10 of Σ|x| · scale
        check_kernel(lambda x, **kw: int4_matmul(x, *q4g, **kw), reference, x, 2**-10 * q4g[1].max().item() * x.abs().sum().item(), **launch)
assert int4_matmul(torch.zeros(0, 96), *q4g, impl="triton").shape == (0, 12)
# the integers' rounding: an input far below its chunk's largest keeps only its top bits (here none: 2^-30 of it), so
# the result moves by at most 2^-10 of that largest input per weight (2^-14 for a low nibble's): int4's own steps are far
# coarser
x = torch.randn(1, 96)
x[0, ::16] = 1000.0  # one large input in every chunk
x[0, 1::16] = 1000.0 * 2**-30
floats, integers = int4_gemv(x, *q4g, int_dot=False), int4_gemv(x, *q4g, int_dot=True)
want = int4_matmul_reference(x, *q4g)
for got in (floats, integers):  # (FP32 too loses bits of the small inputs next to 1000: the high nibbles' offsets)
    assert (got - want).abs().max() <= 2**-10 * 1000.0 * 15 * q4g[1].float().max() * 96
assert not torch.equal(integers, floats)
# the largest sums: every input of a thread's chunk just under a power of two and every nibble 15 (each group one weight
# 0, the rest 1): 8- and 16-byte chunks alike stay exact to FP32's rounding (a 16-byte chunk with x scaled under 2^14
# would sum past 2^22, where the float trick breaks: 45% too large)
ones = quantize_int4(torch.ones(8, 512).index_fill_(1, torch.arange(0, 512, 128), 0.0))
assert (ones[0] >> 4).min() == 15 and (ones[0] & 15).sum() == 15 * (8 * 256 - 8 * 4)  # each group's first nibble 0
for value, dtype in ((1.9921875, torch.float32), (-1.9921875, torch.float32), (1.9921875, torch.bfloat16)):
    flat = torch.full((1, 512), value, dtype=dtype)  # (1.9921875: the largest BF16 under 2)
    want = int4_matmul_reference(flat.float(), *ones)
    for chunk in (8, 16):
        got = int4_gemv(flat, *ones, chunk=chunk, int_dot=True).float()
        # FP32: exact integer sums, then one conversion and one scaling (2^-24 each); BF16 out: one rounding, which
        # the interpreter does by truncation (under 2^-7)
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0)
# scales paired with their minimums (`pair_scales`, as Int4Linear keeps them): the same bits from the GEMV and the
# skinny matmul; any other layout of the two (here a transposed copy) is made contiguous first
paired = pair_scales(*q4g[1:])
for rows in (1, 3, 6):
    x_rows = torch.randn(rows, 96)
    assert torch.equal(int4_matmul(x_rows, q4g[0], paired[..., 0], paired[..., 1], impl="triton"),
                       int4_matmul(x_rows, *q4g, impl="triton"))
assert torch.equal(int4_gemv(x_rows[:1], q4g[0], q4g[1].t().contiguous().t(), q4g[2]), int4_gemv(x_rows[:1], *q4g))
# packed rows that do not start at whole 32-bit words: FP32 (the default), or an error that says so
shifted = torch.empty(q4g[0].numel() + 1, dtype=torch.uint8)[1:].view(q4g[0].shape)
shifted.copy_(q4g[0])
assert torch.equal(int4_gemv(x, shifted, *q4g[1:]), floats)
with pytest.raises(ValueError, match="int_dot reads the packed rows as 32-bit words: they must start at multiples of 4"):
    int4_gemv(x, shifted, *q4g[1:], int_dot=True)
with pytest.raises(ValueError, match="the gemv kernels take at most 4 rows, got 5"):
    int4_matmul(torch.zeros(5, 96), *q4g, impl="triton", kernel="gemv")
with pytest.raises(ValueError, match="unknown kernel 'splitk'; choose one of gemv, split_k"):
    int4_matmul(torch.zeros(1, 96), *q4g, impl="triton", kernel="splitk")
# `swiglu`: a gate-up matrix's GEMV with SiLU-mul in its epilogue gives the bits of the GEMV followed by `silu_mul`
for m, k, launch in ((1, 384, {}), (2, 96, dict(block_n=4)), (1, 512, dict(block_n=8, num_warps=1)), (3, 576, {})):
    q4s = quantize_int4(torch.randn(24, k) * 0.1, int4_group_size(k))  # 12 gate rows, then their 12 up rows
    x = torch.randn(m, k).bfloat16()
    want = silu_mul(int4_gemv(x, *q4s, **launch), impl="triton")
    assert torch.equal(int4_gemv(x, *q4s, swiglu=True, **launch), want), (m, k, launch)
with pytest.raises(ValueError, match="an even N and block_n, got 12 and 3"):
    int4_gemv(torch.zeros(1, 96), *q4g, swiglu=True, block_n=3)

# %% [markdown]
# The int4 GEMV takes chapter 09's epilogue folds too (`residual`, `hand_off`, `norm_sums`), so a
# decode step in int4 hands its norms from GEMV to GEMV as int8's does (chapter 09a):
# o and down add the residual and store h·g with h's squares summed; qkv and gate-up take h·g and
# scale by 1/rms at the end. The same bits as the plain GEMV plus chapter 09's separate kernels
# where nothing is reassociated; the consumer within rounding of `rmsnorm` then the GEMV.
# Measured (`kernels_lab/decode_overlap.py int4`, one H200): the step 1.604 → **1.556 ms**, W1
# 625.3 tok/s against BF16's 414.7 in the same call. Its residual and norm weights are asked for
# before the loop (`INT4_EARLY_EPILOGUE`; after the input wait): 1.530 → 1.519 ms. (Chapter 09's
# int8 tiles lost with theirs early: more registers, fewer programs an SM.)

# %%
from forge_engine.kernels import add_rmsnorm, rmsnorm
# n is the next GEMV's K: one group of 64, or three of 32 with the last step masked (the interpreter's time goes as
# n times the rows of x, ~0.03 s a weight row and a row of x here)
for m, k, n, launch in ((1, 384, 64, {}), (2, 256, 96, dict(block_n=4, num_warps=1)), (3, 512, 96, {})):
    q_in, q_out = quantize_int4(torch.randn(n, k) * 0.1), quantize_int4(torch.randn(16, n) * 0.1)
    x, r = torch.randn(m, k).bfloat16(), (4 * torch.randn(m, n)).bfloat16()
    g, sums = (torch.rand(n) + 0.5).bfloat16(), torch.zeros(m)
    h, hg = int4_gemv(x, *q_in, residual=r, hand_off=(g, sums), **launch)
    plain = int4_gemv(x, *q_in, **launch)
    assert torch.equal(h, add_rmsnorm(plain, r, torch.ones(n, dtype=torch.bfloat16), 1e-6, impl="triton")[1])
    assert torch.equal(int4_gemv(x, *q_in, residual=r, **launch), h)
    # h · g: one BF16 rounding on each side, done two ways (bit for bit on a GPU; the interpreter truncates):
    # within one BF16 step, under bf16's default rtol of 2^-6
    torch.testing.assert_close(hg, h * g)
    torch.testing.assert_close(sums, h.float().square().sum(-1))  # FP32 sums of n squares in another order: ~n·2^-24
    for swiglu in (False, True):
        got = int4_gemv(hg, *q_out, norm_sums=sums, eps=1e-5, swiglu=swiglu)
        want = int4_gemv(rmsnorm(h, g, 1e-5, impl="triton"), *q_out, swiglu=swiglu)
        # the norm applied after the GEMV (got) or to its BF16 input (want): x · rstd · g rounded to BF16 (2^-8) at a
        # different place, and FP32 sums over n inputs: a few 2^-8 of the largest output
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())
with pytest.raises(ValueError, match=r"int4_gemv's hand_off needs a residual and a norm weight \[12\]"):
    int4_gemv(torch.zeros(1, 96), *q4g, hand_off=(torch.ones(12), torch.zeros(1)))
with pytest.raises(ValueError, match=r"int4_gemv's norm_sums must be float32 \[2\] on cpu"):
    int4_gemv(torch.zeros(2, 96), *q4g, norm_sums=torch.zeros(1))
with pytest.raises(ValueError, match=r"int4_gemv's early_weights is a number of steps, 0 or more, got -1"):
    int4_gemv(torch.zeros(1, 96), *q4g, early_weights=-1)

# %% [markdown]
# ## GGUF blocks, kept as they are
#
# A GGUF file of chapter 01a stores each row as blocks of 32 or 256 weights with their scales.
# With `--quantization gguf` we keep those bytes, row by row, as a `[N, bytes_per_row]` uint8
# matrix, and the kernel decodes each weight where it needs it. The same formulas as the
# dequantizers of chapter 01a, per weight `j` of a block:
#
# | type | block | bytes | weight `j` |
# |---|---|---|---|
# | Q8_0 | 32 | 34 | `d · int8[2 + j]` |
# | Q4_0 | 32 | 18 | `d · (nibble − 8)`, byte `2 + j % 16`, high nibble for `j ≥ 16` |
# | Q4_1 | 32 | 20 | `d · nibble + m`, byte `4 + j % 16` |
# | Q5_0 | 32 | 22 | `d · (q − 16)`, `q` = the Q4_0 nibble of byte `6 + j % 16` plus 16 · bit `j` of bytes 2..5 |
# | Q5_1 | 32 | 24 | `d · q + m`, nibble in byte `8 + j % 16`, fifth bit `j` of bytes 4..7 |
# | Q4_K | 256 | 144 | `d · sc[t] · nibble − dmin · mn[t]`, sub-block `t = j / 32`, byte `16 + 32 (j / 64) + j % 32`, high nibble for odd `t` |
# | Q5_K | 256 | 176 | as Q4_K with `q` = nibble of byte `48 + 32 (j / 64) + j % 32` plus 16 · bit `t` of byte `16 + j % 32` |
# | Q6_K | 256 | 210 | `d · sc[j / 16] · (q − 32)`, half `h = j / 128`, `r = j % 128`: low 4 bits in byte `64 h + r % 64` (high nibble for `r ≥ 64`), top 2 bits at bit `2 (r / 32)` of byte `128 + 32 h + r % 32`; int8 `sc` at byte 192, `d` at 208 |
#
# `d`, `m`, `dmin` are float16 at bytes 0 and 2 (Q6_K: 208); the K types' eight 6-bit scales
# `sc` and mins `mn` are packed in bytes 4..15 as chapter 01a explains. A float16 is assembled
# from its two bytes (blocks of 34, 18 or 210 bytes do not keep 4-byte alignment, so we read
# bytes). A typical `Q4_K_M` file mixes Q4_K and Q6_K matrices (`Q5_K_M`: Q5_K and Q6_K), and
# all of them load. Other types (Q2_K, Q3_K, the IQ types, ...) are not kept quantized: such a
# file loads dequantized, without `--quantization gguf`.
#
# The kernel works on whole blocks: a step of K is `BLOCK_K / QK` blocks of each of its rows, a
# `[BLOCK_N, blocks, QK]` tile, so the numbers that belong to a whole block (`d`, `m`, `dmin`)
# are read once per block and broadcast over its weights. The tile is then flattened to
# `[BLOCK_N, BLOCK_K]` for the same multiply-and-sum (or `tl.dot`) as the int8 kernel. Up to
# four rows take it without split and without `tl.dot`, in `gguf_gemv_config`'s tiles: wide steps
# of K and few rows per program, the GEMV shape (the H200 sweep of `kernels_lab/quant_gemv.py` at one
# row: Q4_K 8 rows a program below 16,384 outputs, else 4, in steps of 1,024; Q6_K 2 rows in steps
# of 512); more rows take the split-K launch.
#
# Llama's q/k rows are stored permuted for llama.cpp's rotary layout (chapter 01a). The
# un-permutation moves whole rows, so it applies to the rows of blocks just as well.

# %%
#| export
# GGML type number -> (name, weights per block, bytes per block). Plain numbers, so that the int8 / int4
# paths import without the `gguf` package (the GPU machine may not have it); chapter 01a is imported lazily.
KEPT_GGUF_TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                   7: ("Q5_1", 32, 24), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


@triton.jit
def _load_f16(p, mask):
    "The float16 at byte address p (two bytes, little-endian), as float32."
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_byte(p, mask):
    "The bytes at p, as int32 (shifts and ORs on them then need no casts)."
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _nibble(byte, high):
    "The high 4 bits of each byte where `high`, else the low 4."
    return tl.where(high, byte >> 4, byte & 0x0F)


@triton.jit
def _k_scale_min(blk, t, mask):
    "Q4_K / Q5_K: the 6-bit scale and min of sub-block t (0..7), unpacked from bytes 4..15, as float32."
    s_t = _load_byte(blk + 4 + t, mask)
    s_t4 = _load_byte(blk + 8 + t, mask)
    s_tm4 = _load_byte(blk + t, mask)  # scale byte t - 4: used only for t >= 4
    sc = tl.where(t < 4, s_t & 63, (s_t4 & 0x0F) | ((s_tm4 >> 6) << 4))
    mn = tl.where(t < 4, s_t4 & 63, (s_t4 >> 4) | ((s_t >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _gguf_weights(blk, j, mask, QTYPE: tl.constexpr):
    """Weights j [1, 1, QK] of the blocks at byte addresses blk [BN, NB, 1] -> [BN, NB, QK] float32.
    `mask` [BN, NB, 1] says which blocks exist. Per-block numbers are [BN, NB, 1] loads: once per block."""
    if QTYPE == 8:  # Q8_0
        w = _load_f16(blk, mask) * tl.load(blk + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    elif QTYPE == 2:  # Q4_0
        w = _load_f16(blk, mask) * (_nibble(_load_byte(blk + 2 + j % 16, mask), j >= 16) - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        q = _nibble(_load_byte(blk + 4 + j % 16, mask), j >= 16)
        w = _load_f16(blk, mask) * q.to(tl.float32) + _load_f16(blk + 2, mask)
    elif QTYPE == 6:  # Q5_0: fifth bits at bytes 2..5, nibbles from byte 6
        fifth = (_load_byte(blk + 2 + j // 8, mask) >> (j % 8)) & 1
        q = _nibble(_load_byte(blk + 6 + j % 16, mask), j >= 16) | (fifth << 4)
        w = _load_f16(blk, mask) * (q - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1: d, m, fifth bits at bytes 4..7, nibbles from byte 8
        fifth = (_load_byte(blk + 4 + j // 8, mask) >> (j % 8)) & 1
        q = _nibble(_load_byte(blk + 8 + j % 16, mask), j >= 16) | (fifth << 4)
        w = _load_f16(blk, mask) * q.to(tl.float32) + _load_f16(blk + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: 4-bit runs of 32 bytes, two sub-blocks per run
        t = j // 32
        if QTYPE == 12:
            q = _nibble(_load_byte(blk + 16 + (j // 64) * 32 + j % 32, mask), t % 2 == 1)
        else:  # Q5_K: bit t of byte 16 + j % 32 is the fifth bit; the nibbles start at byte 48
            q = _nibble(_load_byte(blk + 48 + (j // 64) * 32 + j % 32, mask), t % 2 == 1)
            q = q | (((_load_byte(blk + 16 + j % 32, mask) >> t) & 1) << 4)
        sc, mn = _k_scale_min(blk, t, mask)
        w = _load_f16(blk, mask) * sc * q.to(tl.float32) - _load_f16(blk + 2, mask) * mn
    else:  # Q6_K: two halves of 128 weights; 4 low bits, 2 high bits, an int8 scale per 16 weights, d last
        tl.static_assert(QTYPE == 14, "a GGUF type without a decoder")
        h, r = j // 128, j % 128
        low = _nibble(_load_byte(blk + 64 * h + r % 64, mask), r >= 64)
        high = (_load_byte(blk + 128 + 32 * h + r % 32, mask) >> (2 * (r // 32))) & 3
        sc = tl.load(blk + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _load_f16(blk + 208, mask) * sc * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(x_ptr, q_ptr, out_ptr, M, N, K, k_per_split, row_bytes,
                        QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_b, offs_j = tl.arange(0, BLOCK_K // QK), tl.arange(0, QK)  # a step: BLOCK_K / QK whole blocks
    row_ptr = q_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
        blocks = k0 // QK + offs_b
        blk_mask = n_mask[:, None, None] & (blocks * QK < k_end)[None, :, None]  # k_end is a whole number of blocks
        w = _gguf_weights(row_ptr + blocks[None, :, None] * TYPE_SIZE, offs_j[None, None, :], blk_mask, QTYPE)
        acc = _accumulate(acc, x, tl.reshape(w, (BLOCK_N, BLOCK_K)), USE_DOT, UPCAST, PRECISION)
    _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k)


def gguf_gemv_config(qtype: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the GGUF GEMV launch (1-4 rows). Q4_K and Q6_K: the best of the H200 sweep
    (kernels_lab/quant_gemv.py, Qwen3-4B's shapes, one row); Q5_K is taken to be like Q4_K and the 32-weight types
    keep the first guess: neither was swept."""
    name = KEPT_GGUF_TYPES[int(qtype)][0]
    if name == "Q6_K": return 2, 512, 4
    if name in ("Q4_K", "Q5_K"): return (8 if n < 16384 else 4), 1024, 4
    if k >= 4096: return 2, 1024, 4
    return (4 if n < 16384 else 8), 1024, 4


def gguf_matmul_reference(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    "Dense: chapter 01a's dequantizer on the rows of blocks, then one matmul."
    from forge_engine.gguf_file import DEQUANTIZERS
    _, _, type_size = KEPT_GGUF_TYPES[qtype]
    w = DEQUANTIZERS[qtype](raw.reshape(-1, type_size)).reshape(raw.shape[0], -1)
    return F.linear(x, w.to(x.dtype))


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, impl: str = "auto", kernel: str | None = None,
                block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                split: int | None = None) -> torch.Tensor:
    """x [M, K] @ W.T where W's rows are GGUF blocks of `qtype` (a GGML type number), raw [N, bytes per row] uint8.
    Up to GEMV_MAX_ROWS rows (kernel 'gemv'): one program per BLOCK_N rows over all of K; above ('split_k'): split-K tiles."""
    if kernel_backend(x.device, impl) == "torch":
        return gguf_matmul_reference(x, raw, qtype)
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    n, k = raw.shape[0], x.shape[1]
    if _skinny_kernel(kernel, x.shape[0]) == "gemv":
        if split not in (None, 1): raise ValueError("gguf_matmul: a split along K is for kernel='split_k'")
        default = gguf_gemv_config(qtype, n, k)
        block_n, block_k, num_warps = block_n or default[0], block_k or default[1], num_warps or default[2]
        split, use_dot = 1, False
    else:
        block_k, num_warps, use_dot = block_k or 256, num_warps or 4, None
    block_k = max(block, min(block_k, _pow2(k)))  # whole blocks per step, no more than K has
    return _skinny_matmul(_gguf_matmul_kernel, x, (raw,), n, block_k, block_n=block_n, split=split, num_warps=num_warps,
                          use_dot=use_dot, row_bytes=raw.shape[1], QTYPE=int(qtype), QK=block, TYPE_SIZE=type_size,
                          BLOCK_K=block_k)


# %% [markdown]
# Against the `gguf` package, under the interpreter: real Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 bytes
# from its quantizer, and K-type bytes made by hand (random bits with sane float16 scales: the
# package cannot quantize to the K types). First the decoding alone: the kernel times the
# identity matrix is the dequantized matrix, which must equal `gguf.quants.dequantize` exactly.
# Then the matmul against the reference, with 1 to 4 rows (the GEMV launch, ragged N, K of
# 1,280 = 5 super-blocks in steps of 512 or 1,024) and 6 (split-K, `tl.dot` tiles).

# %%
import gguf as gguf_package
import numpy as np
from gguf import GGMLQuantizationType as QType

def gguf_bytes(qtype, rows, cols, seed=0) -> torch.Tensor:
    "Valid GGUF bytes of `qtype` for a [rows, cols] matrix, as [rows, bytes per row] uint8."
    rng = np.random.default_rng(seed)
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    if block == 32:
        data = gguf_package.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    else:
        data = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
        for at in ([208] if qtype == QType.Q6_K else [0, 2]):  # d (and dmin): finite float16
            data[..., at:at + 2] = rng.uniform(0, 0.01, data.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1).copy())

torch.manual_seed(0)  # (the inputs of this cell alone, whatever the cells above drew)
for qtype in map(QType, KEPT_GGUF_TYPES):
    raw = gguf_bytes(qtype, 20, 512, seed=int(qtype))
    decoded = gguf_matmul(torch.eye(512), raw, qtype, impl="triton", kernel="split_k").T
    want = torch.from_numpy(gguf_package.quants.dequantize(raw.numpy(), qtype).astype(np.float32))
    assert torch.equal(decoded, want), qtype.name
    for m, dtype, launch in [(1, torch.float32, {}), (2, torch.float32, dict(kernel="split_k", split=2)),
                             (6, torch.float32, {}), (3, torch.float32, dict(block_n=8, block_k=32)),
                             (1, torch.bfloat16, dict(kernel="split_k", split=1))]:
        x = torch.randn(m, 512, dtype=dtype)
        # FP32 sums of 512 products in another order than the reference's: a few ulps of Σ|x·w| (the K types'
        # weights reach ~40, so that is well above 1e-4 for some outputs)
        sum_order = 2**-22 * (x.float().abs() @ want.abs().T).max().item()
        assert_matches(gguf_matmul(x, raw, qtype, impl="triton", **launch), gguf_matmul_reference(x, raw, qtype),
                       f"{qtype.name} M={m} {dtype} {launch}", max(1e-4, sum_order))
for qtype in (QType.Q4_K, QType.Q6_K, QType.Q8_0):  # K = 1,280: the last GEMV step holds part of BLOCK_K
    raw = gguf_bytes(qtype, 13, 1280, seed=3)
    for m, launch in [(4, {}), (2, dict(block_k=512, block_n=4))]:
        x = torch.randn(m, 1280)
        assert_matches(gguf_matmul(x, raw, qtype, impl="triton", **launch), gguf_matmul_reference(x, raw, qtype),
                       f"{qtype.name} M={m} K=1280 {launch}")
assert gguf_gemv_config(QType.Q4_K, 6144, 2560) == (8, 1024, 4) and gguf_gemv_config(QType.Q4_K, 19456, 2560)[0] == 4
assert gguf_gemv_config(QType.Q6_K, 2560, 9728) == (2, 512, 4)  # the sweep's winners

# %% [markdown]
# ## The modules that replace `nn.Linear`
#
# Each keeps its quantized data in *buffers* (they move with `.to(device)` and are not
# parameters: nothing trains them) and an optional bias in the compute dtype. `forward` chooses
# the path; nothing in it waits for the GPU, so it records into a CUDA graph like the rest of the
# decode step. The dense path dequantizes a tile of output rows at a time (`DENSE_TILE_WEIGHTS`):
# its temporaries stay under 200 MB (int4 codes become FP32 before they are scaled and cast) even
# for an LM head of 389 million weights, where the whole matrix dequantized at once would take
# gigabytes.

# %% [markdown]
# On a CPU, PyTorch has weight-only GEMMs of its own (the ones gpt-fast and torchao call): int8 with a scale per
# output row (`torch._weight_int8pack_mm`, on our int8 bytes as they are) and int4 in groups
# (`_weight_int4pack_mm_for_cpu`, on its own tiled order of the nibbles, with a bf16 scale and zero per group:
# weights (q − 8) · scale + zero). Both are fast with bf16 inputs (10-25× their FP32 speed on this project's 2-core
# machine), so the CPU paths below hand them x in bf16. `cpu_int4pack` builds the int4 operands from nibbles in our
# layout (a group's byte j holds its weights j and j + group/2: chapter 10's int4 and GGUF's Q4_0 / Q4_1 alike).

# %%
#| export
CPU_WEIGHT_GEMMS = True  # quantized layers on a CPU through PyTorch's weight-only GEMMs; off: dequantize + matmul (exact)


def cpu_int4pack(nibbles: torch.Tensor, group: int, scale: torch.Tensor, zero: torch.Tensor) -> tuple | None:
    """Operands of PyTorch's CPU int4 GEMM for weights (q - 8) · scale + zero: nibbles uint8 [N, K/2] (a group's byte
    j holds q j and j + group/2), scale and zero [N, K/group] -> (its packed nibbles, group, scale and zero
    [K/group, N, 2] bf16); None off the CPU, without that kernel, or for a shape it does not take (N a multiple of
    16, groups of 32-256)."""
    n = nibbles.shape[0]
    if (n % 16 or group not in (32, 64, 128, 256) or nibbles.device.type != "cpu"
            or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")):
        return None
    b = nibbles.reshape(n, -1, group // 2)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(n, -1).to(torch.int32)
    scale_zero = torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), group, scale_zero


def cpu_int4pack_mm(x: torch.Tensor, operands: tuple) -> torch.Tensor:
    "x [M, K] @ the weights of `cpu_int4pack`'s operands .T -> [M, N] in x's dtype, through PyTorch's CPU int4 GEMM in bf16."
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), *operands).to(x.dtype)


def _q8_0_blocks_mm(x: torch.Tensor, operands: tuple) -> torch.Tensor:
    "x [M, K] @ Q8_0 weights .T: PyTorch's CPU int8 GEMM once a block of 32 inputs (scale 1), each block's sums times its d."
    q, d, ones = operands  # [K/32, N, 32] int8, [K/32, N] fp32, [N] bf16
    xb = x.to(torch.bfloat16)
    out = torch.zeros(x.shape[0], q.shape[1], dtype=torch.float32, device=x.device)
    for b in range(q.shape[0]):
        out += torch._weight_int8pack_mm(xb[:, 32 * b:32 * b + 32].contiguous(), q[b], ones).float() * d[b]
    return out.to(x.dtype)


def _gguf_cpu_operands(raw: torch.Tensor, qtype: int) -> tuple | None:
    "(matmul, operands) for a run of GGUF rows [N, bytes a row] on PyTorch's CPU GEMMs, or None (another type, shape)."
    from forge_engine.gguf_file import _f16  # (chapter 01a's reader of a block's float16 fields)
    if qtype not in (2, 3, 8) or raw.device.type != "cpu":
        return None
    n, size = raw.shape[0], KEPT_GGUF_TYPES[qtype][2]
    blocks = raw.reshape(-1, size)  # a block a row, N x K/32 of them
    d = _f16(blocks, 0).reshape(n, -1)  # [N, K/32]: each of these blocks opens with d
    if qtype in (2, 3):  # Q4_0: d, 16 bytes, weights d (q - 8); Q4_1: d, m, 16 bytes, weights d q + m
        zero = torch.zeros_like(d) if qtype == 2 else _f16(blocks, 2).reshape(n, -1) + 8 * d
        operands = cpu_int4pack(blocks[:, size - 16:].reshape(n, -1), 32, d, zero)
        return None if operands is None else (cpu_int4pack_mm, operands)
    if hasattr(torch, "_weight_int8pack_mm"):  # Q8_0: d, 32 int8
        q = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, -1, 32).permute(1, 0, 2).contiguous()
        return _q8_0_blocks_mm, (q, d.t().contiguous(), torch.ones(n, dtype=torch.bfloat16))
    return None


# %%
#| export
DENSE_TILE_WEIGHTS = 2**24  # weights dequantized at a time on the dense path


class QuantLinear(nn.Module):
    "A linear layer with quantized weights: the fused kernel for few rows on a GPU, dequantize + matmul otherwise."
    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, device=None):
        "`device`: where the bias goes (default: where it is)."
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bias = None if bias is None else bias.detach() if device is None else bias.detach().to(device)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def skinny(self, x: torch.Tensor) -> torch.Tensor: raise NotImplementedError  # the fused kernel
    def dense_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:  # x @ weight rows start:end, dequantized
        raise NotImplementedError
    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # weight rows `ids` [n], dequantized: [n, K]
        raise NotImplementedError

    def dense(self, x: torch.Tensor, tile_weights: int = DENSE_TILE_WEIGHTS) -> torch.Tensor:
        "The PyTorch path: dequantize + matmul, `tile_weights` weights at a time."
        rows = max(1, tile_weights // self.in_features)
        if rows >= self.out_features: return self.dense_rows(x, 0, self.out_features)
        out = x.new_empty(x.shape[0], self.out_features)
        for start in range(0, self.out_features, rows):
            end = min(start + rows, self.out_features)
            out[:, start:end] = self.dense_rows(x, start, end)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= SKINNY_MAX_ROWS and x.is_cuda and kernel_backend(x.device) == "triton":
            y = self.skinny(x2)
        else:
            y = self.dense(x2)
        if self.bias is not None: y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self): return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantLinear):
    """int8 weights [N, K] and one fp32 scale per output row; quantized (and kept) on `device`, default the weight's.
    `linear`: an nn.Linear, or any module with a `weight` [N, K] (a tied model's embedding, as its LM head)."""
    def __init__(self, linear: nn.Module, device=None):
        super().__init__(linear.weight.shape[1], linear.weight.shape[0], getattr(linear, "bias", None), device)
        q, scale = quantize_rows(quantize_int8, linear.weight, device)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    def skinny(self, x):
        if x.shape[0] <= GEMV_MAX_ROWS:  # chapter 09's GEMV streams the int8 rows and applies the scales at the end
            return gemv(x, self.qweight, None, self.scale, impl="triton")
        return int8_matmul(x, self.qweight, self.scale, impl="triton")

    def dense(self, x, tile_weights=DENSE_TILE_WEIGHTS):
        if x.device.type == "cpu" and CPU_WEIGHT_GEMMS and hasattr(torch, "_weight_int8pack_mm"):
            # PyTorch's CPU int8 weight-only GEMM (used by gpt-fast / torchao); it is fast with bf16 inputs
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scale.to(torch.bfloat16))
            return y.to(x.dtype)
        return super().dense(x, tile_weights)

    def dense_rows(self, x, start, end): return int8_matmul_reference(x, self.qweight[start:end], self.scale[start:end])
    def rows(self, ids, dtype): return int8_rows(ids, self.qweight, self.scale, dtype)
    def gemv_operands(self): return self.qweight, self.bias, self.scale  # (as chapter 09a's FusedLinear: its gemv)


class Int4Linear(QuantLinear):
    "4-bit weights, two per byte, with an fp16 scale and minimum per group of 128 inputs; quantized on `device`, as Int8Linear."
    def __init__(self, linear: nn.Module, group: int | None = None, device=None):
        super().__init__(linear.weight.shape[1], linear.weight.shape[0], getattr(linear, "bias", None), device)
        packed, scale, minimum = quantize_rows(quantize_int4, linear.weight, device, group=group)
        self.register_buffer("qweight", packed)
        self.register_buffer("scale_minimum", pair_scales(scale, minimum))  # one 4-byte load a group in the GEMV

    @property
    def scale(self) -> torch.Tensor: return self.scale_minimum[..., 0]

    @property
    def minimum(self) -> torch.Tensor: return self.scale_minimum[..., 1]

    def skinny(self, x): return int4_matmul(x, self.qweight, self.scale, self.minimum, impl="triton")

    def dense(self, x, tile_weights=DENSE_TILE_WEIGHTS):
        if x.device.type == "cpu" and CPU_WEIGHT_GEMMS and (cpu := self.cpu_pack()) is not None:
            return cpu_int4pack_mm(x, cpu)  # PyTorch's CPU int4 GEMM (gpt-fast's / torchao's), bf16 inputs
        return super().dense(x, tile_weights)

    def cpu_pack(self) -> tuple | None:
        """The weights as PyTorch's CPU int4 GEMM takes them (`cpu_int4pack`: a second copy of the nibbles, in its own
        tiled order), built on the first CPU call and kept; None where it does not fit. Its weights are
        (q - 8) · scale + zero: zero = minimum + 8 · scale."""
        if "_cpu_pack" not in self.__dict__:
            self.__dict__["_cpu_pack"] = cpu_int4pack(self.qweight, self.in_features // self.scale.shape[1], self.scale,
                                                      self.minimum.float() + 8 * self.scale.float())
        return self.__dict__["_cpu_pack"]

    def dense_rows(self, x, start, end):
        return int4_matmul_reference(x, self.qweight[start:end], self.scale[start:end], self.minimum[start:end])

    def decode_gemv(self, x, swiglu=False, residual=None, norm_sums=None, hand_off=None, eps=1e-6):
        """This layer on a decode step's rows (x on a GPU) by the int4 GEMV, with chapter 09's `gemv`'s folds (chapter
        09a's `folded_gemv` passes them): `swiglu` (as a gate-up layer: silu(gate) * up), `residual`, `norm_sums`,
        `hand_off`. A bias is added after the GEMV: not with swiglu or a residual (our models have none there)."""
        if self.bias is not None and (swiglu or residual is not None):
            raise ValueError("Int4Linear.decode_gemv adds its bias after the GEMV: not with swiglu or a residual")
        out = int4_gemv(x, self.qweight, self.scale, self.minimum, swiglu=swiglu, residual=residual,
                        norm_sums=norm_sums, hand_off=hand_off, eps=eps)
        return out if self.bias is None else out + self.bias

    def hands_off_norms(self) -> bool:
        "Whether a decode step hands its norms between this format's GEMVs (chapter 09's `gemv_hands_off_norms`)."
        return gemv_hands_off_norms(self.qweight)

    def rows(self, ids, dtype): return dequantize_int4(self.qweight[ids], self.scale[ids], self.minimum[ids], dtype)


class TiedEmbedding(nn.Module):
    "A tied model's embedding read from its quantized LM head (the same table): a token's row, dequantized."
    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.head, self.dtype = head, dtype  # shared with the model's lm_head, not copied: one table serves both ends

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, -1)


# %% [markdown]
# Tiles of output rows give what one dequantized matrix gives (here 3 rows a tile, the last one
# short), and a tied embedding read from its quantized head is the head's rows dequantized:

# %%
linear = nn.Linear(48, 10, bias=True)
x = torch.randn(5, 48)
for layer in (Int4Linear(linear, group=16), Int8Linear(linear)):
    full = F.linear(x, dequantize_int4(layer.qweight, layer.scale, layer.minimum) if isinstance(layer, Int4Linear)
                    else dequantize_int8(layer.qweight, layer.scale))
    # the tiled path itself: the same FP32 products, in tiles (K = 48: 1e-5 leaves ~100 ulps)
    torch.testing.assert_close(QuantLinear.dense(layer, x, tile_weights=3 * 48), full, rtol=1e-5, atol=1e-5)
    # int8 on the CPU goes to PyTorch's int8 GEMM in BF16 (x and output rounded, 2^-8 each; |y| < 2 here)
    torch.testing.assert_close(layer(x), full + linear.bias, rtol=0, atol=2e-2)
# int4 on the CPU: PyTorch's int4 GEMM where the shape suits it (N a multiple of 16), in BF16, the same weights
wide, x96 = Int4Linear(nn.Linear(96, 32, bias=False), group=32), torch.randn(5, 96)
full = F.linear(x96, dequantize_int4(wide.qweight, wide.scale, wide.minimum))
assert wide.cpu_pack() is not None and Int4Linear(linear, group=16).cpu_pack() is None  # (N = 10)
torch.testing.assert_close(wide(x96), full, rtol=0, atol=2e-2 * full.abs().max().item())  # BF16 x, scales, output
table = nn.Embedding(10, 40)
head = Int8Linear(table)
tokens = torch.tensor([[3, 9], [0, 3]])
rows = TiedEmbedding(head, torch.bfloat16)(tokens)
assert rows.shape == (2, 2, 40) and rows.dtype == torch.bfloat16 and head.bias is None
torch.testing.assert_close(rows.float(), dequantize_int8(head.qweight, head.scale)[tokens], rtol=2**-8, atol=0)  # to BF16
# and the table's own rows within int8's step (half of max|w| / 127, and BF16's rounding: under a whole step)
torch.testing.assert_close(rows.float(), table.weight[tokens].detach(), rtol=0, atol=table.weight.abs().max().item() / 127)


# %% [markdown]
# A GGUF layer may be *several* file tensors: our `qkv` is the file's `attn_q`, `attn_k` and
# `attn_v`, which may even have different types. `GGUFLinear` keeps one row-block matrix per run of
# parts with the same type, runs one matmul per run, and concatenates the outputs. Every part's
# bytes are checked against its type and shape, with the tensor's name in the error.

# %%
#| export
class GGUFLinear(QuantLinear):
    "Rows of GGUF blocks, as stored in the file, in one or more runs of the same quant type."
    def __init__(self, parts: list[tuple[str, int, tuple[int, int], torch.Tensor]], bias: torch.Tensor | None = None):
        "parts: (name, GGML type number, (rows, cols), bytes) in output order; every part has the same cols."
        runs: list[tuple[int, list[torch.Tensor]]] = []
        in_features = parts[0][2][1]
        for name, qtype, shape, raw in parts:
            if int(qtype) not in KEPT_GGUF_TYPES:
                kept = ", ".join(t for t, _, _ in KEPT_GGUF_TYPES.values())
                raise ValueError(f"{name}: GGUF type {getattr(qtype, 'name', qtype)} cannot be kept quantized; "
                                 f"--quantization gguf supports {kept} (load without it: dequantized)")
            qtype = int(qtype)
            type_name, block, type_size = KEPT_GGUF_TYPES[qtype]
            if len(shape) != 2 or shape[1] != in_features:
                raise ValueError(f"{name}: shape {list(shape)} does not fit a layer with {in_features} inputs")
            if shape[1] % block:
                raise ValueError(f"{name}: {type_name} stores rows in blocks of {block}, but the row length is {shape[1]}")
            expected = shape[0] * shape[1] // block * type_size
            if raw.numel() != expected:
                raise ValueError(f"{name}: {type_name} data of shape {list(shape)} needs {expected} bytes, got {raw.numel()}")
            rows = raw.reshape(shape[0], -1)
            if runs and runs[-1][0] == qtype: runs[-1][1].append(rows)
            else: runs.append((qtype, [rows]))
        super().__init__(in_features, sum(shape[0] for _, _, shape, _ in parts), bias)
        self.qtypes = tuple(q for q, _ in runs)
        for i, (_, rows) in enumerate(runs):
            self.register_buffer(f"blocks{i}", torch.cat(rows).contiguous())

    def _runs(self): return zip(self.qtypes, (getattr(self, f"blocks{i}") for i in range(len(self.qtypes))))

    def dense(self, x, tile_weights=DENSE_TILE_WEIGHTS):
        if x.device.type == "cpu" and CPU_WEIGHT_GEMMS and (packs := self.cpu_packs()) is not None:
            return torch.cat([matmul(x, operands) for matmul, operands in packs], dim=-1)
        return super().dense(x, tile_weights)

    def cpu_packs(self) -> list | None:
        """Each run as PyTorch's CPU GEMMs take it, (matmul, operands), built on the first CPU call and kept (a second
        copy of the bytes): Q4_0 / Q4_1 through `cpu_int4pack` (scale d; zero 0, or m + 8d), Q8_0 as its int8 blocks
        [K/32, N, 32] with their scales, a GEMM a block; None if a run is of another type or a shape they do not take."""
        if "_cpu_packs" not in self.__dict__:
            packs = [_gguf_cpu_operands(raw, qtype) for qtype, raw in self._runs()]
            self.__dict__["_cpu_packs"] = None if any(p is None for p in packs) else packs
        return self.__dict__["_cpu_packs"]

    def skinny(self, x):
        return torch.cat([gguf_matmul(x, raw, qtype, impl="triton") for qtype, raw in self._runs()], dim=-1)

    def dense_rows(self, x, start, end):  # the part of each run inside rows start:end
        outs, first = [], 0
        for qtype, raw in self._runs():
            lo, hi = max(start, first), min(end, first + raw.shape[0])
            if lo < hi: outs.append(gguf_matmul_reference(x, raw[lo - first:hi - first], qtype))
            first += raw.shape[0]
        return torch.cat(outs, dim=-1)

    def rows(self, ids, dtype):
        from forge_engine.gguf_file import DEQUANTIZERS
        if len(self.qtypes) != 1:
            raise ValueError("rows of a GGUF layer of several types: only a single tensor (an embedding) reads rows")
        qtype, raw = self.qtypes[0], self.blocks0
        return DEQUANTIZERS[qtype](raw[ids].reshape(-1, KEPT_GGUF_TYPES[qtype][2])).reshape(ids.shape[0], -1).to(dtype)

    def extra_repr(self): return super().extra_repr() + f", qtypes={[KEPT_GGUF_TYPES[q][0] for q in self.qtypes]}"


# %%
parts = [("blk.0.attn_q.weight", QType.Q4_K, (20, 512), gguf_bytes(QType.Q4_K, 20, 512)),  # as in a Q4_K_M file
         ("blk.0.attn_k.weight", QType.Q6_K, (8, 512), gguf_bytes(QType.Q6_K, 8, 512)),
         ("blk.0.attn_v.weight", QType.Q6_K, (8, 512), gguf_bytes(QType.Q6_K, 8, 512, seed=1))]
layer = GGUFLinear(parts, bias=torch.randn(36))
assert layer.qtypes == (12, 14) and layer.blocks1.shape == (16, 2 * 210)
x = torch.randn(3, 512)
want = torch.cat([gguf_matmul_reference(x, raw, qt) for _, qt, _, raw in parts], -1) + layer.bias
torch.testing.assert_close(layer(x), want)  # FP32 defaults (1.3e-6 relative): the same dequantize + matmul, tiled
torch.testing.assert_close(layer.skinny(x) + layer.bias, want, rtol=1e-4, atol=1e-4)  # FP32 sums over K = 512, reordered
assert layer.cpu_packs() is None  # Q4_K, Q6_K: no PyTorch CPU GEMM for them, the tiled dense path above

# %% [markdown]
# On a CPU, runs of Q4_0, Q4_1 and Q8_0 (SmolLM2's file: Q4_1 layers, a Q8_0 embedding and head) go to PyTorch's CPU
# GEMMs (`cpu_packs`), in bf16: within bf16's rounding of the reference.

# %%
parts = [("blk.0.attn_q.weight", QType.Q4_1, (32, 256), gguf_bytes(QType.Q4_1, 32, 256)),
         ("blk.0.attn_k.weight", QType.Q4_0, (16, 256), gguf_bytes(QType.Q4_0, 16, 256)),
         ("blk.0.attn_v.weight", QType.Q8_0, (16, 256), gguf_bytes(QType.Q8_0, 16, 256))]
layer, x = GGUFLinear(parts), torch.randn(3, 256)
want = torch.cat([gguf_matmul_reference(x, raw, qt) for _, qt, _, raw in parts], -1)
assert [matmul.__name__ for matmul, _ in layer.cpu_packs()] == ["cpu_int4pack_mm", "cpu_int4pack_mm", "_q8_0_blocks_mm"]
torch.testing.assert_close(layer(x), want, rtol=0, atol=2e-2 * want.abs().max().item())  # BF16 x, scales, outputs
torch.testing.assert_close(QuantLinear.dense(layer, x), want, rtol=1e-5, atol=1e-5)  # (the tiled reference path: FP32)
assert GGUFLinear(parts[:1] + [("v", QType.Q4_1, (8, 256), gguf_bytes(QType.Q4_1, 8, 256))]).cpu_packs() is None  # 8 rows

# %% [markdown]
# Bad input names the tensor:

# %%
with pytest.raises(ValueError, match=r"blk.0.attn_q.weight: Q8_0 data of shape \[20, 512\] needs 10880 bytes, got 10846"):
    GGUFLinear([("blk.0.attn_q.weight", QType.Q8_0, (20, 512), gguf_bytes(QType.Q8_0, 20, 512).reshape(-1)[:-34])])
with pytest.raises(ValueError, match="blk.3.ffn_down.weight: GGUF type Q3_K cannot be kept quantized"):
    GGUFLinear([("blk.3.ffn_down.weight", QType.Q3_K, (4, 256), torch.zeros(4 * 110, dtype=torch.uint8))])
with pytest.raises(ValueError, match="blk.1.attn_k.weight: Q4_K stores rows in blocks of 256, but the row length is 128"):
    GGUFLinear([("blk.1.attn_k.weight", QType.Q4_K, (4, 128), torch.zeros(4 * 72, dtype=torch.uint8))])

# %% [markdown]
# ## Quantizing a loaded model, module by module
#
# `quantize_model` walks the layers and replaces each of the four matrices with its quantized
# module. The full-precision weight is released as soon as its module is replaced, so memory
# never holds the model twice: the peak is the loaded model plus one slice's FP32 temporaries
# (`QUANTIZE_CHUNK`), and it falls as the work goes on.
#
# With `device`, each matrix is quantized on that device and its quantized module stays there,
# while the rest of the model stays where it is: chapter 04a loads a model under a GPU memory
# budget on the CPU and quantizes it on the GPU this way, so the GPU never holds a full-precision
# matrix, only the quantized ones and one slice at a time; then it moves the rest (embedding,
# norms) over.
#
# Then the LM head. It is one matrix, but a big one: Qwen3-4B's has 389 million weights, 778 MB
# read every step in BF16, almost a fifth of an int8 step's reads and a third of an int4 step's.
# It becomes int8 with a scale per vocabulary row in *both* modes: the head is where 4 bits cost
# the most quality, so int4 keeps it at 8 bits, as most int4 schemes keep it unquantized or at 8.
# A tied model's embedding is the same table: its `TiedEmbedding` reads the token's int8 row and
# its scale from the head, so the BF16 table is gone and the embedding costs nothing extra.

# %%
#| export
QUANTIZED_LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # inside every DecoderLayer
QUANTIZERS = {"int8": Int8Linear, "int4": Int4Linear}


@torch.no_grad()
def quantize_model(model: Transformer, mode: str, int4_group: int | None = None, device=None) -> Transformer:
    """Swap every layer's linear modules for `mode` ('int8' or 'int4') quantized ones, in place, one at a time, and
    the LM head for an int8 one (a tied embedding then reads its rows from it).
    `int4_group`: inputs per int4 scale (default: 128, or 64 / 32 where 128 does not divide the input size).
    `device`: where to quantize and keep the quantized modules (default: where each matrix is); the rest stays put."""
    if mode not in QUANTIZERS:
        raise ValueError(f"unknown quantization {mode!r}; quantize_model does {', '.join(QUANTIZERS)}")
    options = {"group": int4_group} if mode == "int4" else {}
    options["device"] = device
    for layer in model.layers:
        for name in QUANTIZED_LINEARS:
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            if isinstance(linear, QuantLinear):
                raise ValueError(f"layer {layer.attn.layer} {name} is already quantized")
            setattr(parent, attr, QUANTIZERS[mode](linear, **options))
            del linear  # the last reference: the full-precision weight is freed here
    if model.lm_head is not None:
        model.lm_head = Int8Linear(model.lm_head, device)
    else:  # tied: one int8 table, the head's, read by both ends
        dtype = model.embed.weight.dtype
        model.lm_head = Int8Linear(model.embed, device)
        model.embed = TiedEmbedding(model.lm_head, dtype)
    return model


# %%
tiny = init_random_weights(empty_model(preset("qwen2-tiny").replace(vocab_size=512, intermediate_size=256)), seed=2, std=0.05)
ids, positions = torch.randint(0, 512, (12,)), torch.arange(12)
with torch.inference_mode():
    want = tiny.compute_logits(tiny(ids, positions))
    # random weights: quantization errors add up over every matmul; int8's step is 1/127 of a row's largest weight
    # (~1/40 of a typical one), int4's 1/15 of a group's range, so ~0.5-1% and ~10% of the logits' norm are expected
    for mode, limit in (("int8", 0.03), ("int4", 0.3)):
        quantized = quantize_model(copy.deepcopy(tiny), mode)
        assert all(isinstance(layer.get_submodule(n), QUANTIZERS[mode]) for layer in quantized.layers for n in QUANTIZED_LINEARS)
        assert quantized.layers[0].attn.qkv.bias is not None  # qwen2's qkv bias is kept, in the compute dtype
        assert isinstance(quantized.lm_head, Int8Linear) and isinstance(quantized.embed, nn.Embedding)  # untied
        got = quantized.compute_logits(quantized(ids, positions))
        rel = ((got - want).norm() / want.norm()).item()
        print(f"{mode}: {model_bytes(quantized):,} bytes (fp32: {model_bytes(tiny):,}); relative logit error {rel:.4f}")
        assert 0 < rel < limit, (mode, rel)
tied = init_random_weights(empty_model(preset("qwen3-tiny")), seed=2, std=0.05)  # qwen3-tiny ties its embedding
with torch.inference_mode():
    want = tied.compute_logits(tied(ids, positions))
    quantized = quantize_model(copy.deepcopy(tied), "int8")
    got = quantized.compute_logits(quantized(ids, positions))
assert quantized.embed.head is quantized.lm_head and model_bytes(quantized) < model_bytes(tied) / 3  # one int8 table
assert 0 < ((got - want).norm() / want.norm()).item() < 0.03  # int8's steps, as above
with pytest.raises(ValueError, match="already quantized"):
    quantize_model(quantize_model(copy.deepcopy(tiny), "int8"), "int4")
with pytest.raises(ValueError, match="unknown quantization 'int3'"):
    quantize_model(tiny, "int3")

# %% [markdown]
# Quantizing with `device` (here the CPU itself: the GPU test in `tests/test_quant_gpu.py` quantizes on a GPU and
# compares) keeps, matrix by matrix, exactly what the whole-matrix functions make of the original weights:

# %%
staged = copy.deepcopy(tiny).to(torch.bfloat16)  # as chapter 04a stages a model: in the compute dtype
originals = {n: staged.layers[1].get_submodule(n).weight.clone() for n in QUANTIZED_LINEARS}
for mode, quantize in (("int8", quantize_int8), ("int4", quantize_int4)):
    quantized = quantize_model(copy.deepcopy(staged), mode, device="cpu")
    for n, w in originals.items():
        module = quantized.layers[1].get_submodule(n)
        stored = [module.qweight, module.scale] + ([module.minimum] if mode == "int4" else [])
        assert all(torch.equal(a, b) for a, b in zip(stored, quantize(w))), (mode, n)
    assert quantized.layers[1].attn.qkv.bias.dtype == torch.bfloat16

# %% [markdown]
# ## Loading a GGUF model kept quantized
#
# The model is built on the `meta` device (shapes, no memory), its four matrices per layer are
# replaced by `GGUFLinear` modules over the file's bytes (copied to the device as they are), and
# only then is the rest (embedding, norms, biases) given storage and filled by chapter 03's
# `load_weights` from the dequantized file tensors. At no point does a full-precision copy of
# the matrices exist.

# %%
#| export
_GGUF_PARTS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
               "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}


def _materialize(model: nn.Module, device, dtype) -> None:
    "Give every parameter still on the meta device uninitialised storage on `device` in `dtype`."
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False))


@torch.no_grad()
def load_gguf_quantized(gguf, device="cpu", dtype=torch.float32) -> Transformer:
    """A model whose layer matrices and LM head keep the `GGUFFile`'s quantized blocks (a tied model's embedding reads
    its rows from the head's); everything else dequantized to `dtype`."""
    from forge_engine.gguf_file import SKIPPED_TENSORS, hf_name, llama_cpp_unpermute
    config = gguf.model_config()
    infos = {t.name: t for t in gguf.tensor_infos}
    with torch.device("meta"):
        model = Transformer(config)
    kept = set()
    for i, layer in enumerate(model.layers):
        for ours, file_parts in _GGUF_PARTS.items():
            parts = []
            for part in file_parts:
                name = f"blk.{i}.{part}.weight"
                if name not in infos: raise ValueError(f"{gguf.path}: tensor {name} is missing")
                info, rows = infos[name], gguf.raw(name).to(device)
                if config.architecture == "llama" and part in ("attn_q", "attn_k"):  # whole rows move: blocks too
                    heads = config.num_heads if part == "attn_q" else config.num_kv_heads
                    rows = llama_cpp_unpermute(rows.reshape(info.shape[0], -1), heads)
                parts.append((f"{gguf.path.name}: {name}", info.qtype, info.shape, rows))
                kept.add(name)
            parent_name, _, attr = ours.rpartition(".")
            parent = layer.get_submodule(parent_name)
            bias = getattr(parent, attr).bias
            setattr(parent, attr, GGUFLinear(parts, None if bias is None else torch.empty(bias.shape, device="meta")))
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    if head in infos and int(infos[head].qtype) in KEPT_GGUF_TYPES:  # (a head stored as F16 / F32 is loaded dense)
        info = infos[head]
        model.lm_head = GGUFLinear([(f"{gguf.path.name}: {head}", info.qtype, info.shape, gguf.raw(head).to(device))])
        if config.tie_word_embeddings: model.embed = TiedEmbedding(model.lm_head, dtype)
        kept.add(head)
    _materialize(model, device, dtype)
    rest = [t for t in gguf.tensor_infos if t.name not in kept and t.name not in SKIPPED_TENSORS]
    load_weights(model, ((hf_name(t.name), gguf.load(t, config, dtype, device)) for t in rest))
    return model.eval()


# %% [markdown]
# A tiny Llama written as a GGUF file with Q8_0, Q4_0 and Q4_1 matrices (q/k permuted, a `qkv`
# of mixed types): kept quantized, its logits equal those of the same file dequantized at load
# (with `CPU_WEIGHT_GEMMS` off; on, PyTorch's CPU GEMMs take bf16 inputs: within bf16's rounding).

# %%
import tempfile
from pathlib import Path
from forge_engine.gguf_file import GGUFFile, write_gguf
from forge_engine.model import hf_state_dict

tmp_dir = tempfile.TemporaryDirectory()
llama = preset("llama-tiny").replace(vocab_size=128, num_layers=2, hidden_size=64, head_dim=16, num_heads=4,
                                     intermediate_size=128)
state = {k: v.contiguous() for k, v in hf_state_dict(init_random_weights(empty_model(llama), 3, std=0.05)).items()}
qtypes = {name: [QType.Q8_0, QType.Q4_0, QType.Q4_1][i % 3] for i, name in enumerate(state) if "proj" in name}
qtypes["lm_head.weight"] = QType.Q4_1
gguf_path = write_gguf(Path(tmp_dir.name) / "tiny.gguf", llama, state, qtypes)
gguf_file = GGUFFile(gguf_path)
kept = load_gguf_quantized(gguf_file)
dequantized = empty_model(llama)
load_weights(dequantized, gguf_file.tensors())
assert isinstance(kept.layers[1].mlp.down, GGUFLinear) and len(kept.layers[0].attn.qkv.qtypes) == 3
assert isinstance(kept.lm_head, GGUFLinear) and isinstance(kept.embed, nn.Embedding)  # untied: the embedding is dense
def kept_logits_match(kept, dequantized, ids):
    "Kept quantized: the dequantized model's logits, exactly on the dequantizing path, within bf16 on the CPU GEMMs."
    global CPU_WEIGHT_GEMMS
    with torch.inference_mode():
        want = dequantized.compute_logits(dequantized(ids, torch.arange(len(ids))))
        got = kept.compute_logits(kept(ids, torch.arange(len(ids))))
        CPU_WEIGHT_GEMMS = False
        exact = kept.compute_logits(kept(ids, torch.arange(len(ids))))
        CPU_WEIGHT_GEMMS = True
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)  # the same FP32 weights: only sums reordered
    # BF16 GEMMs: x, scales and outputs rounded (2^-8 each) in every matmul of two layers and the head
    assert ((got - want).norm() / want.norm()).item() < 2e-2

ids = torch.randint(0, 128, (9,))
kept_logits_match(kept, dequantized, ids)
print(f"kept quantized: {model_bytes(kept):,} bytes; dequantized fp32: {model_bytes(dequantized):,} bytes")
assert model_bytes(kept) < model_bytes(dequantized) / 2

# %% [markdown]
# A tied model (no `output.weight` in the file): the head is the embedding's blocks, and the
# embedding reads its rows from them.

# %%
tied = preset("qwen3-tiny").replace(vocab_size=128, intermediate_size=128)
state = {k: v.contiguous() for k, v in hf_state_dict(init_random_weights(empty_model(tied), 4, std=0.05)).items()}
tied_path = write_gguf(Path(tmp_dir.name) / "tied.gguf", tied, state,
                       {name: QType.Q8_0 for name in state if "proj" in name or "embed_tokens" in name})
kept = load_gguf_quantized(GGUFFile(tied_path))
dequantized = empty_model(tied)
load_weights(dequantized, GGUFFile(tied_path).tensors())
assert isinstance(kept.embed, TiedEmbedding) and kept.embed.head is kept.lm_head and kept.lm_head.qtypes == (8,)
kept_logits_match(kept, dequantized, ids)
assert model_bytes(kept) < model_bytes(dequantized) / 3


# %% [markdown]
# ## Quality: perplexity on a fixed text
#
# How much does quantization hurt? Perplexity, `exp` of the mean negative log-likelihood of each
# token given the ones before it (teacher forcing: one forward over the whole text), measures how
# surprised the model is by real text. We compare the same model unquantized, int8, int4, and
# (for a GGUF) kept in its file's blocks.

# %%
#| export
@torch.inference_mode()
def perplexity(model: Transformer, token_ids) -> float:
    "exp(mean NLL of token t+1 given tokens 0..t) over one sequence, through the plain forward."
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(token_ids), device=device)
    if ids.numel() < 2: raise ValueError("perplexity needs at least 2 tokens")
    logits = model.compute_logits(model(ids[:-1], torch.arange(ids.numel() - 1, device=device)))
    return math.exp(F.cross_entropy(logits, ids[1:]).item())


# %% [markdown]
# SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized to FP32, is the baseline) on a fixed text of
# a few hundred tokens. The GGUF kept quantized is loaded through `load_model(...,
# quantization="gguf")`, as the command line does.

# %%
#| export
FIXED_TEXT = """The river begins as snow on the northern slopes, melts in late spring, and runs for three hundred
kilometres before it reaches the sea. For most of that distance it is shallow and quick, and the towns along its
banks were built where the water slows: at a bend, below a rapid, or where a smaller stream joins it. Each town kept
a mill, and each mill kept a record of the water's height, so that today we know, almost year by year, when the
floods came and how high they rose. The records show a pattern that the millers themselves noticed. A dry winter was
followed by a calm spring, but a winter of heavy snow did not always bring a flood; what mattered was how fast the
warm weather arrived. When the thaw was slow, the river carried the water away as it came. When a week of warm rain
fell on deep snow, the river rose by two metres in a night, and the lower streets of every town were under water by
morning. Engineers in the last century built three dams in the upper valley. They were meant to hold back the spring
water and release it slowly through the summer, when the fields needed it most. The dams worked, but they changed the
river in ways nobody had planned. Fish that had swum upstream to spawn for thousands of years could no longer pass,
and the gravel that the floods used to carry down to the coast stayed behind the walls."""

# %%
import forge_engine.quant
from forge_engine.loader import load_model
smol = load_model("smollm2-135m-instruct", device="cpu", progress=False)
kept = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf").model
text_ids = smol.tokenizer.encode(FIXED_TEXT)
variants = {"none": lambda: smol.model, "int8": lambda: quantize_model(copy.deepcopy(smol.model), "int8"),
            "int4": lambda: quantize_model(copy.deepcopy(smol.model), "int4"),
            "int4, groups of 32": lambda: quantize_model(copy.deepcopy(smol.model), "int4", int4_group=32),
            "gguf": lambda: kept}
ppl = {}
for mode, make in variants.items():
    start, model = time.perf_counter(), make()
    ppl[mode] = perplexity(model, text_ids)
    print(f"{mode:18s} perplexity {ppl[mode]:7.3f} ({100 * (ppl[mode] / ppl['none'] - 1):+6.2f}%)  "
          f"layer matrices + rest: {model_bytes(model) / 2**20:5.1f} MiB  ({time.perf_counter() - start:.1f} s)")
    del model
forge_engine.quant.CPU_WEIGHT_GEMMS = False  # (the package's switch: load_model's layers are the package's)
ppl["gguf, in FP32"] = perplexity(kept, text_ids)
forge_engine.quant.CPU_WEIGHT_GEMMS = True
print(f"gguf, in FP32      perplexity {ppl['gguf, in FP32']:7.3f} ({ppl['gguf, in FP32'] / ppl['none'] - 1:+.1e})")
print(f"{len(text_ids)} tokens")

# %% [markdown]
# What the bounds are, and what the numbers say. On a CPU the quantized layers multiply through
# PyTorch's weight-only int8 / int4 GEMMs, and those take **BF16**: x, each group's or block's
# scale and zero point, and the output are rounded to BF16's 8 significant bits, a relative error
# of up to 2^-8 each (their FP32 variants are scalar loops, ~40x slower). That rounding moves the
# perplexity by a small random amount whose sign and size depend on which kernel build the CPU
# runs. `kernels_lab/cpu_bf16_perplexity.py` measures it on this text (one 2-core machine, each of
# PyTorch's builds forced with `ATEN_CPU_CAPABILITY`):
#
# | perplexity / baseline - 1 | GGUF kept | int8 | int4, groups of 32 |
# |---|---|---|---|
# | dequantized to FP32 (no BF16) | +0.00000% | +0.268% | +0.290% |
# | BF16 GEMMs, generic build | -0.086% | +0.529% | +0.755% |
# | BF16 GEMMs, AVX2 build | +0.130% | +0.566% | +0.494% |
# | BF16 GEMMs, AVX-512 build | -0.002% | +0.642% | +0.673% |
#
# and the GGUF path's roundings emulated in FP64 under 16 seeds of stochastic rounding (unbiased,
# each error up to one BF16 step: twice the variance of rounding to nearest, so a conservative model
# of "some BF16 kernel"): mean +0.14%, standard deviation 0.26%, all within -0.24% .. +0.63%.
# So BF16 alone is worth up to ~1.2% here (the mean plus four standard deviations), and the bounds:
#
# - **GGUF kept quantized** holds the file's blocks: the *same* weights as the baseline. Dequantized
#   to FP32 on the way, it gives the baseline's perplexity to FP32's rounding (the same products
#   summed in another order, ~2^-24 each): within 1e-5. Through the BF16 GEMMs: within 1.25%.
# - **int8 within 1.5%**: its own rounding (+0.27% in FP32) plus BF16's.
# - **int4 within 75%**, a loose bound, and the reason is instructive. SmolLM2's weights *are
#   already* 4-bit: the file is Q4_1, min/max codes in blocks of 32. Re-quantizing them to groups of
#   64 (576 inputs) or 128 (1,536) puts a second, misaligned 4-bit grid on top of the first, and
#   the two rounding errors add up: about +54% perplexity on this text, on a 135M model where every
#   weight counts. With groups of 32 the groups coincide with the file's blocks, min and max are
#   representable up to their own rounding, and int4 gives the baseline back (+0.29% in FP32; within
#   1.5% with BF16's, asserted). On weights that were never quantized (Qwen3-4B in BF16) groups of
#   128 are the usual choice; its perplexity there needs the real weights, which CI does not have.

# %%
assert len(text_ids) >= 200
assert abs(ppl["gguf, in FP32"] / ppl["none"] - 1) < 1e-5
assert abs(ppl["gguf"] / ppl["none"] - 1) < 0.0125
assert abs(ppl["int8"] / ppl["none"] - 1) < 0.015
assert abs(ppl["int4, groups of 32"] / ppl["none"] - 1) < 0.015
assert 1 < ppl["int4"] / ppl["none"] < 1.75
with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's blocks, but 'random:qwen3-tiny' is random"):
    load_model("random:qwen3-tiny", quantization="gguf")
with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
    load_model("random:qwen3-tiny", quantization="fp8")
