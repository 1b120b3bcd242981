"""What a benchmark run reports: one `Report` per workload, its BENCHMARKS.md section, and the machine it ran on."""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import subprocess
from pathlib import Path


@dataclasses.dataclass
class Report:
    """One workload's results.

    Attributes:
      workload: the workload name (`jaxinfer.benchmarks.WORKLOADS`).
      markdown: the section body for BENCHMARKS.md, without its begin / end markers (the runner adds them), from
        its heading on; it names the command, the date and the machine (`machine_line`).
      data: the measured values as JSON-able data (seconds, tokens/s, bytes, GB/s...): what `--json` writes and
        the smoke tests check.
    """

    workload: str
    markdown: str
    data: dict


def splice(existing: str, section: str, begin: str, end: str) -> str:
    """`existing` with the text from `begin` to `end` (markers included) replaced by `section`, or `section`
    appended when `existing` has no such markers."""
    if begin in existing and end in existing:
        a, b = existing.index(begin), existing.index(end) + len(end)
        return existing[:a] + section + existing[b:]
    return existing.rstrip("\n") + "\n\n" + section + "\n"


def write_section(path: Path, body: str, markers: tuple[str, str]) -> str:
    """Replaces (or appends) the section between `markers` in the markdown file `path`; other sections stay.

    Returns:
      The section as written, markers included.
    """
    begin, end = markers
    section = f"{begin}\n{body.strip()}\n{end}"
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    path.write_text(splice(old, section, begin, end))
    return section


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: a header row, the separator, then one row per list of cell strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def vs_range(x: float, lo: float, hi: float) -> str:
    """Where a measurement falls against an expected range [lo, hi]: "within", "above" or "below"."""
    return "within" if lo <= x <= hi else ("above" if x > hi else "below")


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}


# Instruction-set extensions that change XLA:CPU's numerics and speed (as scripts/cpu_info.sh prints them).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8",
              "amx_tile")


def machine() -> dict:
    """The machine of this run: `lscpu`'s model name, family and model numbers, the AVX-512 / AMX flags present,
    cores (`os.cpu_count()`), memory in GiB, and the jax / jaxlib versions."""
    import jax
    import jaxlib
    import psutil

    info = _lscpu()
    try:
        flags = set(re.findall(r"\b\w+\b", next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                                                if line.startswith("flags"))))
    except (OSError, StopIteration):
        flags = set()
    return {"cpu": info.get("Model name") or platform.processor() or "unknown",
            "cpu_family": info.get("CPU family", "?"), "cpu_model": info.get("Model", "?"),
            "cpu_flags": [f for f in _CPU_FLAGS if f in flags], "nproc": os.cpu_count() or 1,
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def machine_line(m: dict | None = None) -> str:
    """One line for a report: "machine: nproc 2, CPU `MODEL` (family F, model M; flags), 24 GiB, jax V"."""
    m = machine() if m is None else m
    flags = ", ".join(m["cpu_flags"]) or "no AVX2 / AVX-512 / AMX"
    return (f"machine: nproc {m['nproc']}, CPU `{m['cpu']}` (family {m['cpu_family']}, model {m['cpu_model']}; "
            f"{flags}), {m['mem_gib']:g} GiB, jax {m['jax']}")


def name_list(option: str, text: str, sep: str = ",") -> list[str]:
    """A workload option's `sep`-separated names, stripped, each once in the order given.

    Raises:
      ValueError: naming the option and its text, for an empty list or an empty item (`a;;b`, a trailing `sep`).
    """
    names = [t.strip() for t in text.split(sep)]
    if not all(names):
        raise ValueError(f"{option} {text!r}: an empty {'list' if not text.strip() else 'item'}; expected "
                         f"{sep!r}-separated names")
    return list(dict.fromkeys(names))


def int_list(option: str, text: str, lo: int = 1, hi: int | None = None, allow_empty: bool = False) -> list[int]:
    """A workload option's comma-separated ints, each in [lo, hi] (no upper bound when `hi` is None); an empty
    string is the empty list only with `allow_empty`.

    Raises:
      ValueError: naming the option and its text, for an empty list or item (`1,,2`), a non-integer or a value out
        of range.
    """
    try:
        values = [int(x) for x in text.split(",")] if text.strip() else []
    except ValueError:
        values = None
    if values is None or (not values and not allow_empty) or not all(
            lo <= v and (hi is None or v <= hi) for v in values):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{option} {text!r}: expected comma-separated integers {bound}")
    return values
