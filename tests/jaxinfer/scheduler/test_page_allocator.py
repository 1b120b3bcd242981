"""PageAllocator: the null page is never handed out, refcounts count owners, pages come back at 0, misuse raises."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.scheduler.page_allocator import PageAllocator


def test_never_hands_out_the_null_page_and_reuses_freed_pages() -> None:
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and alloc.num_free_pages == 0
    with pytest.raises(ValueError, match="4 free"):
        PageAllocator(5).allocate(5)
    alloc.free(pages[:2])
    assert sorted(alloc.allocate(2)) == sorted(pages[:2])


def test_needs_a_page_besides_the_null_page() -> None:
    with pytest.raises(ValueError, match="null page"):
        PageAllocator(1)


def test_shared_page_returns_to_the_pool_only_when_its_last_owner_frees_it() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.incref([a, a])
    assert (alloc.refcount(a), alloc.refcount(b), alloc.num_free_pages, alloc.num_used_pages) == (3, 1, 1, 2)
    alloc.free([a, b])
    assert (alloc.refcount(a), alloc.refcount(b), alloc.num_free_pages) == (2, 0, 2)
    alloc.free([a, a])
    assert alloc.refcount(a) == 0 and alloc.num_free_pages == 3


def test_misuse_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a, b, b])
    with pytest.raises(ValueError, match="free pages"):
        alloc.incref([a, 3])
    with pytest.raises(ValueError, match="outside"):
        alloc.free([0])
    with pytest.raises(ValueError, match="outside"):
        alloc.refcount(4)
    with pytest.raises(ValueError, match="n=-1"):
        alloc.allocate(-1)
    assert (alloc.refcount(a), alloc.refcount(b), alloc.refcount(3), alloc.num_free_pages) == (1, 1, 0, 1)


@settings(max_examples=100, deadline=None)
@given(num_pages=st.integers(2, 9), ops=st.lists(st.tuples(st.sampled_from("aif"), st.integers(0, 4)), max_size=40))
def test_refcounts_match_a_model_of_owners(num_pages: int, ops: list[tuple[str, int]]) -> None:
    """Random allocate / incref / free against a dict model; bad calls must raise and change nothing."""
    alloc = PageAllocator(num_pages)
    owners: dict[int, int] = {}
    for op, k in ops:
        owned = sorted(owners)
        if op == "a":
            if k > alloc.num_free_pages:
                with pytest.raises(ValueError):
                    alloc.allocate(k)
            else:
                pages = alloc.allocate(k)
                assert len(set(pages)) == k and not set(pages) & set(owners) and 0 not in pages
                owners.update(dict.fromkeys(pages, 1))
        elif owned:
            page = owned[k % len(owned)]
            if op == "i":
                alloc.incref([page])
                owners[page] += 1
            else:
                alloc.free([page])
                owners[page] -= 1
                if owners[page] == 0:
                    del owners[page]
        for p in range(1, num_pages):
            assert alloc.refcount(p) == owners.get(p, 0) >= 0
        assert alloc.num_free_pages + len(owners) == alloc.num_usable_pages


def test_scheduler_imports_without_jax() -> None:
    code = ("import sys, jaxinfer.scheduler.page_allocator, jaxinfer.scheduler.scheduler, jaxinfer.scheduler; "
            "assert 'jax' not in sys.modules, 'jax was imported'; "
            "assert not any(m.startswith(('models', 'jaxinfer.engine')) for m in sys.modules), 'engine imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
