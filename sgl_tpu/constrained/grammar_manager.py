"""Compiled-grammar cache with off-thread compilation, used by the scheduler loop.

Data flow for a request that carries a grammar (regex / json_schema / ebnf):

    scheduler thread                          grammar-compile worker thread(s)
    ----------------                          --------------------------------
    fut = manager.request(kind, text)  ---->  backend.compile(kind, text)   (ms .. seconds)
    park the request; each loop turn:
      fut.done()?  no  -> keep waiting
                   yes -> fut.exception()?    GrammarError -> finish the request with a 400
                          fut.result().new_matcher() -> req.grammar; schedule it

`request` never blocks: a cached (kind, text) returns its future at once, already completed
(or still pending when the same grammar is compiling for another request), so a slow compile
holds back only the requests that need it. Failed compiles stay cached, so a bad regex sent
again fails immediately. The cache is an LRU bounded by `max_cached` entries; evicting an entry
does not affect futures already handed out.

Exceptions other than GrammarError from a future are bugs in a backend; the scheduler should
still finish only that request (as a server error) and carry on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from sgl_tpu.constrained.base import CompiledGrammar, GrammarBackend


class GrammarManager:
    def __init__(
        self, backend: GrammarBackend, *, max_cached: int = 1024, num_workers: int = 2
    ) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.backend = backend
        self.max_cached = max_cached
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def request(self, kind: str, text: str) -> Future[CompiledGrammar]:
        """The compiled grammar for (kind, text), as a future; never blocks on compilation."""
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self.backend.compile, kind, text)
            self._cache[key] = future
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        """Stop the workers; compilations not yet started are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)
