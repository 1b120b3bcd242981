"""A simulated engine for `jaxinfer tune`: the real `Scheduler` with a step whose duration is a cost model of
(batched tokens, sequences), on a virtual clock. No model, no device, no compile: a sweep over the scheduling
knobs runs in milliseconds and always gives the same numbers.

1. `add_request` queues a `Sequence` (arrival on the virtual clock), as `Engine.add_request` does.
2. `step` asks the scheduler for a plan (`max_num_seqs`, `max_num_batched_tokens`, `page_size` and the KV
   capacity in pages decide it, preemption included), advances the clock by `cost(plan.num_batched_tokens,
   len(plan.chunks))`, and gives every chunk that samples one token (id `TOKEN`), through the scheduler's stop
   rules. Outputs are `RequestOutput`s, as the engine's.

Only what the scheduler sees is simulated: the knobs that change the device step itself (KV dtype, quantization,
speculative decoding, tensor parallelism) change the result only through the cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

from jaxinfer.engine.config import EngineConfig
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import PageAllocator, Scheduler, SchedulerConfig, Sequence
from jaxinfer.tune.drive import Measurement, Targets, VirtualClock, drive
from jaxinfer.tune.profile import Profile, expand

StepCost = Callable[[int, int], float]  # (tokens computed in the step, sequences in it) -> seconds, > 0
TOKEN = 1  # the id every simulated step samples (no EOS: requests run to max_tokens)


class _NoText:
    """A detokenizer whose every token is empty text."""

    def step(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class SimulatedEngine:
    """Engine-shaped (`jaxinfer.tune.drive.Server`): the real scheduler, steps timed by `cost` on `clock`.

    Args:
      config: the engine options; the scheduler takes max_num_seqs, max_num_batched_tokens and page_size.
      cost: seconds one step takes, from its tokens and sequences.
      clock: advanced by every step.
      max_model_len: context limit, tokens.
      kv_capacity_tokens: KV cache size in tokens (rounded down to pages).

    Raises:
      ValueError: a capacity of less than one page.
    """

    def __init__(self, config: EngineConfig, cost: StepCost, clock: VirtualClock, max_model_len: int,
                 kv_capacity_tokens: int) -> None:
        pages = kv_capacity_tokens // config.page_size
        if pages < 1:
            raise ValueError(f"kv_capacity_tokens={kv_capacity_tokens} is less than one page of {config.page_size}")
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            page_size=config.page_size, max_model_len=max_model_len),
            PageAllocator(pages + 1), eos_ids=(), clock=clock.now)  # + the null page
        self.cost, self.clock = cost, clock
        self._ids = itertools.count()
        self._live: dict[str, Sequence] = {}

    def add_request(self, prompt: list[int], params: SamplingParams) -> str:
        """Queues one sequence; returns its request id.

        Raises:
          ValueError: as `Scheduler.add` (a request that can never fit the cache or the context).
        """
        seq_id = next(self._ids)
        seq = Sequence(seq_id=seq_id, request_id=f"sim-{seq_id}", prompt_token_ids=prompt, params=params, seed=0,
                       detokenizer=_NoText(), arrival_time=self.clock.now())
        self.scheduler.add(seq)
        self._live[seq.request_id] = seq
        return seq.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        """One scheduling step; the outputs of the requests that got a token.

        Raises:
          RuntimeError: the scheduler planned nothing while requests wait (the simulation would not advance), or
            the cost model gave a step time that is not a finite number > 0.
        """
        plan = self.scheduler.schedule()
        if not plan.chunks:
            raise RuntimeError(f"the scheduler planned no work with {len(self._live)} requests unfinished")
        seconds = self.cost(plan.num_batched_tokens, len(plan.chunks))
        if not 0 < seconds < math.inf:
            raise RuntimeError(f"step cost {seconds!r} s for {plan.num_batched_tokens} tokens, {len(plan.chunks)} "
                               f"sequences: it must be a finite number > 0")
        self.clock.advance(seconds)
        produced = self.scheduler.update(plan, {c.seq.seq_id: TOKEN for c in plan.chunks if c.samples})
        outputs = []
        for seq in produced:
            if seq.is_finished:
                del self._live[seq.request_id]
            outputs.append(RequestOutput(
                request_id=seq.request_id, prompt=None, prompt_token_ids=seq.prompt_token_ids,
                outputs=[CompletionOutput(0, "", list(seq.output_token_ids), seq.finish_reason)],
                finished=seq.is_finished))
        return outputs


def _approximate_encode(text: str) -> list[int]:
    """About one token per 4 characters (English BPE's rule of thumb), for text prompts without a tokenizer."""
    return [TOKEN] * max(1, round(len(text) / 4))


@dataclasses.dataclass
class SimulatedRunner:
    """Runs a configuration on `SimulatedEngine` (a `jaxinfer.tune.sweep.Runner`).

    Attributes:
      cost: the step cost model.
      kv_capacity_tokens: the simulated KV cache, tokens.
      encode: token ids of a text prompt (default: one per 4 characters).
    """

    cost: StepCost
    kv_capacity_tokens: int = 1 << 16
    encode: Callable[[str], list[int]] = _approximate_encode

    def __call__(self, config: EngineConfig, profile: Profile, targets: Targets,
                 max_run_s: float = math.inf) -> tuple[Measurement, dict[str, float]]:
        """(the measurement of `profile` under `config` on a fresh virtual clock, {}: no wall-clock timing)."""
        requests = expand(profile, self.encode, [TOKEN] * max(r.prompt_len or 1 for r in profile.requests))
        max_len = config.max_model_len or max(len(r.prompt) + r.output_len for r in requests)
        clock = VirtualClock()
        engine = SimulatedEngine(config, self.cost, clock, max_len, self.kv_capacity_tokens)
        return drive(engine, requests, clock, targets, max_run_s), {}
