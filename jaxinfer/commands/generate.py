"""`jaxinfer generate`: one prompt, its text streamed to stdout (or one JSON object with `--json`); or a JSONL file of
requests with `--input-file` (`jaxinfer.commands.batch`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import TYPE_CHECKING, TextIO

from jaxinfer.cli_parser import error_line
from jaxinfer.commands import batch
from jaxinfer.commands.options import add_engine_options, add_multihost_options, engine_options, given, start_llm
from jaxinfer.commands.sampling import add_sampling_options, request_error, sampling_params
from jaxinfer.engine.config import EngineConfig

if TYPE_CHECKING:
    from jaxinfer.engine.compile_time import CompileTimer
    from jaxinfer.llm import LLM
    from jaxinfer.outputs import RequestMetrics
    from jaxinfer.sampling_params import SamplingParams

EXIT_REQUEST_FAILED = 1  # the engine failed the request (finish_reason "error")


class _Once(argparse.Action):
    """A flag that may be given once: a second --prompt used to replace the first without a word."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice: one prompt a run (several: --input-file, one JSON line each)")
        setattr(namespace, self.dest, values)


def add_parser(sub) -> None:
    """Adds the `generate` subcommand to the subparsers `sub`."""
    gen = sub.add_parser("generate", help="generate text from a prompt or a JSONL file of prompts",
                         description="Generate text from one prompt (text streams to stdout), or from every line of "
                                     "a JSONL file (--input-file; one JSON line out per line in, in order).")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action=_Once, help="prompt text (a user message with --chat)")
    source.add_argument("--input-file", metavar="PATH",
                        help='JSONL, one request per line: {"prompt": TEXT} or {"messages": [...]}, optionally "id" '
                             '/ "custom_id" and SamplingParams fields (max_tokens, temperature, ...) overriding the '
                             "flags; generated as one batch (up to 32 sequences at a time unless --max-num-seqs is "
                             "given) with a progress bar on stderr")
    gen.add_argument("--output-file", metavar="PATH", default=None,
                     help="with --input-file: where the JSON lines go (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    add_sampling_options(gen, max_tokens=128)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt, prompt_token_ids, token_ids, text, finish_reason, "
                          "stop_reason, error, error_kind, ttft_s, decode_tokens_per_s, quantization, weight_bytes; "
                          "with --speculative-config also the speculative counters) instead of streaming text")
    gen.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    add_engine_options(gen, "generate")
    add_multihost_options(gen)


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer generate`; returns the exit status (1: the engine failed a request)."""
    from jaxinfer.request_limits import check_text

    if args.input_file is None and args.output_file is not None:
        raise ValueError("--output-file goes with --input-file")
    if args.input_file is not None and args.json:
        raise ValueError("--json is for --prompt; --input-file always writes JSON lines")
    if args.input_file is None and not check_text("--prompt", args.prompt):
        raise ValueError("--prompt must not be empty")
    params = sampling_params(args)  # validates before the slow load
    lines = None if args.input_file is None else batch.read_batch(args.input_file, params, args.chat)
    options = engine_options(args)  # before the jax import: a bad config fails at once
    if lines is not None and not given(args, "max_num_seqs"):  # generate's default, 1, is for one prompt
        options["max_num_seqs"] = min(len(lines), EngineConfig.max_num_seqs)
    # Process 0 writes the output (a follower of a multi-host job leaves the file alone).
    out = sys.stdout if args.output_file is None or args.process_id != 0 else _open_output(args.output_file)
    llm = start_llm(args, options)
    if llm is None:  # a follower process: process 0 writes the output
        return 0
    if lines is not None:
        try:
            return batch.run_batch(llm, lines, out)
        finally:
            if out is not sys.stdout:
                out.close()
    return _generate(args, llm, params, options)


def _open_output(path: str) -> TextIO:
    """--output-file, opened (truncated) before the model loads, so that a bad path fails at once."""
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by run
    except OSError as e:
        raise ValueError(f"--output-file {path}: {e}") from None


def _generate(args: argparse.Namespace, llm: LLM, params: SamplingParams, options: dict) -> int:
    """--prompt: streams the text (or prints one JSON object) and logs the timing; returns the exit status."""
    from jaxinfer.engine.compile_time import CompileTimer

    spec = options["speculative_config"]

    def stream(_: int, __: list[int], delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    on_output = None if args.json else stream
    with CompileTimer() as compiles:
        try:
            if args.chat:
                outputs = llm.chat([{"role": "user", "content": args.prompt}], params, on_output=on_output,
                                   use_tqdm=False)
            else:
                outputs = llm.generate(args.prompt, params, on_output=on_output, use_tqdm=False)
        except ValueError as e:  # refused before it ran: said with the flags' names
            raise ValueError(request_error(e, unlimited_default=False)) from None
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
        m = out.metrics
        logging.getLogger("jaxinfer").info(
            "finish_reason=%s, %d tokens, TTFT %.2f s, decode %.1f tokens/s%s", completion.finish_reason,
            len(completion.token_ids), m.ttft_s, m.decode_tokens_per_s, _compile_note(compiles, m, options["warmup"]))
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


def _compile_note(compiles: CompileTimer, m: RequestMetrics, warmup: bool) -> str:
    """What the timing line adds when jax compiled while the request ran (the first run of a shape traces, lowers
    and compiles it, or loads it from the persistent cache): how much of the TTFT and of the decode it took."""
    ttft = 0.0 if m.first_token_time is None else compiles.seconds(m.arrival_time, m.first_token_time)
    decode = 0.0 if None in (m.first_token_time, m.finish_time) else compiles.seconds(m.first_token_time,
                                                                                        m.finish_time)
    if ttft + decode < 0.005:
        return ""
    hint = "" if warmup else "; --warmup compiles at start-up instead"
    return f" (first run of these shapes: XLA compiles took {ttft:.2f} s of the TTFT, {decode:.2f} s of decode{hint})"
