"""What `jaxinfer tune` reports: the table of runs (markdown), the throughput-vs-latency plot with its Pareto
front (PNG, matplotlib), and the BENCHMARKS.md section that holds both."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfer.benchmarks.report import table
from jaxinfer.engine.config_file import json_value
from jaxinfer.tune.drive import Targets
from jaxinfer.tune.sweep import Trial, pareto_front

SECTION = ("<!-- tune: begin -->", "<!-- tune: end -->")
SHORT = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "batched tokens", "page_size": "page",
         "kv_cache_dtype": "KV dtype", "quantization": "quantization", "speculative_config": "speculative",
         "tensor_parallel_size": "TP"}
COMPLETE = ("meets", "misses")  # statuses of complete runs, which have a place on the plot


def show_value(knob: str, value: Any) -> str:
    """A knob's value for the table: "none" for off, "ngram k=4" for a speculative config, a format (with
    " w8a8" when activations are quantized too), else compact JSON or the value."""
    if value is None:
        return "none"
    value = json_value(value)  # a normalised SpeculativeConfig / QuantizationConfig: its non-default fields
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json.loads(value)
    if isinstance(value, dict) and knob == "speculative_config":
        return f"{value.get('method', 'ngram')} k={value.get('num_speculative_tokens', '?')}"
    if isinstance(value, dict) and knob == "quantization" and set(value) <= {"format", "quantize_activations"}:
        return str(value.get("format")) + (" w8a8" if value.get("quantize_activations") else "")
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def varied_knobs(trials: Sequence[Trial]) -> list[str]:
    """The knobs whose value differs between trials, in the trials' knob order."""
    names = list(trials[0].knobs) if trials else []
    return [n for n in names if len({show_value(n, t.knobs.get(n)) for t in trials}) > 1]


def _num(x: float | None, digits: int, scale: float = 1.0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{digits}f}"


def trials_table(trials: Sequence[Trial], best: Trial | None) -> str:
    """The markdown table: one row per trial, the varied knobs, status, throughput, latencies, and (for real
    runs) start-up seconds with the warm-up's shapes read from the compilation cache / compiled, warm pass and run
    seconds, and the step shapes first met in the run."""
    knobs = varied_knobs(trials)
    timed = any(t.timing for t in trials)
    header = ["#", *[SHORT[k] for k in knobs], "status", "output tok/s", "TTFT p50 / p99 s", "TPOT p50 / p99 ms"]
    if timed:
        header += ["start-up s", "cached / compiled", "warm s", "run s", "new shapes"]
    rows = []
    for i, t in enumerate(trials, 1):
        m, tm = t.metrics, t.timing
        status = "**best**" if t is best else t.status
        row = [f"{i}{' (default)' if t.is_default else ''}", *[show_value(k, t.knobs.get(k)) for k in knobs],
               status, _num(m.get("output_tok_s"), 1),
               f"{_num(m.get('ttft_p50_s'), 2)} / {_num(m.get('ttft_p99_s'), 2)}",
               f"{_num(m.get('tpot_p50_s'), 1, 1e3)} / {_num(m.get('tpot_p99_s'), 1, 1e3)}"]
        if timed:
            cache = f"{tm['cache_hits']} / {tm['cache_misses']}" if "cache_hits" in tm else "-"
            row += [_num(tm.get("startup_s"), 1), cache, _num(tm.get("warm_s"), 1), _num(tm.get("run_s"), 1),
                    str(tm.get("new_shapes", "-"))]
        rows.append(row)
    notes = [f"{i} {t.status}: {t.reason}" for i, t in enumerate(trials, 1) if t.reason]
    if any(t.status in ("pruned", "stopped") for t in trials):
        notes.append("pruned and stopped rows give the figures of the requests done when the run stopped")
    return table(header, rows) + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")


def require_matplotlib() -> None:
    """Raises ValueError, saying how to install it, when matplotlib (the plot's) is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the tune plot needs matplotlib, a dependency of jaxinfer: reinstall it (scripts/setup_env.sh), or pass --no-plot") from None


def plot(trials: Sequence[Trial], targets: Targets, path: str | os.PathLike, best: Trial | None = None,
         title: str = "") -> Path:
    """Writes the PNG: output tokens/s against p99 TTFT (left) and p99 TPOT (right) for every complete run,
    the Pareto front of each panel as a line, the targets as dashed lines, the default (a star) and `best` (a
    ring) marked.

    Raises:
      ValueError: matplotlib is not installed.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [(i, t) for i, t in enumerate(trials, 1) if t.status in COMPLETE]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, target, label, scale in ((axes[0], "ttft_p99_s", targets.ttft_p99_s, "p99 TTFT (s)", 1.0),
                                          (axes[1], "tpot_p99_s", targets.tpot_p99_s, "p99 TPOT (ms)", 1e3)):
        pts = [(t.metrics[key] * scale, t.metrics["output_tok_s"]) for _, t in done]
        for (i, t), (x, y) in zip(done, pts):
            ax.scatter(x, y, s=160 if t.status == "meets" else 60, marker="*" if t.is_default else "o",
                       c="tab:green" if t.status == "meets" else "tab:red", edgecolors="k", zorder=3)
            ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
            if t is best:
                ax.scatter(x, y, s=420, facecolors="none", edgecolors="tab:blue", linewidths=2, zorder=4,
                           label="best")
        front = pareto_front(pts)
        if front:
            ax.plot([pts[j][0] for j in front], [pts[j][1] for j in front], "-", c="tab:blue", zorder=2,
                    label="Pareto front")
        if target is not None:
            ax.axvline(target * scale, ls="--", c="gray", label="target")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.margins(0.1)
    axes[0].set_ylabel("output tokens/s")
    labels = {}
    for ax in axes:  # one legend for both panels, below them, covering no point
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    if labels:
        fig.legend(list(labels.values()), list(labels), loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title or "jaxinfer tune: green meets every target, red misses one; * the default, ring the best; "
                          "numbers: the table's rows", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def section(trials: Sequence[Trial], best: Trial | None, *, command: str, date: str, machine_line: str,
            profile: str, targets: Targets, plan_note: str, png: str | None, config_path: str | None,
            note: str = "") -> str:
    """The BENCHMARKS.md section body (markers added by `write_section`): what ran, the table, the plot, the
    best configuration."""
    tg = [f"p99 TTFT <= {targets.ttft_p99_s:g} s" if targets.ttft_p99_s is not None else "",
          f"p99 TPOT <= {targets.tpot_p99_s * 1e3:g} ms" if targets.tpot_p99_s is not None else ""]
    lines = ["## Tuning: `jaxinfer tune`", "", f"    {command}", "",
             f"{date}; {machine_line}." + (f" {note}" if note else ""), "",
             f"Traffic: {profile}. Targets: {', '.join(t for t in tg if t) or 'none (most tokens/s)'}. {plan_note}",
             "", trials_table(trials, best), ""]
    if png:
        lines += [f"![throughput vs p99 latency]({png})", ""]
    if best is not None:
        knobs = ", ".join(f"{k}={show_value(k, v)}" for k, v in best.knobs.items()) or "the base configuration"
        where = f", written to `{config_path}`" if config_path else ""
        lines.append(f"Best: {knobs}{where} (`jaxinfer serve --config FILE`, `LLM(config=FILE)`).")
    else:
        lines.append("No configuration met every target.")
    return "\n".join(lines)
