"""What a grammar costs a decode step: 16 streams of 128 new tokens on random Qwen3-4B, with and without a JSON
schema (an array of at least 200 integers: every stream stays under its grammar for all its tokens), the median and
p90 of the decode steps at batch 16, the plain run twice around the constrained one.
The masks of a step are made on the host while the GPU runs the step before (chapter 06a); what remains is their
copy and the masked sampling.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/grammar_step_cost.py  (random:qwen3-4b;
the Qwen3 tokenizer from the catalog, `forge-engine models pull qwen3-tokenizer`)."""

import json
import random
import statistics
import time
from collections import deque

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams, StructuredOutput
from forge_engine.loader import load_model

loaded = load_model("random:qwen3-4b", "cuda", "bfloat16", progress=False)
engine = LLMEngine(loaded, EngineConfig(device="cuda", dtype="bfloat16"))
engine.warm_up()
engine.recent = deque(maxlen=100_000)  # every step's record
rng = random.Random(0)
schema = {"type": "array", "items": {"type": "integer"}, "minItems": 200}
results = {}
for name, structured in (
    ("plain", None),
    ("json_schema", StructuredOutput("json_schema", schema)),
    ("plain_again", None),
):
    first_step = engine.steps
    for _ in range(16):
        prompt = [rng.randrange(1000, 100_000) for _ in range(80)]
        params = SamplingParams(
            max_tokens=128, ignore_eos=True, temperature=0, structured=structured
        )
        engine.add_request(prompt, params)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.delta_token_ids) for out in engine.step())
    steps = sorted(
        r.seconds
        for r in engine.recent
        if r.index > first_step and not r.prefill_tokens and r.decode_seqs == 16
    )
    results[name] = {
        "tokens": tokens,
        "wall_s": time.perf_counter() - start,
        "decode_16_steps": len(steps),
        "step_ms_p50": statistics.median(steps) * 1e3,
        "step_ms_p90": steps[int(0.9 * len(steps))] * 1e3,
    }
print(json.dumps(results, indent=1))
