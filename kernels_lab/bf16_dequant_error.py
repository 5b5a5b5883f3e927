"""How far chapter 09_kernels_rows_matmul's bf16 dequantization moves a product, on a CPU (bf16 arithmetic in torch).

Why: for bf16 x the rows_matmul tiles make each weight bf16 in bf16 arithmetic, the group's scale (and for int4 its
minimum) rounded to bf16 first; the split-K and cuBLAS paths make it in fp32 and round once. A scale rounded to bf16
moves a whole group's weights together, by up to 2^-9 of each; a Q4_K minimum is about -7.5 scales, so rounding it
moves every weight of the group by up to 2^-9 of that, several times a weight's own rounding. Centred, a weight is
(q - 8) * s + (m + 8 s): m + 8 s is about one scale, and its rounding small.

Gaussian weights quantized as the GGUF types store them (Q8_0: int8 and an fp16 scale a group of 32; Q4_K: 4-bit q,
an fp16 scale and minimum a group of 32), 16 rows of bf16 x; the product's error against fp64's, relative (RMS):
    PYTHONPATH=. python3 kernels_lab/bf16_dequant_error.py"""

import torch

N, K, GROUP, ROWS = 4096, 2560, 32, 16
BF16 = torch.bfloat16


def relative_error(weights: torch.Tensor, x: torch.Tensor, truth: torch.Tensor) -> float:
    got = weights.double() @ x.T
    return ((got - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()).item()


def bf16(t: torch.Tensor) -> torch.Tensor:
    "Rounded to bf16 (round to nearest even), back in fp64."
    return t.to(BF16).double()


def main():
    gen = torch.Generator().manual_seed(0)
    x = bf16(torch.randn(ROWS, K, generator=gen, dtype=torch.float64))
    w = torch.randn(N, K // GROUP, GROUP, generator=gen, dtype=torch.float64) * 0.02

    # Q8_0: q = round(w / s), s = max|w| / 127 in fp16
    s = (w.abs().amax(-1, keepdim=True) / 127).half().double()
    q = (w / s).round().clamp(-127, 127)
    s, q = s.expand_as(q).reshape(N, K), q.reshape(N, K)
    truth = (q * s) @ x.T
    print("Q8_0, error of the product relative to fp64's (RMS):")
    print(f"  q * s in fp32, rounded once to bf16     {relative_error(bf16(q * s), x, truth):.2e}")
    print(
        f"  q * bf16(s) rounded to bf16 (the tile)  {relative_error(bf16(q * bf16(s)), x, truth):.2e}"
    )

    # Q4_K: w ~ q * s + m, m the group's minimum, s its range / 15, both fp16
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    s, m = ((hi - lo) / 15).half().double(), lo.half().double()
    q = ((w - m) / s).round().clamp(0, 15)
    s, m, q = (t.expand_as(q).reshape(N, K) for t in (s, m, q))
    truth = (q * s + m) @ x.T
    print(f"Q4_K (minimum / scale {(m / s).mean().item():.2f} on average), the same:")
    print(
        f"  q * s + m in fp32, rounded once          {relative_error(bf16(q * s + m), x, truth):.2e}"
    )
    for label, shift, minimum in (("m", 0, m), ("m + 8 s, centred", 8, m + 8 * s)):
        fused = bf16((q - shift) * bf16(s) + bf16(minimum))  # one rounding: a bf16x2 FMA
        twice = bf16(bf16((q - shift) * bf16(s)) + bf16(minimum))  # a multiply, then an add
        print(f"  (q - {shift}) * bf16(s) + bf16({label}): one rounding {relative_error(fused, x, truth):.2e}, "
              f"two {relative_error(twice, x, truth):.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
