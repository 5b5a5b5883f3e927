"""One request's decode step on a CPU, end to end through the engine: SmolLM2-135M-Instruct with chapter 10's fixed
text (307 tokens) as the prompt, so the steps timed attend to ~320-420 keys. Best of 3 rounds of 30 steps; then 10
steps under PyTorch's profiler: how many operations a step calls, and the ones that take the most time.
Run anywhere from the repository root (the model must be in the cache: `forge-engine models pull
smollm2-135m-instruct`): PYTHONPATH=. python3 kernels_lab/cpu_decode_step.py [none|int8|int4|gguf]"""

import re
import sys
import time
from collections import Counter

import torch

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model


def main():
    quantization = sys.argv[1] if len(sys.argv) > 1 else "none"
    loaded = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization=quantization)
    text = re.search(
        r'FIXED_TEXT = """(.*?)"""', open("nbs/_py/10e_quant_layers.py").read(), re.S
    ).group(1)
    engine = LLMEngine(loaded, EngineConfig())
    engine.add_request(
        loaded.tokenizer.encode(text),
        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
    )
    for _ in range(10):
        engine.step()  # the prompt, then a few decodes
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(30):
            engine.step()
        best = min(best, (time.perf_counter() - start) / 30)
    print(f"{quantization}: {best * 1e3:.1f} ms a decode step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    top, end = [], -1  # the operations the Python code calls (not the ones they call in turn)
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        if e.name.startswith("aten::") and e.time_range.start >= end:
            top.append(e)
            end = e.time_range.end
    print(f"{len(top) / 10:.0f} operations a step (under the profiler, which slows each down)")
    ms = Counter()
    for e in top:
        ms[e.name] += e.time_range.elapsed_us() / 1e3 / 10
    for name, t in ms.most_common(8):
        print(f"  {name:40s} {t:6.2f} ms a step")


if __name__ == "__main__":
    main()
