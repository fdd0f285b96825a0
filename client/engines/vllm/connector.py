"""The out-of-tree KV connector that maps vLLM's scheduler to record rows (it moves no KV data).

Load it with ``kv_transfer_config={"kv_connector": "TraceStoreConnector", "kv_role": "kv_both",
"kv_connector_module_path": "tracestore.client.engines.vllm.connector"}``; the setting comes from
``kv_connector_extra_config["tracestore"]`` or ``TRACESTORE_RECORD``.

Scheduler side (one per engine core):

- ``on_new_request`` keeps each :class:`vllm.v1.request.Request` (its ``all_token_ids`` and
  ``spec_token_ids`` give every scheduled position's input id);
- ``build_connector_meta`` turns the step's ``SchedulerOutput`` (new and cached requests,
  ``num_scheduled_tokens``, ``scheduled_spec_decode_tokens``) into a
  :class:`~tracestore.client.engines.rows.StepPlan` through a
  :class:`~tracestore.client.engines.rows.RowMapper`, sent to the workers as the step's metadata;
- ``request_finished`` ends the request in the mapper (aborted: a gap) and returns the dict vLLM
  puts on the request output as ``kv_transfer_params``: ``{"tracestore": {"trajectory",
  "n_tokens", "gap", "trace_ref"}}``. Where the recording worker lives in this process (a
  one-process engine, or vLLM's uniproc executor) the seal is queued here at once. Otherwise the
  ending rides on the next step's metadata to the workers, which seal and then report the request
  through ``get_finished``; until then vLLM keeps its blocks and keeps stepping (the path vLLM
  has for asynchronous KV sends). The ``trace_ref`` is then made here from the run identity the
  recording worker sent back (``update_connector_output``; null before any forward declared it).

Worker side: ``bind_connector_metadata`` hands the plan to the forward's capture
(:mod:`.hooks`) and seals the endings it carries; ``get_finished`` reports them;
``build_connector_worker_meta`` sends the run identity once; ``shutdown`` flushes and closes the
recorder; every other connector method is a no-op (no KV is loaded or saved). Only tensor-parallel
rank 0 records (:func:`~tracestore.client.engines.vllm.hooks.recording_rank`); pipeline
parallelism, and asynchronous scheduling with speculative decoding, are refused at start-up
(:func:`check_config`).

Asynchronous scheduling (``AsyncScheduler``): a step is scheduled before the previous step's
sampled token is known — ``Request.all_token_ids`` lacks it (``num_output_placeholders`` counts
it) while ``num_computed_tokens`` already counts its position. Positions are therefore exact at
schedule time, input ids are not: the positions past ``all_token_ids`` are planned as pending
(``Scheduled.n_pending``), their rows held by the worker, and released with their ids once a
later step's schedule finds them in ``all_token_ids`` (:meth:`RowMapper.learn`) or the request's
final ids confirm them. Each record then carries its token ids (``ids_crc``) one step later.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch  # noqa: F401  (before vLLM: an environment without torch reports the missing extra)
from tracestore.client.engines import setting as _setting
from tracestore.client.engines.recording import unguided_reason
from tracestore.client.engines.rows import Ending, RowMapper, Scheduled, StepPlan
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from tracestore.errors import ConfigError
from tracestore.traceref import TraceRef, site_digest, split_attempt_id

from . import hooks

log = logging.getLogger("tracestore.client.engines")


@dataclasses.dataclass
class TraceStoreConnectorMetadata(KVConnectorMetadata):
    """One step's row plan, and the requests that ended since the last step (their seals)."""

    plan: StepPlan
    endings: list[tuple[str, Ending]] = dataclasses.field(default_factory=list)  # (request id, ending)


@dataclasses.dataclass
class TraceStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the recording worker's run identity (``run``, ``policy_version``,
    ``writer``, ``sites``: the digest of its run's sites), which a scheduler in another process
    needs to make each request's TraceRef, and ``failed``: trajectories whose rows never reached
    the recorder since the last report (the scheduler's mapper stops linking to them, and ends
    them with a gap). Only the recording rank sends one."""

    identity: dict[str, Any] | None = None
    failed: list[str] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TraceStoreWorkerMetadata):
            return self
        return TraceStoreWorkerMetadata(self.identity or other.identity, self.failed + other.failed)


def run_identity(engine: Any) -> dict[str, Any] | None:
    """An :class:`EngineRecorder`'s run identity once its run is declared, else None."""
    if engine is None or engine.run_spec is None or engine.recorder is None:
        return None
    return {
        "run": engine.run_spec.run,
        "policy_version": int(engine.recorder.policy_version),
        "writer": engine.setting.writer,
        "sites": site_digest(engine.run_spec),
    }


def scheduler_ref(identity: dict[str, Any], ending: Ending) -> str:
    """The TraceRef JSON of ``ending`` made on the scheduler side from the worker's ``identity``:
    guided when the scheduler's plan left no gap (the worker seals it with the next step's metadata;
    that the seal is durable is the sidecar's to confirm, e.g. ``check_refs``)."""
    base, attempt = split_attempt_id(ending.trajectory)
    gap = ending.gap
    return TraceRef(
        run=identity["run"],
        policy_version=identity["policy_version"],
        trajectory=base,
        attempt=attempt,
        n_tokens=max(ending.n_tokens, 1),
        sites=identity["sites"],
        guided=gap is None,
        reason="" if gap is None else unguided_reason(gap),
        writer=identity["writer"],
    ).to_json()


def check_config(vllm_config: Any) -> None:
    """Refuse (:class:`ConfigError`, naming the fix) engine configurations whose rows the connector
    cannot map: asynchronous scheduling with speculative decoding (the scheduler plans a step with
    ``-1`` placeholders for the drafts the worker proposes on the device, and counts every draft
    as computed until the next update corrects it: neither a draft row's id nor the next step's
    positions are known when the step is planned), a MoE model under data parallelism (the MoE
    input rows at the FlashInfer entry are the data-parallel group's tokens, all-gathered or
    dispatched to their experts' ranks, not the rank's own forward's) and pipeline parallelism (no
    one worker runs every layer, so no one recorder has the run's sites)."""
    sched = getattr(vllm_config, "scheduler_config", None)
    if getattr(sched, "async_scheduling", False) and getattr(vllm_config, "speculative_config", None) is not None:
        raise ConfigError(
            "tracestore cannot record vLLM's asynchronous scheduling together with speculative decoding: "
            "the drafts are proposed on the device after the step is scheduled (the scheduler sees -1 "
            "placeholders) and the next step's positions assume every draft accepted, so draft rows could "
            "not be tied to their tokens. Start vLLM with async_scheduling=False (--no-async-scheduling), "
            "or without speculative decoding, or unset TRACESTORE_RECORD."
        )
    par = getattr(vllm_config, "parallel_config", None)
    model = getattr(vllm_config, "model_config", None)
    if int(getattr(par, "data_parallel_size", 1) or 1) > 1 and model is not None and bool(model.is_moe):
        raise ConfigError(
            "tracestore cannot record a MoE model under vLLM's data parallelism: before the FlashInfer MoE "
            "entry vLLM dispatches the tokens across the data-parallel group (all-gathered in DP-rank order "
            "without expert parallelism, sent to their experts' ranks with it), so a rank's MoE input rows "
            "are not its own forward's tokens. Run each replica as its own engine (data_parallel_size=1; "
            "expert parallelism within one replica is fine), or unset TRACESTORE_RECORD."
        )
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        raise ConfigError(
            "tracestore records within one process per engine and does not support pipeline "
            "parallelism (each stage runs other layers); use tensor parallelism, or unset TRACESTORE_RECORD."
        )


def _status_aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.FINISHED_ABORTED)


class TraceStoreConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        text = extra.get("tracestore")
        self.setting = _setting.parse_setting(text) if text else _setting.setting_from_env()
        if self.setting is None:
            raise ConfigError(
                "TraceStoreConnector needs the recording setting: "
                f"kv_connector_extra_config['tracestore'] or {_setting.ENV}"
            )
        check_config(vllm_config)
        block = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 16) or 16)
        self.async_scheduling = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        self.mapper = RowMapper(block=block)
        self._requests: dict[str, Any] = {}
        self._endings: list[tuple[str, Ending]] = []
        self._sealed: set[str] = set()  # worker: requests sealed since the last get_finished
        self._identity: dict[str, Any] | None = None  # scheduler: the recording worker's run identity
        self._sent: dict[str, Any] | None = None  # worker: the identity last sent to the scheduler
        if role == KVConnectorRole.WORKER:
            hooks.LOCAL_WORKER = True
        if role == KVConnectorRole.WORKER and hooks.ENGINE is None:
            from tracestore.client.engines import vllm as plugin

            plugin.register()  # no-op where the entry point already ran
            if hooks.ENGINE is None:
                hooks.install(self.setting)
        if role == KVConnectorRole.WORKER:
            model = getattr(vllm_config, "model_config", None)
            hooks.set_graph_mode(bool(getattr(model, "enforce_eager", True)))
            if not hooks.recording_rank():
                hooks.disable("tensor-parallel rank > 0: rank 0 of the group records the same rows")

    # -- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests.setdefault(request.request_id, request)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def _ids(self, rid: str, start: int, n: int, drafts: list[int]) -> list[int]:
        req = self._requests[rid]
        known = list(req.all_token_ids[start : start + n - len(drafts)])
        return known + list(drafts)

    def _scheduled(self, rid: str, start: int, n: int, drafts: list[int]) -> Scheduled:
        """One request's share of the step; under asynchronous scheduling the positions past the
        ids vLLM knows are pending, and the ids it learned since the last step go to the mapper."""
        if not self.async_scheduling:
            return Scheduled(rid, start, n, len(drafts), self._ids(rid, start, n, drafts))
        ids = self._requests[rid].all_token_ids
        have = self.mapper.n_ids(rid)
        if len(ids) > have:
            self.mapper.learn(rid, have, list(ids[have:]))
        known = max(0, min(n, len(ids) - start))
        return Scheduled(rid, start, n, 0, list(ids[start : start + known]), n_pending=n - known)

    def build_connector_meta(self, scheduler_output: Any) -> TraceStoreConnectorMetadata:
        sched = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        batch = []
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            if rid not in self._requests:
                raise ConfigError(f"request {rid} was scheduled but never announced to the connector")
            if not self.mapper.known(rid):
                self.mapper.add(rid, list(new.prompt_token_ids or []))
            batch.append(self._scheduled(rid, new.num_computed_tokens, sched[rid], list(spec.get(rid, ()))))
        cached = scheduler_output.scheduled_cached_reqs
        for rid, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if rid not in sched or not self.mapper.known(rid):
                continue
            batch.append(self._scheduled(rid, start, sched[rid], list(spec.get(rid, ()))))
        plan = self.mapper.step(batch)
        meta = TraceStoreConnectorMetadata(plan, self._endings)
        self._endings = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        if not self.mapper.known(rid):
            return False, None
        ending = self.mapper.finish(rid, list(request.all_token_ids), aborted=_status_aborted(request))
        if hooks.LOCAL_WORKER and hooks.ENGINE is not None:  # the recording worker is this process: seal now
            return False, {"tracestore": hooks.ENGINE.end_request(ending)}
        # The worker seals it when the next step's metadata reaches it; until its get_finished says
        # so, vLLM keeps the request's blocks and keeps stepping (as for an asynchronous KV send).
        # The TraceRef is made here from the run identity the recording worker sent back.
        self._endings.append((rid, ending))
        ref = None if self._identity is None else scheduler_ref(self._identity, ending)
        params = {"trajectory": ending.trajectory, "n_tokens": ending.n_tokens, "gap": ending.gap, "trace_ref": ref}
        return True, {"tracestore": params}

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, TraceStoreWorkerMetadata):
            return
        if meta.identity is not None:
            self._identity = meta.identity
        for trajectory in meta.failed:
            self.mapper.mark_gap(trajectory)

    # -- worker side ------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TraceStoreConnectorMetadata):
            hooks.PLAN.value = connector_metadata.plan
            for rid, ending in connector_metadata.endings:
                if hooks.ENGINE is not None:
                    try:
                        hooks.ENGINE.end_request(ending)
                    except Exception:
                        log.exception("tracestore: sealing %s failed", ending.trajectory)
                self._sealed.add(rid)

    def build_connector_worker_meta(self) -> TraceStoreWorkerMetadata | None:
        """The recording worker's run identity, once the run is declared (again if it changes), and
        the trajectories that failed since the last step."""
        ident = run_identity(hooks.ENGINE)
        failed = [] if hooks.ENGINE is None else hooks.ENGINE.take_failed()
        if ident == self._sent:
            ident = None
        elif ident is not None:
            self._sent = ident
        if ident is None and not failed:
            return None
        return TraceStoreWorkerMetadata(ident, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._sealed = self._sealed, set()
        return (done or None), None

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER and hooks.ENGINE is not None:
            hooks.ENGINE.close(30)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
