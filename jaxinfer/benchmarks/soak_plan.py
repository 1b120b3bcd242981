"""The requests of `jaxinfer bench soak`, drawn up front from one seed, and their prompts cut from the GPL-3 text.

1. `draw_plan` draws, for request k, its sampling (greedy / seeded / unseeded, a third each), its input form (text,
   chat, token ids, a third each), its prompt length and `max_tokens` (uniform in their ranges), `ignore_eos` (half
   of them, so that both "length" and "stop" endings occur) and whether and where it is cancelled (`cancel_share`
   of them: half of those a random 0-200 ms after sending, usually before the first token; the other half once a
   random 1 to max_tokens - 1 tokens have arrived).
2. `build_prompts` tokenizes the corpus once on the server (`Tokenize`), gives each request a slice of those ids at
   a random offset, and turns it into the request's input: the ids as they are, their text (`Detokenize`), or that
   text as one user chat message; it asks the server (`Tokenize`) how many prompt tokens that input makes, which is
   what `usage.prompt_tokens` must say, and trims the slice when text round trips make it too long for the context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.v1 import jaxinfer_pb2_grpc as pb_grpc

SAMPLINGS = ("greedy", "seeded", "unseeded")
INPUTS = ("text", "chat", "token_ids")
CANCEL_BEFORE_FIRST_MAX_DELAY_S = 0.2


def parse_range(text: str, option: str, low: int = 1) -> tuple[int, int]:
    """"LO-HI" (or one number N, meaning N-N) -> (LO, HI).

    Raises:
      ValueError: naming `option`, unless LO and HI are integers with low <= LO <= HI.
    """
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"{option} {text!r} must be LO-HI, two integers") from None
    if not low <= a <= b:
        raise ValueError(f"{option} {text!r} must have {low} <= LO <= HI")
    return a, b


@dataclasses.dataclass
class PlannedRequest:
    """One request of the soak and what it must produce.

    Attributes:
      index: its number, 0 ... requests - 1.
      sampling: "greedy" (temperature 0), "seeded" (temperature 0.9, top_p 0.95, a seed) or "unseeded"
        (temperature 1.0, top_k 50, no seed): only the first two are reproducible, so only they get a reference.
      input: "text", "chat" or "token_ids".
      prompt_len: the drawn prompt length in tokens (of the corpus slice; the input may tokenize a little
        differently, see `prompt_tokens`).
      max_tokens, ignore_eos, seed: its sampling values.
      cancel: None, "before_first" (cancelled `cancel_delay_s` after sending) or "mid_stream" (cancelled once
        `cancel_after_tokens` tokens have arrived).
      request: the `GenerateRequest` (set by `build_prompts`).
      prompt_tokens: the prompt tokens the server makes of its input (set by `build_prompts`).
    """

    index: int
    sampling: str
    input: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool
    seed: int | None
    cancel: str | None
    cancel_delay_s: float = 0.0
    cancel_after_tokens: int = 0
    request: pb.GenerateRequest | None = None
    prompt_tokens: int = 0

    def sampling_proto(self) -> pb.SamplingParams:
        """This request's `jaxinfer.v1.SamplingParams`."""
        if self.sampling == "greedy":
            params = pb.SamplingParams(temperature=0.0)
        elif self.sampling == "seeded":
            params = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=self.seed)
        else:
            params = pb.SamplingParams(temperature=1.0, top_k=50)
        params.max_tokens, params.ignore_eos = self.max_tokens, self.ignore_eos
        return params


def draw_plan(num_requests: int, seed: int, cancel_share: float, max_tokens_range: tuple[int, int],
              prompt_len_range: tuple[int, int]) -> list[PlannedRequest]:
    """Step 1 of the module docstring: `num_requests` requests, the same for the same arguments.

    Raises:
      ValueError: num_requests < 1 or cancel_share outside [0, 1].
    """
    if num_requests < 1:
        raise ValueError(f"--requests {num_requests} must be >= 1")
    if not 0.0 <= cancel_share <= 1.0:
        raise ValueError(f"--cancel-share {cancel_share} must be in [0, 1]")
    rng = random.Random(seed)
    plan = []
    for k in range(num_requests):
        max_tokens = rng.randint(*max_tokens_range)
        r = PlannedRequest(index=k, sampling=rng.choice(SAMPLINGS), input=rng.choice(INPUTS),
                           prompt_len=rng.randint(*prompt_len_range), max_tokens=max_tokens,
                           ignore_eos=rng.random() < 0.5, seed=rng.getrandbits(32), cancel=None)
        if r.sampling != "seeded":
            r.seed = None
        if rng.random() < cancel_share:
            if max_tokens < 2 or rng.random() < 0.5:
                r.cancel, r.cancel_delay_s = "before_first", rng.uniform(0.0, CANCEL_BEFORE_FIRST_MAX_DELAY_S)
            else:
                r.cancel, r.cancel_after_tokens = "mid_stream", rng.randint(1, max_tokens - 1)
        plan.append(r)
    return plan


async def _prompt_tokens(stub: pb_grpc.JaxInferStub, request: pb.GenerateRequest) -> int:
    """The prompt tokens the server makes of the request's input (its chat template applied)."""
    which = request.WhichOneof("input")
    if which == "token_ids":
        return len(request.token_ids.ids)
    tokenize = (pb.TokenizeRequest(text=request.text) if which == "text" else
                pb.TokenizeRequest(chat=request.chat))
    return len((await stub.Tokenize(tokenize, timeout=60)).token_ids)


async def _build_one(stub: pb_grpc.JaxInferStub, r: PlannedRequest, ids: list[int], max_model_len: int) -> None:
    for _ in range(4):  # a text round trip may add tokens; trim the slice by the excess and try again
        if r.input == "token_ids":
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
        else:
            text = (await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True),
                                          timeout=60)).text
            request = (pb.GenerateRequest(text=text) if r.input == "text" else pb.GenerateRequest(
                chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)])))
        n = await _prompt_tokens(stub, request)
        excess = n + r.max_tokens - max_model_len
        if n > 0 and excess <= 0 and (request.text or r.input != "text"):
            request.sampling.CopyFrom(r.sampling_proto())
            r.request, r.prompt_tokens = request, n
            return
        ids = ids[:max(1, len(ids) - max(excess, 1))]
    raise ValueError(f"request {r.index}: cannot make a {r.input} prompt of {r.prompt_len} corpus tokens fit the "
                     f"context of {max_model_len} with max_tokens {r.max_tokens}")


async def build_prompts(stub: pb_grpc.JaxInferStub, plan: list[PlannedRequest], text: str, seed: int,
                        max_model_len: int, concurrency: int) -> None:
    """Step 2 of the module docstring: sets `request` and `prompt_tokens` of every planned request.

    Args:
      text: the corpus; `max_model_len`: the server's context (`ModelInfo`); `concurrency`: RPCs in flight.

    Raises:
      ValueError: a drawn prompt length plus max_tokens that cannot fit the context, or a corpus that tokenizes
        to nothing.
    """
    corpus = list((await stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)).token_ids)
    if not corpus:
        raise ValueError("the corpus tokenizes to no tokens")
    longest = max(r.prompt_len for r in plan)
    corpus = corpus * (longest // len(corpus) + 2)  # wrap around for prompts longer than the corpus
    rng = random.Random(seed + 1)
    slices = [corpus[(o := rng.randrange(len(corpus) - longest)): o + r.prompt_len] for r in plan]
    for r in plan:
        if r.prompt_len + r.max_tokens > max_model_len:
            raise ValueError(f"--prompt-len-range and --max-tokens-range: request {r.index} draws {r.prompt_len} "
                             f"prompt + {r.max_tokens} output tokens, past the server's context of {max_model_len}")
    gate = asyncio.Semaphore(concurrency)

    async def build(r: PlannedRequest, ids: list[int]) -> None:
        async with gate:
            await _build_one(stub, r, ids, max_model_len)

    await asyncio.gather(*(build(r, ids) for r, ids in zip(plan, slices)))
