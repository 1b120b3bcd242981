"""Conditional disaggregated prefill/decode (xPyD): when a request's prefill runs on a prefill replica and its K/V
moves to the decode replica, and what the router counts about it (plain Python, no Ray: the command line checks
`DisaggConfig` before Ray is imported).

1. The router first picks the decode replica (`jaxinfer.cluster.routing`, over decode and mixed replicas), then
   `local_prefill_reason` decides: the decode replica prefills locally when
   - no prefill replica is up (`NO_PREFILL_REPLICA`);
   - the request cannot be handed over (`PARAMS`): n > 1 (a handoff carries one sample) or prompt logprobs (the
     decode side would have to return them);
   - its prefix cache, as the router's index of it predicts, holds at least `local_cached_share` of the prompt
     (`CACHED`): the handoff would move the whole prompt's K/V to save computing a small part of it;
   - the part of the prompt it does not hold is shorter than `min_prefill_tokens` (`SHORT`): a short prefill
     rides along in the decode replica's next step for little more than that step's cost, while a handoff adds
     two Ray calls, an export and an import to the request's second token.
   Otherwise the prompt goes to a prefill replica (`None`: hand over). The idea is Kiely's "conditional
   disaggregation" (ch. 5.5) and llm-d's P/D decider (prompt length, KV-cache hits).
2. `HandoffCounters` holds the router's counts for its Prometheus families: handoffs, bytes, their latency
   (`Buckets`), local prefills by reason, prefills waiting on prefill replicas, resubmissions after a fault.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum

from jaxinfer.engine.config import DTYPE_NAMES, KV_CACHE_DTYPE_NAMES
from jaxinfer.sampling_params import SamplingParams

# Page dtypes on the wire: `jaxinfer.engine.kv_handoff.WIRE_DTYPES`' names (that module loads jax).
WIRE_DTYPE_NAMES = (*DTYPE_NAMES, *KV_CACHE_DTYPE_NAMES)
# Seconds: a handoff's export, object-store move and fetch.
HANDOFF_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LocalReason(enum.Enum):
    """Why the decode replica prefills a request itself (the label `reason` of
    `jaxinfer:router_local_prefills_total`)."""

    NO_PREFILL_REPLICA = "no_prefill_replica"
    PARAMS = "params"
    CACHED = "cached"
    SHORT = "short"


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    """When prompts cross to a prefill replica, and how their K/V travels (module docstring, item 1).

    Attributes:
      min_prefill_tokens: prompt tokens the decode replica does not hold (per the router's index) below which it
        prefills locally, >= 0 (0: every prompt it does not hold entirely crosses).
      local_cached_share: the share of the prompt, in [0, 1], the decode replica must hold for it to prefill the
        rest locally whatever its length (1: only a fully held prompt).
      wire_dtype: page dtype of the K/V on the wire: "float32", "bfloat16", "int8" or "fp8" (int8 / fp8 per-token
        quantized), or None for the prefill replica's own KV cache dtype.

    Raises:
      ValueError: a value out of its range, or an unknown wire dtype.
    """

    min_prefill_tokens: int = 128
    local_cached_share: float = 0.75
    wire_dtype: str | None = None

    def __post_init__(self) -> None:
        n = self.min_prefill_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"--disagg-min-prefill-tokens {n!r} must be an integer >= 0")
        if not 0.0 <= self.local_cached_share <= 1.0:
            raise ValueError(f"--disagg-local-cached-share {self.local_cached_share} must be in [0, 1]")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(f"--kv-wire-dtype {self.wire_dtype!r} is not one of {', '.join(WIRE_DTYPE_NAMES)}")


def local_prefill_reason(config: DisaggConfig, num_prompt_tokens: int, held_tokens: int,
                         params: SamplingParams, prefill_up: bool) -> LocalReason | None:
    """Why the decode replica should prefill this prompt itself, or None to hand it to a prefill replica.

    Args:
      config: the thresholds.
      num_prompt_tokens: the prompt's length, tokens, >= 1.
      held_tokens: of those, the leading tokens the router's index says the decode replica holds (a multiple of
        the page size), in [0, num_prompt_tokens].
      params: the request's sampling parameters.
      prefill_up: whether some prefill replica is up.
    """
    if not prefill_up:
        return LocalReason.NO_PREFILL_REPLICA
    if params.n != 1 or params.prompt_logprobs is not None:
        return LocalReason.PARAMS
    if held_tokens > 0 and held_tokens >= config.local_cached_share * num_prompt_tokens:
        return LocalReason.CACHED
    if num_prompt_tokens - held_tokens < config.min_prefill_tokens:
        return LocalReason.SHORT
    return None


class Buckets:
    """A latency histogram's counts (Prometheus' cumulative `le` buckets are made from them at scrape time).

    Args:
      bounds: upper bounds, increasing, seconds.
    """

    def __init__(self, bounds: tuple[float, ...] = HANDOFF_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, observations <= le)], the last le "+Inf" (prometheus_client's `HistogramMetricFamily` form)."""
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


@dataclasses.dataclass
class HandoffCounters:
    """The router's disaggregation and fault counts (the metrics of `jaxinfer.cluster.served`).

    Attributes:
      handoffs: requests whose K/V moved from a prefill replica to a decode replica.
      handoff_bytes: their K/V arrays' bytes (`KVHandoff.nbytes`).
      handoff_seconds: per handoff, from the router's export call to the decode replica holding the arrays
        (export, object store, fetch; not the import into its pages, which is part of its next step).
      local_prefills: decode replicas' own prefills in a cluster with prefill replicas, by reason.
      prefill_queue: requests sent to prefill replicas whose first token has not come back.
      resubmissions: requests sent again (with their output so far) after their replica went down, by that
        replica's name.
    """

    handoffs: int = 0
    handoff_bytes: int = 0
    handoff_seconds: Buckets = dataclasses.field(default_factory=Buckets)
    local_prefills: dict[LocalReason, int] = dataclasses.field(
        default_factory=lambda: {reason: 0 for reason in LocalReason})
    prefill_queue: int = 0
    resubmissions: dict[str, int] = dataclasses.field(default_factory=dict)
