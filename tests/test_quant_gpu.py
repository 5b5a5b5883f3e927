"""Quantized matmul kernels (chapter 10) on the GPU, at Qwen3-4B shapes, against their PyTorch references;
a quantized model through the CUDA-graph decode path; quantizing on the GPU (the same bytes as on the CPU, and
a staged Qwen3-4B load's peak); and `forge-engine bench w1 --quantization int8`.
Run there with `PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_quant_gpu.py`."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel, load_model
from forge_engine.memory_plan import load_peak_bytes, parse_bytes, weight_bytes
from forge_engine.model import empty_model, init_random_weights
from forge_engine.quant.formats import quantize_int4, quantize_int8, quantize_rows
from forge_engine.quant.gemv import int4_gemv, int4_matmul, int4_matmul_reference, pair_scales
from forge_engine.quant.gguf_blocks import gguf_matmul
from forge_engine.quant.layers import QUANTIZED_LINEARS, quantize_model
from forge_engine.quant.split_k import SKINNY_MAX_ROWS, int8_matmul, int8_matmul_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(2560, 6144), (2560, 19456), (9728, 2560), (4096, 2560)]  # (K, N): qkv, gate_up, down, o


def rel_error(got, want) -> float:
    "The error's norm over the result's: a rounding to bf16 of every element gives 2^-8 / sqrt(3) = 2.3e-3 (its RMS)."
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 64])  # int4: the GEMV up to 4 rows, split-K above
def test_int8_and_int4_kernels_match_the_reference(k, n, m):
    gen = torch.Generator(device="cuda").manual_seed(k + n + m)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    q, s = quantize_int8(w)
    got, want = int8_matmul(x, q, s, impl="triton"), int8_matmul_reference(x, q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert (
        rel_error(got, want) < 1e-2
    )  # the reference rounds the scale and its output twice to bf16: ~2^-8 in all
    # and the int8 weights are close to the originals: a code's rounding error has RMS step / sqrt(12), the step
    # max|w| / 127 of a row, ~4.2 sigma / 127 for these rows: 9.5e-3 of the weights' RMS, and so of the products
    assert rel_error(got, x.float() @ w.T) < 2e-2
    packed, scale, minimum = quantize_int4(w)
    got, want = (
        int4_matmul(x, packed, scale, minimum, impl="triton"),
        int4_matmul_reference(x, packed, scale, minimum),
    )
    assert (
        rel_error(got, want) < 1e-2
    )  # bf16 weights (2^-8 each) and output against the kernel's one rounding
    # 4-bit Gaussian weights: a group of 128 spans ~5.2 sigma, so a step of 0.35 sigma and an error of step / sqrt(12):
    # ~10% per weight
    assert rel_error(got, x.float() @ w.T) < 0.2
    if (
        m <= 4
    ):  # the GEMV's arithmetic in FP32 too (its default is in integers: chapter 10's INT4_INT_DOT)
        floats = int4_gemv(x, packed, scale, minimum, int_dot=False)
        assert (
            rel_error(floats, want) < 1e-2 and rel_error(got, floats) < 1e-2
        )  # as above: a few bf16 roundings
    paired = pair_scales(
        scale, minimum
    )  # as Int4Linear keeps them: one 4-byte load a row and group, the same bits
    assert torch.equal(int4_matmul(x, packed, paired[..., 0], paired[..., 1], impl="triton"), got)


def test_int8_rows_on_the_gpu_are_the_dequantized_rows_bit_for_bit():
    "A tied model's embedding read from its int8 head (`int8_rows`): the bits of `dequantize_int8` of the rows."
    from forge_engine.quant.formats import dequantize_int8, int8_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, s = quantize_int8(torch.randn(151936, 2560, device="cuda", generator=gen))
    ids = torch.tensor([0, 151935, 7, 7, 98304], device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(int8_rows(ids, q, s, dtype), dequantize_int8(q[ids], s[ids], dtype))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_gguf_q8_0_kernel_matches_hand_made_blocks(m):
    "Q8_0 blocks built by hand (d as float16, 32 int8): no gguf package needed on this machine."
    n, k = 2560, 4096
    gen = torch.Generator(device="cuda").manual_seed(m)
    d = (torch.rand(n, k // 32, 1, device="cuda", generator=gen) * 0.01).half()
    q = torch.randint(-127, 128, (n, k // 32, 32), device="cuda", generator=gen, dtype=torch.int8)
    raw = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    want = x.float() @ (d.float() * q.float()).reshape(n, k).T
    assert (
        rel_error(gguf_matmul(x, raw, 8, impl="triton"), want) < 1e-2
    )  # exact weights, fp32 sums, one bf16 rounding


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_kernels_match_the_dequantizers(qtype):
    gguf = pytest.importorskip("gguf")  # the reference dequantizers of chapter 01a need it
    from forge_engine.gguf_file import DEQUANTIZERS

    t = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    n, k = 2560, 4096
    gen = torch.Generator(device="cuda").manual_seed(int(t))
    raw = torch.randint(
        0, 256, (n, k // block, type_size), device="cuda", generator=gen, dtype=torch.uint8
    )
    scales = (
        torch.rand(n, k // block, 2, device="cuda", generator=gen)
        .mul(0.01)
        .half()
        .view(torch.uint8)
    )
    if qtype == "Q6_K":
        raw[..., 208:] = scales[..., :2]  # a sane float16 d: Q6_K keeps it last
    else:
        raw[..., :4] = scales  # sane float16 d (and m / dmin) at bytes 0..3
    raw = raw.reshape(n, -1)
    w = DEQUANTIZERS[t](raw.reshape(-1, type_size)).reshape(n, k)
    for m in (1, 3, 9):  # the GEMV launch, then split-K
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        assert rel_error(gguf_matmul(x, raw, int(t), impl="triton"), x.float() @ w.T) < 1e-2, (
            m
        )  # as for Q8_0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_under_cuda_graphs_matches_eager(mode):
    config = preset("qwen3-tiny").replace(
        hidden_size=256, intermediate_size=512, head_dim=64, num_heads=4, num_kv_heads=2
    )
    model = init_random_weights(empty_model(config, "cuda", torch.bfloat16), seed=0, std=0.05)
    quantize_model(model, mode)
    assert all(
        type(layer.get_submodule(n)).__name__ != "Linear"
        for layer in model.layers
        for n in QUANTIZED_LINEARS
    )
    options = dict(max_num_seqs=SKINNY_MAX_ROWS, max_num_batched_tokens=256)
    assert greedy_tokens(
        LoadedModel(mode, model, None, None), graphs=True, **options
    ) == greedy_tokens(LoadedModel(mode, model, None, None), graphs=False, **options)


def greedy_tokens(loaded: LoadedModel, graphs: bool, **options) -> list[list[int]]:
    "Three prompts' greedy tokens through the engine, with or without CUDA graphs."
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(
        kv_cache_bytes=32 * 2**20, max_model_len=512, cuda_graphs=graphs, **options
    )
    engine = LLMEngine(loaded, config)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_on_the_gpu_gives_the_cpu_bytes(mode):
    "A bf16 model on the CPU quantized on the CPU and (matrix by matrix, in slices) on the GPU: identical buffers."
    config = preset("qwen3-tiny").replace(
        hidden_size=256, intermediate_size=768, head_dim=64, num_heads=4, num_kv_heads=2
    )
    staged = init_random_weights(empty_model(config, "cpu", torch.bfloat16), seed=1, std=0.05)
    on_cpu = quantize_model(copy.deepcopy(staged), mode)
    on_gpu = quantize_model(copy.deepcopy(staged), mode, device="cuda")
    assert on_gpu.layers[0].mlp.gate_up.qweight.is_cuda and on_gpu.lm_head.qweight.is_cuda
    assert not on_gpu.norm.weight.is_cuda  # the rest stays put
    cpu_buffers, gpu_buffers = dict(on_cpu.named_buffers()), dict(on_gpu.named_buffers())
    quantized = [n for n in cpu_buffers if n.endswith(("qweight", "scale", "scale_minimum"))]
    assert (
        len(quantized) == 2 * 4 * config.num_layers + 2
    )  # codes and scales (int4: scale-minimum pairs); the int8 head
    for name in quantized:
        assert_same_quantization(cpu_buffers[name], gpu_buffers[name].cpu(), name)
    w = staged.layers[0].mlp.gate_up.weight  # and in slices of 5 rows, CPU weight to GPU
    quantize = quantize_int8 if mode == "int8" else quantize_int4
    for a, b in zip(quantize_rows(quantize, w, "cuda", chunk=5 * 256), quantize(w)):
        assert_same_quantization(b, a.cpu(), "gate_up in slices")


def assert_same_quantization(cpu: torch.Tensor, gpu: torch.Tensor, name: str):
    """Scales within an ulp; codes equal but for rare off-by-one roundings (measured on an H200: a few int8 codes of
    the tiny model's qkv differ by 1 between the devices, a value a hair from a rounding boundary)."""
    assert cpu.shape == gpu.shape and cpu.dtype == gpu.dtype, name
    if cpu.is_floating_point():  # one fp32 ulp is 2^-24 to 2^-23 (1.2e-7) of the value: rtol 2e-7
        torch.testing.assert_close(gpu, cpu, rtol=2e-7, atol=0, msg=name)
    elif (
        cpu.dtype == torch.int8
    ):  # a code flips only where w / scale is an fp32 ulp or two (<= 2^-17) from a half: ~1e-5
        diff = (gpu.int() - cpu.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, (name, int((diff > 0).sum()))
    else:  # packed nibbles: compare each nibble
        nibbles = lambda t: torch.stack([t & 15, t >> 4]).int()
        diff = (nibbles(gpu) - nibbles(cpu)).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, (name, int((diff > 0).sum()))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_staged_load_equals_an_unstaged_one(mode):
    "Under a budget (staged on the CPU, drawn and quantized on the GPU) and without: the same quantized model."
    staged = load_model(
        "random:qwen3-tiny",
        "cuda",
        quantization=mode,
        memory_budget=parse_bytes("4GiB"),
        progress=False,
    )
    direct = load_model("random:qwen3-tiny", "cuda", quantization=mode, progress=False)
    a, b = dict(staged.model.named_buffers()), dict(direct.model.named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert all(
        torch.equal(p, q) for p, q in zip(staged.model.parameters(), direct.model.parameters())
    )
    assert all(t.is_cuda for t in [*staged.model.parameters(), *staged.model.buffers()])


def test_qwen3_4b_int4_staged_load_is_quick_and_its_peak_stays_low():
    "Issue 6's 8 GiB run: random Qwen3-4B, int4, staged on the CPU: the GPU peak is the planned one, in seconds."
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load_model(
        "random:qwen3-4b",
        "cuda",
        quantization="int4",
        memory_budget=parse_bytes("8GiB"),
        progress=False,
    )
    peak = torch.cuda.max_memory_allocated() - base
    config = loaded.config
    print(
        f"staged int4 load: {loaded.stats.seconds:.1f} s, GPU peak {peak / 2**30:.2f} GiB "
        f"(planned {load_peak_bytes(config, 'int4') / 2**30:.2f}, bf16 weights {weight_bytes(config) / 2**30:.2f})"
    )
    assert (
        peak <= load_peak_bytes(config, "int4") + 64 * 2**20
    )  # the plan counts tensors; the allocator rounds blocks up
    assert peak < weight_bytes(config) / 2
    assert loaded.stats.seconds < 45  # it took over 75 s quantizing on the CPU
    del loaded
    torch.cuda.empty_cache()


def test_bench_w1_int8_runs():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_engine",
            "bench",
            "w1",
            "--model",
            "random:qwen3-4b",
            "--quantization",
            "int8",
            "--output-len",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout[r.stdout.index("{") :])
    assert result["quantization"] == "int8" and result["decode_tok_s"] > 0
    assert (
        result["weight_bytes"] < 4.1e9
    )  # 8.04 GB in bf16; int8 layers + the int8 head (tied: the embedding): 4.03 GB


def test_a_gguf_file_repacked_on_the_gpu_decodes_as_its_blocks(tmp_path):
    """A tiny Qwen3 written as GGUF with Q8_0, Q4_0 and Q4_1 matrices (QKV as three runs, a tied Q8_0 head), kept in
    its blocks on the GPU as the loader does (chapter 10g's repack: int8 group planes, int4, a concatenation): its
    logits against the same file dequantized, and its greedy tokens with and without CUDA graphs."""
    gguf = pytest.importorskip("gguf")
    from forge_engine.fused_layers import install_fused_layers
    from forge_engine.gguf_file import GGUFFile, write_gguf
    from forge_engine.model import hf_state_dict
    from forge_engine.quant.gguf_gpu import ConcatLinear, Int8GroupLinear, gguf_layers_for_gpu
    from forge_engine.quant.layers import GGUFLinear, Int4Linear, load_gguf_quantized

    QType = gguf.GGMLQuantizationType
    config = preset("qwen3-tiny").replace(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_heads=4,
        num_kv_heads=2,
    )
    state = {
        k: v.contiguous()
        for k, v in hf_state_dict(init_random_weights(empty_model(config), 3, std=0.05)).items()
    }
    types = [QType.Q8_0, QType.Q4_0, QType.Q4_1]
    qtypes = {k: types[i % 3] for i, k in enumerate(state) if "proj" in k}
    qtypes["model.embed_tokens.weight"] = QType.Q8_0
    path = write_gguf(tmp_path / "tiny.gguf", config, state, qtypes)

    model = install_fused_layers(
        gguf_layers_for_gpu(load_gguf_quantized(GGUFFile(path), "cuda", torch.float32))
    )
    kinds = {type(m) for m in model.modules()}
    assert {Int8GroupLinear, Int4Linear, ConcatLinear} <= kinds and GGUFLinear not in kinds
    dense = empty_model(config, "cuda", torch.float32)
    from forge_engine.model import load_weights

    load_weights(dense, GGUFFile(path).tensors(dtype=torch.float32))
    ids = torch.arange(7, 47, device="cuda")
    with torch.inference_mode():
        logits = [m.compute_logits(m(ids, torch.arange(40, device="cuda"))) for m in (model, dense)]
    assert (
        rel_error(*logits) < 1e-4
    )  # the repacks are exact for these types: FP32 sums in another order

    loaded = LoadedModel("tiny-gguf", model, None, None)
    assert greedy_tokens(loaded, graphs=True, max_num_seqs=8) == greedy_tokens(
        loaded, graphs=False, max_num_seqs=8
    )


@pytest.mark.parametrize("k,n", SHAPES)
def test_dense_paths_dequantize_once_on_the_gpu(k, n):
    "Prefill's path (many rows): the weights made by one Triton launch, as the PyTorch reference makes them."
    from forge_engine.quant.gemv import int4_dense
    from forge_engine.quant.gguf_gpu import int8_group_dense, int8_group_matmul_reference

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(300, k, device="cuda", generator=gen).bfloat16()
    q = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, k // 32, device="cuda", generator=gen) * 0.01).half()
    assert torch.equal(int8_group_dense(x, q, scale), int8_group_matmul_reference(x, q, scale))
    packed, s, m = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.02, 32)
    paired = pair_scales(s, m)
    got = int4_dense(x, packed, paired[..., 0], paired[..., 1])
    assert (
        rel_error(got, int4_matmul_reference(x, packed, s, m)) < 1e-3
    )  # (an FMA may round q·s + m once)
