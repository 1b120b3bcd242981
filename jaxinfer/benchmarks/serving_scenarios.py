"""Serving scenarios: N requests with fixed or uniformly drawn input / output lengths, arriving all at once
(offline) or as a Poisson process (online), and the requests they expand to (prompts cut from real text)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxinfer.benchmarks.report import name_list
from jaxinfer.engine.step_inputs import page_bucket

PAGE_SIZE = 16
MIN_PAGES = 8  # the runner's smallest page-table width
MIN_WARM_OUTPUT = 16  # shortest output of the untimed compile run
DEFAULT_SCENARIOS = "offline:n=32,in=128,out=128;online:n=32,in=32-256,out=32-128,rate=1"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """N requests; lengths are inclusive ranges (lo == hi: fixed); rate in requests/s, inf: all at once."""

    name: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    rate: float = math.inf
    seed: int = 0

    @property
    def fixed(self) -> bool:
        """Every request has the same input and output length (what the HF peer's one batch needs)."""
        return self.input_len[0] == self.input_len[1] and self.output_len[0] == self.output_len[1]

    @property
    def offline(self) -> bool:
        """All requests arrive at once (rate inf)."""
        return math.isinf(self.rate)

    def describe(self) -> str:
        """One line for the report, e.g. "32 requests, input U[32, 256], output 128, Poisson 1 req/s"."""
        def rng(r: tuple[int, int]) -> str:
            return str(r[0]) if r[0] == r[1] else f"U[{r[0]}, {r[1]}]"

        arrival = "all at once" if self.offline else f"Poisson {self.rate:g} req/s"
        return f"{self.num_requests} requests, input {rng(self.input_len)}, output {rng(self.output_len)}, {arrival}"


def parse_scenario(spec: str) -> Scenario:
    """`name:n=32,in=128,out=128[,rate=2][,seed=0]`; lengths may be ranges `64-256`; rate `inf` = all at once.

    Raises:
      ValueError: a missing, unknown, repeated or empty field, a value that is not a number, a bad length range,
        n < 1 or rate <= 0.
    """
    name, _, body = spec.partition(":")
    fields: dict[str, str] = {}
    for item in name_list(f"scenario {spec!r}", body) if body.strip() else []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"scenario {spec!r}: expected key=value, got {item!r}")
        if key.strip() in fields:
            raise ValueError(f"scenario {spec!r}: {key.strip()} given twice")
        fields[key.strip()] = value.strip()

    def length(key: str) -> tuple[int, int]:
        lo, _, hi = fields[key].partition("-")
        try:
            r = (int(lo), int(hi or lo))
        except ValueError:
            r = (0, 0)
        if not 1 <= r[0] <= r[1]:
            raise ValueError(f"scenario {spec!r}: bad {key} range {fields[key]!r}")
        return r

    unknown = set(fields) - {"n", "in", "out", "rate", "seed"}
    if unknown or not name or not {"n", "in", "out"} <= set(fields):
        raise ValueError(f"scenario {spec!r}: need name:n=..,in=..,out=..[,rate=..][,seed=..]")
    input_len, output_len = length("in"), length("out")
    try:
        sc = Scenario(name=name, num_requests=int(fields["n"]), input_len=input_len, output_len=output_len,
                      rate=float(fields.get("rate", "inf")), seed=int(fields.get("seed", "0")))
    except ValueError as e:
        raise ValueError(f"scenario {spec!r}: {e}") from None
    if sc.num_requests < 1 or not sc.rate > 0:
        raise ValueError(f"scenario {spec!r}: n must be >= 1 and rate > 0")
    return sc


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a scenario: when it arrives, its prompt ids and how many tokens it must produce."""

    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    output_len: int


def prompt_slices(lengths: list[int], text_ids: list[int]) -> list[list[int]]:
    """Prompts of the given lengths (tokens) as consecutive slices of `text_ids`, wrapping around to its start
    when the next one would run past its end (a prompt longer than the text is the whole text).

    Raises:
      ValueError: empty `text_ids`.
    """
    if not text_ids:
        raise ValueError("prompt_slices: no text to cut prompts from")
    out, cursor = [], 0
    for n in lengths:
        if cursor + n > len(text_ids):
            cursor = 0
        out.append(text_ids[cursor: cursor + int(n)])
        cursor += int(n)
    return out


def make_requests(sc: Scenario, text_ids: list[int]) -> list[Request]:
    """Prompts are consecutive slices of `text_ids` (`prompt_slices`); arrivals Poisson or all at 0."""
    rng = np.random.default_rng(sc.seed)
    ins = rng.integers(sc.input_len[0], sc.input_len[1] + 1, sc.num_requests)
    outs = rng.integers(sc.output_len[0], sc.output_len[1] + 1, sc.num_requests)
    gaps = np.zeros(sc.num_requests) if sc.offline else rng.exponential(1 / sc.rate, sc.num_requests)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    prompts = prompt_slices([int(n) for n in ins], text_ids)
    return [Request(float(a), p, int(o)) for a, p, o in zip(arrivals, prompts, outs)]


def max_model_len(scenarios: list[Scenario]) -> int:
    """The longest context rounded up to its page-table bucket: the step shapes are those of the default (the
    model's 8192) for these contexts, and the engine's warm-up has fewer page-table widths to compile."""
    pages = -(-max(sc.input_len[1] + sc.output_len[1] for sc in scenarios) // PAGE_SIZE)
    return page_bucket(pages, 1 << 30) * PAGE_SIZE


def warm_output_len(input_len: int, output_len: int, max_pages_per_seq: int) -> int:
    """Shortest output >= MIN_WARM_OUTPUT whose final context needs the same page bucket as the full output."""
    target = page_bucket(-(-(input_len + output_len) // PAGE_SIZE), max_pages_per_seq)
    for o in range(min(MIN_WARM_OUTPUT, output_len), output_len + 1):
        if page_bucket(-(-(input_len + o) // PAGE_SIZE), max_pages_per_seq) == target:
            return o
    return output_len



def parse_scenarios(specs: str) -> list[Scenario]:
    """`;`-separated `parse_scenario` specs; the first is the headline.

    Raises:
      ValueError: a malformed spec, none at all, an empty one (`a;;b`), two with one name (their rows would merge).
    """
    scenarios = [parse_scenario(x) for x in name_list("--scenarios", specs, ";")]
    names = [s.name for s in scenarios]
    if len(set(names)) < len(names):
        raise ValueError(f"--scenarios {specs!r}: each scenario needs a name of its own (got {', '.join(names)})")
    return scenarios
