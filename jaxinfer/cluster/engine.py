"""`ClusterEngine`: `AsyncEngine`'s interface over a pool of engine replicas, so that the HTTP front end
(`jaxinfer.serving.openai.app`) serves a cluster as it serves one engine.

1. The router tokenizes: `engine` (a `ReplicaView`) has what the front end reads of an `Engine` (the tokenizer, the
   model's config and context, `make_prompt`, `stats()`), from the replicas' `ReplicaInfo`.
2. `generate` routes the prompt (`_route`: `jaxinfer.cluster.routing` picks among the replicas that are up), then
   streams the replica's outputs through Ray (`EngineReplica.generate`). The request's pages are recorded in the
   chosen replica's index when routed, and its prompt + output when it finishes.
3. A caller that stops iterating (a client gone, a deadline) cancels the Ray task and aborts the request on the
   replica, which frees its pages.
4. Health: `watch` asks every replica for its stats each `health_period_s`; one that does not answer within
   `health_timeout_s`, whose actor died, or whose engine loop stopped is down and gets no new requests (it is up
   again when it answers). A request whose replica goes down ends with `EngineStoppedError` (`_lost`: HTTP 503
   before its first output, an error event after). With no replica up, `generate` raises `Unavailable` (HTTP
   503) at once: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.pool import ReplicaHandle, ReplicaPool, unwrap
from jaxinfer.cluster.replica import ReplicaRole
from jaxinfer.cluster.routing import PageIndex, RouteTarget, Router, RoutingConfig
from jaxinfer.cluster.stats import merge_stats
from jaxinfer.engine.async_engine import EngineStoppedError
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt, make_prompt
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.prefix_cache import prefix_page_keys
from jaxinfer.serving.served import Unavailable

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

    @property
    def name(self) -> str:
        return self.handle.name

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
    """What the front ends read of an `Engine`, for a cluster: the first replica's `ReplicaInfo` (every replica
    runs the same configuration) and the replicas' stats merged (`jaxinfer.cluster.stats.merge_stats`)."""

    def __init__(self, cluster: ClusterEngine) -> None:
        info = cluster.replicas[0].handle.info
        self._cluster = cluster
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
        return merge_stats([r.stats for r in self._cluster.replicas if r.stats is not None and r.target.up])

    @property
    def metrics(self) -> _StepCounts:
        """The engines' step histograms, summed (`EngineMetrics.steps_by_num_tokens`)."""
        total: dict[int, int] = {}
        for r in self._cluster.replicas:
            for n, c in r.steps_by_num_tokens.items():
                total[n] = total.get(n, 0) + c
        return _StepCounts(total)


class ClusterEngine:
    """Serves requests on a pool of replicas, with `AsyncEngine`'s interface (module docstring).

    Args:
      pool: the started replicas.
      routing: the routing policy and its knobs.
      cluster: the health check's period and timeout (only those fields are read).
      owns_pool: whether `shutdown` stops the pool's replicas.
    """

    def __init__(self, pool: ReplicaPool, routing: RoutingConfig, cluster: ClusterConfig = ClusterConfig(),
                 owns_pool: bool = True) -> None:
        self.pool, self.cluster, self.owns_pool = pool, cluster, owns_pool
        self.replicas = [Replica(h, RouteTarget(h.name, PageIndex(max(h.info.kv_pages_total, 1))))
                         for h in pool.replicas]
        self.engine = ReplicaView(self)
        self.router = Router(routing, self.engine.page_size)
        self.error: BaseException | None = None
        self._ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._closed = False
        self._running: dict[str, Replica] = {}  # request id -> its replica, while in flight

    # --- AsyncEngine's interface ---------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        """True while some replica is up (and the engine is not shut down)."""
        return not self._closed and any(r.target.up for r in self.replicas)

    def unavailable(self) -> Unavailable:
        """Why no request can be served now."""
        if self._closed:
            return Unavailable("the router is shut down")
        return Unavailable(f"no replica is reachable ({len(self.replicas)} down)")

    async def generate(self, prompt: Prompt | str | dict | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs from the replica it is routed to (as `AsyncEngine.generate`).

        Raises:
          ValueError: the replica refused the request (its message, as one engine's).
          Unavailable: no replica is up.
          EngineStoppedError: the replica went down while the request ran (`_lost`).
        """
        if not isinstance(prompt, Prompt):
            prompt = await asyncio.to_thread(self.engine.make_prompt, prompt)
        request_id = request_id or next(self._ids)
        if request_id in self._running:
            raise ValueError(f"request_id={request_id!r} is already in use")
        replica, keys = self._route(prompt)
        self._running[request_id] = replica
        replica.target.index.add(keys)
        replica.target.in_flight += 1
        stream = replica.handle.actor.generate.options(num_returns="streaming").remote(prompt, params, request_id)
        finished = False
        try:
            async with contextlib.aclosing(_until_down(stream, replica)) as refs:
                async for ref in refs:
                    out = await ref
                    finished = out.finished
                    if finished:
                        self._remember_output(replica, prompt, out)
                    yield out
                    if finished:
                        return
        except (RayActorError, _ReplicaDown) as e:
            raise self._lost(replica, e) from None
        except RayTaskError as e:  # the replica's own exception (a ValueError naming the field, ...), as it is
            raise unwrap(e) from None
        finally:
            replica.target.in_flight -= 1
            del self._running[request_id]
            if not finished:  # the caller left: stop the Ray task and the request (either alone would do)
                with contextlib.suppress(Exception):
                    ray.cancel(stream)
                with contextlib.suppress(Exception):
                    replica.handle.actor.abort.remote(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request on its replica (a no-op for one not in flight); its stream then ends with finish_reason
        "abort", as one engine's."""
        replica = self._running.get(request_id)
        if replica is not None:
            with contextlib.suppress(Exception):
                replica.handle.actor.abort.remote(request_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Refuses new requests; stops the pool's replicas when it owns the pool."""
        self._closed = True
        if self.owns_pool:
            self.pool.shutdown()

    # --- routing -------------------------------------------------------------------------------------------------

    def _route(self, prompt: Prompt) -> tuple[Replica, list[int]]:
        """The replica for a new request and the prompt's page keys.

        Disaggregated prefill/decode (issue 25, part 3) picks a prefill replica and then a decode replica here;
        every replica is `ReplicaRole.MIXED` so far.

        Raises:
          Unavailable: no replica is up.
        """
        if self._closed:
            raise self.unavailable()
        keys = prefix_page_keys(prompt.token_ids, prompt.cache_salt, self.engine.page_size)
        mixed = [r for r in self.replicas if r.handle.info.role is ReplicaRole.MIXED]
        choice = self.router.choose([r.target for r in mixed], keys, len(prompt.token_ids))
        if choice is None:
            raise self.unavailable()
        replica = next(r for r in mixed if r.target is choice.target)
        replica.requests_routed += 1
        replica.routed_hit_tokens += choice.hit_tokens
        return replica, keys

    def _remember_output(self, replica: Replica, prompt: Prompt, out: RequestOutput) -> None:
        """Records the full pages of prompt + first sample's output (all but its last token, whose K/V the engine
        never computes) in the replica's index."""
        if out.outputs:
            tokens = [*prompt.token_ids, *out.outputs[0].token_ids[:-1]]
            replica.target.index.add(prefix_page_keys(tokens, prompt.cache_salt, self.engine.page_size))

    def _lost(self, replica: Replica, error: BaseException) -> EngineStoppedError:
        """A request's replica went down: it is marked down and the request fails.

        Fault tolerance (issue 25, part 4) resubmits the request here instead, to another replica, with the tokens
        streamed so far as its output so far.
        """
        replica.set_up(False)
        return EngineStoppedError(f"replica {replica.name} went down: {type(error).__name__}")

    # --- health ---------------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Checks every replica's health each `health_period_s` until cancelled (module docstring, item 4)."""
        while not self._closed:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(self.cluster.health_period_s)

    async def _check(self, replica: Replica) -> None:
        try:
            replica.stats, replica.steps_by_num_tokens = await asyncio.wait_for(
                replica.handle.actor.stats.remote(), self.cluster.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - dead actor, timeout, stopped engine loop: down either way
            if replica.target.up:
                logger.warning("replica %s failed its health check: %s", replica.name, type(unwrap(e)).__name__)
            replica.set_up(False)
            return
        replica.set_up(True)


class _ReplicaDown(Exception):
    """The health check marked a request's replica down while the request waited for its next output."""


async def _until_down(stream, replica: Replica) -> AsyncIterator:
    """The stream's items (object refs) until its replica is marked down: then `_ReplicaDown`."""
    down = asyncio.ensure_future(replica.down.wait())
    try:
        while True:
            item = asyncio.ensure_future(anext(stream))
            await asyncio.wait((item, down), return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                item.cancel()
                raise _ReplicaDown()
            try:
                yield item.result()
            except StopAsyncIteration:
                return
    finally:
        down.cancel()
