"""The router's view of its replicas: `Replica` (a handle, its routing target, its counters, whether it is up),
`ReplicaView` (what the front ends read of an `Engine`, for a cluster), and `until_down`, which ends a wait on a
replica that the health check marks down."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence

from jaxinfer.cluster.pool import ReplicaHandle
from jaxinfer.cluster.replica import ReplicaRole
from jaxinfer.cluster.routing import RouteTarget
from jaxinfer.cluster.stats import merge_stats
from jaxinfer.prompt import Prompt, make_prompt

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Replica:
    """One replica as the router tracks it: its handle, its routing view, its counters and last stats."""

    handle: ReplicaHandle
    target: RouteTarget
    requests_routed: int = 0
    routed_hit_tokens: int = 0  # prompt tokens its index held when requests were routed to it
    stats: dict[str, float | int] | None = None
    steps_by_num_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    down: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set while down
    restarting: asyncio.Task | None = None  # its engine being built again after Ray restarted its actor

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def role(self) -> ReplicaRole:
        return self.handle.info.role

    def set_up(self, up: bool) -> None:
        if up != self.target.up:
            logger.warning("replica %s is %s", self.name, "up again" if up else "down")
        self.target.up = up
        if up:
            self.down.clear()
        else:
            self.down.set()


@dataclasses.dataclass
class _StepCounts:
    steps_by_num_tokens: dict[int, int]


class ReplicaView:
    """What the front ends read of an `Engine`, for a cluster: the `ReplicaInfo` of the first replica that decodes
    (the replicas agree on the model, tokens and context: `jaxinfer.cluster.replica.check_compatible`) and the
    replicas' stats merged (`jaxinfer.cluster.stats.merge_stats`).

    Args:
      replicas: the router's replicas (read, not copied: their stats change).
    """

    def __init__(self, replicas: Sequence[Replica]) -> None:
        info = next((r.handle.info for r in replicas if r.role is not ReplicaRole.PREFILL), replicas[0].handle.info)
        self._replicas = replicas
        self.tokenizer, self.model_config, self.config = info.tokenizer, info.model_config, info.config
        self.max_model_len, self.page_size, self.vocab_limit = info.max_model_len, info.page_size, info.vocab_limit

    def make_prompt(self, prompt: Prompt | str | dict | Sequence[int], cache_salt: str | None = None) -> Prompt:
        """`Engine.make_prompt` with the replicas' tokenizer and vocabulary.

        Raises:
          ValueError: as `jaxinfer.prompt.make_prompt`.
        """
        return make_prompt(prompt, self.tokenizer.encode, self.vocab_limit, cache_salt)

    def stats(self) -> dict[str, float | int]:
        """`Engine.stats()` summed over the replicas that answered their last health check."""
        return merge_stats([r.stats for r in self._replicas if r.stats is not None and r.target.up])

    @property
    def metrics(self) -> _StepCounts:
        """The engines' step histograms, summed (`EngineMetrics.steps_by_num_tokens`)."""
        total: dict[int, int] = {}
        for r in self._replicas:
            for n, c in r.steps_by_num_tokens.items():
                total[n] = total.get(n, 0) + c
        return _StepCounts(total)


class ReplicaDown(Exception):
    """The health check marked a request's replica down while the request waited on it."""


async def until_down(replica: Replica, awaitable: Awaitable) -> object:
    """`awaitable`'s result, unless `replica` is marked down first: then `awaitable` is cancelled and `ReplicaDown`
    raised."""
    item = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(replica.down.wait())
    try:
        await asyncio.wait((item, down), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        item.cancel()
        raise
    finally:
        down.cancel()
    if not item.done():
        item.cancel()
        raise ReplicaDown()
    return item.result()


async def items_until_down(stream, replica: Replica) -> AsyncIterator:
    """The items (object refs) of a Ray streaming generator until its replica is marked down (`ReplicaDown`)."""
    while True:
        try:
            yield await until_down(replica, anext(stream))
        except StopAsyncIteration:
            return
