"""Token identity of record chunks: the CRC-32 of a trajectory's token-id prefix.

A chunk of tokens ``[token_start, token_end)`` may carry ``ids_crc``: the CRC-32 (zlib's
polynomial) of :data:`IDS_TAG` followed by the trajectory's input token ids at positions
``0 .. token_end - 1`` as int32 little-endian (:func:`ids_crc`). It binds the chunk's rows to
the exact token sequence the rollout fed up to its last row: any different id at or before the
chunk's end, a chunk stored at the wrong position, or rows of another trajectory give another
value (a false match has probability 2^-32 per chunk). A trainer holding its own token ids
computes the same value (:class:`PrefixCrcs`) and compares.

It costs 4 bytes per chunk, whatever the number of tokens in it; storing each row's token id per
site would cost 4 bytes per token per site (80 B per token at 20 sites, over 1% of the 7,680 B
of records per token at width 2048, b = 1).

Example::

    ids = np.array([1, 15043, 3186], dtype=np.int32)
    PrefixCrcs(ids).at(3) == ids_crc(ids)      # True
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from tracestore.checksum import fold_ids  # noqa: F401  (a chunk's identity in its checksum)
from tracestore.errors import ValidationError

IDS_TAG = b"tracestore.ids.v1\0"
_SEED = zlib.crc32(IDS_TAG)
MAX_TOKEN_ID = (1 << 31) - 1
GAP_ID = -1  # stands for a position a recorder skipped: never a token id (those are 0..2^31-1)


def as_token_ids(ids: Any, what: str = "token_ids") -> np.ndarray:
    """``ids`` (a 1-D sequence, numpy array or CPU/CUDA torch tensor of integers) as a contiguous
    int32 little-endian numpy array; ValidationError when it is not 1-D integers in 0..2^31-1."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch tensor (no torch import here)
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValidationError(f"{what} must be 1-D (one id per token), got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValidationError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValidationError(f"{what} must lie in 0..2^31-1, got {int(arr.min())}..{int(arr.max())}")
    return np.ascontiguousarray(arr, dtype="<i4")


def ids_crc(prefix: Any) -> int:
    """The identity value of a chunk ending after ``prefix`` (the token ids from position 0)."""
    return zlib.crc32(as_token_ids(prefix, "prefix").data, _SEED)


class PrefixCrcs:
    """Identity values of one token sequence at any end, computed incrementally from the last end
    asked for (ends asked in increasing order cost one pass over the ids in all).

    ``ids``: token ids from position 0 (:func:`as_token_ids`). ``at(end)`` is
    ``ids_crc(ids[:end])``, or None when ``end`` lies past the ids known. ``put(start, ids)``
    replaces the ids from ``start`` on (``start`` at most the length known), growing the buffer
    by doubling, so a sequence fed one decode token at a time costs amortized O(1) per token.
    """

    __slots__ = ("_buf", "n", "_end", "_crc")

    def __init__(self, ids: Any = ()) -> None:
        arr = as_token_ids(ids)
        self._buf = np.empty(max(16, arr.size), dtype="<i4")
        self._buf[: arr.size] = arr
        self.n = int(arr.size)
        self._end, self._crc = 0, _SEED

    @property
    def ids(self) -> np.ndarray:
        return self._buf[: self.n]

    def put(self, start: int, ids: np.ndarray) -> None:
        if not 0 <= start <= self.n:
            raise ValidationError(f"token ids from position {start}: only {self.n} are known before it")
        end = start + int(ids.size)
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype="<i4")
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:end] = ids
        self.n = end
        if self._end > start:  # the checkpoint covered ids that were replaced
            self._end, self._crc = 0, _SEED

    def at(self, end: int) -> int | None:
        if end > self.n or end < 0:
            return None
        if end < self._end:
            self._end, self._crc = 0, _SEED
        self._crc = zlib.crc32(self._buf[self._end : end].data, self._crc)
        self._end = end
        return self._crc


class TokenLedger:
    """The token ids a recorder has seen per trajectory, to give each chunk its identity value.

    ``note(trajectory, start, ids)`` records the ids of positions ``start ..``; a forward that
    starts at 0 begins the sequence again, one that starts inside or right after the known ids
    replaces what follows (a cache cut back, or the next step). One that starts past them (a
    position skipped: rows stored at the wrong place) fills the skipped positions with
    :data:`GAP_ID`, which no token id equals, so every later chunk of the trajectory fails the
    reader's check; a trajectory first seen past position 0 (continued from another recorder)
    stays unidentified until a forward starts at 0. ``link(trajectory, source, n)``
    gives ``trajectory`` the source's first ``n`` ids. ``crc(trajectory, end)``: the chunk's
    value, or None when the ids up to ``end`` are not known. Not thread-safe: one sender thread
    uses it.
    """

    def __init__(self) -> None:
        self._seqs: dict[str, PrefixCrcs | None] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def note(self, trajectory: str, start: int, ids: np.ndarray) -> None:
        seq = self._seqs.get(trajectory)
        if start == 0:
            seq = self._seqs[trajectory] = PrefixCrcs()
        if seq is None:
            self._seqs[trajectory] = None
            return
        if start > seq.n:
            seq.put(seq.n, np.full(start - seq.n, GAP_ID, dtype="<i4"))
        seq.put(start, ids)

    def link(self, trajectory: str, source: str, n_tokens: int) -> None:
        seq = self._seqs.get(source)
        self._seqs[trajectory] = PrefixCrcs(seq.ids[:n_tokens]) if seq is not None and seq.n >= n_tokens else None

    def crc(self, trajectory: str, end: int) -> int | None:
        seq = self._seqs.get(trajectory)
        return None if seq is None else seq.at(end)

    def lose(self, trajectory: str) -> None:
        """``trajectory`` was recorded without ids: unidentified until it restarts at 0."""
        if trajectory in self._seqs:
            self._seqs[trajectory] = None

    def forget(self, trajectory: str) -> None:
        self._seqs.pop(trajectory, None)

    def clear(self) -> None:
        self._seqs.clear()
