"""`forge-engine bench` as a user runs it: W3 against a server it starts itself, results and plots on disk."""

import json
import subprocess
import sys


def forge(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "forge_engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_w3_starts_its_own_server_and_saves_results_and_plots(tmp_path):
    r = forge(
        "bench",
        "all",
        "--model",
        "random:qwen3-tiny",
        "--device",
        "cpu",
        "--workloads",
        "w3",
        "--rates",
        "inf",
        "--w3-num-prompts",
        "3",
        "--w3-max-tokens",
        "4",
        "--prompt-words",
        "4",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    [folder] = tmp_path.iterdir()
    [result_file] = folder.glob("w3-random-qwen3-tiny-*.json")
    result = json.loads(result_file.read_text())
    [run] = result["runs"]
    assert run["completed"] == 3 and run["failed"] == 0 and run["total_output_tokens"] == 3 * 4
    assert result["server_exit_code"] == 0 and result["environment"]["command"].startswith(
        "forge-engine bench all"
    )
    pngs = sorted(p.name for p in folder.glob("*.png"))
    assert pngs == [
        result_file.stem + f"-{kind}.png" for kind in ("latency", "throughput", "timeline")
    ]
    for png in pngs:
        (folder / png).unlink()
    r = forge("bench", "plot", str(result_file))  # the plots again, from the saved file
    assert (
        r.returncode == 0
        and len(r.stdout.split()) == 3
        and sorted(p.name for p in folder.glob("*.png")) == pngs
    )


def test_bench_refuses_an_unknown_workload():
    r = forge(
        "bench", "all", "--model", "random:qwen3-tiny", "--device", "cpu", "--workloads", "w1,w7"
    )
    assert r.returncode == 2 and "w7" in r.stderr
