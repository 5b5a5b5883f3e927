"""The serving core end to end: random workloads through the real engine on tiny random models,
and the real SmolLM2 through the paged engine against the contiguous reference loop."""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams, generate_tokens
from forge_engine.kv_cache import PagedKVCache
from forge_engine.loader import LoadedModel, load_model
from forge_engine.model import empty_model, init_random_weights

TINY = {
    name: LoadedModel(
        name, init_random_weights(empty_model(preset(name)), seed=0, std=0.1), None, None
    )
    for name in ("qwen3-tiny", "llama-tiny")
}


def engine_with_blocks(loaded, num_blocks, **options) -> LLMEngine:
    per_block = PagedKVCache.bytes_per_block(
        loaded.config, options.get("block_size", 16), torch.float32
    )
    return LLMEngine(loaded, EngineConfig(kv_cache_bytes=num_blocks * per_block, **options))


def run_to_end(engine, arrivals=None, aborts=None, max_steps=2000):
    "Step until idle; add requests at their arrival step, abort at theirs. Returns every output, in order."
    arrivals, aborts, outputs = arrivals or {}, aborts or {}, []
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=rid)
        for rid in aborts.get(step, []):
            if rid in engine.requests:
                outputs.append(engine.abort(rid))
        outputs += engine.step()
        engine.allocator.check_invariants()
        if step >= last_arrival and not engine.has_unfinished():
            return outputs
    raise AssertionError("the engine did not become idle")


request = st.fixed_dictionaries(
    {
        "prefix": st.sampled_from(
            [(), tuple(range(40, 52)), tuple(range(60, 69))]
        ),  # shared prefixes
        "tail": st.lists(st.integers(1, 500), min_size=1, max_size=14),
        "max_tokens": st.integers(1, 12),
        "arrival": st.integers(0, 6),
        "abort_after": st.one_of(st.none(), st.integers(0, 8)),
    }
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(sorted(TINY)),
    requests=st.lists(request, min_size=1, max_size=7),
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([2, 4]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(4, 24),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
)
def test_random_workloads_finish_once_match_serial_and_leave_the_pool_idle(
    model, requests, num_blocks, block_size, max_num_seqs, budget, prefix_caching, overlap
):
    "Arrivals, aborts, preemption, prefix hits, with overlapped steps or not: each request's tokens are its serial ones."
    options = dict(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(budget, max_num_seqs),
        enable_prefix_caching=prefix_caching,
        batch_invariant=True,
    )
    loaded = TINY[model]
    arrivals, aborts, specs = {}, {}, {}
    for i, r in enumerate(requests):
        prompt = list(r["prefix"]) + r["tail"]
        if len(prompt) + 1 > num_blocks * block_size:
            continue  # would be refused; tested elsewhere
        params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        specs[f"r{i}"] = (prompt, params)
        arrivals.setdefault(r["arrival"], []).append((f"r{i}", prompt, params))
        if r["abort_after"] is not None:
            aborts.setdefault(r["arrival"] + r["abort_after"], []).append(f"r{i}")
    engine = engine_with_blocks(loaded, num_blocks, async_scheduling=overlap, **options)
    assert engine.overlap == overlap
    finals = [o for o in run_to_end(engine, arrivals, aborts) if o.finished]
    assert sorted(o.request_id for o in finals) == sorted(specs), (
        "every request finishes exactly once"
    )
    assert all(o.finish_reason in ("length", "abort") for o in finals)
    engine.allocator.check_idle()
    stats = engine.stats()
    assert stats.kv.used_blocks == 0 and stats.running == stats.waiting == 0
    for out in finals:  # the same request alone, on a fresh engine of the same shape
        if out.finish_reason == "abort":
            continue
        prompt, params = specs[out.request_id]
        alone = engine_with_blocks(loaded, num_blocks, async_scheduling=False, **options)
        [serial] = [o for o in run_to_end(alone, {0: [("x", prompt, params)]}) if o.finished]
        assert out.token_ids == serial.token_ids and out.finish_reason == serial.finish_reason, (
            out.request_id
        )


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_resumes_with_identical_output(overlap):
    loaded = TINY["qwen3-tiny"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[i + 1] * 9 for i in range(4)]
    options = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, batch_invariant=True)
    crowded = engine_with_blocks(
        loaded, 16, async_scheduling=overlap, **options
    )  # 64 slots for 4 x 33 tokens: preemption must happen
    outs = {
        o.request_id: o
        for o in run_to_end(crowded, {0: [(f"p{i}", p, params) for i, p in enumerate(prompts)]})
        if o.finished
    }
    assert sum(r.preempted for r in crowded.stats().recent_steps) > 0
    for i, p in enumerate(prompts):
        roomy = engine_with_blocks(loaded, 64, **options)
        [alone] = [o for o in run_to_end(roomy, {0: [("a", p, params)]}) if o.finished]
        assert outs[f"p{i}"].token_ids == alone.token_ids and len(alone.token_ids) == 24
    crowded.allocator.check_idle()


def test_batch_invariant_mode_gives_bitwise_identical_logprobs():
    "The guarantee behind batch invariance: a request's logits do not depend on its neighbours."
    loaded = TINY["llama-tiny"]
    target = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    seen = []
    for budget, neighbours in [(256, 0), (8, 3), (24, 6)]:
        engine = engine_with_blocks(
            loaded,
            200,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            batch_invariant=True,
        )
        arrivals = {
            0: [
                (f"n{k}", [k + 2] * (5 + 7 * k), SamplingParams(temperature=0, max_tokens=15))
                for k in range(neighbours)
            ]
            + [("t", target, params)]
        }
        [out] = [o for o in run_to_end(engine, arrivals) if o.request_id == "t" and o.finished]
        seen.append([next(iter(lp.values())) for lp in out.logprobs])
    assert seen[0] == seen[1] == seen[2]


def test_seeded_sampling_is_reproducible_in_any_batch():
    loaded = TINY["qwen3-tiny"]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    results = []
    for neighbours in (0, 5):
        engine = engine_with_blocks(
            loaded,
            200,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            batch_invariant=True,
        )
        arrivals = {
            0: [
                (f"n{k}", [k + 3] * 7, SamplingParams(temperature=1.0, max_tokens=9))
                for k in range(neighbours)
            ]
            + [("t", [5, 6, 7, 8], params)]
        }
        results += [
            o.token_ids for o in run_to_end(engine, arrivals) if o.request_id == "t" and o.finished
        ]
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True
        ),  # the host reads tokens first
        SamplingParams(
            temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True, logprobs=2
        ),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=4),
    ],
)
def test_overlapped_steps_give_the_tokens_of_plain_steps(params):
    "Overlap on or off: the same tokens, logprobs and finish reasons, and the placeholder never leaks out."
    loaded = TINY["llama-tiny"]
    arrivals = {
        0: [(f"r{i}", list(range(3 + i, 12 + 3 * i)), params) for i in range(3)],
        2: [("late", [7, 8, 9], params)],
    }
    results = []
    for overlap in (False, True):
        engine = engine_with_blocks(
            loaded,
            64,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            batch_invariant=True,
            max_model_len=40,
            async_scheduling=overlap,
        )
        outputs = run_to_end(engine, arrivals)
        assert all(t >= 0 for o in outputs for t in o.token_ids + o.delta_token_ids)
        results.append(
            {
                o.request_id: (o.token_ids, o.finish_reason, o.logprobs)
                for o in outputs
                if o.finished
            }
        )
        engine.allocator.check_idle()
    assert results[0] == results[1] and len(results[0]) == 4


def test_overlapped_steps_end_at_the_context_and_abort_with_a_token_in_flight():
    loaded = TINY["qwen3-tiny"]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine = engine_with_blocks(
        loaded, 64, block_size=4, max_model_len=20, async_scheduling=True, batch_invariant=True
    )
    [out] = [
        o for o in run_to_end(engine, {0: [("long", list(range(5, 15)), params)]}) if o.finished
    ]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 20
    engine.add_request([1, 2, 3], params, request_id="gone")
    engine.step()
    engine.step()  # the second step launched while the first's token is in flight
    assert engine._launched is not None and engine.requests["gone"].seq.output_ids[-1] == -1
    gone = engine.abort("gone")
    assert gone.finish_reason == "abort" and all(t >= 0 for t in gone.token_ids)
    assert engine.step() == [] and not engine.has_unfinished()  # the dropped token lands on nobody
    engine.allocator.check_idle()


def test_static_decode_path_gives_the_same_tokens():
    "The CUDA-graph decode path (run eagerly on the CPU) against the default path, with padding to buckets."
    loaded = TINY["qwen3-tiny"]
    arrivals = {
        0: [
            (
                f"r{i}",
                list(range(3 + i, 9 + 2 * i)),
                SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True),
            )
            for i in range(5)
        ]
    }
    results = []
    for graphs in (False, True):
        engine = engine_with_blocks(
            loaded,
            64,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=256,
            cuda_graphs=graphs,
        )
        assert (engine.runner.decode is not None) == graphs
        results.append(
            {o.request_id: o.token_ids for o in run_to_end(engine, arrivals) if o.finished}
        )
        engine.allocator.check_idle()
    assert results[0] == results[1] and len(results[0]) == 5


# -- the real model --


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", device="cpu", progress=False)


QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three fruits.",
]


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_smollm2_quantized_heads_on_the_static_decode_path(quantization):
    """A quantized head with the tied embedding reading its rows (chapter 10) through the CUDA-graph decode path (run
    eagerly on the CPU) and the default one: the same tokens. The GGUF file kept in blocks rounds its inputs to int8
    blocks (as llama.cpp does), so where the dequantized file's best tokens nearly tie it may take another: each of its
    tokens is one the dequantized file scores within 0.5 logits of its best."""
    loaded = load_model(
        "smollm2-135m-instruct", device="cpu", progress=False, quantization=quantization
    )
    assert loaded.model.embed.table is loaded.model.lm_head  # one table for both ends
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = []
    for graphs in (False, True):
        # one sequence a step: a GGUF file's Q4_0 / Q4_1 rows then meet the C kernel in both paths (inputs rounded to
        # int8 blocks); batched, the static path's PyTorch GEMM rounds otherwise and near ties flip on some CPUs
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, cuda_graphs=graphs))
        finals = {
            o.request_id: o.token_ids
            for o in run_to_end(engine, {0: [(str(i), p, params) for i, p in enumerate(prompts)]})
            if o.finished
        }
        tokens.append([finals[str(i)] for i in range(len(prompts))])
        engine.allocator.check_idle()
    assert tokens[0] == tokens[1]
    if (
        quantization == "gguf"
    ):  # each token one the dequantized file scores within 0.5 logits of its best
        dense = load_model("smollm2-135m-instruct", device="cpu", progress=False).model
        for p, got in zip(prompts, tokens[0]):
            ids = torch.tensor(p + got)
            with torch.no_grad():
                logits = dense.compute_logits(dense(ids, torch.arange(len(ids))))[len(p) - 1 : -1]
            chosen = logits[torch.arange(len(got)), torch.tensor(got)]
            assert (logits.max(-1).values - chosen).max() < 0.5, (p, got)


def test_smollm2_paged_engine_matches_the_contiguous_loop(smollm2):
    prompts = [smollm2.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    engine = LLMEngine(
        smollm2, EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=32)
    )  # chunked prefill too
    finals = {
        o.request_id: o
        for o in run_to_end(engine, {0: [(str(i), p, params) for i, p in enumerate(prompts)]})
        if o.finished
    }
    for i, p in enumerate(prompts):
        reference = generate_tokens(smollm2.model, p, params, smollm2.eos_token_ids)
        assert finals[str(i)].token_ids == reference.token_ids, QUESTIONS[i]
        paged_lp = torch.tensor(
            [lp[t] for lp, t in zip(finals[str(i)].logprobs, reference.token_ids)]
        )
        contiguous_lp = torch.tensor(
            [lp[t] for lp, t in zip(reference.logprobs, reference.token_ids)]
        )
        # fp32: paged and contiguous attention sum in another order (~1e-7 relative), compounding over 30 layers:
        # ~1e-5 on logprobs of O(1) (measured: 6e-6)
        torch.testing.assert_close(paged_lp, contiguous_lp, rtol=1e-4, atol=1e-4)
    assert "Paris" in finals["0"].text
    engine.allocator.check_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_smollm2_stop_strings_never_leak_into_the_stream(smollm2, overlap):
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    free = LLMEngine(smollm2, EngineConfig())
    [full] = [
        o
        for o in run_to_end(
            free, {0: [("f", prompt, SamplingParams(temperature=0, max_tokens=24))]}
        )
        if o.finished
    ]
    assert "Paris" in full.text
    stop = "Paris"
    engine = LLMEngine(smollm2, EngineConfig(async_scheduling=overlap))
    outs = [
        o
        for o in run_to_end(
            engine, {0: [("s", prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))]}
        )
    ]
    streamed = "".join(o.delta_text for o in outs)
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop"
    assert (
        streamed == final.text == full.text[: full.text.index(stop)]
    )  # not even a "P" went out early
    engine.allocator.check_idle()


def test_smollm2_streams_from_an_event_loop_and_abandoned_streams_free_their_blocks(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(max_num_seqs=8)))
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def one(leave_early):
        text = ""
        async for out in engine.stream(prompt, params):
            text += out.delta_text
            if leave_early and out.token_ids:
                break
        return text

    async def main():
        return await asyncio.gather(*(one(i % 2 == 1) for i in range(8)))

    texts = asyncio.run(main())
    assert (
        len(set(texts[0::2])) == 1 and texts[0]
    )  # greedy: every complete stream has the same text
    import time

    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_unfinished()
    engine.engine.allocator.check_idle()
    engine.close()
