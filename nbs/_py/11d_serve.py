# %% [markdown]
# # Serving
#
# > `forge-engine serve`: uvicorn around the app, the model loaded while `/health` already answers; and a real server with a real stream, backpressure and cancellation.

# %%
#| default_exp server.serve

# %%
#| export
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from typing import Sequence

import uvicorn
from fastapi import FastAPI

from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.llm import load_model_over
from forge_engine.loader import (
    add_memory_budget_flag,
    add_quantization_flag,
    load_model,
    pick_model,
)
from forge_engine.server.app import ServerState, create_app

logger = logging.getLogger("forge_engine.server")

# %%
#| hide
import json

from prometheus_client.parser import text_string_to_metric_families

# %% [markdown]
# `ServerThread` runs uvicorn on a background thread, for notebooks and tests.
# `forge-engine serve` (`run` below) instead runs uvicorn on the main thread and loads the
# model on another, so `/health` answers 503 from the first second and 200 once the engine
# is up and warmed up (`LLMEngine.warm_up`: one throwaway request, so the first real one does not
# wait for kernels to compile). It binds to 127.0.0.1 unless told otherwise, and says so loudly
# when it is told.
#
# **Shutdown.** On SIGINT or SIGTERM (or `stop()`) `Server` stops accepting connections,
# refuses new requests on open ones (503), lets the requests in flight finish for
# `--shutdown-grace` seconds, then cuts the rest off: each stream still ends with a
# `finish_reason`, an error event and `[DONE]` (chapter 11c). A second Ctrl-C quits at once.
# The process then exits 0. A signal while the model is still loading exits at once, with
# 128 + the signal's number (130 for Ctrl-C) and a message: the loading thread cannot be
# stopped, and leaving the interpreter under it would crash the process.
#
# **The HTTP parser.** uvicorn parses requests and frames the streamed chunks with `httptools`
# (C) when it is installed, as it is with this package, and with `h11` (pure Python) otherwise.
# The event loop and the engine thread share one GIL, so the Python spent per chunk is taken from
# the engine's steps: with 64 streams on the H200 the served TPOT was 1.06-1.07× the engine's own
# decode step with httptools and 1.16-1.19× with h11 (two runs each, one device call:
# `forge-engine bench w3 --model random:qwen3-4b --rates 16,inf` beside
# `kernels_lab/serving_steps.py`; docs/benchmarks.md).

# %%
#| export
DEFAULT_SHUTDOWN_GRACE = (
    5.0  # seconds the requests in flight get to finish when the server shuts down
)


class Server(uvicorn.Server):
    "uvicorn that drains the app's requests in flight on shutdown, and returns after a signal instead of re-raising it."

    def __init__(self, config: uvicorn.Config, grace: float = DEFAULT_SHUTDOWN_GRACE):
        super().__init__(config)
        self.grace, self.signals = grace, []
        config.timeout_graceful_shutdown = (
            grace + 5
        )  # the cut-off streams' last events still go out

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: now
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        state = (
            getattr(self.config.app.state, "forge", None)
            if hasattr(self.config.app, "state")
            else None
        )
        drain = asyncio.ensure_future(state.drain(self.grace)) if state is not None else None
        try:
            await super().shutdown(sockets)
        finally:
            if drain is not None:
                drain.cancel()


class ServerThread:
    "uvicorn serving `app` on a background thread: `with ServerThread(app) as url: ...`, or `start()` and `stop()`."

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,  # port 0: any free port
        grace: float = DEFAULT_SHUTDOWN_GRACE,
    ):
        self.server = Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"), grace
        )
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url: str | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> str:
        "Start serving; the base URL once the socket listens."
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (is the port taken?)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        "Finish open responses (cut off after the grace period), close the socket, end the thread."
        self.server.should_exit = True
        self._thread.join(timeout=self.server.grace + 10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    "Whether binding `host` keeps the server reachable from this machine only."
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENGINE_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_bytes",
    "max_waiting",
    "tensor_parallel_size",
    "max_model_len",
    "speculative_tokens",
)


def bound_host_names(host: str) -> list[str]:
    "The Host header names that reach a server bound to `host` (none to add for the wildcard addresses)."
    return [] if host in ("0.0.0.0", "::", "") else [host]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    "The flags of `forge-engine serve`."
    parser.add_argument(
        "--model", default="auto", help="registry name, local path, random:<preset>, or auto"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $FORGE_API_KEY, else none)",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API (repeatable; default: no CORS)",
    )
    parser.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST",
        help="without --api-key, also answer requests whose Host header names HOST (repeatable, or "
        "comma-separated; '*': any). Always: localhost, 127.0.0.1, [::1] and --host",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long requests in flight may still run before they are cut off",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a smaller model with the same tokenizer that drafts --speculative-tokens tokens (chapter 08d)",
    )
    for name in ENGINE_FLAGS:
        parser.add_argument(
            "--" + name.replace("_", "-"), type=int, default=None, help=f"EngineConfig.{name}"
        )
    add_quantization_flag(parser, "auto")  # the same flags as generate / chat (chapter 04a)
    add_memory_budget_flag(parser)


def run(args: argparse.Namespace) -> int:
    "`forge-engine serve`: answer /health at once, load the model on a thread, serve until Ctrl-C."
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        options = {
            name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None
        }
        config = EngineConfig(
            dtype=args.dtype,
            quantization=args.quantization,
            gpu_memory_budget=args.gpu_memory_budget,
            **options,
        )
        model, device = pick_model(args.model, args.device, logger.info)
        if args.draft_model and not config.speculative_tokens:
            raise ValueError("--draft-model drafts --speculative-tokens tokens: set it (> 0)")
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if not is_loopback(args.host):
        logger.warning(
            "binding %s: the server is reachable from other machines%s",
            args.host,
            "" if args.api_key or os.environ.get("FORGE_API_KEY") else ", and no --api-key is set",
        )
    hosts = [h.strip() for flag in args.allowed_hosts for h in flag.split(",") if h.strip()]
    app = create_app(
        None,
        args.served_model_name or model,
        api_key=args.api_key or os.environ.get("FORGE_API_KEY"),
        cors_origins=args.cors_origin,
        allowed_hosts=hosts + bound_host_names(args.host),
    )
    state: ServerState = app.state.forge
    server = Server(
        uvicorn.Config(app, host=args.host, port=args.port, lifespan="off"),
        grace=args.shutdown_grace,
    )

    def load() -> None:
        try:
            loaded = load_model_over(
                model,
                device,
                args.dtype,
                seed=config.seed,
                progress=False,
                quantization=config.quantization,
                tensor_parallel_size=config.tensor_parallel_size,
                memory_budget=config.gpu_memory_budget,
                gpu_layers=args.gpu_layers,
                offload=args.offload,
            )
            draft = None
            if args.draft_model:  # chapter 08d: drafts from a smaller model with the same tokenizer
                draft = load_model(
                    args.draft_model,
                    device,
                    args.dtype,
                    progress=False,
                    quantization=config.quantization,
                )
            engine = LLMEngine(loaded, config.replace(device=device), draft=draft)
            logger.info(
                "warmed up in %.2f s (kernels compiled before the first request)", engine.warm_up()
            )
            state.engine = AsyncEngine(engine)
            logger.info(
                "%s is ready: http://%s:%d (chat page at /)", state.model_name, args.host, args.port
            )
        except (
            Exception
        ) as e:  # say why, then stop: a server that can never serve should not look alive
            state.load_error = f"loading {model!r} failed: {type(e).__name__}: {e}"
            logger.error("%s", state.load_error)
            server.should_exit = True

    loader = threading.Thread(target=load, name="forge-load", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        if (
            loader.is_alive()
        ):  # a signal while loading: the loader cannot be stopped, and exiting under it crashes
            code = 128 + (server.signals[-1] if server.signals else signal.SIGINT)
            logger.warning("stopped while %r was still loading; exiting with %d", model, code)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if state.engine is not None:
            state.engine.close()  # the loader is done: state.engine is final
    return 1 if state.load_error else 0


def main(argv: Sequence[str] | None = None) -> int:
    "`python -c 'from forge_engine.server.serve import main; main()' --model ...`: the same as `forge-engine serve`."
    parser = argparse.ArgumentParser(
        prog="forge-engine serve", description="An OpenAI-compatible HTTP server."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


# %%
assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
assert (
    not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.org")
)
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(
    [
        "--model",
        "random:qwen3-tiny",
        "--cors-origin",
        "http://a",
        "--cors-origin",
        "http://b",
        "--max-waiting",
        "8",
    ]
)
assert (args.host, args.port, args.cors_origin, args.max_waiting, args.max_num_seqs) == (
    "127.0.0.1",
    8000,
    ["http://a", "http://b"],
    8,
    None,
)
args = parser.parse_args(["--quantization", "int8", "--gpu-memory-budget", "8GiB"])
assert (args.quantization, args.gpu_memory_budget) == ("int8", 8 * 2**30)
args = parser.parse_args(
    ["--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan", "--shutdown-grace", "1.5"]
)
assert (args.allowed_hosts, args.shutdown_grace, args.max_model_len) == (
    ["a.lan,b.lan", "c.lan"],
    1.5,
    None,
)
assert bound_host_names("0.0.0.0") == [] and bound_host_names("192.168.1.5") == ["192.168.1.5"]

# %% [markdown]
# From a terminal, the same server with a real model, and any OpenAI client against it:
#
# ```
# forge-engine serve --model smollm2-135m-instruct --port 8000      # add --api-key KEY to require one
# curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#      -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": true}'
# ```
#
# ```python
# from openai import OpenAI
# client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
# client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}])
# ```
#
# and a browser at http://127.0.0.1:8000/ for the chat page.

# %% [markdown]
# ## A real server, a real stream
#
# A tiny random Qwen3 (real tokenizer and chat template, gibberish text) behind the app, on
# a free loopback port. The engine takes one sequence at a time and queues at most one more,
# so backpressure is easy to see.

# %%
import httpx
from forge_engine.loader import load_model

loaded = load_model("random:qwen3-tiny", "cpu", progress=False)
engine = AsyncEngine(
    LLMEngine(
        loaded,
        EngineConfig(
            kv_cache_bytes=2**21, max_num_seqs=1, max_num_batched_tokens=256, max_waiting=1
        ),
    )
)
app = create_app(engine, "qwen3-tiny", api_key="secret")
server = ServerThread(app)
url = server.start()
client = httpx.Client(base_url=url, headers={"Authorization": "Bearer secret"}, timeout=60)
story = "Tell me a story about a forge, an anvil and a hammer, in three short sentences please."
hammer = loaded.tokenizer.encode(" hammer")[0]  # one token
question = {
    "model": "qwen3-tiny",
    "messages": [{"role": "user", "content": story}],
    "temperature": 0,
    "max_tokens": 6,
    "logit_bias": {str(hammer): 100},
}

# %% [markdown]
# `/v1/models` lists the one served model in OpenAI's shape, with what the registry knows of it:

# %%
card = client.get("/v1/models").json()["data"][0]
assert (card["id"], card["object"], card["owned_by"]) == ("qwen3-tiny", "model", "forge-engine")
assert (card["format"], card["architecture"], card["parameters"]) == (
    "random",
    "qwen3",
    loaded.config.num_parameters,
)
assert (
    card["context_length"] == loaded.config.max_position_embeddings
    and client.get("/v1/models/qwen3-tiny").json() == card
)
card

# %% [markdown]
# A streamed chat completion, event by event. The random model's text is gibberish; a
# `logit_bias` of +100 on one token makes greedy decoding pick it every time, so what comes
# back is readable and the same on every run:

# %%
with client.stream(
    "POST",
    "/v1/chat/completions",
    json={**question, "stream": True, "stream_options": {"include_usage": True}},
) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines() if line]
for line in events:
    print(line[:150])

# %%
assert events[-1] == "data: [DONE]"
chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
assert chunks[-1]["usage"]["completion_tokens"] == 6
streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
assert streamed == " hammer" * 6
whole = client.post("/v1/chat/completions", json=question).json()
assert (
    whole["choices"][0]["message"]["content"] == streamed
    and whole["usage"]["completion_tokens"] == 6
)
assert (
    whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
)  # the same prompt again: its full blocks were cached

# %% [markdown]
# Bad requests never reach the engine, and the answer says what to fix:

# %%
too_long = {**question, "messages": [{"role": "user", "content": "hi " * 5000}]}
for body, status in [
    ({**question, "n": 17}, 400),
    ({**question, "model": "gpt-4"}, 404),
    (too_long, 400),
    ({**question, "max_tokens": 5000}, 400),
]:
    r = client.post("/v1/chat/completions", json=body)
    print(r.status_code, r.json()["error"]["message"])
    assert r.status_code == status

# %% [markdown]
# **Backpressure.** One request streams (the engine's only running slot), a second waits in
# the queue; a third is refused with 429 and `Retry-After` instead of queueing without
# bound. Closing the first stream (a client that disconnects) aborts it: the waiting one
# then runs, and when all is done no KV block is in use.

# %%
long = {**question, "max_tokens": 1000, "ignore_eos": True, "stream": True}


def metric(name: str) -> float:
    "One sample of the server's /metrics, by its full name (labels included)."
    for line in client.get("/metrics").text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    raise KeyError(name)


def wait_until(condition, seconds=20):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


first = client.send(client.build_request("POST", "/v1/chat/completions", json=long), stream=True)
first_lines = first.iter_lines()  # keep the iterator: dropping it would close the connection
next(first_lines)  # its role chunk: it is running
waiting = threading.Thread(target=lambda: client.post("/v1/chat/completions", json=question))
waiting.start()
wait_until(lambda: metric("forge_requests_waiting") == 1)
r = client.post("/v1/chat/completions", json=question)
print(r.status_code, r.headers["retry-after"], r.json()["error"]["message"])
assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
first.close()  # the client goes away mid-stream
waiting.join(timeout=30)
wait_until(
    lambda: metric("forge_requests_running") == 0 and metric("forge_kv_cache_used_blocks") == 0
)
assert metric('forge_requests_total{finish_reason="abort"}') == 1
engine.engine.allocator.check_idle()

# %% [markdown]
# The metrics after all this, as Prometheus scrapes them (a few lines of many):

# %%
exposition = client.get("/metrics").text
print(
    "\n".join(
        line
        for line in exposition.splitlines()
        if line.startswith(("forge_requests", "forge_generation"))
    )
)
families = {f.name: f.type for f in text_string_to_metric_families(exposition)}
assert (
    families["forge_time_to_first_token_seconds"] == "histogram"
    and families["forge_prompt_tokens"] == "counter"
)
assert metric("forge_time_to_first_token_seconds_count") >= 3

# %% [markdown]
# **A 500 keeps the connection.** An unexpected exception is answered with a 500 in OpenAI's
# shape, and the keep-alive connection stays open: the next request on the same socket is
# answered. (Starlette's last-resort handler would answer and then re-raise, and uvicorn would
# close the connection unannounced: a pooled client's next request then fails.) A route that
# raises, added for the test, on a raw socket:

# %%
import socket


@app.get("/boom")
async def boom():
    raise RuntimeError("kaboom")


def http_request(sock, path: str) -> bytes:
    "One GET on an open socket; its whole response (headers and body: Content-Length)."
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer secret\r\n\r\n".encode()
    )
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, "the server closed the connection"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "the server closed the connection"
        body += more
    return head + b"\r\n\r\n" + body


host, port = url.removeprefix("http://").split(":")
with socket.create_connection((host, int(port)), timeout=10) as sock:
    first = http_request(sock, "/boom")
    assert first.startswith(b"HTTP/1.1 500") and b"connection: close" not in first.lower()
    assert b'"message": "internal error: RuntimeError: kaboom"' in first
    assert http_request(sock, "/health").startswith(
        b"HTTP/1.1 200"
    )  # the same connection, still served

# %% [markdown]
# When the engine stops, the server says so instead of hanging: `/health` turns 503, and so
# do new requests. Then we shut the server down.

# %%
engine.close()
assert client.get("/health").status_code == 503
assert client.post("/v1/chat/completions", json=question).status_code == 503
client.close()
server.stop()
assert not server.alive
