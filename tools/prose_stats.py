"""Count the prose in product code: docstring and comment lines, their length, and measurements.

Usage: ``python tools/prose_stats.py [--per-file N] [PATH ...]`` (default: ``tracestore client server``
(the kernels are in ``tracestore/kernels``); ``tracestore/v1`` generated stubs and ``tests`` are skipped).

A *measurement line* is a docstring or comment line that holds a number followed by a unit
(``ms``, ``µs``, ``us``, ``s``, ``GB/s``, ``MiB``, ``MB``, ``%``, ``x``, ``×`` and their kin) or one
of the words ``measured``, ``was``, ``before``; a *figure line* holds a number with a unit (the
words left out, since they also occur in plain prose). Rates are per 1000 lines of code (all lines of the
files counted).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOTS = ("tracestore", "client", "server")
SKIP_PARTS = ("tracestore/v1/", "tests/")

_UNIT = r"(?:ns|µs|us|ms|s|sec|min|GB/s|MB/s|GiB/s|MiB/s|GiB|MiB|KiB|GB|MB|KB|kB|B|%|x|×)"
FIGURE = re.compile(r"\d(?:[\d.,_]*\d)?\s?" + _UNIT + r"(?![A-Za-z0-9_])")
MEASUREMENT = re.compile(FIGURE.pattern + r"|\b(?:measured|was|before)\b", re.IGNORECASE)


@dataclass
class FileStats:
    """Prose counts for one file."""

    path: str
    lines: int = 0
    prose_lines: int = 0
    doc_lines: int = 0
    doc_chars: int = 0
    measurement_lines: int = 0
    figure_lines: int = 0
    samples: list[str] = field(default_factory=list)


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers (1-based) covered by module, class and function docstrings."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
                out.update(range(first, last + 1))
    return out


def _comment_text(source: str) -> dict[int, str]:
    """Comment text by line number (1-based), without the ``#``."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#:").strip()
            if text and not text.startswith(("type:", "noqa", "fmt:", "pragma", "mypy:")):
                out[tok.start[0]] = text
    return out


def file_stats(path: Path, rel: str | None = None) -> FileStats:
    """Prose counts for the Python file at ``path``; raises ``SyntaxError`` on invalid source."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    stats = FileStats(rel or str(path), lines=len(lines))
    doc = _docstring_lines(ast.parse(source))
    comments = _comment_text(source)
    for no in sorted(doc | comments.keys()):
        if no in doc:
            text = lines[no - 1].strip().strip("\"'").strip()
            if not text:
                continue
            stats.doc_lines += 1
            stats.doc_chars += len(lines[no - 1].rstrip())
        else:
            text = comments[no]
        stats.prose_lines += 1
        if FIGURE.search(text):
            stats.figure_lines += 1
        if MEASUREMENT.search(text):
            stats.measurement_lines += 1
            stats.samples.append(f"{no}: {text[:90]}")
    return stats


def collect(roots: list[str], base: Path) -> list[FileStats]:
    """Stats for every product ``*.py`` under ``roots`` (directories or files, relative to ``base``)."""
    out = []
    for root in roots:
        top = base / root
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            rel = path.relative_to(base).as_posix()
            if any(rel.startswith(part) or "/" + part in rel for part in SKIP_PARTS):
                continue
            out.append(file_stats(path, rel))
    return out


def summary(stats: list[FileStats]) -> dict[str, float]:
    """Totals and rates over ``stats``: per-kloc figures and the mean docstring line length."""
    lines = sum(s.lines for s in stats)
    kloc = max(lines / 1000, 1e-9)
    doc_lines = sum(s.doc_lines for s in stats)
    return {
        "files": len(stats),
        "lines": lines,
        "prose_lines": sum(s.prose_lines for s in stats),
        "prose_per_kloc": sum(s.prose_lines for s in stats) / kloc,
        "doc_lines": doc_lines,
        "doc_line_mean_chars": sum(s.doc_chars for s in stats) / max(doc_lines, 1),
        "measurement_lines": sum(s.measurement_lines for s in stats),
        "measurement_per_kloc": sum(s.measurement_lines for s in stats) / kloc,
        "figure_lines": sum(s.figure_lines for s in stats),
        "figure_per_kloc": sum(s.figure_lines for s in stats) / kloc,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_ROOTS))
    parser.add_argument("--per-file", type=int, default=0, metavar="N",
                        help="also list the N files with the most measurement lines per kloc")
    parser.add_argument("--samples", action="store_true", help="print each measurement line")
    args = parser.parse_args(argv)
    base = Path(__file__).resolve().parent.parent
    stats = collect(args.paths, base)
    for key, value in summary(stats).items():
        print(f"{key:22} {value:.1f}" if isinstance(value, float) else f"{key:22} {value}")
    if args.per_file:
        ranked = sorted(stats, key=lambda s: s.measurement_lines, reverse=True)[: args.per_file]
        for s in ranked:
            print(f"{s.measurement_lines:4} meas {s.prose_lines:5} prose {s.lines:5} lines  {s.path}")
            if args.samples:
                for line in s.samples:
                    print("        " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
