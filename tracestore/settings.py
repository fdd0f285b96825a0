"""The typed settings layer: every ``tracestore`` subcommand, the sidecar's included, declares its
options with it. It sits in the core, below the commands, so the sidecar's command (``server/``)
uses it without importing the command line.

Configuration. The settings of every subcommand (``serve``, ``inspect``, ``selftest``, ``check``,
``demo``, ``health``) are declared once each as a :class:`Setting` (flag, type, default, help) and
come from, in this order of precedence:

1. the flag (``--memory-budget-mib 2048``);
2. the environment variable ``TRACESTORE_<FLAG>`` (``TRACESTORE_MEMORY_BUDGET_MIB=2048``);
3. a TOML config file, ``--config FILE`` or ``TRACESTORE_CONFIG=FILE``, in the subcommand's table
   (``[serve]`` ``memory_budget_mib = 2048``; dashes or underscores in keys);
4. the default shown in ``--help``.

Argparse reads the command line as text; :func:`resolve` then converts and checks every value once,
after parsing, so a bad variable fails only the subcommand that reads it, as one line naming the
flag, variable or file key, the value and what was expected (exit status 2), never a traceback and
never ``--help``. Why argparse + this small typed layer rather than pydantic-settings: argparse
already is the contract every subcommand module registers with (``register(subparsers)``, some of
them owned elsewhere and only flag/env), the layer adds no dependency to the core package that
``[client]`` installs, and TOML is parsed by the standard library (``tomllib``; ``tomli`` before
Python 3.11). :func:`env_default` (flag and environment only) remains for a subcommand registered
from elsewhere without settings; a variable of its that does not convert is reported the same way
when that subcommand runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from tracestore.errors import ConfigError

ENV_PREFIX = "TRACESTORE_"
CONFIG_ENV = "TRACESTORE_CONFIG"


# ---------------------------------------------------------------------------- value kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    """A value type: ``parse(raw)`` turns a flag's or variable's text, or a TOML value, into the
    setting's value and raises ``ValueError`` (optionally with a detail) otherwise; ``expected``
    says what is accepted, for the error line."""

    expected: str
    parse: Callable[[Any], Any]
    metavar: str | None = None  # what --help writes for the value, unless the setting says

    def __call__(self, raw: Any) -> Any:
        return self.parse(raw)


OFF_WORDS = ("off", "none", "")


def _as_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        return int(raw.strip(), 10)
    raise ValueError


def integer(lo: int | None = None, hi: int | None = None) -> Kind:
    if lo is not None and hi is not None:
        what = f"an integer in {lo}..{hi}"
    elif lo is not None:
        what = f"an integer >= {lo}"
    else:
        what = "an integer"

    def parse(raw: Any) -> int:
        v = _as_int(raw)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError
        return v

    return Kind(what, parse, "N")


def number(gt: float | None = None, ge: float | None = None) -> Kind:
    what = f"a number > {gt:g}" if gt is not None else f"a number >= {ge:g}" if ge is not None else "a number"

    def parse(raw: Any) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError
        v = float(raw.strip()) if isinstance(raw, str) else float(raw)
        if not math.isfinite(v) or (gt is not None and not v > gt) or (ge is not None and not v >= ge):
            raise ValueError
        return v

    return Kind(what, parse, "X")


def text(what: str = "a non-empty string") -> Kind:
    def parse(raw: Any) -> str:
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError
        return raw

    return Kind(what, parse)


def optional(kind: Kind) -> Kind:
    """``kind`` or nothing: ``off``, ``none`` or an empty value give None."""

    def parse(raw: Any) -> Any:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in OFF_WORDS):
            return None
        return kind(raw)

    return Kind(f"{kind.expected}, or 'off'", parse, kind.metavar)


def choice(*names: str) -> Kind:
    def parse(raw: Any) -> str:
        if isinstance(raw, str) and raw.strip().lower() in names:
            return raw.strip().lower()
        raise ValueError

    return Kind("one of " + ", ".join(names), parse, "{" + ",".join(names) + "}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _switch(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError


SWITCH = Kind("true or false (1/0, yes/no, on/off)", _switch)


def _octal(raw: Any) -> int:
    if isinstance(raw, str):
        v = int(raw.strip(), 8)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        v = int(str(raw), 8)  # TOML `socket_mode = 660` means 0o660, as on the command line
    else:
        raise ValueError
    if not 0 <= v <= 0o777:
        raise ValueError
    return v


OCTAL_MODE = Kind("an octal file mode such as 0660", _octal)


def _json_object(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ValueError
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(value, dict):
        raise ValueError(f"JSON {type(value).__name__}, not an object")
    return value


JSON_OBJECT = Kind("a JSON object (a TOML table in a config file)", _json_object)


# ---------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configurable value of a subcommand: ``--flag``, its ``TRACESTORE_FLAG`` twin (unless
    ``env=False``) and its key in the subcommand's table of a config file.

    ``switch``: a boolean flag (``--x``/``--no-x``). ``secret``: never shown (errors, the serve
    startup line). ``show``: how ``--help`` writes the default (else the default itself).
    ``deprecated``: old flag spellings, accepted with a note on standard error."""

    flag: str
    kind: Kind
    default: Any
    help: str
    env: bool = True
    switch: bool = False
    secret: bool = False
    show: str | None = None
    metavar: str | None = None
    deprecated: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    def shown_default(self) -> str:
        if self.show is not None:
            return self.show
        if self.default is None:
            return "off"
        if self.switch:
            return "on" if self.default else "off"
        return str(self.default)


SECTIONS: dict[str, tuple[Setting, ...]] = {}
"""Subcommand name -> its settings, filled as the subcommands register (the known tables of a
config file)."""


class _Deprecated(argparse.Action):
    """An old spelling of a flag: sets the same value and notes the new name on standard error."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        print(f"{parser.prog}: {opt} is deprecated, use {self.new}", file=sys.stderr)
        setattr(ns, self.dest, values)


def _metavar(s: Setting) -> str:
    return s.metavar or s.kind.metavar or s.dest.upper()


def add_settings(parser: argparse.ArgumentParser, section: str, settings: Iterable[Setting]) -> None:
    """Add every setting's flag to ``parser`` (value text kept as given: :func:`resolve` converts
    it), plus ``--config``; help shows each default and variable."""
    settings = tuple(settings)
    SECTIONS[section] = settings
    for s in settings:
        env = f"; env {s.env_name}" if s.env else ""
        help_text = f"{s.help} (default: {s.shown_default()}{env})"
        if s.switch:
            parser.add_argument(
                s.flag, dest=s.dest, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(s.flag, dest=s.dest, default=None, metavar=_metavar(s), help=help_text)
        for old in s.deprecated:
            parser.add_argument(
                old,
                dest=s.dest,
                default=None,
                action=_Deprecated,
                new=s.flag,
                metavar=_metavar(s),
                help=f"deprecated spelling of {s.flag} (no variable)",
            )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"TOML config file; settings in its [{section}] table, below flags and variables "
        f"(default: none; env {CONFIG_ENV})",
    )
    parser.set_defaults(_section=section)


def _shown(raw: Any, secret: bool) -> str:
    if secret:
        return "<redacted>"
    r = repr(raw)
    return r if len(r) <= 120 else r[:117] + "..."


def _bad(where: str, raw: Any, s: Setting, exc: BaseException) -> ConfigError:
    detail = str(exc) if isinstance(exc, ValueError) and str(exc) and not s.secret else ""
    more = f" ({detail})" if detail and "invalid literal" not in detail and "could not convert" not in detail else ""
    return ConfigError(f"{where}={_shown(raw, s.secret)}: expected {s.kind.expected}{more}")


def load_config_file(path: str, section: str, settings: Sequence[Setting], where: str) -> dict[str, tuple[Any, str]]:
    """``{dest: (value, where)}`` of ``section``'s table in the TOML file ``path``; unknown tables
    and keys are errors (a typo must not be silently ignored)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{where}={path!r}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}={path!r}: not valid TOML ({' '.join(str(exc).split())})") from None
    for key, value in data.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {key!r} is outside a table; put settings under [{section}]")
        if key not in SECTIONS:
            known = ", ".join(f"[{k}]" for k in sorted(SECTIONS))
            raise ConfigError(f"{path}: unknown table [{key}] (known: {known})")
    table = data.get(section, {})
    by_key = {s.dest: s for s in settings if s.env}
    out: dict[str, tuple[Any, str]] = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in by_key:
            near = difflib.get_close_matches(dest, list(by_key), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{path}: [{section}] has no setting {key!r}{hint}")
        out[dest] = (value, f"{path} [{section}] {key}")
    return out


def resolve(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Give every setting of ``ns``'s subcommand its value: flag, else variable, else config file,
    else default; each converted and checked. Sets ``ns._sources`` (dest -> ``flag``/``env``/
    ``file``/``default``) and ``ns.config``. Idempotent. Raises :class:`ConfigError` with one
    line."""
    section = getattr(ns, "_section", None)
    if section is None or getattr(ns, "_resolved", False):
        return ns
    settings = SECTIONS[section]
    env = os.environ if environ is None else environ
    path, where = getattr(ns, "config", None), "--config"
    if path is None and env.get(CONFIG_ENV, "").strip():
        path, where = env[CONFIG_ENV], CONFIG_ENV
    from_file = load_config_file(path, section, settings, where) if path else {}
    sources: dict[str, str] = {}
    for s in settings:
        raw = getattr(ns, s.dest, None)
        if raw is not None:
            origin, where = "flag", s.flag
        elif s.env and s.env_name in env:
            raw, origin, where = env[s.env_name], "env", s.env_name
        elif s.dest in from_file:
            (raw, where), origin = from_file[s.dest], "file"
        else:
            setattr(ns, s.dest, s.default)
            sources[s.dest] = "default"
            continue
        try:
            value = s.kind(raw)
        except (ValueError, TypeError, OverflowError) as exc:
            raise _bad(where, raw, s, exc) from None
        setattr(ns, s.dest, value)
        sources[s.dest] = origin
    ns._sources = sources
    ns.config = path
    ns._resolved = True
    return ns


# ---------------------------------------------------------------------------- flag + env only (other modules)

_REGISTERING: list[str] = []
_DEFERRED: dict[str, list[str]] = {}


@contextlib.contextmanager
def registering(owner: str) -> Iterator[None]:
    """Within it, :func:`env_default` files a variable it cannot convert under ``owner`` (the
    subcommand module being registered)."""
    _REGISTERING.append(owner)
    try:
        yield
    finally:
        _REGISTERING.pop()


def deferred_errors(owner: str) -> list[str]:
    """What :func:`env_default` could not convert while ``owner`` registered."""
    return list(_DEFERRED.get(owner, []))


def clear_deferred() -> None:
    """Forget the errors filed so far (a new parser is being built)."""
    _DEFERRED.clear()


def env_default(flag: str, default: Any) -> Any:
    """Default of ``--flag`` from ``TRACESTORE_FLAG`` when set (dashes become underscores), for
    subcommands without :class:`Setting` declarations. The text is converted to the type of
    ``default`` (bool, int, float); one that does not convert is recorded and reported, as one
    line with exit status 2, when the subcommand that reads it runs (``default`` is returned so
    building the parser, and every other subcommand and ``--help``, still work)."""
    name = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    if name not in os.environ:
        return default
    raw = os.environ[name]
    kind = SWITCH if isinstance(default, bool) else integer() if isinstance(default, int) else None
    if isinstance(default, float):
        kind = number()
    if kind is None:
        return raw
    try:
        return kind(raw)
    except ValueError:
        owner = _REGISTERING[-1] if _REGISTERING else ""
        _DEFERRED.setdefault(owner, []).append(f"{name}={raw!r}: expected {kind.expected}")
        return default


# ---------------------------------------------------------------------------- library variables


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """An environment variable the library reads outside a subcommand's settings (a recorder in a
    rollout process, a kernel module, a crash point). ``kind`` converts the text; an unset or
    empty variable gives ``default``."""

    name: str
    kind: Kind
    default: Any
    help: str
    secret: bool = False


ENVIRONMENT: dict[str, EnvVar] = {}
"""Every variable :func:`read_env` reads, by name (``docs/operations.md`` lists them)."""


def env_var(name: str, kind: Kind, default: Any, help: str, *, secret: bool = False) -> EnvVar:
    """Declare a library variable (once per name)."""
    if name in ENVIRONMENT:
        raise ValueError(f"environment variable {name} is declared twice")
    var = EnvVar(name, kind, default, help, secret)
    ENVIRONMENT[name] = var
    return var


def read_env(var: EnvVar, environ: Mapping[str, str] | None = None) -> Any:
    """The value of ``var`` in ``environ`` (default: the process environment), converted by its
    kind; ``var.default`` when unset or blank. A value that does not convert raises
    :class:`ConfigError` naming the variable, the value and what is expected."""
    if ENVIRONMENT.get(var.name) is not var:
        raise KeyError(f"{var.name} is not a declared library variable (tracestore.settings.env_var)")
    raw = (os.environ if environ is None else environ).get(var.name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.kind(raw)
    except (ValueError, TypeError) as exc:
        detail = str(exc) if str(exc) and not var.secret and "invalid literal" not in str(exc) else ""
        more = f" ({detail})" if detail else ""
        shown = _shown(raw, var.secret)
        raise ConfigError(f"{var.name}={shown}: expected {var.kind.expected}{more}") from None


def _token(raw: Any) -> str:
    if not isinstance(raw, str) or any(c.isspace() for c in raw.strip()):
        raise ValueError
    return raw.strip()


TOKEN = env_var(
    "TRACESTORE_TOKEN",
    Kind("a bearer token without whitespace", _token),
    None,
    "the bearer token clients send when none is given",
    secret=True,
)
SHM_GROUP = env_var(
    "TRACESTORE_SHM_GROUP",
    text("a group name or number"),
    None,
    "the group of a recorder's shared staging pools (a sidecar of another user in that group maps them)",
)
RECORDER_COPY = env_var(
    "TRACESTORE_RECORDER_COPY",
    choice("auto", "driver", "torch"),
    "auto",
    "how a recorder copies device rows to its staging: the CUDA driver where it loads (auto, driver) or torch",
)
GUIDED_TABLE = env_var(
    "TRACESTORE_GUIDED_TABLE",
    SWITCH,
    False,
    "run the general table kernel for b = 1 'bracket' guided rounding instead of guided_b1",
)
FAULT = env_var(
    "TRACESTORE_FAULT",
    text("<point>[:<n>]"),
    None,
    "a crash point for fault tests: the process SIGKILLs itself the n-th time it passes <point>",
)
RECORD = env_var(
    "TRACESTORE_RECORD",
    text("the engine plugins' recording setting"),
    None,
    "turns the vLLM / SGLang plugins on: sidecar address, run and policy version",
)
SERVE_UNIX_SOCKET = env_var(
    "TRACESTORE_UNIX_SOCKET", optional(text("a socket path")), None, "the sidecar's unix socket (serve, health)"
)
SERVE_PORT = env_var("TRACESTORE_PORT", integer(1, 65535), 7433, "the sidecar's TCP port (serve, health)")
MALLOC_ARENA_MAX = env_var(
    "MALLOC_ARENA_MAX", integer(1), None, "glibc's arena limit; when unset the sidecar uses one arena"
)
GRPC_VERBOSITY = env_var("GRPC_VERBOSITY", text("a gRPC log level"), None, "gRPC core's log level")
