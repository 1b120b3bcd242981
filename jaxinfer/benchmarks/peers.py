"""Peers run in their own interpreter (torch and llama.cpp live in other venvs): the protocol and the runner.

The protocol: a peer is a Python script run as `PYTHON SCRIPT ARGS...`; it prints one JSON object as the last
line of its stdout (its results, or {"error": why}); stderr lines that start with "[peer]" are progress for the
log. `scripts/peer_transformers.py` is the HF transformers peer, `scripts/peer_llamacpp.py` the llama.cpp peer
(llama-cpp-python); a test's stub peer speaks the same protocol.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

from jaxinfer.benchmarks.report import name_list

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
TRANSFORMERS_PEER = REPO / "scripts" / "peer_transformers.py"
LLAMACPP_PEER = REPO / "scripts" / "peer_llamacpp.py"
LLAMACPP_CACHE = Path.home() / ".cache" / "jaxinfer" / "peers"
LLAMACPP_TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")  # the weight types scripts/peer_llamacpp.py knows


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """`--peer-python` (the peer's interpreter; omitted: no peer), `--peer-script`, `--peer-timeout`."""
    parser.add_argument("--peer-python", default=None,
                        help="Python with torch + transformers (e.g. .venv-golden/bin/python); omitted: no peer")
    parser.add_argument("--peer-script", type=Path, default=TRANSFORMERS_PEER,
                        help="the peer script (default: scripts/peer_transformers.py)")
    parser.add_argument("--peer-timeout", type=int, default=600, help="seconds before the peer is given up")


def add_llamacpp_arguments(parser: argparse.ArgumentParser) -> None:
    """`--llamacpp-python` (an interpreter with llama-cpp-python; omitted: no llama.cpp peer), `--llamacpp-script`,
    `--llamacpp-types` (weight types, the GGUF re-quantized as needed), `--llamacpp-cache` (where those files
    stay)."""
    parser.add_argument("--llamacpp-python", default=None,
                        help="Python with llama-cpp-python (e.g. /work/venv-llamacpp/bin/python); omitted: no "
                             "llama.cpp peer")
    parser.add_argument("--llamacpp-script", type=Path, default=LLAMACPP_PEER,
                        help="the llama.cpp peer script (default: scripts/peer_llamacpp.py)")
    parser.add_argument("--llamacpp-types", default="Q4_0,BF16,Q4_1",
                        help=f"llama.cpp weight types (of {', '.join(LLAMACPP_TYPES)}); the GGUF is re-quantized "
                             "to each it is not already (default: %(default)s; Q4_1 is the default model's own type)")
    parser.add_argument("--llamacpp-cache", type=Path, default=LLAMACPP_CACHE,
                        help="folder of the re-quantized GGUF files, kept between runs (default: %(default)s)")


def check_llamacpp_types(text: str) -> list[str]:
    """"Q4_0,BF16" -> ["Q4_0", "BF16"] (`--llamacpp-types`).

    Raises:
      ValueError: an empty list or an unknown type (named), before any minutes of measuring.
    """
    names = name_list("--llamacpp-types", text)
    unknown = [t for t in names if t not in LLAMACPP_TYPES]
    if unknown:
        raise ValueError(f"--llamacpp-types {text!r}: unknown {', '.join(unknown)} (known: {', '.join(LLAMACPP_TYPES)})")
    return names


def check_peer_paths(args, model: Path) -> None:
    """Before any measuring: the interpreters given (`--peer-python`, `--llamacpp-python`) exist, and the llama.cpp
    peer script, which reads GGUF files only, gets one.

    Raises:
      ValueError: naming the option and the path.
    """
    for option, python in (("--peer-python", getattr(args, "peer_python", None)),
                           ("--llamacpp-python", getattr(args, "llamacpp_python", None))):
        if python is not None and not Path(python).is_file():
            raise ValueError(f"{option} {python}: no such interpreter")
    real_llamacpp = getattr(args, "llamacpp_script", LLAMACPP_PEER) == LLAMACPP_PEER  # (tests run a stub)
    if getattr(args, "llamacpp_python", None) is not None and real_llamacpp and not (
            model.is_file() and model.suffix == ".gguf"):
        raise ValueError(f"--llamacpp-python: the llama.cpp peer reads GGUF files only; --model {model} is not one "
                         "(leave out --llamacpp-python, or give a .gguf file)")


def run_peer(python: str, script: Path, args: list[str], timeout: int) -> dict:
    """Runs `python script args...`; returns the JSON object its stdout ends with, or {"error": why} (a missing
    interpreter or script, a timeout, a non-zero exit, output that is not JSON)."""
    if not Path(python).is_file():
        return {"error": f"peer interpreter {python} not found"}
    if not Path(script).is_file():
        return {"error": f"peer script {script} not found"}
    cmd = [str(python), str(script), *args]
    logger.info("peer: %s", shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout} s"}
    for line in proc.stderr.splitlines():
        if line.startswith("[peer]"):
            logger.info("%s", line)
    if proc.returncode != 0:
        return {"error": f"peer exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": "peer printed no JSON object as its last line"}
    return result if isinstance(result, dict) else {"error": "peer's JSON is not an object"}


def run_worker(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> dict:
    """Runs one of our own worker processes (`cmd`); returns the JSON object its stdout ends with.

    Raises:
      RuntimeError: naming `what` (e.g. "the longctx worker (8192 tokens)"): a timeout, or a non-zero exit or output
        that is not JSON, with the last lines of its stderr.
    """
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ) if env is None else env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} timed out after {timeout} s") from None
    try:
        if proc.returncode != 0:
            raise ValueError
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}") from None


def run_llamacpp_peer(python: str, script: Path, args: list[str], timeout: int) -> dict:
    """`run_peer` of the llama.cpp peer; if it dies from a signal, once more with `--no-extra-bufts`.

    llama-cpp-python 0.3.36 built natively died with SIGSEGV in its first Q4_0 prefill on an Intel Xeon with AMX
    while ggml's extra CPU buffer types (AMX, repacked weight layouts) were on; without them it runs. The result's
    `extra_bufts` field says which run it is.
    """
    result = run_peer(python, script, args, timeout)
    if "error" in result and result["error"].startswith("peer exited with -"):  # a negative code: a signal
        logger.warning("llama.cpp peer: %s; rerunning without ggml's extra CPU buffer types", result["error"])
        result = run_peer(python, script, [*args, "--no-extra-bufts"], timeout)
    return result


def run_peers(args: argparse.Namespace, model: Path, prompt: list[int], rows: list[list[int]], dtypes: list[str],
              batches: list[int]) -> tuple[dict | None, dict | None]:
    """Runs the peers `args` names on the same model file, prefill prompt and batch prompts as jaxinfer.

    Args:
      args: the options of `add_peer_arguments` and `add_llamacpp_arguments`, and the timing the peers share with
        `jaxinfer bench step`: `decode_prompt_len`, `prefill_reps`, `decode_steps`, `warmup_steps` (batch 1) and
        `peer_batch_steps` (the `batches` sizes).
      model: the GGUF file (or HF folder, HF peer only).
      prompt: the prefill prompt's token ids; batch-1 decode starts from its first `decode_prompt_len`.
      rows: equal-length prompts; batch b decodes the first b.
      dtypes: the HF peer's dtypes ("float32", "bfloat16").
      batches: decode batch sizes besides 1 ([]: batch 1 only).

    Returns:
      (HF peer's JSON, llama.cpp peer's JSON), each None when its interpreter option is not given, or
      {"error": why}.
    """
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file, rows_file = Path(tmp) / "prompt.json", Path(tmp) / "rows.json"
        prompt_file.write_text(json.dumps(prompt))
        rows_file.write_text(json.dumps(rows))
        common = ["--gguf", str(model), "--prompt-file", str(prompt_file), "--threads", str(os.cpu_count() or 1),
                  "--decode-prompt-len", str(args.decode_prompt_len), "--prefill-reps", str(args.prefill_reps),
                  "--decode-steps", str(args.decode_steps), "--warmup-steps", str(args.warmup_steps)]
        if batches:
            common += ["--batches", ",".join(map(str, batches)), "--batch-prompts", str(rows_file),
                       "--batch-steps", str(args.peer_batch_steps)]
        hf = llama = None
        if args.peer_python is not None:
            hf = run_peer(args.peer_python, args.peer_script, [*common, "--dtypes", ",".join(dtypes)],
                          args.peer_timeout)
        if args.llamacpp_python is not None:
            llama_args = [*common, "--types", args.llamacpp_types, "--cache-dir", str(args.llamacpp_cache)]
            llama = run_llamacpp_peer(args.llamacpp_python, args.llamacpp_script, llama_args,
                                      args.peer_timeout)
    for name, result in (("HF transformers", hf), ("llama.cpp", llama)):
        if result and "error" in result:
            logger.warning("%s peer: %s", name, result["error"])
    return hf, llama


def merge_runs(runs: list[dict | None]) -> dict | None:
    """One peer's several runs (`run_peers` results, each None or a JSON dict) as one: the first run that has
    results, each weights' `decode_tok_s` replaced by the median over the runs that measured it, with those runs'
    values in `decode_tok_s_runs`. None or the first error when no run has results."""
    good = [r for r in runs if r and "results" in r]
    if not good:
        return next((r for r in runs if r), None)
    merged = json.loads(json.dumps(good[0]))
    for weights, res in merged["results"].items():
        values = [r["results"][weights]["decode_tok_s"] for r in good if weights in r["results"]]
        res["decode_tok_s"], res["decode_tok_s_runs"] = statistics.median(values), values
    return merged
