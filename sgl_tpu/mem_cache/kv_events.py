"""KV events: what the radix tree holds, told to a cache-aware router in SGLang's event format.

`KVEventRecorder` is a `TreeListener`: it turns every page the tree stores or drops into an
event and keeps them until the scheduler loop takes them, once per turn, as one
`KVEventBatch` (`server/kv_events.py` publishes it over ZeroMQ). Pure host code: no sockets.

Events, one per page as SGLang emits them (P = page_size tokens)::

    tree:   root --[a b|c d]--> n1 --[e f]--> n2          page_size = 2
    hashes:        h0   h1             h2                  h_i = block_hash(chain hash of page i)

    stored(n1):  BlockStored([h0], parent=None, [a b], 2)  BlockStored([h1], parent=h0, [c d], 2)
    stored(n2):  BlockStored([h2], parent=h1, [e f], 2)
    removing(n2): BlockRemoved([h2])
    clearing(..): AllBlocksCleared()

A page's hash names it and every token before it (`page_hash.py`), so a split, which moves no
page, emits nothing, and a router can rebuild each replica's tree from the events alone.

Wire format (SGLang's `KVEventBatch`, msgpack): structs encoded as arrays, events tagged by
their class name, e.g. ``[ts, [["BlockStored", [h0], None, [a, b], 2, None, "GPU"]], 0]``.
"""

from __future__ import annotations

import msgspec
import numpy as np

from sgl_tpu.mem_cache.page_hash import block_hash
from sgl_tpu.mem_cache.tree_node import TreeListener, TreeNode

# SGLang's name (StorageMedium.GPU) for the tier of the device's own KV pool; routers compare
# it as a string, so a TPU's or a CPU's pool goes by it too.
MEDIUM_DEVICE = "GPU"


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # seconds since the epoch, when the batch was taken
    events: list
    attn_dp_rank: int | None = None  # the replica (--dp-size) whose tree this is


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """One change of the tree; encoded with its class name as the first array element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # signed int64 each (page_hash.block_hash)
    parent_block_hash: int | None  # the page before the first one; None at the root
    token_ids: list[int]  # the pages' tokens, block_size per hash
    block_size: int  # tokens per page
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def page_block_hashes(hashes: np.ndarray) -> list[int]:
    """The `block_hash` of each row of uint8 [num_pages, 16] chain hashes."""
    # [num_pages, 8] -> [num_pages] little-endian int64: block_hash, all rows at once
    return np.ascontiguousarray(hashes[:, :8]).view("<i8").ravel().tolist()


class KVEventRecorder(TreeListener):
    """Collects the tree's changes as events until `take` (the tree must track hashes: any
    listener makes it)."""

    def __init__(self, medium: str = MEDIUM_DEVICE) -> None:
        self.medium = medium
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, node: TreeNode) -> None:
        hashes = page_block_hashes(node.hashes)
        page_size = len(node.key) // len(hashes)
        pages = node.key.reshape(len(hashes), page_size).tolist()  # [num_pages, page_size]
        # a namespace root's hash is a seed, not a stored block: first blocks have no parent
        parent_hash = None if node.parent.is_root else node.parent.last_hash()
        parent = None if parent_hash is None else block_hash(parent_hash)
        for h, tokens in zip(hashes, pages, strict=True):
            self._events.append(BlockStored(block_hashes=[h], parent_block_hash=parent,
                                            token_ids=tokens, block_size=page_size,
                                            lora_id=None, medium=self.medium))
            parent = h

    def removing(self, node: TreeNode) -> None:
        self._events.extend(BlockRemoved(block_hashes=[h], medium=self.medium)
                            for h in page_block_hashes(node.hashes))

    def clearing(self, nodes: list[TreeNode]) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
