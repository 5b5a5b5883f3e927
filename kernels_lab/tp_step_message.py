"""Host cost of one tensor-parallel step message at W2's shape (256 decoding sequences, prompts of
100-1024 tokens, block size 16): rank 0's encode + pickle + pipe send, and a worker's receive + decode.

v0: every sequence's (new tokens, cached count, whole block table, samples?) as pickled Python tuples
    (the simple message the step deltas replace);
v1: `StepWriter` / `StepReader` (chapter 09c): what changed since the last step, as numpy arrays.

CPU only, no GPU needed: `PYTHONPATH=. python3 kernels_lab/tp_step_message.py`."""

import multiprocessing as mp
import pickle
import random
import statistics
import time

from forge_engine.generate import SamplingParams
from forge_engine.scheduler import ScheduledSeq, Sequence, Status, StepPlan
from forge_engine.tensor_parallel.step_message import StepReader, StepWriter

BATCH, BLOCK, STEPS = 256, 16, 300


def v0_encode(plan):
    "The v0 message: one plain tuple per sequence (the reference)."
    items = []
    for i in plan.scheduled:
        seq, n = i.seq, i.num_new
        new = (
            [seq.last_token]
            if n == 1 and seq.num_computed + 1 == seq.num_tokens
            else seq.token_ids[seq.num_computed : seq.num_computed + n]
        )
        items.append((new, seq.num_computed, seq.block_table, i.samples))
    return items


def v0_decode(items):
    "What a v0 worker built per step: one object per sequence for its ModelRunner (as StepReader does)."
    from forge_engine.tensor_parallel.step_message import _Scheduled, _SeqView, _Tokens

    return [
        _Scheduled(_SeqView(table, done, _Tokens(done, new), new[-1]), len(new), samples)
        for new, done, table, samples in items
    ]


def decoding_batch(rng):
    "256 sequences mid-decode, with their own blocks, as the scheduler leaves them."
    seqs, next_block = [], 0
    for i in range(BATCH):
        seq = Sequence(
            str(i), [rng.randrange(10000) for _ in range(rng.randint(100, 1024))], SamplingParams()
        )
        seq.output_ids = [rng.randrange(10000) for _ in range(rng.randint(1, 256))]
        seq.status, seq.num_computed = Status.RUNNING, seq.num_tokens - 1
        need = -(-seq.num_tokens // BLOCK)
        seq.block_table, next_block = list(range(next_block, next_block + need)), next_block + need
        seqs.append(seq)
    return seqs, next_block


def advance(seqs, next_block, rng):
    "One decode step later: every sequence has one more token; those past a block boundary get a block."
    for seq in seqs:
        seq.num_computed += 1
        seq.output_ids.append(rng.randrange(10000))
        if -(-seq.num_tokens // BLOCK) > len(seq.block_table):
            seq.block_table += [next_block]
            next_block += 1
    return next_block


def drain(conn):
    while conn.recv_bytes() != b"stop":
        pass


def measure(name, encode, decode, send):
    rng = random.Random(0)
    seqs, next_block = decoding_batch(rng)
    send_s, decode_s, sizes = [], [], []
    for step in range(STEPS):
        plan = StepPlan([ScheduledSeq(seq, 1, True) for seq in seqs])
        start = time.perf_counter()
        message = pickle.dumps(("step", encode(plan)), protocol=pickle.HIGHEST_PROTOCOL)
        send(message)
        send_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        decode(pickle.loads(message)[1])
        decode_s.append(time.perf_counter() - start)
        sizes.append(len(message))
        next_block = advance(seqs, next_block, rng)
    steady = slice(1, None)  # the first message carries every table in both versions
    ms = lambda xs: statistics.median(xs[steady]) * 1e3
    print(
        f"{name}: rank 0 encode+pickle+send {ms(send_s):.3f} ms (first step {send_s[0] * 1e3:.3f} ms), "
        f"worker unpickle+decode {ms(decode_s):.3f} ms, message {statistics.median(sizes[steady]):,.0f} bytes "
        f"(first {sizes[0]:,}); medians over {STEPS - 1} steps"
    )


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=drain, args=(ours,))
    reader.start()
    print(f"{BATCH} decoding sequences, block size {BLOCK}")
    for _ in range(
        3
    ):  # rounds alternate, so that a busy machine hurts both alike (the first also warms up)
        measure("v0 tuples", v0_encode, v0_decode, theirs.send_bytes)
        measure("v1 deltas", StepWriter().encode, StepReader().decode, theirs.send_bytes)
    theirs.send_bytes(b"stop")
    reader.join()
