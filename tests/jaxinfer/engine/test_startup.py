"""Engine start-up refuses options that do not fit the model or the memory with a ValueError naming the option at
fault and the limit it broke (tiny Llama-3 model; most cases fail before its weights load)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.engine import startup
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from tests.jaxinfer.engine.tiny_model import DATA, make_tiny_model_dir

CONFIG = json.loads((DATA / "config.json").read_text())
CONTEXT = CONFIG["max_position_embeddings"]
# f32 K and V of every layer and KV head, per token
TOKEN_BYTES = 2 * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))


def _no_load(monkeypatch):
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("the weights loaded before the check"))


@pytest.mark.parametrize("options, context", [
    ({"page_size": 10**9}, CONTEXT),
    ({"page_size": CONTEXT + 1}, CONTEXT),
    ({"page_size": 64, "max_model_len": 48}, 48),
    ({"page_size": 10**9, "kv_cache_memory_bytes": 1 << 20}, CONTEXT),
])
def test_a_page_larger_than_the_context_is_blamed_on_page_size(tiny_dir, options, context, monkeypatch):
    """Found by a hostile-user trial: page_size=10**9 was reported as a too small kv_cache_memory_bytes."""
    _no_load(monkeypatch)
    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=tiny_dir, warmup=False, **options))
    message = str(e.value)
    assert message.startswith(f"page_size={options['page_size']} is larger than the context, max_model_len={context} "
                              "tokens"), message
    assert f"[1, {context}]" in message and "kv_cache_memory_bytes" not in message


def test_a_page_that_fits_the_context_and_the_budget_starts(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, warmup=False, page_size=CONTEXT, kv_cache_memory_bytes=2 * CONTEXT *
                                 TOKEN_BYTES))
    assert engine.runner.num_pages == 3  # two pages plus the null page


@pytest.mark.parametrize("budget", [None, 1000])
def test_a_page_larger_than_the_budget_names_page_size_and_the_budget(tiny_dir, budget, monkeypatch):
    _no_load(monkeypatch)
    monkeypatch.setattr(startup, "default_kv_budget", lambda: 4096)
    page_size = 128
    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=tiny_dir, warmup=False, page_size=page_size, kv_cache_memory_bytes=budget))
    message = str(e.value)
    page = f"one KV page of page_size={page_size} tokens ({page_size * TOKEN_BYTES} bytes)"
    if budget is None:
        assert message.startswith(f"the KV cache budget, 4096 bytes (kv_cache_memory_bytes unset: a share of free "
                                  f"memory), is smaller than {page}"), message
    else:
        assert message.startswith(f"kv_cache_memory_bytes={budget} is smaller than {page}"), message
    assert message.endswith("; lower page_size or raise kv_cache_memory_bytes")


@pytest.mark.parametrize("budget", [None, 1000])
def test_the_page_count_after_the_load_names_page_size_and_the_budget_too(budget, monkeypatch):
    """`num_kv_pages` checks again with the page bytes only the load tells (a draft model's cache, padded heads)."""
    monkeypatch.setattr(startup, "default_kv_budget", lambda: 4096)
    config = EngineConfig(page_size=8, kv_cache_memory_bytes=budget)
    with pytest.raises(ValueError, match=r"is smaller than one KV page of page_size=8 tokens \(5000 bytes\); lower "
                                         "page_size or raise kv_cache_memory_bytes"):
        startup.num_kv_pages(config, page_bytes=5000, max_model_len=64)
    pages = min((budget or 4096) // 500, config.max_num_seqs * 64 // 8) + 1  # budget // page bytes, + null page
    assert startup.num_kv_pages(config, page_bytes=500, max_model_len=64) == pages


def test_a_budget_beyond_the_memory_is_refused_before_it_is_allocated(tiny_dir):
    """Found by a hostile-user trial: a budget of 10**15 bytes (and room for a million sequences) reached the
    allocation and failed there with XLA's RESOURCE_EXHAUSTED."""
    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=tiny_dir, warmup=False, kv_cache_memory_bytes=10**15, max_num_seqs=10**6))
    message = str(e.value)
    num_pages = 10**6 * CONTEXT // 16  # every sequence's pages: budget // page bytes is more
    assert message.startswith(f"kv_cache_memory_bytes={10**15} gives a KV cache of {num_pages} pages "
                              f"({num_pages * 16 * TOKEN_BYTES} bytes), more than the free memory ("), message
    assert "lower kv_cache_memory_bytes or max_num_seqs" in message
