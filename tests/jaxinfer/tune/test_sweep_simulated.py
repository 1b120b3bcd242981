"""`jaxinfer tune`'s search over the real scheduler with a fake step-cost model on a virtual clock: the simulator
against a hand-worked example, the early-stop rule against full runs, and a sweep that finds a configuration
meeting a p99 TPOT target the default EngineConfig misses, written as a config file that loads back."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.benchmarks.serving_scenarios import Request
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.config_file import load_config_file, write_config_file
from jaxinfer.tune.drive import Targets, VirtualClock, drive, misses_to_fail
from jaxinfer.tune.profile import Profile, TrafficRequest, parse_histograms
from jaxinfer.tune.simulate import SimulatedEngine, SimulatedRunner
from jaxinfer.tune.sweep import best, pareto_front, plan, sweep


def _profile(reqs: list[TrafficRequest]) -> Profile:
    return Profile(tuple(reqs), "test")


def test_simulator_worked_example():
    # Every step costs 1 s; max_num_batched_tokens=3. A (prompt 4, output 3) arrives at 0, B (prompt 2, output 2)
    # at 0.5.
    #   step 1, t 0 -> 1: A's first 3 prompt tokens (no sample yet)          tokens 3, seqs 1
    #   step 2, t 1 -> 2: A's last prompt token + B's 2 prompt tokens: both sample their first token at 2
    #   step 3, t 2 -> 3: both decode; B has its 2 tokens and finishes at 3       tokens 2, seqs 2
    #   step 4, t 3 -> 4: A decodes its third token and finishes at 4            tokens 1, seqs 1
    # TTFT: A 2 - 0 = 2, B 2 - 0.5 = 1.5. TPOT: A (4 - 2) / 2 = 1, B (3 - 2) / 1 = 1. 5 tokens over 4 s.
    calls = []

    def cost(tokens: int, seqs: int) -> float:
        calls.append((tokens, seqs))
        return 1.0

    clock = VirtualClock()
    engine = SimulatedEngine(EngineConfig(max_num_batched_tokens=3, page_size=2), cost, clock, max_model_len=16,
                             kv_capacity_tokens=64)
    m = drive(engine, [Request(0.0, [5, 6, 7, 8], 3), Request(0.5, [9, 10], 2)], clock)
    assert calls == [(3, 1), (3, 2), (2, 2), (1, 1)]
    assert m.ttft_s == [2.0, 1.5] and m.tpot_s == [1.0, 1.0]
    assert (m.output_tokens, m.wall_s, m.num_finished, m.stopped) == (5, 4.0, 2, None)
    assert m.summary()["output_tok_s"] == 5 / 4


@pytest.mark.parametrize("n", [1, 2, 5, 50, 99, 100, 101, 250])
def test_misses_to_fail_makes_the_p99_miss(n):
    # With misses_to_fail(n) values over the target, numpy's p99 is over it, whatever the values are.
    rng = np.random.default_rng(n)
    m = misses_to_fail(n)
    assert 1 <= m <= n
    for _ in range(20):
        under = rng.uniform(0, 1, n - m)  # at or under the target 1
        over = 1 + rng.uniform(1e-9, 1, m)
        assert np.percentile(np.concatenate([under, over]), 99) > 1


def _mixed_profile(num_requests: int = 60, seed: int = 1, rate: float = 6.0) -> Profile:
    """Mostly short prompts, some long ones: long prefill chunks stall the decodes that share their steps."""
    return _profile(parse_histograms({"input_lens": [[64, 7], [1024, 3]], "output_lens": [[64, 1]],
                                      "rate_per_s": rate, "num_requests": num_requests, "seed": seed}, "mixed"))


def linear_cost(tokens: int, seqs: int) -> float:
    """A step: 5 ms fixed, 0.3 ms per token computed, 0.5 ms per sequence (a 512-token prefill chunk: ~160 ms)."""
    return 0.005 + 0.0003 * tokens + 0.0005 * seqs


TARGETS = Targets(ttft_p99_s=2.0, tpot_p99_s=0.06)
SPACE = {"max_num_seqs": [4, 8, 32], "max_num_batched_tokens": [64, 128, 256, 512]}


def test_sweep_finds_a_config_meeting_the_tpot_target_the_default_misses(tmp_path):
    profile = _mixed_profile()
    runner = SimulatedRunner(linear_cost)
    candidates, skipped, size = plan(SPACE, {}, budget=12)
    assert (len(candidates), skipped, size) == (12, [], 12)
    assert candidates[0] == {"max_num_seqs": 32, "max_num_batched_tokens": 512}  # EngineConfig's defaults
    trials = sweep(runner, profile, {}, candidates, TARGETS)
    # Independent of the early stops: every candidate's complete run, judged against the targets afterwards.
    full = [runner(EngineConfig.create(**c), profile, Targets())[0].summary() for c in candidates]
    meets = [TARGETS.met(f["ttft_p99_s"], f["tpot_p99_s"]) for f in full]
    assert full[0]["tpot_p99_s"] > TARGETS.tpot_p99_s and not meets[0]  # the default misses the TPOT target
    assert trials[0].is_default and trials[0].status in ("misses", "pruned")
    for t, f, ok in zip(trials, full, meets):
        assert t.status in ("meets", "misses", "pruned"), t
        assert (t.status == "meets") == ok, (t.knobs, t.status, f)
        if t.status != "pruned":
            assert t.metrics["output_tok_s"] == pytest.approx(f["output_tok_s"])
    assert any(t.status == "pruned" for t in trials)  # the rule stopped some runs early
    winner = best(trials)
    assert winner is not None and winner.status == "meets"
    assert winner.metrics["output_tok_s"] == max(f["output_tok_s"] for f, ok in zip(full, meets) if ok)
    assert winner.knobs["max_num_batched_tokens"] < 512  # smaller prefill chunks stall decodes less

    # The best configuration as a config file: LLM(config=...)'s path and serve --config's parsing load it back.
    path = write_config_file(tmp_path / "best.json", winner.knobs, {"tuned": winner.metrics})
    loaded = load_config_file(path)
    assert loaded == winner.knobs
    config = EngineConfig.create(**loaded)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (winner.knobs["max_num_seqs"],
                                                                    winner.knobs["max_num_batched_tokens"])
    from jaxinfer import cli
    from jaxinfer.commands.options import engine_options

    served = EngineConfig.create(**engine_options(cli._build_parser().parse_args(["serve", "--config", str(path)])))
    assert served == config


def test_budget_samples_the_grid_with_the_default_first():
    runs, _, size = plan(SPACE, {"max_num_seqs": 8}, budget=4, seed=3)
    assert size == 12 + 0 and len(runs) == 4  # the base default (8, 512) is in the grid
    assert runs[0] == {"max_num_seqs": 8, "max_num_batched_tokens": 512}
    assert len({tuple(sorted(r.items())) for r in runs}) == 4
    assert plan(SPACE, {"max_num_seqs": 8}, budget=4, seed=3)[0] == runs  # seeded
    # A default outside the grid is run too; TP sizes that do not divide the devices are refused.
    runs, skipped, size = plan({"tensor_parallel_size": [1, 2, 3]}, {"max_num_seqs": 5}, budget=9, num_devices=4)
    assert runs == [{"tensor_parallel_size": 1}, {"tensor_parallel_size": 2}] and size == 2
    assert [k for k, _ in skipped] == [{"tensor_parallel_size": 3}] and "divide" in skipped[0][1]
    with pytest.raises(ValueError, match="budget"):
        plan(SPACE, {}, budget=0)


def test_a_failing_configuration_fails_alone():
    def runner(config, profile, targets, max_run_s=math.inf):
        if config.max_num_seqs == 4:
            raise RuntimeError("out of memory")
        return SimulatedRunner(linear_cost)(config, profile, targets, max_run_s)

    trials = sweep(runner, _mixed_profile(8), {}, [{"max_num_seqs": 32}, {"max_num_seqs": 4}], Targets())
    assert [t.status for t in trials] == ["meets", "failed"]
    assert trials[1].reason == "RuntimeError: out of memory" and trials[1].metrics == {}


def test_table_shows_knob_values_briefly():
    from jaxinfer.tune.report import show_value, trials_table
    from jaxinfer.tune.sweep import Trial

    assert show_value("speculative_config", '{"method": "ngram", "num_speculative_tokens": 3}') == "ngram k=3"
    assert show_value("quantization", {"format": "int8", "quantize_activations": True}) == "int8 w8a8"
    assert show_value("quantization", EngineConfig.create(quantization="fp8").quantization) == "fp8"
    assert show_value("quantization", None) == "none" and show_value("page_size", 16) == "16"
    trials = [Trial({"page_size": 16, "max_num_seqs": 8}, True, "meets", metrics={"output_tok_s": 10.0}),
              Trial({"page_size": 32, "max_num_seqs": 8}, False, "pruned", "p99 TTFT > 1 s")]
    text = trials_table(trials, trials[0])
    assert text.splitlines()[0].startswith("| # | page | status |")  # only the knob that varies
    assert "| 1 (default) | 16 | **best** | 10.0 |" in text and "- 2 pruned: p99 TTFT > 1 s" in text


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 30.0), (2.0, 20.0), (3.0, 30.0), (0.5, 5.0), (4.0, 40.0)]
    # (2, 20) loses to (2, 30); (3, 30) loses to (2, 30); the rest trade latency for throughput.
    assert pareto_front(pts) == [4, 0, 1, 5]


@settings(max_examples=20, deadline=None)
@given(per_token_ms=st.floats(0.05, 0.5), seqs=st.sampled_from([2, 4, 16]), tokens=st.sampled_from([32, 128, 512]),
       ttft=st.floats(0.2, 3.0), tpot=st.floats(0.01, 0.2), seed=st.integers(0, 1000))
def test_early_stop_only_prunes_runs_that_miss(per_token_ms, seqs, tokens, ttft, tpot, seed):
    profile = _mixed_profile(30, seed, rate=8.0)
    runner = SimulatedRunner(lambda t, s: 0.004 + per_token_ms * 1e-3 * t + 0.0005 * s)
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    targets = Targets(ttft, tpot)
    early = runner(config, profile, targets)[0]
    full = runner(config, profile, Targets())[0]
    assert full.stopped is None and full.num_finished == 30
    if early.stopped is not None:
        assert early.pruned and not targets.met(full.summary()["ttft_p99_s"], full.summary()["tpot_p99_s"])
    else:
        assert early.summary() == full.summary()
