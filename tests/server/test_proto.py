"""The committed generated code in tracestore/v1 is what grpc_tools.protoc makes of proto/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("tracestore_pb2.py", "tracestore_pb2.pyi", "tracestore_pb2_grpc.py")


# What the generator writes of its own version: grpcio-tools' and its bundled protoc's. A patch
# release of grpcio-tools changes these lines and nothing else; the committed stamps are the
# runtime minimums (test_declared_minimums_match_the_generated_stamps), so they stay as generated.
STAMPS = (
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = '<stamp>'"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <stamp>"),
    (
        re.compile(r"(ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.\w+,)\n\s*\d+,\n\s*\d+,\n\s*\d+,"),
        r"\1 <stamp>",
    ),
)


def without_stamps(text: str) -> str:
    for pattern, replacement in STAMPS:
        text = pattern.sub(replacement, text)
    return text


def stale_modules(proto_root: Path, out: Path) -> list[str]:
    """Generate tracestore/v1 from ``proto_root`` into ``out``; the committed modules that differ."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(proto_root / "tracestore" / "v1" / "tracestore.proto"),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=60)
    return [
        name
        for name in GENERATED
        if without_stamps((out / "tracestore" / "v1" / name).read_text())
        != without_stamps((ROOT / "tracestore" / "v1" / name).read_text())
    ]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the [dev] extra) regenerates the code")
    stale = stale_modules(ROOT / "proto", tmp_path)
    assert not stale, f"tracestore/v1/{stale} are stale: rerun the protoc command in the .proto header"


def test_a_changed_proto_is_seen_whatever_the_stamps(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the [dev] extra) regenerates the code")
    proto = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", proto)
    path = proto / "tracestore" / "v1" / "tracestore.proto"
    text = path.read_text()
    assert "message StatRequest {" in text
    path.write_text(text.replace("message StatRequest {", "message StatRequest {\n  string note = 99;", 1))
    (tmp_path / "out").mkdir()
    assert stale_modules(proto, tmp_path / "out") == ["tracestore_pb2.py", "tracestore_pb2.pyi"]


def test_stamps_are_all_that_is_ignored() -> None:
    committed = (ROOT / "tracestore" / "v1" / "tracestore_pb2_grpc.py").read_text()
    assert without_stamps(committed) != committed  # the stamp line is there and is masked
    bumped = committed.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9")
    assert without_stamps(bumped) == without_stamps(committed)
    assert without_stamps(committed.replace("def ", "def x", 1)) != without_stamps(committed)
    pb2 = (ROOT / "tracestore" / "v1" / "tracestore_pb2.py").read_text()
    assert "<stamp>" in without_stamps(pb2).split("ValidateProtobufRuntimeVersion", 1)[1][:80]


def _stamp_versions() -> tuple[str, str]:
    grpc_py = (ROOT / "tracestore" / "v1" / "tracestore_pb2_grpc.py").read_text()
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '([^']*)'$", grpc_py, re.M)
    pb2 = (ROOT / "tracestore" / "v1" / "tracestore_pb2.py").read_text()
    pb_version = re.search(r"^# Protobuf Python Version: (\S+)$", pb2, re.M)
    assert grpc_version and pb_version
    return grpc_version.group(1), pb_version.group(1)


def test_declared_minimums_match_the_generated_stamps() -> None:
    """The committed stubs refuse older runtimes, so pyproject's minimums are exactly their stamps."""
    grpc_version, pb_version = _stamp_versions()
    client = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["client"]
    assert f"grpcio>={grpc_version}" in client, client
    assert f"protobuf>={pb_version}" in client, client


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


_ids = st.text("abcxyz-_.0123456789", min_size=1, max_size=12)
_payload = st.one_of(
    st.just(b""),
    st.binary(max_size=64),
    st.integers(1, 60_000).map(lambda n: bytes(range(256)) * (n // 256) + bytes(n % 256)),  # past SMALL_CHUNK
)


@st.composite
def _chunk(draw: st.DrawFn) -> tuple[Any, list[bytes] | None]:
    """A chunk head and its payloads (None: a shared-memory reference, no inline bytes)."""
    from tracestore.v1 import tracestore_pb2 as pb

    has_ts = draw(st.booleans())
    head = pb.Chunk(
        policy_version=draw(st.integers(0, 2**40)), trajectory=draw(_ids), site=draw(_ids),
        token_start=draw(st.integers(0, 2**62)), n_tokens=draw(st.integers(1, 2**24)),
        global_scale=draw(st.floats(0.125, 1024, width=32)), has_token_scales=has_ts,
        checksum=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip
    if draw(st.booleans()):
        head.shm.codes_offset = draw(st.integers(0, 2**40))
        head.shm.scales_offset = draw(st.integers(0, 2**40))
        head.shm.token_scales_offset = draw(st.integers(0, 2**40)) if has_ts else 0
        return head, None
    return head, [draw(_payload), draw(_payload), draw(_payload) if has_ts else b""]


def _pieces(data: bytes, cuts: int) -> list[bytes]:
    """``data`` cut into ``cuts`` + 1 buffers (a coalesced run of staged pieces)."""
    at = sorted({len(data) * i // (cuts + 1) for i in range(1, cuts + 1)})
    return [data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True)]


@given(chunks=st.lists(_chunk(), max_size=6), cuts=st.integers(0, 3), pool=st.sampled_from(["", "pool-1"]))
@settings(max_examples=120, deadline=None)
def test_spliced_payloads_round_trip(chunks: list[tuple[Any, list[bytes] | None]], cuts: int, pool: str) -> None:
    """A WriteRequest whose chunks are spliced by tracestore.wire (head + payload fields, payloads in
    pieces) is the message protobuf reads, and tracestore.wire.decode_write gives back every head
    and payload: token scales, empty payloads, shared-memory references, small and large chunks.
    The sidecar's scan of it checksums exactly the bytes sent."""
    import zlib

    from tracestore.server.rpc.ingest import scan_write

    from tracestore.v1 import tracestore_pb2 as pb
    from tracestore.wire import decode_write, inline_chunk_parts

    req = pb.WriteRequest(run="run-1", writer="w", epoch=7, sequence=3, shm_pool=pool)
    req.seals.add(trajectory="t", n_tokens=4, sites=["s"])
    want = pb.WriteRequest()
    want.CopyFrom(req)
    parts: list[Any] = []
    for head, payload in chunks:
        full = want.chunks.add()
        full.CopyFrom(head)
        if payload is None:
            req.chunks.add().CopyFrom(head)
            continue
        full.codes, full.scales, full.token_scales = payload
        ts = _pieces(payload[2], cuts) if head.has_token_scales else None
        parts += inline_chunk_parts(head.SerializeToString(), _pieces(payload[0], cuts), _pieces(payload[1], cuts), ts)
    raw = req.SerializeToString() + b"".join(bytes(p) for p in parts)

    got = pb.WriteRequest.FromString(raw)
    by_kind = sorted(want.chunks, key=lambda c: not c.HasField("shm"))  # references first, as spliced
    assert list(got.chunks) == by_kind and got.seals == want.seals and got.shm_pool == pool

    rest, decoded = decode_write(raw)
    assert not rest.chunks and rest.seals == want.seals and (rest.run, rest.epoch, rest.sequence) == ("run-1", 7, 3)
    assert len(decoded) == len(chunks)
    for (head, payloads, _), full in zip(decoded, by_kind, strict=True):
        assert head.HasField("shm") == full.HasField("shm") and head.trajectory == full.trajectory
        assert (head.checksum, head.token_start, head.n_tokens) == (full.checksum, full.token_start, full.n_tokens)
        assert [bytes(v or b"") for v in payloads] == [full.codes, full.scales, full.token_scales]

    _, scanned, crc = scan_write(raw)
    assert crc is None or crc == zlib.crc32(raw)
    for (_, _, crcs), full in zip(scanned, by_kind, strict=True):
        for part, field in zip(crcs, (full.codes, full.scales, full.token_scales), strict=True):
            assert part is None or part == zlib.crc32(field)
