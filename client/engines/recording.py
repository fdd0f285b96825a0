"""One engine instance's recording: the forward's captured sites -> the recorder, by a step plan.

:class:`EngineRecorder` sits between an engine plugin and
:class:`tracestore.client.RolloutRecorder`:

- during a forward, the plugin's hooks call :meth:`EngineRecorder.capture` once per site with the
  record rows of every token of the forward (:func:`tracestore.client.engines.codes.record_rows`),
  and :meth:`EngineRecorder.capture_route` once per MoE layer with its routed expert ids (a
  ``routed_experts`` site, :mod:`tracestore.client.engines.routing`);
- after it, :meth:`EngineRecorder.end_forward` applies the step's
  :class:`~tracestore.client.engines.rows.StepPlan`: prefix links first, then the planned rows
  (one ``record_forward`` with their token ids), draft rows (and, under asynchronous scheduling,
  rows whose input id the engine has not reported yet) held until confirmed: under a
  :class:`~tracestore.client.engines.graph.GraphCapture` in its slab's spare rows on the device
  (confirmed ones are committed with the next forward's rows in one gather; no host read of
  device data), eagerly as host copies of their rows. A rejected draft's row is never handed to
  the recorder;
- :meth:`EngineRecorder.end_request` seals a finished request, or records why it has a gap, and
  returns the dict an engine hands back on the request output (with the :class:`TraceRef`).

Rows that never reach the recorder (a forward that fails or is refused, a held row with no room)
leave their trajectories with the gap ``unrecorded_positions``; such a trajectory is never a
prefix-link source: a planned link to it gives the linking trajectory that gap too, whether the
source is still running or has ended (remembered for the last :data:`REMEMBER_FAILED`). The plugin
hands :meth:`EngineRecorder.take_failed` to its :class:`~tracestore.client.engines.rows.RowMapper`
(:meth:`~tracestore.client.engines.rows.RowMapper.mark_gap`), so later plans stop offering them.

The run's sites are declared from the first forward that captures any (every forward passes
through every layer); a later forward capturing a site outside them raises. Without a sidecar
connection the recorder marks trajectories unguided and the engine keeps running.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from tracestore.errors import ValidationError
from tracestore.records import RunSpec, SiteSpec
from tracestore.traceref import site_digest, split_attempt_id

from .layout import EMPTY, RowLayout, column, held_rows, row_index, runs
from .routing import route_rows
from .rows import Ending, StepPlan
from .setting import RecordSetting

log = logging.getLogger("tracestore.client.engines")
_LAYER = re.compile(r"^layers\.(\d+)\.")
REMEMBER_FAILED = 1 << 16  # ended trajectories with lost rows kept to refuse links to them
Rows = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # site -> (codes, scales, g)
_TRAJ, _POS = itemgetter(0), itemgetter(1)  # of StepPlan.held and .released entries
_HELD_TOKEN, _RELEASED_TOKEN = itemgetter(4), itemgetter(2)
_KEPT = itemgetter(1)  # of a held row's (token id, spare slab row or host copies)


def site_spec(name: str, width: int, bits: int) -> SiteSpec:
    """The :class:`SiteSpec` of a captured site: ``layers.{i}.mlp.input`` is a ``moe_input`` (the
    name :class:`HFSiteHooks` gives a MoE block's input), anything else under ``layers.{i}.`` is
    ``other``."""
    m = _LAYER.match(name)
    if m is None:
        raise ValidationError(f"site {name!r}: engine sites are named layers.{{i}}.<...>")
    if name.endswith(".mlp.input"):
        return SiteSpec(name, "moe_input", layer=int(m.group(1)), width=width, bits=bits)
    return SiteSpec(name, "other", layer=int(m.group(1)), width=width, bits=bits)


def unguided_reason(gap: str) -> str:
    """The :class:`TraceRef` reason of an ending's ``gap``: ``aborted`` for an abort, ``refused``
    when the recorder refused the seal (``unguided``: staging full, sidecar gone), ``incomplete``
    for every gap in the rows themselves (``prefix_unrecorded``, ``unrecorded_positions``,
    ``nothing_recorded``)."""
    if gap == "aborted":
        return "aborted"
    return "refused" if gap == "unguided" else "incomplete"


class EngineRecorder:
    """Records one engine instance's forwards under ``setting`` (see the module docstring).

    ``make_recorder(run_spec)`` builds the :class:`RolloutRecorder` once the sites are known
    (default: one connected to ``setting.sidecar`` with ``setting.writer`` and
    ``setting.policy_version``; a ``sidecar`` with rank placeholders is filled from ``ranks()``,
    which the engine's plugin sets: ``{"rank": global rank, "dp_rank": data-parallel rank}`` of
    this process, asked for when the recorder connects).
    """

    def __init__(self, setting: RecordSetting, make_recorder: Callable[[RunSpec], Any] | None = None) -> None:
        self.setting = setting
        self._make = make_recorder or self._default_recorder
        self.recorder: Any = None
        self.run_spec: RunSpec | None = None
        self._sites: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.artifacts: dict[str, SiteSpec] = {}  # artifact sites captured so far (routing), by name
        # (trajectory, position) -> (token id, its rows: a spare slab row of the graph capture, or
        # per-site host copies on the eager path)
        self._held: dict[tuple[str, int], tuple[int, int | Rows]] = {}
        self._lock = threading.Lock()
        self._broken: set[str] = set()  # running trajectories some of whose rows never reached the recorder
        self._failed_ended: dict[str, None] = {}  # ended ones (insertion order: the oldest is forgotten first)
        self._failed_new: list[str] = []  # broken since the last take_failed()
        self.graph: Any = None  # a GraphCapture (.graph): rows come from its slab once it is armed
        self._graph_checked: Any = None  # the armed GraphCapture whose sites the run was checked against
        self._layout = RowLayout()  # the last forward's row layout (kept while the batch order is unchanged)
        self.ranks: Callable[[], dict[str, int]] | None = None  # this process's ranks (sidecar= placeholders)
        self.ended: list[dict[str, Any]] = []  # every end_request result, in order (for reports and tests)
        self.stats = {
            "forwards": 0,
            "rows": 0,
            "links": 0,
            "held": 0,
            "released": 0,
            "dropped": 0,
            "held_overflow": 0,
            "seals": 0,
            "gaps": 0,
        }

    def _default_recorder(self, spec: RunSpec) -> Any:
        from tracestore.client import RolloutRecorder

        s = self.setting
        return RolloutRecorder(
            self.address(), spec, writer=s.writer, policy_version=s.policy_version, staging_bytes=s.staging_mb << 20
        )

    def address(self) -> str:
        """The sidecar this process records to: ``setting.sidecar``, its rank placeholders filled
        from :attr:`ranks` (:meth:`RecordSetting.address`)."""
        s = self.setting
        return s.address(self.ranks() if s.placeholders and self.ranks is not None else None)

    # -- during a forward -------------------------------------------------------------------------

    def capture(self, site: str, codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> None:
        """This forward's record rows of ``site`` (one row per token of the forward, in its order):
        ``codes uint8 [T, width·bits/8]``, ``scales uint8 [T, width/16]``, ``g float32 [1]`` or
        ``[T]``. A site captured twice in one forward raises (two consumers under one name)."""
        if site in self._sites:
            raise ValidationError(f"site {site!r} captured twice in one forward")
        if codes.shape[0] != scales.shape[0] or g.numel() not in (1, codes.shape[0]):
            raise ValidationError(
                f"site {site!r}: {codes.shape[0]} code rows, {scales.shape[0]} scale rows, {g.numel()} g values"
            )
        self._sites[site] = (codes, scales, g)

    def capture_route(self, spec: SiteSpec, ids: torch.Tensor) -> None:
        """This forward's routing of the ``routed_experts`` site ``spec``: ``ids`` integers
        ``[T, >= top_k]`` (the first ``top_k`` columns: the chosen logical expert ids), one row per
        token of the forward. The site is declared with the run; a site of that name declared
        otherwise raises."""
        old = self.artifacts.setdefault(spec.name, spec)
        if old != spec:
            raise ValidationError(f"routing site {spec.name} captured as {spec}, declared as {old}")
        self.capture(spec.name, *route_rows(ids, spec))

    def discard_forward(self) -> None:
        """Forget what this forward captured (a forward with nothing to record: warm-up, profiling)."""
        self._sites.clear()

    def _ensure_run(self) -> None:
        if self.run_spec is not None:
            unknown = set(self._sites) - set(self.run_spec.site_names)
            if unknown:
                raise ValidationError(
                    f"sites {sorted(unknown)} appeared after the run declared {self.run_spec.site_names}"
                )
            return
        bits = self.setting.bits
        if self._graph_rows():
            specs = list(self.graph.specs())
        else:
            specs = [
                self.artifacts.get(n) or site_spec(n, c.shape[1] * 8 // bits, bits)
                for n, (c, _, _) in sorted(self._sites.items())
            ]
        spec = RunSpec(self.setting.run, tuple(specs))
        self.recorder = self._make(spec)
        self.run_spec = spec

    # -- after a forward --------------------------------------------------------------------------

    def end_forward(self, plan: StepPlan, order: Sequence[tuple[str, int]] | None = None) -> bool:
        """Apply ``plan`` to this forward's captured rows, laid out in ``order`` (``(request_id,
        n)`` pairs; default the plan's scheduled order). Returns the recorder's answer for the
        planned rows (True when there were none). When it raises, every trajectory the plan names
        ends with the gap ``unrecorded_positions`` (the mapper counted its rows as recorded)."""
        try:
            return self._end_forward(plan, order)
        except Exception:
            self._break(t for t, _, _ in plan.segments)
            self._break(h[0] for h in plan.held)
            self._break(t for t, _, _ in plan.links)
            self._break(r[0] for r in plan.released)
            raise

    def _break(self, trajectories: Any) -> None:
        """Rows of ``trajectories`` never reached the recorder: each ends with a gap."""
        for t in trajectories:
            if t not in self._broken:
                self._broken.add(t)
                self._failed_new.append(t)

    def failed(self, trajectory: str) -> bool:
        """Whether some of ``trajectory``'s rows never reached the recorder (running or ended)."""
        return trajectory in self._broken or trajectory in self._failed_ended

    def take_failed(self) -> list[str]:
        """Trajectories whose rows failed to reach the recorder since the last call (for
        :meth:`RowMapper.mark_gap`)."""
        out, self._failed_new = self._failed_new, []
        return out

    def _end_forward(self, plan: StepPlan, order: Sequence[tuple[str, int]] | None) -> bool:
        sites, self._sites = self._sites, {}
        if not sites and self._graph_rows():  # a compiled or graph-replayed forward: every site's rows are in the slab
            return self._graph_forward(plan, order)
        if not sites:
            if plan.segments or plan.held:
                raise ValidationError("the step plans rows but the forward captured no site")
            self._links_and_dropped(plan)
            self._release(plan.released)
            return True
        self._sites = sites
        try:
            self._ensure_run()
        finally:
            self._sites = {}
        self.stats["forwards"] += 1
        layout = self._layout.of(plan.order if order is None else order)
        n_fwd = layout.n_rows
        for name, (c, _, _) in sites.items():
            if c.shape[0] < n_fwd:  # (rows past them: padding the engine added)
                raise ValidationError(f"site {name!r} captured {c.shape[0]} rows; the forward has {n_fwd} tokens")
        # earlier drafts first: those this step's computed counts confirmed or rejected (a position
        # may be drafted again in this very step, whose new row must not be dropped with the old
        # one)
        self._links_and_dropped(plan)
        self._release(plan.released)
        for (traj, pos, _, _, tok), row in zip(plan.held, held_rows(plan.held, layout).tolist(), strict=True):
            # held rows: host copies (the eager path) until confirmed
            self._held[(traj, pos)] = (
                tok,
                {
                    n: (c[row : row + 1].cpu(), s[row : row + 1].cpu(), self._g_row(g, row))
                    for n, (c, s, g) in sites.items()
                },
            )
            self.stats["held"] += 1
        if not plan.segments:
            return True
        ids = np.asarray(plan.token_ids, dtype=np.int64)
        idx = torch.from_numpy(row_index(plan.rows, layout))
        outputs = {}
        from tracestore.client import SiteOutput

        for name, (c, s, g) in sites.items():
            i = idx.to(c.device)
            gg = g if g.numel() == 1 else g.index_select(0, i)
            outputs[name] = SiteOutput(c.index_select(0, i), s.index_select(0, i), gg)
        self.stats["rows"] += int(idx.numel())
        ok = bool(self.recorder.record_forward(plan.segments, outputs, token_ids=ids))
        if not ok:  # refused (staging full, recorder closed): those rows are not stored
            self._break(t for t, _, _ in plan.segments)
        return ok

    def _graph_forward(self, plan: StepPlan, order: Sequence[tuple[str, int]] | None) -> bool:
        """A graph-captured forward: the drafts this step confirmed (spare slab rows) and the
        planned rows in one commit, then this step's drafts copied into spare rows. The slab's
        sites are checked against the run once per armed capture, its capacity against the
        forward once per step (every site has the same rows)."""
        graph = self.graph
        if self._graph_checked is not graph:
            self._sites = graph.rows()
            try:
                self._ensure_run()
            finally:
                self._sites = {}
            self._graph_checked = graph
        self.stats["forwards"] += 1
        layout = self._layout.of(plan.order if order is None else order)
        if graph.capacity < layout.n_rows:  # (rows past them: padding the engine added)
            raise ValidationError(
                f"the slab holds {graph.capacity} forward rows; the forward has {layout.n_rows} tokens"
            )
        # earlier drafts first (as on the eager path)
        self._links_and_dropped(plan)
        segs, slots, ids = self._take_released(plan.released)
        n_released = len(ids)
        if plan.segments:
            segs += plan.segments
            index = row_index(plan.rows, layout)
            tokens = np.asarray(plan.token_ids, dtype=np.int64)
            if n_released:
                index = np.concatenate([slots, index])
                tokens = np.concatenate([ids, tokens])
        else:
            index, tokens = slots, ids
        ok = True
        try:
            if segs:
                ok = bool(graph.commit(self.recorder, segs, index, tokens))
                self.stats["rows"] += len(plan.token_ids)
                self.stats["released"] += n_released
                if not ok:
                    self._break(t for t, _, _ in segs)
        finally:
            if n_released:
                graph.free(slots)  # (reused below at the earliest: after the commit's gather)
        self._hold_graph(plan.held, layout)
        return ok

    def _hold_graph(self, held: Sequence[tuple[str, int, str, int, int]], layout: RowLayout) -> None:
        """Copy this forward's draft rows into the graph capture's spare rows, as many as are free;
        the trajectories of the rest end with a gap (their drafts are never recorded)."""
        if not held:
            return
        fit = min(len(held), self.graph.spare_free)
        if fit < len(held):
            lost = {h[0] for h in held[fit:]}
            self._break(sorted(lost))
            self.stats["held_overflow"] += len(held) - fit
            log.error(
                "tracestore: %d draft rows found no free spare slab row: %d trajectories will have a gap",
                len(held) - fit, len(lost),
            )  # fmt: skip
            held = held[:fit]
        slots = self.graph.hold(held_rows(held, layout))
        if slots is None:  # (cannot happen: fit rows are free)
            raise ValidationError(f"{len(held)} spare slab rows were free, then were not")
        keys = zip(map(_TRAJ, held), map(_POS, held), strict=True)
        self._held.update(zip(keys, zip(map(_HELD_TOKEN, held), slots.tolist(), strict=True), strict=True))
        self.stats["held"] += len(held)

    def _graph_rows(self) -> bool:
        """Whether forwards write their rows into an armed :class:`GraphCapture`'s slab."""
        return bool(self.graph is not None and self.graph.active and self.graph.armed)

    @staticmethod
    def _g_row(g: torch.Tensor, row: int) -> torch.Tensor:
        return (g.reshape(1) if g.numel() == 1 else g[row : row + 1]).cpu()

    def _links_and_dropped(self, plan: StepPlan) -> None:
        unguided = getattr(self.recorder, "unguided", ()) if plan.links else ()
        for traj, source, n in plan.links:
            if self.failed(source) or source in unguided:  # the prefix it would link to lacks rows: so does this one
                self._break([traj])
                continue
            self.recorder_or_raise().link_prefix(traj, source, n)
            self.stats["links"] += 1
        for key in plan.dropped:
            if self._drop(key):
                self.stats["dropped"] += 1

    def _drop(self, key: tuple[str, int]) -> bool:
        """Forget a held draft row (its spare slab row is free again)."""
        held = self._held.pop(key, None)
        if held is not None and isinstance(held[1], int):
            self.graph.free([held[1]])
        return held is not None

    def recorder_or_raise(self) -> Any:
        if self.recorder is None:
            raise ValidationError("no forward has captured a site yet: the run's sites are not known")
        return self.recorder

    def _take_released(
        self, released: Sequence[tuple[str, int, int]]
    ) -> tuple[list[tuple[str, int, int]], np.ndarray, np.ndarray]:
        """Take confirmed draft rows out of the hold: those in spare slab rows are returned as
        (segments, spare rows, token ids) for one commit; host copies (the eager path) are
        recorded here, one ``record_forward`` per run of consecutive positions. A confirmed row
        that was never kept (no free spare row) leaves its trajectory with a gap."""
        if not released:
            return [], EMPTY, EMPTY
        # (the ids the plan confirmed: a pending row's is known now)
        keys = zip(map(_TRAJ, released), map(_POS, released), strict=True)
        taken: list[Any] = list(map(self._held.pop, keys, repeat(None)))
        if None not in taken:
            where = list(map(_KEPT, taken))
            if set(map(type, where)) == {int}:  # all in spare slab rows: array work
                merged = runs(list(map(_TRAJ, released)), column(released, _POS))
                return merged, np.asarray(where, dtype=np.int64), column(released, _RELEASED_TOKEN)
        segs: list[tuple[str, int, int]] = []
        slots: list[int] = []
        ids: list[int] = []
        eager: list[tuple[str, int, list[tuple[int, Rows]]]] = []
        for (traj, pos, tok), held in zip(released, taken, strict=True):
            if held is None:
                self._break([traj])
                continue
            rows = held[1]
            if isinstance(rows, int):
                if segs and segs[-1][0] == traj and segs[-1][2] == pos:
                    segs[-1] = (traj, segs[-1][1], pos + 1)
                else:
                    segs.append((traj, pos, pos + 1))
                slots.append(rows)
                ids.append(tok)
            elif eager and eager[-1][0] == traj and eager[-1][1] + len(eager[-1][2]) == pos:
                eager[-1][2].append((tok, rows))
            else:
                eager.append((traj, pos, [(tok, rows)]))
        for traj, pos, copies in eager:
            self._record_copies(traj, pos, copies)
        return segs, np.asarray(slots, dtype=np.int64), np.asarray(ids, dtype=np.int64)

    def _record_copies(self, traj: str, pos: int, taken: list[tuple[int, Rows]]) -> None:
        """Record held row copies of consecutive positions from ``pos`` (one ``record_forward``; a
        site's g is one value when every row's is the same, as the eager path stores a forward)."""
        from tracestore.client import SiteOutput

        outputs = {}
        for name in taken[0][1]:
            c = torch.cat([r[name][0] for _, r in taken])
            s = torch.cat([r[name][1] for _, r in taken])
            gs = [r[name][2] for _, r in taken]
            g = gs[0] if all(bool(torch.equal(x, gs[0])) for x in gs) else torch.cat(gs)
            outputs[name] = SiteOutput(c, s, g)
        ids = np.asarray([t for t, _ in taken], dtype=np.int64)
        self.recorder_or_raise().record_forward([(traj, pos, pos + len(taken))], outputs, token_ids=ids)
        self.stats["released"] += len(taken)

    def _release(self, released: Sequence[tuple[str, int, int]]) -> None:
        """Record confirmed draft rows outside a forward (a request's end, a forward without sites)."""
        segs, slots, ids = self._take_released(released)
        if not segs:
            return
        try:
            self.graph.commit(self.recorder_or_raise(), segs, slots, ids)
            self.stats["released"] += len(ids)
        finally:
            self.graph.free(slots)

    # -- after a request --------------------------------------------------------------------------

    def end_request(self, ending: Ending) -> dict[str, Any]:
        """Seal ``ending``'s trajectory (or note its gap) and return the request-output dict:
        ``{"trajectory", "n_tokens", "gap", "trace_ref"}`` (``trace_ref``: TraceRef JSON, guided
        when the trajectory was sealed; durability is the sidecar's to confirm, e.g.
        ``check_refs``)."""
        self._release(ending.released)
        from tracestore.client import TraceRef

        traj, n = ending.trajectory, ending.n_tokens
        for key in [k for k in self._held if k[0] == traj]:
            self._drop(key)
        gap = ending.gap
        if traj in self._broken:
            self._broken.discard(traj)
            self._remember_failed(traj)
            gap = gap or "unrecorded_positions"
        if gap is None and self.recorder is not None and n >= 1:
            if not self.recorder.finish(traj, n):  # refused: its rows may be missing
                gap = "unguided"
                self._remember_failed(traj)
                self._failed_new.append(traj)
        elif gap is None:
            gap = "nothing_recorded"
        self.stats["seals" if gap is None else "gaps"] += 1
        base, attempt = split_attempt_id(traj)
        ref = None
        if self.run_spec is not None and self.recorder is not None:
            ref = TraceRef(
                run=self.run_spec.run,
                policy_version=self.recorder.policy_version,
                trajectory=base,
                attempt=attempt,
                n_tokens=max(n, 1),
                sites=site_digest(self.run_spec),
                guided=gap is None,
                reason="" if gap is None else unguided_reason(gap),
                writer=self.setting.writer,
            ).to_json()
        out = {"trajectory": traj, "n_tokens": n, "gap": gap, "trace_ref": ref}
        self.ended.append(out)
        return out

    def _remember_failed(self, trajectory: str) -> None:
        self._failed_ended[trajectory] = None
        while len(self._failed_ended) > REMEMBER_FAILED:
            del self._failed_ended[next(iter(self._failed_ended))]

    def close(self, timeout: float = 30.0) -> bool:
        """Flush and close the recorder (True: everything acknowledged durable)."""
        return True if self.recorder is None else bool(self.recorder.close(timeout))
