"""The KV pages of the scheduler's sequences: allocation on demand, sharing, copy-on-write, trimming and release.

The `Scheduler` decides which sequences compute which tokens; `SequencePages` keeps each sequence's `page_ids`
right for that: it allocates the pages a chunk's positions need, starts a sequence on pages it can share (its
sample 0's full prompt pages, or a prefix-cache hit), gives a sequence its own copy of a shared page before the
first write into it (copy-on-write), registers completed pages in the prefix cache, and frees pages. Plain Python.
"""

from __future__ import annotations

from jaxinfer.scheduler.config import SchedulerConfig
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import PrefixCache
from jaxinfer.scheduler.sequence import Sequence


class SequencePages:
    """Page bookkeeping of sequences over one allocator (and an optional prefix cache).

    Args:
      config: the scheduler's limits (`page_size`, `pages_for`).
      allocator: the KV pages.
      prefix_cache: the cache of full pages, or None without prefix caching.
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, prefix_cache: PrefixCache | None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = allocator
        self.prefix_cache = prefix_cache

    # --- sharing ----------------------------------------------------------------------------------------------

    def shareable_prompt_tokens(self, seq: Sequence) -> int:
        """Prompt tokens in full pages before the last prompt token (which every sample computes itself)."""
        return (len(seq.prompt_token_ids) - 1) // self.page_size * self.page_size

    def share_prompt_pages(self, seq: Sequence, sibling: Sequence) -> int:
        """Starts `seq` on the full prompt pages `sibling` has computed (reference counted, read-only).

        Both write only positions past the shared pages, so no page is written by two owners.

        Returns:
          The number of pages shared.
        """
        shared_tokens = self.shareable_prompt_tokens(seq)
        shared = sibling.page_ids[: shared_tokens // self.page_size]
        self.allocator.incref(shared)
        seq.page_ids = list(shared)
        seq.num_computed_tokens = shared_tokens
        seq.num_shared_pages = len(shared)
        return len(shared)

    def take_cached_prefix(self, seq: Sequence) -> None:
        """Starts a sequence on the longest cached run of its full pages (prefix caching)."""
        ps, n = self.page_size, seq.num_tokens
        entries = self.prefix_cache.acquire(seq.token_ids, seq.cache_salt, max_pages=n // ps)
        seq.page_ids = [e.page for e in entries]
        seq.cached_entries = list(entries)
        # The last token is always computed, for its logits: when every token was cached, it is recomputed into
        # a private copy of the last page (copy-on-write in `prepare`).
        seq.num_computed_tokens = min(len(entries) * ps, n - 1)
        seq.num_shared_pages = seq.num_computed_tokens // ps  # a copied-on-write last page is the sequence's own
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def register_full_pages(self, seq: Sequence) -> None:
        """Records the sequence's newly completed full pages in the prefix cache."""
        ps = self.page_size
        for i in range(len(seq.cached_entries), seq.num_computed_tokens // ps):
            parent = seq.cached_entries[i - 1] if i else None
            seq.cached_entries.append(self.prefix_cache.register(
                seq.page_ids[i], parent, seq.token_slice(i * ps, (i + 1) * ps), seq.cache_salt))

    # --- room -------------------------------------------------------------------------------------------------

    def needs_copy(self, seq: Sequence) -> bool:
        """True when the next write lands in a page that is shared or cached (copy-on-write)."""
        start = seq.num_computed_tokens
        if start % self.page_size == 0 or start // self.page_size >= len(seq.page_ids):
            return False
        page = seq.page_ids[start // self.page_size]
        return self.allocator.refcount(page) > 1 or (self.prefix_cache is not None
                                                     and self.prefix_cache.is_cached_page(page))

    def _free_after_copy(self, seq: Sequence) -> int:
        """Free pages left once the sequence's pending copy-on-write (if any) has taken one; may be -1."""
        return self.allocator.num_free_pages - self.needs_copy(seq)

    def capacity(self, seq: Sequence) -> int:
        """Positions the sequence's pages plus the free pages can hold (less a pending copy-on-write's page)."""
        return (len(seq.page_ids) + max(self._free_after_copy(seq), 0)) * self.page_size

    def fit(self, seq: Sequence, n: int) -> int:
        """`n` shrunk to the tokens whose positions the sequence's pages plus the free pages can hold."""
        if self._free_after_copy(seq) < 0:
            return 0
        return max(0, min(n, self.capacity(seq) - seq.num_computed_tokens))

    # --- allocation and release -------------------------------------------------------------------------------

    def prepare(self, seq: Sequence, num_positions: int) -> None:
        """Makes the sequence's pages hold positions `[0, num_positions)`, its next write landing in a page of its
        own: copies a shared or cached page first, then allocates the missing pages.

        Raises:
          AssertionError: a shared page would be written without a prefix cache (a scheduler bug).
        """
        if self.needs_copy(seq):
            index = seq.num_computed_tokens // self.page_size
            if self.prefix_cache is None:
                raise AssertionError("a shared page would be written without a prefix cache")
            seq.page_ids[index] = self.prefix_cache.copy_on_write(seq.page_ids[index])
        need = self.config.pages_for(num_positions) - len(seq.page_ids)
        if need > 0:
            seq.page_ids.extend(self.allocator.allocate(need))

    def trim(self, seq: Sequence) -> None:
        """Frees the pages past those holding the sequence's tokens (rejected drafts' and unused slots')."""
        keep = self.config.pages_for(seq.num_tokens)
        if len(seq.page_ids) > keep:
            extra = seq.page_ids[keep:]
            del seq.page_ids[keep:]
            self.allocator.free(reversed(extra))

    def release(self, seq: Sequence) -> None:
        """Drops the sequence's pages, last page first: its cached tail pages are evicted before its head."""
        self.allocator.free(reversed(seq.page_ids))
        seq.page_ids = []
        seq.cached_entries = []
        seq.num_shared_pages = 0
