"""The engine's own counters and latency samples (`EngineMetrics`) and the `Engine.stats()` snapshot built from
them and from the scheduler, page allocator, prefix cache and speculation policy.

Plain numbers only: the Prometheus families are `jaxinfer.serving.metrics`'s, which reads `Engine.stats()`.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.spec_decode.policy import SpeculationPolicy
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import PrefixCache
from jaxinfer.scheduler.scheduler import Scheduler
from jaxinfer.scheduler.sequence import Sequence


@dataclasses.dataclass
class RunAheadStats:
    """Counters of async scheduling (`jaxinfer.engine.run_ahead`).

    Attributes:
      launched: steps dispatched ahead.
      used: of them, steps whose rows the next step took (all or some).
      dropped: steps nobody took (a sequence joined, was preempted, aborted, or every one stopped).
      dropped_rows: rows computed ahead and not taken (in used and dropped steps).
    """

    launched: int = 0
    used: int = 0
    dropped: int = 0
    dropped_rows: int = 0


@dataclasses.dataclass
class EngineMetrics:
    """Counters and latency samples gathered by the engine (seconds and token counts).

    `steps_by_num_tokens` maps a step's scheduled tokens (prefill + decode, drafts included) to the number of
    steps that had that many: exact, and bounded by the step's token budget (a histogram's source at any buckets;
    read it with `.copy()` from another thread).
    """

    num_steps: int = 0
    num_device_calls: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_padded_tokens: int = 0
    num_finished: int = 0
    num_errors: int = 0
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    queue_time_s: list[float] = dataclasses.field(default_factory=list)
    step_time_s: float = 0.0
    host_time_s: float = 0.0
    steps_by_num_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    run_ahead: RunAheadStats = dataclasses.field(default_factory=RunAheadStats)

    def record_step(self, prefill_tokens: int, decode_tokens: int, step_s: float, device_s: float) -> None:
        """Counts one engine step: its prefill and decode tokens, its wall time and the part spent in device
        calls (seconds)."""
        self.num_steps += 1
        self.num_prefill_tokens += prefill_tokens
        self.num_decode_tokens += decode_tokens
        n = prefill_tokens + decode_tokens
        self.steps_by_num_tokens[n] = self.steps_by_num_tokens.get(n, 0) + 1
        self.step_time_s += step_s
        self.host_time_s += step_s - device_s

    def record_finished(self, seq: Sequence) -> None:
        """Samples a finished sequence's TTFT, TPOT (over its tokens after the first) and queue time."""
        if seq.first_token_time is not None:
            self.ttft_s.append(seq.first_token_time - seq.arrival_time)
            if len(seq.output_token_ids) > 1 and seq.finish_time is not None:
                self.tpot_s.append((seq.finish_time - seq.first_token_time) / (len(seq.output_token_ids) - 1))
        if seq.first_scheduled_time is not None:
            self.queue_time_s.append(seq.first_scheduled_time - seq.arrival_time)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _prefix_cache_stats(prefix_cache: PrefixCache | None, page_allocator: PageAllocator) -> dict[str, float | int]:
    if prefix_cache is None:
        return {}
    c = prefix_cache.stats
    return {
        "prefix_cache_queried_tokens": c.queried_tokens,
        "prefix_cache_hit_tokens": c.hit_tokens,
        "prefix_cache_hit_rate": c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0,
        "prefix_cache_pages": prefix_cache.num_cached_pages,
        "prefix_cache_evictions": page_allocator.num_evictions,
        "prefix_cache_host_pages": prefix_cache.num_host_pages,
        "prefix_cache_host_hits": c.host_hit_pages,
    }


def engine_stats(m: EngineMetrics, scheduler: Scheduler, page_allocator: PageAllocator,
                 prefix_cache: PrefixCache | None, spec_policy: SpeculationPolicy | None) -> dict[str, float | int]:
    """The snapshot `Engine.stats()` returns; its docstring lists the keys."""
    return {
        "running": scheduler.num_running,
        "waiting": scheduler.num_waiting,
        "kv_pages_used": page_allocator.num_usable_pages - page_allocator.num_free_pages,
        "kv_pages_total": page_allocator.num_usable_pages,
        "preemptions": scheduler.num_preemptions,
        "steps": m.num_steps,
        "device_calls": m.num_device_calls,
        "prefill_tokens": m.num_prefill_tokens,
        "decode_tokens": m.num_decode_tokens,
        "tokens_per_step": (m.num_prefill_tokens + m.num_decode_tokens) / m.num_steps if m.num_steps else 0.0,
        "finished": m.num_finished,
        "errors": m.num_errors,
        "host_time_share": m.host_time_s / m.step_time_s if m.step_time_s else 0.0,
        "ttft_s_mean": _mean(m.ttft_s),
        "tpot_s_mean": _mean(m.tpot_s),
        "queue_time_s_mean": _mean(m.queue_time_s),
        "run_ahead_steps": m.run_ahead.launched,
        "run_ahead_dropped_steps": m.run_ahead.dropped,
        **_prefix_cache_stats(prefix_cache, page_allocator),
        **(spec_policy.stats.as_dict() if spec_policy is not None else {}),
    }
