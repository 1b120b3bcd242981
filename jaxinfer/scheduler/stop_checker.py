"""Stop rules: appends a sampled token to a `Sequence`, detokenizes it, and decides whether the sequence ends.

Rules, in order, for the n-th output token (n counts from 1):

1. While n < min_tokens nothing below rule 3 applies (the sampler also suppresses EOS and stop ids then).
2. EOS (unless `ignore_eos`) or a `stop_token_ids` id ends the sequence with "stop"; the id stays in the output
   and, for a stop id (EOS is checked first), becomes `stop_reason`, as in vLLM. Otherwise, a stop string found in
   the text ends it with "stop": the text is cut before the match (after it with `include_stop_str_in_output`),
   the ids are kept up to the token that completed the match, and the string is the `stop_reason`. Only matches
   that may end in the new text are searched for; they may start in earlier text (spanning tokens).
3. n == max_tokens, or prompt + output >= max_model_len, ends it with "length".
4. A sequence that ends without a stop-string match gets `detokenizer.flush()` appended to its text.
"""

from __future__ import annotations

from collections.abc import Container

from jaxinfer.scheduler.sequence import Sequence


def append_token(seq: Sequence, token_id: int, eos_ids: Container[int], max_model_len: int) -> str | None:
    """Appends one sampled token to `seq` (ids and text) and applies the stop rules.

    Args:
      seq: a live sequence; its `output_token_ids`, `text` and `stop_reason` are updated in place.
      token_id: the sampled id.
      eos_ids: the model's end-of-sequence ids.
      max_model_len: context limit, tokens (prompt + output).

    Returns:
      "stop", "length", or None while the sequence goes on. Status and pages are left to the caller.
    """
    p = seq.params
    seq.output_token_ids.append(token_id)
    previous_len = len(seq.text)
    seq.text += seq.detokenizer.step(token_id)
    n = len(seq.output_token_ids)
    reason = None
    matched_stop_string = False
    if n >= p.min_tokens:
        if token_id in eos_ids and not p.ignore_eos:
            reason = "stop"
        elif token_id in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token_id
        elif p.stop:
            window_start = max(0, previous_len - max(len(s) for s in p.stop) + 1)
            hits = [(seq.text.find(s, window_start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)  # the earliest match; on a tie the shorter (lexicographically first) string
                seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                reason, seq.stop_reason = "stop", s
                matched_stop_string = True
    if reason is None and ((p.max_tokens is not None and n >= p.max_tokens) or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and not matched_stop_string:
        seq.text += seq.detokenizer.flush()  # bytes of an unfinished character, if any
    return reason
