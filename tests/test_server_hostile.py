"""The real server process against what a careless or hostile client sends: huge stop strings, bodies that
break parsers, hang-ups, signals, requests from web pages, parameters that cannot be honoured; and a fuzzer
(schemathesis) driven by the server's own /openapi.json."""

import json
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import HAMMER, HELLO, KEY, TINY, ServerProcess

from forge_engine.server.protocol import MAX_STOP_CHARS, MAX_STOPS


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    "Started together (they load in parallel), each waited for on first use."
    logs = tmp_path_factory.mktemp("hostile")
    started = {
        "open": ServerProcess(
            logs / "open.log",
            "--model",
            TINY,
            "--max-num-seqs",
            "4",
            "--kv-cache-bytes",
            str(2**23),
            "--allowed-hosts",
            "forge.lan",
        ),
        "keyed": ServerProcess(
            logs / "keyed.log",
            "--model",
            TINY,
            "--kv-cache-bytes",
            str(2**22),
            env={"FORGE_API_KEY": KEY},
        ),
        "fuzz": ServerProcess(
            logs / "fuzz.log",
            "--model",
            TINY,
            "--max-model-len",
            "48",
            "--max-num-seqs",
            "8",
            "--kv-cache-bytes",
            str(2**22),
        ),
    }
    yield started
    for server in started.values():
        if server.proc.poll() is None:
            server.stop()
    for name, server in started.items():
        log = server.log_path.read_text()
        assert "Traceback" not in log and "Exception in ASGI" not in log, f"{name}:\n{log}"


@pytest.fixture
def open_server(servers):
    return servers["open"].wait_ready()


@pytest.fixture
def keyed(servers):
    return servers["keyed"].wait_ready()


def chat(server, api_key="unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=kw.get("timeout", 60)
    )


def http_exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    "One request on an open socket: its status and body (the server must not close the connection meanwhile)."
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, "the server closed the connection"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "the server closed the connection"
        body += more
    assert b"connection: close" not in head.lower()
    return int(head.split(b" ")[1]), body


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# -- 1. stop strings -------------------------------------------------------------------------------------------------
def test_huge_stop_strings_are_refused_at_once(open_server):
    c = chat(open_server)
    t0 = time.monotonic()
    for stop, words in [
        ("x" * 2**20, f"at most {MAX_STOP_CHARS}"),
        (["y" * 200_000], f"at most {MAX_STOP_CHARS}"),
        ([str(i) for i in range(MAX_STOPS + 1)], f"at most {MAX_STOPS}"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=TINY, messages=HELLO, max_tokens=4, stop=stop)
        assert e.value.param == "stop" and words in e.value.message
    assert time.monotonic() - t0 < 10


def test_longest_stop_strings_do_not_stall_other_requests(open_server):
    "Four stop strings of the longest length that the text keeps almost matching: held back, and cheap."
    c = chat(open_server)
    almost = [
        (" hammer" * 200)[: MAX_STOP_CHARS - 1] + c for c in "!?.;"
    ]  # the text is ' hammer' again and again
    result = {}

    def long_one():
        result["reply"] = c.chat.completions.create(
            model=TINY,
            messages=HELLO,
            max_tokens=150,
            temperature=0,
            stop=almost,
            logit_bias={str(HAMMER): 100},
            extra_body={"ignore_eos": True},
        )

    worker = threading.Thread(target=long_one)
    worker.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    tiny = c.chat.completions.create(model=TINY, messages=HELLO, max_tokens=2, temperature=0)
    assert tiny.usage.completion_tokens <= 2 and time.monotonic() - t0 < 10
    worker.join(timeout=120)
    reply = result["reply"].choices[0]
    assert (
        reply.finish_reason == "length" and reply.message.content == " hammer" * 150
    )  # held back, then all of it


# -- 2. no 500s, and a refused request leaves the connection usable -------------------------------------------------
def test_lone_surrogate_and_deep_nesting_are_400_on_a_kept_connection(open_server):
    host, port = open_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        status, body = http_exchange(
            sock, post("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}')
        )
        assert (
            status == 400
            and json.loads(body)["error"]["param"] == "prompt"
            and b"surrogate" in body
        )
        status, body = http_exchange(
            sock, post("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        )
        assert status == 400 and b"nests deeper than" in body
        status, body = http_exchange(
            sock, post("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}")
        )
        assert status == 400 and b"nests deeper than" in body
        status, body = http_exchange(
            sock, post("/v1/completions", b'{"prompt": "Hi", "temperature": NaN}')
        )
        assert status == 400 and b"NaN is not JSON" in body
        status, body = http_exchange(
            sock, post("/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
        )
        assert (
            status == 200 and json.loads(body)["object"] == "text_completion"
        )  # the same connection


def test_pooled_client_survives_refusals(open_server):
    "The openai client keeps its connections: after refusals, its next (valid) request on the pool succeeds."
    c = chat(open_server)
    for bad in [
        {"seed": 2**64},
        {"stop_token_ids": [-1]},
        {"stop": "x" * (MAX_STOP_CHARS + 1)},
        {"n": 17},
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=TINY, prompt="Hi", max_tokens=2, extra_body=bad)
        assert e.value.param == next(iter(bad))
        assert (
            c.completions.create(model=TINY, prompt="Hi", max_tokens=2).usage.completion_tokens <= 2
        )


# -- 4. a non-streaming client that hangs up ----------------------------------------------------------------------------
def test_non_streaming_hang_up_is_aborted_and_counted(open_server):
    aborted = open_server.metric('forge_requests_total{finish_reason="abort"}')
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(
            open_server.url + "/v1/chat/completions",
            timeout=httpx.Timeout(30, read=1.0),
            json={"messages": HELLO, "max_tokens": 3000, "ignore_eos": True},
        )
    open_server.wait_metric(
        lambda s: (
            s.metric('forge_requests_total{finish_reason="abort"}') == aborted + 1
            and s.metric("forge_requests_running") == 0
            and s.metric("forge_kv_cache_used_blocks") == 0
        )
    )
    log = open_server.log_path.read_text()
    assert "InvalidStateError" not in log and "Exception in ASGI" not in log, log


# -- 5. requests a web page could make ---------------------------------------------------------------------------------
def test_web_pages_cannot_drive_a_server_without_a_key(open_server):
    url = open_server.url + "/v1/chat/completions"
    body = json.dumps({"messages": HELLO, "max_tokens": 2})
    r = httpx.post(
        url, content=body, headers={"Content-Type": "text/plain", "Origin": "http://evil.test"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(
        url, content=body, headers={"Content-Type": "text/plain"}
    )  # a simple request: no preflight
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    port = open_server.url.rsplit(":", 1)[1]
    for host in ["evil.test", f"evil.test:{port}", f"127.0.0.1.evil.test:{port}"]:  # DNS rebinding
        r = httpx.post(
            url, content=body, headers={"Content-Type": "application/json", "Host": host}
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
        assert httpx.get(open_server.url + "/metrics", headers={"Host": host}).status_code == 403
    for host in [f"localhost:{port}", f"forge.lan:{port}"]:  # loopback names, and --allowed-hosts
        r = httpx.post(
            url, content=body, headers={"Content-Type": "application/json", "Host": host}
        )
        assert r.status_code == 200, (host, r.text)
    same_origin = {
        "Content-Type": "application/json; charset=utf-8",
        "Origin": open_server.url,
    }  # the chat page
    assert httpx.post(url, content=body, headers=same_origin).status_code == 200


def test_a_key_is_what_guards_a_keyed_server(keyed):
    "With an API key, Host and Origin are not checked (a page cannot send the key); the key is, its scheme in any case."
    body = {"messages": HELLO, "max_tokens": 2}
    for scheme in ["Bearer", "bearer", "BEARER"]:
        r = httpx.post(
            keyed.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"{scheme} {KEY}"},
        )
        assert r.status_code == 200, scheme
    r = httpx.post(
        keyed.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Basic {KEY}"}
    )
    assert r.status_code == 401
    assert httpx.get(keyed.url + "/health", headers={"Host": "anything.test"}).status_code == 200


# -- 6. parameters that would change the reply's meaning ---------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("reasoning_effort", "high"),
        ("stop_token_ids", [10**9]),
        ("stop_token_ids", ["7"]),
        ("stop_token_ids", [1.5]),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("made_up_option", 1),
    ],
)
def test_parameters_that_cannot_be_honoured_are_refused(keyed, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        chat(keyed, KEY).chat.completions.create(
            model=TINY, messages=HELLO, max_tokens=2, extra_body={field: value}
        )
    assert e.value.param == field and e.value.status_code == 400


def test_harmless_parameters_are_accepted(keyed):
    r = chat(keyed, KEY).chat.completions.create(
        model=TINY,
        messages=HELLO,
        max_tokens=2,
        seed=2**63 - 1,
        user="u",
        store=False,
        metadata={"k": "v"},
        parallel_tool_calls=False,
        extra_body={"tool_choice": "none", "modalities": ["text"]},
    )
    assert r.usage.completion_tokens <= 2


# -- 7. the published schema, and a fuzzer driven by it ---------------------------------------------------------------
def test_openapi_schema_is_published(keyed):
    schema = httpx.get(keyed.url + "/openapi.json").json()  # no key needed, like /health
    chat_body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    assert chat_body["properties"]["max_tokens"]["description"].startswith(
        "prompt + max_tokens must fit the context (4096"
    )
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


FUZZ_EXAMPLES = {
    "POST": 12,
    "GET": 4,
}  # per operation and mode; a 48-token context keeps replies short: ~20 s


def test_schemathesis_finds_no_server_error_and_no_nonconformance(servers):
    "Derandomized, a fixed number of examples: valid (positive) and invalid (negative) requests per operation."
    fuzz = servers["fuzz"].wait_ready()
    schema = schemathesis.openapi.from_url(fuzz.url + "/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    seen = {}
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                continue

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=FUZZ_EXAMPLES[operation.method.upper()],
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case):
                response = case.call(base_url=fuzz.url, timeout=60)
                seen.setdefault(operation.label, set()).add(response.status_code)
                case.validate_response(response, checks=checks)

            run()
    assert time.monotonic() - t0 < 100
    assert {200, 400} <= seen["POST /v1/chat/completions"] and {200, 400} <= seen[
        "POST /v1/completions"
    ], seen
    assert not any(code >= 500 for codes in seen.values() for code in codes), seen


# -- 3. shutdown (each test its own process) -----------------------------------------------------------------------
def stream_events(response) -> list[str]:
    return [line for line in response.iter_lines() if line]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_finishes_short_streams_and_ends_long_ones_properly(tmp_path, sig):
    server = ServerProcess(
        tmp_path / "server.log",
        "--model",
        TINY,
        "--shutdown-grace",
        "2",
        "--max-num-seqs",
        "4",
        "--kv-cache-bytes",
        str(2**23),
    ).wait_ready()
    try:
        long = {"messages": HELLO, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        short = {"messages": HELLO, "max_tokens": 3, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as a,
            httpx.Client(base_url=server.url, timeout=60) as b,
        ):
            with (
                a.stream("POST", "/v1/chat/completions", json=long) as cut,
                b.stream("POST", "/v1/chat/completions", json=short) as done,
            ):
                cut_lines, done_lines = cut.iter_lines(), done.iter_lines()
                first = next(cut_lines), next(done_lines)  # both running
                t0 = time.monotonic()
                server.proc.send_signal(sig)
                cut_events = [*first[:1], *(line for line in cut_lines if line)]
                done_events = [*first[1:], *(line for line in done_lines if line)]
                took = time.monotonic() - t0
        assert done_events[-1] == "data: [DONE]"
        assert json.loads(done_events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert cut_events[-1] == "data: [DONE]" and 1.5 < took < 15, (took, cut_events[-3:])
        error = json.loads(cut_events[-2][6:])["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        assert json.loads(cut_events[-3][6:])["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(timeout=20) == 0
        log = server.log_path.read_text()
        assert "cutting off 1 request(s)" in log and "Traceback" not in log, log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_ctrl_c_while_the_model_loads_exits_cleanly(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--model", "smollm2-135m-instruct")
    deadline = time.monotonic() + 60
    while (503, "loading") not in server.health_seen:
        assert time.monotonic() < deadline and server.proc.poll() is None, (
            server.log_path.read_text()
        )
        time.sleep(0.05)
    if server.ready.is_set():
        pytest.skip("the model loaded before the signal could be sent")
    server.proc.send_signal(signal.SIGINT)
    code = server.proc.wait(timeout=30)
    log = server.log_path.read_text()
    assert code == 130 and "was still loading; exiting with 130" in log, (code, log)
    assert "terminate called" not in log and "Traceback" not in log, log
