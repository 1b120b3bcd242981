"""Runs a `jaxinfer bench` workload in this process the way a user would, and checks the shape of its report."""

from __future__ import annotations

import json
import math
from pathlib import Path

from jaxinfer.cli import main

REPO = Path(__file__).resolve().parents[3]
TINY_LLAMA = REPO / "tests" / "data" / "tiny_llama3"
STUB_PEER = Path(__file__).resolve().parent / "stub_peer.py"


def run_bench(tmp_path: Path, workload: str, *options: str) -> tuple[dict, str]:
    """`jaxinfer bench WORKLOAD OPTIONS --write tmp/B.md --json tmp/r.json`; returns (the JSON report, the
    written markdown). Fails the test on a non-zero exit status."""
    out_json, out_md = tmp_path / f"{workload}.json", tmp_path / "BENCHMARKS.md"
    status = main(["bench", workload, *options, "--json", str(out_json), "--write", str(out_md)])
    assert status == 0, f"jaxinfer bench {workload} exited with {status}"
    report = json.loads(out_json.read_text())
    assert report["workload"] == workload
    assert report["machine"]["cpu"] and report["machine"]["nproc"] >= 1
    return report, out_md.read_text()


def assert_positive_finite(value: float, what: str) -> None:
    """A time, rate or size a benchmark reports must be a finite number > 0."""
    assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{what}={value!r} is not a number"
    assert math.isfinite(value) and value > 0, f"{what}={value!r} is not finite and positive"
