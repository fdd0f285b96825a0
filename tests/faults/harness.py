"""Harness of the fault suite: ``tracestore serve`` as a subprocess, a raw Write client that keeps
track of what was acknowledged, a storage reader that checks every acknowledged record came back
bit-identical and exactly once, RSS sampling, the LD_PRELOAD fault shim, and the results table.

Black box: the sidecar is only started, signalled and spoken to over gRPC on loopback; storage is
read the way a trainer reads it (``tracestore.storage.store.Store`` + ``StoreReader`` on the storage URL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec, SiteSpec
from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
WRITE = "/tracestore.v1.TraceStore/Write"
SEAL = "/tracestore.v1.TraceStore/Seal"
READ = "/tracestore.v1.TraceStore/Read"
STAT = "/tracestore.v1.TraceStore/Stat"

SITE_A = SiteSpec("layers.0.mlp.input", "moe_input", 0, 128)  # nvfp4 b=1: 16 code + 8 scale bytes per row
SITE_B = SiteSpec("layers.0.attn.k", "key", 0, 64, format="mxfp4", bits=2, rows_per_token=2)  # 16 + 2 bytes, 2 rows
SPEC = RunSpec("faults", (SITE_A, SITE_B))


# ---------------------------------------------------------------------------------------------
# results table


@dataclasses.dataclass
class Row:
    """One line of the table: filled in as the test runs, so a failing test still shows its numbers."""

    scenario: str
    trials: int = 0
    acked: int = 0  # acknowledged record chunks
    lost: int = 0  # acked chunks missing or not bit-identical on storage
    duplicated: int = 0  # chunk keys stored more than once
    wedged: int = 0  # trials where committed progress stopped / restart did not converge
    rss_mib: float | None = None  # peak RSS - idle RSS of the sidecar
    note: str = ""
    nodeid: str = ""
    outcome: str = "?"

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


RESULTS: list[Row] = []
_CURRENT: dict[str, str] = {"nodeid": ""}


def row(scenario: str) -> Row:
    r = Row(scenario, nodeid=_CURRENT["nodeid"])
    RESULTS.append(r)
    return r


def format_table(rows: list[Row], elapsed: float) -> str:
    head = ("scenario", "result", "trials", "acked", "lost", "dup", "wedged", "dRSS MiB", "note")
    lines = [
        (
            r.scenario,
            r.outcome,
            str(r.trials),
            str(r.acked),
            str(r.lost),
            str(r.duplicated),
            str(r.wedged),
            "-" if r.rss_mib is None else f"{r.rss_mib:.0f}",
            r.note[:160],
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])

    def fmt(cols: Iterable[str]) -> str:
        pairs = enumerate(zip(cols, widths, strict=True))
        return "  ".join(c.ljust(w) if i in (0, 1, 8) else c.rjust(w) for i, (c, w) in pairs)

    out = [fmt(head), fmt("-" * w for w in widths)]
    out += [fmt(x) for x in lines]
    failed = sum(r.outcome == "FAIL" for r in rows)
    out.append(f"{len(rows)} rows, {failed} failing; fault suite wall time {elapsed:.0f} s")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(rest.split()[0])
    return got["VmRSS"], got["VmHWM"]


def reset_hwm(pid: int) -> bool:
    """Reset ``pid``'s peak RSS (VmHWM) to its current RSS (``5`` to /proc/PID/clear_refs, Linux >= 4.0;
    needs the right to write it: root or the same user)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakSampler:
    """Peak RSS of ``pid`` (KiB) over a ``with`` block: VmHWM reset at entry where allowed, else
    VmRSS sampled every ``every`` s in a thread (which may miss a short spike)."""

    def __init__(self, pid: int, every: float = 0.005) -> None:
        self.pid, self.every = pid, every
        self.base = rss_kib(pid)[0]
        self.peak = self.base
        self.hwm = reset_hwm(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, KeyError):
                self.peak = max(self.peak, rss_kib(self.pid)[0])
            time.sleep(self.every)

    def __enter__(self) -> PeakSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=5)
        if self.hwm:
            with contextlib.suppress(OSError, KeyError):
                self.peak = max(self.peak, rss_kib(self.pid)[1])

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.base) / 1024


class StartError(AssertionError):
    def __init__(self, rc: int | None, log: str) -> None:
        super().__init__(f"tracestore serve exited with {rc} before it was ready:\n{log[-3000:]}")
        self.rc, self.log = rc, log


_SHIM: dict[str, Path] = {}


def build_shim(out_dir: Path) -> Path:
    """Compile faultshim.c once per session (gcc is on CI); returns the .so path."""
    if "so" not in _SHIM:
        so = out_dir / "faultshim.so"
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            import pytest

            pytest.skip("the fault shim needs a C compiler (gcc) to build tests/faults/faultshim.c")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(HERE / "faultshim.c"), "-ldl"], check=True)
        _SHIM["so"] = so
    return _SHIM["so"]


class Sidecar:
    """``tracestore serve`` in a subprocess on a fixed loopback port (kept across restarts)."""

    def __init__(
        self,
        workdir: Path,
        *,
        storage: str | None = None,
        storage_options: dict[str, Any] | None = None,
        wal_dir: Path | None = None,
        flags: Iterable[str] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.workdir / "data"
        self.storage = storage or f"file://{self.data_dir}"
        self.storage_options = storage_options
        self.wal_dir = Path(wal_dir) if wal_dir is not None else self.workdir / "wal"
        self.flags = list(flags)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = self.workdir / "serve-0.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, env_extra: dict[str, str] | None, flags_extra: Iterable[str]) -> Path:
        ready = self.workdir / f"ready-{self.starts + 1}.json"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "tracestore.cli", "serve", "--storage", self.storage,
            "--wal-dir", str(self.wal_dir), "--port", str(self.port), "--metrics-port", "off",
            "--ready-file", str(ready), "--log-level", "WARNING",
        ]  # fmt: skip
        cmd += self.flags + list(flags_extra)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACESTORE_", "FAULTSHIM_"))}
        env.pop("LD_PRELOAD", None)
        if os.environ.get("FAULTS_SIDECAR_PYTHONPATH"):  # run another checkout's sidecar (suite self-checks)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["FAULTS_SIDECAR_PYTHONPATH"],
                                                              env.get("PYTHONPATH")]))  # fmt: skip
        if self.storage_options is not None:  # (not on the command line: it would be visible in /proc)
            env["TRACESTORE_STORAGE_OPTIONS"] = json.dumps(self.storage_options)
        env.update(self.env)
        env.update(env_extra or {})
        self.starts += 1
        self.log_path = self.workdir / f"serve-{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        return ready

    def start(
        self, *, env_extra: dict[str, str] | None = None, flags_extra: Iterable[str] = (), timeout: float = 30.0
    ) -> Sidecar:
        """Start and wait for the ready file; :class:`StartError` if the process exits first."""
        ready = self._spawn(env_extra, flags_extra)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not ready.exists():
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                raise StartError(rc, self.log())
            if time.monotonic() > deadline:
                self.kill()
                raise StartError(None, "did not become ready in time\n" + self.log())
            time.sleep(0.01)
        return self

    def start_expect_exit(self, timeout: float = 30.0, flags_extra: Iterable[str] = ()) -> tuple[int | None, str]:
        """Start and expect the process to refuse: (exit code or None if it became ready / hung, log)."""
        ready = self._spawn(None, flags_extra)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                return rc, self.log()
            if ready.exists():
                return None, self.log()
            time.sleep(0.01)
        return None, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM; the exit code, or None (then SIGKILLed) when it did not exit in ``timeout``."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        rc = self.wait_exit(timeout)
        if rc is None:
            self.kill()
        return rc

    def rss(self) -> tuple[int, int]:
        return rss_kib(self.pid)

    # gRPC helpers, each on a fresh channel with a deadline

    def health(self, timeout: float = 2.0, service: str = "") -> str:
        """SERVING / NOT_SERVING / ..., or the RPC error code name."""
        with grpc.insecure_channel(self.address) as ch:
            try:
                req = health_pb2.HealthCheckRequest(service=service)
                r = health_pb2_grpc.HealthStub(ch).Check(req, timeout=timeout)
            except grpc.RpcError as exc:
                return f"rpc:{exc.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def stat(self, timeout: float = 5.0) -> pb.StatResponse:
        with grpc.insecure_channel(self.address) as ch:
            raw = ch.unary_unary(STAT)(pb.StatRequest(run=SPEC.run).SerializeToString(), timeout=timeout)
        return pb.StatResponse.FromString(raw)

    def writer_state(self, writer: str) -> pb.WriterState | None:
        for w in self.stat().writers:
            if w.writer == writer:
                return w
        return None

    def wal_files(self) -> dict[str, bytes]:
        """{segment file name: sha256} of the WAL directory."""
        if not self.wal_dir.exists():
            return {}
        return {p.name: hashlib.sha256(p.read_bytes()).digest() for p in sorted(self.wal_dir.iterdir()) if p.is_file()}

    def wal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.wal_dir.glob("*.log")) if self.wal_dir.exists() else 0


# ---------------------------------------------------------------------------------------------
# records


@dataclasses.dataclass(frozen=True)
class Rec:
    """One record chunk as sent: its key and its exact bytes."""

    version: int
    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    codes: bytes
    scales: bytes
    global_scale: float
    token_scales: bytes | None

    @property
    def key(self) -> tuple[int, str, str, int]:
        return (self.version, self.trajectory, self.site, self.token_start)

    def to_pb(self) -> pb.Chunk:
        c = pb.Chunk(
            policy_version=self.version, trajectory=self.trajectory, site=self.site, token_start=self.token_start,
            n_tokens=self.n_tokens, codes=self.codes, scales=self.scales, global_scale=self.global_scale,
        )  # fmt: skip
        if self.token_scales is not None:
            c.token_scales = self.token_scales
            c.has_token_scales = True
        return c


class EngineOnDisk:
    """For the state machines over the in-process engine: ``self.cfg`` (storage ``self.url``, its
    WAL under ``self.dir``) makes :meth:`_engine`, a started engine (WAL replayed); ``teardown``
    closes ``self.eng`` and removes ``self.dir``."""

    cfg: Any
    url: str
    dir: Path
    eng: Any

    def _engine(self) -> Any:
        from tracestore.server.engine.core import Engine
        from tracestore.server.metrics import Metrics
        from tracestore.server.rpc.ingest import wal_parser

        from tracestore.storage.store import Store

        eng = Engine(self.cfg, Store(self.url), Metrics())
        eng.start(wal_parser(eng.run_spec))
        return eng

    def teardown(self) -> None:
        try:
            self.eng.close(timeout=5)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def read_back(reader: Any, recs: Iterable[Rec], must_exist: bool, stats: Counter[str], where: str = "") -> None:
    """Read ``recs`` through ``reader`` (a StoreReader of their run), grouped by (version, site):
    each is either absent (counted in ``stats["lost"]`` and an error when ``must_exist``) or
    present whole with exactly its bytes. A version with no shard yet is absent."""
    by: dict[tuple[int, str], list[Rec]] = {}
    for r in recs:
        by.setdefault((r.version, r.site), []).append(r)
    for (v, site), rs in by.items():
        rows_per_token = reader.spec.site(site).rows_per_token
        plan = [(r.trajectory, 0, r.n_tokens) for r in rs]
        try:
            out = reader.read(MicrobatchPlan(plan), versions=[v], sites=[site], on_missing="mask")[site]
        except Exception:
            if must_exist:
                raise
            continue
        row0 = 0
        for r in rs:
            sl = slice(row0, row0 + r.n_tokens * rows_per_token)
            row0 = sl.stop
            name = f"{where}{r.key}"
            if not out.valid[sl].any():
                stats["lost"] += int(must_exist)
                assert not must_exist, f"acknowledged record {name} missing after a flush"
                continue
            assert out.valid[sl].all(), f"{name}: partly stored"
            assert out.codes[sl].tobytes() == r.codes, f"{name}: codes differ"
            assert out.scales[sl].tobytes() == r.scales, f"{name}: scales differ"
            assert np.all(out.global_scale[sl] == np.float32(r.global_scale)), f"{name}: global_scale differs"


def make_recs(writer: str, payload: int, *, trajs: int = 4, tokens: int = 64, version: int = 0) -> list[Rec]:
    """Deterministic records of payload ``payload`` of ``writer``: identical bytes on every resend."""
    out = []
    wid = int.from_bytes(hashlib.blake2b(writer.encode(), digest_size=4).digest(), "little")
    for k in range(trajs):
        traj = f"{writer}.p{payload}.{k}"
        for j, site in enumerate(SPEC.sites):
            rng = np.random.default_rng([wid, payload, k, j, version])
            rows = tokens * site.rows_per_token
            codes = rng.integers(0, 256, rows * site.code_bytes, dtype=np.uint8).tobytes()
            scales = rng.integers(0, 256, rows * site.scale_bytes, dtype=np.uint8).tobytes()
            g = float(np.float32(0.25 + 0.01 * (payload % 50))) if site.fmt.has_global_scale else 1.0
            ts = rng.standard_normal(rows).astype("<f4").tobytes() if (j == 0 and payload % 2) else None
            out.append(Rec(version, traj, site.name, 0, tokens, codes, scales, g, ts))
    return out


@dataclasses.dataclass
class Msg:
    payload: int
    recs: list[Rec]
    epoch: int = 0
    seq: int = 0

    def request(self, run: str, writer: str, declare: bool) -> bytes:
        req = pb.WriteRequest(run=run, writer=writer, epoch=self.epoch, sequence=self.seq,
                              chunks=[r.to_pb() for r in self.recs])  # fmt: skip
        if declare:
            req.run_spec.CopyFrom(run_spec_to_pb(SPEC))
        return req.SerializeToString()


# ---------------------------------------------------------------------------------------------
# the raw writer


@dataclasses.dataclass
class SessionResult:
    code: str | None  # None: the stream ended cleanly; else the gRPC code name, or "CLIENT_TIMEOUT"
    details: str = ""
    sent_new: int = 0
    acked: int = 0


class Writer:
    """One writer id over raw Write streams: numbers messages (epoch, sequence), resends what is not
    acknowledged on every new stream (as the recorder does), starts a new epoch on FAILED_PRECONDITION
    and keeps every acknowledged message for the final read-back.

    ``anomalies`` collects protocol breaches seen from the client side (an acknowledged sequence
    the server forgot, a gap after a restart)."""

    def __init__(
        self, writer: str, *, trajs: int = 4, tokens: int = 64, version: int = 0, window: int = 8, epoch: int = 1
    ) -> None:
        self.writer = writer
        self.trajs, self.tokens, self.version, self.window = trajs, tokens, version, window
        self.epoch = epoch
        self.next_seq = 1
        self.next_payload = 0
        self.unacked: deque[Msg] = deque()
        self.acked: list[Msg] = []
        self.acked_seq = 0  # highest durable sequence of this epoch reported
        self.codes: Counter[str] = Counter()
        self.anomalies: list[str] = []
        self._lock = threading.Lock()

    @property
    def acked_recs(self) -> list[Rec]:
        return [r for m in self.acked for r in m.recs]

    def _new(self) -> Msg:
        m = Msg(self.next_payload, make_recs(self.writer, self.next_payload, trajs=self.trajs, tokens=self.tokens,
                                             version=self.version))  # fmt: skip
        self.next_payload += 1
        m.epoch, m.seq = self.epoch, self.next_seq
        self.next_seq += 1
        self.unacked.append(m)
        return m

    def _on_ack(self, raw: bytes) -> int:
        r = pb.WriteResponse.FromString(raw)
        if r.epoch != self.epoch:
            return 0
        if r.durable_sequence < self.acked_seq:
            self.anomalies.append(
                f"durable_sequence went back from {self.acked_seq} to {r.durable_sequence} (epoch {self.epoch})"
            )
        self.acked_seq = max(self.acked_seq, r.durable_sequence)
        n = 0
        while self.unacked and self.unacked[0].seq <= r.durable_sequence:
            self.acked.append(self.unacked.popleft())
            n += 1
        return n

    def new_epoch(self) -> None:
        self.epoch += 1
        self.acked_seq = 0
        for i, m in enumerate(self.unacked, start=1):
            m.epoch, m.seq = self.epoch, i
        self.next_seq = len(self.unacked) + 1

    def session(
        self,
        address: str,
        *,
        max_new: int | None = None,
        stop: Callable[[], bool] | None = None,
        timeout: float = 30.0,
        pace_s: float = 0.0,
    ) -> SessionResult:
        """One Write stream: resend what is unacknowledged, then send new messages (keeping at most
        ``window`` unacknowledged) until ``max_new`` were sent or ``stop()``; then half-close and
        wait for the stream's end. Ends early on a stream error or after ``timeout`` s (cancelled:
        code ``CLIENT_TIMEOUT``)."""
        res = SessionResult(None)
        sendq: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        respq: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

        def requests() -> Any:
            while True:
                item = sendq.get()
                if item is None:
                    return
                yield item

        ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * MiB)])
        call = ch.stream_stream(WRITE)(requests(), timeout=timeout + 5)

        def reader() -> None:
            try:
                for raw in call:
                    respq.put(("ack", raw))
                respq.put(("end", None))
            except grpc.RpcError as exc:
                respq.put(("err", exc))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        first = True
        for m in list(self.unacked):
            sendq.put(m.request(SPEC.run, self.writer, first))
            first = False
        closed = False
        deadline = time.monotonic() + timeout
        last_send = 0.0
        try:
            while True:
                stopping = (max_new is not None and res.sent_new >= max_new) or (stop is not None and stop())
                now = time.monotonic()
                while not stopping and len(self.unacked) < self.window and now - last_send >= pace_s:
                    m = self._new()
                    sendq.put(m.request(SPEC.run, self.writer, first))
                    first = False
                    res.sent_new += 1
                    last_send = now
                    stopping = max_new is not None and res.sent_new >= max_new
                if stopping and not closed:
                    sendq.put(None)
                    closed = True
                try:
                    kind, val = respq.get(timeout=0.02)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        call.cancel()
                        res.code = "CLIENT_TIMEOUT"
                        break
                    continue
                if kind == "ack":
                    res.acked += self._on_ack(val)
                elif kind == "end":
                    break
                else:
                    code = val.code()
                    res.code = code.name if code is not None else "UNKNOWN"
                    res.details = val.details() or ""
                    break
        finally:
            if not closed:
                sendq.put(None)
            t.join(timeout=5)
            ch.close()
        if res.code is not None:
            self.codes[res.code] += 1
        if res.code == "FAILED_PRECONDITION":
            # a gap or a fenced epoch: the server does not know messages it acknowledged (or another
            # instance took the writer id over); continue in a new epoch, as the recorder does
            self.anomalies.append(f"FAILED_PRECONDITION at epoch {self.epoch}: {res.details[:200]}")
            self.new_epoch()
        return res

    def write_until(self, address: str, pred: Callable[[], bool], timeout: float, **kw: Any) -> None:
        """Sessions (reconnecting after errors) until ``pred()`` or ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not pred() and time.monotonic() < deadline:
            res = self.session(address, stop=pred, timeout=max(0.5, min(10.0, deadline - time.monotonic())), **kw)
            if res.code is not None and not pred():
                time.sleep(0.1)

    def drain(self, address: str, timeout: float = 30.0) -> bool:
        """Resend until everything sent is acknowledged; True when it is."""
        deadline = time.monotonic() + timeout
        while self.unacked and time.monotonic() < deadline:
            res = self.session(address, max_new=0, timeout=max(0.5, deadline - time.monotonic()))
            if res.code is not None and self.unacked:
                time.sleep(0.1)
        return not self.unacked


class Background:
    """A writer in a thread: sessions back to back (reconnecting after errors); codes counted per
    ``phase`` (set by the test as it goes)."""

    def __init__(self, w: Writer, address: str, *, session_s: float = 2.0, pace_s: float = 0.01) -> None:
        self.w, self.address = w, address
        self.session_s, self.pace_s = session_s, pace_s
        self.stop = threading.Event()
        self.phase = "before"
        self.codes: dict[str, Counter[str]] = {}
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            res = self.w.session(self.address, stop=self.stop.is_set, timeout=self.session_s, pace_s=self.pace_s)
            if res.code is not None:
                self.codes.setdefault(self.phase, Counter())[res.code] += 1
                time.sleep(0.1)

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


# ---------------------------------------------------------------------------------------------
# reading back


@dataclasses.dataclass
class Check:
    acked: int = 0
    lost: int = 0  # missing
    corrupt: int = 0  # present, bytes differ
    duplicated: int = 0
    phantom: int = 0  # stored chunks of our writers that were never sent
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def lost_total(self) -> int:
        return self.lost + self.corrupt

    def ok(self) -> bool:
        return not (self.lost or self.corrupt or self.duplicated or self.errors)

    def __str__(self) -> str:
        s = f"acked={self.acked} lost={self.lost} corrupt={self.corrupt} duplicated={self.duplicated}"
        return s + (f" errors={self.errors[:3]}" if self.errors else "")


def verify(
    storage: str, recs: list[Rec], storage_options: dict[str, Any] | None = None, versions: list[int] | None = None
) -> Check:
    """Every record in ``recs`` is on storage bit for bit, and no chunk key is stored twice (in
    ``versions``, default all)."""
    from tracestore.plan import MicrobatchPlan
    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    chk = Check(acked=len(recs))
    store = Store(storage, storage_options, timeout=30.0)
    stored: Counter[tuple[int, str, str, int]] = Counter()
    spans: dict[tuple[int, str, str], list[tuple[int, int]]] = {}
    try:
        stored_versions = store.list_versions(SPEC.run)
    except Exception as exc:  # noqa: BLE001 - nothing stored at all
        stored_versions = []
        if recs:
            chk.errors.append(f"list_versions: {type(exc).__name__}: {exc}")
    for v in stored_versions:
        if versions is not None and v not in versions:
            continue
        try:
            manifests = store.manifests(SPEC.run, v)
        except Exception as exc:  # noqa: BLE001 - an unreadable manifest is a finding, not a crash of the check
            chk.errors.append(f"manifests of v{v}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        for m in manifests:
            for e in m.chunks:
                stored[(v, e.trajectory, e.site, e.token_start)] += 1
                spans.setdefault((v, e.trajectory, e.site), []).append((e.token_start, e.token_start + e.n_tokens))
    chk.duplicated = sum(n - 1 for n in stored.values() if n > 1)
    for sp in spans.values():  # overlapping different ranges of one key are duplicates too
        sp.sort()
        pairs = zip(sp, sp[1:], strict=False)
        chk.duplicated += sum(1 for (a0, a1), (b0, b1) in pairs if b0 < a1 and (a0, a1) != (b0, b1))
    present = [r for r in recs if stored[r.key] > 0]
    chk.lost = len(recs) - len(present)
    by: dict[tuple[int, str], list[Rec]] = {}
    for r in present:
        by.setdefault((r.version, r.site), []).append(r)
    reader = StoreReader(store, SPEC.run)
    for (v, site), rs in by.items():
        spec = SPEC.site(site)
        for i in range(0, len(rs), 2048):
            part = rs[i : i + 2048]
            try:
                out = reader.read(
                    MicrobatchPlan([(r.trajectory, r.token_start, r.token_start + r.n_tokens) for r in part]),
                    versions=[v], sites=[site], on_missing="mask",
                )[site]  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a read that fails is counted, with its reason
                chk.corrupt += len(part)
                chk.errors.append(f"read {site} v{v}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row0 = 0
            for r in part:
                n = r.n_tokens * spec.rows_per_token
                sl = slice(row0, row0 + n)
                row0 += n
                same = (
                    bool(out.valid[sl].all())
                    and out.codes[sl].tobytes() == r.codes
                    and out.scales[sl].tobytes() == r.scales
                    and bool(np.all(out.global_scale[sl] == np.float32(r.global_scale)))
                )
                if same and r.token_scales is not None:
                    ts = out.token_scales
                    same = ts is not None and ts[sl].astype("<f4").tobytes() == r.token_scales
                if not same:
                    chk.corrupt += 1
    return chk


# ---------------------------------------------------------------------------------------------
# the WAL's on-disk format, read-only (server/wal/log.py's docstring: <IIB> header + payload; zero
# padding after the last entry ends a segment)

WAL_HEADER = struct.Struct("<IIB")


def wal_entries(path: Path) -> list[tuple[int, int, int]]:
    """[(offset, total length, type)] of the intact entries of one segment, in order."""
    import zlib

    data = path.read_bytes()
    out = []
    pos = 0
    while pos + WAL_HEADER.size <= len(data):
        length, crc, kind = WAL_HEADER.unpack_from(data, pos)
        end = pos + WAL_HEADER.size + length
        if (length == 0 and crc == 0 and kind == 0) or end > len(data):
            break
        if zlib.crc32(data[pos + WAL_HEADER.size : end], zlib.crc32(bytes([kind]))) != crc:
            break
        out.append((pos, end - pos, kind))
        pos = end
    return out


def wal_segments(wal_dir: Path) -> list[Path]:
    return sorted(p for p in wal_dir.glob("wal-*.log"))


def wal_data_request(path: Path, offset: int) -> pb.WriteRequest:
    """The WriteRequest inside the DATA entry at ``offset`` (u32 length + raw request)."""
    data = path.read_bytes()
    length, _, _ = WAL_HEADER.unpack_from(data, offset)
    payload = data[offset + WAL_HEADER.size : offset + WAL_HEADER.size + length]
    (n,) = struct.unpack_from("<I", payload)
    return pb.WriteRequest.FromString(payload[4 : 4 + n])


# ---------------------------------------------------------------------------------------------
# misc


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def converged(sc: Sidecar, writer: str) -> bool:
    """committed == durable == received for the writer and no backlog (Stat)."""
    with contextlib.suppress(grpc.RpcError):
        s = sc.stat()
        w = next((w for w in s.writers if w.writer == writer), None)
        if w is None:
            return s.backlog_bytes == 0
        return s.backlog_bytes == 0 and w.committed_sequence == w.durable_sequence == w.received_sequence
    return False
