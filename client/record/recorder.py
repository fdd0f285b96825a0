"""RolloutRecorder: the rollout engine's side of tracestore. Never blocks, never crashes the engine.

Per forward, :meth:`RolloutRecorder.record_forward` copies each site's record rows (a GPU slab slice
or CPU memory) into the staging pool — on a side CUDA stream, non-blocking, when the rows live on a
GPU — and queues one descriptor per (segment, site). A background thread waits for the copies,
numbers messages per writer ``(writer, epoch, sequence)``, streams them to the sidecar (offsets into
shared memory over a unix socket, inline bytes over TCP), and releases staging when the sidecar
acknowledges the sequence as durable — or, over shared memory, once the sidecar also reports it
released (``released_sequence``: a sidecar with a WAL may read on from staging until the shard is
written instead of copying it out, see server/engine/core.py). On a lost connection it reconnects
and resends the unacknowledged messages (the sidecar answers duplicates as success). When it cannot
keep up — staging full, sidecar unreachable for ``give_up_s`` — it drops the affected trajectories,
marks them unguided (they are never sealed, so a reader sees them as incomplete), counts them, and
carries on.

This module is the engine-facing part: arguments, staging copies and the queue. The sender's
parts own their state: :mod:`tracestore.client.record.items` (the queue items and the unguided ledger),
:mod:`tracestore.client.record.outbox` (the sender's end of the queue), :mod:`tracestore.client.record.chunks`
(the chunk builder) and :mod:`tracestore.client.record.session` (the Write stream, acknowledgements,
reconnects, fencing and giving up).

Example::

    rec = RolloutRecorder("unix:///run/tracestore.sock", run_spec, writer="node3-gpu0")
    rec.record_forward([("traj-1", 0, 12), ("traj-2", 0, 9)], {"layers.23.mlp.input": SiteOutput(codes, scales, g)})
    rec.finish("traj-1", n_tokens=13); rec.flush(timeout=30); rec.close()
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from tracestore.client.transport import resolve_token

from tracestore.errors import ConfigError, ShapeError, TraceStoreError, ValidationError
from tracestore.identity import as_token_ids
from tracestore.records import PrefixLink, RunSpec, validate_id, validate_version
from tracestore.settings import SHM_GROUP, read_env
from tracestore.site_output import SiteOutput, check_array, per_row_g

from .chunks import ChunkBuilder
from .config import RecorderConfig
from .copier import StagingCopier
from .items import Finish, Forward, Region, SlabForward, Unguided
from .outbox import Outbox
from .session import WriterFencedError, WriteSession
from .slab import SegmentCheck, Segments, SlabStage
from .slab_queue import LONG_SEGMENT, RecorderStageHost, SlabQueue
from .staging import StagingPool, socket_group
from .traceref import SealLedger

log = logging.getLogger("tracestore.client")


def join_record_branches() -> None:
    """Record kernels this thread forked onto a ``tracestore.kernels.RecordBranch`` join the current
    stream before their rows are staged (nothing to do when the branch module was never loaded)."""
    branch = sys.modules.get("tracestore.kernels.branch")
    if branch is not None:
        branch.join_pending()


class RolloutRecorder:
    """Streams a rollout's TRACE records to a sidecar. See the module docstring.

    ``address``: ``"host:port"`` or ``"unix:///path/sock"`` (then shared-memory staging is used);
    ``writer``: this engine instance's id (unique per run); ``epoch``: defaults to the current
    time in ns, so a restarted engine fences its predecessor. ``pin``: register the staging pool
    with CUDA now (default: when torch is already imported and sees a GPU). ``linger_s``: how long
    decode forwards may wait to be coalesced with later ones (a window of up to half the pool)
    before they are sent; ``flush`` sends at once.
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
        linger_s: float = 4.0,
        channel_credentials: Any = None,
        token: str | None = None,
    ) -> None:
        cfg = RecorderConfig(
            staging_bytes, batch_bytes, shared_memory, shm_dir, shm_group, give_up_s, reconnect_backoff_s,
            reconnect_cap_s, epoch, connect, pin, linger_s, channel_credentials, token,
        )  # fmt: skip
        self.config = cfg
        if not isinstance(run_spec, RunSpec):
            raise ConfigError(f"run_spec must be a tracestore.records.RunSpec, got {type(run_spec).__name__}")
        validate_id("writer", writer)
        self.address = address
        # checked here, not in the sender thread: a token that would travel in the clear is refused now
        self._credentials = (channel_credentials, resolve_token(address, channel_credentials, token))
        self.run_spec = run_spec
        self.writer = writer
        policy_version = validate_version(policy_version)  # checked before the pool exists; the Outbox keeps it
        self.batch_bytes = int(batch_bytes)
        # Decode steps wait until half the pool is queued (or linger_s passed) and are coalesced:
        # a (trajectory, site) gets one chunk per window, and per-chunk work dominates both sides.
        self.window_bytes = max(self.batch_bytes, staging_bytes // 2)
        # Unacknowledged bytes in flight before the sender waits for acks. They hold staging until
        # acknowledged (nothing else: messages are serialized as gRPC sends them), so half the
        # pool, enough to keep the sender busy between shard commits when acks wait for them.
        # no WAL, 384 MiB over shm: 0.34 GB/s, against 0.26 GB/s with 32 MiB in flight
        self.inflight_bytes = max(8 * self.batch_bytes, staging_bytes // 2)
        self.linger_s = cfg.linger_s
        self.give_up_s = cfg.give_up_s
        self.reconnect_backoff_s = cfg.reconnect_backoff_s
        self.reconnect_cap_s = cfg.reconnect_cap_s
        shared = address.startswith("unix:") if shared_memory is None else bool(shared_memory)
        if shared and shm_group is None and read_env(SHM_GROUP) is None:
            shm_group = socket_group(address)
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
        self._check_segments = SegmentCheck()
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
            dropped=0,  # messages and queued records dropped unacknowledged (given up, refused, stopped, closed)
            stale_pools_removed=self.pool.stale_removed,  # left in shm_dir by recorders that died
            driver_copies=0,  # slab forwards copied through the CUDA driver (client/record/_cuda.py), not torch
            stager_behind=0,  # SlabStage commits that queued pending copies themselves (the stager lagged)
        )
        self._unguided = Unguided(self.stats)
        self._unguided_ids = self._unguided.ids  # read on the engine thread, without a lock
        self._outbox = Outbox(
            run_spec,
            self.pool,
            self._np,
            self._unguided,
            policy_version,
            batch_bytes=self.batch_bytes,
            window_bytes=self.window_bytes,
            linger_s=self.linger_s,
        )
        # Callers append (deque.append is atomic), the sender pops: the engine thread never waits
        # for a lock the sender holds while it expands and serializes.
        self._queue = self._outbox.queue
        self._chunks = ChunkBuilder(
            run_spec, writer, self.pool, self._np, self.batch_bytes, self._unguided, self._outbox.ledger
        )
        self._seals = SealLedger(self._lock, self._unguided, writer, run_spec.run)  # for refs()
        self._session = WriteSession(
            address,
            self._credentials,
            run_spec,
            writer,
            int(epoch) if epoch is not None else time.time_ns(),
            self._outbox,
            self._chunks,
            self._unguided,
            self._wake,
            self.stats,
            self._seals.note_sealed,
            shm=self.pool.name is not None,
            give_up_s=self.give_up_s,
            reconnect_backoff_s=self.reconnect_backoff_s,
            reconnect_cap_s=self.reconnect_cap_s,
            inflight_bytes=self.inflight_bytes,
        )
        self._thread = self._session.thread
        self._copier = StagingCopier(self.pool, self._np, self.stats, writer)
        self._slabs = SlabQueue(
            run_spec, self.pool, self._copier, self._outbox, self._unguided, self.stats, self._check_segments,
            self._session,
        )  # fmt: skip
        self._stages: list[SlabStage] = []  # slab_stage()'s, whose commits may defer their copies
        self._stage_lock = threading.Lock()  # held while a stage queues deferred copies
        if connect:
            self._session.start()

    @classmethod
    def from_config(
        cls, address: str, run_spec: RunSpec, writer: str, config: RecorderConfig, policy_version: int = 0
    ) -> RolloutRecorder:
        """A recorder with the settings of ``config`` (the keyword arguments' values as one value)."""
        if not isinstance(config, RecorderConfig):
            raise ConfigError(f"config must be a RecorderConfig, got {type(config).__name__}")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}  # (no deep copy)
        return cls(address, run_spec, writer, policy_version, **fields)

    @property
    def _side_stream(self) -> Any:
        """The side CUDA stream of the staging copies (None before the first copy from a GPU)."""
        return self._copier.side_stream

    @property
    def epoch(self) -> int:
        """This writer's epoch at the sidecar (a new one after a sequence gap or giving up)."""
        return self._session.epoch

    @property
    def error(self) -> TraceStoreError | None:
        """Why the recorder stopped for good (fenced, refused), else None."""
        return self._session.error

    # -- engine-facing API (never blocks on the network) ------------------------------------------

    def record_forward(
        self,
        segments: Sequence[tuple[str, int, int]] | Segments,
        outputs: dict[str, SiteOutput],
        policy_version: int | None = None,
        token_ids: Any = None,
    ) -> bool:
        """Queue one forward's records. ``segments`` are the forward's rows in order,
        ``(trajectory, token_start, token_end)``; each site's tensors hold those rows
        (x ``rows_per_token``), as a list of tuples or a :class:`Segments` (column form, cheaper
        per decode step). Returns False when the forward was refused (staging full or
        recorder closed): its trajectories are then unguided. Bad arguments raise.

        ``token_ids``: the input token id of each of the forward's tokens, in segment order (1-D,
        integers in 0..2^31-1; numpy, a list or a torch tensor). With them every chunk carries its
        token identity (:mod:`tracestore.identity`), which readers check against the trainer's
        token ids; a trajectory's ids must be given from its position 0 on (a forward starting
        past the ids known leaves the trajectory's later chunks without identity).

        Cost on the caller's thread does not grow with the sender's work: no lock the sender holds,
        no per-segment Python loop (checks run in C over the segment list), one staging
        reservation, copies that keep the GIL (one that let it go could wait a switch interval to
        get it back while the sender runs) and one queue append. Splitting into chunks, coalescing
        and serialization run on the sender thread.
        """
        if self._stages:
            self._drain_stages()
        join_record_branches()
        version = self.policy_version if policy_version is None else validate_version(policy_version)
        segs = segments if isinstance(segments, (list, Segments)) else list(segments)
        trajs, n_tok = self._check_segments(segs)
        ids = None if token_ids is None else as_token_ids(token_ids)
        if ids is not None and ids.size != n_tok:
            raise ShapeError(f"token_ids holds {ids.size} ids; the segments hold {n_tok} tokens (one id per token)")
        plans = []
        total = 0
        for name, out in outputs.items():
            site = self._sites.get(name)
            if site is None:
                raise ValidationError(f"run {self.run_spec.run} declares no site {name!r}: {list(self._sites)}")
            rows = n_tok * site.rows_per_token
            check_array(out.codes, (rows, site.code_bytes), f"{name}.codes")
            check_array(out.scales, (rows, site.scale_bytes), f"{name}.scales")
            out = per_row_g(out, name, rows)
            if out.token_scales is not None:
                check_array(out.token_scales, (rows,), f"{name}.token_scales", dtype="float32")
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
            self._unguided.mark(list(trajs), "staging_full")
            return False
        region = Region(off, total, refs=0)
        sites = []
        copies = []
        for name, site, out, rel, nc, ns, nt in plans:
            o = off + rel
            g_off = o + nc + ns + nt
            copies.append((out, o, nc, ns, nt, g_off))
            sites.append((name, site, o, nc, ns, nt, g_off))
        region.event = self._copier.sites(copies)
        nbytes = sum(p[4] + p[5] + p[6] for p in plans)
        long_segments = n_tok >= LONG_SEGMENT * len(segs)
        self._queue.append(
            Forward(segs, version, sites, region, time.monotonic(), nbytes, long_segments, ids)
        )  # atomic
        self._outbox.in_bytes += nbytes  # written by callers only
        return True

    def record_slab(
        self,
        segments: Sequence[tuple[str, int, int]] | Segments,
        slab: Any,
        n_rows: int | Sequence[int] | None = None,
        policy_version: int | None = None,
        token_ids: Any = None,
    ) -> bool:
        """Queue one forward recorded into a :class:`tracestore.kernels.RecordSlab` (or a few, one
        per ``rows_per_token``): its rows ``[0, n_rows)`` for ``segments``, the forward's
        ``(trajectory, token_start, token_end)`` rows in order (a list, or :class:`Segments`: the
        same in column form, the cheap one per decode step). One copy per slab, whatever the number
        of sites: from a GPU a non-blocking copy on the side stream into pinned staging, after which
        the engine's current stream waits for it (the next forward rewrites the slab); the per-site
        layout is made on the sender thread. ``n_rows`` (optional) is the rows the engine wrote,
        checked against the segments' tokens × ``rows_per_token``. A site whose rows carry different
        g values (per-token NVFP4 activation scales) is stored with them as token scales (chunk
        g 1.0: the same dequantized values bit for bit); one g per site is stored as the chunk's g.
        Returns False when refused (staging full, recorder stopped): its trajectories are then
        unguided. Bad arguments raise (ValidationError for a site the run does not declare,
        ShapeError naming the site or slab otherwise). ``token_ids``: as for :meth:`record_forward`
        (each chunk's token identity).

        Inside a CUDA graph, use :meth:`slab_stage`."""
        if self._stages:
            self._drain_stages()
        join_record_branches()
        slabs = tuple(slab) if isinstance(slab, (list, tuple)) else (slab,)
        ids = None if token_ids is None else as_token_ids(token_ids)
        ok, _ = self._slabs.queue(segments, slabs, n_rows, policy_version, None, True, ids=ids)
        return ok

    def slab_stage(self, slab: Any, rows: int | None = None, slots: int = 4, deferred: bool = True) -> SlabStage:
        """The CUDA-graph form of :meth:`record_slab`: a :class:`SlabStage` whose ``capture()`` goes
        inside the engine's captured graph (after the last record kernel) and whose
        ``commit(segments)`` the engine calls once after each replay. ``rows``: the slab rows the
        graph stages (default its capacity, i.e. the graph's batch); ``slots``: device ring slots (a
        step's staging copy has ``slots - 1`` steps to be queued and land before its slot is written
        again); ``deferred``: on a GPU, commits leave the copies to the stage's stager thread (see
        :class:`SlabStage`)."""
        host = RecorderStageHost(
            self.writer, self.stats, self._copier, self._stage_lock, self._slabs, self._outbox, self._unguided
        )
        stage = SlabStage(host, slab, rows, slots, deferred)
        self._stages.append(stage)
        return stage

    def _drain_stages(self) -> None:
        """Queue the copies the slab stages' commits deferred (before what must follow them in
        order: a seal, a link, another forward, a flush), and raise an error one of them met."""
        for stage in self._stages:
            stage.drain()

    def _admit(self, segs: Collection[tuple[str, int, int]], trajs: tuple[str, ...]) -> bool:
        """Whether a forward of ``segs`` is staged at all (:meth:`SlabQueue.admit`)."""
        return self._slabs.admit(segs, trajs)

    def _unslab(self, fwd: SlabForward) -> SlabForward:
        """Lay a slab forward's raw rows out per site (what the sender does first with one)."""
        return self._outbox.unslab(fwd)

    def link_prefix(self, trajectory: str, source: str, n_tokens: int, policy_version: int | None = None) -> None:
        """Declare that ``trajectory``'s tokens ``[0, n_tokens)`` are ``source``'s (shared prompt)."""
        if self._stages:
            self._drain_stages()
        v = self.policy_version if policy_version is None else validate_version(policy_version)
        if self._session.error is None:  # (a stopped recorder's queue has no reader)
            self._queue.append(PrefixLink(self.run_spec.run, v, trajectory, source, n_tokens))

    def finish(self, trajectory: str, n_tokens: int, sites: Sequence[str] | None = None) -> bool:
        """Seal ``trajectory`` (``n_tokens`` = its full length; the last position is unrecorded by
        design). Returns False if it is unguided (then it is not sealed). The seal's sites (default:
        every site this recorder queued for it) and policy version are resolved by the sender, after
        the forwards queued before it."""
        validate_id("trajectory", trajectory)
        n_tokens = int(n_tokens)
        if n_tokens < 1:  # no seal has that length: refused here, not by the sender thread
            raise ValidationError(f"finish({trajectory!r}): n_tokens must be >= 1, got {n_tokens}")
        if self._stages:
            self._drain_stages()
        version = self._outbox.versions.get(trajectory, self.policy_version)
        self._seals.finished(trajectory, n_tokens, version)
        session = self._session
        if session.error is not None:  # stopped: nothing is sealed, and its queue has no reader
            self._unguided.mark([trajectory], session.stop_reason)
            return False
        if trajectory in self._unguided_ids:
            self._queue.append(Finish(trajectory, -1, None))  # forget its bookkeeping, in order
            return False
        names = None if sites is None else tuple(sorted(sites))
        if names is not None:
            unknown = [s for s in names if s not in self._sites]
            if unknown:
                raise ValidationError(f"run {self.run_spec.run} declares no sites {unknown}: {list(self._sites)}")
        self._queue.append(Finish(trajectory, int(n_tokens), names))
        return True

    @property
    def policy_version(self) -> int:
        """The policy version records are stamped with when a call does not name one."""
        return self._outbox.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        # checked at the call: a version the wire cannot carry (int64) failed only on the sender
        # thread, which then dropped every record it had taken with it
        self._outbox.policy_version = validate_version(version)

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is durably acknowledged or dropped. True only when nothing
        was dropped while it waited: False when ``timeout`` passed first, when records were dropped
        meanwhile (the sidecar acknowledged nothing for ``give_up_s``, or refused a message for its
        content: their trajectories are unguided, ``rec.unguided`` says which) and at once when the
        recorder stopped (:attr:`error`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._stages:
            self._drain_stages()
        with self._lock:
            dropped = self.stats["dropped"]
            self._outbox.urgent = True  # send now, do not linger
            self._wake.notify_all()
            try:
                while self._queue or self._session.pending() or self._session.error is not None:
                    if self._session.error is not None:
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(0.1 if left is None else min(left, 0.1))
            finally:
                self._outbox.urgent = False
            return self.stats["dropped"] == dropped

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush (up to ``timeout``), stop the sender and free the staging pool. Returns the
        flush's result; what was not acknowledged by then is dropped and its trajectories are
        unguided (``closed_unacknowledged``)."""
        try:
            for stage in self._stages:
                stage.close()
            ok = self.flush(timeout)
        finally:
            self._stages.clear()
            self._session.close()
            self.pool.close()
        return ok

    @property
    def unguided(self) -> frozenset[str]:
        return frozenset(self._unguided_ids)

    def attempt(self, trajectory: str, attempt: int | None = None) -> str:
        """The stored id to record ``attempt`` of ``trajectory`` under (``"<trajectory>::a<n>"``,
        :func:`tracestore.client.record.traceref.attempt_id`); default: the next attempt this
        recorder has not handed out. Attempts of one trajectory on one recorder must increase, so a
        retried or aborted rollout never writes under an earlier attempt's id (across recorders,
        pass the framework's own retry counter)."""
        return self._seals.attempt(trajectory, attempt)

    def refs(self, trajectories: Sequence[str], timeout: float = 60.0) -> list[Any]:
        """One :class:`tracestore.client.record.traceref.TraceRef` per stored id of ``trajectories``
        (each finished with :meth:`finish`), in order. Waits up to ``timeout`` seconds for every
        seal to be durable and for the sidecar to report the shard holding it committed to storage;
        a trajectory that is unguided, or not durable or published by then, gets an unguided ref
        (``guided=False`` and its ``reason``). A guided ref therefore names records a trainer can
        read from storage."""
        from tracestore.client.transport import channel

        from .traceref import RefSource, make_refs

        source = RefSource(
            self.writer, self.run_spec, self._seals, lambda t: self.flush(timeout=t),
            lambda: channel(self.address, *self._credentials),
        )  # fmt: skip
        return make_refs(source, list(trajectories), timeout)


__all__ = ["RolloutRecorder", "Segments", "SiteOutput", "SlabStage", "WriterFencedError"]
