"""The GPU engine (CUDA graphs, Triton kernels, BF16) against the PyTorch reference path, on the GPU machine.
Run there with `python -m pytest -m gpu tests/test_gpu.py`."""

import copy

import pytest
import torch

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def assert_same_greedy(got, want, tolerance=5e-2):
    """Greedy outputs of two paths agree token for token, their logprobs within `tolerance`: bf16 logprobs of O(10),
    where one bf16 rounding of a logit is up to 2^-8 x 10 = 4e-2 (a GEMM of padded rows may round otherwise). Where
    they part, it must be at a near tie (the other path's token within `tolerance` of the top in the reference's
    top 2); the rest of that output is not compared."""
    for g, w in zip(got, want):
        for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            top = w.logprobs[k]
            if a != b:
                assert a in top and abs(top[a] - top[b]) <= tolerance, (k, a, b, top)
                break
            assert abs(g.logprobs[k][a] - top[b]) <= tolerance, (k, g.logprobs[k], top)
        assert len(g.token_ids) == len(w.token_ids)


def run_all(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_gpu_engine_matches_the_reference_path(name):
    model = init_random_weights(empty_model(preset(name), "cuda", torch.bfloat16), seed=0, std=0.1)
    loaded = LoadedModel(name, model, None, None)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 64)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    config = dict(
        kv_cache_bytes=64 * 2**20,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )
    fast = LLMEngine(loaded, EngineConfig(**config))
    assert fast.runner.decode is not None and fast.runner.decode.use_graphs
    assert (
        type(model).__name__ == "FusedTransformer"
    )  # the engine swapped in chapter 09a's fused layers
    reference = LLMEngine(loaded, EngineConfig(**config, cuda_graphs=False))
    got, want = run_all(fast, prompts, params), run_all(reference, prompts, params)
    assert_same_greedy(got, want)
    for engine in (fast, reference):
        engine.allocator.check_idle()
        assert engine.stats().kv.used_blocks == 0


def test_greedy_in_graph_gives_the_samplers_tokens(monkeypatch):
    """Chapter 09b's GREEDY_IN_GRAPH: the small decode graphs take each row's argmax, the sampler uses it for
    all-greedy steps (seen by a spy on chapter 06's `sample`), and the tokens and logprobs are those without it."""
    import forge_engine.cuda_graphs as cuda_graphs
    import forge_engine.engine as engine_module

    model = init_random_weights(
        empty_model(preset("qwen3-tiny"), "cuda", torch.bfloat16), seed=0, std=0.1
    )
    loaded = LoadedModel("qwen3-tiny", model, None, None)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    config = EngineConfig(
        kv_cache_bytes=64 * 2**20, max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024
    )
    handed, exported = [], engine_module.sample

    def spy(logits, batch, greedy=None):
        handed.append(greedy is not None)
        return exported(logits, batch, greedy)

    monkeypatch.setattr(engine_module, "sample", spy)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(cuda_graphs, "GREEDY_IN_GRAPH", on)
        handed.clear()
        engine = LLMEngine(loaded, config)
        outs[on] = run_all(engine, prompts, params)
        assert any(handed) == on, handed  # with it, decode steps got the graph's tokens
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize(
    "name,mode",
    [
        ("qwen3-tiny", "none"),
        ("qwen2-tiny", "none"),
        ("llama-tiny", "none"),
        ("qwen3-tiny", "int8"),
        ("qwen2-tiny", "int8"),
        ("qwen3-tiny", "int4"),
        ("qwen2-tiny", "int4"),
    ],
)
def test_norms_folded_into_the_gemvs_match_the_separate_kernels(name, mode, monkeypatch):
    """A batch-1 decode step (its CUDA graph) with each add + RMSNorm folded into the GEMVs around it (chapter 09a's
    fused layers, `gemv_folds_norms`; int8, int4: handed from GEMV to GEMV, `gemv_hands_off_norms`) against the same
    step with the separate kernels (those two answering no) and against the PyTorch decode path, all after the same prefill (eager, with PyTorch's
    attention): logits within BF16, and the folded step's pick scores as the best under the others, within that
    (random weights leave near-ties among 151,936 logits)."""
    import forge_engine.fused_layers as fused_layers
    import forge_engine.quant.layers as quant_layers
    from forge_engine.cuda_graphs import DecodeRunner
    from forge_engine.kernels.prefill_attention import KernelDecodeAttention
    from forge_engine.fused_layers import install_fused_layers
    from forge_engine.kv_cache import (
        PagedAttention,
        PagedKVCache,
        build_step_layout,
        paged_decode_attention_torch,
    )

    config = preset(name)
    model = init_random_weights(empty_model(config, "cuda", torch.bfloat16), seed=0, std=0.1)
    if mode != "none":
        from forge_engine.quant.layers import quantize_model

        quantize_model(model, mode)
    install_fused_layers(
        model
    )  # (as the loader and the engine do; a DecodeRunner alone runs what it is given)
    switch, check = (
        ("gemv_folds_norms", "folds_norms")
        if mode == "none"
        else ("gemv_hands_off_norms", "hands_off_norms")
    )
    chosen = getattr(fused_layers, switch)
    cache = PagedKVCache(config, 9, 16, "cuda", torch.bfloat16)  # 8 blocks + the scratch block
    prompt, table = list(range(5, 45)), [0, 1, 2]
    with torch.no_grad():
        model(
            torch.tensor(prompt, device="cuda"),
            build_step_layout([(table, 0, 40)], 16, "cuda").positions,
            PagedAttention(cache, build_step_layout([(table, 0, 40)], 16, "cuda")),
        )
    prefilled = cache.k_cache.clone(), cache.v_cache.clone()
    step = ([7], [40], [table[2] * 16 + 8], [table], [41])  # token 7 at position 40
    logits = {}
    for label, fold, graphs in (
        ("folded", True, True),
        ("separate", False, True),
        ("eager", False, False),
    ):
        for module in (fused_layers, quant_layers):  # asked when the graphs are recorded
            if hasattr(module, switch):
                monkeypatch.setattr(
                    module, switch, chosen if fold else lambda weight, rows=1: False
                )
        cache.k_cache.copy_(prefilled[0])
        cache.v_cache.copy_(prefilled[1])
        attention = KernelDecodeAttention() if graphs else paged_decode_attention_torch
        runner = DecodeRunner(
            model, cache, 4, 256, scratch_block=8, attention=attention, use_graphs=graphs
        )
        if graphs:
            x = torch.zeros(1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
            assert getattr(model.layers[0], check)(x) == fold
        logits[label] = runner.run(*step).float()
    for other in ("separate", "eager"):
        # bf16: the folded step skips the rounding of the normalised x (and hands h·g on rounded once), so a logit is
        # a few roundings of 2^-8 of the largest one apart (measured on an H200: 0.64 of this bound at most)
        atol = 2e-2 * logits[other].abs().max().item()
        torch.testing.assert_close(logits["folded"], logits[other], rtol=0, atol=atol)
        assert logits[other][0, logits["folded"].argmax()] >= logits[other].max() - atol, other


@pytest.mark.parametrize("weights", ["bf16", "int8 groups", "int4 groups", "q4_k_m mix"])
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_decode_rows_through_the_rows_matmul_match_the_separate_kernels(rows, weights, monkeypatch):
    """A decode step of several sequences (their rows through chapter 09's `rows_matmul` with the norms handed from
    matmul to matmul: chapter 09a's GEMV_ROWS_BF16 for BF16 weights, chapter 10g's `Int8GroupLinear.takes_decode_step` for a
    GGUF file's int8 planes with a scale a group of 32, `Int4Linear`'s for int4 ones with groups of 32 as a Q4_K
    file's repack, and as a Q4_K_M file mixes them: qkv a `ConcatLinear` of int4 q, k and int8 v, down int8) against
    the same step with the rows through cuBLAS (the planes: chapter 10b's and 10g's split-K launches) and the
    separate kernels, both replayed from CUDA graphs after the same prefill: logits within BF16, each row's pick
    scored as the best under the other, within that."""
    import forge_engine.fused_layers as fused_layers
    from forge_engine.quant.gguf_gpu import ConcatLinear, Int8GroupLinear
    from forge_engine.quant.layers import Int4Linear
    from forge_engine.quant.layers import swap_layer_matrices
    from forge_engine.cuda_graphs import DecodeRunner
    from forge_engine.fused_layers import install_fused_layers
    from forge_engine.kernels.prefill_attention import KernelDecodeAttention
    from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout

    config = preset("qwen3-tiny")
    model = init_random_weights(empty_model(config, "cuda", torch.bfloat16), seed=0, std=0.1)
    if (
        weights == "int8 groups"
    ):  # each matrix as the loader repacks a Q8_0 file's: int8, an fp16 scale a group of 32

        def planes(linear, where):
            w = linear.weight.float().view(linear.out_features, -1, 32)
            scale = w.abs().amax(-1).clamp(min=1e-8) / 127
            q = (w / scale[:, :, None]).round().to(torch.int8).view(linear.weight.shape)
            return Int8GroupLinear(q, scale.half())

        swap_layer_matrices(model, planes)
    if weights in ("int4 groups", "q4_k_m mix"):

        def planes(linear, where):
            int4 = Int4Linear(linear, group=32)
            if weights == "int4 groups" or not where.endswith(("qkv", "down")):
                return int4
            w = linear.weight.float().view(linear.out_features, -1, 32)
            scale = w.abs().amax(-1).clamp(min=1e-8) / 127
            q = (w / scale[:, :, None]).round().to(torch.int8).view(linear.weight.shape)
            if where.endswith("down"):
                return Int8GroupLinear(q, scale.half())
            v = config.num_kv_heads * config.head_dim  # the last rows: v, int8 as Q6_K's repack
            front = Int4Linear.from_groups(int4.qweight[:-v], int4.scale[:-v], int4.minimum[:-v])
            return ConcatLinear([front, Int8GroupLinear(q[-v:].contiguous(), scale[-v:].half())])

        swap_layer_matrices(model, planes)
    install_fused_layers(model)
    cache = PagedKVCache(
        config, 3 * rows + 1, 16, "cuda", torch.bfloat16
    )  # 3 blocks a sequence + scratch
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(rows)]
    prefill = build_step_layout([(table, 0, 40) for table in tables], 16, "cuda")
    tokens = torch.tensor([t for i in range(rows) for t in range(5 + i, 45 + i)], device="cuda")
    with torch.no_grad():
        model(tokens, prefill.positions, PagedAttention(cache, prefill))
    prefilled = cache.k_cache.clone(), cache.v_cache.clone()
    step = (
        [7 + i for i in range(rows)],
        [40] * rows,
        [table[2] * 16 + 8 for table in tables],
        tables,
        [41] * rows,
    )
    logits = {}
    for label, gemv_rows in (("rows_matmul", fused_layers.GEMV_ROWS_BF16), ("cublas", 1)):
        # asked when the graphs are recorded
        monkeypatch.setattr(fused_layers, "GEMV_ROWS_BF16", gemv_rows)
        for kind in (Int8GroupLinear, Int4Linear, ConcatLinear):
            monkeypatch.setattr(
                kind, "takes_decode_step", lambda self, x: 1 < x.shape[0] <= gemv_rows
            )
        cache.k_cache.copy_(prefilled[0])
        cache.v_cache.copy_(prefilled[1])
        runner = DecodeRunner(
            model, cache, rows, 256, scratch_block=3 * rows, attention=KernelDecodeAttention()
        )
        x = torch.zeros(rows, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        assert model.layers[0].hands_off_norms(x) == (gemv_rows > 1)
        logits[label] = runner.run(*step).float()
    # as the one-row fold against the separate kernels (test above): a few roundings of 2^-8 of the largest logit
    atol = 2e-2 * logits["cublas"].abs().max().item()
    torch.testing.assert_close(logits["rows_matmul"], logits["cublas"], rtol=0, atol=atol)
    picks = logits["rows_matmul"].argmax(-1)
    best = logits["cublas"].max(-1).values
    assert (logits["cublas"].gather(1, picks[:, None])[:, 0] >= best - atol).all()


@pytest.mark.parametrize("heads,dim,with_norm", [(32, 128, True), (8, 128, True), (9, 64, False)])
def test_fused_norm_rope_on_the_gpu_matches_the_reference(heads, dim, with_norm):
    from forge_engine.kernels.elementwise import norm_rope, norm_rope_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(37, 3 * heads * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = qkv[:, : heads * dim].view(37, heads, dim)  # strided, as in the model
    angles = torch.arange(37.0, device="cuda")[:, None] * torch.rand(
        dim // 2, device="cuda", generator=gen
    )
    weight = (
        (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).bfloat16() if with_norm else None
    )
    got = norm_rope(x, weight, 1e-6, angles.cos().bfloat16(), angles.sin().bfloat16())
    want = norm_rope_reference(
        x.float(), weight.float() if with_norm else None, 1e-6, angles.cos(), angles.sin()
    )
    # bf16 cos and sin (2^-8 relative each) and the bf16 output (2^-8) against fp32: ~3 x 2^-8 = 1.2e-2 of |x1·c| + |x2·s|
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(6144, 2560), (2560, 9728), (151936, 2560), (1000, 300)])
def test_gemv_on_the_gpu_matches_the_matmul(rows, n, k):
    from forge_engine.kernels.gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    # fp32 sums against fp32 (another order, ~1e-6), then one rounding to bf16: 2^-8 = 3.9e-3 relative on outputs of O(1)
    torch.testing.assert_close(
        gemv(x, w).float(), torch.nn.functional.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize(
    "n,k,group",
    [(6144, 2560, 0), (2560, 9728, 0), (19456, 2560, 0), (151936, 2560, 0), (1000, 300, 0)]
    + [(6144, 2560, 32), (2560, 9728, 32), (19456, 2560, 32), (1024, 2560, 16)]
    + [(6144, 2560, -128), (2560, 9728, -128), (19456, 2560, -32), (2560, 9728, -32)],
)
def test_rows_matmul_on_the_gpu_matches_the_matmul_with_its_folds(rows, n, k, group):
    """Chapter 09's tensor-core matmul for a few rows against cuBLAS followed by the small steps it folds in (gemv's
    PyTorch path), on Qwen3-4B's shapes (split along K or not): plain, SiLU-mul, the residual with the next norm
    handed on, the handed norm taken in. Replayed, a launch gives the same bits and leaves its tickets zero.
    group > 0: int8 weights with an fp16 scale a group of inputs (chapter 10g's planes of Q8_0 and Q6_K blocks);
    group < 0: chapter 10's int4 pairs with a scale and a minimum a group of -group inputs (`Int4Linear`'s, and a
    GGUF file's Q4_K blocks repacked), the two as views of one tensor; each against cuBLAS on them dequantized."""
    from forge_engine.kernels.gemv import gemv_folds_reference
    from forge_engine.kernels.rows_matmul import dequantized_groups, rows_matmul, rows_matmul_tiles

    gen = torch.Generator(device="cuda").manual_seed(rows * n + abs(group))
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    weight, planes = w, {}
    if group > 0:
        q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
        scale = (torch.rand(n, k // group, device="cuda", generator=gen) + 0.5).half() / (
            127 * k**0.5
        )
        weight, planes = q, {"scale": scale}
        w = dequantized_groups(q, scale, torch.bfloat16)  # what the reference multiplies by
    if group < 0:
        q = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        spread = torch.rand(n, k // -group, device="cuda", generator=gen) + 0.5
        pairs = (
            torch.stack((spread, -7.5 * spread), -1) / (8 * k**0.5)
        ).half()  # about zero-mean weights
        weight, planes = q, {"scale": pairs[..., 0], "minimum": pairs[..., 1]}
        w = dequantized_groups(q, pairs[..., 0], torch.bfloat16, pairs[..., 1])

    def multiply(**folds):
        return rows_matmul(x, weight, **planes, **folds)

    res = torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
    g = (torch.rand(n, device="cuda", generator=gen) + 0.5).bfloat16()
    sums = torch.rand(rows, device="cuda", generator=gen) * k + 1
    tickets = torch.zeros(rows_matmul_tiles(n), device="cuda", dtype=torch.int32)

    def close(
        got, want
    ):  # fp32 sums in another order, then bf16 roundings: a few 2^-8 of the largest output
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * scale)

    first = multiply(tickets=tickets)
    close(first, gemv_folds_reference(x, w))
    assert torch.equal(multiply(tickets=tickets), first) and not tickets.any()
    close(
        multiply(swiglu=True, norm_sums=sums),
        gemv_folds_reference(x, w, swiglu=True, norm_sums=sums),
    )
    got_sums, want_sums = torch.zeros_like(sums), torch.zeros_like(sums)
    got = multiply(residual=res, hand_off=(g, got_sums), tickets=tickets)
    want = gemv_folds_reference(x, w, residual=res, hand_off=(g, want_sums))
    for a, b in zip((*got, got_sums), (*want, want_sums)):
        close(a, b)


@pytest.mark.parametrize("group", [32, -32])
def test_rows_matmul_on_the_gpu_takes_fp16_x_through_fp32(group):
    """For bf16 x `rows_matmul` makes quantized weights bf16 through their bits (chapter 09_kernels_rows_matmul); fp16
    x keeps the fp32 path, each weight rounded once to fp16: against cuBLAS on the weights dequantized to fp16, at 5
    rows of Qwen3-4B's down projection (int8 groups of 32; int4 pairs, groups of 32)."""
    from forge_engine.kernels.gemv import gemv_folds_reference
    from forge_engine.kernels.rows_matmul import dequantized_groups, rows_matmul

    n, k = 2560, 9728
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(5, k, device="cuda", generator=gen).half()
    spread = (torch.rand(n, k // abs(group), device="cuda", generator=gen) + 0.5) / k**0.5
    if group > 0:
        q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
        planes = {"scale": (spread / 127).half()}
    else:
        q = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        planes = {"scale": (spread / 8).half(), "minimum": (-7.5 * spread / 8).half()}
    want = gemv_folds_reference(x, dequantized_groups(q, dtype=torch.float16, **planes))
    got = rows_matmul(x, q, **planes)
    assert got.dtype == torch.float16
    torch.testing.assert_close(
        got.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item()
    )


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n,k", [(6144, 2560), (2560, 9728), (151936, 2560), (1000, 300)])
def test_int8_gemv_on_the_gpu(rows, n, k):
    "int8 weights with one scale per row (chapter 10), converted through their bits in the kernel."
    from forge_engine.kernels.gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    q = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    scale = torch.rand(n, device="cuda", generator=gen) / 127 / k**0.5
    want = torch.nn.functional.linear(x.float(), q.float()) * scale
    # as above: exact integer weights, fp32 sums and scale, one rounding to bf16 (2^-8 relative)
    torch.testing.assert_close(gemv(x, q, None, scale).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", [(6144, 2560), (1000, 320), (151936, 2560)])
def test_gemv_early_weights_change_no_result(n, k):
    "The GEMVs with their first tile (int4: first steps) loaded before the input wait, or launched plainly: the same bits."
    from forge_engine.kernels.gemv import gemv
    from forge_engine.quant.formats import quantize_int4
    from forge_engine.quant.gemv import int4_gemv

    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    q, scale = (
        torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen),
        torch.rand(n, device="cuda"),
    )
    for args in ((w,), (q, None, scale)):
        assert torch.equal(
            gemv(x, *args, early_weights=True), gemv(x, *args, early_weights=False)
        )  # first tile early
    packed = quantize_int4(w, group=64)
    assert torch.equal(
        int4_gemv(x, *packed, pdl=False), int4_gemv(x, *packed)
    )  # and the dependent launch
    for steps in (
        True,
        2,
        3,
    ):  # the first steps of weights before the wait: the same sums in the same order
        for int_dot in (True, False):  # in integers and in FP32
            assert torch.equal(
                int4_gemv(x, *packed, early_weights=steps, int_dot=int_dot),
                int4_gemv(x, *packed, early_weights=False, int_dot=int_dot),
            )
    # a SiLU-mul GEMV's program takes its gate rows and their up rows early too: the same bits
    assert torch.equal(gemv(x, w, swiglu=True), gemv(x, w, swiglu=True, early_weights=False))


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny"])
def test_gpu_kernels_match_the_cpu_pytorch_path_in_fp32(name):
    "Every kernel (GEMV and its fused steps: one sequence at a time, so batch 1) against plain PyTorch on the CPU, fp32."
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    config = dict(
        kv_cache_bytes=16 * 2**20,
        block_size=16,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        max_model_len=512,
    )
    cpu_model = init_random_weights(
        empty_model(preset(name), "cpu", torch.float32), seed=0, std=0.1
    )
    results = []  # the same weights on both (a generator on the GPU would draw other numbers)
    for model in (copy.deepcopy(cpu_model).to("cuda"), cpu_model):
        results.append(
            run_all(
                LLMEngine(LoadedModel(name, model, None, None), EngineConfig(**config)),
                [list(range(7, 7 + n)) for n in (1, 9, 30)],
                params,
            )
        )
    for g, w in zip(*results):
        assert g.token_ids == w.token_ids
        g_lp = torch.tensor([next(iter(lp.values())) for lp in g.logprobs])
        w_lp = torch.tensor([next(iter(lp.values())) for lp in w.logprobs])
        # fp32 on both: sums in another order (~1e-7 relative each) over 2 layers and 32 steps, logprobs of O(10):
        # ~1e-5 at worst (measured on an H200: 2.9e-6)
        torch.testing.assert_close(g_lp, w_lp, rtol=1e-4, atol=1e-4)


def test_silu_mul_and_qk_norm_rope_on_the_gpu():
    from forge_engine.kernels.elementwise import (
        norm_rope,
        norm_rope_reference,
        silu_mul,
        silu_mul_reference,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(5, 2 * 9728, device="cuda", generator=gen).bfloat16()
    # the same formula rounded to bf16 at the same two points; exp's last fp32 bit may differ between the kernel and
    # PyTorch and flip a rounding: one bf16 ulp, 2^-7 = 7.8e-3 relative
    torch.testing.assert_close(silu_mul(h), silu_mul_reference(h), rtol=1e-2, atol=1e-2)
    qkv = torch.randn(7, 48 * 128, device="cuda", generator=gen).bfloat16()
    qk = qkv[:, : 40 * 128].view(7, 40, 128)
    angles = torch.arange(7.0, device="cuda")[:, None] * torch.rand(
        64, device="cuda", generator=gen
    )
    wq, wk = (1 + 0.1 * torch.randn(2, 128, device="cuda", generator=gen)).bfloat16()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = norm_rope(
        qk, wq, 1e-6, cos, sin, k_weight=wk, num_q_heads=32
    )  # bf16 against fp32: as in the test above
    torch.testing.assert_close(
        got[:, :32].float(),
        norm_rope_reference(qk[:, :32].float(), wq.float(), 1e-6, angles.cos(), angles.sin()),
        rtol=2e-2,
        atol=2e-2,
    )
    torch.testing.assert_close(
        got[:, 32:].float(),
        norm_rope_reference(qk[:, 32:].float(), wk.float(), 1e-6, angles.cos(), angles.sin()),
        rtol=2e-2,
        atol=2e-2,
    )


@pytest.mark.parametrize("split_tokens", [16, 64, None])
def test_verify_rows_attend_to_their_sequences_rows_on_the_gpu(split_tokens):
    """Chapter 09's decode attention with `verify`: rows of one sequence at consecutive positions (1 + 7 across a
    split's end, a decode row, 1 + 4), one program taking a sequence's rows and storing their K/V, Qwen3-4B's
    heads in bf16. Contexts of a few keys, so that the step's rows weigh in each output (under the interpreter, a
    kernel that forgets the earlier rows fails it). Against storing every row first and attending row by row."""
    from forge_engine.kernels.elementwise import NormRope, norm_rope_reference, write_kv_reference
    from forge_engine.kernels.paged_attention import (
        paged_attention_reference,
        paged_decode_attention,
        random_paged_kv,
    )

    rows = [(0, 12 + j) for j in range(8)] + [(1, 5)] + [(2, 2 + j) for j in range(5)]
    k_cache, v_cache, tables = random_paged_kv(
        [20, 6, 7],
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(len(rows), 32, 128, device="cuda", generator=gen).bfloat16()
    new_k, new_v = (
        torch.randn(len(rows), 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2)
    )
    positions = torch.tensor([p for _, p in rows], device="cuda")
    row_tables, lens = tables[[s for s, _ in rows]], (positions + 1).int()
    slots = tables[[s for s, _ in rows], positions // 16].long() * 16 + positions % 16
    angles = positions[:, None].float() * torch.rand(64, device="cuda", generator=gen)[None, :]
    weights = (torch.rand(128, device="cuda", generator=gen).bfloat16() + 0.5 for _ in range(2))
    rope = NormRope(*weights, 1e-6, angles.cos(), angles.sin())
    roped_k = norm_rope_reference(new_k, rope.k_weight, 1e-6, rope.cos, rope.sin)
    by_hand = (k_cache.clone(), v_cache.clone())
    write_kv_reference(*by_hand, slots, roped_k, new_v)
    want = paged_attention_reference(
        norm_rope_reference(q, rope.q_weight, 1e-6, rope.cos, rope.sin),
        *by_hand,
        row_tables,
        torch.arange(len(rows) + 1, device="cuda"),
        lens,
        128**-0.5,
    )
    pools = (k_cache.clone(), v_cache.clone())
    got = paged_decode_attention(
        q, *pools, row_tables, lens, 128**-0.5, split_tokens=split_tokens, block_n=16,
        new_kv=(new_k, new_v, slots), rope=rope, verify=True,
    )  # fmt: skip
    # bf16: the kernel rounds the softmax's weights to bf16 before multiplying V, the reference not
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pools[0].float(), by_hand[0].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(pools[1], by_hand[1])


def test_write_kv_on_the_gpu_matches_index_copy():
    from forge_engine.kernels.elementwise import write_kv, write_kv_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(9, 48 * 128, device="cuda", generator=gen).bfloat16()
    k, v = qkv[:, 32 * 128 : 40 * 128].view(9, 8, 128), qkv[:, 40 * 128 :].view(9, 8, 128)
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:9]
    got = [torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    want = [torch.zeros_like(got[0]) for _ in range(2)]
    write_kv(*got, slots, k, v)
    write_kv_reference(*want, slots, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_qwen3_4b_int8_serves_under_an_8_gib_budget():
    "Issue 6's check: the allocator capped at 8 GiB, Qwen3-4B int8 gets >= 1 GiB of KV cache and the peak stays under."
    from forge_engine.loader import load_model
    from forge_engine.memory_plan import MIN_KV_BYTES, parse_bytes

    budget = parse_bytes("8GiB")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    loaded = load_model(
        "random:qwen3-4b", "cuda", quantization="int8", memory_budget=budget, progress=False
    )
    assert (
        type(loaded.model.layers[0]).__name__ == "FusedDecoderLayer"
    )  # the loader swapped in the fused layers
    engine = LLMEngine(loaded, EngineConfig(gpu_memory_budget=budget))
    try:
        assert engine.cache.nbytes >= MIN_KV_BYTES
        out = run_all(
            engine,
            [list(range(100, 400))],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        )
        assert len(out[0].token_ids) == 16
        engine.allocator.check_idle()
        assert torch.cuda.max_memory_allocated() <= budget
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_mixed_steps_replayed_from_graphs_match_the_reference_path():
    "Requests arriving while others decode: steps of prefill chunks beside decodes, replayed from chapter 09b's graphs."
    model = init_random_weights(
        empty_model(preset("qwen3-tiny"), "cuda", torch.bfloat16), seed=1, std=0.1
    )
    loaded = LoadedModel("qwen3-tiny", model, None, None)
    config = dict(
        kv_cache_bytes=64 * 2**20,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=96,  # a 150-token prompt comes in two chunks, the second beside decodes
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 40, 150, 1, 77, 9))]

    def staggered(engine):  # a new request every third step
        finals, pending, step = {}, list(enumerate(prompts)), 0
        while pending or engine.has_unfinished():
            if pending and step % 3 == 0:
                i, p = pending.pop(0)
                engine.add_request(p, params, request_id=str(i))
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            step += 1
        return [finals[str(i)] for i in range(len(prompts))]

    fast = LLMEngine(loaded, EngineConfig(**config))
    assert fast.runner.mixed is not None and fast.runner.mixed.use_graphs
    counted = []
    for graph in fast.runner.mixed.graphs.values():  # count the replays
        graph.replay = (lambda g: lambda: (counted.append(1), type(g).replay(g)))(graph)
    got = staggered(fast)
    reference = LLMEngine(loaded, EngineConfig(**config, cuda_graphs=False))
    want = staggered(reference)
    assert len(counted) >= len(prompts)  # every arrival's first chunk at least
    assert_same_greedy(got, want)
    for engine in (fast, reference):
        engine.allocator.check_idle()


def test_verify_steps_replayed_from_graphs_keep_the_greedy_tokens():
    """Speculative decoding on a GPU (chapter 08c): verify steps replay chapter 09b's verify graphs, whose attention
    takes each row's earlier rows' K/V from the step's rows (chapter 09's `verify`). With the target as its own draft model every draft is accepted, and the greedy
    tokens are those without speculation (fp32: no near ties between the 1-row GEMV and the verify rows' matmul)."""
    model = init_random_weights(
        empty_model(preset("qwen3-tiny"), "cuda", torch.float32), seed=2, std=0.1
    )
    loaded = LoadedModel("qwen3-tiny", model, None, None)
    config = EngineConfig(
        kv_cache_bytes=64 * 2**20,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    want = run_all(LLMEngine(loaded, config), prompts, params)
    fast = LLMEngine(loaded, config.replace(speculative_tokens=4), draft=loaded)
    verify_graphs = [g for (_, _, verify), g in fast.runner.decode.graphs.items() if verify]
    assert verify_graphs and fast.runner.decode.row_limit(True) == 20
    replayed = []
    for graph in verify_graphs:
        graph.replay = (lambda g: lambda: (replayed.append(1), type(g).replay(g)))(graph)
    got = run_all(fast, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    counts = fast.stats().speculation
    assert replayed and counts.verified > 0 and counts.accepted == counts.proposed > 0, counts
    fast.allocator.check_idle()


def test_qwen3_5_on_the_gpu_matches_the_cpu():
    """A tiny Qwen3.5 (chapter 03b) in fp32 on the GPU, its decode steps replayed from chapter 09b's graphs over the
    state pool (chapter 05a) and its prompts through chapter 03c's kernels, against the same weights on the CPU
    (PyTorch throughout): the same greedy tokens, logprobs within 1e-3, every block and slot free after."""
    from forge_engine.qwen3_5 import QWEN35_TINY, Qwen35Model, init_random_qwen35

    cpu = init_random_qwen35(Qwen35Model(QWEN35_TINY), seed=0, std=0.1)
    gpu = copy.deepcopy(cpu).cuda()
    prompts = [list(range(5, 5 + n)) for n in (1, 17, 64, 150)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    config = EngineConfig(
        kv_cache_bytes=16 * 2**20, block_size=16, max_num_seqs=4, max_num_batched_tokens=256
    )
    want = run_all(LLMEngine(LoadedModel("cpu", cpu, None, None), config), prompts, params)
    engine = LLMEngine(LoadedModel("gpu", gpu, None, None), config)
    assert (
        engine.runner.decode is not None and engine.runner.decode.graphs
    )  # decode steps from graphs
    got = run_all(engine, prompts, params)
    assert_same_greedy(got, want, tolerance=1e-3)
    engine.allocator.check_idle()
    assert sorted(engine.scheduler.free_state_slots) == list(range(4))


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_layers_streamed_to_the_gpu_give_the_tokens_of_the_model_whole(quantization):
    """Chapter 10h's streaming mode on a real GPU: a tiny fp32 model of five layers with layers 1.. in pinned host memory,
    run from two GPU slots filled on a copy stream (each slot twice a step), gives the greedy tokens of the same model
    whole on the GPU, with its fused layers."""
    from forge_engine.fused_layers import install_fused_layers
    from forge_engine.offload import StreamedTransformer, stream_layers
    from forge_engine.quant.layers import quantize_model

    model = init_random_weights(empty_model(preset("qwen3-tiny").replace(num_layers=5)), seed=4)
    if quantization != "none":
        quantize_model(model, quantization)
    whole = install_fused_layers(copy.deepcopy(model).to("cuda"))
    streamed = install_fused_layers(stream_layers(model, 1, "cuda"))
    assert isinstance(streamed, StreamedTransformer) and len(streamed.stream.slots) == 2

    def tokens(m):
        engine = LLMEngine(
            LoadedModel("tiny", m, None, None),
            EngineConfig(kv_cache_bytes=16 * 2**20, max_num_seqs=4, cuda_graphs=False),
        )
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        outs = run_all(engine, [list(range(5, 5 + n)) for n in (1, 20, 70)], params)
        engine.allocator.check_idle()
        return outs

    # the same kernels on the same weights but for the norms handed between the whole model's decode GEMVs
    assert_same_greedy(tokens(streamed), tokens(whole), tolerance=1e-3)


def loaded_tokens(quantization: str, **split):
    """A tiny fp32 model loaded on the GPU (split as `split` says), its greedy tokens (with logprobs) for three prompts,
    and the engine's decode runner."""
    from forge_engine.loader import load_model

    loaded = load_model(
        "random:qwen3-tiny",
        "cuda",
        "float32",
        seed=1,
        progress=False,
        quantization=quantization,
        **split,
    )
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=16 * 2**20, max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = run_all(engine, [list(range(5, 5 + n)) for n in (1, 20, 70)], params)
    engine.allocator.check_idle()
    return loaded, outs, engine.runner.decode


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_layers_split_with_the_cpu_give_the_tokens_of_the_model_whole(quantization):
    """Chapter 10h on a real GPU: a tiny model in fp32 with its first layer on the GPU and the rest on the CPU (each
    matrix quantized where it sits; a prompt's matmuls on the GPU, `PromptMatmuls`) gives the greedy tokens of the same
    model whole on the GPU."""
    from forge_engine.cuda_graphs import SplitDecodeRunner
    from forge_engine.offload import OffloadedTransformer

    split, got, runner = loaded_tokens(quantization, gpu_layers=1, offload="cpu")
    assert (
        isinstance(split.model, OffloadedTransformer)
        and split.model.layers[1].attn_norm.weight.device.type == "cpu"
    )
    # a prompt's matmuls of the CPU's layers go to the GPU from the rows the loader measured (chapter 10h)
    assert split.model.prompt_matmuls is not None and split.model.prompt_matmuls.rows >= 2
    # decode steps replayed the GPU's layers and the head as graphs around the CPU's layers (chapter 09b)
    assert isinstance(runner, SplitDecodeRunner) and runner.use_graphs and runner.fronts
    _, want, _ = loaded_tokens(quantization)
    # fp32 both ways; quantized layers are computed by different kernels on each device (PyTorch's weight-only CPU
    # matmul, chapter 10's GEMV), whose sums of ~1e4 products round apart by ~1e-4 of a logit
    assert_same_greedy(got, want, tolerance=1e-3 if quantization == "none" else 5e-3)


def test_offload_auto_picks_a_mode_and_gives_the_tokens_of_the_model_whole():
    """`--offload auto` on a real GPU: one layer timed on the CPU and copied from pinned memory, then the faster mode
    loaded (split with the CPU, or streamed), whose int4 tokens are the model whole's."""
    from forge_engine.offload import OffloadedTransformer, StreamedTransformer

    auto, got, _ = loaded_tokens("int4", gpu_layers=1, offload="auto")
    assert isinstance(auto.model, (OffloadedTransformer, StreamedTransformer))
    assert_same_greedy(got, loaded_tokens("int4")[1], tolerance=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hybrid_kernels_on_the_gpu_match_their_references(dtype):
    """Chapter 09h's kernels compiled on a GPU against their PyTorch references at the Qwen3.5-4B shape: the gates, the
    gated norm, q's norm and partial rotation, and the zero-centred add + norm (chapter 09's `add_rmsnorm`)."""
    from forge_engine.fused_hybrid import (
        gated_rmsnorm,
        gated_rmsnorm_reference,
        gdn_gates,
        gdn_gates_reference,
        norm_partial_rope,
        norm_partial_rope_reference,
    )
    from forge_engine.model import rope_cos_sin
    from forge_engine.kernels.elementwise import add_rmsnorm, add_rmsnorm_reference

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)

    # bf16: a result rounded once by each, the same rounding almost everywhere; one ulp (2^-8) apart at most
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    ab = randn(7, 64, scale=4.0)
    a, b = ab[:, :32], ab[:, 32:]  # (strided rows, as split from the merged projection)
    A_log = torch.rand(32, generator=gen, device="cuda").mul(15).add(1).log()
    dt_bias = torch.randn(32, generator=gen, device="cuda")
    for got, want in zip(
        gdn_gates(a, b, A_log, dt_bias), gdn_gates_reference(a, b, A_log, dt_bias)
    ):
        torch.testing.assert_close(got, want, **tol)
    x = torch.randn(7, 32, 128, generator=gen, device="cuda")
    z, weight = randn(7, 32, 128), 1 + randn(128, scale=0.1)
    torch.testing.assert_close(
        gated_rmsnorm(x, z, weight, 1e-6), gated_rmsnorm_reference(x, z, weight, 1e-6), **tol
    )
    q = randn(7, 16, 512)[:, :, :256]  # the query halves of the merged projection's rows
    q_weight = randn(256, scale=0.1)
    cos, sin = rope_cos_sin(torch.arange(7, device="cuda") * 100, 64, 1e7, dtype)
    torch.testing.assert_close(
        norm_partial_rope(q, q_weight, 1e-6, cos, sin),
        norm_partial_rope_reference(q, q_weight, 1e-6, cos, sin),
        # bf16: the reference rounds each product and the difference of the rotation, the kernel the result once:
        # a few ulps of the products (up to ~4), ~3e-2
        **(tol if dtype == torch.float32 else dict(rtol=2**-7, atol=3e-2)),
    )
    h, r, w = randn(7, 2560), randn(7, 2560), randn(2560, scale=0.1)
    for got, want in zip(
        add_rmsnorm(h, r, w, 1e-6, zero_centred=True),
        add_rmsnorm_reference(h, r, w, 1e-6, zero_centred=True),
    ):
        torch.testing.assert_close(got, want, **tol)
