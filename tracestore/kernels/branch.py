"""Record kernels on a branch beside the engine's stream, so they overlap the engine's next kernels.

A record kernel only reads its activations and writes its slab rows; nothing in the engine's
forward waits for it. Launched on the engine's stream it still sits between two engine kernels
(a few microseconds each, a few percent of a decode step). :class:`RecordBranch` forks
each record onto a side stream that first waits for the engine's stream (the activations are
written), and joins the side stream back into the engine's stream once, before the slab is staged.
Inside ``torch.cuda.graph`` capture the side stream joins the capture, so the graph gets a parallel
branch and the record kernels run on SMs the engine's small decode GEMMs leave idle. Eager
forwards get the same overlap.

Joining is automatic for the recorder: ``stage_rows`` (``SlabStage.capture``),
``RolloutRecorder.record_slab`` and ``record_forward`` join every branch forked on the calling
thread first (:func:`join_pending`). Anything else that reads the slab calls
:meth:`RecordBranch.join`. A capture that forks and never joins fails at its end with CUDA's
"unjoined" capture error.

The inputs given to :meth:`RecordBranch.fork` are marked used by the side stream
(``Tensor.record_stream``), so the caching allocator does not hand their memory to a later tensor
of the engine's stream before the record kernel read them (in a capture, not until the capture
ends: a graph keeps each forked activation's block to itself, about 1 MB per site at 256 tokens of
width 2048 in bf16).

On the CPU a branch runs the records in place (nothing to overlap). Example::

    branch = RecordBranch("cuda")
    def forward(x):                         # captured in the engine's CUDA graph
        for i, layer in enumerate(layers):
            x = layer.attn(x)
            with branch.fork(x):            # the record runs beside layer i's MLP
                record_from_activations(x, sites[i], slab[sites[i].name], global_scale=g)
            x = layer.mlp(x)
        stage.capture()                     # joins the branch, then stages the slab
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from tracestore.errors import ConfigError

_local = threading.local()


def _pending() -> dict[int, RecordBranch]:
    p: dict[int, RecordBranch] | None = getattr(_local, "pending", None)
    if p is None:
        p = _local.pending = {}
    return p


class RecordBranch:
    """A side stream for record kernels on one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        dev = torch.device("cuda" if device is None else device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        # streams are made lazily: a branch built before CUDA is initialised (or on a CPU box) is fine
        self._stream: torch.cuda.Stream | None = None
        self.forks = 0  # records forked since construction (the GPU path only)

    @property
    def stream(self) -> torch.cuda.Stream:
        if self.device.type != "cuda":
            raise ConfigError(f"a RecordBranch on {self.device} has no stream (records run in place)")
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    @contextlib.contextmanager
    def fork(self, *inputs: torch.Tensor | None) -> Iterator[None]:
        """Run the body's kernels on the branch, after the work queued so far on the engine's stream.

        ``inputs``: the device tensors the body reads that the engine may free or overwrite after
        the fork (the activations, a per-step g); None entries are skipped. The body must not
        allocate memory the engine reads later (the record launchers allocate nothing)."""
        if self.device.type != "cuda":
            yield
            return
        engine = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(engine)
        with torch.cuda.stream(side):
            yield
        for t in inputs:
            if t is not None and t.device.type == "cuda":
                t.record_stream(side)
        self.forks += 1
        _pending()[id(self)] = self

    def join(self) -> None:
        """Make the current stream of the branch's device wait for every record forked so far (on
        this thread); nothing when nothing is pending."""
        if _pending().pop(id(self), None) is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def __repr__(self) -> str:
        return f"RecordBranch({self.device}, forks={self.forks})"


def join_pending(device: torch.device | None = None) -> int:
    """Join every branch forked on this thread (on ``device``, or on any) into that device's current
    stream; returns how many were joined. Called before a slab is staged."""
    p = getattr(_local, "pending", None)
    if not p:
        return 0
    joined = [b for b in p.values() if device is None or b.device == device]
    for branch in joined:
        branch.join()
    return len(joined)
