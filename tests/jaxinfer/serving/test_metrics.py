"""The server's Prometheus metrics without a model: a request's outputs through `RequestRecorder` (hand-computed
latencies), the engine collector (vLLM's names, `model_name` on every sample, tokens per step from
`EngineMetrics`), and the metrics port (`/metrics` only)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.engine.metrics import EngineMetrics
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.serving.metrics import ServerMetrics, buckets_1_2_5, buckets_powers_of_2
from jaxinfer.serving.metrics_port import MetricsPort

STATS = {"running": 1, "waiting": 2, "kv_pages_used": 3, "kv_pages_total": 12, "preemptions": 4, "steps": 7,
         "run_ahead_steps": 5, "run_ahead_dropped_steps": 1}
PROMPT = [5, 6, 7]


def _metrics(stats: dict | None = None, steps: dict[int, int] | None = None, **kw) -> ServerMetrics:
    return ServerMetrics(lambda: stats, model_name="tiny-model", steps_by_num_tokens=lambda: dict(steps or {}), **kw)


def _output(deltas: dict[int, list[int]], totals: dict[int, list[int]], finishes: dict[int, str | None],
            t: float | None, first_token_time: float | None, finish_time: float | None = None,
            rate: float = 0.0) -> RequestOutput:
    """One output of a request that arrived at 10.0 and was first scheduled at 10.5; `t` is when its new tokens
    were made."""
    completions = [CompletionOutput(index=i, text="", token_ids=totals[i], finish_reason=finishes[i],
                                    delta_token_ids=deltas.get(i, [])) for i in sorted(totals)]
    times = RequestMetrics(arrival_time=10.0, first_token_time=first_token_time, finish_time=finish_time,
                           ttft_s=(first_token_time or 10.0) - 10.0, decode_tokens_per_s=rate,
                           first_scheduled_time=10.5, last_token_time=t)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=PROMPT, outputs=completions,
                         finished=all(finishes.values()), metrics=times)


def _two_sample_request() -> list[RequestOutput]:
    """n = 2. Sample 0: 1 token at 11.0, 2 (verified drafts) at 11.5, 1 at 12.5 (length). Sample 1: 1 token at
    11.5, 1 at 12.5 (stop)."""
    return [
        _output({0: [1]}, {0: [1], 1: []}, {0: None, 1: None}, 11.0, 11.0),
        _output({0: [2, 3], 1: [8]}, {0: [1, 2, 3], 1: [8]}, {0: None, 1: None}, 11.5, 11.0),
        _output({0: [4], 1: [9]}, {0: [1, 2, 3, 4], 1: [8, 9]}, {0: "length", 1: "stop"}, 12.5, 11.0,
                finish_time=12.5, rate=2.0),
    ]


def test_a_request_s_outputs_give_its_token_counts_latencies_and_outcome():
    m = _metrics()
    outs = _two_sample_request()
    recorder = m.admitted(outs[0])
    for out in outs:
        recorder.record(out)
    recorder.record(outs[-1])  # a repeated last output is not counted twice
    value = m.sample
    assert value("jaxinfer:prompt_tokens_total") == 3
    assert value("jaxinfer:generation_tokens_total") == 6
    # Inter-token latency: sample 0: 0.5 s / 2 tokens twice, then 1.0 s; sample 1: 1.0 s. 4 = (4 - 1) + (2 - 1).
    assert value("jaxinfer:inter_token_latency_seconds_count") == 4
    assert value("jaxinfer:inter_token_latency_seconds_sum") == 0.25 + 0.25 + 1.0 + 1.0
    assert value("jaxinfer:inter_token_latency_seconds_bucket", {"le": "0.2"}) == 0
    assert value("jaxinfer:inter_token_latency_seconds_bucket", {"le": "0.3"}) == 2
    assert value("jaxinfer:inter_token_latency_seconds_bucket", {"le": "1.0"}) == 4
    assert (value("jaxinfer:time_to_first_token_seconds_count"), value("jaxinfer:time_to_first_token_seconds_sum")) \
        == (1, 1.0)
    phases = {"e2e_request_latency": 2.5, "request_queue_time": 0.5, "request_prefill_time": 0.5,
              "request_decode_time": 1.5, "request_inference_time": 2.0, "request_time_per_output_token": 0.5}
    for name, seconds in phases.items():
        assert value(f"jaxinfer:{name}_seconds_count") == 1, name
        assert value(f"jaxinfer:{name}_seconds_sum") == seconds, name
    assert (value("jaxinfer:request_prompt_tokens_count"), value("jaxinfer:request_prompt_tokens_sum")) == (1, 3)
    assert value("jaxinfer:request_generation_tokens_sum") == 6
    # one request, counted by the first of error, abort, length, stop among its samples' reasons
    reasons = {r: value("jaxinfer:request_success_total", {"finished_reason": r})
               for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 0, "length": 1, "abort": 0, "error": 0}


def test_a_request_its_caller_left_counts_once_as_aborted():
    m = _metrics()
    outs = _two_sample_request()
    left = m.admitted(outs[0])
    left.record(outs[0])
    left.abandoned()
    left.abandoned()
    done = m.admitted(outs[0])
    for out in outs:
        done.record(out)
    done.abandoned()  # after its finished output: nothing
    reasons = {r: m.sample("jaxinfer:request_success_total", {"finished_reason": r}) for r in ("length", "abort")}
    assert reasons == {"length": 1, "abort": 1}


def test_a_request_that_failed_before_its_first_token_has_no_token_phases():
    m = _metrics()
    out = _output({}, {0: []}, {0: "error"}, None, None, finish_time=11.0)
    m.admitted(out).record(out)
    assert m.sample("jaxinfer:request_success_total", {"finished_reason": "error"}) == 1
    assert m.sample("jaxinfer:e2e_request_latency_seconds_sum") == 1.0
    assert m.sample("jaxinfer:request_queue_time_seconds_count") == 1
    for name in ("request_prefill_time", "request_decode_time", "request_inference_time", "time_to_first_token",
                 "inter_token_latency"):
        assert m.sample(f"jaxinfer:{name}_seconds_count") == 0, name


def test_engine_gauges_and_counters_have_vllm_names_and_the_model_name():
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in _metrics(STATS).registry.collect() for s in family.samples}
    label = (("model_name", "tiny-model"),)
    for name, value in (("jaxinfer:num_requests_running", 1), ("jaxinfer:num_requests_waiting", 2),
                        ("jaxinfer:kv_cache_usage_perc", 3 / 12), ("jaxinfer:kv_pages_used", 3),
                        ("jaxinfer:kv_pages_total", 12), ("jaxinfer:num_preemptions_total", 4),
                        ("jaxinfer:engine_steps_total", 7), ("jaxinfer:run_ahead_steps_total", 5),
                        ("jaxinfer:run_ahead_dropped_steps_total", 1)):
        assert samples[(name, label)] == pytest.approx(value), name
    assert all(dict(labels).get("model_name") == "tiny-model" for _, labels in samples)
    assert not any(name.startswith("jaxinfer:prefix_cache") for name, _ in samples)  # prefix caching off
    assert not any(name.startswith("jaxinfer:num_requests") for family in _metrics(None).registry.collect()
                   for name in [family.name])  # engine still loading: no engine families, no error


def test_prefix_cache_counters_are_vllm_s_queries_and_hits():
    stats = STATS | {"prefix_cache_queried_tokens": 90, "prefix_cache_hit_tokens": 30, "prefix_cache_hit_rate": 1 / 3,
                     "prefix_cache_pages": 2, "prefix_cache_evictions": 1, "prefix_cache_host_pages": 0,
                     "prefix_cache_host_hits": 0}
    m = _metrics(stats)
    assert m.sample("jaxinfer:prefix_cache_queries_total") == 90
    assert m.sample("jaxinfer:prefix_cache_hits_total") == 30
    assert m.sample("jaxinfer:prefix_cache_hit_rate") == pytest.approx(1 / 3)
    assert m.sample("jaxinfer:prefix_cache_evictions_total") == 1


def test_iteration_tokens_histogram_counts_each_step_of_the_engine():
    step_tokens = [1, 1, 3, 40, 48, 7, 64, 2]
    em = EngineMetrics()
    for n in step_tokens:
        em.record_step(prefill_tokens=n // 2, decode_tokens=n - n // 2, step_s=0.01, device_s=0.005)
    m = _metrics(STATS, em.steps_by_num_tokens, max_num_batched_tokens=48)
    name = "jaxinfer:iteration_tokens_total"
    assert m.sample(name + "_count") == len(step_tokens) and m.sample(name + "_sum") == sum(step_tokens)
    for le in (1, 2, 4, 8, 16, 32, 48):
        assert m.sample(name + "_bucket", {"le": f"{float(le)}"}) == sum(n <= le for n in step_tokens), le
    assert m.sample(name + "_bucket", {"le": "+Inf"}) == len(step_tokens)  # 64 > the budget: a verify step, say


def test_bucket_series():
    assert buckets_1_2_5(1) == (1,) and buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert buckets_powers_of_2(512) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert buckets_powers_of_2(48) == (1, 2, 4, 8, 16, 32, 48)


def test_metrics_port_answers_metrics_only():
    m = _metrics(STATS)
    port = MetricsPort(m.registry, 0)
    base = f"http://127.0.0.1:{port.port}"
    try:
        for path in ("/metrics", "/metrics?name[]=x"):
            with urllib.request.urlopen(base + path, timeout=10) as reply:
                assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
                families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
            assert families["jaxinfer:num_requests_waiting"].samples[0].value == 2
        for path in ("/", "/metrics/", "/metricsx", "/v1/models", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(base + path, timeout=10)
            assert info.value.code == 404, path
        head = urllib.request.Request(base + "/metrics", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b""
    finally:
        port.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "/metrics", timeout=10)


def test_metrics_port_refuses_a_port_in_use():
    first = MetricsPort(_metrics().registry, 0)
    try:
        with pytest.raises(OSError):
            MetricsPort(_metrics().registry, first.port)
    finally:
        first.close()


def test_served_engine_labels_its_metrics_with_the_served_model_name():
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.serving.openai import translate
    from jaxinfer.serving.served import ServedEngine, served_model_name

    config = EngineConfig(model="/models/Tiny-Chat.Q4_K_M.gguf", max_model_len=64)
    assert ServedEngine(config).metrics.model_name == ServedEngine(config).model_name == "Tiny-Chat"
    named = ServedEngine(config, model_name="my-model")
    assert named.metrics.sample("jaxinfer:prompt_tokens_total") == 0
    assert named.metrics.registry.get_sample_value("jaxinfer:prompt_tokens_total", {"model_name": "my-model"}) == 0
    assert named.metrics.sample("jaxinfer:request_prompt_tokens_bucket", {"le": "50.0"}) == 0  # up to max_model_len
    assert named.metrics.sample("jaxinfer:request_prompt_tokens_bucket", {"le": "100.0"}) is None
    assert translate.served_model_name is served_model_name  # one home, still importable from translate
