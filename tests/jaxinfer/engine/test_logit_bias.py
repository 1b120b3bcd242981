"""`logit_bias` in the jitted sampler and the verify step, against a per-row NumPy reference (float64): the bias is
added after the bans and before the penalties (vLLM V1's order), its arrays take the penalty inputs' two width
variants, and the raw logprobs stay those of the unprocessed logits."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest

from jaxinfer.engine.sampling import SamplingArrays, SamplingRow, process_logits, sample
from jaxinfer.engine.spec_decode.verify import verify
from jaxinfer.request_limits import MAX_LOGIT_BIAS
from jaxinfer.sampling_params import SamplingParams as P

V, B, W = 64, 6, 96
LIMIT = V - 5  # ids [LIMIT, V) are embedding padding
_sample = jax.jit(sample)
_process = jax.jit(process_logits)
_verify = jax.jit(verify)
_build = functools.partial(SamplingArrays.build, penalty_width=W, vocab_limit=LIMIT)


def _logits(seed: int, batch: int = B) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, V)) * 3).astype(np.float32)


def reference_penalised(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """Vocab limit and bans, then + bias, then CTRL repetition penalty (prompt + output), then presence and
    frequency (output): float64, one row, written out plainly."""
    p = row.params
    x = logits.astype(np.float64).copy()
    x[LIMIT:] = -np.inf
    for t in row.suppress:
        x[t] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in collections.Counter(row.output_token_ids).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def _random_rows(seed: int) -> list[SamplingRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(B):
        bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(LIMIT, size=int(rng.integers(0, 12)),
                                                                           replace=False)} if i % 3 else None
        penalties = dict(repetition_penalty=float(rng.uniform(0.5, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                         frequency_penalty=float(rng.uniform(-2, 2))) if i % 2 else {}
        rows.append(SamplingRow(P(temperature=0, logit_bias=bias, **penalties), seed=i,
                                prompt_token_ids=rng.integers(0, LIMIT, 10).tolist(),
                                output_token_ids=rng.integers(0, LIMIT, 7).tolist(),
                                suppress=rng.choice(LIMIT, 3, replace=False).tolist()))
    return rows


@pytest.mark.parametrize("seed", range(3))
def test_bias_is_added_after_bans_and_before_penalties(seed: int) -> None:
    rows = _random_rows(seed)
    logits = _logits(seed)
    raw, penalised, _ = _process(logits, _build(rows, B, V))
    for i, row in enumerate(rows):
        ref = reference_penalised(logits[i], row)
        got = np.asarray(penalised[i], np.float64)
        assert np.array_equal(np.isinf(got), np.isinf(ref)), i
        np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-5, atol=1e-4)
    # The raw logprobs ignore bias, bans and penalties.
    x = logits.astype(np.float64)[:, :LIMIT]
    ref_raw = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(raw)[:, :LIMIT], ref_raw, rtol=1e-5, atol=1e-5)


def test_bias_then_repetition_penalty_is_not_penalty_then_bias() -> None:
    """(l + b) / r differs from l / r + b for a seen token with a positive logit: the order is observable."""
    logits = np.zeros((1, V), np.float32)
    logits[0, 7] = 4.0
    row = SamplingRow(P(temperature=0, logit_bias={7: 2.0}, repetition_penalty=2.0), seed=0, prompt_token_ids=[7])
    _, penalised, _ = _process(logits, _build([row], 1, V))
    assert float(penalised[0, 7]) == pytest.approx((4.0 + 2.0) / 2.0)  # 3, not 4 / 2 + 2 = 4


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_with_a_large_bias_picks_the_biased_token(mixed: bool) -> None:
    """Greedy rows alone take the greedy fast path; beside a sampled row the full path. Both pick the token a
    +100 bias forces, the one +bias makes the argmax, and never the -100 one."""
    logits = _logits(7, batch=4)
    top = logits[:, :LIMIT].argmax(-1)
    forced = (top + 11) % LIMIT
    second = np.argsort(-logits[:, :LIMIT], axis=-1)[:, 1]
    params = [P(temperature=0, logit_bias={int(forced[0]): 100.0}),
              P(temperature=0, logit_bias={int(top[1]): -100.0}),
              P(temperature=0, logit_bias={int(second[2]): float(logits[2, top[2]] - logits[2, second[2]]) + 0.5}),
              P(temperature=1.0, seed=1) if mixed else P(temperature=0)]
    out = np.asarray(_sample(logits, _build([SamplingRow(p, seed=i) for i, p in enumerate(params)], 4, V)).token_ids)
    assert out[0] == forced[0]
    assert out[1] == second[1]
    assert out[2] == second[2]
    if not mixed:
        assert out[3] == top[3]


def test_a_minus_100_bias_is_never_sampled() -> None:
    """The unbiased row samples its top token often (so the check can fail); with -100 on it, never, in 300 draws."""
    logits = np.tile(_logits(3, batch=1), (B, 1))
    top = int(logits[0, :LIMIT].argmax())
    seen = {False: 0, True: 0}
    for seed in range(0, 300, B):
        for biased in (False, True):
            rows = [SamplingRow(P(temperature=1.5, seed=seed + i, logit_bias={top: -100.0} if biased else None),
                                seed=seed + i) for i in range(B)]
            seen[biased] += int((np.asarray(_sample(logits, _build(rows, B, V)).token_ids) == top).sum())
    assert seen[False] > 20 and seen[True] == 0


def test_sampled_distribution_follows_the_biased_softmax() -> None:
    """Temperature 1 over three tokens with biases: the counts of 3000 draws match softmax(logits + bias)."""
    logits = np.full((1, V), -1e4, np.float32)
    logits[0, [3, 4, 5]] = [1.0, 0.0, 0.0]
    bias = {4: 1.5, 5: -1.0}
    expected = np.exp(np.array([1.0, 1.5, -1.0]))
    expected /= expected.sum()
    counts = collections.Counter()
    logits_b = np.tile(logits, (B, 1))
    for seed in range(0, 3000, B):
        rows = [SamplingRow(P(temperature=1.0, logit_bias=bias), seed=seed + i) for i in range(B)]
        counts.update(np.asarray(_sample(logits_b, _build(rows, B, V)).token_ids).tolist())
    freq = np.array([counts[3], counts[4], counts[5]]) / sum(counts.values())
    assert sum(counts.values()) == 3000
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_the_raw_logprob_of_a_forced_token_is_its_unbiased_one() -> None:
    logits = _logits(5, batch=1)
    token = int(logits[0, :LIMIT].argmin())
    out = _sample(logits, _build([SamplingRow(P(temperature=0, logit_bias={token: 100.0}), seed=0)], 1, V))
    x = logits[0, :LIMIT].astype(np.float64)
    assert int(out.token_ids[0]) == token
    assert float(out.logprobs[0]) == pytest.approx(x[token] - x.max() - np.log(np.exp(x - x.max()).sum()), abs=1e-4)


def test_bias_arrays_take_the_penalty_inputs_two_width_variants() -> None:
    plain = SamplingRow(P(temperature=0), seed=0, prompt_token_ids=[1, 2])
    biased = SamplingRow(P(temperature=0, logit_bias={9: 1.0, 3: -2.0}), seed=0)
    penalised = SamplingRow(P(temperature=0, presence_penalty=1.0), seed=0, prompt_token_ids=[1, 2])
    narrow = _build([plain, plain], 4, V)
    assert narrow.bias_ids.shape == narrow.bias_values.shape == narrow.penalty_ids.shape == (4, 1)
    for rows in ([plain, biased], [penalised, plain], [biased, penalised]):
        s = _build(rows, 4, V)
        assert s.bias_ids.shape == s.bias_values.shape == (4, MAX_LOGIT_BIAS) and s.penalty_ids.shape == (4, W)
    s = _build([plain, biased], 4, V)
    assert s.bias_ids[1, :2].tolist() == [9, 3] and s.bias_values[1, :2].tolist() == [1.0, -2.0]
    assert (s.bias_ids[[0, 2, 3]] == -1).all() and (s.bias_ids[1, 2:] == -1).all() and (s.bias_values[1, 2:] == 0).all()
    assert (s.penalty_ids == -1).all()  # a biased row carries no penalty ids


def test_a_bias_id_outside_the_vocabulary_is_refused_by_build() -> None:
    with pytest.raises(ValueError, match="logit_bias of row 0"):
        _build([SamplingRow(P(logit_bias={V: 1.0}), seed=0)], 1, V)


def test_verify_honours_the_bias() -> None:
    """Greedy rows verifying drafts of their raw argmax: with -100 on those tokens every draft is rejected and the
    emitted token is the biased argmax; with +100 on a token drafted everywhere, every draft is accepted. With no
    drafts, verify emits what `sample` samples."""
    k = 3
    target = (np.random.default_rng(11).standard_normal((2, k + 1, V)) * 3).astype(np.float32)
    top = target[:, :, :LIMIT].argmax(-1)  # [2, k+1]
    drafts = top[:, :k].astype(np.int32)
    banned = [P(temperature=0, logit_bias={int(t): -100.0 for t in set(top[i].tolist())}) for i in range(2)]
    out = _verify(target, drafts, None, np.full(2, k, np.int32), _build([SamplingRow(p, seed=0) for p in banned], 2, V))
    assert np.asarray(out.num_accepted).tolist() == [0, 0]
    for i in range(2):
        ref = reference_penalised(target[i, 0], SamplingRow(banned[i], seed=0))
        assert int(out.token_ids[i, 0]) == int(np.argmax(ref)) != top[i, 0]
    forced_token = int((top.max() + 1) % LIMIT)
    forced = P(temperature=0, logit_bias={forced_token: 100.0})
    rows = [SamplingRow(forced, seed=0)] * 2
    out = _verify(target, np.full((2, k), forced_token, np.int32), None, np.full(2, k, np.int32), _build(rows, 2, V))
    assert np.asarray(out.num_accepted).tolist() == [k, k] and (np.asarray(out.token_ids) == forced_token).all()
    sampled_rows = [SamplingRow(P(temperature=1.0, logit_bias={int(top[i, 0]): -100.0, 5: 3.0}), seed=40 + i)
                    for i in range(2)]
    s = _build(sampled_rows, 2, V)
    out = _verify(target, drafts, None, np.zeros(2, np.int32), s)
    assert np.asarray(out.token_ids[:, 0]).tolist() == np.asarray(_sample(target[:, 0], s).token_ids).tolist()
