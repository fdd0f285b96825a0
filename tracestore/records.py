"""The record model: sites, runs, record chunks, trajectory seals, prefix links.

numpy only (no torch): the sidecar and the storage layer build on these types. Every type is a
frozen dataclass validated on construction, so an object that exists is well formed; ids are
checked against a charset that cannot escape a storage path.

Example::

    site = SiteSpec("layers.23.mlp.input", "moe_input", layer=23, width=2048)   # NVFP4, b = 1
    chunk = RecordChunk("run-1", 0, "traj-7", site.name, token_start=0, n_tokens=4,
                        codes=np.zeros((4, site.code_bytes), np.uint8),
                        scales=np.zeros((4, site.scale_bytes), np.uint8), global_scale=1.0)
    chunk.validate(site)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Literal

import numpy as np

from tracestore.checksum import ChunkKey, crc32, crc32_combine, record_checksum  # noqa: F401  (importable from here too)
from tracestore.errors import ConfigError, DTypeError, NotFoundError, ShapeError, ValidationError
from tracestore.formats import FP4Format, check_bits, get_format

SiteKind = Literal["moe_input", "key", "value", "other", "routed_experts", "logprobs"]
FP4_KINDS: tuple[str, ...] = ("moe_input", "key", "value", "other")
ARTIFACT_KINDS: tuple[str, ...] = ("routed_experts", "logprobs")  # per-token rollout artifacts, not FP4 records
SITE_KINDS: tuple[str, ...] = FP4_KINDS + ARTIFACT_KINDS
FORMAT_NAMES: tuple[str, ...] = ("nvfp4", "mxfp4", "mxfp4-rceil")
ID_FORMATS: dict[str, int] = {"uint8": 1, "uint16": 2}  # routed_experts: expert-id dtype -> bytes per id
GATE_FORMATS: dict[str, int] = {"float32": 4, "bfloat16": 2}  # routed_experts: gate-weight dtype -> bytes
MAX_EXPERTS = 1 << 16  # expert ids are uint16 at most

_RUN_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
IdKind = Literal["run", "trajectory", "site", "writer", "source"]


MAX_POLICY_VERSION = (1 << 63) - 1  # the wire's int64


def validate_version(value: object) -> int:
    """Check a policy version: an integer (Python or NumPy; not a bool) from 0 to 2**63 - 1, the
    wire's int64. Returns it as an int, or raises :class:`ValidationError`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValidationError(f"policy_version must be an integer >= 0, got {value!r}")
    v = int(value)
    if not 0 <= v <= MAX_POLICY_VERSION:
        raise ValidationError(f"policy_version must be an integer from 0 to 2**63 - 1 (int64), got {v}")
    return v


def validate_id(kind: str, value: object) -> str:
    """Check a run / trajectory / site / writer id; return it or raise :class:`ValidationError`.

    run: ``[a-z0-9][a-z0-9_.-]{0,63}``;
    trajectory, site, writer: ``[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}``.
    ``".."`` is refused anywhere in an id, so no id can name a parent directory.
    """
    if not isinstance(value, str):
        raise ValidationError(f"{kind} id must be a str, got {type(value).__name__} {value!r}")
    pattern = _RUN_RE if kind == "run" else _ID_RE
    if kind not in ("run", "trajectory", "site", "writer", "source"):
        raise ConfigError(f"unknown id kind {kind!r}; expected run, trajectory, site, writer or source")
    if pattern.fullmatch(value) is None or ".." in value:
        rule = "[a-z0-9][a-z0-9_.-]{0,63}" if kind == "run" else "[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
        raise ValidationError(f"invalid {kind} id {value[:200]!r}: expected {rule} without '..'")
    return value


# One past the largest token position a record, seal or link may name: 2^40 (~1.1e12) is far past
# any context a model runs, and keeps sums over tokens, sites and rows exact in int64 and float64.
MAX_TOKEN_END = 1 << 40


def _tokens_end(what: str, end: int) -> None:
    if end > MAX_TOKEN_END:
        raise ValidationError(f"{what}: tokens must end at or before 2^40 (MAX_TOKEN_END), got {end}")


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValidationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValidationError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _format_name(fmt: FP4Format | str) -> str:
    f = get_format(fmt)
    return "nvfp4" if f.name == "nvfp4" else "mxfp4-rceil" if f.scale_rule == "rceil" else "mxfp4"


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """One site of a run: an FP4 quantization site, or a per-token rollout artifact.

    FP4 sites (kinds ``moe_input``, ``key``, ``value``, ``other``): ``width`` values per row (a
    multiple of the format's block); ``bits`` = b low code bits kept; ``rows_per_token`` > 1 for
    MoE inputs quantized once per routed expert (rows by routing slot). A row holds
    ``code_bytes = width*bits//8`` packed code bytes and ``scale_bytes = width//block`` scale bytes.

    Artifact sites (kinds in :data:`ARTIFACT_KINDS`, one row per token, docs/data-model.md
    "Artifacts"): ``routed_experts`` of one MoE layer (``width`` = top_k, ``n_experts`` logical
    experts, ``format`` the id dtype ``"uint8"`` for n_experts <= 256 else ``"uint16"``, chosen when
    left at its default; ``gate`` None, ``"float32"`` or ``"bfloat16"``): codes hold the top_k ids,
    scales one flag byte (bit 0: the row is valid) and the gate weights. ``logprobs`` (``width`` 1,
    ``format`` ``"float32"``): codes hold the float32 log-prob, scales the flag byte. ``bits`` is
    the id or value width in bits (8, 16 or 32), derived; ``tracestore.artifacts`` encodes and
    decodes the rows.
    """

    name: str
    kind: SiteKind
    layer: int
    width: int
    format: str = "nvfp4"
    bits: int = 1
    rows_per_token: int = 1
    n_experts: int = 0
    gate: str | None = None

    def __post_init__(self) -> None:
        validate_id("site", self.name)
        if self.kind not in SITE_KINDS:
            raise ConfigError(f"site {self.name}: kind must be one of {SITE_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "layer", _int(f"site {self.name}: layer", self.layer, 0))
        object.__setattr__(self, "rows_per_token", _int(f"site {self.name}: rows_per_token", self.rows_per_token, 1))
        if self.kind in ARTIFACT_KINDS:
            self._check_artifact()
            return
        if self.n_experts or self.gate is not None:
            raise ConfigError(
                f"site {self.name}: n_experts and gate belong to routed_experts sites, not to kind {self.kind!r}"
            )
        object.__setattr__(self, "format", _format_name(self.format))
        object.__setattr__(self, "bits", check_bits(self.bits))
        width = _int(f"site {self.name}: width", self.width, 1)
        block = self.fmt.block
        if width % block:
            raise ShapeError(
                f"site {self.name}: width must be a multiple of the {self.format} block {block}, got {width}"
            )
        object.__setattr__(self, "width", width)

    def _check_artifact(self) -> None:
        where = f"site {self.name} ({self.kind})"
        if self.rows_per_token != 1:
            raise ConfigError(f"{where}: artifacts have one row per token; expected rows_per_token 1")
        if self.kind == "logprobs":
            if self.n_experts or self.gate is not None:
                raise ConfigError(f"{where}: n_experts and gate belong to routed_experts sites")
            fmt = "float32" if self.format == "nvfp4" else self.format
            if fmt != "float32" or self.width != 1:
                raise ConfigError(f"{where}: expected width 1 and format 'float32', got {self.width} and {fmt!r}")
            self._set_bits(where, "float32", 32)
            return
        n = _int(f"{where}: n_experts", self.n_experts, 1)
        if n > MAX_EXPERTS:
            raise ConfigError(f"{where}: n_experts must be <= {MAX_EXPERTS} (uint16 ids), got {n}")
        want = "uint8" if n <= 256 else "uint16"
        fmt = want if self.format == "nvfp4" else self.format
        if fmt != want:
            raise ConfigError(f"{where}: {n} experts take format {want!r} ids (uint8 up to 256 experts), got {fmt!r}")
        top_k = _int(f"{where}: width (top_k)", self.width, 1)
        if top_k > n:
            raise ConfigError(f"{where}: top_k (width) {top_k} exceeds n_experts {n}")
        if self.gate is not None and self.gate not in GATE_FORMATS:
            raise ConfigError(f"{where}: gate must be None or one of {sorted(GATE_FORMATS)}, got {self.gate!r}")
        self._set_bits(where, fmt, 8 * ID_FORMATS[fmt])

    def _set_bits(self, where: str, fmt: str, bits: int) -> None:
        if self.bits not in (1, bits):  # 1: the dataclass default, meaning "derive"
            raise ConfigError(
                f"{where}: {fmt} values are {bits} bits; expected bits {bits} (or left out), got {self.bits}"
            )
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "bits", bits)

    @property
    def is_artifact(self) -> bool:
        """True for a per-token artifact site (:data:`ARTIFACT_KINDS`), False for an FP4 site."""
        return self.kind in ARTIFACT_KINDS

    # Cached (the fields are frozen): the sidecar asks for them several times per received chunk.
    @functools.cached_property
    def fmt(self) -> FP4Format:
        """The FP4 format; an artifact site has none (:class:`ConfigError`)."""
        if self.kind in ARTIFACT_KINDS:
            raise ConfigError(f"site {self.name} is a {self.kind} artifact, not an FP4 site: it has no FP4 format")
        return get_format(self.format)

    @functools.cached_property
    def code_bytes(self) -> int:
        return self.width * self.bits // 8

    @functools.cached_property
    def scale_bytes(self) -> int:
        if self.kind == "routed_experts":
            return 1 + self.width * (GATE_FORMATS[self.gate] if self.gate else 0)
        if self.kind == "logprobs":
            return 1
        return self.width // self.fmt.block

    def byte_spans(self, columns: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The code and scale bytes of a row that hold values ``[a, b)``: ``((c0, c1), (s0, s1))``.
        An artifact row is read whole: only ``(0, width)``."""
        a, b = columns
        if self.kind in ARTIFACT_KINDS:
            if (a, b) != (0, self.width):
                raise ConfigError(f"site {self.name} ({self.kind}) is read whole; expected columns (0, {self.width})")
            return (0, self.code_bytes), (0, self.scale_bytes)
        return (a * self.bits // 8, b * self.bits // 8), (a // self.fmt.block, b // self.fmt.block)

    @property
    def payload_layout(self) -> str:
        """What one row's code and scale bytes hold, for error messages."""
        if self.kind == "routed_experts":
            gate = f" + {self.width} {self.gate} gate weights" if self.gate else ""
            return f"routed_experts: codes = top_k {self.width} {self.format} expert ids, scales = 1 flag byte{gate}"
        if self.kind == "logprobs":
            return "logprobs: codes = 1 float32 log-prob, scales = 1 flag byte"
        return (
            f"{self.format} b={self.bits}: codes = {self.width} values x {self.bits} bits, scales = "
            f"{self.width}/{self.fmt.block} scale bytes"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.n_experts:  # FP4 sites keep the JSON (run.json, site digests) they always had
            del d["n_experts"]
        if self.gate is None:
            del d["gate"]
        return d


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run and its declared sites. ``RunSpec("run-1", (site_a, site_b)).site("name")``."""

    run: str
    sites: tuple[SiteSpec, ...]

    def __post_init__(self) -> None:
        validate_id("run", self.run)
        sites = tuple(self.sites)
        for s in sites:
            if not isinstance(s, SiteSpec):
                raise ValidationError(f"run {self.run}: sites must be SiteSpec objects, got {type(s).__name__}")
        names = [s.name for s in sites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValidationError(f"run {self.run}: duplicate site names {dup}")
        object.__setattr__(self, "sites", sites)

    def site(self, name: str) -> SiteSpec:
        s = self._by_name.get(name)
        if s is None:
            raise NotFoundError(f"run {self.run} has no site {name!r}; declared sites: {[s.name for s in self.sites]}")
        return s

    @functools.cached_property
    def _by_name(self) -> dict[str, SiteSpec]:
        return {s.name: s for s in self.sites}

    @property
    def sites_by_name(self) -> dict[str, SiteSpec]:
        """Every site by name (one dict, built once; do not mutate)."""
        return self._by_name

    @functools.cached_property
    def site_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "sites": [s.to_dict() for s in self.sites]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        try:
            return cls(d["run"], tuple(SiteSpec(**s) for s in d["sites"]))
        except (KeyError, TypeError) as exc:
            raise ValidationError(f"not a RunSpec dict ({exc}): expected {{'run': str, 'sites': [...]}}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        return cls.from_dict(parse_json(text, "RunSpec"))


def parse_json(text: str | bytes, what: str) -> Any:
    """``json.loads(text)``; text that does not parse is a ValidationError naming ``what``."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"{what} JSON does not parse: {exc}") from exc


def _u8_2d(name: str, a: object) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise DTypeError(f"{name} must be a numpy uint8 array, got {type(a).__name__}")
    if a.dtype != np.uint8:
        raise DTypeError(f"{name} must have dtype uint8, got {a.dtype}")
    if a.ndim != 2:
        raise ShapeError(f"{name} must be 2-D [rows, bytes_per_row], got shape {a.shape}")
    return np.ascontiguousarray(a)


@dataclasses.dataclass(frozen=True, eq=False)
class RecordChunk:
    """Records of one site for tokens ``[token_start, token_start + n_tokens)`` of one trajectory.

    ``codes``: uint8 ``[n_tokens*rows_per_token, code_bytes]`` (packed low-b code bits),
    ``scales``: uint8 ``[n_rows, scale_bytes]`` (raw E4M3/E8M0 bytes, row-major),
    ``global_scale``: the decode-side float32 g (1.0 for MX), ``token_scales``: float32 ``[n_rows]``
    or None, ``ids_crc``: the chunk's token identity (:mod:`tracestore.identity`: the CRC-32 of the
    trajectory's token ids up to ``token_end``) or None when the recorder had no token ids. Arrays
    are not copied; do not mutate them after construction.
    """

    run: str
    policy_version: int
    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    codes: np.ndarray
    scales: np.ndarray
    global_scale: float
    token_scales: np.ndarray | None = None
    ids_crc: int | None = None

    def __post_init__(self) -> None:
        validate_id("run", self.run)
        validate_id("trajectory", self.trajectory)
        validate_id("site", self.site)
        object.__setattr__(self, "policy_version", _int("policy_version", self.policy_version, 0))
        object.__setattr__(self, "token_start", _int("token_start", self.token_start, 0))
        object.__setattr__(self, "n_tokens", _int("n_tokens", self.n_tokens, 1))
        _tokens_end(f"trajectory {self.trajectory} site {self.site}", self.token_start + self.n_tokens)
        codes = _u8_2d("codes", self.codes)
        scales = _u8_2d("scales", self.scales)
        if codes.shape[0] != scales.shape[0]:
            raise ShapeError(f"{self.key_str}: codes has {codes.shape[0]} rows but scales has {scales.shape[0]}")
        if codes.shape[0] % self.n_tokens:
            raise ShapeError(
                f"{self.key_str}: {codes.shape[0]} rows is not a whole number of rows per token for "
                f"n_tokens={self.n_tokens}"
            )
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "scales", scales)
        try:
            g = np.float32(self.global_scale)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"{self.key_str}: global_scale must be a float, got {self.global_scale!r}") from exc
        if not np.isfinite(g) or g <= 0:
            raise ValidationError(f"{self.key_str}: global_scale must be finite and > 0, got {self.global_scale!r}")
        object.__setattr__(self, "global_scale", float(g))
        if self.token_scales is not None:
            ts = self.token_scales
            if not isinstance(ts, np.ndarray) or ts.dtype != np.float32:
                raise DTypeError(f"{self.key_str}: token_scales must be a float32 numpy array or None")
            if ts.shape != (codes.shape[0],):
                raise ShapeError(f"{self.key_str}: token_scales must have shape ({codes.shape[0]},), got {ts.shape}")
            object.__setattr__(self, "token_scales", np.ascontiguousarray(ts))
        if self.ids_crc is not None:
            if isinstance(self.ids_crc, bool) or not isinstance(self.ids_crc, (int, np.integer)):
                raise ValidationError(f"{self.key_str}: ids_crc must be an integer or None, got {self.ids_crc!r}")
            if not 0 <= int(self.ids_crc) <= 0xFFFFFFFF:
                raise ValidationError(f"{self.key_str}: ids_crc must be a uint32, got {self.ids_crc}")
            object.__setattr__(self, "ids_crc", int(self.ids_crc))

    @classmethod
    def from_checked_fields(cls, *fields: Any) -> RecordChunk:
        """A chunk of these field values (in field order), built without the constructor's checks,
        for a caller that has established each of them on its input's types:
        :func:`tracestore.wire.chunk_from_parts`, the sidecar's parser, is the one such caller."""
        obj = object.__new__(cls)
        obj.__dict__.update(zip(_FIELD_NAMES, fields, strict=True))
        return obj

    @property
    def token_end(self) -> int:
        return self.token_start + self.n_tokens

    @property
    def n_rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def rows_per_token(self) -> int:
        return self.n_rows // self.n_tokens

    @property
    def key_str(self) -> str:
        return (
            f"run {self.run} v{self.policy_version} trajectory {self.trajectory} site {self.site} "
            f"tokens [{self.token_start}, {self.token_start + self.n_tokens})"
        )

    @functools.cached_property
    def nbytes(self) -> int:
        # cached: a shard encode asks every chunk several times (row groups, entries, payload)
        ts = 0 if self.token_scales is None else self.token_scales.nbytes
        return int(self.codes.nbytes + self.scales.nbytes + ts)

    @property
    def checksum(self) -> int:
        """The chunk checksum: CRC-32 of the canonical encoding of :attr:`key` and the payloads
        (:mod:`tracestore.checksum`)."""
        return record_checksum(self)

    @property
    def key(self) -> ChunkKey:
        """Everything :attr:`checksum` covers but the payloads."""
        return ChunkKey.of(self)

    def validate(self, site: SiteSpec) -> RecordChunk:
        """Check this chunk against its site's declared layout; returns self. An artifact chunk's
        values are checked too (:func:`check_artifact_rows`)."""
        if site.name != self.site:
            raise ValidationError(f"{self.key_str}: validated against site {site.name!r}")
        rows = self.n_tokens * site.rows_per_token
        if site.is_artifact:
            for what, arr, want in (("codes", self.codes, site.code_bytes), ("scales", self.scales, site.scale_bytes)):
                if arr.shape != (rows, want):
                    raise ShapeError(
                        f"{self.key_str}: {what} must be uint8[{rows}, {want}] ({site.payload_layout}), "
                        f"got {list(arr.shape)}"
                    )
            if self.global_scale != 1.0 or self.token_scales is not None:
                raise ValidationError(f"{self.key_str}: a {site.kind} chunk has global_scale 1.0 and no token_scales")
            check_artifact_rows(site, self.codes, self.scales, self.key_str)
            return self
        if self.codes.shape != (rows, site.code_bytes):
            raise ShapeError(
                f"{self.key_str}: codes must be uint8[{rows}, {site.code_bytes}] (n_tokens*rows_per_token, "
                f"width*bits/8 for width {site.width}, b={site.bits}), got {list(self.codes.shape)}"
            )
        if self.scales.shape != (rows, site.scale_bytes):
            raise ShapeError(
                f"{self.key_str}: scales must be uint8[{rows}, {site.scale_bytes}] (width/block), "
                f"got {list(self.scales.shape)}"
            )
        if not site.fmt.has_global_scale and self.global_scale != 1.0:
            raise ValidationError(f"{self.key_str}: {site.format} has no global scale; expected 1.0")
        return self

    def same_bytes(self, other: RecordChunk) -> bool:
        """True when both chunks hold the same key and identical bytes (a harmless retry)."""
        if (self.run, self.policy_version, self.trajectory, self.site, self.token_start, self.n_tokens) != (
            other.run,
            other.policy_version,
            other.trajectory,
            other.site,
            other.token_start,
            other.n_tokens,
        ):
            return False
        if np.float32(self.global_scale).tobytes() != np.float32(other.global_scale).tobytes():
            return False
        if (self.token_scales is None) != (other.token_scales is None) or self.ids_crc != other.ids_crc:
            return False
        if (
            self.token_scales is not None
            and other.token_scales is not None
            and self.token_scales.tobytes() != other.token_scales.tobytes()
        ):
            return False
        return bool(np.array_equal(self.codes, other.codes) and np.array_equal(self.scales, other.scales))


# (run, policy_version, trajectory, site, token_start, n_tokens, codes, scales, global_scale,
# token_scales, ids_crc): the order of RecordChunk.from_checked_fields' arguments
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RecordChunk))


def check_artifact_rows(site: SiteSpec, codes: np.ndarray, scales: np.ndarray, where: str) -> None:
    """Check the values of artifact rows (uint8 ``codes`` [rows, code_bytes], ``scales`` [rows,
    scale_bytes]): every flag byte is 0 or 1 (bit 0: valid); on valid rows the expert ids are
    below ``n_experts`` and distinct within the row (``routed_experts``), the log-prob finite
    (``logprobs``). Raises :class:`ValidationError` naming the first bad row."""
    flags = scales[:, 0]
    bad = np.flatnonzero(flags > 1)
    if bad.size:
        raise ValidationError(f"{where}: row {int(bad[0])} has flag byte {int(flags[bad[0]])}; expected 0 or 1 (valid)")
    valid = flags == 1
    if site.kind == "routed_experts":
        ids = codes.view("<u2") if site.format == "uint16" else codes
        over = np.flatnonzero(valid & (ids >= site.n_experts).any(axis=1))
        if over.size:
            raise ValidationError(
                f"{where}: row {int(over[0])} names expert ids {ids[over[0]].tolist()}; expected ids below "
                f"n_experts {site.n_experts}"
            )
        if site.width > 1:
            s = np.sort(ids[valid], axis=1)
            dup = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
            if dup.size:
                row = int(np.flatnonzero(valid)[dup[0]])
                raise ValidationError(
                    f"{where}: row {row} names an expert twice: {ids[row].tolist()}; expected top_k distinct ids"
                )
    elif site.kind == "logprobs":
        lp = codes.view("<f4")[:, 0]
        bad = np.flatnonzero(valid & ~np.isfinite(lp))
        if bad.size:
            raise ValidationError(f"{where}: row {int(bad[0])} holds log-prob {lp[bad[0]]}; expected a finite value")


def _site_tuple(run: str, sites: object) -> tuple[str, ...]:
    if isinstance(sites, str) or not isinstance(sites, (tuple, list)):
        raise ValidationError(f"run {run}: seal sites must be a tuple of site names, got {sites!r}")
    out = tuple(validate_id("site", s) for s in sites)
    if len(set(out)) != len(out):
        raise ValidationError(f"run {run}: seal lists a site twice: {list(out)}")
    return out


@dataclasses.dataclass(frozen=True)
class TrajectorySeal:
    """The writer's statement that every token of every listed site has been sent.

    A rollout runs forwards for positions ``0..n_tokens-2`` only: the last position of a sealed
    trajectory is unrecorded by design (readers mask it; it is not missing data).
    """

    run: str
    policy_version: int
    trajectory: str
    n_tokens: int
    sites: tuple[str, ...]

    def __post_init__(self) -> None:
        validate_id("run", self.run)
        validate_id("trajectory", self.trajectory)
        object.__setattr__(self, "policy_version", _int("policy_version", self.policy_version, 0))
        object.__setattr__(self, "n_tokens", _int(f"seal of {self.trajectory}: n_tokens", self.n_tokens, 1))
        _tokens_end(f"seal of {self.trajectory}", self.n_tokens)
        object.__setattr__(self, "sites", _site_tuple(self.run, self.sites))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "policy_version": self.policy_version,
            "trajectory": self.trajectory,
            "n_tokens": self.n_tokens,
            "sites": list(self.sites),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrajectorySeal:
        return cls(d["run"], d["policy_version"], d["trajectory"], d["n_tokens"], tuple(d["sites"]))


@dataclasses.dataclass(frozen=True)
class PrefixLink:
    """``trajectory``'s tokens ``[0, n_tokens)`` are ``source``'s (a shared prompt, a cache hit)."""

    run: str
    policy_version: int
    trajectory: str
    source: str
    n_tokens: int

    def __post_init__(self) -> None:
        validate_id("run", self.run)
        validate_id("trajectory", self.trajectory)
        validate_id("source", self.source)
        if self.source == self.trajectory:
            raise ValidationError(f"prefix link of {self.trajectory} names itself as its source")
        object.__setattr__(self, "policy_version", _int("policy_version", self.policy_version, 0))
        object.__setattr__(self, "n_tokens", _int(f"link of {self.trajectory}: n_tokens", self.n_tokens, 1))
        _tokens_end(f"link of {self.trajectory}", self.n_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefixLink:
        return cls(d["run"], d["policy_version"], d["trajectory"], d["source"], d["n_tokens"])
