"""Storage fixtures: one conformance suite over memory://, file:// and s3:// (moto's standalone
S3 server on loopback, started once per session), plus record generators shared by the tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tracestore import RecordChunk, RunSpec, SiteSpec
from tracestore.storage.store import Store

SITES = (
    SiteSpec("layers.20.mlp.input", "moe_input", 20, 64),  # NVFP4, b=1: 8 code + 4 scale bytes per row
    SiteSpec("layers.21.mlp.input", "moe_input", 21, 64, bits=2, rows_per_token=2),
    SiteSpec("layers.3.attn.k", "key", 3, 64, format="mxfp4", bits=4),
)
RUN = "run-1"
SPEC = RunSpec(RUN, SITES)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server", reason="s3 tests need moto[server]>=5.2.5")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_options(endpoint: str, timeout: float = 10.0) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-west-2"},
        "config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout, "retries": {"max_attempts": 2}},
    }


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options(s3_endpoint))
    bucket = f"ts-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return bucket


@pytest.fixture(params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any] | None]:
    """(url, storage_options) of a fresh, empty storage root on each backend."""
    if request.param == "memory":
        return f"memory://ts-{uuid.uuid4().hex}", None
    if request.param == "file":
        return f"file://{tmp_path}/store", None
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{uuid.uuid4().hex}", s3_options(endpoint)


@pytest.fixture
def store(backend) -> Store:
    url, opts = backend
    st = Store(url, opts, timeout=30.0)
    st.put_run(SPEC)
    return st


def make_chunk(
    site: SiteSpec,
    trajectory: str,
    token_start: int,
    n_tokens: int,
    *,
    version: int = 0,
    rng: np.random.Generator | None = None,
    token_scales: bool = False,
    run: str = RUN,
) -> RecordChunk:
    rng = rng or np.random.default_rng()
    rows = n_tokens * site.rows_per_token
    return RecordChunk(
        run,
        version,
        trajectory,
        site.name,
        token_start,
        n_tokens,
        rng.integers(0, 256, (rows, site.code_bytes), dtype=np.uint8),
        rng.integers(0, 256, (rows, site.scale_bytes), dtype=np.uint8),
        float(np.float32(rng.uniform(0.01, 2.0))) if site.format == "nvfp4" else 1.0,
        rng.standard_normal(rows).astype(np.float32) if token_scales else None,
    )


def expected_rows(chunks: list[RecordChunk], site: SiteSpec, segments, cols=None) -> dict[str, np.ndarray]:
    """Reference: a plain Python walk over the plan, token by token (no shared code with the reader)."""
    k = site.rows_per_token
    lo, hi = cols or (0, site.width)
    cb = slice(lo * site.bits // 8, hi * site.bits // 8)
    sb = slice(lo // site.fmt.block, hi // site.fmt.block)
    by_token = {}
    for c in chunks:
        if c.site != site.name:
            continue
        for t in range(c.n_tokens):
            by_token[(c.policy_version, c.trajectory, c.token_start + t)] = (c, t)
    codes, scales, valid, g = [], [], [], []
    for traj, a, b in segments:
        for tok in range(a, b):
            hit = None
            if traj is not None:
                versions = sorted({v for v, tr, _ in by_token if tr == traj}, reverse=True)
                for v in versions:
                    if (v, traj, tok) in by_token:
                        hit = by_token[(v, traj, tok)]
                        break
            for r in range(k):
                if hit is None:
                    codes.append(np.zeros(cb.stop - cb.start, np.uint8))
                    scales.append(np.zeros(sb.stop - sb.start, np.uint8))
                    valid.append(False)
                    g.append(1.0)
                else:
                    c, t = hit
                    codes.append(c.codes[t * k + r, cb])
                    scales.append(c.scales[t * k + r, sb])
                    valid.append(True)
                    g.append(c.global_scale)
    return {
        "codes": np.array(codes, np.uint8).reshape(len(valid), cb.stop - cb.start),
        "scales": np.array(scales, np.uint8).reshape(len(valid), sb.stop - sb.start),
        "valid": np.array(valid, bool),
        "global_scale": np.array(g, np.float32),
    }
