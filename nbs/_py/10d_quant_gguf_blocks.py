# %% [markdown]
# # GGUF blocks, kept as they are
#
# > A GGUF file's quantized blocks kept byte for byte and decoded inside the matmul: eight block types, a GEMV for one to four rows, split-K tiles above.

# %% [markdown]
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
#| default_exp quant.gguf_blocks

# %%
#| export
from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_engine.kernels.backend import _pow2, kernel_backend, tl, triton
from forge_engine.quant.split_k import (
    _accumulate,
    _program_tile,
    _skinny_kernel,
    _skinny_matmul,
    _store_partial,
)

# %%
#| hide
from forge_engine.quant.split_k import assert_matches

# %%
#| export
# GGML type number -> (name, weights per block, bytes per block). Plain numbers, so that the int8 / int4
# paths import without the `gguf` package (the GPU machine may not have it); chapter 01a is imported lazily.
KEPT_GGUF_TYPES = {
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


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
        w = _load_f16(blk, mask) * tl.load(blk + 2 + j, mask=mask, other=0).to(
            tl.int8, bitcast=True
        ).to(tl.float32)
    elif QTYPE == 2:  # Q4_0
        w = _load_f16(blk, mask) * (_nibble(_load_byte(blk + 2 + j % 16, mask), j >= 16) - 8).to(
            tl.float32
        )
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
        sc = (
            tl.load(blk + 192 + j // 16, mask=mask, other=0)
            .to(tl.int8, bitcast=True)
            .to(tl.float32)
        )
        w = _load_f16(blk + 208, mask) * sc * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr,
    q_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    row_bytes,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, pid_k, k_start, k_end = _program_tile(K, k_per_split, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_b, offs_j = (
        tl.arange(0, BLOCK_K // QK),
        tl.arange(0, QK),
    )  # a step: BLOCK_K / QK whole blocks
    row_ptr = q_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :],
            mask=m_mask[:, None] & (offs_k < k_end)[None, :],
            other=0.0,
        )
        blocks = k0 // QK + offs_b
        blk_mask = (
            n_mask[:, None, None] & (blocks * QK < k_end)[None, :, None]
        )  # k_end is a whole number of blocks
        w = _gguf_weights(
            row_ptr + blocks[None, :, None] * TYPE_SIZE, offs_j[None, None, :], blk_mask, QTYPE
        )
        acc = _accumulate(acc, x, tl.reshape(w, (BLOCK_N, BLOCK_K)), USE_DOT, UPCAST, PRECISION)
    _store_partial(out_ptr, acc, offs_m, offs_n, M, N, pid_k)


def gguf_gemv_config(qtype: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the GGUF GEMV launch (1-4 rows). Q4_K and Q6_K: the best of the H200 sweep
    (kernels_lab/quant_gemv.py, Qwen3-4B's shapes, one row); Q5_K is taken to be like Q4_K and the 32-weight types
    keep the first guess: neither was swept."""
    name = KEPT_GGUF_TYPES[int(qtype)][0]
    if name == "Q6_K":
        return 2, 512, 4
    if name in ("Q4_K", "Q5_K"):
        return (8 if n < 16384 else 4), 1024, 4
    if k >= 4096:
        return 2, 1024, 4
    return (4 if n < 16384 else 8), 1024, 4


def gguf_matmul_reference(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    "Dense: chapter 01a's dequantizer on the rows of blocks, then one matmul."
    from forge_engine.gguf_file import DEQUANTIZERS

    _, _, type_size = KEPT_GGUF_TYPES[qtype]
    w = DEQUANTIZERS[qtype](raw.reshape(-1, type_size)).reshape(raw.shape[0], -1)
    return F.linear(x, w.to(x.dtype))


def gguf_matmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    impl: str = "auto",
    kernel: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T where W's rows are GGUF blocks of `qtype` (a GGML type number), raw [N, bytes per row] uint8.
    Up to GEMV_MAX_ROWS rows (kernel 'gemv'): one program per BLOCK_N rows over all of K; above ('split_k'): split-K tiles."""
    if kernel_backend(x.device, impl) == "torch":
        return gguf_matmul_reference(x, raw, qtype)
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    n, k = raw.shape[0], x.shape[1]
    if _skinny_kernel(kernel, x.shape[0]) == "gemv":
        if split not in (None, 1):
            raise ValueError("gguf_matmul: a split along K is for kernel='split_k'")
        default = gguf_gemv_config(qtype, n, k)
        block_n, block_k, num_warps = (
            block_n or default[0],
            block_k or default[1],
            num_warps or default[2],
        )
        split, use_dot = 1, False
    else:
        block_k, num_warps, use_dot = block_k or 256, num_warps or 4, None
    block_k = max(block, min(block_k, _pow2(k)))  # whole blocks per step, no more than K has
    return _skinny_matmul(
        _gguf_matmul_kernel,
        x,
        (raw,),
        n,
        block_k,
        block_n=block_n,
        split=split,
        num_warps=num_warps,
        use_dot=use_dot,
        row_bytes=raw.shape[1],
        QTYPE=int(qtype),
        QK=block,
        TYPE_SIZE=type_size,
        BLOCK_K=block_k,
    )


# %% [markdown]
# `gguf_bytes` makes valid blocks of every kept type for the tests, here and in chapter 10e.

# %%
#| export
def gguf_bytes(qtype, rows, cols, seed=0) -> torch.Tensor:
    """Valid GGUF bytes of `qtype` for a random [rows, cols] matrix, as [rows, bytes per row] uint8: the 32-weight types
    quantized by the `gguf` package, the K types random bits with sane float16 scales (it cannot quantize to them)."""
    import gguf as gguf_package  # (here, not above: the layers import without the `gguf` package)
    import numpy as np
    from gguf import GGMLQuantizationType as QType

    rng = np.random.default_rng(seed)
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    if block == 32:
        data = gguf_package.quants.quantize(
            rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype
        )
    else:
        data = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
        for at in [208] if qtype == QType.Q6_K else [0, 2]:  # d (and dmin): finite float16
            data[..., at : at + 2] = (
                rng.uniform(0, 0.01, data.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
            )
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1).copy())


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

torch.manual_seed(0)  # (the inputs of this cell alone, whatever the cells above drew)
for qtype in map(QType, KEPT_GGUF_TYPES):
    raw = gguf_bytes(qtype, 20, 512, seed=int(qtype))
    decoded = gguf_matmul(torch.eye(512), raw, qtype, impl="triton", kernel="split_k").T
    want = torch.from_numpy(gguf_package.quants.dequantize(raw.numpy(), qtype).astype(np.float32))
    assert torch.equal(decoded, want), qtype.name
    for m, dtype, launch in [
        (1, torch.float32, {}),
        (2, torch.float32, dict(kernel="split_k", split=2)),
        (6, torch.float32, {}),
        (3, torch.float32, dict(block_n=8, block_k=32)),
        (1, torch.bfloat16, dict(kernel="split_k", split=1)),
    ]:
        x = torch.randn(m, 512, dtype=dtype)
        # FP32 sums of 512 products in another order than the reference's: a few ulps of Σ|x·w| (the K types'
        # weights reach ~40, so that is well above 1e-4 for some outputs)
        sum_order = 2**-22 * (x.float().abs() @ want.abs().T).max().item()
        assert_matches(
            gguf_matmul(x, raw, qtype, impl="triton", **launch),
            gguf_matmul_reference(x, raw, qtype),
            f"{qtype.name} M={m} {dtype} {launch}",
            max(1e-4, sum_order),
        )
for qtype in (
    QType.Q4_K,
    QType.Q6_K,
    QType.Q8_0,
):  # K = 1,280: the last GEMV step holds part of BLOCK_K
    raw = gguf_bytes(qtype, 13, 1280, seed=3)
    for m, launch in [(4, {}), (2, dict(block_k=512, block_n=4))]:
        x = torch.randn(m, 1280)
        assert_matches(
            gguf_matmul(x, raw, qtype, impl="triton", **launch),
            gguf_matmul_reference(x, raw, qtype),
            f"{qtype.name} M={m} K=1280 {launch}",
        )
assert (
    gguf_gemv_config(QType.Q4_K, 6144, 2560) == (8, 1024, 4)
    and gguf_gemv_config(QType.Q4_K, 19456, 2560)[0] == 4
)
assert gguf_gemv_config(QType.Q6_K, 2560, 9728) == (2, 512, 4)  # the sweep's winners
