"""Admission of a request: its id, and its `Sequence`s, fresh or resumed with output so far.

Resuming: a request whose engine died mid-stream is submitted again with its prompt and the tokens already
streamed (`Engine.add_request(..., output_token_ids=...)`); a KV handoff is the same with the K/V attached
(`jaxinfer.engine.kv_handoff`). The engine prefills prompt + output as context, and the request goes on as if
nothing had happened, because `replay_output` appends each earlier token to the fresh `Sequence` exactly as the
scheduler appends a sampled one (`jaxinfer.scheduler.stop_checker.append_token`):

- `max_tokens`, `min_tokens` and the context limit count them; the penalties see them (`SamplingRow` reads
  `output_token_ids`); the t-th token's sampling key is `fold_in(fold_in(key(seed), sample_index), t)`
  (`jaxinfer.engine.sampling`), t counting them, so a seeded request draws the keys it would have drawn.
- The detokenizer and the text hold them, so a stop string that starts in the earlier text and ends in a new
  token is found, and text deltas continue the earlier ones.
- The stream starts after them: `Sequence.stream_delta` is called once here, so later deltas hold only new ids,
  and new text from where a stream that had emitted exactly these tokens stopped (a live stream holds back the
  last len(longest stop string) - 1 characters; those come in the next delta). Cumulative fields (`text`,
  `token_ids`) of the request's outputs include the earlier tokens; with `logprobs`, their entries are `{}` (the
  earlier attempt returned them) and `cumulative_logprob` sums the new tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence

from jaxinfer.prompt import Prompt
from jaxinfer.request_limits import check_text, check_token_ids, show
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.sequence import Sequence as Seq
from jaxinfer.scheduler.stop_checker import append_token
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer


def request_id_or_new(request_id: str | None, in_use: Callable[[str], bool], counter: Iterator[int]) -> str:
    """A checked request id, or "req-N" with the first N from `counter` not in use.

    Raises:
      ValueError: an id that is not a non-empty string of valid text, or one in use.
    """
    if request_id is None:
        request_id = f"req-{next(counter)}"
        while in_use(request_id):
            request_id = f"req-{next(counter)}"
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={show(request_id)} must be a non-empty string")
    else:
        check_text("request_id", request_id)
    if in_use(request_id):
        raise ValueError(f"request_id={show(request_id)} is already in use")
    return request_id


def check_output_so_far(output_token_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> list[int]:
    """The earlier tokens as a list of ints, checked against the request.

    Raises:
      ValueError: naming the field: ids that are not ints in [0, vocab_size), as many ids as max_tokens or more
        (nothing left to generate), n > 1 (one list of ids cannot continue several samples), prompt_logprobs (the
        earlier attempt returned them).
    """
    ids = list(check_token_ids("output_token_ids", list(output_token_ids), vocab_size))
    if params.max_tokens is not None and len(ids) >= params.max_tokens:
        raise ValueError(f"output_token_ids: {len(ids)} tokens leave nothing to generate with max_tokens="
                         f"{params.max_tokens} (they count toward it)")
    if ids and params.n != 1:
        raise ValueError(f"output_token_ids continue one sample; n={params.n} must be 1")
    if ids and params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs with output_token_ids: the earlier attempt returned them; resume without")
    return ids


def replay_output(seq: Seq, output_token_ids: Sequence[int], eos_ids: Container[int], max_model_len: int) -> None:
    """Appends earlier output tokens to a fresh sequence through the stop rules and marks them streamed.

    Args:
      seq: a sequence with no output yet.
      output_token_ids: the earlier tokens, checked by `check_output_so_far`.
      eos_ids: the model's end-of-sequence ids.
      max_model_len: context limit, tokens.

    Raises:
      ValueError: the tokens already end the request (an EOS, stop id or stop string past min_tokens, or the
        context limit), naming the token.
    """
    for i, token_id in enumerate(output_token_ids):
        reason = append_token(seq, token_id, eos_ids, max_model_len)
        if reason is not None:
            why = f" (stop_reason {seq.stop_reason!r})" if seq.stop_reason is not None else ""
            raise ValueError(f"output_token_ids: token {i} (id {token_id}) already ends the request with "
                             f"finish_reason {reason!r}{why}; nothing is left to generate")
    seq.stream_delta()


def new_sequences(tokenizer: Tokenizer, prompt: Prompt, params: SamplingParams, request_id: str,
                  seq_ids: Iterator[int], seed: int, arrival_time: float, output_token_ids: Sequence[int] = (),
                  prefill_only: bool = False, eos_ids: Container[int] = (), max_model_len: int = 0) -> list[Seq]:
    """The request's `params.n` sequences, each with its detokenizer, the earlier output replayed
    (`replay_output`, with `eos_ids` and `max_model_len`).

    Raises:
      ValueError: prefill_only with n > 1, and as `replay_output`.
    """
    if prefill_only and params.n != 1:
        raise ValueError(f"prefill_only hands one sample over; n={params.n} must be 1")
    seqs = []
    for index in range(params.n):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt.token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
        seqs.append(Seq(seq_id=next(seq_ids), request_id=request_id, prompt_token_ids=list(prompt.token_ids),
                        params=params, seed=seed, detokenizer=detok, arrival_time=arrival_time, sample_index=index,
                        cache_salt=prompt.cache_salt, prefill_only=prefill_only))
        replay_output(seqs[-1], output_token_ids, eos_ids, max_model_len)
    return seqs
