"""Interleaved A/B of the decode step between environment settings: one engine of a `jaxinfer bench quant` format
per setting, each built and compiled under its variables (e.g. `JAXINFER_NATIVE_ISA=avx2`), then rounds in which
every engine runs one untimed step and `--steps` timed ones under its variables, so the shared VM's slow spells
hit all alike. Prints the median over rounds of each round's median step (`ModelRunner.execute`: device step,
sampling, host), and the best round.

    F="int4 g32 w4a8, embedding + LM head int8 (llama.cpp Q4_0's layout and arithmetic)"
    .venv/bin/python scripts/ab_step.py "$F" 30 JAXINFER_NATIVE_ISA=avx2 JAXINFER_NATIVE_ISA=avx512_vnni

A setting is VAR=VALUE[,VAR=VALUE...]; an empty string ("") is the environment as it is. Variables read once per
process (`JAXINFER_NATIVE_THREADS`: the kernels' thread pool) cannot differ between settings: compare those in
separate runs. `--chained` times the steps chained as the engine's decode loop runs them (async scheduling:
`decode_timing.ChainedSteps`, a round's mean call) instead of one `execute` at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

from jaxinfer.benchmarks.decode_timing import ChainedSteps, timed_calls
from jaxinfer.benchmarks.quant import FORMATS, decode_step
from pallas_kernels.cpu_features import check_environment

ONCE_PER_PROCESS = "JAXINFER_NATIVE_THREADS"


@contextlib.contextmanager
def variables(setting: str) -> Iterator[None]:
    """The setting's variables set inside the block, the earlier values put back after it."""
    pairs = dict(p.split("=", 1) for p in setting.split(",") if p)
    saved = {k: os.environ.get(k) for k in pairs}
    os.environ.update(pairs)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=list(FORMATS))
    parser.add_argument("rounds", type=int)
    parser.add_argument("settings", nargs="+", help="VAR=VALUE[,VAR=VALUE...] per engine")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="timed steps an engine a round")
    parser.add_argument("--chained", action="store_true", help="steps chained as the engine's decode loop runs them")
    args = parser.parse_args()
    if any(p and "=" not in p for s in args.settings for p in s.split(",")):
        parser.error("each setting is VAR=VALUE[,VAR=VALUE...]")
    if any(p.startswith(ONCE_PER_PROCESS + "=") for s in args.settings for p in s.split(",")):
        parser.error(f"{ONCE_PER_PROCESS} is read once per process: compare thread counts in separate runs")
    if min(args.rounds, args.steps, args.batch) < 1:
        parser.error("rounds, --steps and --batch must be >= 1")
    for setting in args.settings:
        with variables(setting):
            try:
                check_environment()
            except ValueError as e:
                parser.error(f"setting {setting!r}: {e}")
    steps = []
    for setting in args.settings:
        with variables(setting):
            engine, step = decode_step(args.format, args.batch)
            if args.chained:
                step = ChainedSteps(engine.runner, *step.args)
            step()  # compiles under the setting's variables
            if args.chained:
                step.flush()
        steps.append(step)
    medians: list[list[float]] = [[] for _ in steps]
    for _ in range(args.rounds):
        for i, step in enumerate(steps):
            with variables(args.settings[i]):
                step()
                if args.chained:  # the first call only dispatched: read that step untimed, as `bench quant` does
                    step()
                    medians[i].append(1e3 * timed_calls(step, args.steps)[0])  # a round's mean call
                    continue
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
            medians[i].append(1e3 * statistics.median(times))
    for setting, ms in zip(args.settings, medians):
        print(f"{setting or '(as is)':48s} step {statistics.median(ms):.2f} ms (best round {min(ms):.2f})")


if __name__ == "__main__":
    main()
