"""The real server process on loopback, driven by the official `openai` client: streaming and whole
replies, errors as the client's exception types, backpressure, and 32 streams half of which hang up."""

import asyncio
import base64
import hashlib
import json
import importlib.resources
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key-123"
TINY = "random:qwen3-tiny"
ENTRY = "import sys; from forge_engine.server.serve import main; sys.exit(main(sys.argv[1:]))"
HELLO = [{"role": "user", "content": "Tell me about the forge, the anvil and the hammer."}]
HAMMER = 23457  # " hammer" in the Qwen3 vocabulary: a logit bias of +100 pins greedy decoding to it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    "`forge-engine serve` in a child process on a free loopback port; its output goes to a log file."

    def __init__(self, log_path, *args, env=None):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY, "--port", self.url.rsplit(":", 1)[1], *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        self.health_seen: list[
            tuple[int, str]
        ] = []  # (status, body["status"]) of each /health poll
        self.ready = threading.Event()
        threading.Thread(target=self._poll_health, daemon=True).start()

    def _poll_health(self, timeout: float = 150) -> None:
        "From the start on, until it says ok (or exits, or the time is up)."
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health_seen.append((r.status_code, r.json()["status"]))
                if r.status_code == 200:
                    return self.ready.set()
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def wait_ready(self, timeout: float = 160) -> "ServerProcess":
        if not self.ready.wait(timeout):
            raise AssertionError(
                f"server not ready (exit code {self.proc.poll()}):\n{self.log_path.read_text()}"
            )
        return self

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends: uvicorn shuts down gracefully
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def metric(self, name: str) -> float:
        "One sample of /metrics by its full name, labels included."
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
        raise KeyError(name)

    def wait_metric(self, condition, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self):
            assert time.monotonic() < deadline, httpx.get(self.url + "/metrics").text
            time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    "Started together (they load in parallel), each waited for on first use."
    logs = tmp_path_factory.mktemp("servers")
    started = {
        "tiny": ServerProcess(
            logs / "tiny.log",
            "--model",
            TINY,
            "--kv-cache-bytes",
            str(2**24),
            env={"FORGE_API_KEY": KEY},
        ),
        "small": ServerProcess(
            logs / "small.log",
            "--model",
            TINY,
            "--served-model-name",
            "small",
            "--max-num-seqs",
            "1",
            "--max-waiting",
            "1",
            "--kv-cache-bytes",
            str(2**21),
            "--cors-origin",
            "http://localhost:5173",
        ),
        "smol": ServerProcess(
            logs / "smol.log", "--model", "smollm2-135m-instruct", "--max-num-seqs", "4"
        ),
        "draft": ServerProcess(  # the same random model as its own draft model (chapter 08d)
            logs / "draft.log",
            "--model",
            TINY,
            "--draft-model",
            TINY,
            "--speculative-tokens",
            "3",
            "--kv-cache-bytes",
            str(2**24),
            env={"FORGE_API_KEY": KEY},
        ),
    }
    yield started
    codes = {name: server.stop() for name, server in started.items()}
    assert codes["tiny"] == 0, started["tiny"].log_path.read_text()  # a clean shutdown on Ctrl-C


@pytest.fixture
def tiny(servers):
    return servers["tiny"].wait_ready()


@pytest.fixture
def small(servers):
    return servers["small"].wait_ready()


def client(server, api_key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def test_chat_whole_and_streamed(tiny):
    c = client(tiny)
    pinned = dict(
        model=TINY, messages=HELLO, max_tokens=8, temperature=0, logit_bias={str(HAMMER): 100}
    )
    whole = c.chat.completions.create(**pinned)
    assert (
        whole.object == "chat.completion"
        and whole.model == TINY
        and whole.id.startswith("chatcmpl-")
    )
    assert (
        whole.choices[0].message.role == "assistant"
        and whole.choices[0].message.content == " hammer" * 8
    )
    assert whole.choices[0].finish_reason == "length"
    assert (
        whole.usage.completion_tokens == 8
        and whole.usage.total_tokens == whole.usage.prompt_tokens + 8 > 8
    )

    chunks = list(
        c.chat.completions.create(**pinned, stream=True, stream_options={"include_usage": True})
    )
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " hammer" * 8
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1]) and len({ch.id for ch in chunks}) == 1
    assert (
        chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    )  # the same prompt again: prefix cache hit

    plain = list(
        c.chat.completions.create(**pinned, stream=True)
    )  # without include_usage: no usage chunk
    assert plain[-1].choices[0].finish_reason == "length" and all(ch.usage is None for ch in plain)


def test_chat_logprobs_and_stop(tiny):
    c = client(tiny)
    r = c.chat.completions.create(
        model=TINY,
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        alternatives = [a.logprob for a in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert (
            entry.logprob <= 0 and entry.logprob == alternatives[0]
        )  # greedy took the top one: one float of one row
    r = c.chat.completions.create(
        model=TINY,
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        stop=["hammer hammer"],
        logit_bias={str(HAMMER): 100},
    )
    assert (
        r.choices[0].finish_reason == "stop" and r.choices[0].message.content == " "
    )  # text before the stop string


def test_text_completions(tiny):
    c = client(tiny)
    pinned = dict(
        model=TINY, prompt="The forge", max_tokens=4, temperature=0, logit_bias={str(HAMMER): 100}
    )
    r = c.completions.create(**pinned, logprobs=2)
    assert (
        r.object == "text_completion"
        and r.choices[0].text == " hammer" * 4
        and r.choices[0].finish_reason == "length"
    )
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 4
    assert r.choices[0].logprobs.tokens == [" hammer"] * 4 and all(
        lp <= 0 for lp in r.choices[0].logprobs.token_logprobs
    )
    chunks = list(
        c.completions.create(**pinned, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " hammer" * 4
    assert chunks[-1].usage.completion_tokens == 4
    ids = c.completions.create(
        model=TINY, prompt=[785, 56628], max_tokens=3, temperature=0
    )  # token ids
    assert ids.usage.prompt_tokens == 2 and ids.usage.completion_tokens <= 3
    assert (
        c.completions.create(
            model=TINY, prompt="Hi", temperature=0, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 16
    )


def test_models(tiny):
    c = client(tiny)
    assert [m.id for m in c.models.list()] == [TINY]
    assert c.models.retrieve(TINY).owned_by == "forge-engine"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_errors_are_the_openai_clients_exceptions(tiny):
    c = client(tiny)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=HELLO, n=17)
    assert e.value.param == "n" and "[1, 16]" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as e:
        client(tiny, api_key="wrong").chat.completions.create(model=TINY, messages=HELLO)
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi " * 5000}])
    assert re.search(r"prompt has \d{4} tokens; the context holds 4096", e.value.message)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=HELLO, extra_body={"temperature": "hot"})
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=TINY, messages=[{"role": "robot", "content": "x"}])
    assert e.value.param == "messages" and "role 'robot'" in e.value.message


def test_raw_http_errors_keep_the_openai_shape(tiny):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = (b"x" * 65536 for _ in range(80))  # 5 MiB, chunked: no Content-Length to refuse it by
    r = httpx.post(tiny.url + "/v1/chat/completions", content=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(tiny.url + "/v1/chat/completions", content=b"{oops", headers=auth)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(tiny.url + "/v2/whatever", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v2/whatever"
    assert httpx.get(tiny.url + "/v1/models").status_code == 401  # no key at all
    assert (
        "access-control-allow-origin"
        not in httpx.get(tiny.url + "/health", headers={"Origin": "http://x.test"}).headers
    )


def test_chat_page_is_the_packaged_files(tiny):
    "The page comes from the package data (found by importlib.resources), its CSP pinned to the files' bytes."
    static = importlib.resources.files("forge_engine.server") / "static"
    script, style = (static / "chat.js").read_bytes(), (static / "chat.css").read_bytes()
    assert (static / "chat.html").is_file() and b"textContent" in script
    r = httpx.get(tiny.url + "/")  # no API key needed for the page
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    inline = lambda tag: re.search(rf"<{tag}>(.*)</{tag}>".encode(), r.content, re.S).group(1)
    assert (inline("script"), inline("style")) == (script, style)
    sha = lambda code: "'sha256-" + base64.b64encode(hashlib.sha256(code).digest()).decode() + "'"
    policy = r.headers["content-security-policy"]
    assert f"script-src {sha(script)};" in policy and f"style-src {sha(style)};" in policy


def test_health_and_metrics_format(tiny):
    assert httpx.get(tiny.url + "/health").json() == {"status": "ok", "model": TINY}
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(tiny.url + "/metrics").text)
    }
    kinds = {
        "forge_time_to_first_token_seconds": "histogram",
        "forge_inter_token_latency_seconds": "histogram",
        "forge_e2e_request_latency_seconds": "histogram",
        "forge_request_queue_time_seconds": "histogram",
        "forge_prompt_tokens": "counter",
        "forge_generation_tokens": "counter",
        "forge_requests": "counter",
        "forge_requests_running": "gauge",
        "forge_requests_waiting": "gauge",
        "forge_kv_cache_usage_ratio": "gauge",
        "forge_kv_cache_used_blocks": "gauge",
        "forge_prefix_cache_hit_rate": "gauge",
    }
    assert {name: families[name].type for name in kinds} == kinds
    ttft_count = next(
        s.value
        for s in families["forge_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    )
    assert ttft_count >= 1 and tiny.metric("forge_generation_tokens_total") >= 8


def test_32_streams_half_of_them_hang_up(tiny):
    tokens = 48
    aborted_before = tiny.metric('forge_requests_total{finish_reason="abort"}')

    async def one(c: openai.AsyncOpenAI, i: int):
        stream = await c.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": f"Story number {i}, please."}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if i % 2 and len(chunks) == 2:  # the role chunk and the first token: then hang up
                await stream.close()
                return None
        return chunks

    async def all_streams():
        c = openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(32))), 150)

    results = asyncio.run(all_streams())
    for chunks in results[0::2]:
        assert chunks[-1].usage.completion_tokens == tokens
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert all(r is None for r in results[1::2])
    tiny.wait_metric(
        lambda s: (
            s.metric("forge_requests_running") == 0
            and s.metric("forge_requests_waiting") == 0
            and s.metric("forge_kv_cache_used_blocks") == 0
        )
    )
    assert tiny.metric('forge_requests_total{finish_reason="abort"}') == aborted_before + 16


def test_backpressure_429_then_recovery_and_cors(small):
    c = client(small, api_key="no key needed")
    short = dict(model="small", messages=HELLO, max_tokens=4, temperature=0)
    with httpx.Client(base_url=small.url, timeout=60) as http:
        running = http.send(
            http.build_request(
                "POST",
                "/v1/chat/completions",
                json={**short, "max_tokens": 2000, "ignore_eos": True, "stream": True},
            ),
            stream=True,
        )
        lines = running.iter_lines()  # keep it: dropping the iterator closes the connection
        assert next(lines).startswith("data: ")  # its first chunk: it holds the only running slot
        queued = {}
        waiter = threading.Thread(
            target=lambda: queued.update(reply=c.chat.completions.create(**short))
        )
        waiter.start()
        small.wait_metric(lambda s: s.metric("forge_requests_waiting") == 1)
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(**short)
        assert (
            e.value.response.headers["retry-after"] == "1" and e.value.code == "rate_limit_exceeded"
        )
        running.close()  # hang up: the slot frees, the queued request runs
        waiter.join(timeout=60)
    assert queued["reply"].choices[0].finish_reason in ("stop", "length")
    small.wait_metric(
        lambda s: (
            s.metric("forge_requests_running") == 0 and s.metric("forge_kv_cache_used_blocks") == 0
        )
    )
    preflight = httpx.options(
        small.url + "/v1/chat/completions",
        headers={"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:5173"


@pytest.mark.slow
def test_real_model_answers_paris_and_health_said_loading_first(servers):
    smol = servers["smol"].wait_ready()
    assert smol.health_seen[0] == (503, "loading") and smol.health_seen[-1] == (200, "ok")
    log = servers["smol"].log_path.read_text()
    assert "warmed up in" in log and log.index("warmed up in") < log.index("is ready"), (
        log
    )  # before /health said ok
    r = client(smol, api_key="unused").chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    # real weights under a JSON schema (chapter 06a): a document that validates, with the answer in it
    import jsonschema

    capital = {
        "type": "object",
        "additionalProperties": False,
        "required": ["country", "capital"],
        "properties": {
            "country": {"type": "string", "maxLength": 20},
            "capital": {"type": "string", "maxLength": 20},
        },
    }
    r = client(smol, api_key="unused").chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": capital},
        },
    )
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, capital)
    assert r.choices[0].finish_reason == "stop" and "Paris" in answer["capital"], answer


PLACE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "rank"],
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "coastal": {"type": "boolean"},
    },
}


def test_structured_outputs_hold_whatever_the_weights(tiny):
    "A random model under a JSON schema: every reply parses and validates, whole and streamed (chapter 06a)."
    import jsonschema

    c = client(tiny)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": PLACE, "strict": True},
    }
    for seed in range(4):
        r = c.chat.completions.create(
            model=TINY,
            messages=HELLO,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            response_format=response_format,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), PLACE)
    chunks = list(
        c.chat.completions.create(
            model=TINY,
            messages=HELLO,
            max_tokens=60,
            temperature=1.0,
            seed=7,
            response_format=response_format,
            stream=True,
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), PLACE)
    assert [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ] == ["stop"]
    # vLLM's extra fields, on the text endpoint too
    for seed in range(3):
        r = c.completions.create(
            model=TINY,
            prompt="Pick one:",
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": ["forge", "anvil", "hammer"]},
        )
        assert (
            r.choices[0].text in ("forge", "anvil", "hammer")
            and r.choices[0].finish_reason == "stop"
        )
    # every one of these requests got its grammar: compiled once per schema, then from the cache
    assert tiny.metric("forge_grammar_compile_seconds_count") >= 8


def test_structured_outputs_refused_with_the_field_named(tiny):
    c = client(tiny)
    cases = [
        ({"guided_regex": "[0-9"}, "guided_regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=TINY, messages=HELLO, max_tokens=4, extra_body=body)
        assert info.value.body["param"] == param, (body, info.value.body)
    r = c.chat.completions.create(
        model=TINY, messages=HELLO, max_tokens=2
    )  # the same client still works
    assert r.choices[0].finish_reason == "length"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
        },
    },
}


def test_tool_call_round_trip(tiny):
    "A required call, its result sent back as a `tool` message, then the answer; streamed calls; refusals."
    import jsonschema

    c = client(tiny)
    ask = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    r = c.chat.completions.create(
        model=TINY,
        messages=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=1.0,
        seed=1,
        parallel_tool_calls=False,
    )  # one call, then the end
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and call.id.startswith("call_")
    )
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = ask + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    answer = c.chat.completions.create(
        model=TINY, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in (
        "stop",
        "length",
    )
    assert (
        answer.usage.prompt_tokens > r.usage.prompt_tokens
    )  # the call and its result are in the prompt now

    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        c.chat.completions.create(
            model=TINY,
            messages=ask,
            tools=[WEATHER],
            tool_choice=named,
            max_tokens=60,
            temperature=1.0,
            seed=2,
            stream=True,
            parallel_tool_calls=False,
        )
    )
    calls = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ] == ["tool_calls"]

    free = c.chat.completions.create(
        model=TINY, messages=ask, tools=[WEATHER], max_tokens=4
    )  # auto: the model decides
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for kwargs, param in [
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (dict(tool_choice="required"), "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=TINY, messages=ask, max_tokens=4, **kwargs)
        assert info.value.body["param"] == param, (kwargs, info.value.body)


def test_n_choices_whole_and_streamed(tiny):
    "n choices: seeded ones differ from each other and repeat; streamed, told apart by index; the usage of all."
    c = client(tiny)
    ask = dict(
        model=TINY,
        messages=HELLO,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    r = c.chat.completions.create(**ask)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert r.usage.completion_tokens == 18 and r.usage.total_tokens == r.usage.prompt_tokens + 18
    assert [
        ch.message.content for ch in c.chat.completions.create(**ask).choices
    ] == texts  # seeded: repeatable
    chunks = list(
        c.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    streamed = {i: "" for i in range(3)}
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    assert sorted(
        ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 18 and not chunks[-1].choices
    greedy = c.completions.create(model=TINY, prompt="The forge", n=2, max_tokens=4, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text and [
        ch.index for ch in greedy.choices
    ] == [0, 1]

    # the prompt is computed once: the first choice goes ahead, the others find its full blocks (16 tokens each)
    # in the prefix cache
    def kv():
        r = httpx.get(tiny.url + "/v1/engine/stats", headers={"Authorization": f"Bearer {KEY}"})
        return r.json()["kv"]

    tiny.wait_metric(lambda s: s.metric("forge_requests_running") == 0)
    before = kv()
    prompt = " ".join(f"word{i}" for i in range(150))
    for stream in (False, True):
        r = c.completions.create(
            model=TINY, prompt=prompt, n=3, max_tokens=2, temperature=0, stream=stream,
            stream_options={"include_usage": True} if stream else None,
        )  # fmt: skip
        usage = list(r)[-1].usage if stream else r.usage
    tiny.wait_metric(lambda s: s.metric("forge_requests_running") == 0)
    time.sleep(0.3)  # the engine's snapshot, refreshed when idle
    full_blocks = (usage.prompt_tokens - 1) // 16
    after = kv()
    # each run: 2 choices x the full blocks (the streamed run finds them for its first choice too)
    assert after["hit_tokens"] - before["hit_tokens"] >= (2 + 3) * full_blocks * 16, (before, after)


def test_a_draft_model_drafts_and_leaves_the_tokens_as_they_are(servers, tiny):
    "`serve --draft-model`: greedy text as without drafts, every draft accepted (the draft model is the target), on /metrics."
    draft = servers["draft"].wait_ready()
    request = dict(model=TINY, prompt="The forge", max_tokens=12, temperature=0)
    want = client(tiny).completions.create(**request).choices[0].text
    assert client(draft).completions.create(**request).choices[0].text == want
    assert draft.metric("forge_spec_decode_accepted_tokens") > 0
    assert draft.metric("forge_spec_decode_acceptance_rate") == 1.0
