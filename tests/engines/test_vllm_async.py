"""vLLM's asynchronous scheduling, driven by vLLM's real ``AsyncScheduler`` (its KV connector is
ours, built by the scheduler itself) in the engine core's order: step N+1 is scheduled, and its
forward run, before step N's sampled tokens reach the scheduler. A stand-in worker runs each
forward with the tokens it sampled itself (as vLLM's worker feeds them from the device) and
captures one row per scheduled token whose bytes are a function of the ids of its prefix, so a
row stored at the wrong position, for the wrong request or with the wrong token shows up against
the request's final ids. Rows go through a real sidecar and are read back from storage."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine venv (.ci/engines-venv) runs these")
pytestmark = pytest.mark.engines

import torch  # noqa: E402
from tracestore.client.engines.vllm import hooks  # noqa: E402
from tracestore.client.engines.vllm.connector import TraceStoreConnector  # noqa: E402
from tracestore.server.testing import ServeProcess  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tests.engines.nvfp4_model import write_checkpoint  # noqa: E402
from tests.engines.test_vllm_rows import SITE, row_bytes  # noqa: E402
from tracestore import Store, StoreReader  # noqa: E402
from tracestore.errors import ConfigError  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"))  # a model config vLLM can read offline


@pytest.fixture(autouse=True)
def hooks_state() -> Iterator[None]:
    """The worker connector turns the plugin's graph mode on (these configs do not enforce eager)
    and installs a recorder: both are process globals, restored for the tests after these."""
    graph = None if hooks.GRAPH is None else hooks.GRAPH.active
    engine = hooks.ENGINE
    try:
        yield
    finally:
        hooks.ENGINE = engine
        if hooks.GRAPH is not None:
            hooks.GRAPH.active = bool(graph)


def config(checkpoint: Path, address: str, run: str, budget: int, spec: bool = False) -> VllmConfig:
    text = f"sidecar={address} run={run} policy_version=0 writer=w-{run}"
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(checkpoint), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TraceStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="tracestore.client.engines.vllm.connector",
            kv_connector_extra_config={"tracestore": text},
        ),
    )
    cfg.scheduler_config.async_scheduling = True  # (the CPU platform turns it off; GPUs default it on)
    if spec:
        cfg.speculative_config = object()  # type: ignore[assignment]  # (only its presence is read)
    return cfg


def sampled(rid: str, n: int) -> int:
    """The token the stand-in model samples for ``rid`` holding ``n`` tokens."""
    return 10 + zlib.crc32(f"{rid}:{n}".encode()) % 400


class AsyncEngine:
    """vLLM's AsyncScheduler with our connector, stepped as vLLM's engine core steps it with a
    batch queue of 2; the worker side is our worker-role connector and EngineRecorder."""

    def __init__(self, cfg: VllmConfig, blocks: int) -> None:
        kv = KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
                )
            ],
        )
        cfg.cache_config.num_gpu_blocks = blocks
        init_none_hash(sha256)
        hooks.ENGINE = None
        self.worker = TraceStoreConnector(cfg, KVConnectorRole.WORKER, None)  # installs the recorder
        assert hooks.ENGINE is not None
        self.engine = hooks.ENGINE
        self.sched = AsyncScheduler(
            vllm_config=cfg,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BLOCK,
        )
        assert isinstance(self.sched.connector, TraceStoreConnector)
        self.tokens: dict[str, list[int]] = {}  # the worker's view: every token it fed or sampled
        self.params: dict[str, dict] = {}
        self.final: dict[str, list[int]] = {}
        self.inflight: deque[tuple[Any, ModelRunnerOutput]] = deque()
        self.reqs: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        r = Request(rid, prompt, params, None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.reqs[rid] = r
        self.tokens[rid] = list(prompt)
        self.sched.add_request(r)

    def _forward(self, so: Any) -> ModelRunnerOutput:
        self.worker.bind_connector_metadata(so.kv_connector_metadata)
        order = sorted(so.num_scheduled_tokens)  # a worker order of its own, not the scheduler's
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens, strict=True))
        codes, scales, out = [], [], []
        for rid in order:
            toks, start, n = self.tokens[rid], starts[rid], so.num_scheduled_tokens[rid]
            for p in range(start, start + n):
                c, s = row_bytes(toks[: p + 1])
                codes.append(c)
                scales.append(s)
            new = []
            if start + n == len(toks) and rid not in self.final:  # the last known token was fed: sample
                new = [sampled(rid, len(toks))]
                toks += new
            out.append(new)
        self.engine.capture(
            SITE,
            torch.tensor(np.frombuffer(b"".join(codes), np.uint8).reshape(-1, 4)),
            torch.tensor(np.frombuffer(b"".join(scales), np.uint8).reshape(-1, 2)),
            torch.ones(1),
        )
        plan = hooks.PLAN.value
        hooks.PLAN.value = None
        assert plan is not None
        self.engine.end_forward(plan, [(rid, so.num_scheduled_tokens[rid]) for rid in order])
        self.worker.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=out
        )

    def _update(self) -> None:
        so, mro = self.inflight.popleft()
        for eco in self.sched.update_from_output(so, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.params[o.request_id] = o.kv_transfer_params["tracestore"]
                    self.final[o.request_id] = list(self.reqs[o.request_id].all_token_ids)

    def run(self, abort: dict[int, str] | None = None, max_steps: int = 200) -> int:
        """Step until every request ended (``abort``: step -> request to abort then); returns
        the steps."""
        for step in range(max_steps):
            if abort and step in abort:
                self.sched.finish_requests(abort[step], RequestStatus.FINISHED_ABORTED)
            if len(self.inflight) < 2 and self.sched.has_requests():
                so = self.sched.schedule()
                if so.total_num_scheduled_tokens:
                    self.inflight.append((so, self._forward(so)))
                    if len(self.inflight) < 2:
                        continue
            if not self.inflight:
                return step
            self._update()
        raise AssertionError("requests did not finish")


def check_stored(sp: ServeProcess, run: str, eng: AsyncEngine, rid: str) -> None:
    res, ids = eng.params[rid], eng.final[rid]
    n = res["n_tokens"]
    assert n == len(ids)
    with StoreReader(Store(sp.storage), run) as reader:
        rows = reader.read([(res["trajectory"], 0, n)], on_missing="mask", token_ids={res["trajectory"]: ids})[SITE]
    for p in range(n - 1):
        c, s = row_bytes(ids[: p + 1])
        assert rows.valid[p], (rid, p)
        assert rows.codes[p].tobytes() == c and rows.scales[p].tobytes() == s, (rid, p)
    assert not rows.valid[n - 1]


def test_async_scheduling_maps_rows_exactly(sidecar: ServeProcess, checkpoint: Path) -> None:
    """Chunked prefill (a 16-token budget), continuous batching, a prefix-cache hit and a GRPO
    pair, each decode row's id learned a step after it was scheduled."""
    eng = AsyncEngine(config(checkpoint, sidecar.address, "async", 16), blocks=128)
    prompt = list(range(100, 121))  # 21 tokens: two chunks
    eng.add("a", prompt, 7)
    eng.add("b", [5, 6, 7], 9)
    eng.run()
    eng.add("g0", prompt[:12] + [300, 301], 5)  # a prefix-cache hit on a's first 12 (3 blocks)
    eng.add("g1", [7, 8, 9, 10, 11], 6)
    eng.add("g2", [7, 8, 9, 10, 11], 6)  # GRPO: same prompt
    eng.run()
    assert all(p["gap"] is None and p["trace_ref"] for p in eng.params.values()), eng.params
    st = eng.engine.stats
    assert st["held"] > 0 and st["held"] == st["released"] + st["dropped"]
    assert st["links"] >= 2  # g0's cached prefix and g2's prompt
    assert eng.engine.close(30)
    sidecar.terminate()
    sidecar.start()
    for rid in ("a", "b", "g0", "g1", "g2"):
        check_stored(sidecar, "async", eng, rid)


def test_async_preemption_and_abort(sidecar: ServeProcess, checkpoint: Path) -> None:
    """Too few KV blocks for four growing requests: vLLM preempts (a preempted request's in-flight
    token arrives stale) and recomputes; one request is aborted mid-decode. The others are sealed
    with exact rows; the aborted one is a gap, never a wrong row."""
    eng = AsyncEngine(config(checkpoint, sidecar.address, "apre", 32), blocks=9)
    for rid in ("p", "q", "r"):
        eng.add(rid, [1 + ord(rid), 2, 3, 4, 5, 6, 7, 8], 10)
    eng.add("x", [40, 41, 42], 30)
    preempted: list[str] = []
    preempt = eng.sched._preempt_request  # (counted only: vLLM's own method runs)

    def count(request: Request, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    eng.sched._preempt_request = count  # type: ignore[method-assign]
    eng.run(abort={6: "x"})
    assert preempted, "the test meant vLLM to preempt"
    ended = {e["trajectory"]: e for e in eng.engine.ended}
    assert ended["x::a0"]["gap"] == "aborted"
    sealed = [r for r in ("p", "q", "r") if eng.params[r]["gap"] is None]
    assert sealed == ["p", "q", "r"], eng.params  # recomputed after preemption: still every row once
    assert eng.engine.close(30)
    sidecar.terminate()
    sidecar.start()
    for rid in sealed:
        check_stored(sidecar, "apre", eng, rid)


def test_async_scheduling_with_speculative_decoding_is_refused(checkpoint: Path) -> None:
    """Under async scheduling the scheduler plans drafts as -1 placeholders and counts them as
    computed until the next update: neither ids nor the next positions are exact at plan time."""
    cfg = config(checkpoint, "127.0.0.1:1", "aspec", 16, spec=True)
    with pytest.raises(ConfigError, match="speculative decoding"):
        TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_a_moe_model_under_data_parallelism_is_refused(checkpoint: Path) -> None:
    """vLLM dispatches a MoE layer's tokens across the data-parallel group before the FlashInfer
    entry (``maybe_make_prepare_finalize``: all-gather without EP, all2all kernels with it)."""
    cfg = config(checkpoint, "127.0.0.1:1", "dpmoe", 16)
    cfg.scheduler_config.async_scheduling = False
    assert cfg.model_config.is_moe
    TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)  # one replica: recorded
    cfg.parallel_config.data_parallel_size = 2
    with pytest.raises(ConfigError, match="MoE model under vLLM's data parallelism"):
        TraceStoreConnector(cfg, KVConnectorRole.SCHEDULER, None)
