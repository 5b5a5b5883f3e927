# %% [markdown]
# # Reading GGUF files
#
# > Parse a GGUF file's header and metadata, and dequantize its tensors to PyTorch one at a time, under Hugging Face names.
#
# GGUF is llama.cpp's single-file model format: the tokenizer, the model's shape and every
# weight in one file, the weights usually *quantized* (stored in 4 to 8 bits in small blocks
# that share a scale). Our small real test model, SmolLM2-135M-Instruct, ships as a GGUF of
# 98 MB. This chapter reads such a file by hand, turns its metadata into plain Python (for
# `ModelConfig` and the tokenizer) and turns each quantized block back into float32 with a
# few PyTorch tensor operations, so the loader of chapter 01 can consume `(hf_name, tensor)`
# pairs exactly as it does for safetensors.
#
# ## The file layout
#
# Everything is little-endian. A *string* is a u64 byte length followed by UTF-8 bytes.
#
# | part | contents |
# |---|---|
# | header | magic `b"GGUF"`, version u32 (2 or 3), tensor count u64, metadata count u64 |
# | metadata | per entry: key (string), value type (u32), value. Types: u8/i8/u16/i16/u32/i32/u64/i64, f32/f64, bool, string, array (item type u32, count u64, items) |
# | tensor infos | per tensor: name (string), number of dims u32, dims u64 each (*fastest-varying first*, the reverse of PyTorch), type u32 (`GGMLQuantizationType`), data offset u64 (from the start of the data section) |
# | padding | zeros up to a multiple of `general.alignment` (32 when absent) |
# | data | each tensor's bytes at its (aligned) offset |
#
# The `gguf` package from llama.cpp has a reader (`gguf.GGUFReader`), and we use it in the
# tests as the reference. We don't open files with it: it builds a numpy view per metadata
# item and takes about 4 s to open SmolLM2 on a 2-core laptop (its 49,152 tokens and 48,900
# merges), three times that for Qwen3's vocabulary. The format is simple enough that reading
# it ourselves takes 60 lines and a tenth of a second. From `gguf` we take only constants: the
# type numbers (`QType`, our short name for `gguf.GGMLQuantizationType`) and each type's block size.

# %%
#| default_exp gguf_file

# %%
#| export
# Why one module of ~540 lines: it is one file format. Most of it is the dequantizer of each block
# type, a few lines each, tied to the byte layout the header reader describes; the name map and the
# writer (used by tests and tools) are the format read the other way.
from __future__ import annotations

import math
import mmap
import re
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFValueType, LlamaFileType
from gguf import GGMLQuantizationType as QType

from forge_engine.config import ModelConfig, model_config_from_gguf

# %%
#| hide
import tempfile

import gguf
import pytest

tmp_dir = (
    tempfile.TemporaryDirectory()
)  # small GGUF files written by this notebook; removed at exit
tmp = Path(tmp_dir.name)

# %% [markdown]
# ## Reading the header
#
# A `_ByteReader` walks the memory-mapped bytes with a position and refuses to read past the
# end: a truncated or corrupt file then fails with the byte range it needed instead of
# garbage. Metadata arrays of numbers are read in one `np.frombuffer`; arrays of strings (the
# tokenizer's tokens and merges) need one small step per string.

# %%
#| export
_VALUE_FORMATS = {  # metadata value type -> little-endian struct / numpy format
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


class _ByteReader:
    "A position in a GGUF file's bytes, with bounds-checked reads of GGUF values."

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int, what: str) -> int:
        "Advance over `n` bytes; return where they start."
        start, end = self.pos, self.pos + n
        if end > len(self.buf):
            raise ValueError(
                f"{self.path} is truncated: {what} needs bytes {start}..{end}, "
                f"but the file has {len(self.buf)} bytes"
            )
        self.pos = end
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        start = self.take(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{self.path} is corrupt: {what} (bytes {start}..{start + n}) is not UTF-8 text: {e.reason}"
            ) from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _VALUE_FORMATS:
            return self.scalar(_VALUE_FORMATS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.scalar("<I", what), self.scalar("<Q", what)
            if item_type in _VALUE_FORMATS:  # numbers: one read, no Python loop
                dtype = np.dtype(_VALUE_FORMATS[item_type])
                start = self.take(count * dtype.itemsize, what)
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            return [self.value(item_type, what) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} in {what}")


# %% [markdown]
# A tensor info says where a tensor's bytes are and how to read them. We store the shape in
# PyTorch order (GGUF lists dims fastest-first, so `token_embd.weight` of SmolLM2 is
# `[576, 49152]` in the file and `(49152, 576)` here) and check, before anything is read, that
# every tensor's type is known, that its bytes lie inside the file, and that they end before
# the next tensor's begin. GGUF stores no byte size: it follows from the type and the shape, so
# a corrupt shape or type shows up as a tensor running into its neighbour (or past the end).

# %%
#| export
@dataclass(frozen=True)
class TensorInfo:
    "Where one tensor lives in a GGUF file and how it is encoded."

    name: str  # the GGUF name, e.g. "blk.0.attn_q.weight"
    qtype: QType
    shape: tuple[int, ...]  # PyTorch order: [out_features, in_features] for a weight
    offset: int  # absolute file offset of the first byte
    nbytes: int


_KNOWN_TYPE_IDS = {int(q) for q in QType}


def tensor_nbytes(qtype: QType, shape) -> int:
    "Bytes a tensor of this type and shape takes; its rows must be whole blocks."
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise ValueError(
            f"{qtype.name} stores rows in blocks of {block_size}, but the row length is {shape[-1]}"
        )
    return math.prod(shape) // block_size * type_size


def read_gguf_header(buf, path: Path) -> tuple[int, dict[str, Any], list[TensorInfo]]:
    "Parse the header of GGUF bytes `buf`: (version, metadata, tensor infos)."
    r = _ByteReader(buf, path)
    magic = bytes(buf[r.take(4, "the magic number") : 4])
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    version = r.scalar("<I", "the version")
    if version & 0xFFFF == 0:
        raise ValueError(
            f"{path} is a big-endian GGUF file; only little-endian files are supported"
        )
    if version not in (2, 3):
        raise ValueError(f"{path} has GGUF version {version}; supported: 2, 3")
    n_tensors, n_kv = r.scalar("<Q", "the tensor count"), r.scalar("<Q", "the metadata count")
    metadata = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        metadata[key] = r.value(r.scalar("<I", key), key)
    raw_infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor info #{i}")
        dims = [r.scalar("<Q", name) for _ in range(r.scalar("<I", name))]
        raw_infos.append((name, dims, r.scalar("<I", name), r.scalar("<Q", name)))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    data_start = -(-r.pos // alignment) * alignment  # round up
    infos = []
    for name, dims, type_id, offset in raw_infos:
        if type_id not in _KNOWN_TYPE_IDS:
            raise ValueError(
                f"{path} is corrupt: tensor {name!r} has type id {type_id}, which no GGUF type has"
            )
        try:
            qtype = QType(type_id)
            shape = tuple(int(d) for d in reversed(dims))
            nbytes = tensor_nbytes(qtype, shape)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"{path}: tensor {name!r} (type {type_id}, dims {dims}): {e}"
            ) from None
        if offset % alignment:
            raise ValueError(
                f"{path}: tensor {name!r} starts at data offset {offset}, not a multiple of {alignment}"
            )
        begin = data_start + offset
        if begin + nbytes > len(buf):
            raise ValueError(
                f"{path}: tensor {name!r} ({qtype.name}, shape {list(shape)}) needs bytes "
                f"{begin}..{begin + nbytes}, but the file has {len(buf)} bytes (truncated?)"
            )
        infos.append(TensorInfo(name, qtype, shape, begin, nbytes))
    by_offset = sorted(infos, key=lambda t: t.offset)
    for t, after in zip(by_offset, by_offset[1:]):
        if t.offset + t.nbytes > after.offset:
            raise ValueError(
                f"{path} is corrupt: tensor {t.name!r} ({t.qtype.name}, shape {list(t.shape)}) needs "
                f"{t.nbytes} bytes, but the next tensor, {after.name!r}, starts {after.offset - t.offset} "
                f"bytes after it: its size does not match its type and shape"
            )
    return version, metadata, infos


# %% [markdown]
# ## Dequantizing, block by block
#
# A quantized row is cut into blocks of 32 (or 256) weights; each block stores small integers
# `q` and one or two float16 numbers that map them back: a scale `d` and, for the `_1` and `_K`
# types, an offset `m`. All types, with their bytes per block:
#
# | type | weights / block | bytes | bits / weight | block layout | weight |
# |---|---|---|---|---|---|
# | F32, F16, BF16 | 1 | 4, 2, 2 | 32, 16, 16 | the number itself | as is |
# | Q8_0 | 32 | 34 | 8.5 | `d`, 32 × int8 | `d·q` |
# | Q4_0 | 32 | 18 | 4.5 | `d`, 16 bytes of 4-bit `q` | `d·(q−8)` |
# | Q4_1 | 32 | 20 | 5.0 | `d`, `m`, 16 bytes of 4-bit `q` | `d·q + m` |
# | Q5_0 | 32 | 22 | 5.5 | `d`, 4 bytes of 5th bits, 16 bytes of low 4 bits | `d·(q−16)` |
# | Q5_1 | 32 | 24 | 6.0 | `d`, `m`, 5th bits, low 4 bits | `d·q + m` |
# | Q4_K | 256 | 144 | 4.5 | `d`, `dmin`, 8 × (6-bit scale, 6-bit min) in 12 bytes, 128 bytes of 4-bit `q` | `d·sc·q − dmin·mn` per 32 |
# | Q5_K | 256 | 176 | 5.5 | like Q4_K plus 32 bytes of 5th bits | `d·sc·q − dmin·mn` per 32 |
# | Q6_K | 256 | 210 | 6.5625 | 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 × int8 scale, `d` | `d·sc·(q−32)` per 16 |
#
# The `_K` types quantize the scales too: a 256-weight *super-block* has one float16 `d`, and
# each 32-weight (16 for Q6_K) sub-block has a small integer scale `sc` relative to it.
#
# Every dequantizer below takes the bytes as a `[n_blocks, bytes_per_block]` uint8 tensor and
# returns `[n_blocks, weights_per_block]` float32: slicing the columns picks a field in every
# block at once, so there is no Python loop over blocks. Where two 4-bit numbers share a byte,
# the low nibble comes first: in Q4_0, byte `j` holds weight `j` (low) and weight `j + 16` (high).

# %%
#| export
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    "The float16 stored at byte `at` of every block, as a float32 column `[n, 1]`."
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    "Bytes `[n, k]` -> 4-bit numbers `[n, 2k]`: all low nibbles, then all high nibbles."
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    "Bytes `[n, k]` -> bits `[n, 8k]`, least significant bit of the first byte first."
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def dequantize_f32(blocks):
    "F32: 4 bytes per weight."
    return blocks.view(torch.float32).clone()


def dequantize_f16(blocks):
    "F16: 2 bytes per weight, IEEE half precision."
    return blocks.view(torch.float16).float()


def dequantize_bf16(blocks):
    "BF16: 2 bytes per weight, the top half of a float32."
    return blocks.view(torch.bfloat16).float()


def dequantize_q8_0(blocks):
    "Q8_0, 34 bytes per 32 weights: d (f16) | 32 × int8 q. Weight = d·q."
    return _f16(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def dequantize_q4_0(blocks):
    "Q4_0, 18 bytes per 32 weights: d (f16) | 16 bytes of 4-bit q. Weight = d·(q − 8)."
    return _f16(blocks, 0) * (_low_high_nibbles(blocks[:, 2:]).float() - 8)


def dequantize_q4_1(blocks):
    "Q4_1, 20 bytes per 32 weights: d (f16) | m (f16) | 16 bytes of 4-bit q. Weight = d·q + m."
    return _f16(blocks, 0) * _low_high_nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def dequantize_q5_0(blocks):
    "Q5_0, 22 bytes per 32 weights: d (f16) | 32 fifth bits (4 bytes) | 16 bytes of low 4 bits. Weight = d·(q − 16)."
    q = _low_high_nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4)
    return _f16(blocks, 0) * (q.float() - 16)


def dequantize_q5_1(blocks):
    "Q5_1, 24 bytes per 32 weights: d (f16) | m (f16) | 32 fifth bits | 16 bytes of low 4 bits. Weight = d·q + m."
    q = _low_high_nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


# %% [markdown]
# The K types. Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes:
# bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take
# their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits
# from the spare top bits of bytes 0-3 and 4-7. The 4-bit numbers come in 32-byte runs: run `i`
# holds sub-block `2i` in its low nibbles and sub-block `2i + 1` in its high nibbles.

# %%
#| export
def _k_scales_and_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "The 12 packed scale bytes of Q4_K / Q5_K `[n, 12]` -> (scales, mins), each `[n, 8]` float32."
    scales = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    "128 bytes `[n, 128]` -> 4-bit numbers `[n, 8, 32]` of the 8 sub-blocks."
    runs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(-1, 8, 32)


def _k_combine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    "Weight = d·sc·q − dmin·mn for the 8 sub-blocks of Q4_K / Q5_K; q is `[n, 8, 32]`."
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0) * scales, _f16(blocks, 2) * mins
    return (d.unsqueeze(-1) * q.float() - dmin.unsqueeze(-1)).reshape(-1, 256)


def dequantize_q4_k(blocks):
    "Q4_K, 144 bytes per 256 weights: d | dmin (f16) | 12 bytes of 6-bit scales and mins | 128 bytes of 4-bit q."
    return _k_combine(blocks, _k_nibbles(blocks[:, 16:144]))


def dequantize_q5_k(blocks):
    "Q5_K, 176 bytes per 256 weights: d | dmin | 12 scale bytes | 32 bytes of fifth bits | 128 bytes of low 4 bits."
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    fifth = (blocks[:, None, 16:48] >> shifts) & 1  # bit i of byte l: sub-block i, weight l
    return _k_combine(blocks, _k_nibbles(blocks[:, 48:176]) | (fifth << 4))


def q6_k_quants_and_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks `[n, 210]` -> (q − 32 as int8 `[n, 256]`, d·sc per 16 weights as float32 `[n, 16]`).
    Each half of 128 weights uses 64 low bytes (weights 0-63 in low nibbles, 64-127 in high
    nibbles) and 32 high bytes (bit pairs 0-1, 2-3, 4-5, 6-7 for the four runs of 32)."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(-1, 2, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)
    return q.reshape(-1, 256), _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()


def dequantize_q6_k(blocks):
    """Q6_K, 210 bytes per 256 weights: 128 bytes of low 4 bits | 64 bytes of high 2 bits |
    16 × int8 scales (one per 16 weights) | d (f16). Weight = d·sc·(q − 32)."""
    q, d = q6_k_quants_and_scales(blocks)
    return (d.unsqueeze(-1) * q.float().reshape(-1, 16, 16)).reshape(-1, 256)


# %% [markdown]
# One table maps each type to its function; `dequantize` checks the byte count against the
# type and shape, cuts the bytes into blocks and reshapes the result.

# %%
#| export
DEQUANTIZERS = {
    QType.F32: dequantize_f32,
    QType.F16: dequantize_f16,
    QType.BF16: dequantize_bf16,
    QType.Q8_0: dequantize_q8_0,
    QType.Q4_0: dequantize_q4_0,
    QType.Q4_1: dequantize_q4_1,
    QType.Q5_0: dequantize_q5_0,
    QType.Q5_1: dequantize_q5_1,
    QType.Q4_K: dequantize_q4_k,
    QType.Q5_K: dequantize_q5_k,
    QType.Q6_K: dequantize_q6_k,
}


def _as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    "Any tensor or array -> its bytes as a flat uint8 tensor (numpy data is copied only if read-only)."
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        return torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    return raw.contiguous().reshape(-1).view(torch.uint8)


def dequantize(
    raw: torch.Tensor | np.ndarray, qtype: QType, shape, name: str = "tensor"
) -> torch.Tensor:
    "Decode the bytes of a GGUF tensor of type `qtype` into a float32 tensor of `shape` (PyTorch order)."
    qtype = QType(qtype)
    if qtype not in DEQUANTIZERS:
        raise ValueError(
            f"{name}: GGUF type {qtype.name} is not supported; supported: {', '.join(q.name for q in DEQUANTIZERS)}"
        )
    shape = tuple(shape)
    try:
        expected = tensor_nbytes(qtype, shape)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    raw = _as_bytes(raw)
    if raw.numel() != expected:
        raise ValueError(
            f"{name}: {qtype.name} data of shape {list(shape)} needs {expected} bytes, got {raw.numel()}"
        )
    _, type_size = GGML_QUANT_SIZES[qtype]
    return DEQUANTIZERS[qtype](raw.reshape(-1, type_size)).reshape(shape)


# %% [markdown]
# ### Checking against the reference
#
# `gguf.quants` has numpy (de)quantizers written by the llama.cpp authors. Where it can
# quantize a type we feed it real quantized data; the K types it can only dequantize, so they
# get random bytes with sane float16 scales (random bytes there could be NaN or infinity).

# %%
#| hide
def random_quantized(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    "Valid GGUF bytes of `qtype` for a `[rows, cols]` tensor (numpy, the reference's byte shape)."
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return gguf.quants.quantize(weights, qtype).view(np.uint8)
    except NotImplementedError:  # the K types: random bytes, then real float16 scales
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
        scale_at = {QType.Q6_K: [208]}.get(qtype, [0, 2])
        for at in scale_at:
            data[..., at : at + 2] = (
                rng.uniform(-1, 1, data.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
            )
        return data.reshape(rows, -1)


for qtype in DEQUANTIZERS:
    data = random_quantized(qtype, 4, 512, seed=int(qtype))
    ours = dequantize(torch.from_numpy(data), qtype, (4, 512))
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    # the reference's float32 products and sums in its order: bit for bit
    torch.testing.assert_close(ours, reference, rtol=0, atol=0, msg=lambda m: f"{qtype.name}: {m}")
    assert ours.dtype == torch.float32 and ours.isfinite().all(), qtype.name

# %% [markdown]
# Wrong sizes and types fail with the numbers:

# %%
q8 = random_quantized(QType.Q8_0, 2, 64)
with pytest.raises(ValueError, match=r"w: Q8_0 data of shape \[2, 64\] needs 136 bytes, got 134"):
    dequantize(q8.reshape(-1)[:-2], QType.Q8_0, (2, 64), name="w")
with pytest.raises(ValueError, match="blocks of 32, but the row length is 48"):
    dequantize(q8, QType.Q8_0, (2, 48))
with pytest.raises(ValueError, match="type Q2_K is not supported; supported: F32, F16, BF16, Q8_0"):
    dequantize(q8, QType.Q2_K, (2, 64))

# %% [markdown]
# ## What quantization does to a weight row
#
# A row of 4,096 Gaussian weights (real weight rows look much like this, plus a few outliers),
# through each type `gguf` can quantize. Q8_0 is nearly lossless; Q4_1, the type of most of
# SmolLM2's file, spends 5 bits per weight and errs about 15 times more:

# %%
import matplotlib.pyplot as plt

row = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
errors = {}
for qtype in (QType.Q8_0, QType.Q5_1, QType.Q5_0, QType.Q4_1, QType.Q4_0):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    back = dequantize(gguf.quants.quantize(row.numpy(), qtype), qtype, row.shape)
    errors[qtype.name] = (back - row).flatten()
    rel = errors[qtype.name].norm() / row.norm()
    print(f"{qtype.name}: {8 * type_size / block_size:5.2f} bits/weight, relative error {rel:.4f}")

fig, ax = plt.subplots(figsize=(7, 2.5))
for name in ("Q4_1", "Q8_0"):
    ax.hist(errors[name].numpy(), bins=80, alpha=0.6, label=name)
ax.set_xlabel("dequantized − original")
ax.set_yscale("log")
ax.legend()
plt.show()

# %%
# half a step: Q8_0's is a block's largest |w| / 254, Q4_1's (max - min) / 30, about 1/15 of it: ~17 times Q8_0's
assert errors["Q8_0"].abs().max() < errors["Q4_1"].abs().max() / 8

# %% [markdown]
# ## From GGUF names to Hugging Face names
#
# llama.cpp has its own tensor names; the rest of the engine speaks Hugging Face names.
#
# One more twist for the `llama` architecture only. Hugging Face Llama applies rotary
# embeddings to the two *halves* of each head (dimension `i` pairs with `i + head_dim/2`);
# llama.cpp's original Llama rotated *adjacent* pairs (`2i` with `2i + 1`). So its converter
# reorders the rows of `q_proj` and `k_proj` inside each head (an exact permutation, no
# change in values) to make the halves adjacent. We undo it, so one RoPE serves every file.
# Qwen2/Qwen3 GGUFs use the half-split layout and are stored as they are.

# %%
#| export
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QWEN35_LAYER_PARTS = {  # blk.N.<gguf> -> model.layers.N.<hf> where a qwen35 file differs (whole suffixes:
    # A_log has no .weight, dt_bias is stored as the bias of a "dt" projection that has no weight)
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
SKIPPED_TENSORS = {  # present in some GGUFs, not used by our decoder
    "rope_freqs.weight": "per-frequency rotary factors (Llama 3 rope scaling) are not implemented; "
    "the model uses plain RoPE from rope_theta",
}


def hf_name(gguf_name: str, architecture: str = "") -> str:
    "The Hugging Face name of a GGUF tensor, e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if architecture == "qwen35" and m and m[2] in _QWEN35_LAYER_PARTS:
        return f"model.layers.{m[1]}.{_QWEN35_LAYER_PARTS[m[2]]}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m[2] not in _LAYER_PARTS:
        raise ValueError(
            f"unknown GGUF tensor {gguf_name!r}; known: {', '.join(_GLOBAL_NAMES)}, "
            f"blk.N.{{{','.join(_LAYER_PARTS)}}}.weight|bias"
        )
    return f"model.layers.{m[1]}.{_LAYER_PARTS[m[2]]}.{m[3]}"


def gguf_name(hf: str, architecture: str = "") -> str:
    "The inverse of `hf_name`."
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    qwen35 = {v: k for k, v in _QWEN35_LAYER_PARTS.items()}
    if architecture == "qwen35" and m and m[2] in qwen35:
        return f"blk.{m[1]}.{qwen35[m[2]]}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    parts = {v: k for k, v in _LAYER_PARTS.items()}
    if m is None or m[2] not in parts:
        raise ValueError(f"no GGUF name for tensor {hf!r}")
    return f"blk.{m[1]}.{parts[m[2]]}.{m[3]}"


def _head_pairs(w: torch.Tensor, n_head: int) -> int:
    if w.shape[0] % (2 * n_head):
        raise ValueError(f"{w.shape[0]} rows do not split into {n_head} heads of even size")
    return w.shape[0] // n_head // 2


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    "What llama.cpp's converter does to Llama q/k rows: in each head, interleave the two halves."
    half = _head_pairs(w, n_head)
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    "The inverse of `llama_cpp_permute`: back to Hugging Face's half-split rows."
    half = _head_pairs(w, n_head)
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# %%
assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
assert hf_name("output.weight") == "lm_head.weight"
for name in ("blk.7.attn_v.bias", "token_embd.weight", "blk.2.ffn_norm.weight"):
    assert hf_name(gguf_name(hf_name(name))) == hf_name(name) and gguf_name(hf_name(name)) == name
with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
    hf_name("blk.0.ffn_gate_exps.weight")

# one head of 4 dims: HF pairs (0, 2), (1, 3); llama.cpp stores the pairs next to each other
w = torch.arange(4.0)[:, None]
assert llama_cpp_permute(w, 1).flatten().tolist() == [0, 2, 1, 3]
for rows, cols, heads in [(8, 3, 2), (64, 5, 4), (24, 1, 3)]:
    w = torch.randn(rows, cols)
    assert torch.equal(llama_cpp_unpermute(llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(llama_cpp_permute(w, heads), w)
with pytest.raises(ValueError, match="6 rows do not split into 2 heads"):
    llama_cpp_permute(torch.zeros(6, 2), 2)


# %% [markdown]
# ## Qwen3.5 in llama.cpp's layout (`qwen35`)
#
# llama.cpp's converter (`convert_hf_to_gguf.py`, its Qwen3.5 text model class) does more to a
# Qwen3.5 checkpoint than rename it. Reading a `qwen35` file means undoing each change:
#
# | tensor | in the file | why llama.cpp stores it so | we undo it by |
# |---|---|---|---|
# | `A_log` → `ssm_a` | `−exp(A_log)` | the decay rate `A` itself, negative, as its kernel uses it | `log(−a)` |
# | `dt_bias` → `ssm_dt.bias` | as is | a bias of the "dt" step, Mamba's name | renaming |
# | `conv1d.weight` `[C, 1, K]` → `ssm_conv1d` | `[C, K]` | the grouped conv's dummy dimension dropped | `unsqueeze(1)` |
# | zero-centred norms (`attn_norm`, `post_attention_norm`, `output_norm`, `attn_q_norm`, `attn_k_norm`) | `1 + weight` | llama.cpp's RMSNorm multiplies by the weight | `− 1` |
# | the DeltaNet's output norm `ssm_norm` | as is | a plain RMSNorm already | nothing |
# | value heads (`in_proj_qkv`'s v rows, `conv1d`'s v channels, `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias` rows, `out_proj` columns) | *tiled* order | see below | the inverse permutation |
# | `q_proj` (query and gate per head), `k_proj`, `v_proj`, the MLP | as is (renamed) | | renaming |
#
# The value heads: with fewer key heads than value heads, consecutive value heads share a key
# head (chapter 03b's grouping: `[k0v0, k0v1, k1v0, k1v1]` for 2 key heads and 2 value heads
# each). ggml broadcasts a smaller tensor over a larger one by *tiling* it, `[k0, k1, k0, k1]`,
# so the converter reorders the value heads to `[k0v0, k1v0, k0v1, k1v1]`: then each value head
# meets its key head by plain broadcasting. With as many key heads as value heads nothing moves.
#
# The shape lives under `qwen35.*`: the usual keys, plus the DeltaNet's in Mamba's words
# (`ssm.group_count`: key heads, `ssm.time_step_rank`: value heads, `ssm.state_size`: key head
# dim, `ssm.inner_size`: value heads × value head dim, `ssm.conv_kernel`), `rope.dimension_count`
# (the rotated dims), `attention.recurrent_layers` (which layers are DeltaNet; else every
# `full_attention_interval`-th is full attention). A file may carry the checkpoint's
# multi-token-prediction layer as extra blocks (`nextn_predict_layers` of them after the
# decoder's, counted in `block_count`); we skip them, as chapter 03b skips `mtp.*`. The
# `rope.dimension_sections` of Qwen3.5's multimodal RoPE do not matter for text: the three
# position components of a text token are equal, which is plain RoPE.
#
# This chapter sits below chapter 03b, so it does not build a `Qwen35Config`: it reads the file
# into the text `config.json` a checkpoint would have (`hf_config_from_gguf`), which chapter
# 03b's `Qwen35Config.from_hf` reads, and its tensors into the checkpoint's names.

# %%
#| export
def qwen35_value_head_order(text: Mapping[str, Any], hf: str) -> tuple[int, torch.Tensor] | None:
    """(dim, index) that puts the value heads of checkpoint tensor `hf` in llama.cpp's tiled order (`index_select`);
    None for a tensor without value heads, or when there are as many key heads as value heads."""
    key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if key_heads == value_heads or ".linear_attn." not in hf:
        return None
    group, qk_rows = value_heads // key_heads, 2 * key_heads * text["linear_key_head_dim"]

    def tiled(head_dim: int, skip: int = 0) -> torch.Tensor:  # rows [skip, ...) hold value heads
        heads = torch.arange(value_heads * head_dim).view(key_heads, group, head_dim)
        return torch.cat((torch.arange(skip), skip + heads.transpose(0, 1).reshape(-1)))

    part, dv = hf.split(".linear_attn.")[1], text["linear_value_head_dim"]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):  # q and k rows first, then v
        return 0, tiled(dv, skip=qk_rows)
    if part == "in_proj_z.weight":
        return 0, tiled(dv)
    if part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return 0, tiled(1)
    if part == "out_proj.weight":
        return 1, tiled(dv)
    return None  # norm.weight: one weight per value dim, shared by all heads


def _zero_centred_norm(hf: str) -> bool:
    return hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight")


def qwen35_to_llama_cpp(hf: str, w: torch.Tensor, text: Mapping[str, Any]) -> torch.Tensor:
    "What llama.cpp's converter stores for Qwen3.5 checkpoint tensor `hf` (see the table above)."
    if order := qwen35_value_head_order(text, hf):
        w = w.index_select(order[0], order[1].to(w.device))
    if hf.endswith("A_log"):
        return -w.exp()
    if hf.endswith("conv1d.weight"):
        return w.squeeze(1)
    return w + 1 if _zero_centred_norm(hf) else w


def qwen35_from_llama_cpp(hf: str, w: torch.Tensor, text: Mapping[str, Any]) -> torch.Tensor:
    "The checkpoint's tensor `hf` back from what a `qwen35` GGUF stores: the inverse of `qwen35_to_llama_cpp`."
    if hf.endswith("A_log"):
        w = (-w).log()
    elif hf.endswith("conv1d.weight"):
        w = w.unsqueeze(1)
    elif _zero_centred_norm(hf):
        w = w - 1
    if order := qwen35_value_head_order(text, hf):
        w = w.index_select(order[0], order[1].argsort().to(w.device))
    return w


def hf_config_from_gguf(metadata: Mapping[str, Any], tensor_infos) -> dict[str, Any]:
    "The text `config.json` of a `qwen35` GGUF file's model, from its metadata and tensor shapes."
    if metadata.get("general.architecture") != "qwen35":
        raise ValueError(
            f"not a qwen35 file: general.architecture is {metadata.get('general.architecture')!r}"
        )

    def key(name, default=None):
        value = metadata.get(f"qwen35.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks qwen35.{name}")
        return value

    if metadata.get("qwen35.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(
            f"rope scaling {metadata['qwen35.rope.scaling.type']!r} is not implemented; only plain RoPE is"
        )
    shapes = {t.name: t.shape for t in tensor_infos}
    if "token_embd.weight" not in shapes:
        raise ValueError("a qwen35 GGUF file without token_embd.weight")
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    recurrent = metadata.get("qwen35.attention.recurrent_layers")
    every = int(key("full_attention_interval", 4))
    layer_types = [
        ("linear_attention" if recurrent[i] else "full_attention")
        if recurrent
        else ("full_attention" if (i + 1) % every == 0 else "linear_attention")
        for i in range(layers)
    ]
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim, value_heads = (
        int(key("attention.key_length", hidden // heads)),
        int(key("ssm.time_step_rank")),
    )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": shapes["token_embd.weight"][0],  # the padded vocabulary: the embedding's rows
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel", 4)),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(key("rope.freq_base", 10_000_000.0)),
            "partial_rotary_factor": int(key("rope.dimension_count", head_dim // 4)) / head_dim,
        },
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight"
        not in shapes,  # as for every architecture: no head, tied
        "max_position_embeddings": int(key("context_length", 262_144)),
        "eos_token_id": None if eos is None else int(eos),
    }


def mtp_layer(gguf_name: str, num_layers: int) -> bool:
    "A tensor of a block past the decoder's `num_layers`: the multi-token-prediction layer of a qwen35 file."
    m = re.match(r"blk\.(\d+)\.", gguf_name)
    return m is not None and int(m[1]) >= num_layers


# %% [markdown]
# The reordering, on 2 key heads with 2 value heads each, one dim per head: value heads
# `[k0v0, k0v1, k1v0, k1v1]` go to `[k0v0, k1v0, k0v1, k1v1]`, after the q and k rows; every
# transformation comes back exactly (the norms' `± 1` and `A_log`'s `log(exp)` to a rounding).

# %%
text = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=1, linear_value_head_dim=1
)
dim, order = qwen35_value_head_order(text, "model.layers.0.linear_attn.in_proj_qkv.weight")
assert dim == 0 and order.tolist() == [
    0,
    1,
    2,
    3,
    4,
    6,
    5,
    7,
]  # q0 q1 k0 k1, then v: k0v0 k1v0 k0v1 k1v1
assert qwen35_value_head_order(text, "model.layers.0.linear_attn.out_proj.weight")[0] == 1
assert qwen35_value_head_order(text, "model.layers.0.linear_attn.norm.weight") is None
assert (
    qwen35_value_head_order(text | dict(linear_num_key_heads=4), "model.layers.0.linear_attn.A_log")
    is None
)
for name, shape in [
    ("model.layers.0.linear_attn.in_proj_qkv.weight", (8, 3)),
    ("model.layers.0.linear_attn.conv1d.weight", (8, 1, 4)),
    ("model.layers.0.linear_attn.out_proj.weight", (3, 4)),
    ("model.layers.0.linear_attn.A_log", (4,)),
    ("model.layers.0.input_layernorm.weight", (3,)),
    ("model.layers.0.linear_attn.norm.weight", (3,)),
]:
    w = torch.randn(shape)
    stored = qwen35_to_llama_cpp(name, w, text)
    assert not torch.equal(stored, w) or name.endswith("linear_attn.norm.weight"), name
    torch.testing.assert_close(qwen35_from_llama_cpp(name, stored, text), w, rtol=1e-6, atol=1e-6)
assert qwen35_to_llama_cpp(
    "model.layers.0.linear_attn.conv1d.weight", torch.zeros(8, 1, 4), text
).shape == (8, 4)
torch.testing.assert_close(
    qwen35_to_llama_cpp("x.linear_attn.A_log", torch.zeros(4), text), -torch.ones(4)
)
assert hf_name("blk.2.ssm_a", "qwen35") == "model.layers.2.linear_attn.A_log"
assert hf_name("blk.2.ssm_dt.bias", "qwen35") == "model.layers.2.linear_attn.dt_bias"
assert (
    gguf_name("model.layers.2.post_attention_layernorm.weight", "qwen35")
    == "blk.2.post_attention_norm.weight"
)
assert (
    gguf_name("model.layers.2.post_attention_layernorm.weight") == "blk.2.ffn_norm.weight"
)  # Qwen3, Llama
assert mtp_layer("blk.4.nextn.eh_proj.weight", 4) and not mtp_layer("blk.3.attn_q.weight", 4)
assert not mtp_layer("output_norm.weight", 4)


# %% [markdown]
# ## `GGUFFile`
#
# Opening a file maps it into memory (nothing is read until it is touched), parses the header
# and checks every tensor's extent. `tensors()` then yields `(hf_name, tensor)` one at a time:
# only one tensor is ever dequantized at once, and the quantized bytes go to the target device
# *before* dequantizing, so a GPU moves 4-bit data over PCIe instead of float32.

# %%
#| export
class GGUFFile:
    "A memory-mapped GGUF file: decoded metadata, tensor infos, and tensors dequantized on demand."

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if self.path.stat().st_size == 0:
                raise ValueError(f"{self.path} is empty, not a GGUF file")
            # ACCESS_COPY: private copy-on-write pages, so torch may view them as writable memory
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.version, self.metadata, self.tensor_infos = read_gguf_header(self._buf, self.path)
        self._infos = {t.name: t for t in self.tensor_infos}

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensor_infos]

    def model_config(self) -> ModelConfig:
        if self.architecture == "qwen35":
            raise ValueError(
                f"{self.path} holds a Qwen3.5 model, whose shape is not a ModelConfig: read `hf_config()` "
                "with chapter 03b's `Qwen35Config.from_hf`"
            )
        return model_config_from_gguf(self.metadata, self.tensor_names)

    def hf_config(self) -> dict[str, Any]:
        "The text `config.json` of a `qwen35` file's model (chapter 03b's `Qwen35Config.from_hf` reads it)."
        return hf_config_from_gguf(self.metadata, self.tensor_infos)

    def raw(self, name: str) -> torch.Tensor:
        "The stored bytes of tensor `name` (a GGUF name) as a uint8 view of the mapped file."
        info = self._infos[name]
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def load(
        self,
        info: TensorInfo,
        config: ModelConfig | Mapping[str, Any],
        dtype=torch.float32,
        device="cpu",
    ) -> torch.Tensor:
        """One tensor, dequantized on `device`, in Hugging Face layout, cast to `dtype`. `config`: the
        `model_config()`, or for a qwen35 file its `hf_config()`."""
        w = dequantize(
            self.raw(info.name).to(device), info.qtype, info.shape, name=f"{self.path}: {info.name}"
        )
        if self.architecture == "qwen35":
            return qwen35_from_llama_cpp(hf_name(info.name, "qwen35"), w, config).to(dtype)
        if config.architecture == "llama" and re.match(r"blk\.\d+\.attn_[qk]\.", info.name):
            w = llama_cpp_unpermute(
                w, config.num_heads if ".attn_q." in info.name else config.num_kv_heads
            )
        return w.to(dtype)

    def tensors(self, dtype=torch.float32, device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
        "Yield `(hf_name, tensor)` in file order, one dequantized tensor at a time."
        # fails here, before any tensor, on an unsupported architecture
        qwen35 = self.architecture == "qwen35"
        config = self.hf_config() if qwen35 else self.model_config()
        for name in self.tensor_names:
            if name in SKIPPED_TENSORS:
                warnings.warn(f"{self.path}: skipping {name}: {SKIPPED_TENSORS[name]}")
        plan = [
            (hf_name(t.name, self.architecture), t)
            for t in self.tensor_infos
            if t.name not in SKIPPED_TENSORS
            and not (qwen35 and mtp_layer(t.name, config["num_hidden_layers"]))
        ]
        unsupported = sorted({t.qtype.name for _, t in plan if t.qtype not in DEQUANTIZERS})
        if unsupported:  # say so before the first tensor, not halfway through a load
            raise ValueError(
                f"{self.path}: tensors of type {', '.join(unsupported)} cannot be dequantized; "
                f"supported: {', '.join(q.name for q in DEQUANTIZERS)}"
            )
        return ((name, self.load(info, config, dtype, device)) for name, info in plan)

    def describe(self) -> dict[str, Any]:
        """A summary from the header: architecture, tensor and parameter counts, quant types, the file's
        quantization (`general.file_type`, else the commonest type of the matrices), context length, license."""
        quant_types = Counter(t.qtype.name for t in self.tensor_infos)
        file_type = self.metadata.get("general.file_type")
        if file_type in set(LlamaFileType):
            quantization = (
                LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            )
        else:
            matrices = Counter(t.qtype.name for t in self.tensor_infos if len(t.shape) > 1)
            quantization = (
                (matrices or quant_types).most_common(1)[0][0] if self.tensor_infos else None
            )
        return {
            "path": str(self.path),
            "architecture": self.architecture,
            "gguf_version": self.version,
            "tensors": len(self.tensor_infos),
            "parameters": sum(math.prod(t.shape) for t in self.tensor_infos),
            "quant_types": dict(quant_types.most_common()),
            "quantization": quantization,
            "context_length": self.metadata.get(f"{self.architecture}.context_length"),
            "license": self.metadata.get("general.license"),
            "file_bytes": len(self._buf),
        }

    def __repr__(self):
        return (
            f"GGUFFile({str(self.path)!r}, {self.architecture}, {len(self.tensor_infos)} tensors)"
        )


# %% [markdown]
# ## Writing a small GGUF
#
# To test the reader (and, later, the loader) without downloading anything we need GGUF files
# of tiny models. `write_gguf` is the reader run backwards: Hugging Face names to GGUF names,
# the llama.cpp permutation for Llama q/k, the `ModelConfig` as the metadata keys llama.cpp
# writes, and `gguf.GGUFWriter` for the bytes. Norms and biases stay F32, as llama.cpp keeps them.
# `write_qwen35_gguf` does the same for a Qwen3.5 model, from its text `config.json`, with the
# transformations of llama.cpp's converter (`qwen35_to_llama_cpp`).

# %%
#| export
def _add_key(writer, key: str, value) -> None:
    "A shape key typed as llama.cpp types it: u32 counts, f32 reals, arrays of their items."
    if isinstance(value, bool) or isinstance(value, list):
        writer.add_key_value(key, value, GGUFValueType.get_type(value))
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))


def _write_file(
    path: str | Path,
    arch: str,
    keys: Mapping[str, Any],
    token_ids: tuple[int | None, int | None],
    tensors: Iterator[tuple[str, str, torch.Tensor]],
    qtypes: Mapping[str, QType] | None,
    metadata: Mapping[str, Any] | None,
) -> Path:
    "Write `arch.<key>` shape keys, the bos / eos ids, `metadata`, and (hf name, GGUF name, stored tensor) triples."
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        _add_key(writer, f"{arch}.{key}", value)
    for which, token in zip(("bos", "eos"), token_ids):
        if token is not None:
            writer.add_uint32(f"tokenizer.ggml.{which}_token_id", token)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, value, GGUFValueType.get_type(value))
    for name, stored_name, w in tensors:
        w = w.detach().float().cpu()
        qtype = QType.F32 if w.dim() == 1 else (qtypes or {}).get(name, QType.F32)
        try:
            data = gguf.quants.quantize(w.numpy(), qtype)
        except (NotImplementedError, gguf.quants.QuantError) as e:
            raise ValueError(f"cannot write {name} as {qtype.name}: {e}") from None
        writer.add_tensor(stored_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_gguf(
    path: str | Path,
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    qtypes: Mapping[str, QType] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write Hugging Face-named `tensors` of a model shaped like `config` as a GGUF file.
    `qtypes` picks a type per tensor name (default F32); `metadata` adds keys (str, int, float, bool, lists).
    An untied model must include `lm_head.weight`: GGUF marks a tied model by its absence."""
    arch, c = config.architecture, config
    keys = {
        "block_count": c.num_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_heads,
        "attention.head_count_kv": c.num_kv_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "vocab_size": c.vocab_size,
        "rope.freq_base": float(c.rope_theta),
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
    }

    def stored(name: str, w: torch.Tensor):
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj\.", name):
            w = llama_cpp_permute(w, c.num_heads if ".q_proj." in name else c.num_kv_heads)
        return name, gguf_name(name), w

    eos = c.eos_token_ids[0] if c.eos_token_ids else None
    items = (stored(name, w) for name, w in tensors.items())
    return _write_file(path, arch, keys, (c.bos_token_id, eos), items, qtypes, metadata)


def write_qwen35_gguf(
    path: str | Path,
    text: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    qtypes: Mapping[str, QType] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a Qwen3.5 model as llama.cpp stores it (`qwen35`): `text` is its text `config.json`, `tensors` its
    checkpoint tensors (`model.layers.N...`; `lm_head.weight` unless tied). The inverse of the reading above."""
    heads, layers, value_heads = (
        text["num_attention_heads"],
        text["num_hidden_layers"],
        text["linear_num_value_heads"],
    )
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rope = text.get("rope_parameters") or {}
    layer_types = text.get("layer_types") or [
        "full_attention"
        if (i + 1) % text.get("full_attention_interval", 4) == 0
        else "linear_attention"
        for i in range(layers)
    ]
    keys = {
        "block_count": layers,
        "context_length": text.get("max_position_embeddings", 262_144),
        "embedding_length": text["hidden_size"],
        "feed_forward_length": text["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": text.get("num_key_value_heads") or heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.freq_base": float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
        "attention.layer_norm_rms_epsilon": text.get("rms_norm_eps", 1e-6),
        "ssm.conv_kernel": text.get("linear_conv_kernel_dim", 4),
        "ssm.state_size": text["linear_key_head_dim"],
        "ssm.group_count": text["linear_num_key_heads"],
        "ssm.time_step_rank": value_heads,
        "ssm.inner_size": text["linear_value_head_dim"] * value_heads,
        "attention.recurrent_layers": [t == "linear_attention" for t in layer_types],
        "full_attention_interval": text.get("full_attention_interval", 4),
        "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        # multimodal RoPE's sections (unused for text; llama.cpp requires them): Qwen3.5's default
        "rope.dimension_sections": (list(rope.get("mrope_section") or [11, 11, 10]) + [0])[:4],
    }
    eos = text.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
    items = (
        (name, gguf_name(name, "qwen35"), qwen35_to_llama_cpp(name, w, text))
        for name, w in tensors.items()
    )
    return _write_file(path, "qwen35", keys, (None, eos), items, qtypes, metadata)


# %% [markdown]
# A tiny Llama (so the q/k permutation is exercised) with weights in F32, Q8_0 and Q4_0,
# written and read back. F32 comes back exactly; quantized tensors come back as exactly what
# the reference dequantizer makes of the same bytes.

# %%
from forge_engine.config import preset
from forge_engine.model import empty_model, hf_state_dict, init_random_weights


def random_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    "Random Hugging Face-named weights of a model shaped like `config`."
    return {
        k: v.contiguous()
        for k, v in hf_state_dict(init_random_weights(empty_model(config), seed, std=0.02)).items()
    }


llama = preset("llama-tiny").replace(
    vocab_size=64,
    num_layers=2,
    hidden_size=64,
    head_dim=16,
    num_heads=4,
    bos_token_id=1,
    eos_token_ids=(2,),
)
state = random_state(llama)
qtypes = {
    "model.embed_tokens.weight": QType.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": QType.Q4_0,
    "model.layers.0.self_attn.k_proj.weight": QType.Q8_0,
    "model.layers.1.mlp.up_proj.weight": QType.Q4_0,
}
tokens = [f"tok{i}" for i in range(64)]
path = write_gguf(
    tmp / "llama.gguf",
    llama,
    state,
    qtypes,
    metadata={
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 63 + [3],
        "tokenizer.ggml.merges": ["t o", "to k"],
        "tokenizer.ggml.add_bos_token": False,
        "general.name": "tiny llama",
    },
)
f = GGUFFile(path)
f, f.describe()

# %%
assert f.architecture == "llama" and f.version == 3
assert f.metadata["tokenizer.ggml.tokens"] == tokens and f.metadata["tokenizer.ggml.merges"] == [
    "t o",
    "to k",
]
assert (
    f.metadata["tokenizer.ggml.token_type"][-2:] == [1, 3]
    and f.metadata["tokenizer.ggml.add_bos_token"] is False
)
assert (
    f.metadata["llama.attention.head_count_kv"] == 2 and f.metadata["general.name"] == "tiny llama"
)
assert f.model_config() == llama.replace(
    rms_norm_eps=f.model_config().rms_norm_eps
)  # eps went through float32
assert f.describe()["quant_types"] == {"F32": 17, "Q8_0": 2, "Q4_0": 2}
# no general.file_type: the commonest type of the matrices; the context length and license from the metadata
assert (f.describe()["quantization"], f.describe()["context_length"], f.describe()["license"]) == (
    "F32",
    4096,
    None,
)
assert f._infos["token_embd.weight"].shape == (64, 64)

loaded = dict(f.tensors())
assert list(loaded) == list(state)  # every tensor, in order, under its HF name
for name, w in loaded.items():
    assert w.shape == state[name].shape and w.dtype == torch.float32, name
    if name not in qtypes:
        assert torch.equal(w, state[name]), name
# quantized tensors: exactly the reference's reading of the stored bytes, un-permuted
q_ref = gguf.quants.dequantize(f.raw("blk.0.attn_q.weight").numpy(), QType.Q4_0).reshape(64, 64)
assert torch.equal(
    loaded["model.layers.0.self_attn.q_proj.weight"],
    llama_cpp_unpermute(torch.from_numpy(q_ref), 4),
)
for (
    name,
    qtype,
) in (
    qtypes.items()
):  # of the largest |w|, M: half a step, M / 254 (and the float16 scale's rounding);
    err = (
        (loaded[name] - state[name]).abs().max()
    )  # Q4_0's codes reach only 7/8 M on one side: M / 8
    assert (
        0 < err < {QType.Q8_0: 1 / 200, QType.Q4_0: 1 / 8 + 2**-10}[qtype] * state[name].abs().max()
    ), (name, err)
# the metadata and bytes agree with the gguf package's own reader
reader = gguf.GGUFReader(path)
assert {
    k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")
} == f.metadata
for t in reader.tensors:
    assert torch.equal(f.raw(t.name), torch.from_numpy(t.data.reshape(-1).view(np.uint8).copy())), (
        t.name
    )

# %% [markdown]
# `tensors(dtype, device)` casts after dequantizing; the generator holds one tensor at a time:

# %%
it = f.tensors(dtype=torch.bfloat16)
name, first = next(it)
assert name == "model.embed_tokens.weight" and first.dtype == torch.bfloat16
torch.testing.assert_close(
    first, loaded[name].bfloat16(), rtol=0, atol=0
)  # the same floats rounded once to bf16

# %% [markdown]
# Bad files fail with the file, the tensor and the sizes:

# %%
data = path.read_bytes()
(tmp / "truncated.gguf").write_bytes(data[:-100])
with pytest.raises(
    ValueError,
    match=r"tensor 'blk.1.ffn_norm.weight' \(F32, shape \[64\]\) needs bytes .* but the file has",
):
    GGUFFile(tmp / "truncated.gguf")
(tmp / "header_only.gguf").write_bytes(data[:300])
with pytest.raises(ValueError, match="header_only.gguf is truncated: .* needs bytes"):
    GGUFFile(tmp / "header_only.gguf")
(tmp / "notes.txt").write_text("not a model")
with pytest.raises(ValueError, match=r"notes.txt is not a GGUF file: it starts with b'not '"):
    GGUFFile(tmp / "notes.txt")


def write_named(path, arch: str, metadata: dict, tensors: dict[str, torch.Tensor]) -> Path:
    "A GGUF file with these metadata keys and these GGUF-named F32 tensors, for files `write_gguf` won't make."
    w = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if key != "general.architecture":
            w.add_key_value(key, value, GGUFValueType.get_type(value))
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


gemma_meta = {k.replace("llama.", "gemma."): v for k, v in f.metadata.items()}
gemma = GGUFFile(
    write_named(tmp / "gemma.gguf", "gemma", gemma_meta, {"output_norm.weight": torch.ones(64)})
)
with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
    gemma.tensors()

# %% [markdown]
# Unused tensors are skipped with a warning; unknown ones stop the load before any tensor is read:

# %%
norm, freqs = torch.rand(64), torch.rand(8)
extra = GGUFFile(
    write_named(
        tmp / "extra.gguf",
        "llama",
        f.metadata,
        {"rope_freqs.weight": freqs, "output_norm.weight": norm},
    )
)
with pytest.warns(UserWarning, match="skipping rope_freqs.weight: per-frequency rotary factors"):
    got = list(extra.tensors())
assert len(got) == 1 and got[0][0] == "model.norm.weight" and torch.equal(got[0][1], norm)

unknown = GGUFFile(
    write_named(
        tmp / "moe.gguf", "llama", f.metadata, {"blk.0.ffn_gate_exps.weight": torch.rand(4, 64)}
    )
)
with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
    unknown.tensors()

# %% [markdown]
# A type we cannot dequantize (here Q2_K, written as raw bytes) stops the load before any tensor:

# %%
w = gguf.GGUFWriter(tmp / "q2k.gguf", "llama")
for key, value in f.metadata.items():
    if key != "general.architecture":
        w.add_key_value(key, value, GGUFValueType.get_type(value))
w.add_tensor("output_norm.weight", np.ones(64, np.float32))
w.add_tensor(
    "blk.0.ffn_up.weight", np.zeros((128, 84), np.uint8), raw_dtype=QType.Q2_K
)  # 84 bytes = one Q2_K block
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
q2k = GGUFFile(tmp / "q2k.gguf")
assert q2k._infos["blk.0.ffn_up.weight"].shape == (128, 256)
with pytest.raises(
    ValueError, match=r"q2k.gguf: tensors of type Q2_K cannot be dequantized; supported: F32, F16"
):
    q2k.tensors()

# %% [markdown]
# Corrupt headers, made by changing single fields of a good file: a shape that runs into the
# next tensor, a type id that does not exist, a key that is not UTF-8. Each names the file and
# what is wrong.

# %%
import struct as _struct

two = write_named(
    tmp / "two.gguf",
    "llama",
    f.metadata,
    {"output_norm.weight": torch.ones(64), "blk.0.attn_norm.weight": torch.ones(64)},
)
good = two.read_bytes()


def patched(name: str, *, dim0: int | None = None, type_id: int | None = None) -> Path:
    "A copy of two.gguf with one field of tensor `name`'s info changed (a 1-dim tensor: n_dims, dim, type, offset)."
    key = _struct.pack("<Q", len(name)) + name.encode()
    at = good.index(key) + len(key)  # n_dims u32, then dim0 u64, then the type u32
    data = bytearray(good)
    if dim0 is not None:
        _struct.pack_into("<Q", data, at + 4, dim0)
    if type_id is not None:
        _struct.pack_into("<I", data, at + 12, type_id)
    out = tmp / f"patched-{name}-{dim0}-{type_id}.gguf"
    out.write_bytes(bytes(data))
    return out


assert GGUFFile(patched("output_norm.weight", dim0=64)).tensor_names == [
    "output_norm.weight",
    "blk.0.attn_norm.weight",
]
with pytest.raises(
    ValueError,
    match=r"is corrupt: tensor 'output_norm.weight' \(F32, shape \[96\]\) needs 384 bytes, "
    r"but the next tensor, 'blk.0.attn_norm.weight', starts 256 bytes after it",
):
    GGUFFile(patched("output_norm.weight", dim0=96))
with pytest.raises(
    ValueError, match=r"needs bytes .* but the file has"
):  # the last tensor runs past the end
    GGUFFile(patched("blk.0.attn_norm.weight", dim0=1 << 40))
with pytest.raises(
    ValueError,
    match="is corrupt: tensor 'output_norm.weight' has type id 99, which no GGUF type has",
):
    GGUFFile(patched("output_norm.weight", type_id=99))
(tmp / "bad_utf8.gguf").write_bytes(good.replace(b"general.name", b"\xffeneral.name", 1))
with pytest.raises(
    ValueError,
    match=r"bad_utf8.gguf is corrupt: metadata key #\d+ \(bytes \d+\.\.\d+\) is not UTF-8 text",
):
    GGUFFile(tmp / "bad_utf8.gguf")

# %% [markdown]
# ## A Qwen3.5 file, written and read back
#
# A tiny Qwen3.5 (chapter 03b; 2 key heads and 4 value heads, so the value heads move) with
# random weights of every kind, written as llama.cpp lays it out and read back: the config, every
# tensor and the logits come back, the matrices exactly from F32 and to F16's rounding from F16.
# The file's multi-token-prediction block is skipped.

# %%
from forge_engine.qwen3_5 import (
    QWEN35_TINY,
    Qwen35Config,
    empty_qwen35_model,
    init_random_qwen35,
    load_hf_state_dict,
    qwen35_config_json,
)

qwen35 = QWEN35_TINY.replace(eos_token_ids=(255,))
model35 = init_random_qwen35(empty_qwen35_model(qwen35), seed=3)
checkpoint = {
    ("" if k == "lm_head.weight" else "model.") + k: v for k, v in model35.state_dict().items()
}
text35 = qwen35_config_json(qwen35)
path35 = write_qwen35_gguf(tmp / "qwen35.gguf", text35, checkpoint)
f35 = GGUFFile(path35)
assert "blk.0.ssm_a" in f35.tensor_names and "blk.3.post_attention_norm.weight" in f35.tensor_names
assert f35._infos["blk.0.ssm_conv1d.weight"].shape == (128, 4)
with pytest.raises(ValueError, match="holds a Qwen3.5 model"):
    f35.model_config()
assert Qwen35Config.from_hf(f35.hf_config()) == qwen35.replace(
    rms_norm_eps=f35.hf_config()["rms_norm_eps"]
)
read35 = dict(f35.tensors())
assert read35.keys() == checkpoint.keys()
for (
    name,
    w,
) in read35.items():  # exact but for A_log's log(exp) and the norms' + 1 - 1: a few ulps of 1
    torch.testing.assert_close(w, checkpoint[name], rtol=1e-6, atol=2e-7, msg=name)

# the same file with a multi-token-prediction block after the decoder's 4: the same model
stored = {t.name: dequantize(f35.raw(t.name), t.qtype, t.shape) for t in f35.tensor_infos}
with_mtp = f35.metadata | {
    "qwen35.block_count": 5,
    "qwen35.nextn_predict_layers": 1,
    "qwen35.attention.recurrent_layers": f35.metadata["qwen35.attention.recurrent_layers"]
    + [False],
}
mtp_block = {
    "blk.4.nextn.eh_proj.weight": torch.randn(64, 128),
    "blk.4.attn_q.weight": torch.randn(256, 64),
}
f_mtp = GGUFFile(write_named(tmp / "qwen35-mtp.gguf", "qwen35", with_mtp, stored | mtp_block))
assert f_mtp.hf_config() == f35.hf_config() and "blk.4.attn_q.weight" in f_mtp.tensor_names
assert [name for name, _ in f_mtp.tensors()] == list(read35)

# %% [markdown]
# The same weights in F16 matrices, loaded into a fresh model: logits within F16's rounding.

# %%
matrices = {name: QType.F16 for name, w in checkpoint.items() if w.dim() > 1}
f16 = GGUFFile(write_qwen35_gguf(tmp / "qwen35-f16.gguf", text35, checkpoint, matrices))
assert f16.describe()["quant_types"]["F16"] == len(matrices)
reloaded = empty_qwen35_model(Qwen35Config.from_hf(f16.hf_config()))
load_hf_state_dict(reloaded, f16.tensors())
ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    want = model35.compute_logits(model35(ids, torch.arange(30)))
    got = reloaded.compute_logits(reloaded(ids, torch.arange(30)))
# weights rounded to F16 (2^-11 relative) through 4 layers: logits of size ~1 move by ~1e-3
torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
assert not torch.equal(got, want)  # F16 did round
print(f"qwen35 F16 round trip: max |logit diff| {(got - want).abs().max():.1e}")
