"""The ``tracestore`` command line (also ``python -m tracestore`` and ``python -m tracestore.cli``).

Each subcommand lives in its own module with ``register(subparsers)``, which adds a parser and
sets ``func`` (``Namespace -> int`` exit code): ``inspect``, ``check`` and ``selftest`` here,
``serve`` and ``health`` in ``tracestore.server``, ``demo`` in ``tracestore.demo``. Modules whose
extra is not installed still register, and fail with a message naming the extra when run. Options
are declared with the typed settings layer of :mod:`tracestore.settings` (flag, environment,
TOML config file, default). The CLI and the demo are the top floor: the only parts of the core
package that may import ``tracestore.client`` and ``tracestore.server``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tracestore.errors import ConfigError
from tracestore.settings import (
    CONFIG_ENV,
    ENV_PREFIX,
    JSON_OBJECT,
    OCTAL_MODE,
    SECTIONS,
    SWITCH,
    Kind,
    Setting,
    add_settings,
    choice,
    clear_deferred,
    deferred_errors,
    env_default,
    integer,
    load_config_file,
    number,
    optional,
    registering,
    resolve,
    text,
)

SUBCOMMAND_MODULES = (
    "tracestore.cli.selftest",
    "tracestore.cli.inspect",
    "tracestore.cli.check",
    "tracestore.server.cli",
    "tracestore.server.cli_health",
    "tracestore.demo.cli",
)

# ---------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    from tracestore import __version__

    parser = argparse.ArgumentParser(
        prog="tracestore",
        description="TRACE guidance-record storage and transport for FP4 RL of MoE models. Settings come from "
        "--flags, else TRACESTORE_<FLAG> variables, else the COMMAND's table of a TOML config file (--config FILE "
        "or TRACESTORE_CONFIG), else the defaults `tracestore COMMAND --help` shows.",
    )
    parser.add_argument("--version", action="version", version=f"tracestore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    clear_deferred()
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):  # not built yet
                continue
            raise
        with registering(name):
            module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    deferred = deferred_errors(getattr(ns.func, "__module__", ""))
    try:
        if deferred:
            raise ConfigError(deferred[0])
        resolve(ns)
    except ConfigError as exc:
        print(f"tracestore {ns.command}: {exc}", file=sys.stderr)
        return 2
    return int(ns.func(ns))


__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "JSON_OBJECT",
    "OCTAL_MODE",
    "SECTIONS",
    "SUBCOMMAND_MODULES",
    "SWITCH",
    "Kind",
    "Setting",
    "add_settings",
    "build_parser",
    "choice",
    "env_default",
    "integer",
    "load_config_file",
    "main",
    "number",
    "optional",
    "resolve",
    "text",
]
