"""The engine-facing forms of a forward's rows that the recorder takes besides plain lists:
:class:`Segments` (the rows in column form) and :class:`SlabStage` (recording from inside a CUDA
graph: a device ring of staged slab rows, a slot per replay)."""

from __future__ import annotations

import logging
import operator
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.identity import as_token_ids
from tracestore.records import validate_id, validate_version

from ._cuda import DriverEvent

if TYPE_CHECKING:  # pragma: no cover
    from .copier import StagingCopier
    from .items import SlabPlan

log = logging.getLogger("tracestore.client")


class Segments:
    """A forward's rows in column form, the cheap way to hand them to
    :meth:`RolloutRecorder.record_slab` every decode step: ``trajectories`` (a tuple: keep the same
    object while the batch is unchanged and its ids are checked once, not every step), ``starts``
    and ``ends`` (integer arrays, token ``[start, end)`` per trajectory, in the slab's row order).
    The list form ``[(trajectory, start, end), ...]`` costs a Python pass over every segment on the
    engine thread; this one costs a few numpy reductions.

    ``Segments.decode(trajectories, positions)``: one token per trajectory, ``[p, p + 1)``. It
    takes a snapshot of ``positions`` (an engine may advance that array in place at once) and
    makes the columns when they are first read: on a GPU, by :class:`SlabStage`'s stager thread,
    not the engine thread.
    Iterating yields the ``(trajectory, start, end)`` tuples (the sender thread does that)."""

    __slots__ = ("_ends", "_positions", "_starts", "trajectories")

    def __init__(self, trajectories: Sequence[str], starts: Any, ends: Any) -> None:
        self.trajectories = trajectories if isinstance(trajectories, tuple) else tuple(trajectories)
        self._positions: Any = None
        self._starts: np.ndarray | None = np.asarray(starts, dtype=np.int64).reshape(-1)
        self._ends: np.ndarray | None = np.asarray(ends, dtype=np.int64).reshape(-1)
        self._check_lengths("starts", "ends")

    @classmethod
    def decode(cls, trajectories: Sequence[str], positions: Any) -> Segments:
        """One decode step: trajectory ``i`` records its token at ``positions[i]`` (a numpy
        integer array, or a sequence of ints)."""
        seg = cls.__new__(cls)
        seg.trajectories = trajectories if isinstance(trajectories, tuple) else tuple(trajectories)
        # A numpy array is kept as its bytes (one C call, no numpy dispatch on the engine thread)
        seg._positions = (
            (positions.tobytes(), positions.dtype)
            if type(positions) is np.ndarray
            else (np.array(positions, dtype=np.int64).tobytes(), np.dtype(np.int64))
        )
        seg._starts = seg._ends = None
        return seg

    @property
    def starts(self) -> np.ndarray:
        if self._starts is None:
            self._columns()
        return self._starts  # type: ignore[return-value]

    @property
    def ends(self) -> np.ndarray:
        if self._ends is None:
            self._columns()
        return self._ends  # type: ignore[return-value]

    def _columns(self) -> None:
        raw, dtype = self._positions
        if dtype.kind not in "iu":
            raise ShapeError(f"Segments.decode: positions must be integers, got dtype {dtype}")
        starts = np.frombuffer(raw, dtype=dtype).astype(np.int64)
        self._starts, self._ends = starts, starts + 1
        self._check_lengths("positions", None)

    def _check_lengths(self, a: str, b: str | None) -> None:
        n, ns, ne = len(self.trajectories), self._starts.shape[0], self._ends.shape[0]  # type: ignore[union-attr]
        if ns != n or ne != n:
            got = f"{ns} {a} and {ne} {b}" if b else f"{ns} {a}"
            want = f"one {a[:-1]} and one {b[:-1]}" if b else f"one {a[:-1]}"
            raise ShapeError(f"Segments: {n} trajectories, {got}; expected {want} per trajectory")

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        return zip(self.trajectories, self.starts.tolist(), self.ends.tolist(), strict=True)

    def __contains__(self, segment: object) -> bool:
        return any(segment == s for s in self)

    def __repr__(self) -> str:
        return f"Segments({len(self)} trajectories, {int((self.ends - self.starts).sum())} tokens)"


class SegmentCheck:
    """Checks a forward's segments (a list of ``(trajectory, token_start, token_end)`` tuples or
    :class:`Segments`) and remembers the trajectory ids it validated, so that a decode step over the
    same trajectories costs no per-segment Python loop. Calling it returns (trajectories, token
    count); a malformed segment raises ValidationError."""

    def __init__(self) -> None:
        self._valid_ids: set[str] = set()
        self._checked_trajs: tuple[str, ...] | None = None  # the Segments.trajectories checked last

    def __call__(self, segs: Any) -> tuple[tuple[str, ...], int]:
        if isinstance(segs, Segments):
            trajs = segs.trajectories
            if trajs is not self._checked_trajs:
                self._check_ids(trajs)
                self._checked_trajs = trajs
            starts, ends = segs.starts, segs.ends
            if not len(trajs):
                return (), 0
            if starts.min() < 0 or (ends <= starts).any():
                i = int(np.flatnonzero((starts < 0) | (ends <= starts))[0])
                raise ValidationError(
                    f"segment of {trajs[i]}: expected 0 <= token_start < token_end, got [{starts[i]}, {ends[i]})"
                )
            return trajs, int(ends.sum() - starts.sum())
        if not segs:
            return (), 0
        try:
            ids, first, last = zip(*segs, strict=True)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"segments must be (trajectory, token_start, token_end) tuples: {exc}") from exc
        self._check_ids(ids)
        if min(first) < 0 or min(map(operator.sub, last, first)) <= 0:
            t, a, b = next(x for x in segs if x[1] < 0 or x[2] <= x[1])
            raise ValidationError(f"segment of {t}: expected 0 <= token_start < token_end, got [{a}, {b})")
        return ids, sum(last) - sum(first)

    def _check_ids(self, trajs: tuple[str, ...]) -> None:
        known = self._valid_ids
        if not known.issuperset(trajs):
            for t in trajs:
                if t not in known:
                    validate_id("trajectory", t)
                    if len(known) > 1 << 20:
                        known.clear()
                    known.add(t)


class StageHost(Protocol):
    """What a :class:`SlabStage` needs of the recorder that made it
    (``RolloutRecorder.slab_stage`` hands one over)."""

    @property
    def writer(self) -> str: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def stats(self) -> Any:
        """The recorder's counters (``stager_behind`` is counted here)."""

    @property
    def copier(self) -> StagingCopier:
        """The recorder's staging copier (its side stream and ring-slot selection)."""

    @property
    def issue_lock(self) -> threading.Lock:
        """Held while one of the recorder's stages queues its deferred copies."""

    def slab_plan(self, slab: Any) -> SlabPlan:
        """``slab`` checked against the run's sites."""

    def queue_slabs(
        self,
        segments: Any,
        slabs: tuple[Any, ...],
        policy_version: int | None,
        views: list[Any],
        after: Any = None,
        ids: Any = None,
    ) -> tuple[bool, Any]:
        """Stage one forward's rows from the ring slot ``views`` (as ``record_slab``), the copies
        after the event ``after`` if given; (queued, the event the copies complete on)."""

    def unguide(self, trajectories: list[str], reason: str) -> None:
        """Mark ``trajectories`` unguided for ``reason``."""


class SlabStage:
    """Recording from inside a CUDA graph (``RolloutRecorder.slab_stage``).

    ``capture()`` belongs inside the engine's captured region, after the forward's last record
    kernel: one kernel per slab copies the slab's ``rows`` into a device ring slot chosen on the
    device (``tracestore.kernels.stage_rows``). ``commit(segments)``, once after each replay on the
    engine thread, is the bookkeeping outside the graph. A replay without a commit is simply not
    recorded (the next replay writes the same slot). On the CPU the same calls copy at once.

    On a GPU (with the CUDA driver binding, ``client/record/_cuda.py``) ``commit`` does only what
    must happen before the next replay is queued: it records an event on the engine's current stream
    (the step's rows are in slot k once it fires), selects the next slot (a one-element fill on that
    stream) and orders the next replay after the staging copy that last read that slot (a
    device-side wait, normally long satisfied). Everything else — checking the segments, reserving
    pinned staging, queueing the copy of slot k on the recorder's side stream after the commit's
    event, handing the forward to the sender — runs on the stage's stager thread, woken by the
    commit. Should the stager fall ``slots - 1`` commits behind (its thread starved of the GIL), the
    commit issues the pending copies itself before reusing a slot, so a slot is never rewritten
    before its copy was queued and ordered. ``commit`` then returns True once the step is accepted:
    a step refused later for lack of staging marks its trajectories unguided (as ``record_slab``'s
    refusal does), and malformed segments are raised by the next ``commit``, ``finish`` or ``flush``
    (the error met, its message naming the step). Without the driver binding (torch's copies) or
    with ``deferred=False``, ``commit`` does all of it itself and returns whether the step was
    queued.

    Example::

        stage = rec.slab_stage(slab)                 # before capture
        with torch.cuda.graph(g):
            logits = decode_step(static_inputs)      # record_* kernels write slab[site]
            stage.capture()
        for step in ...:
            g.replay()
            stage.commit(Segments.decode(batch_ids, positions))
    """

    def __init__(
        self,
        host: StageHost,
        slab: Any,
        rows: int | Sequence[int] | None = None,
        slots: int = 2,
        deferred: bool = True,
    ):
        import torch

        from tracestore.kernels import stage_rows

        self.host = host
        self.slabs = tuple(slab) if isinstance(slab, (list, tuple)) else (slab,)
        want = [rows] * len(self.slabs) if rows is None or isinstance(rows, int) else list(rows)
        if slots < 2 or len(want) != len(self.slabs):
            raise ConfigError(f"need slots >= 2 and one row count per slab, got {slots} and {want}")
        plans = [host.slab_plan(s) for s in self.slabs]  # checks the sites now, not at the first commit
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
        # the deferred path (decided at the first commit): committed steps whose copy is not queued
        # yet, oldest first: (slot, segments, policy version, the commit's event); an entry leaves
        # only once its copy and the slot's event are issued (the commit reads len() without a lock)
        self._deferred: bool | None = None if deferred and getattr(self.slot, "is_cuda", False) else False
        self._todo: deque[tuple[int, Any, int, DriverEvent, Any]] = deque()
        self._issue = host.issue_lock  # one per recorder: its stages' copies are queued one at a time
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self._steps = 0  # commits so far (named in a deferred error)

    def capture(self) -> None:
        """Stage the slabs' rows into the selected ring slot (inside the captured region)."""
        for slab, rows, ring in zip(self.slabs, self.rows, self.rings, strict=True):
            self._stage(slab, rows, ring, self.slot)

    def commit(
        self,
        segments: Sequence[tuple[str, int, int]] | Segments,
        policy_version: int | None = None,
        token_ids: Any = None,
    ) -> bool:
        """Queue the last replay's rows for ``segments`` (as :meth:`RolloutRecorder.record_slab`,
        ``token_ids`` too: host integers, one per token)."""
        ids = None if token_ids is None else as_token_ids(token_ids)
        if self._deferred:
            return self._commit_deferred(segments, policy_version, ids)
        if self._deferred is None and self._start_deferred():
            return self._commit_deferred(segments, policy_version, ids)
        k = self.k
        ok, ev = self.host.queue_slabs(segments, self.slabs, policy_version, self._views[k], ids=ids)
        self._events[k] = self._slot_event(ev, k)
        self.k = k = (k + 1) % self.slots
        self.host.copier.advance(self.slot, k, self._events[k])
        return ok

    def _commit_deferred(self, segments: Any, policy_version: int | None, ids: Any = None) -> bool:
        self.raise_error()
        drv, cur = self._drv, self._raw_stream(self._dev)
        ready = drv.event()
        drv.record(ready, cur)
        k = self.k
        v = self.host.policy_version if policy_version is None else validate_version(policy_version)
        self._steps += 1
        self._todo.append((k, segments, v, ready, ids))
        self._wake.put(True)
        self.k = k = k + 1 if k + 1 < self.slots else 0
        if len(self._todo) >= self.slots:  # the copy that last read slot k is not queued yet: queue it here
            self.host.stats["stager_behind"] += 1
            self.stage_pending()
        self.host.copier.advance(self.slot, k, self._events[k], cur)
        return True

    def _start_deferred(self) -> bool:
        """Whether commits defer their copies (the CUDA driver binding is usable for this stage's
        device); starts the stager thread if so."""
        import torch

        copier = self.host.copier
        drv = copier.cuda_driver()
        dev = self.slot.device.index
        self._deferred = bool(drv is not None and (copier.one_gpu or dev == torch.cuda.current_device()))
        if self._deferred:
            self._drv, self._raw_stream, self._dev = drv, copier.raw_stream, dev
            self._thread = threading.Thread(
                target=_stager, args=(self, dev), daemon=True, name=f"tracestore-stager-{self.host.writer}"
            )
            self._thread.start()
        return self._deferred

    def stage_pending(self) -> None:
        """Queue the copies of every committed step not yet queued, oldest first (the stager
        thread's work; the engine thread's when it must not wait, and before a seal or flush)."""
        with self._issue:
            todo = self._todo
            while todo:
                k, segments, version, ready, ids = todo[0]
                try:
                    views = self._views[k]
                    _, ev = self.host.queue_slabs(segments, self.slabs, version, views, ready, ids)
                    if ev is not None:
                        self._events[k] = self._slot_event(ev, k)
                except Exception as exc:  # noqa: BLE001 - e.g. the caller's segments: raised at its next call
                    self._error = _named(exc, f"slab stage commit {self._steps - len(todo) + 1}")
                    log.warning("recorder %s: %s", self.host.writer, self._error)
                    self._unguide(segments)
                finally:
                    todo.popleft()
                    ready.driver.give_back(ready)

    def _unguide(self, segments: Any) -> None:
        """A refused step's trajectories are unguided (their records have a gap), where it names any."""
        try:
            trajs = list(getattr(segments, "trajectories", None) or (s[0] for s in segments))
            self.host.unguide([t for t in trajs if isinstance(t, str)], "malformed_commit")
        except Exception:  # noqa: BLE001 - segments too malformed to name a trajectory
            pass

    def drain(self) -> None:
        """Queue the copies deferred so far and raise an error one of them met (the recorder's
        call before what must follow them in order: a seal, a link, another forward, a flush)."""
        if self._todo:
            self.stage_pending()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise (once) the error a deferred commit met, if any."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Queue what is pending and stop the stager thread."""
        if self._thread is not None:
            self._wake.put(False)
            self._thread.join(timeout=10)
            self._thread = None
        self.stage_pending()

    def _slot_event(self, ev: Any, k: int) -> Any:
        """What the next replay writing slot ``k`` waits for: the copy's event, or for a driver
        event (the sender's, returned to the driver's pool once the copy landed) this stage's own
        event for the slot, recorded on the side stream after the copy."""
        if not isinstance(ev, DriverEvent):
            return ev
        if self._slot_events is None:
            self._slot_events = [ev.driver.event() for _ in range(self.slots)]  # kept, never pooled
        ev.driver.record(self._slot_events[k], self.host.copier.side_handle)
        return self._slot_events[k]


def _named(exc: Exception, where: str) -> Exception:
    """``exc`` with ``where`` in front of its message (the same class where it takes a message)."""
    try:
        named = type(exc)(f"{where}: {exc}")
    except Exception:  # noqa: BLE001 - a class that does not take a message
        return exc
    named.__cause__ = exc
    return named


def _stager(stage: SlabStage, device: int) -> None:
    """The stager thread: on each commit's wake-up, queue the pending copies."""
    import torch

    torch.cuda.set_device(device)  # the driver calls act on this thread's current context
    while stage._wake.get():
        try:
            stage.stage_pending()
        except Exception:  # noqa: BLE001 - logged; the engine thread's next commit retries
            log.exception("recorder %s: the slab stager failed", stage.host.writer)
