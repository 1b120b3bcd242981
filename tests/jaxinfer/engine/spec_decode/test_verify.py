"""Speculative verification: greedy equals plain greedy decoding, sampling is lossless (chi-square), seeds hold.

The chi-square tests compare counts of emitted tokens over many seeded rows with the target distribution at
significance ALPHA = 0.001 (scipy.stats.chisquare); seeds are fixed, so each test is deterministic, and
`test_wrong_rules_fail_the_chi_square` shows the same test rejecting two plausible wrong rules.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import scipy.stats

from jaxinfer.engine.sampling import SamplingArrays, SamplingRow, sample
from jaxinfer.sampling_params import SamplingParams as P
from jaxinfer.engine.spec_decode import verify as verify_module
from jaxinfer.engine.spec_decode.verify import VerifyOutput, verify
from pallas_kernels import cpu_gemv

ALPHA = 0.001  # significance of every chi-square goodness-of-fit test here
N = 20_000  # seeded rows per distribution test, one jitted call
PENALTY_WIDTH = 64  # >= every row's prompt plus output ids here
_verify = jax.jit(verify)
_sample_xla = jax.jit(lambda logits, s: sample(logits, s))


def _sample(logits, s):
    """`sample` on XLA's path, as `verify` computes (on CPU the step's sampler reduces rows natively: its logprobs
    agree with these to f32 rounding, tests/jaxinfer/engine/test_sampling_fast.py)."""
    with cpu_gemv.native_kernels(False):
        return _sample_xla(logits, s)


def _arrays(rows: list[SamplingRow], vocab: int, batch: int | None = None) -> SamplingArrays:
    return SamplingArrays.build(rows, batch or len(rows), vocab, penalty_width=PENALTY_WIDTH)


def _row(out: VerifyOutput, i: int) -> list[np.ndarray]:
    return [np.asarray(x)[i] for x in jax.tree.leaves(out)]


# ---------------------------------------------------------------- greedy


def _toy_logits(context: list[int], vocab: int) -> np.ndarray:
    """f32[V] logits of a deterministic toy model: a fixed random function of the whole context."""
    return (np.random.default_rng([7, *context]).standard_normal(vocab) * 3).astype(np.float32)


def _greedy_loop(prompt: list[int], n: int, vocab: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(np.argmax(_toy_logits(prompt + tokens, vocab))))
    return tokens


def test_greedy_hand_built():
    # Argmax of the target at positions 0..3 is [2, 0, 1, 3]; drafts [2, 0, 4]: drafts 0 and 1 match, draft 2
    # (4 != 1) is rejected, so 2 are accepted and the target's 1 follows them.
    logits = np.zeros((1, 4, 5), np.float32)
    logits[0, np.arange(4), [2, 0, 1, 3]] = 1.0
    s = _arrays([SamplingRow(P(temperature=0), seed=0)], 5)
    out = _verify(logits, np.array([[2, 0, 4]], np.int32), None, np.array([3], np.int32), s)
    assert out.num_accepted.tolist() == [2]
    assert out.token_ids.tolist() == [[2, 0, 1, -1]]
    # raw log-probability of each emitted token: log(e / (e + 4)) for the peak, 0 for the padding.
    np.testing.assert_allclose(out.logprobs, [[np.log(np.e / (np.e + 4))] * 3 + [0.0]], rtol=1e-6)


@pytest.mark.parametrize("draft_probs", [False, True])
def test_greedy_equals_argmax_loop(draft_probs):
    vocab, k = 16, 4
    prompt = [3, 1, 4]
    greedy = _greedy_loop(prompt, k + 1, vocab)
    # (case, position of the first wrong draft or None, num_drafts)
    cases = [("all accepted", None, k), ("first rejected", 0, k), ("mid-block reject", 2, k),
             ("last rejected", k - 1, k), ("padding: 2 real drafts", None, 2),
             ("padding: reject in the real part", 1, 3), ("no drafts", None, 0)]
    drafts = np.empty((len(cases), k), np.int32)
    logits = np.empty((len(cases), k + 1, vocab), np.float32)
    for i, (_, wrong, num) in enumerate(cases):
        row = list(greedy[:k])  # slots past num_drafts keep the right tokens: they must still not be accepted
        if wrong is not None:
            row[wrong] = (row[wrong] + 1) % vocab
        if num < k:
            row[k - 1] = -1  # padding may hold anything
        drafts[i] = row
        for j in range(k + 1):  # the target sees the drafts before j, as in one verification forward
            logits[i, j] = _toy_logits(prompt + [max(t, 0) for t in row[:j]], vocab)
    s = _arrays([SamplingRow(P(temperature=0), seed=i) for i in range(len(cases))], vocab)
    num_drafts = np.array([c[2] for c in cases], np.int32)
    probs = np.full((len(cases), k, vocab), 1 / vocab, np.float32) if draft_probs else None  # ignored when greedy
    out = _verify(logits, drafts, probs, num_drafts, s)
    for i, (name, wrong, num) in enumerate(cases):
        accepted = num if wrong is None else min(wrong, num)
        assert out.num_accepted[i] == accepted, name
        assert out.token_ids[i].tolist() == greedy[:accepted + 1] + [-1] * (k - accepted), name


def test_greedy_penalties_count_the_drafts():
    # Constant target logits [3.0, 2.9, 0, 0]; frequency_penalty 0.5 subtracts 0.5 per earlier output occurrence:
    #   position 0: 3.0 vs 2.9          -> 0
    #   position 1: 3.0 - 0.5 = 2.5     -> 1 (2.9)
    #   position 2: 2.5 vs 2.9 - 0.5    -> 0
    #   position 3: 2.0 vs 2.4          -> 1
    # so drafts [0, 1, 0] are all accepted and 1 follows; drafts [0, 0, 1] are rejected at position 1, which emits 1.
    # Without counting the drafts every position would emit 0.
    logits = np.zeros((2, 4, 4), np.float32)
    logits[:, :, 0], logits[:, :, 1] = 3.0, 2.9
    s = _arrays([SamplingRow(P(temperature=0, frequency_penalty=0.5), seed=0)] * 2, 4)
    out = _verify(logits, np.array([[0, 1, 0], [0, 0, 1]], np.int32), None, np.array([3, 3], np.int32), s)
    assert out.num_accepted.tolist() == [3, 1]
    assert out.token_ids.tolist() == [[0, 1, 0, 1], [0, 1, -1, -1]]


def test_greedy_penalties_equal_sample_loop():
    """Greedy rows with every penalty: verify equals `sample` called once per step with the output so far."""
    vocab, k = 16, 4
    prompt, before = [5, 6, 5], [6, 9]
    params = P(temperature=0, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.6)

    def model(tokens: list[int]) -> np.ndarray:  # the toy model, pulled toward tokens already seen
        x = _toy_logits(tokens, vocab)
        x[tokens] += 2.5
        return x

    generated: list[int] = []
    for _ in range(k + 1):
        row = SamplingRow(params, seed=0, prompt_token_ids=prompt, output_token_ids=before + generated)
        generated.append(int(_sample(model(prompt + before + generated)[None], _arrays([row], vocab)).token_ids[0]))
    assert generated != _greedy_loop(prompt + before, k + 1, vocab)  # the penalties shape this continuation
    drafts = np.array([generated[:k], generated[:2] + [(generated[2] + 1) % vocab, 0]], np.int32)
    logits = np.stack([np.stack([model(prompt + before + list(d[:j])) for j in range(k + 1)]) for d in drafts])
    s = _arrays([SamplingRow(params, seed=0, prompt_token_ids=prompt, output_token_ids=before)] * 2, vocab)
    out = _verify(logits, drafts, None, np.array([k, k], np.int32), s)
    assert out.num_accepted.tolist() == [k, 2]
    assert out.token_ids.tolist() == [generated, generated[:3] + [-1, -1]]


# ---------------------------------------------------------------- sampling rows: agreement with `sample`


def test_no_drafts_is_sample_and_bonus_uses_sample_key():
    """num_drafts = 0 reproduces `sample` exactly; an all-accepted block's bonus is `sample` at step + k."""
    vocab, k = 32, 3
    rng = np.random.default_rng(1)
    params = [P(temperature=1.0), P(temperature=0.7, top_k=5), P(temperature=1.3, top_p=0.8, min_p=0.05),
              P(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2, logprobs=3),
              P(temperature=0)]
    rows = [SamplingRow(p, seed=100 + i, step=10 + i, prompt_token_ids=[1, 2, 3], output_token_ids=list(range(10 + i)))
            for i, p in enumerate(params)]
    b = len(rows)
    logits = (rng.standard_normal((b, k + 1, vocab)) * 2).astype(np.float32)
    drafts = rng.integers(0, vocab, (b, k)).astype(np.int32)
    # Make each draft certain under the target (p(draft) = 1 exactly in f32), so every draft is accepted.
    for j in range(k):
        logits[np.arange(b), j, drafts[:, j]] = 1000.0
    s = _arrays(rows, vocab)

    first = _verify(logits, drafts, None, np.zeros(b, np.int32), s)
    expected = _sample(logits[:, 0], s)
    assert first.num_accepted.tolist() == [0] * b
    np.testing.assert_array_equal(first.token_ids[:, 0], expected.token_ids)
    np.testing.assert_array_equal(first.logprobs[:, 0], expected.logprobs)
    np.testing.assert_array_equal(first.top_logprobs[:, 0], expected.top_logprobs)
    np.testing.assert_array_equal(first.top_token_ids[:, 0], expected.top_token_ids)
    np.testing.assert_array_equal(first.ranks[:, 0], expected.ranks)
    assert np.all(first.ranks[:, 1:] == 0)  # not emitted
    no_slots = _verify(logits[:, :1], drafts[:, :0], None, np.zeros(b, np.int32), s)  # k = 0
    np.testing.assert_array_equal(no_slots.token_ids[:, 0], expected.token_ids)

    block = _verify(logits, drafts, None, np.full(b, k, np.int32), s)
    assert block.num_accepted.tolist() == [k] * b
    np.testing.assert_array_equal(block.token_ids[:, :k], drafts)
    later = [SamplingRow(r.params, seed=r.seed, step=r.step + k, prompt_token_ids=r.prompt_token_ids,
                         output_token_ids=[*r.output_token_ids, *d]) for r, d in zip(rows, drafts.tolist())]
    bonus = _sample(logits[:, k], _arrays(later, vocab))
    np.testing.assert_array_equal(block.token_ids[:, k], bonus.token_ids)
    np.testing.assert_array_equal(block.logprobs[:, k], bonus.logprobs)
    np.testing.assert_array_equal(block.top_token_ids[:, k], bonus.top_token_ids)
    np.testing.assert_array_equal(block.ranks[:, k], bonus.ranks)


def test_ranks_of_emitted_tokens_are_their_place_in_the_raw_distribution():
    """Accepted drafts (drawn from a q unlike the target), corrections and bonus tokens: each one's rank is 1 + the
    number of raw target logprobs at its position strictly above its own (float64 NumPy reference); 0 past it."""
    vocab, k, b = 16, 4, 64
    logits, drafts, q, num_drafts = _random_batch(b, vocab, k, seed=5)
    rows = [SamplingRow(P(temperature=2.0, logprobs=1 if i % 2 else None), seed=i) for i in range(b)]
    out = _verify(logits, drafts, q, num_drafts, _arrays(rows, vocab))
    ranks, token_ids = np.asarray(out.ranks), np.asarray(out.token_ids)
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for i in range(b):
        n = int(out.num_accepted[i]) + 1
        want = [1 + np.sum(raw[i, j] > raw[i, j, token_ids[i, j]]) for j in range(n)]
        assert ranks[i, :n].tolist() == want, i
        assert np.all(ranks[i, n:] == 0)
    assert np.sum(ranks > 1) > b and np.any(np.asarray(out.num_accepted) > 1)


# ---------------------------------------------------------------- seeds and batch independence


def _random_batch(b: int, vocab: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((b, k + 1, vocab)) * 1.5).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab) * 0.5, (b, k)).astype(np.float32)
    drafts = np.array([[rng.choice(vocab, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(b)], np.int32)
    num_drafts = rng.integers(0, k + 1, b).astype(np.int32)
    return logits, drafts, q, num_drafts


def test_same_seeds_same_outputs_and_seeds_matter():
    vocab, k, b = 16, 4, 64
    logits, drafts, q, num_drafts = _random_batch(b, vocab, k, seed=2)
    s = _arrays([SamplingRow(P(temperature=1.0), seed=i) for i in range(b)], vocab)
    a = _verify(logits, drafts, q, num_drafts, s)
    again = _verify(logits, drafts, q, num_drafts, s)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(again)):
        np.testing.assert_array_equal(x, y)
    other = _verify(logits, drafts, q, num_drafts, _arrays([SamplingRow(P(), seed=i + b) for i in range(b)], vocab))
    assert (np.asarray(a.token_ids) != np.asarray(other.token_ids)).any(axis=1).mean() > 0.3


def _widen(s: SamplingArrays, like: SamplingArrays) -> SamplingArrays:
    """`s` with its id lists padded with -1 to the widths of `like` (more padding, same meaning, same shapes)."""
    def pad(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, y.shape[1] - x.shape[1])), constant_values=-1)
    return s.replace(suppress=pad(s.suppress, like.suppress), penalty_ids=pad(s.penalty_ids, like.penalty_ids))


@pytest.mark.parametrize("draft_probs", [True, False])
def test_row_independent_of_batch(draft_probs):
    """Each row gives the same outputs in a mixed batch (penalties, truncation, logprobs switch on the batch-wide
    branches) as at another index of a batch of only inert padding rows (where those branches are off)."""
    vocab, k, b = 16, 3, 8
    logits, drafts, q, num_drafts = _random_batch(b, vocab, k, seed=3)
    num_drafts[:] = [3, 3, 2, 1, 0, 3, 0, 0]  # the last 2 rows pad the batch
    q = q if draft_probs else None
    rows = [SamplingRow(P(temperature=0.8), seed=11, step=4),
            SamplingRow(P(temperature=1.0, top_k=4, top_p=0.9), seed=12),
            SamplingRow(P(temperature=0), seed=13),
            SamplingRow(P(temperature=1.0, repetition_penalty=1.5, logprobs=2), seed=14, output_token_ids=[1, 2]),
            SamplingRow(P(temperature=1.2, min_p=0.1, n=3), seed=15, sample_index=2),
            SamplingRow(P(temperature=0.6, top_p=0.5, n=2), seed=16, sample_index=1)]
    s = _arrays(rows, vocab, batch=b)
    together = _verify(logits, drafts, q, num_drafts, s)
    for i, row in enumerate(rows):
        def moved(x: np.ndarray | None) -> np.ndarray | None:  # row i first, the other rows' data behind it
            return None if x is None else np.roll(x, -i, axis=0)
        alone = _verify(moved(logits), moved(drafts), moved(q), moved(num_drafts), _widen(_arrays([row], vocab, b), s))
        got, want = _row(together, i), _row(alone, 0)
        names = ["num_accepted", "token_ids", "logprobs", "top_logprobs", "top_token_ids", "ranks"]
        for name, x, y in zip(names, got, want, strict=True):
            if (name.startswith("top") or name == "ranks") and not row.params.logprobs:
                continue  # filled only when some row of the batch asks for them
            np.testing.assert_array_equal(x, y, err_msg=f"row {i} {name}")


# ---------------------------------------------------------------- lossless sampling


P_TARGET = np.array([0.35, 0.25, 0.2, 0.15, 0.05])
Q_FULL = np.array([0.1, 0.15, 0.3, 0.25, 0.2])  # full support, disagrees with P_TARGET
Q_ZEROS = np.array([0.0, 0.5, 0.0, 0.2, 0.3])  # zero where P_TARGET is not


def _processed(p: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """p after temperature then top_k, as `process_logits` does to logits log(p)."""
    x = np.log(p) / temperature
    x[np.argsort(-x)[top_k:]] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def _sampled_block(q: np.ndarray | None, k: int, params: P, seed: int, fn=None) -> tuple[np.ndarray, np.ndarray]:
    """N rows with target log(P_TARGET) at every position and drafts from q (None: deterministic drafts)."""
    rng = np.random.default_rng(seed)
    logits = np.broadcast_to(np.log(P_TARGET).astype(np.float32), (N, k + 1, len(P_TARGET)))
    if q is None:
        drafts = (np.arange(N)[:, None] + np.arange(k)[None, :]) % len(P_TARGET)  # any rule not using the keys
        probs = None
    else:
        drafts = rng.choice(len(q), size=(N, k), p=q)
        probs = np.broadcast_to(q.astype(np.float32), (N, k, len(q)))
    steps = rng.integers(0, 1000, N)
    rows = [SamplingRow(params, seed=seed * N + i, step=int(steps[i])) for i in range(N)]
    out = (fn or _verify)(logits, drafts.astype(np.int32), probs, np.full(N, k, np.int32),
                          _arrays(rows, len(P_TARGET)))
    return np.asarray(out.num_accepted), np.asarray(out.token_ids), drafts


def _chi_square_p(tokens: np.ndarray, expected_probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(expected_probs))
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, f"tokens outside the target's support: {counts}"
    return scipy.stats.chisquare(counts[keep], expected_probs[keep] * len(tokens)).pvalue


def _acceptance_tolerance(rate: float) -> float:
    return 4 * np.sqrt(rate * (1 - rate) / N)  # 4 standard errors of a binomial proportion over N rows


@pytest.mark.parametrize("q_name,q,params", [
    ("full support", Q_FULL, P(temperature=1.0)),
    ("zeros where p is not", Q_ZEROS, P(temperature=1.0)),
    ("deterministic drafts", None, P(temperature=1.0)),
    ("temperature 0.7, top_k 4", Q_FULL, P(temperature=0.7, top_k=4)),
])
def test_first_token_is_distributed_as_the_target(q_name, q, params):
    k = 3
    num_accepted, tokens, drafts = _sampled_block(q, k, params, seed=5)
    p = _processed(P_TARGET, params.temperature, params.top_k or len(P_TARGET))
    assert _chi_square_p(tokens[:, 0], p) > ALPHA, q_name
    # P(first draft accepted) = sum_x min(p(x), q(x)); for a deterministic draft x it is p(x).
    expected_rate = np.minimum(p, q).sum() if q is not None else p[drafts[:, 0]].mean()
    rate = (num_accepted >= 1).mean()
    assert abs(rate - expected_rate) < _acceptance_tolerance(expected_rate), (rate, expected_rate)
    assert (num_accepted == 0).any() and (num_accepted == k).any()  # rejections and full acceptances both happen
    # Emitted tokens are the accepted drafts, then one more; nothing after.
    position = np.arange(k + 1)[None, :]
    np.testing.assert_array_equal(np.where(position < num_accepted[:, None], tokens, 0),
                                  np.where(position < num_accepted[:, None], np.pad(drafts, ((0, 0), (0, 1))), 0))
    assert (tokens[position > num_accepted[:, None]] == -1).all()


# A context-dependent target and draft for the joint of the first two tokens: p(x, y) = P1[x] * P2[x, y].
P1 = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
P2 = np.full((5, 5), 0.1) + 0.5 * np.eye(5)[(np.arange(5) + 1) % 5]  # mode of the token after x: x + 1
Q1 = np.array([0.1, 0.1, 0.4, 0.4, 0.0])
Q2 = np.full((5, 5), 0.1) + 0.5 * np.eye(5)[(np.arange(5) + 2) % 5]  # draft's mode after x: x + 2
Q2[0] = [0.0, 0.0, 0.5, 0.5, 0.0]  # zeros where P2[0] is not


@pytest.mark.parametrize("deterministic", [False, True])
def test_first_two_tokens_jointly_distributed_as_the_target(deterministic):
    """Two verification steps, as an engine runs them: a row rejected at position 0 emits one token, and its second
    token comes from the next step (output step 1, drafts after the emitted token)."""
    rng = np.random.default_rng(6)
    vocab, k = 5, 2
    uniform = np.log(np.full(vocab, 1 / vocab, np.float32))
    if deterministic:
        x1 = np.arange(N) % vocab
        x2 = (x1 + 1) % vocab
    else:
        x1 = rng.choice(vocab, N, p=Q1)
        x2 = np.array([rng.choice(vocab, p=Q2[x]) for x in x1])
    logits = np.stack([np.broadcast_to(np.log(P1), (N, vocab)), np.log(P2[x1]), np.broadcast_to(uniform, (N, vocab))],
                      axis=1).astype(np.float32)
    probs = None if deterministic else np.stack([np.broadcast_to(Q1, (N, vocab)), Q2[x1]], axis=1).astype(np.float32)
    rows = [SamplingRow(P(temperature=1.0), seed=i) for i in range(N)]
    first = _verify(logits, np.stack([x1, x2], 1).astype(np.int32), probs, np.full(N, k, np.int32),
                    _arrays(rows, vocab))
    y1 = np.asarray(first.token_ids[:, 0])
    # Next step for every row (used only where position 0 was rejected): context y1, output step 1.
    z1 = (y1 + 1) % vocab if deterministic else np.array([rng.choice(vocab, p=Q2[y]) for y in y1])
    logits2 = np.stack([np.log(P2[y1]), np.broadcast_to(uniform, (N, vocab)), np.broadcast_to(uniform, (N, vocab))],
                       axis=1).astype(np.float32)
    probs2 = None if deterministic else np.stack([Q2[y1], np.broadcast_to(Q1, (N, vocab))], axis=1).astype(np.float32)
    rows2 = [SamplingRow(P(temperature=1.0), seed=i, step=1) for i in range(N)]
    second = _verify(logits2, np.stack([z1, z1], 1).astype(np.int32), probs2, np.ones(N, np.int32),
                     _arrays(rows2, vocab))
    accepted = np.asarray(first.num_accepted)
    y2 = np.where(accepted >= 1, np.asarray(first.token_ids[:, 1]), np.asarray(second.token_ids[:, 0]))
    assert _chi_square_p(y1 * vocab + y2, (P1[:, None] * P2).ravel()) > ALPHA  # 25 cells, 24 degrees of freedom
    assert (accepted == 0).any() and (accepted == 1).any() and (accepted == 2).any()
    expected_rate = P1[x1].mean() if deterministic else np.minimum(P1, Q1).sum()
    assert abs((accepted >= 1).mean() - expected_rate) < _acceptance_tolerance(expected_rate)


@pytest.mark.parametrize("wrong", ["residual from p", "accept with p(x) ignoring q", "accept with q/p"])
def test_wrong_rules_fail_the_chi_square(monkeypatch, wrong):
    """The chi-square test above has power: each plausible mistake is rejected at ALPHA (by a wide margin)."""
    if wrong == "residual from p":
        monkeypatch.setattr(verify_module, "_residual", lambda p, q: p)
    elif wrong == "accept with p(x) ignoring q":
        monkeypatch.setattr(verify_module, "_accepted", lambda u, p_draft, q_draft: u < p_draft)
    else:
        monkeypatch.setattr(verify_module, "_accepted", lambda u, p_draft, q_draft: u * p_draft < q_draft)
    wrong_verify = jax.jit(lambda *args: verify_module.verify(*args))  # a fresh trace under the patch
    _, tokens, _ = _sampled_block(Q_FULL, 3, P(temperature=1.0), seed=5, fn=wrong_verify)
    assert _chi_square_p(tokens[:, 0], P_TARGET) < ALPHA * 1e-6, wrong
