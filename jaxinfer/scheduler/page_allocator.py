"""Reference-counted pages of the KV cache; page 0 is the reserved null page and is never handed out."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable


class PageAllocator:
    """Hands out page ids in [1, num_pages), counts their owners and takes them back.

    A page is free at refcount 0 and owned at refcount >= 1. `allocate` hands out free pages at refcount 1;
    `incref` adds an owner to an owned page (a shared prompt prefix, a forked sample); `free` drops one owner per
    listed page, and a page whose count reaches 0 goes back to the end of the free list.

    With a prefix cache, a page that reaches refcount 0 while it holds a cached prefix (`is_cached(page)`) is not
    wiped: it becomes *evictable*, kept in least-recently-freed order. `allocate` hands out plain free pages
    first and evicts the least recently freed cached pages only when those run out, calling `on_evict(page)` so
    the cache forgets (or offloads) the page first; `revive` takes an evictable page back on a cache hit. Both
    kinds count as free in `num_free_pages`.

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
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages at refcount 0, oldest first
        self._refcounts = [0] * num_pages  # indexed by page id; entry 0 (the null page) stays 0
        self.is_cached: Callable[[int], bool] = lambda page: False
        self.on_evict: Callable[[int], None] = lambda page: None
        self.num_evictions = 0

    @property
    def num_free_pages(self) -> int:
        """Pages available now (plain free plus evictable cached pages)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_pages(self) -> int:
        """Free pages that still hold a cached prefix."""
        return len(self._evictable)

    def is_evictable(self, page: int) -> bool:
        """True for a cached page at refcount 0."""
        return page in self._evictable

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
        if n > self.num_free_pages:
            raise ValueError(f"asked for {n} pages, {self.num_free_pages} free")
        pages = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:  # evict the least recently freed cached pages
            page, _ = self._evictable.popitem(last=False)
            self.on_evict(page)
            self.num_evictions += 1
            pages.append(page)
        for p in pages:
            self._refcounts[p] = 1
        return pages

    def revive(self, page: int) -> None:
        """Takes an evictable cached page back at refcount 1 (a prefix-cache hit on a page nobody owns).

        Raises:
          ValueError: if the page is not evictable.
        """
        if page not in self._evictable:
            raise ValueError(f"page {page} is not an evictable cached page")
        del self._evictable[page]
        self._refcounts[page] = 1

    def uncache(self, page: int) -> None:
        """The cache dropped an evictable page's prefix: it becomes a plain free page (no-op for other pages)."""
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

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
        """Drops one owner from each listed page; pages left with no owner return to the free list (or, when cached,
        to the evictable list, the first listed first evicted).

        Raises:
          ValueError: if a page is out of range or would drop below refcount 0 (a double free). Nothing changes
            then.
        """
        counts = Counter(pages)  # insertion order = the caller's order, which sets the eviction order
        self._check_ids(counts)
        over = sorted(p for p, k in counts.items() if self._refcounts[p] < k)
        if over:
            raise ValueError(f"freeing pages {over[:5]} more times than they are owned (double free)")
        for p, k in counts.items():
            self._refcounts[p] -= k
            if self._refcounts[p] == 0:
                if self.is_cached(p):
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def _check_ids(self, pages: Iterable[int]) -> None:
        bad = [p for p in pages if not 0 < p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:5]} are outside [1, {self.num_pages})")
