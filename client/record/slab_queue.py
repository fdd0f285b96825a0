"""The recorder's slab path: :class:`SlabQueue` checks a ``tracestore.kernels.RecordSlab`` against
the run once (:meth:`SlabQueue.plan`) and stages one forward's slab rows as one queue item
(:meth:`SlabQueue.queue`, behind ``RolloutRecorder.record_slab`` and the commits of its
``slab_stage``); :class:`RecorderStageHost` is the recorder as a :class:`SlabStage` sees it.

The slab's raw rows are staged with one copy per slab and laid out per site later, on the sender
thread (:meth:`tracestore.client.record.outbox.Outbox.unslab`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.records import RunSpec, validate_version

from .copier import StagingCopier
from .items import Region, SlabForward, SlabPlan, Unguided
from .outbox import Outbox
from .session import WriteSession
from .slab import SegmentCheck, Segments
from .staging import StagingPool

# A forward whose sequences average at least this many tokens is not coalesced with later ones:
# its chunks are long enough already for per-chunk work on both sides to stay small.
LONG_SEGMENT = 32


class SlabQueue:
    """Stages slab forwards for one recorder: its run, staging pool, copier, queue (the
    :class:`Outbox`'s) and Write session (:meth:`admit` asks it whether the recorder stopped). It
    holds no reference to the recorder, so a recorder dropped without ``close`` is freed at once."""

    def __init__(
        self,
        run_spec: RunSpec,
        pool: StagingPool,
        copier: StagingCopier,
        outbox: Outbox,
        unguided: Unguided,
        stats: dict[str, int],
        check_segments: SegmentCheck,
        session: WriteSession,
    ) -> None:
        self.run_spec = run_spec
        self._sites = {s.name: s for s in run_spec.sites}
        self._pool = pool
        self._copier = copier
        self._outbox = outbox
        self._unguided = unguided
        self._stats = stats
        self._check_segments = check_segments
        self._session = session
        self._plans: dict[int, tuple[Any, SlabPlan]] = {}

    def plan(self, slab: Any) -> SlabPlan:
        """``slab`` checked against the run once (cached by identity, the slab kept alive)."""
        hit = self._plans.get(id(slab))
        if hit is not None and hit[0] is slab:
            return hit[1]
        layout = getattr(slab, "layout", None)
        if layout is None or not hasattr(slab, "data") or not hasattr(slab, "row_bytes"):
            raise ConfigError(f"slab must be a tracestore.kernels.RecordSlab, got {type(slab).__name__}")
        fields = []
        for f, sspec in zip(layout, slab.sites, strict=True):
            site = self._sites.get(f.name)
            if site is None:
                raise ValidationError(f"run {self.run_spec.run} declares no site {f.name!r}: {list(self._sites)}")
            if (f.code_bytes, f.scale_bytes, int(getattr(sspec, "rows_per_token", 1))) != (
                site.code_bytes,
                site.scale_bytes,
                site.rows_per_token,
            ) or str(getattr(sspec, "format", site.format)) != str(site.format):
                raise ShapeError(
                    f"slab site {f.name}: {f.code_bytes} code and {f.scale_bytes} scale bytes per row "
                    f"({getattr(sspec, 'format', '?')}, rows_per_token {getattr(sspec, 'rows_per_token', 1)}), the run "
                    f"declares {site.code_bytes} and {site.scale_bytes} ({site.format}, width {site.width}, "
                    f"bits {site.bits}, rows_per_token {site.rows_per_token})"
                )
            fields.append((f.name, site, f))
        per_row = sum(f.code_bytes + f.scale_bytes for f in layout)
        plan = SlabPlan(tuple(fields), int(slab.row_bytes), int(slab.rows_per_token), per_row)
        if len(self._plans) > 64:
            self._plans.clear()
        self._plans[id(slab)] = (slab, plan)
        return plan

    def queue(
        self,
        segments: Sequence[tuple[str, int, int]] | Segments,
        slabs: tuple[Any, ...],
        n_rows: int | Sequence[int] | None,
        policy_version: int | None,
        sources: list[Any] | None,
        order: bool,
        after: Any = None,
        ids: Any = None,
    ) -> tuple[bool, Any]:
        """Stage ``slabs`` (or ``sources``: ring slots holding their rows) for one forward; returns
        (queued, the CUDA event the copies complete on). ``order``: make the current stream wait
        for the copies (the source is rewritten by the engine's next kernels); ``after``: the
        event the copies wait for (a deferred :class:`SlabStage` commit), not the current stream."""
        outbox = self._outbox
        version = outbox.policy_version if policy_version is None else validate_version(policy_version)
        segs = segments if isinstance(segments, (list, Segments)) else list(segments)
        trajs, n_tok = self._check_segments(segs)
        if ids is not None and ids.size != n_tok:
            raise ShapeError(f"token_ids holds {ids.size} ids; the segments hold {n_tok} tokens (one id per token)")
        want = [n_rows] * len(slabs) if n_rows is None or isinstance(n_rows, int) else list(n_rows)
        if len(want) != len(slabs):
            raise ShapeError(f"n_rows gives {len(want)} row counts for {len(slabs)} slabs")
        staged: list[tuple[SlabPlan, int, int]] = []
        total = nbytes = 0
        for i, slab in enumerate(slabs):
            plan = self.plan(slab)
            rows = n_tok * plan.rows_per_token
            limit = slab.capacity if sources is None else sources[i].shape[0] // plan.row_bytes
            if want[i] is not None and want[i] != rows:
                raise ShapeError(
                    f"slab of sites {plan.fields[0][0]}..{plan.fields[-1][0]}: the engine wrote {want[i]} rows but "
                    f"the segments hold {n_tok} tokens x {plan.rows_per_token} rows per token = {rows}"
                )
            if rows > limit:
                raise ShapeError(
                    f"slab of sites {plan.fields[0][0]}..{plan.fields[-1][0]}: the segments hold {rows} rows, more "
                    f"than the {limit} it stages"
                )
            staged.append((plan, total, rows))
            total += plan.staged_bytes(rows)
            nbytes += rows * plan.code_scale_bytes
        if not self.admit(segs, trajs):
            return False, None
        off = self._pool.reserve(max(total, 1))
        if off is None:
            self._stats["refused_forwards"] += 1
            self._unguided.mark(list(trajs), "staging_full")
            return False, None
        region = Region(off, total, refs=0)
        srcs = [s.data for s in slabs] if sources is None else sources
        ev = self._copier.slabs(staged, srcs, off, order, keep=sources is None, after=after)
        region.event = ev
        fwd = SlabForward(segs, version, [], region, time.monotonic(), nbytes, n_tok >= LONG_SEGMENT * len(segs))
        fwd.staged = [(plan, off + rel, rows) for plan, rel, rows in staged]
        fwd.ids = ids
        outbox.queue.append(fwd)  # atomic
        outbox.in_bytes += nbytes
        return True, ev

    def admit(self, segs: Collection[tuple[str, int, int]], trajs: tuple[str, ...]) -> bool:
        """Whether a forward of ``segs`` is staged at all (a stopped or closed recorder, an empty
        forward and one whose trajectories are all unguided record nothing)."""
        session = self._session
        if session.error is not None and segs:
            self._unguided.mark(list(trajs), session.stop_reason)
            return False
        unguided = self._unguided.ids
        return not (session.closed or not segs or (unguided and unguided.issuperset(trajs)))


class RecorderStageHost:
    """The recorder as its slab stages see it (:class:`~tracestore.client.record.slab.StageHost`):
    its writer id, counters, copier, the lock its stages queue deferred copies under, its
    :class:`SlabQueue`, its current policy version (the :class:`Outbox`'s) and its unguided
    ledger."""

    def __init__(
        self,
        writer: str,
        stats: dict[str, int],
        copier: StagingCopier,
        issue_lock: threading.Lock,
        slabs: SlabQueue,
        outbox: Outbox,
        unguided: Unguided,
    ) -> None:
        self._writer = writer
        self._stats = stats
        self._copier = copier
        self._issue_lock = issue_lock
        self._slabs = slabs
        self._outbox = outbox
        self._unguided = unguided

    @property
    def writer(self) -> str:
        return self._writer

    @property
    def policy_version(self) -> int:
        return self._outbox.policy_version

    @property
    def stats(self) -> Any:
        return self._stats

    @property
    def copier(self) -> StagingCopier:
        return self._copier

    @property
    def issue_lock(self) -> threading.Lock:
        return self._issue_lock

    def slab_plan(self, slab: Any) -> SlabPlan:
        return self._slabs.plan(slab)

    def queue_slabs(
        self,
        segments: Any,
        slabs: tuple[Any, ...],
        policy_version: int | None,
        views: list[Any],
        after: Any = None,
        ids: Any = None,
    ) -> tuple[bool, Any]:
        return self._slabs.queue(segments, slabs, None, policy_version, views, False, after, ids)

    def unguide(self, trajectories: list[str], reason: str) -> None:
        self._unguided.mark(trajectories, reason)
