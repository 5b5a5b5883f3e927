# %% [markdown]
# # Starting and watching the ranks
#
# > Rank 0 starts the workers, sends them each step, watches them, and loads a model split over them.
#
# Part of tensor parallelism: chapter 09c says how the model is split and what crosses the wire.

# %%
#| default_exp tensor_parallel.ranks

# %%
#| export
# Why one module of ~520 lines: it is one concept, the life of a group of rank processes (start,
# step, watch, stop). Rank 0's side and the worker's loop read each other's messages and failure
# modes; split apart, neither half could be read without the other.
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from forge_engine.config import EngineConfig, ModelConfig
from forge_engine.kv_cache import to_device
from forge_engine.loader import (
    LoadedModel,
    finish_stats,
    model_config_of,
    resolve_device,
    resolve_dtype,
)
from forge_engine.loading import LoadStats, rss_bytes
from forge_engine.registry import ResolvedModel, describe_model, resolve
from forge_engine.runner import ModelRunner, PendingTokens, build_runner
from forge_engine.tokenizer import Tokenizer
from forge_engine.tensor_parallel.collective_timing import time_collectives
from forge_engine.tensor_parallel.peer_all_reduce import (
    RELEASE_LAUNCH_WAIT_S,
    SymmMemAllReduce,
    all_reduce_choice,
    setup_all_reduce,
)
from forge_engine.tensor_parallel.shards import (
    ShardPlan,
    ShardedTransformer,
    _agree_min,
    load_shard,
)
from forge_engine.tensor_parallel.step_message import (
    StepReader,
    StepWriter,
    broadcast_pending,
    received_pending,
)

# %%
#| hide
import tempfile
from pathlib import Path
import pytest
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.model import (
    causal_attention,
    empty_model,
    hf_state_dict,
    init_random_weights,
    rope_cos_sin,
)


# ## Rank 0's side: workers, their pipes, and a watch on them
#
# **Why a pipe for the step descriptions.** The workers spend their idle time waiting for the
# next step. A `torch.distributed` receive waits at most its timeout (and a server may be idle
# for hours), while a `multiprocessing` pipe waits for ever and reports a dead peer at once
# (`EOFError` in a worker whose engine died, `BrokenPipeError` on rank 0's side). A step's
# message is a few hundred bytes of arrays (a few KB when many sequences are admitted at
# once). The *model's* collectives, which carry tensors, go through `torch.distributed`.
#
# **CUDA graphs before communicators.** A CUDA graph that recorded NCCL collectives holds a
# reference on the communicator, and (since NCCL 2.26) destroying *or aborting* the
# communicator waits until every such graph is destroyed. A process that leaves the group
# while its engine's decode graphs are still alive therefore hangs for ever. So every rank
# destroys its decode graphs first (`DecodeRunner.release_graphs`): a worker before it leaves,
# rank 0 for every runner it built, on `close()` and on failure alike.
#
# **Failure.** A watcher thread waits on the workers' process sentinels. When one dies, it
# records why, starts releasing the symmetric-memory kernels that wait for the dead rank (see
# *small all-reduces through peer memory*), destroys rank 0's decode graphs (a replay in
# flight finishes first), aborts the communicator (on NCCL) so that no NCCL call waits on the
# dead rank, and stops the others. From
# then on every `run` raises at once with that reason; the engine fails the step's requests,
# then every later step's, so each open request ends with an error and nothing hangs. A step
# that raises on rank 0 after the workers have started it poisons the group too: the ranks
# can no longer be trusted to meet in the same collective.
#
# **A step's GPU work.** On a GPU, `run` only *queues* the step: the engine samples, and does
# its host work, while the GPU computes (chapter 08). A collective aborted because a rank died
# returns early, with garbage in its output, and what follows it on the stream runs on that
# garbage; nothing on the GPU says so. What does say so is the order of events on rank 0: the
# watcher records the failure *before* it aborts anything, and an aborted collective can only
# end after the abort. So once a step's GPU work has ended, a group with no failure recorded ran
# it whole. `run` records an event after each step; the engine (chapter 08), once it has a
# step's tokens and before it applies them, calls `check_step()`, which waits for that step's
# event (free: the tokens came later on the same stream) and checks the group. So the step
# that was running when a rank died fails its requests there, each with the dead worker's
# exit code, and no token of it reaches them. Waiting for the GPU inside every `run`, as this
# chapter first did, cost each step the overlap of chapter 08.
#
# **Overlapped steps.** The engine launches step N+1 before it has read step N's tokens back
# (chapter 08); their places in step N+1's inputs hold a placeholder, in the step message too.
# Rank 0 then broadcasts those tokens, straight from its GPU, before the step's forward
# (`broadcast_pending`): one small NCCL call queued like the all-reduces, so no rank waits on
# the host, and each worker copies them into its inputs as rank 0 does. Measured on 2 H200s
# (`random:qwen3-4b`, TP=2, NCCL all-reduces): W1 355.2 tok/s and W2 15,958 tok/s with overlapped
# steps, against 262.7 and 9,893 without (an earlier build); so steps overlap under tensor
# parallelism by default too, as on one GPU. Against one GPU in one run: TP=2 W1 355.3 tok/s (2.81 ms a
# token) and W2 17,870 tok/s against one GPU's 330.3 (3.03 ms) and 13,872: a token comes sooner
# on two GPUs, but W2 is 1.29 times one GPU's, not twice. With the fast all-reduce path,
# the row-parallel outputs written into its buffer and the prefill kernel compiled once (chapter 09):
# TP=2 W1 417.9 tok/s and W2 21,417, against one GPU's W2 15,058 in the same call (1.42 times).
# Rank 0's GPU in a decode step of 256 sequences (`kernels_lab/tp_step_profile.py`, before the
# staging change): 7.88 ms at TP=2 against 10.38 at TP=1; the attention and the GEMMs split
# (5.77 → 3.19 and 3.43 → 2.05 ms), the collectives add 1.33 ms, and the rest (sampling over the
# whole vocabulary on rank 0, the norms, the embedding) does not split. (When a worker is killed while steps
# overlap, rank 0 may find its pipe broken first; the requests fail with the dead worker's exit
# code, or, where none is found dead within the wait, naming the worker whose pipe broke.)
#
# **One engine at a time.** A worker keeps the runner (KV pool, graphs, mirrors) of the newest
# engine built on the model; an older engine's runner on rank 0 refuses to run a step.
#
# **Shutdown.** `close()` asks the workers to stop, destroys the graphs, leaves the group (the
# workers leave at the same time), then waits for the workers and terminates whatever is
# left. When the handle is garbage collected or the interpreter exits (`weakref.finalize`),
# the workers are terminated. The workers are daemonic, so they cannot outlive a rank 0 that
# exits normally, and a worker whose pipe breaks (rank 0 killed) exits.
#
# **Where a hang is.** With `FORGE_TP_STACKS=S` in the environment, every rank dumps its
# Python stacks (all threads) on `SIGUSR1`, and a worker dumps them by itself when one message
# (loading, building an engine, a step, leaving) takes more than `S` seconds.

# %%
#| export
class TensorParallelError(RuntimeError):
    "A worker process died (or a step failed midway): the tensor-parallel group cannot run any more steps."


STACKS_ENV = "FORGE_TP_STACKS"


def _stack_dump_seconds() -> float | None:
    "With FORGE_TP_STACKS=S: Python stacks on SIGUSR1 from now on, and S (None without it)."
    seconds = os.environ.get(STACKS_ENV)
    if not seconds or sys.__stderr__ is None:
        return None
    if hasattr(
        signal, "SIGUSR1"
    ):  # (the process's own stderr: a test runner may have swapped sys.stderr)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    return float(seconds)


@contextmanager
def _stacks_if_slower_than(seconds: float | None):
    "Dump every thread's stack (to stderr) every `seconds` while the block runs (nothing when None)."
    if seconds is None:
        yield
        return
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _stop_workers(processes, timeout: float = 10.0) -> None:
    "Terminate every worker still running and wait for it."
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()


def _abort_collectives(backend: str, wait_s: float = 30.0) -> None:
    """Make a collective that waits on a dead rank return (NCCL; gloo notices a closed socket by itself).
    The abort raises NCCL's abort flag at once, then reclaims the communicator; it runs on a helper
    thread so that a slow reclaim cannot hold up the caller past `wait_s`."""
    if backend != "nccl" or not dist.is_initialized():
        return

    def abort():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # best effort: the failure is already recorded
            pass

    helper = threading.Thread(target=abort, name="forge-tp-abort", daemon=True)
    helper.start()
    helper.join(wait_s)


class _Group:
    "What rank 0's handle, its watcher thread and its finalizer share (not the handle itself: it must stay collectable)."

    def __init__(self, processes, backend: str, fast: SymmMemAllReduce | None = None):
        self.processes, self.backend, self.fast = processes, backend, fast
        self.failure: str | None = None
        self.closing = False
        self.lock = threading.Lock()
        # one thread reaps at a time: a second waitpid on a child another thread is reaping finds none (ECHILD),
        # and `exitcode` then says None, so a report raced by the watcher lost the dead worker's exit code
        self.reaping = threading.Lock()
        self.graph_owners = (
            weakref.WeakSet()
        )  # rank 0's decode runners: their graphs hold NCCL collectives
        self.releaser: threading.Thread | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.closing:
            raise TensorParallelError("the tensor-parallel group is closed")

    def release_graphs(self) -> None:
        for runner in list(self.graph_owners):
            runner.release_graphs()

    def death_report(self, wait_s: float = 0.0) -> str | None:
        "Which worker died and how, waiting up to `wait_s` for a dying one to be reaped; None when all live."
        from multiprocessing.connection import wait

        ended = wait([p.sentinel for p in self.processes], timeout=wait_s)
        with self.reaping:
            for p in (
                self.processes
            ):  # an exiting worker's pipe closes a moment before it can be reaped: wait that out
                if p.sentinel in ended:
                    p.join()  # (or rank 0, failing at the same moment, names the socket, not it)
            dead = next((p for p in self.processes if p.exitcode is not None), None)
        return (
            None
            if dead is None
            else f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
        )

    def fail(self, why: str) -> None:
        "Record the first failure, then: graphs, abort, stop the workers (in that order: see above). Once."
        with self.lock:
            if self.failure is not None or self.closing:
                return
            self.failure = why
            if (
                self.fast is not None
            ):  # symmetric-memory kernels waiting for the dead rank: let them finish
                launched = threading.Event()
                self.releaser = threading.Thread(
                    target=self.fast.release_waiters,
                    args=(lambda: self.closing, launched),
                    name="forge-tp-release",
                    daemon=True,
                )
                self.releaser.start()
                launched.wait(
                    RELEASE_LAUNCH_WAIT_S
                )  # the release kernel queued before anything here may block launches
            self.release_graphs()
            _abort_collectives(self.backend)
            _stop_workers(self.processes)


def _watch_workers(group: _Group) -> None:
    while not group.closing:
        report = group.death_report(wait_s=0.5)
        if report is not None:
            group.fail(report)
            return


def _finalize_group(group: _Group) -> None:
    group.closing = True
    _stop_workers(group.processes)


class TensorParallel:
    "Rank 0's handle on the other ranks: sends them work, watches them, stops them."

    def __init__(self, model: ShardedTransformer, processes, pipes, backend: str):
        self.model, self.processes, self.pipes, self.backend = model, processes, pipes, backend
        self.world = model.plan.world
        self.all_reduce_path = (
            model.all_reduce.path
        )  # which path the model's all-reduces take, in words
        self.group = _Group(processes, backend, model.all_reduce.fast)
        self.engines = 0  # engines built: the workers keep the newest one's runner only
        self._watcher = threading.Thread(
            target=_watch_workers, args=(self.group,), name="forge-tp-watch", daemon=True
        )
        self._watcher.start()
        self._finalize = weakref.finalize(self, _finalize_group, self.group)

    def send(self, kind: str, payload=None) -> None:
        "Send one message to every worker."
        self.group.check()
        message = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe, process in zip(self.pipes, self.processes):
            try:
                pipe.send_bytes(message)
            except (
                OSError
            ) as e:  # (when no worker is found dead within _fail's wait, this names the one)
                self._fail(
                    f"tensor-parallel worker {process.name} (pid {process.pid}) is gone: its pipe broke "
                    f"({type(e).__name__}: {e})"
                )

    def _fail(self, why: str):
        "Record the failure (a dead worker's exit code when one died: the root cause), stop the rest, raise."
        # a killed GPU worker can take seconds to exit (its CUDA context is torn down): wait to name the cause
        self.group.fail(self.group.death_report(wait_s=10.0) or why)
        self.group.check()

    def _collective(self, kind: str, payload, work):
        "Run `work` here while the workers run the same message: collectives inside meet."
        self.send(kind, payload)
        try:
            return work()
        except Exception as e:
            try:
                self._fail(f"tensor-parallel {kind} failed on rank 0: {type(e).__name__}: {e}")
            except TensorParallelError as failure:
                raise failure from e

    def build_runner(self, config: EngineConfig) -> "ParallelRunner":
        "Every rank builds its KV pool and decode graphs; the number of blocks is the smallest any rank can hold."
        # (steps with prefill tokens stay eager here: chapter 09b's mixed-step graphs are not recorded across ranks)
        runner = self._collective(
            "engine",
            config,
            lambda: build_runner(self.model, config, _agree_min, mixed_graphs=False),
        )
        if runner.decode is not None:
            self.group.graph_owners.add(runner.decode)
        self.engines += 1
        return ParallelRunner(runner, self, self.engines)

    def time_collectives(self, batch: int, repeats: int = 20) -> dict[str, float]:
        "Seconds per decode step of its all-reduces and of its logits all-gather at `batch` sequences (see above)."
        p = next(self.model.parameters())
        args = (self.model.plan.config, self.world, batch, p.device, p.dtype, repeats)
        return self._collective(
            "time_collectives", args, lambda: time_collectives(*args, self.model.all_reduce)
        )

    def close(self) -> None:
        "Stop the workers, destroy the decode graphs, leave the process group (see Shutdown above)."
        if self._finalize.alive:
            with (
                self.group.lock
            ):  # a failure being handled finishes first; later ones are ours, not failures
                self.group.closing = True
            for pipe in self.pipes:
                try:
                    pipe.send_bytes(pickle.dumps(("stop", None)))
                except OSError:
                    pass
            self._watcher.join(5.0)
            if self.group.releaser is not None:
                self.group.releaser.join(5.0)
            self.group.release_graphs()
            if dist.is_initialized() and (self.group.failure is None or self.backend != "nccl"):
                dist.destroy_process_group()  # while the workers leave too (a failed NCCL group was aborted instead)
            for p in self.processes:
                p.join(15.0)  # a clean exit; whoever is still there is then terminated
            self._finalize()

    @property
    def alive(self) -> bool:
        return self._finalize.alive and self.group.failure is None


class ParallelRunner:
    "Rank 0's runner: sends each step (what changed since the last one) to the workers, then runs its own part of it."

    def __init__(self, runner: ModelRunner, parallel: TensorParallel, engine_number: int):
        self.inner, self.parallel, self.engine_number = runner, parallel, engine_number
        self.cache, self.decode, self.states = runner.cache, runner.decode, runner.states
        self.writer = StepWriter()
        self.step_ends: deque[torch.cuda.Event] = (
            deque()
        )  # the end of each launched step's GPU work, oldest first

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        return self.inner.greedy_tokens(logits)

    def run(self, plan, pending: PendingTokens | None = None) -> torch.Tensor:
        if self.engine_number != self.parallel.engines:
            raise TensorParallelError(
                "a newer engine was built on this tensor-parallel model: this one cannot run steps"
            )
        self.parallel.group.check()
        unread = pending.inputs_of(plan.scheduled) if pending is not None else None

        def step():
            if unread:
                broadcast_pending(
                    pending.token_ids[to_device(torch.tensor(unread[1]), pending.token_ids.device)]
                )
            return self.inner.run(plan, pending)

        logits = self.parallel._collective(
            "step", self.writer.encode(plan, unread[0] if unread else ()), step
        )
        if logits.is_cuda:  # no wait here: the engine samples while the GPU still runs this step
            self.step_ends.append(torch.cuda.Event())
            self.step_ends[-1].record(torch.cuda.current_stream(logits.device))
        self.parallel.group.check()
        return logits

    def check_step(self) -> None:
        """Raise if the group failed before the oldest unchecked step's GPU work ended (see *a step's GPU work* above).
        The engine calls it once it has that step's tokens, which came after it on the same stream: the wait is free."""
        if self.step_ends:
            self.step_ends.popleft().synchronize()
        self.parallel.group.check()


# %% [markdown]
# ## Starting the ranks
#
# Rank 0 opens a `TCPStore` on a free port, starts ranks 1..N-1 (spawned: a fresh
# interpreter, as CUDA requires), and all join one process group: NCCL on CUDA, gloo on the
# CPU. Rank `r` uses GPU `r`. Each rank then loads its slices at the same time.

# %%
#| export
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)  # startup, loading and one step at most


@dataclass(frozen=True)
class _WorkerSpec:
    resolved: ResolvedModel
    config: ModelConfig
    world: int
    device_type: str
    dtype: torch.dtype
    seed: int
    store_port: int


def _rank_device(device_type: str, rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _join_group(spec: _WorkerSpec, rank: int, store) -> None:
    dist.init_process_group(
        "nccl" if spec.device_type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=spec.world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _worker_main(rank: int, spec: _WorkerSpec, pipe) -> None:
    "Ranks 1..N-1: join, load this rank's slices, then run what rank 0 sends until it says stop."
    if spec.device_type == "cpu":  # the ranks share the CPU cores
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.world))
    slow = _stack_dump_seconds()
    device = _rank_device(spec.device_type, rank)
    runner, stopped = None, False
    try:
        with _stacks_if_slower_than(slow):
            _join_group(
                spec, rank, dist.TCPStore("127.0.0.1", spec.store_port, spec.world, is_master=False)
            )
            model = load_shard(
                spec.resolved,
                ShardPlan(spec.config, rank, spec.world),
                device,
                spec.dtype,
                spec.seed,
            )
            dist.barrier()  # loaded
            setup_all_reduce(model)
            if model.all_reduce.fast is not None:
                _exit_when_orphaned()
        while True:
            kind, payload = pickle.loads(
                pipe.recv_bytes()
            )  # EOFError when rank 0 is gone: we leave
            if kind == "stop":
                stopped = True
                break
            with torch.no_grad(), _stacks_if_slower_than(slow):
                if kind == "engine":
                    _release(runner)
                    runner = None  # free the previous engine's pool first
                    runner, reader = (
                        build_runner(model, payload, _agree_min, mixed_graphs=False),
                        StepReader(),
                    )
                elif kind == "step":
                    plan = reader.decode(payload)
                    runner.run(plan, received_pending(plan, device) if plan.unread else None)
                elif kind == "time_collectives":
                    time_collectives(*payload[:3], device, *payload[4:], model.all_reduce)
    finally:
        _release(runner)  # graphs first: NCCL will not destroy a communicator they still use
        if stopped:  # otherwise rank 0 is gone, or this rank failed: the other ranks cannot be met, just exit
            with _stacks_if_slower_than(slow):
                dist.destroy_process_group()


def _exit_when_orphaned() -> None:
    "A background thread that ends this worker when rank 0's process ends (its kernels may wait for rank 0 for ever)."
    import multiprocessing

    def watch(parent):
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        print(
            f"{multiprocessing.current_process().name}: rank 0 is gone; exiting",
            file=sys.__stderr__,
            flush=True,
        )
        os._exit(1)

    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=watch, args=(parent,), name="forge-tp-orphan", daemon=True).start()


def _release(runner: ModelRunner | None) -> None:
    if runner is not None and runner.decode is not None:
        runner.decode.release_graphs()


def load_model_parallel(
    name: str,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    world: int = 2,
) -> LoadedModel:
    """`load_model` (chapter 04a) split over `world` processes: start ranks 1..world-1, load rank 0's slices here,
    and return rank 0's model with the handle on the others."""
    import torch.multiprocessing as mp

    device = resolve_device(device)
    dtype, resolved = resolve_dtype(dtype, device), resolve(name)
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"tensor_parallel_size {world} needs {world} GPUs; torch sees {torch.cuda.device_count()}"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not {device.type!r}"
        )
    if dist.is_initialized():
        raise ValueError(
            "this process already belongs to a tensor-parallel group: close the other model first "
            "(loaded.parallel.close())"
        )
    all_reduce_choice()  # a bad FORGE_TP_ALL_REDUCE fails here, before any process starts
    config = model_config_of(resolved)
    plan = ShardPlan(config, 0, world)  # checks divisibility before any process starts
    stats, start = LoadStats(rss_before_bytes=rss_bytes()), time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    spec = _WorkerSpec(resolved, config, world, device.type, dtype, seed, store.port)
    ctx = mp.get_context("spawn")
    processes, pipes = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker_main, args=(rank, spec, ours), name=f"forge-tp-rank{rank}", daemon=True
        )
        p.start()
        ours.close()
        processes.append(p)
        pipes.append(theirs)
    _stack_dump_seconds()  # (workers time their messages; rank 0 only dumps on SIGUSR1)
    try:
        device = _rank_device(device.type, 0)
        _join_group(spec, 0, store)
        model = load_shard(resolved, plan, device, dtype, seed, stats=stats)
        dist.barrier()  # every rank has loaded
        setup_all_reduce(model)
    except BaseException:
        _stop_workers(processes)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    tokenizer = None
    if resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile

        tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(resolved.path).metadata)
    if resolved.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(resolved.tokenizer_path)
    finish_stats(stats, model, start, device)
    parallel = TensorParallel(model, processes, pipes, dist.get_backend())
    return LoadedModel(
        resolved.name, model, tokenizer, stats, parallel=parallel, metadata=describe_model(resolved)
    )


# %% [markdown]
# ## Two ranks on the CPU
#
# `random:llama-tiny` (6 query heads and 2 KV heads: 3 and 1 per rank; an untied LM head) in
# one process and over two (gloo). The engine, scheduler and sampler are the same objects;
# only the model and the runner underneath are split. Greedy tokens and their
# log-probabilities agree (the partial sums are added in a different order, so to fp32
# rounding, not bit for bit).

# %%
from forge_engine.engine import LLMEngine
from forge_engine.loader import load_model
from forge_engine.tensor_parallel.ranks import (
    load_model_parallel,
)  # the module's: spawned workers find their code there


def run_all(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


prompts = [[5, 6, 7], list(range(100, 130)), [9] * 11]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
small = dict(
    kv_cache_bytes=2**20, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, cuda_graphs=True
)
alone = run_all(
    LLMEngine(load_model("random:llama-tiny", "cpu", progress=False), EngineConfig(**small)),
    prompts,
    greedy,
)
split = load_model_parallel("random:llama-tiny", "cpu", world=2)
engine = LLMEngine(split, EngineConfig(**small, tensor_parallel_size=2))
together = run_all(engine, prompts, greedy)
for a, b in zip(alone, together):
    print(a.token_ids, "\n", b.token_ids)
    assert a.token_ids == b.token_ids
    # fp32: the ranks' partial sums added after: a few roundings of 2^-24 on logprobs up to ~11 (measured 9.5e-7)
    assert all(abs(x[t] - y[t]) < 1e-5 for x, y in zip(a.logprobs, b.logprobs) for t in x)
engine.allocator.check_idle()
print("all-reduces:", split.parallel.all_reduce_path)
assert split.parallel.all_reduce_path.startswith("torch.distributed (gloo)")
times = split.parallel.time_collectives(1)
print(
    f"gloo on this CPU, one decode step at batch 1: all-reduces {times['all_reduce_s'] * 1e3:.2f} ms, "
    f"logits all-gather {times['all_gather_s'] * 1e3:.2f} ms"
)
assert times["all_reduce_s"] > 0 and times["all_gather_s"] > 0

# %% [markdown]
# Closing stops the worker; nothing is left behind.

# %%
workers = split.parallel.processes
split.parallel.close()
assert workers and not any(p.is_alive() for p in workers)
print("worker exit codes:", [p.exitcode for p in workers])
assert not split.parallel.alive
