"Tensor parallelism on the CPU: 2 processes over gloo, against the single-process engine."

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.model import empty_model, hf_config_dict, hf_state_dict, init_random_weights
from forge_engine.tensor_parallel.ranks import TensorParallelError, load_model_parallel

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7], list(range(100, 140)), [9] * 11, list(range(300, 321))]
# small steps: chunked prefills, mixed steps and pure decode steps (through the static decode runner) all happen
ENGINE = dict(
    kv_cache_bytes=2**20, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, cuda_graphs=True
)


def run_to_end(engine, prompts, params=GREEDY, timeout=120):
    ids = [engine.add_request(p, params) for p in prompts]
    finals, start = {}, time.monotonic()
    while engine.has_unfinished():
        assert time.monotonic() - start < timeout, "the engine hangs"
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def test_a_killed_worker_is_named_by_its_exit_code_every_time():
    """Rank 0's report right after a worker is killed (`_Group.death_report`): the worker's pipe closes a moment before
    the kernel lets it be reaped, and reading its exit code at once found none about one time in twenty (CI then saw
    rank 0's socket error reported instead of the dead worker). Thirty kills, each named with its exit code."""
    from forge_engine.tensor_parallel.ranks import _Group

    spawn = multiprocessing.get_context("spawn")
    for _ in range(30):
        worker = spawn.Process(target=time.sleep, args=(60,), name="sleeper", daemon=True)
        worker.start()
        os.kill(worker.pid, signal.SIGKILL)
        report = _Group([worker], "gloo").death_report(wait_s=10.0)
        assert report == f"tensor-parallel worker sleeper (pid {worker.pid}) exited with code -9", (
            report
        )


def write_checkpoint(directory, config, seed):
    "A 2-shard safetensors checkpoint with an index, as the hub has them (weights large enough to give varied tokens)."
    model = init_random_weights(empty_model(config), seed=seed, std=0.1)
    tensors = {k: v.contiguous() for k, v in hf_state_dict(model).items()}
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, directory / file)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}})
    )
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config)))
    return sum(t.nbytes for t in tensors.values())


def assert_same_outputs(reference, got):
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    for a, b in zip(reference, got):
        assert b.finish_reason == "length" and b.error is None
        for la, lb in zip(
            a.logprobs, b.logprobs
        ):  # the sampled token's log-probability, to fp32 rounding
            assert la.keys() == lb.keys()
            # the ranks' partial sums added by the all-reduce, not inside one matmul: a few roundings of 2^-24 relative
            # on logprobs up to ~11, ~1e-6 (measured: 1.9e-6), so 1e-5
            assert all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def assert_no_workers(parallel):
    assert all(p.exitcode is not None for p in parallel.processes)
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()


def test_random_preset_same_tokens_as_one_process():
    "random:qwen3-tiny (2 KV heads = 2 ranks): the same weights as one process, the same greedy tokens."
    one = LLMEngine(load_model("random:qwen3-tiny", "cpu", progress=False), EngineConfig(**ENGINE))
    reference = run_to_end(one, PROMPTS)
    loaded = load_model_parallel("random:qwen3-tiny", "cpu", world=2)
    try:
        assert loaded.config.vocab_size == 151936 and loaded.config.num_heads == 2
        engine = LLMEngine(
            loaded, EngineConfig(**ENGINE, tensor_parallel_size=2, async_scheduling=True)
        )
        assert engine.overlap  # rank 0 broadcasts the tokens it has not read back yet
        assert (
            engine.warm_up() > 0 and engine.steps == 0
        )  # as `forge-engine serve` does: the ranks step along
        assert_same_outputs(reference, run_to_end(engine, PROMPTS))
        engine.allocator.check_idle()
        with pytest.raises(ValueError, match="tensor_parallel_size 1"):
            LLMEngine(loaded, EngineConfig(**ENGINE))
    finally:
        loaded.parallel.close()
    assert_no_workers(loaded.parallel)
    assert [p.exitcode for p in loaded.parallel.processes] == [
        0
    ]  # it left by itself, not terminated
    engine.add_request([1, 2, 3], GREEDY, request_id="after close")
    [out] = engine.step()
    assert out.finish_reason == "error" and "closed" in out.error


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_shared_prefixes_keep_the_workers_in_step(overlap):
    """A pool too small for every request: sequences are preempted and re-admitted (their block tables
    replaced), and a repeated prompt shares cached blocks; the workers' mirrors of the tables follow.
    Overlapped: a sequence preempted with a token in flight is re-admitted with it as a pending input."""
    prompts = PROMPTS + [PROMPTS[1]]
    one = LLMEngine(load_model("random:qwen3-tiny", "cpu", progress=False), EngineConfig(**ENGINE))
    reference = run_to_end(one, prompts)
    loaded = load_model_parallel("random:qwen3-tiny", "cpu", world=2)
    try:  # 2 KiB blocks per rank (1 KV head of 32 fp32 dims x 2 layers, K and V, 4 tokens): 24 blocks for ~130 tokens
        engine = LLMEngine(
            loaded,
            EngineConfig(
                **{**ENGINE, "kv_cache_bytes": 24 * 2048},
                tensor_parallel_size=2,
                async_scheduling=overlap,
            ),
        )
        assert_same_outputs(reference, run_to_end(engine, prompts))
        assert sum(r.preempted for r in engine.recent) > 0
        engine.allocator.check_idle()
    finally:
        loaded.parallel.close()
    assert_no_workers(loaded.parallel)


def test_llm_splits_the_model_when_asked():
    "`LLM(..., tensor_parallel_size=2)`: `load_model_over` (chapter 08b) picks chapter 09c's loader; the same tokens."
    from forge_engine.llm import LLM

    one = LLM("random:qwen3-tiny", device="cpu", progress=False, **ENGINE)
    reference = one.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM("random:qwen3-tiny", device="cpu", progress=False, tensor_parallel_size=2, **ENGINE)
    try:
        assert one.loaded.parallel is None and llm.loaded.parallel.world == 2
        assert_same_outputs(
            reference, llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        )
    finally:
        llm.loaded.parallel.close()
    assert_no_workers(llm.loaded.parallel)


def test_sharded_safetensors_and_a_killed_worker(tmp_path):
    """qwen2-tiny (1 KV head on 2 ranks: replicated; q/k/v biases; untied LM head) from a 2-shard checkpoint:
    each rank reads its slices, tokens match one process; then a worker is killed mid-generation."""
    config = preset("qwen2-tiny")
    full_bytes = write_checkpoint(tmp_path, config, seed=7)
    one = LLMEngine(load_model(str(tmp_path), "cpu", progress=False), EngineConfig(**ENGINE))
    reference = run_to_end(one, PROMPTS)
    assert (
        len({tuple(o.token_ids) for o in reference}) > 1 and len(set(reference[1].token_ids)) > 1
    )  # varied tokens
    loaded = load_model_parallel(str(tmp_path), "cpu", world=2)
    try:
        # rank 0 read its row slices only (q/k/v/gate/up/embed/lm_head halves); o/down/norms whole
        assert (
            loaded.stats.bytes_read < 0.7 * full_bytes
        )  # its slices and the small tensors whole: 0.50 of the bytes
        engine = LLMEngine(loaded, EngineConfig(**ENGINE, tensor_parallel_size=2))
        assert_same_outputs(reference, run_to_end(engine, PROMPTS))
        engine.allocator.check_idle()

        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in PROMPTS]
        for _ in range(3):
            engine.step()
        worker = loaded.parallel.processes[0]
        threading.Timer(
            0.2, os.kill, (worker.pid, signal.SIGKILL)
        ).start()  # lands in a step, wherever it is
        finals, start = {}, time.monotonic()
        while engine.has_unfinished():
            assert time.monotonic() - start < 30, "the engine hangs after a worker died"
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert set(finals) == set(ids)
        assert all(
            o.finish_reason == "error" and "exited with code -9" in o.error for o in finals.values()
        ), [o.error for o in finals.values()]
        engine.allocator.check_idle()
        engine.add_request([1, 2, 3], params, request_id="later")
        [later] = engine.step()
        assert later.finish_reason == "error" and "exited with code -9" in later.error
        with pytest.raises(TensorParallelError, match="exited with code -9"):
            LLMEngine(loaded, EngineConfig(**ENGINE, tensor_parallel_size=2))
    finally:
        loaded.parallel.close()
    assert_no_workers(loaded.parallel)


def test_refuses_what_cannot_be_split():
    with pytest.raises(ValueError, match="does not divide the model's num_heads"):
        load_model_parallel("random:llama-tiny", "cpu", world=4)
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-14b"])
def test_larger_qwen3_shapes_split_over_2_4_and_8_ranks(name):
    "The presets the TP benchmarks use: every rank's shard is whole, and the shards add up to the model."
    from forge_engine.config import preset
    from forge_engine.tensor_parallel.shards import ShardPlan

    c = preset(name)
    for world in (2, 4, 8):
        plans = [ShardPlan(c, rank, world) for rank in range(world)]
        shards = [p.shard_config for p in plans]
        assert sum(s.num_heads for s in shards) == c.num_heads
        assert sum(s.intermediate_size for s in shards) == c.intermediate_size
        assert sum(p.vocab_part for p in plans) == c.vocab_size
        assert sorted(h for p in plans for h in p.kv_heads) == list(
            range(c.num_kv_heads)
        )  # 8 KV heads: split
