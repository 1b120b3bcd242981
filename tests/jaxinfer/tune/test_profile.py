"""Traffic profiles of `jaxinfer tune`: JSONL requests and length histograms, their seeded expansion, and errors
that name the file, the line and the field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxinfer.tune.profile import Profile, TrafficRequest, expand, load_profile, parse_jsonl


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_jsonl_requests_with_arrivals_start_at_the_first_and_sort(tmp_path):
    path = _write(tmp_path, "t.jsonl", "\n".join([
        '{"prompt_len": 100, "output_len": 8, "arrival_s": 5.5}',
        "",
        '{"prompt": "hello there", "max_tokens": 3, "arrival_s": 2.0}']))
    p = load_profile(path)
    assert p.requests == (TrafficRequest(0.0, 3, None, "hello there"), TrafficRequest(3.5, 8, 100, None))
    assert p.description.startswith("2 requests (t.jsonl), input tokens median 100 / max 100")


def test_jsonl_without_arrivals_is_all_at_once_or_poisson(tmp_path):
    path = _write(tmp_path, "t.jsonl", '{"prompt_len": 10, "output_len": 2}\n' * 2000)
    assert {r.arrival_s for r in load_profile(path).requests} == {0.0}
    reqs = load_profile(path, rate_per_s=4.0, seed=7).requests
    gaps = np.diff([r.arrival_s for r in reqs])
    assert reqs[0].arrival_s == 0.0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential gaps of mean 1 / rate
    assert load_profile(path, rate_per_s=4.0, seed=7).requests == reqs  # seeded


@pytest.mark.parametrize("lines, match", [
    (['{"prompt_len": 4, "output_len": 2}', '{"prompt_len": 4, "output_len": 2'], r"t\.jsonl:2: not valid JSON"),
    (['[1, 2]'], r"t\.jsonl:1: a request must be a JSON object"),
    (['{"prompt_len": 4, "max_token": 2}'], r"t\.jsonl:1: unknown key\(s\) 'max_token' \(did you mean 'max_tokens'"),
    (['{"prompt": "x", "prompt_len": 4, "max_tokens": 2}'], r"t\.jsonl:1: give exactly one of prompt"),
    (['{"prompt_len": 4}'], r"t\.jsonl:1: give exactly one of max_tokens and output_len"),
    (['{"prompt_len": 0, "max_tokens": 2}'], r"t\.jsonl:1: prompt_len must be an integer >= 1, got 0"),
    (['{"prompt_len": 4, "max_tokens": true}'], r"t\.jsonl:1: max_tokens must be an integer >= 1"),
    (['{"prompt": "", "max_tokens": 2}'], r"t\.jsonl:1: prompt must be non-empty text"),
    (['{"prompt_len": 4, "max_tokens": 2, "arrival_s": -1}'], r"t\.jsonl:1: arrival_s must be a number"),
    (['{"prompt_len": 4, "max_tokens": 2, "arrival_s": 0}', '{"prompt_len": 4, "max_tokens": 2}'],
     r"t\.jsonl:2: arrival_s must be on every line or on none"),
    (["", "  "], r"t\.jsonl: no requests"),
])
def test_bad_jsonl_lines_are_named(tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        load_profile(_write(tmp_path, "t.jsonl", "\n".join(lines)))


def test_histograms_draw_lengths_with_their_weights(tmp_path):
    spec = {"input_lens": [[32, 3], [256, 1]], "output_lens": [[16, 1], [64, 1]], "rate_per_s": "inf",
            "num_requests": 4000, "seed": 5}
    p = load_profile(_write(tmp_path, "h.json", json.dumps(spec)))
    ins = np.array([r.prompt_len for r in p.requests])
    outs = np.array([r.output_len for r in p.requests])
    assert set(ins) == {32, 256} and set(outs) == {16, 64}
    assert np.mean(ins == 32) == pytest.approx(0.75, abs=0.03)  # weights 3 : 1
    assert np.mean(outs == 16) == pytest.approx(0.5, abs=0.03)
    assert {r.arrival_s for r in p.requests} == {0.0}
    again = load_profile(_write(tmp_path, "h2.json", json.dumps(spec)))
    assert again.requests == p.requests
    timed = load_profile(_write(tmp_path, "h3.json", json.dumps({**spec, "rate_per_s": 2})))
    assert timed.requests[-1].arrival_s == pytest.approx(4000 / 2, rel=0.1)  # Poisson: n / rate on average


@pytest.mark.parametrize("spec, match", [
    ({"input_lens": [[32, 1]], "output_lens": [[8, 1]]}, r"h\.json: missing num_requests"),
    ({"input_lens": [[32, 1], [64, -1]], "output_lens": [[8, 1]], "num_requests": 2},
     r"h\.json: input_lens\[1\] weight must be a number > 0"),
    ({"input_lens": [[0, 1]], "output_lens": [[8, 1]], "num_requests": 2}, r"h\.json: input_lens\[0\] length"),
    ({"input_lens": [32], "output_lens": [[8, 1]], "num_requests": 2}, r"input_lens\[0\] must be a \[length, weight\]"),
    ({"input_lens": [], "output_lens": [[8, 1]], "num_requests": 2}, r"input_lens must be a non-empty list"),
    ({"input_lens": [[32, 1]], "output_lens": [[8, 1]], "num_requests": 2, "rate_per_s": 0},
     r"h\.json: rate_per_s must be a number > 0"),
    ({"input_lens": [[32, 1]], "output_lens": [[8, 1]], "num_requests": 2, "rate": 1}, r"unknown key\(s\) 'rate'"),
])
def test_bad_histograms_are_named(tmp_path, spec, match):
    with pytest.raises(ValueError, match=match):
        load_profile(_write(tmp_path, "h.json", json.dumps(spec)))


def test_unreadable_profile_is_named(tmp_path):
    with pytest.raises(ValueError, match="profile .*missing.jsonl: cannot be read"):
        load_profile(tmp_path / "missing.jsonl")


def test_expand_encodes_text_and_cuts_lengths_from_the_text():
    reqs = (TrafficRequest(0.0, 4, 3), TrafficRequest(1.0, 2, None, "ab c"), TrafficRequest(2.0, 1, 4))
    out = expand(Profile(reqs, ""), lambda text: [ord(c) for c in text], list(range(100, 106)))
    # lengths 3 then 4 from [100..105]: the second would run past the end, so it starts over
    assert [(r.arrival_s, r.prompt, r.output_len) for r in out] == [
        (0.0, [100, 101, 102], 4), (1.0, [97, 98, 32, 99], 2), (2.0, [100, 101, 102, 103], 1)]
    with pytest.raises(ValueError, match="^profile request 1: its prompt encodes to no tokens"):
        expand(Profile((TrafficRequest(0.0, 1, None, "x"),), ""), lambda text: [], [1])
    # a JSONL request is named by its line, as the parse errors name theirs (1-based), after sorting by arrival
    reqs = parse_jsonl('{"prompt": "a", "output_len": 1, "arrival_s": 1}\n\n{"prompt": "b", "output_len": 1, '
                       '"arrival_s": 0}', "t.jsonl")
    assert [r.prompt for r in reqs] == ["b", "a"]
    with pytest.raises(ValueError, match="^t.jsonl:3: its prompt encodes to no tokens"):
        expand(Profile(tuple(reqs), ""), lambda text: [] if text == "b" else [1], [1])
    with pytest.raises(ValueError, match="^t.jsonl:1: its prompt encodes to no tokens"):
        expand(Profile(tuple(reqs), ""), lambda text: [] if text == "a" else [1], [1])
    assert math.isfinite(out[-1].arrival_s)


def test_the_benchmark_profile_parses(data_dir):
    # tests/data/tune_chat.json: the traffic of BENCHMARKS.md's "Tuning" section.
    p = load_profile(data_dir / "tune_chat.json")
    assert len(p.requests) == 16 and {r.prompt_len for r in p.requests} <= {48, 160, 400}
    assert p.requests[0].arrival_s == 0 and p.requests[-1].arrival_s > 0
