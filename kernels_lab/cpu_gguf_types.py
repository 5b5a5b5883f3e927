"""Chapter 10da's C kernel on each GGUF type it multiplies, one matrix of Qwen3-4B's width (4096 x 2560, random valid
blocks) at 1 and 4 rows: microseconds of one product (best of 5 rounds) and the weight bytes read a second. What the
K types' super-block path (Q4_K, Q6_K: a Q4_K_M file's types) costs against the 32-weight types.

Run anywhere from the repository root (a C compiler builds the kernel): PYTHONPATH=. python3 kernels_lab/cpu_gguf_types.py"""

from common import best_host_s  # first: it may switch on the interpreter (these ops do not care)
import torch

from forge_engine.quant.cpu_gguf import NATIVE_MAX_ROWS, native_gguf_matmul
from forge_engine.quant.gguf_blocks import KEPT_GGUF_TYPES, gguf_bytes

N, K = 4096, 2560
print(f"{torch.get_num_threads()} threads, {N} x {K}")
torch.manual_seed(0)
for qtype in NATIVE_MAX_ROWS:
    raw = gguf_bytes(qtype, N, K)
    for rows in (1, 4):
        x = torch.randn(rows, K)
        if native_gguf_matmul(x, raw, qtype) is None:
            continue  # (more rows than the kernel takes for this type)
        s = best_host_s(lambda: native_gguf_matmul(x, raw, qtype), reps=20)
        name = KEPT_GGUF_TYPES[qtype][0]
        print(f"{name:5s} {rows} rows  {s * 1e6:7.1f} us  {raw.numel() / s / 1e9:5.1f} GB/s")
