"""Smoke test of `jaxinfer bench prefix`: a tiny random Llama with a character tokenizer and a ChatML template, one
repetition, a 200-token shared prefix, one short chat with short replies, one break-even point (every shape the run
meets costs an XLA compile); checks the report's fields, the page bytes against the config, and the section."""

from __future__ import annotations

import json

from jaxinfer.benchmarks.prefix import SECTION
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model


def test_prefix_smoke(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "prefix", "--model", str(model), "--reps", "1",
                                "--ttft-prefix-tokens", "200", "--chat-convs", "2", "--chat-turns", "2",
                                "--chat-passes", "1", "--chat-max-tokens", "4", "--chat-system-tokens", "60",
                                "--break-even-pages", "4", "--host-pages", "16")
    data = report["data"]
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    assert data["page_bytes"] == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 16 \
        * config["head_dim"] * 4
    assert data["host_pages"] == 16 and data["kv_pages"] == 512
    ttft = data["ttft"]
    assert ttft["cached"] == 200 // 16 * 16 and ttft["prompt_tokens"] == 220
    for key in ("cold", "warm", "cold_wall", "warm_wall"):
        assert len(ttft[key]) == 1
        assert_positive_finite(ttft[key][0], f"ttft {key}")
    chat = data["chat"]
    assert chat["same_tokens"] is True and chat["max_tokens"] == 4
    for name in ("on", "off"):
        (p,) = chat["runs"][name]
        assert p["prompt_tokens"] >= 4 * chat["first_prompt_tokens"] and 4 <= p["output_tokens"] <= 4 * 4
        assert_positive_finite(p["wall_s"], f"chat {name} wall_s")
    assert chat["runs"]["on"][0]["hit_rate"] > 0 and chat["runs"]["off"][0]["cached_tokens"] == 0
    assert [row["pages"] for row in data["break_even"]] == [4]
    for row in data["break_even"]:
        for key in ("recompute", "host", "device", "load_call", "prefill_call"):
            assert_positive_finite(row[key], f"break-even k={row['pages']} {key}")
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Prefix caching (tiny, float32)" in section and "machine: nproc" in section
    assert f"{data['page_bytes'] / 1024:.0f} KiB" in section and "### Host tier" in section
    assert "2 conversations x 2 turns, greedy, max_tokens 4" in section


def test_bad_sizes_name_the_problem(capsys):
    from jaxinfer.cli import main

    assert main(["bench", "prefix", "--ttft-prefix-tokens", "8"]) == 2
    assert "--ttft-prefix-tokens 8: expected 16 ... 2000 tokens" in capsys.readouterr().err
    assert main(["bench", "prefix", "--chat-system-tokens", "0"]) == 2
    assert "--chat-system-tokens" in capsys.readouterr().err
