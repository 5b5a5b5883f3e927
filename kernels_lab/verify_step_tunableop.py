"""`verify_step.py` with cuBLAS autotuned: PyTorch's TunableOp times every cuBLAS / cuBLASLt algorithm for each
matmul shape of a verify step's rows (2-5 rows times each of random Qwen3-4B's matrices and its LM head), eagerly,
before the verify graphs are captured (TunableOp cannot tune inside a capture), then keeps the fastest for them.

On one H200 (LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1): 1 + 4 rows 1.388x a decode step, against 1.384x without tuning in
the same call, and 1.386x with cuBLASLt preferred (TORCH_BLAS_PREFER_CUBLASLT=1): cuBLAS's own choice is already
its fastest for these shapes.

Run on a GPU from the repository root:
    LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 PYTHONPATH=.:kernels_lab python3 kernels_lab/verify_step_tunableop.py"""

import runpy
import sys

import torch
import torch.cuda.tunable as tunable
import torch.nn.functional as F

SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560)]  # (N, K)


def tune() -> None:
    "Each verify-row count's matmuls once, eagerly, with tuning on; then tuning off, the results kept."
    tunable.enable(True)
    tunable.tuning_enable(True)
    for rows in (2, 3, 4, 5):
        for n, k in SHAPES:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            F.linear(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    tunable.tuning_enable(False)


if __name__ == "__main__":
    tune()
    sys.argv = ["verify_step.py", "bf16"]
    runpy.run_path("kernels_lab/verify_step.py", run_name="__main__")
