"""Count limits taken without waiting: the concurrent Read/Seal calls (:class:`CallSlots`) and the
open Write streams (:class:`StreamSlots`: in all, and per identity with authentication on). The
service (``service.py``) takes one as a call starts and gives it back as the call ends; a call that
finds none is refused at once (``RESOURCE_EXHAUSTED``)."""

from __future__ import annotations

import threading
import time

# After a Write stream was refused for want of a slot (--max-streams), idle streams are ended for
# this long (once idle READ_TURN_IDLE_S, like when others wait for a turn): the refused caller
# retries after RETRY_AFTER_LIMIT_MS and finds room instead of idle streams holding every slot.
SLOT_WANTED_S = 5.0


class CallSlots:
    """A count limit taken without waiting: ``take()`` is False when all ``limit`` are in use."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.limit:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1


class StreamSlots(CallSlots):
    """The Write streams' slots: ``limit`` in all and, where ``share`` is set (authentication on),
    at most ``share`` held by one identity, so that one caller's streams cannot keep every other
    caller out. ``wanted()``: a stream was refused for want of a slot (not of its own share) within
    :data:`SLOT_WANTED_S`, so idle streams should make room (``write_stream.py``)."""

    def __init__(self, limit: int, share: int | None) -> None:
        super().__init__(limit)
        self.share = share
        self.held: dict[str, int] = {}
        self.refused_at = -SLOT_WANTED_S  # (monotonic) the last refusal at the limit

    def take_for(self, identity: str | None) -> str | None:
        """Take a slot for ``identity`` (None: counted in no share); None if taken, else the name of
        the setting that refuses it. The share is checked first: a caller over its own share is
        told so, and its refusal asks no other stream to make room."""
        with self._lock:
            held = self.held.get(identity, 0) if identity is not None else 0
            if identity is not None and self.share is not None and held >= self.share:
                return "max_streams_per_identity"
            if self.used >= self.limit:
                self.refused_at = time.monotonic()
                return "max_streams"
            self.used += 1
            if identity is not None:
                self.held[identity] = held + 1
            return None

    def give_for(self, identity: str | None) -> None:
        with self._lock:
            self.used -= 1
            if identity is not None:
                left = self.held[identity] - 1
                if left:
                    self.held[identity] = left
                else:
                    del self.held[identity]  # (an entry per identity with streams open, no more)

    def wanted(self) -> bool:
        return time.monotonic() - self.refused_at < SLOT_WANTED_S
