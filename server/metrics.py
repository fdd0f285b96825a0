"""Prometheus metrics of the sidecar (design.md §9). Names here are a contract with deploy/.

One registry per server instance (tests run several servers in one process). Labels are bounded:
``method`` (RPC names), ``code`` (gRPC status names), ``op`` (storage operation), ``path``
(``grpc``/``shm``) — never a run, trajectory or writer id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Latency buckets: durable acks are fsync-bound (ms) on disk, PUT-bound (100s of ms) on S3.
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24, 2**26, 2**27, 2**28, 2**29, 2**30)


class Metrics:
    """All sidecar metrics, registered on ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
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
        self.unguided_trajectories = Counter(
            p + "unguided_trajectories",
            "Trajectories recorders reported as unguided (no complete records)",
            ["reason"],
            registry=r,
        )
