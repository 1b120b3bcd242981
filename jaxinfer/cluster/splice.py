"""`StreamSplice`: one client stream out of a request's attempts on several replicas (no Ray).

A request's outputs may come from more than one engine: a prefill replica's first token, then a decode replica's
stream from the handed-over K/V (`jaxinfer.cluster.disagg`); or a replica that died mid-stream, then another that
resumes with the tokens already streamed as output so far (`Engine.add_request(..., output_token_ids=...)`). The
later engine's outputs already continue the earlier ones: their cumulative `token_ids` and `text` hold the
earlier tokens, their deltas hold only new ones, and seeds, penalties, `min_tokens`, `max_tokens` and stop strings
count the earlier tokens (`jaxinfer.engine.admission`). What the router fixes, per output (`patch`):

1. A prefill replica's last output ends with finish_reason "handoff": to the client it is a running output.
2. Logprobs: the later engine's entries for the earlier tokens are `{}` and its `cumulative_logprob` sums its own
   tokens: the earlier entries are put back and their sum added. Prompt logprobs (asked without streaming) come
   from the first attempt; a resumed attempt is sent without them (`next_attempt`).
3. `num_cached_tokens` is the first attempt's (the prompt's cache hit as the client's request met it).
4. Times: each engine reports its own clock (`time.perf_counter`, not shared between machines). A later attempt's
   times are moved to the first attempt's clock by the difference of the two clocks' offsets to the router's,
   each measured when an attempt's first output with a token time arrives (the Ray hop, milliseconds, is the
   error); arrival, first scheduling and first token stay the first attempt's, and the decode speed is recomputed.

Only a request of one sample (n = 1) can resume after it streamed tokens (one list of ids continues one sample);
one of n > 1 is resubmitted only if nothing of it was streamed (`can_resume`).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.outputs import Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams

HANDOFF = "handoff"  # the finish_reason of a prefill-only request (`Engine.add_request(prefill_only=True)`)


class StreamSplice:
    """What a client has been sent of one request, and the patch that makes a later attempt continue it.

    Args:
      params: the request's sampling parameters (with its seed resolved, so that every attempt draws the same keys).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.token_ids: list[int] = []  # sample 0's output ids streamed so far
        self.attempts = 0
        self._streamed = False  # any output with a token was sent (any sample)
        self._logprobs: list[dict[int, Logprob]] | None = None
        self._cumulative_logprob: float | None = None
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._num_cached_tokens: int | None = None
        self._base = 0  # tokens streamed before this attempt
        self._base_logprob = 0.0
        self._first: RequestMetrics | None = None  # the first attempt that sent a token: its times
        self._first_offset: float | None = None  # router clock - that attempt's engine clock, seconds
        self._first_attempt = 0
        self._offset: float | None = None  # router clock - this attempt's engine clock, seconds

    def can_resume(self) -> bool:
        """Whether another replica can continue the request (module docstring, last paragraph)."""
        return not self._streamed or (self.params.n == 1 and (
            self.params.prompt_logprobs is None or self._prompt_logprobs is not None))

    def next_attempt(self) -> tuple[SamplingParams, list[int]]:
        """Starts an attempt; returns its sampling parameters and output so far (`output_token_ids`).

        Raises:
          ValueError: `can_resume()` is False (the caller checks it first).
        """
        if not self.can_resume():
            raise ValueError("a request of n > 1 samples cannot resume after it streamed tokens")
        self.attempts += 1
        self._base, self._offset = len(self.token_ids), None
        self._base_logprob = self._cumulative_logprob or 0.0
        params = self.params
        if self.token_ids and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)  # the client has them (module item 2)
        return params, list(self.token_ids)

    def patch(self, out: RequestOutput, now: float) -> RequestOutput:
        """An attempt's output as the client's stream continues (module docstring, items 1-4), recorded as sent.

        Args:
          out: the engine's output (changed in place).
          now: the router's clock (`time.perf_counter()`) when it arrived.
        """
        if any(c.finish_reason == HANDOFF for c in out.outputs):
            out.finished = False
            for c in out.outputs:
                c.finish_reason = None if c.finish_reason == HANDOFF else c.finish_reason
            if out.metrics is not None:
                out.metrics = dataclasses.replace(out.metrics, finish_time=None)
        self._patch_times(out, now)
        if self._num_cached_tokens is None:
            self._num_cached_tokens = out.num_cached_tokens
        out.num_cached_tokens = self._num_cached_tokens
        if out.prompt_logprobs is None:
            out.prompt_logprobs = self._prompt_logprobs
        self._prompt_logprobs = out.prompt_logprobs
        self._streamed = self._streamed or any(c.token_ids for c in out.outputs)
        if len(out.outputs) != 1:
            return out
        c = out.outputs[0]
        if self._base and c.logprobs is not None and self._logprobs is not None:
            c.logprobs[: self._base] = self._logprobs[: self._base]
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + self._base_logprob
        self.token_ids, self._logprobs, self._cumulative_logprob = list(c.token_ids), c.logprobs, c.cumulative_logprob
        return out

    def _patch_times(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        if m is None:
            return
        if self._offset is None and m.last_token_time is not None:
            self._offset = now - m.last_token_time
        if self._first is None and m.first_token_time is not None:
            self._first, self._first_offset, self._first_attempt = m, self._offset, self.attempts
        if self._first is None or self._first_attempt == self.attempts:
            return  # the first attempt's times are the stream's own
        first = self._first
        shift = 0.0 if self._offset is None or self._first_offset is None else self._offset - self._first_offset

        def moved(t: float | None) -> float | None:
            return None if t is None else t + shift

        finish = moved(m.finish_time) if out.finished else None
        num_out = max((len(c.token_ids) for c in out.outputs), default=0)
        decode_s = finish - first.first_token_time if finish is not None else 0.0
        out.metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_token_time=first.first_token_time, finish_time=finish,
            ttft_s=first.ttft_s, decode_tokens_per_s=(num_out - 1) / decode_s if num_out > 1 and decode_s > 0 else 0.0,
            first_scheduled_time=first.first_scheduled_time, last_token_time=moved(m.last_token_time))
