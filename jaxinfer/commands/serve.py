"""`jaxinfer serve`: the OpenAI HTTP API and gRPC over one engine."""

from __future__ import annotations

import argparse
import os

from jaxinfer.commands.options import (add_engine_options, add_multihost_options, check_host, engine_options,
                                       join_job)
from jaxinfer.engine.config import EngineConfig



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
    from jaxinfer.serving.served import ServerLimits
    from jaxinfer.serving.serve import run

    config = EngineConfig.create(**options)
    if config.model is not None and not os.path.exists(config.model):
        raise ValueError(f"--model {config.model}: no such file or folder")
    if join_job(args):  # a follower serves no requests: it replays process 0's steps
        from jaxinfer.engine.engine import Engine

        Engine(config).follow_leader()
        return 0
    from jaxinfer.engine.startup import check_before_load

    check_before_load(config)  # before the port is bound and the model loads
    return run(config, host=args.host, port=None if args.no_grpc else args.port,
               http_port=None if args.no_http else args.http_port, metrics_port=args.metrics_port,
               limits=ServerLimits(max_queued_requests=args.max_queued_requests), grace_s=args.grace_seconds,
               model_name=args.served_model_name, api_key=api_key)
