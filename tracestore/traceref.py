"""TraceRef: the small handle an RL framework carries for one trajectory's records.

A rollout sample travels from an engine worker to trainer ranks through the framework (a Ray
object, a queue, a JSON-lines file). Its per-token records must not ride along (that is the
fan-out that runs trainers out of memory); a :class:`TraceRef` does instead: run, policy
version, trajectory, attempt, token count, a digest of the sealed site set and whether the
trajectory is guided. It pickles and serializes to JSON in a few hundred bytes whatever the
trajectory's length, and each trainer rank reads only its own rows with it
(:mod:`tracestore.rank_plan`).

Attempts. Records are write-once per (trajectory, attempt): a retried or aborted rollout never
overwrites an earlier attempt's records. The record model has no attempt field, so the attempt is
part of the *stored* trajectory id through a reserved suffix: attempt ``n`` of trajectory ``t`` is
stored as ``f"{t}::a{n}"`` (:func:`attempt_id`). ``"::"`` is reserved: a base trajectory id may not
contain it, and a stored id parses back (:func:`split_attempt_id`) by its last ``"::a"`` followed
by a canonical decimal, so the mapping is one-to-one and stays inside the id charset every storage
layer already validates (nothing in the storage format changes). A reader given a ref reads
exactly ``ref.stored_id``, never another attempt.

When a ref exists. :meth:`tracestore.client.RolloutRecorder.refs` (made in
:mod:`tracestore.client.record.traceref`) hands out a guided ref only once the message carrying the
trajectory's seal is durable at the sidecar *and* the sidecar reports the shard holding it committed
to storage (``Stat``'s ``committed_sequence`` for the recorder's writer): publication completes
before the handle exists, so a trainer given a guided ref can read it from storage. A trajectory the
recorder dropped (staging full, sidecar unreachable, refused) or whose seal was not published within
the timeout gets an unguided ref (``guided=False`` and a ``reason``): trainers use RTN for its rows.

Example::

    tid = recorder.attempt("prompt-17-sample-3")            # "prompt-17-sample-3::a0"
    recorder.record_forward([(tid, 0, 12)], outputs) ...; recorder.finish(tid, 13)
    [ref] = recorder.refs([tid], timeout=30)
    blob = ref.to_json()                                     # ~250 bytes, to the trainer
    ref = TraceRef.from_json(blob)                           # checked on the way in
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tracestore.errors import ConfigError, MissingRecordsError, ValidationError
from tracestore.records import RunSpec, parse_json, validate_id

if TYPE_CHECKING:  # pragma: no cover
    from tracestore.storage.reader import StoreReader

REF_FORMAT = 1
ATTEMPT_SEP = "::a"
_RESERVED = "::"
_STORED_RE = re.compile(r"(?P<base>.+)::a(?P<n>0|[1-9][0-9]{0,8})")
_DIGEST_RE = re.compile(r"[0-9a-f]{16}")
MAX_ATTEMPT = 999_999_999
# Why a ref is unguided; a fixed set so that reports and metrics stay bounded.
UNGUIDED_REASONS = (
    "staging_full",
    "sidecar_unreachable",
    "unpublished",
    "not_durable",
    "refused",
    "stopped",
    "aborted",
    "incomplete",  # positions the engine computed were never recorded (a gap other than an abort)
)


def attempt_id(trajectory: str, attempt: int) -> str:
    """The stored trajectory id of ``attempt`` of ``trajectory``: ``f"{trajectory}::a{attempt}"``.

    ``trajectory`` must be a valid trajectory id without ``"::"`` (reserved), and the result must
    fit the 128-character id limit."""
    validate_id("trajectory", trajectory)
    if _RESERVED in trajectory:
        raise ValidationError(
            f"trajectory id {trajectory[:200]!r} contains '::', which is reserved for attempt suffixes "
            f"(attempt n is stored as '<trajectory>::a<n>'); use another separator"
        )
    n = _attempt(attempt)
    stored = f"{trajectory}{ATTEMPT_SEP}{n}"
    if len(stored) > 128:
        raise ValidationError(
            f"trajectory id {trajectory[:60]!r}... is too long for an attempt suffix: the stored id "
            f"{len(stored)} characters, the limit is 128 (keep base ids to {128 - len(ATTEMPT_SEP) - len(str(n))})"
        )
    return validate_id("trajectory", stored)


def split_attempt_id(stored: str) -> tuple[str, int]:
    """``(trajectory, attempt)`` of a stored id made by :func:`attempt_id`; ValidationError for an
    id without the attempt suffix."""
    validate_id("trajectory", stored)
    m = _STORED_RE.fullmatch(stored)
    if m is None or _RESERVED in m.group("base"):
        raise ValidationError(
            f"stored trajectory id {stored[:200]!r} has no attempt suffix '::a<n>': record trajectories that "
            f"get TraceRefs under attempt_id(trajectory, n) (RolloutRecorder.attempt)"
        )
    return m.group("base"), int(m.group("n"))


def _attempt(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ATTEMPT:
        raise ValidationError(f"attempt must be an integer in [0, {MAX_ATTEMPT}], got {value!r}")
    return value


def site_digest(run_spec: RunSpec, sites: Iterable[str] | None = None) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of the specs of ``sites`` (default: all of
    the run's sites), sorted by name: equal digests mean the same site names, kinds, layers,
    widths, formats, bits and rows per token."""
    names = sorted(run_spec.site_names if sites is None else set(sites))
    specs = [run_spec.site(n).to_dict() for n in names]
    blob = json.dumps(specs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_FIELDS = ("run", "policy_version", "trajectory", "attempt", "n_tokens", "sites", "guided", "reason", "writer")


@dataclasses.dataclass(frozen=True)
class TraceRef:
    """A handle for the records of one attempt of one trajectory (see the module docstring).

    ``sites``: :func:`site_digest` of the seal's site set; ``guided``: the records are sealed and
    published (False: the trainer uses RTN for its rows, ``reason`` says why); ``writer``: the
    recorder that produced the ref (diagnostics). Validated on construction; :meth:`to_json`
    carries a CRC-32 of the fields that :meth:`from_json` checks, so a hand-edited handle is
    refused rather than read with the wrong length.
    """

    run: str
    policy_version: int
    trajectory: str
    attempt: int
    n_tokens: int
    sites: str
    guided: bool = True
    reason: str = ""
    writer: str = ""

    def __post_init__(self) -> None:
        validate_id("run", self.run)
        validate_id("trajectory", self.trajectory)
        if _RESERVED in self.trajectory:
            raise ValidationError(f"TraceRef trajectory {self.trajectory!r} must be the base id, without '::'")
        for name in ("policy_version", "n_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "n_tokens" else 0):
                raise ValidationError(
                    f"TraceRef {name} must be an integer >= {1 if name == 'n_tokens' else 0}, got {v!r}"
                )
        _attempt(self.attempt)
        if not isinstance(self.sites, str) or _DIGEST_RE.fullmatch(self.sites) is None:
            raise ValidationError(f"TraceRef sites must be a 16-hex-digit site digest, got {self.sites!r}")
        if not isinstance(self.guided, bool):
            raise ValidationError(f"TraceRef guided must be a bool, got {self.guided!r}")
        if self.guided and self.reason:
            raise ValidationError(f"a guided TraceRef has no unguided reason, got {self.reason!r}")
        if not self.guided and self.reason not in UNGUIDED_REASONS:
            raise ValidationError(f"TraceRef reason must be one of {UNGUIDED_REASONS}, got {self.reason!r}")
        if self.writer:
            validate_id("writer", self.writer)
        validate_id("trajectory", self.stored_id)  # the suffixed id fits the id rules too

    @property
    def stored_id(self) -> str:
        """The trajectory id the records are stored under (:func:`attempt_id`)."""
        return f"{self.trajectory}{ATTEMPT_SEP}{self.attempt}"

    @property
    def crc(self) -> int:
        """CRC-32 of the canonical field encoding (what :meth:`to_json` writes as ``crc``)."""
        return zlib.crc32(json.dumps([getattr(self, f) for f in _FIELDS], separators=(",", ":")).encode())

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in _FIELDS}
        d["v"] = REF_FORMAT
        d["crc"] = self.crc
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TraceRef:
        if not isinstance(d, Mapping):
            raise ValidationError(f"a TraceRef is a JSON object, got {type(d).__name__}")
        if d.get("v") != REF_FORMAT:
            raise ValidationError(f"TraceRef format {d.get('v')!r} is not supported (this reader knows {REF_FORMAT})")
        unknown = sorted(set(d) - set(_FIELDS) - {"v", "crc"})
        if unknown:
            raise ValidationError(f"TraceRef has unknown fields {unknown}")
        try:
            ref = cls(**{f: d[f] for f in _FIELDS})
        except KeyError as exc:
            raise ValidationError(f"TraceRef lacks the field {exc.args[0]!r}") from None
        if d.get("crc") != ref.crc:
            raise ValidationError(
                f"TraceRef of {ref.stored_id} (run {ref.run}) fails its CRC: a field was changed after the "
                f"recorder made it (n_tokens={ref.n_tokens}, policy_version={ref.policy_version}, "
                f"guided={ref.guided}); refs are made by RolloutRecorder.refs, not edited"
            )
        return ref

    @classmethod
    def from_json(cls, text: str | bytes) -> TraceRef:
        return cls.from_dict(parse_json(text, "TraceRef"))

    def __reduce__(self) -> tuple[Any, ...]:
        # a plain tuple of the fields (smaller than a dataclass's default pickle), re-validated on load
        return (_unpickle, (tuple(getattr(self, f) for f in _FIELDS),))


def _unpickle(fields: tuple[Any, ...]) -> TraceRef:
    return TraceRef(*fields)


def write_jsonl(refs: Iterable[TraceRef], path: str | Path | IO[str]) -> int:
    """Write ``refs`` one JSON object a line; returns how many."""
    n = 0
    if isinstance(path, (str, Path)):
        with open(path, "w", encoding="utf-8") as f:
            return write_jsonl(refs, f)
    for r in refs:
        path.write(r.to_json() + "\n")
        n += 1
    return n


def read_jsonl(path: str | Path | IO[str]) -> list[TraceRef]:
    """The refs of a JSON-lines file (blank lines skipped); errors name the line."""
    if isinstance(path, (str, Path)):
        with open(path, encoding="utf-8") as f:
            return read_jsonl(f)
    out = []
    for i, line in enumerate(path, start=1):
        if not line.strip():
            continue
        try:
            out.append(TraceRef.from_json(line))
        except ValidationError as exc:
            raise ValidationError(f"line {i}: {exc}") from None
    return out


def check_refs(
    refs: Iterable[TraceRef], reader: StoreReader, *, strict: bool = True, missing: str = "error"
) -> list[str]:
    """Check guided ``refs`` against what ``reader``'s store holds: the run, a seal of the stored id
    in the ref's version with the ref's token count and site set. Returns the problems (empty: all
    fine); with ``strict`` raises the first as ValidationError / MissingRecordsError.
    ``missing="skip"``: a ref with no seal on storage is not a problem (its rows are then found
    missing by the read, and masked or refused there)."""
    if missing not in ("error", "skip"):
        raise ConfigError(f"missing must be 'error' or 'skip', got {missing!r}")
    problems: list[tuple[type[Exception], str]] = []
    spec = reader.spec
    digests: dict[frozenset[str], str] = {}
    versions = set(reader.versions())
    wanted = sorted({r.policy_version for r in refs if isinstance(r, TraceRef) and r.guided} & versions)
    if wanted:
        reader.refresh(wanted)
    for r in refs:
        if not isinstance(r, TraceRef):
            raise ConfigError(f"expected TraceRef objects, got {type(r).__name__}")
        where = f"ref of {r.stored_id} (run {r.run}, v{r.policy_version})"
        if r.run != reader.run:
            problems.append(
                (ValidationError, f"{where} belongs to run {r.run!r}, this reader reads run {reader.run!r}")
            )
            continue
        if not r.guided:
            continue
        seal = reader.seal(r.stored_id, {r.policy_version})
        if seal is None:
            if missing == "error":
                problems.append(
                    (MissingRecordsError, f"{where}: storage has no seal of {r.stored_id} in v{r.policy_version}")
                )
            continue
        if seal.n_tokens != r.n_tokens:
            problems.append(
                (
                    ValidationError,
                    f"{where} says {r.n_tokens} tokens, its seal on storage says {seal.n_tokens}: "
                    "a forged or stale handle",
                )
            )
        key = frozenset(seal.sites)
        d = digests.get(key)
        if d is None:
            try:
                d = digests[key] = site_digest(spec, key)
            except Exception as exc:  # noqa: BLE001 - a seal naming an undeclared site
                problems.append((ValidationError, f"{where}: its seal names sites the run does not declare: {exc}"))
                continue
        if d != r.sites:
            problems.append(
                (
                    ValidationError,
                    f"{where}: site digest {r.sites} differs from its seal's {d} ({len(seal.sites)} sites)",
                )
            )
    if strict and problems:
        cls, msg = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise cls(msg + more)
    return [m for _, m in problems]


__all__ = [
    "ATTEMPT_SEP",
    "REF_FORMAT",
    "UNGUIDED_REASONS",
    "TraceRef",
    "attempt_id",
    "check_refs",
    "read_jsonl",
    "site_digest",
    "split_attempt_id",
    "write_jsonl",
]
