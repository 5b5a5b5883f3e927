"""What a W1 decode token costs beyond its CUDA graph: the GPU's whole timeline over a run of batch-1 decode steps
(torch profiler, CUDA activity), as the engine runs them (async scheduling on). Printed: the token period (first GPU
event of a step to the next step's), the time the GPU was busy in it (the union of kernels, copies and memsets), the
idle time, the largest idle gaps, and every GPU activity name with its count and time a token.

Measured (one H200): the bench's int8 decode step is 1.733 ms a token against 1.679 for the decode graph replayed alone
(`decode_overlap.py`), BF16 ~2.44 against ~2.39: ~55 us a token outside the graph, the same in every format. Under the
profiler: int8 1,780.7 us a token, idle 60.0 (some of it the profiler's own host time), ~28 us of GPU work
outside the graph (12 host-to-device copies, the greedy argmax, two index kernels, a copy back, a memset).

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/step_gaps.py [none|int8|int4]"""

import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from forge_engine.bench import random_prompts
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model

WARM_STEPS, PROFILED_STEPS = 20, 60


def gpu_events(prof) -> list[dict]:
    "The trace's GPU activities (kernels, copies, memsets), by start time (us)."
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    keep = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in keep), key=lambda e: e["ts"]
    )


def main():
    quantization = sys.argv[1] if len(sys.argv) > 1 else "int8"
    engine = LLMEngine(
        load_model("random:qwen3-4b", "cuda", progress=False, quantization=quantization),
        EngineConfig(max_num_seqs=8),
    )
    prompt = random_prompts(1, 128, 128, seed=1)[0]
    engine.add_request(
        prompt,
        SamplingParams(temperature=0, max_tokens=WARM_STEPS + PROFILED_STEPS + 20, ignore_eos=True),
    )
    for _ in range(WARM_STEPS):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    events = gpu_events(prof)
    first, last = events[0]["ts"], max(e["ts"] + e["dur"] for e in events)
    busy, end, gaps = 0.0, first, []
    for e in events:  # the union of the activities' intervals, and the gaps between them
        if e["ts"] > end:
            gaps.append(e["ts"] - end)
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    tokens = PROFILED_STEPS
    print(
        f"[{quantization}] {tokens} decode steps: {(last - first) / tokens:.1f} us a token on the GPU's timeline, "
        f"busy {busy / tokens:.1f}, idle {(last - first - busy) / tokens:.1f}"
    )
    gaps.sort(reverse=True)
    print(
        f"  idle gaps over 5 us: {sum(g > 5 for g in gaps) / tokens:.2f} a token; largest "
        + ", ".join(f"{g:.1f}" for g in gaps[:8])
        + " us"
    )
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        entry = by_name[(e["cat"], e["name"][:70])]
        entry[0] += 1
        entry[1] += e["dur"]
    for (cat, name), (n, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"  {n / tokens:6.2f} a token  {dur / tokens:8.1f} us a token  {cat:10s} {name}")


if __name__ == "__main__":
    main()
