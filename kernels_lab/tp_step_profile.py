"""Where rank 0's GPU time goes in W2-like decode steps, in the engine as it runs (tensor-parallel or not): the torch
profiler over STEPS engine steps once every one of 256 sequences decodes, the kernels of the CUDA graphs included.
Printed: ms a step of wall time (first kernel start to last kernel end), of GPU busy time (kernels' union) and idle,
per kernel family (decode attention, GEMM, all-reduce / all-gather, the rest), the top kernels, and the longest idle
gaps with the kernels on either side (a gap after an all-reduce: waiting for the other rank; a gap before a step's
first kernel: the host).

Run on a GPU from the repository root (FORGE_HOME with the qwen3-tokenizer):
    PYTHONPATH=. python3 kernels_lab/tp_step_profile.py [--tp=2] [--seqs=256] [--model=random:qwen3-4b]"""

import collections
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from forge_engine.bench import random_prompts
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.llm import load_model_over

STEPS = 20
FAMILIES = (
    ("decode attention", ("_decode_kernel", "_merge_splits")),
    (
        "all-reduce / gather",
        ("all_reduce", "allreduce", "all_gather", "allgather", "nccl", "symm", "multimem"),
    ),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "sm90")),
    ("norm", ("rmsnorm",)),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


def main():  # (the tensor-parallel workers are spawned: they import this file as a module)
    tp, seqs, model = int(arg("tp", "1")), int(arg("seqs", "256")), arg("model", "random:qwen3-4b")
    lm = load_model_over(model, "cuda", progress=False, tensor_parallel_size=tp)
    eng = LLMEngine(
        lm,
        EngineConfig(
            max_num_seqs=max(seqs, 64), max_num_batched_tokens=8192, tensor_parallel_size=tp
        ),
    )
    for p in random_prompts(seqs, 100, 1024, seed=0):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=STEPS + 40, ignore_eos=True))
    while eng.scheduler.waiting or not all(s.is_decoding for s in eng.scheduler.running):
        eng.step()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(STEPS):
            eng.step()
        torch.cuda.synchronize()
        host = (
            time.perf_counter() - t
        ) / STEPS  # (before the profiler stops: its processing is not the engine's)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    kernels = sorted((e for e in trace if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    devices = collections.Counter(e["args"].get("device") for e in kernels)
    device = min(d for d in devices if d is not None)  # rank 0's GPU (the process's own)
    kernels = [e for e in kernels if e["args"].get("device") == device]
    wall = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, gaps, end = 0.0, [], kernels[0]["ts"]
    for i, e in enumerate(kernels):
        if e["ts"] > end:
            gaps.append((e["ts"] - end, kernels[i - 1]["name"], e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    per_family, per_name = collections.Counter(), collections.Counter()
    for e in kernels:
        per_family[family(e["name"])] += e["dur"]
        per_name[e["name"].split("(")[0][:70]] += e["dur"]
    ms = lambda us: us / STEPS / 1e3
    print(
        f"{model} tp={tp} seqs={seqs}: {STEPS} decode steps, host {host * 1e3:.2f} ms a step; rank 0's GPU (device "
        f"{device}, {len(kernels) // STEPS} kernels a step): wall {ms(wall):.3f} ms, busy {ms(busy):.3f}, "
        f"idle {ms(wall - busy):.3f} ms a step"
    )
    for name, us in per_family.most_common():
        print(f"  {name:22s} {ms(us):7.3f} ms a step")
    print("  top kernels:")
    for name, us in per_name.most_common(12):
        print(f"    {ms(us):7.3f} ms  {name}")
    gaps.sort(reverse=True)
    by_pair = collections.Counter()
    for g, before, after in gaps:
        by_pair[(family(before), family(after))] += g
    print(f"  idle gaps: {len(gaps) / STEPS:.0f} a step; by (kernel before, kernel after) family:")
    for pair, us in by_pair.most_common(6):
        print(f"    {ms(us):7.3f} ms  {pair[0]} -> {pair[1]}")
    print(
        "  longest gaps (µs):",
        ", ".join(
            f"{g:.0f} ({b.split('(')[0][:30]} -> {a.split('(')[0][:30]})" for g, b, a in gaps[:6]
        ),
    )
    if tp > 1:
        lm.parallel.close()


if __name__ == "__main__":
    main()
