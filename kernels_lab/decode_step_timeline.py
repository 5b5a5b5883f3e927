"""Where one batch-1 decode step of random:qwen3-4b goes, kernel by kernel, as the engine runs it: its CUDA graph
(256-token prompt, after 10 steps) replayed 200 times between CUDA events, then 10 replays under the torch profiler,
whose trace gives every kernel's start and duration inside the graph. Printed per kernel name: launches a step, mean
duration, mean gap since the kernel before ended (negative: they overlapped, programmatic dependent launch), and
their total a step.

On one H200, with the K/V stored by a launch of its own: 2.93 ms a BF16 step of which the 145 GEMVs 2,220 µs, the 36
decode attentions 364 µs, the 73 add+RMSNorms 180 µs; with SwiGLU fused: 269 kernels, the GEMVs 2,203 µs, the decode
attentions 350 µs, add+RMSNorm 166 µs: what chapter 09's fusions (the K/V store, SwiGLU, the norms) cut (the package
now has only the fused paths).

Run on a GPU from the repository root:
    PYTHONPATH=. python3 kernels_lab/decode_step_timeline.py [none|int8|int4] [CONSTANT=N ...] [--batch=B] [--prompt=T]
        [--positions]
(--positions: a middle layer's kernels and the step's last five, one by one.)
(--batch=256 --prompt=600: a W2-like decode step, 256 sequences of ~600 tokens.)
CONSTANT: a tuning constant of chapter 09's kernel modules (DECODE_MIN_SPLIT=64, DEPENDENT_LAUNCH_MAX_ROWS=0,
DECODE_BLOCK_N=64), set before the graph is captured."""

import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from forge_engine.kernels import backend, gemv, paged_attention
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model

REPLAYS = 10


def decode_graph(engine, batch: int = 1, prompt_tokens: int = 256, max_tokens: int = 40):
    """`engine`'s decode CUDA graph for `batch` sequences of `prompt_tokens` each, taken once every sequence has
    decoded 10 tokens (the requests stay queued): the graph of their batch bucket and block-table width."""
    for i in range(batch):
        engine.add_request(
            [100 + (i + j) % 5000 for j in range(prompt_tokens)],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
    while not all(s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(10):
        engine.step()
    decode = engine.runner.decode
    blocks = -(-(prompt_tokens + 10) // engine.cache.block_size)
    return decode.graphs[
        (decode.bucket_for(batch), next(w for w in decode.widths if w >= blocks), False)
    ]


def set_constant(name: str, value: int) -> None:
    "A tuning constant (an int) of the kernels' modules, in every module that holds it (some import it by value)."
    modules = [m for m in (backend, gemv, paged_attention) if hasattr(m, name)]
    if not modules:
        raise ValueError(f"no kernel module has {name}")
    for module in modules:
        setattr(module, name, type(getattr(module, name))(value))


def replay_ms(graph, reps: int = 200) -> float:
    "The graph replayed `reps` times alone between CUDA events: ms a replay."
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_events(graph) -> list[list[dict]]:
    "The kernels of REPLAYS replays from the profiler's trace, each replay's in start order."
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted(
                (e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"),
                key=lambda e: e["ts"],
            )
    per = len(events) // REPLAYS
    return [events[r * per : (r + 1) * per] for r in range(REPLAYS)]


def print_kernels(replays, top: int | None = None) -> None:
    "The replays' kernels by name, most time first (the `top` first): launches a step, mean duration, gap, total."
    stats = collections.defaultdict(
        lambda: [0, 0.0, 0.0]
    )  # name: launches, duration, gap before (µs)
    for run in replays:
        for i, e in enumerate(run):
            s = stats[e["name"].split("(")[0][:60]]
            s[0] += 1
            s[1] += e["dur"]
            if i:
                s[2] += e["ts"] - (run[i - 1]["ts"] + run[i - 1]["dur"])
    for name, (n, dur, gap) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]:
        print(
            f"  {n / REPLAYS:5.0f}/step  {dur / n:7.2f} µs  gap before {gap / n:6.2f} µs  "
            f"total {(dur + gap) / REPLAYS:8.1f} µs  {name}"
        )


def print_positions(replays):
    """The kernels of a middle layer (its QKV GEMV to its down GEMV, found from the decode attentions) and the step's
    last five, one by one: mean duration, gap before and their sum (what the kernel adds after the one before), grid."""
    run = replays[0]
    attentions = [i for i, e in enumerate(run) if e["name"].startswith("_decode_kernel")]
    middle = attentions[len(attentions) // 2]
    for i in [*range(middle - 1, middle + 4), *range(len(run) - 5, len(run))]:
        durs = [r[i]["dur"] for r in replays]
        gaps = [r[i]["ts"] - (r[i - 1]["ts"] + r[i - 1]["dur"]) for r in replays]
        dur, gap = sum(durs) / REPLAYS, sum(gaps) / REPLAYS
        print(
            f"  #{i:3d}  {dur:7.2f} µs  gap before {gap:6.2f} µs  adds {dur + gap:6.2f} µs  "
            f"grid {run[i].get('args', {}).get('grid')}  {run[i]['name'].split('(')[0][:50]}"
        )


def main():
    quantization = sys.argv[1] if len(sys.argv) > 1 else "none"
    batch, prompt_tokens, positions = 1, 256, "--positions" in sys.argv
    for item in sys.argv[2:]:
        if item == "--positions":
            continue
        name, value = item.split("=")
        if name == "--batch":
            batch = int(value)
        elif name == "--prompt":
            prompt_tokens = int(value)
        else:  # a tuning constant (an int) of the kernels' modules
            set_constant(name, int(value))
    engine = LLMEngine(
        load_model("random:qwen3-4b", "cuda", progress=False, quantization=quantization),
        EngineConfig(max_num_seqs=max(8, batch), max_num_batched_tokens=8192),
    )  # (kept alive: it owns the graph's buffers)
    graph = decode_graph(engine, batch, prompt_tokens)
    print(
        f"[{quantization}] batch {batch}, {prompt_tokens}-token prompts: graph replay {replay_ms(graph):.3f} ms"
    )
    replays = kernel_events(graph)
    spans = sorted(run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"] for run in replays)
    print(
        f"[{quantization}] {len(replays[0])} kernels a replay; first start to last end: median {spans[REPLAYS // 2]:.1f} µs"
    )
    print_kernels(replays)
    if positions:
        print_positions(replays)
    del engine


if __name__ == "__main__":
    main()
