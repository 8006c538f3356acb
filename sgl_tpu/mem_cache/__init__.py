"""Host-side KV memory management: page allocator and radix prefix cache (no JAX)."""

from sgl_tpu.mem_cache.allocator import PageAllocator, pages_to_slots, slots_to_pages
from sgl_tpu.mem_cache.radix_cache import (
    MatchResult,
    PrefixPeek,
    RadixCache,
    TreeNode,
    check_page_accounting,
)

__all__ = [
    "MatchResult",
    "PageAllocator",
    "PrefixPeek",
    "RadixCache",
    "TreeNode",
    "check_page_accounting",
    "pages_to_slots",
    "slots_to_pages",
]
