"""Prometheus metrics of the gRPC server (`prometheus-client`), served over HTTP on `--metrics-port`.

Per-request values (TTFT, TPOT, outcomes, tokens) are recorded by the server as streams end; engine gauges
(running / waiting sequences, KV pages, preemptions) are read from `Engine.stats()` at scrape time by a custom
collector, so the engine keeps no Prometheus state. The prefix cache's (`jaxinfer_prefix_cache_*`) and speculative
decoding's (`jaxinfer_spec_*`) metrics appear only when the feature is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds; TTFT spans queueing + prefill, TPOT one decode step of a batch.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


_PREFIX_CACHE_METRICS = (
    (CounterMetricFamily, "jaxinfer_prefix_cache_queried_tokens", "prefix_cache_queried_tokens",
     "tokens of admitted sequences looked up in the prefix cache"),
    (CounterMetricFamily, "jaxinfer_prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
     "of those, tokens taken from the cache"),
    (GaugeMetricFamily, "jaxinfer_prefix_cache_hit_rate", "prefix_cache_hit_rate", "hit tokens / queried tokens"),
    (GaugeMetricFamily, "jaxinfer_prefix_cache_pages", "prefix_cache_pages", "device KV pages holding cached prefixes"),
    (CounterMetricFamily, "jaxinfer_prefix_cache_evictions", "prefix_cache_evictions", "cached pages evicted for reuse"),
    (GaugeMetricFamily, "jaxinfer_prefix_cache_host_pages", "prefix_cache_host_pages", "pages in the host-memory tier"),
    (CounterMetricFamily, "jaxinfer_prefix_cache_host_hits", "prefix_cache_host_hits",
     "pages brought back from the host tier"),
)

_SPEC_METRICS = (
    (CounterMetricFamily, "jaxinfer_spec_draft_tokens", "spec_draft_tokens", "speculative draft tokens verified"),
    (CounterMetricFamily, "jaxinfer_spec_accepted_tokens", "spec_accepted_tokens", "of those, drafts accepted"),
    (CounterMetricFamily, "jaxinfer_spec_verify_rows", "spec_verify_rows", "sequence-steps that verified drafts"),
    (CounterMetricFamily, "jaxinfer_spec_emitted_tokens", "spec_emitted_tokens",
     "tokens those sequence-steps produced (accepted drafts + the target's own token)"),
    (CounterMetricFamily, "jaxinfer_spec_decode_rows", "spec_decode_rows",
     "decode sequence-steps, with or without drafts"),
    (CounterMetricFamily, "jaxinfer_spec_decode_tokens", "spec_decode_tokens", "tokens those sequence-steps produced"),
    (CounterMetricFamily, "jaxinfer_spec_verify_steps", "spec_verify_steps", "engine steps that verified drafts"),
    (CounterMetricFamily, "jaxinfer_spec_off_steps", "spec_off_steps",
     "engine steps with decoding sequences where the batch size turned speculation off"),
    (GaugeMetricFamily, "jaxinfer_spec_acceptance_rate", "spec_acceptance_rate",
     "draft acceptance rate: accepted / drafted tokens"),
    (GaugeMetricFamily, "jaxinfer_spec_mean_accepted_length", "spec_mean_accepted_length",
     "tokens per sequence-step that verified drafts (accepted drafts + 1)"),
    (GaugeMetricFamily, "jaxinfer_spec_tokens_per_decode_step", "spec_tokens_per_decode_step",
     "tokens per decode sequence-step, with or without drafts (1.0 without speculation)"),
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:  # the engine is still warming up
            return
        for name, key, doc in (("jaxinfer_requests_running", "running", "sequences in the running batch"),
                               ("jaxinfer_requests_waiting", "waiting", "sequences waiting to be scheduled"),
                               ("jaxinfer_kv_pages_used", "kv_pages_used", "KV cache pages in use"),
                               ("jaxinfer_kv_pages_total", "kv_pages_total", "KV cache pages (null page excluded)")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield CounterMetricFamily("jaxinfer_preemptions", "sequences preempted (recomputed later)",
                                  value=s["preemptions"])
        yield CounterMetricFamily("jaxinfer_engine_steps", "engine steps run", value=s["steps"])
        if "prefix_cache_hit_tokens" in s:  # prefix caching on
            for family, name, key, doc in _PREFIX_CACHE_METRICS:
                yield family(name, doc, value=s[key])
        if "spec_draft_tokens" in s:  # speculative decoding on
            for family, name, key, doc in _SPEC_METRICS:
                yield family(name, doc, value=s[key])


class ServerMetrics:
    """The server's metrics in their own registry (tests can run several servers in one process).

    Args:
      engine_stats: returns `Engine.stats()`, or None while no engine is ready.
    """

    def __init__(self, engine_stats: Callable[[], dict | None]) -> None:
        self.registry = CollectorRegistry()
        self.ttft_s = Histogram("jaxinfer_time_to_first_token_seconds", "arrival to first token",
                                buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.tpot_s = Histogram("jaxinfer_time_per_output_token_seconds",
                                "mean time per output token after the first, per request",
                                buckets=TPOT_BUCKETS_S, registry=self.registry)
        self.generated_tokens = Counter("jaxinfer_generated_tokens", "tokens generated", registry=self.registry)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=self.registry)
        self.requests = Counter("jaxinfer_requests", "requests by final gRPC status", ["status"],
                                registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the HTTP exporter (a daemon thread); returns the bound port (pass 0 for any free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]

    def record_finished(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft_s.observe(ttft_s)
        if tpot_s is not None:
            self.tpot_s.observe(tpot_s)
