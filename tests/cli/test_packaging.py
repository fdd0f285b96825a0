"""Packaging: extras by role, one source for the version, LICENSE and CHANGELOG."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tracestore

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PROJECT["project"]["optional-dependencies"]
SERVER_ONLY = ("grpcio-health-checking", "grpcio-reflection", "prometheus-client")


def _names(extra: str, seen: set[str] | None = None) -> set[str]:
    """Distribution names an extra installs, following tracestore[...] self-references."""
    seen = set() if seen is None else seen
    out: set[str] = set()
    for req in EXTRAS[extra]:
        m = re.match(r"tracestore\[([\w,-]+)\]", req)
        if m:
            for e in m.group(1).split(","):
                if e not in seen:
                    seen.add(e)
                    out |= _names(e, seen)
        else:
            out.add(re.split(r"[<>=;\[ ]", req, maxsplit=1)[0].lower())
    return out


def test_extras_by_role() -> None:
    for extra in ("client", "server", "s3", "kernels-cu12", "kernels-cu13", "demo", "dev"):
        assert extra in EXTRAS, extra
    client = _names("client")
    assert {"grpcio", "protobuf"} <= client and not client & set(SERVER_ONLY) and "torch" not in client
    assert set(SERVER_ONLY) | client <= _names("server")
    assert "cupy-cuda12x" in _names("kernels-cu12") and "cupy-cuda13x" in _names("kernels-cu13")
    assert not [e for e in EXTRAS if "triton" in _names(e)], "nothing imports triton"
    assert {"torch", "transformers", "grpcio-reflection"} <= _names("demo")
    assert _names("demo") | _names("s3") | {"pytest", "moto"} <= _names("dev")


# Everything a recording engine or a reading trainer imports, with the server-only packages and
# torch made unimportable: [client] is enough for them.
_CLIENT_ONLY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("grpc_health", "grpc_reflection", "prometheus_client", "torch"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
from tracestore.client import RolloutRecorder, SiteOutput, GuidanceReader
from tracestore.client import transport
from tracestore.client.record import recorder, staging, traceref, slab, session, copier
from tracestore.client.read import reader, row_sources, read_process
import grpc
from tracestore.v1 import tracestore_pb2_grpc
print("ok")
"""


def test_client_needs_no_server_packages() -> None:
    proc = subprocess.run([sys.executable, "-c", _CLIENT_ONLY], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_one_source_for_the_version() -> None:
    assert "version" not in PROJECT["project"] and "version" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tracestore.__version__"}
    assert importlib.metadata.version("tracestore") == tracestore.__version__


def test_license_and_changelog() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["project"]["license"] == "Apache-2.0"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(tracestore.__version__)}\]?", changelog, re.M)
