"""`tracestore serve`: every flag has a TRACESTORE_ twin; with no configuration it serves the defaults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tracestore.server.cli import config_from_args

from tracestore.cli import build_parser


def test_help_documents_env_twins() -> None:
    out = subprocess.run([sys.executable, "-m", "tracestore.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    assert "TRACESTORE_" in out
    for flag in ("--storage", "--port", "--unix-socket", "--metrics-port", "--wal-dir", "--memory-budget-mib"):
        assert flag in out


def test_defaults_and_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TRACESTORE_"):
            monkeypatch.delenv(k)
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert (cfg.storage, cfg.host, cfg.port, cfg.metrics_port) == ("file://./tracestore-data", "127.0.0.1", 7433, 9433)
    monkeypatch.setenv("TRACESTORE_PORT", "7999")
    monkeypatch.setenv("TRACESTORE_STORAGE", "memory://x")
    monkeypatch.setenv("TRACESTORE_WAL_DIR", "off")
    monkeypatch.setenv("TRACESTORE_MEMORY_BUDGET_MIB", "256")
    monkeypatch.setenv("TRACESTORE_METRICS_PORT", "off")
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    got = (cfg.port, cfg.storage, cfg.wal_dir, cfg.memory_budget_bytes, cfg.metrics_port)
    assert got == (7999, "memory://x", None, 256 << 20, None)
    cfg = config_from_args(build_parser().parse_args(["serve", "--port", "0"]))  # the flag beats the variable
    assert cfg.port == 0


def test_limit_flags_and_their_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's limits are flags with TRACESTORE_ twins, and out-of-range values are refused by name."""
    from tracestore.server.config import ServerConfig

    from tracestore.errors import ConfigError

    for k in list(os.environ):
        if k.startswith("TRACESTORE_"):
            monkeypatch.delenv(k)
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    got = (cfg.max_streams, cfg.workers, cfg.max_read_bytes, cfg.max_writers, cfg.max_runs, cfg.storage_unhealthy_s,
           cfg.wal_retry_s)  # fmt: skip
    assert got == (256, 64, 256 << 20, 1024, 256, 300.0, 1.0)
    monkeypatch.setenv("TRACESTORE_MAX_WRITERS", "7")
    monkeypatch.setenv("TRACESTORE_WAL_RETRY", "0.5")
    args = ["serve", "--max-streams", "100", "--workers", "8", "--max-read-mib", "16", "--max-runs", "3",
            "--storage-unhealthy", "2.5"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(args))
    got = (cfg.max_streams, cfg.workers, cfg.max_read_bytes, cfg.max_writers, cfg.max_runs, cfg.storage_unhealthy_s,
           cfg.wal_retry_s)  # fmt: skip
    assert got == (100, 8, 16 << 20, 7, 3, 2.5, 0.5)
    assert cfg.rpc_threads == 108 and cfg.max_concurrent_rpcs > cfg.rpc_threads
    bad = {"max_writers": 0, "max_runs": -1, "max_streams": 0, "workers": 4, "storage_unhealthy_s": 0.0,
           "wal_retry_s": float("nan"), "max_read_bytes": 10, "max_writers_per_identity": 0,
           "max_runs_per_identity": True}  # fmt: skip
    for name, value in bad.items():
        with pytest.raises(ConfigError, match=name):
            ServerConfig(**{name: value})  # type: ignore[arg-type]
    # one identity's share: a quarter of the limit unless set, and never more than the limit
    assert (cfg.writers_per_identity, cfg.runs_per_identity) == (1, 1)  # of 7 writers, 3 runs
    assert (ServerConfig().writers_per_identity, ServerConfig().runs_per_identity) == (256, 64)
    args = ["serve", "--max-writers-per-identity", "5", "--max-runs-per-identity", "2", "--max-runs", "3"]
    cfg = config_from_args(build_parser().parse_args(args))
    assert (cfg.writers_per_identity, cfg.runs_per_identity) == (5, 2)
    with pytest.raises(ConfigError, match=r"max_runs_per_identity \(4\) must be at most max_runs \(3\)"):
        ServerConfig(max_runs=3, max_runs_per_identity=4)
    # open Write streams: a quarter, but at least one tensor-parallel engine's 8 recorders (unix-socket
    # callers without a token are one identity), never more than max_streams
    assert ServerConfig().streams_per_identity == 64
    assert [ServerConfig(max_streams=n).streams_per_identity for n in (100, 16, 4, 1)] == [25, 8, 4, 1]
    args = ["serve", "--max-streams", "10", "--max-streams-per-identity", "3"]
    assert config_from_args(build_parser().parse_args(args)).streams_per_identity == 3
    for value in (0, True, 2.5):
        with pytest.raises(ConfigError, match="max_streams_per_identity must be an integer >= 1"):
            ServerConfig(max_streams_per_identity=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"max_streams_per_identity \(11\) must be at most max_streams \(10\)"):
        ServerConfig(max_streams=10, max_streams_per_identity=11)
    # only as many streams wait for a message as half the budget covers at max_message_bytes each,
    # besides the two copies of one that gRPC makes
    assert ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=2 << 20).reading_streams == 15
    assert ServerConfig(memory_budget_bytes=96 << 20, max_message_bytes=32 << 20).reading_streams == 1
    with pytest.raises(ConfigError, match="at most a third"):  # (room for gRPC's two copies too)
        ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=22 << 20)
    # reads have their own budget (a quarter of the memory budget unless set) and the largest read
    # fits it, the slices being sent included
    assert ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=4 << 20).read_budget == 16 << 20
    assert ServerConfig().read_limit_bytes == 244 << 20  # 256 MiB less 3 slices of 4 MiB
    cfg = ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=4 << 20, read_budget_bytes=64 << 20)
    assert cfg.read_limit_bytes == 52 << 20
    for budget, reads in ((64 << 20, None), (4 << 20, None), (1 << 30, 1 << 20), (256 << 20, 300 << 20)):
        cfg = ServerConfig(memory_budget_bytes=budget, max_message_bytes=1 << 20, read_budget_bytes=reads)
        assert 0 < cfg.read_reservation(cfg.read_limit_bytes) <= cfg.read_budget, (budget, reads)
    args = ["serve", "--read-budget-mib", "48", "--read-stall-timeout", "2.5"]
    cfg = config_from_args(build_parser().parse_args(args))
    assert (cfg.read_budget, cfg.read_stall_s) == (48 << 20, 2.5)
    assert config_from_args(build_parser().parse_args(["serve"])).read_stall_s == 10.0
    for name, value in (("read_budget_bytes", 1000), ("read_budget_bytes", True), ("read_stall_s", 0.0)):
        with pytest.raises(ConfigError, match=name):
            ServerConfig(**{name: value})  # type: ignore[arg-type]


def test_stream_window_flag_default_and_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Write stream's HTTP/2 receive window is a setting (gRPC's lookahead, BDP probing off):
    gRPC's own 64 KiB unless given (no lookahead option then), and an open stream holds its window
    plus its buffers against the memory budget; a window over a quarter of the budget is refused."""
    import threading

    from tracestore.server.config import ServerConfig
    from tracestore.server.engine.memory import STREAM_OVERHEAD_BYTES, MemoryBudget
    from tracestore.server.metrics import Metrics

    from tracestore.errors import ConfigError

    for k in list(os.environ):
        if k.startswith("TRACESTORE_"):
            monkeypatch.delenv(k)
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert cfg.stream_window_bytes is None and cfg.stream_window == 64 << 10
    opts = dict(cfg.grpc_options())
    assert "grpc.http2.lookahead_bytes" not in opts and opts["grpc.http2.bdp_probe"] == 0
    budget = MemoryBudget(cfg, Metrics(), threading.Condition(), press=lambda: None)
    assert budget.reserve_stream() == (64 << 10) + STREAM_OVERHEAD_BYTES == 192 << 10  # as before the setting
    monkeypatch.setenv("TRACESTORE_STREAM_WINDOW_KIB", "256")
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert cfg.stream_window == 256 << 10 == dict(cfg.grpc_options())["grpc.http2.lookahead_bytes"]
    cfg = config_from_args(build_parser().parse_args(["serve", "--stream-window-kib", "4096"]))
    assert cfg.stream_window == 4 << 20 == dict(cfg.grpc_options())["grpc.http2.lookahead_bytes"]
    budget = MemoryBudget(cfg, Metrics(), threading.Condition(), press=lambda: None)
    assert budget.reserve_stream() == (4 << 20) + STREAM_OVERHEAD_BYTES
    for bad in ("32", "65537", "x"):
        with pytest.raises(ConfigError, match=r"--stream-window-kib=.*expected an integer in 64\.\.65536"):
            config_from_args(build_parser().parse_args(["serve", "--stream-window-kib", bad]))
    for value in (1024, 128 << 20, True, 1.5):
        with pytest.raises(ConfigError, match="stream_window_bytes must be an integer"):
            ServerConfig(stream_window_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at most a quarter of memory_budget_bytes"):
        ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=1 << 20, stream_window_bytes=32 << 20)
    assert ServerConfig(memory_budget_bytes=64 << 20, max_message_bytes=1 << 20, stream_window_bytes=16 << 20)
    # the refusal of one stream too many says what to change, the window only where it was set
    from tracestore.errors import LimitError

    for window, advice in ((None, False), (1 << 20, True)):
        small = ServerConfig(memory_budget_bytes=4 << 20, max_message_bytes=1 << 20, stream_window_bytes=window)
        budget = MemoryBudget(small, Metrics(), threading.Condition(), press=lambda: None)
        with pytest.raises(LimitError, match="raise --memory-budget-mib") as refused:
            for _ in range(100):
                budget.reserve_stream()
        assert ("--stream-window-kib" in str(refused.value)) is advice, refused.value


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_serves_with_no_configuration(tmp_path: Path) -> None:
    if not (_free(7433) and _free(9433)):
        pytest.skip("the default ports 7433/9433 are taken on this machine by another process")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    env["TRACESTORE_READY_FILE"] = str(tmp_path / "ready.json")  # only to learn when it is up
    proc = subprocess.Popen([sys.executable, "-m", "tracestore.cli", "serve"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        info = json.loads((tmp_path / "ready.json").read_text())
        assert (info["port"], info["metrics_port"]) == (7433, 9433)
        with grpc.insecure_channel("127.0.0.1:7433") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert (tmp_path / "tracestore-wal").is_dir()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_second_server_on_the_same_port_or_socket_is_refused(tmp_path: Path) -> None:
    import socket

    from tracestore.server.config import ServerConfig
    from tracestore.server.rpc.service import Sidecar

    from tracestore.errors import ConfigError

    sock = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock)  # a stale socket left by a crash (bound, nobody listens) is taken over
    stale.close()
    a = Sidecar(ServerConfig(storage="memory://dup", wal_dir=None, port=0, metrics_port=None, unix_socket=sock)).start()
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            Sidecar(ServerConfig(storage="memory://dup", wal_dir=None, port=a.port, metrics_port=None)).start()
        with pytest.raises(ConfigError, match="in use by a running server"):
            Sidecar(ServerConfig(storage="memory://dup", wal_dir=None, port=0, metrics_port=None,
                                 unix_socket=sock)).start()  # fmt: skip
    finally:
        a.stop(1)


_ARENA_PROBE = """
import ctypes, ctypes.util, os, sys, tempfile, threading
from tracestore.server.cli import tune_malloc
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]

def heaps():  # glibc's malloc_info lists one <heap nr=...> per arena
    fd, path = tempfile.mkstemp()
    os.close(fd)
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    n = open(path).read().count("<heap nr=")
    os.unlink(path)
    return n

if sys.argv[1] == "tuned":
    assert tune_malloc()
before = heaps()
go = threading.Barrier(8)

def work():  # 8 threads contending for malloc at once, as a sidecar's stream threads do
    go.wait()
    for _ in range(2000):
        blocks = [libc.malloc(256 << 10) for _ in range(4)]
        for b in blocks:
            libc.free(b)

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(before, heaps())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc arenas")
def test_tune_malloc_stops_new_arenas() -> None:
    """The sidecar's allocator settings: threads started after tune_malloc() create no malloc arenas
    of their own (each fresh arena faulted in its pages again: ~19k faults per shm stream)."""

    def probe(mode: str) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        out = subprocess.run([sys.executable, "-c", _ARENA_PROBE, mode], capture_output=True, text=True, timeout=120,
                             env=env, check=True).stdout.split()  # fmt: skip
        return int(out[0]), int(out[1])

    before, after = probe("plain")
    if after <= before:
        pytest.skip(f"glibc created no arena under contention here ({before} -> {after}); nothing to compare")
    before, after = probe("tuned")
    assert after == before, f"threads created {after - before} new malloc arenas after tune_malloc()"


_HEAP_PROBE = """
import ctypes, ctypes.util
from tracestore.server.cli import tune_malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
tune_malloc()
import pyarrow as pa
small, large = bytearray(24 << 20), bytearray(40 << 20)
print(pa.default_memory_pool().backend_name, libc.mallinfo2().hblkhd >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_malloc_maps_blocks_past_32_mib_and_gives_arrow_the_same_heap() -> None:
    """Blocks past 32 MiB (messages near --max-message-mib and gRPC's copies of them) are mapped
    and unmapped, not left as holes in the heap that the next ones did not fit (57 MiB messages:
    the heap grew past what the budget counts); and Arrow allocates from the same heap, so that
    encoding a shard reuses what gRPC's copies freed (with mimalloc each allocator kept its own
    high-water mark). Before: mmap only past 256 MiB, Arrow on mimalloc."""
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()  # fmt: skip
    assert out[0] == "system"
    assert int(out[1]) == 40  # the 40 MiB block is mapped, the 24 MiB one is in the heap
