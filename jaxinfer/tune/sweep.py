"""The search of `jaxinfer tune`: which configurations to run within a budget, running them, and the best one.

1. The space: for each knob (`KNOBS`, `EngineConfig` fields), the values to try, as users write them (a JSON
   object or format name for `quantization` / `speculative_config`, None for off); a knob not swept keeps the
   base options' value.
2. `plan`: the default configuration (every knob at the base options' value: what `jaxinfer serve` would run)
   first, then the grid in order. Configurations `EngineConfig` refuses, or whose tensor-parallel size does not
   divide the devices, are skipped with the reason. When more remain than the budget, the default and a seeded
   random sample of the rest run.
3. `sweep`: each configuration runs through a `Runner` (a real engine, `jaxinfer.tune.engine_run`, or the
   simulator, `jaxinfer.tune.simulate`) with the latency targets; a run that certainly misses one stops early
   (`jaxinfer.tune.drive`) and is "pruned". A runner that raises fails that configuration alone.
4. `best`: of the configurations whose complete run met every target, the one with the most output tokens/s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jaxinfer.engine.config import EngineConfig

if TYPE_CHECKING:  # the command line reads KNOBS before jax loads; these modules load it
    from jaxinfer.tune.drive import Measurement, Targets
    from jaxinfer.tune.profile import Profile

KNOBS = ("max_num_seqs", "max_num_batched_tokens", "page_size", "kv_cache_dtype", "quantization",
         "speculative_config", "tensor_parallel_size")
INT_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size")
OFF = "none"  # quantization / speculative_config off, on the command line
STATUSES = ("meets", "misses", "pruned", "stopped", "failed")  # a run's outcome; only "meets" can be the best
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


class Runner(Protocol):
    """Runs one configuration over a profile: (measurement, timing {name: seconds or counts})."""

    def __call__(self, config: EngineConfig, profile: Profile, targets: Targets,
                 max_run_s: float = math.inf) -> tuple[Measurement, dict[str, float]]: ...


@dataclasses.dataclass
class Trial:
    """One configuration's run.

    Attributes:
      knobs: {knob: value as written} of this configuration.
      is_default: the base configuration (every knob at its base value).
      status: one of STATUSES: "meets" / "misses" (complete run, within / over a target), "pruned" (stopped once
        a target was certainly missed), "stopped" (time limit), "failed" (the runner raised; see reason).
      reason: why it was pruned, stopped or failed, else None.
      metrics: `Measurement.summary()` plus num_finished (empty when failed).
      timing: the runner's (engine runs: startup_s, warm_s, run_s, new_shapes; the simulator: none).
    """

    knobs: dict[str, Any]
    is_default: bool
    status: str
    reason: str | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)


def parse_knob_values(knob: str, texts: Sequence[str], label: str | None = None) -> list[Any]:
    """A knob's values from command-line texts: each text is a comma-separated list, or one JSON object (for
    `quantization` / `speculative_config`); "none" turns those two off. Duplicates are dropped.

    Args:
      knob: one of KNOBS.
      texts: the flag's values (it may be repeated).
      label: names the flag in errors (default: the knob).

    Returns:
      The values as written: ints for INT_KNOBS, None / dicts / strings for the rest.

    Raises:
      ValueError: naming the flag and value: an empty item, a value that is not an integer, or one
        `EngineConfig.normalize` rejects (bad JSON, unknown keys, an unknown format).
    """
    if knob not in KNOBS:
        raise ValueError(f"{knob!r} is not a tunable option; the knobs are {', '.join(KNOBS)}")
    label = label or knob
    values: list[Any] = []
    seen = set()
    for text in texts:
        items = [text] if text.lstrip().startswith("{") else text.split(",")
        for item in (i.strip() for i in items):
            if not item:
                raise ValueError(f"{label}: empty value in {text!r}")
            if knob in INT_KNOBS:
                try:
                    value: Any = int(item)
                except ValueError:
                    raise ValueError(f"{label}: {item!r} is not an integer") from None
            elif knob in ("quantization", "speculative_config") and item.lower() == OFF:
                value = None
            elif item.startswith("{"):
                try:
                    value = json.loads(item)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{label}: {item!r} is not valid JSON: {e}") from None
            else:
                value = item
            try:
                key = repr(EngineConfig.normalize(knob, value))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{label} {item}: {e}") from None
            if key not in seen:
                seen.add(key)
                values.append(value)
    return values


def _key(knobs: Mapping[str, Any]) -> tuple:
    """Identity of a configuration: its normalised knob values (so "int8" and {"format": "int8"} are one)."""
    return tuple((name, repr(EngineConfig.normalize(name, knobs[name]))) for name in sorted(knobs))


def _refusal(knobs: Mapping[str, Any], base: Mapping[str, Any], num_devices: int) -> str | None:
    """Why this configuration cannot run, or None."""
    tp = knobs.get("tensor_parallel_size", base.get("tensor_parallel_size", 1))
    devices = tp * base.get("expert_parallel_size", 1)
    if devices > num_devices or num_devices % devices:
        return f"tensor_parallel_size={tp}: {devices} devices do not divide the {num_devices} there are"
    try:
        EngineConfig.create(**{**base, **knobs})
    except ValueError as e:
        return str(e)
    return None


def plan(space: Mapping[str, Sequence[Any]], base: Mapping[str, Any], budget: int, seed: int = 0,
         num_devices: int = 1) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]], int]:
    """The configurations to run (module docstring, step 2).

    Args:
      space: {knob: values to try} (`parse_knob_values`); knobs left out keep the base value.
      base: the options every run shares, as `EngineConfig.create` takes them (also the knobs' base values).
      budget: most configurations to run, >= 1 (the default counts).
      seed: seeds the sample when the grid is larger than the budget.
      num_devices: devices there are (`jax.device_count()`); tensor-parallel sizes must divide it.

    Returns:
      (configurations to run as {knob: value}, the default first; skipped (knobs, reason); how many distinct
      runnable configurations the space has, the default included).

    Raises:
      ValueError: a budget < 1, an unknown knob, a knob with no values, or a default configuration that cannot
        run (the reason named).
    """
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} must be an integer >= 1")
    for knob, values in space.items():
        if knob not in KNOBS:
            raise ValueError(f"{knob!r} is not a tunable option; the knobs are {', '.join(KNOBS)}")
        if not values:
            raise ValueError(f"{knob}: no values to try")
    names = list(space)
    default = {name: base.get(name, _DEFAULTS[name]) for name in names}
    grid = [dict(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]
    runnable: list[dict[str, Any]] = []
    skipped: list[tuple[dict[str, Any], str]] = []
    seen = set()
    for knobs in [default, *grid]:
        key = _key(knobs)
        if key in seen:
            continue
        seen.add(key)
        reason = _refusal(knobs, base, num_devices)
        if reason is not None:
            if knobs is default:
                raise ValueError(f"the default configuration cannot run: {reason}")
            skipped.append((knobs, reason))
        else:
            runnable.append(knobs)
    if len(runnable) <= budget:
        return runnable, skipped, len(runnable)
    rest = random.Random(seed).sample(runnable[1:], budget - 1)
    return [runnable[0], *rest], skipped, len(runnable)


def sweep(runner: Runner, profile: Profile, base: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]],
          targets: Targets, max_run_s: float = math.inf,
          on_trial: Callable[[int, Trial], None] | None = None) -> list[Trial]:
    """Runs every candidate (the first is the default) and classifies it (module docstring, step 3).

    Args:
      runner: runs one configuration.
      profile: the traffic.
      base: options every run shares.
      candidates: {knob: value} per configuration, from `plan`.
      targets: the latency targets (runs stop early once one is certainly missed).
      max_run_s: a run's time limit on its clock.
      on_trial: called with (index, trial) after each run (progress logs).

    Returns:
      One `Trial` per candidate, in order.
    """
    trials = []
    for i, knobs in enumerate(candidates):
        trial = Trial(knobs=dict(knobs), is_default=i == 0, status="failed")
        try:
            m, trial.timing = runner(EngineConfig.create(**{**base, **knobs}), profile, targets, max_run_s)
        except Exception as e:  # noqa: BLE001 - one configuration failing (memory, a compile) fails it alone
            trial.reason = f"{type(e).__name__}: {e}"
        else:
            trial.metrics = {**m.summary(), "num_finished": m.num_finished}
            trial.reason = m.stopped
            if m.stopped is not None:
                trial.status = "pruned" if m.pruned else "stopped"
            else:
                trial.status = "meets" if targets.met(trial.metrics["ttft_p99_s"], trial.metrics["tpot_p99_s"]) \
                    else "misses"
        trials.append(trial)
        if on_trial is not None:
            on_trial(i, trial)
    return trials


def best(trials: Sequence[Trial]) -> Trial | None:
    """The trial with the most output tokens/s among those that met every target ("meets"), or None."""
    meeting = [t for t in trials if t.status == "meets"]
    return max(meeting, key=lambda t: t.metrics["output_tok_s"]) if meeting else None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (latency, throughput) no other point beats: none has latency <= and throughput >=
    with one of them strictly better. Sorted by latency.
    """
    front = []
    for i, (lat, thr) in enumerate(points):
        if not any((lo <= lat and to >= thr) and (lo < lat or to > thr) for lo, to in points):
            front.append(i)
    return sorted(front, key=lambda i: points[i])
