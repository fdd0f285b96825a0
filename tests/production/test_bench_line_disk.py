"""bench_line's view of the disk: which device and file system hold the WALs and the shards, how
many bytes the line wrote there, and the disk's own ceiling measured in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

bench_line = pytest.importorskip("bench_line")


def test_fs_type_names_tmpfs_and_the_root() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    assert bench_line.fs_type(Path("/dev/shm")) == "tmpfs"
    assert bench_line.fs_type(Path("/")) not in ("", "tmpfs")


def test_tmpfs_has_no_block_device() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    assert bench_line.block_device(Path("/dev/shm")) is None


def test_probe_writes_syncs_and_cleans_up(tmp_path: Path) -> None:
    dev = bench_line.block_device(tmp_path)
    before = bench_line.disk_written(dev) if dev else 0
    got = bench_line.disk_probe(tmp_path, 2, 0.3)
    assert got["error"] is None
    assert got["writers"] == 2
    assert got["GBps"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe's files are gone
    if dev is None:
        assert got["disk_GBps"] is None
    else:
        # what the probe wrote (at least one 4 MiB block per writer) reached the device's counters
        assert bench_line.disk_written(dev) - before >= 2 * (4 << 20)
        assert got["disk"] == dev[0]


def test_probe_reports_a_directory_it_cannot_write(tmp_path: Path) -> None:
    got = bench_line.disk_probe(tmp_path / "missing", 1, 0.1)
    assert got["error"] is not None and "missing" in got["error"]
    assert got["GBps"] == 0
