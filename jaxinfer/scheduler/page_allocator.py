"""A free list over the KV cache's pages; page 0 is the reserved null page and is never handed out."""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """Hands out page ids in [1, num_pages) and takes them back.

    Args:
      num_pages: pages in the cache, including the null page 0.

    Raises:
      ValueError: if num_pages < 2.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self._free = deque(range(1, num_pages))

    @property
    def num_free_pages(self) -> int:
        """Pages available now."""
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """All pages but the null page."""
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        """Takes n pages.

        Raises:
          ValueError: if fewer than n pages are free (check `num_free_pages` first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        """Returns pages to the pool."""
        assert all(0 < p < self.num_pages for p in pages), pages
        self._free.extend(pages)
