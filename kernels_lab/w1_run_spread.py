"""Why one W1 run in three decoded slower (int8: a third run at 407-444 tok/s against ~565). The answer: a full
collection of Python's garbage collector stalled one step (chapter 08 freezes what is alive after building an engine;
`cli int8 --gc-off` shows the difference).

The bench (`w1_single_stream`) runs the same 128-token prompt again and again on one engine. Here: more runs, and per
run the step times (median, 90th percentile, max, steps over 1.5x the median), so that a slow run shows whether every
step is slower (a different graph or kernel) or a few steps stall (the host, a capture, a synchronisation).

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/w1_run_spread.py [int8,none,int4] [runs]
(`cli` as the first argument: the bench command itself, its runs printed: ... w1_run_spread.py cli int8 [--gc-off])"""

import statistics
import sys

import torch

from forge_engine.bench import random_prompts, run_batch
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model


def spread(quantization: str, runs: int):
    loaded = load_model("random:qwen3-4b", "cuda", progress=False, quantization=quantization)
    engine = LLMEngine(
        loaded, EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    )  # as the bench's
    prompt = random_prompts(1, 128, 128, seed=1)[0]
    run_batch(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )  # warm-up, as W1
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for i in range(runs):
        r = run_batch(engine, [prompt], params)
        steps = [rec.seconds for rec in r["records"] if rec.decode_seqs and not rec.prefill_tokens]
        med = statistics.median(steps)
        slow = sum(s > 1.5 * med for s in steps)
        print(
            f"{quantization:5s} run {i}: {255 / (r['wall_s'] - r['ttft_median_s']):6.1f} tok/s, TTFT "
            f"{r['ttft_median_s'] * 1e3:5.1f} ms, {len(steps)} decode steps: median {med * 1e3:.3f} ms, p90 "
            f"{sorted(steps)[int(0.9 * len(steps))] * 1e3:.3f}, max {max(steps) * 1e3:.3f}, {slow} over 1.5x median",
            flush=True,
        )
    del engine, loaded
    torch.cuda.empty_cache()


def through_the_cli(quantization: str):
    """The bench command itself (`forge-engine bench w1`), each of its runs' decode steps printed as above: where the
    slow third int8 run was seen, and this script's own loop did not show it."""
    import statistics as st
    import forge_engine.bench as bench
    from forge_engine.cli import main as cli_main

    plain = bench.run_batch

    def run_batch_printing(engine, prompts, params):
        r = plain(engine, prompts, params)
        steps = [rec.seconds for rec in r["records"] if rec.decode_seqs and not rec.prefill_tokens]
        if len(steps) > 100:
            print(
                f"cli {quantization} run: {255 / (r['wall_s'] - r['ttft_median_s']):6.1f} tok/s, median step "
                f"{st.median(steps) * 1e3:.3f} ms, max {max(steps) * 1e3:.3f}",
                flush=True,
            )
        return r

    bench.run_batch = run_batch_printing
    cli_main(["bench", "w1", "--model", "random:qwen3-4b", "--quantization", quantization])


if __name__ == "__main__":
    if sys.argv[1:2] == ["cli"]:
        if "--gc-off" in sys.argv:  # is the stall Python's garbage collector?
            import gc

            gc.disable()
        through_the_cli(sys.argv[2] if len(sys.argv) > 2 else "int8")
    else:
        for fmt in (sys.argv[1] if len(sys.argv) > 1 else "int8,none,int4").split(","):
            spread(fmt, int(sys.argv[2]) if len(sys.argv) > 2 else 6)
