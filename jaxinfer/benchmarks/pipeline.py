"""`jaxinfer bench pipeline`: the pipeline bubble measured, per stage, from execution events recorded by the
running program, beside the textbook (N - 1) / (M + N - 1) (GPipe, Huang et al. 2019).

A random 8-layer Llama (`pipeline_worker.MODEL`) runs `models.pipeline.pipeline_forward` over pp = 2 and 4 stages
(fake CPU devices) at M = 1, 2, 4 and 8 micro-batches, for two steps of the same T rows: `uniform` (T decodes) and
`uneven` (a T/2-token prefill chunk of a new sequence, then T/2 decodes: micro-batches of prefill rows beside
micro-batches of decode rows). Each stage stamps the start and end of its work on each micro-batch
(`models.pipeline_events`); a stage's idle share is 1 - its busy time / the span from the first start to the last
end over all stages. Reported: medians over `--reps` steps, and the step's wall time (with the embedding, LM head
and dispatch). The fake devices must exist before jax starts, so the measuring runs in a child process
(`jaxinfer.benchmarks.pipeline_worker`); this process only reports.

Expectation, written before measuring: for uniform micro-batches the idle share tracks (N - 1) / (M + N - 1);
uneven ones idle more (a stage waits for the slowest micro-batch of its neighbour). Caveat of this machine: the
"devices" share its CPU cores, so stages that work at once slow each other, which lengthens busy intervals in the
steady state (less idle than on separate chips).

    .venv/bin/jaxinfer bench pipeline --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jaxinfer.benchmarks.peers import run_worker
from jaxinfer.benchmarks.report import Report, int_list, machine_line, table

logger = logging.getLogger(__name__)

SECTION = ("<!-- pipeline-bubble: begin -->", "<!-- pipeline-bubble: end -->")
FAKE_DEVICES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline workload's options: stage counts, micro-batch counts, rows, context, reps."""
    parser.add_argument("--pps", default="2,4", help=f"stage counts (2 to {FAKE_DEVICES})")
    parser.add_argument("--micro", default="1,2,4,8", help="micro-batch counts M")
    parser.add_argument("--rows", type=int, default=128, help="token rows per step (a power of two)")
    parser.add_argument("--context", type=int, default=128, help="context of every decode, in tokens")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per row (medians)")
    parser.add_argument("--hidden", type=int, default=512, help="the random model's hidden size (MLP 3x)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds before the measuring child is given up")


def _excess(rows: list[dict], pp: int, kind: str) -> float:
    """Mean over stages and M of measured - textbook idle share, for one pp and step kind."""
    diffs = [x - r["textbook"] for r in rows if r["pp"] == pp and r["kind"] == kind for x in r["idle"]]
    return sum(diffs) / len(diffs)


def render(result: dict, args: argparse.Namespace, elapsed: float) -> str:
    """The section: per (pp, step kind, M) the measured idle share of each stage beside the textbook one."""
    model, cost, rows = result["model"], result["overhead"], result["rows"]

    def spread(r: dict) -> str:
        ms = [(b - a) / 1e6 for _, _, a, b in r["intervals"]]
        return f"{min(ms):.0f}-{max(ms):.0f}"

    cells = [[str(r["pp"]), r["kind"], f"{r['micro']}" + (f" ({r['micro_used']})" if r["micro_used"] != r["micro"]
                                                          else ""),
              f"{r['textbook']:.2f}", " / ".join(f"{x:.2f}" for x in r["idle"]),
              f"{sum(r['busy_ms']) / len(r['busy_ms']) / r['micro_used']:.1f}", spread(r), f"{r['span_ms']:.0f}",
              f"{r['step_ms']:.0f}"] for r in rows]
    excess = "; ".join(f"pp={pp}: {_excess(rows, pp, 'uniform'):+.2f} uniform, {_excess(rows, pp, 'uneven'):+.2f} "
                       "uneven" for pp in sorted({r["pp"] for r in rows}))
    return "\n".join([
        "### Bubble accounting (measured)\n",
        f"`jaxinfer bench pipeline`: a random {model['num_layers']}-layer Llama (hidden {model['hidden_size']}, MLP "
        f"{model['intermediate_size']}, f32) through `pipeline_forward` on fake CPU devices, {args.rows} token rows "
        f"a step: `uniform` = {args.rows} decodes at {args.context} tokens of context; `uneven` = a "
        f"{args.rows // 2}-token prefill chunk, then {args.rows // 2} decodes. Each stage stamps the start and end "
        "of its work on each micro-batch from inside the running program (host callbacks, `models.pipeline_events`);"
        " idle = 1 - busy / span, the span running from the first start to the last end over all stages. Medians of "
        f"{args.reps} steps (the min-max column: every stage's micro-batches in the last step). Recording costs: "
        f"{cost['without_ms']:.0f} ms a step without, {cost['with_events_ms']:.0f} ms with (pp={cost['pp']}, "
        f"M={cost['micro']}, uniform).\n",
        "Expectation, written before measuring: uniform micro-batches idle (N - 1) / (M + N - 1); uneven ones more "
        "(a stage waits for its neighbour's slowest micro-batch).\n",
        "```", args.command, "```\n",
        f"- date: {args.date}; run time {elapsed:.0f} s; {machine_line()}; load average {os.getloadavg()[0]:.1f} at "
        f"the end; the {result['devices']} fake devices share the cores: stages busy at once slow each other\n",
        table(["pp", "step", "M (used)", "textbook idle", "measured idle per stage", "ms / micro-batch / stage",
               "micro-batch ms min-max", "span ms", "step ms"], cells), "",
        f"Measured minus textbook idle share, mean over stages and M: {excess}.\n",
        "Reading the columns: (1) a micro-batch does not cost 1/M of the step (ms / micro-batch / stage falls "
        "much more slowly than 1/M): every micro-batch reads its stage's weights again (what a decode step is bound "
        "by) and every tick pays its `lax.cond`, `ppermute` and slicing, while its attention runs over its own "
        "sequences only (`microbatch_metadata`: at most its rows + 1); so on one CPU the step time grows with M, and "
        "more micro-batches pay only where stages run on separate chips. (2) The fake devices share the cores, so a "
        "stage alone in a fill tick runs "
        "its micro-batch faster than in the steady state beside the others (the min-max column): the bubble is "
        "measured in stretched time, and on separate chips it would be the tick count's share, the textbook one.\n",
    ])


def run(args: argparse.Namespace) -> Report:
    """Measures every (pp, step kind, M) in one child with `FAKE_DEVICES` fake CPU devices; the report.

    `Report.data`: rows (pp, kind, micro, micro_used, rows, step_ms, span_ms, idle [per stage], busy_ms [per stage],
    textbook, intervals [stage, micro-batch, start ns, end ns] of the last step), overhead (without_ms,
    with_events_ms), model, devices.

    Raises:
      ValueError: a bad option. RuntimeError: the measuring child failed.
    """
    pps = int_list("--pps", args.pps, 2, FAKE_DEVICES)
    int_list("--micro", args.micro, 1, 1 << 12)
    if args.rows < 2 or args.rows & (args.rows - 1):
        raise ValueError(f"--rows {args.rows} must be a power of two >= 2")
    for option, value in (("--context", args.context), ("--reps", args.reps), ("--timeout", args.timeout)):
        if value < 1:
            raise ValueError(f"{option} {value} must be >= 1")
    if args.hidden < 64 or args.hidden % 64:
        raise ValueError(f"--hidden {args.hidden} must be a positive multiple of 64")
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={FAKE_DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxinfer.benchmarks.pipeline_worker", "--pps", ",".join(map(str, pps)),
           "--micro", args.micro, "--rows", str(args.rows), "--context", str(args.context), "--reps", str(args.reps),
           "--hidden", str(args.hidden)]
    t0 = time.perf_counter()
    result = run_worker(cmd, "the pipeline worker", args.timeout, env)
    for r in result["rows"]:
        logger.info("%s", r)
    return Report("pipeline", render(result, args, time.perf_counter() - t0), result)
