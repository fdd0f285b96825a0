"""The gRPC service in-process on port 0: acks, health, reflection, metrics, and hostile input.

Every hostile case gets its documented status while a concurrent good writer keeps streaming and
loses nothing, and the server stays SERVING.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tracestore.client import RolloutRecorder, SiteOutput
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, wait_for, write_request

from tracestore.errors import LimitError, PermissionDeniedError, UnauthenticatedError
from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

MAX_MSG = 256 << 10
INT64_MAX = (1 << 63) - 1


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    d = tmp_path_factory.mktemp("svc")
    cfg = ServerConfig(storage=f"file://{d / 'data'}", wal_dir=str(d / "wal"), port=0, metrics_port=0,
                       unix_socket=str(d / "s.sock"), flush_interval_s=0.05, max_message_bytes=MAX_MSG,
                       memory_budget_bytes=64 << 20)  # fmt: skip
    sc = Sidecar(cfg).start()
    Store(cfg.storage).put_run(SPEC)
    yield sc
    sc.stop(5)


@pytest.fixture(scope="module")
def channel(sidecar: Sidecar) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(f"127.0.0.1:{sidecar.port}", options=[("grpc.max_send_message_length", 8 << 20)])
    yield ch
    ch.close()


def stream(ch: grpc.Channel, requests: Sequence[bytes]) -> tuple[list[pb.WriteResponse], grpc.RpcError | None]:
    call = ch.stream_stream("/tracestore.v1.TraceStore/Write")
    out = []
    try:
        for raw in call(iter(requests), timeout=20):
            out.append(pb.WriteResponse.FromString(raw))
    except grpc.RpcError as exc:
        return out, exc
    return out, None


def test_write_acks_highest_durable_sequence(channel: grpc.Channel, sidecar: Sidecar) -> None:
    reqs = [write_request(i, [make_chunk(f"ack-{i}", 0, 3)], writer="ack").SerializeToString() for i in range(1, 6)]
    acks, err = stream(channel, reqs)
    assert err is None
    assert acks and acks[-1].durable_sequence == 5
    assert [a.durable_sequence for a in acks] == sorted(a.durable_sequence for a in acks)
    # resending after "reconnect": success, no duplicate
    acks, err = stream(channel, reqs[2:])
    assert err is None and acks[-1].durable_sequence == 5
    assert sidecar.engine is not None and sidecar.engine.flush(10)
    got = [e.trajectory for m in sidecar.engine.store.manifests(SPEC.run, 0) for e in m.chunks
           if e.trajectory.startswith("ack-")]  # fmt: skip
    assert sorted(got) == [f"ack-{i}" for i in range(1, 6)]


def test_health_reflection_metrics(channel: grpc.Channel, sidecar: Sidecar) -> None:
    h = health_pb2_grpc.HealthStub(channel)
    for name in ("", "tracestore.v1.TraceStore"):
        assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tracestore.v1.TraceStore", "grpc.health.v1.Health"} <= names
    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    for metric in ("tracestore_ingest_bytes_total", "tracestore_durable_ack_latency_seconds_bucket",
                   "tracestore_memory_budget_bytes", "tracestore_backlog_bytes"):  # fmt: skip
        assert metric in text


def test_seal_and_stat(channel: grpc.Channel) -> None:
    s1 = pb.TrajectorySeal(trajectory="s1", n_tokens=4, sites=["layers.1.mlp.input"])
    seal = pb.SealRequest(run=SPEC.run, writer="sealer", epoch=1, sequence=1, seals=[s1])
    resp = pb.SealResponse.FromString(channel.unary_unary("/tracestore.v1.TraceStore/Seal")(seal.SerializeToString()))
    assert resp.durable_sequence == 1
    stat = pb.StatResponse.FromString(
        channel.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest(run=SPEC.run).SerializeToString())
    )
    assert stat.state == pb.SERVING_STATE_SERVING
    assert [s.name for s in stat.run_spec.sites] == list(SPEC.site_names)
    assert any(w.writer == "sealer" and w.durable_sequence == 1 for w in stat.writers)


def _bad(mutate: Any) -> bytes:
    req = write_request(1, [make_chunk("bad", 0, 4)], writer="hostile")
    out = mutate(req)
    return out if isinstance(out, bytes) else req.SerializeToString()


def _set(field: str, value: Any) -> Any:
    def f(req: pb.WriteRequest) -> None:
        setattr(req.chunks[0], field, value)

    return f


def _declare(req: pb.WriteRequest, **site_fields: int) -> None:
    """Make ``req`` declare a run of its own whose first site has ``site_fields`` set."""
    req.run = "hostile-spec"
    req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
    req.run_spec.run = "hostile-spec"
    for k, v in site_fields.items():
        setattr(req.run_spec.sites[0], k, v)


HOSTILE = {
    "garbage-bytes": (lambda r: b"\xff\xfe\x00garbage" * 10, "INVALID_ARGUMENT", "not a valid"),
    "short-codes": (_set("codes", b"\0" * 31), "INVALID_ARGUMENT", "expected codes/scales"),
    "long-scales": (_set("scales", b"\0" * 999), "INVALID_ARGUMENT", "expected codes/scales"),
    "token-scales-length": (
        lambda r: (_set("has_token_scales", True)(r), _set("token_scales", b"\0" * 3)(r))[0],
        "INVALID_ARGUMENT",
        "expected codes/scales",
    ),
    "negative-start": (_set("token_start", -5), "INVALID_ARGUMENT", "token_start >= 0"),
    "zero-tokens": (_set("n_tokens", 0), "INVALID_ARGUMENT", "n_tokens >= 1"),
    "dotdot-trajectory": (_set("trajectory", "../../escape"), "INVALID_ARGUMENT", "invalid trajectory id"),
    "slash-trajectory": (_set("trajectory", "a/b"), "INVALID_ARGUMENT", "invalid trajectory id"),
    "nul-site": (_set("site", "layers\0x"), "INVALID_ARGUMENT", "invalid site id"),
    "long-trajectory": (_set("trajectory", "t" * 500), "INVALID_ARGUMENT", "invalid trajectory id"),
    "bad-run": (lambda r: setattr(r, "run", "../Run") or None, "INVALID_ARGUMENT", "invalid run id"),
    "bad-writer": (lambda r: setattr(r, "writer", "/etc/passwd") or None, "INVALID_ARGUMENT", "invalid writer id"),
    "undeclared-run": (lambda r: setattr(r, "run", "never-declared") or None, "NOT_FOUND", "not declared"),
    "unknown-site": (_set("site", "layers.99.x"), "INVALID_ARGUMENT", "declares no site"),
    "zero-epoch": (lambda r: setattr(r, "epoch", 0) or None, "INVALID_ARGUMENT", "epoch and sequence"),
    "new-epoch-not-at-1": (lambda r: setattr(r, "sequence", 7) or None, "FAILED_PRECONDITION", "sequence 1, got 7"),
    "bad-checksum": (_set("checksum", 12345), "DATA_LOSS", "checksum"),
    "nan-global-scale": (_set("global_scale", float("nan")), "INVALID_ARGUMENT", "global_scale"),
    "inf-global-scale": (_set("global_scale", float("inf")), "INVALID_ARGUMENT", "global_scale must be finite"),
    "zero-global-scale": (_set("global_scale", 0.0), "INVALID_ARGUMENT", "global_scale must be finite and > 0"),
    "negative-global-scale": (_set("global_scale", -2.0), "INVALID_ARGUMENT", "global_scale must be finite and > 0"),
    "tokens-past-2^40": (_set("token_start", (1 << 40) - 1), "INVALID_ARGUMENT", "at or before 2^40"),
    "shm-over-tcp": (lambda r: r.chunks[0].shm.SetInParent(), "INVALID_ARGUMENT", "unix socket"),
    # token scale bytes without the flag were silently dropped
    "token-scales-without-flag": (_set("token_scales", b"\0" * 16), "INVALID_ARGUMENT", "has_token_scales"),
    # a declared site with rows_per_token 0 (or bits 0) silently became 1
    "rows-per-token-zero": (lambda r: _declare(r, rows_per_token=0), "INVALID_ARGUMENT", "rows_per_token >= 1"),
    "bits-zero": (lambda r: _declare(r, bits=0), "INVALID_ARGUMENT", "bits >= 1"),
    # tokens ending past int64 were accepted (token_end wrapped negative downstream)
    "token-range-past-int64": (_set("token_start", INT64_MAX - 2), "INVALID_ARGUMENT", "end past 2^63 - 1"),
    "oversized": (_set("codes", b"\0" * (MAX_MSG + 10)), "RESOURCE_EXHAUSTED", ""),
}


class GoodWriter:
    """A recorder streaming in the background through the whole hostile suite."""

    def __init__(self, address: str) -> None:
        self.rec = RolloutRecorder(address, SPEC, "good-writer", staging_bytes=4 << 20, batch_bytes=16 << 10)
        self.sent: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.rng = np.random.default_rng(7)
        self.rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def run(self) -> None:
        site = SPEC.site("layers.1.mlp.input")
        i = 0
        while not self.stop.is_set() and i < 400:
            t = f"good-{i}"
            codes = self.rng.integers(0, 256, (6, site.code_bytes), dtype=np.uint8)
            scales = self.rng.integers(0, 256, (6, site.scale_bytes), dtype=np.uint8)
            assert self.rec.record_forward([(t, 0, 6)], {site.name: SiteOutput(codes, scales, 0.5)})
            self.rows[t] = (codes, scales)
            self.rec.finish(t, 7)
            self.sent.append(t)
            i += 1
            self.stop.wait(0.002)


@pytest.fixture(scope="module")
def good(sidecar: Sidecar) -> Iterator[GoodWriter]:
    g = GoodWriter(f"127.0.0.1:{sidecar.port}")
    g.thread.start()
    yield g
    g.stop.set()
    g.thread.join()
    assert g.rec.flush(30), g.rec.stats
    assert g.rec.stats["unguided"] == 0 and g.rec.stats["rejected_messages"] == 0, g.rec.stats
    assert sidecar.engine is not None and sidecar.engine.flush(30)
    result = StoreReader(sidecar.engine.store, SPEC.run).read(
        MicrobatchPlan([(t, 0, 6) for t in g.sent]), sites=["layers.1.mlp.input"]
    )["layers.1.mlp.input"]
    assert result.codes.tobytes() == b"".join(g.rows[t][0].tobytes() for t in g.sent)
    assert result.scales.tobytes() == b"".join(g.rows[t][1].tobytes() for t in g.sent)
    g.rec.close()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_write(case: str, channel: grpc.Channel, good: GoodWriter, sidecar: Sidecar, tmp_path: Path) -> None:
    mutate, code, words = HOSTILE[case]
    _, err = stream(channel, [_bad(mutate)])
    assert err is not None, f"{case} was accepted"
    assert err.code().name == code, (case, err.code(), err.details())
    assert words in (err.details() or ""), err.details()
    assert "Traceback" not in (err.details() or "")
    h = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    root = Path(sidecar.config.storage.removeprefix("file://"))
    assert not (root.parent / "escape").exists() and not (root / "escape").exists()


def test_conflicting_bytes_already_exists(channel: grpc.Channel, good: GoodWriter) -> None:
    a = write_request(1, [make_chunk("conf", 0, 4, seed=1)], writer="conf-a").SerializeToString()
    b = write_request(1, [make_chunk("conf", 0, 4, seed=2)], writer="conf-b").SerializeToString()
    assert stream(channel, [a])[1] is None
    _, err = stream(channel, [b])
    assert err is not None and err.code() == grpc.StatusCode.ALREADY_EXISTS, err
    assert dict(err.trailing_metadata() or ())["tracestore-failed-sequence"] == "1"


def test_gap_is_failed_precondition(channel: grpc.Channel, good: GoodWriter) -> None:
    one = write_request(1, [make_chunk("gap", 0, 2)], writer="gapper").SerializeToString()
    three = write_request(3, [make_chunk("gap", 2, 2)], writer="gapper").SerializeToString()
    _, err = stream(channel, [one, three])
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expected sequence 2, got 3" in (err.details() or "")
    assert dict(err.trailing_metadata() or ())["tracestore-failed-sequence"] == "3"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(min_size=1, max_size=2000))
def test_random_bytes_never_internal(data: bytes, channel: grpc.Channel, good: GoodWriter) -> None:
    _, err = stream(channel, [data])
    if err is not None:
        assert err.code().name in {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "DATA_LOSS"}, (
            err.code(),
            err.details(),
        )


def test_read_rpc_errors(channel: grpc.Channel) -> None:
    call = channel.unary_stream("/tracestore.v1.TraceStore/Read")
    with pytest.raises(grpc.RpcError) as e:
        list(call(b"\x0a\xff\xff"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    req = pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="nobody", token_start=0, token_end=4)])
    with pytest.raises(grpc.RpcError) as e:
        list(call(req.SerializeToString()))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in (e.value.details() or "")


def _read_error(ch: grpc.Channel, req: pb.ReadRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(ch.unary_stream("/tracestore.v1.TraceStore/Read")(req.SerializeToString(), timeout=20))
    return e.value


def test_hostile_reads(channel: grpc.Channel, good: GoodWriter) -> None:
    """What no read can serve is INVALID_ARGUMENT saying what was expected (an unknown site and a
    negative version were NOT_FOUND); a plan too large to serve is RESOURCE_EXHAUSTED naming the
    limit and the size, computed before anything is allocated (2^40 tokens was INTERNAL); the
    server stays SERVING."""
    seg = [pb.Segment(trajectory="good-0", token_start=0, token_end=6)]
    cases = [
        (pb.ReadRequest(run=SPEC.run, plan=seg, sites=["layers.99.x"]), "INVALID_ARGUMENT", "declares no site"),
        (pb.ReadRequest(run=SPEC.run, plan=seg, versions=[-1]), "INVALID_ARGUMENT", "versions >= 0"),
        (pb.ReadRequest(run=SPEC.run, plan=seg, sites=[SPEC.site_names[0]] * 2), "INVALID_ARGUMENT", "each site once"),
        (pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="good-0", token_start=5, token_end=2)]),
         "INVALID_ARGUMENT", "token_start < token_end"),
        (pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="good-0", token_start=-3, token_end=2)]),
         "INVALID_ARGUMENT", "token_start < token_end"),
        (pb.ReadRequest(run=SPEC.run, plan=seg, has_columns=True, column_start=0, column_end=4096),
         "INVALID_ARGUMENT", "column range"),
        (pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="good-0", token_start=0, token_end=1 << 40)]),
         "RESOURCE_EXHAUSTED", "max_read_bytes"),
        # two segments whose token counts overflow int64 when summed
        (pb.ReadRequest(run=SPEC.run, plan=[pb.Segment(trajectory="good-0", token_start=0, token_end=INT64_MAX)] * 2,
                        on_missing=pb.ON_MISSING_MASK), "RESOURCE_EXHAUSTED", "max_read_bytes"),
    ]  # fmt: skip
    for req, code, words in cases:
        err = _read_error(channel, req)
        assert err.code().name == code, (req, err.code(), err.details())
        assert words in (err.details() or ""), err.details()
        assert "Traceback" not in (err.details() or "")
    huge = _read_error(channel, cases[6][0])
    assert str((1 << 40) * 84) in (huge.details() or ""), huge.details()  # the size (84 bytes a token here)
    h = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_unguided_reasons_are_a_fixed_label_set(channel: grpc.Channel, sidecar: Sidecar) -> None:
    """Recorder-sent unguided reasons become metric labels only from a fixed set (anything else is
    "other"): 300 messages with made-up reasons once made 300 series."""
    from tracestore.server.metrics import UNGUIDED_REASONS

    reqs = []
    for i in range(1, 301):
        req = write_request(i, [], writer="unguided-reporter")
        req.unguided.add(reason=f"made-up-{i}-" + "x" * 40, count=1)
        if i % 3 == 0:
            req.unguided.add(reason="STAGING_FULL", count=2)
        reqs.append(req.SerializeToString())
    _, err = stream(channel, reqs)
    assert err is None, err
    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("tracestore_unguided_trajectories_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            series[reason] = float(line.rsplit(" ", 1)[1])
    assert set(series) <= UNGUIDED_REASONS, sorted(series)[:10]
    assert series["other"] >= 300 and series["staging_full"] >= 200


def test_status_codes_of_limits_and_auth() -> None:
    from tracestore.server.rpc.service import status_of

    assert status_of(LimitError("max_writers")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(PermissionDeniedError("not yours")) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(UnauthenticatedError("no token")) == grpc.StatusCode.UNAUTHENTICATED


def test_storage_op_labels_are_a_fixed_set() -> None:
    from tracestore.server.metrics import STORAGE_OPS, storage_op

    assert storage_op("write run-a/v0/w/part-1.parquet") == "write"
    assert storage_op("list run-a") == "list"
    for op in ("run-a/v0/x", "", "evil-op-" + "y" * 100, "WRITE x"):
        assert storage_op(op) == "other"
    assert {"read", "write", "list", "delete", "other"} <= STORAGE_OPS


def test_writer_and_run_limits(tmp_path: Path) -> None:
    """max_writers / max_runs: a writer, or a run while the ones there have records waiting to be
    committed, beyond them is refused with RESOURCE_EXHAUSTED naming the limit, and the ones already
    there keep working (tests/security/test_shared_limits.py: a committed run's slot is reused)."""
    from tracestore.records import RunSpec

    # nothing is committed until asked, so run-a keeps its slot
    cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                       flush_interval_s=3600, max_writers=2, max_runs=1)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
            for w in ("w1", "w2"):
                req = write_request(1, [make_chunk(f"lim-{w}", 0, 4)], writer=w, declare=True)
                assert stream(ch, [req.SerializeToString()])[1] is None
            _, err = stream(ch, [write_request(1, [make_chunk("lim-w3", 0, 4)], writer="w3").SerializeToString()])
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "max_writers" in (err.details() or ""), err.details()
            assert "retry-after-ms" in dict(err.trailing_metadata() or ())
            other = RunSpec("run-b", SPEC.sites)
            req = write_request(1, [make_chunk("b", 0, 4, spec=other)], writer="w1", declare=True, spec=other)
            _, err = stream(ch, [req.SerializeToString()])
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "max_runs" in (err.details() or ""), err.details()
            again = write_request(2, [make_chunk("lim-w1b", 0, 4)], writer="w1").SerializeToString()
            acks, err = stream(ch, [again])
            assert err is None and acks[-1].durable_sequence == 2, err
    finally:
        sc.stop(5)


def test_refused_messages_return_their_reservation(tmp_path: Path) -> None:
    """Each stream reserves budget for the message it is about to read; a message refused at parse
    must give it back, or a hostile client sending garbage would shrink the budget of everyone
    (here 20 garbage streams x 1 MiB would exceed the 16 MiB budget and stall the good writer)."""
    cfg = ServerConfig(storage=f"file://{tmp_path / 'data'}", wal_dir=str(tmp_path / "wal"), port=0, metrics_port=None,
                       flush_interval_s=0.05, max_message_bytes=MAX_MSG, memory_budget_bytes=16 << 20,
                       backpressure_timeout_s=1.0)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        Store(cfg.storage).put_run(SPEC)
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
            for _ in range(20):
                _, err = stream(ch, [b"\xff\xfe\x00garbage" * 10])
                assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            good = [write_request(1, [make_chunk("after-garbage", 0, 4)], writer="g").SerializeToString()]
            acks, err = stream(ch, good)
            assert err is None, err
            assert acks and acks[-1].durable_sequence == 1
        assert sc.engine is not None and sc.service is not None
        # all but what is reserved for good: gRPC's copies of a message being received, the WAL's buffers
        wait_for("reservations returned", lambda: sc.engine.budget.reserved == sc.engine.budget.fixed)
        assert sc.engine.budget.fixed > sc.service.copy_room > 0
    finally:
        sc.stop(5)
