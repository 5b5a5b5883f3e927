"""1-8 rows times a Qwen3-14B int4 matrix on a CPU (what the CPU's layers of a split model spend most of a step on,
chapter 10h: a decode of one sequence, a verify step's or a few sequences' rows): PyTorch's int4 GEMM (chapter 10's int4, groups of 128 and of 32) against chapter 10da's C kernel on
the same weights as Q4_1 blocks (groups of 32: d q + m, integer dot products with the input quantized to int8).

Napkin math: gate-up (34,816 x 5,120) is 89 MB in 4 bits; at the CPU's read bandwidth that is its floor. PyTorch's
int4 GEMM turns every weight into a float before it multiplies; the C kernel multiplies bytes.

Prints each matrix's time and bandwidth at each row count, and the C kernel's error against PyTorch's on the same
weights. (Chapter 10e sends int4 to the C kernel at one row, as chapter 10da does Q4_0 / Q4_1: there, on another
machine, PyTorch's GEMM won from two rows on.)
Run anywhere from the repository root: PYTHONPATH=. python3 kernels_lab/cpu_int4_rows.py"""

from common import best_host_s  # first: it may switch on the interpreter (unused here)
import numpy as np
import torch

from forge_engine.quant.cpu_gguf import _gguf_kernel, _run_gguf_kernel
from forge_engine.quant.layers import _gguf_cpu_operands, cpu_int4pack, cpu_int4pack_mm

Q4_1 = 3  # GGML's type number
MATRICES = {"gate_up": (34816, 5120), "down": (5120, 17408), "qkv": (7168, 5120)}
ROWS = (1, 2, 4, 8)


def random_q4_1(n: int, k: int, seed: int = 0) -> torch.Tensor:
    "Rows of random Q4_1 blocks [n, k/32 * 20 bytes]: d and m float16 (scale 1e-2, minimum -8e-2), 16 bytes of nibbles."
    rng = np.random.default_rng(seed)
    blocks = np.empty((n * k // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.005, 0.015, n * k // 32).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = (-8 * d).view(np.uint8).reshape(-1, 2)
    blocks[:, 4:] = rng.integers(0, 256, size=(n * k // 32, 16), dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def main():
    print(f"{torch.get_num_threads()} threads; ms a matrix (GB/s of its 4-bit weights)")
    c_kernel = _gguf_kernel()
    for name, (n, k) in MATRICES.items():
        raw = random_q4_1(n, k)
        matmul, operands = _gguf_cpu_operands(raw, Q4_1)  # the same weights in PyTorch's int4 GEMM
        nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        groups_of_128 = cpu_int4pack(
            nibbles, 128, torch.full((n, k // 128), 0.01), torch.zeros(n, k // 128)
        )
        for rows in ROWS:
            x = torch.randn(rows, k)
            got, want = _run_gguf_kernel(c_kernel, x, raw, Q4_1), matmul(x, operands)
            error = float((got - want).abs().max() / want.abs().max())
            times = {
                "C Q4_1": best_host_s(lambda: _run_gguf_kernel(c_kernel, x, raw, Q4_1), 5, 3),
                "PyTorch int4, 32": best_host_s(lambda: matmul(x, operands), 5, 3),
                "PyTorch int4, 128": best_host_s(lambda: cpu_int4pack_mm(x, groups_of_128), 5, 3),
            }
            print(
                f"  {name:8s} {n:6d} x {k:6d}, {rows} rows: "
                + ", ".join(
                    f"{k_} {s * 1e3:.2f} ({n * k / 2 / s / 1e9:.1f})" for k_, s in times.items()
                )
                + f"; C against PyTorch {error:.1e} relative"
            )


if __name__ == "__main__":
    main()
