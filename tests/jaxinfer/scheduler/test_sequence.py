"""Sequence: token views and the streaming cursor with stop-string hold-back."""

from __future__ import annotations

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import SequenceStatus
from tests.jaxinfer.scheduler.fake_model import make_seq


def test_token_views() -> None:
    seq = make_seq(1, [5, 6, 7], SamplingParams())
    assert (seq.last_token_id, seq.num_tokens, seq.is_decoding, seq.num_new_tokens_to_compute) == (7, 3, False, 3)
    seq.output_token_ids += [8, 9]
    seq.num_computed_tokens = 4
    assert seq.token_ids == [5, 6, 7, 8, 9] and seq.last_token_id == 9 and seq.is_decoding
    for start in range(6):
        for stop in range(start, 6):
            assert seq.token_slice(start, stop) == seq.token_ids[start:stop]


def test_stream_delta_holds_back_a_possible_stop_string_start_until_finished() -> None:
    seq = make_seq(1, [5], SamplingParams(stop=["xyz", "q"]))  # longest stop has 3 chars: hold back 2
    seq.output_token_ids.append(1)
    seq.text = "abcde"
    assert seq.stream_delta() == ([1], "abc")
    assert seq.stream_delta() == ([], "")
    seq.output_token_ids.append(2)
    seq.text = "abcdefx"
    assert seq.stream_delta() == ([2], "de")  # "fx" could start "xyz"
    seq.text = "abcdef"  # a stop string cut "x..." off: it was never emitted
    seq.status = SequenceStatus.FINISHED_STOPPED
    assert seq.stream_delta() == ([], "f")
    assert seq.emitted_text_len == len(seq.text)


def test_stream_delta_without_stop_strings_holds_nothing_back() -> None:
    seq = make_seq(1, [5], SamplingParams())
    seq.output_token_ids.append(3)
    seq.text = "d"
    assert seq.stream_delta() == ([3], "d")
