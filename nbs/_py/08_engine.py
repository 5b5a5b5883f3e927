# %% [markdown]
# # The engine
#
# > One step: schedule, run, sample, stop. `LLMEngine` owns the model, the paged KV cache and the scheduler.

# %% [markdown]
# The engine knows nothing about HTTP or terminals. It takes requests (token ids plus
# `SamplingParams`), and each call to `step()` does three things:
#
# 1. **schedule**: the scheduler (chapter 07) picks this step's sequences and token counts;
# 2. **run**: the model runner of chapter 07a flattens them into one batch over the paged KV
#    cache (chapter 05) and returns the logits of every sequence that is due a new token;
#    the batched sampler (chapter 06) picks the tokens;
# 3. **postprocess**: each new token goes through the stop rules and the text stream
#    (chapter 04); finished sequences give their blocks back at once.
#
# It returns a `RequestOutput` for every request that changed, with the text delta, so the
# same loop serves offline generation (`LLM.generate`, chapter 08b) and streaming (chapter 08a).
#
# An exception while running a step fails only the requests in that step, with the reason,
# and frees their blocks; the engine goes on serving the others.

# %%
#| default_exp engine

# %%
#| export
# Why one module of ~520 lines: it is one concept, the engine's step. `SerialEngine` is the step as
# taught (schedule, run, sample, stop); `LLMEngine` overlaps the next step's launch with the last
# one's tokens, as a subclass, so that the test "overlap equals serial" compares the two directly.
from __future__ import annotations

import gc
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from forge_engine.config import EngineConfig
from forge_engine.generate import SamplingParams, StructuredOutput, TextStream, finish_reason_for
from forge_engine.grammar import GrammarCompiler, GrammarError
from forge_engine.kv_cache import BlockAllocator, KVCacheStats
from forge_engine.loader import LoadedModel
from forge_engine.runner import PENDING, PendingTokens, build_runner
from forge_engine.sampling import SampleResult, SamplingBatch, SamplingRow, make_generator, sample
from forge_engine.scheduler import Scheduler, Sequence as Seq, StepPlan
from forge_engine.draft_model import DraftModel, PromptLookup
from forge_engine.speculative import SpeculationCounts, accepted_length, speculates

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.generate import generate_tokens
from forge_engine.model import empty_model, init_random_weights


# %% [markdown]
# ## What comes out
#
# One type for both uses: offline callers read the final `text`; streaming callers read
# `delta_text` of each output as it comes.

# %%
#| export
@dataclass
class RequestOutput:
    "A request's state after a step. `finish_reason`: stop, length, abort or error (then `error` says why)."

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class _Request:
    seq: Seq
    prompt: str | None
    text: TextStream | None
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    grammar: Any = None  # the matcher of a request under a structured output (chapter 06a)


# %% [markdown]
# ## Statistics: enough to draw the engine at work

# %%
#| export
@dataclass(frozen=True)
class StepRecord:
    "What one step did."

    index: int
    seconds: float
    prefill_tokens: int
    decode_seqs: int
    sampled: int
    preempted: int
    kv_used_blocks: int = (
        0  # blocks held by requests after the step: with `ended_at`, the KV usage over time
    )
    ended_at: float = 0.0  # time.perf_counter() at the end of the step


@dataclass(frozen=True)
class EngineStats:
    "A snapshot, safe to hand to another thread."

    running: int
    waiting: int
    kv: KVCacheStats
    block_map: str  # one character per block: '.' free, 'c' cached (free, reusable prefix), '1'-'9' references
    steps: int
    generated_tokens: int
    tokens_per_s: float  # generated tokens per second over the recent steps
    recent_steps: tuple[StepRecord, ...]
    speculation: SpeculationCounts = field(
        default_factory=SpeculationCounts
    )  # chapter 08c's drafts


# %% [markdown]
# ## The engine
#
# One step is the whole idea of a serving engine, in four parts:
#
# 1. **schedule**: the scheduler (chapter 07) picks the sequences that run and how many tokens
#    each brings (a prefill chunk, or one decode token), within the token budget and the free
#    KV blocks;
# 2. **run**: the runner (chapter 07a) runs the model over those tokens, writing their K and V
#    into the paged cache, and returns the logits of the rows that sample;
# 3. **sample**: one batched sampler call (chapter 06) turns the logits into one token per
#    sequence;
# 4. **postprocess**: each token takes its place in its sequence and meets the token rules (end
#    token, stop tokens, stop strings, `max_tokens`, the context), then becomes text and an
#    output.
#
# `SerialEngine.step` is exactly these four, in order. The rest of the class keeps the books of
# requests: adding one (refused with a clear error, nothing queued, when it cannot run),
# aborting one in any state, and reporting what each step did. A failure inside a step fails
# that step's requests only: the engine keeps serving the others.
#
# **Python's garbage collector.** Every so often CPython runs a full collection of its cyclic
# garbage collector, which walks every object that could hold a cycle: the model's modules, the
# tokenizer's tables, the engine's own. On an H200, one W1 decode step in every third run took
# 120-131 ms instead of 1.76 (`PYTHONPATH=. python3 kernels_lab/w1_run_spread.py cli int8`), and
# with the collector off no step took over 1.91 ms. So building an engine starts with a full
# collection and ends by *freezing* what is alive (`gc.freeze()`): those objects stay out of
# later collections, which then walk only what the requests made since. Process-wide, as the
# collector is: objects freed by reference counts are freed as before, but frozen garbage *in
# cycles* waits for the next `gc.unfreeze()`, which the next engine built (before it allocates
# anything) and the bench's `free_memory` call.

# %%
#| export
@dataclass
class _LaunchedStep:
    "A step queued on the device whose sampled tokens the host has not read yet."

    plan: StepPlan
    due: list[Seq]  # the sampling sequences, in row order; each ends in a PENDING placeholder
    result: SampleResult
    tokens: torch.Tensor  # on the host once `ready` has fired (a copy queued behind the sampler)
    ready: torch.cuda.Event | None

    @property
    def pending(self) -> PendingTokens:
        return PendingTokens(self.result.token_ids, {seq: row for row, seq in enumerate(self.due)})


# %%
#| export
class SerialEngine:
    """Requests in, `RequestOutput`s out, one `step()` at a time: schedule → run → sample → postprocess.
    Not thread-safe: one thread owns it."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        draft: LoadedModel | None = None,
    ):
        """`draft`: a smaller model with the same tokenizer that proposes the drafts (chapter 08d; needs
        `speculative_tokens`); without it, drafts come by prompt lookup."""
        gc.unfreeze()  # what an earlier engine froze (below) may be garbage by now: collected before this one allocates
        gc.collect()
        self.loaded, self.config = loaded, config or EngineConfig()
        self.device = next(loaded.model.parameters()).device
        world = loaded.parallel.world if loaded.parallel is not None else 1
        if self.config.tensor_parallel_size != world:
            raise ValueError(
                f"EngineConfig asks for tensor_parallel_size {self.config.tensor_parallel_size}, but the "
                f"model was loaded over {world} process(es): pass the same size to load_model"
            )
        # with tensor parallelism every rank builds the same runner over its own slice (chapter 09c)
        self.runner = (
            loaded.parallel.build_runner(self.config)
            if loaded.parallel is not None
            else build_runner(loaded.model, self.config)
        )
        self.cache = self.runner.cache
        num_blocks = self.cache.num_blocks - 1  # the last block is the decode graphs' scratch block
        states = (
            self.runner.states
        )  # recurrent layers' slots (chapter 05a): no prefix cache with them
        self.allocator = BlockAllocator(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching and states is None
        )
        self.max_model_len = (
            self.config.max_model_len or loaded.model.config.max_position_embeddings
        )
        self.scheduler = Scheduler(
            self.config,
            self.allocator,
            self.max_model_len,
            state_slots=0
            if states is None
            else states.num_slots - 1,  # (the last: the graphs' scratch slot)
        )
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.recent: deque[StepRecord] = deque(maxlen=256)
        self.steps = self.generated_tokens = 0
        self._grammars: GrammarCompiler | None = (
            None  # built on the first structured output (the tokenizer's bytes)
        )
        self._grammars_lock = threading.Lock()
        if self.config.speculative_tokens and world > 1:
            raise ValueError("speculative_tokens: not with tensor parallelism (yet)")
        if draft is not None and not self.config.speculative_tokens:
            raise ValueError("a draft model drafts speculative_tokens tokens: set it (> 0)")
        self.speculation = SpeculationCounts()
        self.proposer = (
            PromptLookup()
            if draft is None
            else DraftModel(draft, self.config, loaded.model.config.vocab_size)
        )
        # what is alive now (the model, the tokenizer's tables, the pools) leaves the cyclic collector's generations:
        # a full collection while decoding then scans only what decoding made (above)
        gc.freeze()

    # -- requests --
    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        "The prompt as a list of ints, or a ValueError naming what is wrong. Reads only constants: any thread may call it."
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.loaded.config.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.scheduler.check_prompt_len(len(ids))
        return ids

    def compile_grammar(self, structured: StructuredOutput):
        """A matcher for a structured output (chapter 06a), or a `GrammarError` saying what is wrong with it. Any
        thread may call it: a server compiles beside the engine's thread and hands the matcher to `add_request`."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.loaded.tokenizer is None:
                    raise GrammarError(
                        f"model {self.loaded.name!r} has no tokenizer: structured outputs need one"
                    )
                self._grammars = GrammarCompiler(
                    self.loaded.tokenizer, self.loaded.config.vocab_size, self.loaded.eos_token_ids
                )
        return self._grammars.compile(structured)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        grammar: Any = None,
    ) -> str:
        """Queue a request; refused with a clear error (nothing queued) when it cannot run. `grammar`: the matcher
        `compile_grammar` made of `params.structured` (compiled here when not given)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.check_prompt(prompt_token_ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured is not None and grammar is None:
            grammar = self.compile_grammar(params.structured)
        seq = Seq(request_id, ids, params, generator=make_generator(params, self.device))
        self.scheduler.add(seq)  # raises on a prompt that cannot fit, or a full queue
        tokenizer = self.loaded.tokenizer
        text = TextStream(tokenizer, params, ids) if tokenizer is not None else None
        self.requests[request_id] = _Request(
            seq,
            prompt,
            text,
            time.perf_counter(),
            logprobs=[] if params.logprobs is not None else None,
            grammar=grammar,
        )
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        "End a request in any state; its blocks are free when this returns."
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r}")
        request = self.requests[request_id]
        self.scheduler.finish(request.seq, "abort")
        return self._output(request, "", [])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def warm_up(self, prompt_len: int = 40, max_tokens: int = 4) -> float:
        """Run throwaway greedy requests (a prefill, then decode steps) so that the first real request does not
        wait for kernels to compile on first use: one of `prompt_len` tokens and, where steps with prefill tokens
        replay graphs up to a size (chapter 09b), one just longer, which runs eager. Afterwards the step counters,
        step records, speculation counts and prefix cache are as if they had never run. Needs an idle engine. Returns the seconds."""
        if self.requests:
            raise RuntimeError(
                f"warm_up needs an idle engine; {len(self.requests)} request(s) are in flight"
            )
        start, vocab = time.perf_counter(), self.loaded.config.vocab_size
        lengths, mixed = [prompt_len], getattr(self.runner, "mixed", None)
        if mixed is not None and mixed.buckets[-1] < self.config.max_num_batched_tokens:
            lengths.append(mixed.buckets[-1] + 1)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for k, n in enumerate(lengths):  # (other tokens each: no prefix is shared)
            n = max(1, min(n, self.max_model_len - max_tokens))
            self.add_request([1 + (i + k) % (vocab - 1) for i in range(n)], params, f"warm-up-{k}")
            while self.has_unfinished():
                self.step()
        self.allocator.reset_prefix_cache()
        self.recent.clear()
        self.steps = self.generated_tokens = 0
        self.speculation = SpeculationCounts()
        return time.perf_counter() - start

    # -- one step --
    def step(self) -> list[RequestOutput]:
        "Schedule, run the model, sample, apply the tokens: outputs for every request that changed."
        start = time.perf_counter()
        self._draft()
        plan, outputs = self._schedule(start)
        if not plan:
            return outputs
        try:
            launched = self._launch(plan)  # run + sample
        except Exception as e:  # fail the requests of this step only; the engine keeps serving
            return outputs + self._fail_step(plan, e)
        self._step_done(plan, launched)
        landed = self._land(launched)  # postprocess
        self._record(plan, sum(len(o.delta_token_ids) for o in landed), time.perf_counter() - start)
        return outputs + landed

    def _draft(self) -> None:
        """Each decoding sequence that `speculates` gets up to `speculative_tokens` drafts from the proposer (chapter
        08d: prompt lookup, or a draft model), within its max_tokens and the context; the others none."""
        k, wanted = self.config.speculative_tokens, []
        for seq in self.scheduler.running if k else ():
            seq.draft_ids = []
            if seq.is_decoding and speculates(seq.params, len(seq.output_ids)):
                room = min(
                    k,
                    seq.params.max_tokens - len(seq.output_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1,
                )
                if room > 0:
                    wanted.append((seq, room))
        for (seq, _), drafts in zip(wanted, self.proposer.propose(wanted) if wanted else []):
            seq.draft_ids = drafts  # (a draft model drafts for all of them at once)

    def _schedule(self, start: float) -> tuple[StepPlan, list[RequestOutput]]:
        "The next step's plan, and the outputs of the sequences the scheduler ended instead of running."
        plan = self.scheduler.schedule()
        for item in plan.scheduled:
            request = self.requests[item.seq.request_id]
            request.first_scheduled = request.first_scheduled or start
        return plan, [self._output(self.requests[s.request_id], "", []) for s in plan.finished]

    def _launch(self, plan: StepPlan, pending: PendingTokens | None = None) -> _LaunchedStep:
        "Queue the forward and the sampler; the tokens' copy to the host is queued behind them."
        return self._sample(plan, self.runner.run(plan, pending))

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> _LaunchedStep:
        "Queue the sampler behind the forward (the masks of rows under a grammar made meanwhile), then the copy."
        # a row of logits for each sampling sequence, and one more for each of its drafts (chapter 08c)
        due = [
            item.seq for item in plan.scheduled if item.samples for _ in range(1 + item.num_draft)
        ]
        rows = [SamplingRow(s.params, s.prompt_ids, s.output_ids, s.generator) for s in due]
        if due:  # (greedy: the decode graph's argmax, where it took one)
            batch = SamplingBatch.build(
                rows,
                logits.shape[-1],
                self.loaded.eos_token_ids,
                self.device,
                allowed=self._allowed_tokens(due),
            )
            result = sample(logits, batch, greedy=self.runner.greedy_tokens(logits))
        else:
            result = SampleResult(torch.empty(0, dtype=torch.long), None)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        tokens = result.token_ids.to(
            "cpu", non_blocking=True
        )  # into pinned memory: the host does not wait here
        if ready is not None:
            ready.record()
        return _LaunchedStep(plan, due, result, tokens, ready)

    def _allowed_tokens(self, due: list[Seq]):
        "The grammars' masks of the rows under one, or None (a sequence ended meanwhile is left unmasked)."
        rows = [
            (row, self.requests[s.request_id].grammar)
            for row, s in enumerate(due)
            if not s.finished and self.requests[s.request_id].grammar is not None
        ]
        if not rows:
            return None
        return self._grammars.allowed_tokens(
            [r for r, _ in rows], [g for _, g in rows], self.device
        )

    def _step_done(self, plan: StepPlan, launched: _LaunchedStep) -> None:
        "The step's tokens count as computed; each sampling sequence holds a place for its token."
        self.scheduler.step_done(
            plan
        )  # (before any token lands: newly full blocks hold real tokens only)
        drafting = {
            item.seq for item in plan.scheduled if item.num_draft
        }  # (they land in `_apply_verified`)
        for seq in dict.fromkeys(launched.due):
            if not seq.finished and seq not in drafting:
                seq.output_ids.append(PENDING)  # (ended meanwhile: its token will be dropped)

    def _land(self, launched: _LaunchedStep | None) -> list[RequestOutput]:
        "Read a launched step's tokens (waiting for the device if needed) and apply them: rules, text, outputs."
        if launched is None:
            return []
        try:
            if launched.ready is not None:
                launched.ready.synchronize()
            self.runner.check_step()  # (with tensor parallelism: did every rank finish the step?)
            tokens = launched.tokens.tolist()
        except Exception as e:  # the step failed on the device
            return [self._fail(seq, e) for seq in launched.due if not seq.finished]
        outputs, drafts, k = [], {i.seq: i.num_draft for i in launched.plan.scheduled}, 0
        while k < len(tokens):
            seq, rows = launched.due[k], 1 + drafts.get(launched.due[k], 0)
            k += rows
            if seq.finished:
                continue  # ended (stop, abort, error) after the step was launched: its token is dropped
            try:
                if rows > 1:
                    outputs.append(self._apply_verified(seq, tokens[k - rows : k]))
                    continue
                logprobs = (
                    launched.result.logprobs[k - 1]
                    if launched.result.logprobs is not None
                    else None
                )
                outputs.append(self._apply_token(seq, tokens[k - 1], logprobs))
            except Exception as e:
                outputs.append(self._fail(seq, e))
        return outputs

    def _apply_verified(self, seq: Seq, sampled: list[int]) -> RequestOutput:
        """A sequence's verify step (chapter 08c): `sampled` are the step's tokens (greedy or sampled) after its
        last token and after each draft. The drafts they agree with and the token after them are applied in order,
        until one ends the sequence; then the K/V of the inputs they follow count as computed. One output for all."""
        draft, seq.draft_ids = seq.draft_ids, []
        accepted = accepted_length(draft, sampled)
        self.speculation.proposed += len(draft)
        self.speculation.accepted += accepted
        self.speculation.verified += 1
        applied, deltas = [], []
        for token in sampled[: accepted + 1]:
            seq.output_ids.append(PENDING)
            out = self._apply_token(seq, token, None)
            applied.append(token)
            deltas.append(out.delta_text)
            if seq.finished:
                break
        if not seq.finished:
            self.scheduler.advance(seq, len(applied))
        return replace(out, delta_text="".join(deltas), delta_token_ids=applied)

    def _fail_step(self, plan: StepPlan, error: Exception) -> list[RequestOutput]:
        return [self._fail(item.seq, error) for item in plan.scheduled if not item.seq.finished]

    def _apply_token(
        self, seq: Seq, token: int, logprobs: dict[int, float] | None
    ) -> RequestOutput:
        "The sampled token in place of its placeholder, the token rules and stop strings, the text delta."
        request = self.requests[seq.request_id]
        seq.output_ids[-1] = token
        request.first_token = request.first_token or time.perf_counter()
        if logprobs is not None:
            request.logprobs.append(logprobs)
        reason = finish_reason_for(
            token, len(seq.output_ids), seq.params, self.loaded.eos_token_ids
        )
        # under a grammar (chapter 06a) the matcher follows each token; when it is done, so is the output
        if request.grammar is not None and reason is None:
            if not request.grammar.consume_token(token):
                raise GrammarError(
                    f"token {token} broke the grammar: {request.grammar.get_error()}"
                )
            if request.grammar.is_stopped():
                reason = "stop"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        delta = request.text.add(token) if request.text is not None else ""
        if reason is None and request.text is not None and request.text.stopped:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if request.text is not None:
                delta += request.text.finish()
        return self._output(request, delta, [token])

    def _fail(self, seq: Seq, error: Exception) -> RequestOutput:
        request = self.requests[seq.request_id]
        request.error = f"{type(error).__name__}: {error}"
        self.scheduler.finish(seq, "error")
        return self._output(request, "", [])

    def _output(self, request: _Request, delta: str, new_tokens: list[int]) -> RequestOutput:
        seq, now = request.seq, time.perf_counter()
        if seq.finished:
            del self.requests[seq.request_id]  # its last output: the engine forgets it
            self.proposer.forget(seq.request_id)  # (a draft model's copy of it)
        if seq.output_ids[-1:] == [PENDING]:
            seq.output_ids.pop()  # ended with a token in flight: it is dropped
        metrics = {"queue_s": (request.first_scheduled or now) - request.arrival}
        if request.first_token is not None:
            metrics["ttft_s"] = request.first_token - request.arrival
            metrics["e2e_s"] = now - request.arrival
            decode_s = now - request.first_token
            metrics["decode_tok_s"] = (len(seq.output_ids) - 1) / decode_s if decode_s > 0 else 0.0
        return RequestOutput(
            seq.request_id,
            request.prompt,
            seq.prompt_ids,
            request.text.text if request.text else "",
            list(seq.output_ids),
            seq.finished,
            seq.finish_reason,
            request.error,
            delta,
            new_tokens,
            list(request.logprobs) if request.logprobs is not None else None,
            seq.num_cached_prompt_tokens,
            metrics,
        )

    # -- statistics --
    def _record(self, plan: StepPlan, sampled: int, seconds: float):
        self.steps += 1
        self.generated_tokens += sampled
        decode = sum(
            1
            for i in plan.scheduled
            if i.num_new == 1 + i.num_draft and i.seq.num_computed > len(i.seq.prompt_ids)
        )
        prefill = plan.num_tokens - decode
        used = self.allocator.num_blocks - self.allocator.num_free_blocks
        self.recent.append(
            StepRecord(
                self.steps,
                seconds,
                prefill,
                decode,
                sampled,
                len(plan.preempted),
                used,
                time.perf_counter(),
            )
        )

    def block_map(self) -> str:
        "One character per KV block (chapter 05's `BlockAllocator.block_map`)."
        return self.allocator.block_map()

    def stats(self) -> EngineStats:
        window = list(self.recent)[-32:]
        seconds = sum(r.seconds for r in window)
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.allocator.stats(),
            self.block_map(),
            self.steps,
            self.generated_tokens,
            sum(r.sampled for r in window) / seconds if seconds else 0.0,
            tuple(self.recent),
            replace(self.speculation),
        )


# %% [markdown]
# ## Trying it on a tiny model
#
# A random tiny Qwen3 (no tokenizer needed: token ids in, token ids out). Three requests of
# different lengths run together; each gets exactly the tokens it gets alone through the
# plain contiguous loop of chapter 04.

# %%
def tiny_engine(name="qwen3-tiny", engine=SerialEngine, tokenizer=None, **config):
    model = init_random_weights(empty_model(preset(name)), seed=0, std=0.1)
    loaded = LoadedModel(name, model, tokenizer, None)
    return engine(
        loaded, EngineConfig(kv_cache_bytes=config.pop("kv_cache_bytes", 2**20), **config)
    )


def run_to_end(engine):
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


import weakref

probe = []
probe.append(
    probe
)  # a cycle alive before the engine is built: frozen with the rest, out of later collections
engine = tiny_engine(block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
assert not any(o is probe for o in gc.get_objects()) and gc.get_freeze_count() > 0


# frozen garbage in a cycle: a plain collection leaves it, the next engine built collects it first
class Probe:
    pass


cycle = Probe()
cycle.me, cycle_alive = cycle, weakref.ref(cycle)
gc.freeze()  # (as an engine built now would)
del probe, cycle
gc.collect()
assert cycle_alive() is not None
tiny_engine()
assert cycle_alive() is None
prompts = [[5, 6, 7], list(range(100, 140)), [9] * 11]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
for i, p in enumerate(prompts):
    engine.add_request(p, greedy, request_id=f"r{i}")
finals = run_to_end(engine)
for i, p in enumerate(prompts):
    alone = generate_tokens(engine.loaded.model, p, greedy).token_ids
    assert finals[f"r{i}"].token_ids == alone and finals[f"r{i}"].finish_reason == "length", i
engine.allocator.check_idle()
print(engine.stats().recent_steps[:4])
records = (
    engine.stats().recent_steps
)  # a time series: blocks held after each step, and when it ended
assert max(r.kv_used_blocks for r in records) > 0 and records[-1].kv_used_blocks == 0
assert all(a.ended_at < b.ended_at for a, b in zip(records, records[1:]))

# %% [markdown]
# A prefix-cache hit gives exactly the output of a miss, and counts as a hit:

# %%
shared = list(range(200, 232))  # 8 full blocks of 4
engine.add_request(shared + [1, 2], greedy, request_id="first")
first = run_to_end(engine)["first"]
engine.add_request(shared + [1, 2], greedy, request_id="again")
again = run_to_end(engine)["again"]
assert (
    again.token_ids == first.token_ids
    and again.num_cached_tokens == 32
    and first.num_cached_tokens == 0
)
assert engine.stats().kv.hit_tokens >= 32
engine.allocator.check_idle()

# %% [markdown]
# Abort in any state, and bad input refused before anything is queued:

# %%
engine.add_request([1, 2, 3], greedy, request_id="gone")
engine.step()
out = engine.abort("gone")
assert out.finished and out.finish_reason == "abort" and not engine.has_unfinished()
engine.allocator.check_idle()
with pytest.raises(ValueError, match="unknown request id 'gone'"):
    engine.abort("gone")
with pytest.raises(ValueError, match="outside the vocabulary"):
    engine.add_request([10**7])
pool_tokens = engine.allocator.num_blocks * 4
with pytest.raises(
    ValueError, match=f"prompt has {pool_tokens} tokens; the KV pool holds {pool_tokens} tokens"
):
    engine.add_request([1] * pool_tokens)
assert not engine.has_unfinished()

# %% [markdown]
# A failure inside a step fails only that step's requests; the next step serves the rest:

# %%
engine.add_request([3, 4, 5], greedy, request_id="doomed")
real_run = engine.runner.run
engine.runner.run = lambda plan, pending=None: (_ for _ in ()).throw(
    RuntimeError("simulated kernel failure")
)
[failed] = engine.step()
engine.runner.run = real_run
assert failed.finish_reason == "error" and "simulated kernel failure" in failed.error
engine.allocator.check_idle()
engine.add_request([3, 4, 5], greedy, request_id="after")
assert run_to_end(engine)["after"].finish_reason == "length"

# %% [markdown]
# `warm_up` runs a throwaway request before serving, so that the first real one does not wait while
# kernels compile on first use (on a fresh H200 the server's first request waited 1.7 s for its first
# token, the next ones ~36 ms: W3 in `docs/benchmarks.md`). Where steps with prompts replay graphs up
# to a size (chapter 09b, on a GPU), a second request just over that size runs the eager path once
# too. Afterwards the engine looks as if it never ran: no steps counted, no step records, nothing in
# the prefix cache; and what it then computes is what a fresh engine computes.

# %%
warm = tiny_engine(block_size=4)
assert warm.warm_up() > 0 and warm.steps == 0 and not warm.recent and warm.generated_tokens == 0
kv = warm.stats().kv
assert (kv.cached_blocks, kv.used_blocks, kv.hit_tokens, kv.query_tokens) == (0, 0, 0, 0)
warm.add_request(prompts[1], greedy, request_id="real")
assert run_to_end(warm)["real"].token_ids == finals["r1"].token_ids and warm.steps > 0
warm.add_request([1, 2, 3], greedy, request_id="busy")
with pytest.raises(RuntimeError, match="idle engine; 1 request"):
    warm.warm_up()

# with mixed-step graphs (here their static path, interpreted), a second request runs eager once
from forge_engine.cuda_graphs import MixedStepRunner

warm = tiny_engine(block_size=4, max_num_batched_tokens=128)
cache = warm.runner.cache
warm.runner.mixed = MixedStepRunner(
    warm.runner.model, cache, 8, 64, 256, cache.num_blocks - 1, "triton", use_graphs=False
)
seen = []
add = warm.add_request
warm.add_request = lambda ids, *args, **kw: (seen.append(len(ids)), add(ids, *args, **kw))[1]
warm.warm_up()
assert seen == [40, 65] and warm.steps == 0  # graphs up to 64 tokens: 65 runs eager


# %% [markdown]
# ## Overlapped steps
#
# A step has a device part (the forward and the sampler) and a host part (schedule, build the
# inputs, then for every sampled token: append it, detokenize, match stop strings, build the
# output). Run one after the other, the GPU waits for the host: on an H200 with Qwen3-4B at one
# sequence, launching a step takes the host 0.7 ms against the GPU's 3.0 ms. So on a GPU the
# engine **overlaps steps** (`async_scheduling`, on by default there): each `step()`
#
# 1. schedules step N+1 and queues it on the GPU behind step N. Step N's tokens are still on
#    the GPU: each is a `PENDING` placeholder on the host, and the runner copies it into step
#    N+1's inputs on the device (`PendingTokens`, chapter 07a);
# 2. **while the GPU runs**, reads step N's tokens (waiting only if step N is not done), puts
#    them in place of the placeholders and applies the token rules, text and outputs;
# 3. marks step N+1's tokens computed (registering the blocks they filled with the prefix
#    cache: after step 2, so a block is hashed with its real tokens).
#
# So a sequence that step N ended has one more token in flight in step N+1. That token is
# dropped when it lands, so what a request returns is exactly what it would be without the
# overlap; its blocks are freed at once (the GPU runs step N+1's writes before any later
# step's, so a block handed to another sequence is never overwritten behind its back).
# The host reads step N's tokens *before* scheduling when the next step needs them there: a
# sequence with a repetition, presence or frequency penalty (the sampler counts its output
# tokens) or one whose next token is surely its last (`max_tokens`, the context, the pool).
# A step with rows under a grammar (chapter 06a) reads step N's tokens a little later instead:
# after step N+1's forward is queued and before its sampler, because each grammar must consume
# its row's token before it can say what may follow. The masks are made on the host while the
# GPU runs the forward, so the sampler waits only for what the grammars take beyond it.
# With tensor parallelism (chapter 09c) rank 0 broadcasts the pending tokens to the other ranks
# on the GPU, so the ranks overlap too. On the CPU, where the forward runs on the calling thread
# anyway, `LLMEngine` steps serially unless asked (`async_scheduling=True`).
#
# `forge-engine bench w1 --model random:qwen3-4b --no-async-scheduling` against the same command
# without the flag measures what the overlap is worth on a GPU.

# %%
#| export
class LLMEngine(SerialEngine):
    """The engine the server, the bench and `LLM` use: `SerialEngine`'s step, but on a GPU (or when
    `async_scheduling` says so) each step is launched before the previous one's tokens are applied."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        draft: LoadedModel | None = None,
    ):
        super().__init__(loaded, config, draft)
        overlap = self.config.async_scheduling
        self.overlap = (
            self.device.type == "cuda" if overlap is None else overlap
        )  # the default: on GPUs
        if (
            self.config.speculative_tokens
        ):  # drafts need the last step's tokens on the host (chapter 08c)
            self.overlap = False
        self._launched: _LaunchedStep | None = (
            None  # the step whose tokens the host has not read yet
        )

    def step(self) -> list[RequestOutput]:
        "Schedule and launch a step, then apply the previous one's tokens while the device computes this one."
        if not self.overlap:
            return super().step()
        start = time.perf_counter()
        outputs = self._land(self._take_launched()) if self._must_land_first() else []
        plan, ended = self._schedule(start)
        outputs += ended
        if not plan:
            return outputs + self._land(self._take_launched())
        try:
            logits = self.runner.run(
                plan, self._launched.pending if self._launched is not None else None
            )
            if self._under_grammar(
                plan
            ):  # the masks need the previous tokens: read them while the device runs
                outputs += self._land(self._take_launched())
            launched = self._sample(plan, logits)
        except Exception as e:  # fail the requests of this step only; the engine keeps serving
            outputs += self._land(
                self._take_launched()
            )  # (which may already have ended some of them)
            return outputs + self._fail_step(plan, e)
        outputs += self._land(
            self._take_launched()
        )  # the previous step's tokens, while the device computes this one
        self._step_done(plan, launched)
        self._launched = launched
        self._record(plan, len(launched.due), time.perf_counter() - start)
        return outputs

    def _under_grammar(self, plan: StepPlan) -> bool:
        return any(
            item.samples and self.requests[item.seq.request_id].grammar is not None
            for item in plan.scheduled
        )

    def _take_launched(self) -> _LaunchedStep | None:
        launched, self._launched = self._launched, None
        return launched

    def _must_land_first(self) -> bool:
        "Whether the next schedule needs the launched step's tokens on the host (see above)."
        if self._launched is None:
            return False

        def needs_its_token(
            s: Seq,
        ) -> bool:  # the sampler counts its tokens, or the pending one is surely its last
            p = s.params
            return (
                p.repetition_penalty != 1.0
                or p.presence_penalty
                or p.frequency_penalty
                or len(s.output_ids) >= p.max_tokens
                or s.num_tokens >= self.max_model_len
                or self.scheduler.outgrows_pool(s)
            )

        return any(not s.finished and needs_its_token(s) for s in self._launched.due)


# %% [markdown]
# The bridge between the two: requests arriving between steps, with every sampling option that
# changes when the host must read a token (penalties, `max_tokens`, the context's end), give
# exactly the same tokens, reasons and log-probabilities overlapped as serial.

# %%
def run_arrivals(engine, arrivals):
    "Step the engine until idle, adding the requests of `arrivals[i]` before step i; the final outputs."
    finals, i = {}, 0
    while engine.has_unfinished() or i <= max(arrivals):
        for request_id, prompt, params in arrivals.get(i, []):
            engine.add_request(prompt, params, request_id)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = (out.token_ids, out.finish_reason, out.logprobs)
        i += 1
    engine.allocator.check_idle()
    return finals


mixed = {
    0: [
        ("greedy", [5, 6, 7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
        (
            "penalised",
            list(range(20, 31)),
            SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.3, ignore_eos=True),
        ),
    ],
    2: [
        (
            "sampled",
            [9] * 6,
            SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2, ignore_eos=True),
        )
    ],
    3: [
        (
            "to the context",
            list(range(40, 50)),
            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        )
    ],
}
serial = run_arrivals(tiny_engine(block_size=4, max_model_len=24), mixed)
overlapped_engine = tiny_engine(
    engine=LLMEngine, block_size=4, max_model_len=24, async_scheduling=True
)
assert type(overlapped_engine) is LLMEngine and overlapped_engine.overlap
assert run_arrivals(overlapped_engine, mixed) == serial and len(serial) == 4
assert serial["to the context"][1] == "length" and len(serial["to the context"][0]) == 24 - 10

# %% [markdown]
# Structured outputs (chapter 06a) through both steps: a random model under a JSON schema, and
# under a choice, beside a plain request. Every constrained output is a valid document that ends
# with `stop`, and overlapping changes no token. A grammar that does not compile is refused by
# `add_request` with nothing queued.

# %%
import json
import jsonschema
from forge_engine.grammar import GrammarError
from forge_engine.registry import fetch
from forge_engine.tokenizer import Tokenizer

qwen3 = Tokenizer.from_file(fetch("qwen3-tokenizer"))  # the tiny models share Qwen3's vocabulary
schema = {
    "type": "object",
    "required": ["answer", "score"],
    "additionalProperties": False,
    "properties": {
        "answer": {"type": "string", "maxLength": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
}
as_schema = StructuredOutput("json_schema", schema)
constrained = {
    0: [
        (
            f"json {i}",
            [5 + i, 6, 7],
            SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured=as_schema),
        )
        for i in range(3)
    ]
    + [("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))],
    2: [
        (
            "choice",
            [9, 9],
            SamplingParams(
                temperature=0,
                max_tokens=8,
                structured=StructuredOutput("choice", ["red", "green", "blue"]),
            ),
        )
    ],
}
serial = run_arrivals(tiny_engine(tokenizer=qwen3, block_size=4), constrained)
assert (
    run_arrivals(
        tiny_engine(engine=LLMEngine, tokenizer=qwen3, block_size=4, async_scheduling=True),
        constrained,
    )
    == serial
)
for request_id, (ids, reason, _) in serial.items():
    if request_id == "plain":
        continue  # (a random model: ids past the tokenizer's vocabulary too)
    text = qwen3.decode([t for t in ids if t not in qwen3.eos_token_ids])
    assert reason == "stop", (request_id, reason, text)
    if request_id.startswith("json"):
        jsonschema.validate(json.loads(text), schema)
    if request_id == "choice":
        assert text in ("red", "green", "blue"), text
print(text, [qwen3.decode(serial[f"json {i}"][0][:-1]) for i in range(3)])

refusing = tiny_engine(tokenizer=qwen3)
with pytest.raises(GrammarError, match="regex"):
    refusing.add_request([1, 2], SamplingParams(structured=StructuredOutput("regex", "[0-9")))
assert not refusing.has_unfinished() and not refusing.scheduler.waiting
with pytest.raises(GrammarError, match="no tokenizer"):
    tiny_engine().add_request([1, 2], SamplingParams(structured=as_schema))
