"""The LM head on a CPU, one row (a decode step of one request): full precision against chapter 10's int8 head
(PyTorch's int8 weight-only GEMM), at SmolLM2-135M's shapes (head 49,152 x 576; its layer matrices for scale).
Napkin math: the FP32 head is 113 MB, the int8 one 28 MB; a laptop reads ~10-20 GB/s, so ~6-11 ms against ~2-3 ms.
Run on any machine from the repository root: PYTHONPATH=. python3 kernels_lab/quant_head_cpu.py"""

from common import best_host_s  # first: it may switch on the interpreter (unused here)
import torch
from torch import nn

from forge_engine.quant.layers import Int8Linear


def best_ms(fn) -> float:
    return best_host_s(fn, reps=50) * 1e3


def main():
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    for label, (n, k) in {
        "head": (49152, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
    }.items():
        linear = nn.Linear(k, n, bias=False)
        int8 = Int8Linear(linear)
        x = torch.randn(1, k)
        with torch.inference_mode():
            full, quantized = best_ms(lambda: linear(x)), best_ms(lambda: int8(x))
        print(
            f"{label:8s} {n:6d} x {k:4d}: fp32 {full:6.3f} ms, int8 {quantized:6.3f} ms ({full / quantized:.2f}x)"
        )


if __name__ == "__main__":
    main()
