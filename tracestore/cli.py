"""The ``tracestore`` command line. Every flag has a ``TRACESTORE_<FLAG>`` environment twin.

Each subcommand lives in its own module with ``register(subparsers)``, which adds a parser and
sets ``func`` (``Namespace -> int`` exit code). Modules whose extra is not installed still
register, and fail with a message naming the extra when run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

SUBCOMMAND_MODULES = (
    "tracestore.cli_selftest",
    "tracestore.cli_inspect",
    "tracestore.cli_check",
    "tracestore.server.cli",
    "tracestore.server.cli_health",
    "tracestore.demo.cli",
)


def env_default(flag: str, default: Any) -> Any:
    """Default of ``--flag`` from ``TRACESTORE_FLAG`` when set (dashes become underscores)."""
    return os.environ.get("TRACESTORE_" + flag.lstrip("-").replace("-", "_").upper(), default)


def build_parser() -> argparse.ArgumentParser:
    from tracestore import __version__

    parser = argparse.ArgumentParser(
        prog="tracestore",
        description="TRACE guidance-record storage and transport for FP4 RL of MoE models. "
        "Every --flag can also be set as TRACESTORE_FLAG in the environment.",
    )
    parser.add_argument("--version", action="version", version=f"tracestore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):  # not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    return int(ns.func(ns))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
