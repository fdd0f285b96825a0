"""The engine-facing forms of a forward's rows that the recorder takes besides plain lists:
:class:`Segments` (the rows in column form) and :class:`SlabStage` (recording from inside a CUDA
graph: a device ring of staged slab rows, a slot per replay)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tracestore.errors import ConfigError, ShapeError

from ._cuda import DriverEvent

if TYPE_CHECKING:  # pragma: no cover
    from .recorder import RolloutRecorder


class Segments:
    """A forward's rows in column form, the cheap way to hand them to :meth:`RolloutRecorder.record_slab`
    every decode step: ``trajectories`` (a tuple: keep the same object while the batch is unchanged
    and its ids are checked once, not every step), ``starts`` and ``ends`` (integer arrays, token
    ``[start, end)`` per trajectory, in the slab's row order). The list form
    ``[(trajectory, start, end), ...]`` costs a Python pass over every segment on the engine
    thread (measured in bench/bench_production.py); this one costs a few numpy reductions.

    ``Segments.decode(trajectories, positions)``: one token per trajectory, ``[p, p + 1)``.
    Iterating yields the ``(trajectory, start, end)`` tuples (the sender thread does that)."""

    __slots__ = ("ends", "starts", "trajectories")

    def __init__(self, trajectories: Sequence[str], starts: Any, ends: Any) -> None:
        self.trajectories = trajectories if isinstance(trajectories, tuple) else tuple(trajectories)
        self.starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        self.ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        n = len(self.trajectories)
        if self.starts.shape[0] != n or self.ends.shape[0] != n:
            raise ShapeError(
                f"Segments: {n} trajectories, {self.starts.shape[0]} starts and {self.ends.shape[0]} ends; expected "
                "one start and one end per trajectory"
            )

    @classmethod
    def decode(cls, trajectories: Sequence[str], positions: Any) -> Segments:
        """One decode step: trajectory ``i`` records its token at ``positions[i]``."""
        starts = np.asarray(positions, dtype=np.int64).reshape(-1)
        return cls(trajectories, starts, starts + 1)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        return zip(self.trajectories, self.starts.tolist(), self.ends.tolist(), strict=True)

    def __contains__(self, segment: object) -> bool:
        return any(segment == s for s in self)

    def __repr__(self) -> str:
        return f"Segments({len(self)} trajectories, {int((self.ends - self.starts).sum())} tokens)"


class SlabStage:
    """Recording from inside a CUDA graph (``RolloutRecorder.slab_stage``).

    ``capture()`` belongs inside the engine's captured region, after the forward's last record
    kernel: one kernel per slab copies the slab's ``rows`` into a device ring slot chosen on the
    device (``tracestore.kernels.stage_rows``). ``commit(segments)``, once after each replay on the
    engine thread, is the bookkeeping outside the graph: it queues a non-blocking copy of that slot
    into pinned staging on the recorder's side stream, selects the next slot for the next replay
    (a one-element fill on the current stream) and orders that replay after the staging copy that
    last read the slot (a device-side wait, normally long satisfied). The engine's stream never
    waits for the step's own copy. A replay without a commit is simply not recorded (the next
    replay writes the same slot). On the CPU the same calls copy at once.

    Example::

        stage = rec.slab_stage(slab)                 # before capture
        with torch.cuda.graph(g):
            logits = decode_step(static_inputs)      # record_* kernels write slab[site]
            stage.capture()
        for step in ...:
            g.replay()
            stage.commit([(t, pos, pos + 1) for t in batch])
    """

    def __init__(self, recorder: RolloutRecorder, slab: Any, rows: int | Sequence[int] | None = None, slots: int = 2):
        import torch
        from tracestore.kernels import stage_rows

        self.recorder = recorder
        self.slabs = tuple(slab) if isinstance(slab, (list, tuple)) else (slab,)
        want = [rows] * len(self.slabs) if rows is None or isinstance(rows, int) else list(rows)
        if slots < 2 or len(want) != len(self.slabs):
            raise ConfigError(f"need slots >= 2 and one row count per slab, got {slots} and {want}")
        plans = [recorder._slab_plan(s) for s in self.slabs]  # checks the sites now, not at the first commit
        self.rows = [s.capacity if r is None else int(r) for s, r in zip(self.slabs, want, strict=True)]
        for s, r in zip(self.slabs, self.rows, strict=True):
            if not 0 < r <= s.capacity:
                raise ShapeError(f"rows must be in [1, {s.capacity}] for {s!r}, got {r}")
        dev = self.slabs[0].device
        self.rings = [
            torch.zeros(slots, -(-r * p.row_bytes // 16) * 16, dtype=torch.uint8, device=dev)
            for r, p in zip(self.rows, plans, strict=True)
        ]
        self.slot = torch.zeros(1, dtype=torch.int32, device=dev)
        self.slots = slots
        self.k = 0  # the slot the next replay writes
        self._views = [[ring[k] for ring in self.rings] for k in range(slots)]
        self._events: list[Any] = [None] * slots
        self._stage = stage_rows
        self._slot_events: list[Any] | None = None  # per-slot driver events (the driver path)

    def capture(self) -> None:
        """Stage the slabs' rows into the selected ring slot (inside the captured region)."""
        for slab, rows, ring in zip(self.slabs, self.rows, self.rings, strict=True):
            self._stage(slab, rows, ring, self.slot)

    def commit(self, segments: Sequence[tuple[str, int, int]] | Segments, policy_version: int | None = None) -> bool:
        """Queue the last replay's rows for ``segments`` (as :meth:`RolloutRecorder.record_slab`)."""
        k = self.k
        ok, ev = self.recorder._queue_slabs(segments, self.slabs, None, policy_version, self._views[k], False)
        self._events[k] = self._slot_event(ev, k)
        self.k = k = (k + 1) % self.slots
        self.recorder._copier.advance(self.slot, k, self._events[k])
        return ok

    def _slot_event(self, ev: Any, k: int) -> Any:
        """What the next replay writing slot ``k`` waits for: the copy's event, or for a driver
        event (the sender's, returned to the driver's pool once the copy landed) this stage's own
        event for the slot, recorded on the side stream after the copy."""
        if not isinstance(ev, DriverEvent):
            return ev
        if self._slot_events is None:
            self._slot_events = [ev.driver.event() for _ in range(self.slots)]  # kept, never pooled
        ev.driver.record(self._slot_events[k], self.recorder._copier.side_handle)
        return self._slot_events[k]
