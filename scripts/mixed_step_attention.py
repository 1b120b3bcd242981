"""Times the reference paged attention (the CPU path) on steps that mix long prefill chunks with short rows, with
its per-sequence pass for such steps on and forced off (every sequence's rows in one batched pass).

SmolLM2-135M's attention shape (9 query / 3 KV heads of 64, f32, pages of 16 tokens, page-table width 128 pages);
one layer, median of `--reps` calls after a compiling one. The two passes must agree to 1e-4 (they differ only in
the order of float sums); the script fails otherwise.

    .venv/bin/python scripts/mixed_step_attention.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import reference

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, WIDTH = 3, 3, 64, 16, 128
# (name, new tokens per sequence, context per sequence incl. the new tokens)
CASES = [
    ("31 decodes + a 481-token chunk", [1] * 31 + [481], [500] * 31 + [1000]),
    ("a 422-token chunk + new prompts of 50, 38", [422, 50, 38], [900, 50, 38]),
    ("a 360-token chunk + a new prompt of 150", [360, 150], [872, 150]),
    ("4 new prompts of 128 (stays batched)", [128] * 4, [128] * 4),
    ("16 new prompts of 32 (stays batched)", [32] * 16, [32] * 16),
]


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _inputs(q_lens: list[int], kv_lens: list[int], rng: np.random.Generator) -> tuple[tuple, int]:
    """Padded step inputs as the engine builds them (powers of two); returns (args, max_q_len)."""
    batch, tokens = _next_pow2(len(q_lens)), _next_pow2(sum(q_lens))
    num_pages = 1 + sum(-(-kv // PAGE_SIZE) for kv in kv_lens)
    k = rng.standard_normal((num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM), np.float32)
    v = rng.standard_normal((num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM), np.float32)
    table, lens, nxt = np.zeros((batch, WIDTH), np.int32), np.zeros(batch, np.int32), 1
    for b, kv in enumerate(kv_lens):
        n = -(-kv // PAGE_SIZE)
        table[b, :n], lens[b], nxt = np.arange(nxt, nxt + n), kv, nxt + n
    cu = np.full(batch + 1, sum(q_lens), np.int32)
    cu[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((tokens, NUM_KV_HEADS * GROUP, HEAD_DIM), np.float32)
    return tuple(map(jnp.asarray, (q, k, v, lens, table, cu))), _next_pow2(max(q_lens))


def _time(fn, args: tuple, max_q_len: int, reps: int) -> tuple[float, np.ndarray]:
    call = lambda: fn(*args, max_q_len=max_q_len, sm_scale=HEAD_DIM**-0.5).block_until_ready()  # noqa: E731
    out = np.asarray(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    impl = reference.paged_attention_reference.__wrapped__
    static = ("max_q_len", "sm_scale")
    split = jax.jit(impl, static_argnames=static)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; one layer, ms (median of {args.reps})")
    print(f"{'step':44s} {'batched':>9s} {'split':>9s} {'speed-up':>9s}")
    for name, q_lens, kv_lens in CASES:
        inputs, max_q_len = _inputs(q_lens, kv_lens, np.random.default_rng(0))
        t_split, out_split = _time(split, inputs, max_q_len, args.reps)
        saved = reference.SPLIT_MIN_Q_LEN
        reference.SPLIT_MIN_Q_LEN = 10**9  # read at trace time: this jit traces the batched pass only
        try:
            # A new function object: jax caches traces per function, so jit(impl) would reuse the split trace.
            batched = jax.jit(lambda *a, **kw: impl(*a, **kw), static_argnames=static)
            t_batched, out_batched = _time(batched, inputs, max_q_len, args.reps)
        finally:
            reference.SPLIT_MIN_Q_LEN = saved
        np.testing.assert_allclose(out_split, out_batched, rtol=1e-4, atol=1e-4, err_msg=name)
        print(f"{name:44s} {t_batched:9.1f} {t_split:9.1f} {t_batched / t_split:8.2f}x")


if __name__ == "__main__":
    main()
