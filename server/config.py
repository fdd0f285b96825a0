"""Sidecar configuration: one frozen dataclass, validated on construction; each field a CLI flag."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from tracestore.errors import ConfigError
from tracestore.storage.config import StorageConfig

MiB = 1 << 20
# Threads beyond the Write streams: Read and Seal together take at most workers - HEALTH_THREADS
# of them, so health checks and Stat always find a thread.
HEALTH_THREADS = 4
MIN_WORKERS = HEALTH_THREADS + 4
# A Read's reply goes out in slices of about this size; while one is sent it exists ~3 times (the
# rows' bytes, the message, its serialization).
READ_SLICE_BYTES = 4 << 20
# The HTTP/2 receive window of one Write stream (``--stream-window-kib``; gRPC's
# ``grpc.http2.lookahead_bytes``, BDP probing off): how far a client may send ahead of the message
# the sidecar asked for. gRPC's own 64 KiB by default. A window of one recorder message (4 MiB) lets
# the next message arrive while the last is taken in, which over TLS lifts one recorder's ingest;
# but gRPC's buffers for the filled windows of many streams take more memory than the windows each
# stream holds against the budget (a flood outgrows the memory bound). See docs/protocol.md, "The
# stream window".
GRPC_STREAM_WINDOW = 64 << 10
MAX_STREAM_WINDOW = 64 << 20
# The least default share of Write streams per identity (--max-streams-per-identity unset): one
# tensor-parallel engine's recorder processes (up to 8), one stream each.
MIN_STREAMS_PER_IDENTITY = 8
# Writers' shared-memory staging pools the sidecar keeps open at once (server/rpc/shm.py); with
# tokens one identity opens at most max_shm_pools_per_identity of them (unset: a quarter).
SHM_POOLS = 64
# gRPC hands a received message over as one bytes object joined from copies of its buffer's slices,
# while its buffers still hold the message: three copies at once, one message at a time (the
# server's polling thread joins them). The reading stream's reservation covers gRPC's buffers;
# this many more of the largest message stay reserved for good.
GRPC_COPIES = 2


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (``localhost``, 127.0.0.0/8, ``::1``)."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # any other name may resolve to a routable address


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything ``tracestore serve`` can be told. Defaults run with no configuration.

    ``wal_dir=None`` acknowledges a write only when its shard is committed (right for ``memory://``
    and for tests); with a WAL directory a write is acknowledged once appended there and fsynced.
    ``dedupe_versions``: how many of a run's newest policy versions keep per-chunk dedupe and
    conflict state in memory. ``port=0`` binds an ephemeral port (reported by :attr:`Sidecar.port`);
    ``metrics_port=None`` disables the Prometheus endpoint.

    Limits. ``max_streams``: open Write streams; one more is refused at once (RESOURCE_EXHAUSTED).
    ``workers``: gRPC threads for everything but Write streams (health, Stat, Seal, Read, streams
    refused over the cap): the server runs ``max_streams + workers`` threads, so idle recorders
    never take the threads a health probe needs. Only :attr:`reading_streams` streams wait for their
    next message at once (each has ``max_message_bytes`` of the memory budget reserved for it); the
    others wait with nothing read, their bytes held back at the client by HTTP/2 flow control. Two
    ``max_message_bytes`` more stay reserved for the whole run: gRPC joins each received message
    from copies of its buffer's slices (one at a time, on its polling thread), so for a moment that
    message takes three times its size. ``max_read_bytes``: the largest Read (plan rows x row bytes
    of the sites read); a Read holds its size against the read budget, not the memory budget, while
    it runs (``read_budget_bytes``; None: a quarter of the memory budget, :attr:`read_budget`), and
    is cancelled once its caller has taken no response for ``read_stall_s``. ``max_writers``: writer
    sessions one sidecar keeps (they are durable: fencing and ownership); ``max_runs``: runs with
    records not committed yet (a committed run's entry is only its spec, dropped when the slot is
    needed). With authentication, one identity holds at most ``max_writers_per_identity`` sessions
    and ``max_runs_per_identity`` runs of those (None: a quarter of the global limit,
    :attr:`writers_per_identity`, :attr:`runs_per_identity`), and ``max_streams_per_identity`` open
    Write streams (None: a quarter of ``max_streams``, at least 8, :attr:`streams_per_identity`),
    and ``max_shm_pools_per_identity`` of the :data:`SHM_POOLS` shared-memory pools open at once
    (None: a quarter, :attr:`shm_pools_per_identity`), so that one team cannot take every slot from
    the others. ``stream_window_bytes``: the HTTP/2 receive window of each Write stream (None:
    gRPC's own, 64 KiB); an open stream holds it against the memory budget (:attr:`stream_window`).
    ``storage_timeout_s``, ``storage_retry_deadline_s``, ``shard_files`` and
    ``shard_split_min_bytes`` make the :class:`~tracestore.storage.config.StorageConfig` of the
    sidecar's ``Store`` (:meth:`storage_config`). ``storage_unhealthy_s``: storage refusing every
    commit this long marks the sidecar degraded (health NOT_SERVING). ``wal_retry_s``: pause between
    attempts to recover a failed write-ahead log.
    """

    # repr=False: a storage URL may carry credentials (user:password@)
    storage: str = dataclasses.field(default="file://./tracestore-data", repr=False)
    # repr=False: credentials live here and a logged or printed config must not show them
    storage_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    host: str = "127.0.0.1"
    port: int | None = 7433  # None: no TCP listener (the unix socket only)
    unix_socket: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: str | None = None
    unix_needs_token: bool = False
    insecure: bool = False
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9433
    wal_dir: str | None = "./tracestore-wal"
    wal_segment_bytes: int = 64 * MiB
    memory_budget_bytes: int = 1024 * MiB
    shard_target_bytes: int = 128 * MiB
    flush_interval_s: float = 2.0
    backpressure_timeout_s: float = 5.0
    max_message_bytes: int = 64 * MiB
    max_streams: int = 256
    stream_window_bytes: int | None = None
    workers: int = 64
    max_read_bytes: int = 256 * MiB
    read_budget_bytes: int | None = None
    read_stall_s: float = 10.0
    max_writers: int = 1024
    max_runs: int = 256
    max_writers_per_identity: int | None = None
    max_runs_per_identity: int | None = None
    max_streams_per_identity: int | None = None
    max_shm_pools_per_identity: int | None = None
    storage_unhealthy_s: float = 300.0
    wal_retry_s: float = 1.0
    grace_s: float = 30.0
    storage_timeout_s: float = 60.0
    storage_retry_deadline_s: float = 30.0
    shard_files: int | None = None  # None: 2 on a machine with two or more cores, else 1
    shard_split_min_bytes: int = 24 * MiB
    shm_dir: str = "/dev/shm"
    max_shm_pool_bytes: int = 64 * 1024 * MiB  # largest writer staging pool the sidecar opens
    # The unix socket's group (name or gid; its members may connect and their shm pools are read)
    # and mode (None: 0660 with a socket_group, else 0600). Checked when the socket is bound.
    socket_group: str | None = None
    socket_mode: int | None = None
    dedupe_versions: int = 4

    def __post_init__(self) -> None:
        self._check_security()
        self.storage_config()  # its own checks, named after its fields
        for name in (
            "wal_segment_bytes",
            "memory_budget_bytes",
            "shard_target_bytes",
            "max_message_bytes",
            "max_read_bytes",
            "max_shm_pool_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1024:
                raise ConfigError(f"{name} must be an integer >= 1024 bytes, got {v!r}")
        v = self.read_budget_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1024):
            raise ConfigError(
                f"read_budget_bytes must be an integer >= 1024 bytes (or unset: a quarter of "
                f"memory_budget_bytes), got {v!r}"
            )
        if self.port is None:
            if not self.unix_socket:
                raise ConfigError("port off (--port off) leaves no listener: give --unix-socket PATH, or a --port")
        elif not 0 <= self.port < 65536:
            raise ConfigError(f"port must be 0..65535 (0 = ephemeral) or None (off), got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0..65535 or None, got {self.metrics_port}")
        for name in (
            "flush_interval_s",
            "backpressure_timeout_s",
            "grace_s",
            "storage_timeout_s",
            "storage_unhealthy_s",
            "wal_retry_s",
            "read_stall_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.dedupe_versions < 1:
            raise ConfigError(f"dedupe_versions must be >= 1, got {self.dedupe_versions}")
        for name, least in (("workers", MIN_WORKERS), ("max_streams", 1), ("max_writers", 1), ("max_runs", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")
        for name, whole in (
            ("max_writers_per_identity", "max_writers"),
            ("max_runs_per_identity", "max_runs"),
            ("max_streams_per_identity", "max_streams"),
        ):
            v, limit = getattr(self, name), getattr(self, whole)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                unset = "a quarter of max_streams, at least 8" if whole == "max_streams" else f"a quarter of {whole}"
                raise ConfigError(f"{name} must be an integer >= 1 (or unset: {unset}), got {v!r}")
            if v > limit:
                raise ConfigError(
                    f"{name} ({v}) must be at most {whole} ({limit}): it is one identity's share of that limit; "
                    f"lower it, or raise {whole} too"
                )
        v = self.max_shm_pools_per_identity
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= SHM_POOLS):
            raise ConfigError(
                f"max_shm_pools_per_identity must be an integer from 1 to {SHM_POOLS} (the shared-memory pools the "
                f"sidecar keeps open at once), or unset: a quarter of them; got {v!r}"
            )
        w = self.stream_window_bytes
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, int) or not GRPC_STREAM_WINDOW <= w <= MAX_STREAM_WINDOW:
                raise ConfigError(
                    f"stream_window_bytes must be an integer from {GRPC_STREAM_WINDOW} (gRPC's own window) to "
                    f"{MAX_STREAM_WINDOW}, got {w!r}"
                )
            if 4 * w > self.memory_budget_bytes:
                raise ConfigError(
                    f"stream_window_bytes ({w}) must be at most a quarter of memory_budget_bytes "
                    f"({self.memory_budget_bytes}): every open Write stream holds its window against the budget"
                )
        if 3 * self.max_message_bytes > self.memory_budget_bytes:
            raise ConfigError(
                f"max_message_bytes ({self.max_message_bytes}) must be at most a third of memory_budget_bytes "
                f"({self.memory_budget_bytes}): the budget keeps room for two copies of a message that gRPC "
                "makes while it delivers it, besides the message being read"
            )

    def storage_config(self) -> StorageConfig:
        """The :class:`StorageConfig` of the sidecar's ``Store``."""
        return StorageConfig(
            timeout_s=self.storage_timeout_s,
            retry_deadline_s=self.storage_retry_deadline_s,
            shard_files=self.shard_files,
            split_min_bytes=self.shard_split_min_bytes,
        )

    @property
    def writers_per_identity(self) -> int:
        """Writer sessions one authenticated identity may hold: ``max_writers_per_identity``, else a
        quarter of ``max_writers`` (at least one)."""
        v = self.max_writers_per_identity
        return max(1, self.max_writers // 4) if v is None else v

    @property
    def runs_per_identity(self) -> int:
        """Runs with records not committed yet that one authenticated identity may have:
        ``max_runs_per_identity``, else a quarter of ``max_runs`` (at least one)."""
        v = self.max_runs_per_identity
        return max(1, self.max_runs // 4) if v is None else v

    @property
    def streams_per_identity(self) -> int:
        """Open Write streams one authenticated identity may hold: ``max_streams_per_identity``,
        else a quarter of ``max_streams`` but at least :data:`MIN_STREAMS_PER_IDENTITY` (never more
        than ``max_streams``): every recorder process holds a stream, and the unix socket's callers
        without a token are all one identity, so a smaller default share would refuse one
        tensor-parallel engine's recorders under a lowered ``--max-streams``."""
        v = self.max_streams_per_identity
        if v is not None:
            return v
        return min(self.max_streams, max(MIN_STREAMS_PER_IDENTITY, self.max_streams // 4))

    @property
    def shm_pools_per_identity(self) -> int:
        """Shared-memory pools one authenticated identity may hold open:
        ``max_shm_pools_per_identity``, else a quarter of :data:`SHM_POOLS` (16: every recorder
        process has one pool, and one tensor-parallel engine's recorders share the unix socket's
        identity)."""
        v = self.max_shm_pools_per_identity
        return SHM_POOLS // 4 if v is None else v

    @property
    def stream_window(self) -> int:
        """The HTTP/2 receive window of one Write stream, which an open stream holds against the
        memory budget: ``stream_window_bytes``, else gRPC's own 64 KiB."""
        return GRPC_STREAM_WINDOW if self.stream_window_bytes is None else self.stream_window_bytes

    @property
    def reading_streams(self) -> int:
        """How many Write streams may wait for their next message at once: each reserves
        ``max_message_bytes`` of the budget before it reads, and together they take at most half of
        what gRPC's copies leave (the other half is the backlog's, which the flusher starts
        committing at half the budget)."""
        room = self.memory_budget_bytes - GRPC_COPIES * self.max_message_bytes
        return max(1, room // 2 // self.max_message_bytes)

    @property
    def read_budget(self) -> int:
        """Bytes all Reads in progress hold at once (their output and the slices being sent), apart
        from the memory budget: ``read_budget_bytes``, else a quarter of ``memory_budget_bytes``."""
        v = self.read_budget_bytes
        return max(1024, self.memory_budget_bytes // 4) if v is None else v

    @property
    def read_limit_bytes(self) -> int:
        """The largest Read served: ``max_read_bytes``, and never more than the read budget can
        hold: a Read holds its output and the slices of it being sent (:meth:`read_reservation`)."""
        room = self.read_budget
        return min(self.max_read_bytes, max(room - 3 * READ_SLICE_BYTES, room // 4))

    @staticmethod
    def read_reservation(nbytes: int) -> int:
        """What a Read of ``nbytes`` of output holds against the read budget while it runs."""
        return nbytes + 3 * min(nbytes, READ_SLICE_BYTES)

    @property
    def rpc_threads(self) -> int:
        """gRPC worker threads: one per Write stream up to the cap, and ``workers`` for the rest."""
        return self.max_streams + self.workers

    @property
    def max_concurrent_rpcs(self) -> int:
        """gRPC refuses RPCs beyond this many at once (RESOURCE_EXHAUSTED before any handler runs).
        Write streams over ``max_streams`` are refused by the handler instead, so this only bounds
        a flood of calls queued for threads; it never counts idle streams against health checks."""
        return self.max_streams + 4 * self.workers

    def _check_security(self) -> None:
        """Transport security and authentication (:mod:`tracestore.server.security.auth`).
        ``tls_cert`` + ``tls_key``: TLS on the TCP port; with ``tls_client_ca`` clients must present
        a certificate that CA signed. ``auth_tokens``: the token file; without one every caller may
        do everything, so the sidecar then serves loopback and the unix socket only.
        ``unix_needs_token``: unix-socket callers need tokens too (otherwise the socket file's
        permissions are the boundary). A host other than loopback needs both TLS and tokens, or
        ``insecure=True`` to serve it anyway."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together (--tls-cert and --tls-key): give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too")
        if self.unix_needs_token and self.auth_tokens is None:
            raise ConfigError("unix_needs_token (--unix-needs-token) needs a token file (--auth-tokens)")
        if self.auth_tokens is not None and self.wal_dir is None:
            raise ConfigError(
                "auth_tokens (--auth-tokens) needs a write-ahead log (--wal-dir): which identity owns each writer id "
                "is recorded there, and without it a restart would forget, letting another identity fence that "
                "writer or write its records"
            )
        if not self.insecure and self.port is not None and not is_loopback_host(self.host):
            missing = [
                what
                for what, ok in (
                    ("TLS (--tls-cert, --tls-key)", self.tls_cert is not None),
                    ("bearer tokens (--auth-tokens)", self.auth_tokens is not None),
                )
                if not ok
            ]
            if missing:
                raise ConfigError(
                    f"host {self.host!r} is not loopback and the sidecar has no {' and no '.join(missing)}: anyone "
                    "who reaches it could read and write every run. Give them, bind 127.0.0.1 (and/or "
                    "--unix-socket), or pass --insecure to serve it anyway (e.g. behind a network policy)"
                )

    def grpc_options(self) -> list[tuple[str, Any]]:
        """Channel arguments set deliberately (docs/protocol.md, "Transport")."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            # Off: BDP probing grows slow streams' windows past the memory budget (100 streams:
            # ~1.7 GiB); the budget bounds in-flight bytes instead.
            ("grpc.http2.bdp_probe", 0),
            # A larger receive window per stream only where asked for: it lifts one recorder's TLS
            # ingest 19-33%, but a flood of streams outgrows the memory bound with it (see
            # GRPC_STREAM_WINDOW).
            *((("grpc.http2.lookahead_bytes", self.stream_window),) if self.stream_window_bytes is not None else ()),
            # Otherwise a second server silently binds the same port.
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]
