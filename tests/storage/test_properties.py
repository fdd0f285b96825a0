"""Property tests: random chunks -> store -> random plan reads -> identical bytes; and a stateful
test of writes, retries, seals, prefix links and retention against a plain-Python model."""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tracestore import ConflictError, CorruptionError, PrefixLink, TrajectorySeal
from tracestore.storage.reader import StoreReader
from tracestore.storage.store import Store

from .conftest import RUN, SITES, SPEC, expected_rows, make_chunk


@st.composite
def layouts(draw):
    """Trajectories with lengths, each site's tokens cut into random chunks, spread over shards."""
    n_traj = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 40)) for _ in range(n_traj)]
    cuts = {}
    for t, n in enumerate(lengths):
        for s in range(len(SITES)):
            inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True)) if n > 1 else []
            cuts[(t, s)] = sorted({0, n, *inner})
    n_shards = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return lengths, cuts, n_shards, seed


@st.composite
def plans(draw, lengths):
    segs = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 5)) == 0:
            segs.append((None, 0, draw(st.integers(1, 5))))
            continue
        t = draw(st.integers(0, len(lengths) - 1))
        a = draw(st.integers(0, lengths[t] + 2))
        b = draw(st.integers(a + 1, lengths[t] + 4))
        segs.append((f"t{t}", a, b))
    return segs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_store_round_trip(data):
    lengths, cuts, n_shards, seed = data.draw(layouts())
    rng = np.random.default_rng(seed)
    chunks = []
    for (t, s), cs in cuts.items():
        for a, b in zip(cs[:-1], cs[1:], strict=True):
            chunks.append(make_chunk(SITES[s], f"t{t}", a, b - a, rng=rng, token_scales=bool(rng.integers(2))))
    store = Store(f"memory://prop-{uuid.uuid4().hex}")
    store.put_run(SPEC)
    order = rng.permutation(len(chunks))
    for k in range(n_shards):
        part = [chunks[i] for i in order[k::n_shards]]
        store.write_shard(RUN, 0, f"w{k}", k, part)
    reader = StoreReader(store, RUN)
    for _ in range(3):
        segs = data.draw(plans(lengths))
        site = SITES[data.draw(st.integers(0, len(SITES) - 1))]
        block = site.fmt.block
        lo = data.draw(st.integers(0, site.width // block - 1)) * block
        hi = data.draw(st.integers(lo // block + 1, site.width // block)) * block
        res = reader.read(segs, sites=[site.name], columns=(lo, hi), on_missing="mask")
        exp = expected_rows(chunks, site, segs, (lo, hi))
        got = res[site.name]
        np.testing.assert_array_equal(got.valid, exp["valid"])
        np.testing.assert_array_equal(got.codes, exp["codes"])
        np.testing.assert_array_equal(got.scales, exp["scales"])
        np.testing.assert_array_equal(got.global_scale, exp["global_scale"])


TRAJS = ("a", "b", "c", "d")
S0 = SITES[0]


class StoreMachine(RuleBasedStateMachine):
    """Writes (with retries), seals, links and retention on one store, checked against a model."""

    @initialize()
    def setup(self):
        self.store = Store(f"memory://state-{uuid.uuid4().hex}")
        self.store.put_run(SPEC)
        self.reader = StoreReader(self.store, RUN)
        self.rng = np.random.default_rng(0)
        self.records: dict[tuple[int, str], dict[int, bytes]] = {}  # (version, traj) -> token -> codes row
        self.links: dict[tuple[int, str], tuple[str, int]] = {}
        self.seals: dict[tuple[int, str], int] = {}
        self.seq = 0
        self.last = None
        self.versions: set[int] = set()

    def _next_start(self, v, t):
        toks = self.records.get((v, t), {})
        return max(toks, default=-1) + 1

    @rule(v=st.integers(0, 3), t=st.sampled_from(TRAJS), n=st.integers(1, 6))
    def write(self, v, t, n):
        # records past the trajectory's link in this version, as a recorder writes them (a later,
        # longer link or one of another version may still overlap them: the reader's ConflictError)
        start = max(self._next_start(v, t), self.links.get((v, t), (None, 0))[1])
        c = make_chunk(S0, t, start, n, version=v, rng=self.rng)
        args = (RUN, v, f"w-{t}", self.seq, [c])
        assert self.store.write_shard(*args).written
        self.seq += 1
        self.last = args
        for i in range(n):
            self.records.setdefault((v, t), {})[start + i] = c.codes[i].tobytes()
        self.versions.add(v)

    @precondition(lambda self: self.last is not None)
    @rule()
    def retry_last_write(self):
        assert not self.store.write_shard(*self.last).written

    @rule(v=st.integers(0, 3), t=st.sampled_from(TRAJS))
    def seal(self, v, t):
        n = self._next_start(v, t) + 1
        self.store.write_shard(RUN, v, f"w-{t}", self.seq, [], seals=[TrajectorySeal(RUN, v, t, n, (S0.name,))])
        self.seq += 1
        self.seals[(v, t)] = max(n, self.seals.get((v, t), 0))
        self.versions.add(v)

    @rule(v=st.integers(0, 3), i=st.integers(1, len(TRAJS) - 1), n=st.integers(1, 8))
    def link(self, v, i, n):
        # the source is always the previous trajectory: links stay acyclic and never disagree; a
        # trajectory's records, seals and links come from one writer (the reader checks it)
        t, src = TRAJS[i], TRAJS[i - 1]
        self.store.write_shard(RUN, v, f"w-{t}", self.seq, [], links=[PrefixLink(RUN, v, t, src, n)])
        self.seq += 1
        old = self.links.get((v, t))
        if old is None or n >= old[1]:
            self.links[(v, t)] = (src, n)
        self.versions.add(v)

    @rule(keep=st.integers(0, 4))
    def retention(self, keep):
        deleted = self.store.delete_versions_older_than(RUN, keep)
        assert sorted(deleted) == sorted(v for v in self.versions if v < keep)
        self.versions = {v for v in self.versions if v >= keep}
        if self.last is not None and self.last[1] < keep:
            self.last = None  # retrying a write of a deleted version would publish it again
        for d in (self.records, self.links, self.seals):
            for key in [k for k in d if k[0] < keep]:
                del d[key]

    def _holds(self, v, t):
        """What the reader takes a trajectory to hold in a version: records, seal or own link."""
        return max(self._next_start(v, t), self.seals.get((v, t), 0), self.links.get((v, t), (None, 0))[1])

    def _expect(self, t, tok):
        """The codes row a read returns for ``tok`` of ``t`` (None: invalid); raises
        ConflictError or CorruptionError where the reader must (a link over records of its own
        trajectory in any version; a link past its source's seal)."""
        while True:
            links = [(v, self.links[(v, t)]) for v in self.versions if (v, t) in self.links]
            if links:
                v, (src, n) = max(links, key=lambda x: (x[0], x[1][1]))
                if tok < n:
                    if any(min(toks) < n for (_, tt), toks in self.records.items() if tt == t and toks):
                        raise ConflictError(f"link {t} -> {src} over records of {t}")
                    held, sealed = self._holds(v, src), self.seals.get((v, src))
                    if held == 0:
                        return None  # the source is missing in the link's version: masked
                    if sealed is not None and n > sealed:
                        raise CorruptionError(f"link {t} -> {src} past the seal")
                    if n > held:
                        return None  # the source holds fewer tokens: masked
                    t = src
                    continue
            break
        for v in sorted(self.versions, reverse=True):
            row = self.records.get((v, t), {}).get(tok)
            if row is not None and tok < self.seals.get((v, t), tok + 1):  # nothing at or past a seal
                return row
        return None

    @invariant()
    def reads_match_model(self):
        if not hasattr(self, "store"):
            return
        assert self.store.list_versions(RUN) == sorted(self.versions)
        for t in TRAJS:
            expected, errors = [], set()
            for tok in range(12):
                try:
                    expected.append(self._expect(t, tok))
                except (ConflictError, CorruptionError) as exc:
                    errors.add(type(exc))
            if errors:
                with pytest.raises((ConflictError, CorruptionError)) as err:
                    self.reader.read([(t, 0, 12)], sites=[S0.name], on_missing="mask")
                assert type(err.value) in errors, (t, err.value)
                if isinstance(err.value, ConflictError):
                    assert re.search(r"prefix link .* holds records of its own", str(err.value)), err.value
                else:
                    assert re.search(r"prefix link .* sealed at", str(err.value)), err.value
                continue
            res = self.reader.read([(t, 0, 12)], sites=[S0.name], on_missing="mask")[S0.name]
            for tok, exp in enumerate(expected):
                assert bool(res.valid[tok]) == (exp is not None), (t, tok)
                if exp is not None:
                    assert res.codes[tok].tobytes() == exp


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_store_state_machine = pytest.mark.slow(StoreMachine.TestCase)
