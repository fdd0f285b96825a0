"""Prometheus metrics of the sidecar (listed in docs/operations.md, "Metrics"). Names here are a contract with deploy/.

One registry per server instance (tests run several servers in one process). Every label value
comes from a fixed set the server chooses, never from a client: ``method`` (RPC names), ``code``
(gRPC status names), ``op`` (:data:`STORAGE_OPS`), ``path`` (``grpc``/``shm``/``wal``), ``reason``
(:data:`UNGUIDED_REASONS` for unguided trajectories, the engine's degraded reasons for
``tracestore_degraded``) — never a run, trajectory or writer id, nor a string a recorder sent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

# Latency buckets: durable acks are fsync-bound (ms) on disk, PUT-bound (100s of ms) on S3.
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Reasons recorders report for unguided trajectories (client.recorder: staging full, sidecar
# unreachable, or the status code of a refused message in lower case). A reason outside the set is
# counted as "other": 20,000 messages with made-up reasons once made 40,000 series.
UNGUIDED_REASONS = frozenset(
    {
        "staging_full",
        "sidecar_unreachable",
        "invalid_argument",
        "already_exists",
        "data_loss",
        "not_found",
        "permission_denied",
        "unauthenticated",
        "resource_exhausted",
        "failed_precondition",
        "other",
    }
)
# Storage operations as tracestore.storage.fs names them (the first word of its op strings).
STORAGE_OPS = frozenset({"read", "exists", "size", "list", "open", "write", "delete", "write_shard", "other"})


def unguided_reason(reason: str) -> str:
    """The metric label for a recorder-reported reason: itself if it is in :data:`UNGUIDED_REASONS`,
    else (empty, unknown, any other string) ``"other"``."""
    r = reason.strip().lower()
    return r if r in UNGUIDED_REASONS else "other"


def storage_op(op: str) -> str:
    """The metric label of a storage operation (``"write run-a/v0/..."`` -> ``"write"``)."""
    word = op.split(" ", 1)[0]
    return word if word in STORAGE_OPS else "other"


_BYTES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24, 2**26, 2**27, 2**28, 2**29, 2**30)


class Metrics:
    """All sidecar metrics, registered on ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        # The sidecar process itself (prometheus_client reads /proc/self; nothing off Linux):
        # process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
        # process_max_fds, process_cpu_seconds_total, process_start_time_seconds
        self.process = ProcessCollector(registry=r)
        p = "tracestore_"
        self.build_info = Info(p + "build", "tracestore version of this sidecar", registry=r)
        # ingest
        self.ingest_bytes = Counter(p + "ingest_bytes", "Record payload bytes accepted", ["path"], registry=r)
        self.ingest_records = Counter(p + "ingest_records", "Token rows accepted", ["path"], registry=r)
        self.ingest_chunks = Counter(p + "ingest_chunks", "Record chunks accepted", ["path"], registry=r)
        self.ingest_duplicates = Counter(
            p + "ingest_duplicates", "Resent messages answered without a second write", registry=r
        )
        self.durable_ack_latency = Histogram(
            p + "durable_ack_latency_seconds",
            "Receipt of a write to its durable acknowledgement",
            buckets=_LATENCY,
            registry=r,
        )
        # durability and storage
        self.backlog_bytes = Gauge(p + "backlog_bytes", "Bytes received but not yet in a committed shard", registry=r)
        self.backlog_oldest_age = Gauge(
            p + "backlog_oldest_age_seconds", "Age of the oldest record not yet in a committed shard", registry=r
        )
        self.wal_bytes = Gauge(p + "wal_bytes", "Bytes in the write-ahead log spool on local disk", registry=r)
        self.open_trajectories = Gauge(p + "open_trajectories", "Trajectories with records and no seal", registry=r)
        self.sealed_trajectories = Counter(p + "sealed_trajectories", "Trajectories sealed", registry=r)
        self.tokens_past_seals = Counter(
            p + "tokens_past_seals",
            "Site-tokens recorded before their trajectory's seal at or past its n_tokens (never read as valid)",
            registry=r,
        )
        self.guidance_mismatches = Counter(
            p + "guidance_mismatches",
            "Read trajectories whose records belong to other token ids than the reader's "
            "(outcome: refused = the read failed, masked = returned unguided)",
            ["outcome"],
            registry=r,
        )
        self.shard_write_latency = Histogram(
            p + "shard_write_latency_seconds",
            "Build and publish one shard and its manifest",
            buckets=_LATENCY,
            registry=r,
        )
        self.shard_bytes = Counter(p + "shard_bytes", "Bytes of committed shards", registry=r)
        self.shards = Counter(p + "shards", "Shards committed", registry=r)
        self.last_commit_timestamp = Gauge(
            p + "last_commit_timestamp_seconds", "Unix time of the last committed shard", registry=r
        )
        self.storage_retries = Counter(p + "storage_retries", "Storage calls retried", ["op"], registry=r)
        self.storage_errors = Counter(p + "storage_errors", "Storage calls that failed", ["op"], registry=r)
        self.checksum_failures = Counter(
            p + "checksum_failures", "Chunks that failed checksum verification", registry=r
        )
        # reads
        self.read_bytes = Counter(p + "read_bytes", "Record bytes served to readers", registry=r)
        self.read_latency = Histogram(
            p + "read_latency_seconds", "One Read RPC, first byte to last", buckets=_LATENCY, registry=r
        )
        self.read_budget = Gauge(p + "read_budget_bytes", "Configured read budget (--read-budget-mib)", registry=r)
        self.read_in_use = Gauge(
            p + "read_in_use_bytes", "Bytes Reads in progress hold against the read budget", registry=r
        )
        self.reads_stalled = Counter(
            p + "reads_stalled", "Reads cancelled: the caller took no response for --read-stall-timeout", registry=r
        )
        # admission and memory
        self.rejected = Counter(p + "rejected_requests", "Requests rejected, by gRPC status", ["code"], registry=r)
        self.requests = Counter(p + "requests", "RPCs handled, by method and status", ["method", "code"], registry=r)
        self.backpressure = Counter(
            p + "backpressure_events", "Writes held or refused over the memory budget", registry=r
        )
        self.memory_budget = Gauge(p + "memory_budget_bytes", "Configured in-memory budget", registry=r)
        self.memory_in_use = Gauge(p + "memory_in_use_bytes", "Bytes held against the memory budget", registry=r)
        self.shm_capacity = Gauge(p + "shm_capacity_bytes", "Shared-memory staging bytes registered", registry=r)
        self.shm_in_use = Gauge(
            p + "shm_in_use_bytes", "Shared-memory staging bytes reserved, not released", registry=r
        )
        self.active_streams = Gauge(p + "active_write_streams", "Open Write streams", registry=r)
        self.waiting_streams = Gauge(
            p + "waiting_write_streams",
            "Write streams waiting for their turn to read a message (the memory budget covers fewer)",
            registry=r,
        )
        self.degraded = Gauge(
            p + "degraded",
            "1 while the sidecar is degraded for this reason (health NOT_SERVING), else 0",
            ["reason"],
            registry=r,
        )
        self.unguided_trajectories = Counter(
            p + "unguided_trajectories",
            "Trajectories recorders reported as unguided (no complete records)",
            ["reason"],
            registry=r,
        )
