"""The routing policies on fake replicas (`RouteTarget`s: a name, requests in flight, an index): no Ray, no engine.
Page keys come from the prefix cache's own chain (`prefix_page_keys`), as the router computes them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.cluster.routing import PageIndex, RouteTarget, Router, RoutingConfig, RoutingPolicy
from jaxinfer.scheduler.prefix_cache import prefix_page_keys

PS = 4  # tokens per page


def _targets(n: int, capacity: int = 64) -> list[RouteTarget]:
    return [RouteTarget(f"r{i}", PageIndex(capacity)) for i in range(n)]


def _keys(tokens: list[int], salt: str | None = None) -> list[int]:
    return prefix_page_keys(tokens, salt, PS)


def _router(policy: str = "cache_aware", **knobs) -> Router:
    return Router(RoutingConfig(policy, **knobs), PS)


def test_round_robin_takes_the_replicas_that_are_up_in_turn():
    targets = _targets(3)
    router = _router("round_robin")
    assert [router.choose(targets, [], 5).target.name for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    targets[1].up = False
    assert {router.choose(targets, [], 5).target.name for _ in range(4)} == {"r0", "r2"}
    for t in targets:
        t.up = False
    assert router.choose(targets, [], 5) is None


def test_least_load_takes_the_fewest_in_flight_and_breaks_ties_in_turn():
    targets = _targets(3)
    targets[0].in_flight, targets[1].in_flight, targets[2].in_flight = 2, 1, 1
    router = _router("least_load")
    assert [router.choose(targets, [], 5).target.name for _ in range(4)] == ["r1", "r2", "r1", "r2"]


def test_cache_aware_follows_the_longest_held_prefix():
    targets = _targets(3)
    conversation = list(range(100, 124))  # 6 pages
    targets[0].index.add(_keys(conversation[:8]))  # 2 leading pages
    targets[1].index.add(_keys(conversation[:20]))  # 5 leading pages
    targets[2].index.add(_keys(list(range(200, 224))))  # another conversation
    choice = _router().choose(targets, _keys(conversation), len(conversation))
    assert (choice.target.name, choice.hit_tokens) == ("r1", 20)
    # the same tokens under another cache salt are another prefix: nothing is held, so the prompt is placed as new
    salted = _router().choose(targets, _keys(conversation, "tenant-b"), len(conversation))
    assert salted.hit_tokens == 0


def test_a_page_in_the_middle_does_not_count_without_the_pages_before_it():
    targets = _targets(2)
    tokens = list(range(16))
    keys = _keys(tokens)
    targets[0].index.add(keys[1:])  # pages 2..4, not the first: the chain is broken
    targets[1].index.add(keys[:1])
    assert targets[0].index.leading_hits(keys) == 0 and targets[1].index.leading_hits(keys) == 1


def test_a_new_prompt_goes_to_the_least_loaded_then_the_emptiest_replica():
    targets = _targets(3)
    shared = list(range(4))  # a shared first page (a system prompt)
    targets[0].index.add(_keys(shared + list(range(50, 70))))
    targets[1].index.add(_keys(shared))
    prompt = shared + list(range(300, 316))  # 20 tokens, 4 held by r0 and r1: under min_match 0.5
    choice = _router().choose(targets, _keys(prompt), len(prompt))
    assert choice.target.name == "r2" and choice.hit_tokens == 0
    targets[2].in_flight = 1
    assert _router().choose(targets, _keys(prompt), len(prompt)).target.name == "r1"  # r1's index is smaller


def test_the_load_term_trades_cached_tokens_for_requests_in_flight():
    targets = _targets(2)
    prompt = list(range(40))  # 10 pages
    targets[0].index.add(_keys(prompt[:32]))  # 32 tokens
    targets[1].index.add(_keys(prompt[:24]))  # 24 tokens
    targets[0].in_flight = 1
    # 32 - 16 * 1 = 16 < 24 - 0: r1
    assert _router(load_weight_tokens=16).choose(targets, _keys(prompt), 40).target.name == "r1"
    # 32 - 4 * 1 = 28 > 24: r0
    assert _router(load_weight_tokens=4).choose(targets, _keys(prompt), 40).target.name == "r0"


def test_the_guard_skips_a_replica_too_far_above_the_least_loaded():
    targets = _targets(2)
    prompt = list(range(40))
    targets[0].index.add(_keys(prompt))
    targets[0].in_flight = 3
    router = _router(load_weight_tokens=0, max_imbalance=3)
    assert router.choose(targets, _keys(prompt), 40).target.name == "r0"  # 3 above: still allowed
    targets[0].in_flight = 4
    assert router.choose(targets, _keys(prompt), 40).target.name == "r1"


@settings(max_examples=30, deadline=None)
@given(num_replicas=st.integers(2, 5), max_imbalance=st.integers(0, 6), num_requests=st.integers(1, 60),
       load_weight=st.sampled_from([0.0, 1.0, 32.0]))
def test_one_hot_prefix_never_pulls_every_request_onto_one_replica(num_replicas, max_imbalance, num_requests,
                                                                  load_weight):
    """Requests that all share one prefix and never finish: the spread of requests in flight stays within the
    guard's bound (+1: the request just placed) whatever the load weight."""
    targets = _targets(num_replicas)
    router = _router(load_weight_tokens=load_weight, max_imbalance=max_imbalance)
    prompt = list(range(32))
    keys = _keys(prompt)
    for _ in range(num_requests):
        choice = router.choose(targets, keys, len(prompt))
        choice.target.in_flight += 1
        choice.target.index.add(keys)
        loads = [t.in_flight for t in targets]
        assert max(loads) - min(loads) <= max_imbalance + 1, loads


def test_the_index_forgets_least_recently_used_pages_past_its_capacity():
    index = PageIndex(3)
    index.add([1, 2, 3])
    index.add([1])  # 1 is fresh again
    index.add([4])
    assert len(index) == 3 and index.leading_hits([1]) == 1 and index.leading_hits([2]) == 0
    with pytest.raises(ValueError, match="capacity_pages=0 must be >= 1"):
        PageIndex(0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="fastest"), "routing policy 'fastest' is not one of cache_aware, round_robin, least_load"),
    (dict(load_weight_tokens=-1.0), "load_weight_tokens=-1.0 must be >= 0"),
    (dict(max_imbalance=-1), "max_imbalance=-1 must be an integer >= 0"),
    (dict(min_match=1.5), r"min_match=1.5 must be in \[0, 1\]"),
])
def test_bad_routing_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


def test_policy_names_are_the_command_line_choices():
    assert RoutingConfig("round_robin").policy is RoutingPolicy.ROUND_ROBIN
    assert RoutingConfig().policy is RoutingPolicy.CACHE_AWARE
