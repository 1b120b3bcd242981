"""The `jaxinfer generate` command, run as a user runs it (a subprocess), against the `LLM` API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxinfer import LLM, SamplingParams


def _jaxinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_generate_json_and_stream_match_the_api(smollm2_llm: LLM) -> None:
    prompt = "What is the capital of France?"
    expected = smollm2_llm.chat([{"role": "user", "content": prompt}],
                                SamplingParams(temperature=0, max_tokens=12))[0]
    done = _jaxinfer("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # stdout holds exactly one JSON object: progress went to stderr
    assert result["prompt_token_ids"] == expected.prompt_token_ids
    assert result["token_ids"] == expected.outputs[0].token_ids
    assert result["text"] == expected.outputs[0].text
    assert result["finish_reason"] == expected.outputs[0].finish_reason
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] >= 0
    assert "loading model" in done.stderr

    streamed = _jaxinfer("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-tokens", "12")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == expected.outputs[0].text + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "x", "--model", "/does/not/exist.gguf"], "does not exist"),
    (["--prompt", "x", "--model", __file__], "not a model"),
])
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    done = _jaxinfer("generate", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kv_cache_dtype_reaches_the_engine_and_a_bad_one_exits_2(command: str, monkeypatch) -> None:
    import signal

    from jaxinfer import cli, llm
    from jaxinfer.serving import server

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    def fake_run(config, **kwargs):
        seen["kv_cache_dtype"] = config.kv_cache_dtype
        raise Stop

    monkeypatch.setattr(llm, "LLM", fake_llm)
    monkeypatch.setattr(server, "run", fake_run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's early stop handlers would exit pytest
    args = [command, "--kv-cache-dtype", "fp8"] + (["--prompt", "x"] if command == "generate" else [])
    with pytest.raises(Stop):
        cli.main(args)
    assert seen["kv_cache_dtype"] == "fp8"
    done = _jaxinfer(command, "--kv-cache-dtype", "int4", *(["--prompt", "x"] if command == "generate" else []))
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--kv-cache-dtype" in errors[0] and "int4" in errors[0], done.stderr
