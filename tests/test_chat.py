"""Chat clients (forge_engine.chat) against servers on loopback.

Two kinds of server:
- `forge_server`: the real forge-engine server process with `random:qwen3-tiny` (the tests that matter);
- `wire_server`: a tiny OpenAI-compatible SSE endpoint written here, only to pin the wire format
  (comments, multi-line data, errors, a stream cut short) that the real server never produces.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from forge_engine.chat import RemoteChat, Reply, call_line, chat_loop
from forge_engine.chat_wire import ChatError
from forge_engine.chat_widget import ChatWidget

API_KEY = "test-key"


# -- the real server --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    "The forge-engine server in its own process on a free loopback port."

    def __init__(
        self, *extra: str, model: str = "random:qwen3-tiny", api_key: str | None = API_KEY
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("FORGE_API_KEY", None)
        cmd = [
            sys.executable,
            "-c",
            "import sys; from forge_engine.server.serve import main; sys.exit(main(sys.argv[1:]))",
            "--model",
            model,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_healthy()

    def _drain(self):
        for line in self.proc.stdout:
            self.output.append(line)

    def _wait_healthy(self, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{''.join(self.output)[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{''.join(self.output)[-3000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="session")
def forge_server():
    server = ServerProcess()
    yield server
    server.stop()


TOOL_DELTAS = [
    {"content": "Let me check."},
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_w1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]},
    {"tool_calls": [{"index": 1, "id": "call_w2", "function": {"name": "get_time"}}]},
    {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"type": "string", "maxLength": 12}},
        },
    },
}


# -- the wire-format fixture ------------------------------------------------------------------------------------------
def _sse(obj) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def make_wire_app():
    "A minimal OpenAI-compatible app: answers 'hello world, ...' one word per chunk, with SSE quirks."
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "wire-model", "object": "model"}]}

    async def answer(request: Request, chat: bool):
        import asyncio

        if request.headers.get("authorization") not in (None, f"Bearer {API_KEY}"):
            return JSONResponse(
                {"error": {"message": "invalid api key", "type": "auth"}}, status_code=401
            )
        body = await request.json()
        if body.get("max_tokens", 16) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be >= 1"}}, status_code=400)
        words = ("hello world, this is the wire fixture speaking " * 20).split()[
            : body.get("max_tokens", 16)
        ]
        quirk = (
            (body.get("messages") or [{}])[-1].get("content", "")
            if chat
            else body.get("prompt", "")
        )

        def chunk(text, finish=None):
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            return {
                "object": "chat.completion.chunk",
                "choices": [{**choice, "finish_reason": finish}],
            }

        async def events():
            yield ": keep-alive comment\n\n"
            if chat:
                yield _sse(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            if quirk == "tools":  # two calls in pieces, as OpenAI streams them
                for delta in TOOL_DELTAS:
                    yield _sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                yield "data: [DONE]\n\n"
                return
            for i, w in enumerate(words):
                await asyncio.sleep(0.002)
                if quirk == "cut" and i == 2:
                    return  # the stream breaks off
                if quirk == "fail" and i == 2:
                    yield _sse({"error": {"message": "engine exploded"}})
                    return
                last = i == len(words) - 1
                text = w if i == 0 else " " + w
                if quirk == "multiline" and i == 0:  # one event, data over two lines
                    yield f"event: message\ndata: {json.dumps(chunk(text))[:10]}\ndata: {json.dumps(chunk(text))[10:]}\n\n"
                    continue
                yield _sse(chunk(text, "length" if last else None))
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse(
                    {
                        "choices": [],
                        "usage": {
                            "prompt_tokens": 3,
                            "completion_tokens": len(words),
                            "total_tokens": 3 + len(words),
                        },
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app


class ThreadServer:
    "uvicorn on a thread, on a free loopback port."

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "wire fixture server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def wire_server():
    server = ThreadServer(make_wire_app())
    yield server
    server.stop()


def params(**kw):
    from forge_engine.generate import SamplingParams

    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **kw})


def collect(chat, messages, p) -> tuple[str, Reply]:
    reply = Reply()
    return "".join(chat.stream(messages, p, reply)), reply


# -- wire-format tests (fixture server) -------------------------------------------------------------------------------
def test_wire_format_stream_usage_comments_multiline(wire_server):
    chat = RemoteChat(wire_server.url + "/v1/", api_key=API_KEY)
    assert chat.model == "wire-model"
    text, reply = collect(chat, [{"role": "user", "content": "multiline"}], params(max_tokens=5))
    assert text == reply.text == "hello world, this is the"
    assert (
        reply.finish_reason == "length"
        and reply.num_tokens == 5
        and reply.usage["prompt_tokens"] == 3
    )
    assert 0 < reply.ttft_s <= reply.e2e_s and len(reply.itl_s) == 4


def test_wire_format_errors_are_clear(wire_server):
    chat = RemoteChat(wire_server.url, api_key="wrong", model="wire-model")
    with pytest.raises(ChatError, match="HTTP 401: invalid api key"):
        collect(chat, [{"role": "user", "content": "hi"}], params())
    chat = RemoteChat(wire_server.url, api_key=API_KEY)
    with pytest.raises(ChatError, match="mid-stream: engine exploded"):
        collect(chat, [{"role": "user", "content": "fail"}], params())
    with pytest.raises(ChatError, match="ended before the reply finished"):
        collect(chat, [{"role": "user", "content": "cut"}], params())
    with pytest.raises(ChatError, match="cannot reach the server at http://127.0.0.1:1/v1"):
        RemoteChat("http://127.0.0.1:1").model
    with pytest.raises(ValueError, match="server URL must look like"):
        RemoteChat("127.0.0.1:8000")


def scripted(*answers):
    "A keyboard that types `answers`, one a prompt, then Ctrl+D; `prompts` keeps what it was asked."
    lines, prompts = iter(answers), []

    def read(prompt):
        prompts.append(prompt)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    return read, prompts


def record_bodies(chat: RemoteChat) -> list[dict]:
    "The JSON body of every POST `chat` sends from now on, as it went on the wire."
    bodies = []
    chat.client.event_hooks["request"].append(
        lambda r: r.method == "POST" and bodies.append(json.loads(r.content))
    )
    return bodies


def test_wire_format_tool_calls_in_pieces(wire_server):
    "Calls streamed in pieces (index, id and name, then argument pieces) join; the loop shows them."
    chat = RemoteChat(wire_server.url, api_key=API_KEY)
    text, reply = collect(chat, [{"role": "user", "content": "tools"}], params())
    assert text == reply.text == "Let me check." and reply.finish_reason == "tool_calls"
    assert [call_line(c) for c in reply.tool_calls] == [
        'get_weather({"city": "Paris"})',
        "get_time({})",
    ]
    assert [c["id"] for c in reply.tool_calls] == ["call_w1", "call_w2"]

    bodies, written = record_bodies(chat), []
    read, prompts = scripted("tools", "18 C", "12:00")
    replies = chat_loop(
        chat,
        params(max_tokens=3),
        read=read,
        write=written.append,
        log=written.append,
        tools=[WEATHER],
        tool_choice="required",
    )
    shown = "".join(written)
    assert 'Let me check.\n→ get_weather({"city": "Paris"})\n→ get_time({})\n' in shown
    assert prompts == [">>> ", "result of get_weather: ", "result of get_time: ", ">>> "]
    assert [r.finish_reason for r in replies] == ["tool_calls", "length"]
    assert bodies[0]["tool_choice"] == "required" and bodies[1]["tool_choice"] == "auto"
    assert bodies[1]["messages"][-3:] == [
        replies[0].message(),
        {"role": "tool", "tool_call_id": "call_w1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_w2", "content": "12:00"},
    ]


# -- against the real server ------------------------------------------------------------------------------------------
def test_remote_chat_streams_from_forge_server(forge_server):
    chat = RemoteChat(forge_server.url, api_key=API_KEY)
    assert chat.model  # the server's first model
    text, reply = collect(
        chat, [{"role": "user", "content": "Hello!"}], params(max_tokens=10, ignore_eos=True)
    )
    assert text == reply.text and reply.finish_reason == "length" and reply.num_tokens == 10
    assert 0 < reply.ttft_s <= reply.e2e_s


def test_remote_chat_refusals_are_clear(forge_server):
    with pytest.raises(ChatError, match="HTTP 401"):
        collect(
            RemoteChat(forge_server.url, api_key="wrong"),
            [{"role": "user", "content": "hi"}],
            params(),
        )
    with pytest.raises(ChatError, match="HTTP 4\\d\\d: .*max_tokens"):
        collect(
            RemoteChat(forge_server.url, api_key=API_KEY),
            [{"role": "user", "content": "hi"}],
            params(max_tokens=10**7),
        )


def test_remote_chat_loop_and_abort(forge_server):
    chat = RemoteChat(forge_server.url, api_key=API_KEY)
    lines, written, pressed = iter(["first", "second"]), [], []

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    def write(s):  # "Ctrl+C" once a few pieces of the first reply have arrived
        written.append(s)
        if s and not pressed and len(written) > 3:
            pressed.append(True)
            raise KeyboardInterrupt

    replies = chat_loop(
        chat, params(max_tokens=40, ignore_eos=True), read=read, write=write, log=lambda s: None
    )
    assert [r.finish_reason for r in replies] == ["abort", "length"] and replies[0].num_tokens < 40
    assert replies[1].num_tokens == 40
    wait_idle(forge_server)


def wait_idle(server, timeout: float = 10):
    "The server's engine has no running or waiting request and holds no KV block (it saw the disconnect and aborted)."
    names = ("forge_requests_running", "forge_requests_waiting", "forge_kv_cache_used_blocks")
    deadline = time.monotonic() + timeout
    while True:
        lines = httpx.get(server.url + "/metrics", timeout=5).text.splitlines()
        values = {
            line.split()[0]: float(line.split()[1]) for line in lines if line.split(" ")[0] in names
        }
        if len(values) == 3 and not any(values.values()):
            return
        assert time.monotonic() < deadline, f"server still busy: {values}"
        time.sleep(0.1)


def remote_chat_program(params: str) -> str:
    "`forge-engine chat --url` as a `python -c` program: its flags, `run_remote_chat`, `params`."
    return (
        "import sys, argparse\n"
        "from forge_engine.chat import add_chat_url_arguments, run_remote_chat\n"
        "from forge_engine.generate import SamplingParams\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--model', default='auto'); p.add_argument('--system')\n"
        "add_chat_url_arguments(p)\n"
        f"sys.exit(run_remote_chat(p.parse_args(sys.argv[1:]), SamplingParams({params})))\n"
    )


def test_cli_remote_chat_with_piped_stdin(forge_server):
    "`forge-engine chat --url` (through run_remote_chat) with piped stdin: answers stream, closed stdin exits 0."
    code = remote_chat_program("max_tokens=6, ignore_eos=True")
    env = {**os.environ, "FORGE_API_KEY": API_KEY}
    r = subprocess.run(
        [sys.executable, "-c", code, "--url", forge_server.url],
        input="Hello\nAgain\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(">>> ") == 3 and r.stderr.count("[6 tokens") == 2, (r.stdout, r.stderr)
    r = subprocess.run(
        [sys.executable, "-c", code, "--url", "http://127.0.0.1:1"],
        input="Hello\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2 and "cannot reach the server at http://127.0.0.1:1/v1" in r.stderr


def test_widget_against_forge_server(forge_server):
    widget = ChatWidget(forge_server.url, api_key=API_KEY)
    widget.max_tokens.value, widget.temperature.value = 6, 0.0
    assert widget.send("Hello!")
    reply = widget.wait(60)
    assert (
        reply.error is None
        and 1 <= reply.num_tokens <= 6
        and reply.text in widget.output.outputs[0]["text"]
    )
    widget.max_tokens.value = 2048
    assert widget.send("Again, at length.")
    deadline = time.monotonic() + 60
    while len(widget.replies) < 2 and len(widget.transcript) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    widget.stop()
    reply = widget.wait(60)
    assert reply.finish_reason == "abort" and reply.num_tokens < 2048
    wait_idle(forge_server)


def test_terminal_tool_call_round_trip(forge_server):
    "A call the server forces (a named tool_choice): shown, its result read, sent back with its id."
    chat = RemoteChat(forge_server.url, api_key=API_KEY)
    bodies, written = record_bodies(chat), []
    read, prompts = scripted("Weather in Paris?", '{"temperature": 18}')
    replies = chat_loop(
        chat,
        params(max_tokens=80, temperature=1.0, seed=1),
        read=read,
        write=written.append,
        log=lambda s: None,
        tools=[WEATHER],
        tool_choice="get_weather",
    )
    [call] = replies[0].tool_calls
    assert replies[0].finish_reason == "tool_calls" and call["id"].startswith("call_")
    assert list(json.loads(call["function"]["arguments"])) == ["city"]
    shown = "".join(written)
    assert shown.startswith(f"→ {call_line(call)}\n") and "<tool_call>" not in shown
    assert prompts == [">>> ", "result of get_weather: ", ">>> "]
    assert bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert bodies[1]["tools"] == [WEATHER] and bodies[1]["tool_choice"] == "auto"
    assert bodies[1]["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
    ]
    assert replies[1].error is None and replies[1].finish_reason in ("stop", "length")
    assert replies[1].usage["prompt_tokens"] > replies[0].usage["prompt_tokens"]
    wait_idle(forge_server)


def test_cli_tools_file(forge_server, tmp_path):
    "`--tools FILE --tool-choice NAME`, `--url`: the call shown, its result read; bad files fail."
    code = remote_chat_program("max_tokens=80, temperature=1.0, seed=2")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    env = {**os.environ, "FORGE_API_KEY": API_KEY}
    run = lambda *flags: subprocess.run(
        [sys.executable, "-c", code, "--url", forge_server.url, *flags],
        input="Weather in Paris?\n18 C\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    r = run("--tools", str(tools), "--tool-choice", "get_weather")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^(>>> )?→ get_weather\(\{\"city\": .*\}\)$", r.stdout, re.M), r.stdout
    assert "result of get_weather: " in r.stdout and r.stdout.count(">>> ") == 2
    [summary] = [line for line in r.stderr.splitlines() if line.endswith("tool_calls]")]
    assert "tok/s" not in summary, summary  # the call came in one piece: no rate to show
    tools.write_text('[{"type": "function", "function": {"name": "get weather"}}]')
    r = run("--tools", str(tools))
    assert r.returncode == 2 and "argument --tools: the tools file" in r.stderr
    assert "tools[0] must be" in r.stderr
    r = run("--tools", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read the tools file" in r.stderr


def test_widget_tool_call_against_forge_server(forge_server):
    "The widget shows the forced call; `answer_tool` puts the tool message in the history."
    widget = ChatWidget(
        forge_server.url, api_key=API_KEY, tools=[WEATHER], tool_choice="required", seed=0
    )  # seeded: the random model's call is the same every run, within max_tokens
    widget.max_tokens.value, widget.temperature.value = 80, 1.0
    assert widget.send("Weather in Paris?")
    reply = widget.wait(60)
    assert reply.finish_reason == "tool_calls" and widget.waiting == reply.tool_calls
    assert all(f"→ {call_line(c)}\n" in widget.transcript for c in reply.tool_calls)
    for call in list(widget.waiting):
        assert widget.answer_tool(call["id"], f"18 C ({call['id']})")
    answer = widget.wait(60)
    results = widget.history[2 : 2 + len(reply.tool_calls)]
    assert widget.history[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": reply.tool_calls,
    }
    assert results == [
        {"role": "tool", "tool_call_id": c["id"], "content": f"18 C ({c['id']})"}
        for c in reply.tool_calls
    ]
    assert answer.error is None and widget.history[-1] == answer.message()
    wait_idle(forge_server)
