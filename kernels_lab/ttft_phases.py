"""Where W1's first token goes: the first steps of a request (128-token prompt, a prefix-cache hit after a warm-up),
overlapped steps on and off. For each mode: host time of each of the first steps; one prefill step's host time by
phase (schedule, forward launch, sampler, landing) and the allocator segments it added (cudaMalloc calls); the
synchronizing CUDA calls inside a prefill step (torch's sync debug mode, with the Python line that made them); and
the prefill step's top host operations under the torch profiler.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/ttft_phases.py [on,off | off,on]
(the order matters: what one mode warms up in the process, the next one finds warm)."""

import collections, gc, sys, time, traceback, warnings
import torch
from common import host_timer
import forge_engine.engine as E
from torch.profiler import profile, ProfilerActivity
from forge_engine.loader import load_model
from forge_engine.engine import LLMEngine
from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams
from forge_engine.bench import random_prompts

lm = load_model("random:qwen3-4b", "cuda", progress=False)
prompt = random_prompts(1, 128, 128, seed=1)[0]


phases = collections.Counter()
timed = host_timer(phases)


def instrument(eng):
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.runner.run = timed("runner.run (forward launched)", eng.runner.run)
    eng._launch = timed("_launch (forward + sampler launched)", eng._launch)
    eng._land = timed("_land (wait + apply tokens)", eng._land)


E.SamplingBatch.build = timed("SamplingBatch.build", E.SamplingBatch.build)
E.sample = timed("sample (launch)", E.sample)
torch.Tensor.pin_memory = timed("Tensor.pin_memory", torch.Tensor.pin_memory)


def first_steps(eng, params, steps=4):
    "Seconds of each of the first `steps` step() calls of one request, and when its first token came."
    eng.add_request(prompt, params)
    torch.cuda.synchronize()
    t0, times, first = time.perf_counter(), [], None
    for _ in range(steps):
        t = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t)
        if first is None and any(o.token_ids for o in outs):
            first = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    return times, first


order = (sys.argv[1] if len(sys.argv) > 1 else "on,off").split(",")
for overlap in [mode == "on" for mode in order]:
    eng = LLMEngine(lm, EngineConfig(max_num_seqs=8, async_scheduling=overlap))
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first_steps(eng, short)  # warm-up: the prompt's blocks go to the prefix cache
    instrument(eng)
    for _ in range(6):
        times, first = first_steps(eng, params)
        print(
            f"overlap={overlap}: first steps {' '.join(f'{t * 1e3:.2f}' for t in times)} ms; first token at "
            f"{first * 1e3:.2f} ms"
        )
    # the phases of one prefill step
    eng.add_request(prompt, params)
    torch.cuda.synchronize()
    phases.clear()
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)  # cudaMalloc calls so far
    t = time.perf_counter()
    eng.step()
    total = time.perf_counter() - t
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
    print(
        f"overlap={overlap}: prefill step {total * 1e3:.2f} ms, {segments} new allocator segments: "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
    )
    while eng.has_unfinished():
        eng.step()
    # the synchronizing calls of a prefill step
    eng.add_request(prompt, params)
    torch.cuda.synchronize()
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):
            return  # the debug mode's own notice, not a synchronization
        stack = [f for f in traceback.extract_stack() if "forge_engine" in f.filename]
        seen.append(
            f"{message} at "
            + " <- ".join(
                f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in stack[::-1][:4]
            )
        )

    old = warnings.showwarning
    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    print(
        f"overlap={overlap}: prefill step {dt * 1e3:.2f} ms under sync debug; {len(seen)} synchronizing calls"
    )
    for s in dict.fromkeys(seen):
        print("   ", s[:300])
    while eng.has_unfinished():
        eng.step()
    # the prefill step's host operations
    eng.add_request(prompt, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    print(f"overlap={overlap}: prefill step under the profiler, top host operations by self time")
    for e in rows:
        print(f"   {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count:5d}  {e.key[:90]}")
    while eng.has_unfinished():
        eng.step()
    del eng
    gc.collect()  # (the timers hold the engine's bound methods: a reference cycle)
    torch.cuda.empty_cache()
