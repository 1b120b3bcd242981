"""The sampler's greedy fast path and its cheaper pieces give exactly what the plain full path gives.

`full_path_sample` below is the sampler written the plain way, every step for every row (log_softmax over [B, V],
-jnp.sort, vmap(jax.random.categorical), an argmax for greedy rows): `sample` must return the same token ids,
logprobs and top logprobs, bit for bit, whichever path it takes. With the native CPU row reductions
(`pallas_kernels.cpu_gemv.logits`, on by default on CPU) the tokens and top logprobs stay bit for bit; the sampled
token's logprob, whose log-sum-exp the kernel adds in another order, agrees to f32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import sampling
from jaxinfer.engine.sampling import MAX_LOGPROBS, SamplingArrays, SamplingRow, apply_penalties, sample, sample_keys
from jaxinfer.engine.sampling_math import sort_descending, token_logprobs
from jaxinfer.sampling_params import SamplingParams as P
from pallas_kernels import cpu_gemv

V = 1000
B = 16
LIMIT = V - 37  # an embedding table padded past the tokenizer's vocabulary
W = 64  # penalty_width: >= every row's prompt plus output ids here (a runner passes its longest context)
_build = functools.partial(SamplingArrays.build, penalty_width=W)
RANDOM_PRIMITIVES = {"random_bits", "random_seed", "random_fold_in", "random_wrap", "threefry2x32"}


def full_path_sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, ...]:
    """Steps a-j of jaxinfer.engine.sampling's docstring, computed for every row with no shortcut."""
    logits = jnp.where(jnp.arange(V)[None, :] < s.vocab_limit, logits, -jnp.inf)
    raw = jax.nn.log_softmax(logits, axis=-1)
    banned = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], jnp.where(s.suppress >= 0, s.suppress, V)].set(
        True, mode="drop")
    penalised = apply_penalties(jnp.where(banned, -jnp.inf, logits), s)
    scaled = penalised / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = jnp.where(scaled - scaled.max(-1, keepdims=True) >= jnp.log(s.min_p)[:, None], scaled, -jnp.inf)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, (s.top_k - 1)[:, None], axis=-1)
    kth = jnp.where(s.top_k[:, None] < V, kth, -jnp.inf)
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = (jnp.cumsum(probs, -1) - probs < s.top_p[:, None]) | (s.top_p[:, None] >= 1) | (jnp.arange(V) == 0)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    truncated = jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)
    keys = sample_keys(s.seed, s.sample_index, s.step)
    sampled = jax.vmap(jax.random.categorical)(keys, truncated)
    tokens = jnp.where(s.temperature > 0, sampled, jnp.argmax(penalised, axis=-1)).astype(jnp.int32)
    top_values, top_ids = jax.lax.top_k(raw, MAX_LOGPROBS)
    return tokens, jnp.take_along_axis(raw, tokens[:, None], -1)[:, 0], top_values, top_ids, raw


_full = jax.jit(full_path_sample)

GREEDY = [P(temperature=0), P(temperature=0, logprobs=5), P(temperature=0, repetition_penalty=1.3),
          P(temperature=0, presence_penalty=0.8, frequency_penalty=0.4), P(temperature=1e-7)]
SAMPLED = [P(temperature=1.0), P(temperature=0.8, top_p=0.9), P(temperature=0.7, top_k=20, logprobs=3),
           P(temperature=1.2, min_p=0.05, repetition_penalty=1.2), P(temperature=1.5, top_p=0.5, top_k=100),
           P(temperature=0.5, presence_penalty=1.0, frequency_penalty=0.5)]


def _rows(params: list[P], seed: int, penalties: bool = True) -> list[SamplingRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(B):
        p = params[i % len(params)]
        rows.append(SamplingRow(p, seed=int(rng.integers(2**32)), step=int(rng.integers(1000)),
                                prompt_token_ids=rng.integers(0, LIMIT, 30).tolist() if penalties else [],
                                output_token_ids=rng.integers(0, LIMIT, 12).tolist() if penalties else [],
                                suppress=rng.integers(0, LIMIT, i % 5).tolist()))
    return rows


def _logits(seed: int) -> np.ndarray:
    logits = np.random.default_rng(seed).standard_normal((B, V)).astype(np.float32) * 3
    logits[:, 5] = logits[:, 6]  # a tie
    return logits


@pytest.mark.parametrize("name, params", [("greedy", GREEDY), ("greedy, no penalties", [P(temperature=0)]),
                                          ("mixed", GREEDY + SAMPLED), ("sampled", SAMPLED)])
@pytest.mark.parametrize("vocab_limit", [V, LIMIT])
@pytest.mark.parametrize("native", [True, False], ids=["native row reductions", "XLA"])
def test_sample_equals_the_full_path(name: str, params: list[P], vocab_limit: int, native: bool) -> None:
    with cpu_gemv.native_kernels(native):
        sample_fn = lambda logits, s: sample(logits, s)  # noqa: E731 (a function of its own: traced under this setting)
        jaxpr = jax.make_jaxpr(sample_fn)(_logits(0), _build(_rows(params, 0), B, V, vocab_limit))
        sample_fn = jax.jit(sample_fn)
        check_fn = jax.jit(lambda logits, s: sampling.sample_and_check(logits, s))
    assert ("ffi_call" in str(jaxpr)) == (native and cpu_gemv.active())
    for seed in range(3):
        logits = _logits(seed)
        s = _build(_rows(params, seed, penalties=name != "greedy, no penalties"), B, V, vocab_limit)
        logits[seed, 3 + seed] = [np.nan, np.inf, -np.inf][seed]  # a row the step reports as not finite
        with cpu_gemv.native_kernels(native):
            out, finite = check_fn(logits, s)
        np.testing.assert_array_equal(np.asarray(finite), np.isfinite(logits).all(-1))
        logits[seed, 3 + seed] = 0.0
        with cpu_gemv.native_kernels(native):
            out = sample_fn(logits, s)
        tokens, logprobs, top_values, top_ids, raw = map(np.asarray, _full(logits, s))
        np.testing.assert_array_equal(np.asarray(out.token_ids), tokens, err_msg=f"{name}, seed {seed}")
        if native:
            np.testing.assert_allclose(np.asarray(out.logprobs), logprobs, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(out.logprobs), logprobs)
        if any(p.logprobs for p in params):
            np.testing.assert_array_equal(np.asarray(out.top_logprobs), top_values)
            np.testing.assert_array_equal(np.asarray(out.top_token_ids), top_ids)
            own = raw[np.arange(B), tokens][:, None]  # tokens 5 and 6 tie: one rank for both
            np.testing.assert_array_equal(np.asarray(out.ranks), 1 + np.sum(raw > own, axis=-1))
        else:
            assert np.all(np.asarray(out.top_token_ids) == -1) and np.all(np.asarray(out.ranks) == 0)
        assert np.all((tokens >= 0) & (tokens < vocab_limit))


def test_greedy_and_sampled_paths_agree_on_a_greedy_batch() -> None:
    logits = _logits(7)
    s = _build(_rows(GREEDY, 7), B, V, LIMIT)
    greedy = jax.jit(sampling._greedy_token_ids)(logits, s)
    full = jax.jit(sampling._sampled_token_ids)(logits, s)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(full))


def test_gumbel_max_draws_as_jax_random_categorical() -> None:
    n, vocab = 1024, 64
    logits = np.random.default_rng(8).standard_normal((n, vocab)).astype(np.float32)
    rows = [SamplingRow(P(temperature=1.0), seed=3, step=t) for t in range(n)]
    s = _build(rows, n, vocab)
    ours = jax.jit(sample)(logits, s).token_ids
    keys = sample_keys(s.seed, s.sample_index, s.step)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jax.vmap(jax.random.categorical)(keys, logits)))


def test_sort_descending_equals_negated_jnp_sort() -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[:, :40] = rng.integers(-3, 3, (6, 40))  # ties
    x[0, 50:60] = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf]
    x[1, :] = -np.inf
    ours, reference = np.asarray(jax.jit(sort_descending)(x)), np.asarray(-jnp.sort(-x, axis=-1))
    np.testing.assert_array_equal(ours, reference)  # equal treats -0 as 0 and NaN as NaN
    # Subnormals: the CPU backend compares them as zeros, so jnp.sort may leave them among the zeros in any order.
    x[2, 100:] = np.finfo(np.float32).tiny * rng.standard_normal(200)
    flush = lambda a: np.where(np.abs(a) < np.finfo(np.float32).tiny, 0, a)  # noqa: E731
    np.testing.assert_array_equal(flush(np.asarray(jax.jit(sort_descending)(x))), flush(-np.sort(-x, axis=-1)))


@pytest.mark.parametrize("vocab_limit", [V, LIMIT, 1])
def test_token_logprobs_equal_log_softmax(vocab_limit: int) -> None:
    logits = _logits(10)
    tokens = np.random.default_rng(10).integers(0, vocab_limit, B).astype(np.int32)
    masked = np.where(np.arange(V) < vocab_limit, logits, -np.inf)
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(masked, axis=-1)), tokens[:, None], -1)[:, 0]
    got = jax.jit(token_logprobs)(logits, tokens, np.int32(vocab_limit))
    np.testing.assert_array_equal(np.asarray(got), expected)


# ---------------------------------------------------------------- the fast path is taken


def _primitives(jaxpr: jax.extend.core.Jaxpr, skip: object = None) -> set[str]:
    """Names of every primitive in `jaxpr` and its sub-jaxprs, leaving out the sub-jaxpr `skip`."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr) and sub is not skip:
                    names |= _primitives(sub, skip)
    return names


def test_all_greedy_batch_runs_no_sort_and_no_random_bits() -> None:
    s = _build(_rows(GREEDY, 11), B, V, LIMIT)
    jaxpr = jax.make_jaxpr(sample)(_logits(11), s).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    costly = [(e, b.jaxpr) for e in conds for b in e.params["branches"]
              if _primitives(b.jaxpr) & (RANDOM_PRIMITIVES | {"sort"})]
    assert len(costly) == 1, "exactly one top-level branch (the sampled rows') draws random bits and sorts"
    assert not _primitives(jaxpr, skip=costly[0][1]) & (RANDOM_PRIMITIVES | {"sort"})


def test_only_batches_with_sampled_rows_enter_the_sampled_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(logits, s, native=False):
        raise AssertionError("the sampled path ran")

    monkeypatch.setattr(sampling, "_sampled_token_ids", refuse)
    logits = _logits(12)
    with jax.disable_jit():  # lax.cond then runs only the branch its concrete predicate picks
        sample(logits, _build(_rows(GREEDY, 12), B, V, LIMIT))
        with pytest.raises(AssertionError, match="sampled path ran"):
            sample(logits, _build(_rows(GREEDY + SAMPLED[:1], 12), B, V, LIMIT))
