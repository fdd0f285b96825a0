"""Rank plans: one trainer rank's :class:`~tracestore.plan.MicrobatchPlan` from TraceRefs and the
trainer's own batch layout, so that the rank reads only its own rows.

The trainer describes its layout (:class:`TrainerLayout`): data-parallel size and which samples
each DP rank trains (default: contiguous equal shares in ref order), packed sequences
(``cu_seqlens``, THD) or a padded ``[B, S]`` batch, context-parallel size (zig-zag: each sequence,
or each padded row, is cut into ``2*cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2*cp-1-r``; contiguous halves without zig-zag), pipeline stages (each stage reads the sites of
its layers) and tensor parallelism (each TP rank reads its share of the columns of the sites
whose kinds TP splits, K/V heads by default; other sites whole). :func:`rank_plan` gives a rank's
:class:`RankPlan`: the plan's rows are exactly the rank's local rows, in the rank's order, so
row ``i`` of a read is the token at local position ``i`` of the rank's batch.

Unguided refs and missing records. A ref that is not guided has no records to read: its rows are
padding in the plan (they come back invalid and train with RTN) and are counted in
``RankPlan.unguided_tokens``; ``on_missing="error"`` refuses such a ref instead. Records missing
behind a guided ref are found at read time (:meth:`RankPlan.read`): masked and counted with
``"rtn"``, an error with ``"error"``.

Example::

    layout = TrainerLayout(dp_size=2, cp_size=2, packing="packed")
    rp = rank_plan(refs, layout, RankCoord(dp=1, cp=0), run_spec=spec)
    rows = rp.read(store_reader)                 # RankRead: {site: SiteRows} + unguided fraction
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.plan import MicrobatchPlan
from tracestore.records import RunSpec, SiteSpec

if TYPE_CHECKING:  # pragma: no cover
    from tracestore.storage.reader import ReadResult, SiteRows, StoreReader
    from tracestore.traceref import TraceRef

Packing = Literal["packed", "padded"]
OnMissingRef = Literal["rtn", "error"]


def _pos_int(name: str, v: object, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class RankCoord:
    """A trainer rank's coordinates: data-, context-, pipeline- and tensor-parallel ranks."""

    dp: int = 0
    cp: int = 0
    pp: int = 0
    tp: int = 0


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """How the trainer lays out one step's samples (see the module docstring).

    ``dp_assignment``: the sample indices (into the step's refs) each DP rank trains, in that
    rank's order (default: contiguous shares, the first ``len % dp_size`` ranks one more).
    ``max_len``: the padded width (default: the longest sample of the rank, rounded up to a
    multiple of the CP chunk count). ``stage_layers``: decoder layers per pipeline stage (default:
    the run's layers split as evenly as possible, earlier stages taking the remainder).
    ``tp_kinds``: site kinds whose columns tensor parallelism splits (the rest are replicated).
    """

    dp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    tp_size: int = 1
    packing: Packing = "packed"
    max_len: int | None = None
    pad_left: bool = False
    zigzag: bool = True
    dp_assignment: tuple[tuple[int, ...], ...] | None = None
    stage_layers: tuple[int, ...] | None = None
    tp_kinds: tuple[str, ...] = ("key", "value")

    def __post_init__(self) -> None:
        for name in ("dp_size", "cp_size", "pp_size", "tp_size"):
            _pos_int(name, getattr(self, name))
        if self.packing not in ("packed", "padded"):
            raise ConfigError(f"packing must be 'packed' or 'padded', got {self.packing!r}")
        if self.max_len is not None:
            _pos_int("max_len", self.max_len)
            if self.packing != "padded":
                raise ConfigError("max_len applies to packing='padded' only")
        if self.dp_assignment is not None:
            a = tuple(tuple(int(i) for i in part) for part in self.dp_assignment)
            if len(a) != self.dp_size:
                raise ConfigError(f"dp_assignment must list {self.dp_size} ranks' samples, got {len(a)}")
            object.__setattr__(self, "dp_assignment", a)
        if self.stage_layers is not None:
            s = tuple(_pos_int("stage_layers entry", n, 0) for n in self.stage_layers)
            if len(s) != self.pp_size:
                raise ConfigError(f"stage_layers must give {self.pp_size} stages' layer counts, got {len(s)}")
            object.__setattr__(self, "stage_layers", s)
        object.__setattr__(self, "tp_kinds", tuple(self.tp_kinds))

    @property
    def cp_chunks(self) -> int:
        return 2 * self.cp_size if self.zigzag and self.cp_size > 1 else self.cp_size

    def samples(self, n: int, dp: int) -> tuple[int, ...]:
        """The sample indices DP rank ``dp`` trains when the step has ``n`` samples."""
        if self.dp_assignment is not None:
            flat = [i for part in self.dp_assignment for i in part]
            if sorted(flat) != list(range(n)):
                raise ValidationError(
                    f"dp_assignment must list each of the step's {n} samples exactly once across ranks, got {flat}"
                )
            return self.dp_assignment[dp]
        q, r = divmod(n, self.dp_size)
        start = dp * q + min(dp, r)
        return tuple(range(start, start + q + (1 if dp < r else 0)))

    def stage_sites(self, spec: RunSpec, pp: int) -> tuple[str, ...]:
        """The sites pipeline stage ``pp`` reads: those of its layers (FP4 sites and routing),
        and on the last stage the ``logprobs`` artifact."""
        n_layers = max((s.layer for s in spec.sites), default=-1) + 1
        counts = self.stage_layers
        if counts is None:
            q, r = divmod(n_layers, self.pp_size)
            counts = tuple(q + (1 if i < r else 0) for i in range(self.pp_size))
        elif sum(counts) < n_layers:
            raise ConfigError(
                f"stage_layers {counts} cover {sum(counts)} layers, the run has sites up to layer {n_layers - 1}"
            )
        lo = sum(counts[:pp])
        hi = lo + counts[pp]
        last = pp == self.pp_size - 1  # where the logits are: the log-prob artifacts' stage
        return tuple(s.name for s in spec.sites if (last if s.kind == "logprobs" else lo <= s.layer < hi))

    def columns(self, site: SiteSpec, tp: int) -> tuple[int, int]:
        """The column range of ``site`` TP rank ``tp`` reads."""
        if self.tp_size == 1 or site.kind not in self.tp_kinds:
            return (0, site.width)
        if site.width % self.tp_size:
            raise ConfigError(f"site {site.name}: width {site.width} does not split into {self.tp_size} TP ranks")
        part = site.width // self.tp_size
        a, b = tp * part, (tp + 1) * part
        block = site.fmt.block
        if a % block or b % block or (a * site.bits) % 8 or (b * site.bits) % 8:
            raise ConfigError(
                f"site {site.name}: TP share [{a}, {b}) of width {site.width} is not aligned to the {site.format} "
                f"block {block}; such a site cannot be column-split {self.tp_size} ways"
            )
        return (a, b)


@dataclasses.dataclass
class RankRead:
    """A rank's rows: ``rows[site]`` (:class:`~tracestore.storage.reader.SiteRows`, plan order), and
    what fell back to RTN. ``rows_total`` counts non-padding rows over the FP4 sites read (artifact
    sites, such as routing, are not counted);
    ``unguided_rows`` those without a record: unguided refs, masked missing records
    (``missing_rows``; ``missing_refs``: guided refs whose trajectory has no seal on storage at all)
    and the final positions of sealed trajectories (unrecorded by design, ``exempt_rows``)."""

    plan: RankPlan
    result: ReadResult
    rows_total: int
    unguided_rows: int
    missing_rows: int
    exempt_rows: int
    unguided_ref_rows: int
    missing_refs: list[str] = dataclasses.field(default_factory=list)  # guided refs with no seal stored

    def __getitem__(self, site: str) -> SiteRows:
        return self.result[site]

    @property
    def rows(self) -> Mapping[str, SiteRows]:
        return self.result

    @property
    def unguided_fraction(self) -> float:
        return self.unguided_rows / self.rows_total if self.rows_total else 0.0


@dataclasses.dataclass
class RankPlan:
    """One rank's plan: ``plan`` (its local rows in order; unguided refs' rows are padding),
    ``sources[i]`` the ref behind segment ``i`` and the ref's tokens there (None for padding), the
    ``sites`` its pipeline
    stage reads and each site's TP ``columns``; ``unguided_tokens`` / ``real_tokens``: tokens of
    unguided refs / of any ref on this rank."""

    coord: RankCoord
    plan: MicrobatchPlan
    sources: tuple[tuple[TraceRef, int, int] | None, ...]
    sites: tuple[str, ...]
    columns: dict[str, tuple[int, int]]
    versions: tuple[int, ...]
    unguided_tokens: int
    real_tokens: int
    on_missing: OnMissingRef
    refs: tuple[TraceRef, ...]

    @property
    def n_tokens(self) -> int:
        return self.plan.n_tokens

    def token_map(self) -> list[tuple[str | None, int]]:
        """Per local row (token): ``(stored trajectory id, token)`` or ``(None, -1)`` for padding —
        including unguided refs' rows, which carry their ids here (a reference for tests)."""
        out: list[tuple[str | None, int]] = []
        for seg, src in zip(self.plan.segments, self.sources, strict=True):
            if src is None:
                out += [(None, -1)] * seg.n_tokens
            else:
                out += [(src[0].stored_id, t) for t in range(src[1], src[2])]
        return out

    def read(self, reader: StoreReader, *, check: bool = True, **kw: Any) -> RankRead:
        """Read this rank's rows with ``reader`` (one
        :class:`~tracestore.storage.reader.StoreReader` per rank). ``check``: first check the guided
        refs against their seals (token count, site set; :func:`tracestore.traceref.check_refs`), so
        a forged or stale handle fails loudly instead of misaligning. Rows whose record carries
        another policy version than its ref are refused (ValidationError)."""
        from tracestore.traceref import check_refs

        guided = [r for r in self.refs if r.guided]
        missing: list[str] = []
        if check:
            # refreshes the refs' versions; a ref without a seal is missing, not misaligned: its
            # rows are masked and counted with on_missing="rtn", refused with "error"
            check_refs(guided, reader, missing="skip" if self.on_missing == "rtn" else "error")
            kw.setdefault("refresh", False)
            missing = [r.stored_id for r in guided if reader.seal(r.stored_id, {r.policy_version}) is None]
        res = reader.read(
            self.plan,
            versions=self.versions or None,
            sites=self.sites,
            columns=self.columns,
            on_missing="mask" if self.on_missing == "rtn" else "error",
            **kw,
        )
        self._check_versions(res)
        rows_total = 0
        unguided = 0
        pad = self._padding_tokens()
        ref_rows = 0
        for name in res:
            r = res[name]
            if r.site.is_artifact:  # routing / log-prob rows: nothing falls back to RTN there
                continue
            k = r.site.rows_per_token
            real = np.repeat(~pad, k)
            rows_total += int(real.sum()) + self.unguided_tokens * k
            unguided += int((real & ~r.valid).sum()) + self.unguided_tokens * k
            ref_rows += self.unguided_tokens * k
        return RankRead(
            self, res, rows_total, unguided, res.stats.missing_rows, res.stats.exempt_rows, ref_rows, missing
        )

    def _padding_tokens(self) -> np.ndarray:
        pad = np.zeros(self.plan.n_tokens, dtype=bool)
        for i, seg in enumerate(self.plan.segments):
            if seg.trajectory is None:
                pad[int(self.plan.offsets[i]) : int(self.plan.offsets[i + 1])] = True
        return pad

    def _check_versions(self, res: ReadResult) -> None:
        want = np.full(self.plan.n_tokens, -1, dtype=np.int64)
        for i, src in enumerate(self.sources):
            if src is not None:
                want[int(self.plan.offsets[i]) : int(self.plan.offsets[i + 1])] = src[0].policy_version
        for name in res:
            r = res[name]
            if r.site.is_artifact:  # routing / log-prob rows: nothing falls back to RTN there
                continue
            k = r.site.rows_per_token
            w = np.repeat(want, k)
            bad = r.valid & (r.policy_version != w)
            if bad.any():
                row = int(np.nonzero(bad)[0][0])
                raise ValidationError(
                    f"site {name} row {row}: record of policy version {int(r.policy_version[row])}, its ref says "
                    f"v{int(w[row])}"
                )


def rank_plan(
    refs: Sequence[TraceRef],
    layout: TrainerLayout,
    coord: RankCoord | None = None,
    *,
    run_spec: RunSpec,
    cu_seqlens: Sequence[int] | np.ndarray | None = None,
    lengths: Sequence[int] | None = None,
    on_missing: OnMissingRef = "rtn",
) -> RankPlan:
    """The :class:`RankPlan` of rank ``coord`` for one step whose samples are ``refs`` (in the
    trainer's sample order). Pure: reads nothing.

    ``cu_seqlens`` (packed) or ``lengths`` (either packing): the trainer's own token counts of the
    rank's samples (``cu_seqlens``) or of all samples (``lengths``); each must equal its ref's
    ``n_tokens``, else :class:`~tracestore.errors.ShapeError` names the sample (silent
    misalignment is what this refuses). Refs of another run are refused.
    """
    from tracestore.traceref import TraceRef

    coord = coord or RankCoord()
    if on_missing not in ("rtn", "error"):
        raise ConfigError(f"on_missing must be 'rtn' or 'error', got {on_missing!r}")
    for name, size in (("dp", layout.dp_size), ("cp", layout.cp_size), ("pp", layout.pp_size), ("tp", layout.tp_size)):
        v = getattr(coord, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size:
            raise ConfigError(f"rank {name}={v!r} is outside [0, {name}_size={size})")
    refs = tuple(refs)
    for i, r in enumerate(refs):
        if not isinstance(r, TraceRef):
            raise ValidationError(f"sample {i}: expected a TraceRef, got {type(r).__name__}")
        if r.run != run_spec.run:
            raise ValidationError(f"sample {i}: ref of {r.stored_id} belongs to run {r.run!r}, not {run_spec.run!r}")
    ids = [r.stored_id for r in refs]
    if len(set(ids)) != len(ids):
        dup = sorted({t for t in ids if ids.count(t) > 1})
        raise ValidationError(f"the step lists trajectories twice: {dup[:5]}")
    if lengths is not None:
        lens = [int(x) for x in lengths]
        if len(lens) != len(refs):
            raise ShapeError(f"lengths has {len(lens)} entries for {len(refs)} samples")
        for i, (r, n) in enumerate(zip(refs, lens, strict=True)):
            if n != r.n_tokens:
                raise ShapeError(f"sample {i} ({r.stored_id}): the trainer has {n} tokens, its ref {r.n_tokens}")
    mine = layout.samples(len(refs), coord.dp)
    if cu_seqlens is not None:
        cu = [int(x) for x in np.asarray(cu_seqlens).tolist()]
        if len(cu) != len(mine) + 1 or cu[0] != 0:
            raise ShapeError(f"cu_seqlens must have {len(mine) + 1} entries starting at 0 for this rank, got {cu}")
        for j, i in enumerate(mine):
            if cu[j + 1] - cu[j] != refs[i].n_tokens:
                raise ShapeError(
                    f"cu_seqlens gives sample {i} ({refs[i].stored_id}) {cu[j + 1] - cu[j]} tokens, its ref "
                    f"{refs[i].n_tokens}"
                )
    if on_missing == "error":
        bad = [refs[i] for i in mine if not refs[i].guided]
        if bad:
            raise ValidationError(
                f"refs {[r.stored_id for r in bad[:5]]} are unguided ({bad[0].reason}) and on_missing='error'"
            )
    n_chunks = layout.cp_chunks
    own = (coord.cp, n_chunks - 1 - coord.cp) if n_chunks != layout.cp_size else (coord.cp,)
    width = None
    if layout.packing == "padded" and mine:
        longest = max(refs[i].n_tokens for i in mine)
        width = layout.max_len if layout.max_len is not None else -(-longest // n_chunks) * n_chunks
        if width < longest:
            raise ShapeError(f"max_len {width} is shorter than sample {refs[mine[0]].stored_id}'s {longest} tokens")
        if width % n_chunks:
            raise ShapeError(f"max_len {width} must be a multiple of the {n_chunks} context-parallel chunks")
    segs: list[tuple[str | None, int, int]] = []
    sources: list[tuple[TraceRef, int, int] | None] = []
    real = unguided = 0

    def emit(src: TraceRef | None, a: int, b: int) -> None:
        if b <= a:
            return
        if src is None or not src.guided:
            segs.append((None, 0, b - a))
        else:
            segs.append((src.stored_id, a, b))
        sources.append(None if src is None else (src, a, b))

    for i in mine:
        r = refs[i]
        n = r.n_tokens
        row = width if width is not None else -(-n // n_chunks) * n_chunks
        lead = row - n if (width is not None and layout.pad_left) else 0
        size = row // n_chunks
        for c in own:
            a, b = c * size, (c + 1) * size
            lo, hi = max(a, lead), min(b, lead + n)
            if lo >= hi:
                emit(None, a, b)
                continue
            emit(None, a, lo)
            emit(r, lo - lead, hi - lead)
            emit(None, hi, b)
            real += hi - lo
            if not r.guided:
                unguided += hi - lo
    sites = layout.stage_sites(run_spec, coord.pp)
    cols = {s: layout.columns(run_spec.site(s), coord.tp) for s in sites}
    versions = tuple(sorted({refs[i].policy_version for i in mine if refs[i].guided}))
    return RankPlan(
        coord,
        MicrobatchPlan(segs),
        tuple(sources),
        sites,
        cols,
        versions,
        unguided,
        real,
        on_missing,
        tuple(refs[i] for i in mine),
    )


def all_coords(layout: TrainerLayout) -> list[RankCoord]:
    """Every rank of ``layout`` (dp-major, then cp, pp, tp)."""
    return [
        RankCoord(d, c, p, t)
        for d in range(layout.dp_size)
        for c in range(layout.cp_size)
        for p in range(layout.pp_size)
        for t in range(layout.tp_size)
    ]
