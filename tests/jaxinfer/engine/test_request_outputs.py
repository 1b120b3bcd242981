"""`request_metrics`: a request's times from its samples' sequences (earliest first token and scheduling, latest
token and finish)."""

from __future__ import annotations

from jaxinfer.engine.request_outputs import request_metrics
from jaxinfer.sampling_params import SamplingParams
from tests.jaxinfer.scheduler.fake_model import make_seq


def _seq(seq_id: int, scheduled: float | None, first: float | None, last: float | None, finish: float | None,
         num_tokens: int):
    seq = make_seq(seq_id, [1, 2], SamplingParams(), arrival_time=1.0, request_id="r")
    seq.first_scheduled_time, seq.first_token_time = scheduled, first
    seq.last_token_time, seq.finish_time = last, finish
    seq.output_token_ids = list(range(num_tokens))
    return seq


def test_times_span_the_request_s_samples():
    one, two = _seq(1, 2.0, 3.0, 6.0, 6.0, 4), _seq(2, 2.5, 4.0, 7.0, None, 2)
    running = request_metrics([one, two], arrival_time=1.0, finished=False)
    assert (running.first_scheduled_time, running.first_token_time, running.last_token_time) == (2.0, 3.0, 7.0)
    assert running.finish_time is None and running.ttft_s == 2.0 and running.decode_tokens_per_s == 0.0
    two.finish_time = 7.0
    done = request_metrics([one, two], arrival_time=1.0, finished=True)
    assert (done.finish_time, done.last_token_time) == (7.0, 7.0)
    assert done.decode_tokens_per_s == (4 - 1) / (7.0 - 3.0)  # the longest sample over first token to finish


def test_a_request_not_scheduled_yet_has_no_times():
    m = request_metrics([_seq(1, None, None, None, None, 0)], arrival_time=1.0, finished=False)
    assert (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finish_time) == (None,) * 4
