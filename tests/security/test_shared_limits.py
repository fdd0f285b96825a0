"""One identity cannot take the shared count limits (``--max-runs``, ``--max-writers``) from another.

Before, both tables kept every entry for good and were shared by every caller: an identity with
only ``read:*`` that read (or Stat-ed) ``--max-runs`` runs existing on storage made the sidecar
refuse every other run, the first write of a new run included (RESOURCE_EXHAUSTED); an identity
allowed to write only its own runs took every writer session with as many writer ids, or every run
slot by declaring runs; and a first message that was refused (a sequence gap) still left its writer
session behind, owned by nobody. Each attack is real gRPC against a sidecar with tokens and a WAL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, write_request

from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb

from .tenants import code, first_write, meta, spec, start_sidecar, write

SITE = SPEC.sites[0].name
MAX_RUNS, MAX_WRITERS = 4, 8  # per identity by default: a quarter, 1 run and 2 writer sessions


def _start(tmp: Path, **config: object) -> Sidecar:
    return start_sidecar(tmp, **(dict(max_runs=MAX_RUNS, max_writers=MAX_WRITERS) | config))


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    sc = _start(tmp_path)
    yield sc
    sc.stop(5)


def _stat(port: int, who: str, run: str) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary("/tracestore.v1.TraceStore/Stat")
        try:
            call(pb.StatRequest(run=run).SerializeToString(), metadata=meta(who), timeout=20)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _read(port: int, who: str, run: str) -> str:
    req = pb.ReadRequest(run=run, plan=[pb.Segment(trajectory="never-written", token_start=0, token_end=4)],
                         sites=[SITE], on_missing=pb.ON_MISSING_MASK)  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream("/tracestore.v1.TraceStore/Read")
        try:
            list(call(req.SerializeToString(), metadata=meta(who), timeout=20))
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _writers(port: int) -> list[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        raw = ch.unary_unary("/tracestore.v1.TraceStore/Stat")(
            pb.StatRequest().SerializeToString(), metadata=meta("ops"), timeout=20
        )
    return [w.writer for w in pb.StatResponse.FromString(raw).writers]


def test_reads_take_no_run_slot_from_writers(sidecar: Sidecar) -> None:
    """A read:* identity reads and Stat-s three times --max-runs runs that exist on storage and
    names many that do not; the owner of a new run still writes it, and the reader can go on
    reading more runs (before: RESOURCE_EXHAUSTED for both once the reads had taken every slot)."""
    store = Store(sidecar.config.storage)
    stored = [f"team-c-{i}" for i in range(3 * MAX_RUNS)]
    for run in stored:
        store.put_run(spec(run))
    port = sidecar.port
    assert [_stat(port, "reader", run) for run in stored] == ["OK"] * len(stored)
    assert [_read(port, "reader", run) for run in stored] == ["OK"] * len(stored)
    assert {_stat(port, "reader", f"no-such-run-{i}") for i in range(3 * MAX_RUNS)} == {"OK"}
    assert {_read(port, "reader", f"no-such-run-{i}") for i in range(3 * MAX_RUNS)} == {"NOT_FOUND"}
    assert code(first_write(port, "team-a", "team-a-1")) == "OK"
    assert _read(port, "team-a", "team-a-1") == "OK"
    # the Read RPC's readers (a thread pool and an index each) are bounded too
    assert sidecar.service is not None and len(sidecar.service.reads._readers) <= MAX_RUNS
    # a caller that may not read a run is refused before the sidecar looks it up
    assert sidecar.engine is not None
    assert _read(port, "team-b", "team-c-0") == _stat(port, "team-b", "team-c-1") == "PERMISSION_DENIED"
    assert not {"team-c-0", "team-c-1"} & set(sidecar.engine.runs)


def test_one_identity_cannot_take_every_writer_session(sidecar: Sidecar) -> None:
    """team-b opens writer ids until refused: refused at its share (RESOURCE_EXHAUSTED naming the
    setting), and team-a's new writer id is still accepted (before: team-b took all
    --max-writers sessions and team-a was refused)."""
    port = sidecar.port
    assert code(first_write(port, "team-b", "team-b-1", "b0")) == "OK"
    errors = [first_write(port, "team-b", "team-b-1", f"b{i}") for i in range(1, MAX_WRITERS + 1)]
    assert code(first_write(port, "team-a", "team-a-1", "a0")) == "OK"
    refused = [e for e in errors if e is not None]
    assert len(refused) == MAX_WRITERS - 1, "team-b went past its share of 2"
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "max_writers_per_identity" in (refused[0].details() or ""), refused[0].details()
    assert "retry-after-ms" in dict(refused[0].trailing_metadata() or ())
    # team-b's own writer ids go on
    again = write_request(2, [make_chunk("b0-u", 0, 4, spec=spec("team-b-1"))], writer="b0", spec=spec("team-b-1"))
    assert code(write(port, "team-b", [again])) == "OK"


def test_a_refused_first_message_leaves_no_writer_session(sidecar: Sidecar) -> None:
    """First messages refused for a sequence gap each created a session no one owned (so no share
    counted them) and that stayed for good, in the WAL too: enough of them refused every new writer."""
    port = sidecar.port
    assert code(first_write(port, "team-b", "team-b-1", "b0")) == "OK"
    gaps = [
        write_request(5, [make_chunk("g", 0, 4, spec=spec("team-b-1"))], writer=f"gap{i}", spec=spec("team-b-1"))
        for i in range(2 * MAX_WRITERS)
    ]
    assert {code(write(port, "team-b", [g])) for g in gaps} == {"FAILED_PRECONDITION"}
    assert not [w for w in _writers(port) if w.startswith("gap")]
    assert code(first_write(port, "team-a", "team-a-1", "a0")) == "OK"


def test_runs_one_identity_declares_do_not_lock_out_another(tmp_path: Path) -> None:
    """team-b declares many runs of its own. Runs whose records are all committed give their slot
    back (a run's entry is only its immutable spec), so team-b is never stuck either; runs with
    records waiting to be committed count against team-b's share, so it cannot hold every slot."""
    # nothing is committed until asked (runs stay busy); a writer session per run (sessions stay)
    sc = _start(tmp_path, flush_interval_s=3600.0, max_writers=64)
    try:
        assert sc.engine is not None
        port = sc.port
        assert code(first_write(port, "team-b", "team-b-0")) == "OK"
        err = first_write(port, "team-b", "team-b-1")
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "max_runs_per_identity" in (err.details() or ""), err.details()
        assert code(first_write(port, "team-a", "team-a-0")) == "OK"
        assert sc.engine.flush(20)  # team-b-0 committed: its slot can be taken again
        for i in range(1, 3 * MAX_RUNS):
            assert code(first_write(port, "team-b", f"team-b-{i}")) == "OK", i
            assert sc.engine.flush(20)
        assert code(first_write(port, "team-a", "team-a-1")) == "OK"
        assert len(sc.engine.runs) <= MAX_RUNS
    finally:
        sc.stop(5)
