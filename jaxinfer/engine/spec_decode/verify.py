"""Verification of drafted tokens: how many of each sequence's k drafts to accept and which token to emit after them.

The rule is the speculative sampling of Leviathan, Kalman & Matias 2023 ("Fast Inference from Transformers via
Speculative Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2): the emitted tokens are distributed exactly as if the target had sampled them
one at a time with `sample` (lossless), and greedy rows emit exactly the tokens greedy decoding would.

1. The caller runs the target over each sequence's last token plus its k drafts and gathers the k+1 rows of logits:
   row j holds the target's logits for output step `step + j`, given the drafts before j.
2. Each of the B*(k+1) positions gets its row's sampling arrays at output step `step + j`, with the drafts before j
   appended to the output ids the penalties count, and goes through `process_logits` of `jaxinfer.engine.sampling`
   (vocab limit, bans, logit bias, penalties, temperature, min_p, top_k, top_p), exactly as `sample` processes
   one step.
   Greedy rows then have the target's argmax g_j; sampling rows have the target distribution p_j.
3. Draft j of row b (j < num_drafts[b]) passes its test if
     greedy rows:   x_j == g_j;
     sampling rows: u_j < min(1, p_j(x_j) / q_j(x_j)), with u_j ~ U[0, 1), tested as u_j * q_j(x_j) < p_j(x_j);
   num_accepted is the number of leading drafts that pass.
4. At position n = num_accepted the row emits one more token:
     greedy rows:                 g_n;
     sampling rows, n < drafts:   a sample from normalize(max(0, p_n - q_n))  (the rejected draft's residual);
     sampling rows, n == drafts:  a sample from p_n  (the bonus token; Gumbel-max on the processed logits as in
                                  `sample`, under the same key, so num_drafts = 0 reproduces `sample` exactly).
   A deterministic draft (draft_probs None, e.g. n-gram lookup) has q_j = one-hot(x_j), so the rule is: accept
   with probability p_j(x_j), else emit a sample of p_j with x_j removed. It is run as a coupling with the
   target's own sampling: s_j = the token `sample` would draw at position j (Gumbel-max on the processed logits
   under `sample`'s key for output step `step + j`); x_j passes iff x_j == s_j (probability p_j(x_j)), and the
   row emits s_n at n = num_accepted (given s_n != x_n it is distributed as p_n without x_n; at n == num_drafts
   it is the bonus token). Every emitted token is then exactly the token decoding without speculation would have
   drawn with the same seed, so deterministic drafts change neither the distribution nor the tokens.
5. Randomness (drafts with probabilities): position j of a row uses output step `step + j` in two streams of the row's request key
   `fold_in(key(seed), sample_index)`: the resample / bonus key `fold_in(., step + j)` (the key `sample` uses for
   that step) and the accept-test key `fold_in(fold_in(., ACCEPT_STREAM), step + j)`. Every step above acts on the
   row alone, so a request's tokens depend only on its own seed, logits and drafts, never on the batch.

Why it is lossless (Leviathan et al., Appendix A.1): a drafted x is emitted at position j with probability
q(x) * min(1, p(x)/q(x)) = min(p(x), q(x)); a rejection happens with probability 1 - sum_x min(p(x), q(x)) =
sum_x max(0, p(x) - q(x)) and then emits x with probability max(0, p(x) - q(x)) / that sum; the two add up to p(x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.sampling import SamplingArrays, process_logits, sample_keys
from jaxinfer.engine.sampling_math import top_logprobs
from models import pytree

__all__ = ["ACCEPT_STREAM", "VerifyOutput", "verify"]

ACCEPT_STREAM = np.uint32(2**32 - 1)  # fold_in tag of the accept-test keys: no output step (< 2**31) equals it


@pytree.dataclass
class VerifyOutput:
    """What `verify` returns for B rows with k draft slots each.

    Attributes:
      num_accepted: i32[B], in [0, num_drafts[b]]: leading drafts accepted. The row emits num_accepted + 1 tokens.
      token_ids: i32[B, k+1], the emitted tokens: the accepted drafts at [0, num_accepted), then the target's
        token (correction or bonus) at num_accepted, then -1.
      logprobs: f32[B, k+1], raw log-probability (log_softmax of the unprocessed target logits at that position)
        of each emitted token, as `SampleOutput.logprobs`; 0 where token_ids is -1.
      top_logprobs: f32[B, k+1, MAX_LOGPROBS], `SampleOutput.top_logprobs` of every position (filled only when
        some row wants logprobs); positions past num_accepted are not emitted and must be ignored.
      top_token_ids: i32[B, k+1, MAX_LOGPROBS], their ids, as `SampleOutput.top_token_ids`.
      ranks: i32[B, k+1], each emitted token's rank in its position's raw distribution, as `SampleOutput.ranks`
        (filled as top_logprobs, else zeros); 0 where token_ids is -1.
    """

    num_accepted: jax.Array
    token_ids: jax.Array
    logprobs: jax.Array
    top_logprobs: jax.Array
    top_token_ids: jax.Array
    ranks: jax.Array


def _accept_keys(seed: jax.Array, sample_index: jax.Array, step: jax.Array) -> jax.Array:
    """Key[N] of the accept tests: fold_in(fold_in(fold_in(key(seed), sample_index), ACCEPT_STREAM), step)."""
    def one(seed: jax.Array, index: jax.Array, step: jax.Array) -> jax.Array:
        request = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.fold_in(jax.random.fold_in(request, ACCEPT_STREAM), step)
    return jax.vmap(one)(seed, sample_index, step)


def _accepted(u: jax.Array, p_draft: jax.Array, q_draft: jax.Array) -> jax.Array:
    """u < min(1, p/q) for u in [0, 1), without dividing (q = 0 with p > 0 accepts; p = 0 always rejects)."""
    return u * q_draft < p_draft


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """max(0, p - q), unnormalised: the distribution a rejected position resamples from (f32[..., V])."""
    return jnp.maximum(p - q, 0.0)


def _positions(s: SamplingArrays, draft_token_ids: jax.Array) -> SamplingArrays:
    """Sampling arrays of B*(k+1) rows: row b*(k+1) + j is row b at output step step + j, with drafts[b, :j] counted
    as output tokens by the penalties."""
    b, k = draft_token_ids.shape
    t = k + 1
    rows = jax.tree.map(lambda x: jnp.repeat(x, t, axis=0) if jnp.ndim(x) else x, s)  # vocab_limit is a scalar
    j = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)  # [B*t]
    before = jnp.arange(k)[None, None, :] < jnp.arange(t)[None, :, None]  # [1, t, k]: draft i precedes position j
    prefix = jnp.where(before, draft_token_ids[:, None, :], -1).reshape(b * t, k)  # [B*t, k], -1 pads
    # Appended after the row's prompt and output ids (its penalty_ids), so counted as output.
    penalty_ids = jnp.concatenate([rows.penalty_ids, prefix.astype(rows.penalty_ids.dtype)], axis=1)  # [B*t, W+k]
    return rows.replace(step=rows.step + j, penalty_ids=penalty_ids)


def _check_shapes(target_logits: jax.Array, draft_token_ids: jax.Array, draft_probs: jax.Array | None,
                  num_drafts: jax.Array, s: SamplingArrays) -> None:
    if jnp.ndim(target_logits) != 3:
        raise ValueError(f"target_logits must be [B, k+1, V]; got shape {jnp.shape(target_logits)}")
    b, t, vocab = target_logits.shape
    if jnp.shape(draft_token_ids) != (b, t - 1):
        raise ValueError(f"draft_token_ids shape {jnp.shape(draft_token_ids)} must be (B, k) = {(b, t - 1)} for "
                         f"target_logits of shape {target_logits.shape}")
    if draft_probs is not None and jnp.shape(draft_probs) != (b, t - 1, vocab):
        raise ValueError(f"draft_probs shape {jnp.shape(draft_probs)} must be (B, k, V) = {(b, t - 1, vocab)}")
    if jnp.shape(num_drafts) != (b,):
        raise ValueError(f"num_drafts shape {jnp.shape(num_drafts)} must be (B,) = {(b,)}")
    if jnp.shape(s.temperature) != (b,):
        raise ValueError(f"sampling arrays have {jnp.shape(s.temperature)[0]} rows; target_logits has B={b}")


def verify(target_logits: jax.Array, draft_token_ids: jax.Array, draft_probs: jax.Array | None,
           num_drafts: jax.Array, s: SamplingArrays) -> VerifyOutput:
    """Accepts the longest valid prefix of each row's drafts and picks the token after it (module docstring, 1-5).

    Pure and jittable (None and an array for draft_probs compile separately). Rows are independent; a padding row
    (greedy, num_drafts 0, as `SamplingArrays.build` pads) is inert.

    Args:
      target_logits: f32[B, k+1, V] (other float dtypes are upcast), k >= 0. Row b, position j: the target's raw
        logits for the token after the row's context plus drafts [0, j), i.e. for output step s.step[b] + j.
        Positions past num_drafts[b] are read by nothing that is emitted.
      draft_token_ids: i32[B, k], the drafts; entries at j >= num_drafts[b] are padding (any value).
        Real drafts lie in [0, V); a draft >= s.vocab_limit has p = 0 and is rejected.
      draft_probs: f32[B, k, V] or None. Row b, position j: the distribution q_j that the proposer sampled draft j
        from (each real row sums to 1). None: deterministic drafts, q_j = one-hot(draft j). Ignored by greedy rows.
      num_drafts: i32[B], in [0, k]: how many of the row's k draft slots are real.
      s: `SamplingArrays` of B rows for the block's first position: `step` is the index of the output token at
        position 0, `penalty_ids` the row's prompt and output before the drafts (penalty rows), `suppress` its bans.

    Returns:
      VerifyOutput of B rows.

    Raises:
      ValueError: at trace time, if the shapes disagree (naming both).

    Caller contract (not checked inside jit):
      - `s.suppress` applies at all k+1 positions. While a row's output is shorter than min_tokens (the scheduler
        bans EOS / stop ids until then), cap its num_drafts so that the whole block lies before min_tokens
        (step + num_drafts < min_tokens), or at 0.
      - Penalties are exact: position j counts the drafts before it as output tokens (they are, whenever j is
        reached). For rows with penalties, `s.penalty_ids` must hold the row's prompt and output
        (SamplingArrays.build does).
      - A sampling row's draft_probs must be the exact distribution its drafts were drawn from, for the same prefix;
        the proposer may process its own logits any way it likes (temperature, top-k, ...), losslessness holds for
        any q.
    """
    _check_shapes(target_logits, draft_token_ids, draft_probs, num_drafts, s)
    b, t, vocab = target_logits.shape
    k = t - 1
    positions = _positions(s, draft_token_ids)
    raw_logprobs, penalised, truncated = process_logits(target_logits.reshape(b * t, vocab), positions)
    raw_logprobs = raw_logprobs.reshape(b, t, vocab)
    truncated = truncated.reshape(b, t, vocab)  # sampling rows: log p_j up to a constant
    target_argmax = jnp.argmax(penalised, axis=-1).astype(jnp.int32).reshape(b, t)  # g_j
    greedy_row = (s.temperature <= 0)[:, None]  # [B, 1]
    drafts = jnp.clip(draft_token_ids.astype(jnp.int32), 0, vocab - 1)  # [B, k]; padding made a valid index
    is_real = jnp.arange(k)[None, :] < num_drafts[:, None]  # [B, k]

    keys = sample_keys(positions.seed, positions.sample_index, positions.step)  # [B*t], `sample`'s keys
    if draft_probs is None:  # deterministic drafts: coupled with the target's own sample at each position
        target_sample = jax.vmap(jax.random.categorical)(keys, truncated.reshape(b * t, vocab))
        choice = jnp.where(greedy_row, target_argmax, target_sample.astype(jnp.int32).reshape(b, t))  # [B, t]
        passes = (drafts == choice[:, :k]) & is_real
        num_accepted = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        return _emit(drafts, choice, num_accepted, raw_logprobs, positions.num_logprobs)

    p = jax.nn.softmax(truncated[:, :k], axis=-1)  # [B, k, V]
    p_draft = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]  # [B, k]
    q = draft_probs.astype(jnp.float32)
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, k]
    residual = _residual(p, q)  # [B, k, V]
    accept_keys = _accept_keys(positions.seed, positions.sample_index, positions.step).reshape(b, t)[:, :k]
    u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys)  # [B, k], U[0, 1)
    passes = jnp.where(greedy_row, drafts == target_argmax[:, :k], _accepted(u, p_draft, q_draft)) & is_real
    num_accepted = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [B]

    # p = q up to rounding leaves no residual mass; a rejection there is a rounding event and resamples from p.
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
    residual_logits = jnp.where(has_mass, jnp.log(residual), truncated[:, :k])  # [B, k, V]
    rejected_at = jnp.arange(k)[None, :, None] < num_drafts[:, None, None]  # [B, k, 1]: a draft was tested here
    resample_logits = jnp.concatenate(
        [jnp.where(rejected_at, residual_logits, truncated[:, :k]), truncated[:, k:]], axis=1)  # [B, t, V]
    resampled = jax.vmap(jax.random.categorical)(keys, resample_logits.reshape(b * t, vocab))
    final = jnp.where(greedy_row, target_argmax, resampled.astype(jnp.int32).reshape(b, t))  # [B, t]
    return _emit(drafts, final, num_accepted, raw_logprobs, positions.num_logprobs)


def _emit(drafts: jax.Array, final: jax.Array, num_accepted: jax.Array, raw_logprobs: jax.Array,
          num_logprobs: jax.Array) -> VerifyOutput:
    """The VerifyOutput of rows that accept `num_accepted` drafts [B, k] and then emit `final` [B, k+1] at that
    position; raw_logprobs f32[B, k+1, V], num_logprobs i32[B*(k+1)]."""
    b, t, vocab = raw_logprobs.shape
    position = jnp.arange(t)[None, :]
    n = num_accepted[:, None]
    drafts_then_pad = jnp.pad(drafts, ((0, 0), (0, 1)))  # [B, t]
    token_ids = jnp.where(position < n, drafts_then_pad, jnp.where(position == n, final, -1))  # [B, t]
    safe_ids = jnp.maximum(token_ids, 0)  # [B, t], -1 made a valid index
    logprobs = jnp.take_along_axis(raw_logprobs, safe_ids[..., None], axis=-1)[..., 0]
    logprobs = jnp.where(token_ids >= 0, logprobs, 0.0)
    top_values, top_ids, ranks = top_logprobs(raw_logprobs.reshape(b * t, vocab), num_logprobs, safe_ids.reshape(-1))
    return VerifyOutput(num_accepted=num_accepted, token_ids=token_ids, logprobs=logprobs,
                        top_logprobs=top_values.reshape(b, t, -1), top_token_ids=top_ids.reshape(b, t, -1),
                        ranks=jnp.where(token_ids >= 0, ranks.reshape(b, t), 0))
