"""The GPU engine (CUDA graphs, Triton kernels, BF16) against the PyTorch reference path, on the GPU machine.
Run there with `python -m pytest -m gpu tests/test_gpu.py`."""
import pytest
import torch

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run_all(engine, prompts, params):
    for i, p in enumerate(prompts): engine.add_request(p, params, request_id=str(i))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished: finals[out.request_id] = out
    return [finals[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_gpu_engine_matches_the_reference_path(name):
    model = init_random_weights(empty_model(preset(name), "cuda", torch.bfloat16), seed=0, std=0.1)
    loaded = LoadedModel(name, model, None, None)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 64)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    config = dict(kv_cache_bytes=64 * 2**20, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    fast = LLMEngine(loaded, EngineConfig(**config))
    assert fast.runner.decode is not None and fast.runner.decode.use_graphs
    reference = LLMEngine(loaded, EngineConfig(**config, cuda_graphs=False))
    got, want = run_all(fast, prompts, params), run_all(reference, prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        g_lp = torch.tensor([next(iter(lp.values())) for lp in g.logprobs])
        w_lp = torch.tensor([next(iter(lp.values())) for lp in w.logprobs])
        torch.testing.assert_close(g_lp, w_lp, rtol=5e-2, atol=5e-2)
    for engine in (fast, reference):
        engine.allocator.check_idle()
        assert engine.stats().kv.used_blocks == 0


@pytest.mark.parametrize("heads,dim,with_norm", [(32, 128, True), (8, 128, True), (9, 64, False)])
def test_fused_norm_rope_on_the_gpu_matches_the_reference(heads, dim, with_norm):
    from forge_engine.kernels import norm_rope, norm_rope_reference
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(37, 3 * heads * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = qkv[:, :heads * dim].view(37, heads, dim)  # strided, as in the model
    angles = torch.arange(37.0, device="cuda")[:, None] * torch.rand(dim // 2, device="cuda", generator=gen)
    weight = (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).bfloat16() if with_norm else None
    got = norm_rope(x, weight, 1e-6, angles.cos().bfloat16(), angles.sin().bfloat16())
    want = norm_rope_reference(x.float(), weight.float() if with_norm else None, 1e-6, angles.cos(), angles.sin())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
