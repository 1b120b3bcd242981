"""`jaxinfer tune` end to end on a tiny random Llama: two real configurations, the table, the PNG, and the best
configuration's file, which `jaxinfer serve --config` and `LLM(config=...)` read back; and its errors."""

from __future__ import annotations

import json

import pytest

from jaxinfer import cli
from jaxinfer.commands.options import engine_options
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.config_file import load_config_file
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model


def _profile(tmp_path) -> str:
    """Two requests at once: one prompt given as a length, one as text (few step shapes: few compiles)."""
    path = tmp_path / "traffic.jsonl"
    lines = [{"prompt_len": 8, "output_len": 3}, {"prompt": "Hello, tune", "max_tokens": 3}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return str(path)


def test_tune_runs_two_configurations_and_writes_the_best(tmp_path, capsys):
    model = make_tiny_chat_model(tmp_path / "tiny")
    out = tmp_path / "out"
    bench = tmp_path / "BENCH.md"
    bench.write_text("# Benchmarks\n")
    status = cli.main(["tune", "--profile", _profile(tmp_path), "--model", str(model), "--dtype", "float32",
                       "--max-num-seqs", "1,32", "--max-num-batched-tokens", "32", "--no-warmup", "--warm-pass", "none",
                       "--out", str(out), "--write", str(bench), "--budget", "2"])
    assert status == 0
    trials = json.loads((out / "trials.json").read_text())
    assert [t["knobs"] for t in trials] == [{"max_num_seqs": 32}, {"max_num_seqs": 1}]  # the default first
    for t in trials:
        assert t["status"] == "meets" and t["metrics"]["num_finished"] == 2
        assert t["metrics"]["output_tok_s"] > 0 and t["timing"]["startup_s"] > 0
    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = max(trials, key=lambda t: t["metrics"]["output_tok_s"])
    options = load_config_file(out / "best.json")
    # --no-warmup shaped tune's own runs only: a server started from best.json warms up as usual
    assert options == {"model": str(model), "dtype": "float32", "max_num_batched_tokens": 32,
                       "max_num_seqs": best["knobs"]["max_num_seqs"]}
    assert json.loads((out / "best.json").read_text())["_tuned"]["metrics"]["num_finished"] == 2
    served = engine_options(cli._build_parser().parse_args(["serve", "--config", str(out / "best.json")]))
    assert EngineConfig.create(**served) == EngineConfig.create(**options)
    section = bench.read_text()
    assert "<!-- tune: begin -->" in section and "## Tuning: `jaxinfer tune`" in section
    assert "![throughput vs p99 latency](out/tune.png)" in section and "| 1 (default) |" in section
    assert "**best**" in capsys.readouterr().out


@pytest.mark.parametrize("flags, match", [
    (["--max-num-seqs", "4,x"], "--max-num-seqs: 'x' is not an integer"),
    (["--quantization", "none,int3"], "--quantization int3: .*int3"),
    (["--budget", "0"], "--budget 0 must be >= 1"),
    # found by a fresh-user trial: "ttft_p99_s=-1.0 must be ... > 0, or None", a field and a value the CLI has not
    (["--ttft-p99-s", "-1"], r"^jaxinfer: error: --ttft-p99-s -1 must be a number of seconds > 0 \(leave it out for "
                             r"no target\)$"),
    (["--tpot-p99-s", "inf"], r"^jaxinfer: error: --tpot-p99-s inf must be a number of seconds > 0"),
])
def test_bad_tune_flags_exit_2_with_one_line(tmp_path, capsys, flags, match):
    import re

    assert cli.main(["tune", "--profile", _profile(tmp_path), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer: error: ") and err.count("\n") == 1 and re.search(match, err), err


@pytest.mark.parametrize("flags, limit, what", [([], 8192, "the model"), (["--max-model-len", "512"], 512, "max_model_len")])
def test_a_profile_beyond_the_context_exits_2_before_any_run(tmp_path, capsys, flags, limit, what):
    """SmolLM2's context (8,192 tokens, read from the GGUF header) or the --max-model-len given; the request is
    named by its line, as the profile's parse errors name theirs."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt_len": 8, "output_len": 3}) + "\n"
                    + json.dumps({"prompt_len": 100000, "output_len": 5}) + "\n")
    assert cli.main(["tune", "--profile", str(path), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxinfer: error: {path}:2: prompt_len 100000 + output_len 5 = 100005 tokens do not fit "
                   f"the context of {limit} tokens ({what})\n")
    assert not (tmp_path / "o" / "trials.json").exists()
