"""Smoke test of `jaxinfer bench spec`: a tiny random Llama (word-level tokenizer, ChatML), the "off" and ngram k=4
engines (each more engine or step shape costs XLA compiles), one repetition of each part at tiny sizes; checks the
report's fields, the lossless check, and the section. The default engine list is checked without running it."""

from __future__ import annotations

import json

from jaxinfer.benchmarks.spec import SECTION
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model


def test_spec_smoke(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny", chars=False)  # short prompts: fewer prefill shapes
    report, written = run_bench(
        tmp_path, "spec", "--model", str(model), "--reps", "1", "--tput-reps", "1", "--step-reps", "1",
        "--copy-max-tokens", "8", "--chat-max-tokens", "4", "--requests", "2", "--tput-max-tokens", "4",
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(8 << 20), "--ngram-ks", "4", "--no-self-draft",
        "--step-batches", "1", "--step-batch1-rows", "2", "--step-verify-batches", "")
    data = report["data"]
    assert data["settings"]["configs"] == ["off", "ngram k=4"] and data["settings"]["self_draft"] is None
    assert data["exit_status"] == 0  # greedy speculation is lossless
    for task, max_tokens in (("copy-heavy", 8), ("chat", 4)):
        for name, cell in data["single"][task].items():
            assert cell["same_as_off"] is True, (task, name)
            assert 2 <= len(cell["tokens"]) <= max_tokens  # greedy on fixed weights: the same every run
            (tok_s,) = cell["tok_s"]
            assert_positive_finite(tok_s, f"{task} {name} tok/s")
    tput = data["tput"]
    assert tput["same"] is True and len(tput["prompt_tokens"]) == 2
    for name in ("on", "off"):
        (run,) = tput["runs"][name]
        assert 2 <= run["output_tokens"] <= 2 * 4
        assert_positive_finite(run["wall_s"], f"tput {name} wall_s")
    assert [(s["kind"], s["batch"], s["k"]) for s in data["steps"]] == [("decode", 1, 0), ("verify", 1, 1)]
    for s in data["steps"]:
        assert_positive_finite(s["ms"], f"step {s}")
        assert s["rows"] == (max(2, s["batch"]) if s["kind"] == "decode" else s["batch"] * (s["k"] + 1))
    assert isinstance(data["suggested_max_step_tokens"], int)
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Speculative decoding (tiny, float32, greedy)" in section and "machine: nproc" in section
    assert "| copy-heavy | ngram k=4 |" in section and "### Cost of a step vs token rows" in section


def test_default_engines():
    """`jaxinfer bench spec` without --ngram-ks / --no-self-draft: off, ngram k = 2 / 4 / 8 and self_draft with all
    but 2 of the layers (at least 1); the throughput part's "on" engine among them."""
    from jaxinfer.benchmarks.spec import TPUT_ON, configs

    config = json.loads((TINY_LLAMA / "config.json").read_text())
    draft = f"self_draft {config['num_hidden_layers'] - 1} layers k=2"  # all but 2 layers, at least 1
    names = [name for name, _ in configs(config["num_hidden_layers"])]
    assert names == ["off", "ngram k=2", "ngram k=4", "ngram k=8", draft] and TPUT_ON in names
    assert dict(configs(30))["self_draft 28 layers k=2"] == {"method": "self_draft", "num_speculative_tokens": 2,
                                                             "num_draft_layers": 28}
    assert [name for name, _ in configs(2, (4,), self_draft=False)] == ["off", "ngram k=4"]


def test_changed_output_is_exit_status_1():
    """A config whose tokens differ from "off" in any run, or a concurrent batch that differs on / off, fails the
    lossless check (the runner then exits with `Report.data["exit_status"]` = 1)."""
    from jaxinfer.benchmarks.spec import all_identical

    def result(single_same: bool, tput_same: bool) -> dict:
        return {"tput": {"same": tput_same},
                "single": {"chat": {"off": {"same_as_off": True}, "ngram k=2": {"same_as_off": single_same}}}}

    assert all_identical(result(True, True))
    assert not all_identical(result(False, True))
    assert not all_identical(result(True, False))


def test_bad_engine_options_name_the_problem(capsys):
    from jaxinfer.cli import main

    assert main(["bench", "spec", "--ngram-ks", "2,8"]) == 2
    assert "--ngram-ks '2,8' must hold 4" in capsys.readouterr().err
    assert main(["bench", "spec", "--ngram-ks", "two"]) == 2
    assert "--ngram-ks 'two': expected comma-separated integers >= 1" in capsys.readouterr().err
