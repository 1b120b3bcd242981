"""A scripted fake model and engine loop for scheduler tests: every token can be computed by hand.

The model. Over a vocabulary of `V = 50` ids, the next token after a context `c` (prompt + outputs) is

    next_token(c) = (7 * sum(c[-3:]) + len(c)) % 50

then, if that id is suppressed (EOS or stop ids while fewer than min_tokens outputs exist), the next id up (mod 50)
that is not. Worked example: prompt [5, 9, 11, 3]:

    7 * (9 + 11 + 3)  + 4 = 165 -> 15
    7 * (11 + 3 + 15) + 5 = 208 -> 8
    7 * (3 + 15 + 8)  + 6 = 188 -> 38

so the outputs start 15, 8, 38, 34, 18, 39, 47, 39 (`test_fake_model_worked_example` checks this).

The detokenizer. Id 0 is EOS and decodes to "". Ids 1..44 decode to a letter repeated 1-3 times:
`piece(i) = "abcdefghijklmnopqrstuvwxyz"[i % 26] * (1 + i % 3)`, e.g. 15 -> "p", 8 -> "iii", 38 -> "mmm",
34 -> "ii". Ids 45..49 are "held" (like the first bytes of a UTF-8 character): their upper-case letter
(45 -> "T") comes out with the next token's text, or from `flush()`. So the text above starts "piiimmmii".

The engine. `FakeEngine` plays the engine for a `Scheduler`: it writes each chunk's token ids into a fake KV cache
(`cache[page, slot]`) through the chunk's page ids, then, for chunks with `samples=True`, reads the whole context
back through the pages and applies `next_token` to it. A scheduler that loses, misplaces or shares pages therefore
changes the tokens, and the cache read is checked against the sequence's own ids.

`reference_generate` is the oracle: a plain loop over one sequence with the stop rules written the naive way
(search the whole text for stop strings after every token). It agrees with the scheduler's rules unless
min_tokens > 0 and stop strings are combined (then a stop string completed while suppressed differs), so tests
give the oracle only one of the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import Scheduler, Sequence

V = 50
EOS_ID = 0
HELD_IDS = frozenset(range(45, 50))
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def piece(token_id: int) -> str:
    """The text of one id (held ids: the text they add once released)."""
    if token_id == EOS_ID:
        return ""
    if token_id in HELD_IDS:
        return _LETTERS[token_id % 26].upper()
    return _LETTERS[token_id % 26] * (1 + token_id % 3)


def next_token(context: list[int], suppressed: Iterable[int] = ()) -> int:
    """The fake model: see the module docstring."""
    banned = set(suppressed)
    t = (7 * sum(context[-3:]) + len(context)) % V
    while t in banned:
        t = (t + 1) % V
    return t


class ToyDetokenizer:
    """`Detokenizer` over `piece`; held ids wait for the next id or `flush()`."""

    def __init__(self) -> None:
        self._held = ""

    def step(self, token_id: int) -> str:
        if token_id in HELD_IDS:
            self._held += piece(token_id)
            return ""
        out, self._held = self._held + piece(token_id), ""
        return out

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


def make_seq(seq_id: int, prompt: list[int], params: SamplingParams, arrival_time: float = 0.0,
             request_id: str | None = None) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id) if request_id is None else request_id,
                    prompt_token_ids=list(prompt), params=params, seed=seq_id, detokenizer=ToyDetokenizer(),
                    arrival_time=arrival_time)


@dataclasses.dataclass(frozen=True)
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str


def reference_generate(prompt: list[int], params: SamplingParams, max_model_len: int) -> Result:
    """The oracle: one sequence, no scheduler, naive stop rules (see the module docstring)."""
    detok = ToyDetokenizer()
    tokens: list[int] = []
    text = ""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS_ID})
    while True:
        suppressed = stop_ids if len(tokens) < params.min_tokens else ()
        t = next_token(prompt + tokens, suppressed)
        tokens.append(t)
        text += detok.step(t)
        if len(tokens) >= params.min_tokens:
            if t in stop_ids:
                return Result(tokens, text + detok.flush(), "stop")
            found = [(text.find(s), len(s)) for s in params.stop if s in text]
            if found:
                i, n = min(found)
                return Result(tokens, text[: i + n] if params.include_stop_str_in_output else text[:i], "stop")
        if len(tokens) >= params.max_tokens or len(prompt) + len(tokens) >= max_model_len:
            return Result(tokens, text + detok.flush(), "length")


@dataclasses.dataclass
class RunStats:
    num_steps: int = 0
    num_chunks: int = 0
    num_partial_chunks: int = 0  # 1 < len < tokens left to compute
    num_short_chunks: int = 0  # len < tokens left to compute
    max_batched_tokens: int = 0
    max_running: int = 0


class FakeEngine:
    """Drives a `Scheduler` with the fake model over a fake paged KV cache (see the module docstring).

    Args:
      num_pages: pages in the cache, null page included (as the allocator's).
      page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.cache = np.full((num_pages, page_size), -1, dtype=np.int64)  # [P, page_size] token ids
        self.deltas: dict[int, list[str]] = {}
        self.streamed_ids: dict[int, list[int]] = {}
        self.stats = RunStats()

    def step(self, scheduler: Scheduler) -> list[Sequence]:
        """One schedule / run / update round; returns what `update` returned (after streaming it)."""
        cfg = scheduler.config
        out = scheduler.schedule()
        st = self.stats
        st.num_steps += 1
        st.max_batched_tokens = max(st.max_batched_tokens, out.num_batched_tokens)
        st.max_running = max(st.max_running, scheduler.num_running)
        assert out.num_batched_tokens == sum(len(c.token_ids) for c in out.chunks) <= cfg.max_num_batched_tokens
        assert scheduler.num_running <= cfg.max_num_seqs
        for ch in out.chunks:
            left = ch.seq.num_tokens - ch.num_computed_tokens
            st.num_chunks += 1
            st.num_short_chunks += len(ch.token_ids) < left
            st.num_partial_chunks += 1 < len(ch.token_ids) < left
            end = ch.num_computed_tokens + len(ch.token_ids)
            assert len(ch.page_ids) == -(-end // self.page_size), (len(ch.page_ids), end)
            assert 0 not in ch.page_ids
            assert ch.samples == (end == ch.seq.num_tokens)
            for i, t in enumerate(ch.token_ids):
                pos = ch.num_computed_tokens + i
                self.cache[ch.page_ids[pos // self.page_size], pos % self.page_size] = t
        sampled = {}
        for ch in out.chunks:
            if ch.samples:
                end = ch.num_computed_tokens + len(ch.token_ids)
                context = [int(self.cache[ch.page_ids[p // self.page_size], p % self.page_size]) for p in range(end)]
                assert context == ch.seq.token_ids, f"KV cache of sequence {ch.seq.seq_id} was corrupted"
                sampled[ch.seq.seq_id] = next_token(context, scheduler.suppressed_token_ids(ch.seq))
        produced = scheduler.update(out, sampled)
        for seq in produced:
            ids, text = seq.stream_delta()
            self.streamed_ids.setdefault(seq.seq_id, []).extend(ids)
            self.deltas.setdefault(seq.seq_id, []).append(text)
        return produced

    def run(self, scheduler: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 100_000) -> None:
        """Adds each list of sequences at its step and steps until everything finished."""
        pending = dict(arrivals)
        step = 0
        while pending or scheduler.has_unfinished():
            for seq in pending.pop(step, []):
                scheduler.add(seq)
            self.step(scheduler)
            step += 1
            assert step < max_steps, "no progress"
