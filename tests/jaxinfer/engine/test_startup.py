"""Engine start-up refuses options that do not fit the model or the memory with a ValueError naming the option at
fault and the limit it broke (tiny Llama-3 model; most cases fail before its weights load)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.engine import kv_budget, startup
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
    monkeypatch.setattr(kv_budget, "memory_cap", lambda config: kv_budget.MemoryCap(4096, "a test cap"))
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
    """`size_kv_cache` checks again with the page bytes only the load tells (a draft model's cache, padded heads)."""
    monkeypatch.setattr(kv_budget, "memory_cap", lambda config: kv_budget.MemoryCap(4096, "a test cap"))
    config = EngineConfig(page_size=8, kv_cache_memory_bytes=budget)
    with pytest.raises(ValueError, match=r"is smaller than one KV page of page_size=8 tokens \(5000 bytes\); lower "
                                         "page_size or raise kv_cache_memory_bytes"):
        kv_budget.size_kv_cache(config, page_bytes=5000, max_model_len=64)
    pages = min((budget or 4096) // 500, config.max_num_seqs * 64 // 8) + 1  # budget // page bytes, + null page
    assert kv_budget.size_kv_cache(config, page_bytes=500, max_model_len=64).num_pages == pages


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


def test_the_default_cache_holds_the_work_when_memory_allows(tiny_dir, caplog):
    """kv_cache_memory_bytes unset: max_num_seqs sequences of max_model_len tokens, not a share of memory."""
    with caplog.at_level("INFO", logger="jaxinfer.engine.startup"):
        engine = Engine(EngineConfig(model=tiny_dir, warmup=False, max_num_seqs=3, max_model_len=40, page_size=8))
    assert engine.runner.num_pages == 3 * 5 + 1  # 3 sequences of ceil(40 / 8) pages, plus the null page
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert line.startswith("KV cache: 120 tokens (15 pages of 8, float32), 3 sequences of max_model_len=40 "
                           "tokens; sized to all the work: max_num_seqs=3 sequences of max_model_len=40 tokens"), line


def test_a_cache_the_memory_cannot_hold_is_capped_with_a_log_line_saying_so(tiny_dir, caplog, monkeypatch):
    """Memory short of the work: the cache takes what memory_utilization allows and the log says how to get more."""
    page_bytes = 8 * TOKEN_BYTES
    monkeypatch.setattr(kv_budget, "memory_cap", lambda config: kv_budget.MemoryCap(7 * page_bytes + 5, "a test cap"))
    with caplog.at_level("INFO", logger="jaxinfer.engine.startup"):
        engine = Engine(EngineConfig(model=tiny_dir, warmup=False, max_num_seqs=3, max_model_len=40, page_size=8))
    assert engine.runner.num_pages == 7 + 1
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert line.startswith("KV cache: 56 tokens (7 pages of 8, float32), 1.4 sequences of max_model_len=40 tokens; "
                           "capped at a test cap"), line
    assert "less than the work needs, max_num_seqs=3 sequences of max_model_len=40 tokens" in line
    assert "raise memory_utilization or give kv_cache_memory_bytes, or lower max_num_seqs or max_model_len" in line


@pytest.mark.parametrize("pages, pages_per_seq", [(5, 5), (15, 5), (7, 5), (2, 3), (3, 7)])
def test_the_sequence_count_reads_as_a_plain_number(pages, pages_per_seq):
    """Found by a fresh-user trial: "1.00 sequences". Whole counts print as integers, "1" takes the singular,
    others keep two decimals at most."""
    sizing = kv_budget.KVSizing(num_pages=pages + 1, tokens=pages * 8, sequences=pages / pages_per_seq, reason="")
    number, word = sizing.sequences_text().split(" ")
    assert float(number) == pytest.approx(pages / pages_per_seq, abs=0.005)
    assert ("." in number) == (pages % pages_per_seq != 0) and len(number.partition(".")[2]) <= 2
    assert word == ("sequence" if pages == pages_per_seq else "sequences")


def test_memory_utilization_sets_the_cpu_cap_from_total_memory(monkeypatch):
    """The CPU cap is memory_utilization of total memory (at most half of what is available), in 64 MiB steps."""
    import psutil

    class Mem:
        total, available = 64 << 30, 48 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    assert kv_budget.memory_cap(EngineConfig()).cap_bytes == int(0.1 * (64 << 30)) // (64 << 20) * (64 << 20)
    assert kv_budget.memory_cap(EngineConfig(memory_utilization=0.25)) == kv_budget.MemoryCap(
        16 << 30, "memory_utilization=0.25 of 64.0 GiB host memory", by_available=False)
    cap = kv_budget.memory_cap(EngineConfig(memory_utilization=0.9))
    assert cap == kv_budget.MemoryCap(16 << 30, "half of the 48.0 GiB available now (rounded down to a power of two)",
                                      by_available=True)
    Mem.available = (48 << 30) - (700 << 20)  # other processes come and go: the cap stays put
    assert kv_budget.memory_cap(EngineConfig(memory_utilization=0.9)).cap_bytes == 16 << 30
    with pytest.raises(ValueError, match=r"memory_utilization=1.5 must be a number in \(0, 1\] \(unset: the "):
        EngineConfig(memory_utilization=1.5)


def test_a_compilation_cache_dir_that_is_a_file_is_refused_up_front(tmp_path) -> None:
    from jaxinfer.cache_dirs import folder_problem

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"compilation_cache_dir='.*/file' is a file, not a folder"):
        EngineConfig(compilation_cache_dir=str(tmp_path / "file"))
    assert folder_problem(tmp_path / "file" / "sub").startswith("cannot be created")
    assert EngineConfig(compilation_cache_dir=str(tmp_path / "new" / "xla")).compilation_cache_dir
    assert (tmp_path / "new" / "xla").is_dir() and folder_problem(tmp_path / "new" / "xla") is None


def test_the_cache_is_sized_ahead_of_the_load_only_where_the_weights_cannot_change_its_size(tiny_dir, monkeypatch):
    """Found by a fresh-user trial: sized before the weights load, a cache capped by free memory would count the
    weights' memory as free (accelerators: a share of the free memory after the weights)."""
    import dataclasses

    import jax

    config = EngineConfig(model=tiny_dir, warmup=False, max_num_seqs=3, max_model_len=40, page_size=8,
                          dtype="float32")  # as `Engine` resolves it
    early = startup._early_kv_cache(config)
    assert early is not None and early[1].num_pages == 3 * 5 + 1
    early[2].wait_filled()
    assert startup._early_kv_cache(dataclasses.replace(config, kv_cache_memory_bytes=1 << 20)) is None
    # the flag decides, not the words of the reason
    monkeypatch.setattr(startup, "memory_cap", lambda config, reserved_bytes=0: kv_budget.MemoryCap(
        1 << 30, "a test cap", by_available=True))
    assert startup._early_kv_cache(config) is None  # memory is short: sized after the load
    monkeypatch.setattr(startup, "memory_cap", lambda config, reserved_bytes=0: kv_budget.MemoryCap(
        1 << 30, "a test cap of memory available", by_available=False))
    early = startup._early_kv_cache(config)
    assert early is not None
    early[2].wait_filled()
    monkeypatch.undo()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert startup._early_kv_cache(config) is None


def test_the_zero_fill_runs_in_a_daemon_thread(monkeypatch):
    """Found by a fresh-user trial: Ctrl-C during start-up waited for a GiB-sized fill to finish before exiting."""
    from jaxinfer.engine import kv_cache
    from models.config import ModelConfig

    started = []

    class Recording(kv_cache.threading.Thread):
        def start(self):
            started.append(self.daemon)
            super().start()

    monkeypatch.setattr(kv_cache.threading, "Thread", Recording)
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8)
    cache = kv_cache.PagedKVCache(cfg, num_pages=4, page_size=4, kv_dtype="float32")
    assert started == [True] and float(cache.cache.k.sum()) == 0.0
