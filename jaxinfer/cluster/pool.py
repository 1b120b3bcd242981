"""`ReplicaPool`: engine replicas as Ray actors: where they run, starting them, and stopping them.

1. `connect` joins the Ray cluster at an address, or starts a local Ray instance (`ClusterConfig.ray_address`
   None), unless this process is connected already.
2. `ReplicaPool.start` creates `num_replicas` mixed `EngineReplica` actors, then `prefill_replicas` and
   `decode_replicas` ones (each role may get engine options of its own: a TP degree, batch limits). Each asks Ray
   for `replica_cpus` CPUs and `replica_gpus` GPUs (default: as many GPUs as its engine uses devices where the
   cluster has GPUs, none where it has not): Ray places them on any node with those resources free, and gives a
   GPU replica its own devices. A CPU replica whose engine needs several devices (`tensor_parallel_size` x
   `expert_parallel_size`) gets that many host devices (`XLA_FLAGS=--xla_force_host_platform_device_count`, in its
   actor's environment). Nothing else
   about the cluster is assumed. Every replica's engine is built in parallel; `start` returns once all of them
   answer `start()` and agree on the model and page size (`check_compatible`), and fails (stopping the ones that
   did start) when one fails or `start_timeout_s` passes.
3. Ray restarts an actor that dies, up to `max_restarts` times (its engine is built again when the router calls
   `start()`: `jaxinfer.cluster.engine`). `shutdown` kills the actors the pool started, for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import Mapping

import ray
from ray.exceptions import RayTaskError

from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.replica import EngineReplica, ReplicaInfo, ReplicaRole, check_compatible
from jaxinfer.engine.config import EngineConfig

logger = logging.getLogger(__name__)


def connect(cluster: ClusterConfig) -> bool:
    """Connects this process to Ray (module docstring, item 1); returns True when it did so now, False when it was
    connected already (then the caller must not shut Ray down).

    Raises:
      ValueError: no Ray cluster answers at `ray_address`.
    """
    if ray.is_initialized():
        return False
    try:
        if cluster.ray_address is None:
            ray.init(include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=cluster.ray_address, log_to_driver=True)
    except ConnectionError as e:
        raise ValueError(f"--ray-address {cluster.ray_address}: no Ray cluster answers there ({e})") from None
    return True


def _num_devices(config: EngineConfig) -> int:
    return config.num_devices


def _gpus_per_replica(cluster: ClusterConfig, config: EngineConfig) -> float:
    """`replica_gpus`, or where unset, as many GPUs as the replica's engine uses devices when the cluster has
    GPUs, else 0."""
    if cluster.replica_gpus is not None:
        return cluster.replica_gpus
    return float(_num_devices(config)) if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def _runtime_env(config: EngineConfig, gpus: float) -> dict | None:
    """A CPU replica's environment when its engine needs several devices (module docstring, item 2), else None."""
    num_devices = _num_devices(config)
    if gpus > 0 or num_devices <= 1:
        return None
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={num_devices}")
    return {"env_vars": {"XLA_FLAGS": " ".join(flags)}}


@dataclasses.dataclass(frozen=True)
class ReplicaHandle:
    """A started replica: its Ray actor and what it told the router."""

    actor: ray.actor.ActorHandle
    info: ReplicaInfo

    @property
    def name(self) -> str:
        return self.info.name


def unwrap(error: BaseException) -> BaseException:
    """The exception a replica raised (a `ValueError` naming the field, say), out of Ray's `RayTaskError`."""
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else error


class ReplicaPool:
    """Started replicas (use `ReplicaPool.start`).

    Args:
      replicas: the replicas, each answering.
      owned: whether `shutdown` kills them (the pool started them).
      ray_started: whether this pool connected the process to Ray (`shutdown` then disconnects).
    """

    def __init__(self, replicas: list[ReplicaHandle], owned: bool = True, ray_started: bool = False) -> None:
        if not replicas:
            raise ValueError("a replica pool needs at least one replica")
        self.replicas, self.owned, self.ray_started = replicas, owned, ray_started

    @classmethod
    async def start(cls, config: EngineConfig, cluster: ClusterConfig,
                    role_configs: Mapping[ReplicaRole, EngineConfig] | None = None) -> ReplicaPool:
        """Connects to Ray (in a worker thread) and starts the replicas `cluster` asks for.

        Args:
          config: every replica's engine options.
          cluster: how many replicas of each role, and where.
          role_configs: engine options of a role's replicas instead of `config`.

        Raises:
          ValueError: as `connect`; a replica refused the configuration or the model (the replica's message);
            replicas that one router cannot serve together (`check_compatible`).
          RuntimeError: a replica failed otherwise, died while starting, or did not start in `start_timeout_s`.
        """
        ray_started = await asyncio.to_thread(connect, cluster)
        prefix = f"jaxinfer-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        roles = [(ReplicaRole.MIXED, f"{prefix}-{i}") for i in range(cluster.num_replicas)]
        roles += [(ReplicaRole.PREFILL, f"{prefix}-p{i}") for i in range(cluster.prefill_replicas)]
        roles += [(ReplicaRole.DECODE, f"{prefix}-d{i}") for i in range(cluster.decode_replicas)]
        actor_class = ray.remote(EngineReplica)
        actors = []
        for role, name in roles:
            role_config = (role_configs or {}).get(role, config)
            gpus = _gpus_per_replica(cluster, role_config)
            actors.append(actor_class.options(name=name, num_cpus=cluster.replica_cpus, num_gpus=gpus,
                                              max_restarts=cluster.max_restarts,
                                              runtime_env=_runtime_env(role_config, gpus))
                          .remote(role_config, name, role))
        logger.info("starting %d replicas (%s CPUs each) on Ray", len(actors), cluster.replica_cpus)
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(a.start.remote() for a in actors)),
                                           cluster.start_timeout_s)
            check_compatible(infos)
        except BaseException as e:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if ray_started:
                ray.shutdown()
            if isinstance(e, asyncio.CancelledError):  # a stop signal during start-up: not a failure
                raise
            cause = unwrap(e)
            if isinstance(cause, ValueError):
                raise cause from None
            if isinstance(e, asyncio.TimeoutError):
                raise RuntimeError(f"the replicas did not start within {cluster.start_timeout_s:g} s "
                                   "(does the cluster have the CPUs and GPUs they ask for?)") from None
            raise RuntimeError(f"a replica failed to start: {type(cause).__name__}: {cause}") from None
        return cls([ReplicaHandle(a, info) for a, info in zip(actors, infos)], owned=True, ray_started=ray_started)

    def shutdown(self) -> None:
        """Kills the replicas the pool started (their requests end) and leaves Ray if the pool joined it."""
        if self.owned:
            for replica in self.replicas:
                ray.kill(replica.actor, no_restart=True)
        if self.ray_started:
            ray.shutdown()
