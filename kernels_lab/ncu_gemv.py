"""Why the quantized GEMVs read below the bandwidth, in the hardware's counters: each of Qwen3-4B's four matrices (and
the LM head) in bf16, int8 and int4, one launch each under Nsight Compute (ncu), with its speed of light (DRAM
throughput), occupancy, issue activity and warp stall reasons.

The chain lab (gemv_chain_sweep.py) gives the times; this gives the reasons. int8 with one instruction a
weight fewer (`GEMV_INT8_OFFSET`: 4.1-4.5 -> 3.3-3.8 instructions a weight, more registers) ran slower (o 4.63 -> 5.47,
gate-up 15.14 -> 17.22 us), so the int8 loop is not short of issue slots; int4's loop is 3.5-4.1 instructions a weight,
at 3.7 TB/s about 3 of an SM's 4 warp-instructions a cycle (`gemv_sass.py`).

Run on a GPU from the repository root (the counters need access to the GPU's performance counters; clocks left
alone):
    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats python3 kernels_lab/ncu_gemv.py [bf16,int8,int4]
Without ncu it only launches each GEMV (and checks it against the dequantized matmul). `LAB_LAYOUTS=1`: bf16 and int8
also in the GEMV layout the export does not take for the shape (tile against rows: the memory side of the choice;
add `--section MemoryWorkloadAnalysis_Tables` for sectors a request and L2 / DRAM traffic).
Measured (one H200): the int8 tile GEMVs at 96 registers, 20 warps an SM, DRAM throughput 32-61%; int4 18-37%."""

import os
import sys

from common import DEVICE, ON_GPU, finish, validate  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels.gemv import gemv
from forge_engine.quant.formats import dequantize_int4, quantize_int4
from forge_engine.quant.gemv import int4_gemv

SHAPES = (
    {
        "qkv": (6144, 2560),
        "o": (2560, 4096),
        "gate_up": (19456, 2560),
        "down": (2560, 9728),
        "lm_head": (151936, 2560),
    }
    if ON_GPU
    else {"qkv": (96, 256), "gate_up": (16384, 256)}
)
LAYOUTS = bool(
    os.environ.get("LAB_LAYOUTS")
)  # bf16 / int8: each shape in the other layout too (`other_layout`)


def matrix(fmt: str, n: int, k: int) -> tuple:
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16()
    if fmt == "int4":
        return quantize_int4(w)
    if fmt == "int8":
        scale = w.float().abs().amax(dim=1) / 127
        return (w.float() / scale[:, None]).round().to(torch.int8), scale
    return (w,)


def product(fmt: str, x: torch.Tensor, mat: tuple, **launch) -> torch.Tensor:
    if fmt == "int4":
        return int4_gemv(x, *mat)
    return gemv(x, mat[0], None, mat[1] if fmt == "int8" else None, impl="triton", **launch)


def other_layout(fmt: str, n: int, k: int) -> dict:
    """The launch of bf16 / int8's other GEMV layout for this shape (`LAB_LAYOUTS=1`): the rows kernel at 2 rows,
    4 warps, 16 bytes a thread where the export takes the tile kernel, else the tile kernel's exported setting."""
    from forge_engine.kernels.gemv import gemv_config, gemv_layout

    width = 1 if fmt == "int8" else 2
    if gemv_layout(n, k, width) == "rows":
        return dict(
            layout="tile",
            **dict(zip(("block_n", "block_k", "num_warps"), gemv_config(n, k, width, "tile"))),
        )
    return dict(layout="rows", block_n=2, num_warps=4, block_k=32 * 4 * 16 // width)


def reference(fmt: str, x: torch.Tensor, mat: tuple) -> torch.Tensor:
    if fmt == "int4":
        return F.linear(x.float(), dequantize_int4(*mat))
    return F.linear(x.float(), mat[0].float()) * (mat[1][None, :] if fmt == "int8" else 1)


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "bf16,int8,int4").split(",")
    ok = True
    for fmt in formats:
        for name, (n, k) in SHAPES.items():
            if fmt == "int4" and name == "lm_head":
                continue  # (the int4 mode's head is int8)
            x = torch.randn(1, k, device=DEVICE).bfloat16()
            mat = matrix(fmt, n, k)
            ok &= validate(
                f"{fmt} {name}", product(fmt, x, mat).float(), reference(fmt, x, mat), 2e-2
            )
            launches = [{}]
            if LAYOUTS and fmt != "int4" and name != "lm_head":
                launches.append(other_layout(fmt, n, k))
                ok &= validate(
                    f"{fmt} {name} {launches[1]}",
                    product(fmt, x, mat, **launches[1]).float(),
                    reference(fmt, x, mat),
                    2e-2,
                )
            for launch in launches:
                for _ in range(3):
                    product(fmt, x, mat, **launch)  # compiled and warm
                if ON_GPU:
                    torch.cuda.synchronize()
                if ON_GPU:
                    torch.cuda.nvtx.range_push(
                        "profile"
                    )  # what ncu profiles (--nvtx-include "profile/")
                product(fmt, x, mat, **launch)
                if ON_GPU:
                    torch.cuda.nvtx.range_pop()
                print(f"profiled: {fmt} {name} {n}x{k} {launch or 'export'}", flush=True)
            del mat
    finish(ok)


if __name__ == "__main__":
    main()
