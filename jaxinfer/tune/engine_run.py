"""Real runs for `jaxinfer tune`: each configuration gets a fresh `Engine` in this process, and the profile goes
through it on the wall clock (`jaxinfer.tune.drive`).

1. Start-up: `Engine(config)` loads the weights and (with `warmup`, the default) compiles the decode and
   single-prefill step shapes; a warm-up that loads them in the background is waited for. Every engine turns on
   JAX's persistent compilation cache (`jaxinfer.engine.compilation_cache`), so a shape another configuration
   already compiled is read from disk: configurations that share shapes start faster than the first (the timing
   counts the warm-up's shapes read from the cache and compiled).
2. Warm pass, untimed (`WARM_PASSES`): "short", the profile's requests all at once with outputs cut to
   `WARM_OUTPUT_LEN` tokens, compiles the shapes of several prefill chunks in one step that warm-up leaves to
   first use; "replay" runs the whole profile once as it will be timed, which compiles (nearly) every shape the
   timed run meets, also without warm-up (`warmup=False`: on a slow compiler, only the shapes this traffic
   needs); "none" skips it. The prefix cache is reset after it.
3. The timed run; step shapes first met in it are counted (`new_shapes`: compiled, or read from the cache):
   each one stalls a step.

Unless the config sets `max_model_len`, runs use the profile's longest context rounded up to its page-table
bucket (a text prompt counts as its UTF-8 bytes + 2, more than its tokens), capped at the model's: warm-up then
compiles only the page-table widths the profile can reach. Prompts given as lengths are consecutive slices of
real text (`jaxinfer.benchmarks.corpus`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time

from jaxinfer.benchmarks import corpus
from jaxinfer.benchmarks.serving_driver import num_executables
from jaxinfer.benchmarks.serving_scenarios import Request
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.step_inputs import page_bucket
from jaxinfer.loading.loader import read_model_config
from jaxinfer.tune.drive import Measurement, Targets, WallClock, drive
from jaxinfer.tune.profile import Profile, expand

WARM_OUTPUT_LEN = 2
WARM_PASSES = ("short", "replay", "none")


def profile_max_model_len(profile: Profile, config: EngineConfig) -> int:
    """The context limit runs of `profile` use when `config` sets none (module docstring), tokens."""
    longest = max((r.prompt_len if r.prompt is None else len(r.prompt.encode()) + 2) + r.output_len
                  for r in profile.requests)
    pages = -(-longest // config.page_size)
    limit = read_model_config(config.model).max_position_embeddings
    return min(page_bucket(pages, 1 << 30) * config.page_size, limit)


def check_profile_fits(profile: Profile, model: str | None, max_model_len: int | None = None) -> None:
    """Refuses a profile with a request of `prompt_len` + `output_len` beyond the context: `max_model_len` if
    given, else the model's (text prompts are checked when tokenized, at the first run).

    Raises:
      ValueError: naming the request (`TrafficRequest.name`: its FILE:LINE), its lengths and the context; or from
        `read_model_config`.
    """
    limit = max_model_len or read_model_config(model).max_position_embeddings
    for i, r in enumerate(profile.requests):
        if r.prompt_len is not None and r.prompt_len + r.output_len > limit:
            raise ValueError(f"{r.name(i)}: prompt_len {r.prompt_len} + output_len {r.output_len} = "
                             f"{r.prompt_len + r.output_len} tokens do not fit the context of {limit} tokens "
                             f"({'max_model_len' if max_model_len else 'the model'})")


@dataclasses.dataclass
class EngineRunner:
    """Runs a configuration on a real `Engine` (a `jaxinfer.tune.sweep.Runner`; module docstring).

    Attributes:
      warm_pass: the untimed pass before the timed run, one of WARM_PASSES.

    Raises:
      ValueError: an unknown warm_pass.
    """

    warm_pass: str = "short"
    _requests: list[Request] | None = dataclasses.field(default=None, repr=False)  # the model's: same for all

    def __post_init__(self) -> None:
        if self.warm_pass not in WARM_PASSES:
            raise ValueError(f"warm_pass={self.warm_pass!r} is not one of {', '.join(WARM_PASSES)}")

    def __call__(self, config: EngineConfig, profile: Profile, targets: Targets,
                 max_run_s: float = math.inf) -> tuple[Measurement, dict[str, float]]:
        """Returns (the timed run's measurement, timing: startup_s, warm_s, run_s (wall seconds), new_shapes (step
        shapes first met in the timed run) and, with warm-up, cache_hits / cache_misses (its shapes read from the
        persistent compilation cache / compiled)).

        Raises:
          ValueError: from `Engine` (a bad option value, a KV budget too small, a model that does not load) or a
            profile prompt that does not fit the context.
        """
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=profile_max_model_len(profile, config))
        t0 = time.perf_counter()
        engine = Engine(config)
        if engine.warmup is not None:
            engine.warmup.wait()  # a warm cache loads the shapes in the background: not during the timed run
        timing = {"startup_s": time.perf_counter() - t0}
        if engine.warmup is not None:
            timing["cache_hits"], timing["cache_misses"] = engine.warmup.cache_hits, engine.warmup.cache_misses
        try:
            if self._requests is None:
                encode = engine.tokenizer.encode
                self._requests = expand(profile, encode, encode(corpus.read_text("tune")))
            requests = self._requests
            t0 = time.perf_counter()
            if self.warm_pass != "none":
                warm = requests if self.warm_pass == "replay" else [
                    dataclasses.replace(r, arrival_s=0.0, output_len=min(r.output_len, WARM_OUTPUT_LEN))
                    for r in requests]
                drive(engine, warm, WallClock(), max_run_s=max_run_s)
                engine.reset_prefix_cache()
            timing["warm_s"] = time.perf_counter() - t0
            shapes = num_executables(engine.runner)
            t0 = time.perf_counter()
            measurement = drive(engine, requests, WallClock(), targets, max_run_s)
            timing["run_s"] = time.perf_counter() - t0
            timing["new_shapes"] = num_executables(engine.runner) - shapes
        finally:
            del engine
            gc.collect()  # the next configuration's engine needs the memory
        return measurement, timing
