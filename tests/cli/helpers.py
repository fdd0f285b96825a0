"""Shared by the CLI tests: run ``tracestore`` in process and capture what it printed."""

from __future__ import annotations

import pytest

from tracestore.cli import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``tracestore ARGV``; argparse's SystemExit is a status."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: --help, usage errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err
