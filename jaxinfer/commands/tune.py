"""`jaxinfer tune`: sweeps engine options for a traffic profile within a budget of runs, prunes configurations that
miss the latency targets, reports the table and the throughput-vs-latency plot, and writes the best configuration
as a config file (`jaxinfer serve --config FILE`, `LLM(config=FILE)`).

    jaxinfer tune --profile traffic.jsonl --ttft-p99-s 2 --tpot-p99-s 0.1 --budget 8 \\
        --max-num-seqs 8,16,32 --max-num-batched-tokens 128,512 --quantization none,int8

Each knob flag takes a comma-separated list (or, for --quantization / --speculative-config, a JSON object; repeat the
flag for more); a knob given one value, or none, keeps it in every run. The base options are those, the other engine
flags and --config; the default configuration (run first) is the base.
Runs happen one after another in this process, each on a fresh engine (`jaxinfer.tune.engine_run`), and share
JAX's persistent compilation cache. Writes into --out: tune.md (the section), tune.png, trials.json and best.json.
Exit status 0 with a best configuration, 1 when none met the targets, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path

from jaxinfer.commands.options import add_engine_options, engine_options, flag_name
from jaxinfer.engine.config import EngineConfig
from jaxinfer.tune.sweep import KNOBS, parse_knob_values

logger = logging.getLogger("jaxinfer.tune")
_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def add_parser(sub) -> None:
    """Adds the `tune` subcommand to the subparsers `sub`."""
    tune = sub.add_parser("tune", help="sweep engine options for a traffic profile; write the best as a config file",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("--profile", required=True, metavar="FILE",
                      help="the traffic: a JSONL of requests ({prompt or prompt_len, max_tokens or output_len, "
                           "arrival_s?} per line) or a JSON object of length histograms ({input_lens: [[len, "
                           "weight], ...], output_lens, rate_per_s, num_requests, seed}); see jaxinfer.tune.profile")
    tune.add_argument("--rate-per-s", type=float, default=None,
                      help="Poisson arrival rate for JSONL requests without arrival_s, or instead of the "
                           "histograms' (default: all at once / the profile's)")
    tune.add_argument("--ttft-p99-s", type=float, default=None, help="target: p99 time to first token, seconds")
    tune.add_argument("--tpot-p99-s", type=float, default=None, help="target: p99 time per output token, seconds")
    tune.add_argument("--budget", type=int, default=8, help="most configurations to run, the default included "
                                                            "(default 8; a larger grid is sampled, seeded)")
    tune.add_argument("--seed", type=int, default=0, help="seeds the sample of the grid and JSONL arrivals")
    tune.add_argument("--max-run-s", type=float, default=300.0,
                      help="a run's time limit in seconds (default 300); a run past it is 'stopped'")
    tune.add_argument("--warm-pass", choices=("short", "replay", "none"), default="short",
                      help="the untimed pass before each timed run: short (default: all requests at once, 2 output "
                           "tokens each: compiles the multi-chunk prefill shapes warm-up leaves out), replay (the "
                           "whole profile once: with --no-warmup, compiles only the shapes this traffic meets), "
                           "none")
    tune.add_argument("--out", type=Path, default=Path("tune-out"),
                      help="folder for tune.md, tune.png, trials.json and best.json (default ./tune-out)")
    tune.add_argument("--write", type=Path, default=None,
                      help="also splice the section into this markdown file (e.g. BENCHMARKS.md)")
    tune.add_argument("--note", default="", help="a sentence for the section (e.g. how busy the machine was)")
    tune.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    tune.add_argument("--verbose", "-v", action="store_true", help="debug logging on stderr")
    knobs = tune.add_argument_group("knobs to sweep (values to try; a knob left out keeps its base value)")
    for knob in KNOBS:
        flag = _FIELDS[knob].metadata["flag"]
        knobs.add_argument(flag_name(knob), *flag.aliases, dest=knob, action="append", default=None,
                           metavar="V[,V...]", help=f"EngineConfig.{knob} values to try"
                           + (' ("none": off; a JSON object whole)' if knob in ("quantization", "speculative_config")
                              else ""))
    add_engine_options(tune, "tune", title="base engine options (every run; EngineConfig fields)", exclude=KNOBS)


def _space(args: argparse.Namespace, base: dict) -> dict:
    """{knob: values to try} of the knob flags given with several values; a knob given one value is fixed: it goes
    into `base` (normalised), so the default configuration has it too."""
    space = {}
    for knob in KNOBS:
        if getattr(args, knob):
            values = parse_knob_values(knob, getattr(args, knob), flag_name(knob))
            if len(values) == 1:
                base[knob] = EngineConfig.normalize(knob, values[0])
            else:
                space[knob] = values
    return space


def _check_args(args: argparse.Namespace) -> None:
    if args.budget < 1:
        raise ValueError(f"--budget {args.budget} must be >= 1")
    if not args.max_run_s > 0:
        raise ValueError(f"--max-run-s {args.max_run_s} must be > 0")
    if args.rate_per_s is not None and not args.rate_per_s > 0:
        raise ValueError(f"--rate-per-s {args.rate_per_s} must be > 0")
    for flag, value in (("--ttft-p99-s", args.ttft_p99_s), ("--tpot-p99-s", args.tpot_p99_s)):
        if value is not None and not 0 < value < math.inf:  # `Targets`' rule, in the command line's words
            raise ValueError(f"{flag} {value:g} must be a number of seconds > 0 (leave it out for no target)")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a folder")
    if args.write is not None and args.write.is_dir():
        raise ValueError(f"--write {args.write} is a folder; give a markdown file")


# Options that shape how tune's own runs start, not the engine to serve: never written into best.json.
RUN_ONLY = ("warmup",)


def best_config_options(base: dict, knobs: dict) -> dict:
    """The options of the best configuration's file: the base options that differ from the engine's defaults
    (but `RUN_ONLY`'s), then every swept knob's value."""
    out = {name: value for name, value in base.items()
           if name not in knobs and name not in RUN_ONLY and value != _FIELDS[name].default}
    return {**out, **knobs}


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer tune`; returns the exit status (1: no configuration met the targets)."""
    _check_args(args)
    base = engine_options(args, exclude=KNOBS)
    space = _space(args, base)
    from jaxinfer.tune.drive import Targets
    from jaxinfer.tune.profile import load_profile

    targets = Targets(args.ttft_p99_s, args.tpot_p99_s)
    profile = load_profile(args.profile, args.rate_per_s, args.seed)
    from jaxinfer.tune import report
    from jaxinfer.tune.engine_run import check_profile_fits

    check_profile_fits(profile, base.get("model"), base.get("max_model_len"))  # before any slow run

    if not args.no_plot:
        report.require_matplotlib()  # before the runs, not after them
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    from jaxinfer.benchmarks.report import machine_line, write_section
    from jaxinfer.engine.config_file import json_value, write_config_file
    from jaxinfer.tune.engine_run import EngineRunner
    from jaxinfer.tune.sweep import best, plan, sweep

    candidates, skipped, size = plan(space, base, args.budget, args.seed, jax.device_count())
    for knobs, reason in skipped:
        logger.info("skipped %s: %s", knobs, reason)
    plan_note = (f"{len(candidates)} of {size} configurations ran (budget {args.budget}"
                 f"{', seeded sample' if size > len(candidates) else ''}; {len(skipped)} refused).")
    logger.info("%s %s", profile.description, plan_note)

    def progress(i: int, t) -> None:
        m = t.metrics
        logger.info("[%d/%d] %s: %s%s", i + 1, len(candidates), t.knobs, t.status,
                    f", {m['output_tok_s']:.1f} tok/s, p99 TTFT {m['ttft_p99_s']:.2f} s, p99 TPOT "
                    f"{m['tpot_p99_s'] * 1e3:.1f} ms" if m else f": {t.reason}")

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    trials = sweep(EngineRunner(warm_pass=args.warm_pass), profile, base, candidates, targets,
                   args.max_run_s, progress)
    elapsed = time.perf_counter() - t0
    winner = best(trials)
    out = args.out
    (out / "trials.json").write_text(json.dumps(
        [{"knobs": {k: json_value(v) for k, v in t.knobs.items()}, "default": t.is_default, "status": t.status,
          "reason": t.reason, "metrics": t.metrics, "timing": t.timing} for t in trials], indent=1, default=str))
    png = None if args.no_plot else report.plot(trials, targets, out / "tune.png", winner)
    config_path = None
    command = shlex.join(["jaxinfer", "tune", *sys.argv[2:]]) if sys.argv[1:2] == ["tune"] else "jaxinfer tune"
    if winner is not None:
        notes = {"tuned": {"command": command, "profile": profile.description, "targets": vars(targets),
                           "metrics": winner.metrics}}
        config_path = write_config_file(out / "best.json", best_config_options(base, winner.knobs), notes)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    note = (f"Load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after; {elapsed:.0f} s in all."
            + (f" {args.note}" if args.note else ""))

    def body(folder: Path) -> str:
        rel = (lambda p: None if p is None else os.path.relpath(p, folder))
        return report.section(trials, winner, command=command, date=date, machine_line=machine_line(),
                              profile=profile.description, targets=targets, plan_note=plan_note, png=rel(png),
                              config_path=rel(config_path), note=note)

    (out / "tune.md").write_text(body(out) + "\n")
    if args.write is not None:
        write_section(args.write, body(args.write.parent.resolve()), report.SECTION)
        logger.info("wrote %s", args.write)
    sys.stdout.write(body(out) + "\n")
    if winner is None:
        logger.warning("no configuration met the targets; nothing written to %s", out / "best.json")
        return 1
    logger.info("best configuration: %s (jaxinfer serve --config %s)", config_path, config_path)
    return 0
