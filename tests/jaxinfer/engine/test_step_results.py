"""`step_results.pack_rows` / `StepResult.unpack`: a step's sampling output travels to the host as one array and
comes back field for field, bit for bit (special floats included), for the first n rows only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.sampling import SampleOutput
from jaxinfer.engine.step_results import StepResult, pack_rows

SPECIAL = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -1e-38, 3.4e38, -7.25], np.float32)


@settings(max_examples=12, deadline=None)  # few shapes, few compiles; k = 20: MAX_LOGPROBS
@given(b=st.sampled_from([1, 8]), k=st.sampled_from([0, 20]), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_packed_rows_unpack_to_the_same_fields(b, k, seed, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, b))
    floats = lambda *shape: rng.choice(SPECIAL, shape) if rng.random() < 0.5 else rng.normal(size=shape).astype(np.float32)  # noqa: E731
    out = SampleOutput(token_ids=rng.integers(0, 2**31 - 1, b, dtype=np.int32), logprobs=floats(b),
                       top_logprobs=floats(b, k), top_token_ids=rng.integers(-1, 50000, (b, k), dtype=np.int32),
                       ranks=rng.integers(1, 50000, b, dtype=np.int32))
    finite = rng.random(b) < 0.5
    packed = jax.jit(pack_rows)(jax.tree.map(jnp.asarray, out), jnp.asarray(finite))
    assert packed.dtype == jnp.int32 and packed.shape == (b, 4 + 2 * k)
    got = StepResult.unpack(np.asarray(packed), n, num_padded_tokens=3)
    assert got.num_padded_tokens == 3 and got.prompt_rows is None
    for name in ("token_ids", "top_token_ids", "ranks"):
        np.testing.assert_array_equal(getattr(got, name), getattr(out, name)[:n])
    for name in ("logprobs", "top_logprobs"):  # the same bits: NaN, -0.0 and infinities too
        np.testing.assert_array_equal(getattr(got, name).view(np.int32), getattr(out, name)[:n].view(np.int32))
        assert getattr(got, name).dtype == np.float32
    np.testing.assert_array_equal(got.finite, finite[:n])
    assert got.finite.dtype == bool
