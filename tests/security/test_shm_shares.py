"""One identity cannot take every shared-memory pool slot from the others (issue 42, item 2d).

The sidecar keeps at most 64 writers' staging pools open at once (``server/rpc/shm.py``), and a pool
stays open while its file exists. Before, those slots were shared by every caller: one identity
allowed only ``write:evil-*`` named 64 pool files of its own, one per message, and every other
identity's shared-memory write was refused for as long as the files stayed. Now, with tokens, one
identity opens at most its share (``--max-shm-pools-per-identity``, env
``TRACESTORE_MAX_SHM_POOLS_PER_IDENTITY``; a quarter of the pools by default): beyond it its writes
are RESOURCE_EXHAUSTED naming the setting, and everyone else's pools still open.

A real ``tracestore serve`` process with a token file, real gRPC over its unix socket, real pool
files in a private shm directory.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import urllib.request
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from tracestore.server.config import ServerConfig
from tracestore.server.testing import SPEC, ServeProcess

from tracestore.errors import ConfigError
from tracestore.records import RecordChunk, RunSpec
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import chunk_to_pb, payload_sizes, run_spec_to_pb

WRITE = "/tracestore.v1.TraceStore/Write"
POOLS = 64  # the sidecar's limit (ShmPools.MAX_POOLS)
SCOPES = {"evil": "write:evil-*", "team-a": "write:team-a-*,read:team-a-*"}
TOKENS = {name: secrets.token_urlsafe(24) for name in SCOPES}
SITE = SPEC.site("layers.1.mlp.input")
N_TOKENS = 16
POOL_BYTES = 64 << 10


def _metric(sp: ServeProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{sp.metrics_port}/metrics", timeout=5) as f:
        for line in f.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _pool(shm: Path, payload: bytes = b"") -> str:
    """A pool file of the test's uid (the sidecar's), 0600, holding ``payload``."""
    name = f"tracestore-pool-{uuid.uuid4().hex}"
    data = payload + bytes(POOL_BYTES - len(payload))
    fd = os.open(shm / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return name


def _stream(sock: Path, who: str, reqs: list[pb.WriteRequest]) -> tuple[int, grpc.RpcError | None]:
    """``reqs`` on one Write stream as ``who``: the highest durable sequence, and the error that
    ended it (None: every message acknowledged)."""
    durable = 0
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        call = ch.stream_stream(WRITE)
        try:
            raws = [r.SerializeToString() for r in reqs]
            for raw in call(iter(raws), metadata=(("authorization", f"Bearer {TOKENS[who]}"),), timeout=30):
                durable = max(durable, pb.WriteResponse.FromString(raw).durable_sequence)
                if durable >= reqs[-1].sequence:
                    return durable, None
        except grpc.RpcError as exc:
            return durable, exc
    raise AssertionError("the stream ended without acknowledging its last message")


def test_one_identity_opens_at_most_its_share_of_shm_pools(tmp_path: Path) -> None:
    """evil names 64 pools of its own, one per message: only its share (16 of 64) is opened, the
    17th message is RESOURCE_EXHAUSTED naming --max-shm-pools-per-identity with a retry hint.
    team-a's recorder then writes through its own pool and is acknowledged (before: evil's 64
    pools took every slot and team-a's write was refused, INVALID_ARGUMENT)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    lines = [f"sha256:{hashlib.sha256(TOKENS[n].encode()).hexdigest()} {s} {n}" for n, s in SCOPES.items()]
    tokens = tmp_path / "tokens"
    tokens.write_text("\n".join(lines) + "\n")
    tokens.chmod(0o600)
    flags = ["--auth-tokens", str(tokens), "--shm-dir", str(shm), "--grace", "5"]
    with ServeProcess(tmp_path / "sc", unix_socket=True, flags=flags) as sp:
        sock = Path(sp.socket or "")
        evil = RunSpec("evil-1", SPEC.sites)
        reqs = [pb.WriteRequest(run=evil.run, writer="e0", epoch=1, sequence=i + 1, shm_pool=_pool(shm))
                for i in range(POOLS)]  # fmt: skip
        reqs[0].run_spec.CopyFrom(run_spec_to_pb(evil))
        _, refused = _stream(sock, "evil", reqs)
        opened = int(_metric(sp, "tracestore_shm_capacity_bytes")) // POOL_BYTES
        print(f"evil: {opened} pools opened of {POOLS} named; then {refused.code().name if refused else 'nothing'}")

        # team-a's writer: its records' bytes in a pool of its own, named by reference
        team = RunSpec("team-a-1", SPEC.sites)
        _, nc, ns, _ = payload_sizes(SITE, N_TOKENS, False)
        payload = secrets.token_bytes(nc + ns)
        arr = np.frombuffer(payload, dtype=np.uint8)
        chunk = RecordChunk(team.run, 0, "a-t0", SITE.name, 0, N_TOKENS, codes=arr[:nc].reshape(N_TOKENS, -1),
                            scales=arr[nc:].reshape(N_TOKENS, -1), global_scale=1.0)  # fmt: skip
        req = pb.WriteRequest(run=team.run, writer="a0", epoch=1, sequence=1, shm_pool=_pool(shm, payload))
        req.run_spec.CopyFrom(run_spec_to_pb(team))
        c = chunk_to_pb(chunk)
        c.ClearField("codes")
        c.ClearField("scales")
        c.shm.codes_offset, c.shm.scales_offset = 0, nc
        req.chunks.append(c)
        durable, err = _stream(sock, "team-a", [req])
        print(f"team-a: {'acknowledged' if err is None else f'{err.code().name}: {err.details()}'}")
        assert err is None and durable == 1, err

        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (opened, refused)
        assert opened == POOLS // 4, opened
        assert "--max-shm-pools-per-identity" in (refused.details() or ""), refused.details()
        assert "retry-after-ms" in dict(refused.trailing_metadata() or ())


def test_the_share_is_a_flag_with_an_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-shm-pools-per-identity (TRACESTORE_MAX_SHM_POOLS_PER_IDENTITY): a quarter of the 64 pools
    unless set, the flag over the variable, 1..64."""
    from tracestore.server.cli import config_from_args

    from tracestore.cli import build_parser

    for k in [k for k in os.environ if k.startswith("TRACESTORE_")]:
        monkeypatch.delenv(k)
    assert ServerConfig().shm_pools_per_identity == POOLS // 4
    monkeypatch.setenv("TRACESTORE_MAX_SHM_POOLS_PER_IDENTITY", "5")
    assert config_from_args(build_parser().parse_args(["serve"])).shm_pools_per_identity == 5
    args = ["serve", "--max-shm-pools-per-identity", "3"]
    assert config_from_args(build_parser().parse_args(args)).shm_pools_per_identity == 3
    for value in (0, POOLS + 1, True):
        with pytest.raises(ConfigError, match="max_shm_pools_per_identity must be an integer from 1 to 64"):
            ServerConfig(max_shm_pools_per_identity=value)
