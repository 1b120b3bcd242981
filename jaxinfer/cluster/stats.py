"""The `Engine.stats()` of a cluster: the replicas' snapshots merged into one of the same keys."""

from __future__ import annotations

from collections.abc import Sequence

# Keys that are not sums: ratios recomputed from their sums, and means weighted by what they average over.
_RATIOS = {"prefix_cache_hit_rate": ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens")}
_MEANS = {"ttft_s_mean": "finished", "tpot_s_mean": "finished", "queue_time_s_mean": "finished",
          "tokens_per_step": "steps", "host_time_share": "steps"}


def merge_stats(snapshots: Sequence[dict[str, float | int]]) -> dict[str, float | int]:
    """One `Engine.stats()` snapshot for several engines.

    Counts and gauges (running, waiting, KV pages, tokens, steps, prefix-cache counters, ...) are summed;
    `prefix_cache_hit_rate` is the summed hits over the summed queries; the means (`*_s_mean`, `tokens_per_step`,
    `host_time_share`) are weighted by the engines' finished requests or steps; any other float (the speculative
    decoding rates) is the plain mean. A key that only some engines report is merged over those.

    Args:
      snapshots: `Engine.stats()` of each engine; none gives {}.
    """
    keys = [k for s in snapshots for k in s]
    merged: dict[str, float | int] = {}
    for key in dict.fromkeys(keys):
        having = [s for s in snapshots if key in s]
        if key in _RATIOS:
            num, den = _RATIOS[key]
            total = sum(s.get(den, 0) for s in having)
            merged[key] = sum(s.get(num, 0) for s in having) / total if total else 0.0
        elif key in _MEANS:
            weights = [s.get(_MEANS[key], 0) for s in having]
            total = sum(weights)
            merged[key] = sum(w * s[key] for w, s in zip(weights, having)) / total if total else 0.0
        elif all(isinstance(s[key], int) for s in having):
            merged[key] = sum(s[key] for s in having)
        else:
            merged[key] = sum(s[key] for s in having) / len(having)
    return merged
