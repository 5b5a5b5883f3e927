# %% [markdown]
# # The engine thread
#
# > One thread owns the model; every other thread and event loop talks to it through an inbox and per-request outboxes.

# %% [markdown]
# A server handles many connections at once, but the model, the KV cache and the scheduler
# must only ever be touched by one thread. `AsyncEngine` runs an `LLMEngine` (chapter 08) on
# its own thread:
#
# - callers **submit** a request (checked at once in the caller's thread, so a bad one is
#   refused before anything is queued) and get its outputs through a *sink*: a callback the
#   engine thread calls with each `RequestOutput`;
# - `stream(...)` wraps that into an async iterator for an event loop
#   (`loop.call_soon_threadsafe` hands outputs over to the loop's thread: all of one step's
#   outputs for that loop in one call, so a step of 64 streams wakes the loop once, not 64
#   times); leaving the iteration early (a client disconnected) aborts the request;
# - **abort** puts a message in the inbox; the engine thread reads its inbox before every
#   step, so an aborted request's blocks are back within one step;
# - `stats()` is a snapshot the engine thread refreshes, safe to read from anywhere.
#
# If the engine thread itself dies, every open request gets an error output and later
# submissions are refused: nothing hangs.

# %%
#| default_exp async_engine

# %%
#| export
from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from forge_engine.engine import EngineStats, LLMEngine, RequestOutput
from forge_engine.generate import SamplingParams
from forge_engine.scheduler import QueueFullError

# %%
#| hide
import pytest
from forge_engine.config import EngineConfig, preset
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights


# %%
#| export
class EngineDeadError(RuntimeError):
    "The engine thread has stopped; no request can be served."


Sink = Callable[[RequestOutput], None]


class LoopSink:
    "A sink that puts outputs in an asyncio queue on its event loop's thread (`stream`'s)."

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    "An `LLMEngine` on its own thread. Thread-safe: submit, stream, abort and stats from anywhere."

    def __init__(self, engine: LLMEngine, stats_interval_s: float = 0.25):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # submitted and not yet finished; guarded by _lock
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}  # touched by the engine thread only
        self._stats, self._stats_interval, self._stats_time = engine.stats(), stats_interval_s, 0.0
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forge-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the caller's side --
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
        prompt: str | None = None,
        grammar: Any = None,
    ) -> str:
        """Queue a request whose outputs go to `sink` (called on the engine thread). Refuses bad requests at once.
        `grammar`: `engine.compile_grammar(params.structured)`, when the caller compiled it already."""
        if not self.alive:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        ids = self.engine.check_prompt(prompt_token_ids)
        # a structured output's grammar is compiled here, on the caller's thread, not the engine's (chapter 06a)
        if grammar is None and params.structured is not None:
            grammar = self.engine.compile_grammar(params.structured)
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            waiting = (
                len(self.engine.scheduler.waiting) + len(self._live) - len(self._sinks)
            )  # queued + not yet added
            if waiting >= self.engine.config.max_waiting:
                raise QueueFullError(
                    f"waiting queue is full ({waiting} of {self.engine.config.max_waiting} requests); "
                    f"try again later"
                )
            self._live.add(request_id)
        self._inbox.put(("add", request_id, ids, params, prompt, sink, grammar))
        return request_id

    def abort(self, request_id: str) -> None:
        "Abort a request in any state; its blocks are free within one engine step."
        with self._lock:
            if request_id not in self._live:
                raise ValueError(
                    f"unknown request id {request_id!r} (never submitted, or already finished)"
                )
        self._inbox.put(("abort", request_id))

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        grammar: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        "Outputs of one request as they come. Leaving the loop early aborts the request."
        loop, outbox = asyncio.get_running_loop(), asyncio.Queue()
        rid = self.submit(
            prompt_token_ids,
            params,
            LoopSink(loop, outbox),
            request_id,
            prompt,
            grammar,
        )
        finished = False
        try:
            while not finished:
                out = await outbox.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                try:
                    self.abort(rid)
                except ValueError:
                    pass  # it finished meanwhile

    def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, timeout: float | None = None
    ) -> RequestOutput:
        "Blocking: the final output of one request (from any thread)."
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt_token_ids, params, lambda out: out.finished and outbox.put(out))
        return outbox.get(timeout=timeout)

    def stats(self) -> EngineStats:
        return self._stats

    def close(self, timeout: float = 10.0) -> None:
        "Stop the engine thread; open requests end with an error."
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # -- the engine thread --
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._read_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver_step(self.engine.step())
                if (
                    time.monotonic() - self._stats_time >= self._stats_interval
                    or not self.engine.has_unfinished()
                ):
                    self._stats, self._stats_time = self.engine.stats(), time.monotonic()
            self._fail_all("the engine was closed")
        except BaseException as e:  # the engine itself broke: nobody may wait forever
            self.error = e
            self._fail_all(f"the engine stopped: {type(e).__name__}: {e}")

    def _read_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                self._handle(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, rid, ids, params, prompt, sink, grammar = message
            self._sinks[rid] = sink
            try:
                self.engine.add_request(ids, params, request_id=rid, prompt=prompt, grammar=grammar)
            except (ValueError, QueueFullError) as e:
                self._deliver(
                    RequestOutput(
                        rid,
                        prompt,
                        ids,
                        "",
                        [],
                        finished=True,
                        finish_reason="error",
                        error=f"{type(e).__name__}: {e}",
                    )
                )
        elif message[0] == "abort" and message[1] in self.engine.requests:
            self._deliver(self.engine.abort(message[1]))

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        "A step's outputs; those bound for one event loop go over in one call (one wake-up of that loop)."
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if isinstance(sink, LoopSink):
                self._forget(out)
                by_loop.setdefault(sink.loop, []).append((sink.queue, out))
            else:
                self._deliver(out)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # that loop is closed: nobody there waits any more
                pass

    def _forget(self, out: RequestOutput) -> None:
        "A finished request's sink and id go."
        if out.finished:
            self._sinks.pop(out.request_id, None)
            with self._lock:
                self._live.discard(out.request_id)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        self._forget(out)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:  # a broken consumer must not stop the engine
            pass

    def _fail_all(self, reason: str) -> None:
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
        for rid, sink in list(self._sinks.items()):
            self._deliver(
                RequestOutput(
                    rid, None, [], "", [], finished=True, finish_reason="error", error=reason
                )
            )


# %% [markdown]
# ## Streams from an event loop
#
# Eight concurrent streams on a tiny random model; half of them stop listening after their
# second output (a client that went away). The others finish, and soon after the last output
# the pool is idle: the abandoned requests gave their blocks back.

# %%
def tiny_async_engine(**options):
    model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
    config = EngineConfig(
        kv_cache_bytes=2**20, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, **options
    )
    return AsyncEngine(LLMEngine(LoadedModel("qwen3-tiny", model, None, None), config))


engine = tiny_async_engine()
params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


async def consume(i, leave_early):
    got = []
    async for out in engine.stream([i + 1, i + 2, i + 3], params):
        got.append(out)
        if leave_early and len(got) == 2:
            break
    return got


async def many():
    return await asyncio.gather(*(consume(i, leave_early=i % 2 == 1) for i in range(8)))


results = asyncio.run(many())
for i, got in enumerate(results):
    if i % 2:
        assert len(got) == 2 and not got[-1].finished
    else:
        assert got[-1].finished and len(got[-1].token_ids) == 20

deadline = time.monotonic() + 5
while engine.engine.has_unfinished() and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # let the engine thread refresh its snapshot
stats = engine.stats()
assert stats.running == 0 and stats.waiting == 0 and stats.kv.used_blocks == 0, stats
engine.engine.allocator.check_idle()


# %% [markdown]
# One step's outputs for one event loop cross over in one call: counting the calls while eight
# streams decode together, there are about as many as steps, not eight times as many.

# %%
async def count_handovers():
    loop, calls = asyncio.get_running_loop(), 0
    threadsafe = loop.call_soon_threadsafe

    def counted(*args):
        nonlocal calls
        calls += 1
        return threadsafe(*args)

    loop.call_soon_threadsafe = counted
    steps = engine.engine.steps
    outs = await asyncio.gather(*(consume(i, leave_early=False) for i in range(8)))
    return calls, engine.engine.steps - steps, outs


calls, steps, outs = asyncio.run(count_handovers())
assert all(o[-1].finished for o in outs) and calls <= steps + 8, (calls, steps)

# %% [markdown]
# The same request gives the same tokens whether it runs alone or among others, and
# blocking callers on other threads work too:

# %%
alone = engine.generate([1, 2, 3], params)
assert alone.token_ids == results[0][-1].token_ids
outs = {}
threads = [
    threading.Thread(
        target=lambda i=i: outs.__setitem__(i, engine.generate([i + 1, i + 2, i + 3], params))
    )
    for i in range(6)
]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert outs[0].token_ids == alone.token_ids and all(
    o.finish_reason == "length" for o in outs.values()
)

# %% [markdown]
# Bad input is refused in the caller's thread; an unknown id cannot be aborted:

# %%
with pytest.raises(ValueError, match="KV pool holds"):
    engine.submit([1] * (engine.engine.allocator.num_blocks * 4 + 5), params, print)
with pytest.raises(ValueError, match="context holds 4096"):
    engine.submit([1] * 5000, params, print)
with pytest.raises(ValueError, match="unknown request id 'nope'"):
    engine.abort("nope")


# %% [markdown]
# If the engine thread dies, open requests get an error and new ones are refused, at once:

# %%
def broken_step():
    raise SystemError("the GPU fell off the bus")


engine.engine.step = broken_step
final = engine.generate([1, 2, 3], params, timeout=10)
assert final.finish_reason == "error" and "fell off the bus" in final.error
assert not engine.alive
with pytest.raises(EngineDeadError):
    engine.submit([1, 2], params, print)
