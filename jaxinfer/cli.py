"""The `jaxinfer` console command.

    jaxinfer generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
                      [--min-p P] [--*-penalty X] [--seed S] [--stop STR ...] [--json] [engine options]

    jaxinfer serve [--host 127.0.0.1] [--port 50051] [--metrics-port N] [--max-queued-requests N]
                   [--grace-seconds S] [engine options]

    jaxinfer convert --output DIR [--model PATH] [--dtype float32|bfloat16] [--quantization FORMAT_OR_JSON]

The engine options are the `EngineConfig` fields (`jaxinfer.engine.config`), as flags of their dashed names
(`--max-model-len N`, `--warmup` / `--no-warmup`, ...): each field's metadata gives its help text and which
subcommands take it. Generated text streams to stdout; progress (model load, compile) goes to stderr. Bad input
exits with status 2 and one line on stderr; a request the engine failed (finish_reason "error") exits with status 1
and one line on stderr giving the engine's reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket
import sys
import time

from jaxinfer.benchmarks import cli as bench_cli
from jaxinfer.cli_parser import Parser, error_line, print_error
from jaxinfer.engine.config import EngineConfig  # no jax: the flags are built before jax loads

EXIT_REQUEST_FAILED = 1  # `generate`: the engine failed the request (finish_reason "error")

# Command-line value types of the fields' annotations; fields with a normaliser take their text as typed.
_FLAG_TYPES = {"int": int, "int | None": int, "str": str, "str | None": str, "bool": bool}


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxinfer", description="LLM inference on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate text from one prompt; text streams to stdout.")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 disables (default)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 disables (default)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt_token_ids, token_ids, text, finish_reason, stop_reason, "
                          "error, timing, quantization, weight_bytes; with --speculative-config also the "
                          "speculative counters) instead of streaming text")
    gen.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    _add_engine_options(gen, "generate")
    _add_multihost_options(gen)

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
    _add_engine_options(srv, "serve")
    _add_multihost_options(srv)

    conv = sub.add_parser("convert", help="convert a GGUF file or HF folder into an orbax checkpoint folder",
                          description="Convert a GGUF file or HF folder into a jaxinfer orbax checkpoint folder "
                                      "(weights, config, tokenizer) that --model accepts and that restores "
                                      "straight onto a device mesh. Prints the folder on stdout.")
    conv.add_argument("--output", required=True, help="the checkpoint folder to create (must not exist or be empty)")
    conv.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    _add_engine_options(conv, "convert", title="model options (EngineConfig fields)")
    bench_cli.add_parser(sub)
    return parser


def _flag_name(field_name: str) -> str:
    """The command-line flag of an `EngineConfig` field: `max_model_len` -> `--max-model-len`."""
    return "--" + field_name.replace("_", "-")


def _engine_fields(command: str) -> list[dataclasses.Field]:
    """The `EngineConfig` fields that `command` takes as flags, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if command in f.metadata["flag"].commands]


def _add_engine_options(parser: argparse.ArgumentParser, command: str,
                        title: str = "engine options (EngineConfig fields; LLM takes the same keywords)") -> None:
    """Adds a flag per `EngineConfig` field that `command` takes, from the field's metadata (help, `Flag`)."""
    group = parser.add_argument_group(title)
    for field in _engine_fields(command):
        flag = field.metadata["flag"]
        default = flag.command_defaults.get(command, field.default)
        text = flag.command_help.get(command, field.metadata["help"]).replace("%", "%%")  # argparse %-formats help
        if default is not None:
            text += " (default: %(default)s)"
        names = (_flag_name(field.name), *flag.aliases)
        if field.metadata["normalize"] is not None:  # the text as typed: EngineConfig.normalize parses it
            kind = str
        elif field.type in _FLAG_TYPES:
            kind = _FLAG_TYPES[field.type]
        else:
            raise TypeError(f"EngineConfig.{field.name}: no command-line type for {field.type!r}; add it to "
                            f"jaxinfer.cli._FLAG_TYPES or give the field a normaliser")
        if kind is bool:
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                               help=text)
        else:
            group.add_argument(*names, dest=field.name, type=kind, default=default, choices=flag.choices,
                               metavar=flag.metavar, help=text)


def _add_multihost_options(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group("multi-host (one process per host; see jaxinfer.engine.multihost)")
    hosts.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0's jax.distributed coordinator (every process gives the same)")
    hosts.add_argument("--num-processes", type=int, default=1, help="processes in the job (default 1)")
    hosts.add_argument("--process-id", type=int, default=0,
                       help="this process's index; 0 takes the requests, the others follow its steps")


def _engine_options(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields the command's flags give, normalised, checked before the slow imports.

    Raises:
      ValueError: "--flag: ..." for a value its field's parser rejects (for --speculative-config and --quantization:
        JSON that does not parse or is not an object, unknown keys, bad values), or a draft model path that does not
        exist.
    """
    options = {}
    for field in _engine_fields(args.command):
        try:
            options[field.name] = EngineConfig.normalize(field.name, getattr(args, field.name))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{_flag_name(field.name)}: {e}") from None
    spec = options.get("speculative_config")
    if spec is not None and spec.method == "draft_model" and not os.path.exists(spec.model):
        raise ValueError(f"--speculative-config: draft model {spec.model}: no such file or folder")
    return options


def _join_job(args: argparse.Namespace) -> bool:
    """Joins a multi-process job when --num-processes > 1; returns True on a follower (process id > 0)."""
    if args.num_processes < 1:
        raise ValueError(f"--num-processes {args.num_processes} must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be in [0, {args.num_processes}) "
                         f"(--num-processes {args.num_processes})")
    if args.num_processes == 1 and args.coordinator_address is None:
        return False
    if args.coordinator_address is None:
        raise ValueError("--num-processes > 1 needs --coordinator-address host:port")
    from jaxinfer.engine import multihost

    # Gloo's C++ code prints connection lines to stdout: send the process's C-level stdout to stderr and keep
    # Python's stdout (generated text, --json) on the real one.
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)
    logging.getLogger("jaxinfer").info(
        "process %d of %d: joining the job at %s (waits until every process has joined)", args.process_id,
        args.num_processes, args.coordinator_address)
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    return not multihost.is_leader()


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def check_host(host: str) -> None:
    """Raises ValueError naming --host unless it is an IP address (IPv6 with or without brackets) or a host name
    this machine resolves."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(name) or name.replace(".", "").isdigit():
        raise ValueError(f"--host {host!r} is not an IP address or a host name")
    try:
        socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e}") from None


def _serve(args: argparse.Namespace) -> int:
    import signal

    # Until the server installs its own handlers (after the jax/grpc imports), a stop signal exits at once, with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))  # nothing to clean up yet
    options = _engine_options(args)  # before the jax import: a bad config fails at once
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
    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such file or folder")
    if _join_job(args):  # a follower serves no requests: it replays process 0's steps
        from jaxinfer.engine.engine import Engine

        Engine(config).follow_leader()
        return 0
    from jaxinfer.engine.startup import check_before_load

    check_before_load(config)  # before the port is bound and the model loads
    return run(config, host=args.host, port=None if args.no_grpc else args.port,
               http_port=None if args.no_http else args.http_port, metrics_port=args.metrics_port,
               limits=ServerLimits(max_queued_requests=args.max_queued_requests), grace_s=args.grace_seconds,
               model_name=args.served_model_name, api_key=api_key)


def _convert(args: argparse.Namespace) -> int:
    options = _engine_options(args)
    from jaxinfer.loading import convert

    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such file or folder")
    t0 = time.perf_counter()
    from jaxinfer.engine.auto_dtype import resolve_dtype

    # auto: the dtype an engine on this machine would run the source in, so that the checkpoint runs the same
    dtype = resolve_dtype(options["dtype"], args.model)
    out = convert(args.model, args.output, dtype=dtype, quantization=options["quantization"])
    logging.getLogger("jaxinfer").info("converted in %.1f s", time.perf_counter() - t0)
    print(out)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jaxinfer.request_limits import check_text
    from jaxinfer.sampling_params import SamplingParams  # no jax: the checks below take milliseconds

    if not check_text("--prompt", args.prompt):
        raise ValueError("--prompt must not be empty")
    options = _engine_options(args)  # before the jax import: a bad config fails at once
    spec = options["speculative_config"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=args.stop)  # validates before the slow load
    from jaxinfer.llm import LLM

    logging.getLogger("jaxinfer").info("loading model %s", args.model or "(default SmolLM2-135M-Instruct)")
    t0 = time.perf_counter()
    follower = _join_job(args)
    llm = LLM(**options)
    if follower:  # replays process 0's steps; process 0 prints the text
        llm.engine.follow_leader()
        return 0
    logging.getLogger("jaxinfer").info("model ready in %.1f s; generating (the first step compiles)",
                                       time.perf_counter() - t0)

    def stream(_: int, __: list[int], delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    on_output = None if args.json else stream
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, on_output=on_output, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, on_output=on_output, use_tqdm=False)
    out = outputs[0]
    completion = out.outputs[0]
    stats = llm.engine.stats()
    if args.json:
        result = {
            "prompt": args.prompt,
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": completion.token_ids,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,  # the --stop string that ended it, else null
            "error": completion.error,  # why the engine failed the request; null unless finish_reason is "error"
            "error_kind": completion.error_kind,  # with error: "request" (its own values) or "engine"
            "ttft_s": round(out.metrics.ttft_s, 4),
            "decode_tokens_per_s": round(out.metrics.decode_tokens_per_s, 2),
            "quantization": None if llm.engine.quantization is None else dataclasses.asdict(llm.engine.quantization),
            "weight_bytes": llm.engine.weight_bytes,
        }
        if spec is not None:  # the engine's spec_* counters and ratios (README, "Speculative decoding")
            result["speculative"] = {k.removeprefix("spec_"): v for k, v in stats.items() if k.startswith("spec_")}
        print(json.dumps(result, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        logging.getLogger("jaxinfer").info(
            "finish_reason=%s, %d tokens, TTFT %.2f s, decode %.1f tokens/s", completion.finish_reason,
            len(completion.token_ids), out.metrics.ttft_s, out.metrics.decode_tokens_per_s)
        if spec is not None:
            logging.getLogger("jaxinfer").info(
                "speculative (%s, k=%d, at most %d per step alone under max_step_tokens %d): %d of %d drafts "
                "accepted (%.0f%%), %.2f tokens per decode step", spec.method, spec.num_speculative_tokens,
                llm.engine.spec_policy.step_k(1), llm.engine.spec_policy.max_step_tokens,
                stats["spec_accepted_tokens"], stats["spec_draft_tokens"],
                100 * stats["spec_acceptance_rate"], stats["spec_tokens_per_decode_step"])
    if completion.finish_reason == "error":
        sys.stderr.write(error_line(f"the request failed: {completion.error}"))
        return EXIT_REQUEST_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxinfer` command; returns the exit status (2 for bad input, 1 for a failed request)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("jax", "absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "bench":
            return bench_cli.run(args.workload, args.options)
        parser.error(f"unknown command {args.command}")
    except ValueError as e:
        return print_error(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's exit flush quiet
        except OSError:
            pass
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
