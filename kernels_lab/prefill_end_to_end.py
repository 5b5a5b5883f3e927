"""Prefill through the whole engine: one prompt of 2,048 (and 8,192) random tokens, max_tokens=1, prefix cache off.
Median of five timed runs after one warm-up; FLOPs = 2 x layer matrix parameters x tokens + causal attention
(2 x layers x heads x head_dim x tokens^2) + the LM head for the last token; ratio to the 790 TFLOP/s bf16 ceiling.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/prefill_end_to_end.py  (random:qwen3-4b, no download)."""

import time, torch, statistics
from forge_engine.loader import load_model
from forge_engine.engine import LLMEngine
from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams
from forge_engine.bench import random_prompts

lm = load_model("random:qwen3-4b", "cuda", progress=False)
eng = LLMEngine(
    lm, EngineConfig(max_num_seqs=16, max_num_batched_tokens=8192, enable_prefix_caching=False)
)
p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for n in (2048, 8192):
    times = []
    for r in range(6):
        prompt = random_prompts(1, n, n, seed=r)[0]
        eng.add_request(prompt, p)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    c = lm.config
    layer_params = c.num_layers * (
        c.hidden_size * (c.q_size + 2 * c.kv_size)
        + c.q_size * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    flops = (
        2 * layer_params * n
        + 2 * c.num_layers * c.num_heads * c.head_dim * n * n
        + 2 * c.hidden_size * c.vocab_size
    )
    med = statistics.median(times[1:])
    print(
        f"prefill {n} tokens: median {med * 1e3:.1f} ms (runs {[round(x * 1e3, 1) for x in times]}), {flops / 1e12:.2f} TFLOP, {flops / med / 1e12:.0f} TFLOP/s = {flops / med / 790e12:.1%} of 790"
    )
