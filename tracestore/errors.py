"""One error hierarchy: every error is a ``TraceStoreError`` and also the builtin it resembles.

Callers can catch ``TraceStoreError`` for everything tracestore raises, or the builtin
(``ValueError``, ``TypeError``, ``FileNotFoundError`` ...) as they would for any library.
"""

from __future__ import annotations


class TraceStoreError(Exception):
    """Base of every error tracestore raises on purpose."""


class ShapeError(TraceStoreError, ValueError):
    """A tensor or buffer has the wrong shape or length (width not a multiple of the block, ...)."""


class DTypeError(TraceStoreError, TypeError):
    """A tensor or array has a dtype the operation does not accept."""


class ConfigError(TraceStoreError, ValueError):
    """An argument or configuration value is outside its allowed set (bits, rule, format, ids)."""


class ValidationError(TraceStoreError, ValueError):
    """A record, seal or link failed validation (ids, token ranges, byte lengths)."""


class ConflictError(TraceStoreError, ValueError):
    """The same key was written twice with different bytes."""


class NotFoundError(TraceStoreError, FileNotFoundError):
    """A run, version, shard or record that was asked for does not exist."""


class MissingRecordsError(TraceStoreError, LookupError):
    """A read plan asked for tokens that have no record (names trajectory, site and tokens)."""


class GuidanceMismatch(TraceStoreError, ValueError):
    """Records made for other token ids than the trainer's; names trajectory, site and tokens."""


class CorruptionError(TraceStoreError, OSError):
    """Stored bytes failed a checksum or could not be decoded (names the shard and chunk)."""


class StorageError(TraceStoreError, OSError):
    """The storage backend failed or timed out."""


class UnauthenticatedError(TraceStoreError, PermissionError):
    """The caller presented no credentials, or credentials the sidecar does not accept."""


class PermissionDeniedError(TraceStoreError, PermissionError):
    """The caller is authenticated but may not do this (another's run or writer)."""


class LimitError(TraceStoreError, RuntimeError):
    """A sidecar limit is reached (streams, writers, runs, read size); the message names it."""


class MissingExtraError(TraceStoreError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str) -> object:
    """Import ``module``, else :class:`MissingExtraError` naming
    ``pip install tracestore[extra]``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise MissingExtraError(
            f"{module!r} is needed for this feature but is not installed; "
            f"install it with `pip install 'tracestore[{extra}]'`"
        ) from exc
