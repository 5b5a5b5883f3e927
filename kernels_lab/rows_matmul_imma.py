"""16 rows of x times a Q8_0 file's int8 planes on the int8 tensor cores, x quantized once per matmul: does the
16-sequence step's int8 matmul then read its weights faster?

Why: chapter 09's `rows_matmul` makes every int8 weight a bf16 before its `tl.dot` (through bf16's bits: 326
instructions a loop step of 64 weights a thread, compiled for sm_90). With x in int8 too, a group of 32 inputs per row
with a scale each (llama.cpp's Q8_1 blocks), one `mma` of k = 32 is one group's product in int32, and what is left per
weight is its share of the group's two scales on the int32 sums: 16 rows x 3 instructions (I2F, FMUL, FFMA) for 32
weights of a row.

folded_rows_matmul.py's `int8_dot` tried it inside the matmul and was 2-2.5x slower than dequantizing: every program
quantized x again, and a step's groups went through one batched `tl.dot`. Here x is quantized by one launch of its own
(`quantize_rows`: int8, group-major [K / 32, 16, 32] so that a group's rows load as one contiguous 512-byte tile, and
fp32 scales [M, K / 32]; in the step it would be the producers' epilogues: the hand-off, SiLU-mul, attention's
output), and each group is a `tl.dot` of its own on tiles loaded apart (STEP_GROUPS of them a loop step). SWAP: x the
left operand (mma.sync m16n8k32), else the weights (wgmma 64 x 16 x 32). Split along K, the programs' sums added
atomically into fp32 (a lab shortcut: the package's tickets would sum them in order).

Compiled for sm_90 offline (`sass`): the loop takes 3.3-5.4 instructions a weight by tile (64/4/4/4 with wgmma 4.9,
64/4/2/4 swapped 3.25), against the export's 5.1; until x's tile was group-major and the pointers' alignment known,
Triton loaded x a byte at a time through shared memory (13 a weight). Within 4e-7 of its own inputs' product and
6e-3 of bf16 x's under the interpreter. Not taken: on an H100 it lost on every matrix once x's own launch is counted
(µs, best tile of this kernel + x quantized, against rows_matmul as exported): qkv 12.5 + 2.2 against 12.4, o
10.8 + 3.0 against 11.9, gate-up 30.4 + 2.9 against 24.5, down 16.7 + 3.2 against 17.0.

Printed per Qwen3-4B matrix at 16 rows (µs a launch, weights read a second; each timing one CUDA graph of 50 launches
over enough copies of the weights to miss L2): `rows_matmul`'s int8 tile as exported, this kernel in each tile, and
x's quantization alone; and the error of each against the product of the dequantized weights and bf16 x.

Checked under the interpreter (TRITON_INTERPRET=1 PYTHONPATH=. python3 kernels_lab/rows_matmul_imma.py check);
compiled for sm_90 offline: TRITON_INTERPRET=0 PYTHONPATH=.:kernels_lab python3 kernels_lab/rows_matmul_imma.py sass.
On a GPU: PYTHONPATH=. python3 kernels_lab/rows_matmul_imma.py [time]"""

import sys

import torch

from common import launches_us
from forge_engine.kernels.backend import INTERPRETED, tl, triton
from forge_engine.kernels.rows_matmul import dequantized_groups, rows_matmul

GROUP = 32
ROWS = 16
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
TILES = (
    (64, 4, 4, 4, 0),
    (128, 4, 4, 4, 0),
    (64, 4, 4, 6, 0),
    (128, 2, 8, 4, 0),
    (64, 4, 4, 4, 1),
    (32, 4, 2, 4, 1),
    (64, 4, 2, 4, 1),
    (128, 4, 4, 4, 1),
)  # (BLOCK_N, STEP_GROUPS, warps, stages, SWAP)


@triton.jit
def _round(v):
    "Nearest integer (halves away from zero), the same compiled and interpreted."
    return tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    "Row program_id(0), inputs BLOCK * program_id(1) on: int8 q = round(x / s), s = max |x| / 127 a group."
    row, at = tl.program_id(0), tl.program_id(1) * BLOCK
    offs = at + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
    x = tl.reshape(x, (BLOCK // GROUP, GROUP))
    amax = tl.max(tl.abs(x), axis=1)
    inverse = 127.0 / tl.maximum(amax, 1e-30)  # (a group of zeros stays zeros)
    q = tl.reshape(_round(x * inverse[:, None]), (BLOCK,))
    # group-major [K / GROUP, ROWS, GROUP]: one group's x rows are one contiguous tile for the matmul's loads
    at_q = (offs // GROUP) * (ROWS * GROUP) + row * GROUP + offs % GROUP
    tl.store(q_ptr + at_q, q.to(tl.int8), mask=offs < K)
    offs_g = at // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * (K // GROUP) + offs_g, amax / 127.0, mask=offs_g < K // GROUP)


def quantize_rows(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= ROWS, K a multiple of group) -> int8 [K / group, ROWS, group] (a group's rows together, rows past
    M zeros) and fp32 scales [M, K / group], a scale a group of each row."""
    m, k = x.shape
    q = torch.zeros(k // group, ROWS, group, dtype=torch.int8, device=x.device)
    s = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    block = 256
    _quantize_rows_kernel[(m, triton.cdiv(k, block))](
        x, q, s, k, x.stride(0), GROUP=group, BLOCK=block, ROWS=ROWS
    )
    return q, s


@triton.jit
def _imma_kernel(
    xq_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
    SWAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    groups = K // GROUP
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([ROWS, BLOCK_N] if SWAP else [BLOCK_N, ROWS], dtype=tl.float32)
    w_rows = tl.multiple_of(
        offs_n.to(tl.int64) * K, 16
    )  # (K is a multiple of 32: rows start 16-byte aligned)
    x_tile = (
        offs_m[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    )  # a group's [ROWS, GROUP], contiguous
    for k0 in range(k_start, k_end, GROUP * STEP_GROUPS):
        for j in tl.static_range(STEP_GROUPS):
            offs_k = tl.max_contiguous(
                tl.multiple_of(k0 + j * GROUP + tl.arange(0, GROUP), GROUP), GROUP
            )
            w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None], other=0)
            g = k0 // GROUP + j
            xq = tl.load(xq_ptr + g * (ROWS * GROUP) + x_tile)
            sw = tl.load(sw_ptr + offs_n.to(tl.int64) * groups + g, mask=n_ok, other=0.0).to(
                tl.float32
            )
            sx = tl.load(sx_ptr + offs_m * groups + g, mask=m_ok, other=0.0)
            # SWAP: x the left operand (its 16 rows the mma's m), the weights transposed the right one
            a, b = (xq, tl.trans(w)) if SWAP else (w, tl.trans(xq))
            if UPCAST:  # the interpreter: the same sums in fp32 (exact: at most 32 * 127 * 127)
                d = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
            if SWAP:
                acc += d * (sx[:, None] * sw[None, :])
            else:
                acc += d * (sw[:, None] * sx[None, :])
    if SWAP:
        tl.atomic_add(
            out_ptr + offs_m[:, None] * N + offs_n[None, :],
            acc,
            mask=m_ok[:, None] & n_ok[None, :],
            sem="relaxed",
        )
    else:
        at = offs_m[None, :] * N + offs_n[:, None]
        tl.atomic_add(out_ptr + at, acc, mask=n_ok[:, None] & m_ok[None, :], sem="relaxed")


def imma_rows_matmul(xq, sx, weight, scale, tile=TILES[0], out=None, programs=None):
    """xq int8 [K / 32, ROWS, 32] with sx [M, K / 32] (`quantize_rows`) @ (weight int8 [N, K] times scale [N, K / 32]).T -> fp32
    [M, N], added into `out` (zeros) where given. tile: (BLOCK_N, STEP_GROUPS, warps, stages, SWAP)."""
    block_n, step_groups, warps, stages, swap = tile
    m, k, n = sx.shape[0], weight.shape[1], weight.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=xq.device) if out is None else out
    tiles = triton.cdiv(n, block_n)
    steps = k // (GROUP * step_groups)
    if programs is None:
        programs = (
            4 * torch.cuda.get_device_properties(xq.device).multi_processor_count
            if xq.is_cuda
            else 8
        )
    per_split = triton.cdiv(steps, max(1, min(steps, programs // tiles)))
    split = triton.cdiv(steps, per_split)
    _imma_kernel[(tiles, split)](
        xq, sx, weight, scale, out, m, n, k, per_split * GROUP * step_groups,
        BLOCK_N=block_n, ROWS=ROWS, GROUP=GROUP, STEP_GROUPS=step_groups, SWAP=bool(swap), UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def planes(n, k, device, gen=None):
    "A random Q8_0 matrix as chapter 10g repacks it: int8 [n, k], fp16 scales [n, k / 32]."
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen).to(device)
    s = ((torch.rand(n, k // GROUP, generator=gen) + 0.5) / (127 * k**0.5)).half().to(device)
    return q, s


def errors(x, q, s, tile) -> tuple[float, float]:
    "(this kernel against its own inputs dequantized, against bf16 x): max error over max |reference|."
    w = dequantized_groups(q, s, torch.float32)
    xq, sx = quantize_rows(x)
    got = imma_rows_matmul(xq, sx, q, s, tile)
    m = x.shape[0]
    own = (xq[:, :m].float().transpose(0, 1) * sx[..., None]).reshape(x.shape) @ w.T
    exact = x.float() @ w.T
    return tuple(((got - ref).abs().max() / ref.abs().max()).item() for ref in (own, exact))


def check():
    gen = torch.Generator().manual_seed(5)
    cases = (
        (16, 96, 256, (32, 2, 2, 2, 0)),
        (5, 64, 512, (64, 4, 4, 3, 0)),
        (2, 40, 128, (32, 1, 1, 2, 0)),
        (16, 96, 256, (32, 2, 2, 2, 1)),
        (7, 80, 512, (64, 4, 4, 3, 1)),
    )
    for m, n, k, tile in cases:
        x = torch.randn(m, k, generator=gen).bfloat16()
        own, exact = errors(x, *planes(n, k, "cpu", gen), tile)
        print(f"{m} x {k} @ {n}: {own:.1e} of its own inputs' product, {exact:.1e} of bf16 x's")
        assert own < 1e-5 and exact < 2e-2


def sass():
    from gemv_sass import loop_sass

    signature = {
        "xq_ptr": "*i8", "sx_ptr": "*fp32", "w_ptr": "*i8", "sw_ptr": "*fp16", "out_ptr": "*fp32",
        "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
        **{name: "constexpr" for name in ("BLOCK_N", "ROWS", "GROUP", "STEP_GROUPS", "SWAP", "UPCAST")},
    }  # fmt: skip
    aligned = ("xq_ptr", "sx_ptr", "w_ptr", "sw_ptr", "out_ptr", "N", "K", "k_per_split")
    for block_n, step_groups, warps, stages, swap in TILES:
        body, registers = loop_sass(
            _imma_kernel, signature,
            dict(BLOCK_N=block_n, ROWS=ROWS, GROUP=GROUP, STEP_GROUPS=step_groups, SWAP=bool(swap), UPCAST=False),
            warps, num_stages=stages, aligned=aligned,
        )  # fmt: skip
        weights = block_n * GROUP * step_groups / (32 * warps)
        kinds = sorted({t.split()[0].split(".")[0] for t in body if "MMA" in t})
        print(
            f"tile {block_n}/{step_groups}/{warps}/{stages}/{swap}: loop {len(body)} instructions for {weights:.0f} weights a "
            f"thread ({len(body) / weights:.2f} a weight), {registers} registers, {kinds}"
        )


def time_shapes():
    device = "cuda"
    print(torch.cuda.get_device_name(), flush=True)
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(400e6 // (n * k)))  # 400 MB of weights: past L2
        weights = [planes(n, k, device) for _ in range(copies)]
        x = torch.randn(ROWS, k, device=device).bfloat16()
        xq, sx = quantize_rows(x)
        out = torch.zeros(ROWS, n, device=device)
        w_bytes = n * k * (1 + 2 / GROUP)
        export = launches_us(
            lambda i: rows_matmul(x, weights[i % copies][0], scale=weights[i % copies][1]), 50
        )
        quant = launches_us(lambda i: quantize_rows(x), 50)
        line = f"{name} {n}x{k}: rows_matmul {export:6.1f} µs ({w_bytes / export / 1e6:.2f} TB/s); x quantized {quant:.1f} µs"
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        for tile in TILES:
            _, exact = errors(x, *weights[0], tile)
            line += f"\n  {'/'.join(map(str, tile))} (err {exact:.1e})"
            for per_sm in (4, 8):  # programs an SM (the export: eight for its int8 tile)
                try:
                    us = launches_us(
                        lambda i: imma_rows_matmul(
                            xq, sx, *weights[i % copies], tile, out=out, programs=per_sm * sms
                        ),
                        50,
                    )
                except Exception as e:  # a tile that does not compile is reported, not fatal
                    line += f" {per_sm} an SM failed: {type(e).__name__}"
                    continue
                line += f"; {per_sm} an SM {us:6.1f} µs ({w_bytes / us / 1e6:.2f} TB/s)"
        print(line, flush=True)
        weights = None  # (freed before the next shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "time"
    {"check": check, "sass": sass, "time": time_shapes}[what]()
