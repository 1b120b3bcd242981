"""Stop rules on hand-picked tokens. Pieces (fake_model.piece): 1 -> "bb", 2 -> "ccc", 3 -> "d", 4 -> "ee",
45 -> "T" (held until the next token or flush), 0 -> EOS ("")."""

from __future__ import annotations

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.stop_checker import append_token
from tests.jaxinfer.scheduler.fake_model import EOS_ID, make_seq

EOS = frozenset({EOS_ID})


def feed(tokens: list[int], max_model_len: int = 100, prompt: tuple[int, ...] = (7,), **params):
    """Feeds tokens until one finishes the sequence; returns (seq, reason, tokens fed)."""
    seq = make_seq(1, list(prompt), SamplingParams(**params))
    for n, t in enumerate(tokens, 1):
        reason = append_token(seq, t, EOS, max_model_len)
        if reason is not None:
            return seq, reason, n
    return seq, None, len(tokens)


def test_eos_stops_and_stays_in_the_ids_unless_ignored() -> None:
    seq, reason, n = feed([1, EOS_ID, 2])
    assert (reason, n, seq.output_token_ids, seq.text, seq.stop_reason) == ("stop", 2, [1, EOS_ID], "bb", None)
    seq, reason, n = feed([1, EOS_ID, 2], ignore_eos=True)
    assert reason is None and seq.text == "bbccc" and seq.stop_reason is None


def test_stop_token_id_stops_and_stays_in_the_ids() -> None:
    seq, reason, n = feed([1, 3, 2], stop_token_ids=[3])
    assert (reason, seq.output_token_ids, seq.text, seq.stop_reason) == ("stop", [1, 3], "bbd", 3)


def test_stop_reason_is_the_stop_id_or_string_and_none_for_eos_and_length() -> None:
    """vLLM's stop_reason: the stop token id or the stop string that matched; None for EOS (checked first, also
    when listed among the stop ids) and for "length"."""
    assert feed([1, EOS_ID], stop_token_ids=[EOS_ID])[0].stop_reason is None
    assert feed([1, EOS_ID], stop_token_ids=[EOS_ID], ignore_eos=True)[0].stop_reason == EOS_ID
    seq, reason, _ = feed([3, 1, 2], stop=["cc", "dbbc"], stop_token_ids=[4])
    assert (reason, seq.stop_reason) == ("stop", "dbbc")  # the string that matched (earliest), not the other
    seq, reason, _ = feed([1, 2, 4], stop=["cc"], stop_token_ids=[4])
    assert (reason, seq.stop_reason) == ("stop", "cc")
    seq, reason, _ = feed([1, 2, 3], stop=["zz"], stop_token_ids=[4], max_tokens=2)
    assert (reason, seq.stop_reason) == ("length", None)


@pytest.mark.parametrize("include, text", [(False, "b"), (True, "bbc")])
def test_stop_string_spanning_tokens_and_ending_inside_a_token(include: bool, text: str) -> None:
    # "bb" + "ccc" = "bbccc"; "bc" starts at 1 and ends inside "ccc"; the ids keep the token that completed it.
    seq, reason, n = feed([1, 2, 3], stop="bc", include_stop_str_in_output=include)
    assert (reason, seq.output_token_ids, seq.text) == ("stop", [1, 2], text)


def test_earliest_stop_string_wins() -> None:
    seq, reason, _ = feed([3, 1, 2], stop=["cc", "dbbc"])  # "dbbccc": "dbbc" at 0, "cc" at 3
    assert (reason, seq.text) == ("stop", "")


def test_stop_string_in_held_text_is_found_when_released() -> None:
    seq, reason, n = feed([45, 1, 2], stop="Tb")
    assert (reason, n, seq.text) == ("stop", 2, "")


def test_min_tokens_defers_stop_ids_and_stop_strings() -> None:
    seq, reason, n = feed([EOS_ID, 3, EOS_ID], min_tokens=2)
    assert (reason, n) == ("stop", 3)
    seq, reason, n = feed([EOS_ID, EOS_ID], min_tokens=2)
    assert (reason, n) == ("stop", 2)
    # "bb" completes at n=1 < min_tokens: not a stop, and not found later (it does not end in new text)
    seq, reason, n = feed([1, 3, 4], stop="bb", min_tokens=2, max_tokens=5)
    assert reason is None and seq.text == "bbdee"


def test_max_tokens_gives_length_and_flushes_held_text() -> None:
    seq, reason, n = feed([1, 45, 2], max_tokens=2)
    assert (reason, n, seq.output_token_ids, seq.text, seq.stop_reason) == ("length", 2, [1, 45], "bbT", None)


def test_stop_string_match_skips_the_flush() -> None:
    # "d" completes at n=1, before min_tokens; at n=2 (a held token, no new text) the search window still reaches
    # it (it starts len("xyz") - 1 chars back), so the sequence stops there and the held "T" is dropped.
    seq, reason, n = feed([3, 45], stop=["d", "xyz"], min_tokens=2, max_tokens=2)
    assert (reason, n, seq.text) == ("stop", 2, "")
    seq, reason, n = feed([3, 45], stop=["q", "xyz"], min_tokens=2, max_tokens=2)
    assert (reason, n, seq.text) == ("length", 2, "dT")


def test_context_limit_gives_length() -> None:
    seq, reason, n = feed([1, 2, 3, 4], max_model_len=4, prompt=(7, 7), max_tokens=10)
    assert (reason, n) == ("length", 2)


def test_stop_beats_length_on_the_same_token() -> None:
    assert feed([EOS_ID], max_tokens=1)[1] == "stop"
    assert feed([1], max_tokens=1)[1] == "length"
