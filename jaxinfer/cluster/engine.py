"""`ClusterEngine`: `AsyncEngine`'s interface over a pool of engine replicas, so that the HTTP front end
(`jaxinfer.serving.openai.app`) serves a cluster as it serves one engine.

1. The router tokenizes: `engine` (a `jaxinfer.cluster.view.ReplicaView`) has what the front end reads of an
   `Engine` (the tokenizer, the model's config and context, `make_prompt`, `stats()`). A request without a seed
   gets one here, so that any replica that continues it draws the keys the first would have.
2. `_route` picks the replica that will decode the request among the decode and mixed replicas that are up
   (`jaxinfer.cluster.routing`; with none up, among the prefill replicas), then, when the cluster has prefill
   replicas, whether a prefill replica computes the prompt's K/V first
   (`jaxinfer.cluster.disagg.local_prefill_reason`) and which (routed the same way over the prefill replicas).
   The prompt's pages go into the index of every replica it is sent to, and prompt + output into the decoding
   one's when it finishes.
3. Locally: the decode replica streams the request (`EngineReplica.generate`). Disaggregated
   (`_disaggregated`): the prefill replica's first token is streamed to the client at once; then the router asks
   it to export the K/V (`export_kv`) and hands the export's Ray object reference, unfetched, to the decode
   replica (`generate_from_handoff`), which pulls the payload from the object store, writes it into its pages
   and streams the rest. The client sees one stream (`jaxinfer.cluster.splice`).
4. Faults: a replica whose actor dies, whose engine loop stops, or that the health check marks down while a
   request waits on it is marked down, and the request is sent again (`_resubmit`) to a decode or mixed replica
   that is up (else any replica that is up) with the tokens already streamed as its output so far, so the client
   sees one unbroken stream; so is a request whose handed-over K/V was lost with its prefill replica. A request
   fails with `EngineStoppedError` (HTTP 503 before its first token, an error event after) only when no replica
   is up, after as many attempts as there are replicas, or when it cannot resume (n > 1 after tokens streamed).
5. A caller that stops iterating cancels the Ray tasks and aborts the request on its replicas, freeing its pages
   (and the K/V a prefill replica holds for a handoff).
6. Health: `watch` asks every replica for its stats each `health_period_s`; one that does not answer within
   `health_timeout_s`, whose actor died, or whose engine loop stopped is down and gets no new requests. Ray
   restarts a dead replica's actor (`ClusterConfig.max_restarts`); the router then builds its engine again
   (`start()`), forgets what its index held, and routes to it once it answers. With no replica up, `generate`
   raises `Unavailable` (HTTP 503) at once: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.disagg import DisaggConfig, HandoffCounters, local_prefill_reason
from jaxinfer.cluster.pool import ReplicaPool, unwrap
from jaxinfer.cluster.replica import Fetched, HandoffLost, ReplicaNotStarted, ReplicaRole
from jaxinfer.cluster.routing import PageIndex, RouteTarget, Router, RoutingConfig
from jaxinfer.cluster.splice import StreamSplice
from jaxinfer.cluster.view import Replica, ReplicaDown, ReplicaView, items_until_down, until_down
from jaxinfer.engine.async_engine import EngineStoppedError
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.prefix_cache import prefix_page_keys
from jaxinfer.serving.served import Unavailable

logger = logging.getLogger(__name__)


class _Lost(Exception):
    """An attempt of a request ended with its replica (or its handed-over K/V) lost: send it again."""

    def __init__(self, replica: Replica | None, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.replica = replica


@dataclasses.dataclass
class _Plan:
    decode: Replica  # the replica that streams the request
    prefill: Replica | None = None  # the replica that prefills it first, if any


class ClusterEngine:
    """Serves requests on a pool of replicas, with `AsyncEngine`'s interface (module docstring).

    Args:
      pool: the started replicas.
      routing: the routing policy and its knobs.
      cluster: the health check's period and timeout, how long a restarted replica may take to start (only those
        fields are read).
      owns_pool: whether `shutdown` stops the pool's replicas.
      disagg: when prompts cross to a prefill replica, and the wire dtype of their K/V.
    """

    def __init__(self, pool: ReplicaPool, routing: RoutingConfig, cluster: ClusterConfig = ClusterConfig(),
                 owns_pool: bool = True, disagg: DisaggConfig = DisaggConfig()) -> None:
        self.pool, self.cluster, self.owns_pool, self.disagg = pool, cluster, owns_pool, disagg
        self.replicas = [Replica(h, RouteTarget(h.name, PageIndex(max(h.info.kv_pages_total, 1))))
                         for h in pool.replicas]
        self.engine = ReplicaView(self.replicas)
        self.router = Router(routing, self.engine.page_size)
        self.counters = HandoffCounters()
        self.error: BaseException | None = None
        self._ids = (f"{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._closed = False
        self._running: dict[str, list[Replica]] = {}  # request id -> the replicas it is on, while in flight

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
        """Streams one request's outputs from the replicas it is routed to (as `AsyncEngine.generate`).

        Raises:
          ValueError: a replica refused the request (its message, as one engine's).
          Unavailable: no replica is up.
          EngineStoppedError: the request's replica went down and it could not go on elsewhere (module
            docstring, item 4).
        """
        if not isinstance(prompt, Prompt):
            prompt = await asyncio.to_thread(self.engine.make_prompt, prompt)
        params = SamplingParams() if params is None else params
        if params.seed is None:  # every attempt must draw the same keys (item 1)
            params = dataclasses.replace(params, seed=random.getrandbits(32))
        request_id = request_id or next(self._ids)
        if request_id in self._running:
            raise ValueError(f"request_id={request_id!r} is already in use")
        keys = prefix_page_keys(prompt.token_ids, prompt.cache_salt, self.engine.page_size)
        plan = self._route(prompt, params, keys)
        splice = StreamSplice(params)
        self._running[request_id] = []
        try:
            for resubmissions in itertools.count(1):
                decode = plan.decode
                decode.target.in_flight += 1
                try:
                    if plan.prefill is not None:
                        attempt = self._disaggregated(plan, prompt, request_id, splice)
                    else:
                        attempt = self._stream(decode, prompt, request_id, splice)
                    async with contextlib.aclosing(attempt) as outputs:
                        async for out in outputs:
                            yield out
                    return
                except _Lost as lost:
                    plan = self._resubmit(lost, splice, keys, len(prompt.token_ids), request_id, resubmissions)
                finally:
                    decode.target.in_flight -= 1
        finally:
            del self._running[request_id]

    def abort(self, request_id: str) -> None:
        """Aborts a request on its replicas (a no-op for one not in flight); its stream then ends with finish_reason
        "abort", as one engine's."""
        for replica in self._running.get(request_id, ()):
            with contextlib.suppress(Exception):
                replica.handle.actor.abort.remote(request_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Refuses new requests; stops the pool's replicas when it owns the pool."""
        self._closed = True
        if self.owns_pool:
            self.pool.shutdown()

    # --- routing -------------------------------------------------------------------------------------------------

    def _choose(self, candidates: list[Replica], keys: list[int], num_tokens: int) -> Replica | None:
        choice = self.router.choose([r.target for r in candidates], keys, num_tokens)
        if choice is None:
            return None
        replica = next(r for r in candidates if r.target is choice.target)
        replica.requests_routed += 1
        replica.routed_hit_tokens += choice.hit_tokens
        replica.target.index.add(keys)
        return replica

    def _route(self, prompt: Prompt, params: SamplingParams, keys: list[int]) -> _Plan:
        """The decode replica of a new request and, if the prompt crosses, its prefill replica (item 2).

        Raises:
          Unavailable: no replica is up.
        """
        if self._closed:
            raise self.unavailable()
        n = len(prompt.token_ids)
        decoding = [r for r in self.replicas if r.role is not ReplicaRole.PREFILL]
        prefilling = [r for r in self.replicas if r.role is ReplicaRole.PREFILL]
        held = {id(r): r.target.index.leading_hits(keys) * self.engine.page_size for r in decoding}
        decode = self._choose(decoding, keys, n) or self._choose(prefilling, keys, n)  # a prefill one decodes too
        if decode is None:
            raise self.unavailable()
        if decode.role is ReplicaRole.PREFILL or not prefilling:
            return _Plan(decode)
        reason = local_prefill_reason(self.disagg, n, held[id(decode)], params,
                                      any(r.target.up for r in prefilling))
        if reason is not None:
            self.counters.local_prefills[reason] += 1
            return _Plan(decode)
        return _Plan(decode, self._choose(prefilling, keys, n))

    def _resubmit(self, lost: _Lost, splice: StreamSplice, keys: list[int], num_prompt_tokens: int, request_id: str,
                  resubmissions: int) -> _Plan:
        """Where a request goes after its replica was lost (item 4), counted; `resubmissions` counts this one.

        Raises:
          EngineStoppedError: it cannot go on (no replica up, too many attempts, n > 1 after tokens streamed).
        """
        if self._closed:  # the server is stopping and killed the replicas: nothing is sent again
            raise EngineStoppedError("the server is shutting down")
        what = "its K/V handoff was lost" if lost.replica is None else f"replica {lost.replica.name} went down"
        if lost.replica is not None:
            lost.replica.set_up(False)
        why = None
        if not splice.can_resume():
            why = f"n={splice.params.n} samples cannot resume after tokens were streamed"
        elif resubmissions > len(self.replicas):
            why = f"it was sent again {resubmissions - 1} times"
        up = [r for r in self.replicas if r.target.up]
        decoding = [r for r in up if r.role is not ReplicaRole.PREFILL] or up
        replica = None if why else self._choose(decoding, keys, num_prompt_tokens)
        if replica is None:
            raise EngineStoppedError(f"{what} ({lost}) and the request cannot go on: {why or 'no replica is up'}")
        name = "handoff" if lost.replica is None else lost.replica.name
        self.counters.resubmissions[name] = self.counters.resubmissions.get(name, 0) + 1
        logger.warning("request %s: %s (%s); sent again to %s with %d tokens of output so far", request_id, what,
                       lost, replica.name, len(splice.token_ids))
        return _Plan(replica)

    # --- attempts ------------------------------------------------------------------------------------------------

    async def _stream(self, replica: Replica, prompt: Prompt, request_id: str,
                      splice: StreamSplice) -> AsyncIterator[RequestOutput]:
        """One attempt on one replica: the request with its output so far (item 3, locally; item 4)."""
        params, output_token_ids = splice.next_attempt()
        stream = replica.handle.actor.generate.options(num_returns="streaming").remote(
            prompt, params, request_id, output_token_ids)
        async for item in self._follow(replica, stream, request_id):
            yield self._deliver(replica, prompt, splice, item)

    async def _disaggregated(self, plan: _Plan, prompt: Prompt, request_id: str,
                             splice: StreamSplice) -> AsyncIterator[RequestOutput]:
        """A prefill replica's first token, then the decode replica's stream from the handed-over K/V (item 3)."""
        prefill, decode = plan.prefill, plan.decode
        params, _ = splice.next_attempt()
        running = self._running[request_id]
        running.append(prefill)
        ref = prefill.handle.actor.prefill.remote(prompt, params, request_id)
        self.counters.prefill_queue += 1
        prefill.target.in_flight += 1
        fetched = False
        try:
            try:
                first = await until_down(prefill, ref)
            except (RayActorError, ReplicaDown) as e:
                raise _Lost(prefill, e) from None
            except RayTaskError as e:
                raise self._task_error(prefill, e) from None
            finally:
                self.counters.prefill_queue -= 1
                prefill.target.in_flight -= 1
            first = self._deliver(prefill, prompt, splice, first)
            yield first
            if first.finished:
                return
            t0 = time.perf_counter()
            payload = [prefill.handle.actor.export_kv.remote(request_id, self.disagg.wire_dtype)]
            splice.next_attempt()
            stream = decode.handle.actor.generate_from_handoff.options(num_returns="streaming").remote(
                payload, params, request_id)
            async for item in self._follow(decode, stream, request_id):
                if isinstance(item, Fetched):
                    fetched = True
                    payload.clear()  # the object store may drop the payload once the decode replica has it
                    self.counters.handoffs += 1
                    self.counters.handoff_bytes += item.nbytes
                    self.counters.handoff_seconds.observe(time.perf_counter() - t0)
                    continue
                yield self._deliver(decode, prompt, splice, item)
        finally:
            if not fetched:  # the caller left, the prefill or the export failed: free K/V held for the handoff
                with contextlib.suppress(Exception):
                    prefill.handle.actor.abort.remote(request_id)
            running.remove(prefill)

    async def _follow(self, replica: Replica, stream, request_id: str) -> AsyncIterator[object]:
        """A streaming Ray task's items on `replica`, up to a finished output; a lost replica is `_Lost`, and so is
        a handoff that did not arrive (`HandoffLost`: no replica to blame); a caller that leaves cancels the task
        and aborts the request there."""
        running = self._running[request_id]
        running.append(replica)
        finished = False
        try:
            async with contextlib.aclosing(items_until_down(stream, replica)) as refs:
                async for ref in refs:
                    item = await ref
                    finished = isinstance(item, RequestOutput) and item.finished
                    yield item
                    if finished:
                        return
        except (RayActorError, ReplicaDown) as e:
            raise _Lost(replica, e) from None
        except RayTaskError as e:
            cause = unwrap(e)
            raise (_Lost(None, cause) if isinstance(cause, HandoffLost) else self._task_error(replica, e)) from None
        finally:
            running.remove(replica)
            if not finished:  # stop the Ray task and the request (either alone would do)
                with contextlib.suppress(Exception):
                    ray.cancel(stream)
                with contextlib.suppress(Exception):
                    replica.handle.actor.abort.remote(request_id)

    @staticmethod
    def _task_error(replica: Replica, error: RayTaskError) -> BaseException:
        """A replica's own exception, as it is (a ValueError naming the field, ...); its stopped engine loop is the
        replica lost."""
        cause = unwrap(error)
        return _Lost(replica, cause) if isinstance(cause, (EngineStoppedError, ReplicaNotStarted)) else cause

    def _deliver(self, replica: Replica, prompt: Prompt, splice: StreamSplice, out: RequestOutput) -> RequestOutput:
        """An attempt's output as the client's stream (`StreamSplice.patch`); a finished one's prompt + output pages
        (all but the last token, whose K/V the engine never computes) go into the replica's index."""
        out = splice.patch(out, time.perf_counter())
        if out.finished and out.outputs:
            tokens = [*prompt.token_ids, *out.outputs[0].token_ids[:-1]]
            replica.target.index.add(prefix_page_keys(tokens, prompt.cache_salt, self.engine.page_size))
        return out

    # --- health ---------------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Checks every replica's health each `health_period_s` until cancelled (module docstring, item 6)."""
        try:
            while not self._closed:
                await asyncio.gather(*(self._check(r) for r in self.replicas))
                await asyncio.sleep(self.cluster.health_period_s)
        finally:
            for replica in self.replicas:
                if replica.restarting is not None:
                    replica.restarting.cancel()

    async def _check(self, replica: Replica) -> None:
        try:
            replica.stats, replica.steps_by_num_tokens = await asyncio.wait_for(
                replica.handle.actor.stats.remote(), self.cluster.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - dead actor, timeout, stopped engine loop: down either way
            cause = unwrap(e)
            if replica.target.up:
                logger.warning("replica %s failed its health check: %s", replica.name, type(cause).__name__)
            replica.set_up(False)
            if isinstance(cause, ReplicaNotStarted) and replica.restarting is None:
                replica.restarting = asyncio.get_running_loop().create_task(self._restart(replica))
            return
        replica.set_up(True)

    async def _restart(self, replica: Replica) -> None:
        """Builds the engine of a replica Ray restarted (item 6); the next health check finds it up."""
        logger.warning("replica %s was restarted by Ray; starting its engine", replica.name)
        try:
            await asyncio.wait_for(replica.handle.actor.start.remote(), self.cluster.start_timeout_s)
            replica.target.index.clear()  # a new engine holds no cached pages
        except Exception as e:  # noqa: BLE001 - it stays down; the next health check tries again
            logger.warning("replica %s did not start again: %s: %s", replica.name, type(unwrap(e)).__name__,
                           unwrap(e))
        finally:
            replica.restarting = None
