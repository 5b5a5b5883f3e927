"""Layers split between the GPU and the CPU (chapter 10h): the two bandwidths that decide where the CPU's layers
compute, and what a split model decodes at against its floor.

Napkin math: a decode step reads every weight once. The GPU's layers are read at the GPU's bandwidth (4.19 TB/s on
an H200: negligible next to the rest), the CPU's either by the CPU from its memory (B_cpu) or over PCIe to the GPU
(B_pcie). Per step: W_cpu / B_cpu against W_cpu / B_pcie; chapter 10h computes them on the CPU, which is faster
where B_cpu > B_pcie. Qwen3-14B in int4 under an 8 GiB budget puts 23 of 40 layers on the GPU (and a slot of one
layer for a prompt's matmuls) and 2.78 GiB on the CPU (`plan_gpu_layers`): at 60 GB/s that is 50 ms a step, about
20 tok/s at best.

1. B_cpu: a sum over a 1 GiB fp32 buffer on the CPU, with all its threads; B_pcie: 1 GiB copied from pinned host
   memory to the GPU, and back.
2. The plan and its floors: `plan_gpu_layers` for Qwen3-14B int4 at 8 GiB, `offload_step_seconds` at both
   measured bandwidths.
3. One Qwen3-14B int4 layer (`offload_layer_seconds`): its one-row products on the CPU at 1, 4 and all threads, and
   its copy to the GPU: what a CPU-mode step pays per layer against the layer's bytes at B_cpu. Then a whole decode
   step of two such layers on the CPU (an engine of a 2-layer model with a 256-token vocabulary, fused layers, all
   threads) against their products: what the CPU's layers spend besides their matmuls (norms, rotations,
   attention, the step's own work).
4. End to end: random Qwen3-14B, int4, `gpu_layers="auto"` under the 8 GiB budget (`load_model`), one request
   (W1: 128 prompt tokens, 64 new), decode tok/s against the CPU-compute floor; then the first token of a 512-token
   prompt with the CPU's layers' matmuls on the GPU (chapter 10h's `PromptMatmuls`, from the rows the loader
   measured) and with them on the CPU.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/offload_bandwidth.py [--no-model]"""

import statistics
import sys
import time

import torch

from forge_engine.bench import free_memory, read_bandwidth, w1_single_stream
from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.fused_layers import install_fused_layers
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel, load_model
from forge_engine.model import empty_model, init_random_weights
from forge_engine.offload import (
    layer_bytes,
    layer_seconds,
    offload_layer_seconds,
    offload_step_seconds,
    pcie_bandwidth,
    plan_gpu_layers,
)
from forge_engine.quant.layers import quantize_model

GIB = 2**30
BUDGET, MODEL, QUANTIZATION, PROMPT = 8 * GIB, "qwen3-14b", "int4", 512


def cpu_step_against_products(layers: int = 2, new_tokens: int = 17) -> None:
    "A decode step of `layers` Qwen3-14B int4 layers on the CPU against those layers' one-row products."
    config = preset(MODEL).replace(num_layers=layers, vocab_size=256)
    model = init_random_weights(empty_model(config, "cpu", torch.bfloat16))
    quantize_model(model, QUANTIZATION)
    model = install_fused_layers(model)
    products = layer_seconds(model.layers[0], "cpu")["cpu"] * layers
    engine = LLMEngine(
        LoadedModel(MODEL, model, None, None),
        EngineConfig(kv_cache_bytes=64 * 2**20, max_num_seqs=1, cuda_graphs=False),
    )
    engine.add_request(
        list(range(5, 133)), SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    )
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps[1:])  # (the first step is the prompt's)
    print(
        f"a decode step of {layers} layers on the CPU: {step * 1e3:.2f} ms against their products "
        f"{products * 1e3:.2f} ms ({step / products:.3f}x)"
    )


def main() -> None:
    cpu = read_bandwidth("cpu", gib=1.0, dtype=torch.float32)
    print(f"CPU read bandwidth ({torch.get_num_threads()} threads): {cpu / 1e9:.1f} GB/s")
    pcie = None
    if torch.cuda.is_available():
        pcie, back = pcie_bandwidth()
        print(
            f"PCIe, pinned host to GPU: {pcie / 1e9:.1f} GB/s; GPU to host: {back / 1e9:.1f} GB/s"
        )
    # (as the loader plans it: with a GPU, a slot there for a prompt's matmuls of the CPU's layers)
    plan = plan_gpu_layers(preset(MODEL), BUDGET, QUANTIZATION, prompt_slot=pcie is not None)
    print(plan.describe())
    floors = offload_step_seconds(plan.cpu_weights, cpu, pcie or float("nan"))
    print(
        "a decode step's floor for the CPU's layers: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in floors.items())
    )
    one, threads = layer_bytes(preset(MODEL), QUANTIZATION), torch.get_num_threads()
    for n in sorted({1, min(4, threads), threads}):
        torch.set_num_threads(n)
        seconds = offload_layer_seconds(
            preset(MODEL), QUANTIZATION, device="cuda" if pcie else "cpu"
        )
        copy = f"; copy to the GPU {seconds['stream'] * 1e3:.2f} ms" if pcie else ""
        print(
            f"one layer ({one / 1e6:.0f} MB), {n} CPU threads: products {seconds['cpu'] * 1e3:.2f} ms "
            f"({one / seconds['cpu'] / 1e9:.1f} GB/s, floor {one / cpu * 1e3:.2f} ms){copy}"
        )
    torch.set_num_threads(threads)
    cpu_step_against_products()
    if "--no-model" in sys.argv or not torch.cuda.is_available():
        return
    loaded = load_model(
        f"random:{MODEL}",
        "cuda",
        quantization=QUANTIZATION,
        memory_budget=BUDGET,
        gpu_layers="auto",
        offload="cpu",
    )
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, gpu_memory_budget=BUDGET)
    result = w1_single_stream(loaded, config, prompt_len=128, new_tokens=64, repeats=1)
    rate = result["decode_tok_s"]
    print(
        f"W1 {MODEL} {QUANTIZATION}, {loaded.model.gpu_layers} layers on the GPU: {rate:.1f} tok/s, "
        f"{1 / rate * 1e3:.1f} ms a step against the CPU-compute floor {floors['cpu_compute'] * 1e3:.1f} ms; "
        f"peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.2f} GiB"
    )
    # a prompt's first token: the CPU's layers' matmuls on the GPU (PromptMatmuls) against on the CPU
    matmuls = loaded.model.prompt_matmuls
    for rows in (matmuls.rows, 10**9):
        matmuls.rows = rows
        ttft = w1_single_stream(loaded, config, prompt_len=PROMPT, new_tokens=2, repeats=3)[
            "ttft_s"
        ]
        where = f"on the GPU from {rows} rows" if rows < 10**9 else "on the CPU"
        print(
            f"TTFT of a {PROMPT}-token prompt, the CPU's layers' matmuls {where}: {ttft * 1e3:.0f} ms"
        )
    free_memory()


if __name__ == "__main__":
    main()
