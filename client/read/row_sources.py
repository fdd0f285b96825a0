"""Where a :class:`~tracestore.client.read.reader.GuidanceReader` gets its rows: one
:class:`RowSource`, chosen once by :func:`open_rows` from the reader's ``source``.

- :class:`StoreRows`: a storage URL read in this process
  (:class:`~tracestore.storage.reader.StoreReader`);
- :class:`ProcessRows`: a storage URL read by child processes into shared memory (``process=True``
  or ``N``, :mod:`tracestore.client.read.read_process`);
- :class:`SidecarRows`: a sidecar address, the ``Read`` RPC.

Every source answers a plan with ``{site: SiteRows}``
(:class:`~tracestore.storage.rows.SiteRows`, numpy arrays aligned row for row to the plan), the
one container a read's rows travel in until the reader turns them into tensors.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
from tracestore.client.transport import channel, is_sidecar_address, method

from tracestore.errors import (
    ConfigError,
    CorruptionError,
    GuidanceMismatch,
    MissingRecordsError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
    TraceStoreError,
    UnauthenticatedError,
    ValidationError,
)
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec

if TYPE_CHECKING:  # pragma: no cover
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.rows import SiteRows

    from .read_process import ReadProcesses


@dataclasses.dataclass(frozen=True)
class Query:
    """What every read of one reader asks for besides the plan: ``versions`` (None: all), ``sites``
    (None: all), one ``columns`` range for every site (None: whole rows), ``on_missing``
    (``"error"`` or ``"mask"``) and ``on_mismatch`` (``"error"`` or ``"mask"``: records of other
    token ids than the trainer's, when a read gives its token ids)."""

    run: str
    versions: int | Iterable[int] | None = None
    sites: list[str] | None = None
    columns: tuple[int, int] | None = None
    on_missing: Literal["error", "mask"] = "error"
    on_mismatch: Literal["error", "mask"] = "error"

    def read_args(self) -> dict[str, Any]:
        """The keyword arguments of ``StoreReader.read`` for this query."""
        return {
            "versions": self.versions,
            "sites": self.sites,
            "columns": self.columns,
            "on_missing": self.on_missing,
            "on_mismatch": self.on_mismatch,
        }


# A read's rows per site, and the trajectories masked for other token ids (trajectory -> why)
RowsRead = tuple[dict[str, "SiteRows"], dict[str, str]]


class RowSource(Protocol):
    """Rows for plans. ``spec``: the run's declaration, None until a source that learns it on
    its first read (the sidecar) has read. ``background``: the read runs in a thread beside a
    training loop that keeps the GIL busy (a source that decodes in this process then keeps the
    GIL for its short copies, see ``StoreReader.read(hold_gil=...)``)."""

    spec: RunSpec | None

    def rows(self, plan: MicrobatchPlan, background: bool = False, token_ids: Any = None) -> RowsRead: ...

    def close(self) -> None: ...


class StoreRows:
    """A storage URL read in this process."""

    def __init__(self, reader: StoreReader, query: Query) -> None:
        self.reader, self.query = reader, query
        self.spec: RunSpec | None = reader.spec

    def rows(self, plan: MicrobatchPlan, background: bool = False, token_ids: Any = None) -> RowsRead:
        res = self.reader.read(plan, hold_gil=background, token_ids=token_ids, **self.query.read_args())
        return dict(res.rows), dict(res.stats.mismatched)

    def close(self) -> None:
        pass  # (the reader's index stays usable by a prefetch still in flight)


class ProcessRows:
    """A storage URL read by child processes
    (:class:`~tracestore.client.read.read_process.ReadProcesses`): the rows are numpy arrays over
    shared memory. ``reader`` (in this process) gives the run's spec and each read's layout; it
    reads nothing itself."""

    def __init__(self, reader: StoreReader, procs: ReadProcesses, query: Query) -> None:
        self.reader, self.procs, self.query = reader, procs, query
        self.spec: RunSpec | None = reader.spec

    def rows(self, plan: MicrobatchPlan, background: bool = False, token_ids: Any = None) -> RowsRead:
        from tracestore.storage.identity_check import token_ids_by_trajectory

        q = self.query
        extra = {} if token_ids is None else {"token_ids": token_ids_by_trajectory(plan, token_ids)}
        layout = self.reader.layout(plan.n_tokens, q.sites, q.columns)
        return self.procs.read(segments(plan), layout, **q.read_args(), **extra)

    def close(self) -> None:
        self.procs.close()


class SidecarRows:
    """A sidecar's ``Read`` RPC over ``ch`` (its run spec comes from ``Stat`` on the first read)."""

    def __init__(self, address: str, ch: Any, query: Query, timeout: float) -> None:
        self.address, self.channel, self.query, self.timeout = address, ch, query, timeout
        self.spec: RunSpec | None = None

    def rows(self, plan: MicrobatchPlan, background: bool = False, token_ids: Any = None) -> RowsRead:
        import grpc

        from tracestore.storage.identity_check import token_ids_by_trajectory
        from tracestore.storage.rows import SiteRows
        from tracestore.v1 import tracestore_pb2 as pb

        spec = self.spec = self.spec or self._run_spec()
        q = self.query
        versions = (
            []
            if q.versions is None
            else ([int(q.versions)] if isinstance(q.versions, int) else [int(v) for v in q.versions])
        )
        req = pb.ReadRequest(
            run=q.run,
            plan=[pb.Segment(trajectory=s[0] or "", token_start=s[1], token_end=s[2]) for s in segments(plan)],
            versions=versions,
            sites=q.sites or [],
            on_missing=pb.ON_MISSING_MASK if q.on_missing == "mask" else pb.ON_MISSING_ERROR,
            has_columns=q.columns is not None,
            column_start=q.columns[0] if q.columns else 0,
            column_end=q.columns[1] if q.columns else 0,
            mask_mismatch=q.on_mismatch == "mask",
        )
        if token_ids is not None:
            for t, ids in token_ids_by_trajectory(plan, token_ids).items():
                req.token_ids.add(trajectory=t, ids=ids.tobytes())
        parts: dict[str, list[Any]] = {}
        mismatched: dict[str, str] = {}
        try:
            for raw in method(self.channel, "Read", "unary_stream")(req.SerializeToString(), timeout=self.timeout):
                m = pb.ReadResponse.FromString(raw)
                mismatched.update(m.mismatched)
                parts.setdefault(m.site, []).append(m)
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        out = {}
        for name, msgs in parts.items():
            site = spec.site(name)
            n = msgs[0].total_rows
            if sum(m.n_rows for m in msgs) != n:
                raise CorruptionError(f"sidecar sent {sum(m.n_rows for m in msgs)} rows of {name}, expected {n}")
            cb, sb = msgs[0].code_bytes, msgs[0].scale_bytes

            def cat(field: str, dtype: str, msgs: list[Any] = msgs) -> np.ndarray:
                return np.frombuffer(bytearray().join(getattr(m, field) for m in msgs), dtype)

            out[name] = SiteRows(
                site,
                q.columns or (0, site.width),
                cat("codes", "u1").reshape(n, cb),
                cat("scales", "u1").reshape(n, sb),
                cat("global_scale", "<f4").astype(np.float32),
                cat("token_scales", "<f4").astype(np.float32) if msgs[0].has_token_scales else None,
                cat("valid", "u1").astype(bool),
                cat("policy_version", "<i8").astype(np.int64),
                np.zeros(n, bool),  # (the sidecar drops stale records, it never flags them)
            )
        return out, mismatched

    def _run_spec(self) -> RunSpec:
        import grpc

        from tracestore.v1 import tracestore_pb2 as pb
        from tracestore.wire import run_spec_from_pb

        try:
            raw = method(self.channel, "Stat", "unary_unary")(
                pb.StatRequest(run=self.query.run).SerializeToString(), timeout=self.timeout
            )
        except grpc.RpcError as exc:
            raise error_from_status(exc) from None
        resp = pb.StatResponse.FromString(raw)
        if not resp.HasField("run_spec"):
            raise NotFoundError(f"run {self.query.run!r} is not declared at the sidecar {self.address}")
        return run_spec_from_pb(resp.run_spec)

    def close(self) -> None:
        self.channel.close()


def open_rows(
    source: str,
    query: Query,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 120.0,
    process: bool | int = False,
    channel_credentials: Any = None,
    token: str | None = None,
) -> RowSource:
    """The :class:`RowSource` for ``source``: a sidecar address (``host:port``, ``unix://...``,
    ``grpcs://...``) or a storage URL, read in this process or, with ``process`` (True: one child,
    N: N children), in child processes (Linux only; not ``memory://``, which another process
    cannot open)."""
    sidecar = is_sidecar_address(source)
    if not isinstance(process, int) or process < 0:  # (bool is an int: True is one child)
        raise ConfigError(f"process must be False, True or a number of child processes, got {process!r}")
    if process and (sidecar or source.startswith("memory://")):
        raise ConfigError(
            f"process=True reads a storage URL another process can open (file://, s3://, ...), not {source!r}"
        )
    if process and not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
        raise ConfigError("process=True needs Linux (memfd_create and SCM_RIGHTS); read in this process instead")
    if sidecar:
        return SidecarRows(source, channel(source, channel_credentials, token), query, timeout)
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    reader = StoreReader(Store(source, storage_options), query.run)
    if not process:
        return StoreRows(reader, query)
    from .read_process import ReadProcesses

    return ProcessRows(reader, ReadProcesses(source, query.run, storage_options, timeout, n=int(process)), query)


def segments(plan: MicrobatchPlan) -> list[tuple[str | None, int, int]]:
    """``plan``'s segments as ``(trajectory, token_start, token_end)``."""
    return [(s.trajectory, s.token_start, s.token_end) for s in plan.segments]


def error_from_status(exc: Any) -> TraceStoreError:
    """The tracestore error of a failed sidecar call (a ``grpc.RpcError``)."""
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    details = exc.details() or code
    cls: type[TraceStoreError] = {
        "INVALID_ARGUMENT": ValidationError,
        "NOT_FOUND": MissingRecordsError,
        "DATA_LOSS": CorruptionError,
        "UNAUTHENTICATED": UnauthenticatedError,
        "PERMISSION_DENIED": PermissionDeniedError,
        "FAILED_PRECONDITION": GuidanceMismatch,  # (the one precondition a Read checks)
    }.get(code, StorageError)
    return cls(f"sidecar Read failed ({code}): {details}")
