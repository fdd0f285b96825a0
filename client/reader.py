"""GuidanceReader: the trainer's side. Plan in, ``{site: Guidance}`` out, aligned row for row.

``source`` is a storage URL (direct ranged reads through :class:`tracestore.storage.reader.StoreReader`;
the scalable path, no sidecar involved) or a sidecar address (``host:port`` / ``unix:///sock``,
the ``Read`` RPC; ``grpcs://host:port`` for TLS, or ``channel_credentials=`` and ``token=``
for a sidecar that requires them, see :func:`tracestore.client.transport.channel`). The next
plan can be fetched in the background (:meth:`GuidanceReader.prefetch`) while the current
microbatch trains. With ``process=True`` (storage URLs) every read decodes in a
child process and lands in shared memory (:mod:`tracestore.client.read_process`); ``process=N``
splits each read's rows among N children. Beside a training loop that keeps the GIL busy, a
prefetch in a thread of the trainer waits for that lock between its copies, a child does not;
and N children decode on N cores where one process reaches about 2. Results are torch tensors on
``device``; for a CUDA device the host arrays are pinned (in the prefetch thread, for a prefetched
plan) and copied with ``non_blocking=True`` on the current stream.

Example::

    reader = GuidanceReader("s3://bucket/trace", "run-1", sites=my_stage_sites, device="cuda")
    reader.prefetch(next_plan)
    guidance = reader.read(plan)             # {site: Guidance}
    y = tracestore.kernels.guided_fp4(x, guidance["layers.23.mlp.input"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tracestore.errors import (
    ConfigError,
    CorruptionError,
    MissingRecordsError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TraceStoreError,
    UnauthenticatedError,
    ValidationError,
)
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec, SiteSpec, validate_id

from .transport import channel, is_sidecar_address, method

PlanLike = MicrobatchPlan | Sequence[tuple[str | None, int, int]]


class HostRows:
    """One site's plan-aligned rows as numpy arrays (what both sources produce)."""

    def __init__(
        self,
        site: SiteSpec,
        codes: np.ndarray,
        scales: np.ndarray,
        global_scale: np.ndarray,
        token_scales: np.ndarray | None,
        valid: np.ndarray,
        policy_version: np.ndarray,
    ) -> None:
        self.site, self.codes, self.scales, self.global_scale = site, codes, scales, global_scale
        self.token_scales, self.valid, self.policy_version = token_scales, valid, policy_version


class GuidanceReader:
    """Reads guidance for microbatch plans. See the module docstring."""

    def __init__(
        self,
        source: str,
        run: str,
        *,
        versions: int | Iterable[int] | None = None,
        sites: Iterable[str] | None = None,
        columns: tuple[int, int] | None = None,
        device: Any = "cpu",
        on_missing: str = "error",
        prefetch: bool = True,
        rule: str = "bracket",
        storage_options: dict[str, Any] | None = None,
        timeout: float = 120.0,
        process: bool | int = False,
        channel_credentials: Any = None,
        token: str | None = None,
    ) -> None:
        validate_id("run", run)
        if on_missing not in ("error", "mask"):
            raise ConfigError(f"on_missing must be 'error' or 'mask', got {on_missing!r}")
        self.source = source
        self.run = run
        self.versions = versions
        self.sites = None if sites is None else [validate_id("site", s) for s in sites]
        self.columns = columns
        self.device = device
        self.on_missing = on_missing
        self.rule = rule
        self.timeout = timeout
        self.sidecar = is_sidecar_address(source)
        self._lock = threading.Lock()
        self._pending: dict[tuple[Any, ...], Future[dict[str, _Staged]]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracestore-prefetch") if prefetch else None
        self._channel: Any = None
        self._process: Any = None
        self.last_report: ReadReport | None = None  # of the latest read() / read_host()
        if not isinstance(process, int) or process < 0:  # (bool is an int: True is one child)
            raise ConfigError(f"process must be False, True or a number of child processes, got {process!r}")
        if process and (self.sidecar or source.startswith("memory://")):
            raise ConfigError(
                f"process=True reads a storage URL another process can open (file://, s3://, ...), not {source!r}"
            )
        if process and not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
            raise ConfigError("process=True needs Linux (memfd_create and SCM_RIGHTS); read in this process instead")
        if self.sidecar:
            self._channel = channel(source, channel_credentials, token)
            self._store_reader = None
            self.spec: RunSpec | None = None
        else:
            from tracestore.storage.reader import StoreReader
            from tracestore.storage.store import Store

            self._store = Store(source, storage_options)
            self._store_reader = StoreReader(self._store, run)
            self.spec = self._store_reader.spec
            if process:
                from .read_process import ReadProcesses

                self._process = ReadProcesses(source, run, storage_options, timeout, n=int(process))

    # -- public -----------------------------------------------------------------------------------

    def prefetch(self, plan: PlanLike) -> None:
        """Start reading ``plan`` in the background; a later :meth:`read` of the same plan uses it."""
        if self._pool is None:
            return
        key = _plan_key(plan)
        with self._lock:
            if key not in self._pending:
                # In the background, beside the training loop's Python: short copies and CRCs keep
                # the GIL instead of queueing for it after each (tracestore.storage.reader._copy_held).
                # The rows are staged there too (pinned for a CUDA device): read() then only
                # queues the non-blocking copies to the device.
                self._pending[key] = self._pool.submit(self._staged, plan, True, self._cuda_index())

    def read(self, plan: PlanLike) -> dict[str, Any]:
        """``{site: tracestore.guidance.Guidance}`` for ``plan`` (rows in plan order, with ``valid``).
        The result's ``report`` (also :attr:`last_report`) says which share of its rows falls back
        to RTN (:class:`ReadReport`)."""
        key = _plan_key(plan)
        with self._lock:
            fut = self._pending.pop(key, None)
        staged = fut.result() if fut is not None else self._staged(plan)
        report = read_report(plan, {name: (rows.site, rows.valid.numpy()) for name, rows in staged.items()})
        self.last_report = report
        return Rows({name: self._to_guidance(rows) for name, rows in staged.items()}, report)

    def read_host(self, plan: PlanLike) -> dict[str, HostRows]:
        """The same rows as numpy arrays (no torch needed), with the same ``report``."""
        rows_of = self._fetch(plan)
        report = read_report(plan, {name: (rows.site, rows.valid) for name, rows in rows_of.items()})
        self.last_report = report
        return Rows(rows_of, report)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._channel is not None:
            self._channel.close()
        if self._process is not None:
            self._process.close()

    def __enter__(self) -> GuidanceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching ---------------------------------------------------------------------------------

    def _fetch(self, plan: PlanLike, background: bool = False) -> dict[str, HostRows]:
        if not isinstance(plan, MicrobatchPlan):
            plan = MicrobatchPlan(plan)
        if self.sidecar:
            return self._fetch_sidecar(plan)
        if self._process is not None:
            return self._fetch_process(plan)
        assert self._store_reader is not None
        result = self._store_reader.read(
            plan,
            versions=self.versions,
            sites=self.sites,
            columns=self.columns,
            on_missing="mask" if self.on_missing == "mask" else "error",
            hold_gil=background,
        )
        out = {}
        for name in result:
            r = result[name]
            out[name] = HostRows(r.site, r.codes, r.scales, r.global_scale, r.token_scales, r.valid, r.policy_version)
        return out

    def _fetch_process(self, plan: MicrobatchPlan) -> dict[str, HostRows]:
        assert self.spec is not None and self._store_reader is not None
        got = self._process.read(
            _segments(plan),
            self._store_reader.layout(plan.n_tokens, self.sites, self.columns),
            versions=self.versions,
            sites=self.sites,
            columns=self.columns,
            on_missing="mask" if self.on_missing == "mask" else "error",
        )
        return {
            name: HostRows(self.spec.site(name), codes, scales, g, ts, valid, pv)
            for name, (codes, scales, g, valid, pv, ts) in got.items()
        }

    def _fetch_sidecar(self, plan: MicrobatchPlan) -> dict[str, HostRows]:
        import grpc

        from tracestore.v1 import tracestore_pb2 as pb

        if self.spec is None:
            self.spec = self._run_spec_from_sidecar()
        versions = (
            []
            if self.versions is None
            else ([int(self.versions)] if isinstance(self.versions, int) else [int(v) for v in self.versions])
        )
        req = pb.ReadRequest(
            run=self.run,
            plan=[pb.Segment(trajectory=s[0] or "", token_start=s[1], token_end=s[2]) for s in _segments(plan)],
            versions=versions,
            sites=self.sites or [],
            on_missing=pb.ON_MISSING_MASK if self.on_missing == "mask" else pb.ON_MISSING_ERROR,
            has_columns=self.columns is not None,
            column_start=self.columns[0] if self.columns else 0,
            column_end=self.columns[1] if self.columns else 0,
        )
        parts: dict[str, list[Any]] = {}
        try:
            for raw in method(self._channel, "Read", "unary_stream")(req.SerializeToString(), timeout=self.timeout):
                m = pb.ReadResponse.FromString(raw)
                parts.setdefault(m.site, []).append(m)
        except grpc.RpcError as exc:
            raise _error_from_status(exc) from None
        out = {}
        for name, msgs in parts.items():
            site = self.spec.site(name)
            n = msgs[0].total_rows
            if sum(m.n_rows for m in msgs) != n:
                raise CorruptionError(f"sidecar sent {sum(m.n_rows for m in msgs)} rows of {name}, expected {n}")
            cb, sb = msgs[0].code_bytes, msgs[0].scale_bytes

            def cat(field: str, dtype: str, msgs: list[Any] = msgs) -> np.ndarray:
                return np.frombuffer(bytearray().join(getattr(m, field) for m in msgs), dtype)

            has_ts = msgs[0].has_token_scales
            out[name] = HostRows(
                site,
                cat("codes", "u1").reshape(n, cb),
                cat("scales", "u1").reshape(n, sb),
                cat("global_scale", "<f4").astype(np.float32),
                cat("token_scales", "<f4").astype(np.float32) if has_ts else None,
                cat("valid", "u1").astype(bool),
                cat("policy_version", "<i8").astype(np.int64),
            )
        return out

    def _run_spec_from_sidecar(self) -> RunSpec:
        import grpc

        from tracestore.v1 import tracestore_pb2 as pb
        from tracestore.wire import run_spec_from_pb

        try:
            raw = method(self._channel, "Stat", "unary_unary")(
                pb.StatRequest(run=self.run).SerializeToString(), timeout=self.timeout
            )
        except grpc.RpcError as exc:
            raise _error_from_status(exc) from None
        resp = pb.StatResponse.FromString(raw)
        if not resp.HasField("run_spec"):
            raise NotFoundError(f"run {self.run!r} is not declared at the sidecar {self.source}")
        return run_spec_from_pb(resp.run_spec)

    def _cuda_index(self) -> int | None:
        """The CUDA device the results go to, resolved in the calling (training) thread, where
        ``"cuda"`` means its current device; None for other devices."""
        import torch

        dev = torch.device(self.device)
        if dev.type != "cuda":
            return None
        return dev.index if dev.index is not None else torch.cuda.current_device()

    def _staged(self, plan: PlanLike, background: bool = False, cuda: int | None = None) -> dict[str, _Staged]:
        """``plan``'s rows as host tensors, pinned when the device is CUDA: the part of :meth:`read`
        that copies bytes, done in the prefetch thread for a prefetched plan (pinning 200 MB is a
        copy of its own, which the training thread then no longer waits for). ``cuda``: the
        training thread's device, made current here while pinning, so that a prefetch thread never
        creates a CUDA context on device 0 for a rank that trains on another."""
        import torch

        pin = torch.device(self.device).type == "cuda"
        rows_of = self._fetch(plan, background)

        def t(a: np.ndarray | None) -> Any:
            if a is None:
                return None
            x = torch.from_numpy(np.ascontiguousarray(a))
            return x.pin_memory() if pin else x

        with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
            return {
                name: _Staged(
                    rows.site,
                    t(rows.codes),
                    t(rows.scales),
                    t(np.asarray(rows.global_scale, np.float32)),  # (no copy: already float32)
                    t(rows.token_scales),
                    t(np.asarray(rows.valid, bool)),
                )
                for name, rows in rows_of.items()
            }

    def _to_guidance(self, rows: _Staged) -> Any:
        import torch

        from tracestore.guidance import Guidance

        dev = torch.device(self.device)
        cuda = dev.type == "cuda"

        def t(x: Any) -> Any:  # from pinned memory: the copy is queued on the current stream
            return None if x is None else x.to(dev, non_blocking=cuda)

        site = rows.site
        return Guidance(
            codes=t(rows.codes),
            scales=t(rows.scales),
            global_scale=t(rows.global_scale),
            bits=site.bits,
            fmt=site.fmt,
            rule=self.rule,  # type: ignore[arg-type]
            token_scales=t(rows.token_scales),
            valid=t(rows.valid),
        )


@dataclasses.dataclass(frozen=True)
class ReadReport:
    """Which rows of one read fall back to RTN: ``rows`` counts the plan's rows that are not padding,
    summed over the sites read, ``unguided_rows`` those of them without a record (no record
    stored, masked, or the final position of a sealed trajectory, unrecorded by design)."""

    rows: int
    unguided_rows: int

    @property
    def unguided_fraction(self) -> float:
        return self.unguided_rows / self.rows if self.rows else 0.0


class Rows(dict):  # type: ignore[type-arg]
    """A read's ``{site: rows}`` with its :class:`ReadReport` as ``report``."""

    def __init__(self, rows: dict[str, Any], report: ReadReport) -> None:
        super().__init__(rows)
        self.report = report


def read_report(plan: PlanLike, valid: dict[str, tuple[SiteSpec, np.ndarray]]) -> ReadReport:
    """The :class:`ReadReport` of ``plan`` from each site's ``(spec, valid)``."""
    if not isinstance(plan, MicrobatchPlan):
        plan = MicrobatchPlan(plan)
    real = np.ones(plan.n_tokens, dtype=bool)
    for i, seg in enumerate(plan.segments):
        if seg.trajectory is None:
            real[int(plan.offsets[i]) : int(plan.offsets[i + 1])] = False
    rows = unguided = 0
    for site, v in valid.values():
        mask = np.repeat(real, site.rows_per_token)
        rows += int(mask.sum())
        unguided += int((mask & ~np.asarray(v, dtype=bool)).sum())
    return ReadReport(rows, unguided)


@dataclasses.dataclass
class _Staged:
    """One site's rows as host tensors (pinned for a CUDA device), ready to go to the device."""

    site: SiteSpec
    codes: Any
    scales: Any
    global_scale: Any
    token_scales: Any
    valid: Any


def _segments(plan: MicrobatchPlan) -> list[tuple[str | None, int, int]]:
    return [(s.trajectory, s.token_start, s.token_end) for s in plan.segments]


def _plan_key(plan: PlanLike) -> tuple[Any, ...]:
    segs = _segments(plan) if isinstance(plan, MicrobatchPlan) else [tuple(s) for s in plan]
    return tuple(segs)


def _error_from_status(exc: Any) -> TraceStoreError:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    details = exc.details() or code
    cls: type[TraceStoreError] = {
        "INVALID_ARGUMENT": ValidationError,
        "NOT_FOUND": MissingRecordsError,
        "DATA_LOSS": CorruptionError,
        "UNAUTHENTICATED": UnauthenticatedError,
        "PERMISSION_DENIED": PermissionDeniedError,
    }.get(code, StorageError)
    return cls(f"sidecar Read failed ({code}): {details}")
