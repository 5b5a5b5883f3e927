# %% [markdown]
# # Load client
#
# > Many users at once: requests arriving at random times against an OpenAI-compatible server, and the latencies each one saw.

# %% [markdown]
# Chapter 13 times the engine from inside. A server is judged from outside, by its clients:
# how long until the first word appears, how smoothly the rest follows, how many requests a
# second it keeps up with. This chapter is that client, for workload **W3** of the
# performance guide: the streaming OpenAI endpoint under Poisson arrivals, the method of
# vLLM's `bench serve`. It speaks only the OpenAI wire format (chapter 12a), so it measures
# any compatible server the same way:
#
# ```
# forge-engine bench serve --url http://127.0.0.1:8000 --rate 4 --num-prompts 200 --ignore-eos --json w3.json
# forge-engine bench serve --url http://127.0.0.1:8000 --rate inf --num-prompts 200   # saturation
# forge-engine bench serve --url http://127.0.0.1:8000 --trace requests.jsonl         # replay a trace
# ```

# %%
#| default_exp load_client

# %%
#| export
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator

from forge_engine.chat import API_KEY_ENV, Reply, api_base, api_headers
from forge_engine.chat_wire import ChatError, SSEDecoder, error_text, parse_chunk, request_body

# %%
#| hide
import subprocess
import tempfile

import pytest


# %% [markdown]
# ## The workload: what to send, and when
#
# A request of the workload says when it leaves (seconds after the start), what it asks and
# how many tokens it may get back. Two ways to make a workload:
#
# - **synthetic**: `num_prompts` prompts of random words, sent at `rate` requests per second
#   on average. The gaps between sends are drawn from a gamma distribution with mean
#   `1 / rate`; with `burstiness = 1` that is the exponential distribution, i.e. a Poisson
#   process: arrivals that do not know about each other, like independent users. Burstiness
#   below 1 clusters the arrivals, above 1 evens them out. `rate = inf` sends everything at
#   once: the server's saturation throughput.
# - **trace replay**: a JSONL file, one request a line, with its `timestamp` (seconds) and its
#   `prompt` (or chat `messages`), optionally `max_tokens`. The timestamps are replayed as
#   they are, shifted so the first request leaves at 0.

# %%
#| export
@dataclass(frozen=True)
class WorkloadRequest:
    "One request of a workload: when it leaves (seconds after the start), what it asks, how many tokens it may get."

    send_at: float
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 128


def arrival_times(count: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    "Send times of `count` requests at `rate` per second: gamma gaps of mean 1/rate (burstiness 1: Poisson); inf: all at 0."
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name"
).split()


def random_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    "Prompts of `words` random common words each: distinct from the first word on, so no two share a cached prefix."
    if words < 1:
        raise ValueError(f"prompt length must be >= 1 word, got {words}")
    rng = random.Random(seed)
    return [
        f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(count)
    ]


def synthetic_workload(
    count: int,
    rate: float,
    words: int = 64,
    max_tokens: int = 128,
    seed: int = 0,
    burstiness: float = 1.0,
) -> list[WorkloadRequest]:
    times = arrival_times(count, rate, seed, burstiness)
    return [
        WorkloadRequest(t, prompt=p, max_tokens=max_tokens)
        for t, p in zip(times, random_prompts(count, words, seed))
    ]


# %%
times = arrival_times(4000, rate=8.0, seed=1)
gaps = [b - a for a, b in zip(times, times[1:])]
# mean gap 1/rate: 3,999 exponential gaps, a standard error of 0.125 / sqrt(3999) = 0.002; 0.01 is five of them
assert times[0] == 0 and all(g >= 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01
cv = (sum((g - 1 / 8) ** 2 for g in gaps) / len(gaps)) ** 0.5 * 8
assert (
    0.9 < cv < 1.1
)  # exponential gaps: spread equal to the mean (standard error sqrt(8 / (4 x 3999)) = 0.022)
bursty = arrival_times(
    4000, 8.0, seed=1, burstiness=0.25
)  # gamma gaps of shape 1/4: sd 0.25, the mean's 0.004
assert abs(bursty[-1] / 3999 - 1 / 8) < 0.02 and max(
    b - a for a, b in zip(bursty, bursty[1:])
) > max(gaps)
assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0] and arrival_times(
    5, 2.0, seed=7
) == arrival_times(5, 2.0, seed=7)
with pytest.raises(ValueError, match="rate must be > 0"):
    arrival_times(3, 0)
prompts = random_prompts(3, words=5, seed=0)
assert len(set(prompts)) == 3 and all(len(p.split(": ", 1)[1].split()) == 5 for p in prompts)


# %%
#| export
def read_trace(path: str, default_max_tokens: int = 128) -> list[WorkloadRequest]:
    "A JSONL trace: one request a line, `timestamp` (s), `prompt` or `messages`, optional `max_tokens`."
    requests = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamp = float(row["timestamp"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{n}: a trace line needs a JSON object with a numeric 'timestamp' ({e})"
                ) from None
            if ("prompt" in row) == ("messages" in row):
                raise ValueError(f"{path}:{n}: give either 'prompt' or 'messages'")
            max_tokens = row.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(
                    f"{path}:{n}: max_tokens must be an integer >= 1, got {max_tokens!r}"
                )
            requests.append(
                WorkloadRequest(stamp, row.get("prompt"), row.get("messages"), max_tokens)
            )
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    first = min(r.send_at for r in requests)
    return sorted(
        (WorkloadRequest(r.send_at - first, r.prompt, r.messages, r.max_tokens) for r in requests),
        key=lambda r: r.send_at,
    )


# %%
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "trace.jsonl")
    with open(path, "w") as f:
        f.write(
            '{"timestamp": 101.5, "prompt": "second", "max_tokens": 4}\n\n'
            '{"timestamp": 100.0, "messages": [{"role": "user", "content": "first"}]}\n'
        )
    trace = read_trace(path, default_max_tokens=9)
    assert [(r.send_at, r.max_tokens) for r in trace] == [(0.0, 9), (1.5, 4)] and trace[0].messages[
        0
    ]["content"] == "first"
    with open(path, "w") as f:
        f.write('{"prompt": "no time"}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: .*numeric 'timestamp'"):
        read_trace(path)
    with open(path, "w") as f:
        f.write('{"timestamp": 0, "prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        read_trace(path)


# %% [markdown]
# ## One request, timed from outside
#
# Each request is one streaming POST. The client notes the time each text chunk arrives
# (chapter 12's `Reply`), and asks for the token count in a final usage chunk
# (`stream_options.include_usage`); a server that ignores the option gets its tokens counted
# as text chunks instead. A request *fails* when the server refuses it, the connection
# cannot be made or breaks, or the stream ends without a `finish_reason`; the reason is kept.
# A failure never stops the run.

# %%
#| export
async def sse_data_async(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    "The async twin of `chat_wire.sse_data`: each event's data up to `[DONE]`."
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data == "[DONE]":
            return
        if data is not None:
            yield data
    if (data := decoder.flush()) not in (None, "[DONE]"):
        yield data


async def send_request(client, url: str, body: dict) -> Reply:
    "POST one streaming request; the `Reply` with its timings, or with `error` set. Never raises for a failed request."
    import httpx

    reply = Reply()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise ChatError(f"HTTP {response.status_code}: {error_text(response.text)}")
            async for data in sse_data_async(response.aiter_lines()):
                reply.take(parse_chunk(data))
        reply.finish_stream()
    except ChatError as e:
        reply.error = str(e)
    except httpx.HTTPError as e:
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, httpx.ConnectError):
            reply.error = f"cannot reach the server: {what}"
        elif isinstance(e, httpx.TimeoutException):
            reply.error = f"timed out: {what}"
        else:
            reply.error = f"the connection broke: {what}"
    reply.end()
    return reply


# %% [markdown]
# ## Running a workload
#
# Every request gets its own task that sleeps until its send time and then streams. The
# clock starts when the first request leaves and stops when the last one ends. With
# `max_concurrency` set, at most that many requests are in flight (a request whose time
# has come waits for a free slot); unset, the arrivals alone decide. The HTTP connection pool
# is made big enough that the pool itself never queues a request.

# %%
#| export
@dataclass
class LoadResult:
    "What a run produced: one `Reply` per workload request (same order) and the wall time of the run."

    requests: list[WorkloadRequest]
    replies: list[Reply]
    duration_s: float
    model: str | None


async def server_model(client, base: str) -> str:
    "The server's first model (`GET /v1/models`)."
    import httpx

    try:
        response = await client.get(base + "/models")
    except httpx.HTTPError as e:
        raise ChatError(f"cannot reach the server at {base}: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        raise ChatError(
            f"GET {base}/models: HTTP {response.status_code}: {error_text(response.text)}"
        )
    models = [m["id"] for m in response.json().get("data", [])]
    if not models:
        raise ChatError(f"the server at {base} lists no models")
    return models[0]


async def run_workload(
    url: str,
    workload: list[WorkloadRequest],
    params,
    model: str | None = None,
    api_key: str | None = None,
    endpoint: str = "chat",
    max_concurrency: int | None = None,
    timeout: float = 600.0,
) -> LoadResult:
    "Send every request of `workload` at its time to the server at `url`; every reply, timed."
    import httpx

    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be chat or completions, got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    base = api_base(url)
    path = base + ("/chat/completions" if endpoint == "chat" else "/completions")
    bodies = [
        _body(r, params, endpoint) for r in workload
    ]  # bad requests fail here, before anything is sent
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    async with httpx.AsyncClient(
        headers=api_headers(api_key), limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)
    ) as client:
        try:
            model = model or await server_model(client, base)
        except ChatError as e:  # nothing can be sent: every request failed for this reason
            return LoadResult(workload, [Reply(error=str(e)) for _ in workload], 0.0, None)
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
        start = time.perf_counter()

        async def one(request: WorkloadRequest, body: dict) -> Reply:
            await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
            async with slots:
                return await send_request(client, path, {**body, "model": model})

        replies = await asyncio.gather(*(one(r, b) for r, b in zip(workload, bodies)))
        return LoadResult(workload, list(replies), time.perf_counter() - start, model)


def _body(request: WorkloadRequest, params, endpoint: str) -> dict:
    if endpoint == "completions":
        if request.prompt is None:
            raise ValueError("a chat request (messages) cannot go to the completions endpoint")
        body = request_body(params, "", prompt=request.prompt)
    else:
        messages = request.messages or [{"role": "user", "content": request.prompt}]
        body = request_body(params, "", messages=messages)
    return {**body, "max_tokens": request.max_tokens}


# %% [markdown]
# ## The figures
#
# Per request, as chapter 12 defines them: TTFT, TPOT `= (E2E - TTFT) / (tokens - 1)` (only
# for replies of at least two tokens), E2E; ITL is one value per gap between chunks, pooled
# over all requests. Each is summarised by its mean, median (p50) and 99th percentile, in
# milliseconds, over the successful requests. Throughput divides by the run's wall time:
# completed requests per second, and output tokens per second. Failed requests count
# separately, grouped by reason.

# %%
#| export
def percentile(values: list[float], q: float) -> float:
    "The q-th percentile, interpolating linearly between the two nearest ranks."
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def describe_ms(seconds: list[float]) -> dict | None:
    "mean, p50 and p99 of durations in milliseconds (None for no values)."
    if not seconds:
        return None
    ms = [s * 1000 for s in seconds]
    return {
        "mean": sum(ms) / len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "count": len(ms),
    }


def summarize(result: LoadResult) -> dict:
    "The W3 figures of a run: latencies over successful requests, throughputs, failures by reason."
    ok = [r for r in result.replies if r.error is None]
    output_tokens = sum(r.num_tokens for r in ok)
    prompt_tokens = [
        r.usage.get("prompt_tokens") if r.usage else None for r in ok
    ]  # known only from usage
    seconds = result.duration_s
    return {
        "completed": len(ok),
        "failed": len(result.replies) - len(ok),
        "duration_s": seconds,
        "request_throughput": len(ok) / seconds if seconds else 0.0,
        "output_throughput": output_tokens / seconds if seconds else 0.0,
        "total_output_tokens": output_tokens,
        "total_input_tokens": sum(prompt_tokens) if ok and None not in prompt_tokens else None,
        "ttft_ms": describe_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": describe_ms([r.e2e_s for r in ok]),
        "failures": dict(
            Counter(r.error for r in result.replies if r.error is not None).most_common()
        ),
    }


def request_records(result: LoadResult) -> list[dict]:
    "Per-request figures, for a detailed results file."
    return [
        {
            "send_at_s": q.send_at,
            "ok": r.error is None,
            "error": r.error,
            "finish_reason": r.finish_reason,
            "output_tokens": r.num_tokens,
            "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s,
            "tpot_s": r.tpot_s,
            "itl_s": r.itl_s,
        }
        for q, r in zip(result.requests, result.replies)
    ]


# %%
# (approx: 0.99 x 10 in float64, a rounding of ~1e-16 relative)
assert (
    percentile([1, 2, 3, 4], 50) == 2.5
    and percentile([5], 99) == 5
    and percentile([0, 10], 99) == pytest.approx(9.9, rel=1e-12)
)
with pytest.raises(ValueError):
    percentile([], 50)


def fake_reply(ttft, gaps, tokens=None, error=None):
    r = Reply(start=0.0, error=error)
    r.piece_times = [ttft] + [ttft + sum(gaps[: i + 1]) for i in range(len(gaps))]
    r.pieces_tokens, r.e2e_s, r.finish_reason = (
        len(r.piece_times),
        r.piece_times[-1] + 0.001,
        "length",
    )
    if tokens:
        r.usage = {"prompt_tokens": 10, "completion_tokens": tokens}
    return r


fake = LoadResult(
    [WorkloadRequest(0.0)] * 3,
    [
        fake_reply(0.1, [0.02, 0.02, 0.02], tokens=4),
        fake_reply(0.3, [0.04]),
        fake_reply(0, [], error="HTTP 503: busy"),
    ],
    duration_s=2.0,
    model="m",
)
s = summarize(fake)
assert (s["completed"], s["failed"], s["failures"]) == (2, 1, {"HTTP 503: busy": 1})
assert (
    s["total_output_tokens"] == 6
    and s["output_throughput"] == 3.0
    and s["request_throughput"] == 1.0
)
# (approx: a few float64 roundings of the times, ~1e-15 relative)
assert s["ttft_ms"]["mean"] == pytest.approx(200, rel=1e-12) and s["itl_ms"]["count"] == 4
assert s["itl_ms"]["p50"] == pytest.approx(20, rel=1e-12)
tpots = [
    (0.161 - 0.1) / 3 * 1000,
    (0.341 - 0.3) / 1 * 1000,
]  # (E2E - TTFT) / (tokens - 1), usage says 4 tokens
assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["p99"] == pytest.approx(
    tpots[0] + 0.99 * (tpots[1] - tpots[0]), rel=1e-12
)
assert s["total_input_tokens"] is None  # one reply came without usage
assert len(request_records(fake)) == 3 and request_records(fake)[2]["error"] == "HTTP 503: busy"


# %% [markdown]
# ## From the command line: `forge-engine bench serve`

# %%
#| export
def add_arguments(parser: argparse.ArgumentParser) -> None:
    "Flags of `forge-engine bench serve`."
    parser.add_argument(
        "--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)"
    )
    parser.add_argument(
        "--endpoint",
        default="chat",
        choices=["chat", "completions"],
        help="/v1/chat/completions (default) or /v1/completions",
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument("--api-key", default=None, help=f"Bearer key (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="requests per second on average, or inf (default)",
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson"
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--prompt-words", type=int, default=64, help="words per random prompt")
    parser.add_argument(
        "--trace",
        default=None,
        help="replay this JSONL trace (timestamp, prompt|messages, max_tokens)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens per reply (trace lines may say otherwise)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM's extension)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--detailed", action="store_true", help="include every request's figures in the results"
    )


def run(args: argparse.Namespace) -> int:
    "`forge-engine bench serve`: results as JSON on stdout (and in --json); 0 if every request succeeded, 1 if some failed, 2 on bad input."
    from forge_engine.generate import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
        )
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if args.trace:
            workload = read_trace(args.trace, args.max_tokens)
        else:
            workload = synthetic_workload(
                args.num_prompts,
                args.rate,
                args.prompt_words,
                args.max_tokens,
                args.seed,
                args.burstiness,
            )
        result = asyncio.run(
            run_workload(
                args.url,
                workload,
                params,
                args.model,
                args.api_key or os.environ.get(API_KEY_ENV),
                args.endpoint,
                args.max_concurrency,
                args.timeout,
            )
        )
    except (ValueError, OSError) as e:
        print(f"forge-engine: error: {e}", file=sys.stderr)
        return 2
    config = {
        "workload": "w3",
        "url": args.url,
        "endpoint": args.endpoint,
        "model": result.model,
        "rate": None if args.trace else "inf" if math.isinf(args.rate) else args.rate,
        "burstiness": args.burstiness,
        "num_prompts": len(workload),
        "trace": args.trace,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "max_concurrency": args.max_concurrency,
    }
    results = {**config, **summarize(result)}
    if args.detailed:
        results["requests"] = request_records(result)
    print(summary_table(results), file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if results["failed"] == 0 else 1


def summary_table(results: dict) -> str:
    "The figures a person reads first."
    lines = [
        f"{results['completed']} completed, {results['failed']} failed in {results['duration_s']:.2f} s: "
        f"{results['request_throughput']:.2f} req/s, {results['output_throughput']:.1f} output tok/s"
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = results[f"{name}_ms"]
        if d:
            lines.append(
                f"{name.upper():>5} ms  mean {d['mean']:9.1f}  p50 {d['p50']:9.1f}  p99 {d['p99']:9.1f}"
            )
    lines += [f"  failed ({n}x): {reason}" for reason, n in results["failures"].items()]
    return "\n".join(lines)


# %%
args = argparse.ArgumentParser()
add_arguments(args)
args = args.parse_args(["--url", "http://127.0.0.1:8000", "--rate", "inf", "--ignore-eos"])
assert (
    math.isinf(args.rate)
    and args.endpoint == "chat"
    and args.num_prompts == 100
    and args.model is None
)

# %% [markdown]
# ## A short run against our server
#
# The server of chapter 11 with the tiny random Qwen3, on a free loopback port in this
# process. 24 requests of 16 tokens each (`ignore_eos`, so every reply has exactly 16), once
# at 6 requests per second and once all at once. In a notebook the event loop is already
# running, so we `await` the workload instead of `asyncio.run`.

# %%
from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.server.app import create_app
from forge_engine.server.serve import ServerThread

engine = AsyncEngine(
    LLMEngine(
        load_model("random:qwen3-tiny", "cpu", progress=False), EngineConfig(kv_cache_bytes=2**23)
    )
)
server = ServerThread(create_app(engine, "qwen3-tiny"))
url = server.__enter__()
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
runs = {}
for rate in (6.0, math.inf):
    workload = synthetic_workload(24, rate, words=32, max_tokens=16, seed=0)
    runs[rate] = await run_workload(url, workload, params)
    print(f"rate {rate}:\n{summary_table(summarize(runs[rate]))}\n")

# %%
for rate, result in runs.items():
    s = summarize(result)
    assert s["completed"] == 24 and s["failed"] == 0 and s["total_output_tokens"] == 24 * 16
    assert all(r.ttft_s <= r.e2e_s and len(r.piece_times) >= 1 for r in result.replies)
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["ttft_ms"]["mean"] < s["e2e_ms"]["mean"]
engine.engine.allocator.check_idle()

# %% [markdown]
# What the figures look like. At a modest rate most requests find the engine almost free:
# the first token comes after one prefill step, and each later token after one decode step
# of a small batch. All at once, every request waits for the prefills queued before it, so
# TTFT grows; each step now carries the whole batch, which on a CPU makes every step (the
# ITL) slower too, while the output tokens per second of the server as a whole go up. That
# is the trade a serving engine makes, and what W3's rates 1, 4, 16 and saturation map out.

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
for rate, result in runs.items():
    ok = [r for r in result.replies if r.error is None]
    label = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
    axes[0].hist([r.ttft_s * 1000 for r in ok], bins=20, alpha=0.6, label=label)
    axes[1].hist([gap * 1000 for r in ok for gap in r.itl_s], bins=30, alpha=0.6, label=label)
axes[0].set(title="time to first token", xlabel="ms", ylabel="requests")
axes[1].set(title="inter-token latency", xlabel="ms", ylabel="gaps")
axes[0].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# A request that cannot be served is a failure with its reason, not a crash of the run:

# %%
bad = await run_workload(
    url, synthetic_workload(2, math.inf, max_tokens=10**6), params, model="qwen3-tiny"
)
s = summarize(bad)
print(s["failures"])
assert s["failed"] == 2 and "HTTP 400" in next(iter(s["failures"]))
server.__exit__(None, None, None)
engine.close()
