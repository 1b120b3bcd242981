"""Host-side scheduling state: pages, sequences, stop rules and the batching policy. Plain Python; imports no jax.

`PageAllocator` (page_allocator.py) hands out reference-counted KV pages; `Sequence` (sequence.py) is one
generated sequence's state; `stop_checker.append_token` applies the stop rules to a sampled token; `Scheduler`
(scheduler.py, limits in config.py) picks each step's decodes and prefill chunks (`SchedulerOutput` of
`ScheduledChunk`s, chunk.py), preempts by recompute when pages run out, and frees the pages of finished sequences;
`SequencePages` (sequence_pages.py) keeps each sequence's pages (sharing, copy-on-write, prefix-cache hits), and
`draft_slots` (draft_slots.py) sizes speculative decoding's reservation.
"""

from jaxinfer.scheduler.chunk import ScheduledChunk, SchedulerOutput
from jaxinfer.scheduler.config import SchedulerConfig
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.scheduler import Scheduler
from jaxinfer.scheduler.sequence import Detokenizer, Sequence, SequenceStatus

__all__ = ["Detokenizer", "PageAllocator", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "Sequence", "SequenceStatus"]
