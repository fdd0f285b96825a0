"""`tracestore health` (the exec probe of deploy/k8s) against a real Sidecar: exit 0 and one line when
SERVING, 1 with one clear line when NOT_SERVING, unknown, unreachable, silent or stopped; the probes'
name (tracestore.v1.Liveness) stays SERVING through a storage outage; the check imports grpc and the
health stubs, not the server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tracestore.server import cli_health
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import LIVENESS, SERVICE, Sidecar
from tracestore.server.testing import wait_for

from tracestore.cli import main


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # short: the socket is bound first at <dir>/.ts-XXXXXXXX/s (108 bytes at most)
    d = Path(tempfile.mkdtemp(prefix="tsh-", dir="/tmp"))
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    d.rmdir()


@pytest.fixture
def sidecar(sock_dir: Path, memory_url: str) -> Iterator[Sidecar]:
    cfg = ServerConfig(storage=memory_url, wal_dir=None, port=0, metrics_port=None,
                       unix_socket=str(sock_dir / "ts.sock"), grace_s=2)  # fmt: skip
    sc = Sidecar(cfg).start()
    try:
        yield sc
    finally:
        sc.stop(1)


def health(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["health", *args])
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert len(lines) == 1, lines
    return rc, lines[0]


def test_serving_exits_0_on_every_name_and_both_transports(sidecar: Sidecar, capsys: pytest.CaptureFixture[str]):
    sock = f"unix://{sidecar.config.unix_socket}"
    for target in (sock, str(sidecar.config.unix_socket), f"127.0.0.1:{sidecar.port}"):
        for service in ("", SERVICE, LIVENESS):
            rc, line = health(capsys, "--target", target, "--service", service)
            assert rc == 0 and line.startswith("SERVING: "), (target, service, line)
    assert cli_health.LIVENESS == LIVENESS


def test_default_target_is_the_socket_of_the_environment(
    sidecar: Sidecar, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TRACESTORE_UNIX_SOCKET", str(sidecar.config.unix_socket))
    monkeypatch.setenv("TRACESTORE_PORT", "1")  # the socket wins
    rc, line = health(capsys, "--service", LIVENESS)
    assert rc == 0 and line == f"SERVING: service {LIVENESS!r} at unix://{sidecar.config.unix_socket}"
    monkeypatch.delenv("TRACESTORE_UNIX_SOCKET")
    monkeypatch.setenv("TRACESTORE_PORT", str(sidecar.port))
    assert cli_health.default_target() == f"127.0.0.1:{sidecar.port}"
    assert health(capsys)[0] == 0
    monkeypatch.delenv("TRACESTORE_PORT")
    assert cli_health.default_target() == "127.0.0.1:7433"
    assert cli_health.default_target({"TRACESTORE_UNIX_SOCKET": "off"}) == "127.0.0.1:7433"


def test_not_serving_and_unknown_names_exit_1(sidecar: Sidecar, capsys: pytest.CaptureFixture[str]):
    target = f"unix://{sidecar.config.unix_socket}"
    rc, line = health(capsys, "--target", target, "--service", "no.such.Service")
    assert rc == 1 and line.startswith("UNKNOWN: ") and "no.such.Service" in line
    assert sidecar.service is not None
    # storage refusing every commit: the overall names go NOT_SERVING, the probes' name stays SERVING
    sidecar.service.degraded = lambda: ["storage_refusing"]  # type: ignore[method-assign]
    wait_for("overall NOT_SERVING", lambda: main(["health", "--target", target]) == 1, timeout=10)
    capsys.readouterr()
    rc, line = health(capsys, "--target", target)
    assert rc == 1 and line == f'NOT_SERVING: service "" (overall) at {target}'
    assert health(capsys, "--target", target, "--service", SERVICE)[0] == 1
    rc, line = health(capsys, "--target", target, "--service", LIVENESS)
    assert rc == 0 and line == f"SERVING: service {LIVENESS!r} at {target}"
    # a dead flusher is what a restart mends: the probes' name goes NOT_SERVING too
    sidecar.service.degraded = lambda: ["flusher_dead"]  # type: ignore[method-assign]
    wait_for("liveness NOT_SERVING", lambda: main(["health", "--target", target, "--service", LIVENESS]) == 1, 10)
    capsys.readouterr()
    rc, line = health(capsys, "--target", target, "--service", LIVENESS)
    assert rc == 1 and line.startswith("NOT_SERVING: ")


def test_after_stop_exits_1(sidecar: Sidecar, capsys: pytest.CaptureFixture[str]):
    sock, tcp = f"unix://{sidecar.config.unix_socket}", f"127.0.0.1:{sidecar.port}"
    assert health(capsys, "--target", sock, "--service", LIVENESS)[0] == 0
    sidecar.stop(1)
    for target in (sock, tcp):
        rc, line = health(capsys, "--target", target, "--service", LIVENESS, "--timeout", "2")
        assert rc == 1 and line.startswith("UNREACHABLE: no sidecar answers at " + target), line


def test_unreachable_and_silent_targets_exit_1_with_a_clear_line(sock_dir: Path, capsys: pytest.CaptureFixture[str]):
    missing = sock_dir / "missing.sock"
    rc, line = health(capsys, "--target", f"unix://{missing}", "--timeout", "2")
    assert rc == 1 and line.startswith(f"UNREACHABLE: no sidecar answers at unix://{missing} (")
    assert "No such file or directory" in line
    # a listener that accepts TCP and never speaks HTTP/2: the deadline, not a hang
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        rc, line = health(capsys, "--target", target, "--timeout", "0.5")
        assert time.monotonic() - t0 < 5
    assert rc == 1 and line == f'TIMEOUT: no health answer from {target} within 0.5s (service "" (overall))', line
    assert main(["health", "--timeout", "0"]) == 2


def test_the_command_line_imports_grpc_not_the_server(sidecar: Sidecar, sock_dir: Path):
    """What an exec probe costs: a fresh interpreter runs the real entry point with the container's
    environment only; the check loads grpc and the health stubs, never the sidecar's server code."""
    code = (
        "import json, sys\n"
        "from tracestore.cli import main\n"
        "rc = main(['health', '--service', sys.argv[1]])\n"
        "heavy = ['tracestore.server.rpc.service', 'tracestore.server.engine.core', 'tracestore.storage.store',\n"
        "         'fsspec',\n"
        "         'prometheus_client', 'torch', 'grpc_reflection.v1alpha.reflection']\n"
        "print(json.dumps({'rc': rc, 'loaded': [m for m in heavy if m in sys.modules],\n"
        "                  'grpc': 'grpc' in sys.modules}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACESTORE_", "GRPC_"))}
    env["TRACESTORE_UNIX_SOCKET"] = str(sidecar.config.unix_socket)
    proc = subprocess.run([sys.executable, "-c", code, LIVENESS], capture_output=True, text=True, env=env, timeout=60,
                          check=False)  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.stderr == "" and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith("SERVING: ")
    assert json.loads(lines[1]) == {"rc": 0, "loaded": [], "grpc": True}
    # and the console script itself, failing: exit 1 and one line, nothing from grpc's C core
    env["TRACESTORE_UNIX_SOCKET"] = str(sock_dir / "gone.sock")
    proc = subprocess.run([sys.executable, "-m", "tracestore.cli", "health"], capture_output=True, text=True, env=env,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 1
    assert len((proc.stdout + proc.stderr).splitlines()) == 1 and proc.stdout.startswith("UNREACHABLE: ")
