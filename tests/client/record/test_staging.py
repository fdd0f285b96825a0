"""Staging ring: reservations never overlap, releases in any order reclaim space, shared pools map."""

from __future__ import annotations

import mmap
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tracestore.client.record.staging import StagingPool, sweep_stale_pools

from tracestore.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 1000)), max_size=200))
def test_reservations_never_overlap(ops: list[tuple[bool, int, int]]) -> None:
    pool = StagingPool(8192, align=64)
    live: dict[int, int] = {}
    for is_reserve, n, pick in ops:
        if is_reserve or not live:
            off = pool.reserve(n)
            if off is None:
                assert live, "an empty pool refused a fitting reservation"
                continue
            assert off >= 0 and off + n <= pool.capacity
            for o, m in live.items():
                assert off + n <= o or o + m <= off
            live[off] = n
        else:
            off = sorted(live)[pick % len(live)]
            pool.release(off)
            del live[off]
    for off in list(live):
        pool.release(off)
    assert pool.in_use == 0
    assert pool.reserve(pool.capacity) == 0  # fully reclaimed
    pool.close()


def test_shared_pool_is_visible_to_another_mapping(tmp_path: Path) -> None:
    pool = StagingPool(4096, shared=True, shm_dir=str(tmp_path))
    assert pool.name is not None and pool.path is not None and pool.path.exists()
    off = pool.reserve(5)
    assert off is not None
    pool.mm[off : off + 5] = b"hello"
    with open(pool.path, "rb") as f:
        other = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert other[off : off + 5] == b"hello"
        other.close()
    pool.close()
    assert not pool.path.exists()


def test_too_small_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 4096"):
        StagingPool(100)


_HOLDER = """
import sys, time
from tracestore.client.record.staging import StagingPool
pool = StagingPool(1 << 20, shared=True, shm_dir=sys.argv[1])
print(pool.name, flush=True)
time.sleep(60)
"""


def _holder(shm_dir: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(shm_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith("tracestore-pool-"), name
    return proc, shm_dir / name


def test_pools_of_dead_recorders_are_removed_live_ones_kept(tmp_path: Path) -> None:
    """A recorder killed with SIGKILL cannot unlink its pool (RAM under /dev/shm, kept until reboot).
    The next pool made in that directory removes it, because no live process holds its lock; the
    pool of a recorder that is still running, and files that are not lockable pools, stay."""
    dead, dead_path = _holder(tmp_path)
    live, live_path = _holder(tmp_path)
    old_style = tmp_path / ("tracestore-" + "ab" * 16)  # an older recorder's pool: no lock, left alone
    old_style.write_bytes(b"x")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert dead_path.exists()  # nobody cleaned up after it
        pool = StagingPool(4096, shared=True, shm_dir=str(tmp_path))
        assert pool.stale_removed == 1
        assert not dead_path.exists()
        assert live_path.exists() and old_style.exists() and pool.path is not None and pool.path.exists()
        pool.close()
        assert not pool.path.exists()
    finally:
        live.kill()
        live.wait(10)
    assert sweep_stale_pools(tmp_path) == 1 and not live_path.exists()  # its process is gone now
    assert sweep_stale_pools(tmp_path) == 0 and old_style.exists()
