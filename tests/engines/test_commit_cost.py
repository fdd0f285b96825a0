"""The per-step commit after a graph-replayed forward (EngineRecorder.end_forward) stays array work:
the Python calls it makes do not grow with the number of requests or sites (FP4 and routing), in a plain decode
step, one whose rows are gathered, one under asynchronous scheduling (every row held, then
released) and one whose batch changed. Counted with ``sys.setprofile`` (calls of Python
functions and of C functions from Python code), not timed, so the guard does not depend on the
machine's load. The array helpers are checked against :class:`StepPlan`'s own answers and the
spare-row free list against its contract."""

from __future__ import annotations

import random
import sys
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from tracestore.client.engines.graph import GraphCapture
from tracestore.client.engines.layout import RowLayout, held_rows, row_index, runs
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.routing import route_spec
from tracestore.client.engines.rows import RowMapper, Scheduled, StepPlan
from tracestore.client.engines.setting import parse_setting
from tracestore.server.testing import ServeProcess

from tracestore.errors import ValidationError

WIDTH = 64


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    sp = ServeProcess(tmp_path_factory.mktemp("sidecar"), wal=False, flags=["--flush-interval", "0.2"])
    sp.start()
    try:
        yield sp
    finally:
        sp.terminate()


def calls(fn: Callable[[], object]) -> int:
    """Python-level calls (Python functions, and C functions called from Python code) in ``fn()``
    on this thread."""
    n = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


class Steps:
    """``batch`` requests decoding one token a step into an armed graph capture of ``sites``
    sites on the CPU (the slab's contents do not matter to the commit's work), recorded through
    a real sidecar; ``mode``: ``sync``, ``gathered`` (the worker's order reversed) or ``async``
    (every row pending: held, then released with its id)."""

    def __init__(self, address: str, run: str, batch: int, sites: int, mode: str, routes: int = 0) -> None:
        self.rec = EngineRecorder(parse_setting(f"sidecar={address} run={run} policy_version=0 writer=w-{run} bits=1"))
        graph = GraphCapture(1)
        graph.install()
        graph.active = True
        for i in range(sites):
            graph.note(f"layers.{i}.mlp.input", WIDTH)
        for i in range(routes):
            graph.note_route(route_spec(i, 2, 16))
        assert graph.arm(batch + 8, "cpu", spare=2 * batch + 2)
        for codes in graph.route_rows.codes.values() if graph.route_rows is not None else ():
            codes[:, 1] = 1  # experts 0 and 1 (a routed row names top_k distinct experts)
        self.rec.graph = graph
        self.mode, self.mapper, self.p = mode, RowMapper(block=4), 0
        self.rids = [f"{run}-{i}" for i in range(batch)]
        for j, r in enumerate(self.rids):
            self.mapper.add(r, [500 + j])  # (distinct prompts: no request links to another's)
        for _ in range(3):  # the prompts (declares the run, connects), then what the recorder sizes once
            self.step()  # per slab (the gather slab's first use) or per new row count

    def plan(self) -> StepPlan:
        p, m = self.p, self.mapper
        self.p += 1
        if self.mode != "async" or p == 0:
            return m.step(
                [Scheduled(r, p, 1, 0, None if p == 0 else [(p * 7 + j) % 997]) for j, r in enumerate(self.rids)]
            )
        if p >= 2:
            for j, r in enumerate(self.rids):
                m.learn(r, p - 1, [(p * 7 + j) % 997])
        return m.step([Scheduled(r, p, 1, 0, [], n_pending=1) for r in self.rids])

    def order(self) -> list[tuple[str, int]]:
        return [(r, 1) for r in (reversed(self.rids) if self.mode == "gathered" else self.rids)]

    def step(self) -> int:
        """One step's commit; returns the Python calls it made."""
        plan, order = self.plan(), self.order()
        ok: list[bool] = []
        n = calls(lambda: ok.append(self.rec.end_forward(plan, order)))
        assert ok == [True]
        return n

    def replace(self) -> int:
        """The batch changes: the first request ends and a new one takes its place (its prompt
        recorded in this step; the forward's row count unchanged, as a new row count costs the
        recorder a per-site size computation once). Returns the Python calls of that step."""
        old = self.rids.pop(0)
        assert self.rec.end_request(self.mapper.finish(old))["gap"] is None
        new = f"{old}-next"
        self.mapper.add(new, [5])
        self.rids.append(new)
        p = self.p
        self.p += 1
        batch = [Scheduled(r, p, 1, 0, [(p * 7 + j) % 997]) for j, r in enumerate(self.rids[:-1])]
        plan = self.mapper.step([*batch, Scheduled(new, 0, 1, 0, [5])])
        ok: list[bool] = []
        n = calls(lambda: ok.append(self.rec.end_forward(plan, self.order())))
        assert ok == [True]
        return n


# Calls that depend on the recorder's state rather than on the batch (a message cut, a staging
# release landing in this step) may differ by a few; a loop over requests or sites adds >= 188.
SLACK = 16


@pytest.mark.parametrize("routing", [False, True], ids=["fp4", "fp4+routing"])
@pytest.mark.parametrize("mode", ["sync", "gathered", "async"])
def test_commit_calls_do_not_grow_with_requests_or_sites(sidecar: ServeProcess, mode: str, routing: bool) -> None:
    small = Steps(sidecar.address, f"cs-{mode}-{routing:d}", batch=4, sites=2, mode=mode, routes=2 * routing)
    large = Steps(sidecar.address, f"cl-{mode}-{routing:d}", batch=192, sites=16, mode=mode, routes=16 * routing)
    for _ in range(3):
        n_small, n_large = small.step(), large.step()
        assert abs(n_large - n_small) <= SLACK, f"{mode}: {n_large} Python calls at 192 x 16, {n_small} at 4 x 2"
    if mode != "async":
        n_small, n_large = small.replace(), large.replace()
        assert abs(n_large - n_small) <= SLACK, f"{mode}, new batch: {n_large} calls at 192 x 16, {n_small} at 4 x 2"
    assert n_large < 400, f"{mode}: {n_large} Python calls per step"
    for eng in (small, large):
        stats = eng.rec.stats
        if mode == "async":  # every position from 1 was held, those from 1 to p - 2 released
            assert stats["released"] == len(eng.rids) * (eng.p - 2) and stats["held_overflow"] == 0
        else:  # a position per request and step (the replaced request's and its successor's: p in all)
            assert stats["rows"] == len(eng.rids) * eng.p and stats["links"] == 0, stats
        assert eng.rec.close(30)


def random_plans(seed: int) -> Iterator[tuple[StepPlan, list[tuple[str, int]]]]:
    """Plans of a mapper driven through chunked prefill, decode and drafts, each with a shuffled
    worker order."""
    rng = random.Random(seed)
    m = RowMapper(block=4)
    state = {}
    for i in range(12):
        rid = f"q{i}"
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        m.add(rid, prompt)
        state[rid] = (0, prompt)
    for _ in range(30):
        batch = []
        for rid, (start, ids) in state.items():
            if rng.random() < 0.3:
                continue
            n = min(rng.randrange(1, 6), len(ids) - start) if start < len(ids) else 0
            drafts = rng.randrange(0, 3) if start >= len(ids) else 0
            n_all = max(n, 1) + drafts
            toks = [rng.randrange(1000) for _ in range(n_all)]
            ids[start : start + n_all] = toks
            batch.append(Scheduled(rid, start, n_all, drafts, toks))
            done = start + n_all - drafts + rng.randrange(0, drafts + 1)  # (some drafts accepted)
            state[rid] = (done, ids[:done])
        plan = m.step(batch)
        order = [(s.request_id, s.n) for s in batch]
        rng.shuffle(order)
        yield plan, order


@pytest.mark.parametrize("seed", range(4))
def test_array_rows_match_the_plan(seed: int) -> None:
    layout = RowLayout()
    n_held = n_rows = 0
    for plan, order in random_plans(seed):
        lay = layout.of(order)
        assert lay.n_rows == sum(n for _, n in order)
        assert np.array_equal(row_index(plan.rows, lay), plan.row_index(order))
        at = plan.starts(order)
        want = np.asarray([at[rid] + off for _, _, rid, off, _ in plan.held], dtype=np.int64)
        assert np.array_equal(held_rows(plan.held, lay), want)
        n_held, n_rows = n_held + len(plan.held), n_rows + len(plan.rows)
    assert n_held and n_rows  # (the plans exercised both)


def test_layout_names_a_missing_request() -> None:
    lay = RowLayout().of([("a", 2)])
    with pytest.raises(ValidationError, match="'b'"):
        row_index([("a", 0, 2), ("b", 0, 1)], lay)


def test_runs_merge_consecutive_positions_of_one_trajectory() -> None:
    trajs = ["a", "a", "b", "a", "a", "a", "b", "b"]
    pos = np.asarray([3, 4, 0, 5, 7, 8, 1, 3], dtype=np.int64)
    assert runs(trajs, pos) == [("a", 3, 5), ("b", 0, 1), ("a", 5, 6), ("a", 7, 9), ("b", 1, 2), ("b", 3, 4)]
    assert runs(["a", "b"], np.asarray([1, 2])) == [("a", 1, 2), ("b", 2, 3)]
    assert runs([], np.zeros(0, dtype=np.int64)) == []


def test_spare_rows_lowest_first_and_free_checks_all_before_any() -> None:
    g = GraphCapture(1)
    g.note("layers.0.mlp.input", WIDTH)
    assert g.arm(4, "cpu", spare=4)
    a = g.hold(np.asarray([0, 1], dtype=np.int64))
    assert a is not None and a.tolist() == [4, 5] and g.spare_free == 2
    b = g.hold(np.asarray([2], dtype=np.int64))
    assert b is not None and b.tolist() == [6] and g.spare_free == 1
    assert g.hold(np.asarray([0, 1], dtype=np.int64)) is None and g.spare_free == 1
    g.free([4])
    c = g.hold(np.asarray([3], dtype=np.int64))
    assert c is not None and c.tolist() == [4]
    for bad in ([5, 7], [5, 3], [5, 5], [6, 9]):  # 7: free; 3: a forward row; 5 twice; 9: past the slab
        with pytest.raises(ValidationError):
            g.free(bad)
        assert g.spare_free == 1, bad  # nothing was given back
    g.free([4, 5, 6])
    assert g.spare_free == 4


def test_vllm_worker_order_is_the_scheduled_requests_in_batch_order() -> None:
    from tracestore.client.engines.vllm.hooks import worker_order

    sched = {f"r{i}": 1 + i % 3 for i in range(0, 300, 2)}
    for ids in ([f"r{i}" for i in range(0, 300, 2)], [f"r{i}" for i in range(300)], ["r4", "x", "r2"], []):
        want = [(rid, sched[rid]) for rid in ids if rid in sched]
        assert worker_order(ids, sched) == want
    small = {f"s{i}": 1 for i in range(4)}
    large = {f"s{i}": 1 for i in range(256)}
    assert calls(lambda: worker_order(list(large), large)) == calls(lambda: worker_order(list(small), small))


def fp4_row(rid: str, pos: int, site: str) -> bytes:
    """The record bytes (codes then scales) the test's forward writes for (rid, pos, site)."""
    return np.random.default_rng(zlib.crc32(f"{rid}:{pos}:{site}".encode())).integers(0, 127, 12, np.uint8).tobytes()


def expert_ids(rid: str, pos: int, layer: int) -> list[int]:
    return [zlib.crc32(f"{rid}:{pos}:{layer}".encode()) % 8, 8 + (pos + layer) % 8]  # (distinct)


def test_fp4_and_routing_rows_commit_in_one_slab_call_and_read_back(sidecar: ServeProcess) -> None:
    """FP4 and routing sites of a graph-captured forward are staged by one ``record_slab`` (two
    slabs), gathered when the worker's order differs, held and released under asynchronous
    scheduling; every stored row is the one written for its (request, position)."""
    from tracestore.client import GuidanceReader
    from tracestore.client.engines.routing import route_spec

    from tracestore import Store, StoreReader
    from tracestore.artifacts import Routing
    from tracestore.plan import MicrobatchPlan

    run = "mixed"
    rec = EngineRecorder(parse_setting(f"sidecar={sidecar.address} run={run} policy_version=0 writer=w-{run} bits=1"))
    graph = GraphCapture(1)
    graph.install()
    graph.active = True
    fp4 = [f"layers.{i}.mlp.input" for i in range(2)]
    routes = [route_spec(i, 2, 16) for i in range(2)]
    for name in fp4:
        graph.note(name, WIDTH)
    for spec in routes:
        graph.note_route(spec)
    assert graph.arm(8, "cpu", spare=8)
    rec.graph = graph
    slab, rslab = graph.slab, graph.route_rows
    assert slab is not None and rslab is not None
    m = RowMapper(block=4)
    ids = {"a": [11, 12, 13], "b": [21, 22]}
    for rid, prompt in ids.items():
        m.add(rid, prompt)

    def forward(rows: list[tuple[str, int]]) -> None:
        slab.data[: graph.capacity].random_(0, 255)  # padding and stale rows: junk (never the spare rows)
        for i, (rid, pos) in enumerate(rows):
            for name in fp4:
                raw = torch.frombuffer(bytearray(fp4_row(rid, pos, name)), dtype=torch.uint8)
                slab[name].codes[i] = raw[:8]
                slab[name].scales[i] = raw[8:]
                slab[name].global_scale[i] = 0.5 + pos
            for layer, spec in enumerate(routes):
                rslab.codes[spec.name][i] = torch.tensor(expert_ids(rid, pos, layer), dtype=torch.uint8)

    def step(batch: list[Scheduled], order: list[tuple[str, int]]) -> None:
        plan = m.step(batch)
        by = {s.request_id: s for s in batch}
        forward([(rid, by[rid].start + i) for rid, n in order for i in range(n)])
        assert rec.end_forward(plan, order)

    step([Scheduled("a", 0, 3, 0, ids["a"]), Scheduled("b", 0, 2, 0, ids["b"])], [("b", 2), ("a", 3)])
    ids["a"].append(14)
    ids["b"].append(23)
    step([Scheduled("a", 3, 1, 0, [14]), Scheduled("b", 2, 1, 0, [23])], [("a", 1), ("b", 1)])
    # asynchronous scheduling: positions 4 and 3 planned before their ids are known
    step([Scheduled("a", 4, 1, 0, [], n_pending=1), Scheduled("b", 3, 1, 0, [], n_pending=1)], [("b", 1), ("a", 1)])
    m.learn("a", 4, [15])
    m.learn("b", 3, [24])
    ids["a"].append(15)
    ids["b"].append(24)
    step([Scheduled("a", 5, 1, 0, [], n_pending=1), Scheduled("b", 4, 1, 0, [], n_pending=1)], [("a", 1), ("b", 1)])
    ids["a"].append(16)
    ids["b"].append(25)
    out = {rid: rec.end_request(m.finish(rid, ids[rid] + [99])) for rid in ("a", "b")}
    assert rec.close(30)
    assert out["a"]["gap"] is None and out["b"]["gap"] is None, out
    assert rec.stats["held"] == 4 and rec.stats["released"] == 4 and graph.stats["gathers"] >= 2
    assert graph.spare_free == 8
    sidecar.terminate()
    sidecar.start()
    for rid in ("a", "b"):
        n = len(ids[rid]) + 1
        traj = f"{rid}::a0"
        with StoreReader(Store(sidecar.storage), run) as reader:
            got = reader.read([(traj, 0, n)], on_missing="mask")
        for name in fp4:
            rows = got[name]
            assert rows.valid[: n - 1].all() and not rows.valid[n - 1]
            for p in range(n - 1):
                raw = fp4_row(rid, p, name)
                assert rows.codes[p].tobytes() == raw[:8] and rows.scales[p].tobytes() == raw[8:], (rid, p, name)
                ts = 1.0 if rows.token_scales is None else float(rows.token_scales[p])
                assert float(rows.global_scale[p]) * ts == 0.5 + p, (rid, p, name)
        with GuidanceReader(str(sidecar.storage), run, prefetch=False) as greader:
            routed = greader.read(MicrobatchPlan([(traj, 0, n)]), token_ids=ids[rid] + [99])
        for layer, spec in enumerate(routes):
            r = routed[spec.name]
            assert isinstance(r, Routing) and r.valid[: n - 1].all()
            want = torch.tensor([expert_ids(rid, p, layer) for p in range(n - 1)])
            assert torch.equal(torch.as_tensor(r.experts[: n - 1]), want), (rid, spec.name)
