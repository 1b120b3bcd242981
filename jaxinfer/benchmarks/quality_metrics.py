"""The quality workload's metrics on numpy arrays: log-softmax, per-position KL divergence, NLL, percentiles, top-1
agreement and greedy-continuation flips.

KL divergence is that of llama.cpp's `llama-perplexity --kl-divergence` (tools/perplexity/README.md there): per
position, KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)) over the whole vocabulary, P the baseline model's
next-token distribution and Q the quantized one's; its mean and percentiles over the positions are reported.
Log-probabilities are computed in f64 and kept in f32 (what the baseline store holds); the sums run in f64, so a
model compared with itself scores exactly 0.
"""

from __future__ import annotations

import numpy as np

ROW_BLOCK = 16  # rows per step: f64 temporaries of 16 x 49,152 stay in cache (10x faster than 512 rows at once)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """f32[n, V] log-probabilities of f32 / bf16 logits [n, V], computed in f64 (max-shifted log-sum-exp) and
    rounded to f32 once.

    Raises:
      ValueError: if `logits` is not 2-D or has no columns.
    """
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [n, V] with V >= 1, got shape {logits.shape}")
    out = np.empty(logits.shape, np.float32)
    for s in range(0, len(logits), ROW_BLOCK):
        x = logits[s : s + ROW_BLOCK].astype(np.float64)  # [rows, V]
        top = x.max(axis=-1, keepdims=True)
        out[s : s + ROW_BLOCK] = x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    return out


def kl_divergence(base_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """f64[n] KL(P || Q) in nats per row, P = exp(base_logp), Q = exp(logp), both [n, V] log-probabilities (f32,
    from `log_softmax`). Entries where P is 0 (log P = -inf) contribute 0; where P > 0 and Q is 0 the row is +inf.

    Raises:
      ValueError: if the shapes differ.
    """
    if base_logp.shape != logp.shape:
        raise ValueError(f"baseline log-probs {base_logp.shape} and compared log-probs {logp.shape} differ in shape")
    out = np.empty(len(base_logp), np.float64)
    for s in range(0, len(base_logp), ROW_BLOCK):
        p = base_logp[s : s + ROW_BLOCK].astype(np.float64)  # [rows, V]
        with np.errstate(invalid="ignore"):  # -inf - -inf where both are 0: masked below
            terms = np.where(np.isneginf(p), 0.0, np.exp(p) * (p - logp[s : s + ROW_BLOCK].astype(np.float64)))
        out[s : s + ROW_BLOCK] = terms.sum(axis=-1)
    return out


def token_nll(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """f64[n] negative log-likelihood (nats) of targets[i] (ids in [0, V)) under row i of `logp` [n, V].

    Raises:
      ValueError: if there is not one target per row.
    """
    targets = np.asarray(targets)
    if targets.shape != (logp.shape[0],):
        raise ValueError(f"need one target per row: {targets.shape} targets for {logp.shape[0]} rows")
    return -logp[np.arange(len(targets)), targets].astype(np.float64)


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, interpolating linearly between the two nearest ranks (rank
    q / 100 * (n - 1) of the sorted values, numpy's default; llama.cpp's KLD percentiles are order statistics).

    Raises:
      ValueError: for no values or q outside [0, 100].
    """
    values = np.asarray(values, np.float64)
    if values.size == 0 or not 0 <= q <= 100:
        raise ValueError(f"percentile {q} of {values.size} values: need values and q in [0, 100]")
    return float(np.percentile(values, q))


def top1_agreement(base_top1: np.ndarray, top1: np.ndarray) -> float:
    """Share in [0, 1] of positions whose argmax token is the same in both i32[n] arrays (llama.cpp's "Same top
    p").

    Raises:
      ValueError: if the shapes differ or are empty.
    """
    if base_top1.shape != top1.shape or base_top1.size == 0:
        raise ValueError(f"top-1 arrays must have one equal, non-empty shape: {base_top1.shape} vs {top1.shape}")
    return float(np.mean(base_top1 == top1))


def count_flips(base_tokens: np.ndarray, tokens: np.ndarray) -> int:
    """Continuations that differ anywhere: base_tokens and tokens are i32[N, steps], row i the greedy tokens after
    the same prompt; a row counts once however many of its tokens differ.

    Raises:
      ValueError: if the shapes differ.
    """
    base_tokens, tokens = np.asarray(base_tokens), np.asarray(tokens)
    if base_tokens.shape != tokens.shape or base_tokens.ndim != 2:
        raise ValueError(f"continuations must both be [N, steps]: {base_tokens.shape} vs {tokens.shape}")
    return int(np.any(base_tokens != tokens, axis=1).sum())
