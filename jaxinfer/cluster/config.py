"""`ClusterConfig`: where the replicas of `jaxinfer serve --replicas N` run and how the router watches them (no
Ray here: the command checks it before Ray is imported)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where the replicas run and how long the router waits for them.

    Attributes:
      num_replicas: mixed engine replicas (prefill and decode their own requests), >= 1 without prefill or decode
        replicas, else >= 0.
      prefill_replicas: replicas that prefill prompts for decode replicas (`jaxinfer.cluster.disagg`), >= 0.
      decode_replicas: replicas that continue requests from handed-over K/V, >= 0; prefill replicas need a decode
        or mixed replica, and decode replicas a prefill replica.
      ray_address: the Ray cluster to join (`ray.init(address=...)`, e.g. "auto" or "10.0.0.1:6379"); None
        starts a local Ray instance with this machine's resources.
      replica_cpus: CPUs Ray reserves for each replica (> 0; a fraction shares a core).
      replica_gpus: GPUs per replica (>= 0); None: where the cluster has GPUs, as many as the replica's engine uses
        devices (tensor x expert parallel size), else 0.
      start_timeout_s: how long all replicas may take to load their model and compile (seconds, > 0).
      health_period_s: how often the router asks every replica for its stats (its health check), seconds, > 0.
      health_timeout_s: a replica that has not answered within this is down (seconds, > 0); so is one whose
        actor died or whose engine loop stopped.
      max_restarts: how many times Ray restarts a replica's actor that died (>= 0; -1: without limit).

    Raises:
      ValueError: a value out of its range.
    """

    num_replicas: int = 1
    prefill_replicas: int = 0
    decode_replicas: int = 0
    ray_address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float | None = None
    start_timeout_s: float = 1800.0
    health_period_s: float = 1.0
    health_timeout_s: float = 10.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        disaggregated = self.prefill_replicas != 0 or self.decode_replicas != 0
        for flag, value, least in (("--replicas", self.num_replicas, 0 if disaggregated else 1),
                                   ("--prefill-replicas", self.prefill_replicas, 0),
                                   ("--decode-replicas", self.decode_replicas, 0),
                                   ("--replica-max-restarts", self.max_restarts, -1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{flag} {value!r} must be an integer >= {least}")
        if self.prefill_replicas and not self.decode_replicas + self.num_replicas:
            raise ValueError(f"--prefill-replicas {self.prefill_replicas} needs --decode-replicas (or --replicas) "
                             ">= 1: prefill replicas hand every request on")
        if self.decode_replicas and not self.prefill_replicas:
            raise ValueError(f"--decode-replicas {self.decode_replicas} needs --prefill-replicas >= 1 (without "
                             "prefill replicas, use --replicas)")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ValueError("--ray-address must not be empty (leave it out to start a local Ray instance)")
        if not self.replica_cpus > 0:
            raise ValueError(f"--replica-cpus {self.replica_cpus} must be > 0")
        if self.replica_gpus is not None and not self.replica_gpus >= 0:
            raise ValueError(f"--replica-gpus {self.replica_gpus} must be >= 0")
        for name in ("start_timeout_s", "health_period_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
