"""Speculative decoding's Prometheus metrics (vLLM's `jaxinfer:spec_decode_num_*` and jaxinfer's own
`jaxinfer:spec_*`): exported from `Engine.stats()` only when speculation is on, with the engine's values; and a
gRPC server with speculation on streams the tokens of a server without it (greedy) while its /metrics endpoint
shows the drafts."""

from __future__ import annotations

import urllib.request

import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.metrics import ServerMetrics
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir
from tests.jaxinfer.serving.test_server import ServerThread

BASE_STATS = {"running": 1, "waiting": 2, "kv_pages_used": 3, "kv_pages_total": 10, "preemptions": 0, "steps": 7}
SPEC_STATS = {"spec_draft_tokens": 40, "spec_accepted_tokens": 30, "spec_verify_rows": 10, "spec_emitted_tokens": 40,
              "spec_decode_rows": 12, "spec_decode_tokens": 42, "spec_verify_steps": 9, "spec_off_steps": 2,
              "spec_acceptance_rate": 0.75, "spec_mean_accepted_length": 4.0, "spec_tokens_per_decode_step": 3.5}
# `Engine.stats()` key -> exported counter (without `_total`): vLLM's three names, then jaxinfer's own.
COUNTERS = {"spec_verify_rows": "spec_decode_num_drafts", "spec_draft_tokens": "spec_decode_num_draft_tokens",
            "spec_accepted_tokens": "spec_decode_num_accepted_tokens", "spec_emitted_tokens": "spec_emitted_tokens",
            "spec_decode_rows": "spec_decode_rows", "spec_decode_tokens": "spec_decode_tokens",
            "spec_verify_steps": "spec_verify_steps", "spec_off_steps": "spec_off_steps"}
GAUGES = ("spec_acceptance_rate", "spec_mean_accepted_length", "spec_tokens_per_decode_step")
MODEL = "tiny"


def _server_metrics(stats) -> ServerMetrics:
    return ServerMetrics(stats, model_name=MODEL)


def _spec_samples(metrics: ServerMetrics) -> dict[str, float]:
    samples = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.startswith("jaxinfer:spec_"):
                assert s.labels == {"model_name": metrics.model_name}, s
                samples[s.name] = s.value
    return samples


def test_spec_metrics_only_when_speculation_is_on():
    assert _spec_samples(_server_metrics(lambda: dict(BASE_STATS))) == {}
    assert _spec_samples(_server_metrics(lambda: None)) == {}  # engine still warming up: nothing, no error
    samples = _spec_samples(_server_metrics(lambda: BASE_STATS | SPEC_STATS))
    want = {f"jaxinfer:{name}_total": SPEC_STATS[key] for key, name in COUNTERS.items()}  # counters get _total
    want |= {f"jaxinfer:{g}": SPEC_STATS[g] for g in GAUGES}
    assert samples == want
    types = {family.name: family.type
             for family in _server_metrics(lambda: BASE_STATS | SPEC_STATS).registry.collect()}
    assert all(types[f"jaxinfer:{name}"] == "counter" for name in COUNTERS.values())
    assert all(types[f"jaxinfer:{g}"] == "gauge" for g in GAUGES)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("spec_metrics") / "tiny")


def test_server_with_ngram_streams_plain_greedy_tokens_and_exports_the_engines_spec_stats(tiny_model):
    prompt = [29] * 8  # "w29" x 8: the tiny model's greedy continuation repeats in stretches (drafts pay)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=32))
    streams = {}
    for name, spec in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": 2})):
        st = ServerThread(EngineConfig.create(model=str(tiny_model), kv_cache_memory_bytes=8 << 20, warmup=False,
                                       speculative_config=spec))
        try:
            st.wait_serving()
            streams[name] = [t for r in st.stub.Generate(request, timeout=120) for t in r.token_ids]
            body = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics",
                                          timeout=10).read().decode()
            stats = st.engine.stats()
            samples = _spec_samples(st.server.metrics)
            itl_count = st.server.metrics.sample("jaxinfer:inter_token_latency_seconds_count")
            generated = st.server.metrics.sample("jaxinfer:generation_tokens_total")
        finally:
            st.stop()
        # one inter-token latency per token after the first, however many tokens an output (a verify step) brought
        assert generated == len(streams[name]) and itl_count == len(streams[name]) - 1
        if spec is None:
            assert "jaxinfer:spec_" not in body and samples == {}
            continue
        label = f'{{model_name="{st.server.served.model_name}"}}'
        for key, name in COUNTERS.items():
            assert f"jaxinfer:{name}_total{label} " in body, name
            assert samples[f"jaxinfer:{name}_total"] == stats[key]
        for g in GAUGES:
            assert f"# TYPE jaxinfer:{g} gauge" in body, g
            assert samples[f"jaxinfer:{g}"] == pytest.approx(stats[g])
        assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
        assert stats["spec_decode_tokens"] >= 31  # decode steps made all tokens but the prefill's first
    assert streams["spec"] == streams["plain"] and len(streams["plain"]) == 32
