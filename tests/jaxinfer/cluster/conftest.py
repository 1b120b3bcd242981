"""Fixtures of the cluster tests: ONE local Ray instance (2 CPUs) for the whole session, the tiny random Llama-3 with
a chat template, and one pool of two tiny replicas that every router of the tests routes over."""

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
