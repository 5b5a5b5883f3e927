"""Chapter 10da's C kernel against chapter 10e's PyTorch path, on SmolLM2-135M-Instruct's GGUF file (Q4_1 layers,
a Q8_0 head), at 1, 2, 4 and 8 rows: microseconds of one product (best of 5 rounds) and each path's relative error
to the dequantized reference. What `NATIVE_MAX_ROWS` rests on.

  c kernel   `native_gguf_matmul`: inputs in int8 blocks, integer dot products on the file's blocks
  pytorch    `GGUFLinear.dense` with the C kernel out of the way: PyTorch's int4 GEMM (Q4_1, inputs in bf16) or
             chapter 10e's `_q8_0_blocks_mm` (Q8_0, an int8 GEMM a block of 32 inputs)
Run anywhere from the repository root (the model must be in the cache: `forge-engine models pull
smollm2-135m-instruct`; a C compiler builds the kernel): PYTHONPATH=. python3 kernels_lab/cpu_gguf_kernel.py"""

from common import best_host_s  # first: it may switch on the interpreter (these ops do not care)
import torch

from forge_engine.loader import load_model
from forge_engine.quant import cpu_gguf
from forge_engine.kernels.cpu import cpu_kernels_status
from forge_engine.quant.gguf_blocks import gguf_matmul_reference

print(cpu_kernels_status())
model = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf").model
layer = model.layers[0]
matrices = {
    "qkv": layer.attn.qkv,
    "o": layer.attn.o,
    "gate_up": layer.mlp.gate_up,
    "down": layer.mlp.down,
    "head": model.lm_head,
}
everywhere = dict.fromkeys(cpu_gguf.NATIVE_MAX_ROWS, 16)  # the kernel at every row count measured
torch.manual_seed(0)
with torch.inference_mode():
    for name, linear in matrices.items():
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, linear.in_features)
            runs = list(linear.runs())
            want = torch.cat([gguf_matmul_reference(x, raw, q) for q, raw in runs], -1)

            def c_kernel():
                return torch.cat([cpu_gguf.native_gguf_matmul(x, raw, q) for q, raw in runs], -1)

            def pytorch():
                return linear.cpu_packs()[0][0](x, linear.cpu_packs()[0][1])

            saved, cpu_gguf.NATIVE_MAX_ROWS = cpu_gguf.NATIVE_MAX_ROWS, everywhere
            try:
                row = []
                for path, fn in (("c kernel", c_kernel), ("pytorch", pytorch)):
                    error = ((fn() - want).norm() / want.norm()).item()
                    row.append(
                        f"{path} {best_host_s(fn, reps=20) * 1e6:8.1f} us (error {error:.1e})"
                    )
            finally:
                cpu_gguf.NATIVE_MAX_ROWS = saved
            print(f"{name:8s} {rows} rows  " + "   ".join(row))
