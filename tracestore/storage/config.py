"""StorageConfig: the knobs of a :class:`~tracestore.storage.store.Store`, frozen and checked once.

The sidecar builds one from its settings (``tracestore serve --storage-timeout``,
``--storage-retry-deadline``, ``--shard-files``, ``--shard-split-mib``: flag, ``TRACESTORE_*``
variable or config file) and hands it to its ``Store``; a ``Store`` made without one uses the
defaults below. The storage package reads no environment variable itself.
"""

from __future__ import annotations

import dataclasses
import math
import os

from tracestore.errors import ConfigError

__all__ = [
    "DEFAULT_RETRY_DEADLINE_S",
    "MIN_ROW_GROUP_BYTES",
    "ROW_GROUP_BYTES",
    "SPLIT_MIN_BYTES",
    "SPLIT_MIN_CHUNK_BYTES",
    "StorageConfig",
]

DEFAULT_RETRY_DEADLINE_S = 30.0
ROW_GROUP_BYTES = 16 << 20
# 4 MiB writes ~4% faster, but a read of half the sites then fetches 24 of 30 MB instead of 13
MIN_ROW_GROUP_BYTES = 1 << 20
# 2 cores, one file / two: 30 MiB 51.3 / 38.6 ms on memory://, 135 / 94 ms on disk; 15 MiB: even
SPLIT_MIN_BYTES = 24 << 20
"""Record payload from which one write becomes two shard files encoded side by side."""
# a 60 MiB write split, speed-up: 24 KiB chunks 1.00-1.05x, 48 KiB 1.02-1.29x, 0.4 KiB 0.82-0.94x
SPLIT_MIN_CHUNK_BYTES = 32 << 10
"""Only writes whose chunks average this many bytes are split: the per-chunk work holds the GIL,
so a second encoder gains nothing on small chunks."""


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """How a ``Store`` talks to its storage and cuts its shards.

    ``timeout_s`` bounds every storage call; transient errors are retried ``retries`` times with
    jittered exponential backoff, none starting later than ``retry_deadline_s`` after the first
    attempt. ``shard_files`` (1, 2, or None: 2 on a machine with two or more cores, else 1) is the
    most files one shard is written as: a write of at least ``split_min_bytes`` of record payload,
    in chunks of at least ``split_min_chunk_bytes`` on average, is split in two. ``row_group_bytes``
    and ``min_row_group_bytes`` size the Parquet row groups. Invalid values raise
    :class:`~tracestore.errors.ConfigError` naming the field and what is expected."""

    timeout_s: float = 60.0
    retries: int = 3
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S
    shard_files: int | None = None
    split_min_bytes: int = SPLIT_MIN_BYTES
    split_min_chunk_bytes: int = SPLIT_MIN_CHUNK_BYTES
    row_group_bytes: int = ROW_GROUP_BYTES
    min_row_group_bytes: int = MIN_ROW_GROUP_BYTES

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"StorageConfig.{name}={getattr(self, name)!r}: expected {expected}")

        for name in ("timeout_s", "retry_deadline_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise bad(name, "a number of seconds > 0")
        for name in ("retries", "split_min_bytes", "split_min_chunk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "an integer >= 0")
        for name, least in (("row_group_bytes", 1), ("min_row_group_bytes", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise bad(name, f"an integer >= {least}")
        if self.shard_files not in (None, 1, 2) or isinstance(self.shard_files, bool):
            raise bad("shard_files", "1, 2 or None (2 where the machine has two or more cores)")

    @property
    def files(self) -> int:
        """``shard_files`` with None resolved for this machine."""
        if self.shard_files is not None:
            return self.shard_files
        return 2 if (os.cpu_count() or 1) >= 2 else 1
