"""Record model: validation on construction, checksums, lossless chunk <-> Arrow round trips."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracestore import (
    CHUNK_SCHEMA,
    ConfigError,
    CorruptionError,
    DTypeError,
    NotFoundError,
    PrefixLink,
    RecordChunk,
    RunSpec,
    ShapeError,
    SiteSpec,
    TrajectorySeal,
    ValidationError,
    chunks_to_table,
    table_to_chunks,
    validate_id,
)
from tracestore.storage.arrow import SCHEMA_VERSION_KEY, schema_version_of


def make_chunk(site: SiteSpec, n_tokens: int = 3, token_start: int = 0, seed: int = 0, **kw) -> RecordChunk:
    rng = np.random.default_rng(seed)
    rows = n_tokens * site.rows_per_token
    args = dict(
        run="run-1",
        policy_version=0,
        trajectory="t0",
        site=site.name,
        token_start=token_start,
        n_tokens=n_tokens,
        codes=rng.integers(0, 256, (rows, site.code_bytes), dtype=np.uint8),
        scales=rng.integers(0, 256, (rows, site.scale_bytes), dtype=np.uint8),
        global_scale=0.5,
    )
    args.update(kw)
    return RecordChunk(**args)


# ---------------------------------------------------------------- ids


@pytest.mark.parametrize("value", ["a", "run-1", "r.2_x", "0" * 64])
def test_run_ids_ok(value):
    assert validate_id("run", value) == value


@pytest.mark.parametrize(
    "value",
    ["", "A", "-a", ".a", "a/b", "a..b", "..", "a\0b", "0" * 65, "a b", "a:b", "ü"],
)
def test_run_ids_rejected(value):
    with pytest.raises(ValidationError, match="invalid run id"):
        validate_id("run", value)


@pytest.mark.parametrize("value", ["T", "traj:7", "layers.23.mlp.input", "a-b_c", "x" * 128])
def test_other_ids_ok(value):
    for kind in ("trajectory", "site", "writer"):
        assert validate_id(kind, value) == value


@pytest.mark.parametrize("value", ["", "/abs", "a/b", "..", "a..b", "a\\b", "a\0", "x" * 129, ".hidden", "_x", 7])
def test_other_ids_rejected(value):
    with pytest.raises(ValidationError):
        validate_id("trajectory", value)


def test_unknown_id_kind():
    with pytest.raises(ConfigError):
        validate_id("bucket", "a")


# ---------------------------------------------------------------- sites and runs


def test_site_spec_derived_sizes():
    s = SiteSpec("layers.23.mlp.input", "moe_input", 23, 2048)
    assert (s.format, s.bits, s.code_bytes, s.scale_bytes, s.fmt.block) == ("nvfp4", 1, 256, 128, 16)
    m = SiteSpec("k", "key", 3, 96, format="mxfp4-rceil", bits=3)
    assert (m.code_bytes, m.scale_bytes, m.fmt.scale_rule) == (36, 3, "rceil")


@pytest.mark.parametrize(
    "kw,err",
    [
        (dict(width=2040), ShapeError),  # not a multiple of 16
        (dict(width=48, format="mxfp4"), ShapeError),  # not a multiple of 32
        (dict(width=0), ValidationError),
        (dict(bits=0), ConfigError),
        (dict(bits=5), ConfigError),
        (dict(kind="mlp"), ConfigError),
        (dict(format="fp8"), ConfigError),
        (dict(layer=-1), ValidationError),
        (dict(rows_per_token=0), ValidationError),
        (dict(name="a/b"), ValidationError),
    ],
)
def test_site_spec_rejects(kw, err):
    args = dict(name="s", kind="other", layer=0, width=64)
    args.update(kw)
    with pytest.raises(err):
        SiteSpec(**args)


def test_run_spec_json_round_trip_and_lookup():
    spec = RunSpec("run-1", (SiteSpec("a", "key", 0, 64), SiteSpec("b", "moe_input", 1, 128, bits=2, rows_per_token=2)))
    assert RunSpec.from_json(spec.to_json()) == spec
    assert spec.site("b").rows_per_token == 2
    with pytest.raises(NotFoundError, match="no site 'c'"):
        spec.site("c")
    with pytest.raises(ValidationError, match="duplicate"):
        RunSpec("run-1", (SiteSpec("a", "key", 0, 64), SiteSpec("a", "key", 1, 64)))


# ---------------------------------------------------------------- chunks

SITE = SiteSpec("s", "moe_input", 0, 64, bits=2, rows_per_token=2)


def test_chunk_validate_and_checksum():
    c = make_chunk(SITE).validate(SITE)
    assert c.n_rows == 6 and c.rows_per_token == 2 and c.token_end == 3
    d = make_chunk(SITE)
    assert c.checksum == d.checksum and c.same_bytes(d)
    e = make_chunk(SITE, seed=1)
    assert c.checksum != e.checksum and not c.same_bytes(e)
    # the key is covered by the checksum too
    assert make_chunk(SITE, trajectory="t1").checksum != c.checksum
    assert make_chunk(SITE, global_scale=0.25).checksum != c.checksum
    ts = make_chunk(SITE, token_scales=np.ones(6, np.float32))
    assert ts.checksum != c.checksum


@pytest.mark.parametrize(
    "kw,err",
    [
        (dict(codes=np.zeros((6, 16), np.int8)), DTypeError),
        (dict(codes=np.zeros(96, np.uint8)), ShapeError),
        (dict(scales=np.zeros((5, 4), np.uint8)), ShapeError),
        (
            dict(n_tokens=4, codes=np.zeros((6, 16), np.uint8), scales=np.zeros((6, 4), np.uint8)),
            ShapeError,
        ),
        (dict(n_tokens=0), ValidationError),
        (dict(token_start=-1), ValidationError),
        (dict(token_start=2**62), ValidationError),  # before: accepted; inspect then counted 6.2e23 site-tokens
        (dict(token_start=2**40 - 1), ValidationError),  # ends past 2^40 with its 6 tokens
        (dict(policy_version=-2), ValidationError),
        (dict(global_scale=float("nan")), ValidationError),
        (dict(global_scale=0.0), ValidationError),
        (dict(token_scales=np.ones(5, np.float32)), ShapeError),
        (dict(token_scales=np.ones(6, np.float64)), DTypeError),
        (dict(trajectory="../x"), ValidationError),
    ],
)
def test_chunk_rejects(kw, err):
    with pytest.raises(err):
        make_chunk(SITE, **kw)


def test_chunk_validate_against_site():
    c = make_chunk(SITE)
    with pytest.raises(ShapeError, match="codes must be uint8"):
        c.validate(SiteSpec("s", "moe_input", 0, 64, bits=1, rows_per_token=2))
    with pytest.raises(ShapeError):
        c.validate(SiteSpec("s", "moe_input", 0, 64, bits=2, rows_per_token=1))
    with pytest.raises(ValidationError, match="no global scale"):
        mx = SiteSpec("s", "moe_input", 0, 64, format="mxfp4", bits=2, rows_per_token=2)
        make_chunk(mx).validate(mx)
    with pytest.raises(ValidationError):
        c.validate(SiteSpec("other", "moe_input", 0, 64, bits=2, rows_per_token=2))


def test_seal_and_link():
    s = TrajectorySeal("run-1", 3, "t0", 10, ("a", "b"))
    assert TrajectorySeal.from_dict(s.to_dict()) == s
    with pytest.raises(ValidationError):
        TrajectorySeal("run-1", 3, "t0", 0, ("a",))
    with pytest.raises(ValidationError):
        TrajectorySeal("run-1", 3, "t0", 5, ("a", "a"))
    with pytest.raises(ValidationError):
        TrajectorySeal("run-1", 3, "t0", 5, "a")
    link = PrefixLink("run-1", 3, "t1", "t0", 4)
    assert PrefixLink.from_dict(link.to_dict()) == link
    with pytest.raises(ValidationError, match="itself"):
        PrefixLink("run-1", 3, "t0", "t0", 4)
    with pytest.raises(ValidationError):
        PrefixLink("run-1", 3, "t1", "a/../b", 4)


# ---------------------------------------------------------------- Arrow


def test_schema_version_in_metadata():
    t = chunks_to_table([make_chunk(SITE)])
    assert t.schema.equals(CHUNK_SCHEMA) and schema_version_of(t.schema) == 1
    bad = t.replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"})
    with pytest.raises(CorruptionError, match="schema version 99"):
        table_to_chunks(bad)
    with pytest.raises(CorruptionError, match="schema_version"):
        table_to_chunks(t.replace_schema_metadata({}))


@pytest.mark.parametrize("n_tokens", [3, 600])
def test_zero_copy_table_equals_copied_table(n_tokens: int):
    """``zero_copy=True`` points the byte columns at the chunks' arrays (one Arrow chunk per value)
    when values are large (600 tokens here: ~74 KB codes per chunk), and copies them into one
    buffer when they are small; either way the table holds the same values as the copied one."""
    from tracestore.storage import arrow

    big = SiteSpec("layers.7.mlp.input", "moe_input", 7, 1024)
    originals = [make_chunk(big, n_tokens, seed=i, trajectory=f"t{i}") for i in range(4)]
    originals.append(make_chunk(big, n_tokens, seed=9, trajectory="t9", token_scales=np.ones(n_tokens, np.float32)))
    views = chunks_to_table(originals, zero_copy=True)
    copied = chunks_to_table(originals)
    assert views.equals(copied)
    chunked = views.column("codes").num_chunks
    large = originals[0].codes.nbytes >= arrow.VIEW_MIN_BYTES
    assert chunked == (len(originals) if large else 1)
    if large:  # no copy: the Arrow values are the chunks' memory
        buf = views.column("codes").chunk(2).buffers()[2]
        assert buf.address == originals[2].codes.ctypes.data
    assert [c.checksum for c in table_to_chunks(views)] == [c.checksum for c in originals]


def test_arrow_detects_flipped_byte():
    t = chunks_to_table([make_chunk(SITE), make_chunk(SITE, trajectory="t9")])
    codes = t.column("codes").to_pylist()
    codes[1] = bytes([codes[1][0] ^ 1]) + codes[1][1:]
    t = t.set_column(t.schema.get_field_index("codes"), "codes", pa.array(codes, pa.large_binary()))
    with pytest.raises(CorruptionError, match="t9.*checksum mismatch"):
        table_to_chunks(t, where="unit")
    assert len(table_to_chunks(t, verify=False)) == 2


_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True).filter(lambda s: ".." not in s)


@st.composite
def chunks(draw):
    fmt = draw(st.sampled_from(["nvfp4", "mxfp4", "mxfp4-rceil"]))
    block = 16 if fmt == "nvfp4" else 32
    site = SiteSpec(
        draw(_ids),
        draw(st.sampled_from(["moe_input", "key", "value", "other"])),
        draw(st.integers(0, 80)),
        block * draw(st.integers(1, 6)),
        format=fmt,
        bits=draw(st.integers(1, 4)),
        rows_per_token=draw(st.integers(1, 3)),
    )
    n = draw(st.integers(1, 7))
    rows = n * site.rows_per_token
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ts = None
    if draw(st.booleans()):
        ts = rng.standard_normal(rows).astype(np.float32)
        if draw(st.booleans()):  # any float32 bit pattern must survive, NaN payloads included
            ts = rng.integers(0, 2**32, rows, dtype=np.uint32).view(np.float32)
    g = 1.0 if fmt != "nvfp4" else draw(st.floats(2.0**-100, 2.0**100, width=32))
    return (
        RecordChunk(
            draw(st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True).filter(lambda s: ".." not in s)),
            draw(st.integers(0, 2**40)),
            draw(_ids),
            site.name,
            draw(st.integers(0, 2**40 - n)),
            n,
            rng.integers(0, 256, (rows, site.code_bytes), dtype=np.uint8),
            rng.integers(0, 256, (rows, site.scale_bytes), dtype=np.uint8),
            g,
            ts,
        ),
        site,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(chunks(), min_size=0, max_size=6))
def test_arrow_round_trip(items):
    originals = [c.validate(s) for c, s in items]
    table = chunks_to_table(originals)
    assert table.num_rows == len(originals)
    # through Arrow IPC as well, so the bytes really leave this process's objects
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    back = table_to_chunks(pa.ipc.open_stream(sink.getvalue()).read_all())
    assert len(back) == len(originals)
    for a, b in zip(originals, back, strict=True):
        assert a.same_bytes(b)
        assert a.checksum == b.checksum
        assert a.codes.shape == b.codes.shape and a.scales.shape == b.scales.shape
        assert (a.token_scales is None) == (b.token_scales is None)
        if a.token_scales is not None:
            assert a.token_scales.tobytes() == b.token_scales.tobytes()


def test_fast_crc32_matches_zlib():
    import zlib

    from tracestore.checksum import crc32

    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert crc32(data.data) == zlib.crc32(data.data)
        assert crc32(data.data, 12345) == zlib.crc32(data.data, 12345)
    ts = rng.standard_normal(9).astype(np.float32)
    assert crc32(ts.data) == zlib.crc32(ts.data)  # a non-byte buffer format


def test_seals_and_links_end_by_two_to_the_forty() -> None:
    from tracestore.records import MAX_TOKEN_END, PrefixLink, TrajectorySeal

    TrajectorySeal("r", 0, "t", MAX_TOKEN_END, ("s",))
    with pytest.raises(ValidationError, match="2\\^40"):
        TrajectorySeal("r", 0, "t", 2**62, ("s",))
    with pytest.raises(ValidationError, match="2\\^40"):
        PrefixLink("r", 0, "t", "u", MAX_TOKEN_END + 1)
