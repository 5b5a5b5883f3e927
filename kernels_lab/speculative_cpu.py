"""Speculative decoding by prompt lookup (chapter 08c) on a CPU: SmolLM2-135M-Instruct (its GGUF file, blocks kept,
chapter 10f's C decode step) asked to rewrite a given text, batch 1, greedy, 160 new tokens at most, with 0, 3, 5
and 7 draft tokens, in interleaved rounds (this machine is shared: medians). Prints decode tok/s, the acceptance
counts, and checks every run's tokens are the same as without speculation.

Napkin math: a verify step of 1 + k rows costs c(k) single-row steps; each step gives E tokens on average, so the
speed-up is E / c(k). Chapter 10f's C step on 2 cores costs about 1.5, 2.4 and 4.5 single-row steps at 2, 4 and 8
rows (its integer dot products are done per row), so k = 3 needs E > 2.4 to win.

Run from the repository root: PYTHONPATH=. python3 kernels_lab/speculative_cpu.py"""

import statistics
import time

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.quant.layers import FIXED_TEXT

DRAFTS, ROUNDS = (0, 3, 5, 7), 3

smol = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="auto")
text = FIXED_TEXT[:900]
prompt = smol.tokenizer.encode_chat([{"role": "user", "content": f"Rewrite this text:\n\n{text}"}])
rates, counts, tokens = {k: [] for k in DRAFTS}, {}, {}
for _ in range(ROUNDS + 1):  # the first round warms up
    for k in DRAFTS:
        engine = LLMEngine(smol, EngineConfig(max_num_seqs=1, speculative_tokens=k))
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=160))
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                first = first or (time.perf_counter() if out.token_ids else None)
                final = out
        rates[k].append((len(final.token_ids) - 1) / (time.perf_counter() - first))
        tokens.setdefault(k, final.token_ids)
        counts[k] = engine.stats().speculation
        assert final.token_ids == tokens[0], f"k={k}: other tokens than without speculation"
print(
    f"{len(prompt)} prompt tokens, {len(tokens[0])} new; {smol.tokenizer.decode(tokens[0])[:120]!r}..."
)
base = statistics.median(rates[0][1:])
for k in DRAFTS:
    rate, c = statistics.median(rates[k][1:]), counts[k]
    print(
        f"k={k}: {rate:6.1f} tok/s ({rate / base:.2f}x); drafts {c.proposed}, accepted {c.accepted} "
        f"({c.acceptance_rate:.0%}), {c.verified} verify steps, {c.mean_accepted_length:.2f} tokens each"
    )
