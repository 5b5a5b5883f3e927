"""Q4_K blocks repacked at load into chapter 10's int4 layout (groups of 32, an fp16 scale and minimum a group),
then multiplied by chapter 10c's int4 GEMV, against chapter 10d's GGUF GEMV on the blocks as the file has them:
one row, Qwen3-4B's matrices, CUDA-graph replays with L2 flushed. The question for the GGUF path on a GPU: does a
layout the fast kernel already reads beat decoding 144-byte super-blocks in the GEMV?

Napkin math: Q4_K is 4.5 bits a weight (144 bytes a super-block of 256); the repack is 4 bits plus 32 bits of fp16
scale and minimum a group of 32, 5 bits a weight: 11% more bytes. The GGUF GEMV reads its blocks byte by byte
(34- and 144-byte blocks are not aligned for wider loads); the int4 GEMV reads 16-byte chunks.

The repack is exact up to the fp16 rounding of the products d * scale and dmin * min (2^-11 relative): weight =
(d sc) q - (dmin m) = scale q + minimum, with q the same nibble.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/gguf_repack.py"""

from common import (
    DEVICE,
    ON_GPU,
    finish,
    rel_error,
    time_variant,
    validate,
)  # first: may switch on the interpreter
import torch

from forge_engine.gguf_file import DEQUANTIZERS
from forge_engine.quant.formats import dequantize_int4
from forge_engine.quant.gemv import int4_matmul
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul
from forge_engine.quant.gguf_gpu import q4_k_as_int4  # the repack chapter 10g does at load on a GPU

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


ok = True
torch.manual_seed(0)
for name, (n, k) in SHAPES.items():
    raw = gguf_bytes(12, n, k).to(DEVICE)
    packed, scale, minimum = q4_k_as_int4(raw)
    want_w = DEQUANTIZERS[12](raw.reshape(-1, 144)).reshape(n, k).float()
    print(
        f"{name} {n}x{k}: repack's weights against the file's: rel err {rel_error(dequantize_int4(packed, scale, minimum), want_w):.1e}"
    )
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    want = x.float() @ want_w.T
    gguf = lambda: gguf_matmul(x, raw, 12, impl="triton")  # noqa: E731
    int4 = lambda: int4_matmul(x, packed, scale, minimum, impl="triton")  # noqa: E731
    ok &= validate(f"{name} gguf Q4_K GEMV", gguf().float(), want, 2e-2)
    ok &= validate(f"{name} repacked int4 GEMV", int4().float(), want, 2e-2)
    if ON_GPU:
        for label, fn, nbytes in (
            ("gguf Q4_K", gguf, raw.numel()),
            ("int4 g32", int4, packed.numel() + 4 * scale.numel()),
        ):
            ms, how = time_variant(fn, graph=True)
            print(f"  {label:10s} {ms * 1e3:8.1f} us ({how})  {nbytes / ms / 1e9:6.2f} TB/s")
finish(ok)
