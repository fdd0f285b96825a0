"""6. 300 Write streams against storage that accepts nothing: the sidecar's memory stays within
peak RSS - idle RSS <= budget + 64 MiB, the surplus is refused with RESOURCE_EXHAUSTED within a
bound (not left hanging, never dropped: every stream ends acknowledged or refused), and everything
acknowledged is stored once storage is back.
7. 100 idle Write streams beside a health probe: health answers within 1 s.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tracestore.v1 import tracestore_pb2 as pb

from .harness import WRITE, Msg, Sidecar, Writer, converged, make_recs, row, verify, wait_until

BUDGET_MIB = 64
STREAMS = 300
MESSAGES = 3  # per stream, ~185 KiB each: ~160 MiB offered against a 64 MiB budget
REFUSE_BOUND_S = 30.0  # a stream neither acknowledged nor refused by then is left hanging


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_300_streams_storage_down_memory_bounded(tmp_path: Path) -> None:
    r = row(f"6 {STREAMS} streams, storage down, budget {BUDGET_MIB} MiB")
    sc = Sidecar(
        tmp_path,
        flags=["--memory-budget-mib", str(BUDGET_MIB), "--max-message-mib", "1", "--backpressure-timeout", "1",
               "--flush-interval", "0.1", "--storage-timeout", "5", "--grace", "5"],
    )  # fmt: skip
    problems: list[str] = []
    outcome: dict[str, tuple[str, int]] = {}  # writer -> (code or OK, durable sequence)
    sent: dict[str, list[Msg]] = {}
    try:
        sc.start()
        warm = Writer("warm", trajs=1, tokens=8)  # declares the run (v0), commits
        assert warm.session(sc.address, max_new=1, timeout=20).code is None
        assert wait_until(lambda: converged(sc, "warm"), 20)
        blocker = sc.data_dir / "faults" / "v1"  # every v1 shard write fails: a file where its directory goes
        blocker.write_text("storage is down")
        time.sleep(0.5)
        idle = sc.rss()[0]
        for k in range(STREAMS):
            writer = f"flood-{k}"
            msgs = [Msg(i, make_recs(writer, i, trajs=4, tokens=768, version=1)) for i in range(MESSAGES)]
            for seq, m in enumerate(msgs, start=1):
                m.epoch, m.seq = 1, seq
            sent[writer] = msgs
        channels = [grpc.insecure_channel(sc.address) for _ in range(10)]
        start = threading.Barrier(STREAMS + 1)

        def flood(k: int) -> None:
            writer = f"flood-{k}"
            reqs = [m.request("faults", writer, declare=False) for m in sent[writer]]
            durable = 0
            start.wait()
            try:
                call = channels[k % len(channels)].stream_stream(WRITE)
                for raw in call(iter(reqs), timeout=REFUSE_BOUND_S):
                    durable = max(durable, pb.WriteResponse.FromString(raw).durable_sequence)
                outcome[writer] = ("OK", durable)
            except grpc.RpcError as exc:
                outcome[writer] = (exc.code().name, durable)

        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(STREAMS)]
        for t in threads:
            t.start()
        start.wait()
        peak_rss = 0
        while any(t.is_alive() for t in threads):
            peak_rss = max(peak_rss, sc.rss()[0])
            time.sleep(0.05)
        peak = max(peak_rss, sc.rss()[1])
        r.rss_mib = (peak - idle) / 1024
        for ch in channels:
            ch.close()
        codes = Counter(code for code, _ in outcome.values())
        r.trials = STREAMS
        r.add_note(f"codes {dict(codes)}")
        if r.rss_mib > BUDGET_MIB + 64:
            problems.append(f"sidecar grew {r.rss_mib:.0f} MiB for a {BUDGET_MIB} MiB budget (bound +64)")
        if not codes.get("RESOURCE_EXHAUSTED"):
            problems.append(f"nothing refused with RESOURCE_EXHAUSTED: {dict(codes)}")
        hung = codes.get("DEADLINE_EXCEEDED", 0)
        if hung:
            problems.append(f"{hung} streams neither acknowledged nor refused within {REFUSE_BOUND_S:.0f} s")
        other = {c: n for c, n in codes.items() if c not in ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")}
        if other:
            problems.append(f"unexpected codes {other}")
        dropped = [w for w, (c, d) in outcome.items() if c == "OK" and d < MESSAGES]
        if dropped:
            problems.append(f"{len(dropped)} streams ended OK without every message acknowledged: {dropped[:3]}")
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
    assert chk.acked > 0, "nothing was acknowledged at all"
    assert chk.ok(), chk
    assert not problems, "\n".join(problems)


IDLE_STREAMS = 100


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_health_answers_beside_100_idle_streams(tmp_path: Path) -> None:
    r = row(f"7 {IDLE_STREAMS} idle streams + health probe")
    sc = Sidecar(tmp_path, flags=["--grace", "5"])
    release = threading.Event()
    problems: list[str] = []
    latencies: list[float] = []
    try:
        sc.start()
        idle = sc.rss()[0]
        channels = [grpc.insecure_channel(sc.address) for _ in range(4)]
        calls = []

        def nothing() -> object:
            release.wait(60)
            return
            yield  # a generator that sends no message until released

        for k in range(IDLE_STREAMS):
            calls.append(channels[k % 4].stream_stream(WRITE)(nothing(), timeout=60))
        time.sleep(1.0)  # let the server take every stream in
        with grpc.insecure_channel(sc.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(10):
                t0 = time.monotonic()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    latencies.append(time.monotonic() - t0)
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        problems.append(f"health {status} beside idle streams")
                except grpc.RpcError as exc:
                    latencies.append(time.monotonic() - t0)
                    problems.append(f"health probe failed: {exc.code().name} after {latencies[-1]:.2f} s")
                time.sleep(0.1)
        r.rss_mib = (sc.rss()[1] - idle) / 1024
        release.set()
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()
        r.trials = len(latencies)
        r.add_note(f"health max {max(latencies) * 1000:.0f} ms over {len(latencies)} probes")
        if sc.terminate(15) != 0:
            problems.append("SIGTERM exit code not 0")
    finally:
        release.set()
        sc.kill()
    for p in problems[:2]:
        r.add_note(p[:150])
    assert not problems, "\n".join(problems)
    assert max(latencies) < 1.0
