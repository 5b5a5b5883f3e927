# %% [markdown]
# # Kernels: the Gated DeltaNet's decode and prefill
#
# > Triton kernels for the steps that read and write a Gated DeltaNet state in a pool of them: one token's update of the recurrent state, the short convolution of one token and of a step's prompts, and a prompt's recurrence by chunks of 64 with `tl.dot`, each against chapter 03b's PyTorch.

# %% [markdown]
# Chapter 03b runs the Gated DeltaNet on one sequence, whose states it keeps in a dict. A serving
# engine keeps them in a **pool**: row `s` of `state [S, value heads, Dk, Dv]` (fp32) is the
# recurrent memory of whichever sequence holds slot `s`, and row `s` of `conv_state [S, K-1, C]`
# holds its last `K - 1` convolution inputs. A step hands the kernels its rows of new tokens and
# each sequence's slot; the kernels read that row of the pool and write it back **in place**. The
# other rows are never touched, and a sequence that starts in this step (`fresh`) never reads its
# row: whatever a finished sequence left there is as good as zeros.
#
# Four entry points, each a Triton kernel on a CUDA tensor and chapter 03b's PyTorch elsewhere
# (chapter 09's `kernel_backend`, `impl=` to force either):
#
# - `gated_delta_decode`: one new token for each of `B` sequences. The token's q and k come
#   straight from the convolution (the kernel L2-normalizes them and scales q by `1/√Dk`, as
#   chapter 03b's `normalized_heads` does), and value head `h` reads key head `h // (Hv / Hk)`.
# - `causal_conv1d_decode`: one new input per sequence through the short convolution, then SiLU.
# - `causal_conv1d_prefill`: the new inputs of several sequences, flattened (`cu_seqlens` marks
#   where each starts), through the convolution in one launch, and each sequence's new window
#   into the pool in a second.
# - `gated_delta_prefill`: the new tokens of several sequences, flattened (`cu_seqlens` marks
#   where each starts), by chunks of 64 tokens within each sequence as chapter 03b derives it.
#
# The PyTorch reference of each is built from chapter 03b's functions; the tests below run the
# Triton kernels under Triton's interpreter on a CPU, in fp32, against them.
# `kernels_lab/gated_delta.py` times them on a GPU.
#
# ## What the floor is
#
# At Qwen3.5-4B's linear layers (16 key heads and 32 value heads of 128 dims, a convolution of 4
# over 8,192 channels; 24 of its 32 layers) a sequence's recurrent state is 32 × 128 × 128 × 4 B =
# 2 MiB a layer. A decode update must read it and write it: 4.2 MB a layer at batch 1, 67 MB at
# batch 16, against a few KiB of q, k, v. At the H200's 4.19 TB/s (`kernels_lab/common.py`) that is
# 1.0 µs and 16 µs a layer: the floor is the state's bytes, so the kernel reads and writes each
# state exactly once, in one launch, with the L2 norms fused. (At batch 1 the launch itself costs
# more than 1 µs: what matters there is to be one launch, not seven.) A prompt of `T` tokens
# reads and writes about 33 KB a token a layer (q, k, v in bf16, the fp32 output), 4.5 µs at 512
# tokens and 33 µs at 4,096, and computes about 5.4 MFLOP a token a layer (mostly `64 × 128` by
# `128 × 128` products): the lab prints both next to its timings.

# %%
#| default_exp gated_delta

# %%
#| export
import torch
import torch.nn.functional as F

from forge_engine.kernels.backend import _pow2, kernel_backend, tl, triton
from forge_engine.qwen3_5 import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    normalized_heads,
)

# %%
#| hide
import pytest

gen = torch.Generator().manual_seed(0)


def random_inputs(T, Hk=2, Hv=4, Dk=16, Dv=24, dtype=torch.float32, device="cpu", seed=0):
    "q, k [T, Hk, Dk] as the convolution gives them (not normalized), v [T, Hv, Dv], g, beta [T, Hv] fp32."
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, Hk, Dk, generator=g) for _ in range(2))
    v = torch.randn(T, Hv, Dv, generator=g)
    decay = F.logsigmoid(2 * torch.randn(T, Hv, generator=g))  # from ~0 (remember) to ~-8 (forget)
    beta = torch.sigmoid(torch.randn(T, Hv, generator=g))
    return [x.to(device, dtype) for x in (q, k, v)] + [x.to(device) for x in (decay, beta)]


# %% [markdown]
# ## The references
#
# Each reference gathers its sequences' rows of the pool, runs chapter 03b's function and
# scatters the new states back. The decode update is chapter 03b's token-by-token rule with the
# batch folded into the heads (one token of `B` sequences of `Hv` heads is one token of `B·Hv`
# heads); the convolution is `causal_conv1d_step` mapped over the batch, or chapter 03b's
# `causal_conv1d` one prompt after another; the prefill is the chunked rule, one sequence after
# another. They are what the engine runs off a GPU, and what the kernels must match. Slots must
# be distinct: a sequence has one row of the pool.

# %%
#| export
def gated_delta_decode_reference(q, k, v, g, beta, state, slots) -> torch.Tensor:
    """Chapter 03b's token-by-token rule for one token of each of B sequences: the arguments of
    `gated_delta_decode`. Updates state[slots] in place; -> out [B, Hv, Dv] fp32."""
    B, Hv = g.shape
    Dk, Dv = state.shape[-2:]
    slots = slots.long()
    qn, kn = normalized_heads(q, k, Hv)  # [B, Hv, Dk] fp32, q scaled by Dk**-0.5
    out, new = (
        gated_delta_rule_recurrent(  # the batch folded into the heads: one token of B*Hv heads
            qn.reshape(1, B * Hv, Dk),
            kn.reshape(1, B * Hv, Dk),
            v.float().reshape(1, B * Hv, Dv),
            g.float().reshape(1, B * Hv),
            beta.float().reshape(1, B * Hv),
            state[slots].reshape(B * Hv, Dk, Dv),
        )
    )
    state[slots] = new.view(B, Hv, Dk, Dv)
    return out.view(B, Hv, Dv)


def causal_conv1d_decode_reference(x, conv_state, weight, slots, silu=True) -> torch.Tensor:
    """Chapter 03b's `causal_conv1d_step` (then SiLU) for one input of each of B sequences: the arguments of
    `causal_conv1d_decode`. Updates conv_state[slots] in place; -> y [B, C] in x's dtype."""
    slots = slots.long()
    y, new = torch.vmap(causal_conv1d_step, in_dims=(0, None, 0))(x, weight, conv_state[slots])
    conv_state[slots] = new.to(conv_state.dtype)
    return (F.silu(y) if silu else y).to(x.dtype)


def gated_delta_prefill_reference(
    q, k, v, g, beta, cu_seqlens, state, slots, fresh, chunk_size: int = 64
) -> torch.Tensor:
    """Chapter 03b's chunked rule over each sequence of the flattened rows: the arguments of `gated_delta_prefill`.
    Writes each sequence's final state into state[slots[n]]; -> out [T, Hv, Dv] fp32."""
    Hv, Dv = v.shape[1], v.shape[2]
    qn, kn = normalized_heads(q, k, Hv)
    out = torch.zeros(q.shape[0], Hv, Dv, dtype=torch.float32, device=q.device)
    bounds, slots, fresh = cu_seqlens.tolist(), slots.tolist(), fresh.tolist()
    for n, slot in enumerate(slots):
        a, b = bounds[n], bounds[n + 1]
        before = None if fresh[n] else state[slot]
        if a == b:  # no new tokens: a fresh sequence's state is zeros, another's stays
            state[slot] = 0.0 if before is None else before
            continue
        out[a:b], state[slot] = gated_delta_rule_chunked(
            qn[a:b], kn[a:b], v[a:b].float(), g[a:b].float(), beta[a:b].float(), before, chunk_size
        )
    return out


# %% [markdown]
# A prompt through the prefill reference, then three tokens through the decode reference, is
# chapter 03b's recurrence over the whole sequence; the other rows of the pool stay as they were:

# %%
q, k, v, g, beta = random_inputs(70, seed=1)
pool = torch.randn(3, 4, 16, 24, generator=gen)
before = pool.clone()
qn, kn = normalized_heads(q, k, 4)
want_out, want_state = gated_delta_rule_recurrent(qn, kn, v, g, beta)
got = [
    gated_delta_prefill_reference(
        q[:67],
        k[:67],
        v[:67],
        g[:67],
        beta[:67],
        torch.tensor([0, 67]),
        pool,
        torch.tensor([1]),
        torch.tensor([True]),
    )
]
for t in range(67, 70):
    one = slice(t, t + 1)
    got.append(
        gated_delta_decode_reference(
            q[one], k[one], v[one], g[one], beta[one], pool, torch.tensor([1])
        )
    )
# fp32: the chunked form's sums in another order (chapter 03b: 2e-6 measured)
torch.testing.assert_close(torch.cat(got), want_out, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(pool[1], want_state, rtol=1e-4, atol=1e-5)
assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])

# %% [markdown]
# ## The decode update: one program per (sequence, value head, slice of Dv)
#
# For one token, chapter 03b's rule on a head's state `S [Dk, Dv]` is
#
# ```
# S ← exp(g) S;   δ = β (v − Sᵀk);   S ← S + k δᵀ;   o = Sᵀq
# ```
#
# Every column of `S` (every value dim) is updated independently of the others, given the whole
# of `k`, `q`, `g` and `β`. So one program takes a slice of `BLOCK_V` columns of one head of one
# sequence: it loads the key head's q and k (`Dk` numbers each, shared by the group of value
# heads), normalizes them, reads its `[Dk, BLOCK_V]` tile of the state once, does the four lines
# in registers, and writes the tile back once. Nothing is read twice and no other launch is
# needed. The slice is what gives a batch of one enough programs: 32 heads make 32 programs of
# 64 KiB each, too few to keep an H200's 132 SMs reading, while slices of 16 columns make 256.
# `state_block_v` picks the widest slice (16 to 64) that still gives 256 programs, run by 4
# warps (8 for 64 columns: compiled for an H200, a `128 × 64` fp32 tile spills at 4);
# `kernels_lab/gated_delta.py` sweeps the slice and the warps to check that choice.

# %%
#| export
L2NORM_EPS = 1e-6  # chapter 03b's l2norm: x / sqrt(sum(x^2) + eps)


def state_block_v(programs: int, dv: int, widest: int = 64, target: int = 256) -> int:
    """Columns of the state a decode program takes: the widest of `widest`, ..., 32, 16 that still gives `target`
    programs when `programs` (sequences x value heads) programs take one slice each. (256: two per SM of an H200;
    the lab sweeps.)"""
    block = min(widest, max(16, _pow2(dv)))
    while block > 16 and programs * -(-dv // block) < target:
        block //= 2
    return block


@triton.jit
def _l2_normalized_rows(x, eps):
    "Each row of x [R, D] fp32 divided by its length (eps inside the root), as chapter 03b's l2norm."
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]


@triton.jit
def _gated_delta_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_gh,
    stride_bb,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ob,
    stride_oh,
    scale,
    eps,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (sequence b x value head h, slice j): columns j*BLOCK_V.. of head h's state in the pool row slots[b],
    read once, updated by the token, written once; and those columns of the head's output."""
    bh, j = tl.program_id(0), tl.program_id(1)
    b, h = bh // HV, bh % HV
    kh = h // GROUP  # the key head this value head reads
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = j * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tile = (
        state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    )
    tile_mask = mask_k[:, None] & mask_v[None, :]
    S = tl.load(
        tile, mask=tile_mask, other=0.0
    )  # the loads go out first: the state is what takes time
    q = tl.load(q_ptr + b * stride_qb + kh * stride_qh + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + b * stride_kb + kh * stride_kh + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_v, mask=mask_v, other=0.0).to(
        tl.float32
    )
    g = tl.load(g_ptr + b * stride_gb + h * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bb + h * stride_bh).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    S = S * tl.exp(g)  # forget
    delta = beta * (v - tl.sum(S * k[:, None], axis=0))  # what S recalls at k, moved towards v
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)  # read with the query
    tl.store(tile, S, mask=tile_mask)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_v, o, mask=mask_v)


def _check_unit_stride(name: str, *tensors: torch.Tensor):
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{name} needs unit stride in the last dimension of its inputs")


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    impl: str = "auto",
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One new token for each of B sequences. q, k [B, Hk, Dk] (conv output after SiLU, NOT yet l2-normalized: the
    kernel l2-normalizes both and scales q by Dk**-0.5); v [B, Hv, Dv]; g, beta [B, Hv] fp32 (g: log decay, beta in
    (0,1)); state [S, Hv, Dk, Dv] fp32: a pool of S states, row slots[b] is sequence b's, read and updated IN PLACE;
    slots [B] int (int32 or int64). Value head h reads key head h // (Hv // Hk). -> out [B, Hv, Dv] fp32."""
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if (
        k.shape != q.shape
        or v.shape[0] != B
        or g.shape != (B, Hv)
        or beta.shape != (B, Hv)
        or slots.shape != (B,)
        or state.shape[1:] != (Hv, Dk, Dv)
        or Hv % Hk
    ):
        raise ValueError(
            f"gated_delta_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, slots {tuple(slots.shape)} do not fit a pool of {tuple(state.shape)}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be fp32, got {state.dtype}")
    if kernel_backend(q.device, impl) == "torch":
        return gated_delta_decode_reference(q, k, v, g, beta, state, slots)
    _check_unit_stride("gated_delta_decode", q, k, v, state)
    out = torch.empty(B, Hv, Dv, dtype=torch.float32, device=q.device)
    block_v = block_v or state_block_v(B * Hv, Dv)
    if B:
        _gated_delta_decode_kernel[(B * Hv, triton.cdiv(Dv, block_v))](
            q,
            k,
            v,
            g,
            beta,
            state,
            slots,
            out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            g.stride(1),
            beta.stride(0),
            beta.stride(1),
            state.stride(0),
            state.stride(1),
            state.stride(2),
            out.stride(0),
            out.stride(1),
            Dk**-0.5,
            L2NORM_EPS,
            HV=Hv,
            GROUP=Hv // Hk,
            DK=Dk,
            DV=Dv,
            BLOCK_K=max(16, _pow2(Dk)),
            BLOCK_V=block_v,
            num_warps=num_warps or (8 if block_v >= 64 else 4),  # a 128 x 64 fp32 tile spills at 4
        )
    return out


# %% [markdown]
# Against the reference: three sequences in a pool of six, slots out of order (int32, then int64),
# two value heads a key head, Dk ≠ Dv with Dv no power of two (the last slice of 16 columns is
# half masked), the slice of 16 and of 32 columns. The rows of the pool no sequence holds keep
# their bits.

# %%
for Hk, slot_dtype, block_v in ((2, torch.int32, 16), (4, torch.int64, 32)):
    q, k, v, g, beta = random_inputs(3, Hk=Hk, seed=2)
    pool = 0.5 * torch.randn(6, 4, 16, 24, generator=gen)
    slots = torch.tensor([4, 1, 2], dtype=slot_dtype)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_decode_reference(q, k, v, g, beta, want_pool, slots)
    got = gated_delta_decode(q, k, v, g, beta, got_pool, slots, impl="triton", block_v=block_v)
    # fp32: the same operations, sums of 16 products in another order: a few 1e-7 of values ~1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-5)
    untouched = [0, 3, 5]
    assert torch.equal(got_pool[untouched], pool[untouched])
    assert torch.equal(
        gated_delta_decode(q, k, v, g, beta, pool, slots), want
    )  # on a CPU: the reference
with pytest.raises(ValueError, match="do not fit a pool"):
    gated_delta_decode(q, k, v, g[:2], beta, pool, slots)
with pytest.raises(ValueError, match="must be fp32"):
    gated_delta_decode(q, k, v, g, beta, pool.double(), slots)

# %% [markdown]
# ## The short convolution of one token
#
# Each channel `c` of the token's input goes through a window of its last `K` inputs: the `K - 1`
# in the pool row, oldest first, then the new one. One program takes `BLOCK_C` channels of one
# sequence: it reads the `K - 1` stored inputs and the new one, sums them times the channel's
# kernel in fp32, applies SiLU, writes the output, and shifts the window in the pool (each row
# takes the next one, the last takes the new input). A thread owns its channels from the first
# load to the last store, so the shift in place needs no barrier.

# %%
#| export
CONV_BLOCK_C = 256  # channels a program of the convolution takes (the lab sweeps it)


@triton.jit
def _causal_conv1d_decode_kernel(
    x_ptr,
    conv_ptr,
    w_ptr,
    slots_ptr,
    y_ptr,
    stride_xb,
    stride_cs,
    stride_ck,
    stride_wc,
    stride_yb,
    C,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SILU: tl.constexpr,
):
    """Program (sequence b, channel block j): the window of K inputs of channels j*BLOCK_C.. times their kernels,
    SiLU, and the window in the pool row slots[b] moved on by one input."""
    b, j = tl.program_id(0), tl.program_id(1)
    c = j * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = conv_ptr + slot * stride_cs + c
    x = tl.load(x_ptr + b * stride_xb + c, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + c * stride_wc + (K - 1), mask=mask, other=0.0).to(
        tl.float32
    )
    for i in tl.static_range(
        K - 1
    ):  # the stored inputs, oldest first, meet the kernel's first taps
        earlier = tl.load(row + i * stride_ck, mask=mask, other=0.0)
        acc += earlier.to(tl.float32) * tl.load(w_ptr + c * stride_wc + i, mask=mask, other=0.0).to(
            tl.float32
        )
        if i > 0:  # input i moves to row i - 1 (row i - 1 was read one step before)
            tl.store(row + (i - 1) * stride_ck, earlier, mask=mask)
    tl.store(row + (K - 2) * stride_ck, x.to(conv_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * stride_yb + c, acc.to(y_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    silu: bool = True,
    *,
    impl: str = "auto",
    block_c: int = CONV_BLOCK_C,
    num_warps: int = 2,
) -> torch.Tensor:
    """x [B, C] (one new input per sequence); conv_state [S, K-1, C] (a pool; row slots[b] holds sequence b's last K-1
    inputs, oldest first, updated IN PLACE to the last K-1 inputs including x); weight [C, K]. -> y [B, C] in x's dtype,
    y = silu(sum over the window of K inputs times weight) when silu, like chapter 03b's causal_conv1d_step (+ F.silu)."""
    B, C = x.shape
    K = weight.shape[1]
    if weight.shape != (C, K) or conv_state.shape[1:] != (K - 1, C) or slots.shape != (B,) or K < 2:
        raise ValueError(
            f"causal_conv1d_decode: x {tuple(x.shape)}, weight {tuple(weight.shape)}, slots {tuple(slots.shape)} "
            f"do not fit a pool of {tuple(conv_state.shape)}"
        )
    if kernel_backend(x.device, impl) == "torch":
        return causal_conv1d_decode_reference(x, conv_state, weight, slots, silu)
    _check_unit_stride("causal_conv1d_decode", x, conv_state, weight)
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B:
        _causal_conv1d_decode_kernel[(B, triton.cdiv(C, block_c))](
            x,
            conv_state,
            weight,
            slots,
            y,
            x.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            weight.stride(0),
            y.stride(0),
            C,
            K=K,
            BLOCK_C=block_c,
            SILU=silu,
            num_warps=num_warps,
        )
    return y


# %% [markdown]
# Against the reference, with and without SiLU, a channel count that is no multiple of the block,
# and slots that skip rows of the pool:

# %%
x, weight = torch.randn(3, 40, generator=gen), torch.randn(40, 4, generator=gen)
conv_pool = torch.randn(5, 3, 40, generator=gen)
slots = torch.tensor([3, 0, 4], dtype=torch.int32)
for silu in (True, False):
    got_pool, want_pool = conv_pool.clone(), conv_pool.clone()
    got = causal_conv1d_decode(x, got_pool, weight, slots, silu, impl="triton", block_c=16)
    want = causal_conv1d_decode_reference(x, want_pool, weight, slots, silu)
    # fp32: four products summed in another order: a few ulps of values ~2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool, want_pool)  # the window moved on: the same numbers, copied
    assert torch.equal(got_pool[3, -1], x[0]) and torch.equal(got_pool[1:3], conv_pool[1:3])

# %% [markdown]
# ## The short convolution of prompts
#
# A step's prompts and prompt chunks go through the convolution together: their rows flattened,
# `cu_seqlens` marking where each sequence starts, as for the prefill below. Output row `t` of
# sequence `n` is its window of `K` inputs, `t - K + 1` to `t`; the taps that fall before the
# sequence's first row read the pool row `slots[n]` (the inputs of its earlier steps, or zeros when
# it is `fresh`). Then the pool row takes the sequence's last `K - 1` inputs. A sequence shorter
# than `K - 1` rows keeps part of its old window: its new state is the old one moved on by the
# new inputs, as `K - 1` decodes would leave it. A sequence with no new rows (`cu_seqlens`
# repeated) keeps its state, or gets zeros when it starts.
#
# **The grid comes from the shapes.** The engine records its steps as CUDA graphs, so the launch
# cannot depend on the lengths, which are on the device. One program takes a block of `BLOCK_T`
# rows and `BLOCK_C` channels of the flattened rows: `⌈T / BLOCK_T⌉ × ⌈C / BLOCK_C⌉` programs,
# none of them idle whatever the lengths. A row finds its sequence by binary search in
# `cu_seqlens`: the last `n` with `cu_seqlens[n] ≤ t`, which steps over empty sequences. That is
# `⌈log₂ N⌉` loads of a few hundred bytes that stay in L1, against the block's `K` loads of inputs.
# A block may hold the end of one sequence and the start of the next: every row has its own
# sequence, start and slot. The other grid, one program per (sequence, block of its rows), has to
# be sized for the longest sequence (the step's row count when the host does not know it): with
# many short prompts, most of its programs would have nothing to do.
#
# **The state is written by a second launch.** The outputs of a sequence's first `K - 1` rows
# read the old state, and those rows may be in different blocks; a program that wrote the new
# state could run before another has read the old one. So the first kernel only reads the pool,
# and a second, one program per (sequence, block of channels), writes each sequence's new window
# once the first has finished (the stream orders them). Its program builds row `i` of the window
# from the input at `end - K + 1 + i`: a new input, or, for a short sequence, the old row
# `L + i` (`L` new rows). Rows are written in order and each reads a row at or after itself, so
# the shift in place needs no barrier, as in the decode. It moves `N × (K - 1) × C` elements:
# a launch's cost, against the host loop of one convolution and one copy per sequence per layer
# it replaces.
#
# The floor is the inputs read and the outputs written: `T × C × 2` bytes each way in bf16, at
# Qwen3.5-4B's 8,192 channels 16.8 MB at 512 tokens (4.0 µs at 4.19 TB/s) and 134 MB at 4,096
# (32 µs). The `K` taps of a row read its inputs `K` times, but from one tile of rows that the
# caches hold: DRAM sees them once. Only a block with rows less than `K - 1` after their
# sequence's start loads window rows from the pool (a branch on the block, so most blocks of a
# long prompt skip those loads). The tile is 16 rows by 128 channels at 4 warps: each tap's tile
# of 64-bit pointers takes registers, and compiled for an H200 (the lab's `--sass`) it takes 128
# registers a thread and spills nothing, 16 × 256 takes 198. The lab times the tiles around it.

# %%
#| export
# rows x channels a program of the prompts' convolution takes (the lab sweeps them)
CONV_PREFILL_TILE = (16, 128)


def causal_conv1d_prefill_reference(
    x, conv_state, weight, cu_seqlens, slots, fresh, silu=True
) -> torch.Tensor:
    """Chapter 03b's `causal_conv1d` (then SiLU) over each sequence of the flattened rows: the arguments of
    `causal_conv1d_prefill`. Writes each sequence's last K-1 inputs into conv_state[slots[n]]; -> y [T, C]."""
    y = torch.empty_like(x)
    bounds, slots, fresh = cu_seqlens.tolist(), slots.tolist(), fresh.tolist()
    for n, slot in enumerate(slots):
        a, b = bounds[n], bounds[n + 1]
        before = None if fresh[n] else conv_state[slot]
        if a == b:  # no new inputs: a fresh sequence's window is zeros, another's stays
            conv_state[slot] = 0.0 if before is None else before
            continue
        out, conv_state[slot] = causal_conv1d(x[a:b], weight, before)
        y[a:b] = F.silu(out) if silu else out
    return y


@triton.jit(
    do_not_specialize=["T", "N", "SEARCH_STEPS"]
)  # the step's rows and sequences change from step to step: one kernel for all, not a compile per value
def _causal_conv1d_prefill_kernel(
    x_ptr,
    conv_ptr,
    w_ptr,
    cu_ptr,
    slots_ptr,
    fresh_ptr,
    y_ptr,
    stride_xt,
    stride_cs,
    stride_ck,
    stride_wc,
    stride_yt,
    T,
    C,
    N,
    SEARCH_STEPS,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SILU: tl.constexpr,
):
    """Program (row block i, channel block j): rows i*BLOCK_T.. and channels j*BLOCK_C.. of y. Each row finds its
    sequence in cu_seqlens; a tap before the sequence's first row reads the pool row slots[n] (zeros when fresh).
    Reads the pool, never writes it."""
    i, j = tl.program_id(0), tl.program_id(1)
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    c = j * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t, mask_c = t < T, c < C
    # each row's sequence: the last n with cu_seqlens[n] <= t (so past the empty ones), kept in lo
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (N - 1)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        at_or_before = tl.load(cu_ptr + mid) <= t
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid - 1)
    start = tl.load(cu_ptr + lo).to(tl.int64)
    slot = tl.load(slots_ptr + lo).to(tl.int64)
    carried = mask_t & (tl.load(fresh_ptr + lo).to(tl.int32) == 0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(K):  # oldest input first, as the kernel's taps
        p = t.to(tl.int64) - (K - 1) + tap  # the input row this tap reads
        inputs = tl.load(
            x_ptr + p[:, None] * stride_xt + c[None, :],
            mask=(mask_t & (p >= start))[:, None] & mask_c[None, :],
            other=0.0,
        )
        tap_weights = tl.load(w_ptr + c * stride_wc + tap, mask=mask_c, other=0.0)
        acc += inputs.to(tl.float32) * tap_weights.to(tl.float32)[None, :]
    # rows less than K-1 after their sequence's start also read its window in the pool: a block
    # without any (most of a long prompt's) skips these loads
    if tl.min(tl.where(mask_t, t - start, K - 1)) < K - 1:
        for tap in tl.static_range(K - 1):  # the last tap is the row itself, never before it
            p = t.to(tl.int64) - (K - 1) + tap
            earlier = tl.load(  # window row K-1 + (p - start), zeros where p is in the sequence
                conv_ptr
                + slot[:, None] * stride_cs
                + (p - start + (K - 1))[:, None] * stride_ck
                + c[None, :],
                mask=(carried & (p < start))[:, None] & mask_c[None, :],
                other=0.0,
            )
            tap_weights = tl.load(w_ptr + c * stride_wc + tap, mask=mask_c, other=0.0)
            acc += earlier.to(tl.float32) * tap_weights.to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(
        y_ptr + t.to(tl.int64)[:, None] * stride_yt + c[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_c[None, :],
    )


@triton.jit
def _conv_state_prefill_kernel(
    x_ptr,
    conv_ptr,
    cu_ptr,
    slots_ptr,
    fresh_ptr,
    stride_xt,
    stride_cs,
    stride_ck,
    C,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (sequence n, channel block j): the sequence's last K-1 inputs of channels j*BLOCK_C.. into its pool
    row, oldest first; for a sequence of fewer than K-1 new rows the first ones come from the row's own window (zeros
    when fresh). Launched after the convolution, which reads the old windows."""
    n, j = tl.program_id(0), tl.program_id(1)
    c = j * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    carried = tl.load(fresh_ptr + n).to(tl.int32) == 0
    row = conv_ptr + tl.load(slots_ptr + n).to(tl.int64) * stride_cs + c
    for i in tl.static_range(K - 1):
        p = end - (K - 1) + i  # the input that becomes row i of the window
        new = tl.load(x_ptr + p * stride_xt + c, mask=mask & (p >= start), other=0.0)
        # before the sequence: the old row (end - start) + i, at or after row i, so not yet overwritten
        old = tl.load(
            row + (p - start + (K - 1)) * stride_ck, mask=mask & carried & (p < start), other=0.0
        )
        tl.store(
            row + i * stride_ck,
            tl.where(p >= start, new.to(conv_ptr.dtype.element_ty), old),
            mask=mask,
        )


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    silu: bool = True,
    *,
    impl: str = "auto",
    block_t: int = CONV_PREFILL_TILE[0],
    block_c: int = CONV_PREFILL_TILE[1],
    num_warps: int = 4,
) -> torch.Tensor:
    """x [T, C]: several sequences' new inputs flattened (sequence n is rows cu_seqlens[n]:cu_seqlens[n+1], the last
    entry T); conv_state [S, K-1, C] a pool (row slots[n] holds sequence n's last K-1 inputs before these, oldest
    first; ignored, as zeros, where fresh[n]); weight [C, K]. Writes each sequence's last K-1 inputs (counting the
    earlier ones when it has fewer than K-1 new rows) into conv_state[slots[n]] IN PLACE. -> y [T, C] in x's dtype:
    silu(conv) if silu, like chapter 03b's causal_conv1d (+ F.silu) a sequence at a time. Two launches, the grids
    from the shapes alone (nothing read back to the host): the convolution, then the new windows."""
    T, C = x.shape
    K = weight.shape[1]
    N = slots.shape[0]
    if (
        weight.shape != (C, K)
        or conv_state.shape[1:] != (K - 1, C)
        or cu_seqlens.shape != (N + 1,)
        or fresh.shape != (N,)
        or K < 2
    ):
        raise ValueError(
            f"causal_conv1d_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)}, cu_seqlens "
            f"{tuple(cu_seqlens.shape)}, slots {tuple(slots.shape)}, fresh {tuple(fresh.shape)} do not fit a pool of "
            f"{tuple(conv_state.shape)}"
        )
    if kernel_backend(x.device, impl) == "torch":
        return causal_conv1d_prefill_reference(
            x, conv_state, weight, cu_seqlens, slots, fresh, silu
        )
    _check_unit_stride("causal_conv1d_prefill", x, conv_state, weight)
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T:  # rows imply a sequence
        _causal_conv1d_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
            x,
            conv_state,
            weight,
            cu_seqlens,
            slots,
            fresh,
            y,
            x.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            weight.stride(0),
            y.stride(0),
            T,
            C,
            N,
            (N - 1).bit_length(),  # halvings of the N candidates down to one
            K=K,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            SILU=silu,
            num_warps=num_warps,
        )
    if N:  # after the convolution, in stream order: every old window has been read
        _conv_state_prefill_kernel[(N, triton.cdiv(C, block_c))](
            x,
            conv_state,
            cu_seqlens,
            slots,
            fresh,
            x.stride(0),
            conv_state.stride(0),
            conv_state.stride(1),
            C,
            K=K,
            BLOCK_C=block_c,
            num_warps=2,  # the decode's shape of work: K-1 rows of a block of channels
        )
    return y


# %% [markdown]
# Against the reference, in two layouts of a pool of eight rows with slots out of order: sequences
# of 1, 2 and 3 rows around a kernel of 4 (the new window mixes old and new inputs), an empty one
# fresh and an empty one carried, longer ones that blocks of 4 rows cut in the middle; kernels of
# 4 and of 2 taps, with and without SiLU, 40 channels in blocks of 16 (the last one half empty)
# and in one block of 64. The windows are copies of inputs, so the pool must match the reference bit for bit,
# and the rows no sequence holds must keep theirs.

# %%
layouts = [  # (lengths, slots, fresh)
    ([1, 0, 6, 2, 9, 0, 3], [5, 2, 0, 7, 3, 1, 6], [False, True, False, True, False, False, True]),
    ([11, 1, 4], [4, 1, 2], [True, False, False]),
]
for taps, (lengths, slots, fresh), block_t, block_c, silu in (
    (4, layouts[0], 4, 16, True),
    (4, layouts[1], 16, 64, False),
    (2, layouts[0], 16, 64, True),
):
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    slots, fresh = torch.tensor(slots, dtype=torch.int32), torch.tensor(fresh)
    x, weight = torch.randn(sum(lengths), 40, generator=gen), torch.randn(40, taps, generator=gen)
    conv_pool = torch.randn(8, taps - 1, 40, generator=gen)
    got_pool, want_pool = conv_pool.clone(), conv_pool.clone()
    args = (cu_seqlens, slots, fresh, silu)
    got = causal_conv1d_prefill(
        x, got_pool, weight, *args, impl="triton", block_t=block_t, block_c=block_c
    )
    want = causal_conv1d_prefill_reference(x, want_pool, weight, *args)
    # fp32: K products summed in another order: a few ulps of values ~2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool, want_pool)
    others = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(got_pool[others], conv_pool[others])
    assert torch.equal(
        causal_conv1d_prefill(x, conv_pool.clone(), weight, *args), want
    )  # on a CPU: the reference
with pytest.raises(ValueError, match="do not fit a pool"):
    causal_conv1d_prefill(x, conv_pool, weight, cu_seqlens[:-1], slots, fresh)

# %% [markdown]
# A prompt cut into chunks of 2, 1 and 5 rows, the chunks in steps of their own beside another
# sequence, then two tokens through the decode: chapter 03b's convolution of the whole sequence,
# and the window it ends with. A step with no rows at all still gives a fresh sequence its zeros.

# %%
x, weight = torch.randn(10, 40, generator=gen), torch.randn(40, 4, generator=gen)
whole, whole_state = causal_conv1d(x, weight)
conv_pool = torch.randn(3, 3, 40, generator=gen)
got = []
for a, b in ((0, 2), (2, 3), (3, 8)):
    other = torch.randn(3, 40, generator=gen)  # a sequence in slot 0, before ours in the rows
    y = causal_conv1d_prefill(
        torch.cat((other, x[a:b])),
        conv_pool,
        weight,
        torch.tensor([0, 3, 3 + b - a]),
        torch.tensor([0, 2]),
        torch.tensor([True, a == 0]),
        impl="triton",
    )
    got.append(y[3:])
for t in (8, 9):
    got.append(
        causal_conv1d_decode(x[t : t + 1], conv_pool, weight, torch.tensor([2]), impl="triton")
    )
torch.testing.assert_close(torch.cat(got), F.silu(whole), rtol=1e-5, atol=1e-5)
assert torch.equal(conv_pool[2], whole_state)
empty = causal_conv1d_prefill(
    x[:0],
    conv_pool,
    weight,
    torch.tensor([0, 0]),
    torch.tensor([1]),
    torch.tensor([True]),
    impl="triton",
)
assert empty.shape == (0, 40) and torch.equal(conv_pool[1], torch.zeros(3, 40))

# %% [markdown]
# ## The prefill, by chunks
#
# Chapter 03b's chunked form cuts a sequence into chunks of `C = 64` tokens. With `γ` the
# cumulative log decay from the chunk's start, the chunk's corrections solve one unit
# lower-triangular system, whose two right-hand sides need no state:
#
# ```
# W = (I + A)⁻¹ (β exp(γ) K)      U = (I + A)⁻¹ (β V)       A[t, s] = β_t exp(γ_t − γ_s) k_t·k_s, s < t
# ```
#
# and then, chunk after chunk, with the state `S` carried:
#
# ```
# Δ = U − W S;    O = (exp(γ) Q) S + (M ⊙ QKᵀ) Δ;    S ← exp(γ_C) S + (exp(γ_C − γ) K)ᵀ Δ
# ```
#
# Two kernels, one for each part:
#
# 1. **The solve**, one program per (chunk, value head), all chunks of all sequences at once. The
#    triangular inverse is the one step that is not a matrix product. The program splits the
#    chunk into four blocks of 16 tokens. Each diagonal block of `I + A` is inverted by doubling:
#    the inverse `T` of the diagonal blocks of size `m` gives that of the blocks of size `2m` as
#    `T − T N T`, `N` the lower-left quarter of each new block: from the unit diagonal, four
#    steps of two `16 × 16` products. The blocks below the diagonal are block forward
#    substitution, `T₁₀ = −T₁₁ A₁₀ T₀₀` and so on. All of it is products of `16 × 16` tiles on
#    the tensor cores, and all of it is substitution by blocks, which keeps the stability of
#    substitution row by row. (A power series such as `(I − A)(I + A²)(I + A⁴)…` is exact too in
#    exact arithmetic, but when keys are alike the powers of `A` grow to ~10¹⁸ and cancel to noise
#    in fp32; a test below feeds the kernel such keys.) Then `W` and `U`, block row by block row,
#    go to a scratch buffer in fp32: 1 KiB a token a head for the two.
# 2. **The state pass**, one program per (sequence, value head, slice of `BLOCK_V` columns of
#    `S`), walks its sequence's chunks in order with its `[Dk, BLOCK_V]` slice of `S` in
#    registers: it starts from zeros (`fresh`) or the pool row, does the three lines above with
#    `tl.dot` on `64 × Dk`, `64 × 64` and `Dk × BLOCK_V` tiles, and writes the slice to the pool
#    row at the end. The columns of `S` are independent here too, so the slices need nothing from
#    each other. Each slice recomputes the chunk's `QKᵀ`: that is the price of the parallelism
#    the slices buy at one long prompt (32 heads are 32 programs without them), which the lab
#    weighs by sweeping `BLOCK_V`.
#
# q and k are normalized where they are loaded, in both kernels: they are read twice but never
# written normalized. The tiles are fp32 and the products accumulate in fp32; their inputs are
# rounded to TF32 (10 bits) for bf16 inputs, which carry 8, and for fp32 inputs each product is
# three TF32 products (`tf32x3`, about fp32's accuracy): `ieee` products would leave the tensor
# cores, and compiled for an H200 they spill 12-21 KB of registers a thread. The state is fp32
# throughout.
#
# The tiles are measured. On an H100 (`LAB_PREFILL_ONLY=1 PYTHONPATH=. python3
# kernels_lab/gated_delta.py`, bf16, every `block_v` × warps × solve warps), a slice of 64
# columns with 4 warps and 4 solve warps was the fastest at every size: a step of 8 prompts of
# 1,024 tokens 1.22 ms against 2.77 ms for the earlier choice (32 columns or fewer, to give 256
# programs, with 8 warps), 80 prompts of 100 tokens 1.69 ms against 4.08, one prompt of 4,096
# 0.89 ms against 2.09. Wider slices recompute less (q, k, their products and the scores are
# computed once a slice). For fp32, 64 columns with 8 solve warps (the solve's fp32-accurate
# products) was fastest: 9.3 ms against 16.9 at 8 × 1,024. Served (`forge-engine bench w2 --model
# random:qwen3.5-4b`, the same card), W2's prefill steps took 2.8 s in all against 5.3, and its
# output rate went from 9,095 to 10,907 tok/s.
#
# What the lab's `--sass` shows, compiled for an H200 without one: the decode update takes 88
# registers a thread at 16 columns and spills nothing; the state pass holds every `64 × 128` fp32
# tile it needs (q, k, W and their scaled copies) at once and spills 0.9-2.4 KB a thread at every
# slice and warp count, the solve 0.8 KB. Products on bf16 tiles where the inputs are bf16 (half
# the registers, and half the scratch) are the change to try first once the lab has timed these.
#
# The scratch is the cost of this split: `W` and `U` are written and read again, 64 KB a token a
# layer against the 33 KB the prefill must move, so at 4,096 tokens the kernels move about three
# times the floor's bytes. Keeping them in bf16, or fusing the solve into the state pass (each
# slice would redo it), are the two ways down; the lab measures where the time goes first.
#
# Which chunks exist: chunk `c` of sequence `n` starts at row `cu_seqlens[n] + 64c`; the solve is
# launched over `N × ⌈max length / 64⌉ × Hv` programs, and those past their sequence's end return
# at once. Without `max_seqlen` the bound is the step's row count (no copy to the host, so a CUDA
# graph can hold it); with many sequences, pass it.

# %%
#| export
CHUNK = 64  # tokens of a chunk (chapter 03b)
SUB = 16  # tokens of a block of the solve: a chunk is four


def prefill_precision(dtype: torch.dtype) -> str:
    """The products' precision for inputs of `dtype` (the tiles are fp32 either way): TF32 for bf16 and fp16 inputs;
    for fp32 inputs three TF32 products per product, about fp32's accuracy ("ieee" would leave the tensor cores)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def _load_rows(
    ptr, row0, end, head, stride_t, stride_h, col0, D, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    "Rows row0..row0+ROWS of one head, columns col0..col0+BLOCK, as fp32; zeros past `end` and past D columns."
    rows, cols = row0 + tl.arange(0, ROWS), col0 + tl.arange(0, BLOCK)
    mask = (rows < end)[:, None] & (cols < D)[None, :]
    ptrs = ptr + rows.to(tl.int64)[:, None] * stride_t + head * stride_h + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(
    ptr, x, row0, end, head, stride_t, stride_h, col0, D, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    "x [ROWS, BLOCK] into rows row0.. (those before `end`) and columns col0.. (those before D) of one head."
    rows, cols = row0 + tl.arange(0, ROWS), col0 + tl.arange(0, BLOCK)
    mask = (rows < end)[:, None] & (cols < D)[None, :]
    tl.store(
        ptr + rows.to(tl.int64)[:, None] * stride_t + head * stride_h + cols[None, :], x, mask=mask
    )


@triton.jit
def _load_gates(
    g_ptr,
    beta_ptr,
    row0,
    end,
    h,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    gamma0,
    ROWS: tl.constexpr,
):
    """g and beta of rows row0..row0+ROWS of head h (zeros past `end`: no decay, no write) -> (beta, gamma: the
    cumulative log decay, gamma0 before the first row, and gamma after the last row)."""
    rows = row0 + tl.arange(0, ROWS)
    valid = rows < end
    rows = rows.to(tl.int64)
    g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=valid, other=0.0).to(
        tl.float32
    )
    return beta, gamma0 + tl.cumsum(g, axis=0), gamma0 + tl.sum(g, axis=0)


@triton.jit
def _decayed_gram(
    k_rows,
    beta_rows,
    gamma_rows,
    k_cols,
    gamma_cols,
    DIAGONAL: tl.constexpr,
    SUB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A block of A: beta_t exp(gamma_t - gamma_s) k_t.k_s for the rows t of one block and the columns s of an
    earlier one (DIAGONAL: of the same block, s < t only)."""
    gram = tl.dot(k_rows * beta_rows[:, None], tl.trans(k_cols), input_precision=PRECISION)
    diff = gamma_rows[:, None] - gamma_cols[None, :]  # <= 0: gamma only falls
    if DIAGONAL:
        below = tl.arange(0, SUB)[:, None] > tl.arange(0, SUB)[None, :]
        diff = tl.where(below, diff, float("-inf"))  # exp(-inf) = 0 on and above the diagonal
    return gram * tl.exp(diff)


@triton.jit
def _unit_lower_inverse(A, SUB: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for A [SUB, SUB] strictly lower (SUB = 2^LEVELS), by doubling: from the inverse T of the diagonal
    blocks of size m, the blocks of size 2m add their lower-left quarter N, and (D + N)^-1 = T - T N T."""
    r, c = tl.arange(0, SUB)[:, None], tl.arange(0, SUB)[None, :]
    T = tl.where(r == c, 1.0, 0.0)  # the blocks of size 1: the unit diagonal
    for level in tl.static_range(LEVELS):
        m = 1 << level
        quarter = (r // (2 * m) == c // (2 * m)) & ((r // m) % 2 == 1) & ((c // m) % 2 == 0)
        N = tl.where(quarter, A, 0.0)
        T = T - tl.dot(T, tl.dot(N, T, input_precision=PRECISION), input_precision=PRECISION)
    return T


@triton.jit
def _store_block_solve(
    T00,
    T10,
    T11,
    T20,
    T21,
    T22,
    T30,
    T31,
    T32,
    T33,
    x0,
    x1,
    x2,
    x3,
    out_ptr,
    r0,
    r1,
    r2,
    r3,
    end,
    h,
    stride_t,
    stride_h,
    D: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    "(I + A)^-1 x for the chunk's four block rows of x, by the blocks T of the lower inverse, stored row block by row block."
    y0 = tl.dot(T00, x0, input_precision=PRECISION)
    y1 = tl.dot(T10, x0, input_precision=PRECISION) + tl.dot(T11, x1, input_precision=PRECISION)
    y2 = (
        tl.dot(T20, x0, input_precision=PRECISION)
        + tl.dot(T21, x1, input_precision=PRECISION)
        + tl.dot(T22, x2, input_precision=PRECISION)
    )
    y3 = (
        tl.dot(T30, x0, input_precision=PRECISION)
        + tl.dot(T31, x1, input_precision=PRECISION)
        + tl.dot(T32, x2, input_precision=PRECISION)
        + tl.dot(T33, x3, input_precision=PRECISION)
    )
    _store_rows(out_ptr, y0, r0, end, h, stride_t, stride_h, 0, D, SUB, BLOCK)
    _store_rows(out_ptr, y1, r1, end, h, stride_t, stride_h, 0, D, SUB, BLOCK)
    _store_rows(out_ptr, y2, r2, end, h, stride_t, stride_h, 0, D, SUB, BLOCK)
    _store_rows(out_ptr, y3, r3, end, h, stride_t, stride_h, 0, D, SUB, BLOCK)


@triton.jit
def _prefill_solve_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    cu_ptr,
    w_ptr,
    u_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    eps,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SUB: tl.constexpr,
    LEVELS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sequence n, chunk c, value head h): W = (I + A)^-1 (beta exp(gamma) K) and U = (I + A)^-1 (beta V)
    for the chunk's rows, into the scratch buffers. The chunk is four blocks of SUB rows; T_ij is block (i, j) of
    (I + A)^-1."""
    n, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    r0 = start + c * 4 * SUB
    if r0 >= end:  # past this sequence's last chunk
        return
    r1, r2, r3 = r0 + SUB, r0 + 2 * SUB, r0 + 3 * SUB
    kh = h // GROUP
    # the keys, normalized, and the gates of each block; gamma runs on from block to block
    k0 = _l2_normalized_rows(
        _load_rows(k_ptr, r0, end, kh, stride_kt, stride_kh, 0, DK, SUB, BLOCK_K), eps
    )
    k1 = _l2_normalized_rows(
        _load_rows(k_ptr, r1, end, kh, stride_kt, stride_kh, 0, DK, SUB, BLOCK_K), eps
    )
    k2 = _l2_normalized_rows(
        _load_rows(k_ptr, r2, end, kh, stride_kt, stride_kh, 0, DK, SUB, BLOCK_K), eps
    )
    k3 = _l2_normalized_rows(
        _load_rows(k_ptr, r3, end, kh, stride_kt, stride_kh, 0, DK, SUB, BLOCK_K), eps
    )
    b0, gm0, after0 = _load_gates(
        g_ptr, beta_ptr, r0, end, h, stride_gt, stride_gh, stride_bt, stride_bh, 0.0, SUB
    )
    b1, gm1, after1 = _load_gates(
        g_ptr, beta_ptr, r1, end, h, stride_gt, stride_gh, stride_bt, stride_bh, after0, SUB
    )
    b2, gm2, after2 = _load_gates(
        g_ptr, beta_ptr, r2, end, h, stride_gt, stride_gh, stride_bt, stride_bh, after1, SUB
    )
    b3, gm3, _ = _load_gates(
        g_ptr, beta_ptr, r3, end, h, stride_gt, stride_gh, stride_bt, stride_bh, after2, SUB
    )
    # the diagonal blocks of the inverse
    T00 = _unit_lower_inverse(
        _decayed_gram(k0, b0, gm0, k0, gm0, True, SUB, PRECISION), SUB, LEVELS, PRECISION
    )
    T11 = _unit_lower_inverse(
        _decayed_gram(k1, b1, gm1, k1, gm1, True, SUB, PRECISION), SUB, LEVELS, PRECISION
    )
    T22 = _unit_lower_inverse(
        _decayed_gram(k2, b2, gm2, k2, gm2, True, SUB, PRECISION), SUB, LEVELS, PRECISION
    )
    T33 = _unit_lower_inverse(
        _decayed_gram(k3, b3, gm3, k3, gm3, True, SUB, PRECISION), SUB, LEVELS, PRECISION
    )
    # below the diagonal, block forward substitution: T_ij = -T_ii (sum over j <= m < i of A_im T_mj)
    A10 = _decayed_gram(k1, b1, gm1, k0, gm0, False, SUB, PRECISION)
    A20 = _decayed_gram(k2, b2, gm2, k0, gm0, False, SUB, PRECISION)
    A21 = _decayed_gram(k2, b2, gm2, k1, gm1, False, SUB, PRECISION)
    A30 = _decayed_gram(k3, b3, gm3, k0, gm0, False, SUB, PRECISION)
    A31 = _decayed_gram(k3, b3, gm3, k1, gm1, False, SUB, PRECISION)
    A32 = _decayed_gram(k3, b3, gm3, k2, gm2, False, SUB, PRECISION)
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=PRECISION), input_precision=PRECISION)
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=PRECISION), input_precision=PRECISION)
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=PRECISION), input_precision=PRECISION)
    T20 = -tl.dot(
        T22,
        tl.dot(A20, T00, input_precision=PRECISION) + tl.dot(A21, T10, input_precision=PRECISION),
        input_precision=PRECISION,
    )
    T31 = -tl.dot(
        T33,
        tl.dot(A31, T11, input_precision=PRECISION) + tl.dot(A32, T21, input_precision=PRECISION),
        input_precision=PRECISION,
    )
    T30 = -tl.dot(
        T33,
        tl.dot(A30, T00, input_precision=PRECISION)
        + tl.dot(A31, T10, input_precision=PRECISION)
        + tl.dot(A32, T20, input_precision=PRECISION),
        input_precision=PRECISION,
    )
    # W, block row by block row, from beta exp(gamma) K
    x0, x1 = k0 * (b0 * tl.exp(gm0))[:, None], k1 * (b1 * tl.exp(gm1))[:, None]
    x2, x3 = k2 * (b2 * tl.exp(gm2))[:, None], k3 * (b3 * tl.exp(gm3))[:, None]
    _store_block_solve(
        T00,
        T10,
        T11,
        T20,
        T21,
        T22,
        T30,
        T31,
        T32,
        T33,
        x0,
        x1,
        x2,
        x3,
        w_ptr,
        r0,
        r1,
        r2,
        r3,
        end,
        h,
        stride_wt,
        stride_wh,
        DK,
        SUB,
        BLOCK_K,
        PRECISION,
    )
    # U the same way from beta V (v loaded only now: fewer tiles alive at once)
    x0 = _load_rows(v_ptr, r0, end, h, stride_vt, stride_vh, 0, DV, SUB, BLOCK_V) * b0[:, None]
    x1 = _load_rows(v_ptr, r1, end, h, stride_vt, stride_vh, 0, DV, SUB, BLOCK_V) * b1[:, None]
    x2 = _load_rows(v_ptr, r2, end, h, stride_vt, stride_vh, 0, DV, SUB, BLOCK_V) * b2[:, None]
    x3 = _load_rows(v_ptr, r3, end, h, stride_vt, stride_vh, 0, DV, SUB, BLOCK_V) * b3[:, None]
    _store_block_solve(
        T00,
        T10,
        T11,
        T20,
        T21,
        T22,
        T30,
        T31,
        T32,
        T33,
        x0,
        x1,
        x2,
        x3,
        u_ptr,
        r0,
        r1,
        r2,
        r3,
        end,
        h,
        stride_ut,
        stride_uh,
        DV,
        SUB,
        BLOCK_V,
        PRECISION,
    )


@triton.jit
def _prefill_state_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    w_ptr,
    u_ptr,
    cu_ptr,
    slots_ptr,
    fresh_ptr,
    state_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ot,
    stride_oh,
    scale,
    eps,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (sequence n, value head h, slice j): columns j*BLOCK_V.. of head h's state, carried in registers
    through the sequence's chunks in order (from zeros when fresh, else from the pool row slots[n]); those columns
    of every output row; the final slice into the pool row."""
    n, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + n).to(tl.int64)
    end = tl.load(cu_ptr + n + 1).to(tl.int64)
    kh = h // GROUP
    col0 = j * BLOCK_V
    offs_k, offs_v = tl.arange(0, BLOCK_K), col0 + tl.arange(0, BLOCK_V)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    tile = (
        state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    )
    tile_mask = (offs_k < DK)[:, None] & (offs_v < DV)[None, :]
    S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if tl.load(fresh_ptr + n).to(tl.int32) == 0:  # a sequence that goes on: its state from the pool
        S = tl.load(tile, mask=tile_mask, other=0.0)
    idx = tl.arange(0, CHUNK)
    causal = idx[:, None] >= idx[None, :]
    for r0 in range(start, end, CHUNK):
        q = _load_rows(q_ptr, r0, end, kh, stride_qt, stride_qh, 0, DK, CHUNK, BLOCK_K)
        k = _load_rows(k_ptr, r0, end, kh, stride_kt, stride_kh, 0, DK, CHUNK, BLOCK_K)
        q, k = _l2_normalized_rows(q, eps) * scale, _l2_normalized_rows(k, eps)
        rows = r0 + idx
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=rows < end, other=0.0).to(
            tl.float32
        )
        gamma, gamma_end = tl.cumsum(g, axis=0), tl.sum(g, axis=0)
        w = _load_rows(w_ptr, r0, end, h, stride_wt, stride_wh, 0, DK, CHUNK, BLOCK_K)
        u = _load_rows(u_ptr, r0, end, h, stride_ut, stride_uh, col0, DV, CHUNK, BLOCK_V)
        delta = u - tl.dot(
            w, S, input_precision=PRECISION
        )  # the chunk's corrections, now that S is known
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * tl.exp(gamma)[:, None], S, input_precision=PRECISION) + tl.dot(
            scores, delta, input_precision=PRECISION
        )
        _store_rows(out_ptr, o, r0, end, h, stride_ot, stride_oh, col0, DV, CHUNK, BLOCK_V)
        k_to_end = k * tl.exp(gamma_end - gamma)[:, None]
        S = S * tl.exp(gamma_end) + tl.dot(tl.trans(k_to_end), delta, input_precision=PRECISION)
    tl.store(tile, S, mask=tile_mask)


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    *,
    impl: str = "auto",
    max_seqlen: int | None = None,
    block_v: int = 64,
    num_warps: int = 4,
    solve_warps: int | None = None,
    precision: str | None = None,
) -> torch.Tensor:
    """Several sequences' new tokens, flattened: q, k [T, Hk, Dk] (not yet l2-normalized, as above), v [T, Hv, Dv], g,
    beta [T, Hv] fp32; cu_seqlens [N+1] int (sequence n is rows cu_seqlens[n]:cu_seqlens[n+1]); state [S, Hv, Dk, Dv]
    fp32 pool; slots [N]: each sequence's row; fresh [N] bool: the sequence starts here (its state taken as zeros, not
    read). Writes each sequence's final state into state[slots[n]] IN PLACE. -> out [T, Hv, Dv] fp32.
    The chunked form (chunks of 64 tokens within each sequence), as chapter 03b derives it. `max_seqlen`: the longest
    sequence, if the caller knows it (fewer idle programs; default the row count T); `precision` of the products:
    by q's dtype (`prefill_precision`). The tiles: the lab's fastest at every size it times (below); `solve_warps`
    4 for TF32 products, 8 for fp32-accurate ones."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    N = slots.shape[0]
    if (
        k.shape != q.shape
        or v.shape[0] != T
        or g.shape != (T, Hv)
        or beta.shape != (T, Hv)
        or cu_seqlens.shape != (N + 1,)
        or fresh.shape != (N,)
        or state.shape[1:] != (Hv, Dk, Dv)
        or Hv % Hk
    ):
        raise ValueError(
            f"gated_delta_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, cu_seqlens {tuple(cu_seqlens.shape)}, slots {tuple(slots.shape)}, fresh "
            f"{tuple(fresh.shape)} do not fit a pool of {tuple(state.shape)}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be fp32, got {state.dtype}")
    precision = precision or prefill_precision(q.dtype)
    if block_v < 32 and precision != "tf32":
        # (products to fp32's accuracy, "ieee" or "tf32x3", at 16 columns fault on an H100, one prompt of 64 or 512
        # tokens at the 4B shape; 32 and up pass)
        raise ValueError(f"fp32-accurate products take block_v >= 32, got {block_v}")
    if kernel_backend(q.device, impl) == "torch":
        return gated_delta_prefill_reference(q, k, v, g, beta, cu_seqlens, state, slots, fresh)
    _check_unit_stride("gated_delta_prefill", q, k, v, state)
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=q.device)
    if N == 0:
        return out
    # the scratch of the solve: W and U of every row, in fp32
    w = torch.empty(T, Hv, Dk, dtype=torch.float32, device=q.device)
    u = torch.empty(T, Hv, Dv, dtype=torch.float32, device=q.device)
    solve_warps = solve_warps or (4 if precision == "tf32" else 8)
    block_k = max(16, _pow2(Dk))
    chunks = triton.cdiv(min(T, max_seqlen if max_seqlen is not None else T), CHUNK)
    if chunks:
        _prefill_solve_kernel[(N, chunks, Hv)](
            k,
            v,
            g,
            beta,
            cu_seqlens,
            w,
            u,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            g.stride(1),
            beta.stride(0),
            beta.stride(1),
            w.stride(0),
            w.stride(1),
            u.stride(0),
            u.stride(1),
            L2NORM_EPS,
            GROUP=Hv // Hk,
            DK=Dk,
            DV=Dv,
            BLOCK_K=block_k,
            BLOCK_V=max(16, _pow2(Dv)),
            SUB=SUB,
            LEVELS=SUB.bit_length() - 1,
            PRECISION=precision,
            num_warps=solve_warps,
        )
    _prefill_state_kernel[(N, Hv, triton.cdiv(Dv, block_v))](
        q,
        k,
        g,
        w,
        u,
        cu_seqlens,
        slots,
        fresh,
        state,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        g.stride(0),
        g.stride(1),
        w.stride(0),
        w.stride(1),
        u.stride(0),
        u.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        out.stride(0),
        out.stride(1),
        Dk**-0.5,
        L2NORM_EPS,
        GROUP=Hv // Hk,
        DK=Dk,
        DV=Dv,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        CHUNK=CHUNK,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=1,  # the chunk loop not pipelined: its tiles in flight three times over overflow shared memory
    )
    return out


# %% [markdown]
# Against the reference: four sequences of 1, 40, 64 and 150 tokens (one token, under a chunk,
# exactly a chunk, two chunks and a ragged third), fresh and carried, in a pool of seven rows
# with slots out of order; slices of 16 (TF32 products) and of 32 columns of the state; the solve
# launched over the row count and over the longest sequence. Rows of the pool no sequence holds keep
# their bits. Fewer than 32 columns with fp32-accurate products are refused.

# %%
lengths = [1, 40, 64, 150]
cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
q, k, v, g, beta = random_inputs(int(cu_seqlens[-1]), seed=3)
slots = torch.tensor([5, 0, 3, 6])
fresh = torch.tensor([True, False, True, False])
pool = 0.5 * torch.randn(7, 4, 16, 24, generator=gen)
want_pool = pool.clone()
want = gated_delta_prefill_reference(q, k, v, g, beta, cu_seqlens, want_pool, slots, fresh)
for block_v, max_seqlen, precision in (
    (
        16,
        None,
        "tf32",
    ),  # (the interpreter's tf32 products are fp32's; fp32-accurate ones take 32 columns and up)
    (32, 150, None),
):  # the longest sequence given or not: the same result
    got_pool = pool.clone()
    got = gated_delta_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        got_pool,
        slots,
        fresh,
        impl="triton",
        block_v=block_v,
        max_seqlen=max_seqlen,
        precision=precision,
    )
    # fp32: the same chunked arithmetic, its inverse by blocks where the reference solves by substitution, and sums in
    # another order: values ~1, a few 1e-7 apart
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_pool[[1, 2, 4]], pool[[1, 2, 4]])
print(f"prefill kernel vs reference: max |difference| {(got - want).abs().max():.1e}")
try:
    gated_delta_prefill(q, k, v, g, beta, cu_seqlens, pool.clone(), slots, fresh, block_v=16)
    raise AssertionError("16 columns with fp32-accurate products were not refused")
except ValueError as e:
    print("refused:", e)

# %% [markdown]
# The hard case for the inverse: keys all alike (one direction plus 1% noise), β near 1 and no
# decay, so that `A` is nearly the all-ones strictly lower matrix. Against chapter 03b's
# recurrence in fp64, the kernel is as close as the reference's triangular solve:

# %%
n = 150
alike = torch.randn(1, 1, 16, generator=gen) + 0.01 * torch.randn(n, 1, 16, generator=gen)
query, value = torch.randn(n, 1, 16, generator=gen), torch.randn(n, 2, 24, generator=gen)
no_decay, strong = torch.zeros(n, 2), torch.full((n, 2), 0.99)
args = (query, alike, value, no_decay, strong, torch.tensor([0, n]))
one, first = torch.tensor([0]), torch.tensor([True])
kernel_pool, reference_pool = torch.zeros(1, 2, 16, 24), torch.zeros(1, 2, 16, 24)
got = gated_delta_prefill(*args, kernel_pool, one, first, impl="triton")
want = gated_delta_prefill_reference(*args, reference_pool, one, first)
exact, exact_state = gated_delta_rule_recurrent(
    *(x.double() for x in normalized_heads(query, alike, 2)),
    value.double(),
    no_decay.double(),
    strong.double(),
)
kernel_err, reference_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
print(
    f"alike keys, outputs ~{exact.abs().max():.1f}: kernel {kernel_err:.1e}, reference {reference_err:.1e} from fp64"
)
assert (
    kernel_err < 2 * reference_err + 1e-6
    and (kernel_pool.double() - exact_state).abs().max() < 1e-5
)

# %% [markdown]
# A sequence with nothing new in the step still gets its state: zeros when it starts, its own
# when it goes on:

# %%
got_pool = pool.clone()
empty = gated_delta_prefill(
    q[:0],
    k[:0],
    v[:0],
    g[:0],
    beta[:0],
    torch.tensor([0, 0, 0]),
    got_pool,
    torch.tensor([2, 4]),
    torch.tensor([True, False]),
    impl="triton",
)
assert empty.shape == (0, 4, 24) and torch.equal(got_pool[2], torch.zeros(4, 16, 24))
assert torch.equal(got_pool[4], pool[4])

# %% [markdown]
# ## The kernels together
#
# What the engine does with them: a prompt through the prefill, fresh, then tokens one at a
# time through the decode, reading the state the prefill left in the pool. That is chapter
# 03b's recurrence over the whole sequence; and so is a prompt cut in two prefills, the second
# carrying the state.

# %%
q, k, v, g, beta = random_inputs(
    70, Hk=1, Dk=32, Dv=16, seed=4
)  # 4 value heads on one key head, Dk > Dv
qn, kn = normalized_heads(q, k, 4)
want_out, want_state = gated_delta_rule_recurrent(qn, kn, v, g, beta)
pool = torch.randn(2, 4, 32, 16, generator=gen)
one, first = torch.tensor([1]), torch.tensor([True])
got = [
    gated_delta_prefill(
        q[:66],
        k[:66],
        v[:66],
        g[:66],
        beta[:66],
        torch.tensor([0, 66]),
        pool,
        one,
        first,
        impl="triton",
    )
]
for t in range(66, 70):
    r = slice(t, t + 1)
    got.append(gated_delta_decode(q[r], k[r], v[r], g[r], beta[r], pool, one, impl="triton"))
# fp32, chunked against token by token (chapter 03b: 2e-6 measured)
torch.testing.assert_close(torch.cat(got), want_out, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(pool[1], want_state, rtol=1e-4, atol=1e-5)
halves = [
    gated_delta_prefill(
        q[a:b],
        k[a:b],
        v[a:b],
        g[a:b],
        beta[a:b],
        torch.tensor([0, b - a]),
        pool,
        one,
        torch.tensor([a == 0]),
        impl="triton",
    )
    for a, b in ((0, 10), (10, 70))
]
torch.testing.assert_close(torch.cat(halves), want_out, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(pool[1], want_state, rtol=1e-4, atol=1e-5)


# %% [markdown]
# ## On a GPU, at Qwen3.5-4B's shape
#
# Skipped on a CPU (cells flagged `gpu`): 16 key heads, 32 value heads of 128 × 128, 8,192
# convolution channels, bf16 q, k, v (the products in TF32) and fp32, against the references on
# the same GPU. The tolerance is on the relative norm of the difference: TF32 keeps 10 bits of
# each product's inputs (2⁻¹¹ relative), bf16 inputs 8 bits, both summed over 128 dims and carried
# through the state; fp32 inputs with `ieee` products agree to ~1e-6.

# %%
#| gpu
def _relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


if torch.cuda.is_available():  # also harmless where the `gpu` flag is not skipped
    for dtype, limit in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        lens = [1, 100, 1000, 64]
        cu = torch.tensor([0] + lens).cumsum(0).cuda()
        q, k, v, g, beta = random_inputs(sum(lens), 16, 32, 128, 128, dtype, "cuda", seed=5)
        pool = 0.5 * torch.randn(6, 32, 128, 128, device="cuda")
        slots, fresh = (
            torch.tensor([4, 0, 2, 5], device="cuda"),
            torch.tensor([True, False, True, False], device="cuda"),
        )
        want_pool, got_pool = pool.clone(), pool.clone()
        want = gated_delta_prefill(q, k, v, g, beta, cu, want_pool, slots, fresh, impl="torch")
        got = gated_delta_prefill(q, k, v, g, beta, cu, got_pool, slots, fresh)
        assert _relative(got, want) < limit and _relative(got_pool, want_pool) < limit, dtype
        assert torch.equal(got_pool[[1, 3]], pool[[1, 3]])
        qd, kd, vd, gd, bd = (x[:16] for x in (q, k, v, g, beta))
        slots16 = torch.randperm(24, device="cuda")[:16]
        pool = 0.5 * torch.randn(24, 32, 128, 128, device="cuda")
        want_pool, got_pool = pool.clone(), pool.clone()
        want = gated_delta_decode(qd, kd, vd, gd, bd, want_pool, slots16, impl="torch")
        got = gated_delta_decode(qd, kd, vd, gd, bd, got_pool, slots16)
        assert _relative(got, want) < limit and _relative(got_pool, want_pool) < limit, dtype
        x = torch.randn(16, 8192, device="cuda", dtype=dtype)
        w = torch.randn(8192, 4, device="cuda", dtype=dtype)
        conv_pool = torch.randn(24, 3, 8192, device="cuda", dtype=dtype)
        want_conv, got_conv = conv_pool.clone(), conv_pool.clone()
        want = causal_conv1d_decode(x, want_conv, w, slots16, impl="torch")
        got = causal_conv1d_decode(x, got_conv, w, slots16)
        assert _relative(got, want) < limit and torch.equal(got_conv, want_conv), dtype
        # the prompts' convolution: short, empty and long sequences, fresh and carried, slots out of order
        lens = [2, 0, 700, 1, 64, 3]
        cu = torch.tensor([0] + lens).cumsum(0).cuda()
        x = torch.randn(sum(lens), 8192, device="cuda", dtype=dtype)
        slots6 = torch.tensor([7, 3, 0, 12, 5, 1], device="cuda")
        fresh6 = torch.tensor([False, True, True, False, False, True], device="cuda")
        want_conv, got_conv = conv_pool.clone(), conv_pool.clone()
        want = causal_conv1d_prefill(x, want_conv, w, cu, slots6, fresh6, impl="torch")
        got = causal_conv1d_prefill(x, got_conv, w, cu, slots6, fresh6)
        assert _relative(got, want) < limit and torch.equal(got_conv, want_conv), dtype

# %% [markdown]
# ## What is left to measure
#
# `kernels_lab/gated_delta.py` validates the four kernels against these references at the
# 4B shape on a GPU, in bf16 and fp32, then times them (CUDA events, the median; the L2 cleared
# before each run) and prints the bandwidth each reaches next to the H200's ceiling: the decode
# at batch 1 and 16 against its 1.0 and 16 µs floors, the prompts' convolution at one prompt of
# 512 and of 4,096 tokens and at a step of 32 short ones against its 4.0 and 32 µs of bytes, the
# prefill at 512 and 4,096 tokens against its bytes and its FLOPs. It sweeps the tiles these
# functions expose: the decode's slice (`block_v`) and warps, the convolutions' `block_c` (and
# the prompts' `block_t`), the prefill's slice, warps and product precision. `PYTHONPATH=.
# python3 kernels_lab/gated_delta.py --cpu-check` runs its validation under the interpreter on a
# CPU; `TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/gated_delta.py --sass` compiles every
# tile for an H200 on any machine and prints its registers, spills and shared memory (the figures
# above).
