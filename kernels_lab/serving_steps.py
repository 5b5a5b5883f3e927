"""The engine alone under W3's load, without HTTP: what a server's inter-token latency is made of.

1. Step times at a batch of 16 decoding sequences: a decode step, and steps that also bring a prompt of
   1 / 80 / 512 / 2,048 tokens (replayed from a mixed-step graph up to 512 tokens, chapter 09b; eager above).
2. W3's arrivals (64 requests of 80 random tokens, 128 new tokens each, at 16 req/s and all at once) added as
   they come to an engine stepped in this thread: ITL and TTFT percentiles, and the step times by kind, to set
   beside `forge-engine bench w3 --model random:qwen3-4b --rates 16,inf` (the same load through the server).
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/serving_steps.py  (random:qwen3-4b)."""

import json
import math
import random
import statistics
import time
from collections import deque

import torch

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model

loaded = load_model("random:qwen3-4b", "cuda", "bfloat16", progress=False)
engine = LLMEngine(loaded, EngineConfig(device="cuda", dtype="bfloat16"))
engine.warm_up()
engine.recent = deque(maxlen=100_000)  # every step's record, not the last 256
rng = random.Random(0)


def prompt(n):
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def params(n):
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def timed_step():
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def drain():
    while engine.has_unfinished():
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()


results = {}
for _ in range(16):
    engine.add_request(prompt(80), params(400))
for _ in range(30):
    engine.step()
torch.cuda.synchronize()
results["decode_16_ms_p50"] = statistics.median(timed_step() for _ in range(20))
for n in (1, 80, 512, 2048):
    times = []
    for _ in range(3):
        engine.add_request(prompt(n), params(1))
        times.append(round(timed_step(), 2))
        engine.step(), engine.step()
    results[f"16_decodes_and_a_{n}_token_prompt_ms"] = times
drain()

for rate in (16.0, math.inf):
    gaps, arrivals, t = random.Random(1), [], 0.0
    for _ in range(64):
        t += 0 if rate == math.inf else gaps.expovariate(rate)
        arrivals.append(t)
    start, sent, stamps, first_step = time.perf_counter(), 0, {}, engine.steps
    while sent < len(arrivals) or engine.has_unfinished():
        now = time.perf_counter() - start
        while sent < len(arrivals) and arrivals[sent] <= now:
            stamps[engine.add_request(prompt(80), params(128))] = [time.perf_counter()]
            sent += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        for out in engine.step():
            stamps[out.request_id] += [time.perf_counter()] * len(out.delta_token_ids)
    itl = [b - a for s in stamps.values() for a, b in zip(s[1:], s[2:]) if b > a]
    ttft = [s[1] - s[0] for s in stamps.values()]
    # TPOT as the bench's client computes it: first token to last over the tokens between
    tpot = [(s[-1] - s[1]) / (len(s) - 2) for s in stamps.values() if len(s) > 2]
    steps = [r for r in engine.recent if r.index > first_step]
    decode = [r.seconds for r in steps if not r.prefill_tokens]
    results[f"w3_engine_only_rate_{rate}"] = {
        "itl_ms_p50": pct(itl, 0.5) * 1e3,
        "itl_ms_p99": pct(itl, 0.99) * 1e3,
        "ttft_ms_p50": pct(ttft, 0.5) * 1e3,
        "tpot_ms_p50": pct(tpot, 0.5) * 1e3,
        "step_with_prefill_ms_p50": pct([r.seconds for r in steps if r.prefill_tokens], 0.5) * 1e3,
        "decode_step_ms_p50": pct(decode, 0.5) * 1e3,
        "decode_step_ms_p99": pct(decode, 0.99) * 1e3,
    }
print(json.dumps(results, indent=1))
