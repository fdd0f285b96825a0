"""Many concurrent streams against storage that accepts nothing: the sidecar's memory stays within
its budget (peak RSS - baseline <= budget + 64 MiB), surplus writes are pushed back
(RESOURCE_EXHAUSTED with a retry hint), never dropped: every acknowledged message is stored once
storage recovers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from tracestore.server.testing import SPEC, ServeProcess, make_chunk, write_request

from tracestore.plan import MicrobatchPlan
from tracestore.reader import StoreReader
from tracestore.store import Store

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
