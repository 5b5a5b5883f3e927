"""Host phases of the engine step, overlapped (default on a GPU) or not: where a step's wall time goes.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/engine_phases.py N_SEQS NEW_TOKENS [--no-async]
[--tp=2] (W1-like: 1 256; W2-like: 256 128). Printed for the whole run, then for its decode-only steps (from the first
step after which every sequence decodes); with --tp=N the phases are rank 0's."""

import sys, time, torch, collections
from common import host_timer
from forge_engine.llm import load_model_over
from forge_engine.engine import LLMEngine
from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams
from forge_engine.bench import random_prompts
import forge_engine.engine as E


def main():  # (the tensor-parallel workers are spawned: they import this file as a module)
    n, new = int(sys.argv[1]), int(sys.argv[2])
    overlap = "--no-async" not in sys.argv
    tp = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tp=")), 1))
    lm = load_model_over("random:qwen3-4b", "cuda", progress=False, tensor_parallel_size=tp)
    eng = LLMEngine(
        lm,
        EngineConfig(
            max_num_seqs=max(n, 64),
            max_num_batched_tokens=8192,
            async_scheduling=overlap,
            tensor_parallel_size=tp,
        ),
    )
    acc = collections.Counter()
    timed = host_timer(acc)
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.scheduler.step_done = timed("step_done", eng.scheduler.step_done)
    eng.runner.run = timed("runner.run (launch)", eng.runner.run)
    eng._launch = timed("_launch (run+sample launch)", eng._launch)
    eng._land = timed("_land (wait + tokens)", eng._land)
    E.SamplingBatch.build = timed("sampling build", E.SamplingBatch.build)
    torch.cuda.Event.synchronize = timed("  of which waiting for GPU", torch.cuda.Event.synchronize)
    eng.step = timed("step total", eng.step)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for p in random_prompts(
        4, 1024, 1024, seed=1
    ):  # warm-up: the prefill kernels compile at long prompts too
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    acc.clear()
    for p in random_prompts(n, 100, 1024, seed=0):
        eng.add_request(p, params)
    t = time.perf_counter()
    steps = 0
    decoding = None  # (steps, time, phases) when every sequence decodes
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if (
            decoding is None
            and not eng.scheduler.waiting
            and all(s.is_decoding for s in eng.scheduler.running)
        ):
            decoding = (steps, time.perf_counter(), collections.Counter(acc))
    torch.cuda.synchronize()
    end = time.perf_counter()
    wall = end - t
    print(
        f"seqs={n} new={new} overlap={overlap} tp={tp}: {steps} steps, {wall:.2f} s, {n * new / wall:.0f} tok/s, "
        f"{wall / steps * 1e3:.2f} ms/step"
    )
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {v:7.3f} s  {v / steps * 1e3:7.3f} ms/step")
    if decoding is not None and steps > decoding[0]:
        first, since, before = decoding
        print(
            f"steps until every sequence decodes ({first}, prefill chunks among them): "
            f"{(since - t) / first * 1e3:.2f} ms/step, {since - t:.2f} s"
        )
        k_steps = steps - first
        print(f"decode-only steps ({k_steps}): {(end - since) / k_steps * 1e3:.2f} ms/step")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"  {k:32s} {(v - before[k]) / k_steps * 1e3:7.3f} ms/step")
    if tp > 1:
        lm.parallel.close()


if __name__ == "__main__":
    main()
