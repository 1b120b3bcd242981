"""Speculative decoding's reservation: how many draft positions a decoding sequence may take after its decode token
in one step."""

from __future__ import annotations

from jaxinfer.scheduler.sequence import Sequence


def draft_slots(seq: Sequence, wanted: int, budget: int, max_model_len: int, capacity: int) -> int:
    """Draft positions a decoding sequence gets this step (see `Scheduler.schedule`'s spec_slots).

    A block never reaches past max_tokens or the context, and while the output is shorter than min_tokens, it
    stays before min_tokens (EOS and stop ids are banned on every position of the block).

    Args:
      seq: the decoding sequence.
      wanted: drafts the proposer asks for; <= 0 gives 0.
      budget: tokens of the step's budget that drafts may take.
      max_model_len: the context limit, tokens.
      capacity: positions the sequence's pages plus the free pages can hold (no preemption for drafts).

    Returns:
      The number of draft positions, >= 0.
    """
    if wanted <= 0:
        return 0
    p, out = seq.params, len(seq.output_token_ids)
    caps = [wanted, budget, max_model_len - seq.num_tokens - 1]
    if p.max_tokens is not None:
        caps.append(p.max_tokens - out - 1)
    if out < p.min_tokens:
        caps.append(p.min_tokens - out - 1)
    caps.append(capacity - seq.num_tokens)
    return max(0, min(caps))
