"""TraceRefs of a recorder's trajectories: :meth:`tracestore.client.RolloutRecorder.refs`.

The handle itself (:class:`TraceRef`, attempt ids, JSON lines, :func:`check_refs`) is part of the
record model, :mod:`tracestore.traceref`, and is re-exported here; this module adds what needs a
recorder and its sidecar: a ref is guided only once the trajectory's seal is durable and the
shard holding it is committed to storage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tracestore.errors import ValidationError
from tracestore.records import TrajectorySeal
from tracestore.traceref import (
    ATTEMPT_SEP,
    MAX_ATTEMPT,
    REF_FORMAT,
    UNGUIDED_REASONS,
    TraceRef,
    attempt_id,
    check_refs,
    read_jsonl,
    site_digest,
    split_attempt_id,
    write_jsonl,
)

from .items import STOP_REASONS, Outgoing, Unguided, bounded_put

if TYPE_CHECKING:  # pragma: no cover
    import threading

    from tracestore.records import RunSpec


class SealLedger:
    """What a recorder knows of its trajectories' seals, for its refs (bounded dicts, the oldest
    entries dropped first): the length and policy version ``finish()`` was given, each seal's
    (epoch, sequence, seal) once its message is durable, and the highest attempt handed out per
    trajectory. Why a trajectory is unguided is the :class:`Unguided` ledger's. ``lock``: the
    recorder's, held by the acknowledgement that calls :meth:`note_sealed`."""

    def __init__(self, lock: threading.Lock, unguided: Unguided, writer: str, run: str) -> None:
        self._lock = lock
        self._unguided = unguided
        self._writer = writer
        self._run = run
        self._finished: dict[str, tuple[int, int]] = {}  # trajectory -> (n_tokens, policy version)
        self._sealed_at: dict[str, tuple[int, int, TrajectorySeal]] = {}
        self._attempts: dict[str, int] = {}

    def finished(self, trajectory: str, n_tokens: int, version: int) -> None:
        bounded_put(self._finished, trajectory, (n_tokens, version))

    def attempt(self, trajectory: str, attempt: int | None) -> str:
        """The stored id of ``attempt`` (default: the next one) of ``trajectory``; see
        :meth:`tracestore.client.RolloutRecorder.attempt`."""
        last = self._attempts.get(trajectory, -1)
        n = last + 1 if attempt is None else attempt
        stored = attempt_id(trajectory, n)  # validates trajectory and n
        if n <= last:
            raise ValidationError(
                f"recorder {self._writer} already handed out attempt {last} of {trajectory}: attempt {n} would "
                f"write under an earlier attempt's id; records are write-once per (trajectory, attempt)"
            )
        bounded_put(self._attempts, trajectory, n)
        return stored

    def state(self, trajectory: str) -> tuple[str, Any]:
        """("sealed", (epoch, seq, seal)) once the seal's message is durable; ("unguided",
        (version, n_tokens, reason)); ("pending", None) after finish(); else ("unknown", None)."""
        with self._lock:
            at = self._sealed_at.get(trajectory)
            if at is not None:
                return "sealed", at
            fin = self._finished.get(trajectory)
            if trajectory in self._unguided and fin is not None:
                return "unguided", (fin[1], fin[0], self._unguided.why(trajectory))
            if fin is not None:
                return "pending", None
            return "unknown", None

    def forget(self, trajectory: str) -> None:
        with self._lock:
            self._sealed_at.pop(trajectory, None)
            self._finished.pop(trajectory, None)
            self._unguided.forget(trajectory)

    def note_sealed(self, out: Outgoing) -> None:
        """The seals of ``out``, durable now (under the lock, from the acknowledgement)."""
        for s in out.req.seals:
            seal = TrajectorySeal(self._run, s.policy_version, s.trajectory, s.n_tokens, tuple(s.sites))
            bounded_put(self._sealed_at, s.trajectory, (int(out.req.epoch), out.seq, seal))


# ---------------------------------------------------------------------------------------- producing


@dataclasses.dataclass(frozen=True)
class RefSource:
    """What :func:`make_refs` needs of a recorder: its writer id and run, its seal ledger,
    ``flush(timeout)`` (send what is queued, wait for the acknowledgements) and ``connect()`` (a
    gRPC channel to its sidecar, closed by the caller)."""

    writer: str
    run_spec: RunSpec
    seals: SealLedger
    flush: Callable[[float], Any]
    connect: Callable[[], Any]


def make_refs(recorder: RefSource, trajectories: Sequence[str], timeout: float = 60.0) -> list[TraceRef]:
    """Refs for ``trajectories`` (stored ids, :func:`attempt_id`) of ``recorder``, in order; see
    :meth:`tracestore.client.RolloutRecorder.refs`."""
    parsed = [split_attempt_id(t) for t in trajectories]
    deadline = time.monotonic() + max(0.0, float(timeout))
    recorder.flush(max(0.0, deadline - time.monotonic()))
    state: dict[str, tuple[str, Any]] = {}
    # 1. every trajectory durably sealed or unguided (the sender may still be giving up on some)
    while True:
        for t in trajectories:
            if t not in state or state[t][0] == "pending":
                state[t] = recorder.seals.state(t)
        pending = [t for t in trajectories if state[t][0] == "pending"]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    unknown = [t for t in trajectories if state[t][0] == "unknown"]
    if unknown:
        raise ValidationError(
            f"recorder {recorder.writer} never finished trajectories {unknown[:5]}: call finish() before refs()"
        )
    # 2. publication: the shard holding each seal is committed (Stat's committed_sequence)
    sealed = {t: s[1] for t, s in state.items() if s[0] == "sealed"}
    published = _wait_published(recorder, sealed, deadline) if sealed else set()
    out = []
    spec = recorder.run_spec
    all_sites = site_digest(spec)
    for t, (base, n) in zip(trajectories, parsed, strict=True):
        kind, info = state[t]
        if kind == "sealed":
            _, _, seal = info
            sites = all_sites if set(seal.sites) == set(spec.site_names) else site_digest(spec, seal.sites)
            ok = t in published
            out.append(
                TraceRef(
                    spec.run,
                    seal.policy_version,
                    base,
                    n,
                    seal.n_tokens,
                    sites,
                    ok,
                    "" if ok else "unpublished",
                    recorder.writer,
                )
            )
            if ok:
                recorder.seals.forget(t)
        else:
            version, n_tokens, reason = info
            out.append(
                TraceRef(
                    spec.run,
                    version,
                    base,
                    n,
                    n_tokens,
                    all_sites,
                    False,
                    _reason(reason) if kind == "unguided" else "not_durable",
                    recorder.writer,
                )
            )
    return out


def _reason(reason: str) -> str:
    if reason in UNGUIDED_REASONS:
        return reason
    if reason in STOP_REASONS:
        return "stopped"
    if reason == "closed_unacknowledged":  # the recorder closed before the sidecar acknowledged them
        return "not_durable"
    return "refused"  # a message the sidecar refused for its content (invalid_argument, data_loss, ...)


def _wait_published(
    recorder: RefSource, sealed: Mapping[str, tuple[int, int, TrajectorySeal]], deadline: float
) -> set[str]:
    """The trajectories of ``sealed`` ({t: (epoch, seq, seal)}) whose message the sidecar reports
    committed before ``deadline``. A writer's messages are committed in order, so a committed
    message of a later epoch covers every earlier one."""
    from tracestore.client.transport import method

    from tracestore.v1 import tracestore_pb2 as pb

    done: set[str] = set()
    ch = recorder.connect()
    try:
        stat = method(ch, "Stat", "unary_unary")
        while True:
            try:
                left = max(0.05, deadline - time.monotonic())
                raw = stat(pb.StatRequest(run=recorder.run_spec.run).SerializeToString(), timeout=min(5.0, left))
                resp = pb.StatResponse.FromString(raw)
            except Exception:  # noqa: BLE001 - the sidecar is away: nothing more is published
                resp = None
            if resp is not None:
                for w in resp.writers:
                    if w.run != recorder.run_spec.run or w.writer != recorder.writer:
                        continue
                    for t, (epoch, seq, _) in sealed.items():
                        if (w.epoch == epoch and w.committed_sequence >= seq) or (
                            w.epoch > epoch and w.committed_sequence >= 1
                        ):
                            done.add(t)
            if len(done) == len(sealed) or time.monotonic() >= deadline:
                return done
            time.sleep(0.05)
    finally:
        ch.close()


__all__ = [
    "ATTEMPT_SEP",
    "MAX_ATTEMPT",
    "REF_FORMAT",
    "UNGUIDED_REASONS",
    "TraceRef",
    "attempt_id",
    "check_refs",
    "make_refs",
    "read_jsonl",
    "site_digest",
    "split_attempt_id",
    "write_jsonl",
]
