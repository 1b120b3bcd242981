"""When to speculate: per step, how many drafts each decoding sequence gets (0 = plain decode).

Speculation is lossless (`verify.py`), so this decides speed only. The rules (see `config.py`):

1. Batch: with B sequences decoding, a verify step computes up to B * (k + 1) tokens. While that stays within
   `max_step_tokens`, the step is still bound by reading the weights (memory bandwidth) and the extra tokens cost
   little; beyond it the step turns compute-bound and each draft costs about as much as the token it might save.
   So the step's k is `min(num_speculative_tokens, max_step_tokens // B' - 1)`, where B' is B rounded up to a
   power of two (the runner's batch bucket: every step of a bucket then has one verify shape, which warm-up
   compiles); below 1, no drafts. With `disable_by_batch_size`, more than that many decoding sequences also
   means no drafts.
2. Acceptance: each sequence keeps an exponential moving average (weight `EMA_WEIGHT` on the newest step) of its
   acceptance rate, accepted / proposed drafts per verify. Below `min_acceptance_rate`, the sequence gets no
   drafts, except one step in `probe_interval`, which measures again: a sequence that starts copying text
   gets speculation back within `probe_interval` steps.

`DEFAULT_MAX_STEP_TOKENS` per backend is where the step stops being bandwidth-bound. On this project's 2-core CPU
(SmolLM2-135M, float32; BENCHMARKS.md, "Speculative decoding", step cost vs token rows) a step is flat only to
about 4 rows: a batch-1 verify step of 8 rows costs 1.35x a decode step, 16 rows 1.9x, and the verify steps a
limit of 32 would allow at batch 8-16 cost 1.4-2x their batch's decode step, which pays only above ~0.45-0.55
per-draft acceptance; every verify step of at most 8 rows costs <= 1.35x. So the CPU default is 8. Accelerators
read their weights hundreds of times faster than a CPU and have the compute to match, so their knee lies at a
few hundred rows (the GPU value is a guess until `scripts/gpu_check.sh` measures it: its engine section times
the verify step beside the decode step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxinfer.engine.spec_decode.config import SpeculativeConfig

DEFAULT_MAX_STEP_TOKENS = {"cpu": 8, "gpu": 256, "tpu": 256}
EMA_WEIGHT = 0.5


@dataclasses.dataclass
class SpecStats:
    """Counters over the engine's life (tokens and sequence-steps).

    Attributes:
      num_draft_tokens: drafts verified.
      num_accepted_tokens: of those, accepted.
      num_verify_rows: sequence-steps that verified at least one draft.
      num_emitted_tokens: tokens those sequence-steps produced (accepted drafts + the target's own token).
      num_decode_rows: every decode sequence-step, with or without drafts.
      num_decode_tokens: tokens produced by all decode sequence-steps.
      num_verify_steps: engine steps that verified drafts.
      num_off_steps: engine steps with decoding sequences where rule 1 turned speculation off.
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_rows: int = 0
    num_emitted_tokens: int = 0
    num_decode_rows: int = 0
    num_decode_tokens: int = 0
    num_verify_steps: int = 0
    num_off_steps: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """The counters plus acceptance_rate (accepted / drafted), mean_accepted_length (tokens a verifying
        sequence-step produces, accepted + 1; vLLM's mean acceptance length) and tokens_per_decode_step (tokens
        per decode sequence-step, 1.0 without speculation), under "spec_"-prefixed keys."""
        out = {f"spec_{f.name.removeprefix('num_')}": getattr(self, f.name) for f in dataclasses.fields(self)}
        out["spec_acceptance_rate"] = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        out["spec_mean_accepted_length"] = (self.num_emitted_tokens / self.num_verify_rows
                                            if self.num_verify_rows else 0.0)
        out["spec_tokens_per_decode_step"] = (self.num_decode_tokens / self.num_decode_rows
                                              if self.num_decode_rows else 0.0)
        return out


@dataclasses.dataclass
class _SeqState:
    acceptance: float | None = None  # EMA of accepted / proposed; None before the first verify
    steps_off: int = 0  # steps without drafts since acceptance fell below the minimum


class SpeculationPolicy:
    """Decides each step's drafts per sequence (module docstring) and keeps the counters.

    Args:
      config: the speculative config.
      backend: "cpu", "gpu" or "tpu" (picks the default `max_step_tokens`).
    """

    def __init__(self, config: SpeculativeConfig, backend: str) -> None:
        self.config = config
        self.max_step_tokens = config.max_step_tokens or DEFAULT_MAX_STEP_TOKENS.get(backend, 32)
        self.stats = SpecStats()
        self._seqs: dict[int, _SeqState] = {}

    def step_k(self, num_decoding: int) -> int:
        """Rule 1: the most drafts per sequence in a step with `num_decoding` decoding sequences (0: off)."""
        c = self.config
        if num_decoding == 0 or (c.disable_by_batch_size is not None and num_decoding > c.disable_by_batch_size):
            return 0
        bucket = 1 << (num_decoding - 1).bit_length()
        return max(0, min(c.num_speculative_tokens, self.max_step_tokens // bucket - 1))

    def plan(self, decoding_seq_ids: Iterable[int]) -> dict[int, int]:
        """Drafts wanted per decoding sequence this step: {seq_id: k}, only entries with k > 0."""
        ids = list(decoding_seq_ids)
        k = self.step_k(len(ids))
        if k == 0:
            if ids:
                self.stats.num_off_steps += 1
            return {}
        out = {}
        for seq_id in ids:
            state = self._seqs.setdefault(seq_id, _SeqState())
            if state.acceptance is not None and state.acceptance < self.config.min_acceptance_rate:
                state.steps_off += 1
                if state.steps_off < self.config.probe_interval:
                    continue
                state.steps_off = 0  # probe
            out[seq_id] = k
        return out

    def record(self, seq_id: int, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """One decode sequence-step's outcome: drafts verified, accepted, tokens appended (before stop rules cut
        them: the tokens the step produced)."""
        s = self.stats
        s.num_decode_rows += 1
        s.num_decode_tokens += num_emitted
        if num_drafts == 0:
            return
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.num_verify_rows += 1
        s.num_emitted_tokens += num_emitted
        state = self._seqs.setdefault(seq_id, _SeqState())
        rate = num_accepted / num_drafts
        state.acceptance = rate if state.acceptance is None else EMA_WEIGHT * rate + (1 - EMA_WEIGHT) * state.acceptance

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's state."""
        self._seqs.pop(seq_id, None)
