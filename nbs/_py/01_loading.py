# %% [markdown]
# # Loading safetensors, one tensor at a time
#
# > Read a sharded safetensors checkpoint tensor by tensor, straight to the target device and dtype.
#
# A checkpoint of Qwen3-4B is 8 GB of BF16. The naive load (`torch.load` everything, convert,
# then copy into the model) holds two or three copies in host memory. We hold one tensor:
# read its bytes into a buffer, hand it to the model, which copies it into place (converting
# dtype and moving it to the GPU in that one copy), and let the buffer go.
#
# The safetensors format is simple enough to read by hand, so we do:
#
# | bytes | what |
# |---|---|
# | 8 | little-endian u64 `N`: length of the header |
# | N | JSON: `{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {...}}` |
# | rest | raw tensor data; offsets are relative to here |
#
# Large models come in shards (`model-00001-of-00003.safetensors`, ...) listed by
# `model.safetensors.index.json`.

# %%
#| default_exp loading

# %%
#| export
from __future__ import annotations

import json
import os
import resource
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

# %%
#| hide
import tempfile
import pytest
from safetensors.torch import save_file

# %% [markdown]
# ## The header

# %%
#| export
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    "Where one tensor lives in a safetensors file."

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    nbytes: int


def read_safetensors_header(path: str | Path) -> list[TensorEntry]:
    "The tensors of a safetensors file, in file order, checked against the file's size."
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100_000_000):
            raise ValueError(
                f"{path}: not a safetensors file (header length {header_len} for a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        expected = dtype.itemsize * (torch.Size(shape).numel())
        if end - begin != expected:
            raise ValueError(
                f"{path}: tensor {name!r} spans {end - begin} bytes, but {info['dtype']}{list(shape)} needs {expected}"
            )
        if data_start + end > size:
            raise ValueError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, file has {size}"
            )
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, end - begin))
    return sorted(entries, key=lambda e: e.begin)


# %%
tmp = Path(tempfile.mkdtemp())
save_file(
    {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
    },
    tmp / "tiny.safetensors",
)
entries = read_safetensors_header(tmp / "tiny.safetensors")
assert [(e.name, e.dtype, e.shape, e.nbytes) for e in entries] == [
    ("a", torch.float32, (2, 3), 24),
    ("b", torch.bfloat16, (4,), 8),
]


# %% [markdown]
# ## Reading one tensor
#
# We read straight into the storage of a fresh CPU tensor with `readinto`: no intermediate
# `bytes` object, no memory map whose pages would stay resident after we are done.

# %%
#| export
def read_tensor(f, entry: TensorEntry, buffer: torch.Tensor | None = None) -> torch.Tensor:
    "Read one tensor's bytes from an open file into `buffer` (uint8, large enough) or a new CPU tensor."
    buffer = (
        torch.empty(entry.nbytes, dtype=torch.uint8) if buffer is None else buffer[: entry.nbytes]
    )
    f.seek(entry.begin)
    if entry.nbytes and f.readinto(memoryview(buffer.numpy())) != entry.nbytes:
        raise ValueError(f"{getattr(f, 'name', 'file')}: short read for tensor {entry.name!r}")
    return buffer.view(entry.dtype).reshape(entry.shape)


# %%
with open(tmp / "tiny.safetensors", "rb") as f:
    a, b = (read_tensor(f, e) for e in entries)
assert torch.equal(a, torch.arange(6.0).reshape(2, 3)) and torch.equal(
    b, torch.ones(4, dtype=torch.bfloat16)
)


# %% [markdown]
# ## A sharded checkpoint, tensor by tensor
#
# `iter_checkpoint` yields `(name, tensor)` pairs across all shards with a progress bar over
# bytes. The consumer (`forge_engine.model.load_weights`) copies each into the model, after
# which the buffer is garbage. `LoadStats` records what a user wants to know: how long, how
# many bytes, and how high host memory went.

# %%
#| export
def checkpoint_shards(directory: str | Path) -> list[Path]:
    "The safetensors files of a checkpoint directory, in index order when there is an index."
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [directory / n for n in names]
        if missing := [s.name for s in shards if not s.exists()]:
            raise FileNotFoundError(
                f"{directory}: shards listed in the index are missing: {missing}"
            )
        return shards
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    return shards


def peak_rss_bytes() -> int:
    "Peak resident memory of this process so far."
    try:  # Linux: the high-water mark of this program's memory (ru_maxrss would include a parent's, from before exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def rss_bytes() -> int:
    "Resident memory of this process now (Linux; elsewhere the peak so far)."
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


@dataclass
class LoadStats:
    seconds: float = 0.0
    bytes_read: int = 0
    tensors: int = 0
    peak_rss_bytes: int = 0
    rss_before_bytes: int = 0  # resident memory when loading started (Python, torch, ...)

    def __str__(self):
        gb = self.bytes_read / 1e9
        return (
            f"loaded {self.tensors} tensors, {gb:.2f} GB in {self.seconds:.2f} s "
            f"({gb / max(self.seconds, 1e-9):.2f} GB/s); peak host memory {self.peak_rss_bytes / 2**30:.2f} GiB "
            f"({self.rss_before_bytes / 2**30:.2f} GiB before loading)"
        )


def iter_checkpoint(
    directory: str | Path, stats: LoadStats | None = None, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every shard, one at a time.

    Every tensor is read into the same staging buffer (the size of the largest one), so a
    yielded tensor is only valid until the next is read: copy it, don't keep it. One buffer
    reused means host memory never holds more than one tensor beyond the model."""
    shards = checkpoint_shards(directory)
    plan = [(shard, read_safetensors_header(shard)) for shard in shards]
    total = sum(e.nbytes for _, entries in plan for e in entries)
    staging = torch.empty(
        max((e.nbytes for _, entries in plan for e in entries), default=0), dtype=torch.uint8
    )
    stats = stats if stats is not None else LoadStats()
    start = time.perf_counter()
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for shard, entries in plan:
            with open(shard, "rb") as f:
                for entry in entries:
                    yield entry.name, read_tensor(f, entry, staging)
                    stats.bytes_read += entry.nbytes
                    stats.tensors += 1
                    bar.update(entry.nbytes)
    stats.seconds = time.perf_counter() - start
    stats.peak_rss_bytes = peak_rss_bytes()


# %%
shard_dir = tmp / "sharded"
shard_dir.mkdir()
save_file({"x": torch.zeros(3)}, shard_dir / "model-00002-of-00002.safetensors")
save_file({"w": torch.ones(2, 2)}, shard_dir / "model-00001-of-00002.safetensors")
(shard_dir / "model.safetensors.index.json").write_text(
    json.dumps(
        {
            "weight_map": {
                "w": "model-00001-of-00002.safetensors",
                "x": "model-00002-of-00002.safetensors",
            }
        }
    )
)
stats = LoadStats()
got = {
    name: t.clone() for name, t in iter_checkpoint(shard_dir, stats, progress=False)
}  # clone: the buffer is reused
assert list(got) == ["w", "x"] and stats.tensors == 2 and stats.bytes_read == 28
assert torch.equal(got["w"], torch.ones(2, 2)) and torch.equal(got["x"], torch.zeros(3))

# %% [markdown]
# Damaged files give errors that name the file and the problem:

# %%
data = (tmp / "tiny.safetensors").read_bytes()
(tmp / "cut.safetensors").write_bytes(data[:-4])
with pytest.raises(ValueError, match="truncated: tensor 'b'"):
    read_safetensors_header(tmp / "cut.safetensors")
(tmp / "junk.safetensors").write_bytes(b"\xff" * 64)
with pytest.raises(ValueError, match="not a safetensors file"):
    read_safetensors_header(tmp / "junk.safetensors")
with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    checkpoint_shards(Path(tempfile.mkdtemp()))
