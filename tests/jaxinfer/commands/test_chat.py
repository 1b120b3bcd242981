"""`jaxinfer chat` with a scripted stdin, against `LLM.chat` on the conversations the turns should send: each turn
carries the history, the oldest turns make room for the reply, /reset forgets, a message too long fails its turn
alone, and /exit ends."""

from __future__ import annotations

import re

from jaxinfer import SamplingParams
from tests.jaxinfer.commands.tiny_chat import ENGINE_FLAGS, run_jaxinfer

MAX_TOKENS = 8


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_chat_carries_history_trims_resets_and_exits(tiny_chat_model, tiny_llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def reply(conversation: list[dict]):
        return tiny_llm.chat(conversation, greedy, use_tqdm=False)[0]

    def prompt_len(conversation: list[dict]) -> int:
        return len(tiny_llm.render_chat(conversation)[0].token_ids)

    # The references, in the CLI's order (so that the prefix cache holds the same pages).
    first = reply([_user("hello")])
    second_history = [_user("hello"), _assistant(first.outputs[0].text), _user("world")]
    second = reply(second_history)
    # A context where the second turn fits with room for a full reply, so the third must drop the oldest turn(s).
    max_model_len = len(second.prompt_token_ids) + MAX_TOKENS
    third_history = second_history + [_assistant(second.outputs[0].text), _user("ok")]
    assert prompt_len(third_history) + MAX_TOKENS > max_model_len
    while prompt_len(third_history) + MAX_TOKENS > max_model_len:
        third_history = third_history[2:]  # the oldest user message and its reply
    third = reply(third_history)
    fourth = reply([_user("world")])  # after /reset
    assert second.outputs[0].text != fourth.outputs[0].text or len(second.prompt_token_ids) != \
        len(fourth.prompt_token_ids)  # the same message with and without history: the test can tell them apart

    too_long = "x" * max_model_len
    script = f"hello\n\nworld\nok\n/reset\n{too_long}\nworld\n/exit\nnever sent\n"
    done = run_jaxinfer("chat", "--model", str(tiny_chat_model), *ENGINE_FLAGS, "--max-model-len",
                        str(max_model_len), "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--verbose",
                        stdin=script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(r.outputs[0].text + "\n" for r in (first, second, third, fourth))
    sent = [int(n) for n in re.findall(r"turn: prompt (\d+) tokens", done.stderr)]
    assert sent == [len(r.prompt_token_ids) for r in (first, second, third, fourth)]
    dropped = (len(second_history) + 2 - len(third_history)) // 2
    assert f"(dropped the {dropped} oldest turn" in done.stderr
    assert "(conversation cleared)" in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("jaxinfer: error:")]
    assert errors == [f"jaxinfer: error: the message makes a prompt of {prompt_len([_user(too_long)])} tokens, "
                      f"which does not fit the context of {max_model_len} tokens: send a shorter one"]


def test_chat_refuses_an_empty_system_message_before_loading(capsys, monkeypatch) -> None:
    from jaxinfer import cli
    from jaxinfer.commands import chat

    monkeypatch.setattr(chat, "start_llm", lambda *_: (_ for _ in ()).throw(AssertionError("the model loaded")))
    assert cli.main(["chat", "--system", ""]) == 2
    assert capsys.readouterr().err == "jaxinfer: error: --system must not be empty\n"
    assert cli.main(["chat", "--temperature", "-1"]) == 2
    assert capsys.readouterr().err.startswith("jaxinfer: error: temperature=-1")
