"""`jaxinfer serve` as a user runs it: a subprocess on a free port, a stream in flight at SIGTERM, exit 0; and the
committed stubs are what grpcio-tools makes of the proto."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0():
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--no-warmup", "--grace-seconds", "60",
           "--kv-cache-memory-bytes", str(32 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # "jaxinfer: serving gRPC on 127.0.0.1:PORT"
        assert "serving gRPC on" in line, line + proc.stderr.read()
        channel = grpc.insecure_channel(line.split()[-1])
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        stub = pb_grpc.JaxInferStub(channel)
        call = stub.Generate(pb.GenerateRequest(text="Count to ten:", sampling=pb.SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True)))
        first = next(call)
        proc.send_signal(signal.SIGTERM)
        responses = [first, *call]  # the stream in flight completes within the grace period
        assert sum(len(r.token_ids) for r in responses) == 24 and responses[-1].finish_reason == "length"
        assert proc.wait(60) == 0
        with pytest.raises(grpc.RpcError):  # and the port is closed
            stub.ModelInfo(pb.ModelInfoRequest(), timeout=2)
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
                 ["--process-id", "1"], ["--port", "0", "--no-warmup", "--tp", "2"],
                 ["--port", "0", "--no-warmup", "--ep", "2"]):
        r = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "serve", *args], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env)
        # One line of ours, last, no traceback; flags checked before anything starts print nothing else (before,
        # a bad --host reached grpc, whose C core logged the resolver's reason first).
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("jaxinfer: error"), r.stderr
        assert "Traceback" not in r.stderr
        if "--no-warmup" not in args or "--host" in args:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr




@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.2, 2.0])  # while importing / while the model loads
def test_a_stop_signal_during_start_up_exits_0_quietly(delay_s):
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--no-warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and " ERROR " not in err, err
