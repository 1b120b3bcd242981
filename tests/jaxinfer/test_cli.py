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
    pinned = ("--dtype", "float32")  # as the smollm2_llm fixture
    done = _jaxinfer("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-tokens", "12", "--json",
                     *pinned)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # stdout holds exactly one JSON object: progress went to stderr
    assert result["prompt_token_ids"] == expected.prompt_token_ids
    assert result["token_ids"] == expected.outputs[0].token_ids
    assert result["text"] == expected.outputs[0].text
    assert result["finish_reason"] == expected.outputs[0].finish_reason
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] >= 0
    assert "loading model" in done.stderr

    streamed = _jaxinfer("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-tokens", "12",
                         *pinned)
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
    (["--prompt", "first", "--prompt", "second"], "--prompt given twice"),  # once ran the second alone, silently
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
    from jaxinfer.serving import serve

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
    monkeypatch.setattr(serve, "run", fake_run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's early stop handlers would exit pytest
    args = [command, "--kv-cache-dtype", "fp8"] + (["--prompt", "x"] if command == "generate" else [])
    with pytest.raises(Stop):
        cli.main(args)
    assert seen["kv_cache_dtype"] == "fp8"
    done = _jaxinfer(command, "--kv-cache-dtype", "int4", *(["--prompt", "x"] if command == "generate" else []))
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--kv-cache-dtype" in errors[0] and "int4" in errors[0], done.stderr


@pytest.mark.parametrize("argv, unrecognized", [
    (["generate", "--prompt", "x", "--max-tok", "3"], "--max-tok 3"),
    (["serve", "--max-queued", "3"], "--max-queued 3"),
    (["convert", "--output", "/nonexistent/out", "--quant", "int8"], "--quant int8"),
    (["bench", "attention", "--rep", "1", "--json", "/nonexistent/x.json"], "--rep 1"),
])
def test_abbreviated_options_are_refused(argv: list[str], unrecognized: str, capsys) -> None:
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("jaxinfer: error: unrecognized arguments: " + unrecognized), err


@pytest.mark.parametrize("argv, line", [
    (["generate", "--prompt", "x", "--temprature", "0"],
     "unrecognized arguments: --temprature 0, did you mean --temperature? (see jaxinfer generate --help)"),
    (["serve", "--prot", "8000", "--max-num-seq=3"], "unrecognized arguments: --prot 8000 --max-num-seq=3, did you "
                                                       "mean --port or --max-num-seqs? (see jaxinfer serve --help)"),
    (["bench", "quant", "--batchs", "1"],
     "unrecognized arguments: --batchs 1, did you mean --batches? (see jaxinfer bench quant --help)"),
    (["generate", "--prompt", "x", "stray", "--zzz"], "unrecognized arguments: stray --zzz (see jaxinfer generate --help)"),
])
def test_unknown_options_name_the_commands_help_and_near_misses(argv: list[str], line: str, capsys) -> None:
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == f"jaxinfer: error: {line}\n"


@pytest.mark.parametrize("argv, hint", [(["genrate", "--prompt", "x"], ", did you mean generate? (see jaxinfer --help)"),
                                        (["bench", "quantt"], ", did you mean quant? (see jaxinfer bench --help)"),
                                        (["--versoin"], ", did you mean --version? (see jaxinfer --help)"),
                                        (["xyz"], ") (see jaxinfer --help)")])
def test_a_misspelt_command_or_workload_gets_its_near_miss(argv: list[str], hint: str, capsys) -> None:
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("jaxinfer: error: ") and err.endswith(hint + "\n"), err
    assert err.count("\n") == 1


def test_an_option_before_the_command_is_named(capsys) -> None:
    from jaxinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--bogus", "generate"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ("jaxinfer: error: unknown option --bogus: the command comes first (generate, "
                                         "chat, serve, convert, tune, bench), then its options (see jaxinfer --help)\n")


def test_bench_without_a_workload_lists_them(capsys) -> None:
    from jaxinfer.benchmarks import WORKLOADS
    from jaxinfer.cli import main

    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer: error: jaxinfer bench needs a workload: one of ") and err.count("\n") == 1
    assert all(name in err for name in WORKLOADS)


def test_usage_errors_and_bad_values_share_one_prefix(capsys) -> None:
    from jaxinfer.cli import main

    with pytest.raises(SystemExit):
        main(["generate"])  # argparse: a missing option
    usage = capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2  # a value the API refuses
    value = capsys.readouterr().err
    assert usage.startswith("jaxinfer: error: one of the arguments --prompt --input-file is required (see jaxinfer "
                            "generate")
    assert value.startswith("jaxinfer: error: max_tokens=0 must be an integer >= 1")


@pytest.mark.parametrize("host, message", [
    ("256.1.1.1", "is not an IP address or a host name"),
    ("bad_host", "is not an IP address or a host name"),
    ("no-such-host.invalid", "cannot be resolved"),
])
def test_serve_checks_the_host_before_anything_loads(host: str, message: str, capsys, monkeypatch) -> None:
    import signal

    from jaxinfer import cli
    from jaxinfer.commands import options

    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's early stop handlers would exit pytest
    monkeypatch.setattr("jaxinfer.engine.config.EngineConfig.create", lambda **_: pytest.fail("got past the host check"))
    assert cli.main(["serve", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxinfer: error: --host {host!r} {message}" + err.split(message, 1)[1] and err.count("\n") == 1
    for good in ("127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0"):
        options.check_host(good)


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "100000"], "max_model_len=100000 must be in [1, 8192]"),
    (["--kv-cache-memory-bytes", "100"], "kv_cache_memory_bytes=100 is smaller than one KV page of page_size=16 "
                                         "tokens (737280 bytes); lower page_size or raise kv_cache_memory_bytes"),
    (["--page-size", "1000000000"], "page_size=1000000000 is larger than the context, max_model_len=8192 tokens, the "
                                    "model's: a KV page holds tokens of one sequence, so it must fit the context; use a "
                                    "page_size in [1, 8192] (the default is 16)"),
    (["--kv-offload-bytes", "10"], "kv_offload_bytes=10 is smaller than one KV page"),
    (["--speculative-config", '{"method": "self_draft", "num_draft_layers": 30}'],
     "num_draft_layers=30 must be in [1, 30) for a target of 30 layers"),
])
def test_options_are_checked_against_the_model_before_its_weights_load(flags, message, capsys, monkeypatch) -> None:
    from jaxinfer import cli
    from jaxinfer.engine import startup

    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    assert cli.main(["generate", "--prompt", "x", "--dtype", "float32", *flags]) == 2  # f32 page bytes below
    assert capsys.readouterr().err.splitlines()[-1] == f"jaxinfer: error: {message}" + \
        ("" if "kv_offload_bytes" not in message else " (737280 bytes)")


@pytest.mark.parametrize("as_json", [False, True])
def test_a_failed_request_prints_its_error_and_exits_1(as_json: bool, capsys, monkeypatch) -> None:
    from jaxinfer import cli, llm
    from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput

    reason = "engine step failed: RuntimeError: boom"

    class FailingLLM:
        """Stands in for `LLM`: fails every request the way the engine does (`Scheduler.fail`)."""

        def __init__(self, **_):
            self.engine = self
            self.quantization = None
            self.weight_bytes = 0

        def stats(self) -> dict:
            return {}

        def generate(self, prompt, params, on_output=None, use_tqdm=True):
            completion = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error", error=reason)
            return [RequestOutput(request_id="0", prompt=prompt, prompt_token_ids=[1, 2], outputs=[completion],
                                  finished=True, metrics=RequestMetrics(0.0, None, 1.0, 0.0, 0.0))]

    monkeypatch.setattr(llm, "LLM", FailingLLM)
    status = cli.main(["generate", "--prompt", "x", *(["--json"] if as_json else [])])
    captured = capsys.readouterr()
    assert status == 1
    assert captured.err.splitlines()[-1] == f"jaxinfer: error: the request failed: {reason}"
    if as_json:
        result = json.loads(captured.out)
        assert result["finish_reason"] == "error" and result["error"] == reason
