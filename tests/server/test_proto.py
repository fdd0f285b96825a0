"""The committed generated code in tracestore/v1 is what grpc_tools.protoc makes of proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("tracestore_pb2.py", "tracestore_pb2.pyi", "tracestore_pb2_grpc.py")


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the [dev] extra) regenerates the code")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-Iproto",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        "proto/tracestore/v1/tracestore.proto",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=60)
    for name in GENERATED:
        fresh = (tmp_path / "tracestore" / "v1" / name).read_text()
        committed = (ROOT / "tracestore" / "v1" / name).read_text()
        assert fresh == committed, f"tracestore/v1/{name} is stale: rerun the protoc command in the .proto header"


def test_enums_have_unspecified_zero() -> None:
    from tracestore.v1 import tracestore_pb2 as pb

    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name


def test_one_request_and_response_message_per_rpc() -> None:
    from tracestore.v1 import tracestore_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["TraceStore"]
    inputs = [m.input_type.name for m in svc.methods]
    outputs = [m.output_type.name for m in svc.methods]
    assert len(set(inputs)) == len(inputs) and len(set(outputs)) == len(outputs)
    for m in svc.methods:
        assert m.input_type.name == m.name + "Request" and m.output_type.name == m.name + "Response"
