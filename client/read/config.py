"""The reader's settings as one frozen, validated value: :class:`ReaderConfig`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from tracestore.errors import ConfigError
from tracestore.formats import GUIDED_RULES
from tracestore.records import validate_id

_POLICIES = ("error", "mask")


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """Everything about a :class:`~tracestore.client.GuidanceReader` but what it reads (source and
    run); checked on construction. ``GuidanceReader.from_config(source, run, config)`` builds a
    reader from one; the reader's keyword arguments build one the same way.

    ``versions``: the policy versions read (None: all); ``sites``: the sites read (None: all);
    ``columns``: the column range ``(start, stop)`` read of every site, or a mapping of site names
    to ranges (checked against each site's block width when read); ``device``: where rows land;
    ``on_missing`` / ``on_mismatch``: ``"error"`` (raise) or ``"mask"`` (the rows unguided) for
    missing records and records of other tokens; ``prefetch``: read ahead on a thread; ``rule``: the
    guided-rounding rule; ``storage_options``: fsspec's; ``timeout``: seconds per read; ``process``:
    read in child processes (True: one, N: N); ``channel_credentials`` and ``token``: how a sidecar
    channel authenticates."""

    versions: int | tuple[int, ...] | None = None
    sites: tuple[str, ...] | None = None
    columns: Any = None
    device: Any = "cpu"
    on_missing: str = "error"
    prefetch: bool = True
    rule: str = "bracket"
    storage_options: dict[str, Any] | None = None
    timeout: float = 120.0
    process: bool | int = False
    channel_credentials: Any = None
    token: str | None = None
    on_mismatch: str = "error"

    def __post_init__(self) -> None:
        if self.on_missing not in _POLICIES:
            raise ConfigError(f"on_missing must be 'error' or 'mask', got {self.on_missing!r}")
        if self.on_mismatch not in _POLICIES:
            raise ConfigError(f"on_mismatch must be 'error' or 'mask', got {self.on_mismatch!r}")
        if self.rule not in GUIDED_RULES:
            raise ConfigError(f"rule must be one of {GUIDED_RULES}, got {self.rule!r}")
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {t!r}")
        p = self.process
        if not isinstance(p, int) or p < 0:  # (bool is an int: True is one child)
            raise ConfigError(f"process must be False, True or a number of child processes, got {p!r}")
        if self.sites is not None:
            if isinstance(self.sites, str) or not isinstance(self.sites, Iterable):
                raise ConfigError(f"sites must be a list of site names, got {self.sites!r}")
            object.__setattr__(self, "sites", tuple(validate_id("site", s) for s in self.sites))
        if self.versions is not None and not isinstance(self.versions, int):
            object.__setattr__(self, "versions", tuple(int(v) for v in self.versions))
