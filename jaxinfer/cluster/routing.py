"""Routing policies of the cluster router: which engine replica takes a new request (plain Python, no Ray).

1. Each replica has a `RouteTarget`: its name, its requests in flight (sent by this router and not finished: the
   router's own count of the replica's running + waiting requests, exact and never stale), whether it is up, and
   an approximate `PageIndex` of the prefix pages it holds.
2. `round_robin` takes the up replicas in turn; `least_load` the one with the fewest requests in flight (ties in
   turn).
3. `cache_aware` (the idea of SGLang's cache-aware router and llm-d's prefix scorer; Kiely, ch. 5.3.3): the
   prompt's full pages are named by the prefix cache's own chain of page hashes with the request's `cache_salt`
   (`jaxinfer.scheduler.prefix_cache.prefix_page_keys`), so a replica's hit is `page_size` times the number of
   the prompt's leading pages its index holds. The index is what this router sent there (prompts when routed,
   prompt + output when finished), least recently used first out, capped at the replica's KV pages: an estimate,
   since the replica evicts on its own.
   - Guard: a replica with more than `max_imbalance` requests in flight above the least loaded one is no
     candidate, so a hot prefix cannot pull every request onto one replica.
   - A prompt whose best hit is under `min_match` of its tokens counts as new: it goes to the least loaded
     candidate, ties to the smallest index (new conversations spread out), then in turn.
   - Otherwise the highest `hit_tokens - load_weight_tokens * in_flight` wins (ties: least loaded, then in turn).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Sequence


class RoutingPolicy(enum.Enum):
    """How the router picks a replica (`--routing`)."""

    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"


POLICY_NAMES = tuple(p.value for p in RoutingPolicy)


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """The router's policy and the knobs of `cache_aware` (module docstring, item 3).

    Attributes:
      policy: a `RoutingPolicy` or its name.
      load_weight_tokens: prompt tokens of cache hit that one request in flight is worth (>= 0).
      max_imbalance: requests in flight a replica may have above the least loaded one and still be chosen (>= 0).
      min_match: the fraction of a prompt's tokens (in [0, 1]) a replica must hold for the prompt to follow its
        cache; below it the prompt is placed as new.

    Raises:
      ValueError: an unknown policy name, or a knob out of its range.
    """

    policy: RoutingPolicy | str = RoutingPolicy.CACHE_AWARE
    load_weight_tokens: float = 32.0
    max_imbalance: int = 4
    min_match: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RoutingPolicy):
            if self.policy not in POLICY_NAMES:
                raise ValueError(f"routing policy {self.policy!r} is not one of {', '.join(POLICY_NAMES)}")
            object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        if not self.load_weight_tokens >= 0:
            raise ValueError(f"load_weight_tokens={self.load_weight_tokens} must be >= 0")
        if isinstance(self.max_imbalance, bool) or not isinstance(self.max_imbalance, int) or self.max_imbalance < 0:
            raise ValueError(f"max_imbalance={self.max_imbalance!r} must be an integer >= 0")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"min_match={self.min_match} must be in [0, 1]")


class PageIndex:
    """An approximate set of the prefix pages one replica holds: page keys, least recently used first out.

    Args:
      capacity_pages: the most keys kept (the replica's KV pages), >= 1.
    """

    def __init__(self, capacity_pages: int) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages={capacity_pages} must be >= 1")
        self.capacity_pages = capacity_pages
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[int]) -> None:
        """Records pages (a prefix's chain of keys, first page first) as held, most recently used."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_pages:
            self._keys.popitem(last=False)

    def leading_hits(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the index holds (pages)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._keys.clear()


@dataclasses.dataclass(eq=False)
class RouteTarget:
    """The router's view of one replica.

    Attributes:
      name: the replica's name (a metrics label).
      index: the pages it is believed to hold.
      in_flight: requests sent to it and not finished.
      up: whether it answers (a replica that is down is never chosen).
    """

    name: str
    index: PageIndex
    in_flight: int = 0
    up: bool = True


@dataclasses.dataclass(frozen=True)
class Choice:
    """A routing decision: the replica and the prompt tokens its index says it holds (0 without `cache_aware`)."""

    target: RouteTarget
    hit_tokens: int


class Router:
    """Chooses a replica per request (module docstring).

    Args:
      config: the policy and its knobs.
      page_size: tokens per KV page of the replicas (> 0), the unit of the page keys.
    """

    def __init__(self, config: RoutingConfig, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.config, self.page_size = config, page_size
        self._turn = 0

    def _in_turn(self, targets: list[RouteTarget]) -> RouteTarget:
        target = targets[self._turn % len(targets)]
        self._turn += 1
        return target

    def choose(self, targets: Sequence[RouteTarget], keys: Sequence[int], num_prompt_tokens: int) -> Choice | None:
        """Picks the replica for a prompt among `targets` (those that are up); None when none is up.

        Args:
          targets: every replica that could take the request (its role allows it), in a fixed order.
          keys: the prompt's `prefix_page_keys` (one per full page).
          num_prompt_tokens: the prompt's length in tokens, >= 1.
        """
        up = [t for t in targets if t.up]
        if not up:
            return None
        policy = self.config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            return Choice(self._in_turn(up), 0)
        least = min(t.in_flight for t in up)
        if policy is RoutingPolicy.LEAST_LOAD:
            return Choice(self._in_turn([t for t in up if t.in_flight == least]), 0)
        candidates = [t for t in up if t.in_flight <= least + self.config.max_imbalance]
        hits = {id(t): t.index.leading_hits(keys) * self.page_size for t in candidates}
        best_hit = max(hits.values())
        if best_hit < self.config.min_match * num_prompt_tokens or best_hit == 0:
            fewest = min(t.in_flight for t in candidates)
            lightest = [t for t in candidates if t.in_flight == fewest]
            smallest = min(len(t.index) for t in lightest)
            target = self._in_turn([t for t in lightest if len(t.index) == smallest])
            return Choice(target, hits[id(target)])
        scores = {id(t): hits[id(t)] - self.config.load_weight_tokens * t.in_flight for t in candidates}
        top = max(scores.values())
        best = [t for t in candidates if scores[id(t)] == top]
        fewest = min(t.in_flight for t in best)
        target = self._in_turn([t for t in best if t.in_flight == fewest])
        return Choice(target, hits[id(target)])
