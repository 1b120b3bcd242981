"""Reference-counted pages of the KV cache; page 0 is the reserved null page and is never handed out."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class PageAllocator:
    """Hands out page ids in [1, num_pages), counts their owners and takes them back.

    A page is free at refcount 0 and owned at refcount >= 1. `allocate` hands out free pages at refcount 1;
    `incref` adds an owner to an owned page (a shared prompt prefix, a forked sample); `free` drops one owner per
    listed page, and a page whose count reaches 0 goes back to the end of the free list.

    Args:
      num_pages: pages in the cache, including the null page 0.

    Raises:
      ValueError: if num_pages < 2.
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self._free = deque(range(1, num_pages))
        self._refcounts = [0] * num_pages  # indexed by page id; entry 0 (the null page) stays 0

    @property
    def num_free_pages(self) -> int:
        """Pages available now."""
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """All pages but the null page."""
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        """Pages with at least one owner."""
        return self.num_usable_pages - len(self._free)

    def refcount(self, page: int) -> int:
        """Owners of `page` (0: free).

        Raises:
          ValueError: if page is not in [1, num_pages).
        """
        self._check_ids((page,))
        return self._refcounts[page]

    def allocate(self, n: int) -> list[int]:
        """Takes n free pages, each at refcount 1.

        Args:
          n: pages wanted, >= 0.

        Returns:
          n distinct page ids in [1, num_pages).

        Raises:
          ValueError: if n < 0 or fewer than n pages are free (check `num_free_pages` first).
        """
        if n < 0:
            raise ValueError(f"{n=} must be >= 0")
        if n > len(self._free):
            raise ValueError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcounts[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Adds one owner to each listed page (a page listed twice gains two).

        Raises:
          ValueError: if a page is out of range or free (only owned pages can be shared). Nothing changes then.
        """
        counts = Counter(pages)
        self._check_ids(counts)
        free = sorted(p for p in counts if self._refcounts[p] == 0)
        if free:
            raise ValueError(f"cannot share free pages {free[:5]}")
        for p, k in counts.items():
            self._refcounts[p] += k

    def free(self, pages: Iterable[int]) -> None:
        """Drops one owner from each listed page; pages left with no owner return to the free list.

        Raises:
          ValueError: if a page is out of range or would drop below refcount 0 (a double free). Nothing changes
            then.
        """
        counts = Counter(pages)
        self._check_ids(counts)
        over = sorted(p for p, k in counts.items() if self._refcounts[p] < k)
        if over:
            raise ValueError(f"freeing pages {over[:5]} more times than they are owned (double free)")
        for p, k in counts.items():
            self._refcounts[p] -= k
            if self._refcounts[p] == 0:
                self._free.append(p)

    def _check_ids(self, pages: Iterable[int]) -> None:
        bad = [p for p in pages if not 0 < p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:5]} are outside [1, {self.num_pages})")
