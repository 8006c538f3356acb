"""Open sessions (SGLang's `/open_session`, `/close_session`): an agent's KV pinned by name.

A session is opened with a TTL (`timeout`, else `--session-ttl-s`, at most
`--max-retention-s`). Every request that names it (`session_params.id`, `session_id` or the
routing header) renews it: the session's deadline becomes now + TTL, and the radix tree moves
every pin the session holds to that deadline (`RadixCache.repin`). The request's cached prefix
is pinned at arrival, its whole path when it finishes (`KVManager`), under the session's id as
owner. Pinned KV is evicted only after every unpinned leaf (`mem_cache/eviction.py`), so an
agent's trajectory survives other traffic while the session is open. `close` drops the pins
(`RadixCache.unpin`): the KV is plain evictable KV again at once. A session whose deadline has
passed is unpinned and forgotten the next time the table is swept (its pins had already
stopped counting when the deadline passed: the tree compares deadlines with the clock).

Owned by the scheduler (one table per replica: behind a router, a session lives on the replica
its requests are routed to). The clock is the tree's. `/server_info` lists sessions by public
id (a keyed hash, the program table's: programs.py), never by the id, which is a capability:
whoever knows it can renew, use or close the session.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.scheduler.programs import PublicIds
from sgl_tpu.validation import check_session_id

SWEEP_INTERVAL_S = 1.0  # expired sessions are forgotten at most this long after expiry
_MAX_LISTED = 100  # sessions listed in /server_info (all are counted)


class SessionError(ValueError):
    """A session call that cannot be honoured; `status_code` is the HTTP status to answer."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class Session:
    session_id: str
    ttl_s: float
    expires_at: float  # on the tree's clock


class SessionTable:
    def __init__(self, tree: RadixCache, *, default_ttl_s: float, max_ttl_s: float) -> None:
        self.tree = tree
        self.clock = tree.clock
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self._sessions: dict[str, Session] = {}
        self._next_sweep = 0.0
        self.public_id = PublicIds()  # the scheduler shares its program table's

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str | None, ttl_s: float | None) -> str:
        """Open a session (a fresh id when None); returns its id."""
        self.sweep(force=True)
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif (error := check_session_id(session_id)) is not None:
            raise SessionError(error)
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} is already open", 409)
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        if (isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float)
                or not 0 < ttl_s <= self.max_ttl_s or math.isnan(ttl_s)):
            raise SessionError(f"timeout must be a number of seconds in (0, {self.max_ttl_s}] "
                               f"(--max-retention-s), got {ttl_s!r}")
        self._sessions[session_id] = Session(session_id, float(ttl_s), self.clock() + ttl_s)
        return session_id

    def close(self, session_id: str) -> None:
        """Close an open session: its pins are dropped, its KV is evictable as any other."""
        self.sweep(force=True)
        if self._sessions.pop(session_id, None) is None:
            raise SessionError(f"session {session_id!r} is not open", 404)
        self.tree.unpin(session_id)

    def renew(self, session_id: str | None) -> float | None:
        """A request of `session_id` arrived or finished: if that session is open, renew its
        TTL and move its pins there; returns the new deadline (None: not an open session)."""
        self.sweep()
        session = None if session_id is None else self._sessions.get(session_id)
        if session is None:
            return None
        session.expires_at = self.clock() + session.ttl_s
        self.tree.repin(session_id, session.expires_at)
        return session.expires_at

    def sweep(self, force: bool = False) -> None:
        """Forget the sessions whose deadline has passed (at most once a second unless
        forced)."""
        now = self.clock()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        for session in [s for s in self._sessions.values() if s.expires_at <= now]:
            del self._sessions[session.session_id]
            self.tree.unpin(session.session_id)

    def info(self) -> dict[str, Any]:
        """`/server_info`'s "sessions": how many are open and the first ones' state."""
        self.sweep(force=True)
        now = self.clock()
        listed = list(self._sessions.values())[:_MAX_LISTED]
        return {"num_open": len(self._sessions),
                "default_ttl_s": self.default_ttl_s, "max_ttl_s": self.max_ttl_s,
                "open": [{"id": self.public_id(s.session_id), "ttl_s": s.ttl_s,
                          "expires_in_s": round(s.expires_at - now, 3),
                          "pinned_tokens": self.tree.pinned_size(s.session_id)}
                         for s in listed]}
