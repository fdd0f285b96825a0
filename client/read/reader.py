"""GuidanceReader: the trainer's side. Plan in, ``{site: Guidance}`` out, aligned row for row.

``source`` is a storage URL (direct ranged reads through
:class:`tracestore.storage.reader.StoreReader`; the scalable path, no sidecar involved) or a sidecar
address (``host:port`` / ``unix:///sock``, the ``Read`` RPC; ``grpcs://host:port`` for TLS, or
``channel_credentials=`` and ``token=`` for a sidecar that requires them, see
:func:`tracestore.client.transport.channel`). The next plan can be fetched in the background
(:meth:`GuidanceReader.prefetch`) while the current microbatch trains. With ``process=True``
(storage URLs) every read decodes in a child process and lands in shared memory
(:mod:`tracestore.client.read.read_process`); ``process=N`` splits each read's rows among N
children. Beside a training loop that keeps the GIL busy, a prefetch in a thread of the trainer
waits for that lock between its copies, a child does not; and N children decode on N cores where one
process reaches about 2. Results are torch tensors on ``device``; for a CUDA device the host arrays
are pinned (in the prefetch thread, for a prefetched plan) and copied with ``non_blocking=True`` on
the current stream.

The source is chosen once, at construction (:func:`tracestore.client.read.row_sources.open_rows`);
each gives ``{site: SiteRows}`` (:class:`tracestore.storage.rows.SiteRows`), which
:meth:`GuidanceReader.read_host` returns as they are and :meth:`GuidanceReader.read` turns into
:class:`~tracestore.guidance.Guidance` of host tensors (pinned for CUDA), then moves to ``device``.

Artifact sites (``routed_experts``, ``logprobs``; docs/data-model.md "Artifacts") come back from
:meth:`GuidanceReader.read` as :class:`~tracestore.artifacts.Routing` and
:class:`~tracestore.artifacts.LogProbs`, aligned to the same plan (packed/THD, padded, CP chunks;
a PP stage's site subset picks its layers' routing) and checked by token identity as records
are; :class:`~tracestore.client.hf.routing.RoutingReplayHooks` replays the routing.

Token identity: give a read the microbatch's token ids (``token_ids=``: the packed ``input_ids``
aligned with the plan, or a mapping trajectory -> ids from position 0) and every record that
carries its token identity is checked against them (:mod:`tracestore.storage.identity_check`).
Records made for other token ids raise :class:`~tracestore.errors.GuidanceMismatch`
(``on_mismatch="error"``, the default) or come back invalid, so those trajectories train
unguided, named with the reason in ``report.mismatched`` (``on_mismatch="mask"``). Either way
the trajectories are counted (:attr:`GuidanceReader.stats`, and the Prometheus counter
``tracestore_reader_guidance_mismatches_total`` when ``prometheus_client`` is installed).

Example::

    reader = GuidanceReader("s3://bucket/trace", "run-1", sites=my_stage_sites, device="cuda")
    reader.prefetch(next_plan, token_ids=next_input_ids)
    guidance = reader.read(plan, token_ids=input_ids)   # {site: Guidance}
    y = tracestore.kernels.guided_fp4(x, guidance["layers.23.mlp.input"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tracestore.errors import ConfigError, GuidanceMismatch
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec, validate_id

from .config import ReaderConfig
from .row_sources import Query, RowSource, open_rows, segments

if TYPE_CHECKING:  # pragma: no cover
    from tracestore.storage.rows import SiteRows

PlanLike = MicrobatchPlan | Sequence[tuple[str | None, int, int]]


def artifact_rows(r: SiteRows, t: Any) -> Any:
    """An artifact site's read rows as :class:`~tracestore.artifacts.Routing` or
    :class:`~tracestore.artifacts.LogProbs` of tensors (``t`` makes a tensor of an array): a row
    is valid where the read found a record and its flag says valid."""
    from tracestore.artifacts import LogProbs, Routing, decode_logprobs, decode_routing

    present = np.asarray(r.valid, bool)
    if r.site.kind == "routed_experts":
        d = decode_routing(r.site, r.codes, r.scales, present)
        return Routing(r.site, t(d.experts), t(d.valid), t(d.gate))
    values, valid = decode_logprobs(r.site, r.codes, r.scales, present)
    return LogProbs(r.site, t(values), t(valid))


class GuidanceReader:
    """Reads guidance for microbatch plans. See the module docstring."""

    def __init__(
        self,
        source: str,
        run: str,
        *,
        versions: int | Iterable[int] | None = None,
        sites: Iterable[str] | None = None,
        columns: tuple[int, int] | None = None,
        device: Any = "cpu",
        on_missing: str = "error",
        prefetch: bool = True,
        rule: str = "bracket",
        storage_options: dict[str, Any] | None = None,
        timeout: float = 120.0,
        process: bool | int = False,
        channel_credentials: Any = None,
        token: str | None = None,
        on_mismatch: str = "error",
    ) -> None:
        cfg = ReaderConfig(
            None if versions is None or isinstance(versions, int) else tuple(versions),
            None if sites is None else tuple(sites),
            columns,
            device,
            on_missing,
            prefetch,
            rule,
            storage_options,
            timeout,
            process,
            channel_credentials,
            token,
            on_mismatch,
        )
        self.config = cfg
        validate_id("run", run)
        self.source = source
        self.run = run
        self.versions = cfg.versions
        self.sites = None if cfg.sites is None else list(cfg.sites)
        self.columns = cfg.columns
        self.device = device
        self.on_missing = on_missing
        self.rule = rule
        self.timeout = cfg.timeout
        self._lock = threading.Lock()
        self._pending: dict[tuple[Any, ...], Future[Rows]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracestore-prefetch") if prefetch else None
        self.last_report: ReadReport | None = None  # of the latest read() / read_host()
        # trajectories whose records belong to other token ids: refused reads, masked trajectories
        self.stats = {"mismatch_refused": 0, "mismatch_masked": 0}
        query = Query(
            run,
            self.versions,
            self.sites,
            self.columns,
            "mask" if on_missing == "mask" else "error",
            "mask" if on_mismatch == "mask" else "error",
        )
        self._rows: RowSource = open_rows(
            source,
            query,
            storage_options=storage_options,
            timeout=timeout,
            process=process,
            channel_credentials=channel_credentials,
            token=token,
        )

    @classmethod
    def from_config(cls, source: str, run: str, config: ReaderConfig) -> GuidanceReader:
        """A reader with the settings of ``config`` (the keyword arguments' values as one value)."""
        if not isinstance(config, ReaderConfig):
            raise ConfigError(f"config must be a ReaderConfig, got {type(config).__name__}")
        return cls(source, run, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @property
    def spec(self) -> RunSpec | None:
        """The run's declaration (from a sidecar: None until the first read)."""
        return self._rows.spec

    # -- public -----------------------------------------------------------------------------------

    def prefetch(self, plan: PlanLike, token_ids: Any = None) -> None:
        """Start reading ``plan`` in the background; a later :meth:`read` of the same plan (and the
        same ``token_ids``) uses it."""
        if self._pool is None:
            return
        key = _plan_key(plan, token_ids)
        with self._lock:
            if key not in self._pending:
                # In the background, beside the training loop's Python: short copies and CRCs keep
                # the GIL instead of queueing for it after each
                # (tracestore.storage.read_out._copy_held). The rows are staged there too (pinned
                # for a CUDA device): read() then only queues the non-blocking copies to the device.
                self._pending[key] = self._pool.submit(self._staged, plan, True, self._cuda_index(), token_ids)

    def read(self, plan: PlanLike, token_ids: Any = None) -> dict[str, Any]:
        """``{site: tracestore.guidance.Guidance}`` for ``plan`` (rows in plan order, with
        ``valid``). The result's ``report`` (also :attr:`last_report`) says which share of its rows
        falls back to RTN (:class:`ReadReport`). ``token_ids``: the microbatch's token ids, to check
        every record's token identity (see the module docstring)."""
        import torch

        key = _plan_key(plan, token_ids)
        with self._lock:
            fut = self._pending.pop(key, None)
        staged = fut.result() if fut is not None else self._staged(plan, token_ids=token_ids)
        self.last_report = staged.report
        dev = torch.device(self.device)
        # from pinned memory (a CUDA device): the copies are queued on the current stream
        return Rows({name: g.to(dev, non_blocking=dev.type == "cuda") for name, g in staged.items()}, staged.report)

    def read_host(self, plan: PlanLike, token_ids: Any = None) -> dict[str, SiteRows]:
        """The same rows as numpy arrays (:class:`~tracestore.storage.rows.SiteRows`, no torch
        needed), with the same ``report``."""
        rows = self._fetch(plan, token_ids=token_ids)
        self.last_report = rows.report
        return rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._rows.close()

    def __enter__(self) -> GuidanceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching ---------------------------------------------------------------------------------

    def _fetch(self, plan: PlanLike, background: bool = False, token_ids: Any = None) -> Rows:
        if not isinstance(plan, MicrobatchPlan):
            plan = MicrobatchPlan(plan)
        try:
            rows, mismatched = self._rows.rows(plan, background, token_ids)
        except GuidanceMismatch:
            self._count("refused", 1)
            raise
        if mismatched:
            self._count("masked", len(mismatched))
        return Rows(rows, read_report(plan, rows, mismatched))

    def _count(self, outcome: str, n: int) -> None:
        with self._lock:
            self.stats[f"mismatch_{outcome}"] += n
        counter = _mismatch_counter()
        if counter is not None:
            counter.labels(self.run, outcome).inc(n)

    def _cuda_index(self) -> int | None:
        """The CUDA device the results go to, resolved in the calling (training) thread, where
        ``"cuda"`` means its current device; None for other devices."""
        import torch

        dev = torch.device(self.device)
        if dev.type != "cuda":
            return None
        return dev.index if dev.index is not None else torch.cuda.current_device()

    def _staged(self, plan: PlanLike, background: bool = False, cuda: int | None = None, token_ids: Any = None) -> Rows:
        """``plan``'s rows as :class:`~tracestore.guidance.Guidance` of host tensors, pinned when
        the device is CUDA: the part of :meth:`read` that copies bytes, done in the prefetch thread
        for a prefetched plan (pinning 200 MB is a copy of its own, which the training thread then
        no longer waits for). ``cuda``: the training thread's device, made current here while
        pinning, so that a prefetch thread never creates a CUDA context on device 0 for a rank that
        trains on another."""
        import torch

        from tracestore.guidance import Guidance

        pin = torch.device(self.device).type == "cuda"
        rows = self._fetch(plan, background, token_ids)

        def t(a: np.ndarray | None) -> Any:
            if a is None:
                return None
            x = torch.from_numpy(np.ascontiguousarray(a))
            return x.pin_memory() if pin else x

        with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
            staged = {
                name: artifact_rows(r, t)
                if r.site.is_artifact
                else Guidance(
                    codes=t(r.codes),
                    scales=t(r.scales),
                    global_scale=t(np.asarray(r.global_scale, np.float32)),  # (no copy: already float32)
                    bits=r.site.bits,
                    fmt=r.site.fmt,
                    rule=self.rule,  # type: ignore[arg-type]
                    token_scales=t(r.token_scales),
                    valid=t(np.asarray(r.valid, bool)),
                )
                for name, r in rows.items()
            }
        return Rows(staged, rows.report)


@dataclasses.dataclass(frozen=True)
class ReadReport:
    """Which rows of one read fall back to RTN: ``rows`` counts the plan's rows that are not
    padding, summed over the sites read, ``unguided_rows`` those of them without a record (no record
    stored, masked, or the final position of a sealed trajectory, unrecorded by design);
    ``mismatched``: trajectories returned unguided because their records belong to other token ids
    (trajectory -> why; ``on_mismatch="mask"``)."""

    rows: int
    unguided_rows: int
    mismatched: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def unguided_fraction(self) -> float:
        return self.unguided_rows / self.rows if self.rows else 0.0


class Rows(dict):  # type: ignore[type-arg]
    """A read's ``{site: rows}`` with its :class:`ReadReport` as ``report``."""

    def __init__(self, rows: Mapping[str, Any], report: ReadReport) -> None:
        super().__init__(rows)
        self.report = report


def read_report(
    plan: PlanLike, rows: Mapping[str, SiteRows], mismatched: Mapping[str, str] | None = None
) -> ReadReport:
    """The :class:`ReadReport` of ``plan`` from each site's rows."""
    if not isinstance(plan, MicrobatchPlan):
        plan = MicrobatchPlan(plan)
    real = np.ones(plan.n_tokens, dtype=bool)
    for i, seg in enumerate(plan.segments):
        if seg.trajectory is None:
            real[int(plan.offsets[i]) : int(plan.offsets[i + 1])] = False
    n = unguided = 0
    for r in rows.values():
        if r.site.is_artifact:  # not FP4 records: nothing falls back to RTN there
            continue
        mask = np.repeat(real, r.site.rows_per_token)
        n += int(mask.sum())
        unguided += int((mask & ~np.asarray(r.valid, dtype=bool)).sum())
    return ReadReport(n, unguided, dict(mismatched or {}))


def _plan_key(plan: PlanLike, token_ids: Any = None) -> tuple[Any, ...]:
    segs = segments(plan) if isinstance(plan, MicrobatchPlan) else [tuple(s) for s in plan]
    return (tuple(segs), _ids_key(token_ids))


def _ids_key(token_ids: Any) -> Any:
    """What tells two reads' token ids apart (a prefetch serves only a read of the same ids)."""
    from tracestore.identity import as_token_ids

    if token_ids is None:
        return None
    if isinstance(token_ids, Mapping):
        return tuple(sorted((str(t), zlib.crc32(as_token_ids(v).data)) for t, v in token_ids.items()))
    return zlib.crc32(as_token_ids(token_ids).data)


_COUNTER: list[Any] = []


def _mismatch_counter() -> Any:
    """The process's ``tracestore_reader_guidance_mismatches_total{run, outcome}`` (None without
    ``prometheus_client``)."""
    if not _COUNTER:
        try:
            from prometheus_client import Counter
        except ImportError:
            _COUNTER.append(None)
        else:
            _COUNTER.append(
                Counter(
                    "tracestore_reader_guidance_mismatches",
                    "Trajectories whose records belong to other token ids than the trainer's "
                    "(outcome: refused = the read raised GuidanceMismatch, masked = returned unguided)",
                    ["run", "outcome"],
                )
            )
    return _COUNTER[0]
