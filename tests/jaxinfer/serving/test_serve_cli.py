"""`jaxinfer serve` as a user runs it: a subprocess on free ports; at SIGTERM a stream that can finish within
`--grace-seconds` finishes, one that cannot gets UNAVAILABLE (gRPC) or a last error event (HTTP) when the grace
ends, and the exit status is 0; and the committed stubs are what grpcio-tools makes of the proto."""

from __future__ import annotations

import filecmp
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]


GRACE_S = 5.0
LONG_MAX_TOKENS = 4000  # SmolLM2 f32 would need > 800 tokens/s on CPU to finish this within GRACE_S


def _collect(call, responses: list, errors: list) -> None:
    try:
        for r in call:
            responses.append(r)
    except grpc.RpcError as e:
        errors.append(e)


def _collect_http(base_url: str, max_tokens: int, events: list) -> None:
    """Streams a greedy completion over HTTP; appends every event (parsed JSON, or the string "[DONE]")."""
    body = {"prompt": "Count to ten:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(timeout=300) as http, http.stream("POST", base_url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append(e)


@pytest.mark.slow
def test_sigterm_finishes_streams_within_the_grace_fails_the_rest_unavailable_and_exits_0():
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--http-port", "0", "--metrics-port", "0",
           "--served-model-name", "my-model", "--no-warmup", "--grace-seconds", str(GRACE_S),
           "--kv-cache-memory-bytes", str(256 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # "jaxinfer: serving gRPC on 127.0.0.1:PORT, metrics on http://.../metrics"
        assert "serving gRPC on" in line, line + proc.stderr.read()
        metrics_url = re.search(r"metrics on (http://\S+/metrics)", line).group(1)
        http_line = proc.stdout.readline()  # "jaxinfer: serving HTTP (OpenAI API) on http://127.0.0.1:PORT/v1 ..."
        base_url = re.search(r"(http://\S+)/v1", http_line).group(1)
        channel = grpc.insecure_channel(re.search(r"serving gRPC on (\S+?),? ", line).group(1))
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        stub = pb_grpc.JaxInferStub(channel)
        streams, readers = {}, []
        for name, max_tokens in (("short", 24), ("long", LONG_MAX_TOKENS)):
            call = stub.Generate(pb.GenerateRequest(text="Count to ten:", sampling=pb.SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True)))
            streams[name] = ([], [])  # responses, errors
            readers.append(threading.Thread(target=_collect, args=(call, *streams[name]), daemon=True))
            readers[-1].start()
        http_streams = {"short": [], "long": []}
        for name, max_tokens in (("short", 24), ("long", LONG_MAX_TOKENS)):
            readers.append(threading.Thread(target=_collect_http, args=(base_url, max_tokens, http_streams[name]),
                                            daemon=True))
            readers[-1].start()
        short, long = streams["short"][0], streams["long"][0]
        deadline = time.monotonic() + 300  # first-use compiles of the prefill and both decode shapes
        while (sum(len(r.token_ids) for r in short) < 16 or not long or len(http_streams["short"]) < 4
               or not http_streams["long"]):  # all decoding, 8 gRPC short tokens to go
            assert time.monotonic() < deadline and not streams["short"][1] and not streams["long"][1]
            time.sleep(0.01)
        assert sum(len(r.token_ids) for r in short) < 24  # still in flight at the signal
        assert "[DONE]" not in http_streams["short"]
        # --served-model-name names the model for the HTTP API and labels the metrics port's samples
        assert [m["id"] for m in httpx.get(base_url + "/v1/models").json()["data"]] == ["my-model"]
        running = [line for line in httpx.get(metrics_url).text.splitlines()
                   if line.startswith("jaxinfer:num_requests_running{")]
        assert len(running) == 1 and re.fullmatch(r'\S+\{model_name="my-model"\} [1-4]\.0', running[0]), running
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while True:  # new calls are refused from the signal on
            try:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=2)
            except grpc.RpcError as e:
                # UNAVAILABLE once the server refuses calls; a probe caught in flight by grpc's own stop is
                # CANCELLED by grpc (seen 1 run in 5), or never answered until its deadline (seen once in a full
                # suite: a new call on a server in grpc's graceful stop can wait out its deadline, grpc/grpc#10418).
                # Each is a call not served; an answer (OK) fails here.
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                    grpc.StatusCode.DEADLINE_EXCEEDED), e
                break
            assert time.monotonic() < t_signal + GRACE_S
            time.sleep(0.02)
        assert proc.wait(GRACE_S + 60) == 0
        shutdown_s = time.monotonic() - t_signal
        for reader in readers:
            reader.join(10)
        # The short stream finished within the grace; the long one was cut off at its end with UNAVAILABLE.
        assert not streams["short"][1] and sum(len(r.token_ids) for r in short) == 24
        assert short[-1].finish_reason == "length"
        errors = streams["long"][1]
        assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert sum(len(r.token_ids) for r in long) < LONG_MAX_TOKENS and not any(r.finish_reason for r in long)
        assert shutdown_s >= GRACE_S - 0.5  # the long stream held the shutdown for the whole grace
        # HTTP likewise: the short stream ended normally, the long one with an error event, both with [DONE].
        hshort, hlong = http_streams["short"], http_streams["long"]
        assert hshort[-1] == "[DONE]" and hshort[-2]["choices"][0]["finish_reason"] == "length", hshort[-3:]
        assert sum(1 for e in hshort if isinstance(e, dict) and "error" not in e) <= 24
        assert hlong[-1] == "[DONE]" and hlong[-2]["error"]["type"] == "service_unavailable_error", hlong[-3:]
        with pytest.raises(grpc.RpcError):  # and the ports are closed
            stub.ModelInfo(pb.ModelInfoRequest(), timeout=2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(base_url + "/health", timeout=2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(metrics_url, timeout=2)
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_committed_stubs_match_the_proto(tmp_path):
    proto = "jaxinfer/serving/v1/jaxinfer.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / proto)], check=True)
    for name in ("jaxinfer_pb2.py", "jaxinfer_pb2.pyi", "jaxinfer_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "jaxinfer/serving/v1" / name, ROOT / "jaxinfer/serving/v1" / name,
                           shallow=False), f"{name} is stale: run bash scripts/gen_protos.sh"


def test_bad_serve_flags_exit_2():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device: --tp 2 cannot start
    # The last two fail only when the engine starts (after the port is bound): serve must exit, not stay up.
    for args in (["--port", "70000"], ["--max-queued-requests", "0"], ["--model", "/no/such/model.gguf"],
                 ["--metrics-port", "-5"], ["--grace-seconds", "-1"], ["--host", "nosuchhost.invalid", "--no-warmup"],
                 ["--process-id", "1"], ["--port", "0", "--http-port", "0", "--no-warmup", "--tp", "2"],
                 ["--port", "0", "--http-port", "0", "--no-warmup", "--ep", "2"],
                 ["--port", "8124", "--http-port", "8124"],
                 ["--no-grpc", "--http-port", "8125", "--metrics-port", "8125"]):
        r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "serve", *args], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env)
        if "8124" in args or "8125" in args:  # one port for two servers: named as such, not "address in use"
            assert "are both 812" in r.stderr and "in use" not in r.stderr, r.stderr
        # One line of ours, last, no traceback; flags checked before anything starts print nothing else (before,
        # a bad --host reached grpc, whose C core logged the resolver's reason first).
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("jaxinfer: error"), r.stderr
        assert "Traceback" not in r.stderr
        if "--no-warmup" not in args or "--host" in args:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr




def _wait_until_catching(pid: int, sig: int, timeout_s: float = 120.0) -> None:
    """Waits until process `pid` has a handler for `sig` (its /proc status "SigCgt" mask): under load the
    interpreter alone may take longer than a fixed delay to reach `serve`, and a signal before any handler
    terminates a process by default, as it should."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} installed no handler for signal {sig} in {timeout_s} s")


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.05, 2.0])  # while importing jax and the servers / while the model loads
def test_a_stop_signal_during_start_up_exits_0_quietly(delay_s):
    """`serve` takes stop signals from the moment it has read its flags, before its slow imports."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--http-port", "0",
                             "--no-warmup"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _wait_until_catching(proc.pid, signal.SIGTERM)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and " ERROR " not in err, err
