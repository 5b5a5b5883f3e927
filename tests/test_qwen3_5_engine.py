"""Qwen3.5's hybrid model (chapter 03b) served by the engine (chapters 05a, 07, 07a, 08): for random prompts, token
budgets, KV pools, batch bounds and aborts, every request's greedy tokens are those of the model run alone on its
whole sequence, and every block and state slot is free afterwards."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import PagedKVCache
from forge_engine.loader import LoadedModel
from forge_engine.qwen3_5 import QWEN35_TINY, Qwen35Model, init_random_qwen35

BLOCK = 4
VOCAB = QWEN35_TINY.vocab_size


@functools.cache
def tiny() -> LoadedModel:
    "A tiny random Qwen3.5 whose weights are large enough that its logits are far apart (no near ties)."
    model = init_random_qwen35(Qwen35Model(QWEN35_TINY), seed=0, std=0.1).eval()
    return LoadedModel("qwen3.5-tiny", model, None, None)


@functools.cache
def alone(prompt: tuple[int, ...], n: int) -> list[int]:
    "Greedy tokens of the model run on the whole sequence at each step: no cache, no state kept, one sequence."
    model, ids = tiny().model, list(prompt)
    with torch.no_grad():
        for _ in range(n):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            ids.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
    return ids[len(prompt) :]


def serve(config: EngineConfig, prompts, max_tokens, abort_at=0) -> tuple[dict, LLMEngine]:
    "Every request to its end (request 0 aborted at step `abort_at`, if any): token ids by request id."
    engine = LLMEngine(tiny(), config)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), str(i)
        )
    out, step = {}, 0
    while engine.has_unfinished():
        step += 1
        if step == abort_at and "0" in engine.requests:
            engine.abort("0")
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
    engine.allocator.check_idle()
    assert sorted(engine.scheduler.free_state_slots) == list(range(config.max_num_seqs))
    return out, engine


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80), min_size=1, max_size=5
    ),
    data=st.data(),
    seqs=st.integers(1, 4),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([32, 80]),
    abort_at=st.sampled_from([0, 3]),
    static=st.booleans(),
)
def test_served_tokens_are_the_model_alone(prompts, data, seqs, budget, blocks, abort_at, static):
    "`static`: decode steps over chapter 09b's static buffers, as the CUDA graphs replay them (here not recorded)."
    max_tokens = data.draw(
        st.lists(st.integers(1, 12), min_size=len(prompts), max_size=len(prompts))
    )
    kv = (blocks + 1) * PagedKVCache.bytes_per_block(QWEN35_TINY, BLOCK, torch.float32)
    config = EngineConfig(
        block_size=BLOCK,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(budget, seqs),
        kv_cache_bytes=kv,
        cuda_graphs=static,
    )
    got, engine = serve(config, prompts, max_tokens, abort_at)
    assert (engine.runner.decode is not None) == static
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        if str(i) not in got:  # request 0, aborted
            assert abort_at and i == 0
            continue
        out = got[str(i)]
        if out.finish_reason == "abort":
            continue
        # a request that grew past the whole pool ends early ("length"): its tokens so far are still right
        assert out.token_ids == alone(tuple(prompt), n)[: len(out.token_ids)], f"request {i}"
        assert len(out.token_ids) == n or out.finish_reason == "length"


def test_preempted_sequences_recompute_their_state():
    "A pool too small for all three: the youngest is preempted, comes back from a zero state, and ends the same."
    prompts = [list(range(20 + 9 * i, 40 + 9 * i)) for i in range(3)]
    kv = 20 * PagedKVCache.bytes_per_block(QWEN35_TINY, BLOCK, torch.float32)  # 80 tokens in all
    config = EngineConfig(
        block_size=BLOCK, max_num_seqs=3, max_num_batched_tokens=64, kv_cache_bytes=kv
    )
    got, engine = serve(config, prompts, [12, 12, 12])
    assert engine.stats().kv.total_blocks == 20
    assert sum(step.preempted for step in engine.recent) > 0  # 3 x 8 blocks wanted
    for i, prompt in enumerate(prompts):
        assert got[str(i)].token_ids == alone(tuple(prompt), 12)


def test_refused_with_recurrent_layers():
    for change, what in [
        (dict(speculative_tokens=2), "speculative_tokens"),
        (dict(batch_invariant=True), "batch_invariant"),
    ]:
        with pytest.raises(ValueError, match=what):
            LLMEngine(tiny(), EngineConfig(block_size=BLOCK, kv_cache_bytes=2**20, **change))
