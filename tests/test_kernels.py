"""The Triton kernels of chapter 09 against their PyTorch references.

On a CPU the kernels run under Triton's interpreter (`impl="triton"` forces it), so sizes stay
small; the `gpu` tests run at Qwen3-4B's shapes on a CUDA device (`pytest -m gpu`)."""

import itertools

import pytest
import torch

from forge_engine.kernels.backend import kernel_backend
from forge_engine.kernels.elementwise import add_rmsnorm, add_rmsnorm_reference, rmsnorm
from forge_engine.kernels.paged_attention import (
    DECODE_BLOCK_N,
    decode_split_len,
    paged_attention_reference,
    paged_decode_attention,
    random_paged_kv,
)
from forge_engine.kernels.prefill_attention import paged_prefill_attention

# fp32: the same products and sums as the reference taken in another order (tiles, splits, merges; up to 4,096 keys),
# each rounding 2^-24 relative: ~1e-6 on outputs of O(1), so 1e-5. bf16: the reference rounds once at the end, a
# kernel also rounds the softmax weights before P·V, or the residual and the normalised row: up to three roundings of
# 2^-8 relative (2^-7 where the interpreter truncates), 3 x 2^-7 = 2.3e-2, so rtol 5e-2; atol 1e-2 for outputs near 0
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=1e-2)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(
        device=device, dtype=dtype
    )


# ---- RMSNorm fused with the residual add


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 3, 256)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(dtype, shape, with_residual):
    x, w = randn(*shape, dtype=dtype, seed=1), 1 + 0.1 * randn(shape[-1], dtype=dtype, seed=2)
    residual = randn(*shape, dtype=dtype, seed=3) if with_residual else None
    out, new_residual = add_rmsnorm(x, residual, w, 1e-6, impl="triton")
    want, want_residual = add_rmsnorm_reference(x, residual, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, want, **TOL[dtype])
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(new_residual, want_residual)  # one rounded add: exact
    else:  # Triton's interpreter rounds fp32 -> bf16 by truncation, not to nearest
        torch.testing.assert_close(new_residual, want_residual, **TOL[dtype])


def test_rmsnorm_rows_of_heads_and_strided_input():
    heads = randn(5, 4, 32)  # q/k-norm: each head's vector is a row
    w = randn(32, seed=4)
    # (the default fp32 tolerance, rtol 1.3e-6: 32 squares summed in another order, a few roundings of 2^-24)
    torch.testing.assert_close(
        rmsnorm(heads, w, 1e-6, impl="triton"), add_rmsnorm_reference(heads, None, w, 1e-6)[0]
    )
    wide = randn(6, 64)
    with pytest.raises(ValueError, match="unit stride"):
        rmsnorm(wide[:, ::2], w, 1e-6, impl="triton")


def test_torch_path_is_the_reference_and_impl_is_checked():
    "The PyTorch path (the reference) against RMSNorm written out in float64."
    x, r, w = randn(3, 16), randn(3, 16, seed=1), randn(16, seed=2)
    out, new_residual = add_rmsnorm(x, r, w, 1e-6, impl="torch")
    h = x.double() + r.double()  # exact in float64: rounded once to fp32 it is the fp32 sum
    assert torch.equal(new_residual, h.float())
    h = h.float().double()
    want = (w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).float()
    # fp32: 16 squares summed (15 roundings of 2^-24, halved by the square root), rsqrt, two products: < 1e-6 relative
    torch.testing.assert_close(out, want, rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="unknown kernel implementation 'fast'"):
        add_rmsnorm(x, r, w, 1e-6, impl="fast")
    assert kernel_backend("cpu") == "torch"


# ---- paged decode attention

DECODE_CASES = [  # (q_heads, kv_heads, head_dim, block_size, context lengths, dtype)
    (2, 2, 64, 16, [1, 17, 300], torch.float32),  # GQA ratio 1
    (8, 2, 64, 16, [5, 2000], torch.float32),  # ratio 4, a long context: several splits
    (8, 1, 128, 8, [1, 129, 700], torch.float32),  # ratio 8, head_dim 128, block 8
    (4, 1, 128, 32, [33, 1024], torch.float32),  # ratio 4, block 32
    (8, 2, 128, 16, [3, 511, 1500], torch.bfloat16),
    (6, 2, 64, 16, [40, 90], torch.float32),  # ratio 3: a group that is not a power of two
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,lens,dtype", DECODE_CASES)
def test_decode_matches_reference(q_heads, kv_heads, head_dim, block_size, lens, dtype):
    k_cache, v_cache, tables = random_paged_kv(
        lens, kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE
    )
    q = randn(len(lens), q_heads, head_dim, dtype=dtype, seed=5)
    ctx = torch.tensor(lens, device=DEVICE)
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, device=DEVICE), ctx, head_dim**-0.5
    )
    counters = torch.zeros(len(lens) * kv_heads, device=DEVICE, dtype=torch.int32)
    for split_tokens, merge in (
        (256, False),
        (256, True),
        (100_000, False),
    ):  # splits merged by a second launch or
        got = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            tables,
            ctx,
            head_dim**-0.5,
            impl="triton",  # by the last
            split_tokens=split_tokens,
            merge=merge,
            counters=counters,
        )  # split; one split
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert not counters.any()  # left at zero for the next call


@pytest.mark.parametrize("merge", [False, True])
def test_decode_is_batch_invariant_and_takes_int64_and_strided_q(merge):
    lens = [70, 1200, 600]
    k_cache, v_cache, tables = random_paged_kv(lens, 2, 64, 16, device=DEVICE, pad_columns=5)
    qkv = randn(3, 8 * 64 + 2 * 2 * 64, seed=6)  # q as a view of a merged qkv projection
    q = qkv[:, : 8 * 64].view(3, 8, 64)
    ctx = torch.tensor(lens, device=DEVICE)
    batched = paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables.long(),
        ctx.long(),
        0.125,
        impl="triton",
        split_tokens=256,
        merge=merge,
    )
    assert decode_split_len(tables.shape[1], 16, 256)[1] > decode_split_len(5 + 1, 16, 256)[1]
    for i, width in (
        (0, 10),
        (2, 45),
    ):  # 70 keys: one split; 600 keys: 3 splits, 2 empty ones fewer than batched
        alone = paged_decode_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            tables[i : i + 1, :width],
            ctx[i : i + 1],
            0.125,
            impl="triton",
            split_tokens=256,
            merge=merge,
        )
        assert torch.equal(alone, batched[i : i + 1]), (
            i
        )  # same bits alone as next to a long sequence
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.arange(4, device=DEVICE), ctx, 0.125
    )
    torch.testing.assert_close(batched, want, **TOL[torch.float32])


def test_decode_split_len_caps_the_number_of_splits():
    assert decode_split_len(4, 16) == (512, 1)
    assert decode_split_len(100, 16) == (512, 4)
    split_len, splits = decode_split_len(100_000, 16)  # 1.6M tokens: splits grow instead
    assert splits <= 64 and split_len * splits >= 1_600_000 and split_len % DECODE_BLOCK_N == 0


def test_decode_splits_by_work():
    "Given the batch's size (pairs), the split follows it: short ones for one sequence, none for 256."
    assert decode_split_len(32, 16, pairs=8) == (64, 8) and decode_split_len(
        128, 16, pairs=2048
    ) == (2048, 1)
    assert decode_split_len(32, 16, 256, pairs=8) == (256, 2)  # split_tokens: fixed
    lens = [300, 20, 900]  # 3 x 2 pairs: 16 splits at most, of 64 keys or more
    k_cache, v_cache, tables = random_paged_kv(lens, 2, 32, 16, device=DEVICE)
    q, ctx = randn(3, 8, 32, seed=7), torch.tensor(lens, device=DEVICE)
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.arange(4, device=DEVICE), ctx, 32**-0.5
    )
    for merge in (False, True):
        got = paged_decode_attention(
            q, k_cache, v_cache, tables, ctx, 32**-0.5, impl="triton", merge=merge
        )
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert decode_split_len(32, 16) == (512, 1)  # no batch size: the fixed split


def test_decode_rejects_bad_shapes():
    k_cache, v_cache, tables = random_paged_kv([4], 2, 16, 4)
    ctx = torch.tensor([4])
    with pytest.raises(ValueError, match="same shape and strides"):
        paged_decode_attention(
            randn(1, 4, 16, device="cpu"), k_cache, v_cache[:-1], tables, ctx, 1.0
        )
    with pytest.raises(ValueError, match="head_dim must match"):
        paged_decode_attention(randn(1, 4, 8, device="cpu"), k_cache, v_cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(
            randn(1, 4, 16, dtype=torch.bfloat16, device="cpu"), k_cache, v_cache, tables, ctx, 1.0
        )
    with pytest.raises(ValueError, match=r"context_lens \[B\]"):
        paged_decode_attention(
            randn(1, 4, 16, device="cpu"), k_cache, v_cache, tables, torch.tensor([4, 4]), 1.0
        )


# ---- prefill attention over the varlen batch

PREFILL_CASES = [  # (q_heads, kv_heads, head_dim, block_size, [(num_computed, num_new)], dtype)
    (
        2,
        2,
        64,
        16,
        [(0, 40), (0, 1), (25, 9)],
        torch.float32,
    ),  # ratio 1: prompt, one-token prompt, chunk
    (
        8,
        2,
        64,
        16,
        [(0, 70), (48, 20), (130, 1)],
        torch.float32,
    ),  # ratio 4: prompt, prefix hit, a decode
    (8, 1, 128, 8, [(16, 33), (0, 5)], torch.float32),  # ratio 8, head_dim 128, block 8
    (4, 2, 128, 32, [(64, 64), (3, 17)], torch.bfloat16),  # block 32, bf16
    (6, 2, 64, 16, [(0, 19), (10, 4)], torch.float32),  # ratio 3
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,chunks,dtype", PREFILL_CASES)
def test_prefill_matches_reference(q_heads, kv_heads, head_dim, block_size, chunks, dtype):
    lens = [computed + new for computed, new in chunks]
    k_cache, v_cache, tables = random_paged_kv(
        lens, kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE
    )
    num_new = [new for _, new in chunks]
    q = randn(sum(num_new), q_heads, head_dim, dtype=dtype, seed=7)
    query_start = torch.tensor([0, *num_new], device=DEVICE).cumsum(0)
    ctx = torch.tensor(lens, device=DEVICE)
    want = paged_attention_reference(q, k_cache, v_cache, tables, query_start, ctx, head_dim**-0.5)
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start, ctx, max(num_new), head_dim**-0.5, impl="triton"
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_prefill_of_decodes_equals_decode_kernel():
    lens = [9, 300, 64]
    k_cache, v_cache, tables = random_paged_kv(lens, 2, 64, 16, device=DEVICE)
    q, ctx = randn(3, 4, 64, seed=8), torch.tensor(lens, device=DEVICE)
    prefill = paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.arange(4, device=DEVICE), ctx, 1, 0.125, impl="triton"
    )
    decode = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, impl="triton")
    torch.testing.assert_close(prefill, decode, **TOL[torch.float32])


def test_reference_agrees_with_the_models_causal_attention():
    from forge_engine.model import causal_attention

    k_cache, v_cache, tables = random_paged_kv([23], 2, 32, 4)
    q = randn(6, 4, 32, device="cpu")
    got = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.tensor([0, 6]), torch.tensor([23]), 32**-0.5
    )
    blocks = tables[0, :6].long()
    want = causal_attention(
        q, k_cache[blocks].flatten(0, 1)[:23], v_cache[blocks].flatten(0, 1)[:23], q_offset=17
    )
    torch.testing.assert_close(
        got, want, rtol=1e-5, atol=1e-5
    )  # fp32: PyTorch's attention sums in another order


def test_prefill_rejects_bad_arguments():
    k_cache, v_cache, tables = random_paged_kv([4, 4], 2, 16, 4)
    q, ctx = randn(8, 4, 16, device="cpu"), torch.tensor([4, 4])
    with pytest.raises(ValueError, match=r"query_start must be \[B\+1\] = \[3\]"):
        paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 8]), ctx, 4, 1.0)
    with pytest.raises(ValueError, match="max_query_len must be >= 1"):
        paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 4, 8]), ctx, 0, 1.0)


# ---- the model's layers, fused


@pytest.mark.parametrize("name", ["qwen2-tiny", "llama-tiny"])
def test_fused_layers_give_the_plain_models_logits(name):
    """Chapter 09a's fused layers (forced where no GPU runs them: the kernels' PyTorch paths, the attention interpreted)
    with the kernel backend against the plain model with the reference one, over a prompt, a mixed step and decodes
    (whose q and k the decode kernel rotates): a qkv bias (qwen2), no q/k norm (llama)."""
    import copy
    from forge_engine.config import preset
    from forge_engine.fused_layers import FusedDecoderLayer, install_fused_layers
    from forge_engine.kernels.prefill_attention import KernelPagedAttention
    from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
    from forge_engine.model import empty_model, init_random_weights

    plain = init_random_weights(empty_model(preset(name), device=DEVICE), seed=0, std=0.1)
    fused = install_fused_layers(copy.deepcopy(plain), force=True)
    assert all(type(layer) is FusedDecoderLayer for layer in fused.layers)
    caches = [
        PagedKVCache(plain.config, num_blocks=16, block_size=4, device=DEVICE) for _ in range(2)
    ]
    steps = [
        ([([7, 2, 9, 4], 0, 6)], [3, 14, 15, 92, 65, 35]),
        ([([7, 2, 9, 4], 6, 4), ([1, 5], 0, 3)], [89, 79, 32, 38, 7, 8, 9]),
        ([([7, 2, 9, 4], 10, 1), ([1, 5], 3, 1)], [46, 26]),
    ]
    with torch.no_grad():
        for seqs, ids in steps:
            layout = build_step_layout(seqs, 4, device=DEVICE)
            ids = torch.tensor(ids, device=DEVICE)
            want = plain.compute_logits(
                plain(ids, layout.positions, PagedAttention(caches[0], layout))
            )
            got = fused.compute_logits(
                fused(ids, layout.positions, KernelPagedAttention(caches[1], layout, "triton"))
            )
            torch.testing.assert_close(
                got, want, **TOL[torch.float32]
            )  # (fp32: attention's sums in another order)


def test_layers_stay_plain_where_no_gpu_runs_the_kernels():
    "On a CPU neither the loader nor the engine swaps in the fused layers: chapter 03's layers run as written."
    from forge_engine.config import EngineConfig
    from forge_engine.engine import LLMEngine
    from forge_engine.loader import load_model
    from forge_engine.model import DecoderLayer, Transformer

    loaded = load_model("random:qwen3-tiny", "cpu", progress=False)
    LLMEngine(loaded, EngineConfig(kv_cache_bytes=2**22))
    assert type(loaded.model) is Transformer and all(
        type(layer) is DecoderLayer for layer in loaded.model.layers
    )
    assert type(loaded.model.layers[0].attn.qkv) is torch.nn.Linear


# ---- on a GPU, at Qwen3-4B's shapes (32 query heads, 8 KV heads, head_dim 128, block 16, bf16)


@pytest.mark.gpu
def test_gpu_qwen3_4b_shapes():
    bf16 = torch.bfloat16
    x, r, w = (
        randn(256, 2560, dtype=bf16),
        randn(256, 2560, dtype=bf16, seed=1),
        randn(2560, dtype=bf16, seed=2),
    )
    out, res = add_rmsnorm(x, r, w, 1e-6)
    want, want_res = add_rmsnorm_reference(x, r, w, 1e-6)
    torch.testing.assert_close(out, want, **TOL[bf16])
    assert torch.equal(res, want_res)

    lens = [1, 15, 16, 17, 1000, 4096, 333, 2048]
    k_cache, v_cache, tables = random_paged_kv(
        lens, 8, 128, 16, dtype=bf16, device="cuda", pad_columns=7
    )
    q, ctx = (
        randn(len(lens), 32, 128, dtype=bf16, seed=3),
        torch.tensor(lens, device="cuda", dtype=torch.int32),
    )
    want = paged_attention_reference(
        q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, device="cuda"), ctx, 128**-0.5
    )
    for merge in (False, True):
        torch.testing.assert_close(
            paged_decode_attention(q, k_cache, v_cache, tables, ctx, 128**-0.5, merge=merge),
            want,
            **TOL[bf16],
        )

    chunks = [(0, 512), (1024, 256), (37, 1), (0, 3), (500, 77)]
    lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = random_paged_kv(lens, 8, 128, 16, dtype=bf16, device="cuda")
    num_new = [n for _, n in chunks]
    q = randn(sum(num_new), 32, 128, dtype=bf16, seed=4)
    query_start = torch.tensor([0, *num_new], device="cuda").cumsum(0)
    ctx = torch.tensor(lens, device="cuda")
    want = paged_attention_reference(q, k_cache, v_cache, tables, query_start, ctx, 128**-0.5)
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start, ctx, max(num_new), 128**-0.5
    )
    torch.testing.assert_close(got, want, **TOL[bf16])


@pytest.mark.gpu
@pytest.mark.parametrize("merge", [False, True])
def test_gpu_decode_replays_in_a_cuda_graph(merge):
    """The decode launch reads nothing back to the host: capture once, change the inputs in place, replay. With
    `merge` the last split merges, counting on counters that each replay leaves at zero for the next."""
    bf16 = torch.bfloat16
    k_cache, v_cache, tables = random_paged_kv(
        [1100, 2000, 520, 520], 8, 128, 16, dtype=bf16, device="cuda"
    )
    q, ctx = randn(4, 32, 128, dtype=bf16), torch.tensor([600, 2000, 50, 1], device="cuda")
    counters = torch.zeros(4 * 8, device="cuda", dtype=torch.int32)
    attend = lambda: paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        128**-0.5,
        merge=merge,
        counters=counters,
        split_tokens=512,
    )  # fixed: the same splits alone and batched
    attend()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for seed, lens in ((9, [601, 1999, 51, 2]), (10, [1100, 1536, 513, 512])):
        q.copy_(randn(4, 32, 128, dtype=bf16, seed=seed))
        ctx.copy_(torch.tensor(lens, device="cuda"))
        graph.replay()
        want = paged_attention_reference(
            q, k_cache, v_cache, tables, torch.arange(5, device="cuda"), ctx, 128**-0.5
        )
        torch.testing.assert_close(out, want, **TOL[bf16])
        assert not counters.any()
        alone = paged_decode_attention(
            q[1:2],
            k_cache,
            v_cache,
            tables[1:2],
            ctx[1:2],
            128**-0.5,
            merge=merge,
            split_tokens=512,
        )
        assert torch.equal(alone, out[1:2])  # the same bits whichever program of a batch merged


@pytest.mark.gpu
def test_gpu_tiny_model_through_the_kernel_backend():
    from forge_engine.config import preset
    from forge_engine.kernels.prefill_attention import KernelPagedAttention
    from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
    from forge_engine.fused_layers import install_fused_layers
    from forge_engine.model import empty_model, init_random_weights

    model = init_random_weights(empty_model(preset("qwen3-tiny"), device="cuda"), seed=0, std=0.1)
    install_fused_layers(model)  # (as the engine does: the layers through the kernels too)
    caches = [
        PagedKVCache(model.config, num_blocks=16, block_size=4, device="cuda") for _ in range(2)
    ]
    steps = [
        ([([7, 2, 9, 4], 0, 6)], [3, 14, 15, 92, 65, 35]),
        ([([7, 2, 9, 4], 6, 4), ([1, 5], 0, 3)], [89, 79, 32, 38, 7, 8, 9]),
        ([([7, 2, 9, 4], 10, 1), ([1, 5], 3, 1)], [46, 26]),
    ]
    with torch.no_grad():
        for seqs, ids in steps:
            layout = build_step_layout(seqs, 4, device="cuda")
            ids = torch.tensor(ids, device="cuda")
            want = model.compute_logits(
                model(ids, layout.positions, PagedAttention(caches[0], layout))
            )
            got = model.compute_logits(
                model(ids, layout.positions, KernelPagedAttention(caches[1], layout))
            )
            # fp32 (the kernels' dots in IEEE fp32): attention sums in another order, ~1e-7 relative, through 2 layers to
            # logits of O(1): ~1e-6 (measured on an H200: 2.2e-6), so 1e-5
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("layout", ["tile", "rows"])
def test_gpu_gate_up_gemv_with_swiglu_epilogue(int8, layout):
    "Qwen3-4B's gate-up at one row: SiLU-mul in the GEMV's epilogue gives the bits of the GEMV, then silu_mul."
    from forge_engine.kernels.elementwise import silu_mul, silu_mul_reference
    from forge_engine.kernels.gemv import gemv, gemv_reference
    from forge_engine.quant.formats import quantize_int8

    x, w = (
        randn(1, 2560, dtype=torch.bfloat16),
        randn(2 * 9728, 2560, dtype=torch.bfloat16, seed=1) / 50,
    )
    w, scale = quantize_int8(w) if int8 else (w, None)
    want = silu_mul(gemv(x, w, None, scale, layout=layout))
    assert torch.equal(gemv(x, w, None, scale, swiglu=True, layout=layout), want)
    # bf16: the GEMV's output, SiLU's and the product each rounded (2^-8 relative), the reference's GEMV summed in
    # another order: three or four roundings apart, ~1.6e-2
    torch.testing.assert_close(
        want.float(),
        silu_mul_reference(gemv_reference(x, w, None, scale)).float(),
        rtol=5e-2,
        atol=5e-2,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_gpu_gemv_layouts_at_qwen3_4b_shapes(int8):
    """Both GEMV layouts, with the first weights early or not, against the reference at each of a layer's shapes; the
    rows layout also at 5 and 8 rows of x (a verify step's), each row the bits it gets among two."""
    from forge_engine.kernels.gemv import gemv, gemv_reference
    from forge_engine.quant.formats import quantize_int8

    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (100, 2560 + 64)):
        x, w = randn(8, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, seed=1) / k**0.5
        w, scale = quantize_int8(w) if int8 else (w, None)
        want = gemv_reference(x.float(), w.float(), None, scale)
        for layout, early, m in itertools.product(("tile", "rows"), (False, True), (1, 5, 8)):
            if layout == "tile" and m > 1:
                continue
            got = gemv(x[:m], w, None, scale, layout=layout, early_weights=early)
            # fp32 sums against an fp32 reference, then one rounding to bf16 (2^-8 = 3.9e-3 relative) on outputs of O(1)
            torch.testing.assert_close(
                got.float(),
                want[:m],
                rtol=2e-2,
                atol=2e-2,
                msg=lambda e: f"{n}x{k} {layout} {early} {m}: {e}",
            )
            if m > 2:  # (one row takes the loop of its own: its sums add in another order)
                two = gemv(x[m - 2 : m], w, None, scale, layout=layout, early_weights=early)
                assert torch.equal(got[m - 2 :], two), (n, k, m)


@pytest.mark.gpu
def test_gpu_decode_normalises_and_rotates_q_and_the_new_k():
    "Qwen3-4B's heads: the decode kernel given q and k as the QKV projection leaves them (rope) = norm_rope first."
    from forge_engine.kernels.elementwise import NormRope, norm_rope_reference, write_kv_reference

    bf16 = torch.bfloat16
    lens = [1, 300, 517, 2048]
    k_cache, v_cache, tables = random_paged_kv(lens, 8, 128, 16, dtype=bf16, device="cuda")
    q, ctx = (
        randn(4, 32, 128, dtype=bf16, seed=3),
        torch.tensor(lens, device="cuda", dtype=torch.int32),
    )
    new_k, new_v = randn(4, 8, 128, dtype=bf16, seed=4), randn(4, 8, 128, dtype=bf16, seed=5)
    last = ctx.long() - 1
    slots = tables[torch.arange(4, device="cuda"), last // 16].long() * 16 + last % 16
    angles = (
        torch.tensor(lens, device="cuda")[:, None]
        * torch.rand(64, generator=torch.Generator().manual_seed(6)).cuda()
    )
    rope = NormRope(
        randn(128, dtype=bf16, seed=7) + 1,
        randn(128, dtype=bf16, seed=8) + 1,
        1e-6,
        angles.cos().to(bf16),
        angles.sin().to(bf16),
    )
    by_hand = (k_cache.clone(), v_cache.clone())
    write_kv_reference(
        *by_hand, slots, norm_rope_reference(new_k, rope.k_weight, 1e-6, rope.cos, rope.sin), new_v
    )
    want = paged_attention_reference(
        norm_rope_reference(q, rope.q_weight, 1e-6, rope.cos, rope.sin),
        *by_hand,
        tables,
        torch.arange(5, device="cuda"),
        ctx,
        128**-0.5,
    )
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 128**-0.5, new_kv=(new_k, new_v, slots), rope=rope
    )
    torch.testing.assert_close(got, want, **TOL[bf16])
    # (the reference rounds to bf16 after the norm, the weight and the rotation; the kernel once, at the end: up to four
    # roundings of 2^-8 apart, relative to |x1·c| + |x2·s|, which x1·c - x2·s may cancel: 5e-2, relative and absolute)
    torch.testing.assert_close(k_cache, by_hand[0], rtol=5e-2, atol=5e-2)
    assert torch.equal(v_cache, by_hand[1])


@pytest.mark.gpu
def test_gpu_decode_early_tile_waits_for_the_projection():
    """With `early_tile` the decode kernel starts as a dependent of the GEMV that writes q and the new K/V and asks for
    its first K/V tile before it waits: in a CUDA graph, replayed with new inputs, the bits and pool of the plain
    launch (lengths put the new position in a split's first tile and in a later one)."""
    from forge_engine.kernels.gemv import gemv

    bf16 = torch.bfloat16
    lens = [1, 130, 517, 2048]
    k_cache, v_cache, tables = random_paged_kv(lens, 8, 128, 16, dtype=bf16, device="cuda")
    ctx = torch.tensor(lens, device="cuda", dtype=torch.int32)
    last = ctx.long() - 1
    slots = tables[torch.arange(4, device="cuda"), last // 16].long() * 16 + last % 16
    x, w = randn(4, 2560, dtype=bf16), randn(48 * 128, 2560, dtype=bf16, seed=1) / 50
    runs = {}
    for early in (False, True):
        pools = (k_cache.clone(), v_cache.clone())

        def step():
            q, k, v = (
                gemv(x, w).view(4, 48, 128).split([32, 8, 8], dim=1)
            )  # the QKV projection of Qwen3-4B's heads
            return paged_decode_attention(
                q, *pools, tables, ctx, 128**-0.5, new_kv=(k, v, slots), early_tile=early
            )

        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        runs[early] = (graph, out, pools)
    for seed in (11, 12):
        x.copy_(randn(4, 2560, dtype=bf16, seed=seed))
        for graph, _, _ in runs.values():
            graph.replay()
        (_, plain, plain_pools), (_, early_out, early_pools) = runs[False], runs[True]
        assert (
            torch.equal(early_out, plain)
            and torch.equal(early_pools[0], plain_pools[0])
            and torch.equal(early_pools[1], plain_pools[1])
        ), seed
        q, k, v = gemv(x, w).view(4, 48, 128).split([32, 8, 8], dim=1)
        assert torch.equal(
            plain_pools[0].view(-1, 8, 128)[slots], k
        )  # this replay's K is in the pool
        want = paged_attention_reference(
            q, *plain_pools, tables, torch.arange(5, device="cuda"), ctx, 128**-0.5
        )
        torch.testing.assert_close(plain, want, **TOL[bf16])
