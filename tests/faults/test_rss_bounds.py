"""12. The memory bound, measured as the kernel sees it: in each scenario the sidecar's peak RSS
minus its idle RSS stays within ``--memory-budget-mib`` + 64 MiB (tests/faults/rss.py prints the
table: scenario, budget, bound, idle RSS, peak RSS, peak - idle, ok), and nothing acknowledged is
lost.

- 57 MiB messages against a 256 MiB budget, with the write-ahead log and without (acks at commit);
- S3 down for a few seconds mid-ingest, 64 MiB budget: connections refused (moto stopped), black-
  holed (a listener on its port that accepts and never answers), wiped (moto reset: the bucket and
  everything in it gone, the bucket made again later, as an object store restarted empty);
- 300 Write streams at once while storage refuses every shard, 64 MiB budget.

What the budget counts, and why each scenario stays within it: docs/operations.md, "What the
memory budget counts".
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

from .harness import (
    SITE_A,
    SPEC,
    WRITE,
    Background,
    Msg,
    Sidecar,
    Writer,
    converged,
    free_port,
    make_recs,
    row,
    verify,
    wait_until,
)
from .rss import BlackHole, RssWatch, start_idle
from .test_s3_outage import _options

MiB = 1 << 20

# -- large messages ------------------------------------------------------------------------------

BIG_BUDGET_MIB = 256
BIG_MSG_MIB = 57
BIG_WRITERS = 4
BIG_MESSAGES = 2  # per writer
BIG_CHUNK_TOKENS = 1 << 19  # 12 MiB chunks (24 bytes a token at SITE_A)


def _big_request(writer: str, seq: int, block: bytes) -> bytes:
    """A WriteRequest of about BIG_MSG_MIB MiB: chunks of SITE_A cut from ``block`` (distinct
    trajectories per message, so every chunk is a new record)."""
    tokens = BIG_MSG_MIB * MiB // (SITE_A.code_bytes + SITE_A.scale_bytes)
    chunks, k = [], 0
    while tokens > 0:
        n = min(tokens, BIG_CHUNK_TOKENS)
        codes = block[k % 7 : k % 7 + SITE_A.code_bytes * n]
        scales = block[k % 5 : k % 5 + SITE_A.scale_bytes * n]
        chunks.append(pb.Chunk(policy_version=0, trajectory=f"{writer}.{seq}.{k}", site=SITE_A.name, token_start=0,
                               n_tokens=n, codes=codes, scales=scales, global_scale=0.25))  # fmt: skip
        tokens -= n
        k += 1
    req = pb.WriteRequest(run=SPEC.run, writer=writer, epoch=1, sequence=seq, chunks=chunks)
    if seq == 1:
        req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
    return req.SerializeToString()


def _stored_keys(storage: str) -> Counter[tuple[str, str]]:
    from tracestore.storage.store import Store

    store = Store(storage)
    return Counter((e.trajectory, e.site) for m in store.manifests(SPEC.run, 0) for e in m.chunks)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("wal", ["wal", "no-wal"])
def test_rss_large_messages(tmp_path: Path, wal: str) -> None:
    name = f"12 {BIG_MSG_MIB} MiB messages, {wal}"
    r = row(name)
    flags = ["--memory-budget-mib", str(BIG_BUDGET_MIB), "--flush-interval", "0.2", "--backpressure-timeout", "60",
             "--grace", "10"] + (["--wal-dir", "off"] if wal == "no-wal" else [])  # fmt: skip
    sc = Sidecar(tmp_path, flags=flags)
    block = np.random.default_rng(7).integers(0, 256, 16 * BIG_CHUNK_TOKENS + 8, dtype=np.uint8).tobytes()
    outcome: dict[str, tuple[str, int]] = {}
    problems: list[str] = []
    try:
        start_idle(sc)
        watch = RssWatch(sc, name, BIG_BUDGET_MIB)

        def send(writer: str) -> None:
            # as a recorder does: a stream that ends (OK: the sidecar passes an idle turn on while
            # a message is still on its way) is opened again and what is unacknowledged resent
            durable, code = 0, "OK"
            opts = [("grpc.max_send_message_length", 256 * MiB)]
            deadline = time.monotonic() + 150
            with grpc.insecure_channel(sc.address, options=opts) as ch:
                while durable < BIG_MESSAGES and time.monotonic() < deadline:
                    reqs = (_big_request(writer, seq, block) for seq in range(durable + 1, BIG_MESSAGES + 1))
                    try:
                        for raw in ch.stream_stream(WRITE)(reqs, timeout=deadline - time.monotonic()):
                            durable = max(durable, pb.WriteResponse.FromString(raw).durable_sequence)
                        code = "OK"
                    except grpc.RpcError as exc:
                        code = exc.code().name
                        time.sleep(0.2)
            outcome[writer] = (code, durable)

        writers = [f"big-{k}" for k in range(BIG_WRITERS)]
        threads = [threading.Thread(target=send, args=(w,), daemon=True) for w in writers]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not wait_until(lambda: sc.stat().backlog_bytes == 0, 60, 0.1):
            r.wedged = 1
            problems.append("backlog did not drain")
        breach = watch.check()
        r.rss_mib = watch.row.grown_mib
        r.trials = len(writers)
        r.add_note(f"{BIG_WRITERS * BIG_MESSAGES * BIG_MSG_MIB} MiB in {time.monotonic() - t0:.1f} s")
        if breach:
            problems.append(breach)
        bad = {w: o for w, o in outcome.items() if o != ("OK", BIG_MESSAGES)}
        if bad:
            problems.append(f"streams that did not end with every message acknowledged: {bad}")
        if sc.terminate(30) != 0:
            problems.append("SIGTERM exit code not 0")
    finally:
        sc.kill()
    stored = _stored_keys(sc.storage)
    acked = [(f"{w}.{seq}.{k}", SITE_A.name) for w, (_, d) in outcome.items() for seq in range(1, d + 1)
             for k in range(-(-BIG_MSG_MIB * MiB // 24 // BIG_CHUNK_TOKENS))]  # fmt: skip
    r.acked = len(acked)
    r.lost = sum(1 for key in acked if stored[key] == 0)
    r.duplicated = sum(n - 1 for n in stored.values() if n > 1)
    for p in problems:
        r.add_note(p[:150])
    assert not r.lost and not r.duplicated, (r.lost, r.duplicated)
    assert not problems, "\n".join(problems)


# -- S3 outages ----------------------------------------------------------------------------------

S3_BUDGET_MIB = 64
OUTAGE_S = 6.0


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["refused", "black-holed", "wiped"])
def test_rss_s3_outage(tmp_path: Path, mode: str) -> None:
    moto = pytest.importorskip("moto.server", reason="needs moto[server]>=5.2.5 (the dev extra)")
    s3fs = pytest.importorskip("s3fs", reason="needs the s3 extra")
    name = f"12 S3 {mode}, {S3_BUDGET_MIB} MiB budget"
    r = row(name)
    port = free_port()
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"ts-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(**_options(endpoint), skip_instance_cache=True)
    fs.mkdir(bucket)
    url = f"s3://{bucket}/root"
    sc = Sidecar(
        tmp_path, storage=url, storage_options=_options(endpoint),
        flags=["--flush-interval", "0.2", "--storage-timeout", "3", "--memory-budget-mib", str(S3_BUDGET_MIB),
               "--max-message-mib", "4", "--backpressure-timeout", "1", "--wal-segment-mib", "4", "--grace", "10"],
    )  # fmt: skip
    w = Writer("s3-rss", trajs=4, tokens=1024, window=4)
    problems: list[str] = []
    first_after = 0  # payloads from here on were sent after the outage began
    up, hole = True, None
    try:
        start_idle(sc)
        watch = RssWatch(sc, name, S3_BUDGET_MIB)
        with Background(w, sc.address, session_s=3.0, pace_s=0.0):
            if not wait_until(lambda: sc.stat().shards_committed > 0, 20):
                problems.append("no shard committed before the outage")
            first_after = w.next_payload
            if mode == "wiped":
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
            else:
                server.stop()
                up = False
                hole = BlackHole(port) if mode == "black-holed" else None
            peak_backlog = 0
            t_end = time.monotonic() + OUTAGE_S
            while time.monotonic() < t_end:
                with contextlib.suppress(grpc.RpcError):
                    peak_backlog = max(peak_backlog, sc.stat(timeout=2).backlog_bytes)
                time.sleep(0.2)
            if hole is not None:
                hole.close()
            if mode == "wiped":
                fs.mkdir(bucket)  # the object store is back, empty
            else:
                server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
                server.start()
                up = True
            time.sleep(1.0)
        w.drain(sc.address, timeout=30)
        if not wait_until(lambda: converged(sc, w.writer), 40, 0.2):
            r.wedged = 1
            problems.append(f"backlog did not drain after S3 came back: {sc.stat()}")
        breach = watch.check()
        r.rss_mib = watch.row.grown_mib
        r.trials = 1
        r.add_note(f"backlog peak {peak_backlog >> 20} MiB")
        if breach:
            problems.append(breach)
        if sc.terminate(30) != 0:
            problems.append("SIGTERM exit code not 0")
    finally:
        sc.kill()
        if hole is not None:
            hole.close()
        if not up:
            server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
    # wiped: what was committed before the wipe went with the bucket; everything sent after it
    # must be there (what was only in the WAL then, too)
    recs = [rec for m in w.acked if mode != "wiped" or m.payload >= first_after for rec in m.recs]
    try:
        chk = verify(url, recs, _options(endpoint))
    finally:
        server.stop()
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    for p in ([str(chk)] if not chk.ok() else []) + problems:
        r.add_note(p[:150])
    assert chk.acked > 0
    assert chk.ok(), chk
    assert not problems, "\n".join(problems)


# -- a flood of streams --------------------------------------------------------------------------

FLOOD_BUDGET_MIB = 64
FLOOD_STREAMS = 300
FLOOD_MESSAGES = 3  # per stream, ~185 KiB each


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rss_300_streams_storage_down(tmp_path: Path) -> None:
    name = f"12 {FLOOD_STREAMS} streams, storage down, {FLOOD_BUDGET_MIB} MiB budget"
    r = row(name)
    sc = Sidecar(
        tmp_path,
        flags=["--memory-budget-mib", str(FLOOD_BUDGET_MIB), "--max-message-mib", "1", "--backpressure-timeout", "1",
               "--flush-interval", "0.1", "--storage-timeout", "5", "--grace", "5"],
    )  # fmt: skip
    problems: list[str] = []
    outcome: dict[str, tuple[str, int]] = {}
    sent: dict[str, list[Msg]] = {}
    try:
        start_idle(sc)
        watch = RssWatch(sc, name, FLOOD_BUDGET_MIB)
        warm = Writer("warm", trajs=1, tokens=8)  # declares the run (v0) and commits
        assert warm.session(sc.address, max_new=1, timeout=20).code is None
        assert wait_until(lambda: converged(sc, "warm"), 20)
        blocker = sc.data_dir / "faults" / "v1"  # every v1 shard write fails: a file where its directory goes
        blocker.write_text("storage is down")
        for k in range(FLOOD_STREAMS):
            msgs = [Msg(i, make_recs(f"flood-{k}", i, trajs=4, tokens=768, version=1)) for i in range(FLOOD_MESSAGES)]
            for seq, m in enumerate(msgs, start=1):
                m.epoch, m.seq = 1, seq
            sent[f"flood-{k}"] = msgs
        channels = [grpc.insecure_channel(sc.address) for _ in range(10)]
        go = threading.Barrier(FLOOD_STREAMS + 1)

        def flood(k: int) -> None:
            writer = f"flood-{k}"
            reqs = [m.request(SPEC.run, writer, declare=False) for m in sent[writer]]
            durable = 0
            go.wait()
            try:
                for raw in channels[k % len(channels)].stream_stream(WRITE)(iter(reqs), timeout=30):
                    durable = max(durable, pb.WriteResponse.FromString(raw).durable_sequence)
                outcome[writer] = ("OK", durable)
            except grpc.RpcError as exc:
                outcome[writer] = (exc.code().name, durable)

        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(FLOOD_STREAMS)]
        for t in threads:
            t.start()
        go.wait()
        for t in threads:
            t.join()
        for ch in channels:
            ch.close()
        breach = watch.check()
        r.rss_mib = watch.row.grown_mib
        codes = Counter(code for code, _ in outcome.values())
        r.trials = FLOOD_STREAMS
        r.add_note(f"codes {dict(codes)}")
        if breach:
            problems.append(breach)
        other = {c: n for c, n in codes.items() if c not in ("OK", "RESOURCE_EXHAUSTED")}
        if other:
            problems.append(f"unexpected codes {other}")
        blocker.unlink()  # storage is back
        if not wait_until(lambda: sc.stat().backlog_bytes == 0, 60, 0.2):
            r.wedged = 1
            problems.append(f"backlog did not drain once storage was back: {sc.stat().backlog_bytes} B")
        if sc.terminate(30) != 0:
            problems.append("SIGTERM exit code not 0")
    finally:
        sc.kill()
    acked = [rec for w, (_, d) in outcome.items() for m in sent[w] if m.seq <= d for rec in m.recs]
    chk = verify(sc.storage, acked, versions=[1])
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    for p in ([str(chk)] if not chk.ok() else []) + problems:
        r.add_note(p[:150])
    assert chk.ok(), chk
    assert not problems, "\n".join(problems)
