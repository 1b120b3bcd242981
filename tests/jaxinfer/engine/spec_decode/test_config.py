"""`SpeculativeConfig` validation and parsing, and `SpeculationPolicy` / `SpecStats` (host-only: no model, no jax)."""

from __future__ import annotations

import json
import types

import pytest

from jaxinfer.engine.spec_decode.config import METHODS, SpeculativeConfig
from jaxinfer.engine.spec_decode.policy import DEFAULT_MAX_STEP_TOKENS, EMA_WEIGHT, SpeculationPolicy, SpecStats

# --- SpeculativeConfig ---------------------------------------------------------------------------------------


def test_defaults_and_every_method_accepted():
    c = SpeculativeConfig()
    assert (c.method, c.num_speculative_tokens, c.model, c.num_draft_layers) == ("ngram", 4, None, None)
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.max_step_tokens, c.disable_by_batch_size) == (1, 4, None, None)
    assert (c.min_acceptance_rate, c.probe_interval) == (0.1, 8)
    assert set(METHODS) == {"ngram", "draft_model", "self_draft"}
    SpeculativeConfig(method="draft_model", model="draft.gguf")
    SpeculativeConfig(method="self_draft", num_draft_layers=3)
    SpeculativeConfig(method="self_draft")  # num_draft_layers defaults per model, at load
    for k in (1, 16):
        SpeculativeConfig(num_speculative_tokens=k)
    SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3)
    SpeculativeConfig(max_step_tokens=1, disable_by_batch_size=1, probe_interval=1)
    for rate in (0, 1, 0.0, 1.0, 0.5):
        SpeculativeConfig(min_acceptance_rate=rate)


@pytest.mark.parametrize("fields, message", [
    ({"method": "eagle"}, "method='eagle' is not one of ngram, draft_model, self_draft"),
    ({"method": None}, "method=None"),
    ({"method": "NGRAM"}, "method='NGRAM'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer in [1, 16]"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens=17"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens=-1"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens=2.0"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens='4'"),
    ({"method": "draft_model"}, "'draft_model' needs 'model'"),
    ({"method": "draft_model", "model": ""}, "'draft_model' needs 'model'"),
    ({"method": "draft_model", "model": 3}, "'draft_model' needs 'model'"),
    ({"method": "ngram", "model": "draft.gguf"}, "'model' is only for method 'draft_model', not 'ngram'"),
    ({"method": "self_draft", "model": "draft.gguf"}, "'model' is only for method 'draft_model', not 'self_draft'"),
    ({"method": "ngram", "num_draft_layers": 2}, "num_draft_layers is only for method 'self_draft', not 'ngram'"),
    ({"method": "draft_model", "model": "d.gguf", "num_draft_layers": 2}, "only for method 'self_draft'"),
    ({"method": "self_draft", "num_draft_layers": 0}, "num_draft_layers=0 must be an integer >= 1"),
    ({"method": "self_draft", "num_draft_layers": 2.5}, "num_draft_layers=2.5"),
    ({"method": "self_draft", "num_draft_layers": True}, "num_draft_layers=True"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min=0 and prompt_lookup_max=4 must be integers with 1 <= min <= max"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min=3 and prompt_lookup_max=2"),
    ({"prompt_lookup_max": 1.5}, "prompt_lookup_max=1.5"),
    ({"prompt_lookup_min": True}, "prompt_lookup_min=True"),
    ({"max_step_tokens": 0}, "max_step_tokens=0 must be None or an integer >= 1"),
    ({"max_step_tokens": 32.0}, "max_step_tokens=32.0"),
    ({"max_step_tokens": True}, "max_step_tokens=True"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size=0 must be None or an integer >= 1"),
    ({"disable_by_batch_size": "8"}, "disable_by_batch_size='8'"),
    ({"min_acceptance_rate": -0.1}, "min_acceptance_rate=-0.1 must be a number in [0, 1]"),
    ({"min_acceptance_rate": 1.5}, "min_acceptance_rate=1.5"),
    ({"min_acceptance_rate": True}, "min_acceptance_rate=True"),
    ({"min_acceptance_rate": "0.5"}, "min_acceptance_rate='0.5'"),
    ({"min_acceptance_rate": float("nan")}, "min_acceptance_rate=nan"),
    ({"probe_interval": 0}, "probe_interval=0 must be an integer >= 1"),
    ({"probe_interval": 2.0}, "probe_interval=2.0"),
    ({"probe_interval": False}, "probe_interval=False"),
])
def test_bad_fields_raise_naming_them(fields: dict, message: str):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(**fields)
    assert message in str(e.value)
    with pytest.raises(ValueError) as e:  # the same through from_value, from a dict and from JSON where it encodes
        SpeculativeConfig.from_value(fields)
    assert message in str(e.value)
    if all(isinstance(v, (str, int, type(None))) for v in fields.values()):
        with pytest.raises(ValueError, match="."):
            SpeculativeConfig.from_value(json.dumps(fields))


def test_from_value_none_instance_dict_json_and_mapping():
    assert SpeculativeConfig.from_value(None) is None
    c = SpeculativeConfig(method="self_draft", num_draft_layers=2)
    assert SpeculativeConfig.from_value(c) is c
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    fields = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert SpeculativeConfig.from_value(fields) == want
    assert SpeculativeConfig.from_value(json.dumps(fields)) == want
    assert SpeculativeConfig.from_value(types.MappingProxyType(fields)) == want  # any Mapping
    assert SpeculativeConfig.from_value({}) == SpeculativeConfig()
    assert SpeculativeConfig.from_value("{}") == SpeculativeConfig()
    assert SpeculativeConfig.from_value('{"method": "draft_model", "model": "/m/draft.gguf", "min_acceptance_rate": 0}'
                                        ) == SpeculativeConfig(method="draft_model", model="/m/draft.gguf",
                                                               min_acceptance_rate=0)


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram",', "not valid JSON"),
    ("", "not valid JSON"),
    ("ngram", "not valid JSON"),
    ("[1, 2]", "must be a JSON object / dict, got list"),
    ("4", "must be a JSON object / dict, got int"),
    ("null", "must be a JSON object / dict, got NoneType"),
    ('"ngram"', "must be a JSON object / dict, got str"),
    (4, "must be a JSON object / dict, got int"),
    (["method", "ngram"], "got list"),
    ({"method": "ngram", "k": 2}, "unknown speculative config key(s) 'k'; known: disable_by_batch_size"),
    ({"num_spec_tokens": 2, "speculative_model": "x"}, "'num_spec_tokens', 'speculative_model'"),
    ('{"method": "eagle"}', "method='eagle' is not one of"),
])
def test_from_value_rejects(value, message: str):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_value(value)
    assert message in str(e.value)


def test_config_is_frozen():
    c = SpeculativeConfig()
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 8  # type: ignore[misc]


# --- SpeculationPolicy: rule 1, the batch ------------------------------------------------------------------------


def test_step_k_follows_max_step_tokens():
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4, max_step_tokens=32), "cpu")
    # k = min(4, 32 // B' - 1), B' = B rounded up to a power of two (the batch bucket): B' * (k + 1) <= 32
    assert [p.step_k(b) for b in (0, 1, 2, 6, 7, 8, 10, 11, 16, 17, 32, 100)] == [0, 4, 4, 3, 3, 3, 1, 1, 1, 0, 0, 0]
    for b in range(1, 40):
        k = p.step_k(b)
        assert k == 0 or b * (k + 1) <= 32


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu", "metal"])
def test_default_max_step_tokens_per_backend(backend: str):
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=16), backend)
    assert p.max_step_tokens == DEFAULT_MAX_STEP_TOKENS.get(backend, 32)
    assert {"cpu", "gpu", "tpu"} <= set(DEFAULT_MAX_STEP_TOKENS)
    n = p.max_step_tokens
    assert p.step_k(n // 2) == 1 and p.step_k(n // 2 + 1) == 0
    configured = SpeculationPolicy(SpeculativeConfig(max_step_tokens=1000), backend)
    assert configured.max_step_tokens == 1000


def test_step_k_disable_by_batch_size():
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3, max_step_tokens=1000,
                                            disable_by_batch_size=4), "cpu")
    assert [p.step_k(b) for b in range(7)] == [0, 3, 3, 3, 3, 0, 0]
    both = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=3, max_step_tokens=16,
                                               disable_by_batch_size=6), "cpu")
    assert [both.step_k(b) for b in range(1, 9)] == [3, 3, 3, 3, 1, 1, 0, 0]  # 16 // B' - 1 up to B = 6; then off


def test_plan_gives_each_decoding_sequence_the_step_k_and_counts_off_steps():
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4, max_step_tokens=32), "cpu")
    assert p.plan([]) == {} and p.stats.num_off_steps == 0  # nothing decoding: not an off step
    assert p.plan([3, 5]) == {3: 4, 5: 4}
    assert p.plan(range(8)) == {i: 3 for i in range(8)}
    assert p.plan(range(20)) == {} and p.stats.num_off_steps == 1
    assert p.plan(iter([7])) == {7: 4}  # any iterable


# --- SpeculationPolicy: rule 2, per-sequence acceptance -----------------------------------------------------------


def _drafting_steps(p: SpeculationPolicy, seq_id: int, steps: int, others: tuple[int, ...] = ()) -> list[bool]:
    """Which of `steps` consecutive plans give `seq_id` drafts (nothing recorded in between)."""
    return [seq_id in p.plan([seq_id, *others]) for _ in range(steps)]


def test_low_acceptance_switches_a_sequence_off_and_probes_bring_it_back():
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.3, probe_interval=4,
                                            max_step_tokens=100), "cpu")
    assert p.plan([1, 2]) == {1: 4, 2: 4}  # no measurement yet: drafts
    p.record(1, num_drafts=4, num_accepted=0, num_emitted=1)  # rate 0 < 0.3
    p.record(2, num_drafts=4, num_accepted=4, num_emitted=5)
    # seq 1 is off for probe_interval - 1 steps, then probes once, and so on; seq 2 drafts every step
    plans = [p.plan([1, 2]) for _ in range(8)]
    assert [1 in plan for plan in plans] == [False, False, False, True, False, False, False, True]
    assert all(plan.get(2) == 4 for plan in plans)
    # a probe that is accepted brings the EMA back over the minimum: drafting every step again
    p.record(1, num_drafts=4, num_accepted=4, num_emitted=5)  # EMA 0.5 * 1 + 0.5 * 0 = 0.5
    assert _drafting_steps(p, 1, 5) == [True] * 5


def test_acceptance_is_an_exponential_moving_average():
    assert EMA_WEIGHT == 0.5
    p = SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=0.3, probe_interval=100, max_step_tokens=100),
                          "cpu")
    p.record(1, 4, 4, 5)  # 1.0
    p.record(1, 4, 0, 1)  # 0.5 * 0 + 0.5 * 1.0 = 0.5: the latest rate alone (0) would switch it off
    assert _drafting_steps(p, 1, 3) == [True] * 3
    p.record(1, 4, 0, 1)  # 0.25 < 0.3
    assert _drafting_steps(p, 1, 3) == [False] * 3
    p.record(1, 2, 1, 2)  # a probe's outcome: 0.5 * 0.5 + 0.5 * 0.25 = 0.375
    assert _drafting_steps(p, 1, 3) == [True] * 3


def test_rows_without_drafts_leave_the_acceptance_alone():
    p = SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=0.5, probe_interval=100, max_step_tokens=100), "cpu")
    p.record(1, 4, 0, 1)
    for _ in range(5):
        p.record(1, 0, 0, 1)  # plain decode steps
    assert _drafting_steps(p, 1, 2) == [False, False]


def test_probe_interval_1_always_drafts_and_min_rate_0_never_switches_off():
    every = SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=1.0, probe_interval=1, max_step_tokens=100),
                              "cpu")
    every.record(1, 4, 3, 4)  # 0.75 < 1.0, but every step is a probe
    assert _drafting_steps(every, 1, 4) == [True] * 4
    never = SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=0.0, probe_interval=8, max_step_tokens=100),
                              "cpu")
    never.record(1, 4, 0, 1)
    assert _drafting_steps(never, 1, 4) == [True] * 4


def test_off_steps_of_the_batch_rule_do_not_advance_the_probe_countdown():
    p = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=2, min_acceptance_rate=0.5, probe_interval=3,
                                            max_step_tokens=8), "cpu")
    p.record(1, 2, 0, 1)
    assert p.plan([1]) == {}  # 1 of 3
    assert p.plan(range(1, 6)) == {}  # B = 5: 8 // 5 - 1 = 0, speculation off for the whole step
    assert p.stats.num_off_steps == 1
    assert p.plan([1]) == {}  # 2 of 3
    assert p.plan([1]) == {1: 2}  # the probe


def test_forget_drops_a_sequences_state():
    p = SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=0.5, probe_interval=100, max_step_tokens=100), "cpu")
    p.record(1, 4, 0, 1)
    assert _drafting_steps(p, 1, 1) == [False]
    p.forget(1)
    p.forget(12345)  # unknown: no error
    assert _drafting_steps(p, 1, 1) == [True]


# --- SpecStats ------------------------------------------------------------------------------------------------


def test_stats_as_dict_keys_and_ratios():
    empty = SpecStats().as_dict()
    assert set(empty) == {"spec_draft_tokens", "spec_accepted_tokens", "spec_verify_rows", "spec_emitted_tokens",
                          "spec_decode_rows", "spec_decode_tokens", "spec_verify_steps", "spec_off_steps",
                          "spec_acceptance_rate", "spec_mean_accepted_length", "spec_tokens_per_decode_step"}
    assert all(v == 0 for v in empty.values())  # no division by zero
    s = SpecStats(num_draft_tokens=10, num_accepted_tokens=4, num_verify_rows=3, num_emitted_tokens=7,
                  num_decode_rows=6, num_decode_tokens=10, num_verify_steps=2, num_off_steps=1).as_dict()
    assert s["spec_draft_tokens"] == 10 and s["spec_accepted_tokens"] == 4 and s["spec_off_steps"] == 1
    assert s["spec_acceptance_rate"] == pytest.approx(0.4)
    assert s["spec_mean_accepted_length"] == pytest.approx(7 / 3)
    assert s["spec_tokens_per_decode_step"] == pytest.approx(10 / 6)


def test_record_feeds_the_counters():
    p = SpeculationPolicy(SpeculativeConfig(max_step_tokens=100), "cpu")
    p.record(1, num_drafts=4, num_accepted=2, num_emitted=3)
    p.record(2, num_drafts=4, num_accepted=4, num_emitted=5)
    p.record(3, num_drafts=0, num_accepted=0, num_emitted=1)  # a row without drafts
    p.record(1, num_drafts=2, num_accepted=2, num_emitted=3)
    s = p.stats.as_dict()
    assert (s["spec_draft_tokens"], s["spec_accepted_tokens"], s["spec_verify_rows"], s["spec_emitted_tokens"]) == \
        (10, 8, 3, 11)
    assert (s["spec_decode_rows"], s["spec_decode_tokens"]) == (4, 12)
    assert s["spec_acceptance_rate"] == pytest.approx(0.8)
    assert s["spec_mean_accepted_length"] == pytest.approx(11 / 3)
    assert s["spec_tokens_per_decode_step"] == pytest.approx(12 / 4)
    assert s["spec_verify_steps"] == 0  # counted by the engine, per step


# --- where users give it: EngineConfig and LLM (validated before any model loads) --------------------------------


def test_engine_config_and_llm_take_dict_json_or_instance():
    from jaxinfer import LLM
    from jaxinfer.engine.config import EngineConfig

    want = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    for value in (want, {"method": "ngram", "num_speculative_tokens": 2}, '{"num_speculative_tokens": 2}'):
        assert EngineConfig.create(speculative_config=value).speculative_config == want
    assert EngineConfig().speculative_config is None
    with pytest.raises(ValueError, match="runs on one device"):
        EngineConfig.create(speculative_config={"method": "draft_model", "model": "d.gguf"}, tensor_parallel_size=2)
    EngineConfig.create(speculative_config={"method": "self_draft"}, tensor_parallel_size=2)  # fine with TP
    with pytest.raises(ValueError, match="unknown speculative config key"):
        LLM(speculative_config={"method": "ngram", "num_spec_tokens": 2})  # raises before loading the model
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(speculative_config="{method: ngram}")
