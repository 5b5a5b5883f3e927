"""Tensor parallelism on 2 GPUs: NCCL, CUDA graphs with the collectives inside, against one GPU.
Run on a machine with 2+ GPUs: `python -m pytest -q -m gpu tests/test_tp_gpu.py`
(`kernels_lab/tp_gpu_check.sh` runs it with every rank's stacks dumped should anything hang)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from forge_engine.config import EngineConfig, preset
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.tensor_parallel.ranks import load_model_parallel
from test_tensor_parallel import PROMPTS, run_to_end, write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

CONFIG = dict(
    kv_cache_bytes=64 * 2**20,
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_model_len=1024,
)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize(
    "dtype,all_reduce,overlap",
    [
        ("float32", "nccl", False),
        ("float32", "nccl", True),
        ("bfloat16", "nccl", True),
        ("float32", "symmetric-memory", True),
    ],
)
def test_two_gpus_match_one(tmp_path, monkeypatch, dtype, all_reduce, overlap):
    """qwen2-tiny (1 KV head: replicated) from a sharded checkpoint; decode steps replay graphs with the all-reduces
    inside; steps overlapped (the pending tokens broadcast on the GPUs) or not."""
    monkeypatch.setenv("FORGE_TP_ALL_REDUCE", all_reduce)
    write_checkpoint(tmp_path, preset("qwen2-tiny"), seed=7)
    one = LLMEngine(
        load_model(str(tmp_path), "cuda", dtype, progress=False), EngineConfig(**CONFIG)
    )
    reference = run_to_end(one, PROMPTS, PARAMS)
    loaded = load_model_parallel(str(tmp_path), "cuda", dtype, world=2)
    try:
        engine = LLMEngine(
            loaded, EngineConfig(**CONFIG, tensor_parallel_size=2, async_scheduling=overlap)
        )
        assert engine.overlap == overlap
        assert engine.runner.decode is not None and engine.runner.decode.use_graphs
        # asked for, small all-reduces (all of this test's) go through symmetric memory, inside the decode graphs too
        path = loaded.parallel.all_reduce_path
        assert path.startswith(
            "symmetric memory" if all_reduce == "symmetric-memory" else "NCCL"
        ), path
        got = run_to_end(engine, PROMPTS, PARAMS)
        engine.allocator.check_idle()
    finally:
        start = time.monotonic()
        loaded.parallel.close()  # with the engine and its graphs still alive: close destroys them first
    assert time.monotonic() - start < 20, "close waited for a worker to be terminated"
    assert all(p.exitcode == 0 for p in loaded.parallel.processes)  # the worker left by itself
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
    for g, w in zip(got, reference):
        assert g.error is None
        first = torch.tensor([next(iter(lp.values())) for lp in g.logprobs[:4]])
        want = torch.tensor([next(iter(lp.values())) for lp in w.logprobs[:4]])
        if dtype == "float32":  # fp32: the same tokens (the partial sums only round differently)
            assert g.token_ids == w.token_ids
            # a few roundings of 2^-24 on logprobs of O(10): ~1e-6 (the CPU's 2 ranks: 1.9e-6), far inside 1e-3
            torch.testing.assert_close(first, want, rtol=1e-3, atol=1e-3)
        else:  # bf16 rounds the partial sums: the first tokens agree, later ones may drift apart
            assert g.token_ids[:4] == w.token_ids[:4]
            # each rank's partial sum rounded to bf16 before the add: a few 2^-8 roundings of logits of O(10), 4e-2 each
            torch.testing.assert_close(first, want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("all_reduce", ["nccl", "symmetric-memory"])
def test_a_killed_gpu_worker_fails_the_engine_cleanly(all_reduce):
    """In a fresh process with a time limit (a hang fails the test instead of blocking the suite); all-reduces through
    NCCL, or the small ones through symmetric memory (whose kernels rank 0 must release: they have no abort)."""
    script = textwrap.dedent("""
        import os, signal, threading, time
        from forge_engine.config import EngineConfig
        from forge_engine.engine import LLMEngine
        from forge_engine.generate import SamplingParams
        from forge_engine.tensor_parallel.ranks import load_model_parallel
        if __name__ == "__main__":
            loaded = load_model_parallel("random:qwen3-tiny", "cuda", world=2)
            path = loaded.parallel.all_reduce_path
            assert path.startswith("symmetric memory" if os.environ["FORGE_TP_ALL_REDUCE"] == "symmetric-memory"
                                   else "NCCL"), path
            engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=2**26, max_num_seqs=8, max_model_len=4096,
                                                    tensor_parallel_size=2, async_scheduling=True))
            params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
            ids = [engine.add_request(list(range(10, 10 + n)), params) for n in (5, 50, 500)]
            for _ in range(20): engine.step()
            threading.Timer(0.05, os.kill, (loaded.parallel.processes[0].pid, signal.SIGKILL)).start()
            errors = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished: errors[out.request_id] = out.error
            # the exit code names the cause; with steps overlapped the next step's message may find the pipe broken
            # first, and where no dead worker is found within _fail's wait the error names the one whose pipe broke
            assert set(errors) == set(ids) and all(e and ("exited with code -9" in e or "is gone: its pipe broke" in e)
                                                   for e in errors.values()), errors
            loaded.parallel.close()
            print("FAILED CLEANLY")
    """)
    # its own session: on a hang every process of it (the workers too) dumps its stacks, then is killed
    env = {**os.environ, "FORGE_TP_STACKS": "30", "FORGE_TP_ALL_REDUCE": all_reduce}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("the killed-worker run hangs; every process's stacks:\n" + out[-20000:])
    assert proc.returncode == 0 and "FAILED CLEANLY" in out, out[-5000:]
