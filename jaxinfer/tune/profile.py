"""Traffic profiles: the requests `jaxinfer tune` sizes the engine for, from a JSONL file of requests or from
input / output-length histograms with an arrival rate.

A JSONL profile has one request per line (blank lines skipped):

    {"prompt": "Summarise ...", "max_tokens": 128, "arrival_s": 0.0}
    {"prompt_len": 900, "output_len": 40, "arrival_s": 0.35}

with exactly one of `prompt` (text, tokenized by the model's tokenizer) or `prompt_len` (tokens, cut from real
text), exactly one of `max_tokens` or `output_len` (tokens the request generates: every request runs to it,
`ignore_eos`), and `arrival_s` (seconds; the first arrival starts the run) on every line or on none. Without
arrival times, requests arrive as a Poisson process of the given rate, or all at once.

A histogram profile is one JSON object:

    {"input_lens": [[128, 6], [512, 3], [2048, 1]], "output_lens": [[32, 1], [256, 1]],
     "rate_per_s": 2.0, "num_requests": 40, "seed": 0}

`[length, weight]` pairs (weights > 0, any scale); each request draws its input and output length independently
with these probabilities; `rate_per_s` (a number or "inf": all at once) drives Poisson arrivals. All draws are
seeded: a profile always expands to the same requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from jaxinfer.benchmarks.serving_scenarios import Request, prompt_slices

REQUEST_KEYS = ("prompt", "prompt_len", "max_tokens", "output_len", "arrival_s")
HISTOGRAM_KEYS = ("input_lens", "output_lens", "rate_per_s", "num_requests", "seed")


@dataclasses.dataclass(frozen=True)
class TrafficRequest:
    """One request of a profile: when it arrives, its prompt (text, or a length in tokens) and its output length.

    Attributes:
      arrival_s: seconds from the start of the run, >= 0.
      output_len: tokens it generates, >= 1.
      prompt_len: prompt tokens (a prompt cut from real text), or None when `prompt` is given.
      prompt: the prompt's text, or None.
      where: where it comes from, for errors: "FILE:LINE" for a JSONL line; "" for a histogram's draw (`name`).
    """

    arrival_s: float
    output_len: int
    prompt_len: int | None = None
    prompt: str | None = None
    where: str = dataclasses.field(default="", compare=False)

    def name(self, index: int) -> str:
        """The request in errors: its `where`, else "profile request N" (N = `index` + 1, in arrival order)."""
        return self.where or f"profile request {index + 1}"


@dataclasses.dataclass(frozen=True)
class Profile:
    """The requests of a traffic profile, in arrival order, and one line saying what they are."""

    requests: tuple[TrafficRequest, ...]
    description: str


def _int(value: object, where: str, least: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where} must be an integer >= {least}, got {value!r}")
    return value


def _arrivals(n: int, rate_per_s: float, rng: np.random.Generator) -> list[float]:
    """Poisson arrivals at `rate_per_s` (the first at 0), or all at 0 for an infinite rate."""
    if math.isinf(rate_per_s):
        return [0.0] * n
    gaps = rng.exponential(1 / rate_per_s, n)
    gaps[0] = 0.0
    return [float(a) for a in np.cumsum(gaps)]


def _rate(value: object, where: str) -> float:
    rate = math.inf if value == "inf" else value
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise ValueError(f"{where} must be a number > 0 or \"inf\" (all at once), got {value!r}")
    return float(rate)


def _request(obj: object, where: str) -> tuple[TrafficRequest, bool]:
    """One JSONL line's request and whether it gave `arrival_s`."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in REQUEST_KEYS]
    if unknown:
        from jaxinfer.request_limits import name_hint

        raise ValueError(f"{where}: unknown key(s) {', '.join(name_hint(k, REQUEST_KEYS) for k in unknown)}; a "
                         f"request has {', '.join(REQUEST_KEYS)}")
    if ("prompt" in obj) == ("prompt_len" in obj):
        raise ValueError(f"{where}: give exactly one of prompt (text) and prompt_len (tokens)")
    if ("max_tokens" in obj) == ("output_len" in obj):
        raise ValueError(f"{where}: give exactly one of max_tokens and output_len")
    out_key = "max_tokens" if "max_tokens" in obj else "output_len"
    output_len = _int(obj[out_key], f"{where}: {out_key}")
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt must be non-empty text, got {prompt!r}")
    prompt_len = None if "prompt_len" not in obj else _int(obj["prompt_len"], f"{where}: prompt_len")
    arrival = obj.get("arrival_s", 0.0)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not 0 <= arrival < math.inf:
        raise ValueError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    return TrafficRequest(float(arrival), output_len, prompt_len, prompt, where), "arrival_s" in obj


def parse_jsonl(text: str, source: str, rate_per_s: float | None = None, seed: int = 0) -> list[TrafficRequest]:
    """The requests of a JSONL profile (module docstring), in arrival order.

    Args:
      text: the file's text.
      source: its name, for errors.
      rate_per_s: without arrival times: Poisson arrivals of this rate (requests / s); None or inf: all at once.
        With arrival times it must be None.
      seed: seeds the Poisson arrivals.

    Raises:
      ValueError: "SOURCE:LINE: ..." naming the line and field: a line that is not JSON or not an object, an
        unknown key, missing or doubled prompt / length keys, a bad value, arrival_s on some lines only; or no
        request at all, or a rate with arrival times.
    """
    reqs, timed = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
        req, has_arrival = _request(obj, where)
        if timed and has_arrival != timed[0]:
            raise ValueError(f"{where}: arrival_s must be on every line or on none (the first request "
                             f"{'has' if timed[0] else 'has none'})")
        timed.append(has_arrival)
        reqs.append(req)
    if not reqs:
        raise ValueError(f"{source}: no requests (one JSON object per line)")
    if timed[0]:
        if rate_per_s is not None:
            raise ValueError(f"{source}: the requests have arrival_s; a rate applies only to requests without")
        start = min(r.arrival_s for r in reqs)  # the run starts with the first arrival
        return sorted((dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in reqs),
                      key=lambda r: r.arrival_s)
    arrivals = _arrivals(len(reqs), math.inf if rate_per_s is None else _rate(rate_per_s, "rate_per_s"),
                         np.random.default_rng(seed))
    return [dataclasses.replace(r, arrival_s=a) for r, a in zip(reqs, arrivals)]


def _histogram(value: object, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, probabilities) of `[[length, weight], ...]`."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of [length, weight] pairs, got {value!r}")
    lengths, weights = [], []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}[{i}] must be a [length, weight] pair, got {pair!r}")
        lengths.append(_int(pair[0], f"{where}[{i}] length"))
        w = pair[1]
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w < math.inf:
            raise ValueError(f"{where}[{i}] weight must be a number > 0, got {w!r}")
        weights.append(float(w))
    p = np.asarray(weights)
    return np.asarray(lengths), p / p.sum()


def parse_histograms(obj: Mapping, source: str, rate_per_s: float | None = None) -> list[TrafficRequest]:
    """The requests a histogram profile (module docstring) expands to, in arrival order.

    Args:
      obj: the profile object.
      source: its file name, for errors.
      rate_per_s: overrides the profile's `rate_per_s` when given.

    Raises:
      ValueError: "SOURCE: FIELD ..." naming the field: an unknown or missing key, a histogram that is not a list
        of [length > 0, weight > 0] pairs, num_requests < 1, a rate <= 0, a seed that is not an integer >= 0.
    """
    unknown = [k for k in obj if k not in HISTOGRAM_KEYS]
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; a histogram profile has "
                         f"{', '.join(HISTOGRAM_KEYS)}")
    missing = [k for k in ("input_lens", "output_lens", "num_requests") if k not in obj]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    ins, p_in = _histogram(obj["input_lens"], f"{source}: input_lens")
    outs, p_out = _histogram(obj["output_lens"], f"{source}: output_lens")
    n = _int(obj["num_requests"], f"{source}: num_requests")
    seed = _int(obj.get("seed", 0), f"{source}: seed", least=0)
    rate = _rate(rate_per_s if rate_per_s is not None else obj.get("rate_per_s", "inf"),
                 "rate_per_s" if rate_per_s is not None else f"{source}: rate_per_s")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = rng.choice(ins, n, p=p_in), rng.choice(outs, n, p=p_out)
    arrivals = _arrivals(n, rate, rng)
    return [TrafficRequest(a, int(o), prompt_len=int(i)) for a, i, o in zip(arrivals, in_lens, out_lens)]


def describe(reqs: list[TrafficRequest] | tuple[TrafficRequest, ...], source: str) -> str:
    """One line: "40 requests (FILE), input tokens median 128 / max 2048, output median 32 / max 256, over 19.5 s"
    (text prompts count as '?' until tokenized)."""
    ins = [r.prompt_len for r in reqs if r.prompt_len is not None]
    outs = [r.output_len for r in reqs]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    inp = f"input tokens median {int(np.median(ins))} / max {max(ins)}" if ins else "text prompts"
    arrive = "all at once" if span == 0 else f"arriving over {span:.1f} s"
    return f"{len(reqs)} requests ({source}), {inp}, output median {int(np.median(outs))} / max {max(outs)}, {arrive}"


def load_profile(path: str | os.PathLike, rate_per_s: float | None = None, seed: int = 0) -> Profile:
    """Reads a profile file: a JSON object with `input_lens` / `output_lens` is a histogram profile, anything
    else JSONL (module docstring).

    Args:
      rate_per_s: arrival rate for requests without arrival times (JSONL), or instead of the histogram's.
      seed: seeds JSONL Poisson arrivals (a histogram profile has its own `seed`).

    Raises:
      ValueError: naming the file (and line or field): it cannot be read, or the parsers' errors.
    """
    name = os.fspath(path)
    try:
        text = Path(name).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"profile {name}: cannot be read: {e}") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and ("input_lens" in whole or "output_lens" in whole):
        reqs = parse_histograms(whole, name, rate_per_s)
    else:
        reqs = parse_jsonl(text, name, rate_per_s, seed)
    return Profile(tuple(reqs), describe(reqs, Path(name).name))


def expand(profile: Profile, encode: Callable[[str], list[int]], text_ids: list[int]) -> list[Request]:
    """The profile's requests with prompt token ids: text prompts through `encode`, lengths as consecutive slices
    of `text_ids` (`serving_scenarios.prompt_slices`).

    Raises:
      ValueError: a text prompt that encodes to no tokens, naming the request (`TrafficRequest.name`).
    """
    lens = [r.prompt_len for r in profile.requests if r.prompt_len is not None]
    slices = iter(prompt_slices(lens, text_ids))
    out = []
    for i, r in enumerate(profile.requests):
        ids = list(encode(r.prompt)) if r.prompt is not None else next(slices)
        if not ids:
            raise ValueError(f"{r.name(i)}: its prompt encodes to no tokens")
        out.append(Request(r.arrival_s, ids, r.output_len))
    return out
