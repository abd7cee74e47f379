"""Session affinity: a conversation's next turn prefers the worker that served its last one.

An agent or chat client sends turn after turn whose prompt starts with the previous turn's
prompt and answer. The worker that streamed that answer (a decode or colocated worker) holds
those tokens' KV blocks in its prefix cache, so the next turn computes (or pulls) only the new
tail there. KV-aware routing finds that worker from the workers' KV events
(:mod:`pdserve.router.kv_index`) once they arrive; a session id names it before they do, and
where KV events are off. Design origin: Dynamo's and SGLang's session affinity (sticky routing
by a session header), kept *soft* here as in llm-d's prefix-aware scorer: the affinity enters the
same cost as every other choice.

How it routes (:meth:`SessionTable.cached`): the session's last worker is credited with the
smaller of the new prompt's length and the last turn's prompt + generated tokens as its cached
prefix (or what its KV index entry says, if more), and :func:`pdserve.router.policy.choose_route`
then picks by the KV-aware cost ``kv_overlap_weight * (uncached tokens) + load_weight * load``:
the session stays on its worker unless another is cheaper by more than the prefix it would
recompute (an overloaded worker loses the session). With ``kv_overlap_weight`` 0 (KV-aware
routing off) the cost ignores cached prefixes, and so sessions too.

When it ends: the entry is dropped when the worker leaves discovery or restarts (another
epoch: its cache is gone), ``ttl_s`` seconds after the session's last turn, or when the table
holds ``max_sessions`` sessions and this one is the least recently used. An estimate that
turned out high (the worker evicted the blocks, or the new prompt is not an extension of the
last one) costs one recompute there, never a wrong answer.

Where sessions live: in each router process (a replica that has not seen a session routes it
by the KV index alone, which every replica builds). Memory: one entry (~200 bytes) per session.
Not thread-safe; the router's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.protocol import WorkerRecord

MAX_SESSION_ID_CHARS = 256
"""Longest session id accepted (``x-session-id``, or ``user`` when it names the session)."""


SESSION_HEADER = "x-session-id"


def session_id_from(header: str | None, user: str | None, *, from_user: bool) -> str | None:
    """A request's session id: the ``x-session-id`` header, else (with ``from_user``,
    ``router.session_from_user``) its OpenAI ``user`` field; None when neither names one.
    Raises :class:`InvalidRequestError` (400) for one longer than
    :data:`MAX_SESSION_ID_CHARS` characters."""
    session = header if header else (user if from_user and user else None)
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        where = SESSION_HEADER if header else "user"
        raise InvalidRequestError(
            f"{where}: a session id has at most {MAX_SESSION_ID_CHARS} characters, "
            f"got {len(session)}"
        )
    return session


@dataclass(frozen=True)
class SessionEntry:
    """Where a session's last turn ran: the worker (id and epoch) that streamed it, and the
    tokens that turn left in its cache (prompt + generated)."""

    worker_id: str
    epoch: int
    tokens: int
    at: float  # monotonic seconds


class SessionTable:
    """Session id -> :class:`SessionEntry`, LRU-bounded (module docstring).

    ``ttl_s``: seconds after a session's last turn that its affinity lasts; ``max_sessions``:
    entries kept; ``clock``: monotonic seconds (replaceable in tests)."""

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, session_id: str, worker: WorkerRecord, tokens: int) -> None:
        """Record that ``worker`` served the session's latest turn, leaving ``tokens`` tokens
        of it in its cache."""
        self._entries[session_id] = SessionEntry(
            worker.worker_id, worker.epoch, tokens, self._clock()
        )
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def lookup(
        self, session_id: str, live: Callable[[str], WorkerRecord | None]
    ) -> SessionEntry | None:
        """The session's entry while its worker is the same live incarnation (``live(id)``:
        the worker's record in discovery now) and the session is younger than ``ttl_s``;
        otherwise the entry is dropped and None returned."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        record = live(entry.worker_id)
        if record is None or record.epoch != entry.epoch or self._clock() - entry.at > self.ttl_s:
            del self._entries[session_id]
            return None
        return entry

    def cached(
        self,
        session_id: str,
        prompt_tokens: int,
        live: Callable[[str], WorkerRecord | None],
        cached: dict[str, int],
    ) -> str | None:
        """Credit the session's worker in ``cached`` (worker id -> expected cached prompt
        tokens, updated in place) with ``min(prompt_tokens, entry.tokens)`` where that is more
        than it holds; return that worker's id, or None without a usable entry."""
        entry = self.lookup(session_id, live)
        if entry is None:
            return None
        credit = min(prompt_tokens, entry.tokens)
        cached[entry.worker_id] = max(cached.get(entry.worker_id, 0), credit)
        return entry.worker_id
