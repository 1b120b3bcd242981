"""`merge_stats`: two engines' `Engine.stats()` snapshots merged, against values worked out by hand."""

from __future__ import annotations

from jaxinfer.cluster.stats import merge_stats


def test_counts_add_ratios_are_recomputed_and_means_weighted():
    a = {"running": 2, "kv_pages_used": 10, "steps": 10, "finished": 1, "ttft_s_mean": 0.4, "tokens_per_step": 3.0,
         "prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 50, "prefix_cache_hit_rate": 0.5}
    b = {"running": 1, "kv_pages_used": 4, "steps": 30, "finished": 3, "ttft_s_mean": 0.2, "tokens_per_step": 1.0,
         "prefix_cache_queried_tokens": 300, "prefix_cache_hit_tokens": 30, "prefix_cache_hit_rate": 0.1,
         "spec_acceptance_rate": 0.6}
    merged = merge_stats([a, b])
    assert merged["running"] == 3 and merged["kv_pages_used"] == 14 and merged["steps"] == 40
    assert merged["prefix_cache_hit_rate"] == 80 / 400  # not the mean of 0.5 and 0.1
    assert abs(merged["ttft_s_mean"] - (1 * 0.4 + 3 * 0.2) / 4) < 1e-12  # weighted by finished requests
    assert abs(merged["tokens_per_step"] - (10 * 3.0 + 30 * 1.0) / 40) < 1e-12  # weighted by steps
    assert merged["spec_acceptance_rate"] == 0.6  # only b reports it
    assert merge_stats([]) == {} and merge_stats([a]) == a
