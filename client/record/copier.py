"""The recorder's copies into its staging pool: what they own is the pinned view of the pool, the
side CUDA stream, the CUDA driver binding and the facts cached about the slabs copied from.

From the CPU a copy is a memoryview assignment, done at once. From a GPU every copy of a forward
is queued on the side stream after the engine's current stream, behind one event, and the
current stream then waits for that event (a device-side wait: the engine's next kernels rewrite
what was copied). A slab goes through five CUDA driver calls that keep the GIL
(:mod:`tracestore.client.record._cuda`); where the driver cannot be used, through torch, whose
calls release the GIL and may wait a switch interval to get it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._cuda import DriverEvent
from .items import SlabPlan
from .staging import StagingPool

log = logging.getLogger("tracestore.client")

# (SiteOutput, staging offset, code bytes, scale bytes, token-scale bytes, offset of its g)
SiteCopy = tuple[Any, int, int, int, int, int]


class StagingCopier:
    """Copies into ``pool`` (``np_view`` is its bytes as numpy); counts driver copies in
    ``stats["driver_copies"]``."""

    def __init__(self, pool: StagingPool, np_view: np.ndarray, stats: dict[str, int], writer: str) -> None:
        self.pool = pool
        self.np = np_view
        self.stats = stats
        self.writer = writer
        self.pinned: Any = None  # torch uint8 tensor over the pool, pinned on first use
        self.side_stream: Any = None
        # the CUDA driver binding: None until the first slab from a GPU, False where unusable
        self.driver: Any = None
        self.raw_stream: Any = None  # torch's current raw CUstream of a device index
        self.side_handle = 0
        self.base = 0  # the pool's address
        self.one_gpu = False
        # slab sources by identity: (tensor, device index, contiguous, address); a static slab or
        # ring slot keeps its storage (an engine that re-points one with set_() must not)
        self._facts: dict[int, tuple[Any, int, bool, int]] = {}

    # -- per-site outputs (record_forward) ----------------------------------------------------------

    def sites(self, copies: Sequence[SiteCopy]) -> Any:
        """Copy each site's codes, scales, token scales and g; the event the GPU copies complete
        on (one for the whole forward), None when everything was copied at once."""
        queued = []
        view = self.pool.view
        for out, off, nc, ns, nt, g_off in copies:
            srcs = [(out.codes, off, nc), (out.scales, off + nc, ns)]
            if nt:
                srcs.append((out.token_scales, off + nc + ns, nt))
            g = out.global_scale
            if any(_is_cuda(x) for x, _, _ in srcs) or _is_cuda(g):
                queued.append((srcs, g, g_off))
                continue
            for x, o, n in srcs:
                # memoryview assignment copies holding the GIL (numpy's copy releases it above 500
                # elements, then waits up to the switch interval for it while the sender runs)
                view[o : o + n] = _as_bytes(x).data
            view[g_off : g_off + 4] = np.float32(_scalar(g)).tobytes()
        if not queued:
            return None
        import torch

        def queue() -> None:
            for srcs, g, g_off in queued:
                for x, o, n in srcs:
                    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
                    self.pinned[o : o + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                if isinstance(g, torch.Tensor):
                    # as_strided: a one-element g may be a strided view (a RecordSlab's g column),
                    # which view(uint8) refuses; its one element is what is copied
                    g1 = g.reshape(-1)[:1].float().as_strided((1,), (1,))
                    self.pinned[g_off : g_off + 4].copy_(g1.view(torch.uint8), non_blocking=True)
                else:
                    self.np[g_off : g_off + 4] = np.frombuffer(np.float32(g).tobytes(), np.uint8)

        # The engine's next forward rewrites its tensors on its stream: that is ordered after the
        # copy, so the next kernels cannot race this forward's rows
        # (tests/client/record/test_recorder_gpu.py)
        keep = [x for srcs, _, _ in queued for x, _, _ in srcs if _is_cuda(x)]
        return self._on_side(queue, keep, order=True)

    # -- slabs (record_slab, SlabStage.commit) -------------------------------------------------------

    def slabs(
        self,
        staged: Sequence[tuple[SlabPlan, int, int]],
        srcs: Sequence[Any],
        off: int,
        order: bool,
        keep: bool,
        after: DriverEvent | None = None,
    ) -> Any:
        """Copy each slab's staged rows (``staged``: plan, offset relative to ``off``, rows) from
        ``srcs``; the event the copies complete on (None: copied at once from the CPU). ``order``:
        the current stream waits for the copies; ``keep``: the sources are the caller's tensors
        (torch's allocator must not reuse them before the copy ran). ``after``: a deferred copy
        (:class:`SlabStage`'s stager thread): the copies wait for this event, recorded on the
        engine's stream when the step was committed, instead of this thread's current stream."""
        if not _is_cuda(srcs[0]):
            view = self.pool.view
            for (plan, rel, rows), src in zip(staged, srcs, strict=True):
                n = rows * plan.row_bytes
                view[off + rel : off + rel + n] = _as_bytes(src.reshape(-1)[:n]).data
            return None
        drv = self.cuda_driver() if self.driver is not False else None
        ev = None if drv is None else self._slabs_driver(drv, staged, srcs, off, order, after)
        if ev is not None:
            return ev
        if after is not None:  # the driver failed since the commit: the step's rows are ready once it ran
            after.wait_host()

        def queue() -> None:
            for (plan, rel, rows), src in zip(staged, srcs, strict=True):
                n = rows * plan.row_bytes
                self.pinned[off + rel : off + rel + n].copy_(src.reshape(-1)[:n], non_blocking=True)

        return self._on_side(queue, srcs if keep else (), order)

    def _slabs_driver(
        self,
        drv: Any,
        staged: Sequence[tuple[SlabPlan, int, int]],
        srcs: Sequence[Any],
        off: int,
        order: bool,
        after: DriverEvent | None = None,
    ) -> Any:
        """The slab copy as driver calls: the side stream waits for the engine's current stream,
        one copy per slab, an event after them, and (``order``) the current stream waits for it.
        None when this call cannot take the path (a source not contiguous, a slab on another
        device than the current one)."""
        facts = self._facts
        ptrs = []
        dev = 0
        for src in srcs:
            f = facts.get(id(src))
            if f is None or f[0] is not src:
                if len(facts) > 256:
                    facts.clear()
                f = facts[id(src)] = (src, src.device.index, src.is_contiguous(), src.data_ptr())
            if not f[2]:
                return None
            ptrs.append(f[3])
            dev = f[1]
        if not self.one_gpu:
            import torch

            if dev != torch.cuda.current_device():
                return None
        cur = self.raw_stream(dev)
        side = self.side_handle
        try:
            if after is None:
                ready = drv.event()
                drv.record(ready, cur)
                drv.wait(side, ready)
                drv.give_back(ready)
            else:
                drv.wait(side, after)
            base = self.base + off
            for (plan, rel, rows), src in zip(staged, ptrs, strict=True):
                drv.copy_to_host(base + rel, src, rows * plan.row_bytes, side)
            ev = drv.event()
            drv.record(ev, side)
        except Exception as exc:  # noqa: BLE001 - e.g. no current context on this thread: torch's path from now on
            log.warning("recorder %s: slab copies through the CUDA driver failed (%s); using torch's", self.writer, exc)
            self.driver = False
            import torch

            torch.cuda.current_stream().synchronize()  # what was queued before the failure lands first
            return None
        if order:
            drv.wait(cur, ev)
        self.stats["driver_copies"] += 1
        return ev

    def advance(self, slot: Any, k: int, wait: Any, cur: int | None = None) -> None:
        """For a ring of device slots: set ``slot`` (an int32 device tensor) to ``k`` on the
        current stream (``cur``: its raw handle, where the caller has it), and make that stream
        wait for ``wait`` (the copy that last read slot k)."""
        drv = self.driver or None
        if drv is not None:
            if cur is None:
                cur = self.raw_stream(slot.device.index)
            drv.fill32(slot.data_ptr(), k, 1, cur)
            if isinstance(wait, DriverEvent):
                drv.wait(cur, wait)
                return
        else:
            slot.fill_(k)
        if isinstance(wait, DriverEvent):  # the driver path failed since that slot's copy: wait here
            wait.wait_host()
        elif wait is not None and getattr(slot, "is_cuda", False):
            import torch

            torch.cuda.current_stream().wait_event(wait)

    # -- the side stream and the driver ---------------------------------------------------------------

    def side(self) -> Any:
        """The side CUDA stream of the copies (pins the pool on first use)."""
        if self.side_stream is None:
            import torch

            self.pool.pin()
            self.pinned = self.pool.tensor()
            self.side_stream = torch.cuda.Stream()
        return self.side_stream

    def _on_side(self, queue: Callable[[], None], keep: Sequence[Any], order: bool) -> Any:
        """Run ``queue`` (it issues copies) on the side stream after the current stream's work;
        return the event after them. ``keep``: tensors the allocator must hold until then;
        ``order``: the current stream waits for the event."""
        import torch

        side = self.side()
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            queue()
            ev = torch.cuda.Event()
            ev.record(side)
        for t in keep:
            t.record_stream(side)
        if order:
            cur.wait_event(ev)
        return ev

    def cuda_driver(self) -> Any:
        """The CUDA driver binding (client/record/_cuda.py), or None (then torch's path)."""
        if self.driver is None:
            import torch

            from . import _cuda

            self.side()
            self.driver = _cuda.driver() or False
            self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if self.raw_stream is None:
                self.driver = False
            self.side_handle = int(self.side_stream.cuda_stream)
            self.base = int(self.pinned.data_ptr())
            self.one_gpu = torch.cuda.device_count() == 1
        return self.driver or None


def _is_cuda(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False))


def _scalar(g: Any) -> float:
    if hasattr(g, "item"):
        return float(g.reshape(-1)[0].item()) if hasattr(g, "reshape") else float(g.item())
    return float(g)


def _as_bytes(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().contiguous().numpy()
    arr = np.ascontiguousarray(x)
    return arr.reshape(-1).view(np.uint8)
