# %% [markdown]
# # The hybrid model's layers, fused
#
# > Chapter 03b's Qwen3.5 layers through kernels: merged projections, zero-centred norms that take the residual add, the gates and the gated norm each in one launch.

# %% [markdown]
# Chapter 03b's Qwen3.5 model is plain PyTorch, written the way its checkpoint names its
# weights. On a GPU, a decode step of that model is mostly kernel launches, not bytes: a Gated
# DeltaNet layer reads four input projections one by one, its zero-centred norms are about
# eight small kernels each, its gates `g` and `beta` about eight more, its gated norm about ten.
# Some fifty launches a layer against chapter 09a's four to six for a Qwen3 layer, at about
# 2.5 µs each inside a CUDA graph, put batch-1 decode far under the read-bandwidth ceiling.
#
# This chapter does for chapter 03b what chapter 09a does for chapter 03: a subclass for each
# layer, swapped in by class where the kernels run compiled (`install_fused_hybrid_layers`).
#
# | fused layer | runs | instead of |
# |---|---|---|
# | `FusedZeroCenteredRMSNorm` | `add_rmsnorm(..., zero_centred=True)`: the residual add and the norm, one launch | an add and ~8 small kernels |
# | `FusedGatedDeltaNet` | one input projection (qkv, z, b, a merged); `gdn_gates`; `gated_rmsnorm` | 4 projections, ~8 kernels of gates, ~10 of gated norm |
# | `FusedGatedAttention` | one projection for q (with its gate), k and v; `norm_partial_rope` for q and for k | 3 projections; a copy, a norm and ~8 kernels of rotation, twice |
# | `FusedSwiGLU` | one gate-up projection; a decode row's SiLU-mul in its GEMV's epilogue | 2 projections, silu and the product |
# | `FusedHybridDecoderLayer`, `FusedQwen35Model` | the residual handed from layer to layer, added by the next norm | an add a norm |
#
# One decision differs from chapter 09a, whose fused layers keep the model's parameters as they
# are: here the projections that read the same input are **merged at install**, their weights
# concatenated into one matrix and the originals dropped. A Qwen3.5 model loads unquantized and
# whole (chapter 04a), before it is installed, so nothing reads the old names afterwards; a
# merged matrix is one GEMV launch instead of four and a view of it would count its bytes twice.
#
# With these, a decode step of a Gated DeltaNet layer is ten launches: add + norm, the input
# projection, the convolution, the gates, the delta rule, the gated norm, the output projection,
# add + norm, gate-up with SiLU-mul, down.
#
# Measured on an H100 at the Qwen3.5-4B shape, `forge-engine bench w1 --model random:qwen3.5-4b`:
# **284.8 tok/s, 82.6% of the card's measured read ceiling** (8.41 GB of weights and 103 MB of
# state a step); chapter 03b's layers with only their `nn.Linear`s swapped ran 137.6 tok/s,
# 38.6%, on the same kind of card.

# %%
#| default_exp fused_hybrid

# %%
#| export
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.kernels.backend import _pow2, kernel_backend, kernels_available, tl, triton
from forge_engine.kernels.elementwise import add_rmsnorm, add_rmsnorm_reference, rmsnorm, silu_mul
from forge_engine.kernels.gemv import gemv
from forge_engine.fused_layers import FusedLinear, device_of, install_fused_layers, takes_gemv
from forge_engine.model import AttentionBackend
from forge_engine.qwen3_5 import (
    DecoderLayer,
    GatedAttention,
    GatedDeltaNet,
    LinearAttentionBackend,
    Qwen35Model,
    SwiGLU,
    ZeroCenteredRMSNorm,
    apply_partial_rope,
)

# %%
#| hide
import copy
import functools

import pytest

from forge_engine.model import rope_cos_sin
from forge_engine.qwen3_5 import (
    QWEN35_TINY,
    GatedRMSNorm,
    SequenceStates,
    init_random_qwen35,
)
from forge_engine.state_pool import StatePool, StepStates


# %% [markdown]
# ## The gates, in one launch
#
# Chapter 03b computes each value head's decay and write strength from two of the input
# projection's columns: `g = -exp(A_log) · softplus(a + dt_bias)` and `beta = sigmoid(b)`, the
# latter in the model's dtype. One program per row does both. `softplus` is `log(1 + e^x)`, which
# loses the small `e^x` of a typical head (`dt` of 1e-3 .. 1e-1) in the `1 +`; the kernel takes
# it as `log(u) · e^x / (u - 1)` for `u = 1 + e^x`, which cancels that rounding (and as x itself
# above 20, as `F.softplus` does).

# %%
#| export
def gdn_gates_reference(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    "Chapter 03b's gates: a, b [T, heads] -> (g, beta) fp32 [T, heads]; beta is sigmoid(b) rounded to b's dtype."
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b).float()


@triton.jit
def _gdn_gates_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    stride_a,
    stride_b,
    H,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    exact = u == 1.0  # e below half an ulp of 1: log(1 + e) is e
    log1p = tl.where(
        exact, e, tl.log(u) * e / tl.where(exact, 1.0, u - 1.0)
    )  # its rounding cancelled
    softplus = tl.where(x > 20.0, x, log1p)
    a_log = tl.load(a_log_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + row * H + offs, -tl.exp(a_log) * softplus, mask=mask)
    b = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-b))).to(b_ptr.dtype.element_ty)  # rounded as chapter 03b's
    tl.store(beta_ptr + row * H + offs, beta.to(tl.float32), mask=mask)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    "The Gated DeltaNet's gates g and beta of each row (see the reference), in one launch on a GPU."
    T, H = a.shape
    if b.shape != (T, H) or A_log.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(
            f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)} and dt_bias "
            f"{tuple(dt_bias.shape)} must be [T, heads], [T, heads], [heads], [heads]"
        )
    if kernel_backend(a.device, impl) == "torch":
        return gdn_gates_reference(a, b, A_log, dt_bias)
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gdn_gates needs a and b with unit stride in the last dimension")
    g = torch.empty(T, H, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if T:
        _gdn_gates_kernel[(T,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            a.stride(0),
            b.stride(0),
            H,
            BLOCK_H=_pow2(H),
            num_warps=1,
        )
    return g, beta


# %% [markdown]
# Against the reference, under the interpreter here, over the range of `a + dt_bias` a model
# meets and past the linear threshold:

# %%
gen = torch.Generator().manual_seed(0)
a = torch.linspace(-30.0, 30.0, 64).reshape(8, 8)
b = torch.randn(8, 8, generator=gen)
A_log, dt_bias = torch.rand(8, generator=gen).log1p(), torch.randn(8, generator=gen)
# bf16's beta is rounded, which the interpreter does by truncating: one ulp of bf16 apart at most
for dtype, beta_tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
    (g, beta), (want_g, want_beta) = (
        f(a.to(dtype), b.to(dtype), A_log, dt_bias)
        for f in (functools.partial(gdn_gates, impl="triton"), gdn_gates_reference)
    )
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, want_beta, rtol=beta_tol, atol=beta_tol)
with pytest.raises(ValueError, match="must be"):
    gdn_gates(a, b[:, :4], A_log, dt_bias)


# %% [markdown]
# ## The gated norm, in one launch
#
# The delta rule's output (fp32, a row per value head) goes through chapter 03b's
# `GatedRMSNorm`: rounded to the model's dtype, RMS-normalised over the head, times the weight,
# times `silu(z)` of the head's gate `z`. One program per (token, head) does it and writes the
# row the output projection reads, rounding where chapter 03b rounds.

# %%
#| export
def gated_rmsnorm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    "Chapter 03b's GatedRMSNorm: x [T, heads, D] (fp32), gate [T, heads, D] -> [T, heads * D] in gate's dtype."
    x = x.to(gate.dtype)
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype).reshape(x.shape[0], -1)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_zt,
    stride_zh,
    HEADS,
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    t, h = tl.program_id(0).to(tl.int64) // HEADS, tl.program_id(0) % HEADS
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    x = x.to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    out = normed * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t * HEADS * D + h * D + offs, out.to(dtype), mask=mask)


def gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto"
) -> torch.Tensor:
    "Chapter 03b's GatedRMSNorm of each head of x by its gate (see the reference), in one launch on a GPU."
    T, heads, D = x.shape
    if gate.shape != x.shape or weight.shape != (D,):
        raise ValueError(
            f"gated_rmsnorm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight {tuple(weight.shape)} must be "
            "[T, heads, D], the same, and [D]"
        )
    if kernel_backend(x.device, impl) == "torch":
        return gated_rmsnorm_reference(x, gate, weight, eps)
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("gated_rmsnorm needs x and gate with unit stride in the last dimension")
    out = torch.empty(T, heads * D, dtype=gate.dtype, device=x.device)
    if T:
        _gated_rmsnorm_kernel[(T * heads,)](
            x,
            gate,
            weight,
            out,
            x.stride(0),
            x.stride(1),
            gate.stride(0),
            gate.stride(1),
            heads,
            D,
            eps,
            BLOCK_D=_pow2(D),
            num_warps=1,
        )
    return out


# %% [markdown]
# Against chapter 03b's module: fp32 to rounding, bf16 to a few ulps (the interpreter truncates
# where PyTorch rounds to nearest, as chapter 09's elementwise kernels note):

# %%
norm = GatedRMSNorm(16, 1e-6)
with torch.no_grad():
    norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=gen))
x, z = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 4, 16, generator=gen)
with torch.no_grad():
    want = norm(x, z).reshape(3, -1)
    torch.testing.assert_close(gated_rmsnorm(x, z, norm.weight, 1e-6, impl="triton"), want)
    torch.testing.assert_close(gated_rmsnorm(x, z, norm.weight, 1e-6), want)  # (the reference here)
    zb, wb = z.bfloat16(), norm.weight.bfloat16()
    torch.testing.assert_close(
        gated_rmsnorm(x, zb, wb, 1e-6, impl="triton"),
        gated_rmsnorm_reference(x, zb, wb, 1e-6),
        rtol=5e-2,
        atol=2e-2,
    )
with pytest.raises(ValueError, match="must be"):
    gated_rmsnorm(x, z[:, :2], norm.weight, 1e-6)


# %% [markdown]
# ## q and k: the norm and the partial rotation, in one launch
#
# A gated attention layer normalises each head of q and k (zero-centred) and rotates the first
# quarter of its dims (`apply_partial_rope`): a copy, about eight kernels of norm, seven of
# rotation and a concatenation, for q and again for k. One program per (token, head) loads the
# row in three parts, the two rotated halves and the rest, normalises it (rounded to the model's
# dtype, as the norm's output is) and writes it rotated.

# %%
#| export
def norm_partial_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    "Chapter 03b's zero-centred norm of each head of x [T, heads, D], then `apply_partial_rope` (cos, sin [T, R / 2])."
    normed = add_rmsnorm_reference(x, None, weight, eps, zero_centred=True)[0]
    return apply_partial_rope(normed, cos, sin)


@triton.jit
def _norm_partial_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    HEADS,
    eps,
    D: tl.constexpr,
    HALF_R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r, p = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    mask_r, mask_p = r < HALF_R, p < D - 2 * HALF_R
    row = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(row + r, mask=mask_r, other=0.0).to(tl.float32)  # the rotated pairs' halves
    x2 = tl.load(row + HALF_R + r, mask=mask_r, other=0.0).to(tl.float32)
    x3 = tl.load(row + 2 * HALF_R + p, mask=mask_p, other=0.0).to(tl.float32)  # the rest
    squares = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(x3 * x3, axis=0)
    rstd = 1.0 / tl.sqrt(squares / D + eps)
    dtype = out_ptr.dtype.element_ty
    w1 = 1.0 + tl.load(w_ptr + r, mask=mask_r, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(w_ptr + HALF_R + r, mask=mask_r, other=0.0).to(tl.float32)
    w3 = 1.0 + tl.load(w_ptr + 2 * HALF_R + p, mask=mask_p, other=0.0).to(tl.float32)
    y1 = (x1 * rstd * w1).to(dtype).to(tl.float32)  # the norm's output, rounded
    y2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + r, mask=mask_r, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + r, mask=mask_r, other=0.0).to(tl.float32)
    out = out_ptr + (t * HEADS + h) * D
    tl.store(out + r, (y1 * c - y2 * s).to(dtype), mask=mask_r)
    tl.store(out + HALF_R + r, (y2 * c + y1 * s).to(dtype), mask=mask_r)
    tl.store(out + 2 * HALF_R + p, (x3 * rstd * w3).to(dtype), mask=mask_p)


def norm_partial_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    "x [T, heads, D] (unit last stride) -> the reference's result, contiguous, in one launch on a GPU."
    T, heads, D = x.shape
    half = cos.shape[-1]
    if weight.shape != (D,) or cos.shape != (T, half) or sin.shape != cos.shape or 2 * half > D:
        raise ValueError(
            f"norm_partial_rope: x {tuple(x.shape)}, weight {tuple(weight.shape)}, cos {tuple(cos.shape)} and sin "
            f"{tuple(sin.shape)} must be [T, heads, D], [D] and [T, R / 2] with R <= D"
        )
    if kernel_backend(x.device, impl) == "torch":
        return norm_partial_rope_reference(x, weight, eps, cos, sin)
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError(
            "norm_partial_rope needs unit stride in the last dimension of x, cos and sin"
        )
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    if T:
        _norm_partial_rope_kernel[(T, heads)](
            x,
            weight,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            eps,
            D=D,
            HALF_R=half,
            BLOCK_R=max(16, _pow2(half)),
            BLOCK_P=max(16, _pow2(D - 2 * half)),
            num_warps=1,
        )
    return out


# %% [markdown]
# Against the reference, q heads strided as they come from the merged projection:

# %%
q = torch.randn(3, 4, 64, generator=gen)[:, :, :32]  # every other half-row: a strided view
weight = 0.1 * torch.randn(32, generator=gen)
cos, sin = rope_cos_sin(torch.tensor([0, 5, 9]), 8, 10_000.0)
torch.testing.assert_close(
    norm_partial_rope(q, weight, 1e-6, cos, sin, impl="triton"),
    norm_partial_rope_reference(q, weight, 1e-6, cos, sin),
)
with pytest.raises(ValueError, match="must be"):
    norm_partial_rope(q, weight[:8], 1e-6, cos, sin)


# %% [markdown]
# ## The layers
#
# `merged_linear` concatenates the rows of linear layers that read the same input; a fused layer
# splits the one product back into its parts, views of it. The decoder layer hands its residual
# on: each zero-centred norm takes the add before it (`add_and_norm`), so the layer returns
# `(the MLP's output, the residual before it)` and the next layer's first norm, or the model's
# final one, adds them.

# %%
#| export
class FusedZeroCenteredRMSNorm(ZeroCenteredRMSNorm):
    "The zero-centred RMSNorm by one kernel (`add_rmsnorm`'s `zero_centred`), and the residual add with it."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, zero_centred=True)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        "(norm(x + residual), x + residual); residual None: (norm(x), x)."
        return add_rmsnorm(x, residual, self.weight, self.eps, zero_centred=True)


@torch.no_grad()
def merged_linear(*layers: nn.Linear) -> FusedLinear:
    "One FusedLinear whose rows are those of `layers`, in order (they read the same input)."
    weight = torch.cat([layer.weight for layer in layers])
    has_bias = [layer.bias is not None for layer in layers]
    if any(has_bias) and not all(has_bias):
        raise ValueError("merged layers must all have a bias or none")
    merged = FusedLinear(weight.shape[1], weight.shape[0], bias=all(has_bias), device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if all(has_bias):
        merged.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=False)
    return merged


class FusedGatedDeltaNet(GatedDeltaNet):
    "The Gated DeltaNet with one input projection (`in_proj`: qkv, z, b, a), its gates and gated norm one launch each."

    def merge(self) -> None:
        "At install: the four input projections into one."
        self.in_proj = merged_linear(
            self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        )
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def forward(self, x: torch.Tensor, linear: LinearAttentionBackend) -> torch.Tensor:
        c, t, heads = self.config, x.shape[0], self.config.linear_num_value_heads
        conv_in, z, b, a = self.in_proj(x).split(
            [2 * self.key_dim + self.value_dim, self.value_dim, heads, heads], dim=-1
        )
        mixed = linear.conv(self.index, conv_in, self.conv1d.weight[:, 0])
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (y.view(t, c.linear_num_key_heads, -1) for y in (q, k))
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        out = linear.delta_rule(self.index, q, k, v.view(t, heads, -1), g, beta)
        return self.out_proj(
            gated_rmsnorm(out, z.view(t, heads, -1), self.norm.weight, self.norm.eps)
        )


class FusedGatedAttention(GatedAttention):
    "Gated attention with one projection for q and its gate, k and v (`qkv`)."

    def merge(self) -> None:
        "At install: the three projections into one."
        self.qkv = merged_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        kv = c.num_kv_heads * c.head_dim
        q_gate, k, v = self.qkv(x).split([2 * c.num_heads * c.head_dim, kv, kv], dim=-1)
        q, gate = q_gate.reshape(t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        k, v = k.reshape(t, c.num_kv_heads, c.head_dim), v.reshape(t, c.num_kv_heads, c.head_dim)
        q = norm_partial_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = norm_partial_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        out = attention(self.index, q, k, v) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))


class FusedSwiGLU(SwiGLU):
    "SwiGLU with one gate-up projection (`gate_up`); a decode row's SiLU-mul in its GEMV (`swiglu`), else `silu_mul`."

    def merge(self) -> None:
        "At install: gate and up into one."
        self.gate_up = merged_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_gemv(x):
            return self.down_proj(gemv(x, *self.gate_up.gemv_operands(), swiglu=True))
        return self.down_proj(silu_mul(self.gate_up(x)))


class FusedHybridDecoderLayer(DecoderLayer):
    "A hybrid decoder layer whose norms take the residual add before them; the residual is handed to the next layer."

    def forward(self, x, residual, cos, sin, attention, linear):
        """x: the last layer's output, residual: the stream before it (None at the first layer) -> (this layer's
        MLP output, the stream before it)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(
            self.mix(h, cos, sin, attention, linear), residual
        )
        return self.mlp(h), residual


class FusedQwen35Model(Qwen35Model):
    "The Qwen3.5 model whose layers hand their residual on, and whose tied LM head is a GEMV for a decode row."

    def run_layers(self, x, cos, sin, attention, linear):
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention, linear)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None and takes_gemv(hidden):  # tied: the embedding matrix is the head
            return gemv(hidden, self.embed_tokens.weight).float()
        return super().compute_logits(hidden)


# %% [markdown]
# `install_fused_hybrid_layers` swaps the classes and merges the projections, in place, then
# lets chapter 09a's `install_fused_layers` turn the remaining `nn.Linear`s (the output
# projections, down, an untied LM head) into `FusedLinear`s. Installing twice changes nothing.

# %%
#| export
FUSED_HYBRID_LAYERS = {
    ZeroCenteredRMSNorm: FusedZeroCenteredRMSNorm,
    GatedDeltaNet: FusedGatedDeltaNet,
    GatedAttention: FusedGatedAttention,
    SwiGLU: FusedSwiGLU,
    DecoderLayer: FusedHybridDecoderLayer,
    Qwen35Model: FusedQwen35Model,
}


def install_fused_hybrid_layers(model: Qwen35Model, force: bool = False) -> Qwen35Model:
    """Swap each module of `model` whose class is one of FUSED_HYBRID_LAYERS' for its fused subclass, in place, merging
    the projections that read one input, where the kernels run compiled (the model on a CUDA GPU), or anywhere with
    `force` (tests: on a CPU the kernels' PyTorch paths run). Returns `model`."""
    if not (force or kernels_available(device_of(model))):
        return model
    for module in list(model.modules()):
        fused = FUSED_HYBRID_LAYERS.get(type(module))
        if fused is not None:
            module.__class__ = fused
            if hasattr(fused, "merge"):
                module.merge()
    return install_fused_layers(model, force)


# %% [markdown]
# The fused model against chapter 03b's, on the CPU (the kernels' PyTorch paths): one sequence
# through `SequenceStates`, a prompt then decodes; and a step of two prompts then decode steps on
# chapter 05a's pool of states (`StepStates`), whose decode-only steps hand back the kernels'
# outputs without a copy. The attention layers here see each step's rows alone (no KV cache,
# the same for both models); chapter 07a's runner gives them chapter 05's paged cache, and the
# GPU test `test_qwen3_5_on_the_gpu_matches_the_cpu` runs the fused model there.

# %%
plain = init_random_qwen35(Qwen35Model(QWEN35_TINY), seed=0, std=0.1).eval()
assert (
    install_fused_hybrid_layers(plain) is plain and type(plain) is Qwen35Model
)  # (a CPU: unchanged)
fused = install_fused_hybrid_layers(copy.deepcopy(plain), force=True)
assert type(fused) is FusedQwen35Model and type(fused.layers[0].linear_attn) is FusedGatedDeltaNet
assert type(fused.layers[3].self_attn.qkv) is FusedLinear and not hasattr(
    fused.layers[0].mlp, "up_proj"
)
assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
assert install_fused_hybrid_layers(fused, force=True) is fused  # (twice: the same)

with torch.no_grad():
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    states = {m: SequenceStates() for m in (plain, fused)}
    for rows in (slice(0, 5), slice(5, 6), slice(6, 7), slice(7, 8)):
        positions = torch.arange(8)[rows]
        want, got = (m(ids[rows], positions, linear=states[m]) for m in (plain, fused))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fused.compute_logits(got), plain.compute_logits(want), rtol=1e-5, atol=1e-5
    )

    pools = {m: StatePool(QWEN35_TINY, 3) for m in (plain, fused)}
    prompts = [[7, 2, 9, 4], [1, 5, 6]]
    for m in (plain, fused):  # two prompts, in slots 2 and 0
        step = StepStates(pools[m], [(4, 2, True), (3, 0, True)])
        positions = torch.tensor([0, 1, 2, 3, 0, 1, 2])
        states[m] = m(torch.tensor(prompts[0] + prompts[1]), positions, linear=step)
    torch.testing.assert_close(states[fused], states[plain], rtol=1e-5, atol=1e-5)
    for t in range(2):  # decodes only
        for m in (plain, fused):
            step = StepStates.decodes(pools[m], torch.tensor([2, 0]))
            states[m] = m(torch.tensor([11, 12]), torch.tensor([4 + t, 3 + t]), linear=step)
        assert step.decodes_only()
        torch.testing.assert_close(states[fused], states[plain], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[fused].recurrent, pools[plain].recurrent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[fused].conv, pools[plain].conv)

# %%
#| hide
import nbdev

nbdev.nbdev_export()
