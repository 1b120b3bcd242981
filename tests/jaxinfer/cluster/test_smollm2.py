"""SmolLM2 end to end through the router (issue 25's real-model case): two replicas of the real model behind the
HTTP API answer chat questions as one in-process engine does, greedy, token for token."""

from __future__ import annotations

import asyncio

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig

pytest.importorskip("ray")  # the optional extra jaxinfer[cluster]
from jaxinfer.cluster.config import ClusterConfig  # noqa: E402
from jaxinfer.cluster.pool import ReplicaPool  # noqa: E402
from jaxinfer.cluster.routing import RoutingConfig  # noqa: E402
from tests.jaxinfer.cluster.router_server import RouterServer  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a primary color."]
MAX_TOKENS = 12


@pytest.mark.slow
def test_two_smollm2_replicas_answer_as_one_engine(ray_address, smollm2_llm):
    config = EngineConfig(dtype="float32", warmup=False, max_num_seqs=4, max_model_len=512,
                          kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = [smollm2_llm.chat([{"role": "user", "content": q}], params, use_tqdm=False)[0].outputs[0].text
            for q in QUESTIONS]  # one at a time, as the replicas get them
    assert "Paris" in want[0] and want[0] != want[1]
    pool = asyncio.run(ReplicaPool.start(config, ClusterConfig(num_replicas=2, replica_cpus=0.1,
                                                               start_timeout_s=600)))
    try:
        server = RouterServer(config, pool, RoutingConfig("round_robin"))
        try:
            client = server.client()
            got = [client.chat.completions.create(model=server.served.model_name, max_tokens=MAX_TOKENS,
                                                  temperature=0, messages=[{"role": "user", "content": q}])
                   .choices[0].message.content for q in QUESTIONS]
            assert got == want
            assert [r.requests_routed for r in server.cluster.replicas] == [1, 1]  # each replica answered one
        finally:
            server.stop()
    finally:
        pool.shutdown()
