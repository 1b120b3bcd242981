"""Device sampling vs a straightforward per-row NumPy reference (float64), plus seeding and ban properties."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.sampling import MAX_LOGPROBS, SamplingArrays, SamplingRow, process_logits, sample
from jaxinfer.request_limits import SUPPRESS_WIDTH
from jaxinfer.sampling_params import SamplingParams as P

V = 64
B = 8
_sample = jax.jit(sample)
_process = jax.jit(process_logits)
W = 128  # penalty_width: >= every row's prompt plus output ids here (a runner passes its longest context)
_build = functools.partial(SamplingArrays.build, penalty_width=W)


def _logits(seed: int, batch: int = B, vocab: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * scale).astype(np.float32)


# ---------------------------------------------------------------- reference


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def reference_raw_logprobs(logits: np.ndarray, vocab_limit: int) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    x[vocab_limit:] = -np.inf
    return x - np.log(np.sum(np.exp(x[:vocab_limit] - x[:vocab_limit].max()))) - x[:vocab_limit].max()


def reference_penalised(logits: np.ndarray, row: SamplingRow, vocab_limit: int) -> np.ndarray:
    """Bans, then CTRL repetition penalty over prompt + output, then OpenAI presence/frequency over output."""
    p = row.params
    x = logits.astype(np.float64).copy()
    x[vocab_limit:] = -np.inf
    for t in row.suppress:
        x[t] = -np.inf
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in collections.Counter(row.output_token_ids).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def reference_kept(penalised: np.ndarray, params: P) -> tuple[np.ndarray, float]:
    """Kept set after temperature, min_p, top_k, top_p, and how close top_p's decision came to p."""
    x = penalised / (params.temperature or 1.0)
    keep = np.isfinite(x)
    probs = _softmax(x)
    keep &= probs >= params.min_p * probs.max()
    if 0 < params.top_k < len(x):
        kth = np.sort(x[keep])[::-1][min(params.top_k, keep.sum()) - 1]
        keep &= x >= kth
    margin = np.inf
    if params.top_p < 1:
        order = [i for i in np.argsort(-x, kind="stable") if keep[i]]
        probs = _softmax(np.where(keep, x, -np.inf))
        kept_p, mass = [], 0.0
        for i in order:
            margin = min(margin, abs(mass - params.top_p))
            if mass >= params.top_p:
                break
            kept_p.append(i)
            mass += probs[i]
        keep &= x >= min(x[i] for i in kept_p)
    return keep, margin


# ---------------------------------------------------------------- greedy, truncation, penalties


def test_greedy_is_argmax_after_bans_and_vocab_limit() -> None:
    logits = _logits(0)
    rows = [SamplingRow(P(temperature=0), seed=i, suppress=[int(np.argmax(logits[i]))] if i % 2 else [])
            for i in range(B)]
    out = _sample(logits, _build(rows, B, V, vocab_limit=V))
    expected = [np.argmax(reference_penalised(logits[i], rows[i], V)) for i in range(B)]
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected)
    assert all(out.token_ids[i] != np.argmax(logits[i]) for i in range(1, B, 2))
    limited = _sample(logits, _build(rows, B, V, vocab_limit=10))
    np.testing.assert_array_equal(np.asarray(limited.token_ids),
                                  [np.argmax(reference_penalised(logits[i], rows[i], 10)) for i in range(B)])


TRUNCATION_PARAMS = [
    P(temperature=1.0),
    P(temperature=0.7, top_k=5),
    P(temperature=1.3, top_p=0.8),
    P(temperature=1.0, min_p=0.1),
    P(temperature=0.5, top_k=10, top_p=0.9, min_p=0.02),
    P(temperature=2.0, top_k=3, top_p=0.3),
    P(temperature=1.0, top_k=1),
    P(temperature=1.0, top_p=0.05),
    P(temperature=1.5, min_p=0.5, top_p=0.95),
    P(temperature=0.8, top_k=V + 100, top_p=0.6),
]


@pytest.mark.parametrize("start", [0, 5])
def test_truncation_keeps_the_reference_sets(start: int) -> None:
    params = (TRUNCATION_PARAMS * 2)[start : start + B]
    logits = _logits(1 + start)
    rows = [SamplingRow(p, seed=i, suppress=[3]) for i, p in enumerate(params)]
    _, penalised, truncated = map(np.asarray, _process(logits, _build(rows, B, V)))
    for i, row in enumerate(rows):
        ref_pen = reference_penalised(logits[i], row, V)
        keep, margin = reference_kept(ref_pen, row.params)
        assert margin > 1e-4, "test data too close to a top_p boundary to decide in f32"
        np.testing.assert_array_equal(np.isfinite(truncated[i]), keep, err_msg=f"row {i}: {row.params}")
        np.testing.assert_allclose(truncated[i][keep], ref_pen[keep] / row.params.temperature, rtol=1e-6)
        assert 1 <= keep.sum() < V


def test_penalties_match_reference() -> None:
    logits = _logits(2)
    prompt = [1, 2, 2, 5, 7, 9, 40]
    output = [2, 5, 5, 5, 11, 12, 12, 63]
    params = [
        P(repetition_penalty=1.5),
        P(repetition_penalty=0.7),
        P(presence_penalty=1.2),
        P(frequency_penalty=0.8),
        P(presence_penalty=-1.0, frequency_penalty=-0.5),
        P(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=2.0, temperature=0),
        P(),  # no penalty: must come back unchanged although its companions use penalties
    ]
    rows = [SamplingRow(p, seed=0, prompt_token_ids=prompt, output_token_ids=output, suppress=[5] if i == 5 else [])
            for i, p in enumerate(params)]
    s = _build(rows, B, V)
    _, penalised, _ = map(np.asarray, _process(logits, s))
    for i, row in enumerate(rows):
        ref = reference_penalised(logits[i], row, V)
        np.testing.assert_allclose(penalised[i], ref, rtol=1e-6, atol=1e-6, err_msg=f"row {i}: {row.params}")
    np.testing.assert_array_equal(penalised[6], logits[6])  # bit-identical
    assert np.all(penalised[:6, 2] != logits[:6, 2])  # token 2 is in prompt and output: every penalty hits it
    greedy = np.asarray(_sample(logits, s).token_ids)[5]
    assert greedy == np.argmax(reference_penalised(logits[5], rows[5], V))


def test_penalties_match_reference_for_rows_of_different_lengths() -> None:
    """One batch of rows whose prompts and outputs differ in length (0 to the whole width W): each row's prompt /
    output split in the one penalty array is its own."""
    logits = _logits(7)
    rng = np.random.default_rng(7)
    lengths = [(0, 0), (1, 0), (0, 5), (7, 3), (40, 12), (70, W - 70), (3, 60), (25, 25)]  # (prompt, output)
    params = [P(repetition_penalty=1.5), P(repetition_penalty=0.6, frequency_penalty=0.4), P(presence_penalty=1.2),
              P(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=2.0),
              P(frequency_penalty=-0.7), P(repetition_penalty=1.8, frequency_penalty=0.3),
              P(), P(presence_penalty=-1.0, repetition_penalty=1.1)]  # row 6 neutral among penalised rows
    rows = [SamplingRow(p, seed=0, prompt_token_ids=rng.integers(0, V // 2, n_prompt).tolist(),
                        output_token_ids=rng.integers(V // 4, V, n_output).tolist())
            for p, (n_prompt, n_output) in zip(params, lengths)]
    s = _build(rows, B, V)
    assert s.penalty_ids.shape == (B, W)
    _, penalised, _ = map(np.asarray, _process(logits, s))
    for i, row in enumerate(rows):
        ref = reference_penalised(logits[i], row, V)
        np.testing.assert_allclose(penalised[i], ref, rtol=1e-6, atol=1e-6, err_msg=f"row {i}: {row.params}")
    np.testing.assert_array_equal(penalised[6], logits[6])  # bit-identical
    # The split matters: counting prompt ids as output (or the reverse) would move these rows.
    assert not np.allclose(penalised[4], reference_penalised(
        logits[4], SamplingRow(rows[4].params, seed=0, output_token_ids=[*rows[4].prompt_token_ids,
                                                                       *rows[4].output_token_ids]), V))


def test_penalty_ids_hold_prompt_then_output_of_penalised_rows_only() -> None:
    prompt, output = list(range(20)), list(range(30, 33))
    build = lambda p: _build(  # noqa: E731
        [SamplingRow(p, seed=0, prompt_token_ids=prompt, output_token_ids=output), SamplingRow(P(), seed=1)], 4, V)
    plain = build(P())
    assert plain.penalty_ids.shape == (4, 1) and np.all(plain.penalty_ids == -1) and np.all(plain.num_prompt_ids == 0)
    for params in (P(presence_penalty=0.5), P(repetition_penalty=1.1), P(frequency_penalty=-0.1)):
        s = build(params)
        assert s.penalty_ids.shape == (4, W)
        np.testing.assert_array_equal(s.penalty_ids[0, :23], prompt + output)
        assert np.all(s.penalty_ids[0, 23:] == -1) and np.all(s.penalty_ids[1:] == -1)
        np.testing.assert_array_equal(s.num_prompt_ids, [20, 0, 0, 0])
    assert np.all(build(P()).temperature[2:] == 0)  # padding rows are greedy


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(prompt_lens=st.lists(st.integers(0, W), min_size=2, max_size=6), data=st.data())
def test_penalty_inputs_take_two_widths_as_outputs_grow(prompt_lens: list[int], data: st.DataObject) -> None:
    """Requests (the first neutral, the second penalised, the rest either) decode until their prompt plus output
    fills the width W, in batches of random subsets: every batch's penalty ids are W wide when one of its rows uses
    penalties, else 1 wide, and hold each penalised row's prompt then output; over the run, exactly {1, W}."""
    penalised = [False, True] + data.draw(st.lists(st.booleans(), min_size=len(prompt_lens) - 2,
                                                   max_size=len(prompt_lens) - 2))
    params = [P(repetition_penalty=1.2, presence_penalty=0.1) if on else P() for on in penalised]
    prompts = [[t % V for t in range(n)] for n in prompt_lens]
    outputs: list[list[int]] = [[] for _ in prompt_lens]
    widths = set()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for step in range(W + 1):
        live = [i for i, p in enumerate(prompts) if len(p) + len(outputs[i]) <= W]
        batch = [i for i in live if rng.random() < 0.6] or live[:1]
        if step == 0:
            batch = [0]  # one batch without penalties
        if not batch:
            break
        s = _build([SamplingRow(params[i], seed=0, prompt_token_ids=prompts[i], output_token_ids=outputs[i])
                    for i in batch], len(batch) + step % 3, V)
        width = W if any(penalised[i] for i in batch) else 1
        assert s.penalty_ids.shape == (len(batch) + step % 3, width)
        widths.add(width)
        for row, i in enumerate(batch):
            ids = prompts[i] + outputs[i] if penalised[i] else []
            np.testing.assert_array_equal(s.penalty_ids[row], ids + [-1] * (width - len(ids)))
            assert s.num_prompt_ids[row] == (len(prompts[i]) if penalised[i] else 0)
        for i in batch:
            outputs[i].append(int(rng.integers(V)))
    assert widths == {1, W}


def test_a_penalised_row_longer_than_the_width_is_refused() -> None:
    row = SamplingRow(P(frequency_penalty=0.5), seed=0, prompt_token_ids=[1] * (W - 3), output_token_ids=[2] * 4)
    with pytest.raises(ValueError, match="penalty_width"):
        _build([row], 2, V)
    assert _build([row], 2, V, penalty_width=W + 1).penalty_ids.shape == (2, W + 1)
    assert _build([dataclasses.replace(row, params=P())], 2, V).penalty_ids.shape == (2, 1)  # no penalty: not read
    with pytest.raises(ValueError, match="penalty_width"):
        SamplingArrays.build([SamplingRow(P(), seed=0)], 2, V, penalty_width=0)


# ---------------------------------------------------------------- sampling distribution and seeding


def test_temperature_sampling_matches_softmax_over_kept_tokens() -> None:
    """4096 draws (one row per step) of a 16-token vocabulary with temperature, min_p and top_k.

    Each frequency has standard deviation sqrt(q (1 - q) / N) <= 0.0079; 5 sigma per token (16 tokens) puts a false
    failure below 1e-5, while using T = 1 instead of T = 0.7 would move the top token's probability by ~0.1.
    """
    n, vocab = 4096, 16
    row_logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] + [-1.2] * 8, np.float32)
    params = P(temperature=0.7, top_k=6, min_p=0.05)
    rows = [SamplingRow(params, seed=1234, step=i) for i in range(n)]
    out = _sample(np.tile(row_logits, (n, 1)), _build(rows, n, vocab))
    freq = np.bincount(np.asarray(out.token_ids), minlength=vocab) / n
    keep, _ = reference_kept(row_logits.astype(np.float64), params)
    expected = np.where(keep, _softmax(np.where(keep, row_logits / 0.7, -np.inf)), 0.0)
    assert keep.sum() == 5  # min_p drops token 5 (p ~ 0.03 * top), before top_k would keep 6
    assert np.all(freq[~keep] == 0)
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= tolerance), (freq, expected)


def _mixed_rows() -> list[SamplingRow]:
    params = [P(temperature=1.0), P(temperature=1.5, top_k=20), P(temperature=0), P(temperature=1.2, top_p=0.9),
              P(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.3, logprobs=5),
              P(temperature=2.0, min_p=0.01), P(temperature=1.0, n=3), P(temperature=1.0, n=3)]
    return [SamplingRow(p, seed=100 + i, sample_index=2 if i == 7 else 0, step=i * 3,
                        prompt_token_ids=[1, 2, 3], output_token_ids=[4] * (i % 3))
            for i, p in enumerate(params)]


def test_token_depends_only_on_seed_sample_index_and_step() -> None:
    logits = _logits(3, scale=1.0)
    rows = _mixed_rows()
    base = _sample(logits, _build(rows, B, V))
    for perm_seed in range(3):
        perm = np.random.default_rng(perm_seed).permutation(B)
        out = _sample(logits[perm], _build([rows[i] for i in perm], B, V))
        np.testing.assert_array_equal(np.asarray(out.token_ids), np.asarray(base.token_ids)[perm])
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(base.logprobs)[perm])
    for i in (0, 3, 6):  # alone in a padded batch: companions without top_p / penalties / logprobs
        alone = _sample(logits[[i] * B], _build([rows[i]], B, V))
        assert int(alone.token_ids[0]) == int(base.token_ids[i])


def test_sample_index_and_step_select_independent_streams() -> None:
    n = 128
    flat = np.zeros((n, V), np.float32)
    params = P(temperature=1.0, n=2)
    draw = lambda index, seed=7: np.asarray(_sample(flat, _build(  # noqa: E731
        [SamplingRow(params, seed=seed, sample_index=index, step=t) for t in range(n)], n, V)).token_ids)
    first, second, again = draw(0), draw(1), draw(0)
    np.testing.assert_array_equal(first, again)
    # Independent uniform streams over 64 tokens agree at ~2 of 128 steps; identical streams at all of them.
    assert np.sum(first == second) < 12 and np.sum(first == draw(0, seed=8)) < 12
    assert len(set(first.tolist())) > 40  # steps give different draws, not one token repeated


def test_banned_and_out_of_vocab_tokens_are_never_sampled() -> None:
    n = 256
    logits = np.zeros((n, V), np.float32)
    logits[:, [0, 1, 60, 61]] = 10.0  # the most likely tokens are exactly the banned ones
    rows = [SamplingRow(P(temperature=1.0 if t % 4 else 0.0, frequency_penalty=-2.0 if t % 3 == 0 else 0.0),
                        seed=t, output_token_ids=[0, 1], suppress=[0, 1]) for t in range(n)]
    tokens = np.asarray(_sample(logits, _build(rows, n, V, vocab_limit=60)).token_ids)
    assert np.all((tokens >= 2) & (tokens < 60))
    assert len(set(tokens.tolist())) > 30


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("vocab", [V, 16])
def test_logprobs_are_raw_log_softmax(vocab: int) -> None:
    logits = _logits(4, vocab=vocab)
    params = [P(temperature=0.5, top_k=3, repetition_penalty=1.4, logprobs=20), P(temperature=0, logprobs=0),
              P(temperature=1.0, min_p=0.2, logprobs=5), P(temperature=1.0)]
    rows = [SamplingRow(p, seed=i, prompt_token_ids=[0, 1, 2], suppress=[3]) for i, p in enumerate(params)]
    limit = vocab - 2
    out = _sample(logits[:4], _build(rows, 4, vocab, vocab_limit=limit))
    k = min(MAX_LOGPROBS, limit)
    for i in range(4):
        ref = reference_raw_logprobs(logits[i], limit)
        token = int(out.token_ids[i])
        np.testing.assert_allclose(float(out.logprobs[i]), ref[token], rtol=1e-5, atol=1e-5)
        order = np.argsort(-ref, kind="stable")[:k]
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i, :k]), ref[order], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.top_token_ids[i, :k]), order)
        assert np.all(np.diff(np.asarray(out.top_logprobs[i, :k])) <= 0)
        if vocab < MAX_LOGPROBS:
            assert np.all(np.asarray(out.top_token_ids[i, limit:]) == -1)
        assert int(out.ranks[i]) == 1 + np.sum(ref > ref[token])  # every row, once some row asks


def test_sampled_token_ranks_are_their_place_in_the_raw_distribution() -> None:
    """Hot sampling, penalties and bans pick tokens far down the raw distribution: their rank is 1 + the number
    of raw logprobs strictly above theirs (float64 NumPy reference), for rows that asked and rows that did not."""
    n = 64
    logits = _logits(11, batch=n)
    params = [P(temperature=3.0, logprobs=2), P(temperature=1.5), P(temperature=0, repetition_penalty=3.0)]
    rows = [SamplingRow(params[i % 3], seed=i, prompt_token_ids=np.argsort(-logits[i])[:4].tolist(),
                        suppress=[int(np.argmax(logits[i]))] if i % 4 == 0 else []) for i in range(n)]
    out = _sample(logits, _build(rows, n, V))
    ranks = np.asarray(out.ranks)
    for i in range(n):
        ref = reference_raw_logprobs(logits[i], V)
        assert ranks[i] == 1 + np.sum(ref > ref[int(out.token_ids[i])]), i
    assert ranks.min() >= 1 and np.sum(ranks > 1) > n // 2 and ranks.max() > 5  # far from the argmax


def test_top_logprobs_skipped_when_no_row_asks() -> None:
    logits = _logits(5)
    out = _sample(logits, _build([SamplingRow(P(), seed=0)], B, V))
    assert np.all(np.asarray(out.top_token_ids) == -1)
    assert np.all(np.asarray(out.ranks) == 0)
    ref = reference_raw_logprobs(logits[0], V)
    np.testing.assert_allclose(float(out.logprobs[0]), ref[int(out.token_ids[0])], rtol=1e-5, atol=1e-5)
    # logprobs=0 wants no top tokens but still its sampled token's rank.
    out = _sample(logits, _build([SamplingRow(P(temperature=5.0, logprobs=0), seed=s) for s in range(B)], B, V))
    for i in range(B):
        ref = reference_raw_logprobs(logits[i], V)
        assert int(out.ranks[i]) == 1 + np.sum(ref > ref[int(out.token_ids[i])]), i
    assert np.any(np.asarray(out.ranks) > 1)


# ---------------------------------------------------------------- host-side validation


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingRow(P(), seed=-1), "seed"),
    (lambda: SamplingRow(P(), seed=2**32), "seed"),
    (lambda: SamplingRow(P(n=2), seed=0, sample_index=2), "sample_index"),
    (lambda: SamplingRow(P(), seed=0, step=-1), "step"),
    (lambda: _build([SamplingRow(P(), seed=0)] * 3, 2, V), "batch"),
    (lambda: _build([SamplingRow(P(), seed=0)], 2, V, vocab_limit=V + 1), "vocab_limit"),
    (lambda: _build([SamplingRow(P(), seed=0, suppress=[V])], 2, V), "suppress"),
    (lambda: _build([SamplingRow(P(repetition_penalty=1.1), seed=0, prompt_token_ids=[-1])], 2, V),
     "prompt_token_ids"),
    (lambda: _build([SamplingRow(P(presence_penalty=1.0), seed=0, output_token_ids=[V])], 2, V),
     "output_token_ids"),
])
def test_bad_rows_raise_naming_the_field(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_step_defaults_to_output_length_and_large_seeds_work() -> None:
    row = SamplingRow(P(temperature=1.0), seed=2**32 - 1, output_token_ids=[5, 6, 7])
    assert row.step == 3
    s = _build([row], 2, V)
    assert int(s.seed[0]) == 2**32 - 1 and int(s.step[0]) == 3
    assert 0 <= int(_sample(_logits(6)[:2], s).token_ids[0]) < V


def test_banned_ids_have_one_width_whatever_the_rows_ban() -> None:
    """No request's stop ids pick a compiled shape: the suppress array is SUPPRESS_WIDTH wide for 0 to
    SUPPRESS_WIDTH banned ids, and a row banning more is refused."""
    vocab = 4 * SUPPRESS_WIDTH
    for n in (0, 1, 5, SUPPRESS_WIDTH):
        s = _build([SamplingRow(P(), seed=0, suppress=list(range(n)))], 2, vocab)
        assert s.suppress.shape == (2, SUPPRESS_WIDTH) and sorted(s.suppress[0][:n]) == list(range(n))
    with pytest.raises(ValueError, match="SUPPRESS_WIDTH"):
        _build([SamplingRow(P(), seed=0, suppress=list(range(SUPPRESS_WIDTH + 1)))], 2, vocab)
