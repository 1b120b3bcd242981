"""A client process SIGKILLed mid-stream: the server aborts its request (it stops generating for it, frees its
pages, nothing is left running) and keeps serving a canary correctly (greedy tokens equal the offline `LLM`'s). The
same check run against a server whose aborts do nothing fails, so it would catch one that never frees them.

The server is a tiny random Llama (`ServerThread`, in this process); the client is a separate Python process, so
the kernel closes its connection the way it does for any client that dies.

Last in the module, the engine loop crashes (an injected failure no request can be blamed for) under the OpenAI
HTTP front end: every stream in flight and every waiting non-streamed request gets its error within a second of
the crash (issue 19's bound), `/health` and new requests answer 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.serve import HTTPServer
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model
from tests.jaxinfer.serving.test_server import ServerThread

ROOT = Path(__file__).resolve().parents[3]
PROMPT = [7, 21, 40, 33, 9, 12, 60, 18]
MAX_TOKENS = 1500  # far more than the client lives for: a request that is not aborted keeps generating
ENGINE = dict(kv_cache_memory_bytes=8 << 20, max_model_len=2048, max_num_seqs=4, warmup=False)
CLIENT = textwrap.dedent("""
    import sys
    import grpc
    from jaxinfer.serving.v1 import jaxinfer_pb2 as pb, jaxinfer_pb2_grpc as pb_grpc
    stub = pb_grpc.JaxInferStub(grpc.insecure_channel(sys.argv[1]))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[int(x) for x in sys.argv[2].split(",")]),
                                 request_id=sys.argv[3],
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=int(sys.argv[4]),
                                                            ignore_eos=True))
    received = 0
    for response in stub.Generate(request):
        received += len(response.token_ids)
        if received >= 3:
            print("streaming", flush=True)  # and keep reading until killed
""")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("faults") / "tiny")


@pytest.fixture(scope="module")
def served_tiny(tiny_model):
    st = ServerThread(EngineConfig.create(model=str(tiny_model), **ENGINE))
    st.wait_serving()
    yield st
    st.stop()


def _cancelled_count(st: ServerThread) -> float:
    value = st.server.metrics.sample("jaxinfer:grpc_requests_total", {"status": "CANCELLED"})
    return value or 0.0


def _kill_client_mid_stream_and_check(st: ServerThread, request_id: str, timeout_s: float = 10.0) -> None:
    """Starts the client, SIGKILLs it once it has received tokens, then asserts what the server must do."""
    engine = st.engine
    before = engine.stats()
    assert before["running"] == before["waiting"] == before["kv_pages_used"] == 0
    cancelled_before = _cancelled_count(st)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{st.server.port}",
                               ",".join(map(str, PROMPT)), request_id, str(MAX_TOKENS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = client.stdout.readline()
        assert line.strip() == "streaming", client.stderr.read()
        at_kill = engine.stats()
        assert at_kill["running"] == 1 and at_kill["kv_pages_used"] > 0  # mid-stream: the request holds pages
        client.kill()
        client.wait(30)
    finally:
        if client.poll() is None:
            client.kill()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == s["waiting"] == s["kv_pages_used"] == 0:
            break
        time.sleep(0.01)
    after = engine.stats()
    assert after["running"] == after["waiting"] == 0, after
    assert after["kv_pages_used"] == 0, after
    # Aborted, not run to its end: all but the prefill's first token would be decode tokens.
    assert after["decode_tokens"] - before["decode_tokens"] < MAX_TOKENS - 1
    assert _cancelled_count(st) == cancelled_before + 1


def _canary(st: ServerThread) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT[::-1]),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return [t for r in st.stub.Generate(request, timeout=120) for t in r.token_ids]


def test_a_killed_client_has_its_request_aborted_and_the_server_keeps_serving(served_tiny, tiny_model):
    _kill_client_mid_stream_and_check(served_tiny, "killed-client")
    offline = LLM(str(tiny_model), **ENGINE).generate(
        [PROMPT[::-1]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    assert _canary(served_tiny) == offline and len(offline) == 16


def test_the_killed_client_check_fails_when_aborts_free_nothing(served_tiny, monkeypatch):
    engine = served_tiny.server.async_engine
    real_abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda request_id: None)  # a server that never frees aborted requests
    try:
        with pytest.raises(AssertionError):
            _kill_client_mid_stream_and_check(served_tiny, "never-freed", timeout_s=3.0)
    finally:
        real_abort("never-freed")
    deadline = time.monotonic() + 30
    while served_tiny.engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served_tiny.engine.stats()["kv_pages_used"] == 0


CRASH_BOUND_S = 1.0  # issue 19: every caller gets its error within a second of an engine-thread crash


def _http_caller(base_url: str, stream: bool, started: threading.Event) -> tuple[float, int, dict]:
    """One long greedy completion over HTTP: (when its error arrived, the HTTP status, the error object). A
    stream sets `started` at its first chunk and reads up to its last event (the error); a whole request waits."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=120) as http:  # the timeout is a safety net only; the bound is checked below
        if not stream:
            r = http.post(base_url + "/v1/completions", json=body)
            return time.monotonic(), r.status_code, r.json().get("error")
        with http.stream("POST", base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return time.monotonic(), r.status_code, chunk["error"]
                started.set()
    raise AssertionError("the stream ended without an error")


def test_an_engine_loop_crash_under_http_answers_every_caller_within_a_second(served_tiny, monkeypatch):
    """Last in the module: it kills `served_tiny`'s engine loop. An HTTP front end on the same engine has two
    streams and one non-streamed request running; a failure inside a step that no request can be blamed for
    (the runner's KV cache) ends the streams with an error event and the whole request with a 503, each within
    `CRASH_BOUND_S` of the crash, all naming it; then `/health` and a new request answer 503."""
    http_server = HTTPServer(served_tiny.server.served, port=0, grace_s=0.5)
    asyncio.run_coroutine_threadsafe(http_server.start(), served_tiny.loop).result(30)
    base_url = f"http://127.0.0.1:{http_server.port}"
    engine = served_tiny.engine
    crashed_at: list[float] = []

    def failing_settle() -> None:
        crashed_at.append(time.monotonic())
        raise RuntimeError("injected KV cache failure")

    try:
        assert httpx.get(base_url + "/health", timeout=30).status_code == 200
        started = [threading.Event() for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(_http_caller, base_url, stream, ev)
                    for stream, ev in zip((True, True, False), started)]
            deadline = time.monotonic() + 60
            while not (started[0].is_set() and started[1].is_set() and engine.stats()["running"] == 3):
                assert time.monotonic() < deadline, engine.stats()
                assert not any(j.done() for j in jobs), [j.result() for j in jobs if j.done()]
                time.sleep(0.01)
            monkeypatch.setattr(engine.runner.kv, "settle_host_pages", failing_settle)
            answers = [j.result(timeout=150) for j in jobs]
        assert crashed_at, "the injected failure never ran"
        for (at, status, error), stream in zip(answers, (True, True, False)):
            assert status == (200 if stream else 503), (status, error)
            assert error["type"] == "service_unavailable_error", error
            assert "the engine loop stopped: RuntimeError: injected KV cache failure" in error["message"], error
            assert at - crashed_at[0] < CRASH_BOUND_S, f"answered {at - crashed_at[0]:.2f} s after the crash"
        health = httpx.get(base_url + "/health", timeout=30)
        assert health.status_code == 503, health.text
        assert "engine loop has stopped: RuntimeError: injected KV cache failure" in health.json()["error"]["message"]
        late = httpx.post(base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable_error", late.text
    finally:
        async def stop() -> None:
            http_server.close(force=True)
            await http_server.wait()

        asyncio.run_coroutine_threadsafe(stop(), served_tiny.loop).result(30)
