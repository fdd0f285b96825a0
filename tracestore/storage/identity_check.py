"""The token identity check of a read: each chunk read carries the CRC-32 of its trajectory's token
ids up to its last row (:mod:`tracestore.identity`); a reader given the trainer's own token ids
compares them, chunk by chunk, so no row of another token sequence reaches training.

:class:`IdentityCheck` is built per read from the plan and the caller's token ids
(:func:`token_ids_by_trajectory`), told what each planned chunk should carry (:meth:`expect`,
while the read is planned), fed every verified chunk as it lands (:meth:`see`, thread-safe), and
at the end either raises :class:`~tracestore.errors.GuidanceMismatch` or masks the mismatching
trajectories' rows (:meth:`finish`, by the read's ``on_mismatch`` policy).

What counts (``ReadStats``): ``ids_verified`` chunks whose identity equals the trainer's,
``ids_absent`` chunks recorded without token ids (nothing to check), ``ids_unverifiable`` chunks
that end past the token ids given or come through a prefix link and run past it (the source's
later tokens are not the linked trajectory's), and ``mismatched_rows`` / ``mismatched``
(trajectory -> reason) for the masked ones, ``misaligned`` (trajectory -> site -> tokens of the
chunks whose identity differs).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from tracestore.errors import ConfigError, GuidanceMismatch
from tracestore.identity import PrefixCrcs, as_token_ids
from tracestore.plan import MicrobatchPlan
from tracestore.storage.manifest import ChunkEntry
from tracestore.storage.read_out import ReadStats
from tracestore.storage.rows import SiteRows

OnMismatch = Literal["error", "mask"]
TokenIds = Mapping[str, Any] | Any


def token_ids_by_trajectory(plan: MicrobatchPlan, token_ids: TokenIds) -> dict[str, np.ndarray]:
    """The caller's token ids per plan trajectory, from position 0 (int32 arrays): ``token_ids`` is
    a mapping trajectory -> 1-D ids (each from position 0; a trajectory the mapping lacks is not
    checked), or one 1-D array aligned with the plan's tokens (the microbatch's packed
    ``input_ids``), which needs every trajectory's segment to start at token 0."""
    if isinstance(token_ids, Mapping):
        return {str(t): as_token_ids(ids, f"token_ids[{t!r}]") for t, ids in token_ids.items()}
    flat = as_token_ids(token_ids)
    if flat.size != plan.n_tokens:
        raise ConfigError(
            f"token_ids holds {flat.size} ids for a plan of {plan.n_tokens} tokens; give one id per plan token "
            "(the microbatch's packed input_ids) or a mapping trajectory -> its ids from position 0"
        )
    out: dict[str, np.ndarray] = {}
    for i, seg in enumerate(plan.segments):
        if seg.trajectory is None:
            continue
        if seg.token_start != 0:
            raise ConfigError(
                f"token_ids aligned with the plan need every segment to start at token 0 (the identity covers a "
                f"trajectory's ids from position 0); segment {i} reads {seg.trajectory} from {seg.token_start}: "
                "give a mapping trajectory -> its ids from position 0 instead"
            )
        o = int(plan.offsets[i])
        out[seg.trajectory] = flat[o : o + seg.n_tokens]
    return out


class IdentityCheck:
    """One read's identity check (see the module docstring)."""

    def __init__(self, run: str, plan: MicrobatchPlan, token_ids: TokenIds, on_mismatch: OnMismatch) -> None:
        if on_mismatch not in ("error", "mask"):
            raise ConfigError(f"on_mismatch must be 'error' or 'mask', got {on_mismatch!r}")
        self.run = run
        self.plan = plan
        self.on_mismatch = on_mismatch
        self._ids = {t: PrefixCrcs(ids) for t, ids in token_ids_by_trajectory(plan, token_ids).items()}
        self._want: dict[int, list[tuple[str, int | None]]] = {}  # id(entry) -> [(plan trajectory, value)]
        self._seen: list[tuple[ChunkEntry, int | None]] = []
        self._lock = threading.Lock()

    def expect(self, trajectory: str, owner: str, hi: int, e: ChunkEntry) -> None:
        """Chunk ``e`` of ``owner`` serves ``trajectory`` up to token ``hi`` (a prefix link's end
        when ``owner`` is its source)."""
        crcs = self._ids.get(trajectory)
        if crcs is None:
            return
        value = None if owner != trajectory and e.token_end > hi else crcs.at(e.token_end)
        self._want.setdefault(id(e), []).append((trajectory, value))

    def see(self, entry: ChunkEntry, ids_crc: int | None) -> None:
        """A verified chunk landed (any thread)."""
        if id(entry) in self._want:
            with self._lock:
                self._seen.append((entry, ids_crc))

    def finish(self, rows: dict[str, SiteRows], stats: ReadStats) -> None:
        """Count, then raise :class:`GuidanceMismatch` or mask the mismatching trajectories."""
        bad: dict[str, list[tuple[ChunkEntry, int, int]]] = {}
        good_ends: dict[str, list[int]] = {}
        for e, got in self._seen:
            for trajectory, want in self._want[id(e)]:
                if got is None:
                    stats.ids_absent += 1
                elif want is None:
                    stats.ids_unverifiable += 1
                elif got == want:
                    stats.ids_verified += 1
                    good_ends.setdefault(trajectory, []).append(e.token_end)
                else:
                    bad.setdefault(trajectory, []).append((e, got, want))
                    sites = stats.misaligned.setdefault(trajectory, {})
                    sites[e.site] = sites.get(e.site, 0) + e.n_tokens
        if not bad:
            return
        reasons = {t: self._reason(t, hits, good_ends.get(t, [])) for t, hits in sorted(bad.items())}
        if self.on_mismatch == "error":
            more = f" (and {len(reasons) - 5} more trajectories)" if len(reasons) > 5 else ""
            raise GuidanceMismatch(
                f"run {self.run}: records that belong to another token sequence: "
                + "; ".join(list(reasons.values())[:5])
                + more
                + ". Their rows would guide the wrong tokens; nothing was returned (on_mismatch='mask' returns "
                "those trajectories unguided instead)"
            )
        for t, why in reasons.items():
            stats.mismatched[t] = why
            for i, seg in enumerate(self.plan.segments):
                if seg.trajectory != t:
                    continue
                o = int(self.plan.offsets[i])
                for r in rows.values():
                    k = r.site.rows_per_token
                    r.valid[o * k : (o + seg.n_tokens) * k] = False
                    r.policy_version[o * k : (o + seg.n_tokens) * k] = -1
                    stats.mismatched_rows += seg.n_tokens * k

    @staticmethod
    def _reason(trajectory: str, hits: list[tuple[ChunkEntry, int, int]], good: list[int]) -> str:
        first = min(hits, key=lambda h: (h[0].token_end, h[0].site))
        e, got, want = first
        below = [end for end in good if end < e.token_end]
        where = f"({max(below)}, {e.token_end}]" if below else f"[0, {e.token_end})"
        return (
            f"trajectory {trajectory}: {len(hits)} chunk(s) recorded for other token ids, the first site "
            f"{e.site} tokens [{e.token_start}, {e.token_end}) (identity {got:#010x}, the trainer's ids give "
            f"{want:#010x}); the token ids differ at a position in {where}"
        )
