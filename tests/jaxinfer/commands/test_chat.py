"""`jaxinfer chat` with a scripted stdin, against `LLM.chat` on the conversations the turns should send: each turn
carries the history, the oldest turns make room for the reply, /reset forgets, a message too long fails its turn
alone, and /exit ends."""

from __future__ import annotations

import re

import pytest

from jaxinfer import SamplingParams
from tests.jaxinfer.commands.tiny_chat import ENGINE_FLAGS, REPO, run_jaxinfer

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
    script = f"hello\n\n/bogus\nworld\nok\n/reset\n{too_long}\nworld\n/exit\nnever sent\n"
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
    assert "(unknown command /bogus: /reset clears the conversation, /exit ends" in done.stderr  # and not sent
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


def test_chat_on_a_terminal_prompts_and_ends_on_ctrl_d(tiny_chat_model, tiny_llm) -> None:
    pty = pytest.importorskip("pty")
    import os
    import select
    import subprocess
    import sys
    import time

    want = tiny_llm.chat([_user("hello")], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "chat", "--model", str(tiny_chat_model),
                             *ENGINE_FLAGS, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)],
                            stdin=follower, stdout=follower, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONIOENCODING": "utf-8"})
    os.close(follower)
    seen = b""

    def read_until(end: bytes) -> None:  # the terminal echoes what is typed
        nonlocal seen
        start, deadline = len(seen), time.monotonic() + 120
        while not seen[start:].endswith(end) and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 4096)

    try:
        read_until(b"> ")
        os.write(leader, b"hello\n")
        read_until(b"\r\n> ")  # the reply's line, then the next prompt
        os.write(leader, b"\x04")  # Ctrl-D at an empty prompt: end of input
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
        os.close(leader)
    assert seen.decode("utf-8") == f"> hello\r\n{want.outputs[0].text}\r\n> "
    assert "/reset clears the conversation, /exit or Ctrl-D ends" in proc.stderr.read().decode()


def test_a_max_tokens_beyond_the_context_fails_the_turn_naming_the_flag(tiny_llm, capsys) -> None:
    """Found by a fresh-user trial: the line said max_tokens=None, which the CLI cannot pass; chat's way is to leave
    --max-tokens out."""
    from jaxinfer.commands.chat import ChatSession

    session = ChatSession(tiny_llm, SamplingParams(temperature=0, max_tokens=100_000_000))
    prompt_len = len(tiny_llm.render_chat([_user("hi")])[0].token_ids)
    room = tiny_llm.max_model_len - prompt_len
    assert session.turn("hi", lambda _: pytest.fail("nothing is generated")) is None
    assert capsys.readouterr().err == (
        f"jaxinfer: error: --max-tokens 100000000: the prompt ({prompt_len} tokens) leaves room for at most {room} "
        f"in the context of {tiny_llm.max_model_len} tokens; give --max-tokens {room} or less, or leave it out to "
        "generate until the context is full\n")
    assert session.history == []  # the failed turn is not part of the conversation
