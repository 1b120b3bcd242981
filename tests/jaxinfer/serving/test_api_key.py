"""`--api-key` guards both front ends: the bearer check, gRPC's interceptor, and the CLI's refusal of an empty key.

The gRPC server here shares a `ServedEngine` that is never started, so no model loads: a call that passes the key
check reaches the service and ends UNAVAILABLE (engine not serving), one that does not ends UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.auth import bearer_matches
from jaxinfer.serving.served import ServedEngine
from jaxinfer.serving.server import Server
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

KEY = "sekret-123"


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER  {KEY} ", True),
    (f"Bearer {KEY}x", False), ("Bearer ", False), (KEY, False), (f"Basic {KEY}", False), ("", False), (None, False),
])
def test_bearer_matches(header, ok):
    assert bearer_matches(header, KEY) is ok


@pytest.fixture(scope="module")
def grpc_stub():
    server = Server(ServedEngine(EngineConfig(dtype="float32", warmup=False)), port=0, api_key=KEY)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.JaxInferStub(channel), health_pb2_grpc.HealthStub(channel)
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.mark.parametrize("metadata, want", [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", f"Bearer {KEY}"),), grpc.StatusCode.UNAVAILABLE),  # past the check: engine not serving
    ((("authorization", f"bearer {KEY}"),), grpc.StatusCode.UNAVAILABLE),
])
def test_grpc_calls_need_the_api_key(grpc_stub, metadata, want):
    stub, _ = grpc_stub
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    assert _code(lambda: list(stub.Generate(request, metadata=metadata, timeout=30))) == want  # streaming
    assert _code(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=30)) == want  # unary


def test_grpc_health_needs_no_key(grpc_stub):
    _, health = grpc_stub
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered, not refused


def test_an_empty_api_key_is_refused_before_anything_loads(capsys, monkeypatch):
    import signal

    from jaxinfer import cli

    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's early stop handlers would exit pytest
    monkeypatch.setattr("jaxinfer.engine.config.EngineConfig.create", lambda **_: pytest.fail("got past the key check"))
    assert cli.main(["serve", "--api-key", ""]) == 2
    assert capsys.readouterr().err.startswith("jaxinfer: error: --api-key must not be empty")
