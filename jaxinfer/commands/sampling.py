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
