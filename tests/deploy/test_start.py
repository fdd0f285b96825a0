"""The shipped pod's sidecar starts, and its probes pass: `tracestore serve` run with the image's ENV
overlaid by the container's env from deploy/k8s (each mounted path mapped to a temporary directory,
ports made ephemeral), then every probe's exec command run with the same environment.

The base comes from the raw rollout.yaml (no kubectl needed); serve-reads needs `kubectl kustomize`
(else skipped) and the `cryptography` package for a throwaway certificate. Listener addresses are
read from /proc/net/tcp (Linux), where the pod IP's "0.0.0.0" and loopback differ.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.timeout(180)

READ_TOKEN = "trainer-token-for-the-deploy-test"
ANY = {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}


def sidecar_of(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "tracestore"]
    return sidecar, spec


def container_env(h: Any, sidecar: dict[str, Any], root: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """The process environment of the sidecar container, every path under a volume mount mapped
    into ``root`` (a path on no volume fails: the root filesystem is read-only). Returns it with
    the mount -> local directory map."""
    mounts = {m["mountPath"]: root / m["name"] for m in sidecar["volumeMounts"]}
    for d in mounts.values():
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACESTORE_", "GRPC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    wanted = {**h.image_env(), **{e["name"]: e["value"] for e in sidecar["env"] if "value" in e}}
    for name, value in wanted.items():
        path = value[len("file://") :] if value.startswith("file://") else value
        if path.startswith("/"):
            under = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
            mount = max(under, key=len) if under else None
            if mount is None and name == "TRACESTORE_STORAGE":
                value = f"file://{root / 'storage'}"  # object storage stands in for s3://
            else:
                assert mount is not None, f"{name}={value} is on no volume (read-only root filesystem)"
                local = str(mounts[mount]) + path[len(mount) :]
                value = f"file://{local}" if value.startswith("file://") else local
        elif name == "TRACESTORE_STORAGE":
            value = f"file://{root / 'storage'}"
        env[name] = value
    env["TRACESTORE_PORT"] = "0"  # both checked statically (test_k8s); here free ports
    env["TRACESTORE_METRICS_PORT"] = "0"
    env["TRACESTORE_READY_FILE"] = str(root / "ready.json")
    if os.geteuid() != 0 and "TRACESTORE_SOCKET_GROUP" in env:
        env["TRACESTORE_SOCKET_GROUP"] = str(os.getgid())  # only root may chown to a group it is not in
    return env, mounts


def _address(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, little-endian here); an
    IPv4-mapped IPv6 address (gRPC's dual-stack sockets) as its IPv4 address."""
    raw = b"".join(bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, len(hexaddr), 8))
    ip = ipaddress.ip_address(raw)
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def listeners(port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses listening on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(_address(addr))
    return found


class Started:
    def __init__(self, proc: subprocess.Popen[bytes], env: dict[str, str], info: dict[str, Any], log: Path) -> None:
        self.proc, self.env, self.info, self.log = proc, env, info, log


def start(env: dict[str, str], root: Path) -> Started:
    log = root / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tracestore.cli", "serve"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=root)  # fmt: skip
    ready = Path(env["TRACESTORE_READY_FILE"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tracestore serve exited {proc.returncode} at start:\n{log.read_text()[-3000:]}")
        if ready.exists():
            return Started(proc, env, json.loads(ready.read_text()), log)
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"tracestore serve not ready in 60 s:\n{log.read_text()[-3000:]}")


def stop(s: Started) -> None:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            assert s.proc.wait(30) == 0, s.log.read_text()[-3000:]
        finally:
            if s.proc.poll() is None:
                s.proc.kill()


def run_probes(sidecar: dict[str, Any], env: dict[str, str]) -> None:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = sidecar[kind]["exec"]["command"]
        assert command[0] == "tracestore"
        argv = [sys.executable, "-m", "tracestore.cli", *command[1:]]
        limit = sidecar[kind]["timeoutSeconds"] + 30  # the kubelet's limit, plus a loaded CI box's slack
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit, check=False)
        out = (proc.stdout + proc.stderr).splitlines()
        assert proc.returncode == 0 and len(out) == 1 and out[0].startswith("SERVING: "), (kind, out)


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tsd-", dir="/tmp"))  # short: unix socket paths hold 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def base_sidecar(h: Any) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((h.DEPLOY / "k8s" / "base" / "rollout.yaml").read_text()) if d]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    return sidecar_of(deploy)[0]


def test_base_sidecar_starts_and_passes_its_probes(h, root: Path):
    sidecar = base_sidecar(h)
    env, _ = container_env(h, sidecar, root)
    s = start(env, root)
    try:
        run_probes(sidecar, env)
        port, metrics_port = s.info["port"], s.info["metrics_port"]
        sock = Path(env["TRACESTORE_UNIX_SOCKET"])
        assert (sock.stat().st_mode & 0o777, sock.stat().st_gid) == (0o660, int(env["TRACESTORE_SOCKET_GROUP"]))
        if os.path.exists("/proc/net/tcp"):
            grpc_on = listeners(port)
            assert grpc_on and all(a.is_loopback for a in grpc_on), f"gRPC must listen on loopback only: {grpc_on}"
            assert listeners(metrics_port) & ANY, "metrics on every interface (the pod IP)"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            assert b"tracestore_degraded{" in resp.read()
    finally:
        stop(s)


def test_the_previous_base_exits_2_at_start(h, root: Path):
    """Negative control: gRPC on 0.0.0.0 without TLS and tokens (the base before this fix)."""
    env, _ = container_env(h, base_sidecar(h), root)
    env["TRACESTORE_HOST"] = "0.0.0.0"
    proc = subprocess.run([sys.executable, "-m", "tracestore.cli", "serve"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 2 and "is not loopback" in proc.stderr, proc.stderr


def test_serve_reads_sidecar_starts_with_tls_and_tokens(h, root: Path, tmp_path: Path):
    pytest.importorskip("cryptography", reason="throwaway certificates need the cryptography package (dev extra)")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tracestore.server.security.tls import write_test_pki

    shutil.copytree(h.DEPLOY / "k8s", tmp_path / "k8s")
    kust = tmp_path / "k8s" / "overlays" / "vllm" / "kustomization.yaml"
    doc = yaml.safe_load(kust.read_text())
    doc["components"] = ["../../components/serve-reads"]
    kust.write_text(yaml.safe_dump(doc))
    (deploy,) = [d for d in h.kustomize(tmp_path / "k8s" / "overlays" / "vllm") if d["kind"] == "Deployment"]
    sidecar, pod = sidecar_of(deploy)
    env, mounts = container_env(h, sidecar, root)
    # the Secrets' keys, as the kubelet would project them (items: key -> path)
    pki = write_test_pki(tmp_path / "pki")
    digest = hashlib.sha256(READ_TOKEN.encode()).hexdigest()
    content = {
        "tls.crt": pki["server"].read_bytes(),
        "tls.key": pki["server_key"].read_bytes(),
        "tokens": f"sha256:{digest} read:* trainer\n".encode(),
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in sidecar["volumeMounts"]:
        secret = volumes[m["name"]].get("secret")
        for item in (secret or {}).get("items", []):
            target = mounts[m["mountPath"]] / item["path"]
            target.write_bytes(content[item["key"]])
            target.chmod(secret["defaultMode"])
    s = start(env, root)
    try:
        run_probes(sidecar, env)  # over the unix socket: no token, no TLS
        port = s.info["port"]
        if os.path.exists("/proc/net/tcp"):
            assert listeners(port) & ANY, "gRPC on every interface (the pod IP)"
        creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            stat = ch.unary_unary("/tracestore.v1.TraceStore/Stat")
            with pytest.raises(grpc.RpcError) as refused:
                stat(b"", timeout=10)  # no token
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)  # plaintext refused
    finally:
        stop(s)
