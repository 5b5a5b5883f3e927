"""Speculative decoding (chapters 08c and 08d) across the scheduler, the runner and the engine: for both proposers
(prompt lookup, a draft model), random prompts, token budgets, KV pools (small ones preempt), draft counts and aborts,
greedy outputs with speculation are the ones without, token for token, and every block is free afterwards."""

import functools

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import PagedKVCache
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights

BLOCK = 4


@functools.cache
def tiny(seed: int = 7) -> LoadedModel:
    """A tiny random model over 12 tokens: its greedy outputs repeat, so prompt lookup finds drafts. Another seed: a
    draft model of the same vocabulary, whose drafts the target accepts only where it agrees."""
    config = preset("qwen3-tiny").replace(vocab_size=12, num_layers=2)
    return LoadedModel(
        "tiny", init_random_weights(empty_model(config), seed=seed, std=0.3), None, None
    )


def finals(
    config: EngineConfig, prompts, max_tokens, abort_at, draft: LoadedModel | None = None
) -> tuple[dict, LLMEngine]:
    "Every request to its end (request 0 aborted at step `abort_at`, if any): token ids by request id."
    engine = LLMEngine(tiny(), config, draft=draft)
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
                out[o.request_id] = (o.token_ids, o.finish_reason)
    engine.allocator.check_idle()
    assert engine.allocator.stats().used_blocks == 0
    return out, engine


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(st.integers(1, 11), min_size=1, max_size=30), min_size=1, max_size=4),
    data=st.data(),
    drafts=st.integers(1, 7),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([12, 64]),
    abort_at=st.sampled_from([0, 2, 5]),
    proposer=st.sampled_from(["lookup", "draft model", "target as draft"]),
)
def test_speculation_gives_the_same_greedy_tokens(
    prompts, data, drafts, budget, blocks, abort_at, proposer
):
    max_tokens = data.draw(
        st.lists(st.integers(1, 24), min_size=len(prompts), max_size=len(prompts))
    )
    kv = (blocks + 1) * PagedKVCache.bytes_per_block(tiny().model.config, BLOCK, torch.float32)
    base = EngineConfig(
        block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=budget, kv_cache_bytes=kv
    )
    want, _ = finals(base, prompts, max_tokens, abort_at=0)
    draft = {"lookup": None, "draft model": tiny(seed=11), "target as draft": tiny()}[proposer]
    got, engine = finals(
        base.replace(speculative_tokens=drafts), prompts, max_tokens, abort_at, draft
    )
    # every request that ran to its end (with an abort, request 0 may not have) has the tokens it has without
    assert set(want) - set(got) <= ({"0"} if abort_at else set())
    assert all(got[r] == want[r] for r in got)
    counts = engine.stats().speculation
    assert 0 <= counts.accepted <= counts.proposed
    if draft is not None:  # the draft model's copies are gone with their requests, and their blocks
        assert not engine.proposer.copies
        assert engine.proposer.allocator.stats().used_blocks == 0
    if proposer == "target as draft" and not abort_at:
        assert counts.accepted == counts.proposed  # its drafts are the target's own greedy tokens
