"""The residual add and the RMSNorm folded into the GEMVs around them, at one row (a batch-1 decode step).

Napkin math: a Qwen3-4B decode step runs 73 add+RMSNorm kernels on 2,560 numbers each: ~10 KB read and written,
nothing for the bandwidth, but each costs a launch in the graph, its ramp and the next kernel's (session 14's step
timeline: 1.9 µs each plus a 0.4 µs gap, 192 µs of a 2.66 ms BF16 step). Folded:
  * the residual add goes into the epilogue of the GEMV before it (o, down): `out = residual + x @ W.T`, rounded once;
  * the norm goes into the GEMV after it (qkv, gate-up, the LM head): it reads the residual stream h instead of
    norm(h), multiplies each x by the norm weight as it loads it (one more 16-byte load a step, from L2/L1), sums x²
    on the side, and scales its sums by 1/rms at the end.
Each program normalises on its own (no grid-wide sum, no atomics): the bits do not depend on timing.

Variants, per layer (36 layers of distinct Qwen3-4B-shaped weights, one CUDA graph, L2 flushed before the replay):
  unfolded  o GEMV, add+RMSNorm, gate-up GEMV (SiLU-mul), down GEMV, add+RMSNorm, qkv GEMV   (what the engine runs)
  folded    o GEMV + residual, gate-up GEMV with the norm, down GEMV + residual, qkv GEMV with the norm
for BF16 and int8 weights (chapter 09's `gemv`, with chapter 10's int8 scales).

Run from the repository root: PYTHONPATH=. python3 kernels_lab/gemv_norm_fold.py (on a CPU: validation only)."""
from common import DEVICE, HBM_BYTES_PER_S, ON_GPU, finish, graphed_ms, validate  # first: it may switch on the interpreter
import torch
from forge_engine.kernels import add_rmsnorm, gemv
from forge_engine.quant import quantize_int8

HIDDEN, INTER, Q_OUT, QKV = 2560, 9728, 4096, 6144  # Qwen3-4B
LAYERS = 36
EPS = 1e-6


def layer_weights(fmt: str, scale_down: int = 1):
    "(o, gate_up, down, qkv) as gemv's (weight, scale) and two norm weights, at 1/scale_down of each size (the CPU)."
    def matrix(n, k):
        w = (torch.randn(n // scale_down, k // scale_down, device=DEVICE) / k ** 0.5)
        return quantize_int8(w) if fmt == "int8" else (w.bfloat16(), None)
    shapes = ((HIDDEN, Q_OUT), (2 * INTER, HIDDEN), (HIDDEN, INTER), (QKV, HIDDEN))
    norms = [(torch.rand(HIDDEN // scale_down, device=DEVICE) + 0.5).bfloat16() for _ in range(2)]
    return [matrix(n, k) for n, k in shapes], norms


def unfolded(attn, h, weights, impl="triton"):
    "A layer as the engine runs it now: the adds and the norms as kernels of their own."
    (o, gu, down, qkv), (n1, n2) = weights
    x, h = add_rmsnorm(gemv(attn, *o[:1], None, o[1], impl=impl), h, n1, EPS, impl=impl)
    x, h = add_rmsnorm(gemv(gemv(x, gu[0], None, gu[1], impl=impl, swiglu=True), down[0], None, down[1], impl=impl), h,
                       n2, EPS, impl=impl)
    return gemv(x, qkv[0], None, qkv[1], impl=impl), h


def folded(attn, h, weights, impl="triton"):
    "The same layer with the adds in the GEMVs' epilogues and the norms in the next GEMVs."
    (o, gu, down, qkv), (n1, n2) = weights
    h = gemv(attn, o[0], None, o[1], impl=impl, residual=h)
    h = gemv(gemv(h, gu[0], None, gu[1], impl=impl, swiglu=True, norm=(n1, EPS)), down[0], None, down[1], impl=impl,
             residual=h)
    return gemv(h, qkv[0], None, qkv[1], impl=impl, norm=(n2, EPS)), h


def main():
    ok = True
    for fmt in ("bf16", "int8"):
        weights = layer_weights(fmt, 1 if ON_GPU else 16)
        k_attn = weights[0][0][0].shape[1]
        attn = torch.randn(1, k_attn, device=DEVICE).bfloat16()
        h = torch.randn(1, weights[0][0][0].shape[0], device=DEVICE).bfloat16() * 4
        want_q, want_h = unfolded(attn, h, weights, impl="torch")
        got_q, got_h = folded(attn, h, weights)
        ok &= validate(f"{fmt} folded layer: qkv", got_q.float(), want_q.float(), 2e-2)
        ok &= validate(f"{fmt} folded layer: residual", got_h.float(), want_h.float(), 2e-2)
    if not ON_GPU:
        finish(ok)
    print(f"\n== {LAYERS} layers' GEMVs (o, gate-up, down, qkv), distinct weights, one CUDA-graph replay")
    for fmt in ("bf16", "int8"):
        layers = [layer_weights(fmt) for _ in range(LAYERS)]
        attn = torch.randn(1, Q_OUT, device=DEVICE).bfloat16()
        h0 = torch.randn(1, HIDDEN, device=DEVICE).bfloat16()

        def chain(layer_fn):
            h = h0
            for weights in layers:
                _, h = layer_fn(attn, h, weights)
            return h
        nbytes = sum(t.numel() * t.element_size() for mats, _ in layers for m in mats for t in m if t is not None)
        times = {name: graphed_ms(lambda: chain(fn)) for name, fn in (("unfolded", unfolded), ("folded", folded))}
        for name, ms in times.items():
            print(f"  {fmt:5s} {name:9s} {ms * 1e3:8.1f} µs a step's layers ({ms * 1e3 / LAYERS:6.2f} µs a layer), "
                  f"{nbytes / ms / 1e9:5.2f} TB/s = {nbytes / ms / 1e9 / HBM_BYTES_PER_S * 1e12:4.0%} of the ceiling")
        print(f"  {fmt:5s} folded saves {(times['unfolded'] - times['folded']) * 1e3:.1f} µs a step")
    finish(ok)


if __name__ == "__main__":
    main()
