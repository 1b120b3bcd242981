"""KV handoff between engines of different tensor-parallel degrees on the tiny random Llama-3 (4 query heads, 2 KV
heads): run by tests/jaxinfer/engine/test_kv_handoff.py in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.

tp=1 -> 2 splits the two KV heads one per device; tp=4 replicates each head into two KV slots
(`models.partition.tp_layout`), so a payload exported at tp=4 carries each head once and an import at tp=4 writes
each head into both of its slots. Every path must give the tokens of one tp=1 engine running the whole request
(greedy and seeded), and the receiving cache must hold the payload's values exactly, split over its devices.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_handoff import kv_slot_sources
from tests.jaxinfer.engine.test_kv_handoff import CONFIG, GREEDY, PROMPTS, SEEDED, assert_idle, drain, one_engine, \
    prefill
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir

TP = (1, 2, 4)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Engine]:
    assert len(jax.devices()) == 8
    folder = make_tiny_model_dir(Path(tmp_path_factory.mktemp("tiny")))
    return {tp: Engine(EngineConfig(model=str(folder), tensor_parallel_size=tp, **CONFIG)) for tp in TP}


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 4), (4, 1), (1, 4)])
def test_handoff_across_tp_degrees_equals_one_engine(engines, src, dst):
    reference, a, b = engines[1], engines[src], engines[dst]
    for params in (GREEDY, SEEDED):
        for prompt in PROMPTS[1:3]:  # 19 and 17 tokens: one shape bucket
            ref = one_engine(reference, prompt, params).outputs[0]
            first, handoff = prefill(a, prompt, params)
            assert first.outputs[0].token_ids == ref.token_ids[:1] and handoff.k.shape[1] == 2  # heads, not slots
            b.import_kv(handoff, params, request_id="dec")
            if params is GREEDY:  # the receiving cache holds the payload exactly, each device its heads
                pages = list(b.scheduler.waiting[0].page_ids)
                slots = kv_slot_sources(b.model_config, b.mesh)
                held = b.runner.kv.gather_tokens(pages, handoff.num_tokens, np.arange(len(slots)), jnp.float32)
                np.testing.assert_array_equal(held.k, handoff.k[:, slots])
                shard = b.runner.kv_cache.k.addressable_shards[0].data.shape
                assert shard[2] == len(slots) // dst
            done = drain(b)["dec"][-1].outputs[0]
            assert (done.token_ids, done.text, done.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert_idle(*engines.values())
