"""A GGUF file's repacked layers (chapter 10g) at 16 rows, the decode step of 16 sequences, and at 512 (prefill):
chapter 10b's split-K launch with a tile dequantized in registers and `tl.dot`, over a sweep of its tiles (BLOCK_N,
warps, pipeline stages), against the one-row GEMV of the same matrix (the time to read it once: what 16 rows should
cost when they are bandwidth-bound), and the dense path (one Triton launch makes the weights, then one matmul).
Qwen3-4B's matrices as Q8_0 and Q6_K (int8 planes, groups of 32 and 16) and Q4_K (int4, groups of 32). The int8
planes also through chapter 09's GEMV on all 16 rows (`gemv(..., dot=True, group_scale=...)`: no split-K, the GEMV's
early weights; a sweep of BLOCK_N, BLOCK_K, warps and pipelined loop stages). Q4_K's int4 planes also through a
GEMV of this file's own on all 16 rows (`int4_dot`: no split-K; each step's bytes split into their low and high
nibbles, each half dequantized by its group's scale and minimum and multiplied with its half of x's inputs by one
`tl.dot`), the same sweep.

Napkin math: at 16 rows a weight is used 16 times, 32 FLOP a byte for int8: far under the H200's ~190 FLOP a byte of
tensor-core BF16, so 16 rows are bound by reading the weights, as one row is. 512 rows: 1,024 FLOP a byte, bound by
the matmul.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/gguf_rows_sweep.py"""

from common import (
    DEVICE,
    ON_GPU,
    finish,
    time_variant,
    validate,
)  # first: may switch on the interpreter
import itertools

import torch
import triton
import triton.language as tl

from forge_engine.kernels.gemv import GEMV_DOT_CONFIG, gemv
from forge_engine.quant.gemv import int4_dense, int4_matmul, int4_matmul_reference
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul_reference
from forge_engine.quant.gguf_gpu import (
    int8_group_dense,
    int8_group_matmul,
    int8_group_matmul_reference,
    q4_k_as_int4,
    q6_k_as_int8,
    q8_0_as_int8,
)
from forge_engine.quant.layers import pair_scales

SHAPES = {
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
}
TYPES = {"Q4_K": 12, "Q6_K": 14, "Q8_0": 8}
SWEEP = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
DOT_SWEEP = list(
    itertools.product((16, 32, 64), (128, 256), (4, 8), (1, 3))
)  # BLOCK_N, BLOCK_K, warps, stages
DOT_IN_F32 = tl.constexpr(
    not ON_GPU
)  # the interpreter's tl.dot misreads bf16: the same products in fp32 there


@triton.jit
def _int4_dot_kernel(
    x_ptr, q_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_sn, stride_sg,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x [M <= 16, K] @ (q · scale + minimum).T for chapter 10's int4: a group's byte j holds its inputs j
    (low nibble) and j + GROUP / 2 (high); BLOCK_K whole groups a step, K a whole number of steps; scale and minimum
    strided alike (`pair_scales` keeps them side by side)."""
    HALF: tl.constexpr = GROUP // 2
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok, m_ok = cols < N, rows < M
    # a step's bytes, and the inputs of their low nibbles (group g's g GROUP + j, j < HALF); the high ones are + HALF
    lane = tl.arange(0, BLOCK_K // 2)
    low_k = (lane // HALF) * GROUP + lane % HALF
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * (K // 2)
    s_rows = cols.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        b = tl.load(q_rows + k0 // 2 + lane[None, :], mask=n_ok[:, None], other=0)
        g = k0 // GROUP + lane // HALF
        at = s_rows + g[None, :] * stride_sg
        s = tl.load(scale_ptr + at, mask=n_ok[:, None], other=0.0).to(tl.float32)
        m = tl.load(min_ptr + at, mask=n_ok[:, None], other=0.0).to(tl.float32)
        w_low = ((b & 0x0F).to(tl.float32) * s + m).to(tl.bfloat16)
        w_high = ((b >> 4).to(tl.float32) * s + m).to(tl.bfloat16)
        x_low = tl.load(
            x_ptr + rows[:, None] * K + k0 + low_k[None, :], mask=m_ok[:, None], other=0.0
        )
        x_high = tl.load(
            x_ptr + rows[:, None] * K + k0 + HALF + low_k[None, :], mask=m_ok[:, None], other=0.0
        )
        if DOT_IN_F32:
            f32 = tl.float32
            acc = tl.dot(x_low.to(f32), tl.trans(w_low.to(f32)), acc, input_precision="ieee")
            acc = tl.dot(x_high.to(f32), tl.trans(w_high.to(f32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_low.to(tl.bfloat16), tl.trans(w_low), acc)
            acc = tl.dot(x_high.to(tl.bfloat16), tl.trans(w_high), acc)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_dot(x, packed, scale, minimum, block_n=32, block_k=256, num_warps=4, num_stages=1):
    "x [M <= 16, K] @ dequantize_int4(packed, scale, minimum).T through `_int4_dot_kernel`."
    m, k = x.shape
    n, group = packed.shape[0], k // scale.shape[1]
    if m > 16 or k % block_k or block_k % group or scale.stride() != minimum.stride():
        raise ValueError(
            f"int4_dot: at most 16 rows, K a multiple of block_k, whole groups: {m}, {k}, {group}"
        )
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _int4_dot_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), packed, scale, minimum, out, m, n, k, scale.stride(0), scale.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out


ok = True
torch.manual_seed(0)
for type_name, qtype in TYPES.items():
    for name, (n, k) in SHAPES.items():
        if not ON_GPU:
            n, k = 64, 512
        raw = gguf_bytes(qtype, n, k).to(DEVICE)
        if qtype == 12:
            packed, s, m = q4_k_as_int4(raw)
            paired = pair_scales(s, m)
            s, m = paired[..., 0], paired[..., 1]

            def run(x, **launch):
                return int4_matmul(
                    x,
                    packed,
                    s,
                    m,
                    impl="triton",
                    kernel="split_k" if x.shape[0] > 1 else None,
                    **launch,
                )

            def dense(x):
                return int4_dense(x, packed, s, m)

            def reference(x):
                return int4_matmul_reference(x, packed, s, m)

            nbytes = packed.numel() + 4 * s.numel()
        else:
            q, scale = (q8_0_as_int8 if qtype == 8 else q6_k_as_int8)(raw)

            def run(x, **launch):
                if not launch or x.shape[0] <= 4:
                    return int8_group_matmul(x, q, scale, impl="triton")
                from forge_engine.quant.gguf_gpu import _int8_group_matmul_kernel
                from forge_engine.quant.split_k import _skinny_matmul

                return _skinny_matmul(
                    _int8_group_matmul_kernel,
                    x,
                    (q, scale),
                    n,
                    256,
                    BLOCK_K=256,
                    GROUP=k // scale.shape[1],
                    **launch,
                )

            def dense(x):
                return int8_group_dense(x, q, scale)

            def reference(x):
                return int8_group_matmul_reference(x, q, scale)

            nbytes = q.numel() + 2 * scale.numel()
        label = f"{type_name} {name}"
        x1 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        x16 = torch.randn(16, k, device=DEVICE, dtype=torch.bfloat16)
        x512 = torch.randn(512, k, device=DEVICE, dtype=torch.bfloat16)
        want16 = gguf_matmul_reference(x16.float(), raw, qtype)
        ok &= validate(f"{label} 16 rows", run(x16).float(), want16, 2e-2)
        ok &= validate(
            f"{label} 512 rows dense", dense(x512).float(), reference(x512).float(), 1e-2
        )
        if qtype == 12:
            dot16 = int4_dot(x16, packed, s, m, block_k=min(256, k))
        else:
            dot16 = gemv(x16, q, dot=True, group_scale=scale, block_n=GEMV_DOT_CONFIG[0])
        ok &= validate(f"{label} 16 rows gemv dot", dot16.float(), want16, 2e-2)
        if not ON_GPU:
            break
        one, _ = time_variant(lambda: run(x1), graph=True)
        now, _ = time_variant(lambda: run(x16), graph=True)
        print(
            f"  {label:13s}  1 row GEMV {one * 1e3:6.1f} us ({nbytes / one / 1e9:4.2f} TB/s); 16 rows as built {now * 1e3:6.1f} us"
        )
        results = []
        for block_n, warps, stages in SWEEP:
            try:
                ms, _ = time_variant(
                    lambda: run(x16, block_n=block_n, num_warps=warps, num_stages=stages),
                    graph=True,
                )
            except Exception as e:  # a tile the compiler refuses: say so, go on
                print(f"  {label:13s} {(block_n, warps, stages)}: {type(e).__name__} {str(e)[:80]}")
                continue
            results.append((ms, (block_n, warps, stages)))
        results.sort()
        for ms, config in results[:3]:
            print(
                f"  {label:13s} 16 rows (BLOCK_N, warps, stages) {config}: {ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s)"
            )
        # the planes through a GEMV on all 16 rows: chapter 09's (int8), this file's (int4)
        dots = []
        for block_n, block_k, warps, stages in DOT_SWEEP:
            launch = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)

            def dot16(launch=launch):
                if qtype == 12:
                    return int4_dot(x16, packed, s, m, **launch)
                return gemv(x16, q, dot=True, group_scale=scale, **launch)

            try:
                got = dot16()
                ms, _ = time_variant(dot16, graph=True)
            except Exception as e:  # a tile the compiler refuses: say so, go on
                print(f"  {label:13s} gemv dot {tuple(launch.values())}: {type(e).__name__}")
                continue
            ok &= validate(f"{label} 16 rows gemv dot", got.float(), want16, 2e-2)
            dots.append((ms, tuple(launch.values())))
        for ms, config in sorted(dots)[:3]:
            print(
                f"  {label:13s} 16 rows gemv dot (BLOCK_N, BLOCK_K, warps, stages) {config}: {ms * 1e3:6.1f} us "
                f"({nbytes / ms / 1e9:4.2f} TB/s)"
            )
        d, _ = time_variant(lambda: dense(x512), graph=True)
        r, _ = time_variant(lambda: reference(x512), graph=True)
        print(
            f"  {label:13s} 512 rows dense {d * 1e3:7.1f} us; PyTorch dequantize + matmul {r * 1e3:7.1f} us"
        )
finish(ok)
