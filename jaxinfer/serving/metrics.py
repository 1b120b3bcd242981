"""Prometheus metrics of a server (`prometheus-client`): vLLM's names with `jaxinfer:` for `vllm:`, every sample
labelled `model_name` (the served model name), one registry for all front ends.

1. Per request, a front end feeds every output of a stream to its `RequestRecorder` (`ServerMetrics.admitted`):
   prompt tokens at admission; generated tokens, TTFT (once) and one inter-token latency per output token after
   the first as the outputs come; at the last output, the outcome (`request_success_total{finished_reason}`),
   the token counts and the phases (e2e, queue, prefill, decode, inference). Times come from the engine's clock
   (`RequestMetrics`), not from when the front end saw an output.
2. Engine state is read from `Engine.stats()` and `EngineMetrics.steps_by_num_tokens` at scrape time by a
   custom collector, so the engine keeps no Prometheus state: requests running / waiting, KV cache usage,
   preemptions, tokens per step; the prefix cache's and speculative decoding's only when the feature is on.
3. Metrics vLLM has no name for keep jaxinfer's under the same prefix (`jaxinfer:kv_pages_used`,
   `jaxinfer:engine_steps_total`, `jaxinfer:prefix_cache_host_*`, `jaxinfer:spec_*`,
   `jaxinfer:grpc_requests_total{status}`). `metrics_port.py` serves the registry on its own port.

Source: vLLM's metrics docs and `vllm/v1/metrics/loggers.py` (names, label names, the latency buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxinfer.outputs import RequestOutput

P = "jaxinfer:"
LABEL = "model_name"
# Seconds. TTFT and the request phases as vLLM buckets them, with finer steps below 0.3 s for the phases; the
# inter-token latency from 1 ms (a decode step of a small model).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                     50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# A request of n samples reports the first of these its samples finished with.
FINISH_REASONS = ("error", "abort", "length", "stop")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def buckets_powers_of_2(max_value: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_value, then max_value itself (tokens per step: the step budget is the top)."""
    out, b = [], 1
    while b < max_value:
        out.append(b)
        b *= 2
    return (*out, max_value)


# (family, name, `Engine.stats()` key, help); a counter's exported name gets `_total`.
_PREFIX_CACHE_METRICS = (
    (CounterMetricFamily, "prefix_cache_queries", "prefix_cache_queried_tokens",
     "prompt tokens of admitted requests looked up in the prefix cache"),
    (CounterMetricFamily, "prefix_cache_hits", "prefix_cache_hit_tokens", "of those, tokens taken from the cache"),
    (GaugeMetricFamily, "prefix_cache_hit_rate", "prefix_cache_hit_rate", "hit tokens / queried tokens, so far"),
    (GaugeMetricFamily, "prefix_cache_pages", "prefix_cache_pages", "device KV pages holding cached prefixes"),
    (CounterMetricFamily, "prefix_cache_evictions", "prefix_cache_evictions", "cached pages evicted for reuse"),
    (GaugeMetricFamily, "prefix_cache_host_pages", "prefix_cache_host_pages", "pages in the host-memory tier"),
    (CounterMetricFamily, "prefix_cache_host_hits", "prefix_cache_host_hits", "pages brought back from the host tier"),
)

_SPEC_METRICS = (
    (CounterMetricFamily, "spec_decode_num_drafts", "spec_verify_rows", "sequence-steps that verified drafts"),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "spec_draft_tokens", "speculative draft tokens verified"),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "spec_accepted_tokens", "of those, drafts accepted"),
    (CounterMetricFamily, "spec_emitted_tokens", "spec_emitted_tokens",
     "tokens the sequence-steps that verified drafts produced (accepted drafts + the target's own token)"),
    (CounterMetricFamily, "spec_decode_rows", "spec_decode_rows", "decode sequence-steps, with or without drafts"),
    (CounterMetricFamily, "spec_decode_tokens", "spec_decode_tokens", "tokens those sequence-steps produced"),
    (CounterMetricFamily, "spec_verify_steps", "spec_verify_steps", "engine steps that verified drafts"),
    (CounterMetricFamily, "spec_off_steps", "spec_off_steps",
     "engine steps with decoding sequences where the batch size turned speculation off"),
    (GaugeMetricFamily, "spec_acceptance_rate", "spec_acceptance_rate",
     "draft acceptance rate: accepted / drafted tokens"),
    (GaugeMetricFamily, "spec_mean_accepted_length", "spec_mean_accepted_length",
     "tokens per sequence-step that verified drafts (accepted drafts + 1)"),
    (GaugeMetricFamily, "spec_tokens_per_decode_step", "spec_tokens_per_decode_step",
     "tokens per decode sequence-step, with or without drafts (1.0 without speculation)"),
)


class _EngineCollector(Collector):
    """The engine's gauges and counters, read at scrape time (nothing while the engine is not loaded)."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None],
                 steps_by_num_tokens: Callable[[], Mapping[int, int]], step_buckets: tuple[int, ...]) -> None:
        self._model_name, self._stats, self._steps, self._step_buckets = (model_name, stats, steps_by_num_tokens,
                                                                          step_buckets)

    def _family(self, family, name: str, doc: str, value: float):
        metric = family(P + name, doc, labels=[LABEL])
        metric.add_metric([self._model_name], value)
        return metric

    def _iteration_tokens(self) -> HistogramMetricFamily:
        counts = self._steps()
        buckets = [(floatToGoString(b), sum(c for n, c in counts.items() if n <= b)) for b in self._step_buckets]
        buckets.append(("+Inf", sum(counts.values())))
        metric = HistogramMetricFamily(P + "iteration_tokens_total", "tokens scheduled per engine step (prefill "
                                       "and decode, drafts included)", labels=[LABEL])
        metric.add_metric([self._model_name], buckets, sum_value=sum(n * c for n, c in counts.items()))
        return metric

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:  # the engine is still warming up
            return
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "num_requests_running", "sequences in the running batch", s["running"])
        yield self._family(gauge, "num_requests_waiting", "sequences waiting to be scheduled", s["waiting"])
        yield self._family(gauge, "kv_cache_usage_perc", "fraction of KV cache pages in use (0 to 1)",
                           s["kv_pages_used"] / s["kv_pages_total"] if s["kv_pages_total"] else 0.0)
        yield self._family(gauge, "kv_pages_used", "KV cache pages in use", s["kv_pages_used"])
        yield self._family(gauge, "kv_pages_total", "KV cache pages (the null page excluded)", s["kv_pages_total"])
        yield self._family(counter, "num_preemptions", "sequences preempted (recomputed later)", s["preemptions"])
        yield self._family(counter, "engine_steps", "engine steps run", s["steps"])
        if "run_ahead_steps" in s:  # an engine's; a stand-in's stats may lack them
            yield self._family(counter, "run_ahead_steps", "decode steps dispatched before the previous step's "
                               "tokens were read (async scheduling)", s["run_ahead_steps"])
            yield self._family(counter, "run_ahead_dropped_steps", "of those, steps the next step could not take "
                               "(a sequence stopped, joined, was aborted or preempted)", s["run_ahead_dropped_steps"])
        yield self._iteration_tokens()
        if "prefix_cache_hit_tokens" in s:  # prefix caching on
            for family, name, key, doc in _PREFIX_CACHE_METRICS:
                yield self._family(family, name, doc, s[key])
        if "spec_draft_tokens" in s:  # speculative decoding on
            for family, name, key, doc in _SPEC_METRICS:
                yield self._family(family, name, doc, s[key])


class ServerMetrics:
    """The server's metrics in their own registry (tests can run several servers in one process).

    Args:
      engine_stats: returns `Engine.stats()`, or None while no engine is ready.
      model_name: the served model name, the `model_name` label of every sample.
      steps_by_num_tokens: returns a copy of `EngineMetrics.steps_by_num_tokens` (tokens in a step -> steps).
      max_model_len: the top bucket of the per-request token histograms (tokens); None: up to 10**6.
      max_num_batched_tokens: the top bucket of `iteration_tokens_total` (tokens per step).
    """

    def __init__(self, engine_stats: Callable[[], dict | None], *, model_name: str,
                 steps_by_num_tokens: Callable[[], Mapping[int, int]] = dict, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 512) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(P + name, doc, [LABEL], buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, [LABEL], registry=r).labels(model_name)

        token_buckets = buckets_1_2_5(max_model_len or 10**6)
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated for the front ends' requests")
        self.ttft_s = histogram("time_to_first_token_seconds", "arrival to first token", TTFT_BUCKETS_S)
        self.itl_s = histogram("inter_token_latency_seconds", "per output token after a sample's first: the time "
                               "since the sample's previous output over the tokens this output brought",
                               ITL_BUCKETS_S)
        self.request_tpot_s = histogram("request_time_per_output_token_seconds", "per finished request: decode "
                                        "time over its longest sample's tokens after the first", ITL_BUCKETS_S)
        self.e2e_s = histogram("e2e_request_latency_seconds", "arrival to finish", REQUEST_BUCKETS_S)
        self.queue_s = histogram("request_queue_time_seconds", "arrival to first scheduled", REQUEST_BUCKETS_S)
        self.inference_s = histogram("request_inference_time_seconds", "first scheduled to last token",
                                     REQUEST_BUCKETS_S)
        self.prefill_s = histogram("request_prefill_time_seconds", "first scheduled to first token",
                                   REQUEST_BUCKETS_S)
        self.decode_s = histogram("request_decode_time_seconds", "first token to last token", REQUEST_BUCKETS_S)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "prompt tokens per finished request",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "generated tokens per finished request (all samples)",
                                                   token_buckets)
        self.request_success = Counter(P + "request_success", "finished requests by finish reason",
                                       [LABEL, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # exported from the start, at 0
            self.request_success.labels(model_name, reason)
        self.grpc_requests = Counter(P + "grpc_requests", "gRPC Generate calls by final status", [LABEL, "status"],
                                     registry=r)
        r.register(_EngineCollector(model_name, engine_stats, steps_by_num_tokens,
                                    buckets_powers_of_2(max_num_batched_tokens)))

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one sample (its full name, e.g. `jaxinfer:prompt_tokens_total`) with these labels and this
        server's `model_name`, or None when there is none."""
        return self.registry.get_sample_value(name, {LABEL: self.model_name, **(labels or {})})

    def count_grpc(self, status: str) -> None:
        """Counts a gRPC call's final status (a `grpc.StatusCode` name)."""
        self.grpc_requests.labels(self.model_name, status).inc()

    def admitted(self, out: RequestOutput) -> RequestRecorder:
        """Counts an admitted request's prompt tokens (call with its first output); returns the recorder to feed
        every output of its stream to, this first one included."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        return RequestRecorder(self)


class RequestRecorder:
    """One request's metrics as its outputs stream (`ServerMetrics.admitted`): call `record` with each output, in
    order, first to last.

    Inter-token latency, per sample: an output bringing k tokens t seconds after the sample's previous one is k
    samples of t / k; the tokens that came with a sample's first token (none but with a multi-token first output)
    are 0 s apart. So each sample gives len(token_ids) - 1 observations, summing to its last token time minus its
    first token time. The times are the engine's (`RequestMetrics.last_token_time`).
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._last_token_time: dict[int, float] = {}  # sample index -> time of its newest token
        self._ttft_seen = False
        self._finished = False

    def record(self, out: RequestOutput) -> None:
        """Counts one output of the request (outputs after its finished one are ignored)."""
        if self._finished:
            return
        m, times = self._m, out.metrics
        now = None if times is None else times.last_token_time
        for c in out.outputs:
            k = len(c.delta_token_ids)
            if k == 0:
                continue
            m.generation_tokens.inc(k)
            if now is None:
                continue
            previous = self._last_token_time.get(c.index)
            for _ in range(k if previous is not None else k - 1):
                m.itl_s.observe(0.0 if previous is None else (now - previous) / k)
            self._last_token_time[c.index] = now
        if times is not None and times.first_token_time is not None and not self._ttft_seen:
            self._ttft_seen = True
            m.ttft_s.observe(times.ttft_s)
        if out.finished:
            self._finished = True
            self._record_finished(out)

    def abandoned(self) -> None:
        """The caller left before the request finished (a disconnect, a cancelled call): it is counted once as
        finished with reason "abort", as vLLM counts it. Nothing happens after its finished output."""
        if not self._finished:
            self._finished = True
            self._m.request_success.labels(self._m.model_name, "abort").inc()

    def _record_finished(self, out: RequestOutput) -> None:
        m, t = self._m, out.metrics
        reasons = {c.finish_reason for c in out.outputs}
        reason = next((r for r in FINISH_REASONS if r in reasons), "stop")
        m.request_success.labels(m.model_name, reason).inc()
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        m.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        if t is None:
            return
        if t.finish_time is not None:
            m.e2e_s.observe(t.finish_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            m.queue_s.observe(t.first_scheduled_time - t.arrival_time)
            if t.last_token_time is not None:
                m.inference_s.observe(t.last_token_time - t.first_scheduled_time)
            if t.first_token_time is not None:
                m.prefill_s.observe(t.first_token_time - t.first_scheduled_time)
        if t.first_token_time is not None and t.last_token_time is not None:
            m.decode_s.observe(t.last_token_time - t.first_token_time)
        if t.decode_tokens_per_s > 0:
            m.request_tpot_s.observe(1.0 / t.decode_tokens_per_s)
