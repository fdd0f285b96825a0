"""RolloutRecorder: the rollout engine's side of tracestore. Never blocks, never crashes the engine.

Per forward, :meth:`RolloutRecorder.record_forward` copies each site's record rows (a GPU slab
slice or CPU memory) into the staging pool — on a side CUDA stream, non-blocking, when the rows
live on a GPU — and queues one descriptor per (segment, site). A background thread waits for the
copies, numbers messages per writer ``(writer, epoch, sequence)``, streams them to the sidecar
(offsets into shared memory over a unix socket, inline bytes over TCP), and releases staging when
the sidecar acknowledges the sequence as durable — or, over shared memory, once the sidecar also
reports it released (``released_sequence``: a sidecar with a WAL may read on from staging until the
shard is written instead of copying it out, see server/engine.py). On a lost connection it reconnects and resends
the unacknowledged messages (the sidecar answers duplicates as success). When it cannot keep up —
staging full, sidecar unreachable for ``give_up_s`` — it drops the affected trajectories, marks
them unguided (they are never sealed, so a reader sees them as incomplete), counts them, and
carries on.

Example::

    rec = RolloutRecorder("unix:///run/tracestore.sock", run_spec, writer="node3-gpu0")
    rec.record_forward([("traj-1", 0, 12), ("traj-2", 0, 9)], {"layers.23.mlp.input": SiteOutput(codes, scales, g)})
    rec.finish("traj-1", n_tokens=13); rec.flush(timeout=30); rec.close()
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import os
import random
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tracestore.checksum import chunk_checksum_parts
from tracestore.errors import (
    ConfigError,
    DTypeError,
    PermissionDeniedError,
    ShapeError,
    TraceStoreError,
    ValidationError,
)
from tracestore.records import PrefixLink, RunSpec, TrajectorySeal, validate_id
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import inline_chunk_parts, len_field, link_to_pb, run_spec_to_pb, seal_to_pb

from .staging import GROUP_ENV, StagingPool
from .transport import channel, method, resolve_token

log = logging.getLogger("tracestore.client")

# protobuf field numbers of the inline payload (the wire protocol, see tracestore.proto)
_WRITE_CHUNKS = pb.WriteRequest.CHUNKS_FIELD_NUMBER
_CODES, _SCALES, _TOKEN_SCALES = (
    pb.Chunk.CODES_FIELD_NUMBER,
    pb.Chunk.SCALES_FIELD_NUMBER,
    pb.Chunk.TOKEN_SCALES_FIELD_NUMBER,
)

# A forward whose sequences average at least this many tokens is not coalesced with later ones:
# its chunks are long already (the decode bench found ~32-token chunks enough to keep per-chunk
# work on both sides small).
_LONG_SEGMENT = 32

# gRPC codes (by name, so this module does not need grpc at import time)
_CONTENT_ERRORS = {"INVALID_ARGUMENT", "ALREADY_EXISTS", "DATA_LOSS", "NOT_FOUND", "PERMISSION_DENIED"}


class WriterFencedError(TraceStoreError, RuntimeError):
    """Another recorder took this writer id over with a newer epoch (or something wrote under it
    with an epoch this recorder cannot pass): this recorder stops (``RolloutRecorder.error``)."""


@dataclasses.dataclass
class SiteOutput:
    """One site's rows of one forward: ``codes`` uint8 [rows, code_bytes], ``scales`` uint8
    [rows, scale_bytes] (torch tensors on any device, or numpy), ``global_scale`` the decode-side
    g: a float or a one-element tensor, or a float32 tensor of one g per row (per-token NVFP4
    activation scales; stored as the rows' token scales with the chunk's g 1.0, which dequantizes
    to the same values bit for bit, docs/numerics.md §6-§7), ``token_scales`` float32 [rows] or
    None (not together with a per-row g)."""

    codes: Any
    scales: Any
    global_scale: Any = 1.0
    token_scales: Any = None


@dataclasses.dataclass
class _Region:
    offset: int
    size: int
    refs: int
    event: Any = None  # CUDA event the copy into it completes on


@dataclasses.dataclass(slots=True)
class _Piece:
    """One chunk waiting to be sent: rows of one segment in a staging region."""

    trajectory: str
    site: str
    version: int
    token_start: int
    n_tokens: int
    region: _Region
    codes_off: int
    scales_off: int
    ts_off: int  # -1: no token scales
    g_off: int
    nbytes: int
    queued: float = 0.0
    g: bytes = b""  # the global scale's float32 bytes (known once the copy landed)


_NBYTES = operator.attrgetter("nbytes")
_F32 = struct.Struct("<f")


@dataclasses.dataclass
class _Forward:
    """One forward as record_forward queued it (one staging region for all its sites); the sender
    thread splits it into pieces, keeping per-segment Python work off the engine thread."""

    segs: list[tuple[str, int, int]]
    version: int
    sites: list[tuple[str, Any, int, int, int, int, int]]  # name, site, offset, nc, ns, nt, g_off
    region: _Region
    queued: float
    nbytes: int = 0
    long_segments: bool = False  # its sequences average >= _LONG_SEGMENT tokens (prefill)


@dataclasses.dataclass
class _SlabForward(_Forward):
    """A forward staged as raw RecordSlab rows (one copy per slab); the sender lays it out per site
    (:meth:`RolloutRecorder._unslab`) before anything else reads it. ``staged``: per slab, its
    plan, the staging offset of its rows and their count."""

    staged: list[tuple[_SlabPlan, int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _SlabPlan:
    """A RecordSlab checked against the run: per site (name, SiteSpec, field), row bytes, rows per token."""

    fields: tuple[tuple[str, Any, Any], ...]
    row_bytes: int
    rows_per_token: int
    code_scale_bytes: int  # per row, summed over the sites: the payload before token scales

    def staged_bytes(self, rows: int) -> int:
        """Room for the raw rows and for the per-site layout made of them (64-byte aligned)."""
        lay = sum(-(-(rows * (f.code_bytes + f.scale_bytes + 4) + 4) // 64) * 64 for _, _, f in self.fields)
        return -(-max(rows * self.row_bytes, lay) // 64) * 64


@dataclasses.dataclass
class _Finish:
    """A seal as finish() queued it; the sender resolves its sites and version in queue order."""

    trajectory: str
    n_tokens: int  # -1: the trajectory is unguided, only forget its bookkeeping
    sites: tuple[str, ...] | None


@dataclasses.dataclass
class _Out:
    """A numbered message in flight."""

    seq: int
    req: pb.WriteRequest
    pieces: list[_Piece]
    trajectories: set[str]
    nbytes: int
    payload: list[Any] = dataclasses.field(default_factory=list)  # inline chunk wire parts
    born: float = float("inf")  # when its oldest record was queued (pieces carry their own)
    chunks: int = 0

    def serialize(self) -> bytes:
        head = self.req.SerializeToString()
        return b"".join([head, *self.payload]) if self.payload else head


class RolloutRecorder:
    """Streams a rollout's TRACE records to a sidecar. See the module docstring.

    ``address``: ``"host:port"`` or ``"unix:///path/sock"`` (then shared-memory staging is used);
    ``writer``: this engine instance's id (unique per run); ``epoch``: defaults to the current
    time in ns, so a restarted engine fences its predecessor. ``pin``: register the staging pool
    with CUDA now (default: when torch is already imported and sees a GPU). ``linger_s``: how long
    small (decode) forwards may wait to be coalesced with later ones (a window of up to 16 x
    ``batch_bytes``, a quarter of the pool) before they are sent; ``flush`` sends at once.
    ``shm_group``: the group (name or gid) of the shared-memory staging pool, made 0640 for a
    sidecar running as another user of that group; default ``$TRACESTORE_SHM_GROUP``, else the
    unix socket's group when that socket admits its group (a sidecar started with
    ``--socket-group``), else none (0600).

    Reconnects wait ``reconnect_backoff_s * 2**n`` seconds (n: attempts since the last
    acknowledgement), at most ``min(reconnect_cap_s, give_up_s / 4)``, each wait drawn uniformly
    below that bound (full jitter: recorders cut off together do not return together). A sidecar
    that refuses this writer for good stops the recorder: PERMISSION_DENIED, or an older epoch than
    the writer's session there (another instance took the writer id over). Then :attr:`error`
    says why (logged once), every trajectory not yet sealed is unguided and later calls record
    nothing (``record_forward`` and ``finish`` return False, ``flush`` returns False at once).
    ``channel_credentials`` (``grpc.ChannelCredentials``, e.g. ``grpc.ssl_channel_credentials(ca)``)
    or a ``grpcs://host:port`` address: TLS; ``token`` (default ``$TRACESTORE_TOKEN``): the bearer
    token sent with every call (see :func:`tracestore.client.transport.channel`).
    """

    def __init__(
        self,
        address: str,
        run_spec: RunSpec,
        writer: str,
        policy_version: int = 0,
        *,
        staging_bytes: int = 256 << 20,
        batch_bytes: int = 4 << 20,
        shared_memory: bool | None = None,
        shm_dir: str = "/dev/shm",
        shm_group: int | str | None = None,
        give_up_s: float = 30.0,
        reconnect_backoff_s: float = 0.05,
        reconnect_cap_s: float = 10.0,
        epoch: int | None = None,
        connect: bool = True,
        pin: bool | None = None,
        linger_s: float = 1.0,
        channel_credentials: Any = None,
        token: str | None = None,
    ) -> None:
        if not isinstance(run_spec, RunSpec):
            raise ConfigError(f"run_spec must be a tracestore.records.RunSpec, got {type(run_spec).__name__}")
        validate_id("writer", writer)
        self.address = address
        # checked here, not in the sender thread: a token that would travel in the clear is refused now
        self._credentials = (channel_credentials, resolve_token(address, channel_credentials, token))
        self.run_spec = run_spec
        self.writer = writer
        self.policy_version = int(policy_version)
        self.batch_bytes = int(batch_bytes)
        # Taken off the queue at once and coalesced (then cut into messages of batch_bytes): 16
        # MiB windows of 256 x 20-site decode steps made ~8-token chunks, 64 MiB ~32-token ones;
        # sidecar CPU per step 75-80 -> 18-22 ms, sender 6-9 -> 2.4-3 ms (bench_ingest --only decode).
        self.window_bytes = max(self.batch_bytes, min(16 * self.batch_bytes, staging_bytes // 4))
        # Unacknowledged bytes in flight before the sender waits for acks. They hold staging until
        # acknowledged (nothing else: messages are serialized as gRPC sends them), so half the
        # pool: with commit acks (no WAL) 32 MiB kept the sender idle between shard commits
        # (memory:// 384 MiB, shm: 0.26 -> 0.34 GB/s, TCP 0.22 -> 0.28 GB/s).
        self.inflight_bytes = max(8 * self.batch_bytes, staging_bytes // 2)
        self.linger_s = float(linger_s)
        self._in_bytes = 0  # bytes record_forward queued (written by the caller only)
        self._out_bytes = 0  # bytes the sender took off the queue (written by the sender only)
        self._urgent = False
        self.give_up_s = float(give_up_s)
        self.reconnect_backoff_s = float(reconnect_backoff_s)
        self.reconnect_cap_s = float(reconnect_cap_s)
        if not 0 < self.reconnect_backoff_s <= self.reconnect_cap_s:
            raise ConfigError(
                f"need 0 < reconnect_backoff_s <= reconnect_cap_s, got {reconnect_backoff_s}, {reconnect_cap_s}"
            )
        self.epoch = int(epoch) if epoch is not None else time.time_ns()
        shared = address.startswith("unix:") if shared_memory is None else bool(shared_memory)
        if shared and shm_group is None and not os.environ.get(GROUP_ENV):
            shm_group = _socket_group(address)
        self.pool = StagingPool(staging_bytes, shared=shared, shm_dir=shm_dir, group=shm_group)
        self._np = np.frombuffer(self.pool.mm, dtype=np.uint8)
        # Pin at start-up, not at the first forward (pinning GBs takes seconds; a failure shows then); by
        # default only when the engine already uses torch, so CPU-only engines never import it.
        self.pinned = False
        if pin or (pin is None and "torch" in sys.modules):
            try:
                self.pinned = self.pool.pin()
            except ConfigError:
                if pin:
                    raise
                log.warning("could not pin the %d-byte staging pool; device copies will be synchronous", staging_bytes)
        self._sites = {s.name: s for s in run_spec.sites}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Callers append (deque.append is atomic), the sender pops: the engine thread never waits
        # for a lock the sender holds while it expands and serializes.
        self._queue: deque[_Piece | _Forward | _Finish | TrajectorySeal | PrefixLink] = deque()
        self._valid_ids: set[str] = set()
        self._unacked: deque[_Out] = deque()
        # durable, but the sidecar still reads their shared-memory regions (released_sequence)
        self._unreleased: deque[_Out] = deque()
        self._next_seq = 1
        self._acked = 0
        self._unguided: set[str] = set()
        self._unguided_unreported: dict[str, int] = {}
        # TraceRef bookkeeping (tracestore.client.traceref): why each trajectory is unguided, the
        # token count finish() was given, the (epoch, sequence, seal) of each durable seal, and the
        # highest attempt handed out per base trajectory. Bounded: the oldest entries go first.
        self._unguided_why: dict[str, str] = {}
        self._finished: dict[str, tuple[int, int]] = {}  # trajectory -> (n_tokens, policy version)
        self._sealed_at: dict[str, tuple[int, int, TrajectorySeal]] = {}
        self._attempts: dict[str, int] = {}
        self._sites_of: dict[str, frozenset[str]] = {}  # sender thread only
        self._version_of: dict[str, int] = {}  # sender thread only
        self._names: dict[tuple[str, ...], frozenset[str]] = {}
        self._closed = False
        self._busy = False  # the sender holds items it took off the queue and has not numbered yet
        self._connected = False
        self._down_since: float | None = time.monotonic()
        # Why the recorder stopped for good (fenced, refused): set once, by the sender thread
        self.error: TraceStoreError | None = None
        self._stop_reason = ""
        self._acks_seen = 0  # acknowledgements that covered messages (they reset the backoff)
        self.stats: dict[str, int] = dict(
            chunks=0,
            bytes=0,
            messages=0,
            acked_messages=0,
            resent=0,
            reconnects=0,
            unguided=0,
            refused_forwards=0,
            rejected_messages=0,
            stale_pools_removed=self.pool.stale_removed,  # left in shm_dir by recorders that died
        )
        self._cuda: Any = None
        self._side_stream: Any = None
        self._slab_plans: dict[int, tuple[Any, _SlabPlan]] = {}
        self._thread = threading.Thread(target=self._run, name=f"tracestore-recorder-{writer}", daemon=True)
        if connect:
            self._thread.start()

    # -- engine-facing API (never blocks on the network) ------------------------------------------

    def record_forward(
        self,
        segments: Sequence[tuple[str, int, int]],
        outputs: dict[str, SiteOutput],
        policy_version: int | None = None,
    ) -> bool:
        """Queue one forward's records. ``segments`` are the forward's rows in order,
        ``(trajectory, token_start, token_end)``; each site's tensors hold those rows
        (x ``rows_per_token``). Returns False when the forward was refused (staging full or
        recorder closed): its trajectories are then unguided. Bad arguments raise.

        Cost on the caller's thread does not grow with the sender's work: no lock the sender holds,
        no per-segment Python loop (checks run in C over the segment list), one staging
        reservation, copies that keep the GIL (a copy that let it go waited up to the 5 ms switch
        interval to get it back while the sender ran: 2-5 ms per decode step measured) and one
        queue append. Splitting into chunks, coalescing and serialization run on the sender thread.
        """
        version = self.policy_version if policy_version is None else int(policy_version)
        segs = segments if isinstance(segments, list) else list(segments)
        trajs, n_tok = self._check_segments(segs)
        plans = []
        total = 0
        for name, out in outputs.items():
            site = self._sites.get(name)
            if site is None:
                raise ValidationError(f"run {self.run_spec.run} declares no site {name!r}: {list(self._sites)}")
            rows = n_tok * site.rows_per_token
            _check(out.codes, (rows, site.code_bytes), f"{name}.codes")
            _check(out.scales, (rows, site.scale_bytes), f"{name}.scales")
            out = _per_row_g(out, name, rows)
            if out.token_scales is not None:
                _check(out.token_scales, (rows,), f"{name}.token_scales", dtype="float32")
            nc, ns = rows * site.code_bytes, rows * site.scale_bytes
            nt = rows * 4 if out.token_scales is not None else 0
            plans.append((name, site, out, total, nc, ns, nt))
            total += -(-(nc + ns + nt + 4) // 64) * 64
        if not self._admit(segs, trajs):
            return False
        # one reservation for the whole forward: it is staged whole or not at all
        off = self.pool.reserve(max(total, 1))
        if off is None:
            self.stats["refused_forwards"] += 1
            self._mark_unguided(list(trajs), "staging_full")
            return False
        region = _Region(off, total, refs=0)
        sites = []
        events = []
        for name, site, out, rel, nc, ns, nt in plans:
            o = off + rel
            g_off = o + nc + ns + nt
            events.append(self._copy(out, o, nc, ns, nt, g_off))
            sites.append((name, site, o, nc, ns, nt, g_off))
        region.event = next((e for e in reversed(events) if e is not None), None)
        nbytes = sum(p[4] + p[5] + p[6] for p in plans)
        long_segments = n_tok >= _LONG_SEGMENT * len(segs)
        self._queue.append(_Forward(segs, version, sites, region, time.monotonic(), nbytes, long_segments))  # atomic
        self._in_bytes += nbytes  # written by callers only; the sender owns _out_bytes
        return True

    def record_slab(
        self,
        segments: Sequence[tuple[str, int, int]],
        slab: Any,
        n_rows: int | Sequence[int] | None = None,
        policy_version: int | None = None,
    ) -> bool:
        """Queue one forward recorded into a :class:`tracestore.kernels.RecordSlab` (or a few, one per
        ``rows_per_token``): its rows ``[0, n_rows)`` for ``segments``, the forward's
        ``(trajectory, token_start, token_end)`` rows in order. One copy per slab, whatever the
        number of sites: from a GPU a non-blocking copy on the side stream into pinned staging, after
        which the engine's current stream waits for it (the next forward rewrites the slab); the
        per-site layout is made on the sender thread. ``n_rows`` (optional) is the rows the engine
        wrote, checked against the segments' tokens × ``rows_per_token``. A site whose rows carry
        different g values (per-token NVFP4 activation scales) is stored with them as token
        scales (chunk g 1.0: the same dequantized values bit for bit); one g per site is stored as
        the chunk's g. Returns False when refused (staging full, recorder stopped): its
        trajectories are then unguided. Bad arguments raise (ValidationError for a site the run
        does not declare, ShapeError naming the site or slab otherwise).

        Inside a CUDA graph, use :meth:`slab_stage`."""
        slabs = tuple(slab) if isinstance(slab, (list, tuple)) else (slab,)
        ok, _ = self._queue_slabs(segments, slabs, n_rows, policy_version, None, True)
        return ok

    def slab_stage(self, slab: Any, rows: int | None = None, slots: int = 2) -> SlabStage:
        """The CUDA-graph form of :meth:`record_slab`: a :class:`SlabStage` whose ``capture()`` goes
        inside the engine's captured graph (after the last record kernel) and whose ``commit(segments)``
        the engine calls once after each replay. ``rows``: the slab rows the graph stages (default
        its capacity, i.e. the graph's batch); ``slots``: device ring slots (2: a step's staging copy
        has a whole step to land before its slot is written again)."""
        return SlabStage(self, slab, rows, slots)

    def _slab_plan(self, slab: Any) -> _SlabPlan:
        """``slab`` checked against the run once (cached by identity, the slab kept alive)."""
        hit = self._slab_plans.get(id(slab))
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
        plan = _SlabPlan(tuple(fields), int(slab.row_bytes), int(slab.rows_per_token), per_row)
        if len(self._slab_plans) > 64:
            self._slab_plans.clear()
        self._slab_plans[id(slab)] = (slab, plan)
        return plan

    def _queue_slabs(
        self,
        segments: Sequence[tuple[str, int, int]],
        slabs: tuple[Any, ...],
        n_rows: int | Sequence[int] | None,
        policy_version: int | None,
        sources: list[Any] | None,
        order: bool,
    ) -> tuple[bool, Any]:
        """Stage ``slabs`` (or ``sources``: ring slots holding their rows) for one forward; returns
        (queued, the CUDA event the copies complete on). ``order``: make the current stream wait
        for the copies (the source is rewritten by the engine's next kernels)."""
        version = self.policy_version if policy_version is None else int(policy_version)
        segs = segments if isinstance(segments, list) else list(segments)
        trajs, n_tok = self._check_segments(segs)
        want = [n_rows] * len(slabs) if n_rows is None or isinstance(n_rows, int) else list(n_rows)
        if len(want) != len(slabs):
            raise ShapeError(f"n_rows gives {len(want)} row counts for {len(slabs)} slabs")
        staged: list[tuple[_SlabPlan, int, int]] = []
        total = nbytes = 0
        for i, slab in enumerate(slabs):
            plan = self._slab_plan(slab)
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
        if not self._admit(segs, trajs):
            return False, None
        off = self.pool.reserve(max(total, 1))
        if off is None:
            self.stats["refused_forwards"] += 1
            self._mark_unguided(list(trajs), "staging_full")
            return False, None
        region = _Region(off, total, refs=0)
        srcs = [s.data for s in slabs] if sources is None else sources
        ev = None
        if _is_cuda(srcs[0]):
            import torch

            side = self._side()
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                for (plan, rel, rows), src in zip(staged, srcs, strict=True):
                    n = rows * plan.row_bytes
                    self._cuda[off + rel : off + rel + n].copy_(src.reshape(-1)[:n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            if sources is None:
                for src in srcs:
                    src.record_stream(side)
            if order:
                cur.wait_event(ev)
        else:
            view = self.pool.view
            for (plan, rel, rows), src in zip(staged, srcs, strict=True):
                n = rows * plan.row_bytes
                view[off + rel : off + rel + n] = _as_bytes(src.reshape(-1)[:n]).data
        region.event = ev
        fwd = _SlabForward(segs, version, [], region, time.monotonic(), nbytes, n_tok >= _LONG_SEGMENT * len(segs))
        fwd.staged = [(plan, off + rel, rows) for plan, rel, rows in staged]
        self._queue.append(fwd)  # atomic
        self._in_bytes += nbytes
        return True, ev

    def _admit(self, segs: list[tuple[str, int, int]], trajs: tuple[str, ...]) -> bool:
        """Whether a forward of ``segs`` is staged at all (a stopped or closed recorder, an empty
        forward and one whose trajectories are all unguided record nothing)."""
        if self.error is not None and segs:
            self._mark_unguided(list(trajs), self._stop_reason)
            return False
        return not (self._closed or not segs or (self._unguided and self._unguided.issuperset(trajs)))

    def _unslab(self, fwd: _SlabForward) -> _SlabForward:
        """Lay a slab forward's raw rows out per site, as record_forward stages them (sender thread):
        codes, scales, token scales when the site's rows carry different g (then g 1.0), g."""
        region = fwd.region
        if region.event is not None:
            region.event.synchronize()
            region.event = None
        npool = self._np
        sites = []
        extra = 0
        for plan, off, rows in fwd.staged:
            rb = plan.row_bytes
            raw = npool[off : off + rows * rb].reshape(rows, rb).copy()
            o = off
            for name, site, f in plan.fields:
                nc, ns = rows * f.code_bytes, rows * f.scale_bytes
                cs, ss = slice(f.codes, f.codes + f.code_bytes), slice(f.scales, f.scales + f.scale_bytes)
                npool[o : o + nc].reshape(rows, f.code_bytes)[:] = raw[:, cs]
                npool[o + nc : o + nc + ns].reshape(rows, f.scale_bytes)[:] = raw[:, ss]
                g = np.ascontiguousarray(raw[:, f.g : f.g + 4])
                nt = 0
                if rows > 1 and not (g.view(np.uint32) == g[0].view(np.uint32)).all():
                    nt = rows * 4  # one g per row: the rows' token scales, the chunk's g 1.0
                    npool[o + nc + ns : o + nc + ns + nt] = g.reshape(-1)
                    g = np.frombuffer(_F32.pack(1.0), np.uint8)
                g_off = o + nc + ns + nt
                npool[g_off : g_off + 4] = g.reshape(-1)[:4]
                sites.append((name, site, o, nc, ns, nt, g_off))
                extra += nt
                o += -(-(nc + ns + nt + 4) // 64) * 64
        fwd.sites = sites
        fwd.nbytes += extra
        self._out_bytes -= extra  # the token scales were not counted in _in_bytes
        return fwd

    def _check_segments(self, segs: list[tuple[str, int, int]]) -> tuple[tuple[str, ...], int]:
        """(trajectories, token count) of a forward's segments; raises on a malformed one (checks
        run in C over the list: no per-segment Python loop once the ids are known)."""
        if not segs:
            return (), 0
        try:
            trajs, starts, ends = zip(*segs, strict=True)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"segments must be (trajectory, token_start, token_end) tuples: {exc}") from exc
        known = self._valid_ids
        if not known.issuperset(trajs):
            for t in trajs:
                if t not in known:
                    validate_id("trajectory", t)
                    if len(known) > 1 << 20:
                        known.clear()
                    known.add(t)
        lens = list(map(operator.sub, ends, starts))
        if min(starts) < 0 or min(lens) <= 0:
            t, a, b = next(x for x in segs if x[1] < 0 or x[2] <= x[1])
            raise ValidationError(f"segment of {t}: expected 0 <= token_start < token_end, got [{a}, {b})")
        return trajs, int(sum(lens))

    def link_prefix(self, trajectory: str, source: str, n_tokens: int, policy_version: int | None = None) -> None:
        """Declare that ``trajectory``'s tokens ``[0, n_tokens)`` are ``source``'s (shared prompt)."""
        v = self.policy_version if policy_version is None else int(policy_version)
        if self.error is None:  # (a stopped recorder's queue has no reader)
            self._queue.append(PrefixLink(self.run_spec.run, v, trajectory, source, n_tokens))

    def finish(self, trajectory: str, n_tokens: int, sites: Sequence[str] | None = None) -> bool:
        """Seal ``trajectory`` (``n_tokens`` = its full length; the last position is unrecorded by
        design). Returns False if it is unguided (then it is not sealed). The seal's sites (default:
        every site this recorder queued for it) and policy version are resolved by the sender, after
        the forwards queued before it."""
        validate_id("trajectory", trajectory)
        _bounded_put(self._finished, trajectory, (int(n_tokens), self._version_of.get(trajectory, self.policy_version)))
        if self.error is not None:  # stopped: nothing is sealed, and its queue has no reader
            self._mark_unguided([trajectory], self._stop_reason)
            return False
        if trajectory in self._unguided:
            self._queue.append(_Finish(trajectory, -1, None))  # forget its bookkeeping, in order
            return False
        names = None if sites is None else tuple(sorted(sites))
        if names is not None:
            unknown = [s for s in names if s not in self._sites]
            if unknown:
                raise ValidationError(f"run {self.run_spec.run} declares no sites {unknown}: {list(self._sites)}")
        self._queue.append(_Finish(trajectory, int(n_tokens), names))
        return True

    def set_policy_version(self, version: int) -> None:
        self.policy_version = int(version)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is durably acknowledged; True on success within ``timeout``
        (False at once when the recorder stopped: :attr:`error`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._urgent = True  # send now, do not linger
            self._wake.notify_all()
            while self._queue or self._unacked or self._busy or self.error is not None:
                if self.error is not None:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(0.1 if left is None else min(left, 0.1))
            self._urgent = False
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush (up to ``timeout``), stop the sender and free the staging pool."""
        ok = self.flush(timeout)
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.pool.close()
        return ok

    @property
    def unguided(self) -> frozenset[str]:
        return frozenset(self._unguided)

    def attempt(self, trajectory: str, attempt: int | None = None) -> str:
        """The stored id to record ``attempt`` of ``trajectory`` under (``"<trajectory>::a<n>"``,
        :func:`tracestore.client.traceref.attempt_id`); default: the next attempt this recorder has
        not handed out. Attempts of one trajectory on one recorder must increase, so a retried or
        aborted rollout never writes under an earlier attempt's id (across recorders, pass the
        framework's own retry counter)."""
        from .traceref import attempt_id

        last = self._attempts.get(trajectory, -1)
        n = last + 1 if attempt is None else attempt
        stored = attempt_id(trajectory, n)  # validates trajectory and n
        if n <= last:
            raise ValidationError(
                f"recorder {self.writer} already handed out attempt {last} of {trajectory}: attempt {n} would "
                f"write under an earlier attempt's id; records are write-once per (trajectory, attempt)"
            )
        _bounded_put(self._attempts, trajectory, n)
        return stored

    def refs(self, trajectories: Sequence[str], timeout: float = 60.0) -> list[Any]:
        """One :class:`tracestore.client.traceref.TraceRef` per stored id of ``trajectories`` (each
        finished with :meth:`finish`), in order. Waits up to ``timeout`` seconds for every seal to
        be durable and for the sidecar to report the shard holding it committed to storage; a
        trajectory that is unguided, or not durable or published by then, gets an unguided ref
        (``guided=False`` and its ``reason``). A guided ref therefore names records a trainer can
        read from storage."""
        from .traceref import make_refs

        return make_refs(self, list(trajectories), timeout)

    def _seal_state(self, trajectory: str) -> tuple[str, Any]:
        """("sealed", (epoch, seq, seal)) once the seal's message is durable; ("unguided",
        (version, n_tokens, reason)); ("pending", None) after finish(); else ("unknown", None)."""
        with self._lock:
            at = self._sealed_at.get(trajectory)
            if at is not None:
                return "sealed", at
            fin = self._finished.get(trajectory)
            if trajectory in self._unguided and fin is not None:
                return "unguided", (fin[1], fin[0], self._unguided_why.get(trajectory, "refused"))
            if fin is not None:
                return "pending", None
            return "unknown", None

    def _forget_seal(self, trajectory: str) -> None:
        with self._lock:
            self._sealed_at.pop(trajectory, None)
            self._finished.pop(trajectory, None)
            self._unguided_why.pop(trajectory, None)

    def _note_sealed(self, out: _Out) -> None:
        """The seals of ``out``, durable now (under the lock, from the acknowledgement)."""
        run = self.run_spec.run
        for s in out.req.seals:
            seal = TrajectorySeal(run, s.policy_version, s.trajectory, s.n_tokens, tuple(s.sites))
            _bounded_put(self._sealed_at, s.trajectory, (int(out.req.epoch), out.seq, seal))

    # -- internals --------------------------------------------------------------------------------

    def _mark_unguided(self, trajectories: Sequence[str] | set[str], reason: str) -> None:
        new = [t for t in trajectories if t not in self._unguided]
        self._unguided.update(new)
        for t in new:
            _bounded_put(self._unguided_why, t, reason)
        if new:
            self.stats["unguided"] += len(new)
            self._unguided_unreported[reason] = self._unguided_unreported.get(reason, 0) + len(new)
            log.warning("%d trajectories unguided (%s), e.g. %s", len(new), reason, new[0])

    def _copy(self, out: SiteOutput, off: int, nc: int, ns: int, nt: int, g_off: int) -> Any:
        srcs = [(out.codes, off, nc), (out.scales, off + nc, ns)]
        if nt:
            srcs.append((out.token_scales, off + nc + ns, nt))
        g = out.global_scale
        if any(_is_cuda(x) for x, _, _ in srcs) or _is_cuda(g):
            return self._copy_cuda(srcs, g, g_off)
        view = self.pool.view
        for x, o, n in srcs:
            # memoryview assignment copies holding the GIL (numpy's copy releases it above 500
            # elements, then waits up to the switch interval for it while the sender runs)
            view[o : o + n] = _as_bytes(x).data
        view[g_off : g_off + 4] = np.float32(_scalar(g)).tobytes()
        return None

    def _side(self) -> Any:
        """The side CUDA stream of the staging copies (pins the pool on first use)."""
        import torch

        if self._cuda is None:
            self.pool.pin()
            self._cuda = self.pool.tensor()
            self._side_stream = torch.cuda.Stream()
        return self._side_stream

    def _copy_cuda(self, srcs: list[tuple[Any, int, int]], g: Any, g_off: int) -> Any:
        import torch

        side = self._side()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, o, n in srcs:
                t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
                self._cuda[o : o + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            if isinstance(g, torch.Tensor):
                # as_strided: a one-element g may be a strided view (a RecordSlab's g column), which
                # view(uint8) refuses; its one element is what is copied
                g1 = g.reshape(-1)[:1].float().as_strided((1,), (1,))
                self._cuda[g_off : g_off + 4].copy_(g1.view(torch.uint8), non_blocking=True)
            else:
                self._np[g_off : g_off + 4] = np.frombuffer(np.float32(g).tobytes(), np.uint8)
            ev = torch.cuda.Event()
            ev.record(side)
        for x, _, _ in srcs:  # keep the slab alive until the copy ran
            if _is_cuda(x):
                x.record_stream(side)
        # The engine's next forward rewrites its static slab on this stream: order that after the
        # copy (a device-side wait; the host does not block). Without it the next kernels raced the
        # copy of this forward's rows (tests/client/test_recorder_gpu.py delays the side stream).
        torch.cuda.current_stream().wait_event(ev)
        return ev

    def _runs(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        """Coalesce pieces of one (trajectory, site, version) with adjacent tokens and the same
        global scale into runs, one chunk each: decode steps record one token per sequence, and a
        chunk per token costs ~75 us of sidecar CPU and a Parquet row (measured), so one chunk per
        run is what makes decode-heavy rollouts affordable. Order of first appearance is kept."""
        runs: list[list[_Piece]] = []
        last: dict[tuple[str, str, int], list[_Piece]] = {}
        for p in pieces:
            key = (p.trajectory, p.site, p.version)
            run = last.get(key)
            if run is not None:
                q = run[-1]
                if q.token_start + q.n_tokens == p.token_start and (q.ts_off < 0) == (p.ts_off < 0) and q.g == p.g:
                    run.append(p)
                    continue
            run = [p]
            runs.append(run)
            last[key] = run
        return runs

    def _build(self, runs: list[list[_Piece]], extras: list[TrajectorySeal | PrefixLink], shm: bool) -> _Out:
        run_id = self.run_spec.run
        req = pb.WriteRequest(run=run_id, writer=self.writer, epoch=self.epoch)
        if shm:
            req.shm_pool = self.pool.name or ""
            req.keeps_staging = True  # regions are kept until released_sequence covers them
        trajs: set[str] = set()
        nbytes = 0
        payload: list[Any] = []
        view = self.pool.view
        pieces: list[_Piece] = []
        for run in runs:
            p = run[0]
            site = self._sites[p.site]
            cb, sb, rpt = site.code_bytes, site.scale_bytes, site.rows_per_token
            g = _F32.unpack(p.g)[0]
            has_ts = p.ts_off >= 0
            codes, scales, ts = [], [], []
            n_tokens = 0
            for q in run:
                rows = q.n_tokens * rpt
                codes.append(view[q.codes_off : q.codes_off + rows * cb])
                scales.append(view[q.scales_off : q.scales_off + rows * sb])
                if has_ts:
                    ts.append(view[q.ts_off : q.ts_off + rows * 4])
                n_tokens += q.n_tokens
                nbytes += q.nbytes
            n_rows = n_tokens * rpt
            crc = chunk_checksum_parts(
                run_id, p.version, p.trajectory, p.site, p.token_start, n_tokens, n_rows, cb, sb,
                codes, scales, g, ts if has_ts else None,
            )  # fmt: skip
            head = pb.Chunk(
                policy_version=p.version,
                trajectory=p.trajectory,
                site=p.site,
                token_start=p.token_start,
                n_tokens=n_tokens,
                global_scale=g,
                has_token_scales=has_ts,
                checksum=crc,
            )
            if shm and len(run) == 1:  # descriptors only; a coalesced run is not contiguous: inline
                c = req.chunks.add()
                c.CopyFrom(head)
                c.shm.codes_offset = p.codes_off
                c.shm.scales_offset = p.scales_off
                c.shm.token_scales_offset = max(p.ts_off, 0)
            else:  # payload straight from staging into the wire bytes (one copy, at send time)
                payload += inline_chunk_parts(head, codes, scales, ts if has_ts else None)
            trajs.add(p.trajectory)
            pieces.extend(run)
        for e in extras:
            if isinstance(e, TrajectorySeal):
                req.seals.append(seal_to_pb(e))
            else:
                req.links.append(link_to_pb(e))
            trajs.add(e.trajectory)
        for reason, n in self._unguided_unreported.items():
            req.unguided.add(reason=reason, count=n)
        self._unguided_unreported = {}
        return _Out(0, req, pieces, trajs, nbytes, payload, chunks=len(runs))

    def _gather(self, fwds: list[_Forward]) -> list[_Out]:
        """Messages for whole forwards taken in order (decode steps), with the chunks :meth:`_runs`
        would make: rows of one (trajectory, version) with adjacent tokens and the same global
        scale form one chunk, across forwards and changes of the batch.

        The runs are found once per window over the segments, not per (segment, site); then per
        site one numpy gather puts every run's rows next to each other, so a chunk is one slice of
        it. Staging is released once the rows are gathered (the messages own copies).
        Trajectories unguided by now are skipped."""
        outs: list[_Out] = []
        i = 0
        while i < len(fwds):  # sub-windows of forwards with the same sites (and token-scale use)
            sig = [(x[0], x[5] > 0) for x in fwds[i].sites]
            j = i + 1
            while j < len(fwds) and [(x[0], x[5] > 0) for x in fwds[j].sites] == sig:
                j += 1
            self._gather_window(fwds[i:j], outs)
            i = j
        return outs

    def _gather_window(self, win: list[_Forward], outs: list[_Out]) -> None:
        unguided = self._unguided
        run_id = self.run_spec.run
        npool = self._np
        # runs: [trajectory, version, token_start, n_tokens, [(forward, window token offset, n)]]
        runs: list[list[Any]] = []
        last: dict[tuple[str, int], list[Any]] = {}
        base = 0
        for fi, f in enumerate(win):
            v = f.version
            for t, a, b in f.segs:
                a, n = int(a), int(b) - int(a)
                if t not in unguided:
                    r = last.get((t, v))
                    if r is not None and r[2] + r[3] == a:
                        r[3] += n
                        r[4].append((fi, base, n))
                    else:
                        r = last[(t, v)] = [t, v, a, n, [(fi, base, n)]]
                        runs.append(r)
                base += n
        if runs:
            los = np.fromiter((lo for r in runs for _, lo, _ in r[4]), np.int64)
            lens = np.fromiter((n for r in runs for _, _, n in r[4]), np.int64)
            ends = np.cumsum(lens)
            perm = np.repeat(los - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
        chunks: list[list[Any]] = []
        trajs_in: set[str] = set()
        size = 0
        heads: dict[int, bytes] = {}

        def cut() -> None:
            nonlocal chunks, trajs_in, size
            req = pb.WriteRequest(run=run_id, writer=self.writer, epoch=self.epoch)
            for reason, n in self._unguided_unreported.items():
                req.unguided.add(reason=reason, count=n)
            self._unguided_unreported = {}
            payload = [x for c in chunks for x in c]
            outs.append(_Out(0, req, [], trajs_in, size, payload, born=win[0].queued, chunks=len(chunks)))
            chunks, trajs_in, size = [], set(), 0

        for s_idx, (name, site, *_) in enumerate(win[0].sites if runs else ()):
            cb, sb, rpt = site.code_bytes, site.scale_bytes, site.rows_per_token
            has_ts = win[0].sites[s_idx][5] > 0
            at = [f.sites[s_idx] for f in win]  # name, site, offset, nc, ns, nt, g_off
            codes = _gather_rows(npool, [(o, nc) for _, _, o, nc, _, _, _ in at], base, perm)
            scales = _gather_rows(npool, [(o + nc, ns) for _, _, o, nc, ns, _, _ in at], base, perm)
            ts = (
                _gather_rows(npool, [(o + nc + ns, nt) for _, _, o, nc, ns, nt, _ in at], base, perm)
                if has_ts
                else None
            )
            gb = [bytes(npool[x[6] : x[6] + 4]) for x in at]
            one_g = gb.count(gb[0]) == len(gb)
            tc, tsb, tt = rpt * cb, rpt * sb, rpt * 4  # bytes per token
            fields: dict[int, tuple[bytes, bytes, bytes, int]] = {}
            pos = 0
            for t, v, start, n_run, parts in runs:
                if one_g:
                    pieces = [(start, n_run, gb[0])]
                else:  # split where the global scale changes between forwards
                    pieces = []
                    for fi, _, n in parts:
                        if pieces and pieces[-1][2] == gb[fi]:
                            a0, n0, g0 = pieces[-1]
                            pieces[-1] = (a0, n0 + n, g0)
                        else:
                            pieces.append((start + sum(p[1] for p in pieces), n, gb[fi]))
                for a, n, g in pieces:
                    c = codes[pos * tc : (pos + n) * tc]
                    sc = scales[pos * tsb : (pos + n) * tsb]
                    tb = ts[pos * tt : (pos + n) * tt] if ts is not None else None
                    pos += n
                    gf = _F32.unpack(g)[0]
                    crc = chunk_checksum_parts(
                        run_id, v, t, name, a, n, n * rpt, cb, sb, [c], [sc], gf, [tb] if tb is not None else None
                    )
                    h = pb.Chunk(
                        policy_version=v, trajectory=t, site=name, token_start=a, n_tokens=n,
                        global_scale=gf, has_token_scales=has_ts, checksum=crc,
                    ).SerializeToString()  # fmt: skip
                    fl = fields.get(n)
                    if fl is None:
                        fl = fields[n] = (
                            len_field(_CODES, n * tc),
                            len_field(_SCALES, n * tsb),
                            len_field(_TOKEN_SCALES, n * tt) if has_ts else b"",
                            n * (tc + tsb + (tt if has_ts else 0)),
                        )
                    lc, ls, lt, per = fl
                    body = len(h) + len(lc) + len(ls) + len(lt) + per
                    lead = heads.get(body)
                    if lead is None:
                        lead = heads[body] = len_field(_WRITE_CHUNKS, body)
                    if size and size + per > self.batch_bytes:
                        cut()
                    chunks.append([lead, h, lc, c, ls, sc, lt, tb] if tb is not None else [lead, h, lc, c, ls, sc])
                    trajs_in.add(t)
                    size += per
                    if len(chunks) & 127 == 0:
                        time.sleep(0)  # let a waiting engine thread have the GIL (a window is ~50 ms of work)
        for f in win:
            self.pool.release(f.region.offset)
        if chunks:
            cut()

    def _messages(
        self, pieces: list[_Piece], extras: list[TrajectorySeal | PrefixLink], shm: bool
    ) -> list[tuple[list[list[_Piece]], list[TrajectorySeal | PrefixLink]]]:
        """Coalesce, then cut into messages of about ``batch_bytes``; seals and links ride in the
        last one (after the records they close)."""
        groups: list[list[list[_Piece]]] = [[]]
        size = 0
        for run in self._runs(pieces):
            n = sum(map(_NBYTES, run))
            if groups[-1] and size + n > self.batch_bytes:
                groups.append([])
                size = 0
            groups[-1].append(run)
            size += n
        out: list[tuple[list[list[_Piece]], list[TrajectorySeal | PrefixLink]]] = [(g, []) for g in groups]
        out[-1] = (groups[-1], list(extras))
        return [(g, e) for g, e in out if g or e]

    def _release(self, out: _Out) -> None:
        for p in out.pieces:
            p.region.refs -= 1
            if p.region.refs == 0:
                self.pool.release(p.region.offset)

    def _note(self, fwd: _Forward) -> None:
        """Wait for a forward's copies and note its trajectories' sites and version (for seals)."""
        region = fwd.region
        if region.event is not None:
            region.event.synchronize()
            region.event = None
        trajs = [t for t, _, _ in fwd.segs]
        names = tuple(name for name, *_ in fwd.sites)
        fs = self._names.get(names)
        if fs is None:
            fs = self._names[names] = frozenset(names)
        sites_of = self._sites_of
        prev = {t: sites_of[t] for t in trajs if sites_of.get(t, fs) is not fs}
        sites_of.update(dict.fromkeys(trajs, fs))
        for t, old in prev.items():
            sites_of[t] = old | fs
        self._version_of.update(dict.fromkeys(trajs, fwd.version))

    def _expand(self, fwd: _Forward) -> list[_Piece]:
        self._note(fwd)
        region = fwd.region
        pieces: list[_Piece] = []
        unguided = self._unguided
        view = self.pool.view
        segs = [(t, int(a), int(b) - int(a)) for t, a, b in fwd.segs]
        for name, site, off, nc, ns, nt, g_off in fwd.sites:
            g = bytes(view[g_off : g_off + 4])
            cb, sb, rpt = site.code_bytes, site.scale_bytes, site.rows_per_token
            per = cb + sb + (4 if nt else 0)
            row = 0
            version, queued, add = fwd.version, fwd.queued, pieces.append
            ts0 = off + nc + ns
            for t, a, n in segs:
                r = n * rpt
                if t not in unguided:
                    add(_Piece(t, name, version, a, n, region, off + row * cb, off + nc + row * sb,
                               ts0 + row * 4 if nt else -1, g_off, r * per, queued, g))  # fmt: skip
                row += r
        region.refs = len(pieces)
        if not pieces:
            self.pool.release(region.offset)
        return pieces

    def _seal(self, f: _Finish) -> TrajectorySeal | None:
        known = self._sites_of.pop(f.trajectory, None)
        version = self._version_of.pop(f.trajectory, self.policy_version)
        if f.n_tokens < 0 or f.trajectory in self._unguided:
            return None
        names = f.sites if f.sites is not None else tuple(sorted(known or self._sites))
        return TrajectorySeal(self.run_spec.run, version, f.trajectory, f.n_tokens, names)

    def _lingering(self) -> bool:
        """Hold the queue back until it fills a window (or its oldest record is ``linger_s`` old) so
        consecutive decode steps coalesce into chunks of many tokens. Holding only up to
        ``batch_bytes`` sent every ~2 steps of a 256 x 20-site decode batch (~2 tokens per chunk:
        per-chunk work on both sides made the sidecar fall behind at 25 ms steps). A forward that
        does not coalesce (:meth:`_coalesces`) goes at once."""
        queued = self._in_bytes - self._out_bytes
        if self._urgent or self._closed or queued >= self.window_bytes or not self._queue:
            return False
        first = self._queue[0]
        if isinstance(first, _Forward) and not self._coalesces(first):
            return False
        born = first.queued if isinstance(first, _Piece | _Forward) else 0.0
        return time.monotonic() - born < self.linger_s

    def _coalesces(self, fwd: _Forward) -> bool:
        """Whether ``fwd`` waits to be coalesced with later forwards (:meth:`_gather`): a decode-like
        forward of at most ``batch_bytes``. One whose sequences average >= ``_LONG_SEGMENT`` tokens
        (prefill) makes long chunks by itself and goes as it is (over shared memory: descriptors,
        no gather copy). Deciding by bytes alone made 6.3 MiB prefills with ``batch_bytes`` of 8
        MiB linger for a 64 MiB window and travel gathered, inline: 0.3 vs 1.0 GB/s in bench_ingest."""
        return fwd.nbytes <= self.batch_bytes and not fwd.long_segments

    def _take_batch(
        self, limit: int | None = None, fwds: list[_Forward] | None = None
    ) -> tuple[list[_Piece], list[TrajectorySeal | PrefixLink]]:
        """Take up to ``limit`` bytes off the queue (sender thread; callers keep appending meanwhile).
        With ``fwds``, forwards that coalesce (decode steps) go there whole, their bookkeeping done,
        for :meth:`_gather`; others are split into pieces."""
        limit = self.batch_bytes if limit is None else limit
        pieces: list[_Piece] = []
        extras: list[TrajectorySeal | PrefixLink] = []
        size = 0
        queue = self._queue
        while queue and size < limit:
            item = queue.popleft()
            if type(item) is _SlabForward:
                item = self._unslab(item)
            if fwds is not None and isinstance(item, _Forward) and self._coalesces(item):
                if size and size + item.nbytes > limit:
                    queue.appendleft(item)
                    break
                self._note(item)
                self._out_bytes += item.nbytes
                fwds.append(item)
                size += item.nbytes
                continue
            if isinstance(item, _Forward):
                expanded = self._expand(item)
                got = sum(map(_NBYTES, expanded))
                if size + got <= limit:  # all of it fits: no round trip through the queue
                    self._out_bytes += item.nbytes
                    pieces += expanded
                    size += got
                    continue
                # the pieces carry the bytes from here on (segments dropped as unguided do not)
                self._out_bytes += item.nbytes - got
                queue.extendleft(reversed(expanded))
                continue
            if isinstance(item, _Piece):
                self._out_bytes += item.nbytes
                if item.trajectory in self._unguided:
                    item.region.refs -= 1
                    if item.region.refs == 0:
                        self.pool.release(item.region.offset)
                    continue
                pieces.append(item)
                size += item.nbytes
            elif isinstance(item, _Finish):
                seal = self._seal(item)
                if seal is not None:
                    extras.append(seal)
                    size += 64
            else:
                if item.trajectory in self._unguided:
                    continue
                extras.append(item)
                size += 64
        return pieces, extras

    def _run(self) -> None:
        shm = self.pool.name is not None
        ch = None
        failures = 0  # attempts since the last acknowledgement: the backoff's exponent
        while True:
            with self._lock:
                if self._closed or self.error is not None:
                    break
            acks = self._acks_seen
            wait = 0.0
            try:
                if ch is None:
                    ch = channel(self.address, *self._credentials)
                self._stream(ch, shm)
            except _StreamError as exc:
                session = self._session_epoch(ch) if exc.code == "FAILED_PRECONDITION" else None
                self._on_stream_error(exc, session)
                if exc.code == "RESOURCE_EXHAUSTED":
                    wait = exc.retry_after
                if exc.code == "UNAVAILABLE" and ch is not None:
                    ch.close()
                    ch = None
            except Exception as exc:  # noqa: BLE001 - never let the sender die
                log.exception("recorder sender error: %s", exc)
            with self._lock:
                if self._closed or self.error is not None:
                    break
            # Every attempt that ended (refused, cut off, or ended by a draining sidecar) waits
            # before the next: without acknowledgements in between the wait grows, so a writer
            # the sidecar keeps refusing never spins on reconnects and resends (the engine's GIL).
            failures = 0 if self._acks_seen != acks else failures + 1
            cap = min(self.reconnect_cap_s, max(self.reconnect_backoff_s, self.give_up_s / 4))
            bound = min(cap, self.reconnect_backoff_s * 2.0 ** min(failures, 40))
            self._pause(max(wait, random.uniform(0.0, bound)))
            self._give_up_if_down()
        if ch is not None:
            ch.close()

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the recorder is closed meanwhile."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)

    def _session_epoch(self, ch: Any) -> int | None:
        """The epoch of this writer's session at the sidecar (``Stat``), None if unknown."""
        if ch is None:
            return None
        try:
            stat_call = method(ch, "Stat", "unary_unary")
            raw = stat_call(pb.StatRequest(run=self.run_spec.run).SerializeToString(), timeout=5)
            for w in pb.StatResponse.FromString(raw).writers:
                if w.run == self.run_spec.run and w.writer == self.writer:
                    return int(w.epoch)
        except Exception as exc:  # noqa: BLE001 - unknown: treated as a gap (a new epoch)
            log.warning("recorder %s: cannot read its session's epoch from the sidecar: %s", self.writer, exc)
        return None

    def _drop_pending(self) -> set[str]:
        """Drop every unacknowledged message and queued item, releasing their staging; return
        their trajectories. Under ``self._lock``, on the sender thread."""
        lost: set[str] = set()
        for out in self._unacked:
            lost |= out.trajectories
            self._release(out)
        self._unacked.clear()
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, _Forward):
                lost.update(t for t, _, _ in item.segs)
                if item.region.event is not None:  # a device copy may still be landing there
                    item.region.event.synchronize()
                self.pool.release(item.region.offset)
                self._out_bytes += item.nbytes
                continue
            lost.add(item.trajectory)
            if isinstance(item, _Finish):
                self._sites_of.pop(item.trajectory, None)
                self._version_of.pop(item.trajectory, None)
            if isinstance(item, _Piece):
                self._out_bytes += item.nbytes
                item.region.refs -= 1
                if item.region.refs == 0:
                    self.pool.release(item.region.offset)
        return lost

    def _stop_for_good(self, error: TraceStoreError, reason: str) -> None:
        """The sidecar will never take this writer's messages: stop sending, drop what is pending
        and mark every trajectory not yet sealed unguided. Under ``self._lock``, sender thread."""
        if self.error is not None:
            return
        self._stop_reason = reason
        self.error = error
        log.error("recorder %s stops: %s", self.writer, error)
        lost = self._drop_pending() | set(self._sites_of)  # the latter: recorded, not sealed
        self._sites_of.clear()
        self._version_of.clear()
        self._mark_unguided(lost, reason)
        self._wake.notify_all()

    def _give_up_if_down(self) -> None:
        with self._lock:
            down = self._down_since
            if down is None or time.monotonic() - down < self.give_up_s:
                return
            if not self._unacked and not self._queue:
                return
            # Only records that waited the whole give-up time are dropped; fresh ones get their chance.
            ages = [p.queued for o in self._unacked for p in o.pieces]
            ages += [o.born for o in self._unacked if o.pieces == []]
            queued = list(self._queue)  # one C call: atomic against callers appending
            ages += [p.queued for p in queued if isinstance(p, _Piece | _Forward)]
            if ages and time.monotonic() - min(ages) < self.give_up_s:
                return
            lost = self._drop_pending()
            # a fresh epoch: sequence restarts at 1, no gap with what the sidecar has
            self.epoch = max(self.epoch + 1, time.time_ns())
            self._next_seq = 1
            self._acked = 0
            self._mark_unguided(lost, "sidecar_unreachable")
            self._down_since = time.monotonic()
            self._wake.notify_all()

    def _stream(self, ch: Any, shm: bool) -> None:
        import grpc

        call = method(ch, "Write", "stream_stream")
        sendq: deque[_Out | None] = deque()
        send_cv = threading.Condition()
        first = [True]

        def requests() -> Iterator[bytes]:
            # Serialized here, when gRPC pulls the next message (its own thread): the one copy of a
            # message's payload exists only while gRPC sends it, however many are in flight.
            while True:
                with send_cv:
                    while not sendq:
                        send_cv.wait(0.5)
                    item = sendq.popleft()
                if item is None:
                    return
                if first[0]:
                    first[0] = False
                    req = pb.WriteRequest()
                    req.CopyFrom(item.req)
                    req.run_spec.CopyFrom(run_spec_to_pb(self.run_spec))
                    yield _Out(item.seq, req, [], set(), 0, item.payload).serialize()
                else:
                    yield item.serialize()

        def push(out: _Out) -> None:
            with send_cv:
                sendq.append(out)
                send_cv.notify()

        responses = call(requests(), wait_for_ready=False)
        stop = threading.Event()
        err: list[Any] = []

        def acks() -> None:
            try:
                for raw in responses:
                    r = pb.WriteResponse.FromString(raw)
                    released = r.released_sequence if r.HasField("released_sequence") else None
                    self._on_ack(r.epoch, r.durable_sequence, released)
            except grpc.RpcError as exc:
                err.append(exc)
            finally:
                stop.set()
                with self._lock:
                    self._wake.notify_all()

        t = threading.Thread(target=acks, daemon=True, name="tracestore-recorder-acks")
        t.start()
        try:
            with self._lock:
                resend = list(self._unacked)
            for out in resend:  # resend in order; the sidecar answers duplicates as success
                push(out)
                self.stats["resent"] += 1
            while not stop.is_set():
                with self._lock:
                    if self._closed and not self._queue and not self._unacked:
                        break
                    inflight = sum(o.nbytes for o in self._unacked)
                    if not self._queue or inflight > self.inflight_bytes or self._lingering():
                        self._wake.wait(0.02)
                        continue
                    fwds: list[_Forward] = []
                    pieces, extras = self._take_batch(self.window_bytes, fwds)
                    if shm and len(fwds) == 1:  # nothing to coalesce: its chunks travel as descriptors
                        pieces[:0] = self._expand(fwds.pop())
                    self._busy = bool(pieces or extras or fwds)
                if not pieces and not extras and not fwds:
                    continue
                try:
                    # Each message goes to gRPC as soon as it is built, not once the whole window
                    # is: building a 30 MiB window while the engine thread records its next
                    # forwards took ~25 ms in bench_ingest's burst, and the sidecar idled meanwhile.
                    outs = itertools.chain(
                        self._gather(fwds) if fwds else (),
                        (self._build(runs, ex, shm) for runs, ex in self._messages(pieces, extras, shm)),
                    )
                    for out in outs:
                        with self._lock:
                            out.seq = self._next_seq
                            out.req.epoch = self.epoch
                            out.req.sequence = out.seq
                            self._next_seq += 1
                            self._unacked.append(out)
                        self.stats["messages"] += 1
                        self.stats["chunks"] += out.chunks
                        self.stats["bytes"] += out.nbytes
                        push(out)
                finally:
                    with self._lock:
                        self._busy = False
                        self._wake.notify_all()
        finally:
            with send_cv:
                sendq.append(None)
                send_cv.notify()
            if not stop.is_set():
                stop.wait(1.0)
            if not stop.is_set():
                responses.cancel()
            t.join(timeout=5)
        if err:
            exc = err[0]
            code = exc.code().name if exc.code() is not None else "UNKNOWN"
            meta = dict(exc.trailing_metadata() or ())
            raise _StreamError(
                code,
                exc.details() or "",
                _int(meta.get("tracestore-failed-sequence")),
                _int(meta.get("retry-after-ms"), 0) / 1000.0,
            )

    def _on_ack(self, epoch: int, durable: int, released: int | None = None) -> None:
        """The sidecar's progress for ``epoch``: messages up to ``durable`` are durable; their
        staging is released too, up to ``released`` when the sidecar reports it (older sidecars
        do not: then with ``durable``)."""
        with self._lock:
            self._connected = True
            self._down_since = None
            if epoch != self.epoch:
                return
            if self._unacked and self._unacked[0].seq <= durable:
                self._acks_seen += 1  # acknowledged messages: the sidecar takes this writer's records
            # Held messages of earlier epochs: a sidecar copies them out before it accepts a new
            # epoch's first message (or it is not the one that held them), so this ack frees them.
            while self._unreleased and self._unreleased[0].req.epoch != epoch:
                self._release(self._unreleased.popleft())
            while self._unacked and self._unacked[0].seq <= durable:
                out = self._unacked.popleft()
                if out.req.seals:
                    self._note_sealed(out)
                if released is not None and out.seq > released and out.pieces:
                    self._unreleased.append(out)  # durable; the sidecar still reads its regions
                else:
                    self._release(out)
                self.stats["acked_messages"] += 1
            if released is not None:
                while self._unreleased and self._unreleased[0].seq <= released:
                    self._release(self._unreleased.popleft())
            self._acked = max(self._acked, durable)
            self._wake.notify_all()

    def _on_stream_error(self, exc: _StreamError, session_epoch: int | None = None) -> None:
        """A Write stream ended with ``exc``; ``session_epoch``: the epoch of this writer's session
        at the sidecar, when the error was FAILED_PRECONDITION and it could be read."""
        with self._lock:
            self._connected = False
            if self._down_since is None:
                self._down_since = time.monotonic()
            self.stats["reconnects"] += 1
            if exc.code == "PERMISSION_DENIED":
                self._stop_for_good(
                    PermissionDeniedError(
                        f"the sidecar at {self.address} refused writer {self.writer} of run {self.run_spec.run}: "
                        f"{exc.details}"
                    ),
                    "permission_denied",
                )
            elif exc.code == "FAILED_PRECONDITION" and session_epoch is not None and session_epoch > self.epoch:
                self._stop_for_good(
                    WriterFencedError(
                        f"writer {self.writer} of run {self.run_spec.run} is fenced at {self.address}: its session "
                        f"there has epoch {session_epoch}, newer than this recorder's {self.epoch} (another "
                        f"instance took this writer id over); give each instance its own writer id"
                    ),
                    "fenced",
                )
            elif exc.code in _CONTENT_ERRORS and exc.failed_seq is not None:
                # The sidecar refused one message for its content: drop it, mark its trajectories
                # unguided and renumber the later ones (the sidecar accepted none of them).
                self._down_since = None
                keep: deque[_Out] = deque()
                for out in self._unacked:
                    if out.seq == exc.failed_seq:
                        self._release(out)
                        self._mark_unguided(out.trajectories, exc.code.lower())
                        self.stats["rejected_messages"] += 1
                        log.warning("sidecar refused message %d: %s %s", out.seq, exc.code, exc.details)
                    else:
                        if out.seq > exc.failed_seq:
                            out.seq -= 1
                            out.req.sequence = out.seq
                        keep.append(out)
                self._unacked = keep
                self._next_seq -= 1
            elif exc.code == "FAILED_PRECONDITION":
                # gap or fenced epoch: start a new epoch; chunk-level dedupe makes the resend safe
                self.epoch = max(self.epoch + 1, time.time_ns())
                for i, out in enumerate(self._unacked, start=1):
                    out.seq = i
                    out.req.sequence = i
                    out.req.epoch = self.epoch
                self._next_seq = len(self._unacked) + 1
                log.warning("sidecar: %s; restarting as epoch %d", exc.details, self.epoch)
            self._wake.notify_all()


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
        self._cuda = dev.type == "cuda"

    def capture(self) -> None:
        """Stage the slabs' rows into the selected ring slot (inside the captured region)."""
        for slab, rows, ring in zip(self.slabs, self.rows, self.rings, strict=True):
            self._stage(slab, rows, ring, self.slot)

    def commit(self, segments: Sequence[tuple[str, int, int]], policy_version: int | None = None) -> bool:
        """Queue the last replay's rows for ``segments`` (as :meth:`RolloutRecorder.record_slab`)."""
        k = self.k
        ok, ev = self.recorder._queue_slabs(segments, self.slabs, None, policy_version, self._views[k], False)
        self._events[k] = ev
        self.k = k = (k + 1) % self.slots
        self.slot.fill_(k)
        nxt = self._events[k]
        if nxt is not None and self._cuda:
            import torch

            torch.cuda.current_stream().wait_event(nxt)
        return ok


class _StreamError(Exception):
    def __init__(self, code: str, details: str, failed_seq: int | None, retry_after: float) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details, self.failed_seq, self.retry_after = code, details, failed_seq, retry_after


def _gather_rows(pool: np.ndarray, spans: list[tuple[int, int]], n_tok: int, perm: np.ndarray) -> memoryview:
    """The staged bytes ``pool[o : o + n]`` of each forward, joined (``n_tok`` tokens in all, equal
    bytes per token) and reordered by token: ``perm`` lists the window tokens to keep, in order."""
    joined = np.concatenate([pool[o : o + n] for o, n in spans]).reshape(n_tok, -1)
    return np.take(joined, perm, axis=0).reshape(-1).data


_REF_STATE_LIMIT = 1 << 20  # entries per TraceRef bookkeeping dict of a recorder


def _bounded_put(d: dict[Any, Any], key: Any, value: Any) -> None:
    """``d[key] = value``, dropping the oldest entry once ``d`` holds :data:`_REF_STATE_LIMIT`."""
    if key not in d and len(d) >= _REF_STATE_LIMIT:
        d.pop(next(iter(d)))
    d[key] = value


def _int(v: Any, default: int | None = None) -> Any:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _is_cuda(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False))


def _per_row_g(out: SiteOutput, name: str, rows: int) -> SiteOutput:
    """``out`` with a per-row global scale moved into the token scales (chunk g 1.0); one value
    passes unchanged. A g of another length, or one per row beside token scales, is refused."""
    g = out.global_scale
    n = getattr(g, "numel", None)
    n = n() if callable(n) else getattr(g, "size", 1)
    if n == 1:
        return out
    if n != rows:
        raise ShapeError(
            f"{name}.global_scale has {n} values: give the forward's one decode-side g, or one per row ({rows})"
        )
    if out.token_scales is not None:
        raise ConfigError(
            f"{name}: a per-row global_scale and token_scales together cannot be stored exactly (the record keeps "
            "one per-row scale); fold them into one per-row scale"
        )
    if not _dtype_is_cached(getattr(g, "dtype", None), "float32"):
        raise DTypeError(f"{name}.global_scale per row must be float32, got {getattr(g, 'dtype', type(g).__name__)}")
    return SiteOutput(out.codes, out.scales, 1.0, g.reshape(-1))


def _scalar(g: Any) -> float:
    if hasattr(g, "item"):
        return float(g.reshape(-1)[0].item()) if hasattr(g, "reshape") else float(g.item())
    return float(g)


def _as_bytes(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().contiguous().numpy()
    arr = np.ascontiguousarray(x)
    return arr.reshape(-1).view(np.uint8)


def _dtype_is(dt: Any, want: str) -> bool:
    return str(dt if dt is not None else "").endswith(want)


# str() of a numpy dtype is Python code (~2.5 us; 40 calls per decode step of 20 sites): decided
# once per dtype object (numpy and torch dtypes are hashable singletons)
_dtype_is_cached = functools.lru_cache(maxsize=256)(_dtype_is)


def _check(x: Any, shape: tuple[int, ...], name: str, dtype: str = "uint8") -> None:
    got = tuple(getattr(x, "shape", ()))
    if got != shape:
        raise ShapeError(f"{name} must have shape {list(shape)}, got {list(got)}")
    dt = getattr(x, "dtype", None)
    try:
        ok = _dtype_is_cached(dt, dtype)
    except TypeError:  # an unhashable dtype-like attribute: decided every time
        ok = _dtype_is(dt, dtype)
    if not ok:
        raise DTypeError(f"{name} must have dtype {dtype}, got {dt if dt is not None else ''}")


def _socket_group(address: str) -> int | None:
    """The group of the sidecar's unix socket at ``address`` when the socket admits that group
    and this process is in it (then the sidecar reads only pools of that group, server/shm.py)."""
    if not address.startswith("unix:"):
        return None
    path = address.removeprefix("unix:")
    if path.startswith("//"):
        path = path[2:]
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or not st.st_mode & stat.S_IWGRP:
        return None
    mine = st.st_gid == os.getegid() or st.st_gid in os.getgroups() or os.geteuid() == 0
    return st.st_gid if mine else None


__all__ = ["RolloutRecorder", "SiteOutput", "SlabStage", "WriterFencedError"]
