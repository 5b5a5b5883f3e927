"""The batched sampler (chapter 06) against the plain per-sequence one (chapter 04), on random
batches with random per-row parameters; seeds across batch compositions; the cost at Qwen3's
vocabulary. The small worked examples are test cells in nbs/06_sampling.ipynb."""

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_engine.generate import (
    SamplingParams,
    apply_penalties,
    filter_probs,
    sample_token,
    token_logprobs,
)
from forge_engine.sampling import (
    SamplingBatch,
    SamplingRow,
    adjust_logits,
    filter_probs_batch,
    make_generator,
    sample,
)

EOS_IDS = (0, 1)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sampling_params(draw, vocab: int) -> SamplingParams:
    "Per-row parameters: often off, sometimes at the edges (k = 1, k >= V, tiny p), sometimes anything valid."
    token = st.integers(0, vocab - 1)
    return SamplingParams(
        max_tokens=8,
        temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]) | st.floats(0.05, 3.0)),
        top_k=draw(
            st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 3]) | st.integers(1, vocab)
        ),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.5, 0.9]) | st.floats(0.01, 1.0, exclude_min=True)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.1]) | st.floats(0.0, 1.0)),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.0]) | st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.5]) | st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3]) | st.floats(0.2, 3.0)),
        logit_bias=draw(st.none() | st.dictionaries(token, st.floats(-100.0, 100.0), max_size=4)),
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=draw(st.lists(token, max_size=2)),
        logprobs=draw(st.none() | st.integers(0, 5)),
    )


@st.composite
def random_batches(draw):
    "(vocab, [(params, prompt, output, seed)], logits): plain random logits, or small integers (many ties)."
    vocab = draw(st.integers(5, 300))  # >= 5: min_tokens never forbids every token
    ids = st.lists(st.integers(0, vocab - 1), max_size=24)
    specs = [
        (draw(sampling_params(vocab)), draw(ids), draw(ids), draw(st.integers(0, 2**31)))
        for _ in range(draw(st.integers(1, 7)))
    ]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        logits = torch.randn(len(specs), vocab, generator=g) * draw(
            st.sampled_from([0.1, 1.0, 5.0])
        )
    else:
        logits = torch.randint(-3, 4, (len(specs), vocab), generator=g).float()
    return vocab, specs, logits


def rows_of(specs, device="cpu") -> list[SamplingRow]:
    "Fresh rows, each with a generator seeded from its spec (so batched and reference draw the same numbers)."
    return [
        SamplingRow(p, prompt, out, torch.Generator(device=device).manual_seed(seed))
        for p, prompt, out, seed in specs
    ]


def reference_adjust(logits_row, row: SamplingRow) -> torch.Tensor:
    "Chapter 04's adjustments for one sequence: penalties, then the min_tokens mask of generate_tokens."
    adjusted = apply_penalties(logits_row, row.params, row.prompt_ids, row.output_ids)
    if len(row.output_ids) < row.params.min_tokens:
        adjusted[[*EOS_IDS, *row.params.stop_token_ids]] = -math.inf
    return adjusted


@SETTINGS
@given(random_batches())
def test_adjusted_logits_match_reference(case):
    vocab, specs, logits = case
    adjusted = adjust_logits(logits, SamplingBatch.build(rows_of(specs), vocab, EOS_IDS))
    for i, row in enumerate(rows_of(specs)):
        # the same float32 operations in the same order (bias, repetition factor, frequency x count + presence): bit for bit
        torch.testing.assert_close(adjusted[i], reference_adjust(logits[i], row), rtol=0, atol=0)


@SETTINGS
@given(random_batches())
def test_filtered_probs_match_reference(case):
    vocab, specs, logits = case
    params = [p for p, *_ in specs]
    probs = torch.softmax(
        logits / torch.tensor([p.temperature or 1.0 for p in params])[:, None], dim=-1
    )
    got = filter_probs_batch(
        probs,
        torch.tensor([max(p.top_k, 0) for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.min_p for p in params]),
    )
    for i, p in enumerate(params):
        # (the default fp32 tolerance, rtol 1.3e-6: a batched renormalising sum over <= 300 values may round otherwise)
        torch.testing.assert_close(got[i], filter_probs(probs[i], p.top_k, p.top_p, p.min_p))


@SETTINGS
@given(random_batches())
def test_tokens_and_logprobs_match_reference(case):
    vocab, specs, logits = case
    result = sample(logits, SamplingBatch.build(rows_of(specs), vocab, EOS_IDS))
    for i, row in enumerate(rows_of(specs)):
        adjusted = reference_adjust(logits[i], row)
        token = sample_token(adjusted, row.params, row.generator)
        assert int(result.token_ids[i]) == token, (i, row.params)
        if row.params.greedy:
            assert token == int(adjusted.argmax())
        if row.params.logprobs is None:
            assert result.logprobs is None or result.logprobs[i] is None
        else:
            want = token_logprobs(logits[i], token, row.params.logprobs)
            assert result.logprobs[i].keys() == want.keys()
            assert all(
                result.logprobs[i][t] == want[t] for t in want
            )  # the same log-softmax of the same row: equal


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_seed_gives_the_same_tokens_whatever_the_batch(data):
    "One seeded request over several steps: alone, and among random neighbours at a random position."
    vocab, steps = 120, 5
    params = data.draw(sampling_params(vocab).filter(lambda p: not p.greedy))
    step_logits = torch.randn(
        steps, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    )

    def run(neighbours: list[SamplingParams], position: int) -> list[int]:
        mine = SamplingRow(params, [3, 4, 5], [], torch.Generator().manual_seed(1234))
        for step in range(steps):
            others = [SamplingRow(p, [7], [8, 9], make_generator(p)) for p in neighbours]
            rows = others[:position] + [mine] + others[position:]
            logits = torch.randn(len(rows), vocab) * 3
            logits[position] = step_logits[step]
            token = int(
                sample(logits, SamplingBatch.build(rows, vocab, EOS_IDS)).token_ids[position]
            )
            mine = mine._replace(output_ids=[*mine.output_ids, token])
        return mine.output_ids

    alone = run([], 0)
    neighbours = data.draw(st.lists(sampling_params(vocab), min_size=1, max_size=8))
    assert run(neighbours, data.draw(st.integers(0, len(neighbours)))) == alone
    # and the chapter-04 loop gives the same tokens
    generator, output = torch.Generator().manual_seed(1234), []
    row = SamplingRow(params, [3, 4, 5], output, generator)
    for step in range(steps):
        output.append(sample_token(reference_adjust(step_logits[step], row), params, generator))
    assert output == alone


def test_draws_follow_the_filtered_distribution():
    "4000 rows of the same logits, each with its own seed, in one call: frequencies match the probabilities."
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, min_p=0.05)
    rows = [SamplingRow(params, [], [], torch.Generator().manual_seed(s)) for s in range(4000)]
    tokens = sample(logits.expand(4000, -1), SamplingBatch.build(rows, 6)).token_ids
    freq = torch.bincount(tokens, minlength=6) / 4000
    expected = filter_probs(torch.softmax(logits / 0.8, -1), 5, 0.95, 0.05)
    # 4000 draws: a frequency's standard error is at most sqrt(0.25 / 4000) = 0.008; 0.025 is about three of them
    torch.testing.assert_close(freq, expected, atol=0.025, rtol=0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="output_ids of row 1 has token id 7"):
        SamplingBatch.build(
            [
                SamplingRow(SamplingParams(), [], []),
                SamplingRow(SamplingParams(presence_penalty=1.0), [], [7]),
            ],
            vocab_size=7,
        )
    with pytest.raises(ValueError, match="eos/stop_token_ids of row 0 has token id 9"):
        SamplingBatch.build(
            [SamplingRow(SamplingParams(min_tokens=1), [], [])], vocab_size=5, eos_ids=[9]
        )
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="row 0: its generator is on cuda"):
            SamplingBatch.build(
                [SamplingRow(SamplingParams(), [], [], torch.Generator("cuda"))], 5, device="cpu"
            )
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), [], [])], vocab_size=5)
    with pytest.raises(
        ValueError, match=r"logits of shape \(5,\) do not match the batch: 1 rows x vocab 5"
    ):
        sample(torch.zeros(5), batch)


def qwen3_sized_batch(
    vocab: int = 151_936,
    rows: int = 64,
    prompt_len: int = 1000,
    output_len: int = 200,
    seed: int = 0,
):
    "64 rows at Qwen3's vocabulary, mixed parameters, long prompts (the penalties' worst case)."
    g = torch.Generator().manual_seed(seed)
    choices = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.0, top_p=0.95, repetition_penalty=1.05),
        dict(temperature=0.8, min_p=0.05),
        dict(
            temperature=1.0,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            logit_bias={5: 10.0},
            logprobs=5,
        ),
    ]
    specs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        output = torch.randint(0, vocab, (output_len,), generator=g).tolist()
        specs.append((SamplingParams(seed=i, **choices[i % len(choices)]), prompt, output, i))
    return specs, torch.randn(rows, vocab, generator=g) * 3


def test_qwen3_vocab_batch_of_64_on_cpu():
    "Not a timed assertion: prints what one step costs, and checks a few rows against the reference."
    vocab = 151_936
    specs, logits = qwen3_sized_batch(vocab)
    start = time.perf_counter()
    batch = SamplingBatch.build(rows_of(specs), vocab, eos_ids=[151643, 151645])
    built = time.perf_counter()
    result = sample(logits, batch)
    done = time.perf_counter()
    print(
        f"\n64 x {vocab} on CPU ({torch.get_num_threads()} threads): build {1e3 * (built - start):.0f} ms, "
        f"sample {1e3 * (done - built):.0f} ms"
    )
    assert result.token_ids.shape == (64,) and sum(lp is not None for lp in result.logprobs) == len(
        range(4, 64, 5)
    )
    for i, row in list(enumerate(rows_of(specs)))[:5]:
        assert int(result.token_ids[i]) == sample_token(
            reference_adjust(logits[i], row), row.params, row.generator
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_matches_reference_on_gpu():
    "On the GPU: the same tokens as the reference run on the GPU with GPU generators."
    vocab = 151_936
    specs, logits = qwen3_sized_batch(vocab, prompt_len=100, output_len=20)
    logits = logits.cuda()
    result = sample(
        logits, SamplingBatch.build(rows_of(specs, "cuda"), vocab, EOS_IDS, device="cuda")
    )
    expected = [
        sample_token(reference_adjust(logits[i], row), row.params, row.generator)
        for i, row in enumerate(rows_of(specs, "cuda"))
    ]
    assert result.token_ids.tolist() == expected
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        sample(
            logits, SamplingBatch.build(rows_of(specs, "cuda"), vocab, EOS_IDS, device="cuda")
        ).token_ids.tolist()
    print(
        f"\n64 x {vocab} on {torch.cuda.get_device_name()}: build + sample {1e2 * (time.perf_counter() - start):.1f} ms"
    )
