"""The run slots: the specs of the runs this sidecar writes lately, at most ``max_runs`` of them.

A run's entry is its spec, which is immutable and on storage: dropping one costs a read of
run.json the next time it is needed, nothing else. Only writes take a slot (``max_runs``); reads,
Stat and the WAL replay look specs up without one (``Engine.run_spec``; a run whose records the
replay queues again is busy, and gets back the slot it had: :meth:`RunSlots.restore`), so
readers cannot make the sidecar refuse new runs. A slot whose run has no records waiting to be
committed is given to the next run that needs one; with authentication, one identity holds at
most ``share`` slots (the runs it brought in), so runs kept busy by one team cannot take every
slot either.

Not thread-safe: the engine (``core.py``) calls it with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from tracestore.server.engine.message import Message
from tracestore.server.engine.sessions import WriterState

from tracestore.errors import LimitError
from tracestore.records import RunSpec


class RunSlots:
    """Run specs by run, least recently written first, with the identity whose write brought each
    one in (None with authentication off). ``busy()`` names the runs with records not committed."""

    def __init__(self, max_runs: int, share: int | None, busy: Callable[[], set[str]]) -> None:
        self.max_runs = max_runs
        self.share = share
        self.busy = busy
        self.specs: OrderedDict[str, RunSpec] = OrderedDict()
        self.holder: dict[str, str | None] = {}
        self._replayed: list[tuple[WriterState, Message]] = []  # in log order

    def get(self, run: str) -> RunSpec | None:
        return self.specs.get(run)

    def admit(self, run: str, identity: str | None, spec: RunSpec | None = None) -> None:
        """Make room for ``run``, now the most recently used, and hold it for ``identity`` with
        ``spec`` (None: only check, and free, that there is room). Frees the least recently used
        slot of a run with nothing waiting to be committed when ``identity`` is at its share or the
        table is full; LimitError when there is none."""
        if run in self.specs:
            if spec is not None:
                self.specs.move_to_end(run)
            return
        busy: set[str] | None = None
        if identity is not None and self.share is not None:
            mine = [r for r in self.specs if self.holder.get(r) == identity]
            if len(mine) >= self.share:
                busy = self.busy()
                if not self._drop_idle(mine, busy):
                    raise LimitError(
                        f"identity {identity!r} already has {len(mine)} runs with records not yet committed on this "
                        f"sidecar, its share (max_runs_per_identity); run {run} is refused: retry once they are "
                        "committed, or raise --max-runs-per-identity"
                    )
        if len(self.specs) >= self.max_runs and not self._drop_idle(self.specs, self.busy() if busy is None else busy):
            raise LimitError(
                f"this sidecar already serves {len(self.specs)} runs with records not yet committed (max_runs); "
                f"run {run} is refused: retry once they are committed, start a sidecar per run group, or raise "
                "--max-runs"
            )
        if spec is not None:
            self.specs[run] = spec
            self.holder[run] = identity

    def replayed(self, writer: WriterState, message: Message) -> None:
        """The replay queued ``message`` of ``writer`` again (noted in log order for
        :meth:`restore_replayed`; held, so that no later message can reuse its ``id()``)."""
        self._replayed.append((writer, message))

    def restore_replayed(self, queued: set[int], spec: Callable[[str], RunSpec]) -> None:
        """After a replay: the runs whose replayed messages are still ``queued`` (``id()``s; not
        committed by a later DONE) are busy and get their slots back, in log order, each held by the
        owner of the first writer queued in it, so --max-runs(-per-identity) keeps bounding the busy
        runs and a replayed run's writers keep their slot. No limit is checked: these were admitted
        before the restart."""
        for w, message in self._replayed:
            if id(message) in queued and w.run not in self.specs:
                self.specs[w.run] = spec(w.run)
                self.holder[w.run] = w.owner
        self._replayed = []

    def _drop_idle(self, candidates: Iterable[str], busy: set[str]) -> bool:
        """Drop the least recently used of ``candidates`` that is not ``busy``; False if none."""
        for run in candidates:
            if run not in busy:
                del self.specs[run]
                self.holder.pop(run, None)
                return True
        return False
