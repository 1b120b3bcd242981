"""Two tiny replicas on the session's Ray instance behind the router's HTTP API, driven by the official `openai`
client: output identical to one in-process engine (greedy and seeded), streaming, a client that leaves, the
prefix-cache hit rate of a multi-turn chat under each routing policy (the replicas' own counters), and 503 when no
replica answers."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx2 as httpx
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.prompt import Prompt
from tests.jaxinfer.cluster.conftest import MAX_MODEL_LEN, PAGE_SIZE

pytest.importorskip("ray")  # the optional extra jaxinfer[cluster]
from tests.jaxinfer.cluster.router_server import RouterServer  # noqa: E402 - needs Ray
from tests.jaxinfer.engine.tiny_model import FIRST_WORD_ID, VOCAB_SIZE, random_prompts

PROMPTS = random_prompts(6, seed=3, min_len=4, max_len=30)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def router(tiny_config, pool):
    server = RouterServer(tiny_config, pool, RoutingConfig("cache_aware"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_chat_dir) -> LLM:
    """One engine in this process, with the replicas' options."""
    return LLM(str(tiny_chat_dir), warmup=False, page_size=PAGE_SIZE, max_num_seqs=16, max_num_batched_tokens=512,
               max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=4 << 20)


def _routed(server: RouterServer) -> list[int]:
    return [r.requests_routed for r in server.cluster.replicas]


def _texts(server: RouterServer, params: SamplingParams, prompts=PROMPTS) -> list[str]:
    extra = {"ignore_eos": True, **({"top_k": params.top_k} if params.top_k else {})}
    response = server.client().completions.create(
        model=server.served.model_name, prompt=prompts, max_tokens=params.max_tokens, temperature=params.temperature,
        top_p=params.top_p, seed=params.seed, extra_body=extra)
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_two_replicas_answer_as_one_engine_token_for_token(router, reference, params):
    expected = [o.outputs[0] for o in reference.generate([Prompt(tuple(p)) for p in PROMPTS], params,
                                                         use_tqdm=False)]
    assert len({tuple(c.token_ids) for c in expected}) == len(PROMPTS)  # distinct: the comparison has teeth
    before = _routed(router)
    assert _texts(router, params) == [c.text for c in expected]
    assert all(after > b for after, b in zip(_routed(router), before))  # both replicas served some prompts
    # streamed: the chunks add up to the same text
    stream = router.client().completions.create(
        model=router.served.model_name, prompt=PROMPTS[0], max_tokens=params.max_tokens,
        temperature=params.temperature, top_p=params.top_p, seed=params.seed, stream=True,
        extra_body={"ignore_eos": True, **({"top_k": params.top_k} if params.top_k else {})})
    assert "".join(chunk.choices[0].text for chunk in stream) == expected[0].text


def test_a_refused_request_is_a_400_naming_the_field(router):
    import openai

    with pytest.raises(openai.BadRequestError, match="max_tokens=1000"):
        router.client().completions.create(model=router.served.model_name, prompt=PROMPTS[0], max_tokens=1000)


def _wait_idle(server: RouterServer, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.replica_stats()
        if all(s["running"] == s["waiting"] == 0 for s in stats) and not any(
                r.target.in_flight for r in server.cluster.replicas):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_aborts_its_request_on_the_replica(router):
    before = sum(s["decode_tokens"] for s in _wait_idle(router))
    max_tokens = MAX_MODEL_LEN - 8
    body = {"model": router.served.model_name, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", router.base_url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert "text" in json.loads(line[6:])["choices"][0]
                break  # leave after the first chunk
    decoded = sum(s["decode_tokens"] for s in _wait_idle(router)) - before
    assert decoded < max_tokens - 1, decoded  # the replica stopped early: the request was aborted there


# --- routing -----------------------------------------------------------------------------------------------------


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(FIRST_WORD_ID, VOCAB_SIZE, n))


def _chat_workload(server: RouterServer, salt: str, conversations: int = 8, turns: int = 4) -> None:
    """Multi-turn chats sent one request at a time: each round sends every conversation's next turn in a seeded
    random order; each turn's prompt is the conversation so far (a shared system prompt, then user and assistant
    messages)."""
    rng = np.random.default_rng(7)
    system = _words(rng, 6)
    users = [[_words(rng, 12) for _ in range(turns)] for _ in range(conversations)]
    chats = [[{"role": "system", "content": system}] for _ in range(conversations)]
    client = server.client()
    for turn in range(turns):
        for c in rng.permutation(conversations):
            chats[c].append({"role": "user", "content": users[c][turn]})
            reply = client.chat.completions.create(model=server.served.model_name, messages=chats[c],
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True, "cache_salt": salt})
            chats[c].append({"role": "assistant", "content": reply.choices[0].message.content})


def _hit_rate(before: list[dict], after: list[dict]) -> float:
    hits = sum(a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"] for a, b in zip(after, before))
    queried = sum(a["prefix_cache_queried_tokens"] - b["prefix_cache_queried_tokens"] for a, b in zip(after, before))
    return hits / queried


def test_cache_aware_routing_keeps_one_engines_prefix_hits_round_robin_loses_them(tiny_config, pool):
    """The replicas' prefix-cache counters over 8 conversations x 4 turns; each run under its own cache salt, so no
    run finds another's pages. "single" routes to one replica only: one engine."""
    from jaxinfer.cluster.pool import ReplicaPool

    rates, routed = {}, {}
    for name, replicas, policy in (("single", pool.replicas[:1], "round_robin"),
                                   ("cache_aware", pool.replicas, "cache_aware"),
                                   ("round_robin", pool.replicas, "round_robin")):
        server = RouterServer(tiny_config, ReplicaPool(list(replicas), owned=False), RoutingConfig(policy))
        try:
            before = _wait_idle(server)
            _chat_workload(server, salt=name)
            rates[name] = _hit_rate(before, _wait_idle(server))
            routed[name] = _routed(server)
            metrics = httpx.get(server.base_url + "/metrics").text
            for r in server.cluster.replicas:
                assert f'jaxinfer:router_requests_total{{model_name="tiny",replica="{r.name}"}} ' \
                       f'{float(r.requests_routed)}' in metrics
        finally:
            server.stop()
    print(f"prefix-cache hit rates: {rates}; requests per replica: {routed}")
    assert sum(routed["cache_aware"]) == 32 and min(routed["cache_aware"]) >= 8  # both replicas took conversations
    assert rates["single"] > 0.5
    assert rates["cache_aware"] >= 0.9 * rates["single"], rates
    assert rates["round_robin"] <= 0.8 * rates["single"], rates


# --- no replica ---------------------------------------------------------------------------------------------------


def test_a_router_whose_replicas_are_all_dead_answers_503(tiny_config, pool):
    """A replica actor killed before its engine was built: the router answers 503 (OpenAI-shaped), at once."""
    import openai
    import ray

    from jaxinfer.cluster.pool import ReplicaHandle, ReplicaPool
    from jaxinfer.cluster.replica import EngineReplica

    dead = ray.remote(EngineReplica).options(num_cpus=0.01).remote(tiny_config, "dead")
    ray.kill(dead, no_restart=True)
    info = dataclasses.replace(pool.replicas[0].info, name="dead")
    server = RouterServer(tiny_config, ReplicaPool([ReplicaHandle(dead, info)], owned=False), RoutingConfig())
    try:
        for _ in range(2):  # the request that finds it dead, then one refused before routing
            t0 = time.monotonic()
            with pytest.raises(openai.InternalServerError) as e:
                server.client().completions.create(model=server.served.model_name, prompt=PROMPTS[0], max_tokens=4)
            assert e.value.status_code == 503 and time.monotonic() - t0 < 10
            assert e.value.body["type"] == "service_unavailable_error"
        assert "no replica is reachable" in e.value.body["message"]
        deadline = time.monotonic() + 10
        while (health := httpx.get(server.base_url + "/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.json()["error"]["type"] == "service_unavailable_error"
    finally:
        server.stop()
