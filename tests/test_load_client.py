"""The load client (forge_engine.load_client) against servers on loopback.

The tests that matter run against the real forge-engine server process (`forge_server`, from
test_chat.py); one wire-format test uses the small fixture server of test_chat.py.
"""

import argparse
import asyncio
import json
import math
import threading
import time

import pytest

from forge_engine.load_client import add_arguments, run, run_workload, summarize, synthetic_workload
from test_chat import API_KEY, ServerProcess, forge_server, free_port, params, wire_server  # noqa: F401 (fixtures)


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def check_consistent(results: dict, n: int, max_tokens: int):
    "Every request succeeded and the figures agree with each other."
    assert results["completed"] == n and results["failed"] == 0 and results["failures"] == {}
    assert results["total_output_tokens"] == n * max_tokens
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = results[name]
        assert d["mean"] > 0 and d["p50"] <= d["p99"], (name, d)
    assert results["ttft_ms"]["count"] == results["e2e_ms"]["count"] == n
    assert (
        results["ttft_ms"]["p99"] <= results["e2e_ms"]["p99"]
        and results["ttft_ms"]["mean"] <= results["e2e_ms"]["mean"]
    )
    assert results["duration_s"] > 0
    assert (
        results["request_throughput"] == n / results["duration_s"]
    )  # the same division (JSON keeps a float's bits)
    assert results["output_throughput"] == n * max_tokens / results["duration_s"]


# -- wire-format test (fixture server) --------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_wire_format_both_endpoints(wire_server, endpoint):
    workload = synthetic_workload(6, rate=50.0, words=4, max_tokens=5, seed=3)
    result = asyncio.run(
        run_workload(
            wire_server.url, workload, params(max_tokens=5), api_key=API_KEY, endpoint=endpoint
        )
    )
    assert result.model == "wire-model"
    assert all(
        r.error is None and r.num_tokens == 5 and r.ttft_s <= r.e2e_s for r in result.replies
    )
    check_consistent(summarize(result), 6, 5)


# -- against the real server ------------------------------------------------------------------------------------------
def test_finite_rate_run_writes_json(forge_server, tmp_path, capsys):
    out = tmp_path / "w3.json"
    rc = run(
        bench_args(
            "--url",
            forge_server.url,
            "--api-key",
            API_KEY,
            "--rate",
            "8",
            "--num-prompts",
            "8",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--prompt-words",
            "8",
            "--json",
            str(out),
            "--detailed",
        )
    )
    assert rc == 0
    results = json.loads(out.read_text())
    assert results == json.loads(capsys.readouterr().out)  # the same figures on stdout
    check_consistent(results, 8, 6)
    assert (
        results["rate"] == 8
        and results["workload"] == "w3"
        and results["total_input_tokens"] > 8 * 8
    )
    sends = [r["send_at_s"] for r in results["requests"]]
    assert sends == sorted(sends) and sends[0] == 0 and sends[-1] > 0  # spread-out arrivals
    for r in results["requests"]:
        assert (
            r["ok"]
            and r["output_tokens"] == 6
            and r["ttft_s"] <= r["e2e_s"]
            and len(r["itl_s"]) >= 1
        )


def test_saturation_run_16_prompts(forge_server, tmp_path):
    out = tmp_path / "inf.json"
    rc = run(
        bench_args(
            "--url",
            forge_server.url + "/v1",
            "--api-key",
            API_KEY,
            "--rate",
            "inf",
            "--num-prompts",
            "16",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--endpoint",
            "completions",
            "--json",
            str(out),
        )
    )
    results = json.loads(out.read_text())
    assert rc == 0 and results["rate"] == "inf"
    check_consistent(results, 16, 8)


def test_wrong_url_counts_failures(tmp_path):
    out = tmp_path / "bad.json"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc = run(
        bench_args(
            "--url", url, "--model", "m", "--rate", "inf", "--num-prompts", "4", "--json", str(out)
        )
    )
    results = json.loads(out.read_text())
    assert rc == 1 and results["completed"] == 0 and results["failed"] == 4
    assert sum(results["failures"].values()) == 4 and all(
        "cannot reach the server" in k for k in results["failures"]
    )
    assert results["ttft_ms"] is None and results["request_throughput"] == 0
    rc = run(
        bench_args("--url", url, "--num-prompts", "3", "--json", str(out))
    )  # no model given: the lookup fails
    results = json.loads(out.read_text())
    assert (
        rc == 1
        and results["failed"] == 3
        and "cannot reach the server" in next(iter(results["failures"]))
    )


def test_bad_arguments_exit_2(capsys):
    assert run(bench_args("--url", "localhost:8000", "--num-prompts", "2")) == 2
    assert "server URL must look like" in capsys.readouterr().err
    assert run(bench_args("--url", "http://127.0.0.1:1", "--rate", "0")) == 2
    assert "rate must be > 0" in capsys.readouterr().err
    assert run(bench_args("--url", "http://127.0.0.1:1", "--max-tokens", "0")) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_server_stopped_mid_run_counts_failures():
    server = ServerProcess()
    try:
        workload = synthetic_workload(12, rate=4.0, words=8, max_tokens=40, seed=0)
        sampling = params(max_tokens=40, ignore_eos=True)
        stopper = threading.Timer(
            1.0, server.proc.kill
        )  # mid-run: streams break off, later requests find nobody
        stopper.start()
        result = asyncio.run(
            run_workload(server.url, workload, sampling, api_key=API_KEY, timeout=30)
        )
        stopper.join()
    finally:
        server.stop()
    s = summarize(result)
    assert (
        s["failed"] >= 7
        and s["completed"] + s["failed"] == 12
        and sum(s["failures"].values()) == s["failed"]
    )
    assert all(r.error for r in result.replies[-4:])  # sent after the stop
    assert any(
        "cannot reach the server" in reason for reason in s["failures"]
    )  # nobody listens any more
    assert any("connection broke" in reason for reason in s["failures"])  # cut mid-stream


def test_trace_replay_keeps_the_trace_times(forge_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 10.0, "prompt": "hello", "max_tokens": 3}\n'
        '{"timestamp": 10.6, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}\n'
        '{"timestamp": 10.3, "prompt": "again", "max_tokens": 4}\n'
    )
    out = tmp_path / "trace.json"
    rc = run(
        bench_args(
            "--url",
            forge_server.url,
            "--api-key",
            API_KEY,
            "--trace",
            str(trace),
            "--ignore-eos",
            "--json",
            str(out),
            "--detailed",
        )
    )
    results = json.loads(out.read_text())
    assert (
        rc == 0
        and results["completed"] == 3
        and results["rate"] is None
        and results["total_output_tokens"] == 12
    )
    # 10.3 - 10.0 is 0.3 to float64 rounding (~1e-15 relative)
    assert [r["send_at_s"] for r in results["requests"]] == pytest.approx(
        [0.0, 0.3, 0.6], rel=1e-12
    )
    assert [r["output_tokens"] for r in results["requests"]] == [3, 4, 5] and results[
        "duration_s"
    ] >= 0.6
