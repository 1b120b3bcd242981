"""`ServedCluster`: a `ServedEngine` whose engine is a `ClusterEngine` over Ray replicas, for the HTTP front end
(`jaxinfer serve --replicas N`); and the router's Prometheus metrics.

1. `start()` (as `ServedEngine`'s) starts the replica pool in the background, so the front end listens and
   answers health checks (503) meanwhile; a pool that fails to start is the server's `engine_error`.
2. A watchdog runs the cluster's health check (`ClusterEngine.watch`) and tells the listeners when the cluster
   stops or starts serving (no replica up, or one up again).
3. `ready()` raises `Unavailable` (HTTP 503, OpenAI-shaped) while no replica is up.
4. The registry of `ServerMetrics` (request counts, latencies; the engines' gauges and counters summed over the
   replicas) gains the router's own families, per replica (label `replica`): `jaxinfer:router_requests_total`,
   `jaxinfer:router_prefix_hit_tokens_total` (prompt tokens the router's index said the replica held when it
   routed there), `jaxinfer:router_requests_in_flight`, `jaxinfer:router_replica_up`, and the replica's own
   prefix-cache counters `jaxinfer:replica_prefix_cache_queries_total` / `_hits_total` (from its last health
   check). Disaggregation and faults (`jaxinfer.cluster.disagg.HandoffCounters`), over the cluster:
   `jaxinfer:router_prefill_queue_length` (requests waiting for their first token from a prefill replica),
   `jaxinfer:router_kv_handoffs_total`, `jaxinfer:router_kv_handoff_bytes_total`,
   `jaxinfer:router_kv_handoff_seconds` (histogram), `jaxinfer:router_local_prefills_total{reason}` and
   `jaxinfer:router_resubmissions_total{replica}` (requests sent again after that replica went down).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.cluster.engine import ClusterEngine
from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.disagg import DisaggConfig
from jaxinfer.cluster.pool import ReplicaPool
from jaxinfer.cluster.replica import ReplicaRole
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.metrics import LABEL, P
from jaxinfer.serving.served import ServedEngine, ServerLimits

logger = logging.getLogger(__name__)


class RouterCollector(Collector):
    """The router's per-replica families (module docstring, item 4), read at scrape time."""

    def __init__(self, served: ServedCluster) -> None:
        self._served = served

    def collect(self) -> Iterator:
        cluster = self._served.async_engine
        if cluster is None:
            return
        labels = [LABEL, "replica"]
        families = {
            "requests": CounterMetricFamily(P + "router_requests", "requests routed to the replica", labels=labels),
            "hits": CounterMetricFamily(P + "router_prefix_hit_tokens", "prompt tokens the router's index said "
                                        "the replica held when it routed requests there", labels=labels),
            "in_flight": GaugeMetricFamily(P + "router_requests_in_flight", "requests routed to the replica and "
                                           "not finished", labels=labels),
            "up": GaugeMetricFamily(P + "router_replica_up", "1 while the replica answers its health check",
                                    labels=labels),
            "queries": CounterMetricFamily(P + "replica_prefix_cache_queries", "the replica's prefix cache: prompt "
                                           "tokens looked up (at its last health check)", labels=labels),
            "cached": CounterMetricFamily(P + "replica_prefix_cache_hits", "the replica's prefix cache: tokens "
                                          "taken from it (at its last health check)", labels=labels),
        }
        name = self._served.model_name
        for r in cluster.replicas:
            key = [name, r.name]
            families["requests"].add_metric(key, r.requests_routed)
            families["hits"].add_metric(key, r.routed_hit_tokens)
            families["in_flight"].add_metric(key, r.target.in_flight)
            families["up"].add_metric(key, 1.0 if r.target.up else 0.0)
            if r.stats is not None and "prefix_cache_hit_tokens" in r.stats:
                families["queries"].add_metric(key, r.stats["prefix_cache_queried_tokens"])
                families["cached"].add_metric(key, r.stats["prefix_cache_hit_tokens"])
        yield from families.values()
        yield from self._handoffs(cluster, name)

    @staticmethod
    def _handoffs(cluster: ClusterEngine, name: str) -> Iterator:
        counts = cluster.counters
        queue = GaugeMetricFamily(P + "router_prefill_queue_length", "requests waiting for their first token from "
                                  "a prefill replica", labels=[LABEL])
        queue.add_metric([name], counts.prefill_queue)
        handoffs = CounterMetricFamily(P + "router_kv_handoffs", "requests whose K/V moved from a prefill replica "
                                       "to a decode replica", labels=[LABEL])
        handoffs.add_metric([name], counts.handoffs)
        moved = CounterMetricFamily(P + "router_kv_handoff_bytes", "bytes of K/V moved by those handoffs",
                                    labels=[LABEL])
        moved.add_metric([name], counts.handoff_bytes)
        seconds = HistogramMetricFamily(P + "router_kv_handoff_seconds", "from the router's export call to the "
                                        "decode replica holding the K/V (export, object store, fetch)",
                                        labels=[LABEL])
        seconds.add_metric([name], counts.handoff_seconds.cumulative(), counts.handoff_seconds.sum)
        local = CounterMetricFamily(P + "router_local_prefills", "prompts a decode replica prefilled itself in a "
                                    "cluster with prefill replicas, by reason", labels=[LABEL, "reason"])
        for reason, n in counts.local_prefills.items():
            local.add_metric([name, reason.value], n)
        resubmitted = CounterMetricFamily(P + "router_resubmissions", "requests sent again, with their output so "
                                          "far, after the replica they ran on went down", labels=[LABEL, "replica"])
        for replica, n in counts.resubmissions.items():
            resubmitted.add_metric([name, replica], n)
        yield from (queue, handoffs, moved, seconds, local, resubmitted)


class ServedCluster(ServedEngine):
    """The cluster a server's front ends drive (module docstring).

    Args:
      config: every replica's engine options.
      cluster: where and how many replicas to start (a `ClusterConfig`), or a started `ReplicaPool` to route over
        (`stop` then leaves it running).
      routing: the routing policy and its knobs.
      limits: the server's limits (request bytes, requests in flight over the whole cluster).
      model_name: the served model name; None derives it from `config.model`.
      disagg: when prompts cross to prefill replicas, and the K/V's wire dtype.
      role_configs: engine options of one role's replicas instead of `config` (with a `ClusterConfig`).
      health: with a `ReplicaPool`, the health check's and restarts' settings (default `ClusterConfig()`'s).
    """

    def __init__(self, config: EngineConfig, cluster: ClusterConfig | ReplicaPool, routing: RoutingConfig,
                 limits: ServerLimits = ServerLimits(), model_name: str | None = None,
                 disagg: DisaggConfig = DisaggConfig(),
                 role_configs: dict[ReplicaRole, EngineConfig] | None = None,
                 health: ClusterConfig | None = None) -> None:
        super().__init__(config, limits, model_name)
        self.cluster, self.routing, self.disagg, self.role_configs = cluster, routing, disagg, role_configs
        self.health = cluster if isinstance(cluster, ClusterConfig) else health or ClusterConfig()
        self.metrics.registry.register(RouterCollector(self))

    async def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            pool = (self.cluster if isinstance(self.cluster, ReplicaPool)
                    else await ReplicaPool.start(self.config, self.cluster, self.role_configs))
        except asyncio.CancelledError:
            logger.info("start-up cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - reported through health and the log (`serve` then exits)
            if not isinstance(e, ValueError):
                logger.exception("the replicas failed to start")
            self.engine_error = e
            return
        self.async_engine = ClusterEngine(pool, self.routing, self.health,
                                          owns_pool=not isinstance(self.cluster, ReplicaPool), disagg=self.disagg)
        await self._notify(True)
        roles = ", ".join(f"{sum(h.info.role is role for h in pool.replicas)} {role.value}" for role in ReplicaRole
                          if any(h.info.role is role for h in pool.replicas))
        logger.info("serving %s on %s replicas, routing %s (ready in %.1f s)", pool.replicas[0].info.model_config.name,
                    roles, self.routing.policy.value, time.perf_counter() - t0)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        health = asyncio.get_running_loop().create_task(self.async_engine.watch())
        serving = True
        try:
            while not self.stopping:
                await asyncio.sleep(self.health.health_period_s / 2)
                if self.serving != serving and not self.stopping:  # a stop is not an outage
                    serving = self.serving
                    logger.log(logging.INFO if serving else logging.ERROR,
                               "serving again" if serving else "no replica is reachable; reporting not serving")
                    await self._notify(serving)
        finally:
            health.cancel()

    def ready(self) -> ClusterEngine:
        """The cluster engine, for a new call.

        Raises:
          Unavailable: the server is stopping, the replicas are starting or failed to start, or none is up.
        """
        engine = self.async_engine
        if self.stopping or engine is None:
            return super().ready()
        if not engine.is_alive():
            raise engine.unavailable()
        return engine
