"""``tracestore serve``: run the sidecar. Works with no configuration; every flag has a TRACESTORE_ twin."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from tracestore.cli import env_default

MiB = 1 << 20


def _opt_int(v: str) -> int | None:
    return None if str(v).lower() in ("", "none", "off", "-1") else int(v)


def _opt_str(v: str) -> str | None:
    return None if str(v).lower() in ("", "none", "off") else v


def _env_flag(v: str) -> bool:
    return str(v).lower() not in ("", "0", "false", "no", "off")


def storage_options_from(ns: argparse.Namespace) -> dict[str, Any] | None:
    """fsspec options from --storage-options-file, else --storage-options, else the environment
    (TRACESTORE_STORAGE_OPTIONS); errors never quote the text (it holds credentials)."""
    from tracestore.errors import ConfigError

    log = logging.getLogger("tracestore.server")
    text, where = None, ""
    if ns.storage_options_file and ns.storage_options:
        raise ConfigError("give --storage-options-file or --storage-options, not both")
    if ns.storage_options_file:
        where = f"--storage-options-file {ns.storage_options_file}"
        try:
            with open(ns.storage_options_file) as f:
                text = f.read()
                mode = os.fstat(f.fileno()).st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
        if mode & 0o077:
            log.warning("%s is readable by other users (mode %o); keep credentials in a 0600 file", where, mode & 0o777)
    elif ns.storage_options:
        where, text = "--storage-options", ns.storage_options
        log.warning(
            "--storage-options on the command line is visible to every local user in /proc/%d/cmdline; "
            "use --storage-options-file or TRACESTORE_STORAGE_OPTIONS for credentials",
            os.getpid(),
        )
    elif os.environ.get("TRACESTORE_STORAGE_OPTIONS"):
        where, text = "TRACESTORE_STORAGE_OPTIONS", os.environ["TRACESTORE_STORAGE_OPTIONS"]
    if not text or not text.strip():
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(options).__name__}")
    return options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the sidecar (gRPC ingest/read service, WAL, shard flusher, Prometheus metrics)",
        description="Run the tracestore sidecar. Every --flag can also be set as TRACESTORE_FLAG "
        "(e.g. TRACESTORE_STORAGE, TRACESTORE_PORT).",
    )
    e = env_default
    p.add_argument("--storage", default=e("--storage", "file://./tracestore-data"), help="fsspec URL of the store")
    p.add_argument(
        "--storage-options",
        default=None,
        help="JSON dict passed to fsspec. Visible to every local user in /proc/PID/cmdline: put credentials in "
        "--storage-options-file or TRACESTORE_STORAGE_OPTIONS instead",
    )
    p.add_argument(
        "--storage-options-file",
        type=_opt_str,
        default=e("--storage-options-file", None),
        help="file holding the JSON dict passed to fsspec (for credentials; keep it mode 0600)",
    )
    p.add_argument("--host", default=e("--host", "127.0.0.1"), help="gRPC bind address")
    p.add_argument("--port", type=int, default=int(e("--port", 7433)), help="gRPC TCP port (0: ephemeral)")
    p.add_argument("--unix-socket", type=_opt_str, default=e("--unix-socket", None), help="also listen on this UDS")
    p.add_argument("--tls-cert", type=_opt_str, default=e("--tls-cert", None), help="PEM certificate chain: TLS on TCP")
    p.add_argument("--tls-key", type=_opt_str, default=e("--tls-key", None), help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        type=_opt_str,
        default=e("--tls-client-ca", None),
        help="PEM CA bundle: TCP clients must present a certificate it signed (mutual TLS)",
    )
    p.add_argument(
        "--auth-tokens",
        type=_opt_str,
        default=e("--auth-tokens", None),
        help="token file, one 'sha256:<hex digest> <scope>[,<scope>...] [name]' per line (scopes write:<run glob>, "
        "read:<run glob>, admin); without it the sidecar serves loopback and the unix socket only",
    )
    p.add_argument(
        "--unix-needs-token",
        action="store_true",
        default=_env_flag(e("--unix-needs-token", "")),
        help="unix-socket callers need a token too (otherwise the socket file's permissions are the boundary)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=_env_flag(e("--insecure", "")),
        help="serve a non-loopback --host without TLS and tokens (e.g. behind a network policy)",
    )
    p.add_argument("--metrics-host", default=e("--metrics-host", "127.0.0.1"))
    p.add_argument("--metrics-port", type=_opt_int, default=e("--metrics-port", "9433"), help="'off' disables")
    p.add_argument(
        "--wal-dir",
        type=_opt_str,
        default=e("--wal-dir", "./tracestore-wal"),
        help="write-ahead log directory; 'off' acks only committed shards",
    )
    p.add_argument("--wal-segment-mib", type=int, default=int(e("--wal-segment-mib", 64)))
    p.add_argument("--memory-budget-mib", type=int, default=int(e("--memory-budget-mib", 1024)))
    p.add_argument("--shard-target-mib", type=int, default=int(e("--shard-target-mib", 128)))
    p.add_argument("--flush-interval", type=float, default=float(e("--flush-interval", 2.0)), help="seconds")
    p.add_argument("--backpressure-timeout", type=float, default=float(e("--backpressure-timeout", 5.0)))
    p.add_argument("--max-message-mib", type=int, default=int(e("--max-message-mib", 64)))
    p.add_argument(
        "--max-streams",
        type=int,
        default=int(e("--max-streams", 256)),
        help="open Write streams at most; one more is refused at once with RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=int(e("--workers", 64)),
        help="gRPC threads besides one per Write stream (health, Stat, Seal, Read); at least 8",
    )
    p.add_argument(
        "--max-read-mib",
        type=int,
        default=int(e("--max-read-mib", 256)),
        help="largest Read (plan rows x row bytes of the sites read), never more than the memory budget",
    )
    p.add_argument(
        "--max-writers",
        type=int,
        default=int(e("--max-writers", 1024)),
        help="writer sessions (run, writer id) one sidecar keeps; a new one beyond is refused",
    )
    p.add_argument(
        "--max-runs", type=int, default=int(e("--max-runs", 256)), help="runs one sidecar serves; more are refused"
    )
    p.add_argument(
        "--storage-unhealthy",
        type=float,
        default=float(e("--storage-unhealthy", 300.0)),
        help="seconds of storage refusing every commit before health reports NOT_SERVING",
    )
    p.add_argument(
        "--wal-retry",
        type=float,
        default=float(e("--wal-retry", 1.0)),
        help="seconds between attempts to recover a failed write-ahead log",
    )
    p.add_argument("--grace", type=float, default=float(e("--grace", 30.0)), help="seconds to drain on SIGTERM")
    p.add_argument("--storage-timeout", type=float, default=float(e("--storage-timeout", 60.0)))
    p.add_argument("--shm-dir", default=e("--shm-dir", "/dev/shm"), help="where writers' staging pools live")
    p.add_argument(
        "--socket-group",
        type=_opt_str,
        default=e("--socket-group", None),
        help="group (name or gid) of --unix-socket: its members may connect; staging pools must be 0640 in it",
    )
    p.add_argument(
        "--socket-mode",
        type=lambda v: None if _opt_str(v) is None else int(v, 8),
        default=e("--socket-mode", None),
        help="octal mode of --unix-socket (default 0660 with --socket-group, else 0600)",
    )
    p.add_argument(
        "--dedupe-versions",
        type=int,
        default=int(e("--dedupe-versions", 4)),
        help="newest policy versions per run whose chunk keys are kept for dedupe/conflicts",
    )
    p.add_argument(
        "--ready-file",
        type=_opt_str,
        default=e("--ready-file", None),
        help="write {port, metrics_port} JSON here once serving (for port 0)",
    )
    p.add_argument("--log-level", default=e("--log-level", "INFO"))
    p.set_defaults(func=run)


def config_from_args(ns: argparse.Namespace) -> Any:
    from .config import ServerConfig

    return ServerConfig(
        storage=ns.storage,
        storage_options=storage_options_from(ns),
        host=ns.host,
        port=ns.port,
        unix_socket=ns.unix_socket,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_client_ca=ns.tls_client_ca,
        auth_tokens=ns.auth_tokens,
        unix_needs_token=ns.unix_needs_token,
        insecure=ns.insecure,
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        wal_dir=ns.wal_dir,
        wal_segment_bytes=ns.wal_segment_mib * MiB,
        memory_budget_bytes=ns.memory_budget_mib * MiB,
        shard_target_bytes=ns.shard_target_mib * MiB,
        flush_interval_s=ns.flush_interval,
        backpressure_timeout_s=ns.backpressure_timeout,
        max_message_bytes=ns.max_message_mib * MiB,
        max_streams=ns.max_streams,
        workers=ns.workers,
        max_read_bytes=ns.max_read_mib * MiB,
        max_writers=ns.max_writers,
        max_runs=ns.max_runs,
        storage_unhealthy_s=ns.storage_unhealthy,
        wal_retry_s=ns.wal_retry,
        grace_s=ns.grace,
        storage_timeout_s=ns.storage_timeout,
        shm_dir=ns.shm_dir,
        socket_group=ns.socket_group,
        socket_mode=ns.socket_mode,
        dedupe_versions=ns.dedupe_versions,
    )


def tune_malloc() -> bool:
    """Keep freed large blocks in the sidecar's heap (glibc ``mallopt``): every received message is a
    few-MiB ``bytes`` that gRPC builds by appending slices, and with glibc's defaults each one came
    from fresh ``mmap`` pages (page fault + zeroing per 4 KiB, then ``munmap``). Fixed thresholds
    (mmap above 256 MiB only, trim above 1 GiB) reuse the same pages: sidecar CPU per 384 MiB over
    TCP 1.04 -> 0.83 s, ingest 0.35 -> 0.44 GB/s (3 alternating runs).

    One malloc arena (unless ``MALLOC_ARENA_MAX`` is set): each Write stream runs on threads of
    its own, and glibc gives new threads new arenas (up to 8 per core), each of which must grow to
    its own high-water mark before it stops faulting in fresh pages. Over shared memory the copies
    out of held staging faulted ~19k pages (76 MiB) per 192 MiB stream for the first five streams
    of a sidecar (its CPU 0.17-0.20 s per stream instead of 0.15 s); with one arena that stops
    from the third stream on. It also makes "the heap stays at its high-water mark, which the
    memory budget bounds" true of the process rather than of each arena. Python allocates under
    the GIL anyway, and gRPC's small allocations go to glibc's per-thread caches. No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # <malloc.h>
        # glibc builds that cap the mmap threshold at 32 MiB refuse 256 MiB: take the cap then
        mmap_ok = libc.mallopt(m_mmap_threshold, 256 << 20) or libc.mallopt(m_mmap_threshold, 32 << 20)
        if "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(m_arena_max, 1)
        return bool(mmap_ok) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def tune_gc() -> None:
    """Collect cycles less often in the sidecar: every received chunk allocates a handful of
    container objects (protobuf message, RecordChunk, arrays, index entries) and with CPython's
    default thresholds (700, 10, 10) the collector ran every few messages and walked the whole,
    growing dedupe index in its full collections (4.6% of sidecar samples over shared memory,
    perf). The server's own data holds no reference cycles; ``gc.freeze`` keeps the objects made
    at start-up out of every collection."""
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def run(ns: argparse.Namespace) -> int:
    tune_malloc()
    try:
        from .service import Sidecar
    except ImportError as exc:
        print(f"tracestore serve needs the server extra ({exc}): pip install 'tracestore[server]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tracestore.errors import TraceStoreError

    try:
        sidecar = Sidecar(config_from_args(ns)).start()
    except TraceStoreError as exc:
        print(f"tracestore serve: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    log = logging.getLogger("tracestore.server")
    log.info(
        "serving on %s:%d%s, metrics %s",
        ns.host,
        sidecar.port,
        f" and unix:{ns.unix_socket}" if ns.unix_socket else "",
        sidecar.metrics_port,
    )
    # Handlers before the ready file: a SIGTERM right after it appears must drain, not kill
    # (test_crash terminated a freshly started sidecar with the default action, exit -15).
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining (grace %.0fs)", signum, ns.grace)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # SIGHUP: read the TLS files and the token file again (what fails to load is logged and the
    # files in use stay)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: sidecar.reload())
    if ns.ready_file:
        tmp = ns.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": sidecar.port, "metrics_port": sidecar.metrics_port, "pid": os.getpid()}, f)
        os.replace(tmp, ns.ready_file)
    while not stop.wait(1.0):
        pass
    ok = sidecar.stop()
    log.info("stopped; everything accepted is %s", "committed" if ok else "in the fsynced write-ahead log")
    return 0
