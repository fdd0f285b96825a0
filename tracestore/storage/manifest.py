"""The manifest of a shard: what one published Parquet file holds, written after it.

The manifest (small JSON) lists every chunk's key, row group and checksum; readers use it to
fetch only the row groups they need and to detect swapped or truncated files. Its chunk index is
columns of little-endian integers in base64 (the smallest unsigned width that holds each column)
and, for trajectory and site, a list of distinct names plus each chunk's index into it; the
entries list the row groups' rows in order, so row group and row are not stored. The manifest is
canonical JSON (sorted keys, no whitespace) whose first member, ``"checksum": "crc32:<8 hex
digits>"``, is the CRC-32 of the canonical JSON of every other member (the file's bytes with that
member left out: ``{`` followed by everything after its comma). It is verified on every load
(:meth:`Manifest.from_json`), so a damaged manifest is a :class:`CorruptionError` naming it,
never chunks, seals or prefix links silently read wrong.

:class:`Manifest` has one entry object per chunk; :class:`ManifestColumns` holds the chunk index
as columns (full validation checks ~300,000 one-token chunks of a decode shard at once).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from tracestore.checksum import crc32
from tracestore.errors import CorruptionError, ValidationError
from tracestore.records import PrefixLink, TrajectorySeal
from tracestore.storage.arrow import SCHEMA_VERSION

MANIFEST_FORMAT = "tracestore.manifest"
MANIFEST_VERSION = 2  # 2: a checksum over the content, the chunk index as binary columns (1: neither)
_CHECKSUM_HEAD = b'{"checksum":"crc32:'
_CHECKSUM_END = len(_CHECKSUM_HEAD) + 10  # 8 hex digits, '",'


def shard_name(seq: int) -> str:
    return f"part-{seq:08d}"


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    """One chunk as the manifest indexes it."""

    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    n_rows: int
    row_group: int
    row: int  # index of the row inside its row group
    checksum: int
    nbytes: int

    @property
    def token_end(self) -> int:
        return self.token_start + self.n_tokens


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one published shard holds; written after the shard, makes it visible to readers."""

    run: str
    policy_version: int
    writer: str
    seq: int
    shard: str | None  # root-relative path of the Parquet file; None for a seal/link-only write
    shard_bytes: int
    shard_crc32: int
    row_groups: tuple[int, ...]  # rows per row group
    chunks: tuple[ChunkEntry, ...]
    seals: tuple[TrajectorySeal, ...]
    links: tuple[PrefixLink, ...]

    def to_json(self) -> bytes:
        ints = {k: np.array([getattr(c, k) for c in self.chunks], dtype=np.int64) for k in _ENTRY_INTS}
        row_group, row = _rows_in_order(self.row_groups)
        got = (np.array([c.row_group for c in self.chunks], np.int64), np.array([c.row for c in self.chunks], np.int64))
        if not (np.array_equal(got[0], row_group) and np.array_equal(got[1], row)):
            raise ValidationError("manifest chunk entries must list the row groups' rows in order")
        d = _header(self)
        d["chunks"] = {
            "count": len(self.chunks),
            "trajectory": _encode_names([c.trajectory for c in self.chunks]),
            "site": _encode_names([c.site for c in self.chunks]),
            **{k: _encode_ints(v) for k, v in ints.items()},
        }
        return _canonical(d)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Decode a manifest, verifying its checksum first; CorruptionError naming ``where`` if the
        bytes are damaged, not a v2 manifest, or describe seals or links of another run or
        version."""
        c = ManifestColumns.from_json(data, where)
        cols = [c.trajectory.to_pylist(), c.site.to_pylist()]
        cols += [
            getattr(c, k).tolist()
            for k in ("token_start", "n_tokens", "n_rows", "row_group", "row", "checksum", "nbytes")
        ]
        chunks = tuple(ChunkEntry(*vals) for vals in zip(*cols, strict=True))
        return cls(
            c.run,
            c.policy_version,
            c.writer,
            c.seq,
            c.shard,
            c.shard_bytes,
            c.shard_crc32,
            c.row_groups,
            chunks,
            c.seals,
            c.links,
        )

    @property
    def trajectories(self) -> set[str]:
        out = {c.trajectory for c in self.chunks}
        out.update(s.trajectory for s in self.seals)
        out.update(x.trajectory for x in self.links)
        return out


_ENTRY_INTS = ("token_start", "n_tokens", "n_rows", "checksum", "nbytes")  # stored; row group and row are not
_INT_WIDTHS = {"<u2": 1 << 16, "<u4": 1 << 32, "<u8": 1 << 64}


def _header(m: Manifest | ManifestColumns) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "manifest_version": MANIFEST_VERSION,
        "schema_version": SCHEMA_VERSION,
        "run": m.run,
        "policy_version": m.policy_version,
        "writer": m.writer,
        "seq": m.seq,
        "shard": m.shard,
        "shard_bytes": m.shard_bytes,
        "shard_crc32": m.shard_crc32,
        "row_groups": list(m.row_groups),
        "seals": [s.to_dict() for s in m.seals],
        "links": [x.to_dict() for x in m.links],
    }


def _canonical(d: dict[str, Any]) -> bytes:
    body = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    # "checksum" sorts before every other key, so this is the canonical JSON of the whole manifest
    return b'%s%08x",%s' % (_CHECKSUM_HEAD, crc32(body), body[1:])


def _encode_ints(a: np.ndarray) -> dict[str, str]:
    """Integers >= 0 as ``{"dtype": "<u2"|"<u4"|"<u8", "data": base64 of the little-endian values}``."""
    top = int(a.max()) if a.size else 0
    if a.size and int(a.min()) < 0:
        raise ValidationError(f"manifest integers must be >= 0, got {int(a.min())}")
    dtype = next(k for k, bound in _INT_WIDTHS.items() if top < bound)
    return {"dtype": dtype, "data": base64.b64encode(a.astype(dtype).tobytes()).decode()}


def _decode_ints(obj: Any, n: int, name: str) -> np.ndarray:
    if not isinstance(obj, dict) or obj.get("dtype") not in _INT_WIDTHS or not isinstance(obj.get("data"), str):
        raise ValueError(f"chunk column {name} is not {{dtype, data}}")
    raw = base64.b64decode(obj["data"], validate=True)
    a = np.frombuffer(raw, obj["dtype"])
    if a.shape != (n,):
        raise ValueError(f"chunk column {name} holds {a.size} values, expected {n}")
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
        raise ValueError(f"chunk column {name} holds a value past int64")
    return a.astype(np.int64)


def _encode_names(names: Sequence[str]) -> dict[str, Any]:
    """Strings as their distinct values (first appearance order) and each one's index."""
    index: dict[str, int] = {}
    codes = np.array([index.setdefault(x, len(index)) for x in names], dtype=np.int64)
    return {"values": list(index), "index": _encode_ints(codes)}


def _decode_names(obj: Any, n: int, name: str) -> pa.StringArray:
    if not isinstance(obj, dict) or not isinstance(obj.get("values"), list):
        raise ValueError(f"chunk column {name} is not {{values, index}}")
    values = pa.array(obj["values"], pa.string())
    index = _decode_ints(obj.get("index"), n, f"{name} index")
    if values.null_count or (n and int(index.max()) >= len(values)):
        raise ValueError(f"chunk column {name}: an index past its {len(values)} values")
    out = values.take(pa.array(index))
    assert isinstance(out, pa.StringArray)
    return out


def _rows_in_order(row_groups: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(row group, row) of every entry when the entries list the row groups' rows in order."""
    sizes = np.array(row_groups, dtype=np.int64).reshape(-1)
    starts = np.cumsum(sizes) - sizes
    return np.repeat(np.arange(len(sizes)), sizes), np.arange(int(sizes.sum())) - np.repeat(starts, sizes)


def manifest_dict(data: bytes, where: str) -> dict[str, Any]:
    """The decoded JSON of a manifest whose checksum verifies (see the module docstring).

    Raises :class:`CorruptionError` naming ``where`` when the checksum does not match, the bytes
    do not start with the checksum member (damaged, or a v1 manifest, which had none), or the
    JSON does not decode to a v2 manifest."""
    view = memoryview(data)
    head = bytes(view[:_CHECKSUM_END])
    stored = None
    if head.startswith(_CHECKSUM_HEAD) and head.endswith(b'",'):
        digits = head[len(_CHECKSUM_HEAD) : -2]
        if all(c in b"0123456789abcdef" for c in digits):
            stored = int(digits, 16)
    if stored is None:
        version = None
        try:
            old = json.loads(data)
            if isinstance(old, dict) and old.get("format") == MANIFEST_FORMAT:
                version = old.get("manifest_version")
        except ValueError:
            pass
        if version == 1:
            raise CorruptionError(
                f"manifest {where} is format v1, which carries no checksum (written by an older "
                f"tracestore); this tracestore reads only checksummed v{MANIFEST_VERSION} manifests: "
                "re-record the data or read it with the tracestore that wrote it"
            )
        raise CorruptionError(
            f"manifest {where} does not start with its checksum (damaged, or not a tracestore "
            f"manifest v{MANIFEST_VERSION})"
        )
    actual = crc32(view[_CHECKSUM_END:], crc32(b"{"))
    if actual != stored:
        raise CorruptionError(
            f"manifest {where} fails its checksum (stored {stored:#010x}, computed {actual:#010x}): "
            "the manifest is damaged"
        )
    try:
        d = json.loads(data)
    except ValueError as exc:  # pragma: no cover - a verified checksum over bytes that never decoded
        raise CorruptionError(f"manifest {where} does not decode ({exc})") from exc
    if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT or d.get("manifest_version") != MANIFEST_VERSION:
        got = (d.get("format"), d.get("manifest_version")) if isinstance(d, dict) else type(d).__name__
        raise CorruptionError(f"manifest {where} is {got}, expected a tracestore manifest v{MANIFEST_VERSION}")
    return d


@dataclasses.dataclass(frozen=True)
class ManifestColumns:
    """A manifest with its chunk index as columns (:meth:`from_json`), rows in shard order.

    ``trajectory`` and ``site`` are Arrow string arrays; the other entry fields int64 arrays. The
    entries list the row groups' rows in order (``row`` counts from 0 in each), so
    :meth:`groups` is a slice. :class:`Manifest` decodes through this (one entry object per chunk).
    """

    where: str
    run: str
    policy_version: int
    writer: str
    seq: int
    shard: str | None
    shard_bytes: int
    shard_crc32: int
    row_groups: tuple[int, ...]
    trajectory: pa.StringArray
    site: pa.StringArray
    token_start: np.ndarray
    n_tokens: np.ndarray
    n_rows: np.ndarray
    row_group: np.ndarray
    row: np.ndarray
    checksum: np.ndarray
    nbytes: np.ndarray
    seals: tuple[TrajectorySeal, ...]
    links: tuple[PrefixLink, ...]

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ManifestColumns:
        """Decode a manifest (checksum verified, :func:`manifest_dict`) into columns;
        CorruptionError naming ``where`` if it does not decode to a well-formed manifest."""
        d = manifest_dict(data, where)
        try:
            c = d["chunks"]
            n = c["count"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"chunk count {n!r}")
            ints = {k: _decode_ints(c[k], n, k) for k in _ENTRY_INTS}
            row_groups = tuple(int(x) for x in d["row_groups"])
            if any(x < 1 for x in row_groups) or sum(row_groups) != n:
                raise ValueError(f"row groups {row_groups[:8]} do not hold the {n} chunks")
            row_group, row = _rows_in_order(row_groups)
            m = cls(
                where,
                str(d["run"]),
                int(d["policy_version"]),
                str(d["writer"]),
                int(d["seq"]),
                d["shard"],
                int(d["shard_bytes"]),
                int(d["shard_crc32"]),
                row_groups,
                _decode_names(c["trajectory"], n, "trajectory"),
                _decode_names(c["site"], n, "site"),
                ints["token_start"],
                ints["n_tokens"],
                ints["n_rows"],
                row_group,
                row,
                ints["checksum"],
                ints["nbytes"],
                tuple(TrajectorySeal.from_dict(s) for s in d["seals"]),
                tuple(PrefixLink.from_dict(x) for x in d["links"]),
            )
            if n and not isinstance(m.shard, str):
                raise ValueError("chunks but no shard")
        except (ValueError, KeyError, TypeError, OverflowError, binascii.Error, pa.ArrowException) as exc:
            raise CorruptionError(
                f"manifest {where} does not decode ({exc}); expected a tracestore manifest v{MANIFEST_VERSION}"
            ) from exc
        owned: tuple[TrajectorySeal | PrefixLink, ...] = (*m.seals, *m.links)
        for item in owned:
            if item.run != m.run or item.policy_version != m.policy_version:
                kind = "seal" if isinstance(item, TrajectorySeal) else "prefix link"
                raise CorruptionError(
                    f"manifest {where} of run {m.run} v{m.policy_version} holds a {kind} of run {item.run} "
                    f"v{item.policy_version} ({item.trajectory})"
                )
        return m

    def __len__(self) -> int:
        return len(self.trajectory)

    def groups(self, g0: int, g1: int) -> ManifestColumns:
        """The entries of row groups ``[g0, g1)`` only (everything else unchanged)."""
        a, b = int(sum(self.row_groups[:g0])), int(sum(self.row_groups[:g1]))
        names = ("trajectory", "site", "row_group", "row", *_ENTRY_INTS)
        cut: dict[str, Any] = {k: getattr(self, k)[a:b] for k in names}
        return dataclasses.replace(self, **cut)

    def describe(self, j: int) -> str:
        return (
            f"chunk (trajectory {self.trajectory[j]}, site {self.site[j]}, tokens "
            f"[{self.token_start[j]}, {self.token_start[j] + self.n_tokens[j]})) in row group "
            f"{self.row_group[j]} row {self.row[j]}"
        )
