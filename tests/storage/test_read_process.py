"""GuidanceReader(process=True): reads decoded in a child process into shared memory give the
same rows as reads in this process, keep their error classes, survive the child's death, and never
hand a block that a live result still uses to a later read."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from tracestore.client import GuidanceReader
from tracestore.client.read import read_process
from tracestore.client.read.read_process import SPARE_BLOCKS

from tracestore.errors import ConfigError, CorruptionError, MissingRecordsError, StorageError
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, make_chunk

S0, S1, S2 = SITES
FIELDS = ("codes", "scales", "global_scale", "token_scales", "valid", "policy_version", "stale")


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].site == b[name].site and a[name].columns == b[name].columns, name
        for f in FIELDS:
            x, y = getattr(a[name], f), getattr(b[name], f)
            assert (x is None) == (y is None), (name, f)
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape, (name, f, x.dtype, y.dtype, x.shape, y.shape)
                np.testing.assert_array_equal(x, y, err_msg=f"{name}.{f}")


def _filled(store: Store, seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    chunks = [
        make_chunk(s, t, 0, 9, rng=rng, token_scales=(s is S1), version=v)
        for v, t in ((0, "t0"), (1, "t1"))
        for s in SITES
    ]
    store.write_shard(RUN, 0, "w0", 0, chunks[:3])
    store.write_shard(RUN, 1, "w1", 0, chunks[3:])  # another version, another shard
    return chunks


def _file_store(tmp_path: Path, fill: bool = False) -> tuple[str, Any]:
    """(url, the chunks of ``_filled``) with ``fill``, else (url, the Store): a file:// store of SPEC."""
    url = f"file://{tmp_path}/store"
    store = Store(url)
    store.put_run(SPEC)
    return url, (_filled(store) if fill else store)


def _readers(store: Store, backend, **kw) -> tuple[GuidanceReader, GuidanceReader]:
    url, opts = backend
    return (
        GuidanceReader(url, RUN, storage_options=opts, prefetch=False, **kw),
        GuidanceReader(url, RUN, storage_options=opts, process=True, timeout=60, **kw),
    )


def test_process_reads_return_the_same_rows(store: Store, backend):
    url, opts = backend
    if url.startswith("memory://"):  # the child cannot see this process's memory
        with pytest.raises(ConfigError, match=r"process=True reads a storage URL another process can open"):
            GuidanceReader(url, RUN, storage_options=opts, process=True)
        return
    _filled(store)
    plan = [("t1", 2, 9), ("t0", 0, 9), (None, 0, 3), ("t9", 0, 2)]  # padding and a missing trajectory
    for kw in ({}, {"columns": (32, 64)}, {"sites": [S1.name, S2.name]}):
        here, child = _readers(store, backend, on_missing="mask", **kw)
        with here, child:
            a, b = here.read_host(plan), child.read_host(plan)
            _same(a, b)
            assert not b[next(iter(b))].valid[-2:].any()  # t9: masked, not invented
            assert child.read_host(plan) is not b  # a second read of the same plan: same rows again
            _same(a, child.read_host(plan))
            # prefetch + read (torch tensors) through the child
            child.prefetch(plan)
            g = child.read(plan)
            for name in a:
                np.testing.assert_array_equal(g[name].codes.numpy(), a[name].codes)
                np.testing.assert_array_equal(g[name].valid.numpy(), a[name].valid)


def test_child_errors_keep_their_class_and_the_child_keeps_serving(tmp_path: Path):
    url, _ = _file_store(tmp_path, fill=True)
    with GuidanceReader(url, RUN, prefetch=False, process=True, timeout=60) as reader:
        pid = reader._rows.procs.pids[0]
        with pytest.raises(MissingRecordsError, match=r"t9"):
            reader.read_host([("t9", 0, 3)])
    with (
        GuidanceReader(url, RUN, prefetch=False, process=True, columns=(16, 48)) as bad,
        pytest.raises(ConfigError, match=r"aligned to the mxfp4 block 32"),
    ):
        bad.read_host([("t0", 0, 9)])
    with GuidanceReader(url, RUN, prefetch=False, process=True, timeout=60) as reader:
        pid = reader._rows.procs.pids[0]
        good = reader.read_host([("t0", 0, 9)])
        assert good[S0.name].valid.all()
        # flip one byte of every shard's codes: the child's verification catches it, same class here
        for shard in Path(tmp_path, "store").rglob("*.parquet"):
            md = pq.ParquetFile(shard).metadata
            data = bytearray(shard.read_bytes())
            for g in range(md.num_row_groups):
                col = md.row_group(g).column(md.schema.names.index("codes"))
                data[col.data_page_offset + col.total_compressed_size // 2] ^= 0x40
            shard.write_bytes(bytes(data))
        with pytest.raises(CorruptionError):
            GuidanceReader(url, RUN, prefetch=False, process=True).read_host([("t0", 0, 9)])
        assert reader._rows.procs.pids[0] == pid  # errors did not cost the child


def test_a_dead_child_fails_the_read_in_progress_then_is_replaced(tmp_path: Path, monkeypatch):
    url, chunks = _file_store(tmp_path, fill=True)
    plan = [("t0", 0, 9)]
    with GuidanceReader(url, RUN, prefetch=False, process=True, timeout=60) as reader:
        first = reader.read_host(plan)
        # killed while idle: the next read starts another child and succeeds
        os.kill(reader._rows.procs.pids[0], signal.SIGKILL)
        time.sleep(0.2)
        again = reader.read_host(plan)
        _same(first, again)
        np.testing.assert_array_equal(again[S0.name].codes, chunks[0].codes)
        # killed during a read: that read raises StorageError, the next one works
        real_send = read_process._Child.send_read

        def send_then_die(self, *a, **kw):
            real_send(self, *a, **kw)
            os.kill(self.proc.pid, signal.SIGKILL)

        monkeypatch.setattr(read_process._Child, "send_read", send_then_die)
        with pytest.raises(StorageError, match=r"read process .* exited \(code -9\) during a read"):
            reader.read_host(plan)
        monkeypatch.setattr(read_process._Child, "send_read", real_send)
        _same(first, reader.read_host(plan))
        # arrays of an earlier child stay readable after it is gone
        np.testing.assert_array_equal(first[S0.name].codes, chunks[0].codes)


def test_live_results_keep_their_block_and_dropped_ones_are_reused(tmp_path: Path):
    url, chunks = _file_store(tmp_path, fill=True)
    with GuidanceReader(url, RUN, prefetch=False, process=True, timeout=60) as reader:
        kept = [reader.read_host([("t0", 0, 9)]), reader.read_host([("t1", 0, 9)]), reader.read_host([("t0", 3, 9)])]
        views = [k[S0.name].codes for k in kept]
        for i in range(3):  # three live results: three different blocks
            for j in range(i):
                assert not np.shares_memory(views[i], views[j])
        for _ in range(12):  # dropped at once: their blocks come back
            reader.read_host([("t1", 0, 9), ("t0", 0, 9)])
        gc.collect()
        reader.read_host([("t1", 0, 5)])
        assert len(reader._rows.procs._blocks) <= len(kept) + SPARE_BLOCKS
        # the kept results were never overwritten by the later reads
        np.testing.assert_array_equal(kept[0][S0.name].codes, chunks[0].codes)
        np.testing.assert_array_equal(kept[1][S0.name].codes, chunks[3].codes)
        np.testing.assert_array_equal(kept[2][S0.name].codes, chunks[0].codes[3:])
        tail = kept[1][S1.name]  # a token-scale site, 2 rows per token
        np.testing.assert_array_equal(tail.token_scales, chunks[4].token_scales)
        # five blocks in use, then all free: the next read takes them back, keeps SPARE_BLOCKS of
        # them (one of which it uses), and the child unmaps the others with that read's message
        kept += [reader.read_host([("t0", 0, 9)]) for _ in range(2)]
        assert len(reader._rows.procs._blocks) == 5
        del kept, views, tail
        gc.collect()
        last = reader.read_host([("t1", 0, 9)])
        assert len(reader._rows.procs._blocks) == SPARE_BLOCKS
        assert _memfd_maps(reader._rows.procs.pids[0]) == SPARE_BLOCKS
        np.testing.assert_array_equal(last[S0.name].codes, chunks[3].codes)


def _memfd_maps(pid: int) -> int:
    """How many of our memfd blocks process ``pid`` maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return len({line.split()[4] for line in lines if "memfd:tracestore-read" in line})


def test_process_needs_a_storage_url_and_a_count(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"process=True"):
        GuidanceReader("127.0.0.1:7433", RUN, process=True)
    url, _ = _file_store(tmp_path)
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ConfigError, match=r"process must be False, True or a number of child processes"):
            GuidanceReader(url, RUN, process=bad)


def test_several_children_split_a_read_and_return_the_same_rows(tmp_path: Path, monkeypatch):
    # process=3, every plan cut into 3 slices (one trajectory split between children; token
    # scales in some slices only; padding; a masked trajectory): the rows of one process's read
    monkeypatch.setattr(read_process, "MIN_SLICE_BYTES", 1)
    url, store = _file_store(tmp_path)
    rng = np.random.default_rng(5)
    chunks = [
        make_chunk(s, t, 0, 20, rng=rng, token_scales=(s is S1 and t == "t1")) for t in ("t0", "t1") for s in SITES
    ]
    store.write_shard(RUN, 0, "w0", 0, chunks)
    plans = [
        [("t0", 0, 20), ("t1", 0, 20)],
        [("t1", 5, 20), (None, 0, 4), ("t0", 0, 7), ("t9", 0, 3)],
        [("t0", 3, 4)],  # fewer tokens than children
    ]
    here = GuidanceReader(url, RUN, prefetch=False, on_missing="mask")
    many = GuidanceReader(url, RUN, prefetch=False, on_missing="mask", process=3, timeout=60)
    with here, many:
        for plan in plans:
            _same(here.read_host(plan), many.read_host(plan))
        assert len(many._rows.procs.pids) == 3
        # one slice missing a record: the error of that child, the other replies drained
        strict = GuidanceReader(url, RUN, prefetch=False, process=3, timeout=60)
        with strict:
            with pytest.raises(MissingRecordsError, match=r"t9"):
                strict.read_host([("t0", 0, 20), ("t1", 0, 20), ("t9", 0, 2)])
            _same(here.read_host(plans[0]), strict.read_host(plans[0]))


def test_read_processes_return_stale_flags_and_columns_of_each_slice(tmp_path: Path, monkeypatch):
    # two children, one slice each: t1 (v1, current) and t0 (v0, flagged stale with max_staleness=0)
    monkeypatch.setattr(read_process, "MIN_SLICE_BYTES", 1)
    url, _ = _file_store(tmp_path, fill=True)
    plan = [("t1", 0, 9), ("t0", 0, 9)]
    kw = {"max_staleness": 0, "stale": "flag", "columns": (32, 64)}
    with StoreReader(Store(url), RUN) as here:
        want = dict(here.read(plan, **kw).rows)
        procs = read_process.ReadProcesses(url, RUN, None, 60, n=2)
        try:
            got, _ = procs.read(plan, here.layout(18, None, (32, 64)), **kw)
        finally:
            procs.close()
    _same(want, got)
    assert not got[S0.name].stale[: 9 * S0.rows_per_token].any() and got[S0.name].stale[9 * S0.rows_per_token :].all()
    assert got[S0.name].columns == (32, 64)


def test_a_child_that_stops_answering_times_out_and_is_replaced(tmp_path: Path):
    url, chunks = _file_store(tmp_path, fill=True)
    with GuidanceReader(url, RUN, prefetch=False, process=True, timeout=1.0) as reader:
        pid = reader._rows.procs.pids[0]
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"did not answer in 1.0 s during a read"):
            reader.read_host([("t0", 0, 9)])
        assert time.monotonic() - t0 < 4  # killed, not waited for
        got = reader.read_host([("t0", 0, 9)])
        assert reader._rows.procs.pids[0] != pid
        np.testing.assert_array_equal(got[S0.name].codes, chunks[0].codes)


def test_close_does_not_wait_for_a_prefetch_in_flight_and_ends_the_children(tmp_path: Path):
    url, _ = _file_store(tmp_path, fill=True)
    reader = GuidanceReader(url, RUN, process=2, timeout=60)
    pids = reader._rows.procs.pids
    os.kill(pids[0], signal.SIGSTOP)  # the prefetch below hangs in this child
    reader.prefetch([("t0", 0, 9)])
    time.sleep(0.3)
    t0 = time.monotonic()
    reader.close()
    assert time.monotonic() - t0 < 8  # stopped children are killed after the grace, not waited on
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped


def test_an_unclosed_reader_takes_its_children_with_it(tmp_path: Path):
    url, _ = _file_store(tmp_path, fill=True)
    reader = GuidanceReader(url, RUN, prefetch=False, process=1)
    reader.read_host([("t0", 0, 9)])
    pid = reader._rows.procs.pids[0]
    del reader
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"read process {pid} outlived its reader")


# the point is a fork of a multi-threaded process (a trainer forking DataLoader workers); the fork
# only calls the reader and exits (Python 3.12 warns about forking with threads)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_copy_neither_reads_nor_stops_the_children(tmp_path: Path):
    url, chunks = _file_store(tmp_path, fill=True)
    with GuidanceReader(url, RUN, prefetch=False, process=1, timeout=60) as reader:
        reader.read_host([("t0", 0, 9)])
        pid = os.fork()
        if pid == 0:  # the fork (a DataLoader worker, say): refused, and closing it is a no-op
            code = 1
            try:
                reader.read_host([("t0", 0, 9)])
            except StorageError as exc:
                code = 0 if "made in another process" in str(exc) else 2
            reader.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        got = reader.read_host([("t0", 0, 9)])  # the owner's children still answer
        np.testing.assert_array_equal(got[S0.name].codes, chunks[0].codes)


_CYCLES = """
import gc, sys
from tracestore.client import GuidanceReader
reader = GuidanceReader(sys.argv[1], sys.argv[2], prefetch=False, process=1, timeout=60)
procs = reader._rows.procs
for k in range(1, 40):
    rows = reader.read_host([("t0", 0, 9)])
    take = procs._take  # (a bound method is a container: made before, not in between)
    gc.collect()  # allocation counts to 0
    cycle = [rows]  # one allocation
    cycle.append(cycle)  # only the cyclic collector frees it
    # a collection at the k-th allocation from here: for some k inside _take's lock (the
    # version whose finalizer took the lock deadlocked here within k < 40)
    gc.set_threshold(1 + k)
    del rows, cycle
    block, _ = take(1024)
    gc.set_threshold(700, 10, 10)
    procs._returned.put(block)  # give the block back as a finalizer would
reader.close()
print("ok")
"""


def test_blocks_freed_by_the_cyclic_collector_inside_a_read_do_not_deadlock(tmp_path: Path):
    # A result caught in a reference cycle is freed by the cyclic GC at whatever allocation comes
    # next: here the first one inside the reader's block bookkeeping, with its lock held. Its
    # finalizer must not take that lock (it only queues the block). In a process of its own, with
    # one thread (the GC runs in the thread that allocates) and a deadline (a deadlock hangs).
    import subprocess
    import sys

    url, _ = _file_store(tmp_path, fill=True)
    try:
        done = subprocess.run([sys.executable, "-c", _CYCLES, url, RUN], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the reader deadlocked freeing a block inside its own bookkeeping")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
