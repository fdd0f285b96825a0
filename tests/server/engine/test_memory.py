"""Many concurrent streams against storage that accepts nothing: the sidecar's memory stays within
its budget (peak RSS - baseline <= budget + 64 MiB), surplus writes are pushed back
(RESOURCE_EXHAUSTED with a retry hint), never dropped: every acknowledged message is stored once
storage recovers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tracestore.server.testing import SPEC, ServeProcess, make_chunk, write_request

from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

BUDGET_MIB = 32
STREAMS = 12
MESSAGES = 24


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


@pytest.mark.slow
def test_memory_bounded_and_nothing_acked_is_lost(tmp_path: Path) -> None:
    sp = ServeProcess(tmp_path, flags=["--memory-budget-mib", str(BUDGET_MIB), "--max-message-mib", "2",
                                       "--backpressure-timeout", "1", "--flush-interval", "0.1"]).start()  # fmt: skip
    try:
        ch = grpc.insecure_channel(sp.address, options=[("grpc.max_send_message_length", 4 << 20)])
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        # declare the run (v0), then make every v1 shard write fail: a file where the v1 directory goes
        list(
            call(iter([write_request(1, [make_chunk("warm", 0, 4)], writer="warm", declare=True).SerializeToString()]))
        )
        root = Path(sp.storage.removeprefix("file://"))
        blocker = root / SPEC.run / "v1"
        blocker.write_text("storage is down")
        assert sp.proc is not None
        time.sleep(0.5)
        baseline = _rss_kib(sp.proc.pid, "VmRSS")
        acked: dict[str, int] = {}
        codes: dict[str, list[str]] = {}

        def flood(k: int) -> None:
            writer = f"flood-{k}"
            msgs = []
            for i in range(1, MESSAGES + 1):
                chunks = [make_chunk(f"{writer}-{i}-{j}", 0, 32768, version=1) for j in range(4)]  # ~1.5 MiB
                msgs.append(write_request(i, chunks, writer=writer).SerializeToString())
            try:
                for resp in call(iter(msgs), timeout=60):
                    from tracestore.v1 import tracestore_pb2 as pb

                    acked[writer] = pb.WriteResponse.FromString(resp).durable_sequence
            except grpc.RpcError as exc:
                codes.setdefault(exc.code().name, []).append(writer)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "retry-after-ms" in dict(exc.trailing_metadata() or ())

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = _rss_kib(sp.proc.pid, "VmHWM")
        grown_mib = (peak - baseline) / 1024
        offered_mib = STREAMS * MESSAGES * 1.5
        assert codes.get("RESOURCE_EXHAUSTED"), f"{offered_mib} MiB offered, nothing pushed back: {codes}"
        assert set(codes) <= {"RESOURCE_EXHAUSTED"}, codes
        assert grown_mib <= BUDGET_MIB + 64, f"sidecar grew {grown_mib:.0f} MiB for a {BUDGET_MIB} MiB budget"
        blocker.unlink()  # storage recovers
        assert sum(acked.values()) > 0
        deadline = time.monotonic() + 60
        store = Store(sp.storage)
        want = [(f"{w}-{i}-{j}", 0, 32768) for w, n in acked.items() for i in range(1, n + 1) for j in range(4)]
        while True:
            try:
                rows = StoreReader(store, SPEC.run).read(
                    MicrobatchPlan(want), versions=[1], sites=["layers.1.mlp.input"]
                )
                break
            except Exception:  # noqa: BLE001 - not flushed yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert rows["layers.1.mlp.input"].valid.all()
        entries = [(e.trajectory, e.site) for m in store.manifests(SPEC.run, 1) for e in m.chunks]
        assert len(entries) == len(set(entries)), "duplicates"
        ch.close()
    finally:
        sp.kill()


FLOOD_STREAMS = 60
FLOOD_BUDGET_MIB = 64
FLOOD_TOKENS = 1 << 19  # one chunk of 6 MiB per message (12 bytes per token at layers.1.mlp.input)


def _flood_messages(writer: str, n: int, codes: bytes, scales: bytes) -> Iterator[bytes]:
    """``n`` WriteRequests of one large chunk each, built as gRPC pulls them (the test process
    never holds more than a message per stream)."""
    from tracestore.v1 import tracestore_pb2 as pb

    for i in range(1, n + 1):
        chunk = pb.Chunk(policy_version=1, trajectory=f"{writer}-{i}", site="layers.1.mlp.input", token_start=0,
                         n_tokens=FLOOD_TOKENS, codes=codes, scales=scales, global_scale=0.25)  # fmt: skip
        yield pb.WriteRequest(run=SPEC.run, writer=writer, epoch=1, sequence=i, chunks=[chunk]).SerializeToString()


@pytest.mark.slow
def test_sixty_streams_stay_within_the_budget(tmp_path: Path) -> None:
    """60 streams flood a sidecar with a 64 MiB budget while storage refuses every shard: RSS grows
    by at most budget + 64 MiB, and surplus is pushed back (RESOURCE_EXHAUSTED), never lost. Each
    stream reserves room for the largest message before it asks gRPC for one, and only the streams
    the budget covers ask at a time. (Before: each stream reserved its previous message's size and
    let go of it before waiting, and the sidecar grew by ~1.1 GiB.)"""
    sp = ServeProcess(tmp_path, flags=["--memory-budget-mib", str(FLOOD_BUDGET_MIB), "--max-message-mib", "8",
                                       "--backpressure-timeout", "1", "--flush-interval", "0.1"]).start()  # fmt: skip
    try:
        assert sp.proc is not None
        ch = grpc.insecure_channel(sp.address, options=[("grpc.max_send_message_length", 16 << 20)])
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        warm = write_request(1, [make_chunk("warm", 0, 4)], writer="warm", declare=True).SerializeToString()
        list(call(iter([warm])))
        (Path(sp.storage.removeprefix("file://")) / SPEC.run / "v1").write_text("storage is down")
        time.sleep(0.5)
        baseline = _rss_kib(sp.proc.pid, "VmRSS")
        codes, scales = bytes(FLOOD_TOKENS * 8), bytes([56]) * (FLOOD_TOKENS * 4)
        codes_seen: dict[str, int] = {}
        acked = [0]
        lock = threading.Lock()

        def flood(k: int) -> None:
            from tracestore.v1 import tracestore_pb2 as pb

            try:
                for resp in call(_flood_messages(f"flood-{k}", 6, codes, scales), timeout=120):
                    n = pb.WriteResponse.FromString(resp).durable_sequence
                    with lock:
                        acked[0] = max(acked[0], n)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes_seen[code] = codes_seen.get(code, 0) + 1

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(FLOOD_STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown_mib = (_rss_kib(sp.proc.pid, "VmHWM") - baseline) / 1024
        print(f"60 streams, {FLOOD_BUDGET_MIB} MiB budget: RSS grew {grown_mib:.0f} MiB; outcomes {codes_seen}")
        assert codes_seen.get("RESOURCE_EXHAUSTED"), codes_seen
        assert set(codes_seen) <= {"RESOURCE_EXHAUSTED", "OK"}, codes_seen
        assert grown_mib <= FLOOD_BUDGET_MIB + 64, f"grew {grown_mib:.0f} MiB for a {FLOOD_BUDGET_MIB} MiB budget"
        ch.close()
    finally:
        sp.kill()


def _read(ch: grpc.Channel, plan: list[tuple[str, int, int]], timeout: float = 60) -> int:
    """Bytes of the ReadResponses for ``plan`` (missing records masked)."""
    from tracestore.v1 import tracestore_pb2 as pb

    req = pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory=t, token_start=a, token_end=b) for t, a, b in plan],
                         on_missing=pb.ON_MISSING_MASK)  # fmt: skip
    return sum(len(r) for r in ch.unary_stream("/tracestore.v1.TraceStore/Read")(req.SerializeToString(),
                                                                                  timeout=timeout))  # fmt: skip


@pytest.mark.slow
def test_reads_are_bounded_and_inside_the_budget(tmp_path: Path) -> None:
    """A Read's output is sized from its plan before anything is read: tokens [0, 2^24) of a
    100-token trajectory (~1.4 GiB of masked rows) and [0, 2^40) are RESOURCE_EXHAUSTED naming the
    limit and the size, at no memory cost (before: +2 GiB, and INTERNAL for 2^40). Reads under
    the limit hold their output against the read budget: four concurrent 40 MiB reads on a
    64 MiB read budget take turns instead of growing the sidecar by all four at once."""
    sp = ServeProcess(tmp_path, flags=["--memory-budget-mib", "64", "--max-read-mib", "48", "--max-message-mib", "4",
                                       "--read-budget-mib", "64", "--backpressure-timeout", "30"]).start()  # fmt: skip
    try:
        assert sp.proc is not None
        ch = grpc.insecure_channel(sp.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
        first = write_request(1, [make_chunk("short", 0, 100)], writer="w", declare=True).SerializeToString()
        list(call(iter([first])))
        assert _read(ch, [("short", 0, 100)]) > 0  # warm: the read path's modules are loaded
        time.sleep(0.5)
        baseline = _rss_kib(sp.proc.pid, "VmRSS")
        for end in (1 << 24, 1 << 40):
            with pytest.raises(grpc.RpcError) as e:
                _read(ch, [("short", 0, end)])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (end, e.value.code(), e.value.details())
            assert "max_read_bytes" in (e.value.details() or "") and str(end * 84) in (e.value.details() or "")
        grown_mib = (_rss_kib(sp.proc.pid, "VmHWM") - baseline) / 1024
        assert grown_mib < 16, f"refused reads grew the sidecar by {grown_mib:.0f} MiB"
        # 84 bytes per token over both sites: 500k tokens ~ 40 MiB of output each
        sizes: list[int | str] = []

        def one(k: int) -> None:
            try:
                sizes.append(_read(ch, [(f"ghost-{k}", 0, 500_000)]))
            except grpc.RpcError as exc:
                sizes.append(exc.code().name)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown_mib = (_rss_kib(sp.proc.pid, "VmHWM") - baseline) / 1024
        print(f"4 concurrent 40 MiB reads, 64 MiB read budget: RSS grew {grown_mib:.0f} MiB; {sizes}")
        assert all(isinstance(s, int) and s > 30_000_000 for s in sizes), sizes
        assert grown_mib <= 64 + 64, f"4 concurrent reads grew the sidecar {grown_mib:.0f} MiB for a 64 MiB read budget"
        ch.close()
    finally:
        sp.kill()
