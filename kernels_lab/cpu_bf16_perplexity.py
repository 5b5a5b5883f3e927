"""What BF16 arithmetic does to perplexity: SmolLM2-135M's Q4_1 / Q8_0 GGUF kept quantized on a CPU (chapter 10).

The kept layers multiply through PyTorch's CPU weight-only GEMMs, which take BF16 (their FP32 variants are scalar
loops, ~40x slower): x, each block's scale and zero point, and the output are rounded to BF16's 8 significant bits,
a relative error of at most u = 2^-8 each; the Q8_0 head rounds each 32-input block's partial sum. Which kernel runs,
and so where exactly it rounds, depends on the CPU (AVX-512, AVX2 or the generic build).

This lab measures the perplexity ratio kept / dequantized FP32 on chapter 10's text:
- the exact path (`CPU_WEIGHT_GEMMS` off: blocks dequantized to FP32, then matmul): FP32 rounding only;
- the served path under each kernel build PyTorch has (`ATEN_CPU_CAPABILITY`), each in its own process;
- the same roundings emulated in FP64 (round to nearest), and under stochastic rounding for `LAB_SEEDS` seeds:
  unbiased, each error up to one BF16 ulp, twice the variance of rounding to nearest: a conservative model of
  "some BF16 kernel". Their spread is what chapter 10's bound on the kept perplexity is derived from.

Run anywhere (CPU, SmolLM2 fetched by the registry): PYTHONPATH=. python3 kernels_lab/cpu_bf16_perplexity.py"""

import copy
import json
import os
import statistics
import subprocess
import sys

import torch

import forge_engine.quant.layers as quant
from forge_engine.gguf_file import _f16
from forge_engine.loader import load_model
from forge_engine.quant.gguf_blocks import KEPT_GGUF_TYPES
from forge_engine.quant.layers import FIXED_TEXT, GGUFLinear, perplexity, quantize_model

SEEDS = int(os.environ.get("LAB_SEEDS", "16"))


def to_bf16(t: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    "t rounded to BF16 and back (FP64 in, FP64 out): to nearest, or stochastically with `gen`."
    f = t.float()
    if gen is None:
        return f.bfloat16().double()
    noise = torch.randint(0, 1 << 16, f.shape, generator=gen, dtype=torch.int32)
    return ((f.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32).double()


def block_parts(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "GGUF rows [N, bytes] -> (scale [N, K/32], zero [N, K/32], codes [N, K]) in FP64, weight = scale * code + zero."
    n, size = raw.shape[0], KEPT_GGUF_TYPES[qtype][2]
    blocks = raw.reshape(-1, size)
    d = _f16(blocks, 0).reshape(n, -1).double()
    if (
        qtype == 3
    ):  # Q4_1: d, m, 16 bytes (byte j: code j low, code j + 16 high); as the int4 GEMM sees it: q - 8
        b = blocks[:, 4:].reshape(n, -1, 16)
        q = torch.cat([b & 15, b >> 4], -1).reshape(n, -1).double() - 8
        return d, _f16(blocks, 2).reshape(n, -1).double() + 8 * d, q
    if qtype == 8:  # Q8_0: d, 32 int8
        return (
            d,
            torch.zeros_like(d),
            blocks[:, 2:].contiguous().view(torch.int8).reshape(n, -1).double(),
        )
    raise ValueError(f"no emulation for GGUF type {qtype}")


def emulated_dense(gen: torch.Generator | None):
    "GGUFLinear.dense in FP64 with the served path's BF16 roundings (Q4_1: x, scale, zero, output; Q8_0: x, blocks)."

    def dense(self, x, tile_weights=None):
        outs, xr = [], to_bf16(x.double(), gen)
        for qtype, raw in self.runs():
            d, z, q = block_parts(raw, qtype)
            if (
                qtype == 8
            ):  # a GEMM a block of 32 inputs, each block's sum rounded, then times d in FP32
                partial = torch.einsum(
                    "mbk,nbk->mnb", xr.reshape(len(xr), -1, 32), q.reshape(len(q), -1, 32)
                )
                outs.append((to_bf16(partial, gen) * d).sum(-1))
            else:
                w = q * to_bf16(d, gen).repeat_interleave(32, 1) + to_bf16(
                    z, gen
                ).repeat_interleave(32, 1)
                outs.append(to_bf16(xr @ w.t(), gen))
        return torch.cat(outs, -1).to(x.dtype)

    return dense


def ratios(smol, kept, ids) -> dict[str, float]:
    "Perplexity / the dequantized FP32 model's, for the kept GGUF and chapter 10's int8 and int4 (groups of 32)."
    base = perplexity(smol.model, ids)
    models = {
        "gguf": kept,
        "int8": quantize_model(copy.deepcopy(smol.model), "int8"),
        "int4, groups of 32": quantize_model(copy.deepcopy(smol.model), "int4", int4_group=32),
    }
    return {mode: perplexity(model, ids) / base for mode, model in models.items()}


def main():
    smol = load_model("smollm2-135m-instruct", device="cpu", progress=False)
    kept = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf").model
    ids = smol.tokenizer.encode(FIXED_TEXT)
    if sys.argv[1:] == ["served"]:  # a child process: this process's kernel build
        print(json.dumps(ratios(smol, kept, ids)))
        return
    base = perplexity(smol.model, ids)
    print(f"SmolLM2-135M Q4_1 GGUF, {len(ids)} tokens; dequantized FP32 perplexity {base:.4f}")
    print("perplexity / dequantized FP32 - 1:")
    quant.CPU_WEIGHT_GEMMS = False
    exact = ratios(smol, kept, ids)
    quant.CPU_WEIGHT_GEMMS = True
    print("  " + " " * 40 + "".join(f"{mode:>20s}" for mode in exact))
    print(
        f"  {'exact path (dequantized to FP32)':40s}"
        + "".join(f"{r - 1:+20.5%}" for r in exact.values())
    )
    for build in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=build)
        out = subprocess.run(
            [sys.executable, __file__, "served"], env=env, capture_output=True, text=True
        )
        served = json.loads(out.stdout.splitlines()[-1]) if out.returncode == 0 else {}
        print(
            f"  {'served, PyTorch ' + build + ' kernels':40s}"
            + "".join(
                f"{served[mode] - 1:+20.5%}" if mode in served else f"{'did not run':>20s}"
                for mode in exact
            )
        )
    kept_dense = GGUFLinear.dense
    GGUFLinear.dense = emulated_dense(None)
    print(f"  gguf, FP64 emulation, rounding to nearest: {perplexity(kept, ids) / base - 1:+.5%}")
    emulated = []
    for seed in range(SEEDS):
        GGUFLinear.dense = emulated_dense(torch.Generator().manual_seed(seed))
        emulated.append(perplexity(kept, ids) / base - 1)
    GGUFLinear.dense = kept_dense
    print(
        f"  gguf, FP64 emulation, stochastic rounding, {SEEDS} seeds: mean {statistics.mean(emulated):+.4%}, "
        f"sd {statistics.stdev(emulated):.4%}, range {min(emulated):+.4%} .. {max(emulated):+.4%}"
    )


if __name__ == "__main__":
    main()
