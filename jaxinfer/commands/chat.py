"""`jaxinfer chat`: a conversation with the model in the terminal.

1. Each line read from stdin (after a `> ` prompt, with line editing, when stdin is a terminal) is a user message.
   An empty line is ignored; `/reset` clears the conversation (a --system message stays); `/exit` or the end of
   input (Ctrl-D) ends it with status 0. Any other line whose first word is `/` and letters (`/help`, `/bogus`) is
   an unknown command, refused with a line on stderr; `//text` sends `/text` as a message.
2. Each turn renders the whole conversation with the model's chat template (`LLM.render_chat`) and streams the
   reply to stdout; the reply joins the conversation. With prefix caching (on by default) a turn mostly computes
   only its new tokens.
3. When the conversation would leave less than min(--max-tokens, half the context) tokens for the reply, its oldest
   turns (a user message and the reply to it) are dropped, and stderr says so.
4. A turn that fails (a message too long for the context, a request the engine fails) or is interrupted (Ctrl-C
   during the reply) prints one line on stderr and leaves its message out of the conversation.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxinfer.cli_parser import error_line
from jaxinfer.commands.options import add_engine_options, add_multihost_options, engine_options, start_llm
from jaxinfer.commands.sampling import add_sampling_options, request_error, sampling_params

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.outputs import RequestOutput
    from jaxinfer.prompt import Prompt
    from jaxinfer.sampling_params import SamplingParams

RESET, EXIT = "/reset", "/exit"


def add_parser(sub) -> None:
    """Adds the `chat` subcommand to the subparsers `sub`."""
    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          description="Chat with the model: each line of stdin is a message, the reply streams to "
                                      f"stdout. {RESET} clears the conversation; {EXIT} or Ctrl-D ends.")
    chat.add_argument("--system", metavar="PROMPT", default=None,
                      help=f"a system message that starts the conversation (kept by {RESET})")
    add_sampling_options(chat, max_tokens=None)
    chat.add_argument("--verbose", "-v", action="store_true",
                      help="debug logging on stderr (also each turn's prompt and reply tokens)")
    add_engine_options(chat, "chat")
    add_multihost_options(chat)


def run(args: argparse.Namespace) -> int:
    """Runs `jaxinfer chat` until /exit or the end of stdin; returns the exit status (0)."""
    from jaxinfer.request_limits import check_text

    if args.system is not None and not check_text("--system", args.system):
        raise ValueError("--system must not be empty")
    params = sampling_params(args)  # validates before the slow load
    options = engine_options(args)
    llm = start_llm(args, options)
    if llm is None:  # a follower process: process 0 reads the messages
        return 0
    session = ChatSession(llm, params, args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - gives input() line editing and recall
        except ImportError:
            pass
        sys.stderr.write(f"Type a message; {RESET} clears the conversation, {EXIT} or Ctrl-D ends.\n")

    def write(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text == EXIT:
            break
        if text == RESET:
            session.reset()
            sys.stderr.write("(conversation cleared)\n")
            continue
        if re.fullmatch(r"/[A-Za-z]+", text.split()[0]):
            sys.stderr.write(f"(unknown command {text.split()[0]}: {RESET} clears the conversation, {EXIT} ends; "
                             "start a line with // to send it as a message)\n")
            continue
        session.turn(text[1:] if text.startswith("//") else text, write)
    return 0


class ChatSession:
    """A conversation: the system message, the user and assistant messages, and the turn that extends them.

    Args:
      llm: the model.
      params: each reply's sampling params; max_tokens None: until the end of the turn or the context.
      system: the system message's content, or None for none.
    """

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None) -> None:
        self.llm = llm
        self.params = params
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.history: list[dict] = []  # user and assistant messages, in order

    @property
    def reply_room(self) -> int:
        """Tokens the context must keep free for a reply: min(max_tokens, half the context)."""
        limit = self.llm.max_model_len
        return min(limit if self.params.max_tokens is None else self.params.max_tokens, limit // 2)

    def reset(self) -> None:
        """Forgets every message but the system one."""
        self.history.clear()

    def turn(self, text: str, write: Callable[[str], None]) -> RequestOutput | None:
        """Sends the user message `text` with the conversation so far and streams the reply through `write`.

        Returns:
          The reply's `RequestOutput`, or None when the turn failed or was interrupted: then one line on stderr
          says why and the message is left out of the conversation.
        """
        self.history.append({"role": "user", "content": text})
        try:
            prompt = self._fit()
            out = self.llm.generate(prompt, self.params, on_output=lambda _i, _ids, delta: write(delta),
                                    use_tqdm=False)[0]
        except ValueError as e:
            return self._fail(error_line(request_error(e, unlimited_default=True)))
        except KeyboardInterrupt:
            write("\n")
            return self._fail("(interrupted)\n")
        write("\n")
        completion = out.outputs[0]
        if completion.finish_reason == "error":
            return self._fail(error_line(f"the request failed: {completion.error}"))
        self.history.append({"role": "assistant", "content": completion.text})
        logging.getLogger("jaxinfer").debug(
            "turn: prompt %d tokens (messages: %d; %d tokens from the prefix cache), reply %d tokens, "
            "finish_reason=%s, TTFT %.2f s, decode %.1f tokens/s", len(out.prompt_token_ids),
            len(self.system) + len(self.history) - 1, out.num_cached_tokens, len(completion.token_ids),
            completion.finish_reason, out.metrics.ttft_s, out.metrics.decode_tokens_per_s)
        return out

    def _fail(self, line: str) -> None:
        self.history.pop()  # the turn's user message: trimming kept it
        sys.stderr.write(line)

    def _fit(self) -> Prompt:
        """The conversation's prompt, after dropping the oldest turns while it leaves less than `reply_room` tokens.

        Raises:
          ValueError: the last user message alone (with the system message) leaves no room for one token.
        """
        limit, dropped = self.llm.max_model_len, 0
        while True:
            prompt = self.llm.render_chat(self.system + self.history)[0]
            n = len(prompt.token_ids)
            if n + self.reply_room <= limit or len(self.history) == 1:
                break
            del self.history[0]  # the oldest user message, then whatever answered it up to the next one
            while self.history[0]["role"] != "user":
                del self.history[0]
            dropped += 1
        if dropped:
            sys.stderr.write(f"(dropped the {dropped} oldest turn{'s' * (dropped > 1)} to fit the context of "
                             f"{limit} tokens)\n")
        if n >= limit:
            raise ValueError(f"the message makes a prompt of {n} tokens, which does not fit the context of {limit} "
                             "tokens: send a shorter one")
        return prompt
