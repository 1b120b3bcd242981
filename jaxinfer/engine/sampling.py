"""Batched token sampling on device, one independent row per sequence.

1. On the host, `SamplingArrays.build` turns one `SamplingRow` per sequence into fixed-width arrays: per-row
   parameters, banned ids (always `SUPPRESS_WIDTH` wide: no request's stop ids pick a compiled shape), and the
   ids the penalties need: one array of each penalised row's prompt ids then output ids, -1 padded, and a count
   of its prompt ids; and each row's logit bias as ids (-1 padded) and values. These take one of two variants of
   widths: (1, 1) when no row uses penalties or a logit bias, else (the caller's `penalty_width`, the runner's
   longest context; MAX_LOGIT_BIAS), so no request's lengths pick a compiled shape. Each row's allowed tokens
   travel as a packed bitmask i32[B, ceil(V / 32)], all ones where a row is unconstrained, so constrained
   (structured output, allowed_token_ids, bad words: the caller ANDs them into `SamplingRow.allowed`) and
   unconstrained rows share one batch and one compiled step. Padding rows are greedy and inert.
2. On device, `sample` processes each row of logits f32[B, V] in vLLM's order:
     a. ids >= vocab_limit (padding of the embedding table) are masked;
     b. raw log-probabilities: log_softmax of these logits, in f32 (returned, never used for sampling);
     c. bans: the row's suppressed ids (EOS / stop ids before min_tokens) and every token whose bit in the row's
        bitmask is 0 get -inf (the bits are unpacked on device, fused with the other bans; the raw logprobs of b
        stay those of the unmasked distribution, as for every ban);
     c'. logit bias: each row's bias added to the logits of its ids (in the branch of d-e, run when some row has
        penalties or a bias);
     d. repetition penalty (Keskar et al. 2019, CTRL) over tokens seen in the prompt or the output;
     e. presence and frequency penalties (OpenAI) over the output tokens' counts;
     -> greedy rows (temperature 0) take the argmax here;
     f. temperature;
     g. min_p: keep tokens with probability >= min_p * the top probability (Nguyen et al. 2024, "Turning Up the
        Heat: Min-p Sampling");
     h. top_k: keep tokens whose logit is >= the k-th largest (ties at the boundary are kept);
     i. top_p: keep the smallest prefix of the descending distribution (renormalised after g-h) whose mass
        reaches p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"); ties kept;
     j. sample with `jax.random.categorical` (Gumbel-max) under the key
        `fold_in(fold_in(key(seed), sample_index), step)`.
   The key depends only on the request (seed), which of its n samples the row is, and the index of the output
   token, and every step above acts on the row alone, so a request draws the same tokens alone or in any batch.
   A batch of greedy rows only (decided on device, so one compiled step serves all batches) stops at the argmax
   after e (c' included); b is then one log-sum-exp per row, and the [B, V] log_softmax (top logprobs, the
   sampled token's rank) is computed only when some row wants logprobs (`logprobs=0` included).
3. The host slices `top_logprobs` / `top_token_ids` to each request's `logprobs`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import sampling_host
from jaxinfer.engine.sampling_math import (apply_logit_bias, apply_penalties, limit_vocab, no_top_logprobs,
                                           scatter_ids, sort_descending, token_logprobs, top_logprobs_and_ranks,
                                           unpack_bitmask)
from jaxinfer.request_limits import MAX_LOGIT_BIAS, SUPPRESS_WIDTH
from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams
from models import pytree
from pallas_kernels import cpu_gemv
from pallas_kernels.cpu_gemv.logits import logit_rows, truncation_threshold

__all__ = ["MAX_LOGPROBS", "SampleOutput", "SamplingArrays", "SamplingRow", "apply_penalties", "process_logits",
           "sample", "sample_and_check", "sample_keys"]

GREEDY_TEMPERATURE = 1e-5  # smallest temperature sampled as such; below it, argmax


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """Host-side sampling inputs of one sequence for one step.

    Attributes:
      params: the request's sampling parameters.
      seed: the request's seed in [0, 2**32) (its `params.seed`, or one the engine drew).
      sample_index: which of the request's `params.n` samples this sequence is, in [0, n).
      step: index of the output token being sampled (= len(output_token_ids)), >= 0; None means
        len(output_token_ids).
      prompt_token_ids: the prompt, ids in [0, V); read only when a penalty is on.
      output_token_ids: tokens generated so far, ids in [0, V); read only when a penalty is on.
      suppress: token ids in [0, V) never sampled this step (EOS and stop ids before `min_tokens`).
      allowed: i32[ceil(V / 32)], the tokens this step may sample as a packed bitmask in llguidance's layout (bit
        j of word i, `(word >> j) & 1`, allows token 32 i + j), read when `SamplingArrays.build` runs; None allows
        every token.

    Raises:
      ValueError: if seed, sample_index or step is out of range, or allowed is not a 1-D int32 numpy array,
        naming it.
    """

    params: SamplingParams
    seed: int
    sample_index: int = 0
    step: int | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    suppress: Sequence[int] = ()
    allowed: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.step is None:
            object.__setattr__(self, "step", len(self.output_token_ids))
        sampling_host.check_row(self)


@pytree.dataclass
class SamplingArrays:
    """Per-row sampling inputs for a batch of B rows (see the module docstring for the order they apply in).

    Attributes:
      temperature: f32[B], >= 0; 0 selects argmax.
      top_k: i32[B], in [1, V]; V disables.
      top_p: f32[B], in (0, 1]; 1 disables.
      min_p: f32[B], in [0, 1]; 0 disables.
      repetition_penalty: f32[B], > 0; 1 disables.
      presence_penalty: f32[B]; 0 disables.
      frequency_penalty: f32[B]; 0 disables.
      seed: u32[B], the request's seed.
      sample_index: i32[B], which of the request's n samples the row is.
      step: i32[B], index of the output token being sampled.
      num_logprobs: i32[B], in [-1, MAX_LOGPROBS]: top log-probabilities the row wants; -1 when it wants no
        logprobs (0 still wants its token's logprob and rank).
      suppress: i32[B, SUPPRESS_WIDTH], ids in [0, V) set to -inf; -1 pads.
      token_bitmask: i32[B, ceil(V / 32)], packed allowed tokens (`SamplingRow.allowed`'s layout); tokens whose
        bit is 0 are set to -inf with the bans. -1 (all allowed) for unconstrained and padding rows: always
        present, so constrained and unconstrained batches share one compiled step.
      penalty_ids: i32[B, W], ids in [0, V) or -1 (padding): a penalised row's prompt ids, then its output ids;
        other rows hold only -1. W is 1 when no row uses penalties or a bias, else `build`'s penalty_width.
      num_prompt_ids: i32[B], in [0, W]: how many of the row's leading penalty_ids are its prompt (0 for rows
        without penalties). The repetition penalty reads all of a row's ids, presence and frequency the rest.
      bias_ids: i32[B, L], the row's logit_bias ids in [0, V), distinct, then -1. L is 1 when no row uses
        penalties or a bias, else MAX_LOGIT_BIAS (the wide variant together with penalty_ids).
      bias_values: f32[B, L], the bias of each of bias_ids (0 where -1).
      vocab_limit: i32[], ids >= it are never sampled and get no probability.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    step: jax.Array
    num_logprobs: jax.Array
    suppress: jax.Array
    token_bitmask: jax.Array
    penalty_ids: jax.Array
    num_prompt_ids: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    vocab_limit: jax.Array

    @staticmethod
    def build(rows: Sequence[SamplingRow], batch: int, vocab: int, vocab_limit: int | None = None, *,
              penalty_width: int) -> SamplingArrays:
        """Host-side (numpy) arrays for `len(rows)` rows, padded with greedy, inert rows to `batch` rows.

        Args:
          rows: one entry per sequence, in batch order.
          batch: B, the padded batch size, >= len(rows).
          vocab: V, the logits' last dimension.
          vocab_limit: ids in [vocab_limit, V) are never sampled; None means V.
          penalty_width: W of `penalty_ids` when some row uses penalties or a logit bias, >= 1 and >= any
            penalised row's prompt plus output length: a constant of the caller (the runner's longest context, in
            tokens), so that penalty and bias inputs take only two shapes per batch size.

        Returns:
          numpy arrays, ready to pass to a jitted function calling `sample`.

        Raises:
          ValueError: if batch < len(rows), vocab_limit is not in [1, V], penalty_width < 1, a token id is outside
            [0, V), a row bans more than SUPPRESS_WIDTH ids, a penalised row has more than penalty_width ids, a row
            has more than MAX_LOGIT_BIAS biases, or a row's `allowed` is not ceil(V / 32) words or allows no token
            below vocab_limit.
        """
        limit = vocab if vocab_limit is None else vocab_limit
        sampling_host.check_batch(rows, batch, vocab, limit, penalty_width)
        pad = batch - len(rows)
        ps = [r.params for r in rows]

        def per_row(values: list, fill: float | int, dtype: type) -> np.ndarray:
            return np.array(values + [fill] * pad, dtype)

        wide = any(p.uses_penalties or p.logit_bias for p in ps)
        penalty_ids, num_prompt_ids = sampling_host.penalty_ids(rows, batch, penalty_width if wide else 1, vocab)
        bias_ids, bias_values = sampling_host.logit_bias(rows, batch, MAX_LOGIT_BIAS if wide else 1, vocab)
        return SamplingArrays(
            # Temperatures below GREEDY_TEMPERATURE would overflow logits / T in f32: they are greedy.
            temperature=per_row([p.temperature if p.temperature >= GREEDY_TEMPERATURE else 0.0 for p in ps],
                                0.0, np.float32),
            top_k=per_row([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], vocab, np.int32),
            top_p=per_row([p.top_p for p in ps], 1.0, np.float32),
            min_p=per_row([p.min_p for p in ps], 0.0, np.float32),
            repetition_penalty=per_row([p.repetition_penalty for p in ps], 1.0, np.float32),
            presence_penalty=per_row([p.presence_penalty for p in ps], 0.0, np.float32),
            frequency_penalty=per_row([p.frequency_penalty for p in ps], 0.0, np.float32),
            seed=per_row([r.seed for r in rows], 0, np.uint32),
            sample_index=per_row([r.sample_index for r in rows], 0, np.int32),
            step=per_row([r.step for r in rows], 0, np.int32),
            num_logprobs=per_row([-1 if p.logprobs is None else p.logprobs for p in ps], -1, np.int32),
            suppress=sampling_host.pad_ids([r.suppress for r in rows], batch, SUPPRESS_WIDTH, vocab, "suppress"),
            token_bitmask=sampling_host.token_bitmask(rows, batch, vocab, limit),
            penalty_ids=penalty_ids,
            num_prompt_ids=num_prompt_ids,
            bias_ids=bias_ids,
            bias_values=bias_values,
            vocab_limit=np.int32(limit),
        )


@pytree.dataclass
class SampleOutput:
    """What `sample` returns for B rows.

    Attributes:
      token_ids: i32[B], sampled ids in [0, vocab_limit).
      logprobs: f32[B], the sampled token's raw log-probability (log_softmax of the unprocessed logits).
      top_logprobs: f32[B, MAX_LOGPROBS], the largest raw log-probabilities of each row, descending. Filled only
        when some row of the batch wants logprobs (num_logprobs >= 0), else zeros.
      top_token_ids: i32[B, MAX_LOGPROBS], their token ids in [0, vocab_limit); -1 where vocab_limit <
        MAX_LOGPROBS leaves no token, and everywhere when not filled.
      ranks: i32[B], in [1, vocab_limit]: the sampled token's rank in the raw distribution, 1 + the number of raw
        log-probabilities strictly larger than its own (vLLM's rank; tied tokens share one). Filled as
        top_logprobs, else zeros.
    """

    token_ids: jax.Array
    logprobs: jax.Array
    top_logprobs: jax.Array
    top_token_ids: jax.Array
    ranks: jax.Array


def _uses_bias_or_penalties(s: SamplingArrays) -> jax.Array:
    penalties = (s.repetition_penalty != 1) | (s.presence_penalty != 0) | (s.frequency_penalty != 0)
    return jnp.any(penalties) | jnp.any(s.bias_ids >= 0)


def _bias_and_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Steps c'-e of f32[B, V] banned logits."""
    return apply_penalties(apply_logit_bias(logits, s), s)


def _truncate(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """top_k then top_p on temperature-scaled logits f32[B, V]; dropped tokens get -inf."""
    vocab = scaled.shape[-1]
    sorted_desc = sort_descending(scaled)  # [B, V]
    kth = jnp.take_along_axis(sorted_desc, (s.top_k - 1)[:, None], axis=-1)  # [B, 1]
    kth = jnp.where(s.top_k[:, None] < vocab, kth, -jnp.inf)
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)  # [B, V], renormalised over the top-k set
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly earlier tokens in the sorted order
    # The most likely token is always kept (a top_p that rounds to 0 in f32 still leaves one token).
    keep = (mass_before < s.top_p[:, None]) | (s.top_p[:, None] >= 1) | (jnp.arange(vocab) == 0)[None, :]
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # smallest kept logit
    return jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)


def _ban(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Steps a and c: -inf at ids >= vocab_limit, at each row's suppressed ids and where its bitmask has a 0."""
    vocab = logits.shape[-1]
    # The suppressed ids scattered to [B, V]: cheaper on CPU than comparing every column with the M ids.
    banned = scatter_ids(s.suppress, vocab, True, jnp.bool_, add=False) | ~unpack_bitmask(s.token_bitmask, vocab)
    return jnp.where(banned, -jnp.inf, limit_vocab(logits, s.vocab_limit))


def _penalised(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Steps a, c-e of f32[B, V] raw logits: what greedy rows take the argmax of."""
    return jax.lax.cond(_uses_bias_or_penalties(s), _bias_and_penalties, lambda x, _: x, _ban(logits, s), s)


def _native() -> bool:
    """Whether the sampler traced now runs its row reductions natively (`pallas_kernels.cpu_gemv.logits`): on CPU
    with the native kernels allowed (`cpu_gemv.native_kernels`; the step forbids them on a multi-device mesh)."""
    return cpu_gemv.native_allowed() and cpu_gemv.active()


def _truncate_native(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """`_truncate` with its threshold from the native kernel (`truncation_threshold`: no sort of the rows)."""
    return jnp.where(scaled >= truncation_threshold(scaled, s.top_k, s.top_p)[:, None], scaled, -jnp.inf)


def _truncated(penalised: jax.Array, s: SamplingArrays, native: bool = False) -> jax.Array:
    """Steps f-i of f32[B, V] penalised logits (top-k / top-p by `_truncate_native` when `native`)."""
    safe_t = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = penalised / safe_t[:, None]
    # min_p in log space: p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p); log(0) = -inf keeps everything.
    top = jnp.max(scaled, axis=-1, keepdims=True)
    scaled = jnp.where(scaled - top >= jnp.log(s.min_p)[:, None], scaled, -jnp.inf)
    needs_truncation = jnp.any((s.top_k < scaled.shape[-1]) | (s.top_p < 1))
    return jax.lax.cond(needs_truncation, _truncate_native if native else _truncate, lambda x, _: x, scaled, s)


def process_logits(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps a-i of the module docstring, without sampling.

    Args:
      logits: f32[B, V] raw logits.
      s: sampling arrays of B rows.

    Returns:
      raw_logprobs: f32[B, V], log_softmax of the logits over [0, vocab_limit) (-inf beyond).
      penalised: f32[B, V], logits after bans and penalties (greedy rows take their argmax); -inf where banned.
      truncated: f32[B, V], `penalised` / temperature (1 for greedy rows) after min_p, top_k and top_p; -inf
        outside each row's kept set.
    """
    logits = logits.astype(jnp.float32)
    penalised = _penalised(logits, s)
    return jax.nn.log_softmax(limit_vocab(logits, s.vocab_limit), axis=-1), penalised, _truncated(penalised, s)


def sample_keys(seed: jax.Array, sample_index: jax.Array, step: jax.Array) -> jax.Array:
    """Key[B] of each row's output token: `fold_in(fold_in(key(seed), sample_index), step)` (module docstring, j).

    Args:
      seed: u32[B], the request's seed.
      sample_index: i32[B], which of the request's n samples the row is.
      step: i32[B], index of the output token being sampled.
    """
    return jax.vmap(lambda seed, index, step: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index),
                                                                 step))(seed, sample_index, step)


def _greedy_token_ids(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """i32[B] argmax of every row after steps a, c-e: the path of a batch whose rows are all greedy.

    The argmax sits inside each branch so that, without penalties or bias, the bans fuse into it (no [B, V] written).
    """
    return jax.lax.cond(_uses_bias_or_penalties(s),
                        lambda x, s: jnp.argmax(_bias_and_penalties(_ban(x, s), s), axis=-1),
                        lambda x, s: jnp.argmax(_ban(x, s), axis=-1), logits, s)


def _sampled_token_ids(logits: jax.Array, s: SamplingArrays, native: bool = False) -> jax.Array:
    """i32[B] tokens of steps a-j: argmax for greedy rows, Gumbel-max over the truncated logits for the others.

    `jax.random.categorical(key, l)` is `argmax(gumbel(key, l.shape, l.dtype) + l)`; written out here so that
    greedy and sampled rows share one argmax. Same draws as `vmap(jax.random.categorical)(keys, truncated)`.
    """
    penalised = _penalised(logits, s)
    truncated = _truncated(penalised, s, native)
    keys = sample_keys(s.seed, s.sample_index, s.step)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, truncated.shape[-1:], truncated.dtype))(keys)  # [B, V]
    # Written out before the argmax: fused into the argmax's (value, index) reduction, XLA's CPU backend computes
    # the random bits element by element, about 2x slower. The barrier changes no value, only fusion.
    noise = jax.lax.optimization_barrier(noise)
    return jnp.argmax(jnp.where(s.temperature[:, None] > 0, noise + truncated, penalised), axis=-1)


def _top_logprobs_of_logits(logits: jax.Array, vocab_limit: jax.Array,
                            token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return top_logprobs_and_ranks(jax.nn.log_softmax(limit_vocab(logits, vocab_limit), axis=-1), token_ids)


def sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    """Samples one token per row (steps a-j of the module docstring).

    A batch whose rows are all greedy (temperature 0, as padding rows are) takes a fast path decided on device,
    so that one compiled step serves every batch: the argmax after bans and penalties, without temperature,
    truncation or random numbers. Either path gives the same tokens for the same rows. On CPU with the native
    kernels allowed (`pallas_kernels.cpu_gemv.native_kernels`), the greedy argmax and the sampled token's
    log-sum-exp come from `pallas_kernels.cpu_gemv.logits.logit_rows` (same tokens; logprobs to f32 rounding),
    and top-k / top-p from `truncation_threshold` instead of a sort (the same kept set, but for a token whose
    mass-before lies within ~1e-6 of top_p).

    Args:
      logits: f32[B, V] (other float dtypes are upcast).
      s: sampling arrays of B rows.

    Returns:
      SampleOutput of B rows.
    """
    return sample_and_check(logits, s)[0]


def sample_and_check(logits: jax.Array, s: SamplingArrays) -> tuple[SampleOutput, jax.Array]:
    """`sample`, and bool[B]: whether all V logits of row b are finite (from the same pass over the logits as the
    sampling's row reductions where those are native)."""
    logits = logits.astype(jnp.float32)
    if _native():  # the row reductions in vectors (`logit_rows`, `truncation_threshold`)
        argmax, row_max, log_sum_exp, finite = logit_rows(logits, s.suppress, s.token_bitmask, s.vocab_limit)
        greedy = lambda x, s: jax.lax.cond(_uses_bias_or_penalties(s), _greedy_token_ids, lambda *_: argmax, x, s)
        # a function of its own: lax.cond caches a branch's trace by function, not by the native switch
        sampled = functools.partial(_sampled_token_ids, native=True)
        token_ids = jax.lax.cond(jnp.all(s.temperature == 0), greedy, sampled, logits, s).astype(jnp.int32)
        own = jnp.where(token_ids < s.vocab_limit, jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0],
                        -jnp.inf)  # limit_vocab's value at the token, without a [B, V] pass
        logprobs = own - row_max - log_sum_exp  # `token_logprobs`' arithmetic
    else:
        token_ids = jax.lax.cond(jnp.all(s.temperature == 0), _greedy_token_ids, _sampled_token_ids, logits, s)
        token_ids = token_ids.astype(jnp.int32)
        logprobs = token_logprobs(logits, token_ids, s.vocab_limit)
        finite = jnp.all(jnp.isfinite(logits), axis=-1)
    # Raw log-probabilities over [B, V] (top ones, the sampled token's rank) only when some row asks for them.
    top_values, top_ids, ranks = jax.lax.cond(jnp.any(s.num_logprobs >= 0), _top_logprobs_of_logits,
                                              no_top_logprobs, logits, s.vocab_limit, token_ids)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_values, top_token_ids=top_ids,
                        ranks=ranks), finite
