from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SiteKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SITE_KIND_UNSPECIFIED: _ClassVar[SiteKind]
    SITE_KIND_MOE_INPUT: _ClassVar[SiteKind]
    SITE_KIND_KEY: _ClassVar[SiteKind]
    SITE_KIND_VALUE: _ClassVar[SiteKind]
    SITE_KIND_OTHER: _ClassVar[SiteKind]
    SITE_KIND_ROUTED_EXPERTS: _ClassVar[SiteKind]
    SITE_KIND_LOGPROBS: _ClassVar[SiteKind]

class OnMissing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_MISSING_UNSPECIFIED: _ClassVar[OnMissing]
    ON_MISSING_ERROR: _ClassVar[OnMissing]
    ON_MISSING_MASK: _ClassVar[OnMissing]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_DRAINING: _ClassVar[ServingState]
SITE_KIND_UNSPECIFIED: SiteKind
SITE_KIND_MOE_INPUT: SiteKind
SITE_KIND_KEY: SiteKind
SITE_KIND_VALUE: SiteKind
SITE_KIND_OTHER: SiteKind
SITE_KIND_ROUTED_EXPERTS: SiteKind
SITE_KIND_LOGPROBS: SiteKind
ON_MISSING_UNSPECIFIED: OnMissing
ON_MISSING_ERROR: OnMissing
ON_MISSING_MASK: OnMissing
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_DRAINING: ServingState

class Site(_message.Message):
    __slots__ = ("name", "kind", "layer", "width", "format", "bits", "rows_per_token", "n_experts", "gate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    N_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: SiteKind
    layer: int
    width: int
    format: str
    bits: int
    rows_per_token: int
    n_experts: int
    gate: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[SiteKind, str]] = ..., layer: _Optional[int] = ..., width: _Optional[int] = ..., format: _Optional[str] = ..., bits: _Optional[int] = ..., rows_per_token: _Optional[int] = ..., n_experts: _Optional[int] = ..., gate: _Optional[str] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run", "sites")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    run: str
    sites: _containers.RepeatedCompositeFieldContainer[Site]
    def __init__(self, run: _Optional[str] = ..., sites: _Optional[_Iterable[_Union[Site, _Mapping]]] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("codes_offset", "scales_offset", "token_scales_offset")
    CODES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SCALES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCALES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    codes_offset: int
    scales_offset: int
    token_scales_offset: int
    def __init__(self, codes_offset: _Optional[int] = ..., scales_offset: _Optional[int] = ..., token_scales_offset: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("policy_version", "trajectory", "site", "token_start", "n_tokens", "codes", "scales", "global_scale", "token_scales", "has_token_scales", "checksum", "shm", "ids_crc")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SCALE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    IDS_CRC_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    trajectory: str
    site: str
    token_start: int
    n_tokens: int
    codes: bytes
    scales: bytes
    global_scale: float
    token_scales: bytes
    has_token_scales: bool
    checksum: int
    shm: ShmRef
    ids_crc: int
    def __init__(self, policy_version: _Optional[int] = ..., trajectory: _Optional[str] = ..., site: _Optional[str] = ..., token_start: _Optional[int] = ..., n_tokens: _Optional[int] = ..., codes: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., global_scale: _Optional[float] = ..., token_scales: _Optional[bytes] = ..., has_token_scales: _Optional[bool] = ..., checksum: _Optional[int] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., ids_crc: _Optional[int] = ...) -> None: ...

class TrajectorySeal(_message.Message):
    __slots__ = ("policy_version", "trajectory", "n_tokens", "sites")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    trajectory: str
    n_tokens: int
    sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy_version: _Optional[int] = ..., trajectory: _Optional[str] = ..., n_tokens: _Optional[int] = ..., sites: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefixLink(_message.Message):
    __slots__ = ("policy_version", "trajectory", "source", "n_tokens")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    trajectory: str
    source: str
    n_tokens: int
    def __init__(self, policy_version: _Optional[int] = ..., trajectory: _Optional[str] = ..., source: _Optional[str] = ..., n_tokens: _Optional[int] = ...) -> None: ...

class UnguidedReport(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    count: int
    def __init__(self, reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("run", "writer", "epoch", "sequence", "run_spec", "chunks", "seals", "links", "shm_pool", "unguided", "keeps_staging")
    RUN_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    SHM_POOL_FIELD_NUMBER: _ClassVar[int]
    UNGUIDED_FIELD_NUMBER: _ClassVar[int]
    KEEPS_STAGING_FIELD_NUMBER: _ClassVar[int]
    run: str
    writer: str
    epoch: int
    sequence: int
    run_spec: RunSpec
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    seals: _containers.RepeatedCompositeFieldContainer[TrajectorySeal]
    links: _containers.RepeatedCompositeFieldContainer[PrefixLink]
    shm_pool: str
    unguided: _containers.RepeatedCompositeFieldContainer[UnguidedReport]
    keeps_staging: bool
    def __init__(self, run: _Optional[str] = ..., writer: _Optional[str] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., run_spec: _Optional[_Union[RunSpec, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., seals: _Optional[_Iterable[_Union[TrajectorySeal, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[PrefixLink, _Mapping]]] = ..., shm_pool: _Optional[str] = ..., unguided: _Optional[_Iterable[_Union[UnguidedReport, _Mapping]]] = ..., keeps_staging: _Optional[bool] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("epoch", "durable_sequence", "received_sequence", "released_sequence")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    durable_sequence: int
    received_sequence: int
    released_sequence: int
    def __init__(self, epoch: _Optional[int] = ..., durable_sequence: _Optional[int] = ..., received_sequence: _Optional[int] = ..., released_sequence: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("run", "writer", "epoch", "sequence", "seals", "links")
    RUN_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SEALS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    run: str
    writer: str
    epoch: int
    sequence: int
    seals: _containers.RepeatedCompositeFieldContainer[TrajectorySeal]
    links: _containers.RepeatedCompositeFieldContainer[PrefixLink]
    def __init__(self, run: _Optional[str] = ..., writer: _Optional[str] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., seals: _Optional[_Iterable[_Union[TrajectorySeal, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[PrefixLink, _Mapping]]] = ...) -> None: ...

class SealResponse(_message.Message):
    __slots__ = ("epoch", "durable_sequence")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    durable_sequence: int
    def __init__(self, epoch: _Optional[int] = ..., durable_sequence: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("trajectory", "token_start", "token_end")
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    trajectory: str
    token_start: int
    token_end: int
    def __init__(self, trajectory: _Optional[str] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("run", "plan", "versions", "sites", "on_missing", "has_columns", "column_start", "column_end", "token_ids", "mask_mismatch")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    ON_MISSING_FIELD_NUMBER: _ClassVar[int]
    HAS_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_START_FIELD_NUMBER: _ClassVar[int]
    COLUMN_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    run: str
    plan: _containers.RepeatedCompositeFieldContainer[Segment]
    versions: _containers.RepeatedScalarFieldContainer[int]
    sites: _containers.RepeatedScalarFieldContainer[str]
    on_missing: OnMissing
    has_columns: bool
    column_start: int
    column_end: int
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    mask_mismatch: bool
    def __init__(self, run: _Optional[str] = ..., plan: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., versions: _Optional[_Iterable[int]] = ..., sites: _Optional[_Iterable[str]] = ..., on_missing: _Optional[_Union[OnMissing, str]] = ..., has_columns: _Optional[bool] = ..., column_start: _Optional[int] = ..., column_end: _Optional[int] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., mask_mismatch: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("trajectory", "ids")
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    trajectory: str
    ids: bytes
    def __init__(self, trajectory: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class ReadResponse(_message.Message):
    __slots__ = ("site", "row_start", "n_rows", "total_rows", "code_bytes", "scale_bytes", "codes", "scales", "global_scale", "token_scales", "has_token_scales", "valid", "policy_version", "mismatched")
    class MismatchedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    N_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    CODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SCALE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_SCALES_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    site: str
    row_start: int
    n_rows: int
    total_rows: int
    code_bytes: int
    scale_bytes: int
    codes: bytes
    scales: bytes
    global_scale: bytes
    token_scales: bytes
    has_token_scales: bool
    valid: bytes
    policy_version: bytes
    mismatched: _containers.ScalarMap[str, str]
    def __init__(self, site: _Optional[str] = ..., row_start: _Optional[int] = ..., n_rows: _Optional[int] = ..., total_rows: _Optional[int] = ..., code_bytes: _Optional[int] = ..., scale_bytes: _Optional[int] = ..., codes: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., global_scale: _Optional[bytes] = ..., token_scales: _Optional[bytes] = ..., has_token_scales: _Optional[bool] = ..., valid: _Optional[bytes] = ..., policy_version: _Optional[bytes] = ..., mismatched: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class WriterState(_message.Message):
    __slots__ = ("run", "writer", "epoch", "received_sequence", "durable_sequence", "committed_sequence")
    RUN_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    run: str
    writer: str
    epoch: int
    received_sequence: int
    durable_sequence: int
    committed_sequence: int
    def __init__(self, run: _Optional[str] = ..., writer: _Optional[str] = ..., epoch: _Optional[int] = ..., received_sequence: _Optional[int] = ..., durable_sequence: _Optional[int] = ..., committed_sequence: _Optional[int] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("state", "version", "backlog_bytes", "memory_in_use_bytes", "memory_budget_bytes", "wal_bytes", "open_trajectories", "shards_committed", "writers", "storage_url", "run_spec", "degraded")
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WRITERS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_URL_FIELD_NUMBER: _ClassVar[int]
    RUN_SPEC_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    state: ServingState
    version: str
    backlog_bytes: int
    memory_in_use_bytes: int
    memory_budget_bytes: int
    wal_bytes: int
    open_trajectories: int
    shards_committed: int
    writers: _containers.RepeatedCompositeFieldContainer[WriterState]
    storage_url: str
    run_spec: RunSpec
    degraded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[_Union[ServingState, str]] = ..., version: _Optional[str] = ..., backlog_bytes: _Optional[int] = ..., memory_in_use_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., wal_bytes: _Optional[int] = ..., open_trajectories: _Optional[int] = ..., shards_committed: _Optional[int] = ..., writers: _Optional[_Iterable[_Union[WriterState, _Mapping]]] = ..., storage_url: _Optional[str] = ..., run_spec: _Optional[_Union[RunSpec, _Mapping]] = ..., degraded: _Optional[_Iterable[str]] = ...) -> None: ...
