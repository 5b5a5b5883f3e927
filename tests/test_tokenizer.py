"""Tokenizer tests against the real Qwen3 tokenizer.json and SmolLM2 GGUF (fetched through the registry),
with Hugging Face `transformers` and the GGUF's own Jinja template as independent references.

The light checks (toy vocabularies, template strings, error messages) are test cells in
nbs/02_tokenizer.ipynb.
"""

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_engine.gguf_file import GGUFFile
from forge_engine.registry import fetch
from forge_engine.tokenizer import (
    PRE_TOKENIZERS,
    SMOLLM2_SYSTEM_PROMPT,
    IncrementalDetokenizer,
    Tokenizer,
    bpe_from_gguf_metadata,
)

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

TEXTS = [
    "Hello, world!",
    "The year 2025 had 365 days; π ≈ 3.14159, 1,000,000 and 0.5%.",
    "東京は日本の首都です。中文测试：你好，世界！한국어 문장입니다.",
    "Emoji: 😀🎉🦜🫠 👨‍👩‍👧 🇫🇷 and a rare one: 𠀀 龘",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\r\n",
    "I'LL say it's   spaced    out   \n \n  and don't stop",
    "Ünïcödé ﬁ café (NFC: e\u0301) Ω≈ç√∫ ℵ₀",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>",
]


@pytest.fixture(scope="module")
def qwen_file() -> Path:
    return fetch("qwen3-tokenizer")


@pytest.fixture(scope="module")
def qwen(qwen_file) -> Tokenizer:
    return Tokenizer.from_file(qwen_file)


@pytest.fixture(scope="module")
def qwen_hf(qwen_file):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_file))


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_meta(smol_path) -> dict:
    return GGUFFile(smol_path).metadata


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta)


# --- Qwen3 from tokenizer.json ------------------------------------------------------------------


def test_qwen_special_ids(qwen):
    names = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    assert [qwen.token_to_id(t) for t in names] == [IM_START, IM_END, ENDOFTEXT]
    assert [qwen.id_to_token(i) for i in (IM_START, IM_END, ENDOFTEXT)] == names
    assert qwen.eos_token_ids == (IM_END, ENDOFTEXT)
    assert qwen.bos_token_id is None and qwen.vocab_size == 151_669


@pytest.mark.parametrize("text", TEXTS)
def test_qwen_matches_transformers(qwen, qwen_hf, text):
    ids = qwen.encode(text)
    assert ids == qwen_hf.encode(text, add_special_tokens=False)
    assert qwen.decode(ids) == qwen_hf.decode(ids, skip_special_tokens=False)
    assert qwen.decode(ids, skip_special_tokens=True) == qwen_hf.decode(
        ids, skip_special_tokens=True
    )


def test_qwen_hello_world(qwen, qwen_hf):
    expected = qwen_hf.encode("Hello, world!", add_special_tokens=False)
    assert qwen.encode("Hello, world!") == expected == [9707, 11, 1879, 0]


def test_qwen_chat_template_multi_turn(qwen, qwen_hf):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in words? 你好 🎉"},
    ]
    text = qwen.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd in words? 你好 🎉<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    # expected ids built independently: each special token by id, each text piece encoded by transformers
    def plain(s):
        return qwen_hf.encode(s, add_special_tokens=False)

    newline = plain("\n")
    expected = []
    for m in messages:
        expected += [IM_START, *plain(m["role"] + "\n" + m["content"]), IM_END, *newline]
    expected += [IM_START, *plain("assistant\n")]
    assert qwen.encode_chat(messages) == expected
    assert qwen_hf.encode(text, add_special_tokens=False) == expected
    no_prompt = qwen.encode_chat(messages[:3], add_generation_prompt=False)
    assert no_prompt[-2:] == [IM_END, *newline] and no_prompt == expected[: len(no_prompt)]


def test_qwen_padding_ids_are_not_tokens(qwen):
    with pytest.raises(ValueError, match="151935"):
        qwen.decode([151935])  # the last embedding row of Qwen3-4B: padding, no token


# --- SmolLM2 from GGUF metadata ----------------------------------------------------------------


def test_smollm2_ids_and_template_choice(smol, smol_meta):
    assert smol_meta["tokenizer.ggml.pre"] == "smollm"
    assert [smol.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")] == [
        1,
        2,
        0,
    ]
    assert smol.eos_token_ids == (2, 0) and smol.bos_token_id == 1
    assert smol.vocab_size == 49152 and smol.chat_template == "smollm2-chatml"
    assert smol.encode("hi", add_special_tokens=True) == smol.encode(
        "hi"
    )  # the file says add_bos_token=False


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text  # no normaliser: byte-exact


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "system", "content": "late system"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_gguf_jinja(smol, smol_meta, messages, add_generation_prompt):
    jinja2 = pytest.importorskip("jinja2")
    source = smol_meta["tokenizer.chat_template"]
    assert SMOLLM2_SYSTEM_PROMPT in source
    template = jinja2.Environment().from_string(source)
    expected = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert smol.apply_chat_template(messages, add_generation_prompt) == expected


def test_smollm2_matches_transformers_gguf_conversion(smol, smol_path):
    transformers = pytest.importorskip("transformers")
    try:
        reference = transformers.AutoTokenizer.from_pretrained(
            str(smol_path.parent), gguf_file=smol_path.name, local_files_only=True
        )
    except Exception as e:  # e.g. a transformers version that wants the hub for this
        pytest.skip(f"transformers could not build a tokenizer from the GGUF offline: {e!r}")
    for text in TEXTS + ["x = 12345 + 678; y=0.25", "  leading spaces and trailing  "]:
        assert smol.encode(text) == reference.encode(text, add_special_tokens=False), text


def test_other_families_build_from_smollm2_metadata(smol_meta):
    # the cut rule changes how numbers split, but every family must still round-trip text
    for pre in PRE_TOKENIZERS:
        tok = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": pre})
        for text in TEXTS:
            expected = unicodedata.normalize("NFC", text) if PRE_TOKENIZERS[pre].nfc else text
            assert tok.decode(tok.encode(text)) == expected


def test_add_bos_token_from_metadata(smol_meta):
    tok = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]


def test_qwen2_family_rebuilt_from_tokenizer_json_matches(qwen, qwen_file):
    "A GGUF-style description of Qwen3's vocabulary with pre='qwen2' tokenizes exactly like tokenizer.json."
    data = json.loads(qwen_file.read_text(encoding="utf-8"))
    vocab = dict(data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]})
    pieces = sorted(vocab, key=vocab.get)
    assert [vocab[p] for p in pieces] == list(range(len(pieces)))
    special = {t["content"]: t["special"] for t in data["added_tokens"]}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.merges": [" ".join(m) for m in data["model"]["merges"]],
        "tokenizer.ggml.token_type": [
            1 if p not in special else 3 if special[p] else 4 for p in pieces
        ],
        "tokenizer.ggml.eos_token_id": IM_END,
    }
    rebuilt = Tokenizer.from_gguf_metadata(meta, chat_template="qwen3-instruct")
    for text in TEXTS:
        assert rebuilt.encode(text) == qwen.encode(text), text
    assert rebuilt.eos_token_ids == (IM_END, ENDOFTEXT)
    assert (
        rebuilt.decode([151667], skip_special_tokens=True) == "<think>"
    )  # user-defined: stays text


def test_bad_gguf_metadata(smol_meta):
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'llama'"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model None"):
        Tokenizer.from_gguf_metadata(
            {k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.model"}
        )
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'deepseek-llm'"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "deepseek-llm"})
    with pytest.raises(ValueError, match="49152 tokens but 3 token types"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.token_type": [3, 3, 3]})
    with pytest.raises(
        ValueError, match="tokenizer.ggml.bos_token_id = 49152 is outside the 49152 tokens"
    ):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.bos_token_id": 49152})
    with pytest.raises(ValueError, match="add_space_prefix"):
        bpe_from_gguf_metadata({**smol_meta, "tokenizer.ggml.add_space_prefix": True})
    unknown = Tokenizer.from_gguf_metadata(
        {**smol_meta, "tokenizer.chat_template": "{{ messages }}"}
    )
    assert unknown.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        unknown.apply_chat_template([{"role": "user", "content": "hi"}])


# --- incremental detokenizer ------------------------------------------------------------------


def stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("name", ["qwen", "smol"])
def test_detokenizer_holds_split_characters(name, request):
    tok = request.getfixturevalue(name)
    text = "Emoji 🫠🦜 and CJK 𠀀龘鬱 end"
    ids = tok.encode(text)
    alone = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in a for a in alone) >= 4  # several ids carry only part of a character
    deltas = stream(tok, ids, prompt_ids=tok.encode_chat([{"role": "user", "content": "go"}]))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    assert deltas.count("") >= 3  # held back while a character was incomplete


class CountingBackend:
    "A backend that records how many ids each decode call gets."

    def __init__(self, backend):
        self.backend, self.lengths = backend, []

    def decode(self, ids, skip_special_tokens):
        self.lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self, with_added_tokens=True):
        return self.backend.get_vocab_size(with_added_tokens=with_added_tokens)


def test_detokenizer_window_stays_small(qwen):
    counting = CountingBackend(qwen.backend)
    tok = Tokenizer(counting, eos_token_ids=())
    ids = qwen.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 2000
    deltas = stream(tok, ids, prompt_ids=list(range(1000)))
    assert "".join(deltas) == qwen.decode(ids, skip_special_tokens=True)
    assert max(counting.lengths) <= 8  # never the whole output, never the whole prompt


def test_detokenizer_specials_padding_and_errors(qwen):
    ids = [*qwen.encode("Paris"), IM_END]
    assert "".join(stream(qwen, ids)) == "Paris"
    assert "".join(stream(qwen, ids, skip_special_tokens=False)) == "Paris<|im_end|>"
    assert stream(qwen, [*qwen.encode("ok"), 151_900]) == [
        "ok",
        "",
        "",
    ]  # an embedding padding row has no text
    detok = IncrementalDetokenizer(qwen)
    for bad in (-1, 1.5, "7", True, None):
        with pytest.raises(ValueError, match="a token id must be a non-negative int"):
            detok.add(bad)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        IncrementalDetokenizer(qwen, prompt_ids=[10**6])


def test_detokenizer_accepts_tensor_and_numpy_ids(qwen):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    ids = qwen.encode("Hi 🫠")
    assert "".join(stream(qwen, np.array(ids))) == "Hi 🫠"
    assert "".join(stream(qwen, torch.tensor(ids), prompt_ids=torch.tensor(ids))) == "Hi 🫠"


def gpt2_byte_pieces() -> dict[int, str]:
    "byte -> the printable character byte-level BPE draws it as."
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(shifted)}


BYTE_PIECES = gpt2_byte_pieces()
no_replacement_char = st.text(
    st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=80
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=no_replacement_char)
def test_detokenizer_property_qwen(qwen, text):
    ids = qwen.encode(text)
    deltas = stream(qwen, ids, skip_special_tokens=False)  # hypothesis does try "<|im_end|>"
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == qwen.decode(ids) == unicodedata.normalize("NFC", text)


def test_smollm2_vocabulary_lacks_some_bytes(smol):
    "SmolLM2 has no piece for 21 byte values; text needing them is dropped (transformers does the same)."
    missing = {
        b for b, piece in gpt2_byte_pieces().items() if smol.backend.token_to_id(piece) is None
    }
    assert missing == {
        0x04,
        0x06,
        0x13,
        0x14,
        0x16,
        0x1D,
        0xC0,
        0xC1,
        0xF1,
        0xF2,
        *range(0xF5, 0x100),
    }
    assert smol.decode(smol.encode("a\x06b")) == "ab"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=no_replacement_char)
def test_detokenizer_property_smollm2(smol, text):
    ids = smol.encode(text)
    full = smol.decode(ids)
    deltas = stream(smol, ids, skip_special_tokens=False)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # a character whose lead byte SmolLM2 lacks decodes to U+FFFD anyway
        assert not any("\ufffd" in d for d in deltas)
    if all(smol.backend.token_to_id(BYTE_PIECES[b]) is not None for b in text.encode()):
        assert full == text


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 49151), max_size=40))
def test_detokenizer_random_ids_match_full_decode(smol, ids):
    "Even for id sequences no text encodes to (a random-weight model's output), the stream adds up."
    assert "".join(stream(smol, ids)) == smol.decode(ids, skip_special_tokens=True)


def test_qwen_tools_render_as_qwen3s_own_template(qwen, qwen_hf):
    "Tools, tool calls and tool results, against the Jinja template of Qwen3's tokenizer_config.json (fetched)."
    template = json.loads(fetch("qwen3-tokenizer-config").read_text())["chat_template"]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo: the weather now",
                "parameters": {
                    "type": "object",
                    "required": ["city"],
                    "properties": {"city": {"type": "string"}},
                },
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    conversations = [
        [{"role": "user", "content": "Weather and time in Paris?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": "18 C"},
            {"role": "tool", "tool_call_id": "b", "content": "noon"},
        ],
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls[:1]},
            {"role": "tool", "tool_call_id": "a", "content": "18 C"},
            {"role": "assistant", "content": "18 C."},
            {"role": "user", "content": "Thanks"},
        ],
    ]
    for messages in conversations:
        for with_tools in (tools, None):
            hf_messages = [
                {**m, "content": m["content"] or ""} for m in messages
            ]  # Jinja concatenates content
            expected = qwen_hf.apply_chat_template(
                hf_messages,
                tools=with_tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=True,
            )
            assert qwen.apply_chat_template(messages, tools=with_tools) == expected
