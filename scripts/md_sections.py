"""Sections of BENCHMARKS.md that each benchmark script owns, between its own begin/end marker comments."""

from __future__ import annotations

# bench_sharding.py's markers live here: that script sets up 8 fake devices when imported.
SHARDING_MARKERS = ("<!-- sharding:begin -->", "<!-- sharding:end -->")


def splice(existing: str, section: str, begin: str, end: str) -> str:
    """`existing` with the section between `begin` and `end` (markers included) replaced by `section`, or
    `section` appended when `existing` has none."""
    if begin in existing and end in existing:
        a, b = existing.index(begin), existing.index(end) + len(end)
        return existing[:a] + section + existing[b:]
    return existing.rstrip("\n") + "\n\n" + section + "\n"


def keep_section(old: str, report: str, begin: str, end: str) -> str:
    """`report` with `old`'s section appended when `report` has none (a run of another workload rewrote the file)."""
    if begin in old and end in old and begin not in report:
        a, b = old.index(begin), old.index(end) + len(end)
        return report.rstrip("\n") + "\n\n" + old[a:b] + "\n"
    return report


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: a header row, the separator, then one row per list of cell strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def vs_range(x: float, lo: float, hi: float) -> str:
    """Where a measurement falls against an expected range [lo, hi]: "within", "above" or "below"."""
    return "within" if lo <= x <= hi else ("above" if x > hi else "below")
