"""Test and bench helpers: ``tracestore serve`` in a process of its own, records, wire requests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracestore.errors import StorageError
from tracestore.records import PrefixLink, RecordChunk, RunSpec, SiteSpec, TrajectorySeal
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import chunk_to_pb, link_to_pb, run_spec_to_pb, seal_to_pb


class ServeProcess:
    """``with ServeProcess(workdir, storage=...) as sp: sp.address`` — a real sidecar process.

    Extra ``flags`` are passed to ``tracestore serve``; ``unix_socket=True`` also listens on
    ``workdir/sidecar.sock`` (``sp.unix_address``). :meth:`kill` sends SIGKILL, :meth:`start`
    starts it again on the same WAL and storage.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        storage: str | None = None,
        wal: bool = True,
        unix_socket: bool = False,
        flags: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage = storage or f"file://{self.workdir / 'data'}"
        self.wal_dir = str(self.workdir / "wal") if wal else "off"
        self.socket = str(self.workdir / "sidecar.sock") if unix_socket else None
        self.flags = list(flags or [])
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def unix_address(self) -> str:
        if self.socket is None:
            raise StorageError("started without unix_socket=True")
        return f"unix://{self.socket}"

    def start(self, timeout: float = 60.0) -> ServeProcess:
        ready = self.workdir / "ready.json"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "tracestore.cli",
            "serve",
            "--storage",
            self.storage,
            "--wal-dir",
            self.wal_dir,
            "--ready-file",
            str(ready),
            "--log-level",
            "WARNING",
        ]
        # Keep the port across restarts so reconnecting clients find it again.
        cmd += ["--port", str(self.port)]
        if "--metrics-port" not in self.flags:
            cmd += ["--metrics-port", "0"]
        if self.socket:
            cmd += ["--unix-socket", self.socket]
        cmd += self.flags
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
        env.update(self.env or {})
        self.starts += 1
        log = open(self.workdir / f"serve-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise StorageError(f"tracestore serve did not start:\n{self.log_tail()}")
            time.sleep(0.02)
        info: dict[str, Any] = json.loads(ready.read_text())
        self.port = int(info["port"])
        self.metrics_port = info.get("metrics_port")
        return self

    def log_tail(self, n: int = 4000) -> str:
        path = self.workdir / f"serve-{self.starts}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL (a crash: no drain, no final fsync)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.proc = None
        return rc

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.terminate(30)


def wait_for(what: str, fn: Any, timeout: float = 20.0) -> Any:
    """Poll ``fn()`` every 20 ms until it is truthy and return that value; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


SPEC = RunSpec(
    "run-a",
    (
        SiteSpec("layers.1.mlp.input", "moe_input", layer=1, width=64),
        SiteSpec("layers.1.attn.k", "key", layer=1, width=32, format="mxfp4", bits=2, rows_per_token=2),
    ),
)


def make_chunk(
    traj: str,
    start: int,
    n: int,
    site: str = "layers.1.mlp.input",
    *,
    seed: int = 0,
    version: int = 0,
    spec: RunSpec = SPEC,
) -> RecordChunk:
    s = spec.site(site)
    rng = np.random.default_rng([seed, start, n, sum(map(ord, traj + site))])
    rows = n * s.rows_per_token
    return RecordChunk(
        spec.run,
        version,
        traj,
        site,
        start,
        n,
        codes=rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
        scales=rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
        global_scale=0.25 if s.fmt.has_global_scale else 1.0,
    )


def write_request(
    seq: int,
    chunks: Sequence[RecordChunk] = (),
    *,
    writer: str = "w0",
    epoch: int = 1,
    seals: Sequence[TrajectorySeal] = (),
    links: Sequence[PrefixLink] = (),
    declare: bool = False,
    spec: RunSpec = SPEC,
) -> pb.WriteRequest:
    req = pb.WriteRequest(
        run=spec.run,
        writer=writer,
        epoch=epoch,
        sequence=seq,
        chunks=[chunk_to_pb(c) for c in chunks],
        seals=[seal_to_pb(s) for s in seals],
        links=[link_to_pb(x) for x in links],
    )
    if declare:
        req.run_spec.CopyFrom(run_spec_to_pb(spec))
    return req


def start_engine(url: str, wal_dir: str | os.PathLike[str] | None, spec: RunSpec = SPEC, **config: Any) -> Any:
    """An in-process :class:`~tracestore.server.engine.core.Engine` on storage ``url`` with ``spec``
    declared, started (WAL replayed) with ``ServerConfig(**config)``; close it with ``close()``."""
    from tracestore.server.config import ServerConfig
    from tracestore.server.engine.core import Engine
    from tracestore.server.metrics import Metrics
    from tracestore.server.rpc.ingest import wal_parser

    from tracestore.storage.store import Store

    cfg = ServerConfig(
        storage=url, wal_dir=None if wal_dir is None else str(wal_dir), port=0, metrics_port=None, **config
    )
    store = Store(url)
    store.put_run(spec)
    eng = Engine(cfg, store, Metrics())
    eng.start(wal_parser(eng.run_spec))
    return eng


def submit_request(eng: Any, req: pb.WriteRequest) -> tuple[Any, bool]:
    """Parse ``req`` as the sidecar does and admit it to ``eng``: (writer state, duplicate)."""
    from tracestore.server.rpc.ingest import parse_write

    _, msg, parts = parse_write(req.SerializeToString(), eng.write_spec, None)
    return eng.submit(msg, parts)  # type: ignore[no-any-return]


class IdleWriteStream:
    """A Write stream on channel ``ch`` that sends ``first`` (if any), then nothing until
    :meth:`close`, with call ``metadata``; a thread collects its answers (``responses``) and how it
    ended (``error``, ``ended``)."""

    def __init__(
        self, ch: Any, first: bytes | None = None, metadata: Sequence[tuple[str, str]] = (), timeout: float = 120.0
    ) -> None:
        import threading

        self.release = threading.Event()
        self.first = first
        self.call = ch.stream_stream("/tracestore.v1.TraceStore/Write")(
            self._requests(), metadata=tuple(metadata), timeout=timeout
        )
        self.responses: list[pb.WriteResponse] = []
        self.error: Any = None  # the grpc.RpcError that ended it
        self.ended = threading.Event()
        threading.Thread(target=self._collect, daemon=True).start()

    def _requests(self) -> Any:
        if self.first is not None:
            yield self.first
        self.release.wait()

    def _collect(self) -> None:
        import grpc

        try:
            for raw in self.call:
                self.responses.append(pb.WriteResponse.FromString(raw))
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def code(self) -> str:
        """How it ended: ``OK`` (or still open), else the status code's name."""
        return "OK" if self.error is None else self.error.code().name

    def close(self) -> None:
        self.release.set()
        self.call.cancel()
