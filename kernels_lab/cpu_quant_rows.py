"""Chapter 10e's row threshold on a CPU: PyTorch's weight-only GEMMs (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) read every weight again for each row of x, so their time grows with the rows; a matmul
on a tile of dequantized weights reuses each weight across all of them. `CPU_WEIGHT_GEMM_ROWS` says where the
quantized layers switch from the first to the second.

1. One random Qwen3-14B decoder layer (its four matrices: qkv, o, gate_up, down), int8 and int4, bf16 activations as
   a model split with the CPU runs them (chapter 10h): for 1 to 512 rows, the layer's products through the weight-only
   GEMMs always, against the path chapter 10e chooses, median of three.
2. SmolLM2-135M-Instruct's GGUF (Q4_1, FP32 activations, the CPU default): the first token of a 128, 256 and
   512-token prompt (no prefix cache), the weight-only GEMMs always against the chosen path, interleaved, median of
   five.

Run from the repository root: PYTHONPATH=. python3 kernels_lab/cpu_quant_rows.py"""

import statistics
import time

import torch

import forge_engine.quant.layers as quant_layers
from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.model import empty_model, init_random_weights
from forge_engine.quant.layers import QUANTIZED_LINEARS, quantize_model

ROWS = (1, 16, 64, 128, 512)


def median_ms(run, repeats: int = 3) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    print(
        f"{torch.get_num_threads()} CPU threads; chosen rows: {quant_layers.CPU_WEIGHT_GEMM_ROWS}"
    )
    config = preset("qwen3-14b").replace(num_layers=1, vocab_size=16)
    chosen = dict(quant_layers.CPU_WEIGHT_GEMM_ROWS)
    for quantization in ("int8", "int4"):
        one = init_random_weights(empty_model(config, "cpu", torch.bfloat16))
        quantize_model(one, quantization)
        matrices = [one.layers[0].get_submodule(name) for name in QUANTIZED_LINEARS]
        for rows in ROWS:
            xs = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in matrices]

            def layer():
                for matrix, x in zip(matrices, xs):
                    matrix(x)

            quant_layers.CPU_WEIGHT_GEMM_ROWS[quantization] = 10**9  # the weight-only GEMMs always
            gemms = median_ms(layer)
            quant_layers.CPU_WEIGHT_GEMM_ROWS.update(chosen)
            ms = median_ms(layer)
            print(
                f"{quantization} {rows:4d} rows: weight-only GEMMs {gemms:7.1f} ms, chosen path {ms:7.1f} ms "
                f"({gemms / ms:.2f}x)"
            )


def first_token_seconds(engine: LLMEngine, length: int, seed: int) -> float:
    "Seconds to the first token of a prompt of `length` ids (differing by `seed`: nothing cached)."
    prompt = [(i * 7919 + seed * 31) % 20000 + 100 for i in range(length)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def smollm2_prompts() -> None:
    loaded = load_model("smollm2-135m-instruct", "cpu", quantization="auto", progress=False)
    config = EngineConfig(max_num_seqs=1, kv_cache_bytes=2**26, enable_prefix_caching=False)
    engine, chosen = LLMEngine(loaded, config), dict(quant_layers.CPU_WEIGHT_GEMM_ROWS)
    first_token_seconds(engine, 64, 0)  # (warm: the packs are built on the first call)
    for length in (128, 256, 512):
        times = {"gemms": [], "chosen": []}
        for seed in range(5):
            for path, rows in (("gemms", {k: 10**9 for k in chosen}), ("chosen", chosen)):
                quant_layers.CPU_WEIGHT_GEMM_ROWS.update(rows)
                times[path].append(first_token_seconds(engine, length, seed))
        gemms, ms = (statistics.median(times[p]) * 1e3 for p in ("gemms", "chosen"))
        print(
            f"SmolLM2 GGUF, a {length}-token prompt's first token: weight-only GEMMs {gemms:.0f} ms, chosen path "
            f"{ms:.0f} ms ({gemms / ms:.2f}x)"
        )


if __name__ == "__main__":
    main()
    smollm2_prompts()
