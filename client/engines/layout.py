"""A step plan's row bookkeeping as array work, for the engine thread after every forward.

:class:`~tracestore.client.engines.rows.StepPlan` names rows as lists of tuples (request id,
offset, count; trajectory, position, token id). The helpers here turn them into ``int64`` arrays
with C-level passes (``map``/``itemgetter`` into ``numpy.fromiter``, ``dict``/``zip``) and numpy
arithmetic, so the Python bytecode run per step does not grow with the number of requests:

- :class:`RowLayout`: where each request's share of a forward starts, for the worker's batch
  order (the last order's layout is kept: consecutive decode steps usually share it);
- :func:`row_index`: the forward rows of a plan's ``rows`` (the arrays
  :meth:`StepPlan.row_index` returns, element for element);
- :func:`held_rows`: the forward rows of a plan's ``held`` entries;
- :func:`runs`: consecutive positions of one trajectory merged into ``(trajectory, start, end)``
  segments.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracestore.errors import ValidationError

_0, _1, _2, _3 = (operator.itemgetter(i) for i in range(4))
EMPTY = np.zeros(0, dtype=np.int64)
EMPTY.flags.writeable = False


def column(items: Sequence[Any], get: Any) -> np.ndarray:
    """``int64`` array of ``get(item)`` for every item (one C-level pass)."""
    return np.fromiter(map(get, items), dtype=np.int64, count=len(items))


class RowLayout:
    """Rows of a forward laid out in ``order`` (``(request_id, n)`` pairs): :attr:`starts` maps
    each request to its first row, :attr:`n_rows` is the forward's token count. :meth:`of`
    recomputes only when the order differs from the last one's."""

    def __init__(self) -> None:
        self._order: list[tuple[str, int]] | None = None
        self.starts: dict[str, int] = {}
        self.n_rows = 0

    def of(self, order: Sequence[tuple[str, int]]) -> RowLayout:
        """This layout, set to ``order`` (a later entry of a request repeated in ``order`` wins,
        as in :meth:`StepPlan.starts`)."""
        if order == self._order:
            return self
        key = list(order)
        ns = column(key, _1)
        if ns.size and int(ns.min()) < 0:
            raise ValidationError(f"the forward's layout gives a request {int(ns.min())} rows")
        ends = np.cumsum(ns)
        self.starts = dict(zip(map(_0, key), (ends - ns).tolist(), strict=True))
        self.n_rows = int(ends[-1]) if ends.size else 0
        self._order = key
        return self

    def firsts(self, rids: Any, n: int) -> np.ndarray:
        """The first row of each of the ``n`` request ids ``rids`` (an iterable); a request
        missing from the layout raises ValidationError naming it."""
        try:
            return np.fromiter(map(self.starts.__getitem__, rids), dtype=np.int64, count=n)
        except KeyError as exc:
            raise ValidationError(f"the forward's layout lacks request {exc.args[0]!r} that the plan records") from None


def row_index(rows: Sequence[tuple[str, int, int]], layout: RowLayout) -> np.ndarray:
    """Forward rows of ``rows`` (``(request_id, offset, count)`` in segment order) under
    ``layout``: ``count`` consecutive rows from the request's first row + ``offset``, each entry's
    after the previous entry's (``int64``)."""
    k = len(rows)
    if not k:
        return EMPTY
    base = layout.firsts(map(_0, rows), k) + column(rows, _1)
    counts = column(rows, _2)
    if bool((counts == 1).all()):  # one row a request (a decode step)
        return base
    ends = np.cumsum(counts)
    return np.repeat(base - (ends - counts), counts) + np.arange(int(ends[-1]), dtype=np.int64)


def held_rows(held: Sequence[tuple[str, int, str, int, int]], layout: RowLayout) -> np.ndarray:
    """Forward rows of ``held`` entries (``(trajectory, position, request_id, offset, token_id)``)
    under ``layout`` (``int64``)."""
    k = len(held)
    if not k:
        return EMPTY
    return layout.firsts(map(_2, held), k) + column(held, _3)


def runs(trajectories: list[str], positions: np.ndarray) -> list[tuple[str, int, int]]:
    """``(trajectory, start, end)`` segments of one-row entries (``trajectories[i]`` at
    ``positions[i]``), in order, an entry merged into the previous segment when it is the same
    trajectory's next position."""
    k = len(trajectories)
    if not k:
        return []
    if k > 1:
        same = np.fromiter(map(operator.eq, trajectories[1:], trajectories[:-1]), dtype=bool, count=k - 1)
        cont = same & (positions[1:] == positions[:-1] + 1)
        if bool(cont.any()):
            first = np.flatnonzero(np.concatenate([[True], ~cont]))
            last = np.concatenate([first[1:], [k]]) - 1
            return list(
                zip(
                    map(trajectories.__getitem__, first.tolist()),
                    positions[first].tolist(),
                    (positions[last] + 1).tolist(),
                    strict=True,
                )
            )
    return list(zip(trajectories, positions.tolist(), (positions + 1).tolist(), strict=True))
