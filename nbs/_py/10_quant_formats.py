# %% [markdown]
# # Quantized weights: the int8 and int4 codes
#
# > Weight-only int8 (a scale per output row) and int4 (a scale and a minimum per group of inputs): how a matrix is stored in fewer bits, quantized a slice of rows at a time.

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
#
# The quantization chapters, in order: this one, the **codes** (int8 and int4, and quantizing a
# matrix a slice of rows at a time); 10b, the **skinny matmul kernels** split along K; 10c, the
# **int4 GEMV** for one to four rows; 10d, **GGUF blocks** kept as they are in the file; 10e, the
# **modules that replace `nn.Linear`**, quantizing a loaded model, loading a GGUF model kept
# quantized, and the perplexity that measures what quantizing costs. (Chapter 10a counts the
# bytes of these formats to plan GPU memory.)

# %%
#| default_exp quant.formats

# %%
#| export
from __future__ import annotations

import torch

from forge_engine.kernels.backend import kernel_backend, tl, triton
from forge_engine.kernels.rows_matmul import dequantized_groups

# %%
#| hide
import pytest


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
    out = q.to(tl.float32) * tl.load(
        scale_ptr + row
    )  # as `dequantize_int8`: the product in fp32, rounded once
    tl.store(out_ptr + i.to(tl.int64) * K + cols, out.to(out_ptr.dtype.element_ty), mask=cols < K)


def int8_rows(
    ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, impl: str = "auto"
) -> torch.Tensor:
    """`dequantize_int8(q[ids], scale[ids], dtype)` [len(ids), K]: the rows `ids` [n] of an int8 matrix, dequantized
    (a tied model's embedding read from its int8 LM head). On a GPU one Triton launch instead of five small ones."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"int8_rows takes a 1-D tensor of integer row ids, got {ids.dtype} {tuple(ids.shape)}"
        )
    if kernel_backend(q.device, impl) == "torch":
        return dequantize_int8(q[ids], scale[ids], dtype)
    out = torch.empty(len(ids), q.shape[1], dtype=dtype, device=q.device)
    block = min(1024, triton.next_power_of_2(q.shape[1]))
    if len(ids):
        _int8_rows_kernel[(len(ids), triton.cdiv(q.shape[1], block))](
            ids.contiguous(), q, scale, out, q.shape[1], q.stride(0), BLOCK=block, num_warps=4
        )
    return out


# %%
w = torch.randn(48, 256)
w[3] = 0  # an all-zero row has scale 0 and stays exactly zero
q, scale = quantize_int8(w)
assert q.dtype == torch.int8 and scale.shape == (48,) and q.abs().max() == 127
err = (dequantize_int8(q, scale) - w).abs()
assert (
    err <= scale[:, None] / 2 + 1e-6
).all()  # at most half a step (+ FP32's rounding of q · scale, ~2^-24 |w|)
assert torch.equal(dequantize_int8(q, scale)[3], torch.zeros(256))
# `int8_rows` (one Triton launch on a GPU, here interpreted): the same bits as dequantizing the gathered rows (in
# BF16 within one rounding here: the interpreter rounds to bf16 its own way; tests/test_quant_gpu.py: bit for bit)
ids = torch.tensor([5, 3, 5, 47])
assert torch.equal(int8_rows(ids, q, scale, impl="triton"), dequantize_int8(q[ids], scale[ids]))
torch.testing.assert_close(
    int8_rows(ids, q, scale, torch.bfloat16, impl="triton"),  # (truncation: under one BF16
    dequantize_int8(q[ids], scale[ids], torch.bfloat16),
    rtol=2**-7,
    atol=0,
)  # step, 2^-7)
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
#
# One group of one row, 128 weights `w0 … w127` in 64 bytes:
#
# ```
# byte:         0         1         2     …     63
#           ┌─────────┬─────────┬─────────┬───┬──────────┐
# high 4 b  │   w64   │   w65   │   w66   │ … │   w127   │   second half of the group
# low  4 b  │   w0    │   w1    │   w2    │ … │   w63    │   first half of the group
#           └─────────┴─────────┴─────────┴───┴──────────┘
#   + scale (fp16) and minimum (fp16) of the group:  w ≈ scale · q + minimum
#
# in the kernel:  lo = byte & 0xF  →  pairs with x[0:64]
#                 hi = byte >> 4   →  pairs with x[64:128]
# ```

# %%
#| export
INT4_GROUP = 128  # inputs per scale / minimum


def int4_group_size(k: int) -> int:
    "128, or for an input size that 128 does not divide the largest of 64 and 32 that does (SmolLM2's 576: 64)."
    for group in (INT4_GROUP, 64, 32):
        if k % group == 0:
            return group
    raise ValueError(
        f"int4 needs the input size to be a multiple of 32 (groups of 128, 64 or 32), got {k}"
    )


def quantize_int4(
    w: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "w [N, K] -> (packed uint8 [N, K/2], scale fp16 [N, K/group], minimum fp16 [N, K/group])."
    n, k = w.shape
    group = group or int4_group_size(k)
    if group % 16 or k % group:  # the GEMV below reads a group as whole 8-byte chunks
        raise ValueError(
            f"int4 groups must be a multiple of 16 that divides the input size {k}, got {group}"
        )
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale, minimum = ((hi - lo) / 15).half(), lo.half()
    if not (scale.isfinite().all() and minimum.isfinite().all()):
        raise ValueError("int4: a weight group does not fit float16 scales (|w| > 65504 or NaN)")
    s = scale.float()[..., None]
    inv = torch.where(
        s > 0, 1 / s, torch.zeros_like(s)
    )  # a constant group: every q = 0, w = minimum
    q = torch.round((g - minimum.float()[..., None]) * inv).clamp_(0, 15).to(torch.uint8)
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(n, k // 2), scale, minimum


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """packed [N, K / 2] -> the weights [N, K] in `dtype`: each code q * scale + minimum its group, in FP32, rounded
    once (chapter 09's `dequantized_groups`, which its tensor-core matmul's reference shares)."""
    return dequantized_groups(packed, scale, dtype, minimum)


# %%
w = torch.randn(16, 512) + torch.linspace(-1, 3, 512)  # groups not centred on zero
w[2, :128] = 0.25  # a constant group
packed, scale, minimum = quantize_int4(w)
assert (
    packed.shape == (16, 256)
    and packed.dtype == torch.uint8
    and scale.shape == minimum.shape == (16, 4)
)
back = dequantize_int4(packed, scale, minimum)
step = scale.float().repeat_interleave(128, dim=1)
# at most half a step: codes are rounded against the float16 scale and minimum they are stored with, so only FP32's
# rounding of q · scale + minimum adds (|w| < 8 here: ~2^-21)
assert ((back - w).abs() <= step / 2 + 1e-5).all()
assert torch.equal(
    back[2, :128], torch.full((128,), 0.25)
)  # scale 0, minimum 0.25 (exact in float16)
# byte j of a group: weight j low, weight j + 64 high
q0 = (
    torch.round((w[0, :128] - minimum[0, 0].float()) / scale[0, 0].float())
    .clamp(0, 15)
    .to(torch.uint8)
)
assert packed[0, 5] == q0[5] | (q0[69] << 4)
assert quantize_int4(torch.randn(4, 576))[1].shape == (4, 9)  # 576 = 9 groups of 64
with pytest.raises(ValueError, match="multiple of 32 .*, got 100"):
    quantize_int4(torch.randn(4, 100))
for bad in (8, 24, 64):  # not whole chunks, or not dividing 96
    with pytest.raises(
        ValueError, match=f"multiple of 16 that divides the input size 96, got {bad}"
    ):
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


def quantize_rows(
    quantize, w: torch.Tensor, device=None, chunk: int = QUANTIZE_CHUNK, **options
) -> tuple[torch.Tensor, ...]:
    """`quantize(w, **options)` (`quantize_int8` or `quantize_int4`), slice of rows by slice of rows on `device`
    (default: w's): each slice is copied there and quantized into the results, kept on `device`."""
    device = w.device if device is None else torch.device(device)
    rows = max(1, chunk // w.shape[1])
    if rows >= w.shape[0]:
        return quantize(w.to(device), **options)
    results = None
    for i in range(0, w.shape[0], rows):
        part = quantize(w[i : i + rows].to(device), **options)
        if (
            results is None
        ):  # allocated once, filled slice by slice: never the slices and their join at once
            results = tuple(
                torch.empty((w.shape[0], *p.shape[1:]), dtype=p.dtype, device=device) for p in part
            )
        for result, p in zip(results, part):
            result[i : i + rows] = p
    return results


# %% [markdown]
# Slices give the same bytes as the whole matrix (here in slices of 3 rows, or of 1 row of 512
# inputs), and a BF16 matrix the same as its values in FP32:

# %%
w = (torch.randn(40, 512) * 0.05 + torch.linspace(-0.1, 0.3, 512)).bfloat16()
for quantize, options in (
    (quantize_int8, {}),
    (quantize_int4, {}),
    (quantize_int4, dict(group=32)),
):
    whole = quantize(w, **options)
    for chunk in (3 * 512, 100):
        sliced = quantize_rows(quantize, w, "cpu", chunk, **options)
        assert len(sliced) == len(whole) and all(
            torch.equal(a, b) for a, b in zip(sliced, whole)
        ), (quantize, chunk)
    assert all(
        torch.equal(a, b) for a, b in zip(quantize_rows(quantize, w.float(), **options), whole)
    )
