"""The output side of a :class:`~tracestore.storage.reader.StoreReader` read: what it returns
(:class:`ReadResult`, :class:`ReadStats`), the unit of placement its planning produces
(:class:`ReadTask`: one chunk's token range and where it lands in the plan), and each site's output
rows as verified chunks are placed into them (:class:`SiteOut`, allocated by :func:`site_outs`),
with the copies that place them (:func:`_copy`, :func:`_copy_held`). Planning, fetching and
verification stay in :mod:`tracestore.storage.reader`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa

from tracestore.errors import ConflictError, NotFoundError
from tracestore.plan import MicrobatchPlan
from tracestore.records import SiteSpec
from tracestore.storage.manifest import ChunkEntry, Manifest
from tracestore.storage.rows import (
    ColumnRange,
    OutputArrays,
    SiteRows,
    checked_out,
    output_arrays,
    output_sections,
    read_layout,
)
from tracestore.storage.shard_read import StoredChunk

__all__ = ["HELD_COPY_BYTES", "ReadResult", "ReadStats", "ReadTask", "SiteOut", "site_outs"]


@dataclasses.dataclass
class ReadStats:
    shards: int = 0
    row_groups: int = 0
    chunks: int = 0
    bytes_read: int = 0  # bytes handed to the Parquet decoder by the storage
    missing_rows: int = 0  # rows masked because no record was found (on_missing="mask")
    exempt_rows: int = 0  # final positions of sealed trajectories (unrecorded by design)
    # token identity, with the trainer's token ids given (tracestore.storage.identity_check)
    ids_verified: int = 0  # chunks whose identity equals the trainer's ids
    ids_absent: int = 0  # chunks recorded without token ids
    ids_unverifiable: int = 0  # chunks ending past the ids given, or past a prefix link they serve
    mismatched_rows: int = 0  # rows masked because their chunk belongs to other ids (on_mismatch="mask")
    mismatched: dict[str, str] = dataclasses.field(default_factory=dict)  # trajectory -> why it was masked
    # trajectory -> site -> tokens of chunks whose identity differs from the trainer's ids
    misaligned: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


class ReadResult(Mapping[str, SiteRows]):
    """``result[site] -> SiteRows``; ``result.stats`` says what the read fetched."""

    def __init__(self, plan: MicrobatchPlan, rows: dict[str, SiteRows], stats: ReadStats) -> None:
        self.plan = plan
        self.rows = rows
        self.stats = stats

    def __getitem__(self, site: str) -> SiteRows:
        try:
            return self.rows[site]
        except KeyError:
            raise NotFoundError(f"site {site!r} was not read; read sites: {list(self.rows)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclasses.dataclass
class ReadTask:
    """One piece of a read's plan: tokens ``[lo, hi)`` of ``entry`` (in ``manifest``'s shard),
    placed at plan token ``out_token`` or compared with what is already there."""

    entry: ChunkEntry
    manifest: Manifest
    lo: int  # source token range [lo, hi)
    hi: int
    out_token: int  # plan token index of lo
    compare: bool  # True: check equality with what is already there (same version overlap)


class SiteOut:
    """One site's output rows, filled task by task; tasks write disjoint rows, so several threads
    may place at once (only the lazy token-scale array is created under a lock)."""

    def __init__(
        self,
        site: SiteSpec,
        cols: ColumnRange,
        n: int,
        codes: np.ndarray,
        scales: np.ndarray,
        pv: np.ndarray,
        g: np.ndarray,
        valid: np.ndarray,
        hold_gil: bool = False,
    ) -> None:
        self.site = site
        self.copy = _copy_held if hold_gil else _copy
        self.cols = cols
        self.n = n
        self.cb, self.sb = site.byte_spans(cols)
        # codes/scales uninitialised: every row is written exactly once, by a record or by the zero fill
        self.codes = codes
        self.scales = scales
        self.pv, self.g, self.valid = pv, g, valid
        self.pv.fill(-1)
        self.g.fill(1.0)
        self.valid.fill(False)
        self.ts: np.ndarray | None = None
        self._lock = threading.Lock()

    def _rows(self, t: ReadTask, c: StoredChunk) -> tuple[int, int, int, int]:
        k = self.site.rows_per_token
        r0, r1 = (t.lo - c.entry.token_start) * k, (t.hi - c.entry.token_start) * k
        o0 = t.out_token * k
        return r0, r1, o0, o0 + (r1 - r0)

    def place(self, t: ReadTask, c: StoredChunk) -> None:
        r0, r1, o0, o1 = self._rows(t, c)
        self.copy(self.codes[o0:o1], c.codes[r0:r1, self.cb[0] : self.cb[1]])
        self.copy(self.scales[o0:o1], c.scales[r0:r1, self.sb[0] : self.sb[1]])
        self.g[o0:o1] = c.global_scale
        self.pv[o0:o1] = t.manifest.policy_version
        self.valid[o0:o1] = True
        if c.token_scales is not None:
            if self.ts is None:
                with self._lock:
                    if self.ts is None:
                        self.ts = np.ones(self.n, np.float32)
            self.ts[o0:o1] = c.token_scales[r0:r1]

    def compare(self, t: ReadTask, c: StoredChunk, run: str) -> None:
        """A same-version chunk overlapping rows already placed must hold identical bytes."""
        r0, r1, o0, o1 = self._rows(t, c)
        ts = self.ts
        same = (
            np.array_equal(self.codes[o0:o1], c.codes[r0:r1, self.cb[0] : self.cb[1]])
            and np.array_equal(self.scales[o0:o1], c.scales[r0:r1, self.sb[0] : self.sb[1]])
            and bool(np.all(self.g[o0:o1] == np.float32(c.global_scale)))
            and (ts is None or c.token_scales is None or ts[o0:o1].tobytes() == c.token_scales[r0:r1].tobytes())
        )
        if not same:
            raise ConflictError(
                f"run {run} v{t.manifest.policy_version} trajectory {t.entry.trajectory} site {self.site.name} "
                f"tokens [{t.lo}, {t.hi}) are stored twice with different bytes (shard {t.manifest.shard})"
            )

    def finish(self, stale_below: int) -> SiteRows:
        valid = self.valid
        if not valid.all():
            self.codes[~valid] = 0
            self.scales[~valid] = 0
        stale_rows = valid & (self.pv < stale_below)
        return SiteRows(self.site, self.cols, self.codes, self.scales, self.g, self.ts, valid, self.pv, stale_rows)


HELD_COPY_BYTES = 4 << 20  # copies up to this size keep the GIL (~0.5 ms at most); larger ones release it


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    dst[...] = src  # numpy releases the GIL for all but small copies


def _copy_held(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, keeping the GIL when both are contiguous blocks of at most
    :data:`HELD_COPY_BYTES` (memoryview assignment is a plain memcpy under the GIL).

    numpy releases the GIL for copies of more than a few hundred elements, and getting it back
    waits for whichever thread holds it: beside a thread that is busy in Python (a training loop
    while the reader prefetches) every release costs up to the switch interval. Keeping the GIL
    also stops the reader's own decode threads from overlapping their copies, so only the
    background prefetch reads this way (``StoreReader.read(hold_gil=True)``)."""
    n = dst.nbytes
    if (
        0 < n <= HELD_COPY_BYTES
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
    ):
        dst.data.cast("B")[:] = src.data.cast("B")
    else:
        dst[...] = src


def _pool_bytes(n: int) -> np.ndarray:
    """A writable uint8 array of ``n`` bytes in Arrow's memory pool (it owns the memory)."""
    return np.frombuffer(pa.allocate_buffer(max(n, 1)), np.uint8)[:n]


def site_outs(
    site_specs: list[SiteSpec],
    col: Mapping[str, ColumnRange],
    n_tokens: int,
    out: Mapping[str, OutputArrays] | None,
    hold_gil: bool,
) -> dict[str, SiteOut]:
    """Each site's output rows for a read of ``n_tokens`` plan tokens: in ``out`` when given, else
    in one new buffer. One allocation for every site's codes and scales and the per-row arrays
    (policy version, global scale, valid), from Arrow's memory pool: it keeps freed memory mapped
    and hands it to the next read, where fresh numpy arrays are new memory to fault in, in the
    reading thread, before any shard is fetched."""
    layout = read_layout(site_specs, col, n_tokens)
    if out is None:
        size, sections = output_sections(layout)
        out = output_arrays(_pool_bytes(size), layout, sections)
    return {s.name: SiteOut(s, col[s.name], *checked_out(s, n, cb, sb, out), hold_gil) for s, n, cb, sb in layout}
