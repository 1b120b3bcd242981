"""`jaxinfer serve --replicas N`: bad input exits 2 with one `jaxinfer: error:` line, one engine needs no Ray, and
the command as a user runs it, joining the session's Ray instance: it serves, answers 503 once its replicas are
killed, and exits 0 on SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.jaxinfer.cluster.conftest import MAX_MODEL_LEN, PAGE_SIZE

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def no_ray(monkeypatch):
    """This process as it would be without Ray installed: `import ray` fails, and the cluster modules that import
    it are imported afresh."""
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's early stop handlers would exit pytest
    monkeypatch.setitem(sys.modules, "ray", None)
    for name in [n for n in sys.modules if n.startswith("jaxinfer.cluster.")]:
        if name not in ("jaxinfer.cluster.config", "jaxinfer.cluster.routing"):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas 0 must be an integer >= 1"),
    (["--replicas", "-2"], "--replicas -2 must be an integer >= 1"),
    (["--routing", "fastest"], "argument --routing: invalid choice: 'fastest' (choose from cache_aware, round_robin, "
                               "least_load) (see jaxinfer serve --help)"),  # Python >= 3.12.8 quotes the choices
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus 0.0 must be > 0"),
    (["--replicas", "2", "--routing-min-match", "2"], "min_match=2.0 must be in [0, 1]"),
    (["--replicas", "2", "--no-http"], "--no-http: the router of --replicas serves the HTTP API only"),
    (["--prefill-replicas", "1"], "--prefill-replicas 1 needs --decode-replicas (or --replicas) >= 1: prefill "
                                  "replicas hand every request on"),
    (["--decode-replicas", "2"], "--decode-replicas 2 needs --prefill-replicas >= 1 (without prefill replicas, use "
                                 "--replicas)"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--disagg-min-prefill-tokens", "-1"],
     "--disagg-min-prefill-tokens -1 must be an integer >= 0"),
    (["--decode-config", "d.json"], "--decode-config needs --decode-replicas >= 1"),
    (["--kv-wire-dtype", "int8", "--disagg-min-prefill-tokens", "5"],
     "--kv-wire-dtype, --disagg-min-prefill-tokens: only for handoffs from prefill replicas; give --prefill-replicas "
     ">= 1"),
    (["--replicas", "2", "--replica-max-restarts", "-2"], "--replica-max-restarts -2 must be an integer >= -1"),
    (["--prefill-replicas", "1", "--replicas", "1", "--prefill-config", "/nonexistent.json"],
     "--prefill-config /nonexistent.json: config file /nonexistent.json: cannot be read: [Errno 2] No such file or "
     "directory: '/nonexistent.json'"),
    (["--replicas", "2"], "--replicas and --ray-address need Ray: pip install 'jaxinfer[cluster]'"),
])
def test_bad_cluster_flags_exit_2_with_one_line(flags, message, no_ray, capsys):
    from jaxinfer import cli

    try:
        status = cli.main(["serve", *flags])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err
    for name in ("cache_aware", "round_robin", "least_load"):
        err = err.replace(f"'{name}'", name)
    assert status == 2 and err == f"jaxinfer: error: {message}\n", err


def test_role_config_files_give_one_role_its_own_engine_options(tmp_path, monkeypatch, tiny_chat_dir):
    """--decode-config FILE: the decode replicas get the file's options over the others; the router the flags'."""
    from jaxinfer import cli
    from jaxinfer.cluster.config import ClusterConfig
    from jaxinfer.cluster.replica import ReplicaRole
    from jaxinfer.commands import serve

    monkeypatch.setattr(signal, "signal", lambda *_: None)
    seen = {}

    class Served:
        def __init__(self, config, cluster, routing, **kwargs):
            seen.update(config=config, cluster=cluster, **kwargs)

    monkeypatch.setattr(serve, "_import_cluster", lambda: Served)
    monkeypatch.setattr("jaxinfer.serving.serve.run", lambda config, **kw: 0)
    (tmp_path / "d.json").write_text('{"tensor_parallel_size": 2, "max_num_seqs": 4}')
    assert cli.main(["serve", "--prefill-replicas", "1", "--decode-replicas", "2", "--decode-config",
                     str(tmp_path / "d.json"), "--kv-wire-dtype", "int8", "--model", str(tiny_chat_dir),
                     "--max-num-seqs", "8", "--replica-max-restarts", "5"]) == 0
    assert seen["cluster"] == ClusterConfig(num_replicas=0, prefill_replicas=1, decode_replicas=2, max_restarts=5)
    decode = seen["role_configs"][ReplicaRole.DECODE]
    assert (decode.tensor_parallel_size, decode.max_num_seqs) == (2, 4) and list(seen["role_configs"]) == [
        ReplicaRole.DECODE]
    assert (seen["config"].tensor_parallel_size, seen["config"].max_num_seqs) == (1, 8)
    assert seen["disagg"].wire_dtype == "int8" and seen["disagg"].min_prefill_tokens == 128


def test_one_engine_serves_without_ray(no_ray, monkeypatch):
    from jaxinfer import cli

    seen = {}
    monkeypatch.setattr("jaxinfer.serving.serve.run", lambda config, **kw: seen.update(kw) or 0)
    monkeypatch.setattr("jaxinfer.engine.startup.check_before_load", lambda config: None)
    assert cli.main(["serve", "--routing", "round_robin", "--http-port", "0"]) == 0  # routing flags: unused here
    assert "served" not in seen and seen["port"] == 50051  # the one-engine server, with gRPC
    assert "jaxinfer.cluster.served" not in sys.modules


def _replica_actors(pid: int) -> list:
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"jaxinfer-{pid}-")]


def test_serve_replicas_joins_a_ray_cluster_answers_503_without_replicas_and_stops_on_sigterm(
        ray_address, tiny_chat_dir):
    import openai

    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--replicas", "2", "--ray-address", ray_address,
           "--replica-cpus", "0.1", "--routing", "least_load", "--http-port", "0", "--served-model-name", "tiny-2",
           "--grace-seconds", "1", "--model", str(tiny_chat_dir), "--no-warmup", "--page-size", str(PAGE_SIZE),
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(1 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        while "serving HTTP" not in line:
            assert line, proc.stderr.read()
            line = proc.stdout.readline()
        base = re.search(r"(http://\S+)/v1", line).group(1)
        deadline = time.monotonic() + 180
        while httpx.get(base + "/health").status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):
            reply = client.chat.completions.create(model="tiny-2", messages=[{"role": "user", "content": "w5 w6"}],
                                                   max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 4
        metrics = httpx.get(base + "/metrics").text
        routed = re.findall(r'jaxinfer:router_requests_total\{model_name="tiny-2",replica="[^"]+"} (\S+)', metrics)
        assert sorted(routed) == ["1.0", "1.0"], metrics  # least_load: one each
        import ray

        actors = _replica_actors(proc.pid)
        assert len(actors) == 2
        for actor in actors:
            ray.kill(actor, no_restart=True)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny-2", prompt="w5", max_tokens=2)
        assert e.value.status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_signal_while_the_replicas_start_exits_0_and_leaves_no_replica(ray_address, tiny_chat_dir):
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--replicas", "2", "--ray-address", ray_address,
           "--replica-cpus", "0.1", "--http-port", "0", "--model", str(tiny_chat_dir), "--page-size", str(PAGE_SIZE),
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(1 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        err = []
        while not err or "starting 2 replicas" not in err[-1]:  # the router now waits for the replicas' start
            err.append(proc.stderr.readline())
            assert err[-1], "".join(err)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(err) + proc.stderr.read()
        rest = "".join(err) + proc.stderr.read()
        assert "Traceback" not in rest and " ERROR " not in rest, rest
        assert _replica_actors(proc.pid) == []  # the pool killed what it had started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_replica_that_refuses_its_options_exits_2_with_its_message(ray_address, tiny_chat_dir):
    """On a Ray cluster the options are checked where the replicas run: the replica's ValueError is the command's."""
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--replicas", "2", "--ray-address", ray_address,
           "--replica-cpus", "0.1", "--http-port", "0", "--model", str(tiny_chat_dir), "--no-warmup",
           "--page-size", str(PAGE_SIZE), "--kv-cache-memory-bytes", "100"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == ("jaxinfer: error: kv_cache_memory_bytes=100 is smaller than one KV page "
                                            f"of page_size={PAGE_SIZE} tokens (4096 bytes); lower page_size or "
                                            "raise kv_cache_memory_bytes")
