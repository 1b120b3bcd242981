"""`jaxinfer serve`: the OpenAI HTTP API and gRPC over one engine; with `--replicas N` (or `--ray-address`, or
`--prefill-replicas X --decode-replicas Y`), the HTTP API over engine replicas on Ray (`jaxinfer.cluster`, imported
only then)."""

from __future__ import annotations

import argparse
import os

from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.disagg import WIRE_DTYPE_NAMES, DisaggConfig
from jaxinfer.cluster.routing import POLICY_NAMES, RoutingConfig
from jaxinfer.commands.options import (add_engine_options, add_multihost_options, check_host, engine_options,
                                       join_job)
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.config_file import load_config_file

_RAY_SIGNAL_HANDLER_OFF = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def add_parser(sub) -> None:
    """Adds the `serve` subcommand to the subparsers `sub`."""
    srv = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API and gRPC",
                         description="Serve a model over the OpenAI-compatible HTTP API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
                                     "/detokenize) and gRPC (jaxinfer.v1.JaxInfer, health, reflection), one engine "
                                     "behind both. SIGTERM / SIGINT stop it gracefully.")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--http-port", type=int, default=8000,
                     help="OpenAI HTTP API port (default 8000; 0 picks a free one)")
    srv.add_argument("--no-http", action="store_true", help="serve gRPC only")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0 picks a free one)")
    srv.add_argument("--no-grpc", action="store_true", help="serve the HTTP API only")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name of the HTTP API (/v1/models; requests' 'model'); default: the model "
                          "file's or folder's name without its quantization suffix, e.g. SmolLM2-135M-Instruct")
    srv.add_argument("--api-key", default=None,
                     help="bearer token every /v1 route and every gRPC call requires (default: $JAXINFER_API_KEY; "
                          "unset: none)")
    srv.add_argument("--metrics-port", type=int, default=None,
                     help="Prometheus metrics on a port of their own (default: off; the HTTP API serves /metrics)")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests in flight before new ones get RESOURCE_EXHAUSTED / HTTP 429")
    srv.add_argument("--grace-seconds", type=float, default=10.0,
                     help="on shutdown, how long streams in flight may finish before they are cancelled")
    srv.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    add_engine_options(srv, "serve")
    add_multihost_options(srv)
    _add_cluster_options(srv)


def _add_cluster_options(srv) -> None:
    ray = srv.add_argument_group("replicas on Ray (README \"Replicas on Ray\"; needs jaxinfer[cluster])")
    ray.add_argument("--replicas", type=int, default=None,
                     help="engine replicas, each a Ray actor, behind one router serving the HTTP API (default 1: one "
                          "engine in this process, no Ray; 0 with --prefill-replicas)")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (e.g. auto, or head-node:6379) instead of starting a local Ray "
                          "instance; implies the router even with --replicas 1")
    ray.add_argument("--replica-cpus", type=float, default=ClusterConfig.replica_cpus,
                     help="CPUs Ray reserves per replica (default %(default)s)")
    ray.add_argument("--replica-gpus", type=float, default=None,
                     help="GPUs per replica (default: where the Ray cluster has GPUs, as many as the replica's engine "
                          "uses devices (--tp x --ep), else 0)")
    ray.add_argument("--replica-max-restarts", type=int, default=ClusterConfig.max_restarts,
                     help="how many times Ray restarts a replica that died (default %(default)s; -1: no limit)")
    ray.add_argument("--routing", choices=POLICY_NAMES, default=RoutingConfig.policy.value,
                     help="how the router picks a replica (default %(default)s)")
    ray.add_argument("--routing-load-weight", type=float, default=RoutingConfig.load_weight_tokens,
                     help="cache_aware: cached prompt tokens one request in flight is worth (default %(default)s)")
    ray.add_argument("--routing-max-imbalance", type=int, default=RoutingConfig.max_imbalance,
                     help="cache_aware: most requests in flight a replica may have above the least loaded one and "
                          "still be chosen (default %(default)s)")
    ray.add_argument("--routing-min-match", type=float, default=RoutingConfig.min_match,
                     help="cache_aware: share of a prompt a replica must hold for the prompt to follow its cache; "
                          "below it the prompt goes to the least loaded replica (default %(default)s)")
    pd = srv.add_argument_group("disaggregated prefill/decode on Ray (README \"Replicas on Ray\", xPyD)")
    pd.add_argument("--prefill-replicas", type=int, default=0,
                    help="replicas that prefill prompts and hand their K/V to decode replicas (default 0)")
    pd.add_argument("--decode-replicas", type=int, default=0,
                    help="replicas that continue requests from handed-over K/V (default 0)")
    for role in ("prefill", "decode"):
        pd.add_argument(f"--{role}-config", default=None, metavar="FILE",
                        help=f"a JSON object of engine options for the {role} replicas only, over the others "
                             "(e.g. {\"tensor_parallel_size\": 2})")
    pd.add_argument("--kv-wire-dtype", choices=WIRE_DTYPE_NAMES, default=None,
                    help="page dtype of handed-over K/V (int8 / fp8: quantized per token; default: the prefill "
                         "replica's KV cache dtype)")
    pd.add_argument("--disagg-min-prefill-tokens", type=int, default=DisaggConfig.min_prefill_tokens,
                    help="prompt tokens the decode replica does not hold below which it prefills locally "
                         "(default %(default)s)")
    pd.add_argument("--disagg-local-cached-share", type=float, default=DisaggConfig.local_cached_share,
                    help="share of the prompt the decode replica's prefix cache must hold for it to prefill the "
                         "rest locally (default %(default)s)")


def _cluster_configs(args: argparse.Namespace) -> tuple[ClusterConfig, RoutingConfig, DisaggConfig] | None:
    """The replicas', the router's and disaggregation's configs, or None to serve one engine in this process.

    Raises:
      ValueError: a bad value, or a flag the router does not serve with.
    """
    disaggregated = args.prefill_replicas != 0 or args.decode_replicas != 0
    replicas = args.replicas if args.replicas is not None else 0 if disaggregated else 1
    cluster = ClusterConfig(num_replicas=replicas, prefill_replicas=args.prefill_replicas,
                            decode_replicas=args.decode_replicas, ray_address=args.ray_address,
                            replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                            max_restarts=args.replica_max_restarts)
    routing = RoutingConfig(args.routing, load_weight_tokens=args.routing_load_weight,
                            max_imbalance=args.routing_max_imbalance, min_match=args.routing_min_match)
    disagg = DisaggConfig(min_prefill_tokens=args.disagg_min_prefill_tokens,
                          local_cached_share=args.disagg_local_cached_share, wire_dtype=args.kv_wire_dtype)
    for role, count in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
        if getattr(args, f"{role}_config") is not None and not count:
            raise ValueError(f"--{role}-config needs --{role}-replicas >= 1")
    given = [flag for flag, value, default in (
        ("--kv-wire-dtype", args.kv_wire_dtype, None),
        ("--disagg-min-prefill-tokens", args.disagg_min_prefill_tokens, DisaggConfig.min_prefill_tokens),
        ("--disagg-local-cached-share", args.disagg_local_cached_share, DisaggConfig.local_cached_share))
        if value != default]
    if given and not args.prefill_replicas:
        raise ValueError(f"{', '.join(given)}: only for handoffs from prefill replicas; give --prefill-replicas >= 1")
    if replicas == 1 and not disaggregated and args.ray_address is None:
        return None
    if args.no_http:
        raise ValueError("--no-http: the router of --replicas serves the HTTP API only")
    if args.num_processes != 1 or args.coordinator_address is not None:
        raise ValueError("--replicas and --ray-address do not combine with a multi-host job (--num-processes)")
    return cluster, routing, disagg


def _role_configs(args: argparse.Namespace, options: dict) -> dict[str, EngineConfig]:
    """{role name: its replicas' engine options} from --prefill-config / --decode-config (over `options`).

    Raises:
      ValueError: a file that cannot be read or names an unknown option; a bad value (naming the file).
    """
    configs = {}
    for role in ("prefill", "decode"):
        path = getattr(args, f"{role}_config")
        if path is not None:
            try:
                configs[role] = EngineConfig.create(**{**options, **load_config_file(path)})
            except ValueError as e:
                raise ValueError(f"--{role}-config {path}: {e}") from None
    return configs


def _import_cluster() -> type:
    """`jaxinfer.cluster.served.ServedCluster`, importing Ray.

    Ray's C++ failure-signal handler would take this process's SIGTERM (a stack dump, then often an abort at
    exit, status -6) before `serve`'s own graceful stop: it is turned off here, in the router only (the variable is
    read when Ray is imported, and removed before Ray starts processes that would inherit it).

    Raises:
      ValueError: Ray is not installed.
    """
    previous = os.environ.get(_RAY_SIGNAL_HANDLER_OFF)
    os.environ[_RAY_SIGNAL_HANDLER_OFF] = "1"
    try:
        from jaxinfer.cluster.served import ServedCluster
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        raise ValueError("--replicas and --ray-address need Ray: pip install 'jaxinfer[cluster]'") from None
    finally:
        if previous is None:
            os.environ.pop(_RAY_SIGNAL_HANDLER_OFF, None)
        else:
            os.environ[_RAY_SIGNAL_HANDLER_OFF] = previous
    return ServedCluster


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer serve` until SIGTERM / SIGINT; returns the exit status."""
    import signal

    # Until the server installs its own handlers (after the jax/grpc imports), a stop signal exits at once, with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))  # nothing to clean up yet
    options = engine_options(args)  # before the jax import: a bad config fails at once
    check_host(args.host)
    for flag, value in (("--port", args.port), ("--http-port", args.http_port), ("--metrics-port", args.metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{flag} {value} must be in [0, 65535]")
    if args.no_grpc and args.no_http:
        raise ValueError("--no-grpc and --no-http leave nothing to serve")
    taken: dict[int, str] = {}  # a fixed port given to two of the servers (0 picks a free one for each)
    for flag, value, used in (("--port", args.port, not args.no_grpc),
                              ("--http-port", args.http_port, not args.no_http),
                              ("--metrics-port", args.metrics_port, True)):
        if used and value:
            if value in taken:
                raise ValueError(f"{taken[value]} and {flag} are both {value}: the gRPC, HTTP and metrics servers "
                                 "each need a port of their own")
            taken[value] = flag
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty (leave it out for no key)")
    api_key = args.api_key if args.api_key is not None else os.environ.get("JAXINFER_API_KEY") or None
    if api_key is not None and (not api_key.isprintable() or not api_key.isascii() or " " in api_key):
        raise ValueError("--api-key must be printable ASCII without spaces")
    if not args.grace_seconds >= 0:
        raise ValueError(f"--grace-seconds {args.grace_seconds} must be >= 0")
    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests {args.max_queued_requests} must be >= 1")
    clustered = _cluster_configs(args)
    from jaxinfer.serving.served import ServerLimits
    from jaxinfer.serving.serve import run

    config = EngineConfig.create(**options)
    role_configs = _role_configs(args, options) if clustered is not None else {}
    if config.model is not None and not os.path.exists(config.model) and args.ray_address is None:
        raise ValueError(f"--model {config.model}: no such file or folder")
    limits = ServerLimits(max_queued_requests=args.max_queued_requests)
    if clustered is not None:
        ServedCluster = _import_cluster()  # noqa: N806 - a class
        from jaxinfer.cluster.replica import ReplicaRole

        print("jaxinfer: the router serves the HTTP API only (no gRPC)", flush=True)
        cluster, routing, disagg = clustered
        served = ServedCluster(config, cluster, routing, limits=limits, model_name=args.served_model_name,
                               disagg=disagg, role_configs={ReplicaRole(k): v for k, v in role_configs.items()})
        return run(config, host=args.host, port=None, http_port=args.http_port, metrics_port=args.metrics_port,
                   grace_s=args.grace_seconds, model_name=args.served_model_name, api_key=api_key, served=served)
    if join_job(args):  # a follower serves no requests: it replays process 0's steps
        from jaxinfer.engine.engine import Engine

        Engine(config).follow_leader()
        return 0
    from jaxinfer.engine.startup import check_before_load

    check_before_load(config)  # before the port is bound and the model loads
    return run(config, host=args.host, port=None if args.no_grpc else args.port,
               http_port=None if args.no_http else args.http_port, metrics_port=args.metrics_port,
               limits=limits, grace_s=args.grace_seconds,
               model_name=args.served_model_name, api_key=api_key)
