"""Ingest and read throughput of the sidecar against baselines measured in the same run (CPU).

Providers, all moving the same record bytes (paper configuration: width 2048, NVFP4, b = 1, so
384 B per token per site; prefill forwards of 8 trajectories x 512 tokens x 4 sites):

- ``raw-grpc``: grpcio client-streaming of pre-serialized 4 MiB messages to a server process that
  only counts them (the transport ceiling);
- ``disk``: write + one fdatasync of the same bytes in the WAL directory (the durability ceiling);
- ``ours-grpc-durable``: RolloutRecorder -> TCP -> `tracestore serve` (WAL fsync acks, file://);
- ``ours-grpc-memory`` / ``ours-shm-memory``: the same with ``memory://`` storage and acks on
  shard commit, over TCP with inline bytes vs the unix socket with shared-memory descriptors;
- ``flight-do_put``: Arrow Flight ``do_put`` of the same chunks (Arrow table) to a server process
  that reads every batch (the peer a user would otherwise pick);
- ``raw-parquet-read`` vs ``ours-read``: reading every stored record back (GuidanceReader on the
  storage URL, plan-aligned and checksum-verified) vs ``pyarrow.parquet.read_table`` of the shards.

Run: ``python bench/bench_ingest.py [--mib 192] [--repeat 3]``; prints a table, appends to
``bench/results/bench_ingest.jsonl``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
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


def _raw_grpc_server(port_q: Any, stop: Any) -> None:
    from concurrent import futures

    import grpc

    def sink(it: Any, ctx: Any) -> bytes:
        n = 0
        for m in it:
            n += len(m)
        return str(n).encode()

    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Put": grpc.stream_unary_rpc_method_handler(sink)}),)
    )
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(1)


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


def _spawn(target: Any) -> tuple[Any, Any, int]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=target, args=(q, stop), daemon=True)
    p.start()
    return p, stop, int(q.get(timeout=60))


def bench_raw_grpc(total: int) -> float:
    import grpc

    p, stop, port = _spawn(_raw_grpc_server)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
        put = ch.stream_unary("/bench.Sink/Put")
        msg = os.urandom(MSG)
        n = max(1, total // MSG)
        put(iter([msg]))  # warm up the connection
        t0 = time.perf_counter()
        got = int(put(iter([msg] * n)))
        dt = time.perf_counter() - t0
        assert got == n * MSG
        ch.close()
        return n * MSG / dt
    finally:
        stop.set()
        p.join(10)


def bench_disk(total: int, directory: Path) -> float:
    buf = os.urandom(MSG)
    path = directory / "disk-probe.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(max(1, total // MSG)):
            os.write(fd, buf)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return max(1, total // MSG) * MSG / dt


def bench_flight(chunks: list[RecordChunk]) -> float:
    import pyarrow.flight as fl

    from tracestore.arrow import chunks_to_table

    p, stop, port = _spawn(_flight_server)
    try:
        client = fl.connect(f"grpc://127.0.0.1:{port}")
        nbytes = sum(c.nbytes for c in chunks)
        t0 = time.perf_counter()
        table = chunks_to_table(chunks)
        writer, _ = client.do_put(fl.FlightDescriptor.for_path("bench"), table.schema)
        writer.write_table(table, max_chunksize=max(1, MSG // (nbytes // max(len(chunks), 1) or 1)))
        writer.close()
        dt = time.perf_counter() - t0
        client.close()
        return nbytes / dt
    finally:
        stop.set()
        p.join(10)


# -- ours ------------------------------------------------------------------------------------------


def run_recorder(address: str, n_fwd: int, tag: str, outputs: dict[str, Any]) -> tuple[float, dict[str, int]]:
    from tracestore.client import RolloutRecorder

    rec = RolloutRecorder(address, SPEC, f"bench-{tag}", staging_bytes=256 << 20, batch_bytes=MSG)
    need = fwd_bytes() + 4096
    # warm-up forward (connection, run declaration)
    rec.record_forward([(f"{tag}-warm-{k}", 0, TOKENS) for k in range(TRAJ_PER_FWD)], outputs)
    if not rec.flush(120):
        raise RuntimeError(f"warm-up not acked: {rec.stats}")
    t0 = time.perf_counter()
    for f in range(n_fwd):
        while rec.pool.capacity - rec.pool.in_use < need:  # pace like an engine with a full ring would
            time.sleep(0.0005)
        ok = rec.record_forward([(f"{tag}-{f}-{k}", 0, TOKENS) for k in range(TRAJ_PER_FWD)], outputs)
        if not ok:
            raise RuntimeError(f"forward refused: {rec.stats}")
    if not rec.flush(600):
        raise RuntimeError(f"not acked: {rec.stats}")
    dt = time.perf_counter() - t0
    stats = dict(rec.stats)
    rec.close()
    if stats["unguided"]:
        raise RuntimeError(f"records dropped: {stats}")
    return n_fwd * fwd_bytes() / dt, stats


def bench_read(storage: str, tag: str, n_fwd: int) -> tuple[float, float, int]:
    import pyarrow.parquet as pq

    from tracestore.client import GuidanceReader

    root = Path(storage.removeprefix("file://"))
    files = sorted(root.rglob("*.parquet"))
    plan = [(f"{tag}-{f}-{k}", 0, TOKENS) for f in range(n_fwd) for k in range(TRAJ_PER_FWD)]
    nbytes = len(plan) * TOKENS * sum(s.code_bytes + s.scale_bytes for s in SPEC.sites)
    t0 = time.perf_counter()
    raw = sum(pq.read_table(f).nbytes for f in files)
    t_raw = time.perf_counter() - t0
    reader = GuidanceReader(storage, SPEC.run, prefetch=False)
    t0 = time.perf_counter()
    rows = reader.read_host(plan)
    t_ours = time.perf_counter() - t0
    reader.close()
    got = sum(r.codes.nbytes + r.scales.nbytes for r in rows.values())
    if got != nbytes or not all(r.valid.all() for r in rows.values()):
        raise RuntimeError(f"read back {got} of {nbytes} bytes")
    # raw reads every shard in full (all trajectories of every step); ours reads this plan's rows
    return raw / t_raw, nbytes / t_ours, raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=192, help="record bytes per measured ingest")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    ns = ap.parse_args()
    from tracestore.server.testing import ServeProcess

    total = ns.mib << 20
    n_fwd = max(1, total // fwd_bytes())
    outputs = forward_outputs()
    rows: list[dict[str, Any]] = []

    def add(provider: str, samples: list[float], extra: dict[str, Any] | None = None) -> float:
        med = statistics.median(samples)
        rows.append(
            dict(
                provider=provider,
                GBps=med / 1e9,
                min_GBps=min(samples) / 1e9,
                max_GBps=max(samples) / 1e9,
                n=len(samples),
                MiB=n_fwd * fwd_bytes() >> 20,
                **(extra or {}),
            )  # fmt: skip
        )
        return med

    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=os.environ.get("BENCH_DIR")) as tmp:
        d = Path(tmp)
        raw = add("raw-grpc", [bench_raw_grpc(total) for _ in range(ns.repeat)])
        disk = add("disk write+fsync", [bench_disk(total, d) for _ in range(ns.repeat)])
        durable_samples = []
        with ServeProcess(d / "durable", flags=["--metrics-port", "off"]) as sp:
            for r in range(ns.repeat):
                bps, stats = run_recorder(sp.address, n_fwd, f"d{r}", outputs)
                durable_samples.append(bps)
        durable = add("ours-grpc-durable (WAL fsync ack)", durable_samples)
        with ServeProcess(d / "commit", wal=False, flags=["--metrics-port", "off", "--flush-interval", "0.05",
                                                          "--shard-target-mib", "32"]) as sp2:  # fmt: skip
            commit = add(
                "ours-grpc-durable (shard-commit ack)",
                [run_recorder(sp2.address, n_fwd, f"c{r}", outputs)[0] for r in range(ns.repeat)],
            )
        read_raw, read_ours = [], []
        for r in range(ns.repeat):
            a, b, _ = bench_read(sp.storage, f"d{r}", n_fwd)
            read_raw.append(a)
            read_ours.append(b)
        rr = add("raw-parquet-read", read_raw)
        ro = add("ours-read (storage URL)", read_ours)
        mem = f"memory://bench-{os.getpid()}"
        with ServeProcess(d / "mem", storage=mem, wal=False, unix_socket=True,
                          flags=["--metrics-port", "off", "--flush-interval", "0.05"]) as sp:  # fmt: skip
            g = add(
                "ours-grpc-memory", [run_recorder(sp.address, n_fwd, f"g{r}", outputs)[0] for r in range(ns.repeat)]
            )
            s = add(
                "ours-shm-memory", [run_recorder(sp.unix_address, n_fwd, f"s{r}", outputs)[0] for r in range(ns.repeat)]
            )
        chunks = []
        for f in range(n_fwd):
            for site, out in outputs.items():
                for k in range(TRAJ_PER_FWD):
                    sl = slice(k * TOKENS, (k + 1) * TOKENS)
                    chunks.append(RecordChunk(SPEC.run, 0, f"f{f}-{k}", site, 0, TOKENS, out.codes[sl], out.scales[sl],
                                              out.global_scale))  # fmt: skip
        fl = add("flight-do_put", [bench_flight(chunks) for _ in range(ns.repeat)])

    ceiling = min(raw, disk)
    checks = [
        dict(check="durable gRPC (WAL) / min(raw gRPC, disk)", ratio=durable / ceiling, target=0.8),
        dict(check="durable gRPC (commit) / min(raw gRPC, disk)", ratio=commit / ceiling, target=0.8),
        dict(check="shm / gRPC (memory://)", ratio=s / g, target=2.0),
        dict(check="durable gRPC / Flight do_put", ratio=durable / fl, target=None),
        dict(check="ours read / raw Parquet read", ratio=ro / rr, target=0.8),
    ]
    for c in checks:
        c["pass"] = "n/a" if c["target"] is None else ("yes" if c["ratio"] >= c["target"] else "NO")
    m = machine()
    print(f"# bench_ingest on {m.get('cpu')} ({m.get('cores')} cores), {n_fwd * fwd_bytes() >> 20} MiB per run")
    print_table(rows, ["provider", "GBps", "min_GBps", "max_GBps", "n", "MiB"])
    print()
    print_table(checks, ["check", "ratio", "target", "pass"])
    if not ns.no_save:
        path = append_results("bench_ingest", rows + checks)
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
