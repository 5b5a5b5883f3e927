"""The matrices of a whole batch-1 decode step, chained as the model runs them: 36 Qwen3-4B layers.

Napkin math: the four matrices of a layer are 202 MB in bf16 (101 MB in int8); 36 layers are
7.26 GB (3.63 GB): 1.73 ms (0.87 ms) at 4.19 TB/s. One kernel launch inside a CUDA graph
costs a few microseconds of mostly idle GPU, so with 4 matrices and 3 small kernels a layer,
~250 launches are ~0.5 ms on top: the chain, not one matrix, says what batch-1 decode can do.
Attention and q/k-norm+RoPE are left out (the same in every variant).

Variants (one CUDA-graph replay of the whole chain, distinct weights per layer, so nothing is cached)
  c0  cuBLAS F.linear + the Triton add+RMSNorm and SiLU-mul kernels: 7 launches a layer
  c1  Triton gemv + the same small kernels (exported, without programmatic dependent launch)
  c2  c1 with the GEMVs launched as programmatic dependents (exported on Hopper)
  c3  c1 on int8 weights with per-row scales (chapter 10's int8); c4 the same with PDL

Measured on one H200 (earlier builds of the GEMV kernel): the residual add + norm
folded into the qkv / gate-up GEMVs and SiLU-mul into down (4 launches a layer) took 3.05 ms
against 2.79 ms unfused (2.58 ms with the best tile sizes and PDL); double-buffered weight tiles
took 2.79 ms against 2.29 ms for the single-load loop. Neither is in the package.
"""

from common import (
    DEVICE,
    HBM_BYTES_PER_S,
    ON_GPU,
    finish,
    graphed_ms,
    selected,
    validate,
)  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels.elementwise import add_rmsnorm, silu_mul
from forge_engine.kernels.gemv import gemv

HIDDEN, QKV, INTER, O_IN = (2560, 6144, 9728, 4096) if ON_GPU else (64, 96, 80, 32)
LAYERS = 36 if ON_GPU else 2


def make_layers(int8: bool):
    def matrix(n, k):
        if int8:
            return torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8), torch.rand(
                n, device=DEVICE
            ) / 127 / k**0.5
        return (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16(), None

    norm = lambda: (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).bfloat16()
    return [
        dict(
            qkv=matrix(QKV, HIDDEN),
            o=matrix(HIDDEN, O_IN),
            gate_up=matrix(2 * INTER, HIDDEN),
            down=matrix(HIDDEN, INTER),
            attn_norm=norm(),
            mlp_norm=norm(),
        )
        for _ in range(LAYERS)
    ]


def chain(x, layers, matmul):
    residual = None
    for p in layers:
        h, residual = add_rmsnorm(x, residual, p["attn_norm"], 1e-6, impl="triton")
        attn = matmul(h, *p["qkv"])[:, :O_IN]  # attention left out: its output has q's width
        h, residual = add_rmsnorm(
            matmul(attn, *p["o"]), residual, p["mlp_norm"], 1e-6, impl="triton"
        )
        x = matmul(silu_mul(matmul(h, *p["gate_up"]), impl="triton"), *p["down"])
    return x + residual


def cublas(h, w, scale):
    return F.linear(h, w) if scale is None else F.linear(h, w.to(h.dtype)) * scale.to(h.dtype)


def triton_gemv(h, w, scale):
    return gemv(h, w, None, scale, impl="triton", pdl=False)


def triton_gemv_pdl(h, w, scale):
    return gemv(h, w, None, scale, impl="triton", pdl=ON_GPU)


def main():
    torch.manual_seed(0)
    x = torch.randn(1, HIDDEN, device=DEVICE).bfloat16()
    bf16, int8 = make_layers(False), make_layers(True)
    ok = validate(
        "c1 gemv chain", chain(x, bf16, triton_gemv).float(), chain(x, bf16, cublas).float(), 3e-2
    )
    ok &= validate(
        "c3 int8 gemv chain",
        chain(x, int8, triton_gemv).float(),
        chain(x, int8, cublas).float(),
        3e-2,
    )
    if not ON_GPU:
        finish(ok)
    variants = {
        "c0 cuBLAS + small kernels": (lambda: chain(x, bf16, cublas), 2),
        "c1 gemv + small kernels": (lambda: chain(x, bf16, triton_gemv), 2),
        "c2 gemv, PDL": (lambda: chain(x, bf16, triton_gemv_pdl), 2),
        "c3 int8 gemv": (lambda: chain(x, int8, triton_gemv), 1),
        "c4 int8 gemv, PDL": (lambda: chain(x, int8, triton_gemv_pdl), 1),
    }
    print(
        f"\n== {LAYERS} layers' matrices at batch 1, one CUDA-graph replay (L2 flushed); ceiling 4.19 TB/s"
    )
    for name, (fn, weight_bytes) in selected(variants).items():
        nbytes = (
            LAYERS
            * weight_bytes
            * (QKV * HIDDEN + HIDDEN * O_IN + 2 * INTER * HIDDEN + HIDDEN * INTER)
        )
        ms = graphed_ms(fn)
        print(
            f"  {name:28s} {ms:7.3f} ms  {nbytes / ms / 1e9:6.2f} TB/s  {100 * nbytes / ms / 1e3 / HBM_BYTES_PER_S:5.1f}%",
            flush=True,
        )
    finish(ok)


if __name__ == "__main__":
    main()
