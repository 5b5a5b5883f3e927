"""A GEMV for int8 weights with an fp16 scale per group of 32 inputs, the layout a Q8_0 file's blocks repack into at
load (the 32 int8 quants of each block side by side in one [N, K] plane, the block scales in another [N, K/32]),
against chapter 10d's GGUF GEMV on the 34-byte blocks as the file has them: one row, Qwen3-4B's matrices, CUDA-graph
replays with L2 flushed, and a small sweep of tile shapes. The question for the GGUF path on a GPU: how close does a
plain Triton kernel on aligned planes come to the read ceiling, where chapter 10d's GEMV reads bytes one at a time?
(Q6_K fits the same layout with groups of 16: its 6-bit q - 32 as int8, d times its int8 scale as the group scale.)

Napkin math: Q8_0 is 8.5 bits a weight, the planes 8.5 too (8 + 16 / 32). At the H200's ~4.2 TB/s read ceiling,
gate_up (19456 x 2560, 52.9 MB) takes 12.6 us; chapter 10d's GEMV reads such blocks at ~0.9 TB/s (58.7 us). Each
weight costs an int8 -> fp32 conversion and an FMA; the conversions, not the bytes, may bound a plain kernel.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/int8_group_gemv.py"""

from common import (
    DEVICE,
    ON_GPU,
    finish,
    time_variant,
    validate,
)  # first: it may switch on the interpreter
import torch
import triton
import triton.language as tl

from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul, gguf_matmul_reference

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
GROUP = 32


def q8_0_planes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "Q8_0 rows [N, K/32 x 34 bytes] -> (int8 quants [N, K], fp16 scales [N, K/32]): the same numbers, regrouped."
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1), blocks[
        ..., :2
    ].contiguous().view(torch.float16).reshape(n, -1)


@triton.jit
def _int8_group_gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    groups = K // G
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=n_mask[:, None]
        )
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        offs_g = k0 // G + tl.arange(0, BLOCK_K // G)
        s = tl.load(
            s_ptr + offs_n[:, None].to(tl.int64) * groups + offs_g[None, :], mask=n_mask[:, None]
        )
        part = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // G, G)), axis=2)
        acc += tl.sum(part * s.to(tl.float32), axis=1)
    tl.store(out_ptr + offs_n, acc, mask=n_mask)


def int8_group_gemv(x, q, scales, block_n=8, block_k=512, num_warps=4):
    "x [1, K] @ (q * scales per group).T -> [1, N] float32."
    n, k = q.shape
    out = torch.empty(1, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n),)
    _int8_group_gemv[grid](
        x, q, scales, out, n, k, GROUP, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps
    )
    return out


ok = True
torch.manual_seed(0)
for name, (n, k) in SHAPES.items():
    if not ON_GPU:  # (the interpreter: one small shape is enough to check the arithmetic)
        n, k = 64, 512
    raw = gguf_bytes(8, n, k).to(DEVICE)
    q, scales = q8_0_planes(raw)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    want = gguf_matmul_reference(x.float(), raw, 8)
    ok &= validate(f"{name} int8 groups of 32", int8_group_gemv(x, q, scales, 8, 256), want, 1e-2)
    if not ON_GPU:
        break
    nbytes = raw.numel()
    ms, how = time_variant(lambda: gguf_matmul(x, raw, 8, impl="triton"), graph=True)
    print(
        f"  {name:8s} gguf Q8_0 GEMV         {ms * 1e3:7.1f} us ({how})  {nbytes / ms / 1e9:5.2f} TB/s"
    )
    best = None
    for block_n, block_k, warps in [
        (4, 512, 4),
        (8, 512, 4),
        (8, 1024, 8),
        (16, 256, 4),
        (16, 512, 8),
        (32, 256, 8),
    ]:
        fn = lambda: int8_group_gemv(x, q, scales, block_n, block_k, warps)  # noqa: E731
        ms, how = time_variant(fn, graph=True)
        best = min(best or (ms, ""), (ms, f"{block_n}x{block_k}, {warps} warps"))
        print(
            f"  {name:8s} int8 g32 {block_n:2d}x{block_k:4d} w{warps}  {ms * 1e3:7.1f} us ({how})  {nbytes / ms / 1e9:5.2f} TB/s"
        )
    print(f"  {name:8s} best int8 g32: {best[0] * 1e3:.1f} us ({best[1]})")
finish(ok)
