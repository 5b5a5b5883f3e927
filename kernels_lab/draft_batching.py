"""A draft model drafting for several sequences at once (chapter 08d) against one sequence at a time, on a CPU:
SmolLM2-135M-Instruct (its GGUF file, blocks kept, chapter 10f's C decode step) as the draft model of 4 sequences,
k = 3 drafts each, each sequence 64 prompt tokens plus what it drafted before (the copies are rolled back to a
kept prefix between rounds, as after a verify step).

Napkin math: drafting k tokens for B sequences is one catch-up step and k - 1 more steps, each of B rows when the
sequences go together, of one row B times when they go one by one. Chapter 10f's C step costs about 2.4 single-row
steps at 4 rows on 2 cores (`kernels_lab/speculative_cpu.py`), so together should take about 2.4 / 4 = 0.6 of the
time.

Run from the repository root: PYTHONPATH=. python3 kernels_lab/draft_batching.py"""

import statistics
import time

from forge_engine.config import EngineConfig
from forge_engine.draft_model import DraftModel
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.scheduler import Sequence

SEQUENCES, DRAFTS, ROUNDS, PROMPT = 4, 3, 7, 64

smol = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="auto")
config = EngineConfig(max_num_seqs=SEQUENCES)
params = SamplingParams(temperature=0)
seqs = [
    Sequence(str(i), list(range(100 + 7 * i, 100 + 7 * i + PROMPT)), params)
    for i in range(SEQUENCES)
]


def draft_round(model: DraftModel, together: bool) -> tuple[float, list[list[int]]]:
    "Seconds to draft for every sequence, each time after a new token (as after a verify step that kept none)."
    for seq in seqs:
        seq.output_ids.append(len(seq.output_ids) + 1)
    wanted = [(seq, DRAFTS) for seq in seqs]
    start = time.perf_counter()
    drafts = model.propose(wanted) if together else [model.propose([w])[0] for w in wanted]
    return time.perf_counter() - start, drafts


times = {True: [], False: []}
for together in (True, False):
    model = DraftModel(smol, config, smol.config.vocab_size)
    for seq in seqs:
        seq.output_ids = []
    got = []
    for r in range(ROUNDS + 1):  # the first round catches the copies up on the prompts: not timed
        seconds, drafts = draft_round(model, together)
        got.append(drafts)
        if r:
            times[together].append(seconds)
    if together:
        reference = got
    else:
        assert got == reference, "other drafts one sequence at a time"
together, alone = statistics.median(times[True]), statistics.median(times[False])
print(
    f"{SEQUENCES} sequences x {DRAFTS} drafts: together {together * 1e3:.1f} ms, one at a time {alone * 1e3:.1f} ms "
    f"(medians of {ROUNDS}): {alone / together:.2f}x"
)
