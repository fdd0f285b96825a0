"""Two shard files when two cores should be used: a large write_shard is cut by trajectory into
shard ``seq`` and shard ``seq + PART_SEQ_STRIDE``, encoded side by side, each a complete shard with
its own manifest. Readers find every record in either file; a repeat of the call is a no-op, also
when it chooses the other layout; nothing is visible before both files are durable, and a crash
between the two manifests (a SIGKILL at ``store.manifest_published:1``) leaves whole trajectories
of one file visible, which the repeat the sidecar's WAL replay makes completes."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tracestore import ConfigError, ConflictError, PrefixLink, TrajectorySeal, ValidationError
from tracestore.cli.inspect import validate_version
from tracestore.plan import MicrobatchPlan
from tracestore.storage.reader import StoreReader
from tracestore.storage.shard_write import check_shard_inputs, split_shard
from tracestore.storage.store import (
    PART_SEQ_STRIDE,
    SHARD_FILES_ENV,
    SPLIT_MIB_ENV,
    SPLIT_MIN_BYTES,
    SPLIT_MIN_CHUNK_BYTES,
    Store,
    default_shard_files,
    default_split_min_bytes,
)

from .conftest import RUN, SITES, SPEC, expected_rows, make_chunk

S0, S1, S2 = SITES
TRAJS = [f"t{i}" for i in range(5)]


def _chunks(seed: int = 1, trajs: list[str] = TRAJS) -> list:
    rng = np.random.default_rng(seed)
    # trajectories of different lengths, so the split has something to balance
    return [
        make_chunk(s, t, a, 8, rng=rng, token_scales=s is S1)
        for i, t in enumerate(trajs)
        for s in SITES
        for a in range(0, 8 * (1 + i % 3), 8)
    ]


def _split_store(url: str, opts=None, **kw) -> Store:
    """A store that writes every shard of two or more trajectories as two files."""
    st = Store(url, opts, timeout=30.0, shard_files=2, split_min_bytes=0, split_min_chunk_bytes=0, **kw)
    st.put_run(SPEC)
    return st


def _check_all(store: Store, chunks: list, trajs: list[str] = TRAJS) -> None:
    ends = {t: max(c.token_start + c.n_tokens for c in chunks if c.trajectory == t) for t in trajs}
    plan = MicrobatchPlan([(t, 0, ends[t]) for t in trajs])
    res = StoreReader(Store(store.url, store.storage.storage_options), RUN).read(plan)
    for s in SITES:
        exp = expected_rows(chunks, s, plan.segments)
        np.testing.assert_array_equal(res[s.name].valid, exp["valid"])
        np.testing.assert_array_equal(res[s.name].codes, exp["codes"])
        np.testing.assert_array_equal(res[s.name].scales, exp["scales"])
        np.testing.assert_array_equal(res[s.name].global_scale, exp["global_scale"])


def _entries(store: Store) -> list[tuple[str, str, int]]:
    fresh = Store(store.url, store.storage.storage_options)
    return sorted((e.trajectory, e.site, e.token_start) for m in fresh.manifests(RUN, 0) for e in m.chunks)


# ---------------------------------------------------------------------------- the cut


def test_split_keeps_trajectories_and_link_groups_whole_and_balances_bytes():
    chunks = _chunks()
    seals = [TrajectorySeal(RUN, 0, t, 9, (S0.name,)) for t in TRAJS] + [TrajectorySeal(RUN, 0, "gone", 3, ())]
    links = [PrefixLink(RUN, 0, "t4", "t0", 4), PrefixLink(RUN, 0, "child", "t2", 4)]
    ordered = check_shard_inputs(RUN, 0, chunks, seals, links)
    parts = split_shard(ordered, seals, links, 2)
    assert len(parts) == 2
    owner = {}
    for k, (cs, ss, ls) in enumerate(parts):
        assert cs == sorted(cs, key=lambda c: (c.trajectory, c.site, c.token_start))
        for c in cs:
            assert owner.setdefault(c.trajectory, k) == k  # a trajectory's chunks in one part
        for s in ss:
            assert owner.setdefault(s.trajectory, k) == k
        for x in ls:
            assert owner.setdefault(x.trajectory, k) == k
            assert owner.get(x.source, k) == k  # a link's source beside it
    assert owner["t4"] == owner["t0"] and owner["child"] == owner["t2"]
    assert owner["gone"] == 0  # a seal without chunks here stays with part 0
    assert sum(len(cs) for cs, _, _ in parts) == len(ordered)
    assert sorted(map(id, (s for _, ss, _ in parts for s in ss))) == sorted(map(id, seals))
    assert sorted(map(id, (x for _, _, ls in parts for x in ls))) == sorted(map(id, links))
    load = [sum(c.nbytes for c in cs) for cs, _, _ in parts]
    biggest = max(sum(c.nbytes for c in ordered if owner[c.trajectory] == owner[t]) for t in TRAJS)
    assert abs(load[0] - load[1]) <= biggest
    # a pure function of the content: the same cut whatever order the chunks came in
    again = split_shard(check_shard_inputs(RUN, 0, chunks[::-1], seals, links), seals, links, 2)
    assert [[id(c) for c in cs] for cs, _, _ in again] == [[id(c) for c in cs] for cs, _, _ in parts]


def test_split_needs_two_units_with_chunks():
    one_traj = [c for c in _chunks() if c.trajectory == "t0"]
    assert len(split_shard(check_shard_inputs(RUN, 0, one_traj), (), (), 2)) == 1
    linked = _chunks(trajs=["a", "b"])
    links = [PrefixLink(RUN, 0, "b", "a", 4)]
    assert len(split_shard(check_shard_inputs(RUN, 0, linked, (), links), (), links, 2)) == 1
    assert len(split_shard(check_shard_inputs(RUN, 0, _chunks()), (), (), 1)) == 1
    assert split_shard([], [TrajectorySeal(RUN, 0, "x", 3, ())], (), 2)[0][1][0].trajectory == "x"


# ---------------------------------------------------------------------------- write and read


def test_two_files_round_trip(backend):
    url, opts = backend
    store = _split_store(url, opts)
    chunks = _chunks()
    ends = {t: max(c.token_end for c in chunks if c.trajectory == t) for t in TRAJS}
    seals = [TrajectorySeal(RUN, 0, t, ends[t], (S0.name,)) for t in TRAJS]  # a seal covers its records
    info = store.write_shard(RUN, 0, "w0", 7, chunks, seals=seals)
    assert len(info.parts) == 2 and info.written
    first, second = info.parts
    assert (first.seq, second.seq) == (7, 7 + PART_SEQ_STRIDE)
    assert (info.path, info.manifest_path) == (first.path, first.manifest_path)
    assert first.path == f"{RUN}/v0/w0/part-00000007.parquet"
    assert second.path == f"{RUN}/v0/w0/part-1000000000000000007.parquet"
    assert info.n_chunks == first.n_chunks + second.n_chunks == len(chunks)
    assert info.nbytes == first.nbytes + second.nbytes
    assert info.payload_bytes == sum(c.nbytes for c in chunks)
    assert store.manifest_paths(RUN, 0) == sorted([first.manifest_path, second.manifest_path])
    fresh = Store(url, opts)
    ms = fresh.manifests(RUN, 0)
    assert {e.trajectory for e in ms[0].chunks}.isdisjoint({e.trajectory for e in ms[1].chunks})
    assert sorted(s.trajectory for m in ms for s in m.seals) == TRAJS
    assert fresh.list_writers(RUN, 0) == ["w0"] and fresh.list_trajectories(RUN, 0) == TRAJS
    _check_all(store, chunks)
    sealed = StoreReader(fresh, RUN).read([(t, 0, 4) for t in TRAJS], sites=[S0.name], require_sealed=True)
    assert sealed[S0.name].valid.all()  # every seal found, whichever file holds it
    # the repeat (a retry after a lost ack, a WAL replay) is a no-op
    again = store.write_shard(RUN, 0, "w0", 7, chunks, seals=seals)
    assert not again.written and [p.seq for p in again.parts] == [7, 7 + PART_SEQ_STRIDE]
    assert len(Store(url, opts).manifest_paths(RUN, 0)) == 2


def test_a_split_store_validates_clean(tmp_path):
    store = _split_store(f"file://{tmp_path}/store", min_row_group_bytes=0)
    # t4's first 8 tokens are t0's: t4 records only past them (a linked prefix has no records of its own)
    chunks = [c for c in _chunks(3) if c.trajectory != "t4" or c.token_start >= 8]
    links = [PrefixLink(RUN, 0, "t4", "t0", 8)]
    seals = [TrajectorySeal(RUN, 0, t, 9, (S0.name,)) for t in ("t0", "t4")]
    info = store.write_shard(RUN, 0, "w0", 0, chunks, seals=seals, links=links)
    assert len(info.parts) == 2
    out = io.StringIO()
    assert validate_version(Store(store.url), RUN, 0, out, jobs=1) == 0, out.getvalue()
    res = StoreReader(Store(store.url), RUN).read([("t4", 0, 8)], sites=[S0.name])
    assert res[S0.name].valid.all()  # through the link, whichever file holds the source


def test_default_policy_splits_only_large_shards_of_large_chunks(tmp_path, monkeypatch):
    monkeypatch.delenv(SHARD_FILES_ENV, raising=False)
    monkeypatch.delenv(SPLIT_MIB_ENV, raising=False)
    store = Store(f"file://{tmp_path}/store")
    store.put_run(SPEC)
    assert store.shard_files == (2 if (os.cpu_count() or 1) >= 2 else 1)
    assert (store.split_min_bytes, store.split_min_chunk_bytes) == (SPLIT_MIN_BYTES, SPLIT_MIN_CHUNK_BYTES)
    assert store.write_shard(RUN, 0, "w0", 0, _chunks()).parts == ()  # small: one file
    store.split_min_bytes = 0
    assert store.write_shard(RUN, 0, "w0", 1, _chunks(2)).parts == ()  # small chunks: one file
    store.split_min_chunk_bytes, store.shard_files = 0, 2
    assert len(store.write_shard(RUN, 0, "w0", 2, _chunks(4)).parts) == 2
    assert store.write_shard(RUN, 0, "w0", 3, _chunks(5), files=1).parts == ()  # the caller's choice wins


def test_settings_and_refusals(tmp_path, monkeypatch):
    from tracestore.server.cli import config_from_args

    from tracestore.cli import build_parser
    from tracestore.settings import resolve

    def serve_config():
        return config_from_args(resolve(build_parser().parse_args(["serve"])))

    monkeypatch.setenv(SHARD_FILES_ENV, "1")
    monkeypatch.setenv(SPLIT_MIB_ENV, "0.5")
    # the library reads no variable; the sidecar's settings do, and hand them to its Store
    assert (default_shard_files(), default_split_min_bytes()) == (
        2 if (os.cpu_count() or 1) >= 2 else 1,
        SPLIT_MIN_BYTES,
    )
    store = Store(f"file://{tmp_path}/a", config=serve_config().storage_config())
    assert (store.shard_files, store.split_min_bytes) == (1, 1 << 19)
    for bad_files in ("3", "two"):
        monkeypatch.setenv(SHARD_FILES_ENV, bad_files)
        with pytest.raises(ConfigError, match=f"{SHARD_FILES_ENV}='{bad_files}': expected one of auto, 1, 2"):
            serve_config()
    monkeypatch.setenv(SHARD_FILES_ENV, "auto")
    for bad_mib in ("-1", "inf", "x"):
        monkeypatch.setenv(SPLIT_MIB_ENV, bad_mib)
        with pytest.raises(ConfigError, match=SPLIT_MIB_ENV):
            serve_config()
    monkeypatch.delenv(SHARD_FILES_ENV)
    monkeypatch.delenv(SPLIT_MIB_ENV)
    with pytest.raises(ValidationError, match="shard_files"):
        Store(f"file://{tmp_path}/a", shard_files=3)
    with pytest.raises(ValidationError, match="split_min_bytes"):
        Store(f"file://{tmp_path}/a", split_min_bytes=-1)
    store = _split_store(f"file://{tmp_path}/store")
    with pytest.raises(ValidationError, match="second files of split shards"):
        store.write_shard(RUN, 0, "w0", PART_SEQ_STRIDE, _chunks())
    with pytest.raises(ValidationError, match="files must be 1 or 2"):
        store.write_shard(RUN, 0, "w0", 0, _chunks(), files=3)


# ---------------------------------------------------------------------------- repeats and failures


def test_a_repeat_in_the_other_layout_completes_the_first(backend):
    """A shard written as one file and repeated by a store that splits (another core count or
    setting after a restart), and the reverse: no conflict, nothing twice, nothing lost."""
    url, opts = backend
    split, one = _split_store(url, opts), Store(url, opts, timeout=30.0, shard_files=1)
    a, b = _chunks(5), _chunks(6, [f"u{i}" for i in range(4)])
    assert one.write_shard(RUN, 0, "w0", 1, a).parts == ()
    again = split.write_shard(RUN, 0, "w0", 1, a)
    assert again.parts == () and not again.written
    assert len(split.write_shard(RUN, 0, "w0", 2, b).parts) == 2
    again = one.write_shard(RUN, 0, "w0", 2, b)
    assert len(again.parts) == 2 and not again.written
    assert _entries(split) == sorted((c.trajectory, c.site, c.token_start) for c in a + b)
    # different bytes under the same number are still a conflict, in either layout
    c = _chunks(7)
    for st in (split, one):
        with pytest.raises(ConflictError):
            st.write_shard(RUN, 0, "w0", 1, c)
        with pytest.raises(ConflictError):
            st.write_shard(RUN, 0, "w0", 2, c)


def test_nothing_is_visible_until_both_files_are_durable(tmp_path, monkeypatch):
    """The second file's publish fails: no manifest at all (the first file, though published, is
    invisible); the retry completes, also through a store that would write one file."""
    store = _split_store(f"file://{tmp_path}/store", retries=0)
    chunks = _chunks(8)
    real = store.storage.publish_stream

    def second_fails(rel, produce):
        if "part-1" in rel:
            raise OSError("disk gone")
        return real(rel, produce)

    monkeypatch.setattr(store.storage, "publish_stream", second_fails)
    with pytest.raises(OSError, match="disk gone"):
        store.write_shard(RUN, 0, "w0", 3, chunks)
    assert store.manifest_paths(RUN, 0) == []
    assert sorted(os.listdir(tmp_path / "store" / RUN / "v0" / "w0")) == ["part-00000003.parquet"]
    monkeypatch.undo()
    info = Store(store.url, shard_files=1).write_shard(RUN, 0, "w0", 3, chunks)
    assert len(info.parts) == 2 and info.written
    _check_all(store, chunks)


def test_a_failed_manifest_publish_is_retried_to_the_full_shard(tmp_path, monkeypatch):
    store = _split_store(f"file://{tmp_path}/store", retries=0)
    chunks = _chunks(9)
    real = store.storage.publish
    calls: list[str] = []

    def first_manifest_fails(rel, data):
        calls.append(rel)
        if rel.endswith("part-00000004.manifest.json"):
            raise OSError("write failed")
        return real(rel, data)

    monkeypatch.setattr(store.storage, "publish", first_manifest_fails)
    with pytest.raises(OSError, match="write failed"):
        store.write_shard(RUN, 0, "w0", 4, chunks)
    # the second file's manifest went first; the shard's own number is published last
    assert [c.rsplit("/", 1)[1] for c in calls] == [
        "part-1000000000000000004.manifest.json",
        "part-00000004.manifest.json",
    ]
    visible = {t for t, _, _ in _entries(store)}
    assert visible and visible < set(TRAJS)  # whole trajectories of one file, not acknowledged
    monkeypatch.undo()
    assert store.write_shard(RUN, 0, "w0", 4, chunks).written
    assert _entries(store) == sorted((c.trajectory, c.site, c.token_start) for c in chunks)
    _check_all(store, chunks)


_CRASH = """
import sys
sys.path.insert(0, {root!r})
from tests.storage.test_split_shard import RUN, _chunks, _split_store
_split_store({url!r}).write_shard(RUN, 0, "w0", 5, _chunks(10))
print("not killed")
"""


@pytest.mark.parametrize("point", ["store.temp_written:1", "store.shard_published:2", "store.manifest_published:1"])
def test_sigkill_between_the_two_files(tmp_path, point):
    """SIGKILL (tracestore.faults) after the first temp file, after both files, and between the two
    manifests: never a partial trajectory, at most one file's trajectories visible, and the repeat
    (what the WAL replay does) completes the shard with nothing twice."""
    url = f"file://{tmp_path}/store"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRACESTORE_FAULT": point}
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CRASH.format(root=root, url=url))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr)
    store = Store(url)
    chunks = _chunks(10)
    keys = _entries(store)
    by_traj = {t: sorted((c.trajectory, c.site, c.token_start) for c in chunks if c.trajectory == t) for t in TRAJS}
    visible = sorted({t for t, _, _ in keys})
    assert keys == sorted(k for t in visible for k in by_traj[t])  # whole trajectories only
    if point == "store.manifest_published:1":
        assert visible and len(visible) < len(TRAJS)  # the second file's, not the shard's own
        assert store.manifest_paths(RUN, 0) == [f"{RUN}/v0/w0/part-1000000000000000005.manifest.json"]
    else:
        assert visible == []
    info = _split_store(url).write_shard(RUN, 0, "w0", 5, chunks)
    assert len(info.parts) == 2
    assert _entries(store) == sorted((c.trajectory, c.site, c.token_start) for c in chunks)
    _check_all(store, chunks)
    # a temp file the kill left (store.temp_written) is ours and swept; nothing else is
    temps = sorted(f"{RUN}/v0/w0/{n}" for n in os.listdir(tmp_path / "store" / RUN / "v0" / "w0") if n[0] == ".")
    assert sorted(Store(url).remove_stale_temp_files(0)) == temps
    assert bool(temps) == (point == "store.temp_written:1")
    out = io.StringIO()
    assert validate_version(Store(url), RUN, 0, out, jobs=1) == 0, out.getvalue()
