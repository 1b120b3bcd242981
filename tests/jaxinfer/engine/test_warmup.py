"""Warm-up compiles every step shape a server meets, with and without penalty inputs: requests with penalties then
compile nothing on the engine thread, and a neutral request's tokens do not change when a penalised one shares its
steps (tiny random Llama-3)."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.warmup import compile_prompt, prompt_shapes, warmup_shapes
from tests.jaxinfer.engine.test_engine import Req, assert_idle, run
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 2, 32
PROMPTS = random_prompts(3, seed=5, min_len=10, max_len=30)  # one prefill chunk each
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PENALISED = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=1.5),
             SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.0)]


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A tiny engine warmed at start-up: 2 sequences, 32 tokens a step, one page-table width (8 pages of 8)."""
    engine = Engine(EngineConfig(model=str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))), warmup=True,
                               page_size=8, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                               max_model_len=64, kv_cache_memory_bytes=1 << 20))
    assert engine.warmup.wait(timeout=600)  # a warm persistent cache loads the shapes in the background
    return engine


def _executables(engine: Engine) -> tuple[int, int]:
    """(step executables, executables of the token feed of decode steps run ahead) the runner holds: warm-up's,
    and any a call compiled since (a new shape compiles and joins them)."""
    kinds = [key[0] for key in engine.runner._compiled]
    return kinds.count("step"), kinds.count("feed")


def test_warmup_compiles_each_shape_with_and_without_penalties(warm: Engine) -> None:
    shapes = warmup_shapes(warm.runner, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
    plain = {s[:3] for s in shapes if not s[3]}
    assert plain and {s[:3] for s in shapes if s[3]} == plain
    decode_batches = {n for kind, n, _, _ in shapes if kind == "decode"}
    assert _executables(warm) == (len(shapes), len(decode_batches))  # every shape its own executable


def test_penalised_requests_after_warmup_compile_nothing(warm: Engine) -> None:
    """Penalised requests alone, then one joining a running neutral request (a one-chunk prefill next to a decode,
    then decodes of two rows): every step runs a warm-up executable. The neutral request's tokens are the ones it
    gets alone although its steps now carry the penalised row's ids, and the penalties change the tokens."""
    before = _executables(warm)
    alone = {i: run(warm, [Req(f"alone{i}", PROMPTS[i], GREEDY)]).tokens()[f"alone{i}"] for i in (0, 1)}
    penalised = run(warm, [Req("penalised", PROMPTS[1], PENALISED[0])]).tokens()["penalised"]
    sampled = run(warm, [Req("sampled", PROMPTS[2], PENALISED[1])]).tokens()["sampled"]
    together = run(warm, [Req("neutral", PROMPTS[0], GREEDY)],
                   arrivals={1: [Req("joining", PROMPTS[1], PENALISED[0])]}).tokens()
    assert _executables(warm) == before
    assert together["neutral"] == alone[0]
    assert together["joining"] == penalised != alone[1]  # the penalties act, in either batch
    assert len(sampled[0]) == 10
    assert_idle(warm)


def test_logit_bias_allowed_ids_and_bad_words_compile_nothing_after_warmup(warm: Engine) -> None:
    """logit_bias rides in the penalty inputs' wide variant, allowed_token_ids and bad_words in the token bitmask:
    requests with them, alone, beside a neutral request and beside a penalised one, run warm-up executables only
    (the shape list is the same as before they existed: each base shape with and without penalty inputs), and
    they act."""
    shapes = warmup_shapes(warm.runner, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
    assert len(shapes) == 2 * len({s[:3] for s in shapes})
    before = _executables(warm)
    biased = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={50: 100.0})
    ruled = SamplingParams(temperature=0.9, seed=2, max_tokens=10, ignore_eos=True, allowed_token_ids=[7, 8, 9, 50],
                           bad_words=["w8", "w7 w9"])
    alone = run(warm, [Req("biased", PROMPTS[0], biased)]).tokens()["biased"]
    together = run(warm, [Req("neutral", PROMPTS[1], GREEDY)],
                   arrivals={1: [Req("ruled", PROMPTS[2], ruled)], 2: [Req("joining", PROMPTS[0], biased)]}).tokens()
    mixed = run(warm, [Req("penalised", PROMPTS[1], PENALISED[0]), Req("biased2", PROMPTS[0], biased)]).tokens()
    assert _executables(warm) == before
    assert alone == together["joining"] == mixed["biased2"] == [[50] * 10]
    ruled_ids = together["ruled"][0]
    assert set(ruled_ids) <= {7, 9, 50} and (7, 9) not in set(zip(ruled_ids, ruled_ids[1:]))
    assert_idle(warm)


def test_compile_prompt_compiles_every_step_of_a_long_prompts_chunked_prefill(tmp_path_factory) -> None:
    """A 200-token prompt alone, 32 tokens a step, pages of 8, at most 32 pages: six chunks of 32 and one of 8. The
    first two end within 8 pages (page-table width 8), the others need 12 to 25 (width 32); the last one's 8 tokens
    pad to 16. So three shapes, and the prompt's prefill then compiles nothing."""
    engine = Engine(EngineConfig(model=str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))), warmup=False,
                                 page_size=8, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=256,
                                 kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False))
    shapes = prompt_shapes(engine.runner, 200, 32)
    assert [(kind, n, width) for kind, n, width, _ in shapes] == [("prefill", 32, 8), ("prefill", 32, 32),
                                                                  ("prefill", 8, 32)]
    compile_prompt(engine.runner, 200, 32)
    assert _executables(engine) == (3, 0)
    (prompt,) = random_prompts(1, seed=9, min_len=200, max_len=200)
    out = run(engine, [Req("long", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))])
    assert len(out.tokens()["long"][0]) == 1
    assert _executables(engine) == (3, 0)  # every step ran an executable compiled ahead
    with pytest.raises(ValueError, match="exceeds the context"):
        prompt_shapes(engine.runner, 257, 32)
