"""Smoke test of `jaxinfer bench serving`: a tiny random Llama through the engine, one offline and one online
scenario, the stub HF peer; checks the report's fields, its byte counts against the config, and the section."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxinfer.benchmarks.serving import SECTION
from tests.jaxinfer.benchmarks.bench_runner import STUB_PEER, TINY_LLAMA, assert_positive_finite, run_bench
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model



def hf_weight_bytes(config: dict, itemsize: int) -> int:
    """Bytes of every weight tensor of an HF Llama config (embedding, per layer q/k/v/o, MLP, two norms, final
    norm, untied LM head)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
    head = 0 if config.get("tie_word_embeddings") else d * v
    return itemsize * (v * d + config["num_hidden_layers"] * per_layer + d + head)


def test_serving_smoke(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny")  # character ids: distinct prompts, so real prefills
    report, written = run_bench(
        tmp_path, "serving", "--model", str(model), "--dtypes", "float32",
        "--scenarios", "offline:n=2,in=16,out=4;online:n=2,in=8-16,out=2-4,rate=50",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--bw-gib", "0.016", "--bw-reps", "1",
        "--peer-python", sys.executable, "--peer-script", str(STUB_PEER))
    data = report["data"]
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    ours = data["ours"]["float32"]
    assert ours["weight_bytes"] == hf_weight_bytes(config, 4)
    head_dim = config["head_dim"]
    assert ours["kv_bytes_per_token"] == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert data["model"]["num_layers"] == config["num_hidden_layers"]
    assert set(ours["scenarios"]) == {"offline", "online"}
    assert ours["scenarios"]["offline"]["output_tokens"] == 2 * 4
    for name, s in ours["scenarios"].items():
        assert s["bad_lengths"] == 0, name
        for key in ("wall_s", "output_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "decode_tok_s", "decode_gb_s",
                    "decode_token_pad", "prefill_token_pad", "prefill_tok_s_device"):
            assert_positive_finite(s[key], f"{name} {key}")
        assert s["prefill_steps"] >= 1 and s["decode_steps"] >= 1
        assert 0 < s["outside_device_share"] < 1, "device time of the jitted steps was not recorded"
    for key in ("load_s", "warmup_s"):
        assert_positive_finite(ours[key], key)
    probe = ours["probe"]
    for key in ("dense", f"execute_ctx{probe['contexts'][1]}", f"attention_ctx{probe['contexts'][1]}"):
        assert_positive_finite(probe[key], key)
    assert_positive_finite(data["roofline_gb_s"], "roofline_gb_s")
    assert data["bandwidth_start"]["sum"]["bytes"] == int(0.016 * 2**30) // 4 * 4
    assert "error" not in data["peer"] and data["peer"]["results"]["float32"]["batch"] == 2
    begin, end = SECTION
    section = written[written.index(begin): written.index(end)]
    assert "## Serving workload" in section and f"{config['num_hidden_layers']} layers" in section
    assert "machine: nproc" in section and "HF transformers stub" in section


def test_bad_scenarios_are_value_errors():
    import pytest

    from jaxinfer.benchmarks.serving_scenarios import parse_scenario, parse_scenarios

    sc = parse_scenario("mix:n=4,in=8-16,out=4,rate=2,seed=3")
    assert (sc.num_requests, sc.input_len, sc.output_len, sc.rate, sc.seed) == (4, (8, 16), (4, 4), 2.0, 3)
    assert sc.describe() == "4 requests, input U[8, 16], output 4, Poisson 2 req/s" and not sc.fixed
    for spec, words in (("x:n=2,in=8", "need"), ("x:n=2,in=8,out=4,speed=1", "need"),
                        ("x:n=2,in=16-8,out=4", "range"), ("x:n=two,in=8,out=4", "two"), ("x:n=0,in=8,out=4", "n must"),
                        ("x:n=2,in=8,out=4,rate=0", "rate"), ("x:n=2,in8,out=4", "key=value")):
        with pytest.raises(ValueError, match=words):
            parse_scenario(spec)
    with pytest.raises(ValueError, match="empty"):
        parse_scenarios(" ; ")
    for specs, words in (("a:n=2,in=8,out=4;a:n=3,in=16,out=6", "a name of its own"),  # rows would merge
                         ("a:n=2,,in=8,out=4", "an empty item"), ("a:n=2,n=3,in=8,out=4", "n given twice")):
        with pytest.raises(ValueError, match=words):
            parse_scenarios(specs)


def test_dtype_lists_are_checked_before_any_work(capsys):
    from jaxinfer.cli import main

    for dtypes, message in (("float32,,bfloat16", "--dtypes 'float32,,bfloat16': an empty item"),
                            ("float16", "--dtypes 'float16': each must be one of")):
        assert main(["bench", "serving", "--dtypes", dtypes]) == 2
        assert message in capsys.readouterr().err
    assert main(["bench", "serving", "--dtypes", "float32, bfloat16", "--scenarios", "a:n=1,in=8,out=1;a:n=2,in=8,out=1",
                 ]) == 2  # the spaced list parses; the repeated scenario name is refused, before any work
    assert "a name of its own" in capsys.readouterr().err
