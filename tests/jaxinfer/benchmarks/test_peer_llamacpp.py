"""The llama.cpp peer script's pure helpers (`scripts/peer_llamacpp.py`), loaded by path without llama-cpp-python:
the script imports `llama_cpp` only inside `main`."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.jaxinfer.benchmarks.bench_runner import REPO


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_llamacpp", REPO / "scripts" / "peer_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_types_names_unknown_types(peer):
    assert peer.parse_types(" Q4_0, BF16 ,") == ["Q4_0", "BF16"]
    with pytest.raises(ValueError, match="unknown Q3_K, f16"):
        peer.parse_types("Q4_0,Q3_K,f16")
    with pytest.raises(ValueError, match="--types is empty"):
        peer.parse_types(" , ")


def test_cache_path_keys_on_the_source_file(peer, tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x" * 10)
    q4 = peer.cache_path(src, "Q4_0", tmp_path / "cache")
    assert q4.parent == tmp_path / "cache" and q4.name.startswith("model.") and q4.name.endswith(".Q4_0.gguf")
    assert peer.cache_path(src, "Q4_0", tmp_path / "cache") == q4  # stable: a second run finds it
    assert peer.cache_path(src, "BF16", tmp_path / "cache") != q4
    src.write_bytes(b"y" * 11)  # another file under the same name: another entry
    os.utime(src, ns=(1, 1))
    assert peer.cache_path(src, "Q4_0", tmp_path / "cache") != q4


def test_context_tokens_fit_the_largest_run(peer):
    assert peer.context_tokens(512, 64, 22, []) == 768  # the 513-token prefill, rounded up to 256
    assert peer.context_tokens(512, 64, 22, [8, 32]) == 2816  # 32 sequences of 64 + 22 + 1 tokens, rounded up
    assert peer.context_tokens(100, 10, 5, [2]) == 256


def test_prefill_calls_pack_whole_prompts_with_logits_on_each_last_token(peer):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    calls = peer.prefill_calls(prompts, n_batch=5)
    assert calls == [[(1, 0, 0, False), (2, 1, 0, False), (3, 2, 0, True), (4, 0, 1, False), (5, 1, 1, True)],
                     [(6, 0, 2, False), (7, 1, 2, False), (8, 2, 2, True)]]
    assert sum(e[3] for call in calls for e in call) == len(prompts)
    with pytest.raises(ValueError, match="prompt 1 has 6 tokens; a prefill call takes 1 to 5"):
        peer.prefill_calls([[1], [1] * 6], n_batch=5)
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        peer.prefill_calls([[]], n_batch=5)


def test_step_entries_one_token_per_sequence(peer):
    assert peer.step_entries([7, 9], [64, 70]) == [(7, 64, 0, True), (9, 70, 1, True)]


def test_median_ms(peer):
    assert peer.median_ms([0.003, 0.001, 0.002]) == pytest.approx(2.0)


def test_the_runner_knows_the_scripts_types(peer):
    """`jaxinfer bench step` checks --llamacpp-types before measuring, against its own copy of the list."""
    from jaxinfer.benchmarks.peers import LLAMACPP_TYPES

    assert set(LLAMACPP_TYPES) == set(peer.FTYPES)


@pytest.mark.parametrize("crash", [False, True])
def test_a_peer_killed_by_a_signal_reruns_without_extra_buffer_types(tmp_path, monkeypatch, crash):
    """The stub dies from SIGSEGV while extra buffer types are on (as llama.cpp's Q4_0 prefill did on an AMX Xeon):
    `run_llamacpp_peer` must rerun it with `--no-extra-bufts` and return that run's numbers; a peer that does not
    crash runs once, with them on."""
    from jaxinfer.benchmarks import peers
    from tests.jaxinfer.benchmarks.bench_runner import STUB_PEER

    monkeypatch.setenv("STUB_PEER_SEGFAULT_WITH_EXTRA_BUFTS", "1" if crash else "0")
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    args = ["--gguf", str(tmp_path / "m.gguf"), "--prompt-file", str(tmp_path / "ids.json"), "--types", "Q4_0",
            "--decode-prompt-len", "2"]
    if crash:  # the plain run does die from the signal
        assert peers.run_peer(sys.executable, STUB_PEER, args, 60)["error"].startswith("peer exited with -11")
    result = peers.run_llamacpp_peer(sys.executable, STUB_PEER, args, 60)
    assert "error" not in result, result
    assert result["extra_bufts"] is (not crash)
    assert set(result["results"]) == {"Q4_0"}
