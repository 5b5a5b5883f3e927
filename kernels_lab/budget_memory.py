"""What the caching allocator holds on the way to an 8 GiB-budget engine (the bench's capped W1 run), step by step as
the bench goes: load int8 under the budget, measure the ceilings, build the engine. Prints allocated / reserved at
each step, and the allocator's segments when the engine refuses.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/budget_memory.py [--ceilings-first]"""

import sys
import torch
from forge_engine.bench import ceilings, free_memory
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.loader import load_model
from forge_engine.memory_plan import parse_bytes

GiB = 2**30
budget = parse_bytes("8GiB")


def show(label):
    print(
        f"{label:40s} allocated {torch.cuda.memory_allocated() / GiB:6.2f} GiB, reserved "
        f"{torch.cuda.memory_reserved() / GiB:6.2f} GiB"
    )


if "--ceilings-first" in sys.argv:
    ceilings(torch.device("cuda"))
    show("ceilings measured")
    free_memory()
    show("after free_memory")
loaded = load_model(
    "random:qwen3-4b", "cuda", quantization="int8", memory_budget=budget, progress=False
)
show("int8 model loaded under the budget")
if "--ceilings-first" not in sys.argv:
    ceilings(torch.device("cuda"))
    show("ceilings measured")
    torch.cuda.empty_cache()
    show("after empty_cache")
try:
    engine = LLMEngine(loaded, EngineConfig(gpu_memory_budget=budget))
    show(f"engine built, KV {engine.cache.nbytes / GiB:.2f} GiB")
except Exception as e:
    print("engine refused:", e)
    segments = sorted(torch.cuda.memory_snapshot(), key=lambda s: -s["total_size"])
    for s in segments[:8]:
        used = sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
        print(
            f"  segment {s['total_size'] / GiB:6.3f} GiB ({s['segment_type']}), in use {used / GiB:6.3f} GiB, "
            f"{len(s['blocks'])} blocks"
        )
