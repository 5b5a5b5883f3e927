# %% [markdown]
# # Kernels: the small fused ones
#
# > Triton kernels for the small operations of a step, each one launch where PyTorch takes several: the residual add with RMSNorm, q/k-norm with RoPE, SiLU-mul, the K/V store, and the argmax of each row.

# %% [markdown]
# At batch 1 a decode step's time goes to launches and memory latency more than to arithmetic:
# each kernel here replaces a handful of PyTorch's, reads its inputs once and writes its result
# once. All of them run on chapter 09's `kernel_backend`: Triton on a CUDA GPU, their PyTorch
# reference elsewhere.

# %%
#| default_exp kernels.elementwise

# %%
#| export
from typing import NamedTuple

import torch
import torch.nn.functional as F

from forge_engine.kernels.backend import (
    _let_next_start,
    _pdl_args,
    _pow2,
    kernel_backend,
    tl,
    triton,
)

# %%
#| hide
import pytest
from forge_engine.model import RMSNorm
from forge_engine.qwen3_5 import ZeroCenteredRMSNorm


# %% [markdown]
# ## RMSNorm fused with the residual add
#
# A pre-norm decoder layer does `residual = x + residual; h = rmsnorm(residual)` twice per
# layer. The reference is exactly the arithmetic of chapter 03's `RMSNorm`, rounding where it
# rounds: the sum is rounded to the model dtype (it *is* the new residual), the mean of squares
# is taken in fp32, the normalised row is rounded before the weight multiplies it. The kernel
# does the same steps in registers, one program per row; only the order of the additions in
# the mean differs, so bf16 results agree to the last bit almost everywhere.
# With `residual=None` it is a plain RMSNorm (the first layer; also q/k-norm over head rows).
# With `zero_centred=True` it is chapter 03b's `ZeroCenteredRMSNorm` instead (Qwen3.5): the
# weight is the offset from 1, and the row is multiplied by `1 + weight` in fp32 before its one
# rounding.

# %%
#| export
def add_rmsnorm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); with residual None: (rmsnorm(x) * weight, x). `zero_centred`:
    times (1 + weight) in fp32, rounded once (chapter 03b's `ZeroCenteredRMSNorm`)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (normed * (1.0 + weight.float())).to(x.dtype), x
    return weight * normed.to(x.dtype), x


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    # the norm weight asked for with x, not after the sum: across warps the sum waits at a barrier, and the
    # compiler does not move a load over it (one memory round trip fewer for a one-row decode step)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the new residual is rounded to the model dtype, and normalised as rounded
        h = h.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(
            tl.float32
        )
        h = h.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    if ZERO_CENTRED:  # one rounding, at the end
        out = h * rstd * (1.0 + w)
    else:
        out = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    impl: str = "auto",
    num_warps: int | None = None,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H], weight [H] -> (rmsnorm(x + residual) * weight, the new residual x + residual).
    `zero_centred`: the weight is the offset from 1 (see the reference)."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape"
        )
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [{x.shape[-1]}] in {x.dtype}, got {tuple(weight.shape)} in {weight.dtype}"
        )
    if kernel_backend(x.device, impl) == "torch":
        return add_rmsnorm_reference(x, residual, weight, eps, zero_centred)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)  # a view for the usual contiguous-row inputs
    res = rows if residual is None else residual.reshape(-1, hidden)
    if rows.stride(-1) != 1 or res.stride(-1) != 1:
        raise ValueError("add_rmsnorm needs rows with unit stride in the last dimension")
    out = torch.empty_like(rows)
    res_out = rows if residual is None else torch.empty_like(rows)
    block = _pow2(hidden)
    if rows.shape[0]:
        _add_rmsnorm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            res_out,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTRED=zero_centred,
            BLOCK_H=block,
            **_pdl_args(x.device, rows=rows.shape[0]),
            num_warps=num_warps or min(8, max(1, block // 512)),
        )
    return out.view(x.shape), (x if residual is None else res_out.view(x.shape))


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    impl: str = "auto",
    zero_centred: bool = False,
) -> torch.Tensor:
    "rmsnorm(x) * weight over the last dimension (no residual)."
    return add_rmsnorm(x, None, weight, eps, impl, zero_centred=zero_centred)[0]


# %% [markdown]
# The reference is chapter 03's `RMSNorm`, and the kernel matches it:

# %%
gen = torch.Generator().manual_seed(0)
x, r = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
norm = RMSNorm(96, 1e-6)
with torch.no_grad():
    norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=gen))
    out, new_res = add_rmsnorm(x, r, norm.weight, 1e-6, impl="triton")
    torch.testing.assert_close(new_res, x + r, rtol=0, atol=0)  # the same one rounded add
    # fp32: 96 squares summed in another order, each rounding 2^-24: ~1e-7 relative (measured 2e-7), so 1e-5
    torch.testing.assert_close(out, norm(x + r), rtol=1e-5, atol=1e-5)
    # bf16: the interpreter truncates the new residual, the normalised row and the output where PyTorch rounds to
    # nearest: up to three ulps apart, 3 x 2^-7 = 2.3e-2 relative (on a GPU the same bits almost everywhere)
    xb, rb, wb = x.bfloat16(), r.bfloat16(), norm.weight.bfloat16()
    torch.testing.assert_close(
        add_rmsnorm(xb, rb, wb, 1e-6, impl="triton")[0],
        norm.bfloat16()(xb + rb),
        rtol=5e-2,
        atol=1e-2,
    )
    torch.testing.assert_close(
        rmsnorm(xb, wb, 1e-6, impl="triton"),
        add_rmsnorm_reference(xb, None, wb, 1e-6)[0],
        rtol=5e-2,
        atol=1e-2,
    )
    # zero-centred: chapter 03b's norm, whose weight is the offset from 1
    centred = ZeroCenteredRMSNorm(96, 1e-6)
    centred.weight.copy_(0.1 * torch.randn(96, generator=gen))
    out, _ = add_rmsnorm(x, r, centred.weight, 1e-6, impl="triton", zero_centred=True)
    torch.testing.assert_close(out, centred(x + r), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        rmsnorm(xb + rb, centred.weight.bfloat16(), 1e-6, impl="triton", zero_centred=True),
        centred.bfloat16()(xb + rb),
        rtol=5e-2,
        atol=1e-2,
    )
with pytest.raises(ValueError, match="same shape"):
    add_rmsnorm(x, r[:2], norm.weight, 1e-6)
with pytest.raises(ValueError, match=r"weight must be \[96\]"):
    add_rmsnorm(x, r, torch.ones(95), 1e-6)


# %% [markdown]
# ## q/k RMSNorm and RoPE in one pass
#
# Between the QKV projection and attention, each head vector of q and k is normalised (Qwen3)
# and rotated. In PyTorch that is a copy (q is a strided view of the QKV output), the norm, and
# about seven small kernels of RoPE, for q and again for k: at batch 1 these launches cost more
# than the arithmetic. One program per (token, head) loads the two halves of the vector once,
# normalises in fp32, rotates, and writes a contiguous result. q and k sit side by side in the
# QKV output (heads 0..Hq-1, then the KV heads), so one launch does both: a program picks the
# q-norm or the k-norm weight by its head index.

# %%
#| export
class NormRope(NamedTuple):
    "What turns the QKV projection's q and k into attention's: q/k RMSNorm weights (None: no norm), eps, cos, sin."

    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor  # [tokens, head_dim / 2]
    sin: torch.Tensor


def norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    "x [T, H, D] -> RoPE(rmsnorm(x) * weight) (weight None: RoPE only), as chapter 03 computes it."
    if weight is not None:
        x32 = x.float()
        x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    w2_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    first_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        if h >= first_heads:  # a head of the second group (k): its own norm weight
            w_ptr = w2_ptr
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1 = x1 * inv * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = x2 * inv * tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    impl: str = "auto",
    k_weight: torch.Tensor | None = None,
    num_q_heads: int | None = None,
) -> torch.Tensor:
    """x [T, H, D] (any strides with unit last stride), cos/sin [T, D/2] -> RoPE(rmsnorm(x) * weight), contiguous.
    With `num_q_heads` and `k_weight`, x holds q heads then k heads: heads from `num_q_heads` on use `k_weight`."""
    split = x.shape[1] if num_q_heads is None else num_q_heads
    if split < x.shape[1] and (weight is None) != (k_weight is None):
        raise ValueError("norm_rope over q and k heads needs both norm weights or neither")
    if kernel_backend(x.device, impl) == "torch":
        if split == x.shape[1]:
            return norm_rope_reference(x, weight, eps, cos, sin)
        return torch.cat(
            (
                norm_rope_reference(x[:, :split], weight, eps, cos, sin),
                norm_rope_reference(x[:, split:], k_weight, eps, cos, sin),
            ),
            dim=1,
        )
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("norm_rope needs unit stride in the last dimension of x, cos and sin")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        w = weight if weight is not None else x
        _norm_rope_kernel[(tokens, heads)](
            x,
            w,
            k_weight if k_weight is not None else w,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            split,
            eps,
            HALF=dim // 2,
            BLOCK=max(16, _pow2(dim // 2)),
            HAS_NORM=weight is not None,
            **_pdl_args(x.device, rows=tokens),
            num_warps=1,
        )
    return out


# %%
gen = torch.Generator().manual_seed(1)
qkv = torch.randn(6, 3 * 4 * 32, generator=gen)
q = qkv[:, : 4 * 32].view(6, 4, 32)  # a strided view, as the model has it
angles = torch.arange(6.0)[:, None] * torch.rand(16, generator=gen)[None, :]
w = 1 + 0.1 * torch.randn(32, generator=gen)
for weight in (
    w,
    None,
):  # fp32: 32 squares summed in another order, then the same products: a few 2^-24 of O(1)
    torch.testing.assert_close(
        norm_rope(q, weight, 1e-6, angles.cos(), angles.sin(), impl="triton"),
        norm_rope_reference(q, weight, 1e-6, angles.cos(), angles.sin()),
        rtol=1e-5,
        atol=1e-5,
    )
# bf16: the reference rounds after the norm, the weight and the rotation, the kernel once at the end (truncating here):
# up to four ulps, 2^-7 each, of |x1·c| + |x2·s|, which x1·c - x2·s may cancel: 5e-2, relative and absolute
qb, wb = q.bfloat16(), w.bfloat16()
torch.testing.assert_close(
    norm_rope(qb, wb, 1e-6, angles.cos().bfloat16(), angles.sin().bfloat16(), impl="triton"),
    norm_rope_reference(qb, wb, 1e-6, angles.cos(), angles.sin()),
    rtol=5e-2,
    atol=5e-2,
)

# %% [markdown]
# q (4 heads) and k (2 heads) of the same QKV rows in one launch, each with its own weight:

# %%
qk = qkv[:, : 6 * 32].view(6, 6, 32)
wk = 1 + 0.1 * torch.randn(32, generator=gen)
both = norm_rope(qk, w, 1e-6, angles.cos(), angles.sin(), impl="triton", k_weight=wk, num_q_heads=4)
# (the default fp32 tolerance, rtol 1.3e-6 and atol 1e-5: as above, differences of a few 1e-7)
torch.testing.assert_close(
    both[:, :4], norm_rope_reference(qk[:, :4], w, 1e-6, angles.cos(), angles.sin())
)
torch.testing.assert_close(
    both[:, 4:], norm_rope_reference(qk[:, 4:], wk, 1e-6, angles.cos(), angles.sin())
)
torch.testing.assert_close(
    norm_rope(qk, w, 1e-6, angles.cos(), angles.sin(), k_weight=wk, num_q_heads=4), both
)
with pytest.raises(ValueError, match="both norm weights or neither"):
    norm_rope(qk, w, 1e-6, angles.cos(), angles.sin(), num_q_heads=4)


# %% [markdown]
# ## SwiGLU's activation: one pass
#
# The MLP computes `silu(gate) * up` on the two halves of the gate-up projection: three
# kernels in PyTorch (silu, the product, and reading the strided halves), one here.

# %%
#| export
def silu_mul_reference(h: torch.Tensor) -> torch.Tensor:
    "h [T, 2I] = [gate | up] -> silu(gate) * up [T, I], as chapter 03's MLP computes it."
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_times(gate, up, dtype: tl.constexpr):
    "silu(gate) * up from fp32 gate and up, rounded to `dtype` as F.silu's output and then the product are."
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_mul_kernel(
    h_ptr,
    out_ptr,
    stride_h,
    stride_o,
    I,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < I
    gate = tl.load(h_ptr + row * stride_h + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + I + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + col, _silu_times(gate, up, out_ptr.dtype.element_ty), mask=mask
    )


def silu_mul(h: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    "h [T, 2I] -> silu(h[:, :I]) * h[:, I:]."
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_mul needs [tokens, 2 x intermediate], got {tuple(h.shape)}")
    if kernel_backend(h.device, impl) == "torch" or h.stride(-1) != 1:
        return silu_mul_reference(h)
    tokens, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=h.dtype, device=h.device)
    block = min(1024, _pow2(inter))
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
            h,
            out,
            h.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            **_pdl_args(h.device, rows=tokens),
            num_warps=4,
        )
    return out


# %%
h = torch.randn(3, 2 * 40, generator=gen)
# fp32: the same formula, exp's last bit apart: the default tolerance. bf16: SiLU and the product each truncated here
# (rounded by PyTorch): two ulps, 2 x 2^-7 = 1.6e-2
torch.testing.assert_close(silu_mul(h, impl="triton"), silu_mul_reference(h))
torch.testing.assert_close(
    silu_mul(h.bfloat16(), impl="triton"), silu_mul_reference(h.bfloat16()), rtol=2e-2, atol=2e-2
)


# %% [markdown]
# ## Storing new K and V in the pool
#
# Each layer writes the K and V of the step's new tokens into their slots of the pool:
# `index_copy_` twice in PyTorch, one kernel here (a program per token and KV head copies both
# vectors). k and v arrive as strided views of the QKV output; nothing is made contiguous first.

# %%
#| export
def write_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    "k/v [T, kv_heads, D] into slot_mapping[T] of k_cache/v_cache [blocks, block_size, kv_heads, D]."
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k)
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    kc_ptr,
    vc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    _let_next_start(PDL, WAIT)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dest = slot * stride_slot + h * stride_ch + offs
    tl.store(
        kc_ptr + dest, tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=mask), mask=mask
    )
    tl.store(
        vc_ptr + dest, tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=mask), mask=mask
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    impl: str = "auto",
) -> None:
    "Store k/v [T, kv_heads, D] (unit stride in D) in their slots of one layer's pool, in one launch."
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} "
            f"do not fit a pool of {tuple(k_cache.shape)}"
        )
    if (
        kernel_backend(k.device, impl) == "torch"
        or k.stride(-1) != 1
        or v.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return write_kv_reference(k_cache, v_cache, slot_mapping, k, v)
    tokens, heads, dim = k.shape
    if tokens:
        _write_kv_kernel[(tokens, heads)](
            k,
            v,
            slot_mapping,
            k_cache,
            v_cache,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(1),
            k_cache.stride(2),
            HEAD_DIM=dim,
            BLOCK_D=max(16, _pow2(dim)),
            **_pdl_args(k.device, rows=tokens),
            num_warps=1,
        )


# %%
kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
kv_rows = torch.randn(5, 3 * 2 * 8, generator=gen)  # strided k and v views, as the model makes them
k_new, v_new = kv_rows[:, :16].view(5, 2, 8), kv_rows[:, 16:32].view(5, 2, 8)
slots = torch.tensor([0, 5, 6, 11, 3])
write_kv(kc, vc, slots, k_new, v_new, impl="triton")
kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
write_kv_reference(kr, vr, slots, k_new, v_new)
assert torch.equal(kc, kr) and torch.equal(vc, vr) and torch.equal(kc.flatten(0, 1)[11], k_new[3])
with pytest.raises(ValueError, match="do not fit a pool"):
    write_kv(kc, vc, slots[:2], k_new, v_new)

# %% [markdown]
# ## The greedy pick: argmax over each row
#
# A greedy request's next token is the argmax of its logits: at Qwen3's 151,936 words one
# reduction per row. PyTorch's `argmax` runs it as one block of 512 threads walking the row:
# 12.0 µs on an H200 even replayed in a graph, outside the decode step's graph besides
# (`kernels_lab/greedy_in_graph.py`). Here the row is cut in chunks of 2,048, one
# program a chunk finds its largest logit and the first column holding it, and one program a
# row keeps the best of the chunks (the chunks in column order, so the first index wins a tie,
# as PyTorch's): 7.0 µs as a graph replay. Chapter 09b records it into the decode graphs, where
# it costs no launch of its own. (A NaN logit is not handled: PyTorch would pick it.)

# %%
#| export
ARGMAX_CHUNK = 2048  # logits a program of the first launch reduces


@triton.jit
def _argmax_chunks_kernel(logits_ptr, max_ptr, at_ptr, V, stride_row, CHUNKS, BLOCK: tl.constexpr):
    "Program (row, chunk): the chunk's largest logit and the first column holding it."
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(
        tl.float32
    )
    best = tl.max(x, axis=0)
    tl.store(max_ptr + row * CHUNKS + chunk, best)
    tl.store(at_ptr + row * CHUNKS + chunk, tl.min(tl.where(x == best, cols, V), axis=0))


@triton.jit
def _argmax_merge_kernel(max_ptr, at_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr):
    "Program row: the chunks' largest logit, at the first column holding it (the chunks are in column order)."
    row, c = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK_C)
    m = tl.load(max_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    at = tl.load(at_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=2**31 - 1)
    tl.store(
        out_ptr + row, tl.min(tl.where(m == tl.max(m, axis=0), at, 2**31 - 1), axis=0).to(tl.int64)
    )


def argmax_rows(logits: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """The argmax of each row of [rows, V] logits (the first column among equal maxima, as `torch.argmax`): int64
    [rows]. A row of -inf gives 0. Two launches (chunks, then each row's best chunk) where Triton runs."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"argmax_rows takes [rows, V] logits with V > 0, got {tuple(logits.shape)}"
        )
    if kernel_backend(logits.device, impl) == "torch" or logits.stride(-1) != 1:
        return logits.argmax(-1)
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    at = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _argmax_chunks_kernel[(rows, chunks)](
            logits, maxima, at, vocab, logits.stride(0), chunks, BLOCK=ARGMAX_CHUNK
        )
        _argmax_merge_kernel[(rows,)](maxima, at, out, chunks, BLOCK_C=_pow2(chunks))
    return out


# %% [markdown]
# Against `torch.argmax`: random rows, a row of -inf, a tie (the first index wins), the last
# column, many ties at the top; FP32 and BF16; a vocabulary that is no multiple of the chunk.

# %%
for vocab, dtype in ((5000, torch.float32), (4099, torch.bfloat16)):
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    logits[1] = float("-inf")
    logits[2, 7] = logits[2, vocab - 3] = logits[2].max() + 1
    logits[3, vocab - 1] = 1e4
    logits[4] = logits[4].round()
    assert torch.equal(argmax_rows(logits, impl="triton"), logits.float().argmax(-1)), (
        vocab,
        dtype,
    )
assert argmax_rows(torch.zeros(0, 10), impl="triton").shape == (0,)
with pytest.raises(ValueError, match="argmax_rows takes"):
    argmax_rows(torch.zeros(3))
