"""`StreamSplice` on hand-made outputs of two attempts (no Ray, no engine): a prefill replica's first token, then a
decode replica that continues it on a clock of its own; the numbers are worked out in the comments."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import SamplingParams
from jaxinfer.cluster.splice import StreamSplice
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _out(ids, logprobs, cumulative, finish_reason, times, num_cached=0, prompt_logprobs=None) -> RequestOutput:
    arrival, first, last, finish = times
    c = CompletionOutput(0, " ".join(f"w{i}" for i in ids), list(ids), finish_reason, logprobs=logprobs,
                         cumulative_logprob=cumulative)
    return RequestOutput("r", None, [3, 4], [c], finish_reason is not None,
                         RequestMetrics(arrival, first, finish, 0.0 if first is None else first - arrival, 0.0,
                                        arrival, last), num_cached, prompt_logprobs)


def test_a_handoff_becomes_one_stream_with_logprobs_and_times_on_the_first_clock():
    splice = StreamSplice(SamplingParams(max_tokens=3, logprobs=1, seed=1))
    assert splice.next_attempt() == (splice.params, [])
    # the prefill replica, clock P: arrived at 100, first token at 101; the router sees it at 1001 (offset 900)
    first = splice.patch(_out([5], [{5: Logprob(-0.5)}], -0.5, "handoff", (100.0, 101.0, 101.0, 101.0), 8), 1001.0)
    assert not first.finished and first.outputs[0].finish_reason is None and first.metrics.finish_time is None
    assert splice.next_attempt() == (splice.params, [5])
    # the decode replica, clock D: its output at 50 reaches the router at 1002 (offset 952): shift 52 onto clock P
    mid = splice.patch(_out([5, 6], [{}, {6: Logprob(-1.0)}], -1.0, None, (49.0, None, 50.0, None)), 1002.0)
    c = mid.outputs[0]
    assert c.logprobs == [{5: Logprob(-0.5)}, {6: Logprob(-1.0)}] and c.cumulative_logprob == -1.5
    assert mid.num_cached_tokens == 8  # the first attempt's prompt cache hit
    m = mid.metrics
    assert (m.arrival_time, m.first_token_time, m.last_token_time, m.ttft_s) == (100.0, 101.0, 102.0, 1.0)
    last = splice.patch(_out([5, 6, 7], [{}, {6: Logprob(-1.0)}, {7: Logprob(-2.0)}], -3.0, "length",
                             (49.0, 50.5, 51.0, 51.0)), 1003.0)
    m = last.metrics
    assert last.finished and m.finish_time == 103.0 and m.decode_tokens_per_s == 2 / (103.0 - 101.0)
    assert last.outputs[0].cumulative_logprob == -3.5 and splice.token_ids == [5, 6, 7]


def test_what_can_resume():
    two = StreamSplice(SamplingParams(n=2, max_tokens=4, seed=1))
    assert two.can_resume()  # nothing streamed yet: it is sent again as it was
    two.next_attempt()
    out = _out([5], None, None, None, (0.0, 1.0, 1.0, None))
    out.outputs.append(dataclasses.replace(out.outputs[0], index=1))
    two.patch(out, 2.0)
    assert not two.can_resume()
    with pytest.raises(ValueError, match="n > 1"):
        two.next_attempt()
    asked = StreamSplice(SamplingParams(max_tokens=4, prompt_logprobs=1, seed=1))
    asked.next_attempt()
    asked.patch(_out([5], None, None, None, (0.0, 1.0, 1.0, None), prompt_logprobs=[None, {4: Logprob(-1.0)}]), 2.0)
    params, ids = asked.next_attempt()  # the client has the prompt logprobs: the resumed attempt is sent without
    assert params.prompt_logprobs is None and ids == [5]
    resumed = asked.patch(_out([5, 6], None, None, None, (5.0, None, 6.0, None)), 3.0)
    assert resumed.prompt_logprobs == [None, {4: Logprob(-1.0)}]
