"""The chat page in real headless Chromium (Debian's, driven by playwright) against the real server and engine.

The model is scripted so the test knows what it will say: every reply is SCRIPT (which holds HTML
and a <script>) followed by " la" until max_tokens. It is a real model to the engine: it runs
over the paged KV cache, and finds its place in the script the way a transformer would, by
attending back to the last <|im_start|> token and reading its position."""

import importlib.util
import json
import os
import re
import time

import httpx
import pytest
import torch

from forge_engine.async_engine import AsyncEngine
from forge_engine.config import EngineConfig, ModelConfig
from forge_engine.engine import LLMEngine
from forge_engine.loader import LoadedModel
from forge_engine.registry import fetch
from forge_engine.server.app import create_app
from forge_engine.server.serve import ServerThread
from forge_engine.tokenizer import Tokenizer
from test_chat import WEATHER  # (the same tool as the terminal chat's tests)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCRIPT = "Hello! Here is <b>html</b> and <script>window.pwned = 1</script>, as text."


class ScriptedModel(torch.nn.Module):
    "Says `script` at the start of every assistant turn, then `tail` forever."

    def __init__(self, config: ModelConfig, script: list[int], tail: int, turn_start: int):
        super().__init__()
        self.config, self.turn_start = config, turn_start
        self.tokens = torch.tensor(script + [tail])
        self.anchor = torch.nn.Parameter(
            torch.zeros(1)
        )  # the engine reads device and dtype from a parameter

    def forward(self, ids, positions, attention):
        pos = positions.float()
        is_start = (ids == self.turn_start).float()
        # one head: a key only on <|im_start|> tokens, growing with position, so the query picks the last one
        k = torch.stack([is_start * (pos + 1) * 30, torch.zeros_like(pos)], -1)[:, None, :]
        v = torch.stack([pos, torch.zeros_like(pos)], -1)[:, None, :]
        q = torch.tensor([1.0, 0.0]).expand(len(ids), 1, 2)
        turn_at = attention(0, q, k, v)[
            :, 0, 0
        ]  # position of the last <|im_start|> up to each token
        return (pos - turn_at - 2)[
            :, None
        ]  # after "<|im_start|>assistant\n": 0 at the first reply token

    def compute_logits(self, hidden):
        index = hidden[:, 0].round().long().clamp(0, len(self.tokens) - 1)
        logits = torch.zeros(len(hidden), self.config.vocab_size)
        logits[torch.arange(len(hidden)), self.tokens[index]] = (
            50.0  # certain even at temperature 1
        )
        return logits


def need_browser():
    missing = [
        what
        for what, ok in (
            (CHROMIUM, os.path.exists(CHROMIUM)),
            ("playwright", importlib.util.find_spec("playwright") is not None),
        )
        if not ok
    ]
    if missing and os.environ.get("CI"):
        pytest.fail(
            f"missing {', '.join(missing)}: the test command must run .dev/install_browser.sh"
        )
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: run .dev/install_browser.sh")


@pytest.fixture(scope="module")
def served():
    need_browser()
    tokenizer = Tokenizer.from_file(fetch("qwen3-tokenizer"))
    config = ModelConfig(
        "qwen3",
        vocab_size=151936,
        hidden_size=1,
        intermediate_size=1,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=2,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    model = ScriptedModel(
        config,
        tokenizer.encode(SCRIPT),
        tokenizer.encode(" la")[0],
        tokenizer.token_to_id("<|im_start|>"),
    )
    engine = AsyncEngine(
        LLMEngine(
            LoadedModel("scripted", model, tokenizer, None), EngineConfig(kv_cache_bytes=2**16)
        )
    )
    app = create_app(engine, "scripted")
    with ServerThread(app) as url:
        yield url, engine
    engine.close()


@pytest.fixture(scope="module")
def page(
    served,
):  # the page's CSP stays on: strings playwright evaluates must be functions, not eval'd code
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.set_default_timeout(30_000)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(served[0])
        yield page
        browser.close()
        assert errors == []  # no script error, and no CSP violation broke our own script


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    raise KeyError(name)


def test_the_scripted_model_says_its_script(served):
    from forge_engine.generate import SamplingParams

    url, engine = served
    prompt = engine.engine.loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    out = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0), timeout=30)
    assert out.text.startswith(SCRIPT + " la la")


def test_streamed_reply_shows_html_as_text_and_stop_aborts(served, page):
    url, engine = served
    page.wait_for_function("() => document.getElementById('model').textContent === 'scripted'")
    page.fill("#max-tokens", "3000")
    page.fill("#prompt", "<i>hi</i> & please answer")
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").last
    lengths, deadline = set(), time.monotonic() + 30
    while True:  # watch it grow until the script's repeats show and two partial texts were seen (streamed, not all
        text = (
            reply.text_content()
        )  # at once); the reply runs on for up to 3,000 tokens, so there is time to see it
        if text:
            lengths.add(len(text))
        if "la la la la" in text and len(lengths) >= 2:
            break
        assert time.monotonic() < deadline, (text, lengths)
        time.sleep(0.02)
    page.wait_for_function("() => document.getElementById('running').textContent === '1'")
    assert re.match(r"KV blocks: [1-9]\d* used", page.text_content("#kv"))
    assert page.is_disabled("#send") and page.is_enabled("#stop")

    page.click("#stop")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.msg.assistant')].pop().classList.contains('stopped')"
    )
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    stopped_at = reply.text_content()
    time.sleep(0.5)
    assert (
        reply.text_content() == stopped_at and len(stopped_at) < len(SCRIPT) + 3 * 2000
    )  # no more text came
    deadline = (
        time.monotonic() + 10
    )  # and the engine let it go: aborted, nothing running, no blocks held
    while metric(url, "forge_requests_running") or metric(url, "forge_kv_cache_used_blocks"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(url, 'forge_requests_total{finish_reason="abort"}') == 1
    page.wait_for_function("() => document.getElementById('running').textContent === '0'")

    assert stopped_at.startswith(SCRIPT)  # the model's HTML, shown as the characters it is made of
    assert page.locator(".msg.user").last.text_content() == "<i>hi</i> & please answer"
    assert page.locator("#log b, #log i, #log script").count() == 0  # nothing became an element
    assert page.evaluate("window.pwned") is None  # and nothing ran
    assert re.fullmatch(r"\d+ tokens, \d+\.\d tok/s", page.text_content("#speed"))


def test_a_reply_that_ends_by_itself(served, page):
    page.fill("#max-tokens", "30")
    page.fill("#prompt", "once more")
    page.click("#send")
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant').length === 2 && "
        "!document.getElementById('send').disabled"
    )
    reply = page.locator(".msg.assistant").last
    assert reply.text_content().startswith(SCRIPT) and "stopped" not in reply.get_attribute("class")
    assert page.text_content("#speed").startswith("30 tokens, ")  # the usage chunk's count
    assert page.locator(".msg.error").count() == 0


def sse_chunks(text: str) -> list[dict]:
    return [
        json.loads(event[len("data: ") :])
        for event in text.split("\n\n")
        if event.startswith("data: {")
    ]


def test_tool_calls_show_as_blocks_and_their_results_go_back(served, page):
    "A bad tools box is refused readably; a forced call shows as a block; its result goes back."
    sent, answers = [], []

    def on_response(response):
        if response.url.endswith("/v1/chat/completions"):
            sent.append(json.loads(response.request.post_data))
            answers.append(response)

    page.on("response", on_response)
    users, assistants = page.locator(".msg.user").count(), page.locator(".msg.assistant").count()
    page.fill("#tools", "[{")
    assert page.text_content("#tools-error").startswith("tools: not JSON: ")
    page.fill("#tools", json.dumps([{"type": "function", "function": {"name": "get weather"}}]))
    assert page.text_content("#tools-error").startswith("tools[0] must be {")
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")  # refused: nothing sent, the message stays in the box
    assert page.locator(".msg.user").count() == users
    assert page.input_value("#prompt") == "Weather in Paris?"

    page.fill("#tools", json.dumps([WEATHER]))
    assert page.text_content("#tools-error") == ""
    page.select_option(
        "#tool-choice", "get_weather"
    )  # the grammar makes the call, whatever the model
    page.fill("#max-tokens", "120")
    page.press("#prompt", "Enter")
    block = page.locator(".msg.tool-call")
    block.wait_for()
    page.wait_for_function("() => document.getElementById('stop').disabled")
    assert block.count() == 1 and block.locator(".call-name").text_content() == "\u2192 get_weather"
    shown = block.locator(".call-args").text_content()
    assert shown.startswith('{\n  "city": ') and list(json.loads(shown)) == ["city"]  # pretty JSON
    assert "<tool_call>" not in page.text_content("#log")
    assert page.locator(".msg.assistant").count() == assistants  # no empty bubble for a call
    assert page.is_disabled("#send")  # the call waits for its result first
    assert sent[-1]["tools"] == [WEATHER] and sent[-1]["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    [call] = [
        piece
        for chunk in sse_chunks(answers[-1].text())
        for choice in chunk["choices"]
        for piece in choice["delta"].get("tool_calls") or []
    ]
    assert json.loads(call["function"]["arguments"]) == json.loads(shown)

    block.locator(".tool-result").fill('{"temperature": 18, "sky": "clear"}')
    block.locator("button").click()
    page.wait_for_function(
        f"() => document.querySelectorAll('.msg.assistant').length === {assistants + 1} && "
        "!document.getElementById('send').disabled"
    )
    assert len(sent) == 2 and sent[1]["tool_choice"] == "auto"  # replies to results choose
    assert sent[1]["messages"][-2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{k: call[k] for k in ("id", "type", "function")}],
        },
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": '{"temperature": 18, "sky": "clear"}',
        },
    ]
    assert page.locator(".msg.assistant").last.text_content().startswith(SCRIPT)  # it answered
    assert block.locator(".tool-result").is_disabled()
    assert page.locator(".msg.error").count() == 0
