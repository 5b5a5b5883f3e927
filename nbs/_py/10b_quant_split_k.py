# %% [markdown]
# # Quantized matmuls, split along K
#
# > The skinny matmul kernels for a few rows of x against int8 or int4 weights: tiles split along K, their partial sums added in a fixed order.

# %% [markdown]
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
# - apply the scale: per output row at the end (int8); per group on the way (int4: each nibble
#   becomes its weight q · scale + minimum in FP32, rounded to x's dtype for `tl.dot`, as the dense
#   path rounds it; a step takes a few whole groups, 128 inputs where they divide K).

# %%
#| default_exp quant.split_k

# %%
#| export
from __future__ import annotations

import torch

from forge_engine.kernels.backend import (
    INTERPRETED,
    _dot,
    _dot_precision,
    _pow2,
    kernel_backend,
    split_k_programs,
    tl,
    triton,
)
from forge_engine.kernels.gemv import GEMV_MAX_ROWS, gemv_reference

# %%
#| hide
from forge_engine.quant.formats import quantize_int8


# %%
#| export
@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    "acc [BM, BN] += x [BM, BK] @ w [BN, BK].T"
    if USE_DOT:
        if (
            UPCAST
        ):  # the interpreter: fp32 operands (see chapter 09; it also mangles int8 -> bf16 casts)
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
def _int8_matmul_kernel(
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
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + offs_n[:, None] * K + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        )
        acc = _accumulate(acc, x, q, USE_DOT, UPCAST, PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    _store_partial(out_ptr, acc * scale[None, :], offs_m, offs_n, M, N, pid_k)


@triton.jit
def _per_byte(t, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, BYTES: tl.constexpr):
    "A per-group value [BLOCK_N, GROUPS] repeated over each group's BYTES: [BLOCK_N, GROUPS * BYTES]."
    return tl.reshape(
        tl.broadcast_to(t[:, :, None], (BLOCK_N, GROUPS, BYTES)), (BLOCK_N, GROUPS * BYTES)
    )


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """STEP_GROUPS groups a step (k_per_split and K are whole steps): each byte's nibbles made weights with their
    group's scale and minimum, the low ones times inputs j of their group, the high ones inputs j + GROUP/2."""
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    HALF: tl.constexpr = GROUP // 2
    STRIDE: tl.constexpr = (
        2 if PAIRED else 1
    )  # PAIRED: scales and minimums side by side (`pair_scales`)
    t = tl.arange(0, STEP_GROUPS * HALF)  # a step's bytes of a row
    x_lo_at = (
        t // HALF
    ) * GROUP + t % HALF  # the input of each byte's low nibble, from the step's first
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, STEP_GROUPS * GROUP):
        b = tl.load(q_ptr + rows * (K // 2) + k0 // 2 + t[None, :], mask=n_mask[:, None], other=0)
        x_at = x_ptr + offs_m[:, None] * K + k0 + x_lo_at[None, :]
        x_lo = tl.load(x_at, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_at + HALF, mask=m_mask[:, None], other=0.0)
        at = (rows * groups + k0 // GROUP + tl.arange(0, STEP_GROUPS)[None, :]) * STRIDE
        scale = _per_byte(
            tl.load(scale_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32),
            BLOCK_N,
            STEP_GROUPS,
            HALF,
        )
        minimum = _per_byte(
            tl.load(min_ptr + at, mask=n_mask[:, None], other=0.0).to(tl.float32),
            BLOCK_N,
            STEP_GROUPS,
            HALF,
        )
        acc = _accumulate(
            acc, x_lo, (b & 0x0F).to(tl.float32) * scale + minimum, USE_DOT, UPCAST, PRECISION
        )
        acc = _accumulate(
            acc, x_hi, (b >> 4).to(tl.float32) * scale + minimum, USE_DOT, UPCAST, PRECISION
        )
    _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k)


# %% [markdown]
# The launcher picks the tiles and the split. Rows: 1 or 2 rows multiply-and-sum; 3 to 16 rows
# (and more, for the lab) take `tl.dot` tiles of at least 16. Split: enough programs for about
# four per SM (on a CPU, where the interpreter runs them one by one, a handful).

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


def _skinny_matmul(
    kernel,
    x: torch.Tensor,
    weights: tuple,
    n: int,
    k_step: int,
    block_n: int | None = None,
    split: int | None = None,
    num_warps: int = 4,
    use_dot: bool | None = None,
    **constexprs,
) -> torch.Tensor:
    "Launch one of the skinny kernels on x [M, K]; returns [M, N] in x's dtype. use_dot: tl.dot tiles (default: above 2 rows)."
    x = x.contiguous()
    m, k = x.shape
    use_dot = m > 2 if use_dot is None else use_dot
    block_m = max(16, min(_pow2(m), 64)) if use_dot else _pow2(m)
    block_n = block_n or (64 if use_dot else 64 // block_m)
    n_tiles, m_tiles, k_steps = (
        triton.cdiv(n, block_n),
        triton.cdiv(m, block_m),
        triton.cdiv(k, k_step),
    )
    if split is None:
        split = max(1, min(k_steps, split_k_programs(x.device) // n_tiles))
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)  # no empty slices
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    partials = (
        out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    )
    kernel[(n_tiles, split, m_tiles)](
        x,
        *weights,
        partials,
        m,
        n,
        k,
        steps_per_split * k_step,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_DOT=use_dot,
        UPCAST=INTERPRETED,
        PRECISION=_dot_precision(x.dtype),
        num_warps=num_warps,
        **constexprs,
    )
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](
            partials, out, m * n, SPLIT=split, BLOCK=1024
        )
    return out


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, impl: str = "auto", **launch
) -> torch.Tensor:
    "x [M, K] @ (scale[:, None] * q).T -> [M, N] in x's dtype."
    if kernel_backend(x.device, impl) == "torch":
        return int8_matmul_reference(x, q, scale)
    block_k = launch.pop("block_k", 128)
    return _skinny_matmul(
        _int8_matmul_kernel, x, (q, scale), q.shape[0], block_k, BLOCK_K=block_k, **launch
    )


SKINNY_KERNELS = ("gemv", "split_k")


def _skinny_kernel(kernel: str | None, rows: int) -> str:
    "The kernel for `rows` rows: 'gemv' up to GEMV_MAX_ROWS, 'split_k' above, unless `kernel` names one."
    kernel = kernel or ("gemv" if rows <= GEMV_MAX_ROWS else "split_k")
    if kernel not in SKINNY_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(SKINNY_KERNELS)}")
    if kernel == "gemv" and rows > GEMV_MAX_ROWS:
        raise ValueError(f"the gemv kernels take at most {GEMV_MAX_ROWS} rows, got {rows}")
    return kernel


def int8_matmul_reference(x, q, scale):
    "Dense: the int8 matrix converted to x's dtype, one matmul, then the per-row scale (chapter 09's GEMV reference)."
    return gemv_reference(x, q, None, scale)


# %% [markdown]
# `assert_matches` compares a kernel's result with its reference, with tolerances that say why
# (`check_kernel`: one launch of it); this chapter's tests and those of chapters 10c and 10d use
# them.

# %%
#| export
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
    "`assert_matches` of `fn(x, impl='triton', **launch)` (a kernel under test) against `reference(x)`."
    assert_matches(
        fn(x, impl="triton", **launch), reference(x), f"M={x.shape[0]} {x.dtype} {launch}", atol
    )


# %% [markdown]
# The int8 kernel against its reference, under Triton's interpreter on a CPU: 1, 2, 5 and 17 rows
# (multiply-and-sum, and `tl.dot` tiles), with and without splits, ragged N and K, FP32 and BF16
# (the int4 kernel: chapter 10c, beside its GEMV).

# %%
torch.manual_seed(0)
w = torch.randn(40, 384) * 0.1  # N = 40: not a multiple of the tiles
q8, s8 = quantize_int8(w)
for m, dtype, launch in [
    (1, torch.float32, {}),
    (1, torch.float32, dict(split=3)),
    (2, torch.float32, dict(split=1)),
    (5, torch.float32, dict(split=2)),
    (17, torch.float32, {}),
    (1, torch.bfloat16, {}),
    (8, torch.bfloat16, dict(split=3)),
]:
    x = torch.randn(m, 384, dtype=dtype)
    check_kernel(
        lambda x, **kw: int8_matmul(x, q8, s8, **kw),
        lambda x: int8_matmul_reference(x, q8, s8),
        x,
        **launch,
    )
# K not a multiple of the int8 step: the last step is masked
q8b, s8b = quantize_int8(torch.randn(24, 200))
check_kernel(
    lambda x, **kw: int8_matmul(x, q8b, s8b, **kw),
    lambda x: int8_matmul_reference(x, q8b, s8b),
    torch.randn(3, 200),
    split=2,
)
assert int8_matmul(torch.randn(2, 200), q8b, s8b).shape == (
    2,
    24,
)  # impl="auto" on a CPU: the reference
