"""Disaggregated prefill/decode on the session's Ray instance (tiny replicas behind the router's HTTP API, driven by
the `openai` client): 1P1D and 1P1D with the decode side at tensor_parallel_size 2 answer as one in-process engine
token for token (greedy, seeded, logprobs spliced), the K/V moves through Ray's object store (the router counts
its bytes), and the conditional rule keeps short and cached prompts on the decode replica (counters)."""

from __future__ import annotations

import re

import httpx2 as httpx
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.cluster.disagg import DisaggConfig, LocalReason
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.prompt import Prompt
from tests.jaxinfer.cluster.conftest import MAX_MODEL_LEN, PAGE_SIZE

pytest.importorskip("ray")  # the optional extra jaxinfer[cluster]
from jaxinfer.cluster.pool import ReplicaPool  # noqa: E402 - needs Ray
from tests.jaxinfer.cluster.router_server import RouterServer  # noqa: E402
from tests.jaxinfer.engine.tiny_model import random_prompts  # noqa: E402

PROMPTS = random_prompts(5, seed=21, min_len=4, max_len=40)
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True,
                        presence_penalty=0.5, logprobs=2)
EVERY_PROMPT = DisaggConfig(min_prefill_tokens=0, local_cached_share=1.0)  # every prompt not held crosses


@pytest.fixture(scope="module")
def reference(tiny_chat_dir) -> LLM:
    return LLM(str(tiny_chat_dir), warmup=False, page_size=PAGE_SIZE, max_num_seqs=16, max_num_batched_tokens=512,
               max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=4 << 20)


def _router(tiny_config, replicas, disagg: DisaggConfig) -> RouterServer:
    return RouterServer(tiny_config, ReplicaPool(list(replicas), owned=False), RoutingConfig(), disagg=disagg)


def _complete(server: RouterServer, prompt: list[int], params: SamplingParams, stream: bool = False):
    """(text, token logprobs) of one completion."""
    kwargs = dict(model=server.served.model_name, prompt=prompt, max_tokens=params.max_tokens,
                  temperature=params.temperature, top_p=params.top_p, seed=params.seed, logprobs=params.logprobs,
                  presence_penalty=params.presence_penalty, extra_body={"ignore_eos": True})
    if not stream:
        choice = server.client().completions.create(**kwargs).choices[0]
        return choice.text, choice.logprobs.token_logprobs
    text, logprobs = "", []
    for chunk in server.client().completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text
        logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    return text, logprobs


def _kv_bytes_per_token(server: RouterServer) -> int:
    m = server.cluster.engine.model_config
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # K and V, float32 on the wire


@pytest.mark.parametrize("decode", ["decode", "decode_tp2"])
def test_1p1d_answers_as_one_engine_token_for_token(disagg_pool, tiny_config, reference, decode):
    server = _router(tiny_config, [disagg_pool["prefill"], disagg_pool[decode]], EVERY_PROMPT)
    try:
        assert server.cluster.replicas[1].handle.info.config.tensor_parallel_size == (2 if decode.endswith("2") else 1)
        for params in (GREEDY, SEEDED):
            expected = [o.outputs[0] for o in reference.generate([Prompt(tuple(p)) for p in PROMPTS], params,
                                                                 use_tqdm=False)]
            assert len({tuple(c.token_ids) for c in expected}) == len(PROMPTS)
            before = server.cluster.counters.handoffs, server.cluster.counters.handoff_bytes
            for i, (prompt, want) in enumerate(zip(PROMPTS, expected)):
                text, logprobs = _complete(server, prompt, params, stream=i % 2 == 1)
                assert text == want.text
                # the first token's logprob came from the prefill replica, the rest from the decode replica
                np.testing.assert_allclose(logprobs, [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)],
                                           rtol=1e-4, atol=1e-4)
            counters = server.cluster.counters
            assert counters.handoffs - before[0] == len(PROMPTS)
            # each handoff moved the prompt's K/V (its positions: the prompt, the first token's comes next step)
            assert counters.handoff_bytes - before[1] == _kv_bytes_per_token(server) * sum(map(len, PROMPTS))
        assert sum(counters.local_prefills.values()) == 0 and counters.prefill_queue == 0
    finally:
        server.stop()


def test_a_quantized_wire_moves_fewer_bytes(disagg_pool, tiny_config):
    server = _router(tiny_config, [disagg_pool["prefill"], disagg_pool["decode"]],
                     DisaggConfig(min_prefill_tokens=0, local_cached_share=1.0, wire_dtype="bfloat16"))
    try:
        reply = server.client().completions.create(model=server.served.model_name, prompt=PROMPTS[0], max_tokens=6,
                                                   temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 6
        assert server.cluster.counters.handoff_bytes == _kv_bytes_per_token(server) // 2 * len(PROMPTS[0])
    finally:
        server.stop()


def test_a_handoff_that_does_not_arrive_goes_on_from_the_first_token(disagg_pool, tiny_config, reference):
    """The prefill replica's export fails (a wire dtype past the flag's check): the decode replica resumes the
    request from its first token, and the client's stream is still one engine's."""
    import ray

    broken = DisaggConfig(min_prefill_tokens=0, local_cached_share=1.0)
    object.__setattr__(broken, "wire_dtype", "float16")
    prefill = disagg_pool["prefill"]
    server = _router(tiny_config, [prefill, disagg_pool["decode"]], broken)
    try:
        want = reference.generate([Prompt(tuple(PROMPTS[2]))], SEEDED, use_tqdm=False)[0].outputs[0]
        text, logprobs = _complete(server, PROMPTS[2], SEEDED, stream=True)
        assert text == want.text
        np.testing.assert_allclose(logprobs, [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)],
                                   rtol=1e-4, atol=1e-4)
        counters = server.cluster.counters
        assert (counters.handoffs, counters.resubmissions) == (0, {"handoff": 1})
        assert all(r.target.up for r in server.cluster.replicas)
        stats = ray.get(prefill.actor.stats.remote())[0]
        assert stats["kv_pages_used"] == 0  # the K/V held for the handoff was freed (cached pages count as free)
    finally:
        server.stop()


def _metric(text: str, name: str, labels: str = "") -> float:
    return float(re.search(rf'^jaxinfer:{name}\{{model_name="tiny"{labels}}} (\S+)$', text, re.M).group(1))


def test_short_and_cached_prompts_stay_on_the_decode_replica(disagg_pool, tiny_config, ray_address):
    """Threshold 32 tokens: a short prompt never crosses; a long one the decode replica does not hold does; the same
    long prompt again (now in the decode replica's cache, as the router's index predicts) does not."""
    import ray

    prefill = disagg_pool["prefill"]
    server = _router(tiny_config, [prefill, disagg_pool["decode"]],
                     DisaggConfig(min_prefill_tokens=32, local_cached_share=0.75))
    try:
        short, long = random_prompts(1, 5, 12, 12)[0], random_prompts(1, 6, 120, 120)[0]
        counters = server.cluster.counters
        prefilled = [ray.get(prefill.actor.stats.remote())[0]["prefill_tokens"]]

        def ask(prompt: list[int]) -> None:
            reply = server.client().completions.create(model=server.served.model_name, prompt=prompt, max_tokens=4,
                                                       temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 4
            prefilled.append(ray.get(prefill.actor.stats.remote())[0]["prefill_tokens"])

        ask(short)
        assert (counters.handoffs, counters.local_prefills[LocalReason.SHORT]) == (0, 1)
        ask(long)
        assert (counters.handoffs, sum(counters.local_prefills.values())) == (1, 1)
        ask(long)
        assert (counters.handoffs, counters.local_prefills[LocalReason.CACHED]) == (1, 1)
        assert np.diff(prefilled).tolist() == [0, len(long), 0]  # the prefill replica computed the long prompt once
        metrics = httpx.get(server.base_url + "/metrics").text
        assert _metric(metrics, "router_kv_handoffs_total") == 1
        assert _metric(metrics, "router_kv_handoff_bytes_total") == _kv_bytes_per_token(server) * len(long)
        assert _metric(metrics, "router_kv_handoff_seconds_count") == 1
        assert _metric(metrics, "router_local_prefills_total", ',reason="short"') == 1
        assert _metric(metrics, "router_local_prefills_total", ',reason="cached"') == 1
        assert _metric(metrics, "router_prefill_queue_length") == 0
    finally:
        server.stop()
