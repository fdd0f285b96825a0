"""Ingest and read throughput of the sidecar against baselines measured in the same run (CPU).

Providers, all moving the same record bytes (paper configuration: width 2048, NVFP4, b = 1, so
384 B per token per site; prefill forwards of 8 trajectories x 512 tokens x 4 sites):

- ``raw-grpc``: grpcio client-streaming of pre-serialized 4 MiB messages to a server process that
  only counts them (the transport ceiling; with the sidecar's malloc settings, see
  ``_raw_grpc_server``);
- ``disk``: write + one fdatasync of the same bytes in the WAL directory, through the page cache
  and with O_DIRECT (the durability ceiling is the better of the two);
- ``durable floor``: the raw client into a sink that does only what no durable design can skip
  (one CRC pass, one copy into aligned buffers, O_DIRECT writes, the final fdatasync; see
  ``_floor_server``): how close to the ceilings a verified, on-disk ack can get on this stack;
- ``compiled``: the same two sinks (counting; durable floor) as a gRPC C++ server with no Python
  in it (``floor_sink.cc``, built here when Debian's libgrpc++-dev and libisal-dev are installed,
  or taken from ``$TRACESTORE_FLOOR_SINK``; left out, with the reason printed, otherwise): whether
  a compiled receive path would lift the durable floor;
- ``ours-grpc-durable``: RolloutRecorder -> TCP -> `tracestore serve` (WAL fsync acks, file://);
- ``ours-grpc-memory`` / ``ours-shm-memory``: the same with ``memory://`` storage and acks on
  shard commit, over TCP with inline bytes vs the unix socket with shared-memory descriptors;
- ``ours-grpc/shm memory://, WAL ack``: a sidecar as ``tracestore serve --storage memory://`` runs
  by default (acks at the fsync of its WAL on the bench disk; it encodes shards in the pauses of
  ingest, here after each measurement, which ``settle`` waits for), over TCP vs shared memory,
  in ``PAIRS`` alternating pairs per repetition (each pair one sample of the ratio);
- ``flight-do_put``: Arrow Flight ``do_put`` of the same chunks (Arrow table) to a server process
  that reads every batch (the peer a user would otherwise pick);
- ``raw-parquet-read`` vs ``ours-read``: reading one repetition's records back (GuidanceReader on
  the storage URL, plan-aligned and checksum-verified) vs ``pyarrow.parquet.read_table`` of the
  shards that repetition created (the same records; both rates over the same record bytes).

Every provider with a server process also reports the CPU seconds of the sending and the serving
process during its measurement, and the rate those would allow if both were spread perfectly over
the box's cores (``cpu_bound_GBps``): on 2 shared cores, a bound no overlap can beat. The
memory:// sidecars are fresh in every repetition (a memory:// store keeps every shard in RAM).

``--only auth`` (not part of the default run) measures what TLS and bearer tokens cost: the durable
TCP sidecar (file://, WAL fsync acks) started plainly and with ``--tls-cert/--tls-key
--auth-tokens`` (certificates made for the run, the recorder sending its token as call credentials
over TLS), and with tokens alone (plaintext loopback), in rounds of alternating order, each round
one sample of each ratio to the plain sidecar; and ``raw-grpc`` plaintext vs TLS in the same rounds
(what TLS costs grpcio itself on the box). Over the unix socket (shared-memory descriptors), in the
same rounds: a sidecar without authorization (the socket's permissions the only check) vs one whose
token file authorizes this uid (``uid:`` rule: the recorder fetches a peer token from
``<socket>.peer``) and one that takes the bench's bearer token; the target there is "unchanged", a
median ratio of at least ``UNCHANGED``. Every side has a sidecar of its own (each takes the same
bytes per round), and the page cache is written back (``os.sync``) after each measurement, so one
side's shards do not land in the next one's fsyncs. With ``--recorders K`` also K recorders in
processes of their own at once (as K tensor-parallel engine processes beside one sidecar), each on
its own connection and with 1/K of the bytes, against the plain and the TLS + token sidecar. With
``--compare-window KIB`` also the plaintext and the TLS + token sidecars with ``--stream-window-kib
KIB`` in the same rounds: what that receive window gains over the default (gRPC's 64 KiB).

Run: ``python bench/bench_ingest.py [--mib 192] [--repeat 3] [--only ingest|read|decode|auth]``;
prints a table, appends to ``bench/results/bench_ingest.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, machine, print_table  # noqa: E402

from tracestore.records import RecordChunk, RunSpec, SiteSpec  # noqa: E402

WIDTH, TOKENS, TRAJ_PER_FWD, N_SITES = 2048, 512, 8, 4
MSG = 4 << 20
SPEC = RunSpec(
    "bench", tuple(SiteSpec(f"layers.{20 + i}.mlp.input", "moe_input", 20 + i, WIDTH) for i in range(N_SITES))
)


def forward_outputs(seed: int = 0) -> dict[str, Any]:
    from tracestore.client import SiteOutput

    rng = np.random.default_rng(seed)
    rows = TRAJ_PER_FWD * TOKENS
    return {
        s.name: SiteOutput(
            rng.integers(0, 256, (rows, s.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (rows, s.scale_bytes), dtype=np.uint8),
            0.01,
        )
        for s in SPEC.sites
    }


def fwd_bytes() -> int:
    return TRAJ_PER_FWD * TOKENS * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)


# -- baselines in child processes ------------------------------------------------------------------


def _serve_sink(sink: Any, port_q: Any, stop: Any, tls_dir: str | None = None) -> None:
    """Serve ``sink`` as the client-streaming ``/bench.Sink/Put`` on a loopback port (sent to the
    parent through ``port_q``) until ``stop`` is set; over TLS with ``tls_dir``'s server.pem/.key."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Put": grpc.stream_unary_rpc_method_handler(sink)}),)
    )
    if tls_dir is None:
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
    else:
        pair = (Path(tls_dir, "server.key").read_bytes(), Path(tls_dir, "server.pem").read_bytes())
        port_q.put(server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair])))
    server.start()
    stop.wait()
    server.stop(1)


def _raw_grpc_server(port_q: Any, stop: Any, tls_dir: str | None = None) -> None:
    from tracestore.server.cli import tune_malloc

    # The allocator settings our sidecar runs with (tune_malloc): with glibc's defaults every
    # received 4 MiB message came from fresh mmap pages, and this ceiling measured 0.44-1.50 GB/s
    # across a run's repetitions instead of 1.79-2.24 GB/s (5 repetitions each, same box): a
    # baseline handicapped by an allocator setting ours avoids made our ratio look ~2.5x better.
    tune_malloc()

    def sink(it: Any, ctx: Any) -> bytes:
        n = 0
        for m in it:
            n += len(m)
        return str(n).encode()

    _serve_sink(sink, port_q, stop, tls_dir)


def _floor_server(port_q: Any, stop: Any, directory: str) -> None:
    """The least a durable gRPC sink in Python must do per byte on this stack, and nothing else:
    grpcio receives pre-serialized 4 MiB messages; each is checksummed (ISA-L CRC-32, one pass)
    and copied into 16 MiB aligned buffers that a writer thread writes with O_DIRECT; the stream
    is answered after the final fdatasync. No parsing, no validation, no dedupe, no per-chunk
    work, no shards: a ceiling for any design that acks only what is on disk and verified."""
    import mmap
    import queue
    import threading

    from tracestore.server.cli import tune_malloc

    from tracestore.checksum import crc32

    tune_malloc()
    size = 16 << 20
    free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for _ in range(3):
        free.put(mmap.mmap(-1, size))
    path = os.path.join(directory, "floor.wal")

    def sink(it: Any, ctx: Any) -> bytes:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        full: queue.SimpleQueue[tuple[mmap.mmap, int] | None] = queue.SimpleQueue()
        written = [0]

        def writer() -> None:
            while (item := full.get()) is not None:
                buf, n = item
                with memoryview(buf) as v:
                    os.pwrite(fd, v[: -(-n // 4096) * 4096], written[0])
                written[0] += n
                free.put(buf)

        th = threading.Thread(target=writer)
        th.start()
        buf, fill, crc, total = free.get(), 0, 0, 0
        try:
            for m in it:
                crc = crc32(m, crc)
                view, total = memoryview(m), total + len(m)
                while view:
                    n = min(len(view), size - fill)
                    buf[fill : fill + n] = view[:n]
                    fill, view = fill + n, view[n:]
                    if fill == size:
                        full.put((buf, fill))
                        buf, fill = free.get(), 0
            if fill:
                full.put((buf, fill))
            else:
                free.put(buf)
        finally:
            full.put(None)
            th.join()
            os.fdatasync(fd)
            os.close(fd)
        return f"{total} {crc}".encode()

    _serve_sink(sink, port_q, stop)


def _flight_server(port_q: Any, stop: Any) -> None:
    import pyarrow.flight as fl

    class Sink(fl.FlightServerBase):
        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            n = 0
            for chunk in reader:
                n += chunk.data.nbytes
            self.received = n

    s = Sink("grpc://127.0.0.1:0")
    port_q.put(s.port)
    stop.wait()
    s.shutdown()


def _spawn(target: Any, *args: Any) -> tuple[Any, Any, int]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=target, args=(q, stop, *args), daemon=True)
    p.start()
    return p, stop, int(q.get(timeout=60))


class CpuMeter:
    """CPU seconds of this (client) process and of a server process over one measurement:
    ``with CpuMeter(pid) as m: ...`` then ``m.client``, ``m.server`` (the server's at the kernel's
    10 ms tick). Spread over the box's cores, their sum bounds the rate from above
    (``bytes / (sum / cores)``) however the two sides overlap."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid, self.client, self.server = server_pid, 0.0, 0.0

    def __enter__(self) -> CpuMeter:
        self._c0, self._s0 = time.process_time(), _proc_cpu_s(self.pid) if self.pid else 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.client = time.process_time() - self._c0
        self.server = (_proc_cpu_s(self.pid) if self.pid else 0.0) - self._s0


class _SinkClient:
    """A client streaming pre-serialized ``MSG``-byte messages to a sink on ``port`` of the server
    process ``pid`` (one warm-up call first); calling it with a byte count returns B/s."""

    def _connect(self, port: int, pid: int, credentials: Any = None) -> None:
        import grpc

        options = [("grpc.max_send_message_length", 64 << 20)]
        target = f"127.0.0.1:{port}"
        self.ch = (
            grpc.insecure_channel(target, options)
            if credentials is None
            else grpc.secure_channel(target, credentials, options)
        )
        self.put = self.ch.stream_unary("/bench.Sink/Put")
        self.msg = os.urandom(MSG)
        self.put(iter([self.msg]))  # warm up the connection
        self.cpu = CpuMeter(pid)

    def __call__(self, total: int) -> float:
        n = max(1, total // MSG)
        with self.cpu:
            t0 = time.perf_counter()
            got = int(self.put(iter([self.msg] * n)).split()[0])
            dt = time.perf_counter() - t0
        if got != n * MSG:
            raise RuntimeError(f"sink counted {got} of {n * MSG} bytes")
        return n * MSG / dt


class RawGrpc(_SinkClient):
    """The transport ceiling: a sink server process and a client streaming pre-serialized messages
    (``directory``: the durable floor's sink instead, :func:`_floor_server`, its WAL there)."""

    def __init__(self, directory: Path | None = None, tls_dir: Path | None = None) -> None:
        credentials = None
        if directory is not None:
            self.proc, self.stop, port = _spawn(_floor_server, str(directory))
        elif tls_dir is not None:  # the same ceiling over TLS (tls_dir: write_test_pki's files)
            import grpc

            self.proc, self.stop, port = _spawn(_raw_grpc_server, str(tls_dir))
            credentials = grpc.ssl_channel_credentials((tls_dir / "ca.pem").read_bytes())
        else:
            self.proc, self.stop, port = _spawn(_raw_grpc_server)
        self._connect(port, self.proc.pid, credentials)

    def close(self) -> None:
        self.ch.close()
        self.stop.set()
        self.proc.join(10)


class CompiledSink(_SinkClient):
    """The same client against ``floor_sink`` (``floor_sink.cc``): counting, or (``directory``) the
    durable floor with its WAL there. ``.version``: the gRPC C++ version it was built with."""

    def __init__(self, binary: str, directory: Path | None = None) -> None:
        import subprocess

        args = ["count"] if directory is None else ["floor", str(directory / "floor.wal")]
        self.sink = subprocess.Popen([binary, *args], stdout=subprocess.PIPE, text=True)
        assert self.sink.stdout is not None
        port, self.version = self.sink.stdout.readline().split()
        self._connect(int(port), self.sink.pid)

    def close(self) -> None:
        self.ch.close()
        self.sink.kill()
        self.sink.wait(10)


def compiled_sink(build_dir: Path) -> tuple[str | None, str]:
    """``(path of the floor_sink binary, "")``, building it into ``build_dir`` from ``floor_sink.cc``
    unless ``$TRACESTORE_FLOOR_SINK`` names one; ``(None, why)`` where it cannot be had."""
    import shutil
    import subprocess

    given = os.environ.get("TRACESTORE_FLOOR_SINK")
    if given:
        return (given, "") if os.access(given, os.X_OK) else (None, f"$TRACESTORE_FLOOR_SINK={given} is not executable")
    src = Path(__file__).with_name("floor_sink.cc")
    if shutil.which("g++") is None or shutil.which("pkg-config") is None:
        return None, "no g++ or pkg-config"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True, text=True)
    if flags.returncode != 0:
        return None, "no gRPC C++ (Debian: apt-get install libgrpc++-dev libisal-dev pkg-config)"
    out = build_dir / "floor_sink"
    cmd = ["g++", "-O2", "-std=c++17", str(src), "-o", str(out), *flags.stdout.split(), "-lisal"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        return None, f"floor_sink.cc did not build: {built.stderr.strip().splitlines()[-1:]}"
    return str(out), ""


def bench_disk(total: int, directory: Path, direct: bool = False) -> float:
    """The disk's write+fsync rate for ``total`` bytes in ``directory``: 4 MiB writes then one
    fdatasync, through the page cache or (``direct``) with O_DIRECT from an aligned buffer, as the
    sidecar's WAL writes where the file system allows it (0.0 where it does not)."""
    import mmap

    n = max(1, total // MSG)
    buf = mmap.mmap(-1, MSG)
    buf[:] = os.urandom(MSG)
    path = directory / "disk-probe.bin"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    t0 = time.perf_counter()
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return 0.0
    try:
        for _ in range(n):
            os.write(fd, buf)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return n * MSG / dt


class Flight:
    """Arrow Flight ``do_put`` of the same chunks (as an Arrow table) to a server process that reads them."""

    def __init__(self) -> None:
        import pyarrow.flight as fl

        self.proc, self.stop, port = _spawn(_flight_server)
        self.client = fl.connect(f"grpc://127.0.0.1:{port}")
        self.cpu = CpuMeter(self.proc.pid)

    def __call__(self, chunks: list[RecordChunk]) -> float:
        import pyarrow.flight as fl

        from tracestore.storage.arrow import chunks_to_table

        nbytes = sum(c.nbytes for c in chunks)
        with self.cpu:
            t0 = time.perf_counter()
            table = chunks_to_table(chunks)
            writer, _ = self.client.do_put(fl.FlightDescriptor.for_path("bench"), table.schema)
            writer.write_table(table, max_chunksize=max(1, MSG // max(1, nbytes // max(len(chunks), 1))))
            writer.close()
            dt = time.perf_counter() - t0
        return nbytes / dt

    def close(self) -> None:
        self.client.close()
        self.stop.set()
        self.proc.join(10)


# -- ours ------------------------------------------------------------------------------------------


def run_recorder(
    address: str, n_fwd: int, tag: str, outputs: dict[str, Any], cpu: CpuMeter | None = None, **creds: Any
) -> tuple[float, dict[str, int]]:
    """Stream ``n_fwd`` forwards through a fresh recorder; B/s from the first timed forward to the
    last ack (``cpu``: measures both processes over that window; ``creds``: the recorder's
    ``channel_credentials``/``token``)."""
    rec = _warm_recorder(address, tag, outputs, **creds)
    with cpu or contextlib.nullcontext():
        t0, t1 = _timed_forwards(rec, n_fwd, tag, outputs)
    stats = _close_checked(rec)
    return n_fwd * fwd_bytes() / (t1 - t0), stats


def _warm_recorder(address: str, tag: str, outputs: dict[str, Any], **creds: Any) -> Any:
    """A recorder for the bench with one forward recorded and acked (connection, run declaration)."""
    from tracestore.client import RolloutRecorder

    rec = RolloutRecorder(address, SPEC, f"bench-{tag}", staging_bytes=256 << 20, batch_bytes=MSG, **creds)
    rec.record_forward([(f"{tag}-warm-{k}", 0, TOKENS) for k in range(TRAJ_PER_FWD)], outputs)
    if not rec.flush(120):
        raise RuntimeError(f"warm-up not acked: {rec.stats}")
    return rec


def _timed_forwards(rec: Any, n_fwd: int, tag: str, outputs: dict[str, Any]) -> tuple[float, float]:
    """Record ``n_fwd`` forwards and wait for their acks: (start, end) on ``time.perf_counter``."""
    need = fwd_bytes() + 4096
    t0 = time.perf_counter()
    for f in range(n_fwd):
        while rec.pool.capacity - rec.pool.in_use < need:  # pace like an engine with a full ring would
            time.sleep(0.0005)
        if not rec.record_forward([(f"{tag}-{f}-{k}", 0, TOKENS) for k in range(TRAJ_PER_FWD)], outputs):
            raise RuntimeError(f"forward refused: {rec.stats}")
    if not rec.flush(600):
        raise RuntimeError(f"not acked: {rec.stats}")
    return t0, time.perf_counter()


def _close_checked(rec: Any) -> dict[str, int]:
    stats = dict(rec.stats)
    rec.close()
    if stats["unguided"]:
        raise RuntimeError(f"records dropped: {stats}")
    return stats


def _recorder_process(conn: Any, address: str, tag: str, ca: str | None, token: str | None) -> None:
    """One engine process's recorder (``--recorders``): warms up, then for each ``n_fwd`` received
    on ``conn`` records that many forwards and answers (start, end); None ends it."""
    creds: dict[str, Any] = {}
    if ca is not None:
        import grpc

        creds["channel_credentials"] = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    if token is not None:
        creds["token"] = token
    outputs = forward_outputs()
    rec = _warm_recorder(address, tag, outputs, **creds)
    conn.send("ready")
    rounds = 0
    while (n_fwd := conn.recv()) is not None:
        conn.send(_timed_forwards(rec, n_fwd, f"{tag}-{rounds}", outputs))
        rounds += 1
    _close_checked(rec)
    conn.send("closed")


class RecorderProcesses:
    """``k`` recorders in processes of their own, as ``k`` engine processes (tensor-parallel ranks)
    beside one sidecar would run them, each on its own connection: calling it with a forward count
    has each record that many at once and returns the aggregate B/s (all bytes, first start to
    last ack)."""

    def __init__(self, k: int, address: str, tag: str, ca: Path | None = None, token: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_recorder_process, args=(theirs, address, f"{tag}-p{i}", ca and str(ca), token),
                            daemon=True)  # fmt: skip
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("a recorder process did not start")

    def __call__(self, n_fwd: int) -> float:
        for c in self.conns:
            c.send(n_fwd)
        spans = [c.recv() for c in self.conns]
        return len(spans) * n_fwd * fwd_bytes() / (max(e for _, e in spans) - min(s for s, _ in spans))

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for c, p in zip(self.conns, self.procs, strict=True):
            if c.poll(60):
                c.recv()
            p.join(10)


def settle(address: str, timeout: float = 300.0, **creds: Any) -> None:
    """Wait until a sidecar has committed its backlog, so its shard writing does not steal the CPU
    from the next measurement (2 cores here)."""
    from tracestore.client.transport import channel

    from tracestore.v1 import tracestore_pb2 as pb

    with channel(address, **creds) as ch:
        stat = ch.unary_unary("/tracestore.v1.TraceStore/Stat")
        deadline = time.monotonic() + timeout
        while pb.StatResponse.FromString(stat(pb.StatRequest().SerializeToString())).backlog_bytes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} did not commit its backlog in {timeout} s")
            time.sleep(0.05)


PAIRS = 3  # alternating gRPC/shm pairs of the default configuration per repetition
READS = 4  # alternating raw/ours read pairs per repetition (after one untimed warm-up read)
CHILDREN = min(8, os.cpu_count() or 1)  # GuidanceReader(process=CHILDREN) in the read bench


def repetition_reads(storage: str, tag: str, before: set[Path]) -> tuple[list[Path], list[tuple[str, int, int]], int]:
    """The shards repetition ``tag`` created (those not in ``before``), a plan of all their
    trajectories, and the record bytes that plan reads (codes + scales of every token)."""
    import pyarrow.parquet as pq

    root = Path(storage.removeprefix("file://"))
    files = sorted(set(root.rglob("*.parquet")) - before)
    trajs = sorted({t for f in files for t in pq.read_table(f, columns=["trajectory"]).column(0).to_pylist()})
    if not all(t.startswith(f"{tag}-") for t in trajs):
        raise RuntimeError(f"shards of repetition {tag} hold other trajectories: {trajs[:4]}")
    plan = [(t, 0, TOKENS) for t in trajs]
    return files, plan, len(plan) * TOKENS * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)


def bench_read(storage: str, tag: str, before: set[Path]) -> dict[str, float]:
    """Read one repetition's records back: ``raw-parquet-read`` reads the shards that repetition
    created (``pq.read_table``, every column), ours reads the same trajectories (the repetition's
    forwards plus its warm-up forward) through a fresh GuidanceReader, plan-aligned and checksum-verified,
    both from the page cache (one untimed read first), alternating, medians of READS each.
    Both rates are over the same record bytes (codes + scales of every token read), so the ratio
    is the ratio of times. Also ours with ``process=1`` and ``process=CHILDREN`` (decoded in child
    processes into shared memory), each against the raw reads of its own phase. Returns B/s by
    kind: ``raw``, ``ours``, ``process=k``, ``raw beside process=k``."""
    import pyarrow.parquet as pq
    from tracestore.client import GuidanceReader

    files, plan, nbytes = repetition_reads(storage, tag, before)

    def raw() -> float:
        t0 = time.perf_counter()
        for f in files:
            pq.read_table(f)
        return time.perf_counter() - t0

    def check(rows: dict[str, Any]) -> None:
        got = sum(r.codes.nbytes + r.scales.nbytes for r in rows.values())
        if got != nbytes or not all(r.valid.all() for r in rows.values()):
            raise RuntimeError(f"read back {got} of {nbytes} bytes")

    def timed_read(reader: Any) -> float:
        """Seconds of ``reader.read_host(plan)``, its rows checked afterwards (untimed)."""
        t0 = time.perf_counter()
        rows = reader.read_host(plan)
        took = time.perf_counter() - t0
        check(rows)
        return took

    def ours() -> float:
        reader = GuidanceReader(storage, SPEC.run, prefetch=False)
        try:
            return timed_read(reader)
        finally:
            reader.close()

    def alternate(kinds: list[tuple[str, Callable[[], float]]], times: dict[str, list[float]]) -> None:
        for j in range(READS):
            for name, fn in kinds if j % 2 == 0 else kinds[::-1]:
                times.setdefault(name, []).append(fn())

    # Untimed first: a shard just written may be partly out of the page cache (the two-writer
    # shard path collapses a range, which drops the second half's pages), and whichever side read
    # first would pay the disk for both. Two rounds of both: after the repetition's ingest, the
    # first raw reads ran at 0.2-1.0 GB/s and reached ~1.7 only by the fourth or fifth (the
    # allocators' pools faulting fresh memory in again), which made the first phase's ratio
    # 1.15-1.2 in three runs against 0.82-0.93 before. Then READS alternating pairs; medians.
    for _ in range(2):
        raw()
        ours()
    times: dict[str, list[float]] = {}
    alternate([("raw", raw), ("ours", ours)], times)
    # Then process=1 and process=CHILDREN, each in its own phase against raw reads of that phase,
    # so what a phase leaves behind (live children, their shared blocks) weighs on both sides (a
    # probe saw raw reads at 0.4-1.4 GB/s with child readers alive and 1.7-1.85 after they closed,
    # though stalls that size also come without them on this VM). One reader per phase, as a
    # trainer keeps one; its children start and its first read (the shared block faulting in)
    # are untimed.
    for k in sorted({1, CHILDREN}):
        child = GuidanceReader(storage, SPEC.run, prefetch=False, process=k)
        try:
            timed_read(child)  # untimed: the children's start and the shared block faulting in

            def in_children(child: Any = child) -> float:
                return timed_read(child)

            alternate([(f"raw beside process={k}", raw), (f"process={k}", in_children)], times)
        finally:
            child.close()
    return {name: nbytes / statistics.median(t) for name, t in times.items()}


def bench_read_beside_busy_thread(storage: str, tag: str, before: set[Path]) -> dict[str, float]:
    """The same read in a background thread while this thread runs Python flat out (a training
    loop while the reader prefetches its next plan): B/s of ``pq.read_table`` of the shards, of
    ours keeping the GIL for its short copies and CRCs (``hold_gil=True``, what
    ``GuidanceReader.prefetch`` does), of ours giving it up (the default of a foreground read), and
    of ours with ``process=1`` (the thread only waits for the child process that decodes).
    One measurement each, after one untimed read of every kind."""
    import threading

    import pyarrow.parquet as pq
    from tracestore.client import GuidanceReader

    from tracestore.storage.reader import StoreReader
    from tracestore.storage.store import Store

    files, plan, nbytes = repetition_reads(storage, tag, before)
    reader = StoreReader(Store(storage), SPEC.run)
    children: list[Any] = []  # the child reader exists only for its own measurement (see bench_read)

    def in_child() -> Any:
        if not children:
            children.append(GuidanceReader(storage, SPEC.run, prefetch=False, process=1))
        return children[0].read_host(plan)

    kinds = {
        "raw-parquet-read, in a thread beside a Python-busy thread": lambda: [pq.read_table(f) for f in files],
        "ours-read, in a thread beside a Python-busy thread (GIL kept: prefetch)": lambda: reader.read(
            plan, hold_gil=True
        ),
        "ours-read, in a thread beside a Python-busy thread (GIL given up)": lambda: reader.read(plan),
        "ours-read in a child process (process=1), from a thread beside a Python-busy thread": in_child,
    }
    out = {}
    try:
        for name, fn in kinds.items():
            fn()  # untimed: page cache, footers, index (and the child's start and shared block)
            took = [0.0]

            def work(fn: Any = fn, took: list[float] = took) -> None:
                t0 = time.perf_counter()
                fn()
                took[0] = time.perf_counter() - t0

            th = threading.Thread(target=work)
            th.start()
            n = 0
            while th.is_alive():  # Python flat out (Thread.is_alive does not wait)
                n += 1
            th.join()
            out[name] = nbytes / took[0]
    finally:
        reader.close()
        for child in children:
            child.close()
    return out


def shard_files(storage: str) -> set[Path]:
    return set(Path(storage.removeprefix("file://")).rglob("*.parquet"))


DEC_ROWS, DEC_SITES = 256, 20  # a decode step: 256 sequences x 20 sites (paper: latter 20 of 40 layers)
DEC_SPEC = RunSpec(
    "bench-dec", tuple(SiteSpec(f"layers.{20 + i}.mlp.input", "moe_input", 20 + i, WIDTH) for i in range(DEC_SITES))
)


def _thread_cpu_s(native_id: int | None) -> float:
    """CPU seconds (user + system) a thread of this process has used, from /proc (Linux)."""
    if native_id is None:
        return 0.0
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


ENGINE_LOOPS = 20_000  # the engine's own Python per decode step (scheduling, sampling): ~1-2 ms alone here


def _engine_python() -> None:
    x = 0
    for i in range(ENGINE_LOOPS):
        x += i & 7


def decode_caller_times(
    address: str | None, steps: int, step_s: float, tag: str
) -> tuple[list[float], float, int, list[float]]:
    """Seconds ``record_forward`` spends on the caller's (engine's) thread per decode step, with the
    sender streaming to ``address`` meanwhile (``None``: no sender thread at all, the idle floor),
    the sender thread's CPU seconds for all the steps (until they are acknowledged), the number
    of chunks it sent, and the seconds a fixed piece of pure-Python work (:data:`ENGINE_LOOPS`,
    the engine's own scheduling code) took each step: what the sender's share of the GIL costs
    the engine.
    Between steps the caller sleeps ``step_s`` (the GPU forward: the engine thread lets go of the GIL)."""
    from tracestore.client import RolloutRecorder, SiteOutput

    rng = np.random.default_rng(1)
    outs = {
        s.name: SiteOutput(
            rng.integers(0, 256, (DEC_ROWS, s.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (DEC_ROWS, s.scale_bytes), dtype=np.uint8),
            0.02,
        )
        for s in DEC_SPEC.sites
    }
    rec = RolloutRecorder(address or "127.0.0.1:1", DEC_SPEC, f"bench-{tag}", staging_bytes=256 << 20,
                          connect=address is not None)  # fmt: skip
    trajs = [f"{tag}-{k}" for k in range(DEC_ROWS)]
    times, work = [], []
    try:
        for i in range(steps):
            segs = [(t, i, i + 1) for t in trajs]
            t0 = time.perf_counter()
            ok = rec.record_forward(segs, outs)
            t1 = time.perf_counter()
            _engine_python()
            work.append(time.perf_counter() - t1)
            times.append(t1 - t0)
            if not ok:
                raise RuntimeError(f"decode step refused: {rec.stats}")
            if address is None and rec.pool.in_use > rec.pool.capacity // 2:
                rec.pool.release(0)  # no sender: recycle staging (the oldest region starts at 0)
                rec.pool._ring.clear()  # noqa: SLF001 - bench only: reset the idle ring
                rec.pool.in_use = 0
            time.sleep(step_s)
        if address is not None and not rec.flush(300):
            raise RuntimeError(f"decode steps not acked: {rec.stats}")
        sender_cpu = _thread_cpu_s(rec._thread.native_id) if address is not None else 0.0  # noqa: SLF001
        chunks = rec.stats["chunks"]
    finally:
        rec.close(timeout=60 if address is not None else 0.1)
    return times, sender_cpu, chunks, work


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_decode(ns: Any) -> int:
    """Caller-thread time of record_forward per decode step, idle sender vs a sidecar on the unix
    socket (shm) and on TCP, interleaved; and the time of the engine's own Python work right after
    each call (the sender thread shares the engine's GIL)."""
    from tracestore.server.testing import ServeProcess

    rows: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {}
    sender: dict[str, list[float]] = {}  # sender-thread CPU seconds per step, one per repetition
    sidecar: dict[str, list[float]] = {}  # sidecar process CPU seconds per step (until committed)
    per_chunk: dict[str, list[float]] = {}  # tokens per chunk sent
    engine: dict[str, list[float]] = {}  # the engine's fixed Python work per step (seconds)
    with tempfile.TemporaryDirectory(prefix="bench-decode-", dir=os.environ.get("BENCH_DIR")) as tmp:
        flags = ["--metrics-port", "off", "--flush-interval", "0.05"]
        mem = ServeProcess(Path(tmp) / "mem", storage=f"memory://bench-dec-{os.getpid()}", wal=False,
                           unix_socket=True, flags=flags).start()  # fmt: skip
        try:
            for r in range(ns.repeat):
                providers = (("no sender (idle floor)", None), ("sender -> shm sidecar", mem.unix_address),
                             ("sender -> TCP sidecar", mem.address))  # fmt: skip
                for j, (name, addr) in enumerate(providers):
                    assert mem.proc is not None
                    c0 = _proc_cpu_s(mem.proc.pid)
                    t, cpu, chunks, work = decode_caller_times(addr, ns.steps, ns.step_ms / 1000, f"dec{r}-{j}")
                    if addr is not None:
                        settle(mem.address)  # until its shards are committed
                    samples.setdefault(name, []).extend(t[5:])  # first steps: connection set-up
                    engine.setdefault(name, []).extend(work[5:])
                    sender.setdefault(name, []).append(cpu / ns.steps)
                    sidecar.setdefault(name, []).append((_proc_cpu_s(mem.proc.pid) - c0) / ns.steps)
                    per_chunk.setdefault(name, []).append(ns.steps * DEC_ROWS * DEC_SITES / max(chunks, 1))
        finally:
            mem.kill()
    for name, v in samples.items():
        q = statistics.quantiles(v, n=100)
        rows.append(dict(provider=f"record_forward caller time, {name}", median_ms=statistics.median(v) * 1e3,
                         p90_ms=q[89] * 1e3, p99_ms=q[98] * 1e3, max_ms=max(v) * 1e3, n=len(v),
                         sender_cpu_ms=statistics.median(sender[name]) * 1e3 if "idle" not in name else None,
                         sidecar_cpu_ms=statistics.median(sidecar[name]) * 1e3 if "idle" not in name else None,
                         tokens_per_chunk=statistics.median(per_chunk[name]) if "idle" not in name else None,
                         step=f"{DEC_ROWS} rows x {DEC_SITES} sites"))  # fmt: skip
    for name, v in engine.items():
        q = statistics.quantiles(v, n=100)
        rows.append(dict(provider=f"engine's own Python per step ({ENGINE_LOOPS} loop iterations), {name}",
                         median_ms=statistics.median(v) * 1e3, p90_ms=q[89] * 1e3, p99_ms=q[98] * 1e3,
                         max_ms=max(v) * 1e3, n=len(v), step=f"{DEC_ROWS} rows x {DEC_SITES} sites"))  # fmt: skip
    m = machine()
    print(f"# decode-step caller time on {m.get('cpu')} ({m.get('cores')} cores), {ns.repeat} interleaved "
          f"repetitions of {ns.steps} steps, {ns.step_ms} ms per step between calls; load average at the end "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print_table(rows, ["provider", "median_ms", "p90_ms", "p99_ms", "max_ms", "sender_cpu_ms", "sidecar_cpu_ms",
                       "tokens_per_chunk", "n"])  # fmt: skip
    print("(sender_cpu_ms: the recorder's sender thread, CPU per step until acknowledged; sidecar_cpu_ms: the sidecar "
          "process per step until its shards are committed; medians of repetitions)")  # fmt: skip
    if not ns.no_save:
        print(f"\nappended to {append_results('bench_ingest', rows)}")
    return 0


# --only auth over the unix socket: authorization must leave ingest "unchanged", read as a median
# ratio to the unauthorized socket of at least this (rounds on one box differ by a few percent).
UNCHANGED = 0.95


def bench_auth(ns: Any) -> int:
    """The durable sidecar without and with authorization, alternating: over TCP plaintext vs TLS +
    bearer tokens (and tokens alone), over the unix socket (shared memory) none vs uid: rules and
    bearer tokens."""
    import grpc
    from tracestore.server.security.tls import write_test_pki
    from tracestore.server.testing import ServeProcess

    total = ns.mib << 20
    n_fwd = max(1, total // fwd_bytes())
    outputs = forward_outputs()
    samples: dict[str, list[float]] = {}
    cpus: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-auth-", dir=os.environ.get("BENCH_DIR")) as tmp:
        d = Path(tmp)
        pki = write_test_pki(d / "pki")
        token = os.urandom(24).hex()
        digest = hashlib.sha256(token.encode()).hexdigest()
        (d / "tokens").write_text(f"sha256:{digest} write:*,read:*,admin bench\n")
        # ... and a file that also authorizes this uid on the unix socket (the recorder sends peer tokens)
        (d / "peers").write_text(
            f"sha256:{digest} write:*,read:*,admin bench\nuid:{os.getuid()} write:*,read:*,admin\n"
        )
        quiet = ["--metrics-port", "off"]
        servers: list[ServeProcess] = []

        def serve(name: str, *flags: str, unix: bool = False) -> ServeProcess:
            """One sidecar per measured side, so each takes the same bytes per round."""
            servers.append(ServeProcess(d / name, unix_socket=unix, flags=[*quiet, *flags]).start())
            return servers[-1]

        tls_flags = ("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]))
        plain, secure = serve("plain"), serve("tls", *tls_flags, "--auth-tokens", str(d / "tokens"))
        tokens = serve("tokens-only", "--auth-tokens", str(d / "tokens"))
        unix_plain = serve("unix-plain", unix=True)
        unix_uid = serve("unix-uid", "--auth-tokens", str(d / "peers"), unix=True)
        unix_bearer = serve("unix-bearer", "--auth-tokens", str(d / "tokens"), unix=True)
        window = ns.compare_window  # the same two TCP sidecars with this receive window as well
        if window:
            plain_w = serve("plain-w", "--stream-window-kib", str(window))
            secure_w = serve(
                "tls-w", *tls_flags, "--auth-tokens", str(d / "tokens"), "--stream-window-kib", str(window)
            )
        tls = {"channel_credentials": grpc.ssl_channel_credentials(pki["ca"].read_bytes()), "token": token}
        shm = "ours-shm-durable (unix socket + shared memory, WAL fsync ack)"
        sides: list[tuple[str, ServeProcess, str, dict[str, Any]]] = [
            ("ours-grpc-durable (WAL fsync ack), plaintext, no auth", plain, plain.address, {}),
            ("ours-grpc-durable (WAL fsync ack), TLS + bearer token", secure, secure.address, tls),
            ("ours-grpc-durable (WAL fsync ack), plaintext loopback + bearer token", tokens, tokens.address,
             {"token": token}),
            (f"{shm}, no auth (the socket's permissions)", unix_plain, unix_plain.unix_address, {}),
            (f"{shm}, uid: rule (peer token)", unix_uid, unix_uid.unix_address, {}),
            (f"{shm}, bearer token", unix_bearer, unix_bearer.unix_address, {"token": token}),
        ]  # fmt: skip
        if window:
            sides += [
                (f"{sides[0][0]}, {window} KiB window", plain_w, plain_w.address, {}),
                (f"{sides[1][0]}, {window} KiB window", secure_w, secure_w.address, tls),
            ]  # fmt: skip
        ratios: dict[str, list[float]] = {}
        raws = [("raw-grpc, plaintext", RawGrpc()), ("raw-grpc, TLS", RawGrpc(tls_dir=d / "pki"))]
        n_rec = ns.recorders
        per_rec = max(1, n_fwd // n_rec)  # forwards per recorder process: the same bytes in all
        groups: list[tuple[str, ServeProcess, dict[str, Any], RecorderProcesses]] = []
        try:
            for i, (_name, _sp, address, creds) in enumerate(sides):  # warm-up: connection, run, the heap
                run_recorder(address, n_fwd, f"warm-{i}", outputs, **creds)
                settle(address, **creds)
            os.sync()
            if n_rec > 1:  # n_rec engine processes' recorders at once, each on its own connection
                for (name, sp, _address, creds), ca in ((sides[0], None), (sides[1], pki["ca"])):
                    group = RecorderProcesses(n_rec, sp.address, f"k{len(creds)}", ca, creds.get("token"))
                    name = name.replace("ours-grpc-durable", f"ours, {n_rec} recorder processes")
                    groups.append((name, sp, creds, group))
            pairs = [  # (check, numerator, denominator, target: None for information only)
                ("TLS + token / plaintext, durable TCP ingest", sides[1][0], sides[0][0], 0.9),
                ("token only (loopback) / plaintext, durable TCP ingest", sides[2][0], sides[0][0], 0.9),
                ("raw grpcio: TLS / plaintext (the stack's own TLS cost)", raws[1][0], raws[0][0], None),
                ("uid: rule (peer token) / no auth, unix socket + shm durable ingest", sides[4][0], sides[3][0],
                 UNCHANGED),
                ("bearer token / no auth, unix socket + shm durable ingest", sides[5][0], sides[3][0], UNCHANGED),
            ]  # fmt: skip
            if groups:
                pairs.append((f"TLS + token / plaintext, {n_rec} recorder processes", groups[1][0], groups[0][0], 0.9))
            if window:
                pairs += [
                    (f"TLS + token / plaintext, both {window} KiB window", sides[7][0], sides[6][0], None),
                    (f"TLS + token, {window} KiB window / plaintext, default", sides[7][0], sides[0][0], None),
                    (f"TLS + token: {window} KiB window / default", sides[7][0], sides[1][0], None),
                    (f"plaintext: {window} KiB window / default", sides[6][0], sides[0][0], None),
                ]
            for r in range(ns.repeat):
                rates = {}
                order = list(enumerate(sides))
                for i, (name, sp, address, creds) in order if r % 2 == 0 else order[::-1]:
                    assert sp.proc is not None
                    cpu = CpuMeter(sp.proc.pid)
                    rates[name] = run_recorder(address, n_fwd, f"a{r}-s{i}", outputs, cpu, **creds)[0]
                    settle(address, **creds)
                    os.sync()  # this write's shards and WAL on disk now, not in the next measurement's fsyncs
                    samples.setdefault(name, []).append(rates[name])
                    cpus.setdefault(name, []).append((cpu.client, cpu.server))
                for name, raw in raws if r % 2 == 0 else raws[::-1]:
                    rates[name] = raw(total)
                    samples.setdefault(name, []).append(rates[name])
                    cpus.setdefault(name, []).append((raw.cpu.client, raw.cpu.server))
                for name, sp, creds, group in groups if r % 2 == 0 else groups[::-1]:
                    assert sp.proc is not None
                    cpu = CpuMeter(sp.proc.pid)  # the client column: this process only, not the recorders'
                    with cpu:
                        rates[name] = group(per_rec)
                    settle(sp.address, **creds)
                    os.sync()
                    samples.setdefault(name, []).append(rates[name])
                    cpus.setdefault(name, []).append((cpu.client, cpu.server))
                for check, a, b, _target in pairs:
                    ratios.setdefault(check, []).append(rates[a] / rates[b])
                line = " ".join(f"#{i}:{rates[name] / 1e9:.3f}" for i, name in enumerate(samples, 1))
                print(f"round {r + 1}/{ns.repeat}, GB/s by the table's #: {line}", file=sys.stderr)
        finally:
            for sp in servers:
                sp.kill()
            for _, raw in raws:
                raw.close()
            for *_, group in groups:
                group.close()
    mib = n_fwd * fwd_bytes() >> 20
    rows: list[dict[str, Any]] = [
        {"#": n, "provider": k, "GBps": statistics.median(v) / 1e9, "min_GBps": min(v) / 1e9,
         "max_GBps": max(v) / 1e9, "n": len(v), "MiB": mib, "client_cpu_s": statistics.median(c for c, _ in cpus[k]),
         "server_cpu_s": statistics.median(s for _, s in cpus[k])}
        for n, (k, v) in enumerate(samples.items(), 1)
    ]  # fmt: skip
    checks = []
    targets = {check: target for check, *_, target in pairs}
    for k, v in ratios.items():  # TCP: at most 10% slower; the unix socket: unchanged, within 5%
        target = targets[k]
        met = "n/a" if target is None else "yes" if statistics.median(v) >= target else "NO"
        checks.append(dict(check=k, median_ratio=statistics.median(v), min_ratio=min(v), max_ratio=max(v),
                           target=target, met=met))  # fmt: skip
    m = machine()
    print(f"# bench_ingest --only auth on {m.get('cpu')} ({m.get('cores')} cores), {mib} MiB per measurement, "
          f"{ns.repeat} rounds (order alternating); load average at the end {os.getloadavg()[0]:.1f}")  # fmt: skip
    if n_rec > 1:
        print(
            f"# {n_rec} recorder processes: {per_rec * fwd_bytes() >> 20} MiB each; their client_cpu_s is the "
            "bench process's only"
        )
    print_table(rows, ["#", "provider", "GBps", "min_GBps", "max_GBps", "n", "MiB", "client_cpu_s", "server_cpu_s"])
    print()
    print_table(checks, ["check", "median_ratio", "min_ratio", "max_ratio", "target", "met"])
    if not ns.no_save:
        print(f"\nappended to {append_results('bench_ingest', [*rows, *checks])}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=192, help="record bytes per measured ingest")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (ratios per repetition)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--only", choices=("all", "ingest", "read", "decode", "auth"), default="all",
                    help="ingest: the ingest providers; read: ingest untimed into one durable sidecar, then time "
                    "the reads; decode: the decode-step caller time; auth: durable TCP ingest without and with "
                    "TLS + tokens (default: ingest and read)")  # fmt: skip
    ap.add_argument("--recorders", type=int, default=1,
                    help="--only auth: also measure this many recorder processes at once (each on its own "
                    "connection, as tensor-parallel engine processes beside one sidecar), plaintext vs TLS + token, "
                    "the same bytes in all")  # fmt: skip
    ap.add_argument("--compare-window", type=int, default=0, metavar="KIB",
                    help="--only auth: also the plaintext and the TLS + token TCP sidecars with this "
                    "--stream-window-kib in the same rounds, and what it gains over the default (gRPC's 64 KiB)",
                    )  # fmt: skip
    ap.add_argument("--decode", action="store_true", help="alias of --only decode")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per measurement (--decode)")
    ap.add_argument("--step-ms", type=float, default=25.0, help="sleep between decode steps (--decode)")
    ns = ap.parse_args()
    if ns.decode or ns.only == "decode":
        return bench_decode(ns)
    if ns.only == "auth":
        return bench_auth(ns)
    ingest, read = ns.only in ("all", "ingest"), ns.only in ("all", "read")
    from tracestore.server.testing import ServeProcess

    total = ns.mib << 20
    n_fwd = max(1, total // fwd_bytes())
    outputs = forward_outputs()
    chunks = [
        RecordChunk(SPEC.run, 0, f"f{f}-{k}", site, 0, TOKENS, out.codes[k * TOKENS : (k + 1) * TOKENS],
                    out.scales[k * TOKENS : (k + 1) * TOKENS], out.global_scale)
        for f in range(n_fwd) for site, out in outputs.items() for k in range(TRAJ_PER_FWD)
    ]  # fmt: skip
    samples: dict[str, list[float]] = {}
    cpus: dict[str, list[tuple[float, float]]] = {}  # (client, server) CPU seconds per measurement
    ratios: dict[str, list[float]] = {}

    def keep(name: str, value: float, cpu: CpuMeter | None = None) -> float:
        samples.setdefault(name, []).append(value)
        if cpu is not None:
            cpus.setdefault(name, []).append((cpu.client, cpu.server))
        return value

    quiet = ["--metrics-port", "off"]
    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=os.environ.get("BENCH_DIR")) as tmp:
        d = Path(tmp)
        raw_grpc, flight = (RawGrpc(), Flight()) if ingest else (None, None)
        (d / "floor").mkdir()
        floor = RawGrpc(d / "floor") if ingest else None
        compiled: tuple[CompiledSink, CompiledSink] | None = None
        if ingest:
            binary, why = compiled_sink(d)
            if binary is None:
                print(f"compiled sinks left out: {why}", file=sys.stderr)
            else:
                (d / "cfloor").mkdir()
                compiled = (CompiledSink(binary), CompiledSink(binary, d / "cfloor"))
        durable = ServeProcess(d / "durable", flags=quiet).start()
        servers = [durable]
        if ingest:
            commit = ServeProcess(d / "commit", wal=False, flags=[*quiet, "--flush-interval", "0.05"]).start()
            servers.append(commit)

        def memory_sidecars(r: int) -> tuple[ServeProcess, ServeProcess]:
            """Fresh memory:// sidecars for repetition ``r`` (the last ones killed), each warmed up
            untimed on both transports. A memory:// store keeps every shard in the sidecar's RAM:
            in a standalone loop of alternating pairs, after ~14 streams of 192 MiB one sidecar
            held ~2.7 GB and its TCP streams slowed from ~0.6 to 0.2-0.4 GB/s (server CPU 0.3 ->
            0.8-1.0 s each) while its shared-memory streams did not. (Inside this bench the TCP
            side stays slower than alone even so: see the closing notes.)"""
            for sp in servers[2:]:
                sp.kill()
            del servers[2:]
            # the default configuration with memory:// storage: WAL in the bench directory, acks at its fsync
            wm = ServeProcess(d / f"wm{r}", storage=f"memory://bench-wm{r}-{os.getpid()}", unix_socket=True,
                              flags=quiet).start()  # fmt: skip
            mem = ServeProcess(d / f"mem{r}", storage=f"memory://bench{r}-{os.getpid()}", wal=False,
                               unix_socket=True, flags=[*quiet, "--flush-interval", "0.05"]).start()  # fmt: skip
            servers.extend((wm, mem))
            for sp in (wm, mem):
                for address in (sp.address, sp.unix_address):
                    # full size: the sidecar's heap reaches the high-water mark of a timed stream (fresh
                    # pages fault in at a high price on this VM)
                    run_recorder(address, n_fwd, f"warm{r}-{len(address)}", outputs)
                    settle(sp.address)
            return wm, mem

        try:
            for r in range(ns.repeat):

                def ours(
                    sp: ServeProcess, name: str, address: str, tag: str, r: int = r, settle_at: str | None = None
                ) -> float:
                    assert sp.proc is not None
                    cpu = CpuMeter(sp.proc.pid)
                    value = keep(name, run_recorder(address, n_fwd, f"{tag}{r}", outputs, cpu)[0], cpu)
                    settle(settle_at or address)
                    return value

                before = shard_files(durable.storage)
                if not ingest:  # --only read: the durable sidecar's shards, ingested untimed
                    run_recorder(durable.address, n_fwd, f"d{r}", outputs)
                    settle(durable.address)
                else:
                    assert raw_grpc is not None and flight is not None
                    wm, mem = memory_sidecars(r)
                    raw = keep("raw-grpc", raw_grpc(total), raw_grpc.cpu)
                    assert floor is not None
                    fl_durable = keep("durable floor (raw grpcio + CRC + copy + O_DIRECT WAL + fsync)", floor(total),
                                      floor.cpu)  # fmt: skip
                    c_floor = None
                    if compiled is not None:
                        count, durable_c = compiled
                        ver = count.version
                        keep(f"raw-grpc, compiled sink (gRPC C++ {ver}, counts only)", count(total), count.cpu)
                        c_floor = keep(f"durable floor, compiled (gRPC C++ {ver}, ISA-L CRC + copy + O_DIRECT + fsync)",
                                       durable_c(total), durable_c.cpu)  # fmt: skip
                    # the disk's ceiling: the better of page-cache and O_DIRECT writes (+ fdatasync)
                    disk = max(keep("disk write+fsync (page cache)", bench_disk(total, d)),
                               keep("disk write+fsync (O_DIRECT)", bench_disk(total, d, direct=True)))  # fmt: skip
                    wal = ours(durable, "ours-grpc-durable (WAL fsync ack)", durable.address, "d")
                    com = ours(commit, "ours-grpc-durable (shard-commit ack)", commit.address, "c")
                    g = ours(mem, "ours-grpc memory:// (commit ack)", mem.address, "g")
                    sh = ours(mem, "ours-shm memory:// (commit ack)", mem.unix_address, "s", settle_at=mem.address)
                    # the default configuration (WAL acks) with memory:// storage: PAIRS alternating
                    # pairs per repetition (its ratio's samples), as single gRPC runs here ranged 0.19-0.72
                    pair = [("grpc", wm.address), ("shm", wm.unix_address)]
                    for k in range(PAIRS):
                        wal_rates = {}
                        for how, addr in pair if (r * PAIRS + k) % 2 == 0 else pair[::-1]:
                            wal_rates[how] = ours(wm, f"ours-{how} memory://, WAL ack (default config)", addr,
                                                  f"w{how}{k}-", settle_at=wm.address)  # fmt: skip
                        ratios.setdefault("shm / gRPC, memory:// WAL acks (default config)", []).append(
                            wal_rates["shm"] / wal_rates["grpc"]
                        )
                    fl = keep("flight-do_put", flight(chunks), flight.cpu)
                    for name, v in (
                        ("durable gRPC (WAL) / min(raw gRPC, disk)", wal / min(raw, disk)),
                        ("durable gRPC (commit) / min(raw gRPC, disk)", com / min(raw, disk)),
                        ("shm / gRPC, memory:// commit acks", sh / g),
                        ("durable gRPC (WAL) / Flight do_put", wal / fl),
                        ("durable floor / min(raw gRPC, disk)", fl_durable / min(raw, disk)),
                        ("durable gRPC (WAL) / durable floor", wal / fl_durable),
                    ):
                        ratios.setdefault(name, []).append(v)
                    if c_floor is not None:
                        ratios.setdefault("compiled durable floor / min(raw gRPC, disk)", []).append(
                            c_floor / min(raw, disk)
                        )
                if read:
                    rates = bench_read(durable.storage, f"d{r}", before)
                    rr, ro = rates["raw"], rates["ours"]
                    keep("raw-parquet-read (same shards)", rr)
                    keep("ours-read (storage URL)", ro)
                    ratios.setdefault("ours read / raw Parquet read", []).append(ro / rr)
                    for kind in sorted({1, CHILDREN}):
                        rc, rk = rates[f"process={kind}"], rates[f"raw beside process={kind}"]
                        keep(f"raw-parquet-read (same shards; phase of process={kind})", rk)
                        keep(f"ours-read (storage URL, {kind} child process{'es' if kind > 1 else ''}: "
                             f"process={kind})", rc)  # fmt: skip
                        ratios.setdefault(f"ours read with process={kind} / raw Parquet read", []).append(rc / rk)
                    busy = bench_read_beside_busy_thread(durable.storage, f"d{r}", before)
                    for name, v in busy.items():
                        keep(name, v)
                    names = list(busy)
                    ratios.setdefault("beside a busy thread: ours (GIL kept) / raw Parquet", []).append(
                        busy[names[1]] / busy[names[0]]
                    )
                    ratios.setdefault("beside a busy thread: GIL kept / GIL given up", []).append(
                        busy[names[1]] / busy[names[2]]
                    )
                    ratios.setdefault("beside a busy thread: ours in a child process / raw Parquet", []).append(
                        busy[names[3]] / busy[names[0]]
                    )
                    ratios.setdefault("beside a busy thread: ours in a child process / GIL kept", []).append(
                        busy[names[3]] / busy[names[1]]
                    )
                print(f"repetition {r + 1}/{ns.repeat} done", file=sys.stderr)
        finally:
            for sp in servers:
                sp.kill()
            if raw_grpc is not None and flight is not None:
                raw_grpc.close()
                if floor is not None:
                    floor.close()
                for sink in compiled or ():
                    sink.close()
                flight.close()

    mib = n_fwd * fwd_bytes() >> 20
    cores = os.cpu_count() or 1

    def cpu_cols(k: str) -> dict[str, float]:
        if k not in cpus:
            return {}
        c = statistics.median(x[0] for x in cpus[k])
        s = statistics.median(x[1] for x in cpus[k])
        raw_bytes = k.startswith(("raw-grpc", "durable floor"))  # pre-serialized MSG-byte messages
        nbytes = MSG * max(1, total // MSG) if raw_bytes else n_fwd * fwd_bytes()
        return dict(client_cpu_s=c, server_cpu_s=s, cpu_bound_GBps=nbytes / ((c + s) / cores) / 1e9)

    rows = [
        dict(provider=k, GBps=statistics.median(v) / 1e9, min_GBps=min(v) / 1e9, max_GBps=max(v) / 1e9, n=len(v),
             MiB=mib, **cpu_cols(k))
        for k, v in samples.items()
    ]  # fmt: skip
    targets = {
        "durable gRPC (WAL) / min(raw gRPC, disk)": 0.8,
        "durable gRPC (commit) / min(raw gRPC, disk)": 0.8,
        "shm / gRPC, memory:// commit acks": 2.0,
        "shm / gRPC, memory:// WAL acks (default config)": 2.0,
        "ours read / raw Parquet read": 0.8,
    }
    checks = []
    for check, values in ratios.items():
        t = targets.get(check)
        med = statistics.median(values)
        checks.append(dict(check=check, median_ratio=med, min_ratio=min(values), max_ratio=max(values), target=t,
                           met="n/a" if t is None else ("yes" if med >= t else "NO")))  # fmt: skip
    m = machine()
    print(f"# bench_ingest on {m.get('cpu')} ({m.get('cores')} cores), {mib} MiB per measurement, "
          f"{ns.repeat} interleaved repetitions; load average at the end {os.getloadavg()[0]:.1f}")  # fmt: skip
    print_table(rows, ["provider", "GBps", "min_GBps", "max_GBps", "n", "MiB", "client_cpu_s", "server_cpu_s",
                       "cpu_bound_GBps"])  # fmt: skip
    print(
        f"(client_cpu_s / server_cpu_s: CPU seconds of the sending process and of the server process during one "
        f"measurement, medians; cpu_bound_GBps: the rate if both were perfectly spread over the {cores} cores, "
        f"bytes / ((client + server) / {cores}), an upper bound for that pair of processes on this box)"
    )
    print()
    print_table(checks, ["check", "median_ratio", "min_ratio", "max_ratio", "target", "met"])
    if not ns.no_save:
        path = append_results("bench_ingest", rows + checks)
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
