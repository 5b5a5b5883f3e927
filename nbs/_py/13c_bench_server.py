# %% [markdown]
# # A server to measure
#
# > `forge-engine serve` started as a process of its own on loopback, loaded with chapter 13a's client, its gauges sampled, and stopped cleanly: workload W3.

# %%
#| default_exp bench_server

# %% [markdown]
# W3 measures the server from outside, as its users see it. `ServerProcess` starts
# `forge-engine serve` as a separate process on a free loopback port, waits until `/health`
# says the model is loaded, and at the end stops it the way a person does, with Ctrl+C
# (SIGINT): the server finishes open responses, stops the engine thread and exits 0.
# Whatever it printed goes to a log file, shown when it fails to start. Chapter 13 runs it
# with a real model; here it is tested with a tiny one.

# %%
#| export
from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from forge_engine.generate import SamplingParams

# %%
#| hide
import pytest


# %%
#| export
def free_port() -> int:
    "A TCP port on 127.0.0.1 that nothing listens on now."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    "Prometheus text format to {name with labels: value} (comments skipped)."
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class ServerProcess:
    "`forge-engine serve` in a subprocess on loopback: `with ServerProcess(model) as url: ...`."

    def __init__(
        self,
        model: str,
        device: str | None = None,
        serve_args: list[str] = (),
        startup_timeout: float = 600,
    ):
        self.model, self.device, self.serve_args, self.startup_timeout = (
            model,
            device,
            list(serve_args),
            startup_timeout,
        )
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="forge-serve-", suffix=".log", delete=False
        )

    def start(self) -> str:
        "Start the server and wait for /health to say ok; the base URL."
        import httpx

        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "forge_engine",
            "serve",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(["--device", self.device] if self.device else []),
            *self.serve_args,
        ]
        self.process = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}) before it was ready:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the server was not ready after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        import httpx

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        "The metrics once no request runs or waits and no KV block is held; an error naming what is still busy."
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {
                k: m[k]
                for k in (
                    "forge_requests_running",
                    "forge_requests_waiting",
                    "forge_kv_cache_used_blocks",
                )
                if m[k] != 0
            }
            if not busy:
                return m
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server is not idle after {timeout:.0f} s: {busy}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        "Ctrl+C, then wait for it to exit (killed after `timeout`); its exit code."
        if self.process is None:
            raise RuntimeError("the server was never started")
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        if self.process.returncode == 0:
            os.unlink(self.log.name)  # kept to be read when something went wrong
        return self.process.returncode

    def log_tail(self, chars: int = 3000) -> str:
        "The end of what the server printed."
        try:
            with open(self.log.name) as f:
                return f.read()[-chars:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.stop()


# %%
assert parse_metrics(
    '# HELP x y\nforge_requests_running 2.0\nforge_requests_total{finish_reason="stop"} 5.0\n'
) == {"forge_requests_running": 2.0, 'forge_requests_total{finish_reason="stop"}': 5.0}
port = free_port()
assert 1024 <= port < 65536
bad = ServerProcess("no-such-model", "cpu")
with pytest.raises(RuntimeError, match="exited") as e:
    bad.start()
assert "no-such-model" in str(e.value)  # the server's own words, from its log


# %% [markdown]
# The load itself is chapter 13a's: Poisson arrivals at each rate, every request streamed and
# timed from outside. While it runs, `/metrics` is polled for the engine's gauges (requests
# running and waiting, KV blocks held): the server's time series, seen from outside. The poller
# has a thread of its own, every 0.25 s (the engine's stats snapshot is that old at most), so
# that the client's event loop, which times the tokens, never waits for it.

# %%
#| export
class MetricsPoller:
    "Columns of the engine's gauges from /metrics, sampled on a thread: `with MetricsPoller(url) as p: ...; p.series`."

    NAMES = {
        "running": "forge_requests_running",
        "waiting": "forge_requests_waiting",
        "kv_used_blocks": "forge_kv_cache_used_blocks",
        "kv_usage": "forge_kv_cache_usage_ratio",
    }

    def __init__(self, url: str, every: float = 0.25):
        self.url, self.every = url, every
        self.series: dict[str, list] = {"t_s": [], **{k: [] for k in self.NAMES}}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def _run(self) -> None:
        import httpx

        start = time.perf_counter()
        with httpx.Client(timeout=10) as client:
            while True:
                try:
                    values = parse_metrics(client.get(self.url + "/metrics").text)
                except httpx.HTTPError:
                    values = None  # a missed sample, not a failed run
                if values:
                    self.series["t_s"].append(time.perf_counter() - start)
                    for key, name in self.NAMES.items():
                        self.series[key].append(values[name])
                if self._done.wait(self.every):
                    return

    def __enter__(self) -> "MetricsPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


async def w3_online_serving(
    url: str,
    rates=(1.0, 4.0, 16.0, math.inf),
    num_prompts: int = 64,
    prompt_words: int = 64,
    max_tokens: int = 128,
    seed: int = 0,
) -> dict:
    "W3: at each rate, `num_prompts` streamed chat requests against the server at `url`, figures and gauges per rate."
    from forge_engine import load_client

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runs = []
    for rate in rates:
        workload = load_client.synthetic_workload(num_prompts, rate, prompt_words, max_tokens, seed)
        with MetricsPoller(url) as poller:
            result = await load_client.run_workload(url, workload, params)
        summary = load_client.summarize(result)
        busy_s = sum(r.e2e_s for r in result.replies if r.error is None)
        runs.append(
            {
                "rate": "inf" if math.isinf(rate) else rate,
                **summary,
                "mean_concurrency": busy_s / result.duration_s
                if result.duration_s
                else 0.0,  # Little's law
                "requests": load_client.request_records(result),
                "gauges": poller.series,
            }
        )
    return {
        "workload": "W3",
        "num_prompts": num_prompts,
        "prompt_words": prompt_words,
        "max_tokens": max_tokens,
        "model": result.model,
        "runs": runs,
    }


def run_w3(args) -> dict:
    "W3 against a `forge-engine serve` started here; the server must end idle and exit cleanly."
    serve_args = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("max_num_seqs", "max_num_batched_tokens", "dtype", "quantization")
        if getattr(args, k) is not None
    ]
    rates = [float(r) for r in args.rates.split(",")]
    server = ServerProcess(args.model, args.device, serve_args)
    with server as url:
        result = asyncio.run(
            w3_online_serving(
                url, rates, args.w3_num_prompts, args.prompt_words, args.w3_max_tokens
            )
        )
        server.wait_idle()
    if server.process.returncode != 0:
        raise RuntimeError(
            f"the server exited with {server.process.returncode}:\n{server.log_tail()}"
        )
    return {**result, "model": args.model, "server_args": serve_args, "server_exit_code": 0}


# %% [markdown]
# ## A short run with a tiny model
#
# A tiny random Qwen3 behind a real `forge-engine serve` process: 6 requests at 8 per second,
# then the server must be idle (checked through `/metrics`) and exit 0 on Ctrl+C.

# %%
server = ServerProcess("random:qwen3-tiny", "cpu", ["--kv-cache-bytes", str(2**22)])
url = server.start()
w3 = await w3_online_serving(url, rates=(8.0,), num_prompts=6, prompt_words=8, max_tokens=8)
idle = server.wait_idle()
assert server.stop() == 0 and server.process.returncode == 0
[run] = w3["runs"]
assert run["completed"] == 6 and run["total_output_tokens"] == 6 * 8 and len(run["requests"]) == 6
assert run["gauges"]["t_s"] == sorted(run["gauges"]["t_s"]) and 0 < run["mean_concurrency"] <= 6
assert idle["forge_kv_cache_used_blocks"] == 0
