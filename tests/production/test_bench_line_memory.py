"""bench_line's memory samples: a process's RSS split into its own (anonymous) pages and the shared
memory it maps (a sidecar maps the recorders' staging pools and reads them in place)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

bench_line = pytest.importorskip("bench_line")


LINUX = Path("/dev/shm").is_dir() and Path("/proc/self/status").exists()


@pytest.mark.skipif(not LINUX, reason="needs Linux: /dev/shm and /proc/<pid>/status")
def test_mapped_shared_memory_counts_as_shmem_not_anon() -> None:
    size = 64 << 20
    path = Path("/dev/shm") / f"tracestore-test-rss-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        before = bench_line.proc_rss(os.getpid())
        with mmap.mmap(fd, size) as mm:
            for off in range(0, size, 4096):  # touch every page, as a sidecar reading a pool does
                mm[off] = 1
            after = bench_line.proc_rss(os.getpid())
    finally:
        os.close(fd)
        path.unlink()
    grown = {k: after[k] - before[k] for k in ("rss", "anon", "shmem")}
    assert grown["shmem"] >= 0.9 * size, grown
    assert grown["anon"] < 0.25 * size, grown
    assert grown["rss"] >= 0.9 * size, grown
    assert after["anon"] + after["shmem"] + after["file"] == pytest.approx(after["rss"], rel=0.02)
