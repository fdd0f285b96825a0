"""tracestore: storage and transport of TRACE guidance records for FP4 RL of MoE models.

``import tracestore`` is light (numpy, pyarrow): the torch reference numerics
(``quantize``, ``guided_round`` ...) are imported on first use, so the sidecar never loads torch.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

from tracestore import _shadow
from tracestore.errors import (
    ConfigError,
    ConflictError,
    CorruptionError,
    DTypeError,
    MissingExtraError,
    MissingRecordsError,
    NotFoundError,
    ShapeError,
    StorageError,
    TraceStoreError,
    ValidationError,
)
from tracestore.formats import MXFP4, MXFP4_RCEIL, NVFP4, FP4Format, get_format
from tracestore.records import (
    PrefixLink,
    RecordChunk,
    RunSpec,
    SiteSpec,
    TrajectorySeal,
    validate_id,
)
from tracestore.storage.arrow import CHUNK_SCHEMA, chunks_to_table, table_to_chunks

# From a checkout, the repository root's client/ and server/ never answer those top-level names
_shadow.hide_source_folders(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))

__version__ = "0.1.0"

# name -> module, resolved lazily by __getattr__ (PEP 562): the torch-backed reference, and the
# storage entry points (fsspec and the shard code load on first use).
_LAZY = {
    "Quantized": "tracestore.fp4",
    "quantize": "tracestore.fp4",
    "dequantize": "tracestore.fp4",
    "dequantize_codes": "tracestore.fp4",
    "rtn_codes": "tracestore.fp4",
    "pack_bits": "tracestore.packing",
    "unpack_bits": "tracestore.packing",
    "low_bits": "tracestore.packing",
    "pack_fp4": "tracestore.packing",
    "unpack_fp4": "tracestore.packing",
    "swizzle_scales": "tracestore.layouts",
    "unswizzle_scales": "tracestore.layouts",
    "guided_round": "tracestore.guided",
    "guided_codes": "tracestore.guided",
    "rtn_fake_quant": "tracestore.guided",
    # storage on an fsspec URL, for a trainer that reads it directly (RankPlan.read takes a
    # StoreReader) or a tool that writes shards without a sidecar; the package itself is private
    "Store": "tracestore.storage.store",
    "StoreReader": "tracestore.storage.reader",
}

__all__ = [
    "FP4Format",
    "NVFP4",
    "MXFP4",
    "MXFP4_RCEIL",
    "get_format",
    "TraceStoreError",
    "ShapeError",
    "DTypeError",
    "ConfigError",
    "ValidationError",
    "ConflictError",
    "NotFoundError",
    "MissingRecordsError",
    "CorruptionError",
    "StorageError",
    "MissingExtraError",
    "SiteSpec",
    "RunSpec",
    "RecordChunk",
    "TrajectorySeal",
    "PrefixLink",
    "validate_id",
    "CHUNK_SCHEMA",
    "chunks_to_table",
    "table_to_chunks",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracestore' has no attribute {name!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if exc.name == "torch":
            raise MissingExtraError(
                f"tracestore.{name} is the torch reference and needs torch: "
                "`pip install torch` (or `pip install 'tracestore[torch]'`)"
            ) from exc
        raise
    value = getattr(mod, name)
    globals()[name] = value
    return value
