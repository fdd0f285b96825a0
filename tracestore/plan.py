"""MicrobatchPlan: the ordered token segments of one rank's microbatch (what a reader aligns to).

A plan is an ordered list of ``(trajectory, token_start, token_end)`` segments; row ``i`` of a
read result is the ``i``-th token of the concatenated segments (times ``rows_per_token`` for
sites with several rows per token). A segment whose trajectory is ``None`` is padding: its rows
come back invalid and are never "missing".

Example::

    plan = MicrobatchPlan.from_cu_seqlens(["a", "b"], [0, 5, 12])           # packed (THD)
    plan = MicrobatchPlan.padded(["a", "b"], [5, 7], max_len=8)              # [B, S] with padding
    plan = MicrobatchPlan.context_parallel(["a"], [16], cp_size=2, cp_rank=0)  # zig-zag: chunks 0 and 3
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from tracestore.errors import ConfigError, ShapeError, ValidationError
from tracestore.records import validate_id


class Segment(NamedTuple):
    trajectory: str | None  # None: padding rows
    token_start: int
    token_end: int

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start


def _ints(name: str, values: object) -> list[int]:
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ShapeError(f"{name} must be a 1-D sequence of integers, got {values!r}")
    return [int(v) for v in arr]


class MicrobatchPlan:
    """An ordered list of segments ``(trajectory, token_start, token_end)`` (end exclusive)."""

    def __init__(self, segments: Iterable[tuple[str | None, int, int]]) -> None:
        segs: list[Segment] = []
        for i, seg in enumerate(segments):
            try:
                traj, a, b = seg
            except (TypeError, ValueError) as exc:
                raise ValidationError(
                    f"plan segment {i} must be (trajectory, token_start, token_end), got {seg!r}"
                ) from exc
            if traj is not None:
                validate_id("trajectory", traj)
            for name, v in (("token_start", a), ("token_end", b)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ValidationError(f"plan segment {i}: {name} must be an integer, got {v!r}")
            a, b = int(a), int(b)
            if a < 0 or b <= a:
                raise ValidationError(
                    f"plan segment {i} ({traj}): expected 0 <= token_start < token_end, got [{a}, {b})"
                )
            segs.append(Segment(traj, a, b))
        self.segments: tuple[Segment, ...] = tuple(segs)
        self.offsets = np.zeros(len(segs) + 1, dtype=np.int64)
        np.cumsum([s.n_tokens for s in segs], out=self.offsets[1:])

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    def __getitem__(self, i: int) -> Segment:
        return self.segments[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MicrobatchPlan) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        head = ", ".join(f"({s.trajectory}, {s.token_start}, {s.token_end})" for s in self.segments[:4])
        more = f", ... {len(self.segments) - 4} more" if len(self.segments) > 4 else ""
        return f"MicrobatchPlan([{head}{more}], n_tokens={self.n_tokens})"

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def trajectories(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.segments:
            if s.trajectory is not None:
                seen.setdefault(s.trajectory)
        return list(seen)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_cu_seqlens(
        cls,
        trajectories: Sequence[str],
        cu_seqlens: Sequence[int] | np.ndarray,
        offsets: Sequence[int] | None = None,
    ) -> MicrobatchPlan:
        """Packed sequences (THD): sequence ``i`` occupies rows ``cu_seqlens[i]:cu_seqlens[i+1]``
        and holds the trajectory's tokens ``[offsets[i], offsets[i] + length)`` (offsets default 0).

        Rows after ``cu_seqlens[-1]`` are not part of the plan; a gap between sequences is an error.
        """
        cu = _ints("cu_seqlens", cu_seqlens)
        if len(cu) != len(trajectories) + 1 or (cu and cu[0] != 0):
            raise ShapeError(
                f"cu_seqlens must have len(trajectories)+1 = {len(trajectories) + 1} entries starting at 0, got {cu}"
            )
        offs = [0] * len(trajectories) if offsets is None else _ints("offsets", offsets)
        if len(offs) != len(trajectories):
            raise ShapeError(f"offsets must have one entry per trajectory ({len(trajectories)}), got {len(offs)}")
        segs = []
        for i, t in enumerate(trajectories):
            n = cu[i + 1] - cu[i]
            if n <= 0:
                raise ValidationError(f"cu_seqlens must be strictly increasing; sequence {i} ({t}) has length {n}")
            segs.append((t, offs[i], offs[i] + n))
        return cls(segs)

    @classmethod
    def padded(
        cls,
        trajectories: Sequence[str | None],
        lengths: Sequence[int],
        max_len: int | None = None,
        offsets: Sequence[int] | None = None,
        *,
        left: bool = False,
    ) -> MicrobatchPlan:
        """A padded ``[B, max_len]`` batch flattened row-major: each sequence's tokens, then padding
        (or padding first with ``left=True``). A ``None`` trajectory is an all-padding batch row."""
        lens = _ints("lengths", lengths)
        if len(lens) != len(trajectories):
            raise ShapeError(f"lengths must have one entry per trajectory ({len(trajectories)}), got {len(lens)}")
        width = max(lens, default=0) if max_len is None else int(max_len)
        offs = [0] * len(lens) if offsets is None else _ints("offsets", offsets)
        if len(offs) != len(lens):
            raise ShapeError(f"offsets must have one entry per trajectory ({len(lens)}), got {len(offs)}")
        segs: list[tuple[str | None, int, int]] = []
        for t, n, o in zip(trajectories, lens, offs, strict=True):
            if n < 0 or n > width:
                raise ValidationError(f"length {n} of {t} is outside [0, max_len={width}]")
            if t is None:
                n = 0
            pad: list[tuple[str | None, int, int]] = [(None, 0, width - n)] if width > n else []
            body: list[tuple[str | None, int, int]] = [(t, o, o + n)] if n else []
            segs.extend(pad + body if left else body + pad)
        return cls(segs)

    @classmethod
    def context_parallel(
        cls,
        trajectories: Sequence[str],
        lengths: Sequence[int],
        cp_size: int,
        cp_rank: int,
        *,
        zigzag: bool = True,
        offsets: Sequence[int] | None = None,
    ) -> MicrobatchPlan:
        """The rows that context-parallel rank ``cp_rank`` of ``cp_size`` holds of packed sequences.

        Each sequence is padded up to a multiple of ``2*cp_size`` (zig-zag) or ``cp_size`` and cut
        into equal chunks; with ``zigzag=True`` (Megatron's load-balanced causal split) the rank
        gets chunks ``r`` and ``2*cp_size-1-r``, otherwise chunk ``r``. Rows past a sequence's true
        length are padding. Sequences are concatenated in order.
        """
        if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
            raise ConfigError(f"cp_size must be an integer >= 1, got {cp_size!r}")
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
            raise ConfigError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank!r}")
        lens = _ints("lengths", lengths)
        if len(lens) != len(trajectories):
            raise ShapeError(f"lengths must have one entry per trajectory ({len(trajectories)}), got {len(lens)}")
        offs = [0] * len(lens) if offsets is None else _ints("offsets", offsets)
        if len(offs) != len(lens):
            raise ShapeError(f"offsets must have one entry per trajectory ({len(lens)}), got {len(offs)}")
        n_chunks = 2 * cp_size if zigzag else cp_size
        mine = (cp_rank, n_chunks - 1 - cp_rank) if zigzag else (cp_rank,)
        segs: list[tuple[str | None, int, int]] = []
        for t, n, o in zip(trajectories, lens, offs, strict=True):
            if n <= 0:
                raise ValidationError(f"length of {t} must be >= 1, got {n}")
            size = -(-n // n_chunks)
            for c in mine:
                a, b = c * size, (c + 1) * size
                real_end = min(b, n)
                if real_end > a:
                    segs.append((t, o + a, o + real_end))
                pad = b - max(a, real_end)
                if pad:
                    segs.append((None, 0, pad))
        return cls(segs)
