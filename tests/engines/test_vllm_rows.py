"""Scheduler -> rows through the vLLM connector, driven by vLLM's own Request / SchedulerOutput /
NewRequestData / CachedRequestData classes, recorded through a real sidecar and read back from storage.

Every captured row's bytes are a function of the token ids of its prefix, so a row stored at the
wrong position, for the wrong request, from a rejected draft or twice with other bytes shows up
as a mismatch against the request's final ids (or a write conflict at the sidecar)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from tracestore.client.engines.recording import EngineRecorder  # noqa: E402
from tracestore.client.engines.setting import parse_setting  # noqa: E402
from tracestore.client.engines.vllm import hooks  # noqa: E402
from tracestore.client.engines.vllm.connector import TraceStoreConnector  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from tracestore import Store, StoreReader  # noqa: E402

SITE = "layers.0.mlp.input"
WIDTH = 32  # 4 code bytes (b = 1), 2 scale bytes per row


def row_bytes(prefix: list[int]) -> tuple[bytes, bytes]:
    c = zlib.crc32(np.asarray(prefix, dtype="<i4").tobytes())
    return c.to_bytes(4, "little"), bytes([(c >> 3) & 0x3F, (c >> 11) & 0x3F])


class Engine:
    """Our connector (scheduler and worker roles, one process) fed by vLLM's real classes; the
    'forward' captures one row per scheduled token, in a worker order of the test's choosing."""

    def __init__(self, address: str, run: str, block: int = 4) -> None:
        text = f"sidecar={address} run={run} policy_version=0 writer=w-{run}"
        cfg = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="TraceStoreConnector",
                kv_role="kv_both",
                kv_connector_module_path="tracestore.client.engines.vllm.connector",
                kv_connector_extra_config={"tracestore": text},
            ),
            cache_config=CacheConfig(block_size=block),
        )
        self.engine = EngineRecorder(parse_setting(text))
        hooks.ENGINE = self.engine
        self.sched = TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = TraceStoreConnector(cfg, KVConnectorRole.WORKER, None)
        self.reqs: dict[str, Request] = {}
        self.results: dict[str, dict] = {}

    def add(self, rid: str, prompt: list[int]) -> Request:
        r = Request(rid, prompt, SamplingParams(max_tokens=64), None)
        self.reqs[rid] = r
        self.sched.on_new_request(r)
        return r

    def step(
        self,
        new: list[tuple[str, int, int]],
        cached: list[tuple[str, int, int]],
        spec: dict[str, list[int]] | None = None,
        worker_order: list[str] | None = None,
        short: bool = False,
        report: bool = False,
    ) -> None:
        """new/cached: (request id, num_computed_tokens, num_scheduled_tokens). ``short``: the
        forward's site captures one row fewer than it runs (its rows never reach the recorder;
        the worker logs it, as the hook does). ``report``: the worker's metadata goes back to the
        scheduler after the step (``update_connector_output``, as vLLM's KVConnectorOutput)."""
        spec = spec or {}
        out = SchedulerOutput.make_empty()
        for rid, start, n in new:
            r = self.reqs[rid]
            r.num_computed_tokens = start
            out.scheduled_new_reqs.append(
                NewRequestData(rid, list(r.prompt_token_ids), [], r.sampling_params, None, ([],), start, None)
            )
            out.num_scheduled_tokens[rid] = n
        cd = CachedRequestData.make_empty()
        for rid, start, n in cached:
            cd.req_ids.append(rid)
            cd.num_computed_tokens.append(start)
            out.num_scheduled_tokens[rid] = n
        out.scheduled_cached_reqs = cd
        for rid, d in spec.items():
            self.reqs[rid].spec_token_ids = list(d)
            out.scheduled_spec_decode_tokens[rid] = list(d)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        meta = self.sched.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)  # (as vLLM hands it to the worker)
        order = worker_order or [rid for rid, _, _ in new + cached]
        rows_c, rows_s = [], []
        for rid in order:
            start = next(s for r, s, _ in new + cached if r == rid)
            n = out.num_scheduled_tokens[rid]
            ids = list(self.reqs[rid].all_token_ids) + list(spec.get(rid, ()))
            for p in range(start, start + n):
                c, s = row_bytes(ids[: p + 1])
                rows_c.append(c)
                rows_s.append(s)
        if short:
            rows_c, rows_s = rows_c[:-1], rows_s[:-1]
        self.engine.capture(
            SITE,
            torch.tensor(np.frombuffer(b"".join(rows_c), np.uint8).reshape(-1, 4)),
            torch.tensor(np.frombuffer(b"".join(rows_s), np.uint8).reshape(-1, 2)),
            torch.ones(1),
        )
        try:
            self.engine.end_forward(hooks.PLAN.value, [(rid, out.num_scheduled_tokens[rid]) for rid in order])
        except Exception:
            assert short, "the forward failed"
        hooks.PLAN.value = None
        self.worker.clear_connector_metadata()
        if report:
            from vllm.v1.outputs import KVConnectorOutput

            meta = self.worker.build_connector_worker_meta()
            self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def sample(self, rid: str, *tokens: int) -> None:
        self.reqs[rid].append_output_token_ids(list(tokens))
        self.reqs[rid].spec_token_ids = []

    def finish(self, rid: str, aborted: bool = False) -> dict:
        r = self.reqs[rid]
        r.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = self.sched.request_finished(r, [])
        assert params is not None
        self.results[rid] = params["tracestore"]
        return params["tracestore"]

    def close(self) -> None:
        assert self.engine.close(30)
        hooks.ENGINE = None


def check_stored(sp: ServeProcess, run: str, eng: Engine, rid: str) -> int:
    """Every stored row of ``rid``'s trajectory equals the row of its final ids; returns the count."""
    res = eng.results[rid]
    ids = list(eng.reqs[rid].all_token_ids)
    n = res["n_tokens"]
    with StoreReader(Store(sp.storage), run) as reader:
        rows = reader.read([(res["trajectory"], 0, n)], on_missing="mask")[SITE]
    for p in range(n - 1):
        assert rows.valid[p], (rid, p)
        c, s = row_bytes(ids[: p + 1])
        assert rows.codes[p].tobytes() == c and rows.scales[p].tobytes() == s, (rid, p)
    assert not rows.valid[n - 1]  # the last token is never fed
    return n - 1


def drain(sp: ServeProcess) -> None:
    sp.terminate()
    sp.start()


def test_batching_chunked_prefill_and_worker_order(sidecar: ServeProcess) -> None:
    eng = Engine(sidecar.address, "cb")
    eng.add("a", [1, 2, 3, 4, 5, 6, 7])
    eng.add("b", [9, 8])
    eng.step([("a", 0, 4), ("b", 0, 2)], [], worker_order=["b", "a"])  # chunk 1 of a's prompt
    eng.sample("b", 30)
    eng.step([], [("a", 4, 3), ("b", 2, 1)], worker_order=["a", "b"])  # a's last chunk, b decodes
    eng.sample("a", 40)
    eng.sample("b", 31)
    eng.step([], [("b", 3, 1), ("a", 7, 1)], worker_order=["b", "a"])
    eng.sample("a", 41)
    eng.sample("b", 32)
    ra, rb = eng.finish("a"), eng.finish("b")
    eng.close()
    assert ra["gap"] is None and rb["gap"] is None
    ref = json.loads(ra["trace_ref"])
    assert ref["guided"] and ref["n_tokens"] == 9 and ref["trajectory"] == "a"
    drain(sidecar)
    assert check_stored(sidecar, "cb", eng, "a") == 8
    assert check_stored(sidecar, "cb", eng, "b") == 4


def test_prefix_hit_links_and_grpo_group_shares_the_prompt(sidecar: ServeProcess) -> None:
    eng = Engine(sidecar.address, "px", block=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    for rid in ("g0", "g1"):  # n = 2: vLLM fans one prompt out into two requests
        eng.add(rid, list(prompt))
    eng.step([("g0", 0, 9), ("g1", 0, 9)], [])
    eng.sample("g0", 100)
    eng.sample("g1", 200)
    eng.step([], [("g0", 9, 1), ("g1", 9, 1)])
    eng.sample("g0", 101)
    eng.sample("g1", 201)
    # later: a request whose first 8 tokens hit the prefix cache (two blocks of 4)
    eng.add("h", prompt[:8] + [77, 78])
    eng.step([("h", 8, 2)], [])
    eng.sample("h", 300)
    # and one whose cached prefix nobody here recorded: a gap, never a wrong row
    eng.add("x", [1, 1, 1, 1, 2, 2])
    eng.step([("x", 4, 2)], [])
    eng.sample("x", 400)
    res = {rid: eng.finish(rid) for rid in ("g0", "g1", "h", "x")}
    stats = dict(eng.engine.stats)
    eng.close()
    assert [res[r]["gap"] for r in ("g0", "g1", "h")] == [None, None, None]
    xref = json.loads(res["x"]["trace_ref"])
    assert res["x"]["gap"] == "prefix_unrecorded" and not xref["guided"] and xref["reason"] == "incomplete"
    assert stats["links"] == 2  # g1 -> g0 (the prompt), h -> g0 (8 tokens)
    assert stats["rows"] == 9 + 2 + 2  # g0's prompt once, the two decodes, h's own 2
    drain(sidecar)
    for rid in ("g0", "g1", "h"):
        check_stored(sidecar, "px", eng, rid)


@pytest.mark.parametrize("report", [True, False], ids=["reported", "not-yet-reported"])
def test_a_trajectory_whose_rows_were_lost_is_never_a_prefix_source(sidecar: ServeProcess, report: bool) -> None:
    """``a``'s prefill never reaches the recorder (its forward fails), so ``a`` ends with a gap;
    afterwards a prefix-cache hit on ``a``'s prompt and a request with ``a``'s whole prompt are
    scheduled. Once the worker's report reaches the scheduler, the hit gets the gap
    ``prefix_unrecorded`` and the second request stores its own prompt; before it does (the
    report still in flight), the worker refuses the links the scheduler planned and both end with
    a gap. Never a link to ``a``'s missing rows."""
    run = f"lost-{int(report)}"
    eng = Engine(sidecar.address, run, block=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    eng.add("a", list(prompt))
    eng.step([("a", 0, 9)], [], short=True, report=report)
    eng.sample("a", 100)
    eng.step([], [("a", 9, 1)], report=report)
    eng.sample("a", 101)
    ra = eng.finish("a")
    eng.add("h", prompt[:8] + [77, 78])  # hits a's first two blocks
    eng.add("g", list(prompt))  # a's prompt again, computed from position 0
    eng.step([("h", 8, 2), ("g", 0, 9)], [], report=report)
    eng.sample("h", 300)
    eng.sample("g", 400)
    eng.step([], [("h", 10, 1), ("g", 9, 1)], report=report)
    eng.sample("h", 301)
    eng.sample("g", 401)
    rh, rg = eng.finish("h"), eng.finish("g")
    stats = dict(eng.engine.stats)
    eng.close()
    assert ra["gap"] == "unrecorded_positions" and not json.loads(ra["trace_ref"])["guided"]
    assert not json.loads(rh["trace_ref"])["guided"]
    if report:
        assert rh["gap"] == "prefix_unrecorded"
        assert rg["gap"] is None and json.loads(rg["trace_ref"])["guided"]
        assert stats["links"] == 0
        drain(sidecar)
        assert check_stored(sidecar, run, eng, "g") == 10  # g's own prompt, all of it
    else:
        assert rh["gap"] == "unrecorded_positions" and rg["gap"] == "unrecorded_positions"
        assert stats["links"] == 0 and not json.loads(rg["trace_ref"])["guided"]


def test_a_group_sibling_never_links_to_a_prompt_not_yet_recorded(sidecar: ServeProcess) -> None:
    """GRPO group under chunked prefill: g0 and g1 (one prompt) each get its first chunk; g0 is
    then preempted, g1 finishes, and g0 resumes from a prefix-cache hit on g1's blocks past what
    g0 recorded (a gap). g1 must not have linked its prompt to g0 when it was scheduled: g0 had
    recorded none of it, and never records positions 4..8."""
    eng = Engine(sidecar.address, "sib", block=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    for rid in ("g0", "g1"):
        eng.add(rid, list(prompt))
    eng.step([("g0", 0, 4), ("g1", 0, 4)], [])  # the first chunk of each (token budget 8)
    eng.step([], [("g1", 4, 5)])  # g0 is preempted; g1 prefills the rest
    eng.sample("g1", 200)
    eng.step([], [("g1", 9, 1)])
    eng.sample("g1", 201)
    r1 = eng.finish("g1")
    eng.step([("g0", 8, 1)], [])  # g0 resumes: 8 tokens hit g1's cached blocks, g0 recorded 4
    eng.sample("g0", 100)
    r0 = eng.finish("g0")
    eng.close()
    assert r1["gap"] is None and json.loads(r1["trace_ref"])["guided"]
    assert r0["gap"] == "unrecorded_positions"
    drain(sidecar)
    assert check_stored(sidecar, "sib", eng, "g1") == 10


def test_the_oldest_prefixes_are_forgotten_past_the_bound(sidecar: ServeProcess) -> None:
    """With room for two offered prefixes, ``a``'s first block (the oldest of its three: 4, 8 and
    the prompt's 9 tokens) is forgotten: a hit on it gets a gap, a hit on 8 tokens still links."""
    eng = Engine(sidecar.address, "bound", block=4)
    eng.sched.mapper.max_prefixes = 2
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    eng.add("a", list(prompt))
    eng.step([("a", 0, 9)], [])
    eng.sample("a", 100)
    eng.add("h", prompt[:8] + [77])
    eng.add("x", prompt[:4] + [66])
    eng.step([("h", 8, 1), ("x", 4, 1)], [])
    eng.sample("h", 300)
    eng.sample("x", 400)
    res = {rid: eng.finish(rid) for rid in ("a", "h", "x")}
    stats = dict(eng.engine.stats)
    assert len(eng.sched.mapper._owners) <= 2 and sum(map(len, eng.sched.mapper._owned.values())) <= 2
    eng.close()
    assert res["a"]["gap"] is None and res["h"]["gap"] is None and res["x"]["gap"] == "prefix_unrecorded"
    assert stats["links"] == 1
    drain(sidecar)
    check_stored(sidecar, "bound", eng, "h")


def test_preemption_recompute_and_abort(sidecar: ServeProcess) -> None:
    eng = Engine(sidecar.address, "pr", block=4)
    eng.add("p", [3, 1, 4, 1, 5])
    eng.add("q", [2, 7, 1, 8])
    eng.step([("p", 0, 5), ("q", 0, 4)], [])
    eng.sample("p", 9)
    eng.sample("q", 2)
    eng.step([], [("p", 5, 1), ("q", 4, 1)])
    eng.sample("p", 2)
    eng.sample("q", 8)
    # p is preempted, then resumed from scratch: everything recomputed, nothing stored twice
    eng.step([("p", 0, 7)], [])
    eng.sample("p", 6)
    # q is aborted mid-decode
    rq = eng.finish("q", aborted=True)
    rp = eng.finish("p")
    stats = dict(eng.engine.stats)
    eng.close()
    assert rq["gap"] == "aborted" and json.loads(rq["trace_ref"])["reason"] == "aborted"
    assert rp["gap"] is None
    assert stats["rows"] == 5 + 4 + 1 + 1 + 1  # the recompute stored only position 6
    drain(sidecar)
    check_stored(sidecar, "pr", eng, "p")
    with StoreReader(Store(sidecar.storage), "pr") as reader:  # q: rows stored, never sealed
        seals = reader.read([("q::a0", 0, 6)], on_missing="mask", require_sealed=False)[SITE]
        assert seals.valid[:5].all()


def test_spec_decode_rejections_are_never_recorded(sidecar: ServeProcess) -> None:
    eng = Engine(sidecar.address, "sd", block=4)
    eng.add("s", [4, 4, 4])
    eng.step([("s", 0, 3)], [])
    eng.sample("s", 10)
    # verify token 10 at position 3 with drafts [11, 12] at 4, 5: the engine accepts 11, rejects 12
    eng.step([], [("s", 3, 3)], spec={"s": [11, 12]})
    eng.sample("s", 11, 13)  # accepted draft 11, then the bonus token 13 (not 12)
    # next step: computed count 5 confirms positions 3 and 4
    eng.step([], [("s", 5, 1)])
    eng.sample("s", 14)
    res = eng.finish("s")
    stats = dict(eng.engine.stats)
    eng.close()
    assert res["gap"] is None
    assert stats["held"] == 2 and stats["released"] == 1 and stats["dropped"] == 1
    drain(sidecar)
    assert check_stored(sidecar, "sd", eng, "s") == 6


def test_setting_is_required_and_checked(tmp_path: Path) -> None:
    from tracestore.errors import ConfigError

    cfg = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TraceStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="tracestore.client.engines.vllm.connector",
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRACESTORE_RECORD", raising=False)
        with pytest.raises(ConfigError, match="needs the recording setting"):
            TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)
        mp.setenv("TRACESTORE_RECORD", "sidecar=x run=r")
        with pytest.raises(ConfigError, match="missing policy_version"):
            TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_a_position_drafted_again_after_a_rejection(sidecar: ServeProcess) -> None:
    """Position 5 is drafted (12, rejected), then drafted again (21, accepted) in the step that drops
    the first draft: the new row is kept, the old one never stored (found by vLLM's ngram run)."""
    eng = Engine(sidecar.address, "rd", block=4)
    eng.add("s", [4, 4, 4])
    eng.step([("s", 0, 3)], [])
    eng.sample("s", 10)
    eng.step([], [("s", 3, 3)], spec={"s": [11, 12]})  # drafts at 4, 5: both rejected
    eng.sample("s", 20)  # the bonus token at 4
    eng.step([], [("s", 4, 3)], spec={"s": [21, 22]})  # drafts at 5, 6: 21 accepted, 22 rejected
    eng.sample("s", 21, 30)
    eng.step([], [("s", 6, 1)])
    eng.sample("s", 31)
    res = eng.finish("s")
    stats = dict(eng.engine.stats)
    eng.close()
    assert res["gap"] is None
    assert stats["held"] == 4 and stats["released"] == 1 and stats["dropped"] == 3
    drain(sidecar)
    assert check_stored(sidecar, "rd", eng, "s") == 7


def test_seal_travels_to_a_worker_in_another_process(sidecar: ServeProcess) -> None:
    """Scheduler and worker in different processes (vLLM's multiprocess executor): the worker sends
    its run identity back once (build_connector_worker_meta -> update_connector_output, through
    vLLM's KVConnectorOutput), so request_finished returns the TraceRef at once — the one the worker
    makes when it seals; it asks vLLM to keep the request's blocks (True), the ending rides on the
    next step's metadata, the worker seals and reports it through get_finished."""
    from vllm.v1.outputs import KVConnectorOutput

    eng = Engine(sidecar.address, "mp", block=4)
    hooks.LOCAL_WORKER = False  # as in the scheduler's process
    try:
        eng.add("m", [6, 6, 6])
        assert eng.worker.build_connector_worker_meta() is None  # no forward yet: no run declared
        eng.step([("m", 0, 3)], [])
        meta = eng.worker.build_connector_worker_meta()
        assert meta is not None and meta.identity["writer"] == "w-mp" and meta.identity["run"] == "mp"
        assert eng.worker.build_connector_worker_meta() is None  # sent once
        eng.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        eng.sample("m", 9)
        eng.step([], [("m", 3, 1)])
        eng.sample("m", 8)
        r = eng.reqs["m"]
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = eng.sched.request_finished(r, [])
        assert params is not None
        sched_ref = params["tracestore"].pop("trace_ref")
        assert delay is True and params == {"tracestore": {"trajectory": "m::a0", "n_tokens": 5, "gap": None}}
        assert eng.engine.stats["seals"] == 0
        assert eng.worker.get_finished({"m"}) == (None, None)  # not sealed yet: blocks stay held
        meta = eng.sched.build_connector_meta(SchedulerOutput.make_empty())  # vLLM keeps stepping
        eng.worker.bind_connector_metadata(meta)
        assert eng.engine.stats["seals"] == 1
        assert eng.worker.get_finished(set()) == ({"m"}, None)  # now vLLM frees them
        assert eng.engine.ended[-1]["gap"] is None and json.loads(eng.engine.ended[-1]["trace_ref"])["guided"]
        assert sched_ref == eng.engine.ended[-1]["trace_ref"]  # the scheduler's ref is the worker's
    finally:
        hooks.LOCAL_WORKER = True
    eng.results["m"] = eng.engine.ended[-1]
    eng.close()
    drain(sidecar)
    assert check_stored(sidecar, "mp", eng, "m") == 4


def test_pipeline_parallelism_is_refused() -> None:
    """Pipeline stages each run other layers: the connector refuses them at start-up, naming the
    fix, instead of recording a part of the run's sites (asynchronous scheduling:
    tests/engines/test_vllm_async.py)."""
    from tracestore.errors import ConfigError

    cfg = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TraceStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="tracestore.client.engines.vllm.connector",
            kv_connector_extra_config={"tracestore": "sidecar=x run=r policy_version=0"},
        )
    )
    cfg.parallel_config.pipeline_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="pipeline parallelism"):
            TraceStoreConnector(cfg, role, None)
