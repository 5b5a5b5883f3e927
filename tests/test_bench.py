"""`forge-engine bench` as a user runs it: W3 against a server it starts itself, results and plots on disk."""

import importlib.util
import json
import subprocess
import sys

import pytest


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


def test_the_llama_cpp_peer_says_how_to_install_it_when_it_is_missing():
    "Without llama_cpp (as in CI) the peer is skipped with the install command, in its own process."
    from forge_engine.bench_peers import llama_cpp_peer

    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is installed here (the test below runs it)")
    w4 = {"new_tokens": 4, "concurrency_1": {"output_tok_s": 1.0}}
    skipped = llama_cpp_peer("model.gguf", [1, 2, 3], w4)
    assert skipped["peer"] == "llama.cpp" and "ratio" not in skipped
    assert "No module named 'llama_cpp'" in skipped["why"]
    assert "pip install llama-cpp-python==0.3.36" in skipped["why"]


def test_the_llama_cpp_peer_on_the_smollm2_gguf_file():
    "llama.cpp on the real Q4_1 file, in its own process: 16 greedy tokens, the first ones ours."
    pytest.importorskip("llama_cpp")
    from forge_engine.bench import w4_cpu_classroom, w4_prompt
    from forge_engine.bench_peers import llama_cpp_peer
    from forge_engine.config import EngineConfig
    from forge_engine.loader import load_model
    from forge_engine.registry import resolve

    try:
        model = resolve("smollm2-135m-instruct", fetch=False)
    except FileNotFoundError as e:  # not pulled into FORGE_HOME
        pytest.skip(f"the SmolLM2 GGUF file is not here: {e}")
    loaded = load_model(str(model.path), "cpu", progress=False, quantization="gguf")
    result = w4_cpu_classroom(loaded, EngineConfig(), concurrency=(1,), new_tokens=16)
    peer = llama_cpp_peer(model.path, w4_prompt(loaded), result)
    assert peer["peer"] == "llama.cpp" and peer["new_tokens"] == 16 and peer["batch"] == 1, peer
    assert peer["output_tok_s"] > 0 and peer["ratio"] == pytest.approx(
        result["concurrency_1"]["output_tok_s"] / peer["output_tok_s"]
    )
    assert peer["same_greedy_tokens"] >= 8  # the same prompt ids: the same first tokens
