"""The sampling flags that `generate` and `chat` share (`SamplingParams` fields, vLLM's names) and the params they
give."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.sampling_params import SamplingParams


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int | None) -> None:
    """Adds the sampling flags; `max_tokens` is the command's default of --max-tokens (None: no limit but the
    context's)."""
    group = parser.add_argument_group("sampling (SamplingParams fields)")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="most tokens to generate" + (f" (default {max_tokens})" if max_tokens is not None else
                                                         " (default: until the end of the turn or the context)"))
    group.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    group.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    group.add_argument("--top-p", type=float, default=1.0, help="1.0 disables (default)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed")
    group.add_argument("--min-p", type=float, default=0.0, help="0 disables (default)")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def request_error(e: ValueError, unlimited_default: bool) -> str:
    """The message of a request the engine refused, in the command line's words: a max_tokens beyond the context
    (`MaxTokensBeyondContext`, whose own message names the Python API's max_tokens=None) names --max-tokens and
    the values that fit; any other message as it is.

    Args:
      e: the refusal.
      unlimited_default: whether leaving --max-tokens out generates until the context is full (`chat`), not a
        fixed number of tokens (`generate`).
    """
    from jaxinfer.request_limits import MaxTokensBeyondContext

    if not isinstance(e, MaxTokensBeyondContext):
        return str(e)
    fix = f"give --max-tokens {e.room} or less" + (", or leave it out to generate until the context is full"
                                                   if unlimited_default else "")
    return f"--max-tokens {e.max_tokens}: {e.reason()}; {fix}"


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` of the sampling flags (no jax: checked before the model loads).

    Raises:
      ValueError: a value `SamplingParams` refuses, naming the field.
    """
    from jaxinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=args.stop)
