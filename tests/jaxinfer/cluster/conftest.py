"""Fixtures of the cluster tests: ONE local Ray instance (2 CPUs) for the whole session, the tiny random Llama-3 with
a chat template, and one pool of two tiny replicas that every router of the tests routes over.

Ray's CPU budget (2 logical CPUs per pytest worker): the session pools hold 2 x 0.5 + 3 x 0.25 = 1.75 until the
session ends, so a test that starts replicas of its own asks for at most 0.25 in all (the CLI tests' replicas and
the SmolLM2 ones take 0.1 each), or it waits for CPUs that never free."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir

PAGE_SIZE = 8
MAX_MODEL_LEN = 256
# "<s> content " per message, then "<s>" to prompt the assistant: every turn's prompt starts with the previous
# turn's prompt and reply, as in a real chat template.
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"


@pytest.fixture(scope="session")
def ray_address() -> str:
    """Starts the session's local Ray instance (2 CPUs, no dashboard); its GCS address, for processes that join."""
    ray = pytest.importorskip("ray")
    t0 = time.perf_counter()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception:  # noqa: BLE001 - "the current node timed out during startup" on a loaded machine: once more
        logging.getLogger(__name__).warning("Ray did not start; trying once more", exc_info=True)
        ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    logging.getLogger(__name__).info("Ray started in %.1f s", time.perf_counter() - t0)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    root = make_tiny_model_dir(tmp_path_factory.mktemp("cluster") / "tiny")
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root


@pytest.fixture(scope="session")
def tiny_config(tiny_chat_dir):
    from jaxinfer.engine.config import EngineConfig

    return EngineConfig(model=str(tiny_chat_dir), warmup=False, page_size=PAGE_SIZE, max_num_seqs=16,
                        max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="session")
def pool(ray_address, tiny_config):
    """Two tiny replicas (half a CPU each), shared by the tests' routers."""
    from jaxinfer.cluster.config import ClusterConfig
    from jaxinfer.cluster.pool import ReplicaPool

    started = asyncio.run(ReplicaPool.start(tiny_config, ClusterConfig(num_replicas=2, replica_cpus=0.5,
                                                                      start_timeout_s=300)))
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def disagg_pool(ray_address, tiny_config):
    """One prefill and one decode replica (tp 1), and a decode replica with tensor_parallel_size 2 on two fake CPU
    devices (its actor's XLA_FLAGS), a quarter CPU each: the routers of the disaggregation tests pick among them."""
    import dataclasses

    from jaxinfer.cluster.config import ClusterConfig
    from jaxinfer.cluster.pool import ReplicaHandle, ReplicaPool
    from jaxinfer.cluster.replica import ReplicaRole

    async def start():
        return await asyncio.gather(
            ReplicaPool.start(tiny_config, ClusterConfig(num_replicas=0, prefill_replicas=1, decode_replicas=1,
                                                         replica_cpus=0.25, start_timeout_s=300)),
            ReplicaPool.start(tiny_config, ClusterConfig(num_replicas=1, replica_cpus=0.25, start_timeout_s=300),
                              {ReplicaRole.MIXED: dataclasses.replace(tiny_config, tensor_parallel_size=2)}))

    pd, tp2 = asyncio.run(start())
    (handle,) = tp2.replicas
    tp2_decode = ReplicaHandle(handle.actor, dataclasses.replace(handle.info, role=ReplicaRole.DECODE))
    yield {"prefill": pd.replicas[0], "decode": pd.replicas[1], "decode_tp2": tp2_decode}
    pd.shutdown()
    tp2.shutdown()
