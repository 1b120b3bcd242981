"""The `RequestOutput` of one request at one step: its samples' cumulative text and ids, this step's deltas, and
its latency metrics (seconds, `time.perf_counter` clock)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.scheduler.sequence import Sequence as Seq


def request_metrics(seqs: Sequence[Seq], arrival_time: float, finished: bool) -> RequestMetrics:
    """TTFT from the earliest first token of the request's samples; decode speed over the longest sample, once
    finished (0.0 before); the earliest first scheduling and the latest token of its samples."""
    first = [s.first_token_time for s in seqs if s.first_token_time is not None]
    ends = [s.finish_time for s in seqs if s.finish_time is not None]
    scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    last = [s.last_token_time for s in seqs if s.last_token_time is not None]
    num_out = max((len(s.output_token_ids) for s in seqs), default=0)
    ttft = (min(first) - arrival_time) if first else 0.0
    decode_time = (max(ends) - min(first)) if first and ends and finished else 0.0
    return RequestMetrics(
        arrival_time=arrival_time, first_token_time=min(first) if first else None,
        finish_time=max(ends) if ends and finished else None, ttft_s=ttft,
        decode_tokens_per_s=(num_out - 1) / decode_time if num_out > 1 and decode_time > 0 else 0.0,
        first_scheduled_time=min(scheduled, default=None), last_token_time=max(last, default=None))


def request_output(request_id: str, prompt: str | None, prompt_token_ids: Sequence[int], seqs: Sequence[Seq],
                   arrival_time: float, deltas: Sequence[tuple[list[int], str]],
                   logprobs: Sequence[tuple[list[dict[int, Logprob]], float] | None],
                   finished: bool, prompt_logprobs: list[dict[int, Logprob] | None] | None = None) -> RequestOutput:
    """One request's output.

    Args:
      request_id, prompt, prompt_token_ids, arrival_time: the request's.
      seqs: its samples' sequences, in sample order.
      deltas: per sample, (token ids, text) new since the last output.
      logprobs: per sample, the logprobs of its output tokens so far and the sum of the sampled tokens', or None
        when not asked for.
      finished: every sample has finished.
      prompt_logprobs: the request's (`jaxinfer.engine.prompt_logprobs`), or None when not asked for.
    """
    completions = [CompletionOutput(index=seq.sample_index, text=seq.text, token_ids=list(seq.output_token_ids),
                                    finish_reason=seq.finish_reason, delta_text=delta_text,
                                    delta_token_ids=delta_ids, logprobs=None if lp is None else lp[0],
                                    error=seq.error, error_kind=seq.error_kind, cumulative_logprob=None if lp is None else lp[1],
                                    stop_reason=seq.stop_reason)
                   for seq, (delta_ids, delta_text), lp in zip(seqs, deltas, logprobs)]
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         outputs=completions, finished=finished, metrics=request_metrics(seqs, arrival_time, finished),
                         num_cached_tokens=max(s.num_cached_tokens for s in seqs), prompt_logprobs=prompt_logprobs)
