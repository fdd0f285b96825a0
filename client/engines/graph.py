"""Graph-safe capture: an engine's FP4 codes written into a static :class:`RecordSlab` by device
ops.

Under CUDA graphs a hook's Python runs once, while the graph is captured; a replay runs only the
kernels the capture queued. :class:`GraphCapture` therefore records through one registered torch
custom op, ``torch.ops.tracestore.engine_record``, whose body writes a site's codes and scales as
record rows into rows ``[0, T)`` of that site's columns of the slab — on a GPU with one
``tracestore.kernels.record_from_codes`` kernel, elsewhere with
:func:`tracestore.client.engines.codes.record_rows`' tensor ops and three copies: no host read of
device data, no allocation outside the ops themselves, nothing that depends on values. Captured once, a
graph rewrites the slab's rows from its new inputs at every replay. The op declares that it
mutates a one-element anchor tensor, so ``torch.compile`` keeps it (an op without outputs or
mutations is removed as dead code) and treats it as opaque; its body runs where the compiled
graph runs, captured or not. Routing goes the same way through a sibling op,
``torch.ops.tracestore.engine_route``, which copies a MoE layer's expert ids into that
``routed_experts`` site's static rows (:class:`~tracestore.client.engines.routing.RouteBuffers`).

Life of a slab (:meth:`GraphCapture.arm`): before it is armed the op only notes each site's name
and width (the engine's warm-up forward passes every layer once, outside any capture); ``arm``
allocates the slab for the sites noted, at a capacity of the engine's largest forward. A site
first seen after arming is not recorded (logged once). A graph captured before arming would replay
without writing its rows, leaving others' in the slab: after one, :meth:`GraphCapture.commit`
refuses every forward.

Rows are mapped after the forward, on the host, from the scheduler's plan
(:class:`~tracestore.client.engines.rows.StepPlan`): :meth:`GraphCapture.commit` hands the
recorder rows ``[0, n)`` of the slab when the plan takes exactly those, else first gathers the
planned rows (``index_select`` on the device, the index copied from pinned host memory) into a
second slab; the routing sites' rows live in a slab of their own
(:class:`~tracestore.client.engines.routing.RouteBuffers`), gathered the same way and staged by
the same ``record_slab`` call. Rows past the scheduled tokens — the padding an engine adds to
reach a captured batch size — are written by the graph but never named by a plan, so never
committed.

Speculative decoding: a draft token's row must wait for the scheduler to confirm it. ``arm(...,
spare=k)`` gives the slab (and the routing rows) ``k`` rows past the forward's capacity, which no
forward writes; :meth:`GraphCapture.hold` copies draft rows there on the device, and a later
:meth:`GraphCapture.commit` names those spare rows in its index like any forward row (a rejected
draft's row is simply never named, and its spare row is reused). No host read is involved.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tracestore.errors import ShapeError, ValidationError
from tracestore.formats import check_bits
from tracestore.fp4 import sane_global_scales
from tracestore.kernels import RecordSlab
from tracestore.records import SiteSpec

from .codes import record_rows, scales_to_rowmajor
from .routing import RouteBuffers

log = logging.getLogger("tracestore.client.engines")

OP = "tracestore::engine_record"
ROUTE_OP = "tracestore::engine_route"
ANCHOR = torch.zeros(1, dtype=torch.int32)  # what the op declares it mutates (never written)
_ACTIVE: list[GraphCapture] = []  # the process's capture the op writes into (one engine a process)


@torch.library.custom_op(OP, mutates_args=("anchor",))
def engine_record(
    anchor: torch.Tensor,
    packed: torch.Tensor,
    sf: torch.Tensor,
    scale: torch.Tensor | None,
    site: str,
    layout: str,
    width: int,
    per_token: bool,
) -> None:
    """Write ``site``'s record rows of this forward into the active :class:`GraphCapture`'s slab.
    ``packed`` uint8 ``[T, >= width/2]`` FP4 codes, ``sf`` their E4M3 scales in ``layout``,
    ``scale`` the decode-side g (one value) or, with ``per_token``, one float32 g per token."""
    if _ACTIVE:
        _ACTIVE[0].write(packed, sf, scale, site, layout, width, per_token)


@engine_record.register_fake
def _engine_record_fake(
    anchor: torch.Tensor,
    packed: torch.Tensor,
    sf: torch.Tensor,
    scale: torch.Tensor | None,
    site: str,
    layout: str,
    width: int,
    per_token: bool,
) -> None:
    return None


@torch.library.custom_op(ROUTE_OP, mutates_args=("anchor",))
def engine_route(anchor: torch.Tensor, ids: torch.Tensor, site: str) -> None:
    """Write the routed expert ids ``ids`` (integers ``[T, >= top_k]``) of the ``routed_experts``
    site ``site`` into the active :class:`GraphCapture`'s routing rows."""
    if _ACTIVE:
        _ACTIVE[0].write_route(ids, site)


@engine_route.register_fake
def _engine_route_fake(anchor: torch.Tensor, ids: torch.Tensor, site: str) -> None:
    return None


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class GraphCapture:
    """One engine process's graph-safe capture (see the module docstring).

    ``bits``: the low code bits recorded per value (the setting's ``bits``). ``active``: whether the
    engine's hooks route through the op (the engine runs compiled or graph-replayed forwards);
    while False, hooks use their eager path and this object is idle. ``kernel``: on a GPU, write
    each site's rows with one ``tracestore.kernels.record_from_codes`` kernel (after a view or copy
    that puts swizzled scales in row order) instead of the dozen torch ops of
    :func:`record_rows`; both write the same bytes. g is stored by the rule of docs/numerics.md §3
    either way (0, negative or non-finite: 1.0).
    """

    def __init__(self, bits: int = 1, kernel: bool = True) -> None:
        self.bits = check_bits(bits)
        self.kernel = kernel
        self.active = False
        self.widths: dict[str, int] = {}  # sites noted before arming, name -> width
        self.routes: dict[str, SiteSpec] = {}  # routed_experts sites noted before arming
        self.slab: RecordSlab | None = None  # the FP4 sites' rows (None: the run has none)
        self.gathered: RecordSlab | None = None
        self.route_rows: RouteBuffers | None = None  # the routing sites' rows (None: none)
        self.route_gathered: RecordSlab | None = None
        self._armed = False
        self._rows = 0  # rows a forward may write (the slab's spare rows follow them)
        self._spare = np.zeros(0, dtype=bool)  # per spare row: True while it holds no draft row
        self._n_free = 0
        self._device: torch.device | None = None
        self.stats = {"writes": 0, "late": 0, "unarmed_capture": 0, "clipped": 0, "gathers": 0, "failed": 0}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._idx: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # pinned host, device, event (a pool)
        self._specs: dict[str, SiteSpec] = {}

    # -- the hooks' side ------------------------------------------------------------------------

    def install(self) -> None:
        """Make this the capture the op writes into (one per process; the last installed wins)."""
        _ACTIVE[:] = [self]

    def record(
        self,
        site: str,
        packed: torch.Tensor,
        sf: torch.Tensor,
        layout: str,
        width: int,
        global_scale: torch.Tensor | None = None,
        token_scale: torch.Tensor | None = None,
    ) -> None:
        """A hook's call: ``site``'s codes of this forward through the op (traceable, capturable).
        ``global_scale`` a decode-side g as a one-element device tensor, or ``token_scale`` float32
        ``[T]`` (one of them)."""
        if (global_scale is None) == (token_scale is None):
            raise ValidationError(f"site {site!r}: give exactly one of global_scale and token_scale")
        scale = token_scale if token_scale is not None else global_scale
        torch.ops.tracestore.engine_record(ANCHOR, packed, sf, scale, site, layout, int(width), token_scale is not None)

    def route(self, spec: SiteSpec, ids: torch.Tensor) -> None:
        """A routing hook's call: the ``routed_experts`` site ``spec``'s expert ids of this forward
        (integers ``[T, >= top_k]``) through the op (declare the site with :meth:`note_route`
        before arming, outside any trace)."""
        torch.ops.tracestore.engine_route(ANCHOR, ids, spec.name)

    def write_route(self, ids: torch.Tensor, site: str) -> None:
        """The routing op's body: rows ``[0, min(T, capacity))`` of ``site``'s routing rows, by
        device ops (before :meth:`arm`: nothing, or counted when a graph is being captured)."""
        if not self._armed:
            if _capturing():
                self.stats["unarmed_capture"] += 1
                self._warn(site, "a CUDA graph was captured before the capture was armed: it records nothing")
            return
        bufs = self.route_rows
        if bufs is None or site not in bufs.specs:
            self.stats["late"] += 1
            self._warn(site, "site first seen after the slab was allocated: not recorded")
            return
        try:
            if bufs.write(site, ids[: self._rows]) < ids.shape[0]:  # (never into the spare rows)
                self.stats["clipped"] += 1
        except Exception:
            self.stats["failed"] += 1
            raise
        self.stats["writes"] += 1

    def write(
        self,
        packed: torch.Tensor,
        sf: torch.Tensor,
        scale: torch.Tensor | None,
        site: str,
        layout: str,
        width: int,
        per_token: bool,
    ) -> None:
        """The op's body: rows ``[0, min(T, capacity))`` of ``site`` in the slab, by device ops.
        Before :meth:`arm` it notes the site instead (outside a capture)."""
        slab = self.slab
        if not self._armed:
            if _capturing():
                self.stats["unarmed_capture"] += 1
                self._warn(site, "a CUDA graph was captured before the capture was armed: it records nothing")
            else:
                self.note(site, width)
            return
        if slab is None or site not in slab.buffers:
            self.stats["late"] += 1
            self._warn(site, "site first seen after the slab was allocated: not recorded")
            return
        rows = packed.reshape(-1, packed.shape[-1])
        n = min(int(rows.shape[0]), self._rows)
        if n < rows.shape[0]:
            self.stats["clipped"] += 1
        if n == 0:
            return
        half = width // 2
        if rows.shape[1] < half:
            self.stats["failed"] += 1
            raise ShapeError(f"site {site!r}: codes hold {rows.shape[1] * 2} values a row, width is {width}")
        if self.kernel and rows.is_cuda:
            try:
                self._write_kernel(slab, site, rows, sf, scale, layout, width, per_token, n)
                self.stats["writes"] += 1
                return
            except Exception:  # e.g. no CuPy: the torch ops write the same bytes
                log.exception("tracestore: the record kernel failed for %s; using torch ops from now on", site)
                self.kernel = False
        try:
            self._write_torch(slab, site, rows, sf, scale, layout, width, per_token, n)
        except Exception:
            self.stats["failed"] += 1  # its rows stay stale: commit refuses from now on
            raise
        self.stats["writes"] += 1

    def _write_torch(
        self,
        slab: RecordSlab,
        site: str,
        rows: torch.Tensor,
        sf: torch.Tensor,
        scale: torch.Tensor | None,
        layout: str,
        width: int,
        per_token: bool,
        n: int,
    ) -> None:
        """:func:`record_rows` and three copies into the site's slab rows ``[0, n)``."""
        codes, scales, g = record_rows(
            rows,
            sf,
            layout=layout,
            bits=self.bits,
            global_scale=None if per_token else scale,
            token_scale=scale.reshape(-1).to(torch.float32) if per_token and scale is not None else None,
        )
        buf = slab[site]
        nb = width // 16
        buf.codes[:n].copy_(codes[:n, : buf.codes.shape[1]])
        buf.scales[:n].copy_(scales[:n, :nb])
        buf.global_scale[:n].copy_(sane_global_scales(g[:n] if g.numel() > 1 else g.expand(n)))

    def _write_kernel(
        self,
        slab: RecordSlab,
        site: str,
        rows: torch.Tensor,
        sf: torch.Tensor,
        scale: torch.Tensor | None,
        layout: str,
        width: int,
        per_token: bool,
        n: int,
    ) -> None:
        """One ``record_from_codes`` kernel into the site's slab rows ``[0, n)`` (on a GPU)."""
        from tracestore.kernels import record_from_codes

        t, cols = int(rows.shape[0]), rows.shape[1] * 2 // 16
        rowmajor = scales_to_rowmajor(sf, t, cols, layout)[:n, : width // 16]
        if scale is None:
            raise ValidationError(f"site {site!r}: no decode-side g")
        g = scale.reshape(-1).to(torch.float32)
        g = g[:n].contiguous() if per_token else g[:1]
        spec = self._specs[site]
        record_from_codes(rows[:n, : width // 2], rowmajor, spec, slab[site], scale_layout="rowmajor", global_scale=g)

    def note(self, site: str, width: int) -> None:
        """Declare ``site`` (``width`` values a row) for the slab :meth:`arm` allocates; hooks that
        record eagerly before the capture is on note theirs here too."""
        if not self._armed:
            with self._lock:
                self.widths.setdefault(site, int(width))

    def note_route(self, spec: SiteSpec) -> None:
        """Declare the ``routed_experts`` site ``spec`` for the routing rows :meth:`arm` allocates
        (a later declaration of the same name must agree)."""
        if not self._armed:
            with self._lock:
                old = self.routes.setdefault(spec.name, spec)
            if old != spec:
                raise ValidationError(f"routing site {spec.name} declared as {old} and as {spec}")

    def _warn(self, site: str, why: str) -> None:
        if site not in self._warned:
            self._warned.add(site)
            log.error("tracestore: %s: %s", site, why)

    # -- arming -----------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return self._armed

    def site_specs(self) -> tuple[SiteSpec, ...]:
        """The noted sites as :class:`SiteSpec` (sorted by name), as the eager path declares
        them."""
        from .recording import site_spec

        return tuple(site_spec(n, w, self.bits) for n, w in sorted(self.widths.items()))

    def specs(self) -> tuple[SiteSpec, ...]:
        """Every site the armed capture records: the FP4 slab's, then the routing sites (by name)."""
        fp4 = () if self.slab is None else tuple(self.slab.sites)
        bufs = self.route_rows
        routes = () if bufs is None else tuple(bufs.specs[n] for n in sorted(bufs.specs))
        return fp4 + routes

    def arm(self, capacity: int, device: torch.device | str, spare: int = 0) -> bool:
        """Allocate the slab (and the gather slab) for the FP4 sites noted so far and the routing
        rows for the routing sites, ``capacity`` rows each: the largest forward the engine runs,
        padding included; plus ``spare`` rows no forward writes, where :meth:`hold` keeps draft
        rows (speculative decoding: the most drafts held at once). Returns whether it is armed
        (False: no site was noted; call again after a forward). Idempotent once armed."""
        if self._armed:
            return True
        if capacity < 1 or spare < 0:
            raise ShapeError(f"capacity must be >= 1 row and spare >= 0, got {capacity} and {spare}")
        specs = self.site_specs()
        if not specs and not self.routes:
            return False
        total = capacity + spare
        if specs:
            self.gathered = RecordSlab.allocate(specs, total, device)
            self._specs = {sp.name: sp for sp in specs}
            self.slab = RecordSlab.allocate(specs, total, device)
        if self.routes:
            self.route_rows = RouteBuffers(self.routes.values(), total, device)
            self.route_gathered = RecordSlab.allocate(self.route_rows.slab.sites, total, device)
        self._device = torch.device(device)
        self._rows = int(capacity)
        self._spare = np.ones(spare, dtype=bool)
        self._n_free = spare
        self._armed = True
        log.info(
            "tracestore: graph capture armed: %d FP4 sites (%s), %d routing sites, %d rows + %d spare",
            len(specs), self.slab, len(self.routes), capacity, spare,
        )  # fmt: skip
        return True

    def rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each site's ``(codes, scales, g)`` views of the slab's forward rows ``[0, capacity)``
        (the last forward's rows; the spare rows are not among them)."""
        if not self._armed:
            raise ValidationError("the graph capture is not armed")
        slab, n = self.slab, self._rows
        out = (
            {}
            if slab is None
            else {k: (b.codes[:n], b.scales[:n], b.global_scale[:n]) for k, b in slab.buffers.items()}
        )
        if self.route_rows is not None:
            out.update({k: (c[:n], f[:n], g) for k, (c, f, g) in self.route_rows.rows().items()})
        return out

    # -- after a forward --------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows a forward writes per site in the armed capture (0 before arming)."""
        return self._rows

    @property
    def total_rows(self) -> int:
        """Rows per site of the armed capture: the forward's, then the spare rows."""
        if self.slab is not None:
            return self.slab.capacity
        return 0 if self.route_rows is None else self.route_rows.capacity

    @property
    def spare_free(self) -> int:
        """Spare rows not holding a draft row."""
        return self._n_free

    def hold(self, rows: np.ndarray) -> np.ndarray | None:
        """Copy the last forward's ``rows`` (int64, each below :attr:`capacity`) into free spare
        rows (the lowest free ones), by device ops on the current stream (no host read); returns
        the spare rows taken, in order, or None (nothing copied) when fewer are free. Name them in
        a later :meth:`commit`'s index, and give them back with :meth:`free`."""
        if not self._armed:
            raise ValidationError("the graph capture is not armed")
        k = int(rows.shape[0])
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        if int(rows.min()) < 0 or int(rows.max()) >= self._rows:
            raise ShapeError(f"rows {rows.min()}..{rows.max()} held; a forward writes rows below {self._rows}")
        if k > self._n_free:
            return None
        taken = np.flatnonzero(self._spare)[:k]
        self._spare[taken] = False
        self._n_free -= k
        slots = taken + self._rows
        both = self._device_index(np.concatenate([rows, slots]))
        src, dst = both[:k], both[k:]
        for slab in self._slabs():
            slab.data.index_copy_(0, dst, slab.data.index_select(0, src))
        return slots

    def _slabs(self, gathered: bool = False) -> list[RecordSlab]:
        """The FP4 slab and the routing sites' slab (those the run has), or their gather slabs."""
        slabs = [self.gathered if gathered else self.slab]
        if self.route_rows is not None:
            slabs.append(self.route_gathered if gathered else self.route_rows.slab)
        return [s for s in slabs if s is not None]

    def free(self, slots: Sequence[int] | np.ndarray) -> None:
        """Give spare rows taken by :meth:`hold` back (after the commit that names them, if any:
        later device work is ordered after its gather). A row that is not a held spare row (or is
        named twice) raises, and none is given back."""
        at = np.asarray(slots, dtype=np.int64).reshape(-1) - self._rows
        if not at.size:
            return
        inside = (at >= 0) & (at < self._spare.size)
        ok = inside.copy()
        ok[inside] = ~self._spare[at[inside]]
        if not bool(ok.all()):
            bad = int(at[int(np.flatnonzero(~ok)[0])]) + self._rows
            raise ValidationError(f"row {bad} is not a held spare row")
        self._spare[at] = True
        if int(np.count_nonzero(self._spare)) != self._n_free + at.size:  # a row named twice
            self._spare[at] = False
            raise ValidationError(f"rows {sorted(at.tolist())[:8]}...: a spare row is given back twice")
        self._n_free += int(at.size)

    def commit(
        self, recorder: Any, segments: Sequence[tuple[str, int, int]], index: np.ndarray, token_ids: Any
    ) -> bool:
        """Hand the recorder the rows ``index`` (one per token of ``segments``, in order) of the
        FP4 slab and of the routing sites' slab in one :meth:`RolloutRecorder.record_slab`: rows
        ``[0, n)`` of the slabs themselves when ``index`` is exactly that, else the planned rows
        gathered into their second slabs first. Returns whether the recorder took them."""
        if not self._armed:
            raise ValidationError("the graph capture is not armed")
        if self.stats["unarmed_capture"] or self.stats["failed"]:
            raise ValidationError(
                "a CUDA graph was captured before the slab was armed, or a write into the slab failed: "
                "some forwards leave other forwards' rows in the slab, so no slab row can be trusted; "
                "nothing is committed"
            )
        n = int(index.shape[0])
        if n == 0:
            return True
        cap = self.total_rows
        if n > cap or int(index.max()) >= cap or int(index.min()) < 0:
            raise ShapeError(f"rows {index.min()}..{index.max()} planned; the slab holds {cap}")
        identity = bool(np.array_equal(index, np.arange(n, dtype=index.dtype)))
        dev_index = None if identity else self._device_index(index)
        if dev_index is not None:
            self.stats["gathers"] += 1
        slabs = self._slabs()
        if dev_index is not None:
            gathered = self._slabs(gathered=True)
            for src, dst in zip(slabs, gathered, strict=True):
                torch.index_select(src.data, 0, dev_index, out=dst.data[:n])
            slabs = gathered
        return bool(recorder.record_slab(segments, tuple(slabs), n_rows=n, token_ids=token_ids))

    def _device_index(self, index: np.ndarray) -> torch.Tensor:
        """``index`` as an int64 tensor on the slab's device; on a GPU through a pool of pinned
        host buffers: one whose last copy has landed (its event has fired) is reused, else another
        is allocated (a few; past them the oldest is waited for)."""
        assert self._device is not None
        dev = self._device
        src = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        if dev.type != "cuda":
            return src.to(dev)
        n = src.shape[0]
        free = next((i for i, (_, _, ev) in enumerate(self._idx) if ev is None or ev.query()), None)
        if free is None and len(self._idx) < 8:
            cap = 2 * self.total_rows  # a hold's index: rows and spare rows
            self._idx.append(
                (
                    torch.empty(cap, dtype=torch.int64, pin_memory=True),
                    torch.empty(cap, dtype=torch.int64, device=dev),
                    None,
                )
            )
            free = len(self._idx) - 1
        if free is None:
            free = 0
            self._idx[0][2].synchronize()  # eight index copies queued and none landed yet
        host, out, _ = self._idx.pop(free)
        host[:n].copy_(src)
        out[:n].copy_(host[:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._idx.append((host, out, ev))  # oldest first
        return out[:n]
