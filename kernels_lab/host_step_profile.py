"""The engine's decode step, 256 greedy sequences: ms a step over 30 steps, then the top functions under cProfile
(sorted by SORT: tottime or cumtime). By default on the CPU with the tiny random model (its vocabulary is Qwen3's
151,936 words, so the LM head and the sampler are full size): runs anywhere, no GPU needed:
    PYTHONPATH=. python3 kernels_lab/host_step_profile.py [tottime|cumtime]
On a GPU, rank 0's host side of the real step (steps overlapped; the wait for the GPU shows as
`Event.synchronize`), with tensor parallelism if asked (FORGE_HOME with the qwen3-tokenizer):
    PYTHONPATH=. python3 kernels_lab/host_step_profile.py tottime --model=random:qwen3-4b --device=cuda [--tp=2]
On a 2-core CPU: 212.8 / 210.4 ms a step with the sampler's float32 copy of the logits, 107.9 / 112.1 ms without it,
so the sampler skips that copy for batches with nothing to adjust."""

import cProfile
import pstats
import sys
import time

from forge_engine.bench import random_prompts
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.llm import load_model_over

STEPS = 30


def arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def main():  # (with --tp the workers are spawned: they import this file as a module)
    sort = next((a for a in sys.argv[1:] if not a.startswith("--")), "tottime")
    device, tp = arg("device", "cpu"), int(arg("tp", "1"))
    engine = LLMEngine(
        load_model_over(
            arg("model", "random:qwen3-tiny"), device, progress=False, tensor_parallel_size=tp
        ),
        EngineConfig(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            tensor_parallel_size=tp,
            **({"kv_cache_bytes": 2**28} if device == "cpu" else {}),
        ),
    )
    for prompt in random_prompts(256, 20, 60, seed=0):
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=STEPS + 50, ignore_eos=True)
        )
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    print(
        f"{(time.perf_counter() - start) / STEPS * 1e3:.2f} ms a decode step (256 sequences, no profiler)"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(STEPS):
        engine.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats(sort).print_stats(40)


if __name__ == "__main__":
    main()
