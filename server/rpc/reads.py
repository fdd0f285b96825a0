"""The Read RPC's side of the service: the size check of a request, a reader per run, the rows
streamed back.

A Read is sized from its request alone (:func:`read_size`) and refused over the read limit
(``max_read_bytes``, within the read budget) before anything is read or allocated; it commits
what the sidecar holds first (read-your-writes, at most one such commit per flush interval for all
reads: :class:`~.read_limits.CommitGate`), reserves its output in the read budget (not the
engine's memory budget: :class:`~.read_limits.ReadBudget`), reads storage through one
``StoreReader`` per run (kept between calls: :class:`Reads` owns them), and streams the rows in
slices of about ``READ_SLICE_BYTES``, cancelled once its caller has taken none for
``read_stall_s`` (:class:`~.read_limits.StallWatch`). The caller must be allowed to read the run
(``require_read``), checked before the run is looked up; with tokens one identity runs at most
half of the Read/Seal threads' calls. The service (``service.py``) takes the call's slot, gives
back what the call holds (:meth:`Reads.release`) and turns errors into status codes.

A reader holds the run's index and a pool of threads, so :class:`Reads` keeps those of the
``max_runs`` runs read most recently (one read by a call in progress is closed once that call is
done), so reading many runs does not grow the sidecar by a thread pool per run. Looking a run up
for a read takes none of the engine's run slots (``Engine.run_spec``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal

import grpc
from tracestore.server.config import HEALTH_THREADS, READ_SLICE_BYTES, ServerConfig
from tracestore.server.engine.core import Engine
from tracestore.server.metrics import Metrics
from tracestore.server.rpc.read_limits import (
    CommitGate,
    ReadBudget,
    ReadCalls,
    StallWatch,
    Watched,
    read_call_share,
    refuse_read_call,
)
from tracestore.server.security.auth import Identity, require_read

from tracestore.errors import GuidanceMismatch, LimitError, StorageError, ValidationError
from tracestore.v1 import tracestore_pb2 as pb

log = logging.getLogger("tracestore.server")


def read_size(req: pb.ReadRequest, spec: Any, sites: list[str]) -> int:
    """Bytes a Read's output takes (per row of each site read: codes and scales of the column range,
    policy version, global scale, token scale, valid and stale flags), computed from the request
    alone; raises ValidationError for what no read could serve (undeclared or repeated sites,
    negative versions, empty or negative token ranges, column ranges outside a site)."""
    declared = set(spec.site_names)
    for name in sites:
        if name not in declared:
            raise ValidationError(
                f"run {spec.run} declares no site {name[:200]!r}; expected sites among {sorted(declared)}"
            )
    if len(set(sites)) != len(sites):
        raise ValidationError(f"expected each site once in the Read request, got {sites}")
    bad = [v for v in req.versions if v < 0]
    if bad:
        raise ValidationError(f"expected policy versions >= 0 in the Read request, got {bad[:10]}")
    tokens = 0
    for i, seg in enumerate(req.plan):
        if not 0 <= seg.token_start < seg.token_end:
            raise ValidationError(
                f"plan segment {i} ({seg.trajectory[:200]!r}): expected 0 <= token_start < token_end, "
                f"got [{seg.token_start}, {seg.token_end})"
            )
        tokens += seg.token_end - seg.token_start  # a Python int: no overflow, however large
    nbytes = 0
    for name in sites:
        site = spec.site(name)
        width = site.width
        if req.has_columns and not site.is_artifact:  # (an artifact is read whole)
            if not 0 <= req.column_start < req.column_end <= site.width:
                raise ValidationError(
                    f"site {name}: expected a column range within [0, {site.width}], got "
                    f"[{req.column_start}, {req.column_end})"
                )
            width = req.column_end - req.column_start
        (c0, c1), (s0, s1) = site.byte_spans((0, width))
        row = (c1 - c0) + (s1 - s0) + 8 + 4 + 4 + 1 + 1
        nbytes += tokens * site.rows_per_token * row
    return nbytes


class ReadHold:
    """What one Read call holds until :meth:`Reads.release`: one of its identity's Read calls
    (``counted``) and ``nbytes`` of the read budget."""

    __slots__ = ("identity", "counted", "nbytes")

    def __init__(self, identity: str | None) -> None:
        self.identity = identity  # None: authentication off (no shares)
        self.counted = False
        self.nbytes = 0


class Reads:
    """Read requests over one :class:`Engine`, with the ``StoreReader`` of each run read so far,
    the read budget, each identity's Read calls, the stall watch and the read-forced commits."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self._readers: OrderedDict[str, Any] = OrderedDict()  # run -> StoreReader, least recently read first
        self._using: dict[int, int] = {}  # id() of a reader -> calls reading with it now
        self._lock = threading.Lock()
        shares = config.auth_tokens is not None
        metrics.read_budget.set(config.read_budget)
        self.budget = ReadBudget(
            config.read_budget,
            config.read_budget // 2 if shares else None,
            # a stalled Read frees what it holds within read_stall_s: a Read waits out one of them
            config.backpressure_timeout_s + config.read_stall_s,
            metrics.read_in_use.set,
        )
        self.calls = ReadCalls(read_call_share(max(1, config.workers - HEALTH_THREADS), shares))
        self.watch = StallWatch(config.read_stall_s, self._stalled)
        self.commits = CommitGate(
            engine.flush, lambda: engine.in_use > 0, config.flush_interval_s, config.storage_timeout_s
        )

    def _stalled(self) -> None:
        self.metrics.reads_stalled.inc()
        self.metrics.requests.labels("Read", "CANCELLED").inc()
        log.info(
            "cancelled a Read whose caller took no response for %g s (--read-stall-timeout)", self.config.read_stall_s
        )

    def release(self, hold: ReadHold) -> None:
        """Give back what a Read call holds (once its stream has ended)."""
        if hold.nbytes:
            self.budget.give(hold.identity, hold.nbytes)
            hold.nbytes = 0
        if hold.counted:
            self.calls.give(hold.identity)
            hold.counted = False

    def rows(self, raw: bytes, who: Identity, hold: ReadHold) -> tuple[list[tuple[str, Any]], dict[str, str]]:
        """The rows a Read request ``raw`` of caller ``who`` asks for, per site, and the
        trajectories masked because their records belong to other token ids (with the reason);
        ``hold``: what the call holds for them (:meth:`release` gives it back once the stream
        ends)."""
        from tracestore.server.rpc.ingest import decode_message

        from tracestore.plan import MicrobatchPlan
        from tracestore.records import validate_id
        from tracestore.storage.reader import StoreReader

        if not self.calls.take(hold.identity):
            assert self.calls.share is not None
            raise refuse_read_call(self.calls.share, who.name)
        hold.counted = True
        req = decode_message(pb.ReadRequest, raw, "Read request")
        assert isinstance(req, pb.ReadRequest)
        require_read(who, req.run)
        validate_id("run", req.run)
        spec = self.engine.run_spec(req.run)
        sites = list(req.sites) or list(spec.site_names)
        nbytes = read_size(req, spec, sites)  # checks the request; before anything is read or allocated
        if nbytes > self.config.read_limit_bytes:
            raise LimitError(
                f"the read plan needs {nbytes} bytes of output, over this sidecar's limit of "
                f"{self.config.read_limit_bytes} bytes (max_read_bytes, --max-read-mib; at most what the read "
                "budget holds, --read-budget-mib); read fewer tokens or sites at a time"
            )
        # (an empty trajectory id is a padding segment: the client sends None that way)
        plan = MicrobatchPlan([(s.trajectory or None, s.token_start, s.token_end) for s in req.plan])
        # Read-your-writes: commit what this sidecar holds before reading storage (at most one
        # read-forced commit per flush interval, shared by the reads that wait for it).
        if not self.commits.before_read():
            raise StorageError("could not commit pending records before the read (storage is behind); retry")
        # the output, and the slices of it being serialized and sent
        hold.nbytes = self.budget.take(hold.identity, self.config.read_reservation(nbytes))
        on_missing: Literal["error", "mask"] = "mask" if req.on_missing == pb.ON_MISSING_MASK else "error"
        columns = (req.column_start, req.column_end) if req.has_columns else None
        token_ids = _token_ids(req)
        with self._reader(req.run, StoreReader) as reader:
            try:
                result = reader.read(
                    plan,
                    versions=list(req.versions) or None,
                    sites=sites,
                    columns=columns,
                    on_missing=on_missing,
                    token_ids=token_ids,
                    on_mismatch="mask" if req.mask_mismatch else "error",
                )
            except GuidanceMismatch:
                self.metrics.guidance_mismatches.labels("refused").inc()
                raise
        if result.stats.mismatched:
            self.metrics.guidance_mismatches.labels("masked").inc(len(result.stats.mismatched))
        return [(s, result[s]) for s in sites], dict(result.stats.mismatched)

    @contextlib.contextmanager
    def _reader(self, run: str, make: Callable[[Any, str], Any]) -> Iterator[Any]:
        """The reader of ``run`` (made by ``make(store, run)`` if there is none), in use until the
        block ends; readers beyond ``max_runs`` are closed, least recently read first."""
        with self._lock:
            reader = self._readers.get(run)
            if reader is None:
                reader = self._readers[run] = make(self.engine.store, run)
            self._readers.move_to_end(run)
            self._using[id(reader)] = self._using.get(id(reader), 0) + 1
            while len(self._readers) > self.config.max_runs:
                _, old = self._readers.popitem(last=False)
                if id(old) not in self._using:
                    old.close()  # (one in use is closed by the last call done with it)
        try:
            yield reader
        finally:
            with self._lock:
                left = self._using.pop(id(reader)) - 1
                if left:
                    self._using[id(reader)] = left
                elif self._readers.get(run) is not reader:
                    reader.close()

    def stream(
        self,
        rows_by_site: list[tuple[str, Any]],
        context: grpc.ServicerContext,
        t0: float,
        mismatched: dict[str, str] | None = None,
    ) -> Iterator[bytes]:
        """Serialized ReadResponse slices of ``rows_by_site`` (a Read that began at ``t0``), while
        the caller is there to take them (one that takes none for ``read_stall_s`` is cancelled);
        ``mismatched`` rides in the first."""
        with self.watch.watching(context) as watched:
            yield from self._slices(rows_by_site, context, t0, mismatched, watched)

    def _slices(
        self,
        rows_by_site: list[tuple[str, Any]],
        context: grpc.ServicerContext,
        t0: float,
        mismatched: dict[str, str] | None,
        watched: Watched,
    ) -> Iterator[bytes]:
        nbytes = 0
        first = True
        for site, rows in rows_by_site:
            n = int(rows.codes.shape[0])
            cb, sb = int(rows.codes.shape[1]), int(rows.scales.shape[1])
            per_row = cb + sb + 4 + 4 + 1 + 8
            step = max(1, READ_SLICE_BYTES // max(per_row, 1))
            for a in range(0, max(n, 1), step):
                b = min(n, a + step)
                if not context.is_active():
                    return
                ts = rows.token_scales
                msg = pb.ReadResponse(
                    site=site,
                    row_start=a,
                    n_rows=b - a,
                    total_rows=n,
                    code_bytes=cb,
                    scale_bytes=sb,
                    codes=rows.codes[a:b].tobytes(),
                    scales=rows.scales[a:b].tobytes(),
                    global_scale=rows.global_scale[a:b].astype("<f4").tobytes(),
                    token_scales=b"" if ts is None else ts[a:b].astype("<f4").tobytes(),
                    has_token_scales=ts is not None,
                    valid=rows.valid[a:b].astype("u1").tobytes(),
                    policy_version=rows.policy_version[a:b].astype("<i8").tobytes(),
                    mismatched=mismatched if first and mismatched else None,
                )
                first = False
                nbytes += (b - a) * per_row
                data = msg.SerializeToString()
                del msg
                watched.since = time.monotonic()  # gRPC resumes this generator once data is sent
                yield data
                watched.since = None
        self.metrics.read_bytes.inc(nbytes)
        self.metrics.read_latency.observe(time.monotonic() - t0)
        self.metrics.requests.labels("Read", "OK").inc()


def _token_ids(req: pb.ReadRequest) -> dict[str, Any] | None:
    """The trainer's token ids of a Read request per trajectory (None: none given)."""
    import numpy as np

    from tracestore.records import validate_id

    if not req.token_ids:
        return None
    out: dict[str, Any] = {}
    for t in req.token_ids:
        validate_id("trajectory", t.trajectory)
        if len(t.ids) % 4:
            raise ValidationError(
                f"token_ids of {t.trajectory!r}: {len(t.ids)} bytes; expected int32 little-endian ids (4 bytes each)"
            )
        if t.trajectory in out:
            raise ValidationError(f"token_ids name trajectory {t.trajectory!r} twice")
        out[t.trajectory] = np.frombuffer(t.ids, "<i4")
    return out
