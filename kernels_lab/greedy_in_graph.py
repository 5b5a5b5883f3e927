"""Does the greedy argmax pay to move into the decode step's CUDA graph? (It does: chapter 09b's `GREEDY_IN_GRAPH`.)

At batch 1 the engine samples outside the decode graph: for a greedy request that is `torch.argmax` over 151,936
FP32 logits, one reduction of 512 threads that took 8.2 us a token on an H200 (`step_gaps.py int8`),
plus its launch gap, while the step's graph is ~1.58 ms (int8) to ~2.39 ms (BF16). Napkin: 600 KB of logits read
at even a tenth of the memory bandwidth is ~1.5 us; the reduction is latency, one block walking the row. A row split
over many programs (each a chunk's max and its first index, then one program merging the chunks) should take two
short launches, and inside the graph no launch gap of its own. The same microseconds come off BF16's step and
int8's, so the gain lifts the int8 / BF16 ratio a little ((B - d) / (Q - d)).

What this measures (on a GPU; on a CPU it only validates the kernels under the interpreter):
1. validation: chapter 09's `argmax_rows` against `torch.argmax` on random rows, ties (the first index wins, as
   torch's), rows of -inf, BF16 and FP32, several rows;
2. micro: torch's argmax and `argmax_rows` on one [1, 151936] row, eager and as a CUDA-graph replay;
3. the engine (`random:qwen3-4b`, bf16 and int8, one engine a variant): W1-like decode tok/s with torch's argmax in
   the sampler, with `argmax_rows` in the sampler, and with `argmax_rows` recorded in the decode graph (chapter 09b's
   `GREEDY_IN_GRAPH`: the sampler then takes the graph's tokens for an all-greedy batch with nothing to adjust);
   BF16's greedy tokens must equal the first variant's.

Measured on one H200: one row, torch.argmax 11.9 us eager /
12.0 as a graph replay, the two launches 28.6 / 7.0; W1-like bf16 411.6 (defaults), 412.2 (in the sampler), 413.4 (in
the graph), 412.5 (defaults again); int8 620.8, 623.1, 623.5, 620.8. About +0.4% in the graph, the same for both
formats. So chapter 09's `argmax_rows` (these two kernels) is recorded into the decode graphs by chapter 09b
(`GREEDY_IN_GRAPH`, on) and taken by chapter 06's `sample(..., greedy=)`; this lab switches that.

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/greedy_in_graph.py [bf16,int8]"""

import sys

from common import ON_GPU, finish, graphed_ms, median_ms  # first: it may switch on the interpreter
import torch

import forge_engine.cuda_graphs as cuda_graphs
import forge_engine.engine as engine_module
from forge_engine.bench import free_memory, random_prompts, run_batch
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.kernels.elementwise import argmax_rows
from forge_engine.loader import load_model
from forge_engine.sampling import SampleResult, batch_logprobs

EXPORTED_SAMPLE = engine_module.sample


def validate(device: str, vocab: int) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, vocab, generator=gen).to(dtype)
        logits[1, :] = float("-inf")
        logits[2, 7] = logits[2, vocab - 3] = logits[2].max() + 1  # a tie: the first index wins
        logits[3, vocab - 1] = 1e4  # the last column
        logits[4] = logits[4].round()  # many ties at the top
        logits = logits.to(device)
        got, want = argmax_rows(logits, impl="triton"), torch.argmax(logits.float(), dim=-1)
        same = torch.equal(got, want)
        print(
            f"  {'ok  ' if same else 'FAIL'} argmax_rows {str(dtype):15s} V={vocab}: "
            f"{got.tolist()} against {want.tolist()}"
        )
        ok &= same
    return ok


def greedy_sample(logits, batch, greedy=None):
    "The sampler with `argmax_rows` for an all-greedy batch with nothing to adjust (else the exported one)."
    if batch.adjusts or len(batch.sampled_rows):
        return EXPORTED_SAMPLE(logits, batch, greedy)
    tokens = argmax_rows(logits)
    return SampleResult(tokens, batch_logprobs(logits, tokens, batch.logprobs))


VARIANTS = {  # name: (the engine's sampler, GREEDY_IN_GRAPH)
    "torch argmax (in the sampler)": (EXPORTED_SAMPLE, False),
    "argmax_rows in the sampler": (greedy_sample, False),
    "argmax_rows in the decode graph (defaults)": (EXPORTED_SAMPLE, True),
    "torch argmax again": (EXPORTED_SAMPLE, False),
}


def greedy_tokens(engine, prompt: list[int], n: int = 64) -> list[int]:
    "The token ids of one greedy request of n tokens, run to its end."
    request = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )
    tokens = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request:
                tokens = list(out.token_ids)
    return tokens


def engine_runs(formats) -> bool:
    print(
        "\n== random:qwen3-4b: W1-like decode tok/s (128-token prompt, 256 greedy tokens), one engine a variant"
    )
    ok = True
    prompt = random_prompts(1, 128, 128, seed=1)[0]
    for fmt in formats:
        loaded = load_model(
            "random:qwen3-4b", "cuda", progress=False, quantization="none" if fmt == "bf16" else fmt
        )
        want = None
        for name, (sampler, in_graph) in VARIANTS.items():
            engine_module.sample, cuda_graphs.GREEDY_IN_GRAPH = sampler, in_graph
            engine = LLMEngine(
                loaded, EngineConfig(max_num_seqs=8)
            )  # (its graphs recorded now, with the switch)
            run_batch(
                engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            )  # warm-up
            r = run_batch(
                engine, [prompt], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
            )
            tokens = greedy_tokens(engine, prompt)
            assert tokens is not None and len(tokens) == 64, tokens
            same = want is None or tokens == want
            want = want if want is not None else tokens
            # (int8's step is not bit-reproducible run to run: its handed norms are float atomic adds, so its greedy
            # tokens may part from the defaults' after a near-tie, "defaults again" too)
            ok &= same or fmt != "bf16"
            agree = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(tokens))
            print(
                f"  {fmt:5s} {name:36s}: {255 / (r['wall_s'] - r['ttft_median_s']):7.1f} tok/s"
                f"{'' if same else f'  TOKENS DIFFER from token {agree} on'}",
                flush=True,
            )
            del engine
            free_memory()
        engine_module.sample, cuda_graphs.GREEDY_IN_GRAPH = EXPORTED_SAMPLE, True
        del loaded
        free_memory()
    return ok


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "bf16,int8").split(",")
    ok = validate("cpu" if not ON_GPU else "cuda", 5000)
    if not ON_GPU:
        finish(ok)
    ok &= validate("cuda", 151936)
    row = torch.randn(1, 151936, device="cuda")
    print("\n== one row of 151,936 FP32 logits, us (median, L2 flushed)")
    for name, fn in (
        ("torch.argmax", lambda: torch.argmax(row, dim=-1)),
        ("argmax_rows", lambda: argmax_rows(row)),
    ):
        print(
            f"  {name:14s} eager {median_ms(fn) * 1e3:6.1f}   graph replay {graphed_ms(fn) * 1e3:6.1f}"
        )
    ok &= engine_runs(formats)
    finish(ok)


if __name__ == "__main__":
    main()
