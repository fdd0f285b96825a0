"""``tracestore serve``: run the sidecar. Works with no configuration.

Every setting is a flag, a ``TRACESTORE_<FLAG>`` variable and a key of the ``[serve]`` table of a
TOML config file (``--config``/``TRACESTORE_CONFIG``), in that order of precedence
(:mod:`tracestore.settings`). At start the sidecar logs one line with every effective setting
(credentials redacted) and where each came from, then checks its storage by writing and deleting a
probe object (``--storage-check``: ``warn``, the default, serves anyway with an error logged;
``fail`` exits 3; ``off`` skips it). docs/operations.md, "Running it", says why ``warn`` is the
default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from tracestore.server.config import SHM_POOLS

from tracestore.settings import (
    JSON_OBJECT,
    MALLOC_ARENA_MAX,
    OCTAL_MODE,
    SWITCH,
    Kind,
    Setting,
    add_settings,
    choice,
    integer,
    number,
    optional,
    read_env,
    resolve,
    text,
)

MiB = 1 << 20
PORT = integer(0, 65535)
SECONDS = number(gt=0)
MIB = Kind("an integer >= 1 (MiB)", integer(1).parse, "MIB")
PATH = optional(text("a path"))

SETTINGS = (
    Setting("--storage", text("an fsspec URL such as file://./data or s3://bucket/prefix"),
            "file://./tracestore-data", "fsspec URL of the store", metavar="URL"),
    Setting("--storage-options", JSON_OBJECT, None,
            "JSON object passed to fsspec (credentials: prefer the variable or --storage-options-file; a flag is "
            "visible to every local user in /proc/PID/cmdline)", secret=True, show="none", metavar="JSON"),
    Setting("--storage-options-file", PATH, None,
            "file holding the JSON object passed to fsspec (for credentials; keep it mode 0600)", metavar="FILE"),
    Setting("--storage-check", choice("warn", "fail", "off"), "warn",
            "write and delete a probe object at start: warn = log an error and serve anyway, fail = exit 3, off"),
    Setting("--storage-retry-deadline", SECONDS, 30.0,
            "seconds after a storage call's first attempt after which no retry starts", metavar="SECONDS"),
    Setting("--shard-files", choice("auto", "1", "2"), "auto",
            "the most files one shard is written as (two are encoded side by side); auto: 2 with two or more "
            "cores"),
    Setting("--shard-split-mib", number(ge=0), 24.0,
            "record payload from which a shard is written as two files (with --shard-files 2 or auto), MiB",
            metavar="MIB"),
    Setting("--host", text("an address"), "127.0.0.1", "gRPC bind address"),
    Setting("--port", optional(PORT), 7433, "gRPC TCP port (0: ephemeral); 'off': no TCP, the --unix-socket only. "
            "Default 7433, but off beside --unix-socket without --auth-tokens (give --port to listen on TCP too)"),
    Setting("--unix-socket", PATH, None, "also listen on this unix socket", metavar="PATH"),
    Setting("--tls-cert", PATH, None, "PEM certificate chain: TLS on TCP", metavar="FILE"),
    Setting("--tls-key", PATH, None, "PEM private key of --tls-cert", metavar="FILE"),
    Setting("--tls-client-ca", PATH, None,
            "PEM CA bundle: TCP clients must present a certificate it signed (mutual TLS)", metavar="FILE"),
    Setting("--auth-tokens", PATH, None,
            "token file, one 'sha256:<hex digest> <scope>[,<scope>...] [name]' per line (scopes write:<run glob>, "
            "read:<run glob>, admin); without it the sidecar serves loopback and the unix socket only",
            metavar="FILE"),
    Setting("--unix-needs-token", SWITCH, False,
            "unix-socket callers need a token too (otherwise the socket file's permissions are the boundary)",
            switch=True),
    Setting("--insecure", SWITCH, False,
            "serve a non-loopback --host without TLS and tokens (e.g. behind a network policy)", switch=True),
    Setting("--metrics-host", text("an address"), "127.0.0.1", "Prometheus metrics bind address"),
    Setting("--metrics-port", optional(PORT), 9433, "Prometheus metrics port; 'off' disables the endpoint"),
    Setting("--wal-dir", PATH, "./tracestore-wal",
            "write-ahead log directory; 'off' acknowledges only committed shards", metavar="DIR"),
    Setting("--wal-segment-mib", MIB, 64, "size of one write-ahead log segment file, MiB"),
    Setting("--memory-budget-mib", MIB, 1024,
            "bytes received and not yet committed, at most (backpressure beyond), MiB"),
    Setting("--shard-target-mib", MIB, 128, "a writer's records are committed as a shard about this big, MiB"),
    Setting("--flush-interval", SECONDS, 2.0, "seconds between flusher passes", metavar="SECONDS"),
    Setting("--backpressure-timeout", SECONDS, 5.0,
            "seconds a write waits for room in the memory budget before it is refused", metavar="SECONDS"),
    Setting("--max-message-mib", MIB, 64, "largest gRPC message, MiB; at most a third of --memory-budget-mib"),
    Setting("--max-streams", integer(1), 256,
            "open Write streams at most; one more is refused at once with RESOURCE_EXHAUSTED"),
    Setting("--stream-window-kib", integer(64, 65536), None,
            "HTTP/2 receive window of each Write stream, KiB (default: gRPC's 64); 4096 lifts one recorder's TLS "
            "ingest but, under a flood of streams, is memory outside the budget (docs/protocol.md)"),
    Setting("--workers", integer(8), 64, "gRPC threads besides one per Write stream (health, Stat, Seal, Read)"),
    Setting("--max-read-mib", MIB, 256,
            "largest Read (plan rows x row bytes of the sites read), never more than the read budget holds, MiB"),
    Setting("--read-budget-mib", MIB, None,
            "bytes all Reads in progress hold at once (outputs being sent), apart from --memory-budget-mib, MiB",
            show="a quarter of --memory-budget-mib"),
    Setting("--read-stall-timeout", SECONDS, 10.0,
            "seconds a Read may wait for its caller to take a response before it is cancelled", metavar="SECONDS"),
    Setting("--max-writers", integer(1), 1024,
            "writer sessions (run, writer id) one sidecar keeps; a new one beyond is refused"),
    Setting("--max-runs", integer(1), 256,
            "runs with records not yet committed one sidecar serves; more are refused (a committed run's slot is "
            "reused)"),
    Setting("--max-writers-per-identity", integer(1), None,
            "with --auth-tokens: writer sessions one identity (token name) may hold, at most --max-writers",
            show="a quarter of --max-writers"),
    Setting("--max-runs-per-identity", integer(1), None,
            "with --auth-tokens: runs with records not yet committed one identity may have, at most --max-runs",
            show="a quarter of --max-runs"),
    Setting("--max-streams-per-identity", integer(1), None,
            "with --auth-tokens: open Write streams one identity (token name; 'unix-socket' for the socket's "
            "callers without a token) may hold, at most --max-streams",
            show="a quarter of --max-streams, at least 8 (at most --max-streams)"),
    Setting("--max-shm-pools-per-identity", integer(1, SHM_POOLS), None,
            f"with --auth-tokens: shared-memory staging pools one identity may hold open, of the {SHM_POOLS} the "
            "sidecar keeps open at once", show=f"{SHM_POOLS // 4} (a quarter)"),
    Setting("--storage-unhealthy", SECONDS, 300.0,
            "seconds of storage refusing every commit before health reports NOT_SERVING", metavar="SECONDS"),
    Setting("--wal-retry", SECONDS, 1.0, "seconds between attempts to recover a failed write-ahead log",
            metavar="SECONDS"),
    Setting("--grace", SECONDS, 30.0, "seconds to drain on SIGTERM", metavar="SECONDS"),
    Setting("--storage-timeout", SECONDS, 60.0, "seconds one storage call may take before it is abandoned",
            metavar="SECONDS"),
    Setting("--shm-dir", text("a directory"), "/dev/shm", "where writers' staging pools live", metavar="DIR"),
    Setting("--max-shm-pool-mib", MIB, 65536,
            "largest writer staging pool (shared memory) the sidecar opens; a bigger one is refused, MiB"),
    Setting("--socket-group", optional(text("a group name or gid")), None,
            "group (name or gid) of --unix-socket: its members may connect; staging pools must be 0640 in it",
            metavar="GROUP"),
    Setting("--socket-mode", optional(OCTAL_MODE), None,
            "octal mode of --unix-socket", show="0660 with --socket-group, else 0600", metavar="MODE"),
    Setting("--dedupe-versions", integer(1), 4,
            "newest policy versions per run whose chunk keys are kept for dedupe/conflicts"),
    Setting("--ready-file", PATH, None, "write {port, metrics_port, pid} JSON here once serving (for port 0)",
            metavar="FILE"),
    Setting("--log-level", choice("debug", "info", "warning", "error", "critical"), "info", "log level"),
)  # fmt: skip
"""Every setting of ``tracestore serve``; the flag names are a contract with deploy/ (the env twins)."""

_RANK = {"flag": 3, "env": 2, "file": 1, "default": 0}


def storage_options_from(ns: argparse.Namespace) -> dict[str, Any] | None:
    """fsspec options from --storage-options-file or --storage-options (each a flag, variable or
    config-file key; the higher-precedence source wins, both from the same one is an error);
    errors never quote the text (it holds credentials)."""
    from tracestore.errors import ConfigError

    resolve(ns)
    log = logging.getLogger("tracestore.server")
    sources = getattr(ns, "_sources", {})
    file_rank = _RANK[sources.get("storage_options_file", "default")]
    text_rank = _RANK[sources.get("storage_options", "default")]
    if ns.storage_options_file and ns.storage_options is not None:
        if file_rank == text_rank:
            raise ConfigError("give --storage-options-file or --storage-options, not both")
        if file_rank < text_rank:
            return _checked_options(ns.storage_options)
    if ns.storage_options_file:
        where = f"--storage-options-file {ns.storage_options_file}"
        try:
            with open(ns.storage_options_file) as f:
                content = f.read()
                mode = os.fstat(f.fileno()).st_mode
        except OSError as exc:
            raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
        if mode & 0o077:
            log.warning("%s is readable by other users (mode %o); keep credentials in a 0600 file", where, mode & 0o777)
        if not content.strip():
            return None
        try:
            return JSON_OBJECT(content)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise ConfigError(f"{where}: expected {JSON_OBJECT.expected} ({exc})") from None
    if ns.storage_options is not None and sources.get("storage_options") == "flag":
        secret = sorted(_secret_keys(ns.storage_options))
        if secret:
            raise ConfigError(
                f"--storage-options on the command line names {', '.join(map(repr, secret))}: the command line is "
                "visible to every local user (/proc/PID/cmdline), so it may carry only options that say where, "
                f"not who ({', '.join(sorted(SHOWN_OPTIONS))}); put the rest in --storage-options-file (mode "
                "0600) or TRACESTORE_STORAGE_OPTIONS"
            )
    return _checked_options(ns.storage_options)


def _secret_keys(options: Any) -> set[str]:
    """The keys of fsspec options (nested tables too) that are not in :data:`SHOWN_OPTIONS`."""
    if not isinstance(options, dict):
        return set()
    out = {k for k in options if k not in SHOWN_OPTIONS}
    for value in options.values():
        out |= _secret_keys(value)
    return out


def _checked_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    return options or None  # {} is no options


# ---------------------------------------------------------------------------- what the startup logs

# fsspec/s3fs options whose values say where, not who: shown in the startup line. Every other
# value (key, secret, token, password, session, profile, anything unknown) is redacted.
SHOWN_OPTIONS = frozenset({"endpoint_url", "region_name", "anon", "use_ssl", "client_kwargs", "config_kwargs",
                           "connect_timeout", "read_timeout", "retries", "max_attempts", "mode", "addressing_style",
                           "signature_version", "s3", "default_block_size", "use_listings_cache", "version_aware",
                           "requester_pays", "auto_mkdir"})  # fmt: skip
REDACTED = "<redacted>"


def redact_url(url: str) -> str:
    """``url`` without a password or token: user info and the query string are replaced."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rsplit("@", 1)[1]
    query = REDACTED if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_options(options: Any) -> Any:
    """A copy of fsspec options with every value redacted except those of :data:`SHOWN_OPTIONS`
    (nested tables are redacted key by key)."""
    if not isinstance(options, dict):
        return REDACTED
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out[key] = redact_options(value)
        elif value is None or (key in SHOWN_OPTIONS and isinstance(value, (str, int, float, bool))):
            out[key] = redact_url(value) if isinstance(value, str) else value
        else:
            out[key] = REDACTED
    return out


def settings_line(ns: argparse.Namespace, cfg: Any) -> str:
    """One line with every effective setting of ``serve``, secrets redacted, each not at its
    default followed by where it came from (``(env)``, ``(flag)``, ``(file)``)."""
    from tracestore import __version__

    sources = getattr(ns, "_sources", {})
    shown: dict[str, Any] = {}
    for s in SETTINGS:
        value = getattr(ns, s.dest, None)
        if s.dest == "storage_options":
            value = (
                json.dumps(redact_options(cfg.storage_options), separators=(",", ":"), sort_keys=True)
                if cfg.storage_options
                else "none"
            )
        elif s.dest == "storage":
            value = redact_url(cfg.storage)
        elif s.dest in ("wal_dir", "shm_dir", "unix_socket", "ready_file") and value is not None:
            value = os.path.abspath(value)
        elif s.dest == "socket_mode" and value is not None:
            value = f"{value:04o}"
        elif value is None:
            value = "off"
        elif isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, float):
            value = f"{value:g}"
        src = sources.get(s.dest, "default")
        shown[s.dest.replace("_", "-")] = f"{value}" + ("" if src == "default" else f"({src})")
    config = f" config={ns.config}" if getattr(ns, "config", None) else ""
    return f"tracestore {__version__} serve, pid {os.getpid()}{config}: " + " ".join(
        f"{k}={v}" for k, v in shown.items()
    )


# ---------------------------------------------------------------------------- storage check

PROBE_PREFIX = ".tracestore-probe-"
"""Probe objects live at the storage root under this prefix (no run id starts with a dot, so
listings of runs never see one)."""


def check_storage(cfg: Any, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Write a small object at the storage root and delete it: (ok, what happened in one line).

    The probe uses the sidecar's own storage options and the create-only publish shards use, with
    at most ``timeout_s`` per call and one retry, so a black-holed endpoint is reported within
    about three times ``timeout_s``."""
    import socket
    import uuid

    from tracestore.errors import TraceStoreError
    from tracestore.storage.fs import Storage

    url = redact_url(cfg.storage)
    t0 = time.monotonic()
    timeout = min(timeout_s, cfg.storage_timeout_s)
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        storage = Storage(cfg.storage, cfg.storage_options, timeout=timeout, retries=1, retry_deadline=timeout)
    except TraceStoreError as exc:
        return False, f"cannot open storage {url}: {_one_line(exc)}"
    try:
        try:
            storage.publish(name, b"tracestore storage probe\n")
        except (TraceStoreError, OSError) as exc:
            return False, f"cannot write a probe object at {url}: {_one_line(exc)}"
        try:
            storage.rm(name)
        except (TraceStoreError, OSError) as exc:
            return False, f"wrote a probe object at {url} but cannot delete {name}: {_one_line(exc)}"
    finally:
        storage.close()
    return True, f"storage check: wrote and deleted a probe object at {url} in {time.monotonic() - t0:.2f} s"


def _one_line(exc: BaseException) -> str:
    line = " ".join(str(exc).split()) or type(exc).__name__
    return line if len(line) <= 500 else line[:497] + "..."


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the sidecar (gRPC ingest/read service, WAL, shard flusher, Prometheus metrics)",
        description="Run the tracestore sidecar. Every setting is a --flag, else a TRACESTORE_<FLAG> variable "
        "(e.g. TRACESTORE_STORAGE, TRACESTORE_PORT), else a key of the [serve] table of a TOML --config file, "
        "else the default shown. A bad value is one line on standard error and exit status 2.",
    )
    add_settings(p, "serve", SETTINGS)
    p.set_defaults(func=run)


def config_from_args(ns: argparse.Namespace) -> Any:
    """The :class:`ServerConfig` of parsed ``serve`` arguments (settings resolved here if they were
    not yet: flag > variable > config file > default). Raises ConfigError on any bad value."""
    from tracestore.server.config import ServerConfig

    resolve(ns)
    port = ns.port
    if (
        getattr(ns, "_sources", {}).get("port", "default") == "default"
        and ns.unix_socket is not None
        and ns.auth_tokens is None
    ):
        # Beside a unix socket and without tokens, TCP listens only where the operator asks: on
        # 127.0.0.1 any local user could read and write every run, whatever the socket's mode.
        port = ns.port = None
    return ServerConfig(
        storage=ns.storage,
        storage_options=storage_options_from(ns),
        host=ns.host,
        port=port,
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
        stream_window_bytes=None if ns.stream_window_kib is None else ns.stream_window_kib << 10,
        workers=ns.workers,
        max_read_bytes=ns.max_read_mib * MiB,
        read_budget_bytes=None if ns.read_budget_mib is None else ns.read_budget_mib * MiB,
        read_stall_s=ns.read_stall_timeout,
        max_writers=ns.max_writers,
        max_runs=ns.max_runs,
        max_writers_per_identity=ns.max_writers_per_identity,
        max_runs_per_identity=ns.max_runs_per_identity,
        max_streams_per_identity=ns.max_streams_per_identity,
        max_shm_pools_per_identity=ns.max_shm_pools_per_identity,
        storage_unhealthy_s=ns.storage_unhealthy,
        wal_retry_s=ns.wal_retry,
        grace_s=ns.grace,
        storage_timeout_s=ns.storage_timeout,
        storage_retry_deadline_s=ns.storage_retry_deadline,
        shard_files=None if ns.shard_files == "auto" else int(ns.shard_files),
        shard_split_min_bytes=int(ns.shard_split_mib * MiB),
        shm_dir=ns.shm_dir,
        max_shm_pool_bytes=ns.max_shm_pool_mib * MiB,
        socket_group=ns.socket_group,
        socket_mode=ns.socket_mode,
        dedupe_versions=ns.dedupe_versions,
    )


def tune_malloc() -> bool:
    """Tune the sidecar's heap for few-MiB messages; returns whether the ``mallopt`` settings took
    (False off glibc).

    - Freed blocks stay in the heap (trim above 1 GiB, mmap above 32 MiB only): every received
      message is a few-MiB ``bytes`` that gRPC builds by appending slices, and glibc's defaults
      give each one fresh ``mmap`` pages (a fault and zeroing per 4 KiB). Blocks above 32 MiB
      (messages near ``--max-message-mib``, their copies) are still mapped: kept in the heap they
      leave holes the next ones do not fit, and the heap grows past what the budget counts.
    - One malloc arena (unless ``MALLOC_ARENA_MAX`` is set): glibc gives new threads (each Write
      stream has its own) new arenas, each growing to its own high-water mark. With one arena, "the
      heap stays at its high-water mark, which the memory budget bounds" holds for the process.
      Python allocates under the GIL anyway, and gRPC's small allocations go to glibc's per-thread
      caches.
    - Arrow allocates from the same heap (pyarrow's system pool, not mimalloc), so the memory that
      encoding a shard takes is the memory gRPC's copies of a message freed, as the budget counts
      it; encoding is as fast either way. Parquet's page buffers still come from Arrow's C++
      default pool, chosen when pyarrow is imported: the engine empties it after every shard
      (``Engine.release_commit``).
    """
    import ctypes
    import ctypes.util

    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # <malloc.h>
        # 384 MiB of 4 MiB messages over TCP: sidecar CPU 0.83 s, against 1.04 s with the defaults
        mmap_ok = libc.mallopt(m_mmap_threshold, 32 << 20)
        if read_env(MALLOC_ARENA_MAX) is None:
            libc.mallopt(m_arena_max, 1)  # copies out of held staging stop faulting from stream 3 on
        return bool(mmap_ok) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def tune_gc() -> None:
    """Collect cycles less often in the sidecar: every received chunk allocates a handful of
    container objects (protobuf message, RecordChunk, arrays, index entries), and with CPython's
    default thresholds the collector runs every few messages and walks the whole, growing dedupe
    index in its full collections. The server's own data holds no reference cycles; ``gc.freeze``
    keeps the objects made at start-up out of every collection."""
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # the defaults (700, 10, 10): 4.6% of sidecar CPU samples


def run(ns: argparse.Namespace) -> int:
    # SIGHUP's default action ends the process: one sent while the sidecar starts (a WAL replay can
    # take minutes; a Secret rotated meanwhile) only asks for a reload once it serves.
    pending_reload = threading.Event()
    signal.signal(signal.SIGHUP, lambda _signum, _frame: pending_reload.set())
    tune_malloc()
    try:
        from tracestore.server.rpc.service import Sidecar
    except ImportError as exc:
        print(f"tracestore serve needs the server extra ({exc}): pip install 'tracestore[server]'", file=sys.stderr)
        return 2
    from tracestore.errors import TraceStoreError

    try:
        resolve(ns)
    except TraceStoreError as exc:
        print(f"tracestore serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tracestore.server")
    try:
        cfg = config_from_args(ns)
    except TraceStoreError as exc:
        print(f"tracestore serve: {exc}", file=sys.stderr)
        return 2
    log.info("%s", settings_line(ns, cfg))
    if ns.storage_check != "off":
        ok, what = check_storage(cfg)
        if ok:
            log.info("%s", what)
        elif ns.storage_check == "fail":
            log.critical("storage check FAILED: %s; exiting (--storage-check fail)", what)
            return 3
        else:
            held = (
                f"acknowledged writes wait in the write-ahead log ({os.path.abspath(cfg.wal_dir)})"
                if cfg.wal_dir is not None
                else "with --wal-dir off nothing is acknowledged until it is committed, so writers wait"
            )
            log.error(
                "storage check FAILED: %s. Serving anyway (--storage-check warn): %s and are committed once "
                "storage works; health turns NOT_SERVING after %g s of failed commits (--storage-unhealthy). "
                "Fix the storage URL, options or credentials, or use --storage-check fail to exit instead",
                what, held, cfg.storage_unhealthy_s,
            )  # fmt: skip
    try:
        sidecar = Sidecar(cfg).start()
    except TraceStoreError as exc:
        print(f"tracestore serve: {exc}", file=sys.stderr)
        return 2
    tune_gc()
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
    if pending_reload.is_set():
        sidecar.reload()
    if ns.ready_file:
        tmp = ns.ready_file + ".tmp"
        with open(tmp, "w") as f:
            port = sidecar.port if ns.port is not None else None  # (null: no TCP listener)
            json.dump({"port": port, "metrics_port": sidecar.metrics_port, "pid": os.getpid()}, f)
        os.replace(tmp, ns.ready_file)
    while not stop.wait(1.0):
        pass
    ok = sidecar.stop()
    log.info("stopped; everything accepted is %s", "committed" if ok else "in the fsynced write-ahead log")
    return 0
