"""`jaxinfer generate`: its timing line says how much of the TTFT and of the decode were XLA compiles (none:
nothing); a max_tokens beyond the context names --max-tokens; the --json object's keys are documented."""

from __future__ import annotations

import logging
import re

import pytest

from jaxinfer.engine.compile_time import CompileTimer
from jaxinfer.outputs import RequestMetrics
from tests.jaxinfer.commands.tiny_chat import ENGINE_FLAGS

NOTE = re.compile(r"TTFT ([\d.]+) s, decode [\d.]+ tokens/s \(first run of these shapes: XLA compiles took ([\d.]+) s "
                  r"of the TTFT, ([\d.]+) s of decode; --warmup compiles at start-up instead\)$")


def test_the_first_run_says_its_compile_time(tiny_chat_model, caplog, capsys) -> None:
    from jaxinfer import cli

    with caplog.at_level(logging.INFO, logger="jaxinfer"):
        status = cli.main(["generate", "--model", str(tiny_chat_model), *ENGINE_FLAGS, "--prompt", "hello",
                           "--temperature", "0", "--max-tokens", "5"])
    assert status == 0 and capsys.readouterr().out
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finish_reason=")]
    match = NOTE.search(lines[-1])
    assert match, lines
    ttft, ttft_compile, _ = (float(g) for g in match.groups())
    assert 0 < ttft_compile <= ttft + 0.01  # a fresh engine traces and compiles its first step


def test_no_note_without_compiles() -> None:
    from jaxinfer.commands.generate import _compile_note

    timer = CompileTimer()
    metrics = RequestMetrics(arrival_time=10.0, first_token_time=11.0, finish_time=12.0, ttft_s=1.0,
                             decode_tokens_per_s=5.0)
    assert _compile_note(timer, metrics, warmup=False) == ""
    timer.spans = [(9.0, 10.5), (11.5, 11.75), (13.0, 14.0)]  # half a second of TTFT, a quarter of decode
    assert _compile_note(timer, metrics, warmup=True) == \
        " (first run of these shapes: XLA compiles took 0.50 s of the TTFT, 0.25 s of decode)"


def test_max_tokens_beyond_the_context_names_the_flag(tiny_chat_model, tiny_llm, capsys) -> None:
    """Found by a fresh-user trial: the CLI said "max_tokens=None generates until the context is full", which it
    cannot pass (generate's --max-tokens defaults to 128): the line names --max-tokens and the values that fit."""
    from jaxinfer import SamplingParams, cli

    prompt_len = len(tiny_llm.generate("h", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids)
    room = tiny_llm.max_model_len - prompt_len
    status = cli.main(["generate", "--model", str(tiny_chat_model), *ENGINE_FLAGS, "--prompt", "h",
                       "--max-tokens", "100000000"])
    err = capsys.readouterr().err.splitlines()
    assert status == 2
    assert err[-1] == (f"jaxinfer: error: --max-tokens 100000000: the prompt ({prompt_len} "
                       f"token{'s' * (prompt_len != 1)}) leaves room for at most {room} in the context of "
                       f"{tiny_llm.max_model_len} tokens; give --max-tokens {room} or less"), err


def test_the_json_fields_are_documented(tiny_chat_model, capsys) -> None:
    """Found by a fresh-user trial: README's `--json` list left out `prompt` and `error_kind`. Every key of the
    object `generate --json` prints is named in README's `--json` bullet and in `--help`."""
    import json

    from jaxinfer import cli
    from tests.jaxinfer.commands.tiny_chat import REPO

    status = cli.main(["generate", "--model", str(tiny_chat_model), *ENGINE_FLAGS, "--prompt", "hello",
                       "--max-tokens", "2", "--json"])
    keys = json.loads(capsys.readouterr().out)
    assert status == 0 and {"prompt", "error_kind"} <= keys.keys()
    readme = (REPO / "README.md").read_text()
    bullet = readme[readme.index("  - `--json`: prints"):]
    bullet = bullet[:bullet.index("\n  - ")]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for key in keys:
        assert f"`{key}`" in bullet, key
        assert re.search(rf"[(, ]{key}[,;)]", help_text), key
