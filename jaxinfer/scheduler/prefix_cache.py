"""Automatic prefix caching over the paged KV cache, with an optional second tier in host memory.

A *full* page (page_size computed tokens) is identified by a chain: its own token ids, the cache salt of the
request, and the entry of the page before it. `match` walks a new sequence's tokens page by page and returns the
longest run of cached pages; the scheduler then starts the sequence on them instead of recomputing them (the idea
of vLLM's automatic prefix caching and SGLang's RadixAttention, at page granularity).

- **A hit is exact, never a hash guess.** The hash only indexes candidates; a candidate matches when its token
  ids equal the page's, its salt equals the request's, and its parent *is* (by identity) the entry matched for
  the page before. By induction the whole prefix, and the salt, are equal.
- **Sharing is read-only.** Cached pages are shared by reference count (`PageAllocator.incref`). A sequence
  only writes positions past what it took from the cache, except when its whole sequence was cached: then its
  last token is recomputed into a private copy of the last page (copy-on-write, `KVOp.COPY`), so there are
  logits to sample from and the cached page stays as it was.
- **Eviction.** A cached page whose last owner lets go stays cached and becomes evictable; the allocator
  evicts evictable pages in least-recently-freed order, and only when no plain free page is left.
- **Host tier.** With `host_capacity_pages > 0`, an evicted page is first copied to a bounded pool of host
  memory (`KVOp.OFFLOAD`); a later match can bring it back (`KVOp.LOAD`) instead of recomputing it, when the run
  of host pages is at least `host_min_pages` long (below that, recompute was measured to be cheaper: see
  BENCHMARKS.md). When the pool is full its least recently offloaded page is dropped (`KVOp.DROP`).

This module is host-only bookkeeping (no jax). The page transfers it decides are returned as `KVOp`s in the
order they must run; the engine runs them before the step's model call (`PagedKVCache.apply_ops`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from jaxinfer.scheduler.page_allocator import PageAllocator


class KVOpKind(enum.Enum):
    """A page transfer between the device cache and the host pool."""

    OFFLOAD = "offload"  # device page `src` -> host page `dst` (before the page is reused)
    LOAD = "load"  # host page `src` -> device page `dst` (the host page is freed after)
    COPY = "copy"  # device page `src` -> device page `dst` (copy-on-write)
    DROP = "drop"  # host page `src` is freed


def page_key(parent_key: int, token_ids: tuple[int, ...], salt: str | None) -> int:
    """The chained hash of one full page: `parent_key` (the previous page's key, 0 for a first page), the page's
    token ids and the request's cache salt. Python's `hash`: stable within one process only."""
    return hash((parent_key, token_ids, salt))


def prefix_page_keys(token_ids: Sequence[int], salt: str | None, page_size: int) -> list[int]:
    """The chain of `page_key`s of every full page of `token_ids` (len(token_ids) // page_size keys): what the cache
    indexes those pages by."""
    keys, key = [], 0
    for i in range(len(token_ids) // page_size):
        key = page_key(key, tuple(token_ids[i * page_size : (i + 1) * page_size]), salt)
        keys.append(key)
    return keys


@dataclasses.dataclass(frozen=True)
class KVOp:
    """One transfer; `src` and `dst` are device page ids or host page ids, as `kind` says."""

    kind: KVOpKind
    src: int
    dst: int = -1


@dataclasses.dataclass(eq=False)
class CachedPage:
    """One cached full page: its tokens, its salt, the entry before it, and where its K/V lives.

    Attributes:
      uid: unique id; names the host page when the page is in the host tier.
      key: the chained hash that indexes it.
      parent: the entry of the previous page of the prefix (None for a first page).
      token_ids: the page's page_size token ids.
      salt: the requests' `cache_salt` (None for none).
      page: device page id holding the K/V, or None when only the host tier holds it.
      on_host: the host tier holds it (then `page` is None).
    """

    uid: int
    key: int
    parent: CachedPage | None
    token_ids: tuple[int, ...]
    salt: str | None
    page: int | None = None
    on_host: bool = False


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters over the cache's life (tokens and pages)."""

    queried_tokens: int = 0  # prompt tokens of admitted sequences that looked up the cache
    hit_tokens: int = 0  # of those, tokens taken from the cache (device or host)
    host_hit_pages: int = 0  # pages brought back from the host tier
    offloaded_pages: int = 0  # pages copied to the host tier on eviction
    dropped_host_pages: int = 0  # pages dropped from a full host tier
    cow_copies: int = 0  # copy-on-write page copies


class PrefixCache:
    """The index of cached full pages; see the module docstring.

    Args:
      allocator: the KV pages; the cache installs itself as the allocator's `is_cached` / `on_evict` hooks.
      page_size: tokens per page.
      host_capacity_pages: pages the host tier holds (0 disables it).
      host_min_pages: shortest run of host-tier pages worth loading back (shorter runs are recomputed).

    Raises:
      ValueError: negative capacities or a host_min_pages below 1.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, host_capacity_pages: int = 0,
                 host_min_pages: int = 1) -> None:
        if host_capacity_pages < 0:
            raise ValueError(f"{host_capacity_pages=} must be >= 0")
        if host_min_pages < 1:
            raise ValueError(f"{host_min_pages=} must be >= 1")
        self.allocator = allocator
        self.page_size = page_size
        self.host_capacity_pages = host_capacity_pages
        self.host_min_pages = host_min_pages
        self.stats = PrefixCacheStats()
        self._index: dict[int, list[CachedPage]] = {}
        self._on_device: dict[int, CachedPage] = {}  # device page -> entry
        self._host: OrderedDict[int, CachedPage] = OrderedDict()  # uid -> entry, least recently offloaded first
        self._uids = itertools.count()
        self._ops: list[KVOp] = []
        allocator.is_cached = self.is_cached_page
        allocator.on_evict = self._evict

    # --- queries ------------------------------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        """Device pages that hold a cached prefix (owned or evictable)."""
        return len(self._on_device)

    @property
    def num_host_pages(self) -> int:
        """Pages held by the host tier."""
        return len(self._host)

    def is_cached_page(self, page: int) -> bool:
        """True when device page `page` holds a cached prefix page."""
        return page in self._on_device

    def entry_of(self, page: int) -> CachedPage | None:
        """The cache entry a device page holds, if any."""
        return self._on_device.get(page)

    def host_entries(self) -> list[CachedPage]:
        """Entries in the host tier, least recently offloaded first."""
        return list(self._host.values())

    def take_ops(self) -> list[KVOp]:
        """The transfers decided since the last call, in the order they must run."""
        ops, self._ops = self._ops, []
        return ops

    @staticmethod
    def _key(parent: CachedPage | None, token_ids: tuple[int, ...], salt: str | None) -> int:
        return page_key(0 if parent is None else parent.key, token_ids, salt)

    def _find(self, parent: CachedPage | None, token_ids: tuple[int, ...], salt: str | None) -> CachedPage | None:
        for entry in self._index.get(self._key(parent, token_ids, salt), ()):
            if entry.parent is parent and entry.token_ids == token_ids and entry.salt == salt:
                return entry
        return None

    def match(self, token_ids: Sequence[int], salt: str | None, max_pages: int) -> list[CachedPage]:
        """The longest run of cached pages (device or host) that starts `token_ids`, at most `max_pages` long."""
        ps, out, parent = self.page_size, [], None
        for i in range(min(max_pages, len(token_ids) // ps)):
            entry = self._find(parent, tuple(token_ids[i * ps : (i + 1) * ps]), salt)
            if entry is None or (entry.page is None and not entry.on_host):
                break
            out.append(entry)
            parent = entry
        return out

    # --- hits and registration ----------------------------------------------------------------------------------

    def acquire(self, token_ids: Sequence[int], salt: str | None, max_pages: int) -> list[CachedPage]:
        """Looks up and takes the cached prefix of a sequence about to be admitted.

        Device pages are shared (incref, or revived when nobody owned them); host-tier pages get fresh device
        pages and a LOAD each. The run is cut where the free pages end, and before the first host page when the
        host part is shorter than `host_min_pages`.

        Returns:
          The entries taken, in order; entry i's K/V is (or, after the LOADs, will be) in `entry.page`. The
          caller owns one reference to each of their pages.
        """
        entries = self.match(token_ids, salt, max_pages)
        free = self.allocator.num_free_pages - sum(1 for e in entries
                                                   if e.page is not None and self.allocator.is_evictable(e.page))
        host_seen = 0
        for i, entry in enumerate(entries):
            if entry.page is None:
                host_seen += 1
                if host_seen > free:
                    entries = entries[:i]
                    break
        host = [e for e in entries if e.page is None]
        if 0 < len(host) < self.host_min_pages:
            entries = entries[: entries.index(host[0])]
            host = []
        for entry in entries:
            if entry.page is None:
                del self._host[entry.uid]  # pinned: a full host tier must not drop it while pages are found
            elif self.allocator.is_evictable(entry.page):
                self.allocator.revive(entry.page)
            else:
                self.allocator.incref([entry.page])
        if host:
            pages = self.allocator.allocate(len(host))  # may evict (and offload) other pages first
            for entry, page in zip(host, pages):
                self._ops.append(KVOp(KVOpKind.LOAD, entry.uid, page))
                entry.page, entry.on_host = page, False
                self._on_device[page] = entry
            self.stats.host_hit_pages += len(host)
        return entries

    def register(self, page: int, parent: CachedPage | None, token_ids: Sequence[int],
                 salt: str | None) -> CachedPage:
        """Records that device `page` now holds the full page `token_ids` after the prefix ending at `parent`.

        Returns:
          The entry for this prefix page: a new one on `page`, or the existing one when the same prefix page is
          already cached elsewhere (then `page` stays uncached; a host-only copy moves to `page`).
        """
        if page in self._on_device:
            return self._on_device[page]
        token_ids = tuple(token_ids)
        entry = self._find(parent, token_ids, salt)
        if entry is not None:
            if entry.page is None:  # only the host tier has it: this device page is a fresher copy
                del self._host[entry.uid]
                self._ops.append(KVOp(KVOpKind.DROP, entry.uid))
                entry.page, entry.on_host = page, False
                self._on_device[page] = entry
            return entry
        entry = CachedPage(uid=next(self._uids), key=self._key(parent, token_ids, salt), parent=parent,
                           token_ids=token_ids, salt=salt, page=page)
        self._index.setdefault(entry.key, []).append(entry)
        self._on_device[page] = entry
        return entry

    def copy_on_write(self, page: int) -> int:
        """A private copy of a shared or cached page that is about to be written: allocates a page, queues a COPY,
        drops the caller's reference to the original. The caller must have checked that a page is free.

        Returns:
          The new page id.
        """
        (new,) = self.allocator.allocate(1)
        self._ops.append(KVOp(KVOpKind.COPY, page, new))
        self.allocator.free([page])
        self.stats.cow_copies += 1
        return new

    def forget_pages(self, pages: Sequence[int]) -> None:
        """Drops the cache entries of these device pages (e.g. K/V that turned out non-finite): no later request
        will find them; their owners keep the pages."""
        for page in pages:
            entry = self._on_device.pop(page, None)
            if entry is not None:
                entry.page = None
                self._forget(entry)
                self.allocator.uncache(page)

    def reset(self) -> None:
        """Forgets every cached page: evictable pages become plain free pages, the host tier is emptied (DROP ops),
        pages still owned stay with their owners but are no longer found by `match`."""
        for page in list(self._on_device):
            if self.allocator.is_evictable(page):
                self.allocator.uncache(page)
        self._ops += [KVOp(KVOpKind.DROP, uid) for uid in self._host]
        for entry in [*self._on_device.values(), *self._host.values()]:
            entry.page, entry.on_host = None, False
        self._index.clear()
        self._on_device.clear()
        self._host.clear()

    # --- eviction ----------------------------------------------------------------------------------------------

    def _evict(self, page: int) -> None:
        """Allocator hook: an evictable cached page is about to be reused."""
        entry = self._on_device.pop(page)
        entry.page = None
        if not self.host_capacity_pages:
            self._forget(entry)
            return
        entry.on_host = True
        self._host[entry.uid] = entry
        self._ops.append(KVOp(KVOpKind.OFFLOAD, page, entry.uid))
        self.stats.offloaded_pages += 1
        while len(self._host) > self.host_capacity_pages:
            _, old = self._host.popitem(last=False)
            old.on_host = False
            self._ops.append(KVOp(KVOpKind.DROP, old.uid))
            self.stats.dropped_host_pages += 1
            self._forget(old)

    def _forget(self, entry: CachedPage) -> None:
        bucket = self._index.get(entry.key, [])
        if entry in bucket:
            bucket.remove(entry)
            if not bucket:
                del self._index[entry.key]
