"""`jaxinfer generate --input-file`: one output line per input line, in order, each equal to a single `LLM` call with
the line's own sampling fields over the flags; a prompt (or its max_tokens) too long fails its line alone; a bad line exits 2 naming its
number before the model loads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxinfer import SamplingParams
from tests.jaxinfer.commands.tiny_chat import ENGINE_FLAGS, run_jaxinfer

FLAGS = SamplingParams(temperature=0, max_tokens=6)  # the command's flags below


def test_batch_keeps_order_applies_overrides_and_equals_single_calls(tiny_chat_model, tiny_llm, tmp_path) -> None:
    requests = [
        {"prompt": "hello there", "id": "a"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "custom_id": 7, "max_tokens": 3},
        {"prompt": "third", "temperature": 0.9, "seed": 5, "max_tokens": 12, "stop": ["a"]},
        {"prompt": "y" * 300},  # longer than the context (256): fails alone
        {"prompt": "fits", "max_tokens": 1000},  # the prompt fits, its max_tokens does not: fails alone
        {"prompt": "last", "id": None},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in requests[:2]) + "\n\n" +  # a blank line is skipped
                      "\n".join(json.dumps(r) for r in requests[2:]) + "\n")
    target = tmp_path / "out.jsonl"
    done = run_jaxinfer("generate", "--model", str(tiny_chat_model), *ENGINE_FLAGS, "--input-file", str(source),
                        "--output-file", str(target), "--temperature", "0", "--max-tokens", "6")
    assert done.returncode == 1, done.stderr  # the long prompt failed
    assert done.stderr.splitlines()[-1] == "jaxinfer: error: 2 of 6 requests failed (their lines give the error)"
    assert "Processed prompts" in done.stderr and done.stdout == ""
    got = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(got) == len(requests)

    overrides = ("max_tokens", "temperature", "seed", "stop")
    for request, line in zip(requests, got):
        ids = {k: request[k] for k in ("id", "custom_id") if k in request}
        assert {k: line[k] for k in ("id", "custom_id") if k in line} == ids
        params = dataclasses.replace(FLAGS, **{k: v for k, v in request.items() if k in overrides})
        if "messages" in request:
            want = tiny_llm.chat(request["messages"], params, use_tqdm=False)[0]
        else:
            try:
                want = tiny_llm.generate(request["prompt"], params, use_tqdm=False)[0]
            except ValueError as refused:  # what a single call refuses is its line's error, the others run
                assert line == {**ids, "text": "", "finish_reason": "error", "completion_tokens": 0,
                                "prompt_tokens": len(tiny_llm.get_tokenizer().encode(request["prompt"])),
                                "stop_reason": None, "error": str(refused)}
                continue
        completion = want.outputs[0]
        if params != FLAGS:  # the line's fields changed what it generates: the comparison can tell them apart
            flags_only = tiny_llm.generate({"prompt_token_ids": want.prompt_token_ids}, FLAGS,
                                           use_tqdm=False)[0].outputs[0]
            assert (flags_only.text, flags_only.finish_reason) != (completion.text, completion.finish_reason)
        assert line == {**ids, "text": completion.text, "prompt_tokens": len(want.prompt_token_ids),
                        "completion_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason, "error": None}


GOOD = '{"prompt": "fine"}'


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ', "not JSON: Expecting value at column 12"),
    ('["x"]', "a line must be a JSON object, got list"),
    ('{"id": 1}', "a line needs exactly one of 'prompt' (text) and 'messages' (a conversation)"),
    ('{"prompt": "x", "messages": []}', "a line needs exactly one of 'prompt'"),
    ('{"prompt": "x", "max_token": 3}', "unknown key 'max_token' (did you mean 'max_tokens'?)"),
    ('{"prompt": "x", "temperature": -1}', "temperature=-1"),
    ('{"prompt": "x", "n": 2}', "'n' is not supported in a batch file"),
    ('{"prompt": ""}', "'prompt' must not be empty"),
    ('{"prompt": 3}', "prompt must be a string, got int"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role='bot' is not one of"),
    ('{"prompt": "x", "id": 1, "custom_id": 2}', "a line has 'id' or 'custom_id', not both"),
])
def test_a_bad_line_exits_2_naming_it_before_the_model_loads(line, message, tmp_path, capsys, monkeypatch) -> None:
    from jaxinfer import cli
    from jaxinfer.commands import generate

    monkeypatch.setattr(generate, "start_llm", lambda *_: pytest.fail("the model loaded"))
    source = tmp_path / "in.jsonl"
    source.write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    assert cli.main(["generate", "--input-file", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxinfer: error: --input-file {source} line 2: {message}") and err.count("\n") == 1, err


def test_a_byte_order_mark_is_skipped(tmp_path) -> None:
    from jaxinfer.commands.batch import read_batch

    source = tmp_path / "bom.jsonl"
    source.write_text(f"{GOOD}\n{GOOD}\n", encoding="utf-8-sig")  # as Windows editors save
    assert source.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert [(line.number, line.prompt) for line in read_batch(str(source), FLAGS, chat=False)] == [(1, "fine"),
                                                                                                  (2, "fine")]


@pytest.mark.parametrize("argv, message", [
    (["--input-file", "{empty}"], "--input-file {empty} holds no request (one JSON object per line)"),
    (["--input-file", "{missing}"], "--input-file {missing}: [Errno 2] No such file or directory"),
    (["--prompt", "x", "--output-file", "{out}"], "--output-file goes with --input-file"),
    (["--input-file", "{good}", "--json"], "--json is for --prompt; --input-file always writes JSON lines"),
    (["--input-file", "{good}", "--output-file", "{missing}/out"], "--output-file {missing}/out: [Errno 2]"),
    (["--prompt", "x", "--input-file", "{good}"], "argument --input-file: not allowed with argument --prompt"),
])
def test_bad_batch_flags_exit_2(argv, message, tmp_path, capsys, monkeypatch) -> None:
    from jaxinfer import cli
    from jaxinfer.commands import generate

    monkeypatch.setattr(generate, "start_llm", lambda *_: pytest.fail("the model loaded"))
    paths = {"empty": tmp_path / "empty.jsonl", "missing": tmp_path / "missing", "good": tmp_path / "good.jsonl",
             "out": tmp_path / "out.jsonl"}
    paths["empty"].write_text("\n  \n")
    paths["good"].write_text(GOOD + "\n")
    status = None
    try:
        status = cli.main(["generate", *(a.format(**paths) for a in argv)])
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("jaxinfer: error: " + message.format(**paths)) and err.count("\n") == 1


@pytest.mark.parametrize("flags, num_seqs", [([], 3), (["--max-num-seqs", "1"], 1), (["--max-num-seqs", "64"], 64)])
def test_a_batch_runs_its_lines_together_unless_max_num_seqs_is_given(flags, num_seqs, tmp_path, monkeypatch) -> None:
    from jaxinfer import cli
    from jaxinfer.commands import generate

    seen = {}

    def fake_start(args, options):
        seen.update(options)
        raise KeyboardInterrupt  # stops before the model loads

    monkeypatch.setattr(generate, "start_llm", fake_start)
    source = tmp_path / "in.jsonl"
    source.write_text(f"{GOOD}\n{GOOD}\n{GOOD}\n")
    assert cli.main(["generate", "--input-file", str(source), *flags]) == 130
    assert seen["max_num_seqs"] == num_seqs  # generate's default of 1 is for --prompt
