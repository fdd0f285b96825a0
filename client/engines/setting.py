"""The one setting that turns recording on inside an engine, and the engines' version gate.

``TRACESTORE_RECORD`` (or the same string in the engine's own config) is whitespace-separated
``key=value`` pairs::

    TRACESTORE_RECORD="sidecar=unix:///run/tracestore.sock run=grpo-7 policy_version=12"

Keys: ``sidecar`` (the recorder's address; it may name the recording process's ranks, below),
``run``, ``policy_version`` (required); ``writer``
(default ``<host>-<pid>``), ``bits`` (1..4, default 1), ``sites`` (``moe``: the MoE expert inputs,
default; ``all``: also the dense NVFP4 linear inputs), ``routing`` (1, default: each MoE layer's
routed experts as a ``routed_experts`` site ``layers.{i}.mlp.router``; 0: not), ``staging_mb``
(default 256). Unset or empty: the plugins install nothing.

Several recording processes (data-parallel replicas, or a multi-node engine) each need their own
sidecar: ``sidecar=`` may hold the placeholders :data:`PLACEHOLDERS`, filled in each recording
process when its recorder connects (:meth:`RecordSetting.address`)::

    TRACESTORE_RECORD="sidecar=unix:///run/tracestore/{dp_rank}.sock run=grpo-7 policy_version=12"

``{rank}``: the recording process's global rank, ``dp_rank × tp_size × pp_size`` plus its rank
within its replica (vLLM's world-group rank; SGLang's replicas each form their own world, so the
plugin computes it the same way); ``{dp_rank}``: its data-parallel replica (0 without data
parallelism). Python format specs apply (``{rank:02d}``); any other field is refused when the
setting is parsed.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import string
import threading
from collections.abc import Callable
from typing import Literal

from tracestore.errors import ConfigError
from tracestore.formats import check_bits
from tracestore.records import validate_id, validate_version
from tracestore.settings import RECORD, read_env

ENV = "TRACESTORE_RECORD"
SiteChoice = Literal["moe", "all"]
_KEYS = ("sidecar", "run", "policy_version", "writer", "bits", "sites", "routing", "staging_mb")
PLACEHOLDERS = ("rank", "dp_rank")  # the fields sidecar= may hold (module docstring)


def placeholders(template: str) -> tuple[str, ...]:
    """The placeholder fields ``template`` uses, in order of first use; a field other than
    :data:`PLACEHOLDERS`, a positional or attribute field, a conversion or a stray brace raises
    :class:`~tracestore.errors.ConfigError`."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        bad = [f for f in fields if f not in PLACEHOLDERS]
        if not bad:
            template.format(**{p: 0 for p in PLACEHOLDERS})  # a bad format spec or conversion
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise ConfigError(
            f"{ENV}: sidecar={template!r} is not a valid address template ({e}); "
            f"placeholders are {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
        ) from None
    if bad:
        raise ConfigError(
            f"{ENV}: sidecar={template!r} names the unknown placeholder {{{bad[0]}}}; "
            f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
        )
    return tuple(dict.fromkeys(fields))


@dataclasses.dataclass(frozen=True)
class RecordSetting:
    """What a plugin records and where to: parsed from one string by :func:`parse_setting`."""

    sidecar: str
    run: str
    policy_version: int
    writer: str = ""
    bits: int = 1
    sites: SiteChoice = "moe"
    staging_mb: int = 256
    routing: bool = True

    def __post_init__(self) -> None:
        if not self.sidecar:
            raise ConfigError(f"{ENV}: sidecar= is empty; give the sidecar's address, e.g. sidecar=127.0.0.1:7433")
        placeholders(self.sidecar)
        validate_id("run", self.run)
        object.__setattr__(self, "policy_version", validate_version(self.policy_version))
        object.__setattr__(self, "bits", check_bits(self.bits))
        if self.sites not in ("moe", "all"):
            raise ConfigError(f"{ENV}: sites= must be 'moe' or 'all', got {self.sites!r}")
        if not isinstance(self.routing, bool):
            raise ConfigError(f"{ENV}: routing= must be 0 or 1, got {self.routing!r}")
        if not isinstance(self.staging_mb, int) or self.staging_mb < 1:
            raise ConfigError(f"{ENV}: staging_mb= must be a positive integer, got {self.staging_mb!r}")
        if not self.writer:
            object.__setattr__(self, "writer", f"{socket.gethostname()}-{os.getpid()}")
        validate_id("writer", self.writer)

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The rank placeholders ``sidecar`` holds (empty: one address for every process)."""
        return placeholders(self.sidecar)

    def address(self, ranks: dict[str, int] | None = None) -> str:
        """The sidecar address of a recording process whose ranks are ``ranks`` (``{"rank": r,
        "dp_rank": d}``): ``sidecar`` with its placeholders filled. A placeholder without a value
        raises :class:`~tracestore.errors.ConfigError`."""
        need, got = self.placeholders, ranks or {}
        missing = [p for p in need if not isinstance(got.get(p), int) or got[p] < 0]
        if missing:
            raise ConfigError(
                f"{ENV}: sidecar={self.sidecar!r} needs {{{missing[0]}}}, which this engine's plugin did not "
                f"report as a rank >= 0 (got {ranks}); give a plain address"
            )
        return self.sidecar.format(**{p: int(got[p]) for p in need}) if need else self.sidecar


def parse_setting(text: str) -> RecordSetting:
    """``"sidecar=ADDR run=RUN policy_version=N [writer=W] [bits=B] [sites=moe|all] [routing=0|1]
    [staging_mb=M]"`` -> :class:`RecordSetting`. Unknown keys, a pair without ``=``, a repeated key
    or a missing required key raise :class:`~tracestore.errors.ConfigError` naming it."""
    values: dict[str, str] = {}
    for pair in text.split():
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"{ENV}: expected key=value pairs, got {pair!r} in {text!r}")
        if key not in _KEYS:
            raise ConfigError(f"{ENV}: unknown key {key!r}; known keys: {', '.join(_KEYS)}")
        if key in values:
            raise ConfigError(f"{ENV}: key {key!r} given twice in {text!r}")
        values[key] = value
    missing = [k for k in ("sidecar", "run", "policy_version") if k not in values]
    if missing:
        raise ConfigError(f"{ENV}: missing {', '.join(missing)} in {text!r} (needs sidecar=, run=, policy_version=)")
    try:
        ints = {k: int(values[k]) for k in ("policy_version", "bits", "staging_mb") if k in values}
    except ValueError as e:
        raise ConfigError(f"{ENV}: policy_version, bits and staging_mb are integers: {e}") from None
    routing = values.get("routing", "1")
    if routing not in ("0", "1"):
        raise ConfigError(f"{ENV}: routing= must be 0 or 1, got {routing!r}")
    return RecordSetting(
        sidecar=values["sidecar"],
        routing=routing == "1",
        run=values["run"],
        writer=values.get("writer", ""),
        sites=values.get("sites", "moe"),  # type: ignore[arg-type]  # checked in __post_init__
        **ints,  # type: ignore[arg-type]
    )


def setting_from_env(environ: dict[str, str] | None = None) -> RecordSetting | None:
    """The setting from ``TRACESTORE_RECORD``; None when it is unset or blank (recording off)."""
    text = read_env(RECORD, environ)
    return parse_setting(text.strip()) if text else None


def check_engine_version(engine: str, installed: str, validated: tuple[str, ...]) -> None:
    """Fail closed: raise :class:`~tracestore.errors.ConfigError` unless ``installed`` is one of the
    ``validated`` releases (compared on major.minor.patch, local suffixes like ``+cpu`` ignored)."""
    base = installed.split("+", 1)[0]
    if base not in validated:
        raise ConfigError(
            f"tracestore's {engine} plugin is validated against {engine} {' / '.join(validated)}, "
            f"but {engine} {installed} is installed: it hooks engine internals that move between "
            f"releases, so it records nothing rather than risk wrong rows. Install {engine}=={validated[-1]}, "
            f"or unset {ENV} to run without recording."
        )


class PluginRegistration:
    """An engine plugin's entry point, once: with the setting unset it does nothing; else it checks
    the engine's version (:func:`check_engine_version`) and calls ``install(setting)`` the first
    time only, however many of the engine's processes or imports call it."""

    def __init__(self, engine: str, validated: tuple[str, ...]) -> None:
        self.engine = engine
        self.validated = validated
        self._lock = threading.Lock()
        self.installed = False

    def register(self, version: Callable[[], str], install: Callable[[RecordSetting], None]) -> None:
        """``version()``: the installed engine's version (imports the engine)."""
        setting = setting_from_env()
        if setting is None:
            return
        check_engine_version(self.engine, version(), self.validated)
        with self._lock:
            if self.installed:
                return
            install(setting)
            self.installed = True
