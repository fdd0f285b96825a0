"""Scheduler facts -> which forward rows are recorded where (engine-independent).

An engine's scheduler says, per step and per running request, which positions the forward feeds:
``start`` (tokens already computed) and ``n`` (tokens fed, the last ``n_draft`` of them speculative
draft tokens), in the order the forward lays its rows out. :class:`RowMapper` turns that into a
:class:`StepPlan` — record segments (trajectory, start, end) with the forward rows they take,
prefix links, draft rows to hold — and, when a request ends, a seal or a gap with its reason.

What it promises, case by case:

- **Continuous batching / chunked prefill**: every position is recorded once, at the step that
  first computes it; a chunk continues where the previous one stopped.
- **Prefix-cache hits** (a request's first step starts past 0): the hit is linked to the
  trajectory that recorded those positions with the same token ids (:meth:`link` in the plan,
  :meth:`RolloutRecorder.link_prefix`), never stored again. With no such trajectory the request
  gets the gap ``prefix_unrecorded`` (its records would lack the prefix).
- **GRPO groups** (n > 1: several requests with one prompt): the first request that records a
  whole prompt owns it; a request with the same prompt scheduled from position 0 once the prompt
  is recorded (in an earlier step, or earlier in the same step) links to it for the prompt's
  length; one scheduled while no request has recorded all of it yet records its own prompt.
- **Prefix sources** are only positions a trajectory has recorded (or linked), never positions it
  is merely scheduled for, and only while it has no gap: a trajectory stops being a source the
  moment it gets one — from the mapper (abort, ``prefix_unrecorded``, ``unrecorded_positions``)
  or from the recorder (:meth:`RowMapper.mark_gap`: rows that never reached it) — since a
  recorder-side failure does not say which positions are missing. A later request then records
  the positions itself where it computes them, or gets the gap ``prefix_unrecorded``.
- **Preemption / recompute**: positions already recorded are skipped when recomputed (a write-once
  key never gets other bytes); positions computed while unrecorded give the gap
  ``unrecorded_positions``.
- **Speculative decoding**: draft rows are held, released only once a later step's ``start`` (the
  scheduler's computed count after rejection) or the finished token ids confirm them; rejected
  drafts are dropped, never recorded.
- **Asynchronous scheduling** (a step is planned before the previous step's sampled token is
  known): the positions whose input id is not known yet (``Scheduled.n_pending``) are held the
  same way, released with their id once the engine reports it (:meth:`RowMapper.learn`, then a
  later step's ``start`` past them, or the finished token ids); the last position of a trajectory
  is never recorded, so a row fed after the request already ended is dropped.
- **Abort**: no seal, gap ``aborted``; held rows are dropped.

Token ids travel with every record segment (the chunk's token identity, docs/data-model.md).
The mapper keeps per-request state only until :meth:`RowMapper.finish`.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Sequence

import numpy as np

from tracestore.errors import ValidationError
from tracestore.identity import IDS_TAG, as_token_ids
from tracestore.traceref import attempt_id

_SEED = zlib.crc32(IDS_TAG)
_BAD = re.compile(r"[^A-Za-z0-9_.:-]")


def trajectory_id(request_id: str, prefix: str = "") -> str:
    """A stored trajectory id for an engine request id: characters outside ``[A-Za-z0-9_.:-]``
    become ``-``, ``..`` becomes ``.-``, a leading non-alphanumeric gets ``r`` before it, at most
    128 characters less room for an attempt suffix (longer ids keep their last 100 characters behind
    an 8-hex CRC, so distinct ids stay distinct); ``::`` (reserved for attempts) becomes ``:-``."""
    t = _BAD.sub("-", f"{prefix}{request_id}").replace("..", ".-").replace("::", ":-")
    if not t or not t[0].isalnum():
        t = "r" + t
    if len(t) > 109:
        t = f"{zlib.crc32(t.encode()):08x}-{t[-100:]}"
    return t


PENDING = -1  # the held token id of a position whose input id is not known yet
MAX_PREFIXES = 1 << 20  # prefixes offered for links at most (SGLang offers every position)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One request's share of a forward: positions ``[start, start + n)``, the last ``n_draft`` of
    them draft tokens, or the last ``n_pending`` of them positions whose input id the engine has
    not reported yet (asynchronous scheduling; not with drafts); ``token_ids`` the ``n −
    n_pending`` known input ids from ``start`` (None: the mapper already knows them)."""

    request_id: str
    start: int
    n: int
    n_draft: int = 0
    token_ids: Sequence[int] | np.ndarray | None = None
    n_pending: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.n < 0 or not 0 <= self.n_draft <= self.n or not 0 <= self.n_pending <= self.n:
            raise ValidationError(
                f"request {self.request_id}: need start >= 0, n >= 0, 0 <= n_draft <= n, 0 <= n_pending <= n; "
                f"got start={self.start} n={self.n} n_draft={self.n_draft} n_pending={self.n_pending}"
            )
        if self.n_draft and self.n_pending:
            raise ValidationError(f"request {self.request_id}: drafts after positions with unknown ids")


@dataclasses.dataclass
class StepPlan:
    """What to do with one forward's rows.

    ``segments[i]`` = ``(trajectory, start, end)`` takes ``rows[i]`` = ``(request_id, offset,
    count)``: rows ``offset .. offset + count`` of that request's share of the forward (the engine
    worker resolves where each request's share starts in its own batch order: :meth:`row_index`);
    ``token_ids`` holds their input ids in segment order. ``held`` lists ``(trajectory, position,
    request_id, offset, token_id)`` draft rows (and rows whose id is not known yet: token id
    :data:`PENDING`) to keep until confirmed. ``links`` are ``(trajectory, source, n_tokens)``
    prefix links to write before the segments. ``released`` are earlier held rows now confirmed:
    ``(trajectory, position, token_id)`` in order (their bytes are in the caller's hold store)."""

    segments: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    rows: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    held: list[tuple[str, int, str, int, int]] = dataclasses.field(default_factory=list)
    links: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    released: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    dropped: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    order: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (request_id, n) as scheduled

    @property
    def n_rows(self) -> int:
        return sum(c for _, _, c in self.rows)

    def starts(self, order: Sequence[tuple[str, int]] | None = None) -> dict[str, int]:
        """First forward row of each request's share, for a forward laid out in ``order``
        (``(request_id, n)`` pairs; default: the scheduled order)."""
        out, row = {}, 0
        for rid, n in self.order if order is None else order:
            out[rid] = row
            row += n
        return out

    def row_index(self, order: Sequence[tuple[str, int]] | None = None) -> np.ndarray:
        """Forward rows to record, in segment order (``int64``), for a forward laid out in ``order``."""
        if not self.rows:
            return np.zeros(0, dtype=np.int64)
        at = self.starts(order)
        missing = [rid for rid, _, _ in self.rows if rid not in at]
        if missing:
            raise ValidationError(f"the forward's layout lacks requests {missing[:5]} that the plan records")
        return np.concatenate([np.arange(at[rid] + a, at[rid] + a + c, dtype=np.int64) for rid, a, c in self.rows])


@dataclasses.dataclass
class Ending:
    """A finished request: ``seal`` (trajectory, n_tokens) or ``gap`` (the reason records are
    incomplete: ``aborted``, ``prefix_unrecorded``, ``unrecorded_positions``); ``released`` as in
    :class:`StepPlan` (held drafts the final ids confirm)."""

    trajectory: str
    n_tokens: int
    gap: str | None
    released: list[tuple[str, int, int]]


@dataclasses.dataclass
class _Req:
    trajectory: str
    ids: list[int]  # input ids known from position 0
    recorded: int = 0  # positions [0, recorded) are stored or linked
    gap: str | None = None
    prompt_len: int = 0
    held: dict[int, int] = dataclasses.field(default_factory=dict)  # position -> its input id (or PENDING)
    crcs: dict[int, int] = dataclasses.field(default_factory=dict)  # registered prefix ends -> crc
    crc_at: tuple[int, int] = (0, _SEED)  # (n, crc of ids[:n]): where the running ids crc stands


class RowMapper:
    """Per-step row mapping for one engine instance (see the module docstring for the cases).

    ``block``: the prefix-cache block size (hits are registered and looked up at its multiples and
    at each prompt's end). ``prefix``: prepended to every trajectory id. ``max_prefixes``: how many
    registered prefixes are offered at most; past it the oldest are forgotten (a later hit on one
    gets the gap ``prefix_unrecorded``, never a wrong link).
    """

    def __init__(self, block: int = 16, prefix: str = "", max_prefixes: int = MAX_PREFIXES) -> None:
        if block < 1 or max_prefixes < 1:
            raise ValidationError(f"block and max_prefixes must be >= 1, got {block} and {max_prefixes}")
        self.block = block
        self.prefix = prefix
        self.max_prefixes = max_prefixes
        self._reqs: dict[str, _Req] = {}
        self._owners: dict[tuple[int, int], str] = {}  # (n_tokens, ids crc) -> trajectory that records them
        self._owned: dict[str, dict[tuple[int, int], None]] = {}  # trajectory -> its keys in _owners
        self._attempts: dict[str, int] = {}  # base trajectory id -> attempts handed out

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: Sequence[int] | np.ndarray, trajectory: str | None = None) -> str:
        """Start tracking a request with its prompt ids; returns its stored trajectory id (default:
        :func:`tracestore.traceref.attempt_id` of :func:`trajectory_id`, the next attempt of that
        id, so a request id reused after its first run ended records under a new attempt). Adding a
        request that is still tracked is an error."""
        if request_id in self._reqs:
            raise ValidationError(f"request {request_id!r} is already tracked (finish it first)")
        ids = as_token_ids(np.asarray(prompt_ids, dtype=np.int64), f"request {request_id} prompt ids").tolist()
        if trajectory is None:
            base = trajectory_id(request_id, self.prefix)
            n = self._attempts.get(base, 0)
            self._attempts[base] = n + 1
            trajectory = attempt_id(base, n)
        traj = trajectory
        self._reqs[request_id] = _Req(traj, ids, prompt_len=len(ids))
        return traj

    def known(self, request_id: str) -> bool:
        return request_id in self._reqs

    def trajectory(self, request_id: str) -> str:
        return self._req(request_id).trajectory

    def n_ids(self, request_id: str) -> int:
        """How many input ids of the request the mapper knows (positions ``[0, n)``)."""
        return len(self._req(request_id).ids)

    def learn(self, request_id: str, start: int, ids: Sequence[int] | np.ndarray) -> None:
        """The engine reports the request's input ids from position ``start`` (at most
        :meth:`n_ids`): ids of positions held as pending are now known (asynchronous scheduling)."""
        r = self._req(request_id)
        if not 0 <= start <= len(r.ids):
            raise ValidationError(f"request {request_id}: ids from position {start}, {len(r.ids)} known before it")
        new = as_token_ids(np.asarray(ids, dtype=np.int64), f"request {request_id} ids").tolist()
        r.ids[start : start + len(new)] = new

    def _req(self, request_id: str) -> _Req:
        r = self._reqs.get(request_id)
        if r is None:
            raise ValidationError(f"request {request_id!r} is not tracked (add() it when it is first scheduled)")
        return r

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Sequence[Scheduled]) -> StepPlan:
        """Map one forward: ``batch`` in the forward's row order. Returns the :class:`StepPlan`."""
        plan = StepPlan()
        for s in batch:
            plan.order.append((s.request_id, s.n))
            r = self._req(s.request_id)
            known = s.n - s.n_pending
            if s.token_ids is not None:
                ids = as_token_ids(np.asarray(s.token_ids, dtype=np.int64), f"request {s.request_id} ids").tolist()
                if len(ids) != known:
                    raise ValidationError(
                        f"request {s.request_id}: {len(ids)} token ids for {s.n} scheduled tokens "
                        f"({s.n_pending} of them pending)"
                    )
                if s.start > len(r.ids):
                    raise ValidationError(
                        f"request {s.request_id}: ids from position {s.start}, only {len(r.ids)} known before it"
                    )
                # (ids past this step's are dropped — drafts rejected since — but never the prompt's)
                r.ids[s.start :] = ids + r.ids[s.start + len(ids) : r.prompt_len]
            elif s.start + known > len(r.ids):
                raise ValidationError(
                    f"request {s.request_id}: positions up to {s.start + known} scheduled, ids known up to {len(r.ids)}"
                )
            self._confirm(r, s.start, plan.released, plan.dropped)
            self._place(r, s, plan)
        return plan

    def _confirm(
        self, r: _Req, computed: int, released: list[tuple[str, int, int]], dropped: list[tuple[str, int]]
    ) -> None:
        """Held rows below ``computed`` were accepted (in order, from ``recorded``; a pending one once
        its id is known); the rest are dropped."""
        if not r.held:
            return
        for pos in sorted(r.held):
            if pos == r.recorded and pos < computed and pos < len(r.ids) and r.gap is None:
                released.append((r.trajectory, pos, r.ids[pos]))
                r.recorded += 1
            else:
                dropped.append((r.trajectory, pos))
        r.held.clear()
        self._register(r)

    def _place(self, r: _Req, s: Scheduled, plan: StepPlan) -> None:
        start, end = s.start, s.start + s.n
        if r.gap is not None:
            return
        if r.recorded == 0 and start == 0 and r.prompt_len and len(r.ids) >= r.prompt_len:
            # a group sibling of a prompt already recorded (in an earlier step, or by a request
            # placed before this one in this step): link to it; else record the prompt itself
            source = self._owners.get((r.prompt_len, self._crc(r.ids, r.prompt_len)))
            if source is not None and source != r.trajectory:
                plan.links.append((r.trajectory, source, r.prompt_len))
                r.recorded = r.prompt_len
        if r.recorded == 0 and start > 0:  # a prefix-cache hit on the first step
            hit = self._owners.get((start, self._crc(r.ids, start)))
            if hit is None:
                self._gap(r, "prefix_unrecorded")
                return
            plan.links.append((r.trajectory, hit, start))
            r.recorded = start
        if start > r.recorded:
            self._gap(r, "unrecorded_positions")
            return
        first = max(start, r.recorded)
        sure_end = end - s.n_draft - s.n_pending
        if first < sure_end:
            plan.segments.append((r.trajectory, first, sure_end))
            plan.rows.append((s.request_id, first - start, sure_end - first))
            plan.token_ids.extend(r.ids[first:sure_end])
            r.recorded = sure_end
        for pos in range(max(sure_end, r.recorded), end):
            tok = r.ids[pos] if s.n_draft else PENDING
            r.held[pos] = tok
            plan.held.append((r.trajectory, pos, s.request_id, pos - start, tok))
        self._register(r)

    def _register(self, r: _Req) -> None:
        """Offer this trajectory's recorded prefixes (block multiples, the prompt's end) to later
        hits; a trajectory with a gap offers none."""
        if r.gap is not None:
            return
        first = (max(r.crcs) // self.block + 1) * self.block if r.crcs else self.block
        ends = list(range(first, r.recorded + 1, self.block))
        if r.prompt_len and r.prompt_len <= r.recorded and r.prompt_len not in r.crcs:
            ends.append(r.prompt_len)
        for e in sorted(ends):
            c = self._running_crc(r, e)
            r.crcs[e] = c
            self._offer((e, c), r.trajectory)

    def _offer(self, key: tuple[int, int], trajectory: str) -> None:
        """``trajectory`` serves the prefix ``key`` unless another one already does; the oldest
        offers past :attr:`max_prefixes` are forgotten."""
        if key in self._owners:
            return
        self._owners[key] = trajectory
        self._owned.setdefault(trajectory, {})[key] = None
        while len(self._owners) > self.max_prefixes:
            old = next(iter(self._owners))
            t = self._owners.pop(old)
            keys = self._owned.get(t)
            if keys is not None:
                keys.pop(old, None)
                if not keys:
                    del self._owned[t]

    def _running_crc(self, r: _Req, n: int) -> int:
        """:meth:`_crc` of ``r.ids[:n]``, carried on from the last one asked for (ends only grow:
        O(new positions), not O(n), per call)."""
        at, c = r.crc_at
        if n < at:
            return self._crc(r.ids, n)
        c = zlib.crc32(np.asarray(r.ids[at:n], dtype="<i4").tobytes(), c)
        r.crc_at = (n, c)
        return c

    def _gap(self, r: _Req, gap: str) -> None:
        """``r`` gets ``gap`` (the first one stays) and stops being a prefix source."""
        if r.gap is None:
            r.gap = gap
        self.forget_owner(r.trajectory)

    @staticmethod
    def _crc(ids: list[int], n: int) -> int:
        return zlib.crc32(np.asarray(ids[:n], dtype="<i4").tobytes(), _SEED)

    # -- endings ----------------------------------------------------------------------------------

    def finish(
        self, request_id: str, all_ids: Sequence[int] | np.ndarray | None = None, aborted: bool = False
    ) -> Ending:
        """End a request. ``all_ids``: its final token ids (prompt + output); held drafts whose ids
        match them, and held pending rows, are released (accepted, with the final ids), the rest
        dropped — and a held row at the last position, which every trajectory leaves unrecorded
        (readers never use it), is dropped too. Returns its
        :class:`Ending`; its registered prefixes stay linkable (their records are stored)."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            raise ValidationError(f"request {request_id!r} is not tracked")
        final = r.ids if all_ids is None else [int(i) for i in all_ids]
        n_tokens = len(final)
        released: list[tuple[str, int, int]] = []
        if aborted:
            r.gap = "aborted"
        elif r.held:
            ok = 0
            while (
                r.recorded + ok in r.held
                and r.recorded + ok < n_tokens - 1
                and r.held[r.recorded + ok] in (PENDING, final[r.recorded + ok])
            ):
                ok += 1
            r.ids[r.recorded : r.recorded + ok] = final[r.recorded : r.recorded + ok]
            self._confirm(r, r.recorded + ok, released, [])
        if r.gap is None and r.recorded < n_tokens - 1:
            r.gap = "unrecorded_positions"
        if r.gap is not None:
            self.forget_owner(r.trajectory)
        return Ending(r.trajectory, n_tokens, r.gap, released)

    def forget_owner(self, trajectory: str) -> None:
        """Stop offering ``trajectory``'s prefixes (it has a gap, an abort); each of them is offered
        by another tracked trajectory without a gap that registered the same ids, if any."""
        gone = self._owned.pop(trajectory, {})
        for key in gone:
            if self._owners.get(key) == trajectory:
                del self._owners[key]
        for q in self._reqs.values():
            if not gone:
                break
            if q.gap is not None or q.trajectory == trajectory:
                continue
            if len(q.crcs) < len(gone):
                found = [(e, c) for e, c in q.crcs.items() if (e, c) in gone]
            else:
                found = [(e, c) for e, c in gone if q.crcs.get(e) == c]
            for key in found:
                del gone[key]
                self._offer(key, q.trajectory)

    def mark_gap(self, trajectory: str, gap: str = "unrecorded_positions") -> None:
        """The recorder could not store some of ``trajectory``'s rows (a failed forward, a refused
        one, a held row it could not keep, a link to such a trajectory): it stops being a prefix
        source, and, while its request is tracked, records nothing more and ends with ``gap``."""
        for r in self._reqs.values():
            if r.trajectory == trajectory:
                r.held.clear()
                self._gap(r, gap)
                return
        self.forget_owner(trajectory)
