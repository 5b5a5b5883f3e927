"""RMSNorm fused with the residual add: `residual = x + residual; out = rmsnorm(residual) * w`.

Napkin math (Qwen3-4B, hidden 2560, bf16): the fewest bytes are read x, read residual, write
the new residual, write out = 4 x T x 2560 x 2 bytes (+ the weight). At T = 1 that is 20 KB:
no kernel gets near the bandwidth, it is one launch (~2-4 us), and the win is in launching
one kernel instead of ~6. At T = 4096 it is 84 MB: 20 us at 4.19 TB/s.

Variants
  v0  PyTorch eager (the reference): add, pow, mean, rsqrt, mul, cast, mul: ~7 kernels
  v1  PyTorch add, then a Triton RMSNorm (the add's result is written and read again)
  v2  one fused Triton kernel, one program per row (forge_engine.kernels.add_rmsnorm), by num_warps
"""

import torch

from common import DEVICE, ON_GPU, Results, finish, selected, time_variant, validate
from forge_engine.kernels.elementwise import add_rmsnorm, add_rmsnorm_reference, rmsnorm

EPS = 1e-6


def v0_torch(x, r, w):
    return add_rmsnorm_reference(x, r, w, EPS)


def v1_add_then_norm(x, r, w):
    residual = x + r
    return rmsnorm(residual, w, EPS, impl="triton"), residual


def v2_fused(num_warps=None):
    return lambda x, r, w: add_rmsnorm(x, r, w, EPS, impl="triton", num_warps=num_warps)


VARIANTS = {
    "v0 torch eager": v0_torch,
    "v1 torch add + triton norm": v1_add_then_norm,
    "v2 fused (exported)": v2_fused(),
}
SWEEP = {f"v2 fused num_warps={n}": v2_fused(n) for n in (2, 4, 8, 16)}


def inputs(tokens, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    return x, r, (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)


def main():
    ok = True
    sizes = (
        [(1, 2560), (256, 2560), (4096, 2560), (7, 1000)]
        if ON_GPU
        else [(1, 64), (5, 100), (3, 2560)]
    )
    print("validation against the reference (fp32 and bf16)")
    for tokens, hidden in sizes:
        for dtype, limit in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            x, r, w = inputs(tokens, hidden, dtype)
            want_out, want_res = v0_torch(x, r, w)
            for name, fn in {**VARIANTS, **(SWEEP if ON_GPU else {})}.items():
                out, res = fn(x, r, w)
                ok &= validate(f"{name} T={tokens} H={hidden} {dtype}", out, want_out, limit)
                ok &= validate(
                    f"{name} residual",
                    res,
                    want_res,
                    0.0 if ON_GPU or dtype == torch.float32 else 1e-2,
                )
    if ON_GPU:
        results = Results("add_rmsnorm")
        for tokens in (1, 64, 256, 4096, 16384):
            x, r, w = inputs(tokens, 2560, torch.bfloat16)
            nbytes = (4 * tokens * 2560 + 2560) * 2
            for name, fn in selected({**VARIANTS, **SWEEP}).items():
                for graph in (False, True):
                    ms, how = time_variant(lambda: fn(x, r, w), graph)
                    results.add(f"T={tokens} H=2560 bf16", f"{name} [{how}]", ms, nbytes)
        results.print()
    finish(ok)


if __name__ == "__main__":
    main()
