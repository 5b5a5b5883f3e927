# %% [markdown]
# # Kernels
#
# > Triton kernels for the hot spots of a step: RMSNorm fused with the residual add, paged GQA decode attention (flash-decoding), and varlen causal prefill attention over the paged pool; each with the PyTorch reference it is tested against.

# %% [markdown]
# Chapters 03 and 05 wrote every operation in plain PyTorch. That is right for reading and for
# the CPU, but on a GPU three things cost more than they should:
#
# - **the residual add and RMSNorm** run as half a dozen small kernels, each reading and
#   writing the hidden state again; one kernel can read `x` and the residual once and write
#   the new residual and the normalised row once;
# - **decode attention** gathers every sequence's K/V through its block table into a padded
#   copy, then runs attention over the copy: the K/V is read twice and written once. A kernel
#   can read it once, straight from the pool, and read each KV head *once for its whole group
#   of query heads* (GQA: Qwen3-4B has 4 query heads per KV head);
# - **prefill attention** loops over sequences in Python, one gather each.
#
# What each is worth is napkin math against the H200's measured ceilings
# (chapter 13's `ceilings`): 4.19 TB/s of HBM read, ~790 TFLOP/s of dense bf16.
# Decode attention is pure bandwidth: Qwen3-4B keeps 16 KiB of K/V per token and layer
# (8 heads x 128 x 2 bytes x K,V), so 64 sequences of 1,024 tokens are 1 GiB per layer,
# 256 µs at the ceiling. Prefill is arithmetic: 4 x tokens x context x heads x head_dim FLOPs.
# The variants we tried, with their measurements, are in `kernels_lab/`; the winners are here.
#
# Every kernel has a PyTorch path that computes the same thing (it is also the reference the
# tests compare with): the engine runs on a CPU, or on a GPU without Triton, with the same API.
# `impl="auto"` picks Triton on a CUDA tensor when Triton is installed, PyTorch otherwise.

# %%
#| default_exp kernels

# %% [markdown]
# ## Triton here, or not
#
# Without a GPU, Triton can still *interpret* a kernel on the CPU (numpy runs each program in
# turn). That is how CI tests the kernels; it is far too slow to serve with. The interpreter
# has to be switched on before `triton` is first imported (Triton's own `tl.zeros` and friends
# are jit functions, decorated at import), so we set `TRITON_INTERPRET=1` here, before importing
# it, and only when there is no CUDA device. Import this module before `triton` on a CPU. Where Triton is
# not installed at all (macOS, Windows), the kernels below are still defined, by a stand-in
# decorator, but never launched.

# %%
#| export
import functools
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

try:
    import triton
    import triton.language as tl
    TRITON_VERSION: str | None = triton.__version__
except ImportError:  # the PyTorch paths still work; the kernel definitions below are read but never launched
    class _NoTriton:
        constexpr = None
        @staticmethod
        def jit(fn): return fn
    triton = tl = _NoTriton()
    TRITON_VERSION = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.model import RMSNorm, causal_attention

# %% [markdown]
# `kernel_backend` is the one place that decides which implementation runs; `kernels_report`
# says it in a line for `forge-engine doctor`.

# %%
#| export
IMPLS = ("auto", "triton", "torch")


def kernel_backend(device, impl: str = "auto") -> str:
    "'triton' or 'torch': what runs for tensors on `device`. 'auto' takes Triton on a CUDA device when Triton is installed."
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "triton" and TRITON_VERSION is None:
        raise ValueError("impl='triton' needs the triton package, which is not installed")
    if impl != "auto": return impl
    return "triton" if TRITON_VERSION is not None and torch.device(device).type == "cuda" else "torch"


def kernels_available(device="cuda") -> bool:
    "True when the Triton kernels run natively (not interpreted) on `device`."
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and kernel_backend(device) == "triton"


def kernels_report() -> str:
    "One line for `forge-engine doctor`: which implementation the kernels of this chapter run as here."
    if TRITON_VERSION is None:
        return "PyTorch (Triton not installed)"
    if kernels_available():
        return (f"Triton {TRITON_VERSION} on CUDA: fused add+RMSNorm, q/k-norm+RoPE, SiLU-mul, K/V store, GEMV; "
                f"paged decode (Triton: the CUDA C++ contender of kernels_lab was 2.4-8x slower) and prefill attention")
    return f"PyTorch (no CUDA GPU; Triton {TRITON_VERSION} runs the kernels only interpreted, for tests)"


# %%
assert kernel_backend("cpu") == "torch" and kernel_backend("cpu", "torch") == "torch"
assert kernel_backend("cpu", "triton") == "triton"  # forced: the interpreter on a CPU tensor
with pytest.raises(ValueError, match="unknown kernel implementation 'cuda'"):
    kernel_backend("cpu", "cuda")
assert not kernels_available("cpu")
if not torch.cuda.is_available():
    assert kernels_report().startswith("PyTorch (no CUDA GPU")
print(kernels_report())


# %% [markdown]
# A bug to know about: in Triton 3.7's interpreter, `tl.dot` multiplies bf16 operands as their
# raw 16-bit patterns. Interpreted kernels therefore upcast dot operands to fp32 first (a
# no-op for fp32; exact for bf16 values). Compiled kernels keep bf16 operands for the tensor
# cores. For fp32 inputs we ask the compiler for full fp32 dots (`ieee`), not TF32, so fp32
# results match the reference to ~1e-6. And the interpreter rounds fp32 -> bf16 by truncation,
# not to nearest as the GPU does: interpreted bf16 results agree to bf16 tolerances, not bits.

# %%
#| export
@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


def _dot_precision(dtype: torch.dtype) -> str: return "ieee" if dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int: return 1 << max(0, n - 1).bit_length()


def _stages(num_stages: int | None) -> dict: return {} if num_stages is None else {"num_stages": num_stages}


# Programmatic dependent launch (Hopper and newer; chapter section "Matrix-vector products"): a
# kernel launched with it may start while the kernel before it is still finishing, once that
# kernel allows it; it must wait (`gdc_wait`) before reading what that kernel writes.
@functools.cache
def pdl_supported(device) -> bool:
    "Programmatic dependent launch here: compiled kernels on compute capability 9 (Hopper) or newer."
    device = torch.device(device)
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _let_next_start(PDL: tl.constexpr, WAIT: tl.constexpr):
    """Allow the next kernel, if launched as a dependent, to start now (it waits for our results before reading them);
    WAIT: this kernel was launched as one, so it waits for the kernel before it to finish."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _wait_for_previous(WAIT)


@triton.jit
def _wait_for_previous(WAIT: tl.constexpr):
    "Launched as a dependent (WAIT): wait here until the kernel before has finished and its writes are visible."
    if WAIT:
        tl.extra.cuda.gdc_wait()


DEPENDENT_LAUNCHES = True  # the small decode kernels launched as dependents too: measured faster (see the GEMV)
DEPENDENT_LAUNCH_MAX_ROWS = 4  # ... in steps of at most this many rows (tokens or sequences): the GEMV steps, where measured


def _pdl_args(device, waits_late: bool = False, rows: int = 1) -> dict:
    """Launch arguments of a small kernel of the decode step (norms, RoPE, K/V store, SiLU-mul, decode attention) over
    `rows` rows: it lets the next kernel start early, and with DEPENDENT_LAUNCHES (at most DEPENDENT_LAUNCH_MAX_ROWS
    rows) is launched early itself, waiting for its input. `waits_late`: launched early in any case; the kernel
    waits itself, further on (DECODE_EARLY_TILE)."""
    pdl = pdl_supported(device)
    dependent = pdl and (waits_late or (DEPENDENT_LAUNCHES and rows <= DEPENDENT_LAUNCH_MAX_ROWS))
    return dict(PDL=pdl, WAIT=dependent and not waits_late, launch_pdl=dependent)


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

# %%
#| export
def add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    "(rmsnorm(x + residual) * weight, x + residual); with residual None: (rmsnorm(x) * weight, x)."
    if residual is not None: x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                        H, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
                        WAIT: tl.constexpr):
    _let_next_start(PDL, WAIT)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    # the norm weight asked for with x, not after the sum: across warps the sum waits at a barrier, and the
    # compiler does not move a load over it (one memory round trip fewer for a one-row decode step)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the new residual is rounded to the model dtype, and normalised as rounded
        h = (h.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                impl: str = "auto", num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    "x, residual [..., H], weight [H] -> (rmsnorm(x + residual) * weight, the new residual x + residual)."
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[-1]}] in {x.dtype}, got {tuple(weight.shape)} in {weight.dtype}")
    if kernel_backend(x.device, impl) == "torch":
        return add_rmsnorm_reference(x, residual, weight, eps)
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
            rows, res, weight, out, res_out, rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK_H=block, **_pdl_args(x.device, rows=rows.shape[0]),
            num_warps=num_warps or min(8, max(1, block // 512)))
    return out.view(x.shape), (x if residual is None else res_out.view(x.shape))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    "rmsnorm(x) * weight over the last dimension (no residual)."
    return add_rmsnorm(x, None, weight, eps, impl)[0]


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
    torch.testing.assert_close(add_rmsnorm(xb, rb, wb, 1e-6, impl="triton")[0], norm.bfloat16()(xb + rb), rtol=5e-2, atol=1e-2)
    torch.testing.assert_close(rmsnorm(xb, wb, 1e-6, impl="triton"), add_rmsnorm_reference(xb, None, wb, 1e-6)[0],
                               rtol=5e-2, atol=1e-2)
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


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    "x [T, H, D] -> RoPE(rmsnorm(x) * weight) (weight None: RoPE only), as chapter 03 computes it."
    if weight is not None:
        x32 = x.float()
        x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, w2_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                      stride_ct, first_heads, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
                      PDL: tl.constexpr, WAIT: tl.constexpr):
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


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              impl: str = "auto", k_weight: torch.Tensor | None = None, num_q_heads: int | None = None) -> torch.Tensor:
    """x [T, H, D] (any strides with unit last stride), cos/sin [T, D/2] -> RoPE(rmsnorm(x) * weight), contiguous.
    With `num_q_heads` and `k_weight`, x holds q heads then k heads: heads from `num_q_heads` on use `k_weight`."""
    split = x.shape[1] if num_q_heads is None else num_q_heads
    if split < x.shape[1] and (weight is None) != (k_weight is None):
        raise ValueError("norm_rope over q and k heads needs both norm weights or neither")
    if kernel_backend(x.device, impl) == "torch":
        if split == x.shape[1]:
            return norm_rope_reference(x, weight, eps, cos, sin)
        return torch.cat((norm_rope_reference(x[:, :split], weight, eps, cos, sin),
                          norm_rope_reference(x[:, split:], k_weight, eps, cos, sin)), dim=1)
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("norm_rope needs unit stride in the last dimension of x, cos and sin")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        w = weight if weight is not None else x
        _norm_rope_kernel[(tokens, heads)](
            x, w, k_weight if k_weight is not None else w, cos, sin, out, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), cos.stride(0), split, eps, HALF=dim // 2, BLOCK=max(16, _pow2(dim // 2)),
            HAS_NORM=weight is not None, **_pdl_args(x.device, rows=tokens), num_warps=1)
    return out


# %%
gen = torch.Generator().manual_seed(1)
qkv = torch.randn(6, 3 * 4 * 32, generator=gen)
q = qkv[:, :4 * 32].view(6, 4, 32)  # a strided view, as the model has it
angles = torch.arange(6.0)[:, None] * torch.rand(16, generator=gen)[None, :]
w = 1 + 0.1 * torch.randn(32, generator=gen)
for weight in (w, None):  # fp32: 32 squares summed in another order, then the same products: a few 2^-24 of O(1)
    torch.testing.assert_close(norm_rope(q, weight, 1e-6, angles.cos(), angles.sin(), impl="triton"),
                               norm_rope_reference(q, weight, 1e-6, angles.cos(), angles.sin()), rtol=1e-5, atol=1e-5)
# bf16: the reference rounds after the norm, the weight and the rotation, the kernel once at the end (truncating here):
# up to four ulps, 2^-7 each, of |x1·c| + |x2·s|, which x1·c - x2·s may cancel: 5e-2, relative and absolute
qb, wb = q.bfloat16(), w.bfloat16()
torch.testing.assert_close(norm_rope(qb, wb, 1e-6, angles.cos().bfloat16(), angles.sin().bfloat16(), impl="triton"),
                           norm_rope_reference(qb, wb, 1e-6, angles.cos(), angles.sin()), rtol=5e-2, atol=5e-2)

# %% [markdown]
# q (4 heads) and k (2 heads) of the same QKV rows in one launch, each with its own weight:

# %%
qk = qkv[:, :6 * 32].view(6, 6, 32)
wk = 1 + 0.1 * torch.randn(32, generator=gen)
both = norm_rope(qk, w, 1e-6, angles.cos(), angles.sin(), impl="triton", k_weight=wk, num_q_heads=4)
# (the default fp32 tolerance, rtol 1.3e-6 and atol 1e-5: as above, differences of a few 1e-7)
torch.testing.assert_close(both[:, :4], norm_rope_reference(qk[:, :4], w, 1e-6, angles.cos(), angles.sin()))
torch.testing.assert_close(both[:, 4:], norm_rope_reference(qk[:, 4:], wk, 1e-6, angles.cos(), angles.sin()))
torch.testing.assert_close(norm_rope(qk, w, 1e-6, angles.cos(), angles.sin(), k_weight=wk, num_q_heads=4), both)
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
def _silu_mul_kernel(h_ptr, out_ptr, stride_h, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):
    _let_next_start(PDL, WAIT)
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < I
    gate = tl.load(h_ptr + row * stride_h + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + I + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, _silu_times(gate, up, out_ptr.dtype.element_ty), mask=mask)


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
        _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](h, out, h.stride(0), out.stride(0), inter, BLOCK=block,
                                                              **_pdl_args(h.device, rows=tokens), num_warps=4)
    return out


# %%
h = torch.randn(3, 2 * 40, generator=gen)
# fp32: the same formula, exp's last bit apart: the default tolerance. bf16: SiLU and the product each truncated here
# (rounded by PyTorch): two ulps, 2 x 2^-7 = 1.6e-2
torch.testing.assert_close(silu_mul(h, impl="triton"), silu_mul_reference(h))
torch.testing.assert_close(silu_mul(h.bfloat16(), impl="triton"), silu_mul_reference(h.bfloat16()), rtol=2e-2, atol=2e-2)


# %% [markdown]
# ## Storing new K and V in the pool
#
# Each layer writes the K and V of the step's new tokens into their slots of the pool:
# `index_copy_` twice in PyTorch, one kernel here (a program per token and KV head copies both
# vectors). k and v arrive as strided views of the QKV output; nothing is made contiguous first.

# %%
#| export
def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
    "k/v [T, kv_heads, D] into slot_mapping[T] of k_cache/v_cache [blocks, block_size, kv_heads, D]."
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k)
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_slot, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                     WAIT: tl.constexpr):
    _let_next_start(PDL, WAIT)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dest = slot * stride_slot + h * stride_ch + offs
    tl.store(kc_ptr + dest, tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=mask), mask=mask)
    tl.store(vc_ptr + dest, tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=mask), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, impl: str = "auto") -> None:
    "Store k/v [T, kv_heads, D] (unit stride in D) in their slots of one layer's pool, in one launch."
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} "
                         f"do not fit a pool of {tuple(k_cache.shape)}")
    if kernel_backend(k.device, impl) == "torch" or k.stride(-1) != 1 or v.stride(-1) != 1 \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return write_kv_reference(k_cache, v_cache, slot_mapping, k, v)
    tokens, heads, dim = k.shape
    if tokens:
        _write_kv_kernel[(tokens, heads)](k, v, slot_mapping, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0),
                                          v.stride(1), k_cache.stride(1), k_cache.stride(2), HEAD_DIM=dim,
                                          BLOCK_D=max(16, _pow2(dim)), **_pdl_args(k.device, rows=tokens), num_warps=1)


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
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    tl.store(max_ptr + row * CHUNKS + chunk, best)
    tl.store(at_ptr + row * CHUNKS + chunk, tl.min(tl.where(x == best, cols, V), axis=0))


@triton.jit
def _argmax_merge_kernel(max_ptr, at_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr):
    "Program row: the chunks' largest logit, at the first column holding it (the chunks are in column order)."
    row, c = tl.program_id(0).to(tl.int64), tl.arange(0, BLOCK_C)
    m = tl.load(max_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    at = tl.load(at_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=2**31 - 1)
    tl.store(out_ptr + row, tl.min(tl.where(m == tl.max(m, axis=0), at, 2**31 - 1), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """The argmax of each row of [rows, V] logits (the first column among equal maxima, as `torch.argmax`): int64
    [rows]. A row of -inf gives 0. Two launches (chunks, then each row's best chunk) where Triton runs."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows takes [rows, V] logits with V > 0, got {tuple(logits.shape)}")
    if kernel_backend(logits.device, impl) == "torch" or logits.stride(-1) != 1:
        return logits.argmax(-1)
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    at = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _argmax_chunks_kernel[(rows, chunks)](logits, maxima, at, vocab, logits.stride(0), chunks, BLOCK=ARGMAX_CHUNK)
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
    assert torch.equal(argmax_rows(logits, impl="triton"), logits.float().argmax(-1)), (vocab, dtype)
assert argmax_rows(torch.zeros(0, 10), impl="triton").shape == (0,)
with pytest.raises(ValueError, match="argmax_rows takes"):
    argmax_rows(torch.zeros(3))

# %% [markdown]
# ## Matrix-vector products for small batches
#
# At batch 1 a decode step is four matrix-*vector* products per layer, and their time is the
# time to read the weights: 8 GB per token for Qwen3-4B, 1.92 ms at the H200's 4.19 TB/s.
# cuBLAS, asked for `x @ W.T` with one row, reaches about 65% of that (a CUDA graph of cuBLAS
# `F.linear` calls over all the weights: 2.95 ms). A GEMV needs no tensor cores; what it needs is every SM streaming weights from the
# first microsecond to the last: many independent programs, each owning `BLOCK_N` output rows,
# loading `BLOCK_K`-wide tiles of those rows as wide vector loads, multiplying by the (tiny,
# cached) input rows and keeping fp32 partial sums in registers; one reduction at the end.
# Up to `GEMV_MAX_ROWS` input rows share every weight tile (batch 2 and 4 read the weights
# once, not twice or four times).
#
# ```
#                      K (inputs) ──────────────────────────────────────────▶
#            ┌──────────┬──────────┬──────────┬──────────┬──────────┐
# program 0  │  tile    │  tile    │  tile    │  tile    │  tile    │  BLOCK_N rows of W
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤
# program 1  │          │          │          │          │          │  each program walks its rows
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤  left to right, BLOCK_K at a
#   ...      │          │          │          │          │          │  time, the fp32 partial sums
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤  staying in registers
# program    │          │          │          │          │          │
# N/BLOCK_N  └──────────┴──────────┴──────────┴──────────┴──────────┘
#               ▲ x[0:BLOCK_K] (1-4 rows, read from L2 by every program)
#   out[n] = Σ_k W[n, k] · x[k]: one reduction of the tile's columns at the end; no partials in memory
# ```
#
# Measured (`kernels_lab/gemv.py`, one H200, one CUDA-graph replay each, L2 flushed): with the
# best of 72 block configurations per shape, one row takes 15.9 / 13.0 / 35.5 / 22.3 / 185 µs
# for Qwen3-4B's qkv / o / gate_up / down / LM head against cuBLAS's 16.8 / 15.0 / 38.3 / 24.4 /
# 196 µs: 5-13% faster. At two and four rows this kernel was slower than cuBLAS, so the model
# uses it for one row only. The LM head (778 MB) runs at 4.2 TB/s either way; the small
# matrices (21-100 MB) are held back by the time it takes to get every SM streaming, not by
# the loads themselves.
#
# A matrix timed alone is not how decode runs it, though: a step runs each shape 36 times, one
# layer after another. `kernels_lab/gemv_chain_sweep.py` times 36 distinct matrices of one shape
# in one graph per configuration, and the gate-up projection's best tile there (4 rows x 512,
# 4 warps: 26.0 µs a matrix, 3.84 TB/s) beat the one chosen alone (29.4 µs).
#
# At one row the tile is 2-D, `[BLOCK_N, BLOCK_K]`, in the layout the weights are loaded in; the
# general `[ROWS, BLOCK_N, BLOCK_K]` product needs its operands moved into another layout, which
# the compiler does through shared memory on every step of the loop. (`kernels_lab/gemv_sass.py`
# compiles this kernel for an H200 on any machine, no GPU needed, and counts the instructions of
# its loop per weight: that is how these shuffles were found.)
#
# The same kernel reads **int8 weights** with one scale per output row (chapter 10): the tile is
# converted in registers and the scale applied to the finished sums. The conversion matters: at
# one row a GEMV does one multiply-add per weight, so at int8's 16 bytes per SM and cycle an SM
# has about 8 instructions per weight for everything. The GPU's int-to-float instruction runs at
# a quarter of the FMA rate, so `_as_f32` builds the float from its bits instead: 2^23 + byte is
# the float whose bits are 0x4B0000 followed by the byte, and subtracting 2^23 + 128 leaves the
# signed weight, exactly. Written in Triton that is a byte extract, an OR and a subtraction per
# weight, and the compiled loop came to 6.0 instructions per weight. Compiled for a GPU it is
# PTX instead, per 32-bit register of four weights (`_int8x4_to_f32`): one XOR flips the four sign
# bits, and one `prmt` (byte permute) per weight places its byte under the exponent: 4.1-4.5
# instructions per weight. The int8 loads are also kept to 8 bytes a thread, as x's 8 bf16 values,
# so that both tiles share one layout (16-byte int8 loads put them in two, and the compiler moved
# x between them through shared memory every step). In the chain lab the PTX conversion took the
# int8 GEMVs from 11.0 / 8.0 / 18.2 / 17.7 µs (qkv / o / gate-up / down) to 8.4 / 6.8 / 16.3 /
# 13.8 µs at the same tiles, and tiles chosen in the chain to 7.8 / 5.1 / 16.1 / 9.1 µs.
#
# The fixed cost per launch is the gap between kernels: each waits for the one before to finish
# completely before its programs start and request their first tiles. **Programmatic dependent
# launch** (Hopper) lets the GPU launch the next kernel while the current one is finishing: the
# kernels that come before a GEMV in a decode step (norms, SiLU-mul, attention) say early that
# the next one may start (`_let_next_start`), and the GEMV, launched as a dependent, waits
# (`gdc_wait`) before it reads its input row. Without Hopper both are no-ops. The small kernels
# between the GEMVs are launched the ordinary way: each starts only once the kernel before has
# finished. With `DEPENDENT_LAUNCHES` they are dependents too (they wait for their input the same
# way). Measured on an H200 (`kernels_lab/decode_overlap.py`: random:qwen3-4b, one sequence's
# decode step as a CUDA graph) with plain GEMVs it did not pay for BF16 (2.913 ms against 2.851) and
# gained 0.7% for int4 (2.353 against 2.370). With the GEMVs asking
# for their first weights before they wait (below) and the rows-layout gate-up: the BF16 step
# 2.458 ms against 2.548 / 2.543 without (W1-like 395.4 against 382.0 / 382.5 tok/s): on, for
# steps of at most `DEPENDENT_LAUNCH_MAX_ROWS` rows (the GEMV's steps, where it was measured; a
# decode kernel of 256 sequences launched early held SMs that the projection before it needed,
# with `DECODE_EARLY_TILE`).
#
# A GEMV's weights do not depend on the kernel before it, only its input row does. So a program
# that starts early can ask for its weight rows *before* it waits: one `cp.async.bulk.prefetch`
# a warp (Hopper's copy engine brings a span of bytes into L2, costing no registers and
# nothing to wait for), then `gdc_wait`, then the loop, which finds its tiles in L2. While a
# batch-1 decode attention runs on 8 of 132 SMs, the output projection's 1,280 programs can all be
# resident and have its 21 MB on the way. `gemv(..., prefetch=True)`. Measured, it loses: the
# BF16 decode step takes 3.326 ms with it against 2.851 (the GEMVs of the chain lab 1-8 µs
# slower each), the int4 step 2.476 against 2.370. Only int4 with the small kernels launched as
# dependents as well gains: 2.272 ms against 2.370 (BF16 with both: 3.298 against 2.818). Off
# (`GEMV_L2_PREFETCH`); a per-format choice would have to reach the small kernels too.
#
# Another way to keep more bytes in flight: a program of the qkv projection walks its rows in
# five steps of 512 inputs, and each step's loads wait for nothing but are issued only when the
# step before has used its own. `loop_stages` > 1 hands the loop to Triton's software pipeliner,
# which issues the loads of later steps (into shared memory, `LDGSTS` in the compiled code) while
# a step computes: 4.38 instructions a weight instead of 4.31 for BF16 (`kernels_lab/gemv_sass.py`).
# Measured: 2.883 ms at 3 stages against 2.851, and int4's chain 40-70% slower at 2-3 stages:
# `GEMV_LOOP_STAGES` keeps the loop as written.
#
# Tried and left in the lab (`kernels_lab/decode_chain.py`, one H200, 36 layers' matrices in one
# CUDA graph): folding the residual add + RMSNorm into the qkv and gate-up GEMVs and SiLU-mul
# into down (three launches fewer a layer). Every program redoes the norm of the whole input row,
# and that work cost more than the launches it saved (3.05 ms vs 2.79 ms for the chain); with the
# best tile sizes it gained 4%, and a mismatch on the GPU for rows not a multiple of the tile was
# not found in time, so it is not shipped. Software double-buffering of the weight tiles made the
# chain 22% slower (2.79 vs 2.29 ms): the loop below loads one tile per step.
#
# Both tried again in the engine's decode step (`kernels_lab/decode_overlap.py`).
# The norm without a pass of its own — each program adds the residual, multiplies by the norm
# weight and sums the squares as it reads its steps, the 1/rms scaling each output at the end —
# and SiLU-mul read by the down GEMV from the gate-up output: 3.122 ms against 2.811 with the
# separate launches (int8: 2.222 against 2.089). 109 launches fewer, but each of the thousands of
# GEMV programs reads the residual and the norm weight (or the up half) next to its weights, and
# the GEMVs went from 17.4 to 31 µs on average. The loop unrolled with the next step's weights
# in registers and the first step's loaded before `gdc_wait`: 2.852 ms against 2.814; int8 3.218
# against 2.114 (the unrolled code moves the int8 tiles through shared memory to change layout).
#
# One fold that does not cost the GEMV any reads: SwiGLU's `silu(gate) * up` needs, for output
# `i`, rows `i` and `I + i` of the gate-up matrix, and nothing else. With `swiglu=True` a program
# takes `BLOCK_N / 2` gate rows and their up rows in one tile (the same bytes and programs as
# before), and its epilogue writes the activation instead of the two halves: no `silu_mul`
# launch, and the down projection reads half as many numbers. The rounding follows the two
# launches it replaces step by step (the GEMV's bf16 store, then SiLU rounded like `F.silu`), so
# the bits are theirs (tested below). The compiled loop is the plain one's (`kernels_lab/gemv_sass.py`:
# 4.75 instructions a weight for bf16, 4.14 for int8, with or without). Measured (H200,
# `kernels_lab/decode_overlap.py bf16,int8,int4`): the Qwen3-4B step 2.631 ms against 2.706 (W1-like
# 365.7 against 356.0 tok/s), int8 1.901 against 1.987; int4, whose gate-up keeps `silu_mul`, 2.259
# against 2.268 (the control). On.
#
# The same idea in two smaller pieces, measured one at a time:
#
# - The residual add in the epilogue of the GEMV before it (o, down) and the norm in the GEMV
#   after it (each program multiplies x by the norm weight as it loads it, sums x² on the side,
#   scales by 1/rms at the end: one 16-byte load more a step): 72 launches fewer, yet the chain
#   of a step's layers (`kernels_lab/gemv_norm_fold.py` at commit e52c29f, one H200) only went
#   from 2,119.6 to 2,090.3 µs for BF16 and from 1,477.5 to **1,495.3** for int8. The add+RMSNorm
#   kernels cost 1.9 µs each in the step's timeline, but they run while the next GEMV's programs
#   are launched and waiting: removing them takes off little more than their 0.4 µs gaps. Not kept.
# - **The first step's weights asked for before `gdc_wait`** (`early_weights`, `EARLY_W`): the
#   weights do not depend on the kernel before, so each program issues its first tile's loads,
#   then waits for x. The loop is unchanged (the first step is peeled). Chain lab
#   (`kernels_lab/gemv_chain_sweep.py`, µs a matrix, export → early): BF16 qkv 9.64 → 9.38, o
#   7.28 → 6.46, gate-up 26.14 → 25.68, down 14.70 → 13.93; int8 qkv 7.76 → 7.14, gate-up
#   16.13 → 15.10, but o 5.08 → 5.47 and down 9.13 → 11.24 (those long-row tiles go from 96 to 114
#   registers a thread). In the decode step (`kernels_lab/decode_overlap.py`): BF16 2.608 ms
#   against 2.666 / 2.655 with every GEMV early (W1-like 374.8 against 367.1 / 368.6 tok/s), 2.652
#   with o and down only; int8 with every GEMV early 1.972 against 1.925 / 1.931. So: on for BF16.
#   Why int8 lost: with the peeled step's inputs written as a plain `0 + offs_k`
#   the compiler gave that step 16-byte int8 loads, the loop 8-byte ones, and moved every later
#   step's [BLOCK_N, BLOCK_K] tile through shared memory into the first one's layout (8-16
#   `BAR.SYNC` + `STS` + `LDS` a step in `kernels_lab/gemv_sass.py`; 114 registers for the o /
#   down tiles). Written as the loop's steps are, `k0 + offs_k` with a k0 the compiler cannot see
#   is 0 (`tl.program_id(1) * BLOCK_K`), the loop compiles as without early weights (int8 4x1024:
#   144 instructions, 56 registers, no shared memory; 4x2048: 96 registers). Then early weights
#   for every int8 GEMV: the int8 step 1.742 ms against 1.778 / 1.780 (W1-like 551.0 against 540.0
#   / 539.2 tok/s; `kernels_lab/decode_overlap.py bf16,int8`, one H200). On for all.
#   (Also tried: each step's weights asked for while the step before computes, two
#   steps' tiles held in registers, lost badly: BF16 2.509 ms against 2.410, int8 2.486 against
#   1.778; the int8 norm fold, now free of the shared-memory trips, still lost: 1.818 ms.)
#
# **The rows layout** (`_gemv_rows_kernel`, `layout="rows"`), chapter 10's int4 GEMV
# layout for BF16 and int8. `_gemv_kernel` leaves the placement of its `[BLOCK_N, BLOCK_K]` tile
# on threads to Triton. Here it is explicit: a program's `BLOCK_N` rows are a tuple of tensors
# `[SLABS, 32, CHUNK]`, so each thread takes the *same* CHUNK inputs (16 bytes) of every row of
# the program, each warp a slab of K. x's chunk is loaded and converted once for all the rows,
# and a thread has every row's 16-byte load in flight at once. Chain lab (`kernels_lab/gemv_rows.py`,
# one H200, µs a matrix, tile → best rows): BF16 gate-up 25.69 → **23.91** (4.17 TB/s, 4 rows,
# 2 warps, 8 inputs), but qkv 9.43 → 9.70, o 6.48 → 7.90, down 13.94 → 16.61; int8 qkv 7.06 →
# 6.31, gate-up 15.13 → 14.71, o and down slower (with the lab's own byte conversion, not this
# chapter's). So `gemv_layout` picks it for the BF16 gate-up shape only, and its SwiGLU epilogue
# pairs each gate row with its up row as `_gemv_kernel`'s does.
#
# **The add + RMSNorm folded in, a third time** (`norm`, `residual`, `FUSED_NORM_GEMV`).
# With every other launch of the step now a programmatic dependent, the 73 one-program
# add+RMSNorm kernels were among the few left between GEMVs. `gemv(x, w, norm=g, eps=...)`
# multiplies x by the norm weight as it loads it and sums x² on the side (`_normed_x`); the
# program, which reads all of x anyway, scales its sums by 1/rms at the end (`_norm_scale`).
# `residual=r` adds r to the output in the epilogue, rounded as the separate add would find it
# (the bits of the GEMV followed by `add_rmsnorm`'s add: tested below). Chapter 09a then runs a
# batch-1 layer as four launches: qkv(norm(x)), attention, x + o(·), gate-up(norm(·)) with
# SiLU-mul, h + down(·). The norm's arithmetic differs from `rmsnorm` followed by the GEMV (x·g
# is never rounded to bf16), so logits agree within bf16, not bit for bit (tests/test_gpu.py).
# Measured (`kernels_lab/decode_overlap.py`, one H200): the BF16 step 2.451 / 2.448 ms against
# 2.464 unfolded, and 2.438 / 2.439 against 2.455 in a second call; int8 **1.842** against 1.795
# (its (4, 1024) tiles share each x value among only 4 rows: the extra load and multiply per x
# value cost more than the launches; the compiled loop 4.53 → 5.47 instructions a weight,
# against bf16's 4.31 → 4.78 in `kernels_lab/gemv_sass.py`). So `gemv_folds_norms`: 2-byte
# weights only. With RoPE's angles in three launches instead of eleven (chapter 03) the W1
# bench went from 394.8 to **402.9 tok/s**.
#
# Also tried: int8 through this rows kernel with `kernels_lab/gemv_rows.py`'s conversion (the byte
# under 2^15's exponent, 2^15 + 128 + w with one permute and no subtraction; the program takes
# 32,896 · Σx off each row's step sum, x's sum shared by the rows). Compiled: the qkv loop's
# FADDs 100 → 50. The chain lab had it faster (qkv 7.10 → 6.29 µs), but the decode step was
# slower: 1.815-1.817 ms against 1.778-1.780 with the tile kernel, for qkv alone too. Not kept
# (commit 92c7b73 has it, as the switch `GEMV_INT8_OFFSET`); `kernels_lab/gemv_rows.py` keeps
# the conversion.
#
# **int8's gate-up through the rows kernel**, with this chapter's conversion. Nsight
# Compute (`kernels_lab/ncu_gemv.py`) shows the int8 tile GEMVs at 96 registers a thread (the
# `[BLOCK_N, BLOCK_K]` accumulator tile: 64 sums a thread at 8 × 512 over 2 warps), 20 warps an
# SM, about 5 of every 8.4 cycles between a warp's instructions waiting on memory. Yet neither
# fewer instructions nor more warps made them faster. int8 read as 2^15 + 128 + w by one byte
# permute, x's sum taken off at the end: the loop 4.1-4.5 → 3.3-3.8 instructions a weight but
# 121-128 registers; o 4.63 → 5.47 µs, gate-up 15.14 → 17.22, the step 1.955 ms against 1.699.
# Each thread summing its 8 inputs every step (a `[BLOCK_N, BLOCK_K / 8]` tile of sums): 40
# registers, 48-50 warps an SM, 0.12 instructions a weight more; o 4.61 → 6.04 µs, the step 1.907
# against 1.679. The norm folded into int8's qkv and gate-up with the tiles its own sweep chose
# (8 × 512, 4 × 512): the step 1.731 against 1.699. Commits aed4513 (`GEMV_INT8_OFFSET`,
# `FUSED_NORM_GEMV_INT8`) and f361c9d (`GEMV_STEP_SUMS`) have them. What did win: the rows
# kernel (one sum per row a thread, every row's loads in flight at once) for the gate-up shape.
# The chain lab's rows grid (`gemv_chain_sweep.py`, `LAB_ROWS=1`): gate-up 14.22 µs at 8 rows, 2
# warps, 8 bytes against the tile's 15.16; qkv 6.98 against 7.07; o and down slower. In the step
# (`decode_overlap.py`) gate-up alone won, 1.679 ms against 1.702 (W1-like 570.3 against 563.7
# tok/s); qkv with it lost (1.708), o and down with a whole row a step lost more (1.796). So
# `GEMV_ROWS_INT8_MIN_N` takes the gate-up shape only.

# %%
#| export
GEMV_MAX_ROWS = 4  # the kernel's limit; the model sends it one row (see above)
FUSED_SWIGLU = True  # the gate-up GEMV applies SiLU-mul in its epilogue (`swiglu`): no silu_mul launch, measured faster


FUSED_NORM_GEMV = True  # a decode step's add + RMSNorm folded into the BF16 GEMVs around it (`norm`, `residual`; below)


def gemv_folds_norms(weight: torch.Tensor) -> bool:
    """Whether a decode step folds its add + RMSNorm into the GEMVs of `weight`'s format: FUSED_NORM_GEMV (read at
    each call: a lab may switch it between captures), for 2-byte weights (int8's tiles measured slower with it)."""
    return FUSED_NORM_GEMV and weight.element_size() == 2


NORM_HANDOFF = True  # int8, int4: each norm of a decode step handed from the GEMV adding the residual to the next


def gemv_hands_off_norms(weight: torch.Tensor) -> bool:
    """Whether a decode step hands its norms between the GEMVs of `weight`'s format instead (`gemv`'s `hand_off` and
    `norm_sums`): NORM_HANDOFF (read at each call, as FUSED_NORM_GEMV), for 1-byte weights (int8; chapter 10's int4,
    two to a byte, in its own GEMV)."""
    return NORM_HANDOFF and weight.element_size() == 1


GEMV_ROWS_LAYOUT = True  # `_gemv_rows_kernel` where `gemv_layout` says it was measured faster (off: `_gemv_kernel` always)
GEMV_ROWS_MAX_N = 65536  # ... for fewer rows than this: the LM head (151,936 rows) keeps the tile kernel
GEMV_ROWS_INT8_MIN_N = 16384  # int8 short rows (k < 4096) through the rows kernel from this many outputs on (gate-up)


def gemv_layout(n: int, k: int, weight_bytes: int = 2) -> str:
    """The GEMV kernel for an [n, k] weight at one input row: 'rows' (`_gemv_rows_kernel`, below) for the gate-up
    shape in BF16 and int8 (int8 from GEMV_ROWS_INT8_MIN_N outputs on), where the chain lab and the decode step
    measured it faster, else 'tile' (`_gemv_kernel`)."""
    if GEMV_ROWS_LAYOUT and n < GEMV_ROWS_MAX_N and k < 4096 and (
            (weight_bytes == 2 and 16384 <= n and 512 <= k) or (weight_bytes == 1 and GEMV_ROWS_INT8_MIN_N <= n)):
        return "rows"
    return "tile"


def gemv_config(n: int, k: int, weight_bytes: int = 2, layout: str | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight of 2-byte or 1-byte (int8) elements in `layout` (default
    `gemv_layout`'s): the sweeps' winners as a rule (kernels_lab/gemv_chain_sweep.py and gemv_rows.py: 36 matrices of
    a shape in one graph; the LM head from kernels_lab/gemv.py)."""
    if (layout or gemv_layout(n, k, weight_bytes)) == "rows":
        if weight_bytes == 1:  # int8: 8 rows, 8 bytes of each a thread and step, 2 warps; fewer outputs 2, 16 bytes, 1
            return (8, 512, 2) if n >= 16384 else (2, 512, 1)
        return 4, 2 * 32 * 16 // weight_bytes, 2  # 4 rows, 16 bytes of each a thread and step, 2 warps
    if weight_bytes == 1 and n < 65536:  # int8 (its LM head takes BF16's tile: the decode step's sweep)
        return (4, 2048, 4) if k >= 4096 else ((4, 1024, 4) if n < 16384 else (8, 512, 2))
    if k >= 4096:  # long rows (o, down): wide K tiles, few rows a program
        return 2, 1024, 4
    if n < 16384:  # qkv
        return 8, 512, 4
    return (4, 512, 4) if n < 65536 else (4, 512, 2)  # gate-up; the LM head


@triton.jit
def _int8x4_to_f32(w):
    "int8 -> fp32 on an NVIDIA GPU, four weights a register: w + 128 (XOR of the sign bits) placed under 2^23's exponent."
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u;
        xor.b32 u, $4, 0x80808080;
        prmt.b32 $0, u, 0x4B000000, 0x7440;
        prmt.b32 $1, u, 0x4B000000, 0x7441;
        prmt.b32 $2, u, 0x4B000000, 0x7442;
        prmt.b32 $3, u, 0x4B000000, 0x7443;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
        }""", constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _as_f32(w, BYTE_ASM: tl.constexpr):
    "A weight tile in fp32. int8 through the float's bits (2^23 + byte), not the int->float unit: that runs at a quarter rate."
    if w.dtype == tl.int8:
        if BYTE_ASM:  # compiled for the GPU (the interpreter runs no PTX)
            return _int8x4_to_f32(w)
        bits = (w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80) | 0x4B000000  # 2^23 + (w + 128), exactly
        return bits.to(tl.float32, bitcast=True) - 8388736.0  # - (2^23 + 128)
    return w.to(tl.float32)


@triton.jit
def _prefetch_to_l2(w_ptr, first_row, rows, row_bytes, THREADS: tl.constexpr):
    """Ask for `rows` rows of a row-major matrix from `first_row` on (`row_bytes` a row, a multiple of 16) to come into
    L2 now: one bulk prefetch (sm_90's cp.async.bulk.prefetch) a warp of the program's THREADS; no registers, nothing
    to wait for. The instruction takes warp-uniform operands (the compiler loops over distinct lane values), so
    every lane of a warp asks for that warp's part."""
    total = rows.to(tl.int64) * row_bytes
    part = tl.cdiv(total, THREADS // 32 * 16) * 16
    offs = (tl.arange(0, THREADS) // 32).to(tl.int64) * part  # thread i: lane i % 32 of warp i // 32
    sizes = tl.minimum(tl.maximum(total - offs, 0), part).to(tl.int32)
    starts = w_ptr.to(tl.pointer_type(tl.int8)) + first_row.to(tl.int64) * row_bytes + offs
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[starts, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _start_gemv(w_ptr, N, row_bytes, BLOCK_N: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                WAIT: tl.constexpr, SWIGLU: tl.constexpr = False):
    """A GEMV program's start. Launched as a dependent (PDL): let the next kernel launch, then (WAIT) wait for this
    one's input. With PREFETCH (threads a program; 0: off), first ask for the program's weight rows into L2: they do
    not depend on the kernel before, so their reading starts while that kernel is still running. (SWIGLU: the rows
    are BLOCK_N / 2 gate rows and their up rows, N / 2 further on: two runs.)"""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            if SWIGLU:
                first = tl.program_id(0) * (BLOCK_N // 2)
                rows = tl.minimum(N // 2 - first, BLOCK_N // 2)
                _prefetch_to_l2(w_ptr, first, rows, row_bytes, PREFETCH)
                _prefetch_to_l2(w_ptr, N // 2 + first, rows, row_bytes, PREFETCH)
            else:
                first = tl.program_id(0) * BLOCK_N
                _prefetch_to_l2(w_ptr, first, tl.minimum(N - first, BLOCK_N), row_bytes, PREFETCH)
        if WAIT:
            tl.extra.cuda.gdc_wait()


@triton.jit
def _normed_x(x, sq, g_ptr, at, ok, NORM: tl.constexpr):
    """A GEMV step's inputs x (fp32) as the matmul takes them. With NORM (an RMSNorm folded in): x's squares added to
    `sq`, and x times the norm's weight at inputs `at`; the norm's 1 / rms scales the outputs at the end."""
    if NORM:
        sq += x * x
        x = x * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _norm_scale(sq, K, eps):
    "1 / rms of x from its summed squares (`_normed_x`), as `_add_rmsnorm_kernel` computes it."
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def _gemv_step(acc, sq, x_rows, w_rows, g_ptr, k, K, m_ok, n_ok, EVEN_K: tl.constexpr, ROWS: tl.constexpr,
               BYTE_ASM: tl.constexpr, NORM: tl.constexpr, w=None):
    """(acc + one step of the GEMV, sq): inputs k of x's rows and of the weight rows (`w`: that tile, already loaded);
    `sq`, `g_ptr`, NORM: `_normed_x`."""
    if EVEN_K:
        if w is None:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
    else:
        if w is None:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
    x, sq = _normed_x(x.to(tl.float32), sq, g_ptr, k[None, :], (k < K)[None, :] | EVEN_K, NORM)
    if ROWS == 1:
        acc += x * _as_f32(w, BYTE_ASM)  # x [1, BLOCK_K] broadcast over the rows of w
    else:
        acc += x[:, None, :] * _as_f32(w, BYTE_ASM)[None, :, :]
    return acc, sq


@triton.jit
def _step_inputs(w_ptr, k0, offs_k):
    "The inputs of a GEMV step from k0; int8 weights: loaded 8 bytes at a time, as x's 8 bf16 (both share one layout)."
    k = k0 + offs_k
    return tl.max_contiguous(k, 8) if w_ptr.dtype.element_ty == tl.int8 else k


@triton.jit
def _tile_constants(scale_ptr, b_ptr, next_g_ptr, offs_n, n_ok, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAND_OFF: tl.constexpr):
    """A tile GEMV's epilogue constants, fp32 [BLOCK_N]: its rows' scales, biases and (HAND_OFF) the next norm's
    weights (zeros where there are none: unused, compiled away)."""
    none = tl.zeros([BLOCK_N], dtype=tl.float32)
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_SCALE else none
    bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_BIAS else none
    next_g = tl.load(next_g_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAND_OFF else none
    return scale, bias, next_g


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, b_ptr, g_ptr, res_ptr, out_ptr, sums_ptr, next_g_ptr, normed_ptr, M, N, K,
                 stride_xm, stride_wn, stride_rm, stride_om, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr, BYTE_ASM: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
                 SWIGLU: tl.constexpr, EARLY_W: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                 NORM_SUMS: tl.constexpr, HAND_OFF: tl.constexpr):
    _start_gemv(w_ptr, N, stride_wn * w_ptr.dtype.element_ty.primitive_bitwidth // 8, BLOCK_N, PDL, PREFETCH,
                not EARLY_W, SWIGLU)
    if SWIGLU:  # rows [gate | up] of the gate-up matrix: a program takes BLOCK_N / 2 gate rows and their up rows
        lane = tl.arange(0, BLOCK_N)
        cols = tl.program_id(0) * (BLOCK_N // 2) + lane % (BLOCK_N // 2)  # the output columns (of N / 2)
        offs_n, n_ok = cols + (lane // (BLOCK_N // 2)) * (N // 2), cols < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m, offs_k = tl.arange(0, ROWS), tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    out_ok = m_ok[:, None] & n_ok[None, :]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # the LM head has 389M elements: int64 offsets
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # one row (decode): a 2-D tile in the weights' own layout; more rows: [ROWS, BLOCK_N, BLOCK_K] (its layout
    # differs from the loads', which costs a trip through shared memory per step)
    acc = tl.zeros((BLOCK_N, BLOCK_K) if ROWS == 1 else (ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)  # NORM: x's squares (unused, and compiled away, without)
    first = 0
    if EARLY_W:  # the first step's weights asked for before waiting for x: they do not depend on the kernel before
        # (step 0's inputs in the form of the loop's, k0 + offs_k, k0 unknown to the compiler: with a plain 0 it gave
        # int8 16-byte loads and moved every later step's tile through shared memory into that layout)
        k = _step_inputs(w_ptr, tl.program_id(1) * BLOCK_K, offs_k)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] if EVEN_K else n_ok[:, None] & (k < K)[None, :], other=0)
        _wait_for_previous(PDL)
        acc, sq = _gemv_step(acc, sq, x_rows, w_rows, g_ptr, k, K, m_ok, n_ok, EVEN_K, ROWS, BYTE_ASM, NORM, w)
        first = BLOCK_K
    if NORM_SUMS:  # x came normalised but for its 1 / rms; its squares, summed by the GEMV before (HAND_OFF): asked
        handed = tl.load(sums_ptr + offs_m, mask=m_ok, other=0.0)  # for once x is there, used at the end
    for k0 in tl.range(first, K, BLOCK_K, num_stages=LOOP_STAGES):  # > 1: Triton's pipeliner loads steps ahead
        acc, sq = _gemv_step(acc, sq, x_rows, w_rows, g_ptr, _step_inputs(w_ptr, k0, offs_k), K, m_ok, n_ok, EVEN_K,
                             ROWS, BYTE_ASM, NORM)
    # the epilogue's operands, asked for together: one wait for all of them (asked for before the loop they hold
    # registers through it, and some GEMVs then fit fewer programs an SM: measured slower)
    scale, bias, next_g = _tile_constants(scale_ptr, b_ptr, next_g_ptr, offs_n, n_ok, BLOCK_N, HAS_SCALE, HAS_BIAS,
                                          HAND_OFF)
    if RESIDUAL:
        residual = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0)
    out = tl.sum(acc, axis=1)[None, :] if ROWS == 1 else tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if NORM:
        out *= _norm_scale(tl.sum(sq, axis=1), K, eps)[:, None]
    if NORM_SUMS:
        out *= _norm_scale(handed, K, eps)[:, None]
    if HAS_SCALE:
        out *= scale[None, :]
    if HAS_BIAS:
        out += bias[None, :]
    if SWIGLU:  # silu(gate) * up, rounded at each step as the GEMV's stores and `_silu_mul_kernel` round them
        half: tl.constexpr = BLOCK_N // 2
        h = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(h, [ROWS, 2, half]), [0, 2, 1]))  # [ROWS, half] each
        cols = tl.program_id(0) * half + tl.arange(0, half)
        tl.store(out_ptr + offs_m[:, None] * stride_om + cols[None, :], _silu_times(gate, up, out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (cols < N // 2)[None, :])
    else:
        if RESIDUAL:  # added to the output as rounded (as a separate add after the GEMV's store would)
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=out_ok)
        if HAND_OFF:  # the next RMSNorm's work but its 1 / rms: h (as stored) x the norm's weight, and h's squares,
            h = out.to(out_ptr.dtype.element_ty).to(tl.float32)  # summed over the programs into sums_ptr
            tl.store(normed_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     (h * next_g[None, :]).to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_add(sums_ptr + offs_m, tl.sum(tl.where(out_ok, h * h, 0.0), axis=1), mask=m_ok, sem="relaxed")


@triton.jit
def _program_row(first_col, r, N, HALF_N: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight row of a rows-layout program's r-th row, and whether it exists: with SWIGLU, HALF_N gate rows, then
    their up rows (N // 2 further on). (Chapter 10's int4 GEMV takes the same rows.)"""
    if SWIGLU:
        col = first_col + r % HALF_N
        return col + (r // HALF_N) * (N // 2), col < N // 2
    return first_col + r, first_col + r < N


@triton.jit
def _rows_chunk(k0, lane, K, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """A step's inputs in a rows-layout program: each thread's CHUNK from k0 + lane * CHUNK on ([SLABS, 32, CHUNK]
    offsets), and which exist."""
    at = tl.multiple_of(k0 + lane * CHUNK, [CHUNK, CHUNK])[:, :, None] + tl.arange(0, CHUNK)[None, None, :]
    return at, (at < K) | EVEN


@triton.jit
def _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N: tl.constexpr):
    """One step's weights: for each of the program's rows (`rows`: their offsets), this thread's inputs `at`; every
    row's loads in flight at once."""
    ws = ()
    for r in tl.static_range(BLOCK_N):
        ws = ws + (tl.load(w_ptr + rows[r] + at, mask=ok & row_ok[r], other=0),)
    return ws


@triton.jit
def _rows_step(accs, sq, ws, x_ptr, g_ptr, at, ok, BLOCK_N: tl.constexpr, BYTE_ASM: tl.constexpr, NORM: tl.constexpr):
    """(accs + one step, sq): x's inputs `at` (loaded and converted once for every row) times each row's weights `ws`;
    `sq`, `g_ptr`, NORM: `_normed_x`."""
    x, sq = _normed_x(tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32), sq, g_ptr, at, ok, NORM)
    new = ()
    for r in tl.static_range(BLOCK_N):
        new = new + (accs[r] + tl.sum(x * _as_f32(ws[r], BYTE_ASM), axis=2),)
    return new, sq


@triton.jit
def _rows_constants(scale_ptr, b_ptr, first_col, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    "A rows-layout program's epilogue constants, fp32: (each row's scale, each row's bias), each () where there are none."
    scales, biases = (), ()
    for r in tl.static_range(BLOCK_N):
        row, real = _program_row(first_col, r, N, BLOCK_N // 2, SWIGLU)
        if HAS_SCALE:
            scales = scales + (tl.load(scale_ptr + row, mask=real, other=0.0).to(tl.float32),)
        if HAS_BIAS:
            biases = biases + (tl.load(b_ptr + row, mask=real, other=0.0).to(tl.float32),)
    return scales, biases


@triton.jit
def _rows_epilogue_operands(res_ptr, next_g_ptr, first_col, M, N, stride_rm, ROWS: tl.constexpr,
                            BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr, HAND_OFF: tl.constexpr):
    """A rows-layout program's epilogue operands, fp32 (no SwiGLU): the residual at each (row r, x row m),
    r * ROWS + m, and (HAND_OFF) the next norm's weight at each row r. (Chapter 10's int4 GEMV's too.)"""
    residuals, next_gs = (), ()
    for r in tl.static_range(BLOCK_N):
        row = first_col + r
        if HAND_OFF:
            next_gs = next_gs + (tl.load(next_g_ptr + row, mask=row < N, other=0.0).to(tl.float32),)
        for m in tl.static_range(ROWS if RESIDUAL else 0):
            residuals = residuals + (tl.load(res_ptr + m * stride_rm + row, mask=(row < N) & (m < M), other=0.0)
                                     .to(tl.float32),)
    return residuals, next_gs


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, scale_ptr, b_ptr, g_ptr, res_ptr, out_ptr, sums_ptr, N, K, stride_wn, eps,
                      BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SLABS: tl.constexpr, EVEN: tl.constexpr,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BYTE_ASM: tl.constexpr,
                      SWIGLU: tl.constexpr, EARLY_W: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                      NORM_SUMS: tl.constexpr):
    _start_gemv(w_ptr, N, 0, BLOCK_N, PDL, 0, not EARLY_W)
    STEP: tl.constexpr = SLABS * 32 * CHUNK  # inputs of a row per step: a slab of 32 x CHUNK per warp
    HALF_N: tl.constexpr = BLOCK_N // 2
    lane = tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [SLABS, 32]: a thread's place in a step
    first_col = tl.program_id(0) * (HALF_N if SWIGLU else BLOCK_N)  # the program's first output column
    rows, row_ok = (), ()
    for r in tl.static_range(BLOCK_N):
        row, real = _program_row(first_col, r, N, HALF_N, SWIGLU)
        rows, row_ok = rows + (row.to(tl.int64) * stride_wn,), row_ok + (real | EVEN,)
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * BLOCK_N
    sq = tl.zeros((SLABS, 32, CHUNK), dtype=tl.float32)  # NORM: x's squares
    first = 0
    if EARLY_W:  # the first step's weights asked for before waiting for x (as `_gemv_kernel`)
        at, ok = _rows_chunk(0, lane, K, CHUNK, EVEN)
        ws = _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N)
        _wait_for_previous(PDL)
        accs, sq = _rows_step(accs, sq, ws, x_ptr, g_ptr, at, ok, BLOCK_N, BYTE_ASM, NORM)
        first = STEP
    if NORM_SUMS:  # (as `_gemv_kernel`'s)
        handed = tl.load(sums_ptr)
    for k0 in tl.range(first, K, STEP):
        at, ok = _rows_chunk(k0, lane, K, CHUNK, EVEN)
        accs, sq = _rows_step(accs, sq, _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N), x_ptr, g_ptr, at, ok,
                              BLOCK_N, BYTE_ASM, NORM)
    scales, biases = _rows_constants(scale_ptr, b_ptr, first_col, N, BLOCK_N, SWIGLU, HAS_SCALE, HAS_BIAS)  # together
    if RESIDUAL:  # (as `_gemv_kernel`'s)
        residuals = _rows_epilogue_operands(res_ptr, res_ptr, first_col, 1, N, 0, 1, BLOCK_N, True, False)[0]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    rstd = _norm_scale(tl.sum(tl.sum(tl.sum(sq, axis=2), axis=1), axis=0), K, eps)  # (NORM only)
    if NORM_SUMS:
        rstd = _norm_scale(handed, K, eps)
    outs = ()
    for r in tl.static_range(BLOCK_N):
        total = tl.sum(tl.sum(accs[r], axis=1), axis=0)
        if NORM or NORM_SUMS:
            total *= rstd
        if HAS_SCALE:
            total *= scales[r]
        if HAS_BIAS:
            total += biases[r]
        outs = outs + (total,)
    for r in tl.static_range(HALF_N if SWIGLU else BLOCK_N):
        row, real = _program_row(first_col, r, N, HALF_N, SWIGLU)
        if SWIGLU:  # silu(gate) * up, rounded as `_gemv_kernel`'s epilogue rounds them
            gate, up = outs[r].to(dtype).to(tl.float32), outs[r + HALF_N].to(dtype).to(tl.float32)
            tl.store(out_ptr + row, _silu_times(gate, up, dtype), mask=real)
        elif RESIDUAL:  # added as rounded, as `_gemv_kernel`'s
            tl.store(out_ptr + row, (outs[r].to(dtype).to(tl.float32) + residuals[r]).to(dtype), mask=real)
        else:
            tl.store(out_ptr + row, outs[r].to(dtype), mask=real)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias=None, scale=None) -> torch.Tensor:
    "PyTorch: `F.linear`, the weight converted to x's dtype and each output scaled where it is int8."
    out = F.linear(x, weight.to(x.dtype))
    if scale is not None: out = out * scale.to(x.dtype)
    return out if bias is None else out + bias


GEMV_L2_PREFETCH = False  # measured on an H200: the decode step slower (see above)
GEMV_LOOP_STAGES = 1  # the loop as written; 2-4: later steps' loads in flight through shared memory (measured: no gain)


def gemv_prefetch(weight: torch.Tensor, pdl: bool, num_warps: int, prefetch: bool | None = None) -> int:
    """The GEMV kernels' PREFETCH: a bulk prefetch a warp (`_start_gemv`) where asked (default GEMV_L2_PREFETCH),
    launched as a dependent, and the weight rows are contiguous and start 16-byte aligned; else 0 (off)."""
    if not (pdl and (GEMV_L2_PREFETCH if prefetch is None else prefetch)):
        return 0  # (every GEMV launch asks: the common answer first, before any look at the weight)
    aligned = weight.is_contiguous() and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
    return 32 * num_warps if aligned else 0  # the program's threads


GEMV_EARLY_WEIGHTS = True  # a program's first weights asked for before it waits for x (measured faster: see below)


def gemv_loop_stages(loop_stages: int | None = None) -> int:
    "The GEMV kernels' LOOP_STAGES: `loop_stages`, else GEMV_LOOP_STAGES (read at each launch: a lab may switch it)."
    if loop_stages is not None and loop_stages < 1:
        raise ValueError(f"loop_stages is how many steps of the GEMV loop are in flight: 1 or more, got {loop_stages}")
    return loop_stages or GEMV_LOOP_STAGES


def hand_off_operands(out: torch.Tensor, norm_sums: torch.Tensor | None, hand_off: tuple | None,
                      unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMV launch's (sums, next norm's weight, normed output) for its folds `norm_sums` / `hand_off` (the normed
    output new, shaped as `out`); `unused` in the places the launch does not read (also chapter 10's int4 GEMV)."""
    if hand_off is None:
        return (unused if norm_sums is None else norm_sums), unused, unused
    return hand_off[1], hand_off[0], torch.empty_like(out)


def check_gemv_folds(kernel: str, x: torch.Tensor, n: int, swiglu: bool, residual: torch.Tensor | None,
                     norm_sums: torch.Tensor | None, hand_off: tuple | None):
    """Raise a ValueError naming `kernel` where a GEMV's epilogue folds (`gemv`'s `residual`, `norm_sums`, `hand_off`,
    also chapter 10's int4 GEMV's) do not fit x [M, K] and N outputs."""
    m = x.shape[0]
    if residual is not None and (swiglu or residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"{kernel}'s residual must be [{m}, {n}] with unit stride in its last dimension (and no "
                         f"swiglu), got {tuple(residual.shape)}")
    for name, sums in (("norm_sums", norm_sums), ("hand_off's sums", None if hand_off is None else hand_off[1])):
        if sums is not None and (sums.dtype != torch.float32 or sums.shape != (m,) or sums.device != x.device):
            raise ValueError(f"{kernel}'s {name} must be float32 [{m}] on {x.device}, got {sums.dtype} "
                             f"{tuple(sums.shape)} on {sums.device}")
    if hand_off is not None and (residual is None or hand_off[0].shape != (n,)):
        raise ValueError(f"{kernel}'s hand_off needs a residual and a norm weight [{n}], got "
                         f"{'no residual' if residual is None else 'a residual'} and {tuple(hand_off[0].shape)}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
         impl: str = "auto", block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, pdl: bool | None = None, byte_asm: bool | None = None,
         prefetch: bool | None = None, loop_stages: int | None = None, swiglu: bool = False,
         out: torch.Tensor | None = None, early_weights: bool | None = None, layout: str | None = None,
         norm: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
         norm_sums: torch.Tensor | None = None, hand_off: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x [M, K] (M <= GEMV_MAX_ROWS) @ weight [N, K].T (x scale[N] for int8 weights) (+ bias) -> [M, N], written into
    `out` where given (contiguous, x's dtype: chapter 09c's all-reduce buffer), else into a new tensor.
    `norm`: an RMSNorm's weight [K]: x is normalised first (`rmsnorm(x, norm, eps)`), inside the GEMV.
    `residual` [M, N]: added to the result (rounded to x's dtype first, as a separate add would find it).
    `hand_off` (with `residual`): (an RMSNorm's weight g [N], sums [M] float32): the norm that follows, handed to the
    GEMV after: returns (h, h x g) for h the result, h's squares added to `sums` (which must start at 0).
    `norm_sums` [M] float32: x is such an h x g, and these its h's squares: x is normalised (x 1 / rms) in the GEMV.
    `swiglu`: weight is a gate-up matrix [gate | up] (N = 2I): -> silu(gate) * up [M, I], in the GEMV's epilogue
    with FUSED_SWIGLU, else by `silu_mul` after it.
    `byte_asm`: int8 converted by `_int8x4_to_f32`'s PTX (default: whenever compiled, not interpreted).
    `prefetch`: each program asks for its weights into L2 before it waits for x (`gemv_prefetch`).
    `loop_stages`: the K loop software-pipelined this many steps deep (default GEMV_LOOP_STAGES).
    `early_weights`: launched as a dependent, each program asks for its first step's weights before it waits for x
    (default GEMV_EARLY_WEIGHTS).
    `layout`: 'tile' (`_gemv_kernel`) or 'rows' (`_gemv_rows_kernel`, one row of x only; `prefetch` and `loop_stages`
    are the tile kernel's); default `gemv_layout`'s choice at one row, else 'tile'."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}: use F.linear")
    if weight.dtype == torch.int8 and scale is None:
        raise ValueError("gemv: int8 weights need their per-row scale")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"gemv with swiglu needs a [gate | up] weight with an even number of rows, got {weight.shape[0]}")
    (m, k), n = x.shape, weight.shape[0]
    if layout not in (None, "tile", "rows"):
        raise ValueError(f"gemv's layout is 'tile' or 'rows', got {layout!r}")
    if layout == "rows" and m != 1:
        raise ValueError(f"gemv's rows layout takes one row of x, got {m}")
    if out is not None and (swiglu or out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"gemv's out must be a contiguous {x.dtype} [{m}, {n}] (and no swiglu), got "
                         f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' not contiguous'}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"gemv's norm is an RMSNorm weight [{k}], got {tuple(norm.shape)}")
    if norm_sums is not None and norm is not None:
        raise ValueError("gemv takes a norm to apply (norm) or the sums of one applied before it (norm_sums), not both")
    check_gemv_folds("gemv", x, n, swiglu, residual, norm_sums, hand_off)
    backend = kernel_backend(x.device, impl)
    if backend == "torch" or x.stride(-1) != 1 or weight.stride(-1) != 1:
        if norm is not None: x = add_rmsnorm_reference(x, None, norm, eps)[0]
        if norm_sums is not None: x = (x.float() * torch.rsqrt(norm_sums[:, None] / k + eps)).to(x.dtype)
        result = gemv_reference(x, weight, bias, scale)
        if swiglu: return silu_mul(result, backend)
        if residual is not None: result = residual + result
        result = result if out is None else out.copy_(result)
        if hand_off is None: return result
        hand_off[1].add_(result.float().square().sum(-1))
        return result, result * hand_off[0].to(result.dtype)
    if swiglu and not FUSED_SWIGLU:
        return silu_mul(gemv(x, weight, bias, scale, impl, block_n, block_k, num_warps, num_stages, pdl, byte_asm,
                             prefetch, loop_stages, early_weights=early_weights, layout=layout, norm=norm, eps=eps,
                             norm_sums=norm_sums), backend)
    if hand_off is not None and layout == "rows":
        raise ValueError("gemv's rows layout does not hand a norm off: use layout='tile'")
    layout = layout or (gemv_layout(n, k, weight.element_size()) if m == 1 and hand_off is None else "tile")
    default = gemv_config(n, k, weight.element_size(), layout)  # the measured configuration, where none is asked for
    block_n, block_k, num_warps = block_n or default[0], block_k or default[1], num_warps or default[2]
    block_k = min(block_k, max(16, _pow2(k)))
    if swiglu and (block_n < 2 or block_n % 2):
        raise ValueError(f"gemv with swiglu takes gate rows and their up rows together: an even block_n, got {block_n}")
    out = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device) if out is None else out
    pdl = pdl_supported(x.device) if pdl is None else pdl
    early = pdl and (GEMV_EARLY_WEIGHTS if early_weights is None else early_weights)
    grid = (triton.cdiv(out.shape[1], block_n // 2 if swiglu else block_n),)
    sums, next_g, normed = hand_off_operands(out, norm_sums, hand_off, weight)
    operands = (x, weight, *(t if t is not None else weight for t in (scale, bias, norm, residual)), out, sums)
    folds = dict(NORM=norm is not None, RESIDUAL=residual is not None, NORM_SUMS=norm_sums is not None)
    byte_asm = not INTERPRETED if byte_asm is None else byte_asm
    if layout == "rows":
        chunk = block_k // (32 * num_warps)  # inputs of a row a thread takes per step
        if chunk < 1 or block_k % (32 * num_warps):
            raise ValueError(f"gemv's rows layout steps over 32 x num_warps x a chunk of inputs: block_k {block_k} "
                             f"is no multiple of 32 x {num_warps}")
        whole_rows = (n // 2) % (block_n // 2) == 0 if swiglu else n % block_n == 0
        _gemv_rows_kernel[grid](
            *operands, n, k, weight.stride(0), eps, BLOCK_N=block_n, CHUNK=chunk, SLABS=num_warps,
            EVEN=whole_rows and k % block_k == 0, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, PDL=pdl,
            launch_pdl=pdl, BYTE_ASM=byte_asm, SWIGLU=swiglu, EARLY_W=early, **folds, num_warps=num_warps,
            **_stages(num_stages))
        return out
    if m:
        _gemv_kernel[grid](
            *operands, next_g, normed, m, n, k, x.stride(0), weight.stride(0), 0 if residual is None else residual.stride(0),
            out.stride(0), eps, ROWS=max(1, _pow2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl,
            BYTE_ASM=byte_asm, PREFETCH=0 if swiglu else gemv_prefetch(weight, pdl, num_warps, prefetch),
            LOOP_STAGES=gemv_loop_stages(loop_stages), SWIGLU=swiglu, EARLY_W=early, **folds,
            HAND_OFF=hand_off is not None, num_warps=num_warps, **_stages(num_stages))
    return out if hand_off is None else (out, normed)


# %% [markdown]
# Against its PyTorch path: plain, with a bias, with a K that is not a multiple of the tile, in
# bf16, and with int8 weights and their scales.

# %%
# fp32: K <= 1,024 products summed in another order, each add rounding 2^-24 of a partial sum of O(sqrt(K)): ~1e-5 on
# outputs of O(30) (measured 1.9e-5), so 1e-4. bf16: the interpreter truncates the output, PyTorch rounds it: one ulp,
# 2^-7 relative, on outputs of O(16): rtol 2e-2, atol 5e-2
for m, n, k, with_bias in ((1, 12, 64, False), (3, 10, 100, True), (4, 8, 1024, False)):
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    torch.testing.assert_close(gemv(x, weight, bias, impl="triton", block_k=64), F.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4)
    q, scale = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 64
    torch.testing.assert_close(gemv(x, q, bias, scale, impl="triton", block_k=64), gemv_reference(x, q, bias, scale),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gemv(x, weight, bias, impl="triton", block_k=64, loop_stages=3), F.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4)  # (the interpreter runs the pipelined loop as written)
xb, wb = torch.randn(2, 256, generator=gen).bfloat16(), torch.randn(16, 256, generator=gen).bfloat16()
torch.testing.assert_close(gemv(xb, wb, impl="triton", block_k=128), F.linear(xb, wb), rtol=2e-2, atol=5e-2)
# `out`: the result written where the caller says (chapter 09c writes into its all-reduce buffer), the same bits
for impl in ("triton", "torch"):
    into = torch.full((2, 16), float("nan")).bfloat16()
    assert gemv(xb, wb, impl=impl, block_k=128, out=into) is into
    assert torch.equal(into, gemv(xb, wb, impl=impl, block_k=128)), impl
with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \[2, 16\]"):
    gemv(xb, wb, impl="triton", out=torch.empty(16, 2).bfloat16().t())
# `swiglu`: the gate-up GEMV with SiLU-mul in its epilogue gives the bits of the GEMV followed by `silu_mul`
# (FUSED_SWIGLU), in fp32 and bf16, with int8 weights, over 1-2 rows and a K that is not a multiple of the tile
for m, inter, k, dtype, int8 in ((1, 24, 64, torch.float32, False), (2, 40, 100, torch.float32, True),
                                 (1, 48, 256, torch.bfloat16, False), (1, 20, 64, torch.bfloat16, True)):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(2 * inter, k, generator=gen).to(dtype)
    scale = None
    if int8: w, scale = torch.randint(-127, 128, (2 * inter, k), generator=gen, dtype=torch.int8), torch.rand(2 * inter, generator=gen) / 64
    want = silu_mul(gemv(x, w, None, scale, impl="triton", block_k=64), impl="triton")
    for fused in (True, False):
        FUSED_SWIGLU = fused  # (the module's switch; here the notebook's copy of it)
        assert torch.equal(gemv(x, w, None, scale, impl="triton", block_k=64, swiglu=True), want), (m, inter, fused)
    # fp32: as the GEMV above; bf16: the GEMV's output, SiLU and the product each truncated here: three ulps, 2.3e-2
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(want.float(), silu_mul_reference(gemv_reference(x, w, None, scale)).float(), **tol)
FUSED_SWIGLU = True
with pytest.raises(ValueError, match="even number of rows"):
    gemv(torch.zeros(1, 8), torch.zeros(3, 8), swiglu=True)
with pytest.raises(ValueError, match="an even block_n, got 3"):
    gemv(torch.zeros(1, 64), torch.zeros(8, 64), impl="triton", swiglu=True, layout="rows", block_n=3, block_k=64, num_warps=1)
with pytest.raises(ValueError, match="at most 4 rows"):
    gemv(torch.zeros(5, 8), torch.zeros(2, 8))
with pytest.raises(ValueError, match="need their per-row scale"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8, dtype=torch.int8))
with pytest.raises(ValueError, match="1 or more, got 0"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), impl="triton", loop_stages=0)
# the prefetch goes only where a dependent launch issues it and each program's rows are one aligned span
w = torch.zeros(8, 64, dtype=torch.bfloat16)
assert gemv_prefetch(w, pdl=True, num_warps=4, prefetch=True) == 128
assert gemv_prefetch(w, pdl=False, num_warps=4, prefetch=True) == 0 and gemv_prefetch(w, True, 4, prefetch=False) == 0
for unfit in (w[:, 1:], w.view(-1)[1:1 + 8 * 56].view(8, 56), torch.zeros(8, 60, dtype=torch.bfloat16)):
    assert gemv_prefetch(unfit, True, 4, prefetch=True) == 0  # a strided view, a misaligned start, 120-byte rows
assert gemv_prefetch(w, True, 2) == (64 if GEMV_L2_PREFETCH else 0)
# the rows layout (one row of x): against the reference in fp32 and bf16, with int8 weights and their scales, a bias,
# rows and inputs that fill no whole program or step; with `swiglu`, the bits of its own GEMV followed by `silu_mul`
for n, k, dtype, int8, with_bias, block_k, warps in ((12, 256, torch.float32, False, True, 128, 2),
                                                     (10, 100, torch.float32, True, False, 64, 1),
                                                     (16, 512, torch.bfloat16, False, False, 512, 2),
                                                     (8, 192, torch.bfloat16, True, True, 128, 1)):
    x, w, scale = torch.randn(1, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype), None
    if int8: w, scale = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 64
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    rows = dict(impl="triton", layout="rows", block_k=block_k, num_warps=warps)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)  # as for the tile GEMV
    torch.testing.assert_close(gemv(x, w, bias, scale, **rows).float(), gemv_reference(x, w, bias, scale).float(), **tol)
    assert torch.equal(gemv(x, w, None, scale, swiglu=True, **rows),
                       silu_mul(gemv(x, w, None, scale, **rows), impl="triton")), (n, k, dtype)
assert gemv_layout(19456, 2560) == "rows" and gemv_config(19456, 2560) == (4, 512, 2)  # Qwen3-4B's gate-up in BF16
assert gemv_layout(19456, 2560, 1) == "rows" and gemv_config(19456, 2560, 1) == (8, 512, 2)  # ... and in int8
assert gemv_layout(6144, 2560) == gemv_layout(6144, 2560, 1) == gemv_layout(151936, 2560) == "tile"
assert gemv_layout(2560, 9728, 1) == gemv_layout(151936, 2560, 1) == "tile"  # int8 down, the int8 LM head
with pytest.raises(ValueError, match="'tile' or 'rows', got 'diagonal'"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), impl="triton", layout="diagonal")
with pytest.raises(ValueError, match="takes one row of x, got 2"):
    gemv(torch.zeros(2, 8), torch.zeros(2, 8), impl="triton", layout="rows")
with pytest.raises(ValueError, match="block_k 32 is no multiple of 32 x 2"):
    gemv(torch.zeros(1, 32), torch.zeros(2, 32), impl="triton", layout="rows", block_k=32, num_warps=2)
# `norm` and `residual` folded in (the batch-1 decode step's add + RMSNorm kernels gone, below): in both layouts, fp32
# and bf16, several rows, a K that fills no whole step, with a bias, int8 weights and `swiglu`. The residual add is the
# bits of the GEMV followed by `add_rmsnorm`'s add; the norm agrees with `rmsnorm` then the GEMV to rounding (here x is normalised
# in fp32 and never rounded)
for layout, m, n, k, dtype, int8, with_bias, swiglu in (
        ("tile", 1, 12, 256, torch.float32, False, True, False), ("tile", 3, 10, 100, torch.float32, True, False, False),
        ("rows", 1, 16, 512, torch.bfloat16, False, False, False), ("tile", 2, 16, 192, torch.bfloat16, False, False, True),
        ("rows", 1, 24, 200, torch.bfloat16, True, True, False), ("rows", 1, 16, 256, torch.float32, False, False, True)):
    x, g = (3 * torch.randn(m, k, generator=gen)).to(dtype), (torch.rand(k, generator=gen) + 0.5).to(dtype)
    w, scale = torch.randn(n, k, generator=gen).to(dtype), None
    if int8: w, scale = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 64
    bias, res = torch.randn(n, generator=gen).to(dtype) if with_bias else None, torch.randn(m, n, generator=gen).to(dtype)
    launch = dict(impl="triton", layout=layout, block_k=64, num_warps=1, swiglu=swiglu)
    normed = gemv(x, w, bias, scale, norm=g, eps=1e-5, **launch).float()
    want = gemv(rmsnorm(x, g, 1e-5, impl="triton"), w, bias, scale, **launch).float()
    # bf16: here x is normalised in fp32, there `rmsnorm` rounds it twice (2^-7 each, truncating): errors of random sign
    # that add up over K as the outputs do, ~2^-7 of a typical output, plus the output's own rounding: 1e-2 of the largest
    bf16_tol = (3e-2 if swiglu else 1e-2) * want.abs().max().item()  # (SiLU-mul multiplies two gate / up errors)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=bf16_tol)
    torch.testing.assert_close(normed, want, **tol)  # (bf16: a few units of the largest output's last place)
    if dtype == torch.bfloat16: tol["atol"] *= 3  # the PyTorch path rounds x, x · g and (int8) the scales to bf16 too
    torch.testing.assert_close(normed, gemv(x, w, bias, scale, impl="torch", norm=g, eps=1e-5, swiglu=swiglu).float(), **tol)
    if not swiglu:
        added = add_rmsnorm(gemv(x, w, bias, scale, **launch), res, torch.ones(n, dtype=dtype), 1e-6, impl="triton")[1]
        assert torch.equal(gemv(x, w, bias, scale, residual=res, **launch), added), layout  # (the add it replaces)
        added = add_rmsnorm(gemv(x, w, bias, scale, impl="torch"), res, torch.ones(n, dtype=dtype), 1e-6, impl="torch")[1]
        assert torch.equal(gemv(x, w, bias, scale, impl="torch", residual=res), added)  # (and on the PyTorch path)
with pytest.raises(ValueError, match=r"norm is an RMSNorm weight \[8\], got \(4,\)"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm=torch.ones(4))
with pytest.raises(ValueError, match=r"residual must be \[1, 4\] .*\(and no swiglu\), got \(1, 2\)"):
    gemv(torch.zeros(1, 8), torch.zeros(4, 8), residual=torch.zeros(1, 2))

# %% [markdown]
# **The norm handed off** (`hand_off`, `norm_sums`; `NORM_HANDOFF` below). For int8
# the fold above costs the loop more than the launches it saves. But the RMSNorm between two
# GEMVs splits in two: the GEMV that adds the residual (o, down) has h = r + W·x in its epilogue
# anyway, so it also stores h·g (the next norm's weight) and adds h's squares, one atomic add a
# program, to a float in memory; the GEMV after (qkv, gate-up) reads h·g as its x and scales its
# sums by 1/rms from that float at the end, nothing added to its loop. (The float must start at 0:
# chapter 09a zeroes one per norm at the start of a step.) Its bound, with
# the add + RMSNorm launches simply skipped (wrong values, a bound; `kernels_lab/decode_overlap.py`,
# one H200): the int8 step 1.678 → 1.589 ms, W1-like 580.1 → 610.6 tok/s; int4 1.600 → 1.493.
# Handed off (int8): the step **1.617-1.625 ms** against 1.678-1.682 without, W1 (bench) 410.6 →
# **599.8 tok/s** against BF16's 410.6 in the same call. A row's 640 programs adding to one float
# cost nothing measurable: spread over 32 floats a row, the step was 1.621 against 1.622. The
# adds' order varies, so the last bits of a norm may differ from run to run (int8 and int4).
#
# Chapter 10's int4 GEMV takes the same folds (`check_gemv_folds` checks them for
# both), so int4 hands its norms on too: its step 1.604 → 1.556 ms. The epilogue's operands (an
# int8 row's scale, the next norm's weight, the residual), asked for one after another
# after the loop, would each be a wait of its own at the very end of the kernel. Asked for before the loop
# (the constants before the input wait) the int8 step got *slower*, 1.579 → 1.746 ms: held
# through the loop they took registers (the o GEMV with the hand-off 96 → 113 a thread), so
# fewer programs fit an SM. So they are asked for together after the loop (`_tile_constants`,
# `_rows_constants`): one wait. Measured on W1 against one after another: no difference (int8 617.3 → 617.2 tok/s). The
# int8 LM head takes BF16's head tile, (4, 512, 2): the decode step 1.577 → 1.571 ms (a sweep of
# int8 tiles inside the step; the qkv, o and down tiles held).

# %%
# h = r + W1·x with norm(h)·g handed to W2: h is the plain residual GEMV's bits, h·g its product
# rounded once, the sums h's squares; W2 over (h·g, sums) agrees with W2 over `rmsnorm(h, g)` to
# rounding (x·g·(1/rms) is not rounded in between); both layouts for the consumer, int8 and bf16
for m, n, k, dtype, int8, layout in ((1, 48, 96, torch.bfloat16, True, "rows"), (2, 40, 64, torch.float32, False, "tile"),
                                     (1, 32, 80, torch.bfloat16, False, "tile")):
    x, r = torch.randn(m, k, generator=gen).to(dtype), (4 * torch.randn(m, n, generator=gen)).to(dtype)
    w1, scale1 = torch.randn(n, k, generator=gen).to(dtype), None
    w2, scale2 = torch.randn(64, n, generator=gen).to(dtype), None
    if int8:
        w1, scale1 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 64
        w2, scale2 = torch.randint(-127, 128, (64, n), generator=gen, dtype=torch.int8), torch.rand(64, generator=gen) / 64
    g = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    sums = torch.zeros(m)
    tile = dict(impl="triton", block_k=32, num_warps=1, block_n=8)
    h, hg = gemv(x, w1, None, scale1, residual=r, hand_off=(g, sums), **tile)
    assert torch.equal(h, gemv(x, w1, None, scale1, residual=r, **tile))
    # (bit for bit on a GPU; the interpreter truncates to bf16: one ulp, 2^-7, within the default bf16 rtol 1.6e-2)
    torch.testing.assert_close(hg, h * g)
    torch.testing.assert_close(sums, h.float().square().sum(-1))  # (default fp32 tolerance: 40-48 squares, another order)
    got = gemv(hg, w2, None, scale2, impl="triton", norm_sums=sums, eps=1e-5, layout=layout, block_k=64, num_warps=1)
    want = gemv(rmsnorm(h, g, 1e-5, impl="triton"), w2, None, scale2, impl="triton", layout=layout, block_k=64, num_warps=1)
    # fp32: sums in another order (as the GEMV above); bf16: the consumer's x·g·(1/rms) not rounded in between, h·g
    # truncated: a couple of ulps of the largest output, 2^-7 of it each
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol if dtype == torch.float32 else 0, atol=tol)
    torch_sums = torch.zeros(m)  # the PyTorch path: the same three results as the kernels
    h_t, hg_t = gemv(x, w1, None, scale1, impl="torch", residual=r, hand_off=(g, torch_sums))
    # h_t is PyTorch's GEMV + r, h the kernel's: in bf16 (truncated here) W·x and the sum h each an ulp apart, 2^-7 of
    # |W·x| + |h|; so the sums of squares up to twice that, ~3e-2, and h·g a couple of ulps of the largest; fp32: 2^-24
    fp32 = dtype == torch.float32
    torch.testing.assert_close(torch_sums, sums, rtol=1e-5 if fp32 else 3e-2, atol=0)
    torch.testing.assert_close(hg_t, hg, rtol=1e-5 if fp32 else 0, atol=1e-5 if fp32 else 2e-2 * hg.float().abs().max().item())
    # (the PyTorch path rounds x·(1/rms) to the dtype before its GEMV, and its h·g differs as above: three times the bound)
    torch.testing.assert_close(gemv(hg_t, w2, None, scale2, impl="torch", norm_sums=torch_sums, eps=1e-5).float(),
                               want.float(), rtol=3 * tol if dtype == torch.float32 else 0, atol=3 * tol)
with pytest.raises(ValueError, match=r"norm_sums must be float32 \[1\] on cpu, got torch.float16 \(1,\)"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm_sums=torch.zeros(1, dtype=torch.float16))
with pytest.raises(ValueError, match="hand_off needs a residual"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), hand_off=(torch.ones(2), torch.zeros(1)))
with pytest.raises(ValueError, match="norm to apply .* not both"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm=torch.ones(8), norm_sums=torch.zeros(1))
with pytest.raises(ValueError, match="rows layout does not hand a norm off"):
    gemv(torch.zeros(1, 64), torch.zeros(2, 64), impl="triton", layout="rows", residual=torch.zeros(1, 2),
         hand_off=(torch.ones(2), torch.zeros(1)))


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
def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    "q [T, Hq, D] over the paged pool -> [T, Hq, D]; the new tokens of sequence b are the last of its context."
    out = torch.empty_like(q)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b, (start, end, ctx) in enumerate(zip(query_start[:-1].tolist(), query_start[1:].tolist(),
                                              context_lens.tolist())):
        blocks = block_tables[b, :-(-ctx // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        positions = torch.arange(ctx - (end - start), ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= positions[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def random_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                    dtype=torch.float32, device="cpu", spare_blocks: int = 3, pad_columns: int = 1, seed: int = 0):
    "Random K/V pools with each sequence's blocks scattered: (k_cache, v_cache, block_tables int32 padded with -1)."
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: a GPU pool can be gigabytes
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(2))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(needed) + pad_columns
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n] + [-1] * (width - n))
        used += n
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device)


# %% [markdown]
# The reference agrees with chapter 03's `causal_attention` (which uses PyTorch's own
# attention) on a chunk of 3 new tokens after 5 cached ones, blocks scattered:

# %%
k_cache, v_cache, tables = random_paged_kv([8, 3], num_kv_heads=2, head_dim=16, block_size=4)
q = torch.randn(3 + 1, 4, 16, generator=gen)  # sequence 0: 3 new tokens, sequence 1: 1 (a decode)
out = paged_attention_reference(q, k_cache, v_cache, tables, torch.tensor([0, 3, 4]), torch.tensor([8, 3]), 16**-0.5)
k0 = k_cache[tables[0, :2].long()].flatten(0, 1)
# (the default fp32 tolerance, rtol 1.3e-6 and atol 1e-5: PyTorch's attention sums the same products in another order)
torch.testing.assert_close(out[:3], causal_attention(q[:3], k0, v_cache[tables[0, :2].long()].flatten(0, 1), q_offset=5))
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
def _attend_keys(q, row_pos, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, start, end, stride_kb, stride_kt,
                 offs_d, d_mask, qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:  # a tile that may cross `end` or the causal diagonal
            n_mask = offs_n < end
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:  # every key of the tile is visible to every row
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]
        token = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt  # [BLOCK_N] offsets into the pool
        k = tl.load(k_ptr + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        p, alpha, m_i, l_i = _softmax_step(q, k, offs_n, end, row_pos, m_i, l_i, qk_scale, MASKED, UPCAST, PRECISION)
        v = tl.load(v_ptr + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _softmax_step(q, k, offs_n, end, row_pos, m_i, l_i, qk_scale, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    "One tile's online softmax: (p, the factor alpha that rescales what came before, the new m, the new l)."
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale  # [R, BLOCK_N]
    if MASKED:
        s = tl.where((offs_n[None, :] < end) & (offs_n[None, :] <= row_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


def _check_attention_args(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [tokens, q_heads, head_dim] and k_cache [num_blocks, block_size, kv_heads, "
                         f"head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same shape and strides, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)}: head_dim must match and "
                         f"q_heads be a multiple of kv_heads")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need unit stride in head_dim")
    if block_tables.dim() != 2 or context_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"block_tables must be [B, max_blocks] and context_lens [B], got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")


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
# under the interpreter); `DECODE_SPLITS_BY_WORK` trades that for speed (below). The number of
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
# K/V), and `DECODE_ONE_LOOP` walks every tile in one masked loop, so the compiler's software
# pipeline can fetch a partial last tile while the whole ones are summed. Measured (one
# H200): one sequence at 300 keys 12.7 µs against 13.8 with the partial tile after the loop, 460
# keys 15.1 against 16.1 (`kernels_lab/decode_attention.py`, v6 against v3); the Qwen3-4B step
# 2.739 ms against 2.777 (`kernels_lab/decode_overlap.py bf16`). On. (Loading q and the new K/V
# with the context length, rather than after it, measured no different: W1 347.3 tok/s both.)

# %%
#| export
DECODE_BLOCK_N = 128  # keys per tile; with 512-key splits the best overall in kernels_lab on an H200
DECODE_SPLIT_TOKENS = 512  # keys per split, when the split is fixed (`split_tokens`, or DECODE_SPLITS_BY_WORK off)
MAX_DECODE_SPLITS = 64  # caps the partial-result buffer; past it splits get longer
DECODE_SPLITS_BY_WORK = True  # the split length from the batch's size too (splits only where programs are few): measured faster
DECODE_TARGET_PROGRAMS = 256  # (sequence, KV head, split) programs the rule aims for: about two per SM of an H200
DECODE_MIN_SPLIT = 64  # keys; a split shorter than DECODE_BLOCK_N is one tile of its own length (measured faster)
DECODE_MAX_WORK_SPLITS = 16  # the rule's cap: the merging program reads the splits one after another
DECODE_ONE_LOOP = True  # one masked loop over a split's tiles instead of whole tiles + the partial one: measured faster
DECODE_LAST_SPLIT_MERGES = True  # the last split of a (sequence, KV head) to finish merges them: measured faster
DECODE_EARLY_TILE = True  # launched early, a split's first K/V tile asked for before the wait for q: measured faster
DECODE_UNROLL_MERGE = 16  # the merging program's loop over up to this many splits unrolled (0: a loop): measured faster


@triton.jit
def _fence_gpu(x, ON: tl.constexpr):
    "Order this thread's earlier memory operations before its later ones, for the whole GPU (ON: compiled, not interpreted)."
    if ON:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, acc, m_i, l_i, offs_d, mask, row_mask,
                    HEAD_DIM: tl.constexpr):
    "A split's unnormalised output and its m and l, at `part` ([rows]) of the partials [B, Hq, num_splits, (HEAD_DIM)]."
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
    tl.store(part_m_ptr + part, m_i, mask=row_mask)
    tl.store(part_l_ptr + part, l_i, mask=row_mask)


@triton.jit
def _merge_split(acc_all, m_all, l_all, part_acc_ptr, part_m_ptr, part_l_ptr, part, offs_d, row_mask, mask,
                 HEAD_DIM: tl.constexpr):
    "The running merge (acc, m, l) with one more split's partials (at `part`); a split masked out changes nothing."
    m_s = tl.load(part_m_ptr + part, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + part, mask=row_mask, other=0.0, cache_modifier=".cg")
    a_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0,
                  cache_modifier=".cg")  # past L1: written by other SMs
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
        return (tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32),
                tl.load(w_ptr + pair, mask=d_mask, other=0.0).to(tl.float32))
    return tl.full(offs_d.shape, 1.0, tl.float32), tl.full(offs_d.shape, 1.0, tl.float32)


@triton.jit
def _norm_rope_rows(x, x_pair, w, w_pair, cos, sin, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows x [R, BLOCK_D] (x_pair: each element's partner in its rotated pair; w, cos, sin [1, BLOCK_D]) ->
    RoPE(rmsnorm(x) * w) in fp32, as `_norm_rope_kernel` computes it; `sin` carries the sign of each half."""
    x, x_pair = x.to(tl.float32), x_pair.to(tl.float32)
    if QK_NORM:
        inv = (1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps))[:, None]
        x, x_pair = x * inv * w, x_pair * inv * w_pair
    return x * cos + x_pair * sin


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                   count_ptr, new_k_ptr, new_v_ptr, slots_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, stride_qb, stride_qh,
                   stride_ob, stride_oh, stride_tb, stride_kb, stride_kt, stride_kh, stride_nkb, stride_nkh, stride_nvb,
                   stride_nvh, stride_cos, eps, qk_scale, num_q_heads, split_len, num_splits, GROUP: tl.constexpr,
                   BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr, WAIT: tl.constexpr, STORE: tl.constexpr, ONE_LOOP: tl.constexpr,
                   ROPE: tl.constexpr, QK_NORM: tl.constexpr, MERGE: tl.constexpr, FENCE: tl.constexpr,
                   EARLY_TILE: tl.constexpr, WAIT_LATE: tl.constexpr, UNROLL_MERGE: tl.constexpr):
    _let_next_start(PDL, WAIT)
    seq, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.maximum(tl.minimum(start + split_len, ctx), start)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N  # whole tiles need no mask
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k_head, v_head, tables_ptr = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_kh, tables_ptr + seq * stride_tb
    if EARLY_TILE:  # the split's first tile of K/V, written by earlier steps: asked for before waiting for q (WAIT_LATE)
        offs_n0 = start + tl.arange(0, BLOCK_N)
        n0_mask = offs_n0 < end
        token0 = tl.load(tables_ptr + offs_n0 // BLOCK_SIZE, mask=n0_mask, other=0).to(tl.int64) * stride_kb \
            + (offs_n0 % BLOCK_SIZE) * stride_kt
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
            pair, in_half = tl.max_contiguous(tl.multiple_of(pair, 8), 8), tl.max_contiguous(tl.multiple_of(in_half, 8), 8)
        pair, in_half, d_row = pair[None, :], in_half[None, :], d_mask[None, :]  # [1, BLOCK_D]: q's 2-D layout
        cos = tl.load(cos_ptr + seq * stride_cos + in_half, mask=d_row, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + seq * stride_cos + in_half, mask=d_row, other=0.0).to(tl.float32)
        q_pair = tl.load(q_rows + pair, mask=q_mask, other=0.0)
        q_w, q_w_pair = _pair_weights(q_norm_ptr, offs_d[None, :], pair, d_row, QK_NORM)
    if STORE:  # the step's new K/V, stored by the program whose split holds the new (last) position, before it reads
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        new_k_row = new_k_ptr + seq * stride_nkb + kv_head * stride_nkh
        new_k = tl.load(new_k_row + offs_d[None, :], mask=d_mask[None, :])  # [1, BLOCK_D]
        new_v = tl.load(new_v_ptr + seq * stride_nvb + kv_head * stride_nvh + offs_d[None, :], mask=d_mask[None, :])
        if ROPE:
            new_k_pair = tl.load(new_k_row + pair, mask=d_row)
            k_w, k_w_pair = _pair_weights(k_norm_ptr, offs_d[None, :], pair, d_row, QK_NORM)
    if ROPE:
        sin = tl.where(offs_d[None, :] < half, -sin, sin)  # first half: x1 c - x2 s; second: x2 c + x1 s
        q = _norm_rope_rows(q, q_pair, q_w, q_w_pair, cos, sin, eps, HEAD_DIM, QK_NORM).to(q.dtype)
    if STORE:
        if ROPE:
            new_k = _norm_rope_rows(new_k, new_k_pair, k_w, k_w_pair, cos, sin, eps, HEAD_DIM, QK_NORM).to(new_v.dtype)
        mine = d_mask[None, :] & ((ctx - 1) // split_len == split)
        at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + offs_d[None, :]
        tl.store(k_head + at, new_k, mask=mine)
        tl.store(v_head + at, new_v, mask=mine)
        tl.debug_barrier()  # every thread of the program sees them
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    row_pos = tl.full([BLOCK_G], 0, tl.int32) + ctx - 1
    if EARLY_TILE:  # (with STORE and ONE_LOOP) the tile loaded early; the new position's K/V from registers
        new_row = (offs_n0 == ctx - 1)[:, None]
        k0, v0 = tl.where(new_row, new_k, k0), tl.where(new_row, new_v.to(v0.dtype), v0)
        p, alpha, m_i, l_i = _softmax_step(q, k0, offs_n0, end, row_pos, m_i, l_i, qk_scale, True, UPCAST, PRECISION)
        acc = acc * alpha[:, None] + _dot(p.to(v0.dtype), v0, UPCAST, PRECISION)
        acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_head, v_head, tables_ptr, start + BLOCK_N, end,
                                     stride_kb, stride_kt, offs_d, d_mask, qk_scale, True, BLOCK_N, BLOCK_SIZE, UPCAST,
                                     PRECISION)
    elif ONE_LOOP:  # every tile masked: a last, partial tile is in the same software-pipelined loop as the others
        acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_head, v_head, tables_ptr, start, end, stride_kb,
                                     stride_kt, offs_d, d_mask, qk_scale, True, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
    else:  # whole tiles without masks, then the partial one in a loop of its own
        acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_head, v_head, tables_ptr, start, full_end, stride_kb,
                                     stride_kt, offs_d, d_mask, qk_scale, False, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
        acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_head, v_head, tables_ptr, full_end, end, stride_kb,
                                     stride_kt, offs_d, d_mask, qk_scale, True, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
    mask = row_mask[:, None] & d_mask[None, :]
    out_rows = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    part = (seq * num_q_heads + heads) * num_splits  # [BLOCK_G] each head's first partial: [B, Hq, num_splits, (D)]
    if not SPLIT:
        _store_normalised(out_rows, acc, l_i, mask)
    elif not MERGE:  # every split's partials, for `_merge_splits_kernel`
        _store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part + split, acc, m_i, l_i, offs_d, mask, row_mask,
                        HEAD_DIM)
    else:  # the splits that hold keys (split 0 at least: an empty context gives zeros) count in; the last merges
        active = tl.maximum(tl.cdiv(ctx, split_len), 1)
        if active == 1:  # the one split is the whole answer
            if split == 0:
                _store_normalised(out_rows, acc, l_i, mask)
        elif split < active:
            _store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part + split, acc, m_i, l_i, offs_d, mask, row_mask,
                            HEAD_DIM)
            _fence_gpu(split, FENCE)  # each thread's partials visible GPU-wide before the count says they are there
            tl.debug_barrier()
            counter = count_ptr + seq * (num_q_heads // GROUP) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == active - 1:  # the last to finish: every other split's partials are written
                _fence_gpu(done, FENCE)
                m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
                l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
                acc_all = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                if UNROLL_MERGE > 0:  # every split's loads in one unrolled run: none waits for the one before
                    for s in tl.static_range(UNROLL_MERGE):  # (past `active`: masked, they change nothing)
                        acc_all, m_all, l_all = _merge_split(acc_all, m_all, l_all, part_acc_ptr, part_m_ptr,
                                                             part_l_ptr, part + s, offs_d, row_mask & (s < active),
                                                             mask & (s < active), HEAD_DIM)
                else:
                    for s in range(0, active):  # in split order, whoever merges: the bits do not depend on timing
                        acc_all, m_all, l_all = _merge_split(acc_all, m_all, l_all, part_acc_ptr, part_m_ptr,
                                                             part_l_ptr, part + s, offs_d, row_mask, mask, HEAD_DIM)
                _store_normalised(out_rows, acc_all, l_all, mask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next call (graphs replay)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ob, stride_oh, num_q_heads, num_splits,
                         BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                         WAIT: tl.constexpr):
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
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _merge_counters(counters: torch.Tensor | None, needed: int, device: torch.device) -> torch.Tensor:
    "The last-split-merges counters: the caller's (checked) or fresh zeros."
    if counters is None:
        return torch.zeros(needed, device=device, dtype=torch.int32)
    if counters.dtype != torch.int32 or counters.numel() < needed or counters.device != device:
        raise ValueError(f"counters must be int32 zeros on {device} with at least {needed} (sequences x KV heads) "
                         f"elements, got {counters.dtype} [{counters.numel()}] on {counters.device}")
    return counters


def decode_split_len(max_blocks: int, block_size: int, split_tokens: int | None = None,
                     block_n: int | None = None, pairs: int | None = None) -> tuple[int, int]:
    """(keys per split, number of splits) for block tables of `max_blocks` columns: from shapes only. `split_tokens`:
    a fixed length (a sequence's bits then never depend on its batch). Else, with DECODE_SPLITS_BY_WORK and the
    number of (sequence, KV head) `pairs`, as many splits as bring the programs to DECODE_TARGET_PROGRAMS (at most
    DECODE_MAX_WORK_SPLITS, none below DECODE_MIN_SPLIT keys); otherwise DECODE_SPLIT_TOKENS."""
    width, block_n = max(1, max_blocks * block_size), block_n or DECODE_BLOCK_N
    if split_tokens is None and DECODE_SPLITS_BY_WORK and pairs is not None:
        splits = min(DECODE_MAX_WORK_SPLITS, -(-DECODE_TARGET_PROGRAMS // max(1, pairs)))
        split_len = max(DECODE_MIN_SPLIT, -(-width // splits))
        block_n = min(block_n, max(16, _pow2(split_len)))  # a short split: one tile of its length
    else:
        split_len = max(split_tokens or DECODE_SPLIT_TOKENS, -(-width // MAX_DECODE_SPLITS))
    split_len = -(-split_len // block_n) * block_n
    return split_len, -(-width // split_len)


FUSED_KV_STORE = True  # the decode kernel stores the step's new K/V itself (no write_kv launch): measured faster
FUSED_NORM_ROPE = True  # ... and normalises and rotates q and the new K itself (no norm_rope launch): measured faster


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, impl: str = "auto",
                           split_tokens: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           one_loop: bool | None = None, rope: NormRope | None = None, merge: bool | None = None,
                           counters: torch.Tensor | None = None, early_tile: bool | None = None) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] attends to its context_lens[b] keys in the pool -> [B, Hq, D].
    `new_kv` (k, v [B, Hkv, D], slots [B]): the step's new K/V, stored in the pool first, each at its sequence's last
    position; by the kernel itself with FUSED_KV_STORE, else by `write_kv`. `rope`: q and the new K are as the
    QKV projection left them; they are normalised and rotated first (by the kernel itself with FUSED_NORM_ROPE and
    FUSED_KV_STORE, else by `norm_rope`). `one_loop`: every tile of a split in one masked loop (default
    DECODE_ONE_LOOP). `split_tokens`: keys per split, fixed (default: `decode_split_len`'s rule). `block_n`: keys per
    tile (default DECODE_BLOCK_N; the rule's splits shorter than that take a tile of their length). `merge`: the last
    split of a (sequence, KV head) to finish merges the splits, no second launch (default DECODE_LAST_SPLIT_MERGES;
    its loop over up to DECODE_UNROLL_MERGE splits unrolled, all their loads at once);
    it counts on `counters`, int32 zeros [>= B x Hkv] that it leaves at zero, kept by the caller from call to call
    (None: fresh zeros each call, one memset more). `early_tile` (default DECODE_EARLY_TILE for at most
    DEPENDENT_LAUNCH_MAX_ROWS sequences; with the fused store and one loop only): launched as a dependent of the
    kernel before, each program asks for its first K/V tile before it waits for q, and takes the new position's K/V
    from registers. `num_warps`: default 4, 8 with the early tile (at 4
    its K and V spill registers, compiled for an H200)."""
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"decode has one query per sequence: q has {q.shape[0]} rows for {block_tables.shape[0]} sequences")
    if rope is not None and new_kv is None:
        raise ValueError("rope: q/k-norm and RoPE apply to the step's new K too, so they need new_kv")
    backend = kernel_backend(q.device, impl)
    fused = new_kv is not None and FUSED_KV_STORE and backend == "triton" and all(t.stride(-1) == 1 for t in new_kv[:2])
    rope_inside = fused and rope is not None and FUSED_NORM_ROPE and rope.cos.stride(-1) == 1 \
        and rope.cos.stride() == rope.sin.stride()
    if rope is not None and not rope_inside:
        q, k = (norm_rope(x, w, rope.eps, rope.cos, rope.sin, impl)
                for x, w in ((q, rope.q_weight), (new_kv[0], rope.k_weight)))
        new_kv = (k, *new_kv[1:])
    if new_kv is not None and not fused:
        write_kv(k_cache, v_cache, new_kv[2], new_kv[0], new_kv[1], impl)
    if backend == "torch":
        query_start = torch.arange(q.shape[0] + 1, device=q.device)
        return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start, context_lens, scale)
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    split_len, num_splits = decode_split_len(block_tables.shape[1], block_size, split_tokens, block_n, batch * kv_heads)
    block_n = min(block_n or DECODE_BLOCK_N, split_len)  # (the rule's short splits take tiles of their length)
    out = torch.empty_like(q)
    merge = DECODE_LAST_SPLIT_MERGES if merge is None else merge
    one_loop = DECODE_ONE_LOOP if one_loop is None else one_loop
    if early_tile is None:  # (a batch of 256 launched early held SMs that the projection before it needed)
        early_tile = DECODE_EARLY_TILE and batch <= DEPENDENT_LAUNCH_MAX_ROWS
    early = early_tile and fused and one_loop
    num_warps = num_warps or (8 if early else 4)
    if num_splits > 1:
        part_acc = torch.empty(batch, q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_m, part_l = (torch.empty(batch, q_heads, num_splits, device=q.device, dtype=torch.float32) for _ in range(2))
    else:
        part_acc = part_m = part_l = out  # unused
    if num_splits > 1 and merge:
        counters = _merge_counters(counters, batch * kv_heads, q.device)
    else:
        counters = context_lens  # unused
    new_k, new_v, slots = new_kv if fused else (q, q, context_lens)  # (unused without STORE)
    rope = rope if rope_inside else NormRope(None, None, 0.0, q, q)  # (unused without ROPE)
    q_weight = rope.q_weight if rope.q_weight is not None else q
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l, counters, new_k, new_v, slots,
        q_weight, rope.k_weight if rope.k_weight is not None else q_weight, rope.cos, rope.sin,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), new_k.stride(0), new_k.stride(1), new_v.stride(0),
        new_v.stride(1), rope.cos.stride(0), rope.eps, scale * math.log2(math.e), q_heads, split_len, num_splits,
        GROUP=group, BLOCK_G=max(16, _pow2(group)), HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLIT=num_splits > 1, UPCAST=INTERPRETED,
        PRECISION=_dot_precision(q.dtype), **_pdl_args(q.device, early, batch), STORE=fused, ONE_LOOP=one_loop,
        ROPE=rope_inside, QK_NORM=rope.q_weight is not None, MERGE=merge, FENCE=not INTERPRETED, EARLY_TILE=early,
        WAIT_LATE=early and pdl_supported(q.device),
        UNROLL_MERGE=_pow2(num_splits) if merge and 1 < num_splits <= DECODE_UNROLL_MERGE else 0, num_warps=num_warps,
        **_stages(num_stages))
    if num_splits > 1 and not merge:
        _merge_splits_kernel[(batch, q_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), q_heads, num_splits,
            BLOCK_S=_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)),
            **_pdl_args(q.device, rows=batch),
            num_warps=4)
    return out


# %% [markdown]
# Three sequences, 4 query heads per KV head, block size 8, forced to short splits so the
# merge runs; then the same without splits. Both match the reference.
#
# A decode step's new K/V have to reach the pool before the attention reads them: the K/V
# store is a kernel of its own, one launch a layer. `new_kv` hands them to the decode
# attention instead: with `FUSED_KV_STORE`, the program whose split holds a sequence's last
# position stores that sequence's new K/V for its KV head, waits at a barrier for its
# threads, then attends (a program's own global writes are visible to its threads after the
# barrier); otherwise `write_kv` runs first. On by default: measured on an H200
# (`kernels_lab/decode_overlap.py`, random:qwen3-4b, one sequence's decode step as a CUDA
# graph), 2.777 ms against 2.814 with `write_kv` (BF16), 2.079 against 2.114 (int8).
#
# The new K the program stores must be normalised (Qwen3's q/k-norm) and rotated (RoPE) first,
# and so must q: one more launch a layer (`norm_rope`, above) whose only job is to prepare
# these few hundred numbers. With `rope` (a `NormRope`: the norm weights, eps, each query's
# cos and sin) the attention does it itself (`FUSED_NORM_ROPE`): it loads each element's
# partner in its rotated pair (`d ± D/2`) next to the element, normalises each row in fp32 and
# rotates, exactly the arithmetic of `_norm_rope_kernel`. Every program redoes it for its group's
# q heads (4 rows of 128 for Qwen3-4B), cheaper than a launch. All of it is asked for before the
# first reduction: the compiler moves no load over the barriers a reduction brings, and each
# load behind one would be another round trip. The model learns that a backend does this from
# its `rope_inside` and hands it q and k as the QKV projection left them (chapter 09a). Measured
# on an H200: step 2.715 ms against 2.742 with `norm_rope` launched (BF16), 1.996 against 2.024
# (int8), 2.272 against 2.302 (int4). On.

# %%
lens = [1, 37, 150]
k_cache, v_cache, tables = random_paged_kv(lens, num_kv_heads=2, head_dim=32, block_size=8, seed=1)
q = torch.randn(3, 8, 32, generator=gen)
ctx = torch.tensor(lens)
want = paged_attention_reference(q, k_cache, v_cache, tables, torch.arange(4), ctx, 32**-0.5)
assert decode_split_len(tables.shape[1], 8, split_tokens=64) == (128, 2)  # rounded up to whole tiles
for split_tokens in (64, 10_000):
    got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens)
    # fp32: the scores and the softmax's sums over <= 150 keys in another order (tiles, splits): ~1e-7 on outputs of
    # O(1) (measured 3e-7), so 1e-5; the same below
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # every tile in one masked loop (tiles of 16: 37 and 150 keys end in a partial one): the same sums
    assert torch.equal(*(paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton",
                                                split_tokens=split_tokens, block_n=16, one_loop=one_loop)
                         for one_loop in (True, False)))

# %% [markdown]
# ### The last split merges
#
# The merge kernel is a second launch a layer, and it reads every split's partials, the empty
# ones too (a 2K-wide table holds 4 splits; a 600-key sequence fills 2). With `merge=True`
# (`DECODE_LAST_SPLIT_MERGES`) the decode kernel does it itself: a sequence whose keys fit one
# split writes its output directly; otherwise each split that holds keys writes its partials
# and counts itself in on an atomic counter per (sequence, KV head), and the one that counts
# last merges them all, in split order, and sets the counter back to zero for the next call (a
# CUDA graph replays the same counters). Empty splits write nothing. Which program merges
# depends on timing; what it computes does not: the same partials, summed in the same order.
#
# Memory order: every thread fences its partials (`fence.acq_rel.gpu`) before the program's
# barrier and the acquire-release atomic, and the merging program reads the partials past its
# L1 (`.cg`). Measured (H200, `kernels_lab/decode_attention.py`, v7 against v3): 256
# sequences of 600 keys in 2K-wide tables 197 µs against 210, of 1,000 keys 284 against 303; at
# batch 1 no different (12.1 against 12.0 µs at 300 keys). The W2-like step
# (`kernels_lab/decode_step_timeline.py none --batch=256 --prompt=600`) 11.96 ms against 12.38;
# W2 13,784 and 13,703 output tok/s against 11,690 and 13,462, alternated. On.
#
# Tried: the merging program reading 8 splits' partials at once, as one
# `[8 splits, 4 heads, 128]` tile whose loads are all in flight together, instead of one split
# after another (a memory round trip each, at the end of the kernel's chain of latencies).
# Compiled for an H200 it spills nothing (`kernels_lab/decode_sass.py` at commit 942e6c9), but
# the batch-1 step took 2.564 / 2.566 ms against 2.468 reading one split at a time
# (`kernels_lab/decode_overlap.py`, one H200, same call): the 3-D tile's reductions cost more
# than the round trips they save. Not kept.
#
# The same idea without the 3-D tile (`DECODE_UNROLL_MERGE`, on): the merging
# program's loop over the splits unrolled (`tl.static_range` over the table's splits rounded up
# to a power of two, up to 16; the splits past `active` masked, so they change nothing). Each
# split is still merged into the running (acc, m, l) as before, in split order, the same bits;
# but none of its loads waits for the split before, so the compiler asks for all of them at
# once: one round trip where there were `active` (2-6 at W1's contexts). Measured on an H200
# (`LAB_NO_CHAIN=1 LAB_VARIANTS="defaults,merge unrolled,defaults again" kernels_lab/decode_overlap.py int8,bf16`,
# one call): int8 step 1.548 ms against 1.563 / 1.563 (W1-like 632.4 tok/s against 621.5 /
# 621.4), BF16 2.364 against 2.378 / 2.377 (417.3 against 412.7 / 413.0).
#
# **How long a split.** Without a second launch, short splits cost little, and how many a batch
# wants depends on how many programs it already has: the same lab, splits of 128 / 512 / 1,024
# keys: one sequence of 460 keys 11.6 / 15.1 / 15.0 µs, of 1,000 keys 13.1 / 17.9 / 24.0; 256
# sequences of 600 keys 296 / 197 / 169 µs, of 1,000 keys 392 / 284 / 263. With
# `DECODE_SPLITS_BY_WORK` the split length comes from the shapes, the batch's too: as many splits
# as bring the `(sequence, KV head, split)` programs to about two per SM (256), at most 16 (the
# merging program reads them one after another), none shorter than `DECODE_MIN_SPLIT` keys. One
# sequence with Qwen3-4B's 8 KV heads gets splits of 64 keys in a 512-wide table (one 64-key
# tile each: a split shorter than `DECODE_BLOCK_N` takes a tile of its own length), 256
# sequences none at all.
# The price: a sequence's bits then depend on the batch's size (as the GEMMs' already do), so
# a fixed `split_tokens` turns the rule off, and the tests that compare bits pass one.
#
# Measured on an H200 (random Qwen3-4B, fixed 512-key splits against the rule, both
# merging in the kernel): lab, one sequence of 1,000 keys in a 2K table 17.9 → 13.1 µs, of 4,096
# keys 21.7 → 20.4; 256 sequences of 600 keys 197.1 → 166.9 µs, of 2,048 keys 538.7 → 502.6;
# 64 sequences of 1,500 keys 117.2 → 120.0 (the one shape that loses). W2, three runs each,
# alternated: 13,897 / 13,925 / 13,929 → 14,876 / 14,921 / 14,800 output tok/s; W1 364.7 → 367.1
# tok/s. So the rule is on.
#
# Shorter splits at batch 1 (`DECODE_MIN_SPLIT` 128 → 64, such splits one 64-key tile):
# the W1 graph's table is 512 keys wide, so one sequence ran 8-24 programs of one 128-key tile,
# 8.2-9.3 µs a layer in the step's timeline. With 64-key splits, 16-48 programs of half the
# work: the batch-1 step 2.530 ms against 2.577 / 2.565 (`kernels_lab/decode_overlap.py`, one
# H200, W1-like 384.9 against 379.7 / 380.8 tok/s), int8 1.860 against 1.875 / 1.880. Longer
# contexts keep 128-key splits and tiles (one sequence of 1,000 keys: 12.8 µs, against 14.7
# with 64-key tiles in `kernels_lab/decode_attention.py`).
#
# **The first tile early** (`DECODE_EARLY_TILE`: on, at most `DEPENDENT_LAUNCH_MAX_ROWS` sequences). At batch 1
# the kernel is a chain of memory latencies after the QKV projection ends: its launch, the
# context length, the block table, K and V, the partials and the merge. Only q and the new K/V
# come from the projection; the rest of the pool was written by earlier steps. So the kernel
# can be launched as a programmatic dependent of the projection and ask for its split's first
# tile (the block table, K and V) before it waits (`gdc_wait`) for q. The new position's K/V,
# which that tile may hold, is not in the pool yet: it comes from registers, as stored. Later
# tiles are read after the store, as before. The tests check the bits against the plain launch.
# Compiled for an H200 without one (`kernels_lab/decode_sass.py`), the held tiles spill
# registers at 4 warps (76 local loads and stores), none at 8: this variant launches with 8.
# Measured on an H200 (random Qwen3-4B, 128-key splits, the small kernels launched plainly;
# `tests/test_kernels.py -m gpu` passes with
# it): the batch-1 step 2.643 ms against 2.654 / 2.641 without (`kernels_lab/decode_overlap.py`),
# W1 368.5 / 368.4 tok/s against 368.6 / 368.4, int8 W1 499.9 against 499.3: no gain; and W2 11,222
# output tok/s against 15,154 (not profiled; likely the 256-sequence kernel, launched early, holds
# SMs while the projection still runs). With splits of 64
# keys at batch 1 (so a split's first tile is all of it) and the small kernels launched as
# dependents: the batch-1 step 2.391 ms against 2.429 / 2.430 without (W1-like 406.4 against
# 400.0 / 399.7 tok/s), int8 1.702 against 1.752 / 1.748 (564.4 against 547.5 / 548.6), int4
# 1.609 against 1.639 / 1.641 (599.4 against 583.1 / 584.9); `kernels_lab/decode_overlap.py`,
# one H200. On, for steps of at most `DEPENDENT_LAUNCH_MAX_ROWS` sequences (the W2 loss above).

# %%
counters = torch.zeros(3 * 2, dtype=torch.int32)
for split_tokens, block_n in ((64, 16), (64, 128), (10_000, 128)):
    for call in range(2):  # the second call finds the counters back at zero
        got = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens,
                                     block_n=block_n, merge=True, counters=counters)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not counters.any(), counters
    # a sequence's bits do not depend on the batch around it (150 keys: 3 splits of 64, merged by the last)
    alone = paged_decode_attention(q[2:], k_cache, v_cache, tables[2:], ctx[2:], 32**-0.5, impl="triton",
                                   split_tokens=split_tokens, block_n=block_n, merge=True)
    assert torch.equal(alone, got[2:]), split_tokens
# the merging program's loop unrolled (DECODE_UNROLL_MERGE, here the notebook's copy of the switch): the same bits
merged = {}
for unroll in (0, 16):  # (ends on the default)
    DECODE_UNROLL_MERGE = unroll
    merged[unroll] = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", split_tokens=64,
                                            block_n=16, merge=True)
assert torch.equal(merged[0], merged[16])
# the rule: a 512-wide table for one sequence of 8 KV heads, 2K, 4K; 8 sequences; 256 (no split)
assert DECODE_SPLITS_BY_WORK
assert [decode_split_len(w // 16, 16, pairs=p) for w, p in ((512, 8), (2048, 8), (4096, 8), (2048, 64), (2048, 2048))] \
    == [(64, 8), (128, 16), (256, 16), (512, 4), (2048, 1)]
assert decode_split_len(32, 16, split_tokens=256, pairs=8) == (256, 2)  # a fixed split stays fixed
DECODE_SPLITS_BY_WORK = False  # (the module's switch; here the notebook's copy of it): the fixed rule
assert decode_split_len(128, 16, pairs=8) == (512, 4)
DECODE_SPLITS_BY_WORK = True
with pytest.raises(ValueError, match=r"counters must be int32 zeros .* at least 6"):
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", split_tokens=64, merge=True,
                           counters=torch.zeros(5, dtype=torch.int32))

# %%
# The step's new K/V (`new_kv`): stored first by `write_kv`, or (FUSED_KV_STORE) by the program whose split holds the
# last position, before it attends. Both leave the pool and the output of storing by hand, then attending.
new_k, new_v = torch.randn(3, 2, 32, generator=gen), torch.randn(3, 2, 32, generator=gen)
last = ctx - 1
slots = tables[torch.arange(3), last // 8].long() * 8 + last % 8
by_hand = (k_cache.clone(), v_cache.clone())
write_kv_reference(*by_hand, slots, new_k, new_v)
want = paged_attention_reference(q, *by_hand, tables, torch.arange(4), ctx, 32**-0.5)
for fused, split_tokens, merge in ((False, 64, False), (True, 64, False), (True, 64, True), (True, 10_000, False)):
    FUSED_KV_STORE = fused  # (the module's switch; here the notebook's copy of it)
    pools = (k_cache.clone(), v_cache.clone())
    got = paged_decode_attention(q, *pools, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens,
                                 new_kv=(new_k, new_v, slots), merge=merge)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: as above, sums in another order
    assert torch.equal(pools[0], by_hand[0]) and torch.equal(pools[1], by_hand[1]), (fused, split_tokens)
FUSED_KV_STORE = True
# `early_tile`: a split's first tile read before the new K/V is stored, the new position's K/V taken from registers;
# the same bits and pool, whether the new position is in a split's first tile (16-key splits) or a later one
for split_tokens in (16, 64, 10_000):
    outs = []
    for early in (False, True):
        pools = (k_cache.clone(), v_cache.clone())
        outs.append(paged_decode_attention(q, *pools, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens,
                                           block_n=16, new_kv=(new_k, new_v, slots), early_tile=early))
        assert torch.equal(pools[0], by_hand[0]) and torch.equal(pools[1], by_hand[1]), (split_tokens, early)
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0], outs[1]), split_tokens

# `rope`: q and the new K come as the QKV projection leaves them (Qwen3's q/k-norm weights, or none as in Llama); the
# kernel normalises and rotates both (FUSED_NORM_ROPE), or `norm_rope` runs first. Both as by hand.
angles = torch.arange(3.0)[:, None] * 10 + torch.rand(16, generator=gen)[None, :]  # one position per sequence
for norm_weights in ((torch.rand(32, generator=gen) + 0.5, torch.rand(32, generator=gen) + 0.5), (None, None)):
    rope = NormRope(*norm_weights, 1e-6, angles.cos(), angles.sin())
    by_hand = (k_cache.clone(), v_cache.clone())
    roped_k = norm_rope_reference(new_k, rope.k_weight, 1e-6, rope.cos, rope.sin)
    write_kv_reference(*by_hand, slots, roped_k, new_v)
    want = paged_attention_reference(norm_rope_reference(q, rope.q_weight, 1e-6, rope.cos, rope.sin), *by_hand,
                                     tables, torch.arange(4), ctx, 32**-0.5)
    for inside, split_tokens, early in ((False, 64, False), (True, 64, False), (True, 16, True), (True, 10_000, True)):
        FUSED_NORM_ROPE = inside
        pools = (k_cache.clone(), v_cache.clone())
        got = paged_decode_attention(q, *pools, tables, ctx, 32**-0.5, impl="triton", split_tokens=split_tokens,
                                     block_n=16, new_kv=(new_k, new_v, slots), rope=rope, early_tile=early)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the new K normalised and rotated in the kernel, 32 squares summed in another order: a few 2^-24 of O(1)
        torch.testing.assert_close(pools[0], by_hand[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(pools[1], by_hand[1])
FUSED_NORM_ROPE = True
with pytest.raises(ValueError, match="need new_kv"):
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, 1.0, rope=rope)
with pytest.raises(ValueError, match="one query per sequence"):
    paged_decode_attention(q[:2], k_cache, v_cache, tables, ctx, 1.0)
with pytest.raises(ValueError, match="multiple of kv_heads"):
    paged_decode_attention(q[:, :3], k_cache, v_cache, tables, ctx, 1.0)

# %% [markdown]
# ## Prefill attention over the varlen batch
#
# Many query tokens per sequence, causal. A program takes `BLOCK_M` consecutive new tokens of
# one sequence and *all* the query heads of one KV head: its rows are (token, head in group)
# pairs, so the K/V tiles it reads serve `BLOCK_M x group` rows (the same GQA packing as decode).
# It walks the keys from 0 to the position of its last token; the causal mask cuts the rest.
# `max_query_len` (a host int: the scheduler knows it) sizes the grid; tiles past a sequence's
# last token return at once. `kernels_lab/prefill_attention.py` has the naive one-row-per-
# program version and a one-head-per-program tiled one this beat.
#
# Triton compiles a kernel once per *specialisation* of its integer arguments: a value of 1, or a
# multiple of 16, each get their own compiled code. The block table's row stride is its width,
# which follows the longest sequence of the step: 1 in a warm-up of short prompts, then a multiple
# of 16 or not in a real batch, so the first steps of a run compiled the kernel twice more, over a
# second each, inside the run (two H200s: a W2 run's prefill steps of 1.48 s and 1.31 s
# against ~0.1 s). `do_not_specialize` keeps one compiled kernel for every width.

# %%
#| export
PREFILL_ROWS = 64  # rows of a program's query tile: tokens x heads of the group
PREFILL_BLOCK_N = 64  # keys per tile


@triton.jit(do_not_specialize=["stride_tb"])  # the table's width changes from step to step: one compiled kernel for all
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_kb, stride_kt, stride_kh, qk_scale,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    tile, seq, kv_head = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    first = tile * BLOCK_M
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
    q = tl.load(q_ptr + row_t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    row_pos = ctx - q_len + token
    full_end = (ctx - q_len + first) // BLOCK_N * BLOCK_N  # keys every row of the tile sees: no mask
    end = tl.minimum(ctx, ctx - q_len + first + BLOCK_M)  # one past the last token's position
    k_ptr, v_ptr, tables_ptr = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_kh, tables_ptr + seq * stride_tb
    acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr, 0, full_end, stride_kb,
                                 stride_kt, offs_d, d_mask, qk_scale, False, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
    acc, m_i, l_i = _attend_keys(q, row_pos, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr, full_end, end, stride_kb,
                                 stride_kt, offs_d, d_mask, qk_scale, True, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + row_t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, scale: float,
                            impl: str = "auto", rows: int = PREFILL_ROWS, block_n: int = PREFILL_BLOCK_N,
                            num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    "Causal varlen attention: q [T, Hq, D], sequence b's rows query_start[b]:query_start[b+1] -> [T, Hq, D]."
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if query_start.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start must be [B+1] = [{block_tables.shape[0] + 1}], got {tuple(query_start.shape)}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if kernel_backend(q.device, impl) == "torch":
        return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start, context_lens, scale)
    q_heads, head_dim = q.shape[1:]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    group_pad = _pow2(group)
    block_m = max(1, rows // group_pad, -(-16 // group_pad))  # tensor-core tiles need >= 16 rows
    out = torch.empty_like(q)
    grid = (-(-max_query_len // block_m), block_tables.shape[0], kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * math.log2(math.e),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, UPCAST=INTERPRETED, PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or (4 if block_m * group_pad <= 64 else 8), **_stages(num_stages))
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
got = paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, max(num_new), 32**-0.5, impl="triton")
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: as for decode, sums in another order
with pytest.raises(ValueError, match=r"query_start must be \[B\+1\] = \[4\]"):
    paged_prefill_attention(q, k_cache, v_cache, tables, query_start[:3], ctx, 20, 1.0)


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
        self.scale = cache.config.head_dim ** -0.5

    @property
    def rope_inside(self) -> bool:
        "Decodes only: the decode kernel applies q/k-norm and RoPE too (chapter 09a hands over q and k unrotated)."
        return self.max_query_len == 1 and FUSED_NORM_ROPE

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: NormRope | None = None) -> torch.Tensor:
        layout, cache = self.layout, self.cache
        if rope is not None and self.max_query_len != 1:
            raise ValueError("rope (q/k-norm and RoPE inside attention) is for decode steps only")
        if q.shape[0] != layout.num_tokens:
            raise ValueError(f"the step has {layout.num_tokens} tokens, attention got {q.shape[0]}")
        k_cache, v_cache = cache.k_cache[layer], cache.v_cache[layer]
        if self.max_query_len == 1:  # decodes only: the decode attention stores their K/V (chapter 09b's graphs too)
            return paged_decode_attention(q, k_cache, v_cache, layout.block_tables, layout.context_lens,
                                          self.scale, self.impl, new_kv=(k, v, layout.slot_mapping), rope=rope)
        cache.write(layer, layout.slot_mapping, k, v)
        return paged_prefill_attention(q, k_cache, v_cache, layout.block_tables, layout.query_start,
                                       layout.context_lens, self.max_query_len, self.scale, self.impl)


class KernelDecodeAttention:
    """Chapter 09b's graph-safe decode attention on a GPU: `paged_decode_attention`, which also stores the step's new
    K/V (`new_kv`), in the same launch with FUSED_KV_STORE, and applies q/k-norm and RoPE (`rope`) with
    FUSED_NORM_ROPE."""
    stores_kv = True

    def __init__(self, impl: str = "auto"):
        self.impl, self.counters = impl, None  # the last-split-merges counters: zeros, kept across calls and graphs

    def _counters(self, needed: int, device: torch.device) -> torch.Tensor:
        "Counters for `needed` (sequence, KV head) pairs. They grow only outside a CUDA graph recording (chapter 09b warms up at its largest batch first)."
        if self.counters is None or self.counters.numel() < needed or self.counters.device != device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"decode attention: {needed} merge counters needed while a CUDA graph records; "
                                   "call it once at the largest batch before recording")
            self.counters = torch.zeros(needed, device=device, dtype=torch.int32)
        return self.counters

    @property
    def rope_inside(self) -> bool: return FUSED_NORM_ROPE  # read when a graph is recorded

    def __call__(self, q, k_layer, v_layer, block_tables, context_lens, new_kv=None,
                 rope: NormRope | None = None) -> torch.Tensor:
        return paged_decode_attention(q, k_layer, v_layer, block_tables, context_lens, q.shape[-1] ** -0.5, self.impl,
                                      new_kv=new_kv, rope=rope,
                                      counters=self._counters(q.shape[0] * k_layer.shape[2], q.device))


# %% [markdown]
# The test that matters again: the tiny Qwen3 gives the same logits through the kernels as
# through chapter 05's reference backend, over a chunked prompt, a mixed step and decodes.

# %%
from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
from forge_engine.model import empty_model, init_random_weights

model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
caches = {name: PagedKVCache(model.config, num_blocks=12, block_size=4) for name in ("reference", "kernels")}
backends = {"reference": PagedAttention, "kernels": lambda c, lay: KernelPagedAttention(c, lay, impl="triton")}
steps = [([([7, 2, 9, 4], 0, 6)], [3, 14, 15, 92, 65, 35]),
         ([([7, 2, 9, 4], 6, 4), ([1, 5], 0, 3)], [89, 79, 32, 38, 7, 8, 9]),
         ([([7, 2, 9, 4], 10, 1), ([1, 5], 3, 1)], [46, 26])]
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
# decode kernel in CUDA C++ just in time (a warp per key, later eight keys in flight per warp,
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
    k_cache, v_cache, tables = random_paged_kv(lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    ctx = torch.tensor(lens, device="cuda")
    want = paged_attention_reference(q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, device="cuda"),
                                     ctx, 128**-0.5)
    # bf16: the softmax weights rounded before P·V and the output rounded (2^-8 each); the norm: the normalised row
    # and the output rounded: as in tests/test_kernels.py's TOL
    torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, ctx, 128**-0.5), want,
                               rtol=5e-2, atol=1e-2)
    x, r, w = (torch.randn(n, q4b.hidden_size, device="cuda", dtype=torch.bfloat16) for n in (64, 64, 1))
    torch.testing.assert_close(add_rmsnorm(x, r, w[0], 1e-6)[0], add_rmsnorm_reference(x, r, w[0], 1e-6)[0],
                               rtol=5e-2, atol=1e-2)
