"""`jaxinfer generate`'s timing line says how much of the TTFT and of the decode were XLA compiles (none: nothing)."""

from __future__ import annotations

import logging
import re

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
