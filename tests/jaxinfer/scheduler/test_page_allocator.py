"""PageAllocator: the null page is never handed out, pages come back, over-asking raises."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_scheduler_imports_without_jax() -> None:
    code = "import sys, jaxinfer.scheduler.page_allocator; assert 'jax' not in sys.modules, 'jax was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
