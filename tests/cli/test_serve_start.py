"""``tracestore serve`` at start: one line with every effective setting (credentials redacted), a storage
check that writes and deletes a probe object, process metrics, and reflection under v1 and v1alpha."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from tracestore.server.cli import SETTINGS, check_storage, redact_options, redact_url, settings_line
from tracestore.server.config import ServerConfig
from tracestore.server.rpc.service import Sidecar

from tracestore.cli import build_parser, resolve

SECRET = "hunter2-do-not-log"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    env.update(extra)
    return env


def test_redaction() -> None:
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url(f"https://user:{SECRET}@host:9000/path") == "https://<redacted>@host:9000/path"
    assert redact_url(f"abfs://container/path?sig={SECRET}") == "abfs://container/path?<redacted>"
    opts = {"key": "AKIA", "secret": SECRET, "token": SECRET, "endpoint_url": "http://127.0.0.1:9000",
            "client_kwargs": {"region_name": "us-west-2", "aws_session_token": SECRET}, "anon": False}  # fmt: skip
    shown = redact_options(opts)
    assert SECRET not in json.dumps(shown) and "AKIA" not in json.dumps(shown)
    assert shown["endpoint_url"] == "http://127.0.0.1:9000" and shown["client_kwargs"]["region_name"] == "us-west-2"
    assert shown["secret"] == shown["key"] == shown["client_kwargs"]["aws_session_token"] == "<redacted>"


def test_settings_line_has_every_setting_and_no_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in list(os.environ):
        if k.startswith("TRACESTORE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TRACESTORE_STORAGE_OPTIONS", json.dumps({"secret": SECRET, "endpoint_url": "http://e:1"}))
    monkeypatch.setenv("TRACESTORE_MEMORY_BUDGET_MIB", "2048")
    ns = resolve(build_parser().parse_args(["serve", "--storage", f"s3://u:{SECRET}@bucket/p", "--wal-dir", "wal"]))
    from tracestore.server.cli import config_from_args

    line = settings_line(ns, config_from_args(ns))
    assert SECRET not in line and "\n" not in line
    for s in SETTINGS:
        assert f" {s.dest.replace('_', '-')}=" in line, s.flag
    assert "storage=s3://<redacted>@bucket/p(flag)" in line and "memory-budget-mib=2048(env)" in line
    assert f"wal-dir={os.path.abspath('wal')}(flag)" in line and "port=7433 " in line
    assert '"endpoint_url":"http://e:1"' in line and '"secret":"<redacted>"' in line


def _start(tmp_path: Path, *argv: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tracestore", "serve", "--port", "0", "--metrics-port", "0",
                             "--ready-file", str(tmp_path / "ready.json"), *argv], cwd=tmp_path,
                            env=_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_ready(proc: subprocess.Popen[str], tmp_path: Path) -> dict:
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(proc.stderr.read() if proc.stderr else "")
        time.sleep(0.05)
    return json.loads((tmp_path / "ready.json").read_text())


def test_serve_logs_settings_and_checks_storage(tmp_path: Path) -> None:
    options = json.dumps({"auto_mkdir": True, "password": SECRET})  # LocalFileSystem ignores unknown options
    proc = _start(tmp_path, "--storage", (tmp_path / "data").as_uri(), TRACESTORE_STORAGE_OPTIONS=options)
    try:
        info = _wait_ready(proc, tmp_path)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).read().decode()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    err = proc.stderr.read() if proc.stderr else ""
    assert SECRET not in err
    (line,) = [x for x in err.splitlines() if " serve, pid " in x]
    assert f"storage={(tmp_path / 'data').as_uri()}(flag)" in line and '"password":"<redacted>"' in line
    assert f"wal-dir={tmp_path / 'tracestore-wal'} " in line and "memory-budget-mib=1024 " in line
    assert "storage check: wrote and deleted a probe object at" in err
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith(".tracestore-probe")]
    if sys.platform.startswith("linux"):
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"):
            assert f"\n{name} " in metrics, name


def _unwritable(tmp_path: Path) -> str:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the storage root's parent directory should be")
    return (blocker / "data").as_uri()


def test_storage_check_fail_exits_3(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tracestore", "serve", "--storage", _unwritable(tmp_path),
                           "--storage-check", "fail", "--port", "0", "--metrics-port", "off"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "storage check FAILED" in x]
    assert "cannot write a probe object at file://" in line and "exiting (--storage-check fail)" in line
    assert "Traceback" not in proc.stderr


def test_storage_check_warn_serves_with_an_error_logged(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--storage", _unwritable(tmp_path))
    try:
        _wait_ready(proc, tmp_path)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    err = proc.stderr.read() if proc.stderr else ""
    (line,) = [x for x in err.splitlines() if "storage check FAILED" in x]
    assert " ERROR " in line and "Serving anyway (--storage-check warn)" in line and "write-ahead log" in line


def test_check_storage_memory() -> None:
    ok, what = check_storage(ServerConfig(storage="memory://probe-check", wal_dir=None))
    assert ok and "wrote and deleted a probe object at memory://probe-check" in what


def test_reflection_v1_and_v1alpha() -> None:
    sc = Sidecar(ServerConfig(storage="memory://reflection", wal_dir=None, port=0, metrics_port=None)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sc.port}") as ch:
            for service in ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"):
                call = ch.stream_stream(
                    f"/{service}/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="tracestore.v1.TraceStore"),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="grpc.reflection.v1.ServerReflection"
                    ),
                ]
                listed, described = call(iter(requests), timeout=10), []
                names = []
                for resp in listed:
                    if resp.HasField("list_services_response"):
                        names = [s.name for s in resp.list_services_response.service]
                    else:
                        raw = resp.file_descriptor_response.file_descriptor_proto[0]
                        described.append(descriptor_pb2.FileDescriptorProto.FromString(raw).package)
                assert {"tracestore.v1.TraceStore", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"} <= set(names), names  # fmt: skip
                assert described == ["tracestore.v1", "grpc.reflection.v1"], described
    finally:
        sc.stop(1)


def test_port_off_serves_the_unix_socket_only(tmp_path: Path) -> None:
    """Before: TCP could not be turned off (`--port off` was refused), so on a multi-user host any
    local user reached the sidecar on 127.0.0.1 whatever the unix socket's mode."""
    from tracestore.errors import ConfigError
    from tracestore.v1 import tracestore_pb2 as pb

    with pytest.raises(ConfigError, match=r"port off \(--port off\) leaves no listener: give --unix-socket"):
        ServerConfig(storage="memory://p", wal_dir=None, port=None, metrics_port=None)
    sock = tmp_path / "ts.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tracestore", "serve", "--port", "off", "--metrics-port", "off",
                             "--unix-socket", str(sock), "--storage", (tmp_path / "data").as_uri(),
                             "--wal-dir", "off", "--ready-file", str(tmp_path / "ready.json")], cwd=tmp_path,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        ready = _wait_ready(proc, tmp_path)
        assert ready["port"] is None  # nothing bound on TCP
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            stat = ch.unary_unary("/tracestore.v1.TraceStore/Stat")(pb.StatRequest().SerializeToString(), timeout=10)
            assert pb.StatResponse.FromString(stat).version
        pid = str(proc.pid)
        listening = [line for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[3] == "0A"]
        inodes = {line.split()[9] for line in listening} | {
            line.split()[9] for line in Path("/proc/net/tcp6").read_text().splitlines()[1:] if line.split()[3] == "0A"
        }
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert not [fd for fd in fds if fd.startswith("socket:[") and fd[8:-1] in inodes], "a TCP socket listens"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    err = proc.stderr.read() if proc.stderr else ""
    assert "no TCP port (--port off" in err
