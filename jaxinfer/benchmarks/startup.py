"""Start-up workload: cold and warm starts of `jaxinfer generate` and `jaxinfer serve`, each a fresh process.

Each row runs the command as a child process and times, from the moment it is started:

* `generate`: the first byte of generated text on its stdout (process start to first token: imports, model
  load, KV cache, compiles, prefill);
* `serve`: the first `GET /health` that answers 200 (SERVING), then the first token of one streamed
  `/v1/completions` request sent right after (what a background warm-up costs the first request), and the
  warm-up's own log line (shapes, seconds, how many the compilation cache held; a warm start's ends after
  SERVING).

"cold" gives the child empty cache folders (XLA compilation cache, prepared-model cache); "warm" runs again on the
folders the cold run filled (`--reps` times; the median is reported). Peak RSS is the child's `ru_maxrss`
(`os.wait4`). A third `generate` row runs with `--max-num-seqs 32`, whose KV cache is capped at a share of host
memory as every start's was before the KV cache was sized to the work. About 4 minutes for SmolLM2 on 2 cores:

    .venv/bin/jaxinfer bench startup --write BENCHMARKS.md

`--warm-from DIR` skips the cold starts and times warm starts on the caches in DIR (e.g. `~/.cache/jaxinfer`, after
a start of the same configuration filled it); `--rows` picks rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jaxinfer.benchmarks.report import Report, machine_line, table
from jaxinfer.cache_dirs import COMPILATION_CACHE_VARIABLE, MODEL_CACHE_VARIABLE

SECTION = ("<!-- startup: begin -->", "<!-- startup: end -->")
PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The start-up workload's options."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=3, help="warm starts per row (the median is reported)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take before it fails")
    parser.add_argument("--rows", default=None, metavar="NAME[,NAME]",
                        help=f"run only these rows (of {', '.join(repr(r[0]) for r in ROWS)}; default all)")
    parser.add_argument("--warm-from", default=None, metavar="DIR",
                        help="skip the cold starts: warm starts on the caches in DIR/xla and DIR/models (e.g. "
                             "~/.cache/jaxinfer after a first start; a minute instead of ten on a quiet machine)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype] + ([] if args.model is None else ["--model", args.model])


def _wait(proc: subprocess.Popen) -> int:
    """Reaps the child; returns its peak RSS in bytes (Linux reports KiB)."""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_maxrss * 1024


def _generate(args: argparse.Namespace, env: dict, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", PROMPT, "--max-tokens", "4",
           "--temperature", "0", *_model_flags(args), *extra]
    log = tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - t0
    proc.stdout.read()
    rss = _wait(proc)
    if not first:
        log.seek(0)
        raise RuntimeError(f"{' '.join(cmd)} printed nothing; its stderr ends:\n{log.read()[-2000:]}")
    return {"first_token_s": ttft, "peak_rss_bytes": rss}


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def _serve(args: argparse.Namespace, env: dict, extra: list[str]) -> dict:
    http = _free_port()
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--http-port", str(http), "--port", str(_free_port()),
           *_model_flags(args), *extra]
    log = tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        while _get(f"http://127.0.0.1:{http}/health") != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > args.timeout:
                raise RuntimeError(f"{' '.join(cmd)} did not reach SERVING")
            time.sleep(0.05)
        serving = time.perf_counter() - t0
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        t1 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            r.readline()  # the first event: the first token
            first = time.perf_counter() - t1
            r.read()
        while (warmup := _warmup_line(log)) is None:  # a background warm-up ends after SERVING
            if proc.poll() is not None or time.perf_counter() - t0 > args.timeout:
                raise RuntimeError(f"{' '.join(cmd)} logged no end of its warm-up")
            time.sleep(0.2)
    finally:
        proc.terminate()
    return {"serving_s": serving, "first_token_after_serving_s": first, "peak_rss_bytes": _wait(proc), **warmup}


_WARMUP = re.compile(r"compiled (\d+) step shapes in ([\d.]+) s(?: in the background| on \d+ threads) \((\d+) loaded")


def _warmup_line(log) -> dict | None:
    """The warm-up's end from the server's log: shapes, seconds, how many the compilation cache held."""
    log.seek(0)
    match = _WARMUP.search(log.read())
    if match is None:
        return None
    return {"warmup_shapes": int(match[1]), "warmup_s": float(match[2]), "warmup_cache_hits": int(match[3])}


ROWS = [("generate", _generate, []), ("generate --max-num-seqs 32", _generate, ["--max-num-seqs", "32"]),
        ("serve --warmup", _serve, [])]


def run(args: argparse.Namespace) -> Report:
    """Runs every row cold once and warm `--reps` times (module docstring)."""
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps} must be >= 1")
    names = [r[0] for r in ROWS] if args.rows is None else [n.strip() for n in args.rows.split(",")]
    unknown = [n for n in names if n not in {r[0] for r in ROWS}]
    if unknown or not names:
        raise ValueError(f"--rows {args.rows!r}: the rows are {', '.join(repr(r[0]) for r in ROWS)}")
    warm_from = None if args.warm_from is None else Path(args.warm_from).expanduser()
    if warm_from is not None and not (warm_from / "xla").is_dir():
        raise ValueError(f"--warm-from {args.warm_from}: no xla/ folder of compiled shapes there (start once first)")
    results = {}
    for name, fn, extra in (r for r in ROWS if r[0] in names):
        with tempfile.TemporaryDirectory(prefix="jaxinfer-startup-") as tmp:
            caches = Path(tmp) if warm_from is None else warm_from
            env = {**os.environ, COMPILATION_CACHE_VARIABLE: str(caches / "xla"),
                   MODEL_CACHE_VARIABLE: str(caches / "models")}
            cold = None if warm_from is not None else fn(args, env, extra)
            warm = [fn(args, env, extra) for _ in range(args.reps)]
        results[name] = {"cold": cold, "warm": {k: statistics.median(w[k] for w in warm) for k in warm[0]}}
    return Report("startup", _markdown(args, results), {"rows": results})


def _cells(r: dict | None) -> list[str]:
    if r is None:
        return ["not run (--warm-from)", ""]
    if "serving_s" in r:
        return [f"{r['serving_s']:.1f} s to SERVING, first token {r['first_token_after_serving_s']:.2f} s later; "
                f"warm-up: {r['warmup_shapes']:g} shapes in {r['warmup_s']:.1f} s, {r['warmup_cache_hits']:g} from the "
                "cache",
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"]
    return [f"{r['first_token_s']:.1f} s to the first token", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"]


def _markdown(args: argparse.Namespace, results: dict) -> str:
    rows = [[f"`{name}`", *_cells(r["cold"]), *_cells(r["warm"])] for name, r in results.items()]
    return "\n".join([
        "## Start-up: cold and warm", "",
        f"`jaxinfer bench startup --dtype {args.dtype} --reps {args.reps}"
        + ("" if args.rows is None else f" --rows '{args.rows}'")
        + ("" if args.warm_from is None else f" --warm-from {args.warm_from}") + "`"
        + ("" if args.model is None else f" `--model {args.model}`") + f", {time.strftime('%Y-%m-%d')}; "
        + machine_line() + ".", "",
        "Each start is a fresh process, timed from its launch. Cold: empty XLA compilation and prepared-model caches "
        "(the GGUF file is read and dequantized, every step shape compiled); warm: the caches the cold start filled "
        + ("" if args.warm_from is None else f"(here: those in {args.warm_from}, filled by earlier starts) ")
        + f"(median of {args.reps}). Peak RSS is the process's maximum resident memory.", "",
        table(["command", "cold", "cold peak RSS", "warm", "warm peak RSS"], rows),
    ])
