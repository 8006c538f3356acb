"""Which retention pins a request's KV gets (host side; `KVManager` applies them).

Pins (`RadixCache.pin`) make KV the last to be evicted while they last; they never block an
allocation. A request gets, at arrival on its cached prefix (so a long queue cannot let other
traffic evict it before admission) and at the end of its turn on its whole stored path:

  open session       the request names a session opened with /open_session: pinned under the
                     session's id until the session closes or its TTL runs out (renewed by each
                     of its requests; `sessions.py`).
  session hint       it names a session that is not open (`session_id`, `session_params.id`,
                     the routing header): a pin of `--session-retention-s`, owned by its
                     program (`hint_owner`) and released early when the program table finds
                     the program done (`release_hint`: silent for longer than twice the
                     longest tool pause it took; programs.py), so finished agents' KV does
                     not crowd out the agents still pausing on tools.
  retention_seconds  its own time-only pin, at most `--max-retention-s`.
  tool pause         (end of turn only) a turn that ends in tool calls: a time-only pin of
                     `--tool-pause-grace-s`, after which the KV is evicted the normal way
                     (demoted to the host tier when the tiers are on).

How a tool pause is known. The scheduler releases a request the moment it finishes, but tool
calls are parsed later, from the text, on the HTTP side (`server/openai_chat.py`), which has the
parser and the request's tools. So: a request that carries `tool_pause` (the client's explicit
hint: "this turn ends in a tool call") is pinned at its finish; a chat request offered tools
(`may_call_tools`) has its finished path's end node remembered here for a short while, keyed by
its rid, and when the HTTP side parses tool calls out of its answer it sends `ToolPauseReq`
naming the rid, which pins that node (`tool_pause`). The message follows the finish on the same
socket order, milliseconds later; in between the KV is in the tree, unpinned. Detecting tool
calls in the scheduler instead would need every parser's syntax there, for every token.
"""

from __future__ import annotations

from collections import OrderedDict

from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.mem_cache.tree_node import TreeNode
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.sessions import SessionTable

MAX_REMEMBERED_TURNS = 4096  # finished tool-capable turns awaiting a possible ToolPauseReq


def hint_owner(session_id: str) -> str:
    """The pin owner of a session hint's KV (an open session's pins are owned by its id)."""
    return f"hint\x00{session_id}"


class Retention:
    def __init__(self, tree: RadixCache, sessions: SessionTable | None, *,
                 session_retention_s: float, max_retention_s: float,
                 tool_pause_grace_s: float) -> None:
        self.tree = tree
        self.sessions = sessions
        self.session_retention_s = session_retention_s
        self.max_retention_s = max_retention_s
        self.tool_pause_grace_s = tool_pause_grace_s
        self._turn_ends: OrderedDict[str, TreeNode] = OrderedDict()
        self.num_tool_pauses = 0

    def wants_pins(self, req: Req) -> bool:
        """Whether `req` may get any pin (cheap: callers skip the tree walk otherwise)."""
        return not self.tree.disable and (
            req.session_id is not None or req.retention_seconds > 0 or req.tool_pause
            or req.may_call_tools)

    def on_arrival(self, req: Req, node: TreeNode) -> None:
        """`req` arrived; `node` ends its cached prefix."""
        self._pin(req, node, 0.0)

    def on_turn_end(self, req: Req, node: TreeNode) -> None:
        """`req` finished normally; `node` ends the path the tree keeps of it."""
        grace = self.tool_pause_grace_s if req.tool_pause else 0.0
        self._pin(req, node, grace)
        if req.may_call_tools and self.tool_pause_grace_s > 0 and not node.is_root:
            self._turn_ends[req.rid] = node
            self._turn_ends.move_to_end(req.rid)
            while len(self._turn_ends) > MAX_REMEMBERED_TURNS:
                self._turn_ends.popitem(last=False)

    def tool_pause(self, rid: str) -> bool:
        """The HTTP side parsed tool calls out of finished request `rid`: pin its KV for the
        grace period. False when the turn is unknown or its KV already left the tree."""
        node = self._turn_ends.pop(rid, None)
        if node is None or node.parent is None:
            return False
        self.tree.retain(node, self.tool_pause_grace_s)
        self.num_tool_pauses += 1
        return True

    def release_hint(self, session_id: str) -> None:
        """The program `session_id` names is done: its session-hint pins end now (its KV is
        evicted the normal way; other pins on the same nodes stay)."""
        self.tree.unpin(hint_owner(session_id))

    def _pin(self, req: Req, node: TreeNode, retain_s: float) -> None:
        if node.is_root:
            return
        deadline = None if self.sessions is None else self.sessions.renew(req.session_id)
        if deadline is not None:
            self.tree.pin(node, req.session_id, deadline)
        elif req.session_id is not None and self.session_retention_s > 0:
            self.tree.pin(node, hint_owner(req.session_id),
                          self.tree.clock() + self.session_retention_s)
        retain_s = max(retain_s, min(req.retention_seconds, self.max_retention_s))
        if retain_s > 0:
            self.tree.retain(node, retain_s)
