"""Chapter 10h's streaming mode (`--offload stream`) against the CPU mode and against its floor: the layers past the
GPU's kept in pinned host memory and streamed to the GPU every step, computed there by its kernels.

Napkin math: chapter 10h's plan for Qwen3-14B int4 under 8 GiB keeps 23 of 40 layers on the GPU in the CPU mode (one
layer's room for a prompt's matmuls) and 2.78 GiB of layers elsewhere; the streamed plan keeps 22, its two slots taking
two layers' room: 2.94 GiB elsewhere. Streamed, a decode step copies those bytes over PCIe: at 55.2 GB/s (pinned,
host to GPU, an H100 machine's figure from offload_bandwidth.py) about 57 ms, 17 tok/s. A copy engine runs at its
rate and the GPU computes a streamed layer in well under a millisecond, so streaming should land near its floor.
Measured on that machine: 58.0 ms a step (17.3 tok/s) against the floor's 57.3, and the CPU mode 56.9 ms.

1. On a CPU (no GPU: the copies made at once): SmolLM2 (30 layers), fp32, layers 1.. streamed (29 layers through two
   slots): its greedy tokens equal the model whole's.
2. On a GPU, first what `--offload auto` chooses for that model and budget on this machine (`auto_offload`: one
   layer timed both ways), then: random Qwen3-14B int4 under an 8 GiB budget, `gpu_layers="auto"` with `offload="stream"`, one W1 request
   (128 prompt tokens, 64 new): decode tok/s against the streaming floor (streamed bytes / pinned PCIe bandwidth),
   and the peak GPU memory.

Run from the repository root: PYTHONPATH=. python3 kernels_lab/offload_streaming.py"""

import copy

import torch

from forge_engine.bench import free_memory, w1_single_stream
from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import auto_offload, load_model
from forge_engine.offload import pcie_bandwidth, stream_layers

GIB = 2**30
BUDGET, MODEL, QUANTIZATION = 8 * GIB, "qwen3-14b", "int4"


def greedy(loaded, config, prompt, n=24) -> list[int]:
    engine = LLMEngine(loaded, config)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return list(final.token_ids)


def cpu_check() -> None:
    config = EngineConfig(max_num_seqs=1, kv_cache_bytes=2**24)
    prompt = list(range(5, 45))
    loaded = load_model("smollm2-135m-instruct", "cpu", dtype=torch.float32, progress=False)
    want = greedy(loaded, config, prompt)
    streamed = copy.copy(loaded)
    streamed.model = stream_layers(copy.deepcopy(loaded.model), 1, "cpu")
    got = greedy(streamed, config, prompt)
    assert got == want, (got, want)
    print(
        f"CPU, SmolLM2, layers 1.. streamed: the same {len(got)} greedy tokens as the model whole"
    )


def gpu_run() -> None:
    pcie, _ = pcie_bandwidth()
    cuda = torch.device("cuda")
    auto_offload("auto", preset(MODEL), BUDGET, QUANTIZATION, torch.bfloat16, cuda, progress=True)
    loaded = load_model(
        f"random:{MODEL}",
        "cuda",
        quantization=QUANTIZATION,
        memory_budget=BUDGET,
        gpu_layers="auto",
        offload="stream",
    )
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, gpu_memory_budget=BUDGET)
    streamed = loaded.model.stream.host_bytes()
    rate = w1_single_stream(loaded, config, prompt_len=128, new_tokens=64, repeats=1)[
        "decode_tok_s"
    ]
    print(
        f"W1 {MODEL} {QUANTIZATION}, {loaded.model.gpu_layers} layers on the GPU, the others streamed "
        f"({streamed / GIB:.2f} GiB a step at {pcie / 1e9:.1f} GB/s): {rate:.1f} tok/s, {1e3 / rate:.1f} ms a step "
        f"against the streaming floor {streamed / pcie * 1e3:.1f} ms; peak GPU memory "
        f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB"
    )
    free_memory()


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_run()
    else:
        cpu_check()
