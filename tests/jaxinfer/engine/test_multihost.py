"""Two local processes with `jax.distributed` (2 CPU devices each, gloo collectives) run one tp=4 engine, and
pp=2 x tp=2 engines (a pipeline stage per process), the second on an orbax checkpoint restored into the stages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.engine import multihost

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from multihost_worker import (CHECKPOINT_OPTIONS, ENGINE_OPTIONS, SPEC_CONFIGS, generate_all,  # noqa: E402
                              generate_checkpoint, generate_spec)
from tiny_model import make_tiny_model_dir  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out: Path, *mode: str) -> dict:
    """Runs the two worker processes (`multihost_worker.py`) and returns what process 0 wrote to `out`."""
    port = _free_port()
    root = str(HERE.parents[2])  # this checkout's code, also where the venv's package points at another one
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(i), str(port), str(out), *mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=root) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_two_processes_generate_the_single_process_tokens(tmp_path):
    from jaxinfer.llm import LLM

    got = _run_workers(tmp_path / "out.json")
    assert got["num_devices"] == 4 and got["mesh_processes"] == [0, 1]  # one mesh over both processes' devices
    assert got["host_hits"] > 0  # prefix-cache pages went to the host tier and came back, on both processes

    plain = LLM(**ENGINE_OPTIONS)
    assert got["tokens"] == generate_all(plain)
    # speculative decoding over both processes: drafts were accepted, and greedy and seeded tokens are those of
    # one process without speculation (self-drafting's seeded row may differ: its drafts carry probabilities)
    reference = generate_spec(plain)
    assert all(n > 0 for n in got["spec_accepted"]), got["spec_accepted"]
    for spec, tokens in zip(SPEC_CONFIGS, got["spec_tokens"]):
        compared = len(tokens) if spec["method"] == "ngram" else len(tokens) // 2
        assert tokens[:compared] == reference[:compared], spec


@pytest.mark.slow
def test_pipeline_stages_on_two_processes_generate_the_single_process_tokens(tmp_path):
    # pp = 2 x tp = 2: each process holds one stage; activations cross processes by ppermute (gloo)
    from jaxinfer.llm import LLM
    from jaxinfer.loading import convert

    checkpoint = convert(make_tiny_model_dir(tmp_path / "tiny"), tmp_path / "checkpoint")  # 2 layers
    got = _run_workers(tmp_path / "out.json", "pp", str(checkpoint))
    assert got["stage_processes"] == [[0], [1]]  # stage s's weights and KV pages live on process s only
    assert got["tokens"] == generate_all(LLM(**ENGINE_OPTIONS), host_tier=False)
    # the orbax checkpoint restored straight into the stages, each process restoring its own stage's layer
    assert got["checkpoint_stage_processes"] == [[0], [1]]
    assert got["checkpoint_tokens"] == generate_checkpoint(LLM(str(checkpoint), **CHECKPOINT_OPTIONS))


def test_initialize_checks_its_arguments():
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, 2\)"):
        multihost.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="host:port"):
        multihost.initialize("localhost", num_processes=2, process_id=0)


def test_single_process_is_its_own_leader():
    assert multihost.is_leader() and not multihost.is_multi_process()
    assert multihost.agree(7) == 7
    multihost.send(multihost.Op.STOP)  # a no-op without followers
