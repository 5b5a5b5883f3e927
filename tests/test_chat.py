"""Chat clients (forge_engine.chat) against servers on loopback.

Two kinds of server:
- `forge_server`: the real forge-engine server process with `random:qwen3-tiny` (the tests that matter);
- `wire_server`: a tiny OpenAI-compatible SSE endpoint written here, only to pin the wire format
  (comments, multi-line data, errors, a stream cut short) that the real server never produces.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from forge_engine.chat import ChatError, ChatWidget, RemoteChat, Reply, chat_loop

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


def test_cli_remote_chat_with_piped_stdin(forge_server):
    "`forge-engine chat --url` (through run_remote_chat) with piped stdin: answers stream, closed stdin exits 0."
    code = (
        "import sys, argparse\n"
        "from forge_engine.chat import add_chat_url_arguments, run_remote_chat\n"
        "from forge_engine.generate import SamplingParams\n"
        "p = argparse.ArgumentParser(); p.add_argument('--model', default='auto'); p.add_argument('--system')\n"
        "add_chat_url_arguments(p)\n"
        "sys.exit(run_remote_chat(p.parse_args(sys.argv[1:]), SamplingParams(max_tokens=6, ignore_eos=True)))\n"
    )
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
