"""KV handoff between engines (`jaxinfer.engine.kv_handoff`) on the tiny random Llama-3, one device.

The reference is always one engine running the whole request. A request prefilled on engine A (`prefill_only`),
exported and imported into engine B must continue exactly as that reference when the pages arrive as they are
(f32 -> f32, also into another page size; int8 -> int8), greedy and seeded. Where the wire or B's cache changes
the numbers (bf16 / int8 / fp8 on the wire, an int8 cache on B), tokens may differ after a few steps on a random
model with small logit margins, so the tests bound the first decode step's logits instead, and check that B holds
exactly the converted values (`pallas_kernels.kv_quant`). TP degrees other than 1 are in
`multi_device_kv_handoff_checks.py` (run in a child process with 8 fake devices, below).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_handoff import WIRE_DTYPES, KVHandoff
from jaxinfer.outputs import RequestOutput
from jaxinfer.scheduler.chunk import ScheduledChunk
from pallas_kernels import kv_quant
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

REPO = Path(__file__).resolve().parents[3]
CONFIG = dict(warmup=False, page_size=8, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64,
              kv_cache_memory_bytes=1 << 20)
L, K, H = 2, 2, 16  # the tiny model's layers, KV heads, head dim
PROMPTS = random_prompts(3, 11, min_len=5, max_len=40) + random_prompts(1, 12, min_len=16, max_len=16)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=10, repetition_penalty=1.2, ignore_eos=True)


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    """Steps until idle; every request's outputs in order."""
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def one_engine(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    engine.add_request(prompt, params, request_id="ref")
    return drain(engine)["ref"][-1]


def prefill(engine: Engine, prompt: list[int], params: SamplingParams, wire: str | None = None
            ) -> tuple[RequestOutput, KVHandoff]:
    engine.add_request(prompt, params, request_id="pre", prefill_only=True)
    (out,) = drain(engine)["pre"]
    assert out.finished and out.outputs[0].finish_reason == "handoff" and len(out.outputs[0].token_ids) == 1
    return out, engine.export_kv("pre", wire)


def assert_idle(*engines: Engine) -> None:
    for e in engines:
        assert not e.has_unfinished_requests() and not e._handoffs
        assert e.page_allocator.num_used_pages == e.page_allocator.num_evictable_pages  # only cached pages left


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama3"))


@pytest.fixture(scope="module")
def a(tiny_dir) -> Engine:
    return Engine(EngineConfig(model=str(tiny_dir), **CONFIG))


@pytest.fixture(scope="module")
def b(tiny_dir) -> Engine:
    """The decode side: pages of 4 tokens (A's are 8)."""
    return Engine(EngineConfig(model=str(tiny_dir), **{**CONFIG, "page_size": 4}))


@pytest.fixture(scope="module")
def int8_engines(tiny_dir) -> tuple[Engine, Engine]:
    return tuple(Engine(EngineConfig(model=str(tiny_dir), kv_cache_dtype="int8", **CONFIG)) for _ in range(2))


# A stop string that never matches holds back its length - 1 characters of a live stream's text: the prefill side's
# delta must hold them back too, or the decode side's first delta sends them twice.
HELD_BACK = dataclasses.replace(GREEDY, stop=["w999 w999"])


@pytest.mark.parametrize("params", [GREEDY, SEEDED, HELD_BACK], ids=["greedy", "seeded", "held_back"])
def test_handoff_continues_as_one_engine(a, b, params):
    for prompt in PROMPTS:
        ref = one_engine(a, prompt, params).outputs[0]
        first, handoff = prefill(a, prompt, params)
        assert first.outputs[0].delta_token_ids == ref.token_ids[:1]
        assert (handoff.num_tokens, handoff.k.shape, handoff.kv_dtype, handoff.page_size) == (
            len(prompt), (L, K, len(prompt), H), "float32", 8)
        assert params.seed is None or handoff.seed == params.seed
        assert handoff.nbytes == 2 * L * K * len(prompt) * H * 4 and handoff.k_scale is None
        b.import_kv(handoff, params, request_id="dec")
        outs = drain(b)["dec"]
        done = outs[-1].outputs[0]
        assert (done.token_ids, done.text, done.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        # the decode side streams only what the prefill side did not
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == ref.token_ids[1:]
        assert first.outputs[0].delta_text + "".join(o.outputs[0].delta_text for o in outs) == ref.text
    assert_idle(a, b)


def test_unseeded_sampling_keeps_the_prefill_engines_seed(a, b):
    params = dataclasses.replace(SEEDED, seed=None)
    _, handoff = prefill(a, PROMPTS[0], params)
    b.import_kv(handoff, params, request_id="dec")
    got = drain(b)["dec"][-1].outputs[0].token_ids
    assert got == one_engine(a, PROMPTS[0], dataclasses.replace(params, seed=handoff.seed)).outputs[0].token_ids


def test_imported_pages_join_the_prefix_cache(a, b):
    prompt = PROMPTS[3]  # 16 tokens: 4 full pages of B
    _, handoff = prefill(a, prompt, GREEDY)
    b.reset_prefix_cache()
    b.import_kv(handoff, GREEDY, request_id="dec")
    drain(b)
    assert b.stats()["prefix_cache_hit_tokens"] == 0  # imported pages are no cache hits
    one_engine(b, prompt, GREEDY)
    assert b.stats()["prefix_cache_hit_tokens"] == 15  # all 4 pages; the last token is computed again
    assert_idle(a, b)


@functools.partial(jax.jit, static_argnames="dtype")
def round_trip(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """f32 K/V as a cache holds them after a trip through `dtype` pages."""
    return kv_quant.convert(*kv_quant.convert(x, None, dtype), jnp.float32)[0]


def first_decode_logits(engine: Engine, pages: list[int], token: int, num_tokens: int) -> np.ndarray:
    """Logits of the step that decodes `token` at position num_tokens over these pages (writes its K/V there)."""
    return engine.runner.compute_logits([ScheduledChunk([token], num_tokens, pages)])[0]


@pytest.mark.parametrize("wire,tol", [("bfloat16", 0.05), ("int8", 0.15), ("fp8", 0.5)])
def test_quantized_wire_bounds_the_logits(a, b, wire, tol):
    """Measured max |logit difference| on these prompts (logits spread over ~7): bf16 0.01, int8 0.05, fp8 0.2."""
    for prompt in PROMPTS[:3]:
        a.add_request(prompt, GREEDY, request_id="pre", prefill_only=True)
        drain(a)
        seq = a._handoffs["pre"][1]
        token = seq.output_token_ids[0]
        f32 = a.runner.kv.gather_tokens(list(seq.page_ids), len(prompt), np.arange(K), jnp.float32)
        ref = first_decode_logits(a, list(seq.page_ids), token, len(prompt))  # position len(prompt) is unused yet
        handoff = pickle.loads(pickle.dumps(a.export_kv("pre", wire)))  # as Ray ships it
        assert handoff.k.dtype == kv_quant.storage_dtype(WIRE_DTYPES[wire])
        assert handoff.nbytes < 2 * f32.k.nbytes
        if wire != "bfloat16":
            assert handoff.k_scale.shape == (L, K, len(prompt)) and handoff.k_scale.dtype == np.float32
        b.import_kv(handoff, GREEDY, request_id="dec")
        pages = list(b.scheduler.waiting[0].page_ids)
        held = b.runner.kv.gather_tokens(pages, len(prompt), np.arange(K), jnp.float32)
        for x, y in ((held.k, f32.k), (held.v, f32.v)):  # B holds exactly the converted values
            np.testing.assert_array_equal(x, np.asarray(round_trip(y, WIRE_DTYPES[wire])))
        diff = np.abs(first_decode_logits(b, pages, token, len(prompt)) - ref).max()
        assert 0 < diff < tol, diff
        b.abort("dec")
        drain(b)
    assert_idle(a, b)


def test_int8_pages_travel_exactly(int8_engines):
    """int8 cache -> int8 wire (as stored, scales with them) -> int8 cache: the tokens of one int8 engine."""
    src, dst = int8_engines
    for params in (GREEDY, SEEDED):
        for prompt in PROMPTS[:2]:
            ref = one_engine(src, prompt, params).outputs[0].token_ids
            for wire in (None, "int8"):
                _, handoff = prefill(src, prompt, params, wire)
                assert handoff.kv_dtype == "int8" and handoff.k_scale.shape == (L, K, len(prompt))
                dst.import_kv(handoff, params, request_id="dec")
                assert drain(dst)["dec"][-1].outputs[0].token_ids == ref
    assert_idle(src, dst)


def test_into_an_int8_cache(a, int8_engines):
    """f32 pages into an int8 cache: quantized on import exactly as a write of the same K/V would be."""
    dst = int8_engines[1]
    prompt = PROMPTS[0]
    a.add_request(prompt, GREEDY, request_id="pre", prefill_only=True)
    drain(a)
    seq = a._handoffs["pre"][1]
    ref = first_decode_logits(a, list(seq.page_ids), seq.output_token_ids[0], len(prompt))
    handoff = a.export_kv("pre")
    dst.import_kv(handoff, GREEDY, request_id="dec")
    pages = list(dst.scheduler.waiting[0].page_ids)
    held = dst.runner.kv.gather_tokens(pages, len(prompt), np.arange(K), jnp.int8)
    values, scales = jax.jit(kv_quant.quantize, static_argnums=1)(handoff.v, jnp.int8)
    np.testing.assert_array_equal(held.v, np.asarray(values))
    np.testing.assert_array_equal(held.v_scale, np.asarray(scales))
    diff = np.abs(first_decode_logits(dst, pages, handoff.output_token_ids[0], len(prompt)) - ref).max()
    assert 0 < diff < 0.15, diff
    dst.abort("dec")
    drain(dst)
    assert_idle(a, dst)


def test_bad_payloads_and_calls_are_value_errors(a, b):
    _, good = prefill(a, PROMPTS[0], GREEDY)
    n = good.num_tokens
    cases = {
        "head dim": (dataclasses.replace(good, k=good.k[..., :8], v=good.v[..., :8]), r"\(2, 2, 8\).*\(2, 2, 16\)"),
        "layers": (dataclasses.replace(good, k=good.k[:1], v=good.v[:1]), r"\(1, 2, 16\).*\(2, 2, 16\)"),
        "kv heads": (dataclasses.replace(good, k=good.k[:, :1], v=good.v[:, :1]), r"\(2, 1, 16\).*\(2, 2, 16\)"),
        "num_tokens": (dataclasses.replace(good, num_tokens=n - 1), f"num_tokens={n - 1}.*need {n}"),
        "scales": (dataclasses.replace(good, kv_dtype="int8"), "k is"),
        "no output": (dataclasses.replace(good, output_token_ids=()), "no output token"),
        "v shape": (dataclasses.replace(good, v=good.v[:, :, :-1]), "v is"),
    }
    for name, (payload, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            b.import_kv(payload, GREEDY, request_id=name)
    with pytest.raises(ValueError, match="KVHandoff"):
        b.import_kv("pages", GREEDY)
    with pytest.raises(ValueError, match="max_tokens=1"):  # its output so far already uses max_tokens
        b.import_kv(good, dataclasses.replace(GREEDY, max_tokens=1))
    assert_idle(b)
    with pytest.raises(ValueError, match="n=2"):
        a.add_request(PROMPTS[0], dataclasses.replace(SEEDED, n=2), prefill_only=True)
    with pytest.raises(ValueError, match="holds no KV pages"):
        a.export_kv("pre")  # exported already
    a.add_request(PROMPTS[0], GREEDY, request_id="pre", prefill_only=True)
    drain(a)
    with pytest.raises(ValueError, match="wire_dtype='int4'"):
        a.export_kv("pre", "int4")
    with pytest.raises(ValueError, match="already in use"):
        a.add_request(PROMPTS[0], GREEDY, request_id="pre")  # held for its handoff
    a.abort("pre")  # frees the held pages
    assert_idle(a)
    short = one_engine(a, PROMPTS[0], dataclasses.replace(GREEDY, max_tokens=1))
    a.add_request(PROMPTS[0], dataclasses.replace(GREEDY, max_tokens=1), request_id="one", prefill_only=True)
    (out,) = drain(a)["one"]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == short.outputs[0].token_ids
    with pytest.raises(ValueError, match="holds no KV pages"):
        a.export_kv("one")
    assert_idle(a, b)


def test_async_engines_hand_over(a, b):
    async def main() -> tuple[RequestOutput, list[RequestOutput]]:
        pre, dec = AsyncEngine(a), AsyncEngine(b)
        try:
            first, handoff = await pre.prefill(PROMPTS[1], SEEDED, wire_dtype="float32")
            assert (await pre.prefill(PROMPTS[1], dataclasses.replace(SEEDED, max_tokens=1)))[1] is None
            return first, [out async for out in dec.generate_from_handoff(handoff, SEEDED)]
        finally:
            pre.shutdown()
            dec.shutdown()

    first, outs = asyncio.run(main())
    ref = one_engine(a, PROMPTS[1], SEEDED).outputs[0]
    streamed = first.outputs[0].delta_token_ids + sum((o.outputs[0].delta_token_ids for o in outs), [])
    assert streamed == ref.token_ids and outs[-1].outputs[0].text == ref.text
    assert_idle(a, b)


def test_tensor_parallel_handoffs_on_eight_fake_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "jaxinfer" / "engine" / "multi_device_kv_handoff_checks.py")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout
