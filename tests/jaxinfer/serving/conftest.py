"""Fixtures of the serving tests: one server with both front ends on SmolLM2 (float32), for the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def both_servers():
    """gRPC + the OpenAI HTTP API (with and without an API key) on one SmolLM2 engine."""
    from jaxinfer.engine.config import EngineConfig
    from tests.jaxinfer.serving.http_server import BothServers

    servers = BothServers(EngineConfig(dtype="float32", max_num_seqs=32, max_num_batched_tokens=512,
                                       kv_cache_memory_bytes=160 << 20, warmup=False))
    servers.wait_serving()
    yield servers
    servers.stop()
