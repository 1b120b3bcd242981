"""`jaxinfer generate`: one prompt, its text streamed to stdout (or one JSON object with `--json`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from jaxinfer.cli_parser import error_line
from jaxinfer.commands.options import add_engine_options, add_multihost_options, engine_options, join_job

EXIT_REQUEST_FAILED = 1  # the engine failed the request (finish_reason "error")


def add_parser(sub) -> None:
    """Adds the `generate` subcommand to the subparsers `sub`."""
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
    add_engine_options(gen, "generate")
    add_multihost_options(gen)


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer generate`; returns the exit status (1: the engine failed the request)."""
    from jaxinfer.request_limits import check_text
    from jaxinfer.sampling_params import SamplingParams  # no jax: the checks below take milliseconds

    if not check_text("--prompt", args.prompt):
        raise ValueError("--prompt must not be empty")
    options = engine_options(args)  # before the jax import: a bad config fails at once
    spec = options["speculative_config"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=args.stop)  # validates before the slow load
    from jaxinfer.llm import LLM

    logging.getLogger("jaxinfer").info("loading model %s", args.model or "(default SmolLM2-135M-Instruct)")
    t0 = time.perf_counter()
    follower = join_job(args)
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
