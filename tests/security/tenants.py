"""Shared by the tests of what one caller can take from another (``test_shared_limits.py``,
``test_stream_shares.py``): a sidecar with tokens for a reader, two teams and an admin, and the
calls they make over real gRPC."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from pathlib import Path

import grpc
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar
from tracestore.server.testing import SPEC, make_chunk, write_request

from tracestore.records import RunSpec
from tracestore.v1 import tracestore_pb2 as pb

WRITE = "/tracestore.v1.TraceStore/Write"
SCOPES = {
    "reader": "read:*",
    "team-a": "write:team-a-*,read:team-a-*",
    "team-b": "write:team-b-*,read:team-b-*",
    "ops": "admin",
}
TOKENS = {name: secrets.token_urlsafe(24) for name in SCOPES}


def spec(run: str) -> RunSpec:
    return RunSpec(run, SPEC.sites)


def start_sidecar(tmp: Path, **config: object) -> Sidecar:
    """A sidecar on ``tmp`` (WAL, file:// storage) whose token file holds :data:`SCOPES`."""
    lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {s} {n}" for n, s in SCOPES.items()]
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    settings: dict[str, object] = dict(flush_interval_s=0.05) | config
    cfg = ServerConfig(storage=f"file://{tmp / 'data'}", wal_dir=str(tmp / "wal"), port=0, metrics_port=None,
                       auth_tokens=str(tmp / "tokens"), **settings)  # type: ignore[arg-type]  # fmt: skip
    return Sidecar(cfg).start()


def meta(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


def write(port: int, who: str, reqs: Sequence[pb.WriteRequest]) -> grpc.RpcError | None:
    """Stream ``reqs`` as ``who`` until the last one is acknowledged; the error that ended the stream."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(WRITE)
        try:
            for raw in call(iter([r.SerializeToString() for r in reqs]), metadata=meta(who), timeout=20):
                ack = pb.WriteResponse.FromString(raw)
                if ack.epoch == reqs[-1].epoch and ack.durable_sequence >= reqs[-1].sequence:
                    return None
        except grpc.RpcError as exc:
            return exc
    raise AssertionError("the stream ended without acknowledging the last message")


def first_write(port: int, who: str, run: str, writer: str = "w0") -> grpc.RpcError | None:
    """``who`` declares ``run`` and writes its first records, as a recorder starting a run does."""
    req = write_request(1, [make_chunk(f"{writer}-t", 0, 4, spec=spec(run))], writer=writer, declare=True,
                        spec=spec(run))  # fmt: skip
    return write(port, who, [req])


def code(err: grpc.RpcError | None) -> str:
    return "OK" if err is None else err.code().name
