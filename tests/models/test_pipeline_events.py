"""The bubble arithmetic of `models.pipeline_events` on hand-made intervals (the recording itself runs in
tests/jaxinfer/benchmarks/test_pipeline.py, which needs several devices)."""

from __future__ import annotations

import numpy as np
import pytest

from models.pipeline_events import EventLog, Interval, idle_shares, textbook_idle


def test_textbook_idle():
    assert textbook_idle(1, 2) == 1 / 2  # 1 of 2 ticks idle
    assert textbook_idle(8, 4) == 3 / 11


def test_idle_shares_of_a_two_stage_schedule():
    # 2 stages, 2 micro-batches of 10 ns each, a perfect GPipe schedule: ticks [0, 10), [10, 20), [20, 30).
    # Stage 0 works in ticks 0, 1; stage 1 in ticks 1, 2: each busy 20 of 30 ns, idle 1/3 = (2-1)/(2+2-1).
    iv = [Interval(0, 0, 0, 10), Interval(0, 1, 10, 20), Interval(1, 0, 10, 20), Interval(1, 1, 20, 30)]
    got = idle_shares(iv, 2)
    np.testing.assert_allclose(got["idle"], [textbook_idle(2, 2)] * 2)
    assert got["micro"] == 2 and got["span_ms"] == 30e-6
    # stage 1's second micro-batch takes 3x as long: span 50, stage 0 idles 30/50, stage 1 (10 + 30) busy, 10/50
    slow = iv[:3] + [Interval(1, 1, 20, 50)]
    np.testing.assert_allclose(idle_shares(slow, 2)["idle"], [0.6, 0.2])
    with pytest.raises(ValueError, match="same number of intervals"):
        idle_shares(iv[:3], 2)


def test_event_log_pairs_stamps_and_refuses_open_intervals():
    log = EventLog()
    log._stamp(0, np.int32(1), np.int32(0), np.float32(0))
    with pytest.raises(RuntimeError, match="still open"):
        log.take()
    log._stamp(1, np.int32(1), np.int32(0), np.float32(0))
    [one] = log.take()
    assert (one.stage, one.micro) == (1, 0) and one.end_ns >= one.start_ns and log.take() == []
