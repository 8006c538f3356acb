"""Orders of the waiting queue (`--schedule-policy`), as a registry of small functions.

* `fcfs`        arrival order.
* `lpm`         longest cached prefix first, so requests that reuse the tree run while their
                prefix is still there (falls back to fcfs for long queues, as SGLang does).
                Prefix lengths come from `RadixCache.peek_prefix` (read-only: ordering does not
                refresh LRU times or split nodes) and are kept on each request between steps:
                a step re-walks the tree only for requests whose key changed, and only from
                where their last match ended, after the tree's content changed.
* `dfs-weight`  depth-first over the radix tree, heavier subtrees (more waiting requests) first,
                so requests sharing a prefix run back to back.
* `program`     by program (scheduler/programs.py `program_ranks`): each program's first
                request in the server before any program's second one (one key's parallel
                requests get one program's share; aged), then the program that arrived first,
                so started agents finish while their KV is resident instead of new agents'
                first turns pushing it out; a request of no program ranks as a program that
                arrived with it; a held program released by the hold bound goes first. Within
                one program, the longest cached prefix first (lpm). With it, admission control
                holds new programs while the admitted ones' working sets fill the pool and host
                tier, for a bounded time (programs.py).
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.mem_cache.tree_node import TreeNode
from sgl_tpu.scheduler.programs import program_ranks
from sgl_tpu.scheduler.req import Req

PolicyFn = Callable[[list[Req], RadixCache], list[Req]]
POLICIES: dict[str, PolicyFn] = {}
LPM_MAX_QUEUE = 128  # beyond this, matching every waiting request each step costs too much


def register(name: str) -> Callable[[PolicyFn], PolicyFn]:
    def deco(fn: PolicyFn) -> PolicyFn:
        POLICIES[name] = fn
        return fn

    return deco


@register("fcfs")
def fcfs(waiting: list[Req], tree: RadixCache) -> list[Req]:
    return sorted(waiting, key=lambda r: r.arrival)


@register("lpm")
def lpm(waiting: list[Req], tree: RadixCache) -> list[Req]:
    if tree.disable or len(waiting) > LPM_MAX_QUEUE:
        return fcfs(waiting, tree)
    prefix = {id(r): cached_prefix_len(r, tree) for r in waiting}
    return sorted(waiting, key=lambda r: (-prefix[id(r)], r.arrival))


@register("program")
def program(waiting: list[Req], tree: RadixCache) -> list[Req]:
    rank = program_ranks(waiting)
    programs = [id(r.program) for r in waiting if r.program is not None]
    if tree.disable or len(waiting) > LPM_MAX_QUEUE or len(set(programs)) == len(programs):
        return sorted(waiting, key=lambda r: (rank[id(r)], r.arrival))
    prefix = {id(r): cached_prefix_len(r, tree) for r in waiting}
    return sorted(waiting, key=lambda r: (rank[id(r)], -prefix[id(r)], r.arrival))


def cached_prefix_len(req: Req, tree: RadixCache) -> int:
    """`tree.match_prefix(req.fill_ids[:req.max_prefix_len]).prefix_len`, without changing the
    tree, and from `req.prefix_peek` when it still holds. While a request waits its key only
    changes through a retraction (which counts) or its log-prob window (its length)."""
    limit = req.max_prefix_len
    hint = None
    if req.prefix_peek is not None and req.prefix_peek[:2] == (req.num_retractions, limit):
        hint = req.prefix_peek[2]
    peek = tree.peek_prefix(lambda: req.fill_ids[:limit], hint, req.cache_namespace)
    req.prefix_peek = (req.num_retractions, limit, peek)
    return peek.prefix_len


@register("dfs-weight")
def dfs_weight(waiting: list[Req], tree: RadixCache) -> list[Req]:
    if tree.disable:
        return fcfs(waiting, tree)
    at_node: dict[TreeNode, list[Req]] = {}
    for r in sorted(waiting, key=lambda r: r.arrival):
        node = tree.match_prefix(r.fill_ids[: r.max_prefix_len], r.cache_namespace).last_node
        at_node.setdefault(node, []).append(r)
    weight: dict[TreeNode, int] = {}
    for node, reqs in at_node.items():
        while node is not None:
            weight[node] = weight.get(node, 0) + len(reqs)
            node = node.parent
    out: list[Req] = []
    stack = [tree.root, *tree.roots.values()]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(node, ()))
        children = [c for c in node.children.values() if c in weight]
        # Push lighter first so the heaviest subtree is visited next.
        stack.extend(sorted(children, key=lambda c: (weight[c], -c.id)))
    return out


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache) -> list[Req]:
    """`waiting` in `policy`'s order (a name from POLICIES, checked at start-up)."""
    return POLICIES[policy](waiting, tree)


# ---- in-batch prefix sharing ----------------------------------------------------------------
# A waiting request that shares at least this many uncached tokens with a request already in
# the EXTEND batch waits one step, then reuses that request's KV from the tree.
IN_BATCH_SHARED_TOKENS = 32


class InBatchPrefixes:
    """The page-aligned prefixes of the requests admitted to one EXTEND batch, as chained
    hashes (hash k covers tokens [0, (k+1) * page_size) of a request's fill tokens)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.keys: set[int] = set()

    def _page_hashes(self, req: Req) -> list[int]:
        fill, out, h = req.fill_ids, [], hash(req.cache_namespace)  # no sharing across adapters
        for i in range(0, len(fill) - self.page_size + 1, self.page_size):
            h = hash((h, tuple(fill[i : i + self.page_size])))
            out.append(h)
        return out

    def add(self, req: Req) -> None:
        self.keys.update(self._page_hashes(req))

    def shares_uncached(self, req: Req) -> bool:
        """Whether `req` would recompute IN_BATCH_SHARED_TOKENS+ tokens the batch computes."""
        if not self.keys:
            return False
        shared = 0
        for h in self._page_hashes(req):
            if h not in self.keys:
                break
            shared += self.page_size
        return shared - req.kv_len >= IN_BATCH_SHARED_TOKENS
