"""``tracestore health``: ask a sidecar's gRPC health service (``grpc.health.v1``) for one name's status.

For exec probes (deploy/k8s) and container health checks: exit status 0 when the status is
SERVING, 1 otherwise (NOT_SERVING, unknown name, unreachable, no answer in time), 2 on usage
errors; exactly one line on standard output either way, starting with what was found: ``SERVING``,
``NOT_SERVING``, ``UNKNOWN`` (no such name), ``UNREACHABLE``, ``TIMEOUT`` or ``ERROR``.

The default target is the sidecar's own unix socket, ``unix://$TRACESTORE_UNIX_SOCKET`` (the
variable ``tracestore serve`` reads), else ``127.0.0.1:$TRACESTORE_PORT`` (7433). The check is
plaintext: over the unix socket that is always right; a TCP port with TLS is not checked by this
command (use the socket). Health needs no token (docs/protocol.md, health and reflection).

Service names (server/rpc/service.py): ``""`` and ``tracestore.v1.TraceStore`` follow every degraded
reason (storage refusing commits, a failing WAL, a dead or stalled flusher);
``tracestore.v1.Liveness`` goes NOT_SERVING only for what a restart mends (a dead flusher): probes
watch that one.

Settings (``--target``, ``--service``, ``--timeout``): flag, else ``TRACESTORE_<FLAG>``, else the
``[health]`` table of a ``--config`` file, through :mod:`tracestore.settings` (standard library
only, and ``tomllib`` only when a config file is named). Only ``grpc`` and the health stubs are
imported for the check, and only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from tracestore.settings import (
    GRPC_VERBOSITY,
    SERVE_PORT,
    SERVE_UNIX_SOCKET,
    Kind,
    Setting,
    add_settings,
    number,
    optional,
    read_env,
    text,
)

LIVENESS = "tracestore.v1.Liveness"  # the same name as server/rpc/service.py (a test keeps them equal)
DEFAULT_PORT = 7433


def default_target(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """``unix://<abs path>`` of ``TRACESTORE_UNIX_SOCKET`` when set, else
    ``127.0.0.1:<TRACESTORE_PORT or 7433>``."""
    sock = read_env(SERVE_UNIX_SOCKET, environ)
    if sock:
        return "unix://" + os.path.abspath(sock.strip())
    return f"127.0.0.1:{read_env(SERVE_PORT, environ)}"


def grpc_target(target: str) -> str:
    """What grpc dials for ``target``: a bare absolute path is a unix socket; ``unix:`` targets
    (``unix:///abs``, ``unix:rel``) and ``host:port`` pass unchanged."""
    return "unix://" + target if target.startswith("/") else target


def _service(raw: object) -> str:
    if not isinstance(raw, str):
        raise ValueError
    return raw.strip()


SETTINGS = (
    Setting(
        "--target",
        optional(text("unix:///path/to.sock, a socket path or host:port")),
        None,
        "unix:///path/to.sock (or the path) or host:port",
        show="unix://$TRACESTORE_UNIX_SOCKET, else 127.0.0.1:$TRACESTORE_PORT",
        metavar="TARGET",
    ),
    Setting(
        "--service",
        Kind("a health service name ('' for the overall status)", _service),
        "",
        f"health name: '' (every degraded reason), tracestore.v1.TraceStore (the same), {LIVENESS} "
        "(NOT_SERVING only for what a restart mends: what probes watch)",
        show="'' (overall)",
        metavar="NAME",
    ),
    Setting("--timeout", number(gt=0), 3.0, "seconds for the whole check, connecting included", metavar="SECONDS"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "health",
        help="ask a sidecar's gRPC health service; exit 0 when SERVING, 1 otherwise (for exec probes)",
        description="Check one gRPC health name of a running sidecar and print one line: exit 0 when "
        "SERVING, 1 otherwise (NOT_SERVING, unknown name, unreachable, timeout). The default target is "
        "unix://$TRACESTORE_UNIX_SOCKET, else 127.0.0.1:$TRACESTORE_PORT (7433). Plaintext: check a TLS "
        "sidecar over its unix socket. Settings: flag, else TRACESTORE_<FLAG>, else the [health] table of a "
        "--config file.",
    )
    add_settings(p, "health", SETTINGS)
    p.set_defaults(func=run)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """(exit status, the line to print) of one health check of ``service`` at ``target``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = f"service {service!r}" if service else 'service "" (overall)'
    dial = grpc_target(target)
    with grpc.insecure_channel(dial, options=[("grpc.enable_retries", 0)]) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = _one_line(exc.details() if hasattr(exc, "details") else str(exc))
            if code == grpc.StatusCode.NOT_FOUND:
                return 1, f"UNKNOWN: the sidecar at {target} has no health status for {name} (not started yet?)"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return 1, f"TIMEOUT: no health answer from {target} within {timeout:g}s ({name})"
            if code == grpc.StatusCode.UNAVAILABLE:
                return 1, f"UNREACHABLE: no sidecar answers at {target} ({details})"
            return 1, f"ERROR: health check of {name} at {target} failed: {getattr(code, 'name', code)}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return (0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1), f"{status}: {name} at {target}"


def run(ns: argparse.Namespace) -> int:
    from tracestore.errors import ConfigError
    from tracestore.settings import resolve

    try:
        resolve(ns)
    except ConfigError as exc:
        print(f"tracestore health: {exc}", file=sys.stderr)
        return 2
    target = ns.target or default_target()
    if "grpc" not in sys.modules and read_env(GRPC_VERBOSITY) is None:
        os.environ["GRPC_VERBOSITY"] = "NONE"  # grpc's C core would log the connection failure again
    try:
        rc, line = check(target, ns.service, ns.timeout)
    except ImportError as exc:
        print(f"tracestore health needs the server extra ({exc}): pip install 'tracestore[server]'", file=sys.stderr)
        return 2
    print(line)
    return rc
